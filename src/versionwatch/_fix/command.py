"""``versionwatch fix``: the fix as a patch of the user's own lines, checked by running it.

1. The program runs once in strict mode (a child process) up to its first
   hazard: the report gives the facts (:func:`versionwatch._candidates.facts.from_report`)
   and the run records the losses, gradients and reach of every backward
   before it.
2. :func:`versionwatch._candidates.edits.propose` builds candidate edits of the
   user's lines from those facts.
3. Each candidate is checked by running the patched program
   (:mod:`versionwatch._fix.check`): verified ones are printed first, as
   unified diffs; the rejected ones after, with why.

The program runs once more per candidate (and once more, unwatched, to get the
gradients of the failing backward when a candidate claims to keep the values),
with its side effects. Nothing of the user's is written but by ``--apply``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from types import FrameType
from typing import Any

from versionwatch._candidates import (
    Candidate,
    FixFacts,
    Line,
    Sources,
    backward_after,
    propose,
    shown,
    shown_at,
)
from versionwatch._fix.apply import apply_patch
from versionwatch._fix.check import Flight, Run, judge, run_child, usable, write_scratch
from versionwatch._fix.notebook import (
    Notebook,
    NotebookError,
    is_notebook,
    patched_text,
    read_notebook,
)
from versionwatch._fix.server import ForkServer
from versionwatch._fix.workspace import Workspace
from versionwatch._report import Fix, Report

USAGE = ("versionwatch fix [--check-steps N] [--timeout SECONDS] [--jobs N] [--fresh] "
         "[--in-place] [--apply [--force]] [--json PATH] [--facts PATH] "
         "(SCRIPT | -m MODULE | -c CODE | -) [ARGS...]")
# Backwards recorded in full (losses, reach) and with their gradients.
_RECORD_UPTO = 1000
_GRADS_UPTO = 8


@dataclass
class FixResult:
    """What ``versionwatch fix`` found and did.

    Attributes:
        status: ``"no_hazard"``, ``"not_ours"`` (the program failed otherwise),
            ``"too_big"`` (the folders to copy for each run are too big: nothing ran),
            ``"unchecked"`` (a program that is not a file: patches as text),
            or ``"checked"``.
        exit_code: the command's exit status.
        original: the first run, up to the failure.
        facts: the facts the candidates were made from.
        candidates: verified first, then the rest.
        applied: the candidate ``--apply`` wrote, if any.
        failing: the number of the backward that fails.
        notes: lines to print after the candidates.
        asked_at: where the program's ``check()``/``assert_backward_safe()``
            (or a watcher, at a write) found the hazard before the backward ran.
        report: the first run's :class:`~versionwatch.Report`, the hazard's
            ``fixes`` filled with the candidates (``None`` without a hazard).
    """

    status: str
    exit_code: int
    original: Run | None = None
    facts: FixFacts | None = None
    candidates: list[Candidate] = field(default_factory=list)
    applied: Candidate | None = None
    failing: int = 0
    check_steps: int = 3
    notes: list[str] = field(default_factory=list)
    asked_at: Line | None = None
    report: Report | None = None

    @property
    def verified(self) -> list[Candidate]:
        return [c for c in self.candidates if c.verified]

    def fill_report(self) -> None:
        """``report``: the first run's report, its first hazard's ``fixes`` the candidates."""
        report = self.original.report_object() if self.original is not None else None
        if report is not None and report.hazards:
            report.hazards[0].fixes = [Fix(**c.to_dict()) for c in self.candidates]
        self.report = report


class Interrupted(KeyboardInterrupt):
    """``fix()`` was interrupted (Ctrl-C; SIGTERM under ``versionwatch fix``).

    Raised once every run in flight has ended and every temporary file is gone.
    ``stopped``: how many runs were stopped; ``signum``: the signal.
    """

    def __init__(self, stopped: int = 0, signum: int = signal.SIGINT) -> None:
        super().__init__(stopped, signum)
        self.stopped, self.signum = stopped, signum


def _program_file(program: list[str]) -> str | None:
    """The main script's path, or ``None`` for ``-m``/``-c``/stdin."""
    if program[0] in ("-m", "-c"):
        return None
    return os.path.join(os.getcwd(), program[0])


def fix(program: Sequence[str], *, facts: FixFacts | None = None, check_steps: int = 3,
        timeout: float = 120.0, jobs: int = 1, fresh: bool = False,
        sources: dict[str, str] | None = None, server: ForkServer | None = None,
        in_place: bool = False, progress: Callable[[str], None] | None = None) -> FixResult:
    """Find the first hazard of ``program``, propose patches, and check each one.

    What ``versionwatch fix`` does, without printing or writing anything:
    ``result.report.hazards[0].fixes`` holds the patches (verified first),
    ``result.verified`` the verified ones; :func:`apply_patch` writes one.

    Args:
        program: ``["script.py", ARGS...]``, ``["-m", "pkg.mod", ARGS...]`` or
            ``["-c", CODE, ARGS...]``, run in the current working directory; a
            notebook (``["nb.ipynb"]``) runs its code cells in order, each cell one
            of the program's files (:class:`NotebookError` if it cannot be read).
        facts: the facts to propose from (default: the strict run's report).
        check_steps: how many backwards past the failing one a check runs.
        timeout: seconds each run may take.
        jobs: how many checks run at once.
        fresh: run each run in a new interpreter rather than a fork of one
            that imported torch (for a program that sets torch's environment
            up before importing it).
        sources: source text of files that are not on disk (``"<string>"``).
        server: the fork server to run on (default: one of its own, where
            ``os.fork`` exists; one for many calls saves its start-up).
        in_place: run every run in the working directory itself, with the
            program's side effects there (default: each run in a fresh copy of
            the working folder, and of the script's folder when it is
            elsewhere; refused, status ``"too_big"``, over
            :data:`~versionwatch._fix.workspace.LIMIT_BYTES`).
        progress: called with a line before the first run (where the runs
            happen) and once the patches are known (how many more runs);
            ``versionwatch fix`` prints them to stderr.

    Example:
        >>> import versionwatch
        >>> result = versionwatch.fix(["train.py"])           # doctest: +SKIP
        >>> print(result.report.hazards[0].fixes[0].diff)     # doctest: +SKIP
    """
    program = list(program)
    if not program or not all(isinstance(a, str) for a in program):
        raise TypeError("fix() takes the program as a list of strings: "
                        "['train.py', ARGS...], ['-m', 'pkg.mod', ...] or ['-c', CODE, ...]")
    if program[0] not in ("-m", "-c") and is_notebook(program[0]):
        # A notebook's cells are the program's files, none of them on disk.
        sources = {**read_notebook(program[0]).sources(), **(sources or {})}
    workspace = Workspace.for_program(program, in_place)
    problem = workspace.plan()
    if problem is not None:
        return FixResult("too_big", 2, notes=[problem])
    say = progress or (lambda line: None)
    own = server is None and not fresh and hasattr(os, "fork")
    flight = Flight()
    try:
        if own:
            server = ForkServer()
        workspace.open()  # the snapshot, before the first run, where describe() names it
        say(workspace.describe())
        result = _fix(program, facts, check_steps, timeout, jobs, sources, server, workspace,
                      say, flight)
        result.fill_report()
        return result
    except KeyboardInterrupt as e:
        # Ctrl-C (or SIGTERM, as the command turns it into one): every run in
        # flight ends now, not at its time limit, before its folder goes.
        raise Interrupted(flight.stop(), getattr(e, "signum", signal.SIGINT)) from None
    finally:
        flight.stop()
        if own and server is not None:
            server.close()  # what still runs on it is killed
        workspace.close()


def _fix(program: list[str], facts: FixFacts | None, check_steps: int, timeout: float,
         jobs: int, sources: dict[str, str] | None, server: ForkServer | None,
         workspace: Workspace, say: Callable[[str], None], flight: Flight) -> FixResult:
    def run(**kw: Any) -> Run:
        # Each run in its own fresh copy of the user's folders, as they were at the start.
        place = workspace.fresh()
        own = "workdir" not in kw
        if own:
            kw["workdir"] = workspace.temp()
        try:
            return run_child(program, timeout=timeout, server=server, ledger=True, where=place,
                             flight=flight, **kw)
        finally:
            workspace.done(place)
            if own:
                shutil.rmtree(kw["workdir"], ignore_errors=True)

    original = run(watch="strict", record_upto=_RECORD_UPTO, grads_upto=_GRADS_UPTO)
    if original.status in ("completed", "stopped") or (
            original.status == "exited" and not original.exit):
        return FixResult("no_hazard", 0, original)
    if original.status != "failed" or not original.ours:
        return FixResult("not_ours", original.exit or 1, original)
    failing = original.failed_at or 0
    if facts is None:
        facts = _facts_of(original)
    texts = dict(sources or {})
    if program[0] == "-c":
        texts.setdefault("<string>", program[1])
    asked_at = None
    rec = original.record(failing)
    if rec and rec.get("before") and rec.get("site"):
        # Found before the backward ran: the backward it asked about is the one.
        asked_at = Line(rec["site"][0], int(rec["site"][1]))
        if facts.failing_backward is None:
            asked = _backward_asked(asked_at, Sources({**facts.sources, **texts}))
            if asked is not None:
                facts = replace(facts, failing_backward=asked)
                rec["site"] = [asked.file, asked.line, False]
    if facts.failing_backward is None:
        rec = original.record(failing)
        if rec and rec.get("site"):
            facts = replace(facts, failing_backward=Line(rec["site"][0], int(rec["site"][1])))
    candidates = propose(replace(facts, sources={**facts.sources, **texts}),
                         Sources({**facts.sources, **texts}), main=_program_file(program))
    # Two families can write the same patch: it is checked, and shown, once.
    seen: set[tuple[tuple[str, str], ...]] = set()
    unique = []
    for c in candidates:
        key = tuple(sorted((path, new) for path, (_, new) in c.files.items()))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    candidates = unique
    result = FixResult("checked", 1, original, facts, candidates, failing=failing,
                       check_steps=check_steps, asked_at=asked_at)
    if program[0] == "-c" or any(p.startswith("<") for c in candidates for p in c.files):
        result.status = "unchecked"
        result.notes.append("not checked: the program is not a file that can be run again "
                            "with a patch; these patches are text only")
        return result
    n = len(candidates)
    # The program as meant is one run, or two where strict mode's repair cannot
    # keep what was saved; a freed graph has none.
    runs = f"{n} more run(s) (one per patch)" if facts.kind == "freed" else (
        f"{n + 1} or {n + 2} more run(s) (the program as meant, then one per patch)")
    say(f"{n} patch(es) to check: {runs}, each up to backward #{failing + check_steps}")
    meant = _meant(facts, failing, check_steps, run)

    # A silent write through .data is seen in strict mode only: check in the mode
    # that saw the hazard.
    mode = "strict" if facts.kind == "silent" else "default"

    def check(c: Candidate) -> None:
        folder = workspace.temp()
        try:
            scratch = write_scratch(c, folder)
            done = run(scratch=scratch, watch=mode, stop_after=failing + check_steps,
                       record_upto=failing + check_steps,
                       grads_upto=min(failing, _GRADS_UPTO), workdir=folder)
            judge(c, done, original, meant, failing, check_steps, timeout)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    if jobs > 1 and len(candidates) > 1:
        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            list(pool.map(check, candidates))
        except BaseException:
            flight.stop()  # the checks in flight end now, not at their time limit
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        for c in candidates:
            check(c)
    candidates = _refresh_order(candidates, original, failing)
    # Verified first: those that keep the program's steps and values, then those
    # that merge steps, then a forward re-run (values differ behind it).
    rank = {"same": 0, "merged": 1, "refreshed": 2}
    result.candidates = sorted([c for c in candidates if c.verified],
                               key=lambda c: (rank.get(c.extra.get("training", "same"), 0),
                                              c.family == "refresh")) + \
        [c for c in candidates if not c.verified]
    return result


def _meant(facts: FixFacts, failing: int, check_steps: int,
           run: Callable[..., Run]) -> Run | None:
    """The program as its author meant it: each backward sees what its forward saved.

    Strict mode's repair keeps a copy of every saved tensor a write would change
    (a silent ``.data`` write or a fused step included); where it cannot,
    ``allow_mutation_on_saved_tensors()`` is the second try. A freed graph has
    no such run: ``None`` then, and the check compares structure only.
    """
    if facts.kind == "freed":
        return None
    runs = (dict(watch="strict", on_hazard="repair"), dict(watch="none", allow_mutation=True))
    for how in runs:
        done = run(stop_after=failing + check_steps, record_upto=failing + check_steps,
                   grads_at=(failing,), watch=str(how["watch"]),
                   on_hazard=str(how.get("on_hazard", "raise")),
                   allow_mutation=bool(how.get("allow_mutation", False)))
        if usable(done, failing):
            return done
    return None


def _refresh_order(candidates: list[Candidate], original: Run, failing: int) -> list[Candidate]:
    """The forward again after the step (``refresh``) first when the failing backward
    trains parameters that step did not (a GAN's generator loss through D after
    opt_d.step()); after the merged step and the summed losses when the step
    changed all it reaches (two losses of one model: one step for both is meant)."""
    refresh = [c for c in candidates if c.family == "refresh"]
    rec = original.record(failing)
    if not refresh or rec is None or not rec.get("reach"):
        return candidates
    stepped = {p for st in original.steps if st["after"] == failing - 1 for p in st["params"]}
    rest = [c for c in candidates if c.family != "refresh"]
    if set(rec["reach"]) - stepped:
        return refresh + rest
    at = max((i + 1 for i, c in enumerate(rest) if c.family in ("move_step", "sum_losses")),
             default=0)
    return rest[:at] + refresh + rest[at:]


def _backward_asked(asked_at: Line, sources: Sources) -> Line | None:
    """The backward that a ``check()`` at ``asked_at`` asked about, from the source."""
    src = sources.at(asked_at)
    stmt = backward_after(src, asked_at.line) if src is not None else None
    if src is None or stmt is None:
        return None
    return Line(asked_at.file, stmt.lineno, src.line_text(stmt.lineno).strip())


def _facts_file(path: str) -> FixFacts:
    """``--facts PATH``: the facts a ``--json`` document's ``fix`` section holds; a file
    that is not such facts is a usage error, in one line."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise _Usage(f"--facts {path}: cannot read it: {e.strerror or e}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise _Usage(f"--facts {path}: nested too deeply to be facts") from None
    except ValueError as e:
        raise _Usage(f"--facts {path}: not JSON: {e}") from None
    problem = _facts_problem(data)
    if problem is not None:
        raise _Usage(f"--facts {path}: {problem}")
    try:
        return FixFacts.from_dict(data)
    except (ValueError, KeyError, TypeError) as e:
        raise _Usage(f"--facts {path}: {e}") from None


def _facts_problem(data: Any) -> str | None:
    """What in ``data`` does not fit :class:`FixFacts`' fields, or ``None``; checked here,
    as ``from_dict`` trusts the types of what the program's own run wrote."""
    if not isinstance(data, dict):
        return f"the facts are {type(data).__name__}, not a JSON object"
    # The fields' annotations, as written (``Line | None``, ``tuple[Line, ...]``):
    # strings, which Python 3.9 cannot evaluate.
    hints = {f.name: str(f.type) for f in fields(FixFacts)}
    for name, value in data.items():
        hint = hints.get(name)
        if hint is None or value is None:
            continue  # an unknown fact: from_dict names it
        if hint.startswith("Line"):
            lines, what = [value], "a line ({file, line})"
        elif hint.startswith("tuple[Line"):
            lines, what = value, "a list of lines ({file, line})"
            if not isinstance(value, list):
                return f"fact {name} is not {what}"
        elif name == "sources":
            if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
                return f"fact {name} is not an object of file names and their text"
            continue
        else:
            if not isinstance(value, str):
                return f"fact {name} is {type(value).__name__}, not a string"
            continue
        for line in lines:
            if not (isinstance(line, dict) and isinstance(line.get("file"), str)
                    and type(line.get("line")) is int
                    and isinstance(line.get("code", ""), (str, type(None)))):
                return f"fact {name} is not {what}"
    return None


def _facts_of(run: Run) -> FixFacts:
    if run.facts:
        return FixFacts.from_dict(run.facts)
    kind = (run.hazard or {}).get("kind", "inplace")
    return FixFacts(kind=kind)


def unchecked(report: Report, main: str | None = None) -> list[Fix]:
    """The patches ``versionwatch fix`` would check for ``report``'s first hazard, unchecked.

    Made in this process from the report alone (no run): for an integration that
    has a report in hand (the Lightning callback). ``main``: the program's main
    script, searched for in-place modules. Each one's ``why`` says how to check it.
    """
    from versionwatch._candidates import from_report

    if not report.hazards:
        return []
    program = shown(main) if main else "SCRIPT"
    out = []
    for c in propose(from_report(report), main=main):
        c.why = c.hides or (f"not checked: `versionwatch fix {program}` checks it by running "
                            "the patched program")
        out.append(Fix(**c.to_dict()))
    return out


# -- output ---------------------------------------------------------------------------

def render(result: FixResult) -> str:
    """The text ``versionwatch fix`` prints: verified diffs first, then the rejected ones."""
    original = result.original
    if result.status == "too_big":
        return f"versionwatch fix: error: {result.notes[0]}"
    unfollowed = [f"versionwatch fix: {note}" for note in not_followed(result)]
    if result.status == "no_hazard":
        n = original.backwards if original else 0
        if not unfollowed:
            return f"versionwatch fix: no hazard ({n} backward(s) ran); nothing to fix"
        where = " in the main process" if original and original.forks else ""
        return "\n".join([f"versionwatch fix: no hazard seen ({n} backward(s) ran{where}), "
                          "but versionwatch fix did not follow all the program did:",
                          *unfollowed])
    if result.status == "not_ours":
        what = original.error if original and original.error else "an error"
        where = ""
        if original and original.error_site:
            where = f" at {shown_at(original.error_site[0], original.error_site[1])}"
        if original and original.status in ("exited", "died"):
            what = f"exit status {original.exit}"
        if original and original.status == "timeout":
            what = "a time-out"
        return "\n".join([f"versionwatch fix: the program ended with {what}{where}, not a "
                          "failure versionwatch fixes; nothing changed", *unfollowed])
    out = []
    head = (original.text.splitlines()[0] if original and original.text else "").removeprefix(
        "versionwatch: ")
    rec = original.record(result.failing) if original else None
    at = f" at {shown_at(rec['site'][0], rec['site'][1])}" if rec and rec.get("site") else ""
    if result.asked_at is not None:
        at += f" (found before it ran, at {result.asked_at})"
    out.append(f"versionwatch fix: backward #{result.failing}{at}: {head}")
    cands = result.candidates
    if not cands:
        out.append("versionwatch fix: no patch found for this failure; the report's fix:")
        fix_line = next((ln.strip() for ln in (original.text if original else "").splitlines()
                         if ln.strip().startswith("fix ")), "")
        if fix_line:
            out.append("  " + fix_line)
        return "\n".join(out + unfollowed)
    if result.status == "unchecked":
        out.append(f"versionwatch fix: {len(cands)} candidate patch(es), not checked")
        for note in result.notes:
            out.append(f"versionwatch fix: {note}")
        for c in cands:
            out.append("")
            out.append(f"unchecked: {c.summary}")
            out.append(c.diff.rstrip("\n"))
        return "\n".join(out)
    verified = result.verified
    out.append(f"versionwatch fix: {len(cands)} candidate patch(es), {len(verified)} verified "
               f"(each checked by running the patched program to {result.check_steps} "
               f"backward(s) past #{result.failing})")
    for c in verified:
        out.append("")
        out.append(f"verified: {c.summary}")
        out.append(f"  {c.why}")
        out.append(c.diff.rstrip("\n"))
    rejected = [c for c in cands if not c.verified]
    if rejected:
        out.append("")
        out.append("rejected:")
        for c in rejected:
            out.append(f"  {c.family} at {shown_at(c.file, c.line)}: {_head(c)}")
            out.append(f"    {c.why}")
    if result.applied is not None:
        out.append("")
        out.append(f"versionwatch fix: applied the first verified patch to "
                   f"{', '.join(shown(p) for p in result.applied.files)}")
    out.extend(f"versionwatch fix: {note}" for note in result.notes)
    return "\n".join(out + unfollowed)


def not_followed(result: FixResult) -> list[str]:
    """What of the program its runs did not follow, each said as a note: a result
    without them would claim what the runs did not see."""
    original = result.original
    if original is None:
        return []
    out = []
    if original.forks:
        out.append(f"the program ran backwards in {original.forks} forked process(es), which "
                   "versionwatch fix does not follow: they were not checked; run the training "
                   "in the main process to check it")
    if original.stdin_read:
        out.append("the program read its standard input, which versionwatch fix does not "
                   "pass to the program's runs (each reads an empty one); give the program "
                   "its input as a file to check the training on it")
    rec = original.record(result.failing) if result.failing else None
    cands = result.candidates
    if rec and rec.get("thread") and (not cands or not all(c.verified for c in cands)):
        out.append(f"backward #{result.failing} ran on thread {rec['thread']!r}: the check "
                   "runs the program as meant (each backward with what its forward saved) "
                   "on the main thread only, so a patch that changes the training is "
                   "compared with the failing run instead; run the training on the main "
                   "thread to check such patches")
    return out


def apply_to_notebook(notebook: Notebook, candidate: Candidate, force: bool,
                      notes: list[str]) -> str | None:
    """``--apply`` of a patch of a notebook's cells: the cells' ``source`` strings edited
    in the file's own text (every other byte kept), written as :func:`apply_patch`
    writes a file (its checks, atomically); ``None`` when done, else why not."""
    try:
        now = read_notebook(notebook.path)  # as it is now, not as it was at the start
        if now.text != notebook.text:
            return f"{shown(notebook.path)} changed since the run; run versionwatch fix again"
        text = patched_text(now, candidate.files)
    except NotebookError as e:
        return str(e)
    whole = replace(candidate, files={os.path.abspath(notebook.path): (now.text, text)})
    return apply_patch(whole, force=force, notes=notes)


def _head(c: Candidate) -> str:
    """What a rejected candidate changes, in a few words: its summary's first clause
    (a move's old and new lines are the same text, so they would say nothing)."""
    head = c.summary.split(": ", 1)[0]
    return head if len(head) <= 120 else head[:117] + "..."


def to_json(result: FixResult, target: str | None) -> dict[str, Any]:
    """The run's document (schema ``versionwatch.report/1``) with the candidates in it."""
    from versionwatch._report import SCHEMA

    original = result.original
    report = (original.report if original else None) or {}
    hazards = [dict(h) for h in report.get("hazards") or []]
    fixes = [c.to_dict() for c in result.candidates]
    if hazards:
        hazards[0]["fixes"] = fixes
    return {
        "schema": SCHEMA,
        "ok": result.status == "no_hazard",
        "hazards": hazards,
        "unverifiable": report.get("unverifiable", []),
        "target": target,
        "exit_status": result.exit_code,
        "exception": original.error if original else None,
        "fix": {
            "status": result.status,
            "failing_backward": result.failing or None,
            "check_steps": result.check_steps,
            "facts": result.facts.to_dict() if result.facts else None,
            "candidates": fixes,
            "applied": None if result.applied is None else {
                "file": shown(result.applied.file), "line": result.applied.line},
            "notes": [*result.notes, *not_followed(result)],
        },
    }


# -- the command ---------------------------------------------------------------------

def help_parser() -> argparse.ArgumentParser:
    """``versionwatch fix``'s options, for ``--help`` and for :func:`_parse`'s two sets.

    ``_parse`` reads the command line itself (the first ``SCRIPT``, ``-m``, ``-c`` or
    ``-`` ends our options, as it ends python's, and its errors are one line): this
    parser only says what each option does, and which ones take a value.
    """
    p = argparse.ArgumentParser(
        prog="versionwatch fix",
        usage=USAGE.replace("versionwatch fix ", "%(prog)s ", 1),
        description="Run the program in strict mode up to its first hazard, write candidate "
        "patches of your own lines, and check each one by running the patched program (each "
        "run in a fresh copy of your folder). A patch is verified when the hazard is gone and "
        "every optimizer step applies the gradients of the same losses, with the same values, "
        "as the program as you meant it. Verified patches are printed first, as diffs you can "
        "`git apply`; rejected ones after, with why.",
        epilog="versionwatch's options go before SCRIPT (or -m MODULE, -c CODE, -): everything "
        "after it belongs to the program, as with python; `--` ends the options. Exit status: "
        "0 without a hazard or when --apply wrote a verified patch; 1 when the program has a "
        "hazard and nothing was applied; the program's own status when it failed otherwise; "
        "2 for a bad invocation. Details: docs/fix.md.",
    )
    p.add_argument("--check-steps", type=int, default=3, metavar="N",
                   help="run each patched program this many backwards past the failing one "
                   "(default: 3)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="stop each run of the program after this long, cleanup included "
                   "(default: 120, at most a week)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="check up to N patches at once, each in a process of its own "
                   "(default: 1; more uses more cores and memory)")
    p.add_argument("--fresh", action="store_true",
                   help="start each run in a new interpreter rather than a fork of one that "
                   "imported torch: for a program that sets torch's environment up "
                   "(OMP_NUM_THREADS, TORCH_LOGS) before importing it; slower")
    p.add_argument("--in-place", action="store_true",
                   help="run every run in your own folder instead of a fresh copy of it "
                   "(the program's side effects land there; for a folder over 256 MB or "
                   "20,000 files, which is not copied)")
    p.add_argument("--apply", action="store_true",
                   help="write the first verified patch to your file, keeping its encoding, "
                   "line endings, mode and links")
    p.add_argument("--force", action="store_true",
                   help="with --apply: write a read-only file too (it stays read-only)")
    p.add_argument("--json", metavar="PATH",
                   help="write the run's JSON document (the hazard, its patches, the facts "
                   "used) to PATH")
    p.add_argument("--facts", metavar="PATH",
                   help="propose patches from facts saved as JSON (the `fix` section's "
                   "`facts` of a --json document) instead of the strict run's report")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                   help="the program, as python takes it: SCRIPT ARGS..., -m MODULE ARGS..., "
                   "-c CODE ARGS..., or - (the script on standard input)")
    return p


_OPTIONS = [a for a in help_parser()._actions if a.option_strings]
_VALUED = {o for a in _OPTIONS if a.nargs != 0 for o in a.option_strings}
_FLAGS = {o for a in _OPTIONS if a.nargs == 0 for o in a.option_strings}


# A run's time limit at most: a week (a limit past what a wait can wait is none).
_MAX_TIMEOUT = 7 * 24 * 3600.0


class _Usage(Exception):
    pass


def _parse(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    opts: dict[str, Any] = {"check_steps": 3, "timeout": 120.0, "jobs": 1, "apply": False,
                            "force": False, "fresh": False, "in_place": False,
                            "json": None, "facts": None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg == "--":
            return opts, list(argv[i + 1:])
        if arg in ("-h", "--help"):
            opts["help"] = True
            return opts, []
        if arg in _FLAGS:  # --apply, --force, --fresh, --in-place
            opts[arg[2:].replace("-", "_")] = True
            i += 1
            continue
        if arg in ("-m", "-c"):
            if i + 1 >= len(argv):
                raise _Usage(f"{arg} needs an argument")
            return opts, [arg, *argv[i + 1:]]
        if name in _VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise _Usage(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            key = name[2:].replace("-", "_")
            if key in ("check_steps", "jobs"):
                if not value.isdigit() or (key == "jobs" and int(value) < 1):
                    raise _Usage(f"{name} takes a whole number, not {value!r}")
                opts[key] = int(value)
            elif key == "timeout":
                try:
                    opts[key] = float(value)
                except ValueError:
                    raise _Usage(f"{name} takes seconds, not {value!r}") from None
                if not 0 < opts[key] <= _MAX_TIMEOUT:  # nan, inf: no time limit at all
                    raise _Usage(f"{name} takes a positive number of seconds, at most "
                                 f"{_MAX_TIMEOUT:.0f} (a week), not {value!r}")
            else:
                opts[key] = value
            i += 1
            continue
        if arg.startswith("-") and arg != "-":
            raise _Usage(f"unknown option {arg}")
        return opts, list(argv[i:])
    return opts, []


@contextlib.contextmanager
def _interruptible() -> Iterator[Callable[[], None]]:
    """Ctrl-C and SIGTERM raise :class:`Interrupted` (the one call's, on the main thread).

    A second signal while the first one's cleanup runs is ignored: the runs are
    being stopped. The context's value disarms it: once ``fix()`` has returned,
    what is left (printing, ``--apply``, ``--json``) takes moments, and is not
    cut half-written.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    armed = [True]

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            raise Interrupted(0, signum)

    def disarm() -> None:
        armed[0] = False

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield disarm
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str], *, server: ForkServer | None = None) -> int:
    """``versionwatch fix ...``: returns the exit status.

    ``server``: a fork server to run on (tests share one); ``--fresh`` ignores it.
    Ctrl-C or SIGTERM stops every run, removes every temporary file, says so in
    one line and returns 130 or 143 (128 + the signal), nothing written.
    """
    try:
        with _interruptible() as disarm:
            return _main(argv, server, disarm)
    except KeyboardInterrupt as e:
        stopped = e.stopped if isinstance(e, Interrupted) else 0
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        runs = "check run" if stopped == 1 else "check runs"
        print(f"versionwatch fix: interrupted; {stopped} {runs} stopped, nothing written",
              file=sys.stderr)
        return 128 + signum


def _main(argv: Sequence[str], server: ForkServer | None, disarm: Callable[[], None]) -> int:
    try:
        opts, program = _parse(argv)
        if opts.get("help"):
            help_parser().print_help()
            return 0
        if opts["force"] and not opts["apply"]:
            raise _Usage("--force goes with --apply (it writes a read-only file)")
        if not program:
            raise _Usage("give a SCRIPT, -m MODULE, -c CODE or - (the program on stdin)")
        sources: dict[str, str] = {}
        if program[0] == "-":
            code = sys.stdin.read()
            program = ["-c", code, *program[1:]]
            sources["<string>"] = code
        elif program[0] not in ("-m", "-c") and not os.path.isfile(program[0]):
            raise _Usage(f"can't open file {program[0]!r}: no such file")
        notebook = None
        if program[0] not in ("-m", "-c") and is_notebook(program[0]):
            try:  # before anything runs: a bad notebook is bad input
                notebook = read_notebook(program[0])
            except NotebookError as e:
                print(f"versionwatch fix: error: {e}", file=sys.stderr)
                return 2
            for note in notebook.notes:
                print(note, file=sys.stderr)
            notebook.register()  # this process's output names cells too
        facts = _facts_file(opts["facts"]) if opts["facts"] else None
    except _Usage as e:
        print(f"versionwatch fix: error: {e} (versionwatch fix --help)", file=sys.stderr)
        return 2
    result = fix(program, facts=facts, check_steps=opts["check_steps"],
                 timeout=opts["timeout"], jobs=opts["jobs"], fresh=opts["fresh"],
                 sources=sources, server=None if opts["fresh"] else server,
                 in_place=opts["in_place"],
                 progress=lambda line: print(f"versionwatch fix: {line}", file=sys.stderr,
                                             flush=True))
    disarm()
    if opts["apply"] and result.status == "checked":
        if result.verified:
            problem = (apply_to_notebook(notebook, result.verified[0], opts["force"],
                                         result.notes) if notebook is not None
                       else apply_patch(result.verified[0], force=opts["force"],
                                        notes=result.notes))
            if problem is None:
                result.applied = result.verified[0]
                result.exit_code = 0
            else:
                result.notes.append(f"--apply: nothing written: {problem}")
        else:
            result.notes.append("--apply: nothing written: no patch was verified")
    text = render(result)
    if result.status == "not_ours" and result.original is not None and result.original.trace:
        print(result.original.trace.rstrip("\n"), file=sys.stderr)  # as the program says it
    print(text, file=sys.stderr if result.status in ("no_hazard", "not_ours", "too_big")
          else sys.stdout)
    if opts["json"]:
        target = program[1] if program[0] == "-m" else (
            "-c" if program[0] == "-c" else program[0])
        try:
            with open(opts["json"], "w", encoding="utf-8") as f:
                json.dump(to_json(result, target), f, indent=2)
                f.write("\n")
        except OSError as e:
            print(f"versionwatch fix: error: cannot write --json {opts['json']}: "
                  f"{e.strerror or e}", file=sys.stderr)
    return result.exit_code
