"""The ``versionwatch`` command: ``run`` a script or module watched, or the ``demo``."""

from __future__ import annotations

import argparse
import atexit
import builtins
import io
import json
import os
import pkgutil
import runpy
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from importlib.machinery import BuiltinImporter, SourceFileLoader
from types import CodeType, FrameType, ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from versionwatch._cli.outputs import write_file, write_outputs
from versionwatch._cli.sigterm import TermGuard, threads_left
from versionwatch._fix import Notebook, NotebookError, is_notebook, read_notebook
from versionwatch._package import PACKAGE_DIR
from versionwatch._watch import POLICIES

if TYPE_CHECKING:
    from versionwatch._cli.replay import Child
    from versionwatch._watch import AutoWatcher

USAGE = """\
versionwatch run [--on-hazard raise|warn|log|repair] [--json PATH] [--dot PATH] [--svg PATH]
                 [--quiet] [--strict [--fingerprint]] [--stop-at-write] [--replay]
                 (SCRIPT | -m MODULE | -) [ARGS...]
versionwatch merge [--json PATH] REPORT...
versionwatch demo
versionwatch native (build [--timeout SECONDS] [--force] [--verbose] | status)"""


class _Version(argparse.Action):
    """``--version``: this package's version and torch's, as ``pytest --version`` says its own.

    torch is imported only when asked: building the parser costs no import.
    """

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        import warnings

        from versionwatch._package import __version__

        with warnings.catch_warnings():
            # Our own program: torch without numpy warns as it loads (as in the demo).
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                                    category=UserWarning)
            import torch

        print(f"versionwatch {__version__} (torch {torch.__version__})")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="versionwatch",
        description="Predict and explain PyTorch's 'modified by an inplace operation' errors "
        "before backward runs, and write the fix.",
        epilog="`versionwatch COMMAND --help` describes each command's options; "
        "docs/cli.md has them all.",
    )
    p.add_argument("--version", action=_Version,
                   help="print versionwatch's version and torch's, and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a script or module with every nn.Module and optimizer watched",
        description="Run SCRIPT (or -m MODULE) as __main__ with every nn.Module and optimizer "
        "it creates watched; no code change. Each backward is predicted before it runs, and "
        "a hazard is explained: which tensor, which node saved it, which event changed it, "
        "and the fix. The exit status is the script's own.",
        epilog="versionwatch's options go before SCRIPT or -m MODULE: everything after it "
        "belongs to the program, as with python. `--` ends versionwatch's options: "
        "`versionwatch run -- train.py --json x` passes `--json x` to train.py. "
        "VERSIONWATCH_ON_HAZARD overrides --on-hazard. Details: docs/cli.md.",
    )
    run.add_argument("--on-hazard", choices=POLICIES, default="raise",
                     help="what a predicted hazard does: raise (the default) stops the "
                     "script at that backward, before it runs, with the explanation (exit "
                     "status 1); warn issues an InplaceHazardWarning and log writes to the "
                     "`versionwatch` logger, then the backward runs; repair keeps copies so "
                     "that a backward after step() works (docs/repair.md)")
    run.add_argument("--json", metavar="PATH",
                     help="write the JSON report here, even if the script dies (one per "
                     "rank under torchrun: PATH with .rankN before the extension)")
    run.add_argument("--dot", metavar="PATH",
                     help="write a Graphviz (DOT) picture of the hazards: the path from the "
                     "backward's root to the node that saved the stale tensor")
    run.add_argument("--svg", metavar="PATH",
                     help="render that picture to SVG with Graphviz's `dot` (if installed)")
    run.add_argument("--quiet", action="store_true",
                     help="print nothing of versionwatch's own unless there is a hazard")
    run.add_argument("--strict", action="store_true",
                     help="strict mode: name the line of each write to a saved tensor, "
                     "including writes that bump no version (slower)")
    run.add_argument("--fingerprint", action="store_true",
                     help="with --strict: also compare a sample of each saved tensor's bytes "
                     "before backward, for writes no version counter sees (slower)")
    run.add_argument("--stop-at-write", action="store_true",
                     help="strict mode that stops at any write to memory a live graph saved, "
                     "before it happens, even if that graph never runs backward again")
    run.add_argument("--replay", action="store_true",
                     help="when a backward would fail, run the same command again in strict "
                     "mode up to that backward, and merge its lines into the report (the "
                     "program runs twice, side effects included)")
    # The replay's own child: stop at backward N, write its report to PATH.
    run.add_argument("--replay-child", metavar="N:PATH", help=argparse.SUPPRESS)
    run.add_argument("-m", dest="module", metavar="MODULE",
                     help="run a module as __main__, like python -m MODULE")
    run.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                     help="the script and its arguments (with -m: the module's arguments); "
                     "SCRIPT - reads the script from standard input, as python - does")
    merge = sub.add_parser(
        "merge", help="summarize the per-rank JSON reports of a distributed run",
        description="Read the reports that `versionwatch run --json PATH` wrote on each rank "
        "(PATH.rank0.json, PATH.rank1.json, ...) and say which ranks hit which hazard and "
        "where the ranks disagree. Exit status 1 if any rank had a hazard, 2 if a file is "
        "not a report.",
        epilog="Details: docs/distributed.md.")
    merge.add_argument("reports", nargs="+", metavar="REPORT",
                       help="the per-rank JSON reports, one file each")
    merge.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    sub.add_parser(
        "demo", help="the seed story in four steps (seconds, on a CPU)",
        description="The seed story in four steps, in a few seconds on a CPU: PyTorch's "
        "bare error; the same loop watched, the failure predicted and explained; "
        "zero_grad(set_to_none=True), which only hides it; and the fix that `versionwatch "
        "fix` writes, verified by running it. It takes no options.")
    native = sub.add_parser(
        "native", help="build the optional native helper, or say whether it is in use",
        description="The optional native helper speeds up the default mode's checks; "
        "without it everything runs in Python with the same results. "
        "VERSIONWATCH_NATIVE=0 turns it off (docs/native.md).")
    native_sub = native.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = native_sub.add_parser(
        "build", help="compile it against this torch (a minute or so)",
        description="Compile the native helper against the torch installed here, with "
        "torch's C++ extension tools, and keep it for this torch and Python. Exit status "
        "0 once built (or already built).")
    build.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                       help="stop the build after this long (default: 900)")
    build.add_argument("--force", action="store_true",
                       help="build again even if a build for this torch exists")
    build.add_argument("--verbose", action="store_true",
                       help="show the compiler's log as it builds")
    native_sub.add_parser(
        "status", help="one line: loaded, not built, or disabled and why",
        description="Say in one line whether the native helper is loaded, not built, or "
        "disabled, and why. It takes no options.")
    sub.add_parser("fix", help="patch the first hazard's lines, each patch checked by running it "
                   "(`versionwatch fix --help`)", add_help=False)
    return p


_CLI_FILE = os.path.abspath(__file__)
_FORWARD_FILE = os.path.join(PACKAGE_DIR, "_watch", "forward.py")


def _print_uncaught(err: BaseException) -> None:
    """Print ``err`` as Python prints an uncaught exception: with ``sys.excepthook``.

    runpy's and the CLI's own frames are dropped from its traceback; for
    versionwatch's own errors the torch and versionwatch frames between the user's
    backward call and the raise are dropped too.
    """
    from versionwatch._report import FreedGraphError, InplaceModificationError
    from versionwatch._sites import is_library

    ours = isinstance(err, (InplaceModificationError, FreedGraphError))
    kept = []
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.endswith("runpy.py") or "<frozen runpy>" in name
                or os.path.abspath(name) == _CLI_FILE
                # The forward route's frame between torch's own: not in a plain run.
                or os.path.abspath(name) == _FORWARD_FILE
                or (ours and is_library(name))):
            kept.append(tb)
        tb = tb.tb_next
    user_tb: TracebackType | None = None
    for t in reversed(kept):
        user_tb = TracebackType(user_tb, t.tb_frame, t.tb_lasti, t.tb_lineno)
    # Python's own hook prints the exception's __traceback__, not its argument.
    err = err.with_traceback(user_tb)
    try:
        sys.excepthook(type(err), err, user_tb)
    except Exception as hook_err:  # the script's own hook failed: as Python reports it
        print("Error in sys.excepthook:", file=sys.stderr)
        hook_err.__context__ = None
        hook_tb = hook_err.__traceback__.tb_next if hook_err.__traceback__ else None
        sys.__excepthook__(type(hook_err), hook_err.with_traceback(hook_tb), hook_tb)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(err), err, user_tb)


def _exit_interrupted(err: KeyboardInterrupt) -> NoReturn:
    """Let ``err`` end the process, so that Python exits by SIGINT as it would.

    Its traceback is printed already, so the hook that Python calls for it prints
    nothing, once.
    """
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        sys.excepthook = previous
        if value is not err:
            previous(tp, value, tb)

    sys.excepthook = hook
    raise err


def _run_script(path: str) -> None:
    """Run the file at ``path`` as ``python path`` runs it.

    runpy.run_path would set both ``sys.argv[0]`` and ``__file__`` to ``path``;
    Python leaves ``sys.argv[0]`` as typed but makes ``__file__``, and so the paths
    of a traceback, absolute.
    """
    filename = os.path.join(os.getcwd(), path)
    if pkgutil.get_importer(filename) is not None:  # a folder or zip with __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(filename) as f:
        code = pkgutil.read_code(f)  # a .pyc
    if code is None:
        with io.open_code(filename) as f:
            # Not this module's `from __future__ import annotations`.
            code = compile(f.read(), filename, "exec", dont_inherit=True)
    _exec_main(code, filename, SourceFileLoader("__main__", filename))


def _run_stdin(source: bytes) -> None:
    """Run ``source``, read from standard input, as ``python -`` runs it.

    Python compiles it as ``<stdin>`` and gives ``__main__`` that ``__file__``, a
    ``__cached__`` of None and the builtin importer as its loader.
    """
    code = compile(source, "<stdin>", "exec", dont_inherit=True)
    _exec_main(code, "<stdin>", BuiltinImporter)


def _run_notebook(notebook: Notebook) -> None:
    """Run a notebook's code cells in order in one ``__main__``, each under its own name.

    Each cell is compiled as it comes, as "Run all" runs it: a syntax error in one
    cell stops the run there, after the cells before it ran.
    """
    notebook.register()
    codes = (compile(c.text, c.filename, "exec", dont_inherit=True) for c in notebook.cells)
    _exec_main(codes, os.path.abspath(notebook.path), None)


def _exec_main(code: CodeType | Iterable[CodeType], file: str, loader: Any) -> None:
    """Run ``code`` in a fresh ``__main__`` module, as the interpreter makes its own."""
    main = ModuleType("__main__")  # __name__, __doc__, __package__, __loader__, __spec__
    main.__loader__ = loader
    saved = sys.modules.get("__main__")
    # The interpreter's own __main__ starts with an empty __annotations__ (up to
    # Python 3.13): the program's gets one whenever ours has it. In its order.
    annotated = "__annotations__" in getattr(saved, "__dict__", {})
    first: dict[str, Any] = {"__annotations__": {}} if annotated else {}
    main.__dict__.update(first, __builtins__=builtins, __file__=file, __cached__=None)
    sys.modules["__main__"] = main
    try:
        for one in [code] if isinstance(code, CodeType) else code:  # a notebook's cells
            exec(one, main.__dict__)
    finally:
        if saved is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = saved


def _run(args: argparse.Namespace) -> int:
    from versionwatch._cli.replay import send_report
    from versionwatch._process import tie_to_parent
    from versionwatch._watch import ReplayStop, watch_all

    if args.module:
        # As python -m: "-m" until runpy finds the module and puts its file there.
        argv = ["-m", *args.target]
    elif args.target:
        argv = list(args.target)
    else:
        print(f"usage: {USAGE}\nversionwatch run: give a SCRIPT or -m MODULE", file=sys.stderr)
        return 2
    stdin = not args.module and argv[0] == "-"
    if not args.module and not stdin and not os.path.exists(argv[0]):
        print(f"versionwatch run: can't open file {argv[0]!r}: no such file", file=sys.stderr)
        return 2
    notebook = None
    if not args.module and not stdin and is_notebook(argv[0]):
        try:  # before anything runs: a bad notebook is bad input
            notebook = read_notebook(argv[0])
        except NotebookError as e:
            print(f"versionwatch run: error: {e}", file=sys.stderr)
            return 2
    if args.fingerprint and not (args.strict or args.stop_at_write):
        print("versionwatch run: --fingerprint needs strict mode: add --strict", file=sys.stderr)
        return 2
    if args.replay:
        from versionwatch._cli.replay import refusal

        problem = refusal()
        if problem is None and (args.strict or args.stop_at_write):
            problem = ("versionwatch run: --replay re-runs a default-mode run in strict mode; "
                       "with --strict or --stop-at-write the lines are there already")
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    child = _child(args.replay_child)
    if args.replay_child is not None and child is None:
        print("versionwatch run: --replay-child takes N:PARENT:DEATH_FD:REPORT_FD",
              file=sys.stderr)
        return 2
    if child is not None:  # first: from now on, this child dies with its parent
        tie_to_parent(child.parent, child.death_fd)
    # Resolved now, where the command runs: the program may chdir.
    args.cwd = os.getcwd()
    args.resolved = {option: os.path.join(args.cwd, getattr(args, option))
                     for option in ("json", "dot", "svg") if getattr(args, option)}
    # As python -: the whole script first; the program then finds stdin at its end.
    args.source = sys.stdin.buffer.read() if stdin else None
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = argv
    if getattr(sys.flags, "safe_path", False):
        pass  # -P/PYTHONSAFEPATH: python gives the program no entry; ours is none either
    elif args.module:
        sys.path[0] = os.getcwd()
    elif stdin:
        sys.path[0] = ""
    else:
        # As python: the script's folder, symlinks resolved.
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    watcher = watch_all(on_hazard="log" if child else args.on_hazard,
                                     strict=args.strict, stop_at_write=args.stop_at_write,
                                     fingerprint=args.fingerprint)
    run = _Session(args, watcher, saved_argv, saved_path0)
    if child is not None:
        watcher.replay_at = child.backward
        run.guard = TermGuard(run.on_term)  # the child writes no outputs of its own
    run.guard.install()
    before = set(threading.enumerate())
    try:
        if args.module:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        elif stdin:
            _run_stdin(args.source)
        elif notebook is not None:
            for note in notebook.notes:
                print(note, file=sys.stderr)
            _run_notebook(notebook)
        else:
            _run_script(argv[0])
    except ReplayStop as stop:
        assert child is not None
        send_report(child.report_fd, stop.report.to_dict() if stop.report is not None
                    else {"ok": True})
        run.close()
        run.guard.close()
        return 0
    except SystemExit as e:
        code = e.code
        run.status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException as e:
        run.status, run.err = (130 if isinstance(e, KeyboardInterrupt) else 1), e
        _print_uncaught(e)
    if child is None and threads_left(before):
        # Python waits for them once __main__ has returned, then runs atexit:
        # the watcher watches them until then, and the outputs are written then.
        atexit.register(run.finish, at_exit=True)
    else:
        run.finish()
    if isinstance(run.err, KeyboardInterrupt):
        _exit_interrupted(run.err)
    if run.interrupted:
        _exit_interrupted(KeyboardInterrupt())
    return run.status


class _ChildOption(NamedTuple):
    """``--replay-child N:PARENT:DEATH_FD:REPORT_FD``."""

    backward: int
    parent: int
    death_fd: int
    report_fd: int


def _child(value: str | None) -> _ChildOption | None:
    """``--replay-child``'s value; ``None`` if absent or malformed."""
    if value is None:
        return None
    parts = value.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    return _ChildOption(*map(int, parts))


class _Session:
    """One ``versionwatch run``, from the program's start to the outputs written.

    It ends in one of these ways, each of which writes the outputs once the
    watcher is closed: the program's end (``finish``, at once or, when threads
    that Python waits for are left, at exit after them), SIGTERM (``on_term``)
    or ``os._exit`` (``on_exit``). ``guard.lock`` orders them: the first one
    to end the process holds it until the process is gone.
    """

    def __init__(self, args: argparse.Namespace, watcher: AutoWatcher, saved_argv: list[str],
                 saved_path0: str | None) -> None:
        self.args = args
        self.watcher = watcher
        self.saved_argv = saved_argv
        self.saved_path0 = saved_path0
        self.status = 0
        self.err: BaseException | None = None
        # "program" (watched, threads included), "finish" (the outputs, the
        # replay), "done".
        self.phase = "program"
        self.child: Child | None = None
        self.interrupted = False  # Ctrl-C came once the program had ended
        self.waiting = False  # for the replay's child
        wanted = args.json or args.dot or args.svg
        self.guard = TermGuard(self.on_term, self.on_exit if wanted else None)

    def close(self) -> None:
        """Close the watcher and give back what the run took: once, whatever comes."""
        with self.guard.lock:
            self.watcher.close()
            sys.argv = self.saved_argv
            if self.saved_path0 is not None and sys.path:
                sys.path[0] = self.saved_path0

    def finish(self, at_exit: bool = False) -> None:
        """The program has ended: close, replay if asked, write the outputs, summarize."""
        with self.guard.lock:
            if self.phase != "program":
                return
            self.phase = "finish"
            self.close()
        # Ctrl-C from here on is noted, not raised into the middle of a write;
        # it stops a replay that runs, and the run then ends by SIGINT.
        previous = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            if self.args.replay and not isinstance(self.err, KeyboardInterrupt):
                self._replay()
            with self.guard.lock:
                write_outputs(self.args, self.watcher, self.status, self.err)
                if not self.args.quiet:
                    _summary(self.watcher, self.err)
        finally:
            self.phase = "done"
            self.guard.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if at_exit and self.interrupted:
            # Too late to raise: end by SIGINT as the interrupted program would.
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def _replay(self) -> None:
        """Re-run the command in strict mode up to the first failing backward; merge its lines.

        The first run's outputs are written first, so that they are there whatever
        happens to the replay.
        """
        from versionwatch._cli.replay import Child, merge, replayed, target

        args = self.args
        report = target(list(self.watcher.reports))
        if report is None or report.backward is None:
            return
        with self.guard.lock:
            write_outputs(args, self.watcher, self.status, self.err)
            command = ["-m", args.module, *args.target] if args.module else list(args.target)
            print(f"versionwatch: --replay: running the same command again in strict mode, "
                  f"up to backward #{report.backward}", file=sys.stderr)
            self.child = Child(command, report.backward, args.cwd, args.source)
        try:
            self.waiting = True
            found, why = self.child.run()
        except KeyboardInterrupt:
            self.child.stop("Ctrl-C")
            self.interrupted = True
            found, why = None, "was interrupted (Ctrl-C)"
        finally:
            self.waiting = False
        with self.guard.lock:
            # The program's error printed the report already: then only what the replay adds.
            before = str(report) if getattr(self.err, "report", None) is report else None
            if merge(report, found, why):
                print(report if before is None else replayed(before, report), file=sys.stderr)
            else:
                print(f"versionwatch: --replay: {report.replay}", file=sys.stderr)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        if self.waiting:  # for the replay's child: stop waiting, and stop it (once)
            self.waiting = False
            raise KeyboardInterrupt

    def _stop_replay(self, why: str) -> None:
        """Stop a replay that runs, and say so in its report."""
        from versionwatch._cli.replay import merge, target

        if self.child is not None and self.child.stop(why):
            report = target(list(self.watcher.reports))
            if report is not None:
                merge(report, None, f"was interrupted ({why})")

    def on_term(self) -> None:
        """SIGTERM, on any thread: the outputs, then the run dies of it."""
        if self.phase == "program":
            # The plain program dies of SIGTERM here, silently; so do we, once written.
            self.watcher.close()
            write_outputs(self.args, self.watcher, 128 + signal.SIGTERM,
                           "terminated by SIGTERM")
        elif self.phase == "finish":
            # The program has ended: its outcome stands; the replay is what stops.
            self._stop_replay("SIGTERM")
            write_outputs(self.args, self.watcher, self.status, self.err)

    def on_exit(self, status: int) -> None:
        """``os._exit(status)``, on any thread: the outputs, then the real exit."""
        if self.phase == "program":
            self.watcher.close()
            write_outputs(self.args, self.watcher, status, f"os._exit({status})")
        elif self.phase == "finish":
            self._stop_replay(f"os._exit({status})")
            write_outputs(self.args, self.watcher, self.status, self.err)


def _merge(args: argparse.Namespace) -> int:
    from versionwatch._cli.merge import MergeError, merge, render_merged

    try:
        summary = merge(args.reports)
    except MergeError as e:
        print(f"versionwatch merge: error: {e}", file=sys.stderr)
        return 2
    print(render_merged(summary))
    if args.json:
        write_file("--json", args.json, args.json, json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


def _summary(watcher: AutoWatcher, err: BaseException | None) -> None:
    from versionwatch._report import FreedGraphError, InplaceModificationError

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
        # Not a bare "no hazard" where some saved tensors were not verified.
        from versionwatch._report import unverified_summary

        unsure = unverified_summary(watcher._backward_pipeline.unverified)
        repaired = _repaired(watcher)
        left = f"{repaired}, no hazard left" if repaired else "no hazard"
        print(f"versionwatch: {watcher.backward_count} backward(s) watched, {left}{unsure}",
              file=sys.stderr)


def _repaired(watcher: AutoWatcher) -> str:
    """``--on-hazard repair``: what it repaired, as the summary says it, else ``""``."""
    if watcher.repairer is None or not watcher.repairer.count:
        return ""
    from versionwatch._report import size

    done = watcher.repair_summary()
    # The kept repairs (the latest 1000) name the graphs: all of them, below that.
    graphs = len({r.graph for r in watcher.repairs})
    which = f"{graphs} graph(s) repaired" if done["repairs"] <= 1000 else "repaired"
    return f"{which} ({done['repairs']} copies, {size(done['copied_bytes'])} copied)"


def _split_run(argv: Sequence[str], parser: argparse.ArgumentParser,
               ) -> tuple[list[str], str | None, list[str]]:
    """``run``'s own options, the module of ``-m``, and the program's ``SCRIPT ARGS...``.

    argparse would take options meant for the program wherever they stand (``-m pkg
    --json cfg.json`` overwrote the program's config), so the first ``SCRIPT``, ``-m
    MODULE`` or ``--`` ends our options here, as it ends python's.
    """
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    valued = {o for a in run.choices["run"]._actions if a.nargs != 0 for o in a.option_strings
              if o.startswith("--")}
    flags = {o for a in run.choices["run"]._actions if a.nargs == 0 for o in a.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), None, list(argv[i + 1:])
        if arg == "-m":
            # A missing MODULE is left to argparse, which says that -m needs one.
            if i + 1 == len(argv):
                return list(argv), None, []
            return list(argv[:i]), argv[i + 1], list(argv[i + 2:])
        if arg.startswith("-m") and not arg.startswith("--"):
            return list(argv[:i]), arg[2:], list(argv[i + 1:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), None, list(argv[i:])
        # An option's value may look like a script (`--json out.json`); argparse
        # takes any unambiguous prefix of a long option (`--js out.json`).
        # A flag spelled out is no prefix (`--replay` of `--replay-child`).
        matches = [o for o in valued if o.startswith(arg)] if arg not in flags else []
        i += 2 if "=" not in arg and (arg in valued or len(matches) == 1) else 1
    return list(argv), None, []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``versionwatch`` console script and ``python -m versionwatch``."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fix"]:  # its own options, parsed like run's: see _fix.main
        from versionwatch._fix import main as fix

        return fix(argv[1:])
    if argv[:1] == ["run"]:
        own, module, target = _split_run(argv[1:], parser)
        args = parser.parse_args(["run", *own])
        if module is not None:
            args.module = module
        args.target = target
    else:
        args = parser.parse_args(argv)
    if args.command == "merge":
        return _merge(args)
    if args.command == "run":
        from versionwatch._watch import env_problem

        problem = env_problem()
        if problem is not None:  # as argparse says a bad --on-hazard, before anything runs
            print(f"versionwatch run: error: {problem}", file=sys.stderr)
            return 2
    if args.command == "native":
        from versionwatch._native import command

        return command(args.action, getattr(args, "timeout", 900.0),
                       getattr(args, "force", False), getattr(args, "verbose", False))
    if args.command == "demo":
        from versionwatch._cli.demo import main as demo

        demo()
        return 0
    return _run(args)
