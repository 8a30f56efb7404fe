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
import subprocess
import sys
import tempfile
from dataclasses import replace
from typing import Any

from versionwatch._explain import fix_for
from versionwatch._report import Hazard, Modification, Report, Site, Writer

# The child's own option: stop at backward N and write its report to PATH.
CHILD_OPTION = "--replay-child"


def refusal() -> str | None:
    """Why replay cannot run here, or ``None``."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(world)
    except ValueError:
        size = 1
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


def run_child(command: list[str], backward: int) -> tuple[dict[str, Any] | None, str]:
    """Run ``versionwatch run --strict`` on ``command`` up to ``backward``.

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
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env, check=False)
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
    return Writer(d["module"], d.get("repr") or "", _site(d))


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
    c = _twin(h, hazards, n)
    if c is None:
        mine = _described({**_identity(h)})
        theirs = _described(hazards[0])
        report.replay = (f"not reproduced: the strict replay diverged at backward #{n}: this "
                         f"run's first hazard there is {mine}, the replay's is {theirs}; the "
                         "program is not deterministic enough to replay (seed it, fix its "
                         "data order), or run it with --strict")
        return
    _fill(h, c)
    # The other hazards of this backward, each with its own twin if the replay has one.
    for other in report.hazards[1:]:
        twin = _twin(other, hazards, n)
        if twin is not None:
            _fill(other, twin)
    report.replay = (f"the lines above come from a strict replay of the same command, "
                     f"which met the same hazard at backward #{n}")


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
                                       event.versions, writer=writer))
        else:
            writes.append(Modification(m["kind"], m["description"], site, None,
                                       writer=writer))
    if writes:
        versions = [m.versions for m in h.modified_by if m.versions]
        if len(writes) == 1 and len(versions) == 1 and writes[0].versions is None:
            writes[0] = replace(writes[0], versions=versions[0])
        h.modified_by = writes
    # Facts only strict mode knows.
    h.variable = h.variable or c.get("variable")
    h.compiled_forward = h.compiled_forward or _site(c.get("compiled_forward"))
    # The hints that point at --replay: it ran.
    h.notes = [note for note in h.notes if "`versionwatch run --replay ...`" not in note]
    h.fix = fix_for(h)  # the lines may make it concrete (the write's own line, its module)
