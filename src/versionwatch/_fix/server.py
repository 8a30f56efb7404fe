"""``versionwatch fix``'s fork server: torch imported once, a fork for each run.

:class:`ForkServer` (in the caller) starts ``python -m versionwatch._fix.server``
(:func:`serve`), which imports torch and versionwatch once and forks a run of
:func:`versionwatch._fix.child.main` for each request: a run then costs the
program's own time, not torch's import. See :class:`ForkServer` for why a fork
is safe here, and what it cannot give (``versionwatch fix --fresh``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from versionwatch._process import (
    end,
    environment,
    python_module,
    signal_group,
    start,
    tie_to_parent,
    wait,
)

# How long a run that is asked to stop (its time limit, Ctrl-C, SIGTERM) has for its
# own cleanup (``finally``, ``atexit``) between SIGTERM and SIGKILL to its group.
GRACE = 5.0


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

    Nothing outlives this object's process: the server holds the read end of a
    pipe whose only write end is here; when it closes (:meth:`close`, or this
    process dying, however it dies) the server kills every run's group and
    exits. Each run leads a session of its own, tied to the same pipe
    (:func:`~versionwatch._process.tie_to_parent`), and the server kills a run's
    group when the run ends, so that what the program started ends with it.
    """

    def __init__(self) -> None:
        death_r, self._death_w = os.pipe()
        try:
            self.proc = start([*python_module("versionwatch._fix.server"), str(death_r)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=environment(),
                              pass_fds=(death_r,))
        except BaseException:
            os.close(self._death_w)
            raise
        finally:
            os.close(death_r)
        self.lock = threading.Lock()
        self.next_id = 0
        self.answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.ended: dict[int, threading.Event] = {}  # runs in flight: set when one ends
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.lock:
                q = self.answers.get(message["id"])
                if "exit" in message or "refused" in message:
                    event = self.ended.pop(message["id"], None)
                    if event is not None:
                        event.set()
            if q is not None:
                q.put(message)
        with self.lock:  # the server is gone: every waiting run ends
            for q in self.answers.values():
                q.put({"exit": -1, "gone": True})
            for event in self.ended.values():
                event.set()
            self.ended.clear()

    def _say(self, message: dict[str, Any]) -> None:
        # Called with self.lock held: one writer at a time.
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the server is gone, or closed: its runs with it
            pass

    def run(self, spec: str, err: str, timeout: float,
            started: Callable[[Callable[[], threading.Event]], None] | None = None,
            ) -> tuple[int, bool] | None:
        """Run ``spec``; its exit status, and whether it timed out (``None``: refused).

        ``timeout`` counts from the run's fork. ``started`` is handed the run's
        stop (SIGTERM to its group, SIGKILL after :data:`GRACE` s), which returns
        an event set when the run has ended: for whoever must end the run from
        another thread (Ctrl-C).
        """
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            self.answers[rid] = q
            event = self.ended[rid] = threading.Event()
            self._say({"id": rid, "spec": spec, "err": err})
        if started is not None:
            started(lambda: self._stop(rid, event))
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    message = q.get(timeout=max(left, 0.01) if not timed_out else None)
                except queue.Empty:
                    timed_out = True
                    self._stop(rid, event)
                    continue
                if "pid" in message and not timed_out:
                    # The limit is the run's own: from its fork, not from the
                    # server's start-up (torch imported, for the first run).
                    deadline = time.monotonic() + timeout
                if "refused" in message:
                    return None
                if "exit" in message:
                    return int(message["exit"]), timed_out
        finally:
            with self.lock:
                del self.answers[rid]

    def _stop(self, rid: int, event: threading.Event) -> threading.Event:
        # The server ends it: it alone knows whether the pid is still the run's.
        with self.lock:
            if not event.is_set():
                self._say({"stop": rid})
        return event

    def close(self) -> None:
        """End the server, and every run still in flight with it (killed), then reap it."""
        with self.lock:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            if self._death_w != -1:
                os.close(self._death_w)  # the server kills what runs, and exits
                self._death_w = -1
        wait(self.proc, 30)
        end(self.proc)


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


def serve(death_fd: int) -> int:
    """Fork a run for each request on stdin: torch is imported once, not once a run.

    A request is a line of JSON, ``{"id": N, "spec": PATH, "err": PATH}``; the
    answers, one JSON line each on stdout, are ``{"id": N, "pid": PID}`` when the
    run starts and ``{"id": N, "exit": STATUS}`` when it ends (a negative status:
    killed by that signal). ``{"stop": N}`` ends run N: SIGTERM to its group, then
    SIGKILL after :data:`GRACE` s. A run is its own session (its process group
    is its pid), so that a stop, or its end, ends it with whatever it started.
    One thread only, so that nothing is held locked across a fork. Ends when
    stdin closes and the last run has ended; when ``death_fd`` (the read end of
    a pipe whose write end the caller holds) closes, at once, every run's group
    killed.
    """
    import select
    import signal

    # Imported once here for every run: what a run imports anyway, no state.
    import torch._dynamo  # noqa: F401  (what an optimizer's first step() imports)

    from versionwatch._candidates import FixFacts  # noqa: F401
    from versionwatch._fix.child import main
    from versionwatch._strict import attach  # noqa: F401  (strict mode)
    from versionwatch._watch import watch_all  # noqa: F401  (the watcher and its parts)

    server = os.getpid()
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    buffer = b""
    running: dict[int, int] = {}  # pid -> request id
    by_id: dict[int, int] = {}  # request id -> pid
    killing: dict[int, float] = {}  # pid -> when SIGKILL follows the SIGTERM it was sent
    open_ = True

    def say(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with contextlib.suppress(OSError):  # the caller is gone: its death pipe says so
            while data:
                data = data[os.write(stdout, data):]

    def signal_run(pid: int, sig: int) -> None:
        # The pid as well as its group: a run forked a moment ago may not lead it yet.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        signal_group(pid, sig)

    while open_ or running:
        ready, _, _ = select.select([death_fd, *([stdin] if open_ else [])], [], [], 0.05)
        if death_fd in ready and not os.read(death_fd, 64):
            # The caller closed the server, or died: nothing it started may stay.
            for pid in running:
                signal_run(pid, signal.SIGKILL)
            for pid in running:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            return 0
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_ = False
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if "stop" in request:
                    pid_ = by_id.get(request["stop"])
                    if pid_ is not None and pid_ not in killing:
                        signal_run(pid_, signal.SIGTERM)
                        killing[pid_] = time.monotonic() + GRACE
                    continue
                unsafe = _fork_unsafe()
                if unsafe is not None:  # the caller starts a new interpreter instead
                    say({"id": request["id"], "refused": unsafe})
                    continue
                pid = os.fork()
                if pid == 0:  # the run
                    _run(request, death_fd, server, main)
                running[pid] = request["id"]
                by_id[request["id"]] = pid
                say({"id": request["id"], "pid": pid})
        now = time.monotonic()
        for pid, when in list(killing.items()):
            if when <= now and pid in running:
                signal_run(pid, signal.SIGKILL)
                killing[pid] = float("inf")
        while running:
            # Exited, not reaped yet: its pid still names its group, which is killed
            # with what the program left running (a worker, a `sleep`), then reaped.
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None or info.si_pid == 0:
                break
            pid = info.si_pid
            signal_group(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            rid = running.pop(pid, None)
            killing.pop(pid, None)
            if rid is None:
                continue
            by_id.pop(rid, None)
            say({"id": rid, "exit": os.waitstatus_to_exitcode(status)})
    return 0


def _run(request: dict[str, Any], death_fd: int, server: int,
         main: Callable[[Sequence[str]], int]) -> NoReturn:
    """A forked run: a session of its own, tied to the caller, then the child's ``main``."""
    code = 70
    try:
        os.setsid()
        # Killed with its group if the server dies (PR_SET_PDEATHSIG), or the
        # caller (the death pipe): whatever kills them, the run goes too.
        tie_to_parent(server, death_fd)
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        code = main([request["spec"]])
        # As a new interpreter would end: the program's threads, then its atexit.
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
