"""Building the native helper: its name, where it lives, and a build that cannot hang.

``torch.utils.cpp_extension`` compiles ``_native.cpp`` against the installed
torch, in a child process that we can stop: its ``FileBaton`` lock stays behind
when a build is killed, and every later build of the same directory then waits
for it forever (pytorch#189245). So a build here holds a lock of its own (an
``flock``, which the kernel releases with the process, however it ends),
removes a baton that no live build of ours can own, and stops the child after
a timeout. cpp_extension keys its cache on the sources and flags, not on the
torch it compiles against, so the extension's name carries the versions of
versionwatch and torch (torch's git commit included) and a digest of the
source: another torch, another name, another directory.

A library is loaded only once it is proven whole: a file cut short (a build or
a copy stopped half way) kills with SIGBUS whoever maps it. The child links it
in the build directory, loads it there and runs the self-test on it; only then
does it rename it into place, next to the build directory, and write its
record (size and SHA-256) after it. :func:`cached` holds the file against its
record before anyone loads it; a file that does not match is set aside, never
loaded. The child runs in the build directory, without the caller's folder on
its path: a ``json.py`` where the command runs is not imported.

Nothing here imports torch's extension machinery into the calling process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from versionwatch._process import end, environment, start, wait

ENV_MODE = "VERSIONWATCH_NATIVE"
ENV_DIR = "VERSIONWATCH_NATIVE_DIR"
MODES = ("auto", "0", "1")
SOURCE = Path(__file__).with_name("native.cpp")
DEFAULT_TIMEOUT = 900.0
# Part of the name's digest: other flags, another build.
_CFLAGS = ("-O2",)
_LIB_EXT = ".pyd" if os.name == "nt" else ".so"

# The child. ``python -c`` puts the folder it runs in first on sys.path (as ''):
# dropped before anything is imported, so that a json.py or torch.py there is
# never taken for the real one. It runs in the build directory, and imports
# this very versionwatch (``environment()``) for the self-test.
_CHILD = """\
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
from versionwatch._native.build import _child
sys.exit(_child(sys.argv[1:]))
"""
# How the child's own lines in the log begin, and its exit status when it fails.
_CHILD_SAYS = "versionwatch: "
_CHILD_FAILED = 3


def mode() -> str:
    """``$VERSIONWATCH_NATIVE``: ``auto`` (the default), ``1`` or ``0``.

    Raises:
        ValueError: any other value, naming the variable and the valid ones.
    """
    problem = mode_problem()
    if problem is not None:
        raise ValueError(problem)
    return os.environ.get(ENV_MODE, "").strip() or "auto"


def mode_problem() -> str | None:
    """What is wrong with ``$VERSIONWATCH_NATIVE``, in one line; ``None`` if nothing."""
    value = os.environ.get(ENV_MODE, "").strip() or "auto"
    if value not in MODES:
        return (f"{ENV_MODE}={value!r} is not valid; use auto (load the native helper if it "
                "is built, the default), 1 (build it at first use) or 0 (never use it)")
    return None


def timeout_problem(timeout: float) -> str | None:
    """What is wrong with a build timeout, in one line; ``None`` if nothing."""
    if not (math.isfinite(timeout) and timeout > 0):
        return f"the timeout must be a positive number of seconds; got {timeout:g}"
    return None


def cache_root() -> Path:
    """Where builds go: ``$VERSIONWATCH_NATIVE_DIR``, else the user's cache.

    The user's cache is ``$XDG_CACHE_HOME/versionwatch``, else ``~/.cache/versionwatch``.
    """
    own = os.environ.get(ENV_DIR)
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "versionwatch"


@functools.cache
def extension_name() -> str:
    """``versionwatch_native_<versionwatch>_torch<version>_<git>_py<X.Y>_<digest>``.

    The digest covers the C++ source and the flags, so an edited source, even
    uncommitted, gets a name of its own.
    """
    import torch

    from versionwatch._package import __version__

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:12]
    git = (getattr(torch.version, "git_version", None) or "")[:8]
    tag = (f"{__version__}_torch{torch.__version__}_{git}_"
           f"py{sys.version_info[0]}{sys.version_info[1]}_{digest}")
    return "versionwatch_native_" + re.sub(r"[^0-9A-Za-z]+", "_", tag).strip("_")


def build_dir() -> Path:
    """cpp_extension's directory: sources' objects, its log, the library as linked."""
    return cache_root() / extension_name()


def library_path() -> Path:
    """Where the proven extension lies (it may not exist): next to the build directory.

    Not in it: there cpp_extension links a new one, in place, before it is proven.
    """
    return cache_root() / f"{extension_name()}{_LIB_EXT}"


def record_path() -> Path:
    """The library's record: its size and SHA-256, written once it is in place."""
    return cache_root() / f"{extension_name()}.record"


def lock_path() -> Path:
    """The build lock: held by a build, and by whoever sets a damaged library aside."""
    return cache_root() / f"{extension_name()}.lock"


def failure_path() -> Path:
    """The note a failed build leaves: ``VERSIONWATCH_NATIVE=1`` does not retry it."""
    return build_dir() / "FAILED"


@dataclass
class BuildResult:
    """What :func:`build` did: ``line`` is one line for a person."""

    ok: bool
    seconds: float
    line: str
    log: Path | None = None


def _digest(path: Path) -> tuple[int, str]:
    """The size and SHA-256 of a file, read once."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _record_text(size: int, digest: str) -> str:
    """A record's whole text; :func:`cached` reads nothing else as one."""
    return f"size {size}\nsha256 {digest}\n"


def cached() -> tuple[str, str]:
    """The library in the cache against its record, without loading it.

    Returns:
        ``("good", "")``: it is there, and its size and SHA-256 are those of its
        record. ``("absent", "")``: there is none. ``("damaged", why)``: any
        other file (cut short, empty, another library, no record), which must
        never be loaded; ``why`` is a few words (``size 0, expected 247288``).
    """
    found = _held_to_record()
    for _ in range(2):
        if found[0] != "damaged":
            break
        # A build puts a library, then its record, in place: between the two
        # renames the new library has the old record. Look again.
        time.sleep(0.05)
        found = _held_to_record()
    return found


def _held_to_record() -> tuple[str, str]:
    """One look of :func:`cached`."""
    lib = library_path()
    try:
        size = lib.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        return "absent", ""
    except OSError as e:
        return "damaged", f"unreadable: {e.strerror or e}"
    try:
        text = record_path().read_text(encoding="ascii")
    except (FileNotFoundError, NotADirectoryError):
        # A build writes the record last: without one, no build finished it.
        return "damaged", f"size {size}, and no record of a finished build"
    except (OSError, UnicodeDecodeError) as e:
        return "damaged", f"its record is unreadable: {e}"
    match = re.fullmatch(r"size (\d+)\nsha256 ([0-9a-f]{64})\n", text)
    if match is None:
        return "damaged", "its record is unreadable"
    expected, digest = int(match[1]), match[2]
    if size != expected:
        return "damaged", f"size {size}, expected {expected}"
    try:
        got = _digest(lib)
    except OSError as e:
        return "damaged", f"unreadable: {e.strerror or e}"
    if got != (expected, digest):
        return "damaged", (f"size {got[0]}, sha256 {got[1][:12]}..., expected "
                           f"{digest[:12]}... by its record")
    return "good", ""


def set_aside(timeout: float = 2.0) -> str | None:
    """Move a damaged library out of the way, holding the build lock.

    Returns what was done, a few words (``set aside``: renamed ``NAME.so.damaged``), or
    ``None`` where the library is good now (another build replaced it meanwhile).
    A library that another process is building, or that cannot be moved, stays.
    """
    try:
        with _locked(lock_path(), timeout) as held:
            if not held:
                return "left in place: another process holds its build lock"
            return _set_aside()
    except OSError as e:  # a read-only cache: no lock file, no rename
        return f"could not set it aside: {e.strerror or e}"


def _set_aside() -> str | None:
    """:func:`set_aside`'s work, with the lock held."""
    if cached()[0] != "damaged":
        return None
    lib = library_path()
    aside = lib.with_name(lib.name + ".damaged")
    try:
        os.replace(lib, aside)
    except OSError as e:
        return f"could not set it aside: {e.strerror or e}"
    with contextlib.suppress(OSError):
        record_path().unlink()
    return "set aside"


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[bool]:
    """Hold ``path`` exclusively (True), or give up after ``timeout`` seconds (False)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # Windows: msvcrt locks a byte instead
            import msvcrt

            def take() -> bool:
                try:
                    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
                except OSError:
                    return False
                return True
        else:
            def take() -> bool:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return False
                return True
        deadline = time.monotonic() + timeout
        held = take()
        while not held and time.monotonic() < deadline:
            time.sleep(0.2)
            held = take()
        yield held
    finally:
        os.close(fd)  # releases the lock


def _summary(log: str) -> str:
    """The line of a build log that says what went wrong."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith(_CHILD_SAYS)]
    if ours:  # the child's own words: the self-test, the rename
        return ours[-1][len(_CHILD_SAYS):][:240]
    for pattern in (r"Ninja is required", r"(^|: )(fatal )?error:", r"not found|No such file"):
        for ln in lines:
            if re.search(pattern, ln):
                return ln[:240]
    # Else the exception that ended the child: a traceback's last line.
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", ln)]
    if raised:
        return raised[-1][:240]
    return lines[-1][:240] if lines else "no output"


def build(timeout: float = DEFAULT_TIMEOUT, *, force: bool = False,
          verbose: bool = False) -> BuildResult:
    """Build the extension in a child process, at most ``timeout`` seconds.

    Another process building the same extension is waited for (within the same
    timeout); an extension already built, and whole, is kept unless ``force``; a
    damaged one is set aside and built again. A cache that cannot be written is
    a failed build, with its one line, not an exception.

    Args:
        timeout: seconds for waiting and building together; the child is killed after.
        force: build again even if the extension exists.
        verbose: copy the build's log (compiler commands and output) to stderr.

    Returns:
        A :class:`BuildResult`; ``ok`` is True only if a proven extension is in place.

    Raises:
        ValueError: ``timeout`` is not a positive, finite number.
    """
    problem = timeout_problem(timeout)
    if problem is not None:
        raise ValueError(problem)
    began = time.monotonic()
    name = extension_name()
    where = build_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with _locked(lock_path(), timeout) as held:
            if not held:
                return BuildResult(False, time.monotonic() - began,
                                   f"another build of {name} has held its lock for over "
                                   f"{timeout:g} s ({lock_path()})")
            return _build_locked(began, timeout, force, verbose)
    except OSError as e:  # a read-only cache, a path under a file
        return BuildResult(False, time.monotonic() - began,
                           f"the cache folder {cache_root()} cannot be written: "
                           f"{type(e).__name__}: {e.strerror or e}")


def _build_locked(began: float, timeout: float, force: bool, verbose: bool) -> BuildResult:
    """:func:`build`'s work, holding the build lock."""
    name = extension_name()
    where = build_dir()
    lib = library_path()
    state, why = cached()
    if state == "good" and not force:
        return BuildResult(True, time.monotonic() - began, f"already built: {lib}")
    note = ""
    if state == "damaged":
        note = f"the cached library {lib} was damaged ({why}): {_set_aside()}; "
    # No build of ours runs now (we hold the lock): a baton left here was left
    # by a killed one, and would make this build wait forever. The library as
    # linked last goes too: ninja would take it as up to date, and it may be
    # the one cut short.
    for stale in (where / "lock", failure_path(), where / lib.name):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    log_path = where / "build.log"
    left = max(1.0, timeout - (time.monotonic() - began))
    line, ok = _run_child(name, where, lib, left, log_path, verbose)
    if line is _TIMED_OUT:
        line = f"the build took over {timeout:g} s and was stopped"
    ok = ok and cached()[0] == "good"
    seconds = time.monotonic() - began
    if ok:
        return BuildResult(True, seconds, f"{note}built {name} in {seconds:.0f} s: {lib}",
                           log_path)
    if not line:
        line = f"the build ended without a proven {lib.name}"
    with contextlib.suppress(OSError):
        failure_path().write_text(line + "\n", encoding="utf-8")
    return BuildResult(False, seconds, note + line, log_path)


_TIMED_OUT = "timed out"


def _run_child(name: str, where: Path, lib: Path, timeout: float, log_path: Path,
               verbose: bool) -> tuple[str, bool]:
    """Run the child build; (a line saying what failed, or "", and success)."""
    cmd = [sys.executable, "-c", _CHILD, name, str(SOURCE), str(where), str(lib),
           str(record_path()), *_CFLAGS]
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        try:
            # Its own group: a timeout stops ninja and the compilers with it. In
            # the build directory: nothing of the caller's folder is imported.
            proc = start(cmd, cwd=str(where), env=environment(), stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as e:
            return f"could not start {sys.executable}: {e}", False
        try:
            timed_out = not wait(proc, timeout)
        finally:
            # Reaped; its group killed only if it still runs: what a finished
            # build left running (a compiler cache's server) is not ours to end.
            end(proc, leftovers=False)
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if verbose:
        sys.stderr.write(text)
    if timed_out:
        return _TIMED_OUT, False
    if proc.returncode != 0:
        return _summary(text), False
    return "", True


def _child(argv: Sequence[str]) -> int:
    """The build child: link, load and self-test the library, then put it in place.

    ``argv``: the name, the source, the build directory, the library's place,
    its record's, then the compiler flags. Only a library that loaded here and
    passed the self-test is renamed into place (one rename: no one sees it
    half written), and its record is written after it.
    """
    name, source, where, lib, record, *flags = argv
    from torch.utils.cpp_extension import load

    ext = load(name=name, sources=[source], build_directory=where, extra_cflags=list(flags),
               verbose=True, is_python_module=True)
    from versionwatch._native import selftest

    ext._set_fault(0)  # the loader's test hook is for the loader, not for a build
    mismatch, graphs = selftest.run(ext)
    if mismatch is not None:
        print(f"{_CHILD_SAYS}the self-test failed: {mismatch}", flush=True)
        return _CHILD_FAILED
    linked = Path(where) / Path(lib).name
    size, digest = _digest(linked)
    temporary = Path(f"{record}.{os.getpid()}")
    try:
        _write_durably(linked, None)
        _write_durably(temporary, _record_text(size, digest))
        # Two renames, the record's last: a library in place with another's
        # record lasts one system call (which a reader's second look covers);
        # one cut short never gets a record.
        os.replace(linked, lib)
        os.replace(temporary, record)
    except OSError as e:
        print(f"{_CHILD_SAYS}could not put {Path(lib).name} in place: {e}", flush=True)
        return _CHILD_FAILED
    print(f"{_CHILD_SAYS}built {name}: self-test passed on {graphs} graphs", flush=True)
    return 0


def _write_durably(path: Path, text: str | None) -> None:
    """Write ``text`` to ``path`` (``None``: keep its contents), and flush it to disk,
    so that a crash after the rename that follows cannot leave it cut short."""
    with open(path, "r+b" if text is None else "wb") as f:
        if text is not None:
            f.write(text.encode("ascii"))
        f.flush()
        os.fsync(f.fileno())
