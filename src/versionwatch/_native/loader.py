"""The optional native helper: an exact saved-tensor check and version reads in C++.

Never required: without it (not built, no compiler, ``VERSIONWATCH_NATIVE=0``,
a failed self-test) everything runs in Python with the same results, and
:func:`status` says why in one line. See ``docs/native.md``.

The API for the predictor and the ledger is :func:`native`, which returns the
loaded extension module or ``None``. The module has:

- ``check(roots) -> (nodes, checked, flagged)``: ``roots`` a sequence of
  autograd nodes (``grad_fn``\\ s, or the ``AccumulateGrad`` of a leaf output).
  It walks every node reachable from them and unpacks every saved tensor with
  PyTorch's own version check. ``flagged == 0`` is a clean answer, exact: the
  Python predictor would report no hazard and nothing unverifiable over
  ``nodes`` nodes and ``checked`` saved tensors. Anything else (a stale or
  freed tensor, saved-tensor hooks, a list of saved tensors, CopySlices, a node
  type it does not know, any doubt) means: run the Python predictor.
- ``explain(roots) -> [(node, slot, verdict, detail)]``: what ``check`` flagged.
- ``VersionSet(refs)``: ``versions()`` is ``read_versions(refs)``; ``changed()``
  says whether a version moved since the last ``versions()`` (None once a
  tensor died).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import types

from versionwatch import _native_state
from versionwatch._native import build as _native_build
from versionwatch._native.build import ENV_MODE, mode

FAULT_ENV = "VERSIONWATCH_NATIVE_FAULT"  # a test hook: "clean" plants a wrong answer


class _State:
    tried = False
    # True while a decision is being made: its self-test runs the predictor,
    # which must then take its Python path (and not wait for this decision).
    deciding = False
    module: types.ModuleType | None = None
    line = ""
    # What the decision found wrong in the cache (a damaged library set aside):
    # said once on stderr by the process it happened in, whose status line it is.
    found = ""
    graphs = 0


_STATE = _State()
_LOCK = threading.Lock()


def native() -> types.ModuleType | None:
    """The extension module if it is usable here, else ``None``.

    The first call decides, once per process: it loads the extension if it is
    built (``VERSIONWATCH_NATIVE=auto``, the default), builds it first in a
    child process if ``VERSIONWATCH_NATIVE=1`` (minutes, once per torch), and
    runs the self-test. Call it where a pause is acceptable, e.g. when a
    watcher starts, not inside a training step. A damaged library in the cache
    is set aside (and rebuilt with ``VERSIONWATCH_NATIVE=1``), with one line on
    stderr; nothing else is printed.

    Raises:
        ValueError: ``VERSIONWATCH_NATIVE`` has a value other than auto, 0 or 1.
    """
    if _STATE.tried:
        return _STATE.module
    if _STATE.deciding:
        return None
    with _LOCK:
        if not _STATE.tried:
            _decide(allow_build=True)
            if _STATE.found:
                print(f"versionwatch: native helper: {_STATE.found}", file=sys.stderr)
                _STATE.found = ""
    return _STATE.module


def status() -> str:
    """One line: loaded, not built, disabled or unavailable, and why. Builds nothing."""
    try:
        mode()
    except ValueError as e:
        return f"error: {e}"
    if _STATE.deciding:
        return "deciding: the native helper is being loaded or built"
    with _LOCK:
        if not _STATE.tried:
            _decide(allow_build=False)
        _STATE.found = ""  # said by the status line itself
        return _STATE.line


def _reset() -> None:
    """Forget the decision (tests; ``versionwatch native build`` before loading)."""
    with _LOCK:
        _native_state.CURRENT = None
        _STATE.tried = False
        _STATE.module = None
        _STATE.line = ""
        _STATE.found = ""
        _STATE.graphs = 0


def _decide(allow_build: bool) -> None:
    """:func:`_load`, flagged as under way (call it holding ``_LOCK``)."""
    _STATE.deciding = True
    try:
        _load(allow_build)
    finally:
        _STATE.deciding = False


_PYTHON_RUNS = "the Python predictor runs"


def _load(allow_build: bool) -> None:
    """Decide, and set ``_STATE``; ``tried`` stays False where a later call may build."""
    value = mode()
    if value == "0":
        _done(None, f"disabled: {ENV_MODE}=0; {_PYTHON_RUNS}")
        return
    try:
        lib = _native_build.library_path()
        state, why = _native_build.cached()
        if state == "damaged":
            # Never loaded: a file cut short kills the process that maps it (SIGBUS).
            outcome = _native_build.set_aside()
            state, _ = _native_build.cached()
            if outcome is not None:
                _STATE.found = f"the cached library {lib} is damaged ({why}): {outcome}"
    except Exception as e:  # torch missing its version, an unreadable source...
        _done(None, f"unavailable: {type(e).__name__}: {e}")
        return
    if state == "damaged":  # still there: another build holds it, or a read-only cache
        found = _STATE.found or f"the cached library {lib} is damaged ({why})"
        _done(None, f"unavailable: {found}; {_PYTHON_RUNS}")
        return
    if state == "absent":
        if _STATE.found and not (value == "1" and allow_build):
            line = (f"unavailable: {_STATE.found}; `versionwatch native build` builds it "
                    f"again; {_PYTHON_RUNS}")
            if value == "1":  # a later call may build it
                _STATE.line = line
            else:
                _done(None, line)
            return
        failed = _native_build.failure_path()
        if value == "auto":
            _done(None, "not built: `versionwatch native build` builds it (or set "
                        f"{ENV_MODE}=1 to build it at first use); {_PYTHON_RUNS}")
            return
        if os.path.exists(failed):  # False, not an error, in a folder we cannot read
            why = failed.read_text(encoding="utf-8", errors="replace").strip()
            _done(None, f"unavailable: the last build failed: {why}; "
                        f"`versionwatch native build` tries again; {_PYTHON_RUNS}")
            return
        if not allow_build:
            _STATE.line = (f"not built yet: {ENV_MODE}=1 builds it at first use "
                           "(`versionwatch native build` builds it now)")
            return
        result = _native_build.build()
        if not result.ok:
            log = f" (log: {result.log})" if result.log else ""
            _done(None, f"unavailable: the build failed: {result.line}{log}; {_PYTHON_RUNS}")
            return
    try:
        ext = _import(lib)
    except Exception as e:
        _done(None, f"unavailable: {lib.name} does not load: {type(e).__name__}: {e}; "
                    f"{_PYTHON_RUNS}")
        return
    fault = os.environ.get(FAULT_ENV, "")
    ext._set_fault(1 if fault == "clean" else 0)
    start = time.perf_counter()
    from versionwatch._native import selftest as _native_selftest

    mismatch, graphs = _native_selftest.run(ext)
    took = (time.perf_counter() - start) * 1e3
    if mismatch is not None:
        _done(None, f"disabled: the self-test failed: {mismatch}; {_PYTHON_RUNS}")
        return
    _STATE.graphs = graphs
    _done(ext, f"loaded: {lib} (self-test passed on {graphs} graphs in {took:.0f} ms)")


def _done(module: types.ModuleType | None, line: str) -> None:
    _native_state.CURRENT = module
    _STATE.module = module
    _STATE.line = line
    _STATE.tried = True


def _import(path: os.PathLike[str]) -> types.ModuleType:
    name = _native_build.extension_name()
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(action: str, timeout: float = _native_build.DEFAULT_TIMEOUT,
            force: bool = False, verbose: bool = False) -> int:
    """``versionwatch native build|status``: prints one line; the exit status.

    ``build`` builds (or finds built) the extension, then loads it and runs the
    self-test as a training process would, and prints :func:`status`: 0 if it
    loaded, 1 if not. ``status`` prints the line and exits 0. A bad
    ``VERSIONWATCH_NATIVE``, or a timeout that is not a positive number of
    seconds, exits 2.
    """
    try:
        mode()
    except ValueError as e:
        print(f"versionwatch native: {e}")
        return 2
    if action == "status":
        print(status())
        return 0
    problem = _native_build.timeout_problem(timeout)
    if problem is not None:
        print(f"versionwatch native build: error: --timeout: {problem}", file=sys.stderr)
        return 2
    try:
        result = _native_build.build(timeout, force=force, verbose=verbose)
    except Exception as e:  # no torch version, an unreadable source...
        print(f"versionwatch native: the build could not start: {type(e).__name__}: {e}")
        return 1
    if not result.ok:
        print(f"versionwatch native: the build failed after {result.seconds:.0f} s: "
              f"{result.line}" + (f" (log: {result.log})" if result.log else ""))
        return 1
    print(f"versionwatch native: {result.line}")
    _reset()
    if mode() == "0":
        print(status())
        return 0
    with _LOCK:
        _decide(allow_build=False)
        line = _STATE.line
    print(line)
    return 0 if _STATE.module is not None else 1
