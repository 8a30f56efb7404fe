"""``versionwatch run --replay``: the lines of strict mode at default mode's cost.

A default-mode run that predicts a failure knows the tensor, the node and the
backward, but not the lines: the op that saved the tensor and the write that
changed it. Replay runs the same command again in a child process in strict
mode, stops it at the same backward (by number), and merges what strict mode
saw into the first run's report, after checking that the child met the same
hazard there (same tensor, node and slot). The program runs twice, with its
side effects: the docs say so, and it is opt-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from versionwatch._report import Hazard, Modification, Report, Site

# The folder this versionwatch is imported from (resolved before any chdir).
_SOURCES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The child's own option: stop at backward N and write its report to PATH.
CHILD_OPTION = "--replay-child"


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


def run_child(command: list[str], backward: int, cwd: str,
              source: bytes | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run ``versionwatch run --strict`` on ``command`` up to ``backward``, in ``cwd``.

    ``cwd`` is where the first run started: the program may have changed its
    working directory since, and its command's paths are relative to where it began.
    ``source``: the script of ``versionwatch run -``, which the child reads from its
    standard input as the first run did.

    Returns the child's report at that backward (as JSON data; ``{"ok": True}``
    when it found none) or ``None``, and, if it ended otherwise, why.
    """
    fd, path = tempfile.mkstemp(prefix="versionwatch-replay-", suffix=".json")
    os.close(fd)
    try:
        argv = [sys.executable, "-m", "versionwatch", "run", "--strict", "--quiet",
                CHILD_OPTION, f"{backward}:{path}", "--", *command]
        if command[:1] == ["-m"]:  # `--` would make "-m" the script's name
            argv = [*argv[:argv.index("--")], *command]
        # This very versionwatch replays, wherever the program's folder puts
        # sys.path (a relative PYTHONPATH, another copy installed).
        env = dict(os.environ)
        here = _SOURCES
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        stdin = None if source is not None else subprocess.DEVNULL
        done = subprocess.run(argv, cwd=cwd, input=source, stdin=stdin,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              check=False)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if text:
                return json.loads(text), ""
        except (OSError, ValueError) as e:  # a child killed halfway through its write
            return None, f"ended (exit status {done.returncode}) with an unreadable report: {e}"
        said = done.stderr.decode(errors="replace").strip().splitlines()
        last = f": {said[-1]}" if said else ""
        return None, (f"ended (exit status {done.returncode}) before backward "
                      f"#{backward}{last}")
    finally:
        os.unlink(path)


def _same(h: Hazard, c: dict[str, Any]) -> bool:
    return (c.get("saved_by") == h.node and c.get("slot") == h.slot
            and c.get("tensor") == (h.tensor or h.describe_tensor()))


def _site(d: dict[str, Any] | None) -> Site | None:
    if not d or d.get("file") is None or d.get("line") is None:
        return None
    code = d.get("code") or _source_line(d["file"], d["line"])
    return Site(d["file"], d["line"], code)


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


def merge(report: Report, child: dict[str, Any] | None, why: str) -> None:
    """Fill ``report`` in with the child's lines, or say why it cannot be."""
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
        return
    c = hazards[0]
    if not _same(h, c):
        report.replay = (f"not reproduced: the strict replay met another hazard at backward "
                         f"#{n} ({c.get('saved_by')}.{c.get('slot')} on {c.get('tensor')}); the "
                         "program is not deterministic enough to replay, run it with --strict")
        return
    # The same hazard: strict mode's lines are this run's.
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
        if event is not None:
            writes.append(Modification(event.kind, event.description, site or event.site,
                                       event.versions))
        else:
            writes.append(Modification(m["kind"], m["description"], site, None))
    if writes:
        versions = [m.versions for m in h.modified_by if m.versions]
        if len(writes) == 1 and len(versions) == 1 and writes[0].versions is None:
            writes[0] = Modification(writes[0].kind, writes[0].description, writes[0].site,
                                     versions[0])
        h.modified_by = writes
    # The hints that point at --replay: it ran.
    h.notes = [note for note in h.notes if "`versionwatch run --replay ...`" not in note]
    report.replay = (f"the lines above come from a strict replay of the same command, "
                     f"which met the same hazard at backward #{n}")
