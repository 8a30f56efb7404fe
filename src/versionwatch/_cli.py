"""The ``versionwatch`` command: ``run`` a script or module watched, or the ``demo``."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import traceback
from collections.abc import Sequence
from typing import Any

USAGE = """\
versionwatch run [--on-hazard raise|warn|log] [--json PATH] [--dot PATH] [--svg PATH]
                 [--quiet] [--strict] [--stop-at-write] (SCRIPT | -m MODULE) [ARGS...]
versionwatch demo"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="versionwatch",
        description="Predict and explain PyTorch's 'modified by an inplace operation' errors.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a script or module with every nn.Module and optimizer watched",
        description="Run SCRIPT (or -m MODULE) as __main__ with every nn.Module and optimizer "
        "it creates watched; no code change. The exit status is the script's own.",
    )
    run.add_argument("--on-hazard", choices=("raise", "warn", "log"), default="raise",
                     help="what a predicted hazard does (default: raise, exit status 1)")
    run.add_argument("--json", metavar="PATH",
                     help="write the JSON report here, even if the script dies")
    run.add_argument("--dot", metavar="PATH", help="write a Graphviz picture of the hazards")
    run.add_argument("--svg", metavar="PATH", help="render the picture with `dot` (if installed)")
    run.add_argument("--quiet", action="store_true", help="print nothing unless there is a hazard")
    run.add_argument("--strict", action="store_true",
                     help="strict mode: name the line of each write to a saved tensor, "
                     "including writes that bump no version (slower)")
    run.add_argument("--stop-at-write", action="store_true",
                     help="strict mode that stops at any write to memory a live graph saved, "
                     "before it happens, even if that graph never runs backward again")
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    run.add_argument("target", nargs=argparse.REMAINDER,
                     help="SCRIPT [ARGS...], or ARGS... with -m")
    sub.add_parser("demo", help="the seed story in four steps (seconds, on a CPU)")
    return p


_FORWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_forward.py")


def _short_traceback(err: BaseException) -> str:
    """The traceback of the user's code: runpy's and the CLI's own frames dropped.

    For versionwatch's own errors the torch and versionwatch frames between the
    user's backward call and the raise are dropped too.
    """
    from versionwatch._errors import FreedGraphError, InplaceModificationError
    from versionwatch._sites import is_library

    ours = isinstance(err, (InplaceModificationError, FreedGraphError))
    frames = [
        f for f in traceback.extract_tb(err.__traceback__)
        if not (f.filename.endswith("runpy.py") or "<frozen runpy>" in f.filename
                or os.path.abspath(f.filename) == os.path.abspath(__file__)
                # The forward route's frame between torch's own: not in a plain run.
                or os.path.abspath(f.filename) == _FORWARD_FILE
                or (ours and is_library(f.filename)))
    ]
    head = "Traceback (most recent call last):\n" if frames else ""
    body = "".join(traceback.format_list(frames))
    return head + body + "".join(traceback.format_exception_only(type(err), err))


def _write_outputs(args: argparse.Namespace, watcher: Any, status: int,
                   err: BaseException | None) -> None:
    from versionwatch._report import SCHEMA, Report

    reports: list[Report] = list(watcher.reports)
    hazards = [h for r in reports for h in r.to_dict()["hazards"]]
    if args.json:
        timeline: dict[str, Any] = {}
        try:
            timeline = watcher.timeline().to_dict()
        except KeyError:
            pass
        # A superset of Report.to_dict(): every hazard of the run, and how it ended.
        doc = {
            "schema": SCHEMA,
            "ok": not hazards,
            "hazards": hazards,
            "unverifiable": [u for r in reports for u in r.to_dict()["unverifiable"]],
            "nodes": sum(r.nodes for r in reports),
            "saved_checked": sum(r.saved_checked for r in reports),
            "timeline": timeline,
            "target": args.module or (args.target[0] if args.target else None),
            "exit_status": status,
            "exception": None if err is None else f"{type(err).__name__}: {err}",
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    if args.dot or args.svg:
        merged = Report(hazards=[h for r in reports for h in r.hazards])
        dot = merged.to_dot()
        if args.dot:
            with open(args.dot, "w", encoding="utf-8") as f:
                f.write(dot)
        if args.svg:
            exe = shutil.which("dot")
            if exe is None:
                print("versionwatch: --svg needs Graphviz's `dot` program; it is not installed "
                      "(the DOT text is still available with --dot)", file=sys.stderr)
            else:
                subprocess.run([exe, "-Tsvg", "-o", args.svg], input=dot.encode(), check=True)


def _run(args: argparse.Namespace) -> int:
    import versionwatch

    if args.module:
        argv = [args.module, *args.target]
    elif args.target:
        argv = list(args.target)
    else:
        print(f"usage: {USAGE}\nversionwatch run: give a SCRIPT or -m MODULE", file=sys.stderr)
        return 2
    if not args.module and not os.path.exists(argv[0]):
        print(f"versionwatch run: can't open file {argv[0]!r}: no such file", file=sys.stderr)
        return 2
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = argv
    if args.module:
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    status = 0
    err: BaseException | None = None
    watcher = versionwatch.watch_all(on_hazard=args.on_hazard, strict=args.strict,
                                     stop_at_write=args.stop_at_write)
    try:
        if args.module:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except KeyboardInterrupt as e:
        status, err = 130, e
        print(_short_traceback(e), file=sys.stderr, end="")
    except BaseException as e:
        status, err = 1, e
        print(_short_traceback(e), file=sys.stderr, end="")
    finally:
        watcher.close()
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        _write_outputs(args, watcher, status, err)
    if not args.quiet:
        _summary(watcher, err)
    return status


def _summary(watcher: Any, err: BaseException | None) -> None:
    from versionwatch._errors import FreedGraphError, InplaceModificationError

    reports = list(watcher.reports)
    n = sum(1 for r in reports if r.hazards and r.hazards[0].detected != "at_write")
    writes = len(reports) - n
    if isinstance(err, (InplaceModificationError, FreedGraphError)):
        print("versionwatch: the run stopped at the failure above", file=sys.stderr)
    elif reports:
        more = f" and {writes} write(s) to saved tensors (--stop-at-write)" if writes else ""
        print(f"versionwatch: {n} backward(s) had hazards{more}; the latest timeline:",
              file=sys.stderr)
        print(watcher.timeline(), file=sys.stderr)
    else:
        print(f"versionwatch: {watcher._backwards} backward(s) watched, no hazard",
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``versionwatch`` console script and ``python -m versionwatch``."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from versionwatch._demo import main as demo

        demo()
        return 0
    return _run(args)
