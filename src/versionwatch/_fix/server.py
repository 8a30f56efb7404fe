"""``versionwatch fix``'s fork server: torch imported once, a fork for each run.

:class:`ForkServer` (in the caller) starts ``python -m versionwatch._fix.server``
(:func:`serve`), which imports torch and versionwatch once and forks a run of
:func:`versionwatch._fix.child.main` for each request: a run then costs the
program's own time, not torch's import. See :class:`ForkServer` for why a fork
is safe here, and what it cannot give (``versionwatch fix --fresh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from versionwatch._process import end, environment, python_module, signal_group, start, wait


class ForkServer:
    """A process that has imported torch once and forks a run for each request.

    Each run is then a fork of a fresh interpreter that imported torch (with
    ``torch._dynamo``, which an optimizer's first step imports) and versionwatch
    and did nothing else: what a new process would be after its imports, for a
    fraction of the start-up. A run takes the working directory of the call
    that asked for it, and the environment the server started with. Used where
    ``os.fork`` exists; :func:`run_child` starts a whole process without it.

    Why a fork is safe here: the server runs one Python thread and no torch op,
    so torch's intra-op and inter-op pools (OpenMP) are not started and CUDA is
    not initialized; the one other thread, numpy's OpenBLAS server, is stopped
    around a fork by OpenBLAS itself. The server checks the first two before
    every fork and refuses otherwise (the run then starts a new interpreter).
    What a fork cannot give is what a program sets up *before* it imports
    torch: environment variables read when torch loads (``OMP_NUM_THREADS``,
    ``TORCH_LOGS``, ...) set by the program itself take no effect, as torch is
    loaded already; ``versionwatch fix --fresh`` runs each in a new interpreter.
    """

    def __init__(self) -> None:
        self.proc = start(python_module("versionwatch._fix.server"),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, env=environment())
        self.lock = threading.Lock()
        self.next_id = 0
        self.answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                q = self.answers.get(message["id"])
            if q is not None:
                q.put(message)
        with self.lock:  # the server is gone: every waiting run ends
            for q in self.answers.values():
                q.put({"exit": -1, "gone": True})

    def run(self, spec: str, err: str, timeout: float) -> tuple[int, bool] | None:
        """Run ``spec``; its exit status, and whether it timed out (``None``: refused)."""
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            self.answers[rid] = q
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"id": rid, "spec": spec, "err": err})
                                   + "\n").encode())
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = None
        timed_out = False
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    message = q.get(timeout=max(left, 0.01) if not timed_out else None)
                except queue.Empty:
                    timed_out = True
                    if pid is not None:
                        signal_group(pid)  # the run leads its own group (see serve)
                    continue
                if "pid" in message:
                    pid = message["pid"]
                    if timed_out:
                        signal_group(pid)
                elif "refused" in message:
                    return None
                elif "exit" in message:
                    return int(message["exit"]), timed_out
        finally:
            with self.lock:
                del self.answers[rid]

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        # Its stdin closed, the server ends once its last run has; one that
        # does not within 30 s is killed with its group. Reaped either way.
        wait(self.proc, 30)
        end(self.proc, leftovers=False)


def _fork_unsafe() -> str | None:
    """Why a fork of this server would not be what a new interpreter is, or ``None``.

    The server has imported torch (which imports numpy, whose OpenBLAS starts a
    thread: OpenBLAS stops it around a fork itself) and run no op of its own, so
    torch's thread pools do not exist yet and CUDA is not initialized; a fork
    is then a new interpreter after its imports. Checked before every fork, in
    case an import changed that.
    """
    import torch

    if threading.active_count() != 1:
        return "the server runs Python threads"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA is initialized in the server"
    return None


def serve() -> int:
    """Fork a run for each request on stdin: torch is imported once, not once a run.

    A request is a line of JSON, ``{"id": N, "spec": PATH, "err": PATH}``; the
    answers, one JSON line each on stdout, are ``{"id": N, "pid": PID}`` when the
    run starts and ``{"id": N, "exit": STATUS}`` when it ends (a negative status:
    killed by that signal). A run is its own session (its process group is its
    pid), so that a time-out ends it with whatever it started. One thread only,
    so that nothing is held locked across a fork. Ends when stdin closes and the
    last run has ended.
    """
    import select

    # Imported once here for every run: what a run imports anyway, no state.
    import torch._dynamo  # noqa: F401  (what an optimizer's first step() imports)

    from versionwatch._candidates import FixFacts  # noqa: F401
    from versionwatch._fix.child import main
    from versionwatch._strict import attach  # noqa: F401  (strict mode)
    from versionwatch._watch import watch_all  # noqa: F401  (the watcher and its parts)

    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    buffer = b""
    running: dict[int, int] = {}  # pid -> request id
    open_ = True

    def say(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(stdout, data):]

    while open_ or running:
        ready, _, _ = select.select([stdin] if open_ else [], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_ = False
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                unsafe = _fork_unsafe()
                if unsafe is not None:  # the caller starts a new interpreter instead
                    say({"id": request["id"], "refused": unsafe})
                    continue
                pid = os.fork()
                if pid == 0:  # the run
                    code = 70
                    try:
                        os.setsid()
                        null = os.open(os.devnull, os.O_RDWR)
                        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                        os.dup2(null, 0)
                        os.dup2(null, 1)
                        os.dup2(err, 2)
                        code = main([request["spec"]])
                    finally:
                        os._exit(code)
                running[pid] = request["id"]
                say({"id": request["id"], "pid": pid})
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") \
                else (status >> 8)
            say({"id": running.pop(pid), "exit": code})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
