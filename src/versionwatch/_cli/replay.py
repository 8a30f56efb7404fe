"""``versionwatch run --replay``: the lines of strict mode at default mode's cost.

A default-mode run that predicts a failure knows the tensor, the node and the
backward, but not the lines: the op that saved the tensor and the write that
changed it. Replay runs the same command again in a child process in strict
mode, stops it at the same backward (by number), and merges what strict mode
saw into the first run's report, after checking that the child met the same
hazard there: the same backward, node, slot, shape, dtype and versions (never
the words that describe the tensor, which differ between the modes). The
program runs twice, with its side effects: the docs say so, and it is opt-in.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import threading
import time
from dataclasses import replace
from typing import Any

from versionwatch._process import (
    end,
    environment,
    exited,
    kill_group,
    python_module,
    start,
    terminate,
    wait,
)
from versionwatch._report import (
    Fix,
    Hazard,
    Modification,
    Report,
    Site,
    Writer,
    fix_for,
    strict_hint,
)

# The child's own option, N:PARENT:DEATH_FD:REPORT_FD: stop at backward N, write the
# report to REPORT_FD, die when DEATH_FD (a pipe from PARENT) closes.
CHILD_OPTION = "--replay-child"
# How often the replay's wait looks whether its child has exited, and how long it
# reads the pipes after that.
_LOOK_S = 0.05
_DRAIN_S = 5.0


def refusal() -> str | None:
    """Why replay cannot run here, or ``None``."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(world)
    except ValueError:
        # Not guessed either way: one rank replayed alone would wait forever.
        return (f"versionwatch run: error: --replay reads WORLD_SIZE to refuse distributed "
                f"runs, and WORLD_SIZE={world!r} is not a whole number")
    if size > 1:
        return (f"versionwatch run: --replay does not support distributed runs yet "
                f"(WORLD_SIZE={world}): re-running one rank alone would wait for the "
                "others forever; run the failing command with --strict instead")
    return None


def target(reports: list[Report]) -> Report | None:
    """The report to replay: the first predicted in-place failure of a numbered backward.

    A freed graph needs none: default mode names its freeing backward already.
    """
    return next((r for r in reports if r.hazards and r.backward is not None
                 and r.hazards[0].detected == "predicted" and r.hazards[0].kind != "freed"),
                None)


class Child:
    """The replay's second run: ``versionwatch run --strict`` up to backward N, in a child.

    The child dies with this process, however this process ends:

    - it runs in a process group of its own (a new session), so a terminal's
      Ctrl-C reaches this process alone, which then stops the child's whole
      group (:meth:`stop`): SIGTERM to the group, SIGKILL to what is left. So
      do SIGTERM's handler, any exception, and the end of a replay that left
      processes behind;
    - when this process dies without a say (SIGKILL), on Linux the kernel kills
      the child (``PR_SET_PDEATHSIG``, which the child sets at its start-up:
      ``_process.tie_to_parent``); everywhere, the child holds the read end of a pipe
      whose only write end is this process's, and a daemon thread of the child
      that waits on it kills the child's group when it closes (the fallback on
      macOS, where there is no ``PR_SET_PDEATHSIG``).

    The child's report comes back through a second pipe, not a file: no
    temporary file is left behind, whatever ends the replay.
    """

    def __init__(self, command: list[str], backward: int, cwd: str,
                 source: bytes | None = None) -> None:
        """``command``: the program's (``SCRIPT ARGS`` or ``-m MODULE ARGS``).

        ``cwd`` is where the first run started: the program may have changed its
        working directory since, and its command's paths are relative to where it
        began. ``source``: the script of ``versionwatch run -``, which the child
        reads from its standard input as the first run did.
        """
        self.command = command
        self.backward = backward
        self.cwd = cwd
        self.source = source
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._death_w = -1
        self.stopped: str | None = None  # why, once stop() ended it

    def run(self) -> tuple[dict[str, Any] | None, str]:
        """Run the child to its end (or until :meth:`stop`).

        Returns its report at backward N (as JSON data; ``{"ok": True}`` when
        it found none) or ``None``, and, if it ended otherwise, why.
        """
        death_r, death_w = os.pipe()
        report_r, report_w = os.pipe()
        try:
            proc = self._start(death_r, death_w, report_w)
        except BaseException:
            os.close(death_w)
            os.close(report_r)
            raise
        finally:
            os.close(death_r)
            os.close(report_w)
        if proc is None:
            os.close(report_r)
            return None, f"was interrupted ({self.stopped})"
        try:
            report, said = self._exchange(proc, report_r)
            status = end(proc)  # its group too, if every pipe closed before it exited
        except BaseException as e:  # Ctrl-C, most likely: the group goes
            self.stop("Ctrl-C" if isinstance(e, KeyboardInterrupt) else type(e).__name__)
            raise
        finally:
            self._close_death_pipe()
            os.close(report_r)
            for pipe in (proc.stdin, proc.stderr):
                if pipe is not None and not pipe.closed:
                    pipe.close()
        if self.stopped is not None:  # by SIGTERM's handler, on another thread
            return None, f"was interrupted ({self.stopped})"
        if report:
            try:
                return json.loads(report.decode()), ""
            except ValueError as e:  # a child killed halfway through its write
                return None, f"ended (exit status {status}) with an unreadable report: {e}"
        lines = said.decode(errors="replace").strip().splitlines()
        last = f": {lines[-1]}" if lines else ""
        return None, f"ended (exit status {status}) before backward #{self.backward}{last}"

    def _exchange(self, proc: subprocess.Popen[bytes],
                  report_r: int) -> tuple[bytes, bytes]:
        """Feed the child its source, read its report and stderr, until it exits.

        On this thread alone: a run that ends after the program's threads (at
        exit) may start no thread on Python 3.12. The child's exit has no file
        to wait on everywhere, so the loop also looks at it every ``_LOOK_S``.
        Once it has exited, its group is killed and what is left in the pipes
        is read while they are open, for at most ``_DRAIN_S`` (a process that
        left the child's group may hold them).
        """
        assert proc.stderr is not None
        chunks: dict[int, list[bytes]] = {report_r: [], proc.stderr.fileno(): []}
        pending = memoryview(self.source or b"")
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                sel.register(fd, selectors.EVENT_READ)
            if proc.stdin is not None:
                if pending:
                    os.set_blocking(proc.stdin.fileno(), False)
                    sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
                else:
                    proc.stdin.close()
            deadline: float | None = None
            while sel.get_map():
                if deadline is None and exited(proc):
                    # What the replayed program left running goes with it.
                    kill_group(proc)
                    deadline = time.monotonic() + _DRAIN_S
                if deadline is not None and time.monotonic() > deadline:
                    break
                for key, _ in sel.select(_LOOK_S):
                    fd = int(key.fd)
                    if fd in chunks:
                        data = _read(fd)
                        if data:
                            chunks[fd].append(data)
                        else:
                            sel.unregister(fd)
                        continue
                    assert proc.stdin is not None
                    try:
                        pending = pending[os.write(fd, pending):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the child died before it read it all
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
            if deadline is None:
                wait(proc)  # every pipe closed: it is exiting (not reaped: its group stays named)
        return b"".join(chunks[report_r]), b"".join(chunks[proc.stderr.fileno()])

    def _start(self, death_r: int, death_w: int,
               report_w: int) -> subprocess.Popen[bytes] | None:
        child = f"{self.backward}:{os.getpid()}:{death_r}:{report_w}"
        argv = [*python_module("versionwatch"), "run", "--strict", "--quiet",
                CHILD_OPTION, child, "--", *self.command]
        if self.command[:1] == ["-m"]:  # `--` would make "-m" the script's name
            argv = [*argv[:argv.index("--")], *self.command]
        with self._lock:
            if self.stopped is not None:
                os.close(death_w)
                return None
            # This very versionwatch replays, wherever the program's folder puts
            # sys.path (a relative PYTHONPATH, another copy installed).
            self._proc = start(
                argv, cwd=self.cwd, env=environment(), pass_fds=(death_r, report_w),
                stdin=subprocess.PIPE if self.source is not None else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._death_w = death_w
            return self._proc

    def stop(self, why: str) -> bool:
        """End the child and its group, from any thread; True if it was still running."""
        with self._lock:
            if self.stopped is None:
                self.stopped = why
            proc = self._proc
        if proc is None:
            return False
        running = terminate(proc)  # a program's own SIGTERM handler gets its say, briefly
        self._close_death_pipe()
        return running

    def _close_death_pipe(self) -> None:
        with self._lock:
            death_w, self._death_w = self._death_w, -1
        if death_w != -1:
            os.close(death_w)


def _read(fd: int) -> bytes:
    # Called when select says the pipe is readable: data, or b"" at its end.
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def send_report(fd: int, data: dict[str, Any]) -> None:
    """The child's report, through the pipe its parent reads."""
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data))
    except OSError:  # the parent is gone: nobody to tell
        pass


def _identity(h: Hazard) -> dict[str, Any]:
    """What identifies a hazard at one backward, in the JSON's terms: never its wording."""
    return {"kind": h.kind, "saved_by": h.node, "slot": h.slot,
            "shape": list(h.shape) if h.shape is not None else None, "dtype": h.dtype,
            "saved_version": h.saved_version, "current_version": h.current_version}


def _same(h: Hazard, c: dict[str, Any], backward: int | None = None) -> bool:
    """Whether the replay's hazard ``c`` is ``h``: backward, node, slot, shape, dtype, versions.

    Descriptions differ between the modes (default mode reads "the output of
    Add" from PyTorch's sentence, strict mode may know only "a tensor", or the
    user's variable), so they are never compared; a fact one side does not
    know (``None``) is no difference.
    """
    if backward is not None and c.get("backward") not in (None, backward):
        return False
    for key, mine in _identity(h).items():
        theirs = c.get(key)
        if key == "slot":
            if not _same_slot(mine, theirs):
                return False
        elif key in ("saved_by", "kind"):
            if theirs != mine:
                return False
        elif mine is not None and theirs is not None and theirs != mine:
            return False
    return True


def _same_slot(a: str, b: Any) -> bool:
    """``"saved_tensors"`` is ``"saved_tensors[0]"`` with the index unknown (old torch
    reads a custom or compiled Function's saved tensors as a whole in default mode)."""
    if not isinstance(b, str):
        return False
    return a == b or b.startswith(a + "[") or a.startswith(b + "[")


def _twin(h: Hazard, hazards: list[dict[str, Any]], backward: int | None
          ) -> dict[str, Any] | None:
    """The replay's hazard that is ``h``; among equals (two layers' weights of one shape),
    the one at the same place in the backward's order, else of the same name."""
    found = [c for c in hazards if _same(h, c, backward)]
    return next((c for c in found if c.get("order") == h.order),
                next((c for c in found if h.tensor and c.get("tensor") == h.tensor),
                     found[0] if found else None))


def _described(d: dict[str, Any]) -> str:
    """``NativeLayerNormBackward0.input (float32[2, 5, 8], version 1 -> 2)``."""
    where = f"{d.get('saved_by')}.{d.get('slot')}" if d.get("slot") else f"{d.get('saved_by')}"
    facts = []
    if d.get("dtype") is not None and d.get("shape") is not None:
        facts.append(f"{d['dtype']}{list(d['shape'])}")
    if d.get("saved_version") is not None:
        facts.append(f"version {d['saved_version']} -> {d.get('current_version')}")
    return f"{where} ({', '.join(facts)})" if facts else where


def _site(d: dict[str, Any] | None) -> Site | None:
    if not d or d.get("file") is None or d.get("line") is None:
        return None
    code = d.get("code") or _source_line(d["file"], d["line"])
    return Site(d["file"], d["line"], code)


def _writer(d: dict[str, Any] | None) -> Writer | None:
    if not d or not d.get("module"):
        return None
    return Writer(d["module"], d.get("repr") or "", _site(d), d.get("class") or "")


def _stack(d: dict[str, Any]) -> tuple[Site, ...]:
    return tuple(s for f in d.get("stack") or () if (s := _site(f)) is not None)


def _source_line(file: str, line: int) -> str:
    # Read afresh: linecache may hold another file of the same relative name.
    try:
        with open(file, encoding="utf-8", errors="replace") as f:
            for n, text in enumerate(f, 1):
                if n == line:
                    return text.strip()
    except OSError:
        pass
    return ""


def merge(report: Report, child: dict[str, Any] | None, why: str) -> bool:
    """Fill ``report`` in with the child's lines, or say why it cannot be; True if filled."""
    n = report.backward
    h = report.hazards[0]
    hazards = (child or {}).get("hazards") or []
    if child is None or not hazards:
        if child is None:
            report.replay = (f"not reproduced: the strict replay of the same command {why}; "
                             "run it with --strict instead")
        else:
            report.replay = (f"not reproduced: the strict replay of the same command found no "
                             f"hazard at backward #{n}; the program is not deterministic "
                             "enough to replay (seed it, fix its data order), or run it with "
                             "--strict")
        return False
    c = _twin(h, hazards, n)
    if c is None:
        mine = _described({**_identity(h)})
        theirs = _described(hazards[0])
        report.replay = (f"not reproduced: the strict replay diverged at backward #{n}: this "
                         f"run's first hazard there is {mine}, the replay's is {theirs}; the "
                         "program is not deterministic enough to replay (seed it, fix its "
                         "data order), or run it with --strict")
        return False
    _fill(h, c)
    # The other hazards of this backward, each with its own twin if the replay has one.
    for other in report.hazards[1:]:
        twin = _twin(other, hazards, n)
        if twin is not None:
            _fill(other, twin)
    report.replay = (f"the lines above come from a strict replay of the same command, "
                     f"which met the same hazard at backward #{n}")
    return True


def replayed(before: str, report: Report) -> str:
    """What the replay adds to a report printed already (``before``, its text then).

    The program's own error printed the report; the replay's lines are the facts
    that changed (the saving op's line, the write's code, a fix made concrete),
    under one line that says where they come from: the report is printed once.
    """
    old = set(before.splitlines())
    lines = [ln for ln in str(report).splitlines()[1:]
             if ln not in old and not ln.lstrip().startswith("replay ")]
    head = (f"versionwatch: --replay: the strict replay met the same hazard at backward "
            f"#{report.backward}; its lines for the report above:")
    return "\n".join([head, *lines])


def _fill(h: Hazard, c: dict[str, Any]) -> None:
    """The same hazard: strict mode's lines (and facts) are this run's."""
    h.saved_at = _site(c.get("saved_at")) or h.saved_at
    h.module = c.get("module") or h.module
    # Strict mode records a step's writes as the step (kind "inplace_op"): one
    # this run saw as an event keeps its kind and versions, and gains the code.
    seen = {m.description: m for m in h.modified_by if m.kind != "between_events"}
    writes = []
    for m in c.get("modified_by") or ():
        if m.get("kind") != "inplace_op":
            continue
        event = seen.get(m["description"])
        site = _site(m)
        writer = _writer(m.get("writer"))
        if event is not None:
            writes.append(Modification(event.kind, event.description, site or event.site,
                                       event.versions, writer=writer, stack=_stack(m)))
        else:
            writes.append(Modification(m["kind"], m["description"], site, None,
                                       writer=writer, stack=_stack(m)))
    if writes:
        versions = [m.versions for m in h.modified_by if m.versions]
        if len(writes) == 1 and len(versions) == 1 and writes[0].versions is None:
            writes[0] = replace(writes[0], versions=versions[0])
        h.modified_by = writes
    # Facts only strict mode knows.
    h.variable = h.variable or c.get("variable")
    h.compiled_forward = h.compiled_forward or _site(c.get("compiled_forward"))
    # The hints that point at strict mode (--replay, or the place's own option): it ran.
    hints = [strict_hint(where) for where in ("cli", "pytest", "notebook")]
    h.notes = [note for note in h.notes if not any(hint in note for hint in hints)]
    h.fix = fix_for(h)  # the lines may make it concrete (the write's own line, its module)
    if c.get("fixes"):  # the replay's candidates, made from its lines
        h.fixes = [Fix(**f) for f in c["fixes"]]
