"""Where ``versionwatch fix`` runs the program: a scratch copy of the user's folders.

Every run (the first one, the program as meant, each candidate's check) has side
effects: a checkpoint written, a log appended, a file deleted. None of them may
reach the user's folder, and each run must start from the same files, or the
runs would not compare (a resumed checkpoint would go on from where the last
run left it). So :class:`Workspace` takes a snapshot of the working folder (and
of the script's folder when it is elsewhere) once, at the start, with the same
relative layout, and gives each run a fresh copy of that snapshot.

Folders a program does not write in (``.git``, a virtual environment, tools'
caches) are linked, not copied. Where the rest is over :data:`LIMIT_BYTES` or
:data:`LIMIT_FILES`, a copy per run would cost too much: :func:`Workspace.plan`
says so, and ``versionwatch fix --in-place`` runs the checks in the user's own
folder instead (with their side effects, as the program would have them).

All of a ``fix``'s temporary files (the copies, each run's spec, record and
``TMPDIR``, the candidates' scratch files) are in one folder, which
:meth:`Workspace.close` removes; a small process of its own (the *janitor*,
``python -m versionwatch._fix.workspace``) removes it when ``fix`` dies without
closing it (SIGKILL): it waits on a pipe whose only write end ``fix`` holds.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from versionwatch._process import end, environment, python_module, start, wait

# A copy per run: what ``fix`` copies at most without --in-place (documented in
# docs/fix.md). Most training folders hold code and a few small files; one that
# holds its dataset is over it.
LIMIT_BYTES = 256 * 1024 * 1024
LIMIT_FILES = 20_000
# Folders a training program reads at most: linked into each copy, never copied.
_LINKED = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".mypy_cache",
           ".pytest_cache", ".ruff_cache", ".tox", ".nox", ".ipynb_checkpoints"}


def _linked(path: str, name: str) -> bool:
    return name in _LINKED or os.path.exists(os.path.join(path, name, "pyvenv.cfg"))


@dataclass
class Run:
    """One run's copy: its working directory, and how its paths map to the user's."""

    cwd: str
    mirror: list[tuple[str, str]]  # (copy root, the user's root), real paths


@dataclass
class Workspace:
    """The user's folders, snapshotted once; a fresh copy of the snapshot per run.

    ``roots``: the user's folders (real paths), ``base``: their common folder.
    ``in_place``: no copies; every run in the user's working directory.
    """

    roots: list[str]
    base: str
    in_place: bool = False
    folder: str = ""
    snapshot: str = ""
    files: int = 0
    size: int = 0
    _runs: int = 0
    _made: list[str] = field(default_factory=list)
    _janitor: subprocess.Popen[bytes] | None = None
    _death_w: int = -1

    @classmethod
    def for_program(cls, program: list[str], in_place: bool = False) -> Workspace:
        """The folders ``program`` (``["train.py", ...]``, ``-m``, ``-c``) reads by
        relative path: the working directory, and a script's folder elsewhere."""
        cwd = os.path.realpath(os.getcwd())
        roots = [cwd]
        if program and program[0] not in ("-m", "-c"):
            here = os.path.dirname(os.path.realpath(program[0]))
            if os.path.commonpath([here, cwd]) != cwd:
                roots.append(here)
        base = os.path.commonpath(roots)
        return cls(roots, base, in_place)

    def plan(self) -> str | None:
        """Why the folders cannot be copied for every run (``None``: they can)."""
        if self.in_place:
            return None
        size = files = 0
        self.files = self.size = 0
        for root in self.roots:
            for path, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if not _linked(path, d)]
                files += len(names)
                for name in names:
                    try:
                        size += os.lstat(os.path.join(path, name)).st_size
                    except OSError:
                        continue
                self.files, self.size = files, size
                if size > LIMIT_BYTES or files > LIMIT_FILES:
                    return (f"{_shown_root(root)} holds over {LIMIT_BYTES >> 20} MB or "
                            f"{LIMIT_FILES} files; each check run would copy it, so that "
                            "the program's side effects stay out of your folder. Run it from "
                            "a smaller folder, or pass --in-place to run the checks in yours "
                            "(the program's side effects then happen there, once per run)")
        return None

    def describe(self) -> str:
        """Where every run happens, for the terminal (after :meth:`plan` and :meth:`open`)."""
        if self.in_place:
            return ("--in-place: every run happens in your working folder, with the "
                    "program's side effects there, once per run")
        where = " and of ".join(_shown_root(root) for root in self.roots)
        return (f"every run of the program happens in a fresh copy of {where} "
                f"({self.files} file(s), {_size(self.size)}) under {self.folder}; "
                "nothing of yours is written but by --apply")

    def _root(self) -> str:
        """The folder of all temporary files, made once, with its janitor."""
        if not self.folder:
            self.folder = tempfile.mkdtemp(prefix="versionwatch-fix-")
            death_r, self._death_w = os.pipe()
            try:
                self._janitor = start([*python_module("versionwatch._fix.workspace"),
                                       str(death_r), self.folder],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      env=environment(), pass_fds=(death_r,))
            finally:
                os.close(death_r)
        return self.folder

    def temp(self) -> str:
        """A new folder for one run's files (its spec, record, TMPDIR; a candidate's scratch)."""
        return tempfile.mkdtemp(dir=self._root(), prefix="t")

    def open(self) -> None:
        """Take the snapshot (once, before the first run)."""
        if self.in_place or self.snapshot:
            return
        self.snapshot = os.path.join(self._root(), "snapshot")
        for root in self.roots:
            _copy(root, os.path.join(self.snapshot, os.path.relpath(root, self.base)),
                  os.path.realpath(self.folder))

    def fresh(self) -> Run:
        """A new copy of the snapshot for one run (the user's folder, in place)."""
        if self.in_place:
            return Run(os.path.realpath(os.getcwd()), [])
        self.open()
        self._runs += 1
        top = os.path.join(self.folder, f"run{self._runs}")
        shutil.copytree(self.snapshot, top, symlinks=True)
        self._made.append(top)
        top = os.path.realpath(top)
        mirror = [(os.path.normpath(os.path.join(top, os.path.relpath(root, self.base))), root)
                  for root in self.roots]
        cwd = os.path.normpath(os.path.join(
            top, os.path.relpath(os.path.realpath(os.getcwd()), self.base)))
        return Run(cwd, mirror)

    def done(self, run: Run) -> None:
        """A run's copy is no longer needed."""
        for top in list(self._made):
            if run.cwd == top or run.cwd.startswith(os.path.realpath(top) + os.sep):
                _remove(top)
                self._made.remove(top)

    def close(self) -> None:
        """Remove every temporary file, and end the janitor."""
        if self.folder:
            _remove(self.folder)
            self.folder = self.snapshot = ""
        if self._death_w != -1:
            os.close(self._death_w)  # the janitor finds nothing left, and exits
            self._death_w = -1
        if self._janitor is not None:
            wait(self._janitor, 10)
            end(self._janitor)
            self._janitor = None


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    return f"{n / 1024:.0f} KB" if n < 1 << 20 else f"{n / (1 << 20):.0f} MB"


def _shown_root(root: str) -> str:
    try:
        rel = os.path.relpath(root)
    except ValueError:
        return root
    return "the working folder" if rel == "." else rel


def _copy(src: str, dst: str, own: str) -> None:
    """``src`` to ``dst``: files copied with their modes, tool folders linked.

    ``own``: the workspace's folder, left out where it is under ``src`` (a
    TMPDIR inside the working folder): the copy would copy itself.
    """
    os.makedirs(dst, exist_ok=True)
    with os.scandir(src) as entries:
        for entry in entries:
            if entry.path == own or os.path.realpath(entry.path) == own:
                continue
            target = os.path.join(dst, entry.name)
            try:
                if entry.is_symlink():
                    os.symlink(os.readlink(entry.path), target)
                elif entry.is_dir():
                    if _linked(src, entry.name):
                        os.symlink(entry.path, target)
                    else:
                        _copy(entry.path, target, own)
                elif entry.is_file():
                    shutil.copy2(entry.path, target)
            except OSError:
                continue  # unreadable: the run will see it missing, as it may see it denied


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    # A program may leave a read-only folder behind: make it removable, then again.
    for folder, dirs, _ in os.walk(path):
        for name in [folder, *(os.path.join(folder, d) for d in dirs)]:
            try:
                os.chmod(name, stat.S_IRWXU)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def _janitor(fd: int, folder: str) -> None:
    """Remove ``folder`` once the pipe ``fd`` closes: ``fix`` is done, or dead.

    Again, a while: the runs that wrote there are being killed as it starts.
    """
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    deadline = time.monotonic() + 30
    while os.path.lexists(folder) and time.monotonic() < deadline:
        _remove(folder)
        time.sleep(0.1)


if __name__ == "__main__":
    _janitor(int(sys.argv[1]), sys.argv[2])
