"""``versionwatch fix --apply``: a verified patch written to the user's files, all else kept.

The candidate's texts already have each file's line endings (the families edit
Python's view of the text; :meth:`~versionwatch._candidates.Sources.as_written`
gives the endings back). Here the new text is encoded as Python reads the file
(its coding cookie, a UTF-8 BOM kept) and written so that the file stays what it
was but for the patched lines:

- a plain file: a temporary file in its folder, with its mode (and owner, where
  this process may set it), moved over it with ``os.replace``: atomic, the file is
  the old one or the new one, never half written;
- a file with more than one hard link: written in place (``r+``, then truncated),
  so that every name of it has the patch (a replace would leave the other names
  on the old text), after a backup copy that is removed once the write is done;
- a symbolic link: its target is written, the link stays a link;
- a file its owner made read-only: refused, unless ``--force``.

Nothing is written unless every file can be: every check is made, and every new
file made, before the first one is moved in place.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass

from versionwatch._candidates import Candidate, decode_source, shown

_PREFIX = ".versionwatch-fix-"


@dataclass
class _Write:
    """One file of the patch, checked and ready to write."""

    path: str    # as the candidate names it
    target: str  # the file written: ``path`` with its symbolic links resolved
    data: bytes  # the new bytes
    before: bytes  # the old ones, as read for the check
    st: os.stat_result
    tmp: str = ""  # the new file, next to the target, before it is moved in place

    @property
    def in_place(self) -> bool:
        return self.st.st_nlink > 1


def apply_patch(candidate: Candidate, *, force: bool = False,
                notes: list[str] | None = None) -> str | None:
    """Write ``candidate``'s files; ``None`` when done, else why not (nothing written then).

    Args:
        candidate: the patch; each file must still hold its old text.
        force: write a file its owner made read-only (it stays read-only).
        notes: gets a line for each file written otherwise than as a plain file
            (a hard link written in place, a symbolic link's target, a
            read-only file), for the output to say so.
    """
    writes: list[_Write] = []
    for path, (old, new) in candidate.files.items():
        planned = _plan(path, old, new, force)
        if isinstance(planned, str):
            return planned
        writes.append(planned)
    try:
        for w in writes:
            if not w.in_place:
                w.tmp = _new_file(w)
        done: list[tuple[_Write, bytes]] = []
        try:
            for w in writes:
                if w.in_place:
                    done.append((w, _write_in_place(w)))
        except _Failed:
            for w, before in done:  # those written in place before the failure: undone
                with contextlib.suppress(OSError), open(w.target, "r+b") as f:
                    f.write(before)
                    f.truncate()
            raise
        for w in writes:
            if not w.in_place:
                try:
                    os.replace(w.tmp, w.target)
                except OSError as e:
                    raise _Failed(f"cannot write {shown(w.path)}: {e.strerror or e}") from None
    except _Failed as e:
        return str(e)
    finally:
        for w in writes:
            if w.tmp and os.path.exists(w.tmp):
                with contextlib.suppress(OSError):
                    os.unlink(w.tmp)
    if notes is not None:
        notes.extend(line for w in writes for line in _said(w))
    return None


class _Failed(Exception):
    """A write that did not happen: the message says which file and why."""


def _plan(path: str, old: str, new: str, force: bool) -> _Write | str:
    """``path``'s write, checked: its new bytes; else why it cannot be written."""
    cwd = os.path.realpath(os.getcwd()) + os.sep
    # The name itself (its folder resolved) or what it points to must be under the
    # working directory: a link the user made in their project is theirs to patch.
    name = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                        os.path.basename(path))
    target = os.path.realpath(path)
    if not (name.startswith(cwd) or target.startswith(cwd)):
        return f"{path} is not under the working directory; apply the patch by hand"
    try:
        with open(target, "rb") as f:
            data = f.read()
        st = os.stat(target)
    except OSError as e:
        return f"cannot read {shown(path)}: {e.strerror or e}"
    try:
        now, encoding = decode_source(data)
    except (SyntaxError, UnicodeDecodeError):
        now, encoding = None, ""
    if now != old:
        return f"{shown(path)} changed since the run; run versionwatch fix again"
    if not st.st_mode & stat.S_IWUSR and not force:
        return f"{shown(path)} is read-only; --force writes it anyway"
    try:
        out = new.encode(encoding)
    except UnicodeEncodeError:
        return f"the patch of {shown(path)} has characters its encoding ({encoding}) cannot hold"
    return _Write(path, target, out, data, st)


def _new_file(w: _Write) -> str:
    """The new bytes in a temporary file next to the target, with its mode and owner."""
    folder = os.path.dirname(w.target)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=_PREFIX)
    except OSError as e:
        raise _Failed(f"cannot write {shown(w.path)}: cannot make a file in its folder "
                      f"{shown(folder) or '.'} ({e.strerror or e}), where the new file is "
                      "written before it replaces the old one") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(w.data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(w.st.st_mode))
        if hasattr(os, "chown") and (os.stat(tmp).st_uid, os.stat(tmp).st_gid) != (
                w.st.st_uid, w.st.st_gid):
            # Root writing another user's file: the file stays theirs. Anyone else
            # may not give a file away, and keeps their own.
            with contextlib.suppress(OSError):
                os.chown(tmp, w.st.st_uid, w.st.st_gid)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _Failed(f"cannot write {shown(w.path)}: {e.strerror or e}") from None
    return tmp


def _write_in_place(w: _Write) -> bytes:
    """The new bytes over the old ones, in the same file (every hard link sees them),
    with a copy of the old ones on disk until the write is done; returns the old ones."""
    before = w.before
    backup = _backup(w.target, before)
    try:
        with open(w.target, "r+b") as f:
            f.write(w.data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        why = f"cannot write {shown(w.path)}: {e.strerror or e}"
        try:
            with open(w.target, "r+b") as f:
                f.write(before)
                f.truncate()
        except OSError:
            raise _Failed(f"{why}; its old text is in {backup}") from None
        with contextlib.suppress(OSError):
            os.unlink(backup)
        raise _Failed(why) from None
    with contextlib.suppress(OSError):
        os.unlink(backup)
    return before


def _backup(target: str, data: bytes) -> str:
    """A copy of ``data`` next to ``target`` (or in the temporary folder, where its own
    folder is not writable): what a write cut short in place can be restored from."""
    for folder in (os.path.dirname(target), tempfile.gettempdir()):
        try:
            fd, path = tempfile.mkstemp(dir=folder, prefix=_PREFIX,
                                        suffix=f"-{os.path.basename(target)}.orig")
        except OSError:
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError:  # a full disk: the next folder, or none
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        return path
    raise _Failed(f"cannot write {target}: no folder to keep a copy of it in while it is "
                  "written in place")


def _said(w: _Write) -> list[str]:
    """What the output says about how ``w`` was written, where it was not a plain file."""
    out = []
    if os.path.islink(w.path):
        out.append(f"{shown(w.path)} is a symbolic link: wrote its target {shown(w.target)}")
    if w.in_place:
        out.append(f"{shown(w.path)} has {w.st.st_nlink} hard links: written in place, so "
                   "that each of them has the patch")
    if not w.st.st_mode & stat.S_IWUSR:
        out.append(f"{shown(w.path)} is read-only: written anyway (--force); it stays "
                   "read-only")
    return out
