"""Checking a candidate: run the patched program and judge what it did.

A check runs the program again in a child (:mod:`versionwatch._fix.child`)
with the candidate's files taken from scratch copies, under default mode, up to
``check_steps`` backwards past the one that failed (or to its end), within a
time limit. The candidate is **verified** when

* the hazard is gone, and no other error, hazard or non-zero exit came up;
* no backward reaches a parameter through a forward made before an optimizer
  step changed that parameter (a stale gradient: the failure hidden, not fixed,
  as ``zero_grad(set_to_none=True)`` hides the seed story's);
* where the patched program runs the same backwards, each one reaches every
  parameter the original's did, except where the candidate cuts a path on
  purpose (``D(fake.detach())`` in the discriminator's loss): a fix must not
  stop a gradient the program trains with.

For a candidate that claims to keep the values, the losses and the gradients
after each backward up to the failing one are compared with the original run's,
bitwise: before the failure from the original run itself; at the failing
backward of an in-place write, from a run of the original under
``torch.autograd.graph.allow_mutation_on_saved_tensors()`` (the values the
program meant: every saved tensor as it was saved).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from versionwatch._candidates import Candidate, line_map, shown
from versionwatch._fix.server import ForkServer
from versionwatch._process import end, environment, start, wait
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


def run_child(program: list[str], *, scratch: dict[str, str] | None = None,
              watch: str = "default", allow_mutation: bool = False,
              stop_after: int | None = None, record_upto: int = 0, grads_upto: int = 0,
              grads_at: tuple[int, ...] = (), timeout: float = 120.0,
              workdir: str | None = None, server: ForkServer | None = None) -> Run:
    """Run ``program`` (``["script.py", ...]``, ``["-m", mod, ...]``, ``["-c", code, ...]``)."""
    own = workdir is None
    folder = workdir or tempfile.mkdtemp(prefix="versionwatch-fix-")
    try:
        fd, spec_path = tempfile.mkstemp(dir=folder, suffix=".json")
        out = spec_path[:-5] + ".pt"
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"argv": program, "scratch": scratch or {}, "watch": watch,
                       "allow_mutation": allow_mutation, "stop_after": stop_after,
                       "record_upto": record_upto, "grads_upto": grads_upto,
                       "grads_at": list(grads_at), "out": out, "cwd": os.getcwd()}, f)
        err_path = spec_path[:-5] + ".err"
        began = time.monotonic()
        answer = server.run(spec_path, err_path, timeout) if server is not None else None
        if answer is not None:
            code, timed_out = answer
        else:
            with open(err_path, "wb") as err:
                proc = start([sys.executable, "-m", "versionwatch._fix.child", spec_path],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             env=environment())
                try:
                    timed_out = not wait(proc, timeout)
                finally:
                    # The child and whatever it started (its own group), and reaped.
                    code = end(proc)
        seconds = time.monotonic() - began
        stderr = ""
        if os.path.exists(err_path):
            with open(err_path, "rb") as f:
                stderr = f.read().decode(errors="replace")
        if timed_out:
            return Run("timeout", exit=-1, stderr=stderr, seconds=seconds)
        if not os.path.exists(out):
            return Run("died", exit=code, stderr=stderr, seconds=seconds)
        import torch

        data = torch.load(out, weights_only=True)
        keys = Run.__dataclass_fields__
        run = Run(**{k: v for k, v in data.items() if k in keys})
        run.stderr, run.seconds = stderr, seconds
        return run
    finally:
        if own:
            _rmtree(folder)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def write_scratch(candidate: Candidate, folder: str) -> dict[str, str]:
    """Write the candidate's new files under ``folder``: original path -> scratch path."""
    out = {}
    for i, (path, (_, new)) in enumerate(candidate.files.items()):
        sub = os.path.join(folder, f"f{i}")
        os.makedirs(sub, exist_ok=True)
        scratch = os.path.join(sub, os.path.basename(path))
        with open(scratch, "w", encoding="utf-8") as f:
            f.write(new)
        out[path] = scratch
    return out


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
    return f"{shown(file)}:{line}"


def judge(candidate: Candidate, run: Run, original: Run, meant: Run | None,
          failing: int, steps: int, timeout: float) -> None:
    """Set ``candidate.verified``, ``keeps_values`` and ``why`` from its check ``run``."""
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
    # Gradients the program trains with.
    if candidate.same_backwards and not candidate.cut_any:
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
