"""Checking a candidate: run the patched program and judge what it trains.

A check runs the program again in a child (:mod:`versionwatch._fix.child`),
in a fresh copy of the user's folders (:mod:`versionwatch._fix.workspace`),
with the candidate's files taken from scratch copies, under default mode, up
to ``check_steps`` backwards past the one that failed (or to its end), within
a time limit. The candidate is **verified** when

* the hazard is gone, and no other error, hazard or non-zero exit came up;
* no backward reaches a parameter through a forward made before an optimizer
  step changed that parameter (a stale gradient: the failure hidden, not fixed,
  as ``zero_grad(set_to_none=True)`` hides the seed story's);
* every optimizer step applies what the program as its author meant it applies
  (:func:`compare_training`): the reference is the original run in strict
  mode with ``on_hazard="repair"`` (each backward sees what its forward saved)
  over the same backwards; each step must apply, to each parameter, the
  gradients of the same losses (named from the source), with the same values
  (bitwise, or within :data:`TOLERANCE` where the patch reorders an
  accumulation); a step that merges several (one step of the summed
  gradients) only where the parameters after it are the reference's; a
  re-timed write (``refresh``, ``move_update``) may change the values behind
  it, and says so. Without a reference (a freed graph), the steps are compared
  with the original's before the failure, losses only, and each backward must
  reach what the original's did.

For a candidate that claims to keep the values, the losses and the gradients
after each backward up to the failing one are compared with the original run's,
bitwise: before the failure from the original run itself; at the failing
backward, from the reference.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from versionwatch._candidates import Candidate, decode_source, line_map, shown_at
from versionwatch._fix.server import GRACE, ForkServer
from versionwatch._fix.workspace import Run as Place
from versionwatch._process import end, environment, python_module, start, terminate, wait
from versionwatch._report import Report


@dataclass
class Run:
    """What one child run recorded (see :mod:`versionwatch._fix.child`)."""

    status: str  # stopped, failed, completed, exited, error, timeout, died
    exit: int = 0
    backwards: int = 0
    failed_at: int | None = None
    ours: bool = False
    hazard: dict[str, Any] | None = None
    error: str | None = None
    error_site: list[Any] | None = None
    trace: str = ""
    text: str = ""
    report: dict[str, Any] | None = None
    facts: dict[str, Any] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""
    seconds: float = 0.0
    report_pickle: str | None = None
    forks: int = 0  # processes the program forked that ran a backward: not followed
    stdin_read: bool = False  # the program read its (empty) standard input

    def record(self, n: int) -> dict[str, Any] | None:
        return next((r for r in self.records if r["n"] == n), None)

    def report_object(self) -> Report | None:
        """The failure's :class:`~versionwatch.Report`, as the child made it (plain data)."""
        if not self.report_pickle:
            return None
        try:
            # Our own child wrote it, for this process: trusted as the program is.
            report = pickle.loads(base64.b64decode(self.report_pickle))
        except Exception:
            return None
        return report if isinstance(report, Report) else None


# What a run's stderr keeps at most, its end: a program may write hundreds of MB.
STDERR_TAIL = 64 * 1024


class Flight:
    """The runs of one ``fix()`` in flight, to end them all at once (Ctrl-C, SIGTERM).

    :func:`run_child` registers each run's stop while it runs; :meth:`stop`
    stops every one (SIGTERM to its group, SIGKILL after the grace) and waits
    until they have ended, and no run starts after it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, Callable[[], threading.Event]] = {}
        self.stopped: int | None = None  # how many runs stop() found running

    def add(self, key: int, stop: Callable[[], threading.Event]) -> bool:
        """Register a run's stop; False once :meth:`stop` ran (the run must not start)."""
        with self.lock:
            if self.stopped is not None:
                return False
            self.live[key] = stop
            return True

    def remove(self, key: int) -> None:
        with self.lock:
            self.live.pop(key, None)

    def stop(self) -> int:
        """End every run in flight and wait for them: how many were running."""
        with self.lock:
            if self.stopped is not None:
                return self.stopped
            stops = list(self.live.values())
            self.stopped = len(stops)
        events = [stop() for stop in stops]
        for event in events:
            event.wait(GRACE + 5)
        return self.stopped


def _terminating(proc: subprocess.Popen[bytes]) -> threading.Event:
    """A run of its own interpreter stopped from another thread: SIGTERM, the grace, SIGKILL."""
    done = threading.Event()

    def stop() -> None:
        terminate(proc, GRACE)
        done.set()

    threading.Thread(target=stop, daemon=True, name="versionwatch-stop").start()
    return done


def _tail(path: str) -> str:
    """The last :data:`STDERR_TAIL` bytes of a run's stderr, read from its end."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - STDERR_TAIL))
            data = f.read(STDERR_TAIL)
    except OSError:
        return ""
    if size > STDERR_TAIL:  # cut inside a line: from the next whole one
        data = data.partition(b"\n")[2]
    return data.decode(errors="replace")


def run_child(program: list[str], *, scratch: dict[str, str] | None = None,
              watch: str = "default", allow_mutation: bool = False,
              stop_after: int | None = None, record_upto: int = 0, grads_upto: int = 0,
              grads_at: tuple[int, ...] = (), timeout: float = 120.0,
              workdir: str | None = None, server: ForkServer | None = None,
              ledger: bool = False, on_hazard: str = "raise",
              where: Place | None = None, flight: Flight | None = None) -> Run:
    """Run ``program`` (``["script.py", ...]``, ``["-m", mod, ...]``, ``["-c", code, ...]``).

    ``where``: the run's copy of the user's folders (:mod:`versionwatch._fix.workspace`):
    the program runs there, its code named by the user's paths; default: in place.
    ``flight``: where the run can be stopped from another thread; a run asked for
    after its ``stop()`` does not start (status ``died``). A run past its
    ``timeout`` is stopped as Ctrl-C would stop it, and has :data:`GRACE` s to clean up.
    """
    own = workdir is None
    folder = workdir or tempfile.mkdtemp(prefix="versionwatch-fix-")
    key = object()
    try:
        fd, spec_path = tempfile.mkstemp(dir=folder, suffix=".json")
        out = spec_path[:-5] + ".pt"
        tmp = tempfile.mkdtemp(dir=folder, prefix="tmp")  # the program's TMPDIR
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"argv": program, "scratch": scratch or {}, "watch": watch,
                       "allow_mutation": allow_mutation, "stop_after": stop_after,
                       "record_upto": record_upto, "grads_upto": grads_upto,
                       "grads_at": list(grads_at), "out": out, "tmp": tmp,
                       "cwd": where.cwd if where is not None else os.getcwd(),
                       "mirror": where.mirror if where is not None else [],
                       "ledger": ledger, "on_hazard": on_hazard}, f)
        err_path = spec_path[:-5] + ".err"
        began = time.monotonic()
        if flight is not None and flight.stopped is not None:
            return Run("died", exit=-signal.SIGTERM)

        def started(stop: Callable[[], threading.Event]) -> None:
            if flight is not None and not flight.add(id(key), stop):
                stop()  # everything was stopped as this run started: it too

        answer = server.run(spec_path, err_path, timeout, started) if server is not None \
            else None
        if answer is not None:
            code, timed_out = answer
        else:
            code, timed_out = _run_fresh(spec_path, err_path, timeout, started,
                                         flight.stop if flight is not None else None)
        seconds = time.monotonic() - began
        stderr = _tail(err_path)
        if not os.path.exists(out):  # a record is whole (os.replace): the run got there
            if timed_out:
                return Run("timeout", exit=-1, stderr=stderr, seconds=seconds)
            return Run("died", exit=code, stderr=stderr, seconds=seconds)
        import torch

        data = torch.load(out, weights_only=True)
        keys = Run.__dataclass_fields__
        run = Run(**{k: v for k, v in data.items() if k in keys})
        run.stderr, run.seconds = stderr, seconds
        return run
    except BaseException:
        if flight is not None:  # interrupted (Ctrl-C) while it ran: it and the others end
            flight.stop()
        raise
    finally:
        if flight is not None:
            flight.remove(id(key))
        if own:
            _rmtree(folder)


def _run_fresh(spec_path: str, err_path: str, timeout: float,
               started: Callable[[Callable[[], threading.Event]], None],
               stop_all: Callable[[], int] | None) -> tuple[int, bool]:
    """The run in a new interpreter (``--fresh``, or the fork server refused): its exit
    status, and whether it timed out. Tied to this process by a pipe: it dies with it.
    Interrupted, it stops every run of ``stop_all`` (this one too) before it kills
    what is left of this one."""
    death_r, death_w = os.pipe()
    try:
        with open(err_path, "wb") as err:
            proc = start([*python_module("versionwatch._fix.child"), spec_path,
                          "--tie", f"{os.getpid()}:{death_r}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                         env=environment(), pass_fds=(death_r,))
        os.close(death_r)
        death_r = -1
        try:
            started(lambda: _terminating(proc))
            timed_out = not wait(proc, timeout)
            if timed_out:
                terminate(proc, GRACE)  # its cleanup gets its say, briefly
        except BaseException:  # Ctrl-C: the same say for every run, at once
            if stop_all is not None:
                stop_all()
            terminate(proc, GRACE)
            raise
        finally:
            # The child and whatever it started (its own group), and reaped.
            code = end(proc)
    finally:
        for fd in (death_r, death_w):
            if fd != -1:
                os.close(fd)
    return code, timed_out


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def write_scratch(candidate: Candidate, folder: str) -> dict[str, str]:
    """Write the candidate's new files under ``folder``: original path -> scratch path.

    Each in the encoding its original is read in (a coding cookie, a BOM): the
    child compiles the copy's bytes, and those bytes are the ones ``--apply`` writes.
    """
    out = {}
    for i, (path, (_, new)) in enumerate(candidate.files.items()):
        sub = os.path.join(folder, f"f{i}")
        os.makedirs(sub, exist_ok=True)
        scratch = os.path.join(sub, os.path.basename(path))
        with open(scratch, "wb") as f:
            f.write(_encoded(path, new))
        out[path] = scratch
    return out


def _encoded(path: str, text: str) -> bytes:
    """``text`` in the encoding of the file at ``path`` (UTF-8 where that cannot hold it)."""
    try:
        with open(path, "rb") as f:
            encoding = decode_source(f.read())[1]
        return text.encode(encoding)
    except (OSError, SyntaxError, UnicodeError):
        # The file is gone or no longer decodes, or the patch has a character its
        # encoding lacks: --apply refuses it then, and the check runs the text as UTF-8.
        return text.encode("utf-8")


# -- judging --------------------------------------------------------------------------

def _same_bits(a: Any, b: Any) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout != torch.strided or b.layout != torch.strided:
        return bool(torch.equal(a.to_dense(), b.to_dense()))
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _names(keys: list[str]) -> str:
    shown_keys = ", ".join(keys[:3])
    return shown_keys + (f" (+{len(keys) - 3})" if len(keys) > 3 else "")


def _at(site: list[Any] | None, lines: dict[str, dict[int, int]]) -> str:
    """``file:line`` of a child's site, as the line of the original file."""
    if not site:
        return "?"
    file, line = site[0], int(site[1])
    patched = bool(site[2]) if len(site) > 2 else False
    real = os.path.realpath(file)
    if patched and real in lines:
        line = lines[real].get(line, line)
    return shown_at(file, line)


def _one_iteration(original: Run, failing: int) -> dict[str, int]:
    """For each optimizer, how many of the original's steps came before the
    first run of the failing backward's line, where that line ran before (a
    loop: the steps since are one iteration, repeated). Where it did not, the
    original ran no whole iteration: none is said, and every step is a prefix."""
    rec = original.record(failing)
    site = rec.get("site") if rec else None
    first = next((r["n"] for r in original.records
                  if r["n"] < failing and site and r.get("site") == site), None)
    if first is None:
        return {}
    out: dict[str, int] = {}
    for st in original.steps:
        if "optimizer" in st:
            out.setdefault(st["optimizer"], 0)
            if st["after"] < first:
                out[st["optimizer"]] += 1
    return out


def usable(reference: Run | None, failing: int) -> bool:
    """A reference run that got past the failing backward, its steps recorded."""
    return reference is not None and any("applied" in st for st in reference.steps) and (
        reference.status in ("stopped", "completed")
        or (reference.status == "exited" and not reference.exit)
        or (reference.status == "failed" and (reference.failed_at or 0) > failing))


def judge(candidate: Candidate, run: Run, original: Run, meant: Run | None,
          failing: int, steps: int, timeout: float) -> None:
    """Set ``candidate.verified``, ``keeps_values`` and ``why`` from its check ``run``.

    ``meant``: the program as its author meant it (each backward sees what its
    forward saved), run with the same budget: every optimizer step of the
    candidate must apply what its step did (:func:`compare_training`). Without
    one (a freed graph), the steps are compared with the original's before the
    failure, losses only, and each backward must reach what the original's did.
    """
    candidate.checked = True
    # By real path: a run names files as the interpreter found them, symlinks resolved.
    lines = {os.path.realpath(path): line_map(old, new)
             for path, (old, new) in candidate.files.items()}
    problems: list[str] = []
    if run.status == "timeout":
        problems.append(f"the patched program did not reach backward #{failing + steps} "
                        f"within {timeout:g} s")
    elif run.status == "died":
        said = run.stderr.strip().splitlines()
        problems.append(f"the check run ended with status {run.exit}"
                        + (f": {said[-1]}" if said else ""))
    elif run.status == "failed":
        rec = run.record(run.failed_at or 0)
        where = _at(rec["site"] if rec else None, lines)
        same = (run.hazard is not None and original.hazard is not None
                and {k: run.hazard.get(k) for k in ("kind", "node", "slot")}
                == {k: original.hazard.get(k) for k in ("kind", "node", "slot")})
        if same:
            problems.append(f"the hazard is still there: backward #{run.failed_at} at {where} "
                            f"fails the same way ({run.error})")
        elif run.ours:
            problems.append(f"another hazard at backward #{run.failed_at} ({where}): {run.error}")
        else:
            problems.append(f"backward #{run.failed_at} ({where}) raised {run.error}")
    elif run.status == "error":
        problems.append(f"the patched program raised {run.error} at "
                        f"{_at(run.error_site, lines)}")
    elif run.status == "exited" and run.exit:
        problems.append(f"the patched program exited with status {run.exit}")
    # Stale gradients: the failure hidden.
    for rec in run.records:
        if rec.get("stale"):
            keys = [k for k, _ in rec["stale"]]
            problems.append(
                f"it only hides the failure: backward #{rec['n']} ({_at(rec['site'], lines)}) "
                f"computes gradients of {_names(keys)} from a forward made before "
                f"{rec['stale'][0][1]} changed them")
            break
    # What each optimizer step applies.
    rec = original.record(failing)
    failing_losses = list(rec.get("losses", [])) if rec else []
    training = None
    reference = meant if usable(meant, failing) else None
    if not problems:
        if reference is not None:
            training = compare_training(candidate, run, reference, values=True,
                                        failing_losses=failing_losses)
        elif any("applied" in st for st in original.steps):
            training = compare_training(candidate, run, original, values=False,
                                        failing_losses=failing_losses,
                                        prefix=_one_iteration(original, failing))
        if training is not None and training.problem:
            problems.append(training.problem)
    # Gradients the program trains with (where no reference says what each step applies).
    if reference is None and candidate.same_backwards and not candidate.cut_any:
        cut = {(os.path.realpath(c.file), c.line) for c in candidate.cut_at}
        for rec in run.records:
            before = original.record(rec["n"])
            if before is None or "reach" not in before or "reach" not in rec:
                continue
            lost = sorted(set(before["reach"]) - set(rec["reach"]))
            site = rec.get("site")
            at_line = None
            if site:
                file, line = os.path.realpath(site[0]), int(site[1])
                if len(site) > 2 and site[2] and file in lines:
                    line = lines[file].get(line, line)
                at_line = (file, line)
            if lost and at_line not in cut:
                problems.append(
                    f"it changes what is trained: {_names(lost)} no longer get gradients from "
                    f"backward #{rec['n']} ({_at(site, lines)})")
                break
    candidate.verified = not problems and not candidate.hides
    if not candidate.verified:
        if candidate.hides:
            seen = problems[0].split(": ", 1)[-1] if problems else ""
            candidate.why = candidate.hides + (f"; the check saw it: {seen}" if seen else "")
        else:
            candidate.why = problems[0]
        if candidate.keeps_values:
            candidate.keeps_values = False
        return
    reached = (f"the program ran to its end ({run.backwards} backward(s))"
               if run.status in ("completed", "exited")
               else f"backward #{failing} and {steps} more ran")
    candidate.why = f"checked: {reached}, no hazard, no other error"
    if training is not None and training.said:
        candidate.why += f"; {training.said}"
        candidate.extra["training"] = ("refreshed" if training.diverged else
                                       "merged" if training.merged else "same")
    if candidate.keeps_values:
        same, values = compare_values(run, original, meant, failing)
        candidate.keeps_values = same
        candidate.why += f"; {values}"


def _numbers(ns: list[int]) -> str:
    if len(ns) == 1:
        return f"backward #{ns[0]}"
    if ns == list(range(ns[0], ns[-1] + 1)):
        return f"backwards #{ns[0]}-#{ns[-1]}"
    return "backwards " + ", ".join(f"#{n}" for n in ns)


def compare_values(run: Run, original: Run, meant: Run | None,
                   failing: int) -> tuple[bool, str]:
    """Whether the losses and gradients up to backward ``failing`` are bitwise the original's."""
    losses: list[int] = []
    grads: list[int] = []
    for n in range(1, failing + 1):
        mine = run.record(n)
        if mine is None or "loss" not in mine:
            return False, f"the values were not compared: no record of backward #{n}"
        ref = original.record(n)
        if ref is not None and "loss" in ref:
            if len(ref["loss"]) != len(mine["loss"]) or not all(
                    _same_bits(a, b) for a, b in zip(ref["loss"], mine["loss"])):
                return False, f"the values differ: the loss of backward #{n}"
            losses.append(n)
        source = ref if n < failing else (meant.record(n) if meant is not None else None)
        if source is None or "grads" not in source or "grads" not in mine:
            continue
        for key, value in source["grads"].items():
            if key in mine["grads"] and not _same_bits(value, mine["grads"][key]):
                return False, f"the values differ: {key}.grad after backward #{n}"
        grads.append(n)
    if not losses:
        return False, "the values were not compared: the original run recorded none"
    said = f"the loss{'es' if len(losses) > 1 else ''} of {_numbers(losses)}"
    if grads:
        return True, f"{said} and the gradients after {_numbers(grads)} are bitwise the " \
                     "original run's"
    verb = "are" if len(losses) > 1 else "is"
    return True, f"{said} {verb} bitwise the original run's (no gradients to compare)"


# -- what each optimizer step applies ---------------------------------------------------

# Two sketches of one gradient or update agree within this, relative to their norm: a
# reordered accumulation rounds differently (about 1e-7 of it in float32); a step
# with another loss's gradient, or with a momentum or Adam state, is off by far more.
TOLERANCE = 1e-4


@dataclass
class Training:
    """How a candidate's optimizer steps compare with the reference's.

    ``problem``: why the candidate trains otherwise than the program meant
    (``None``: it trains as meant); ``said``: what the check found, one clause.
    """

    problem: str | None
    said: str
    merged: int = 0  # the most steps of the reference one step of the candidate merges
    diverged: list[str] = field(default_factory=list)


def _close(a: dict[str, Any] | None, b: dict[str, Any] | None, scale: float = 0.0) -> bool:
    if a is None or b is None:
        return a is None and b is None
    tol = TOLERANCE * max(a["norm"], b["norm"], scale) + 1e-30
    return all(abs(x - y) <= tol for x, y in zip(a["sketch"], b["sketch"]))


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(a["hash"] == b["hash"] and a["dtype"] == b["dtype"] and a["shape"] == b["shape"])


def _summed(sketches: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The sketch of the sum of the tensors (sketches are linear; norms bound it)."""
    if any(s is None for s in sketches):
        return None
    parts = [s for s in sketches if s is not None]
    return {"sketch": [sum(v) for v in zip(*(p["sketch"] for p in parts))],
            "norm": sum(p["norm"] for p in parts)}


def _module_of(keys: list[str]) -> str:
    """``D`` for ``D.0.weight, D.2.bias``; the names themselves when they share nothing."""
    parts = [k.split(".") for k in keys]
    common: list[str] = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    if common and all(len(p) > len(common) for p in parts):
        return f"`{'.'.join(common)}`"
    return _names(keys)


def _losses(names: list[str]) -> str:
    return " and ".join(f"`{n}`'s" for n in dict.fromkeys(names))


def _difference(opt: str, ref: dict[str, Any], mine: dict[str, Any]) -> str:
    """Why ``opt``'s step applies other gradients than the program's, in its names."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for key in sorted(set(ref) | set(mine)):
        had = ref.get(key, {}).get("losses", [])
        now = mine.get(key, {}).get("losses", [])
        extra = tuple(sorted(set(now) - set(had)))
        missing = tuple(sorted(set(had) - set(now)))
        if extra or missing:
            groups.setdefault((extra, missing), []).append(key)
    if not groups:
        return _recount(opt, ref, mine)
    (extra, missing), keys = max(groups.items(), key=lambda kv: len(kv[1]))
    to = _module_of(keys)
    if extra and missing:
        return (f"`{opt}.step()` would apply {_losses(list(extra))} gradient to {to} "
                f"instead of {_losses(list(missing))}")
    if extra:
        return f"`{opt}.step()` would also apply {_losses(list(extra))} gradient to {to}"
    return f"`{opt}.step()` would no longer apply {_losses(list(missing))} gradient to {to}"


def _by_optimizer(run: Run) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for st in run.steps:
        if "applied" in st:
            out.setdefault(st["optimizer"], []).append(st["applied"])
    return out


def _loss_sets(applied: dict[str, Any]) -> dict[str, list[str]]:
    return {k: v["losses"] for k, v in applied.items() if v["losses"]}


# Families that re-time a write the program makes (a forward re-run after the step,
# a no_grad update moved after it): from the step where it first matters, the
# values differ from the program's on purpose; the losses are compared throughout.
RETIMED = {"refresh": "the forward re-run after the step",
           "move_update": "the update moved after the step"}


def compare_training(candidate: Candidate, run: Run, reference: Run, *, values: bool,
                     failing_losses: list[str], prefix: dict[str, int] | None = None,
                     ) -> Training:
    """Whether ``run``'s optimizer steps apply what ``reference``'s do.

    Each optimizer's steps are compared in order: a step must apply the gradients
    of the same losses to each parameter, with the same values (bitwise, or
    within :data:`TOLERANCE` where the candidate reorders an accumulation). A
    step of the candidate that applies what several consecutive steps of the
    reference applied (one step of the summed gradients) is right only where the
    parameters after it match the reference's after the last of them. With
    ``values=False`` (no reference of the values: the original's own steps
    before the failure), only the losses are compared: each optimizer's first
    ``prefix`` steps with the original's in order, the rest cyclically with the
    original's steps after those (one iteration of its loop), if it ran one.
    """
    ref_steps = _by_optimizer(reference)
    my_steps = _by_optimizer(run)
    renames: dict[str, str] = candidate.extra.get("renames") or {}
    if renames:
        # A family that back-propagates a term under its own name (item_accumulator:
        # `loss.backward()` for `total.backward()`): the losses as the program names them.
        my_steps = {opt: [{k: {**v, "losses": sorted(renames.get(n, n) for n in v["losses"])}
                           for k, v in step.items()} for step in steps]
                    for opt, steps in my_steps.items()}
    merged = 0
    diverged: list[str] = []
    exact = values
    # The order the candidate ran its steps in, for the first difference it made.
    for opt in dict.fromkeys([st["optimizer"] for st in run.steps if "applied" in st]
                             + list(ref_steps)):
        refs, mine = ref_steps.get(opt, []), my_steps.get(opt, [])
        if refs and not mine:
            return Training(f"`{opt}.step()` never runs in the patched program", "")
        if not refs:
            continue
        i = 0
        head = min((prefix or {}).get(opt, 1 << 30), len(refs))
        for j, step in enumerate(mine):
            if i >= len(refs) and (values or head == len(refs)):
                break
            ref = refs[i] if i < len(refs) else refs[head + (i - head) % (len(refs) - head)]
            if _loss_sets(step) == _loss_sets(ref):
                if exact:
                    ok = _step_values(ref, step)
                    if not ok:
                        behind = [k for k, v in step.items()
                                  if not _close(ref.get(k, {}).get("grad"), v["grad"])]
                        retimed = candidate.family in RETIMED and (
                            candidate.family != "refresh" or any(
                                set(step[k]["losses"]) & set(failing_losses) for k in behind))
                        if retimed:
                            # The forward re-run through the stepped weights: the
                            # gradients behind it differ on purpose; the losses are
                            # still compared from here on.
                            diverged = behind
                            exact = False
                        else:
                            return Training(
                                f"the values differ: `{opt}.step()` #{j + 1} would apply the "
                                f"same losses' gradients to {_module_of(behind)}, but not the "
                                "values the program meant (the patch computes them on other "
                                "weights or data)", "")
                i += 1
                continue
            # One step of what several of the reference's applied?
            span = _merge_span(refs, i, step) if values else 0
            if span:
                merged = max(merged, span)
                if exact and not _merge_values(refs[i:i + span], step):
                    stateful = any(st.get("stateful") for st in reference.steps
                                   if st.get("optimizer") == opt)
                    return Training(
                        f"it changes the training: one `{opt}.step()` of the summed gradients "
                        f"instead of {_count(span)}, and the parameters after it differ from the "
                        "program's" + (" (its optimizer keeps a state that each step reads: "
                                       "a momentum buffer, or Adam's moments)"
                                       if stateful else ""), "")
                i += span
                continue
            return Training(_difference(opt, ref, step), "")
    if values:
        said = "each optimizer step applies the gradients of the same losses as the program meant"
        if merged:
            said += ("; the steps it merges into one leave the parameters as the program's "
                     f"{_count(merged)} did (within {TOLERANCE:g})")
        elif not diverged and exact:
            said += ", with the same values"
        if diverged:
            said += (f"; the gradients of {_module_of(diverged)} differ from the program's, "
                     f"as they must: {RETIMED[candidate.family]} changes them")
    else:
        said = ("each optimizer step applies the gradients of the same losses as the "
                "program's steps before the failure (a freed graph: no run of the program "
                "as meant to compare values with)")
    return Training(None, said, merged, diverged)


def _step_values(ref: dict[str, Any], step: dict[str, Any]) -> bool:
    """The gradients a step applies are the reference's: bitwise, or within the tolerance."""
    for key, v in step.items():
        r = ref.get(key)
        if r is None or not v["losses"]:
            continue
        if not (_same(r["grad"], v["grad"]) or _close(r["grad"], v["grad"])):
            return False
    return True


def _merge_span(refs: list[dict[str, Any]], i: int, step: dict[str, Any]) -> int:
    """How many consecutive reference steps from ``i`` ``step`` applies at once (0: none)."""
    want = _loss_sets(step)
    have: dict[str, list[str]] = {}
    for span in range(1, len(refs) - i + 1):
        for k, v in _loss_sets(refs[i + span - 1]).items():
            have[k] = sorted(have.get(k, []) + v)
        if span > 1 and {k: sorted(v) for k, v in want.items()} == have:
            return span
    return 0


def _merge_values(refs: list[dict[str, Any]], step: dict[str, Any]) -> bool:
    """The merged step's update is the sum of the reference's: within the tolerance,
    and within what rounding the parameter itself allows (an update is a difference
    of two parameters: a few ulps of the parameter each, not of the update)."""
    for key, v in step.items():
        parts = [r[key]["update"] for r in refs if key in r]
        if not parts or v["update"] is None:
            continue
        after = v.get("after") or {}
        eps = _EPS.get(str(after.get("dtype", "")), 2.0 ** -23)
        if not _close(_summed(parts), v["update"],
                      scale=8 * eps * float(after.get("norm", 0.0)) / TOLERANCE):
            return False
    return True


_EPS = {"torch.float64": 2.0 ** -52, "torch.float32": 2.0 ** -23,
        "torch.bfloat16": 2.0 ** -7, "torch.float16": 2.0 ** -10}


def _count(n: int) -> str:
    return {2: "two", 3: "three", 4: "four"}.get(n, str(n))



def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _recount(opt: str, ref: dict[str, Any], mine: dict[str, Any]) -> str:
    """The same losses, applied another number of times (a ``.grad`` not zeroed as before)."""
    from collections import Counter

    for key in sorted(set(ref) | set(mine)):
        had = Counter(ref.get(key, {}).get("losses", []))
        now = Counter(mine.get(key, {}).get("losses", []))
        for loss in sorted(set(had) | set(now)):
            if had[loss] != now[loss]:
                keys = [k for k in sorted(set(ref) | set(mine))
                        if Counter(ref.get(k, {}).get("losses", []))[loss] == had[loss]
                        and Counter(mine.get(k, {}).get("losses", []))[loss] == now[loss]]
                return (f"`{opt}.step()` would apply `{loss}`'s gradient to {_module_of(keys)} "
                        f"{_times(now[loss])} where the program's step applies it "
                        f"{_times(had[loss])} (its `.grad` is zeroed at other places)")
    return f"`{opt}.step()` applies another gradient than the program's"
