"""What ``versionwatch run`` leaves behind: its ``--json``, ``--dot`` and ``--svg`` files.

The JSON document is the report's own (:func:`versionwatch._report.document.report_dict`)
over all the run's reports, with how the run ended. A file that cannot be
written is one line on stderr; the exit status stays the program's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from versionwatch._watch import AutoWatcher

__all__ = ["output_error", "write_file", "write_outputs"]


def write_outputs(args: argparse.Namespace, watcher: AutoWatcher, status: int,
                  err: BaseException | str | None) -> None:
    """Write ``--json``, ``--dot`` and ``--svg`` for the run so far; each rank its own files."""
    from versionwatch._cli.merge import rank_path
    from versionwatch._distributed import rank as current_rank
    from versionwatch._report import Report, report_dict

    reports: list[Report] = list(watcher.reports)
    # The group is torn down by now in most programs, and a rank whose process
    # group was set up without torchrun has no RANK: the rank seen during the run.
    rank = (current_rank() or next((r.rank for r in reports if r.rank is not None), None)
            or watcher.rank_seen)
    # Where each output goes (resolved at start-up: the program may chdir) and
    # the path as typed, for messages.
    outputs: dict[str, tuple[str, str]] = {}
    for option in ("json", "dot", "svg"):
        typed = getattr(args, option)
        if typed:
            where = getattr(args, "resolved", {}).get(option, typed)
            if rank is not None:  # each rank its own files, not all of them the same
                where, typed = rank_path(where, rank[0]), rank_path(typed, rank[0])
            outputs[option] = (where, typed)
    if isinstance(err, str):
        exception: str | None = err
    else:
        exception = None if err is None else f"{type(err).__name__}: {err}"
    if args.json:
        timeline: dict[str, Any] = {}
        try:
            timeline = watcher.timeline().to_dict()
        except KeyError:
            pass
        # The document of all the run's reports, and how the run ended.
        doc = report_dict(reports, timeline=timeline, rank=rank, run={
            "target": args.module or (args.target[0] if args.target else None),
            "exit_status": status,
            "exception": exception,
        })
        if watcher.policy == "repair":
            doc["repairs"] = [r.to_dict() for r in watcher.repairs]
            doc["repair_summary"] = watcher.repair_summary()
        write_file("--json", *outputs["json"], json.dumps(doc, indent=2) + "\n")
    if args.dot or args.svg:
        merged = Report(hazards=[h for r in reports for h in r.hazards])
        dot = merged.to_dot()
        if args.dot:
            write_file("--dot", *outputs["dot"], dot)
        if args.svg:
            exe = shutil.which("dot")
            if exe is None:
                print("versionwatch: --svg needs Graphviz's `dot` program; it is not installed "
                      "(the DOT text is still available with --dot)", file=sys.stderr)
            else:
                _render_svg(exe, *outputs["svg"], dot)


def _render_svg(exe: str, path: str, shown: str, dot: str) -> None:
    try:
        done = subprocess.run([exe, "-Tsvg", "-o", path], input=dot.encode(),
                              stderr=subprocess.PIPE)
    except OSError as e:
        output_error("--svg", shown, e.strerror or str(e))
        return
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        output_error("--svg", shown,
                      said[-1] if said else f"`dot` exited with status {done.returncode}")


def write_file(option: str, path: str, shown: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        output_error(option, shown, e.strerror or str(e))


def output_error(option: str, path: str, problem: str) -> None:
    # One line, and the exit status stays the program's: the run itself went as it went.
    print(f"versionwatch: error: cannot write {option} {path}: {problem}", file=sys.stderr)
