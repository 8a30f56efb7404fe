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

Nothing here imports torch's extension machinery into the calling process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from versionwatch._process import end, start, wait

ENV_MODE = "VERSIONWATCH_NATIVE"
ENV_DIR = "VERSIONWATCH_NATIVE_DIR"
MODES = ("auto", "0", "1")
SOURCE = Path(__file__).with_name("native.cpp")
DEFAULT_TIMEOUT = 900.0
# Part of the name's digest: other flags, another build.
_CFLAGS = ("-O2",)
_LIB_EXT = ".pyd" if os.name == "nt" else ".so"

# The child: nothing of versionwatch, only torch's builder.
_CHILD = """\
import sys
name, source, where, *flags = sys.argv[1:]
from torch.utils.cpp_extension import load
load(name=name, sources=[source], build_directory=where, extra_cflags=flags,
     verbose=True, is_python_module=True)
print("versionwatch: built", name)
"""


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
    return cache_root() / extension_name()


def library_path() -> Path:
    """Where the built extension lies (it may not exist)."""
    return build_dir() / f"{extension_name()}{_LIB_EXT}"


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
    timeout); an extension already built is kept unless ``force``.

    Args:
        timeout: seconds for waiting and building together; the child is killed after.
        force: build again even if the extension exists.
        verbose: copy the build's log (compiler commands and output) to stderr.

    Returns:
        A :class:`BuildResult`; ``ok`` is True only if the extension file exists.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive; got {timeout!r}")
    began = time.monotonic()
    name = extension_name()
    where = build_dir()
    lib = library_path()
    where.mkdir(parents=True, exist_ok=True)
    with _locked(cache_root() / f"{name}.lock", timeout) as held:
        if not held:
            return BuildResult(False, time.monotonic() - began,
                               f"another build of {name} has held its lock for over "
                               f"{timeout:g} s ({cache_root() / (name + '.lock')})")
        if lib.exists() and not force:
            return BuildResult(True, time.monotonic() - began, f"already built: {lib}")
        # No build of ours runs now (we hold the lock): a baton left here was
        # left by a killed one, and would make this build wait forever.
        with contextlib.suppress(FileNotFoundError):
            (where / "lock").unlink()
        with contextlib.suppress(FileNotFoundError):
            failure_path().unlink()
        if force:
            with contextlib.suppress(FileNotFoundError):
                lib.unlink()
        log_path = where / "build.log"
        left = max(1.0, timeout - (time.monotonic() - began))
        line, ok = _run_child(name, where, left, log_path, verbose)
        if line is _TIMED_OUT:
            line = f"the build took over {timeout:g} s and was stopped (log: {log_path})"
        ok = ok and lib.exists()
        seconds = time.monotonic() - began
        if ok:
            return BuildResult(True, seconds, f"built {name} in {seconds:.0f} s: {lib}", log_path)
        if not line:
            line = f"the build ended without {lib.name}"
        failure_path().write_text(line + "\n", encoding="utf-8")
        return BuildResult(False, seconds, line, log_path)


_TIMED_OUT = "timed out"


def _run_child(name: str, where: Path, timeout: float, log_path: Path,
               verbose: bool) -> tuple[str, bool]:
    """Run the child build; (a line saying what failed, or "", and success)."""
    cmd = [sys.executable, "-c", _CHILD, name, str(SOURCE), str(where), *_CFLAGS]
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        try:
            # Its own group: a timeout stops ninja and the compilers with it.
            # The parent's environment as it is: the child imports torch alone.
            proc = start(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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

