"""Finding the user's line (the first frame outside torch and the training libraries),
and reading other threads' stacks without walking their frames.

Other threads' stacks (:func:`thread_stacks`):
Why not ``sys._current_frames()`` and ``f_back``: on CPython 3.11 (and, as
reported, later) walking ``f_back`` from another running thread's frame object
can read a frame that thread has since popped (python/cpython#111363; sentry's
3.11 crashes in ``PyFrame_GetBack``). A Python loop over ``f_back`` lets the
other thread run between two steps of the walk, and versionwatch's
multi-threaded tests crashed there with SIGSEGV twice in 2,400 rounds.
``faulthandler.dump_traceback`` walks every thread's frames in C without
letting go of the GIL, so no thread moves while it reads; it writes to a file
descriptor, here an anonymous one (``memfd``; an unlinked temporary file
elsewhere), which leaves nothing on disk.

What it costs: a dump per call, of every thread. Callers ask only on the rare
path where one thread's backward waits for another's.

What it cannot see: faulthandler prints at most 100 frames a thread (the
innermost) and 100 threads; a stack cut short says so (``Stack.cut``).
Non-ASCII characters in names are written as faulthandler escapes them, and
:func:`as_dumped` escapes a path the same way before it is compared.
"""

from __future__ import annotations

import contextlib
import faulthandler
import linecache
import os
import re
import sys
import sysconfig
import tempfile
import threading
from types import FrameType
from typing import NamedTuple

import torch

from versionwatch._package import PACKAGE_DIR
from versionwatch._report import Site, import_relative, relative_path

_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, PACKAGE_DIR)
# Frames of these packages are skipped too, so that GradScaler, Accelerate's
# accelerator.backward and Lightning's manual_backward blame the user's line.
# Matched by where each one is imported from, not by a folder's name: a user's
# project folder called "lightning" holds the user's own code.
_LIBRARY_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate",
                     "transformers", "trl", "peft", "_pytest", "pluggy")
# Of those, the ones whose innermost line a report gives after the user's ("via"):
# Trainer-style libraries that call the user's model from their own loop.
_VIA_PACKAGES = ("transformers", "trl", "peft")
_LIBRARY_FILES = (os.path.abspath(contextlib.__file__),)
# The bundled demo plays the user's part, so its lines are the ones to blame.
_USER_FILES = (os.path.join(PACKAGE_DIR, "_cli", "demo.py"),)
_is_library: dict[str, bool] = {}


def _package_dirs(names: tuple[str, ...] = _LIBRARY_PACKAGES) -> tuple[str, ...]:
    """The folders of the training libraries imported so far."""
    dirs = []
    for name in names:
        module = sys.modules.get(name)
        for d in getattr(module, "__path__", None) or ():
            dirs.append(os.path.join(os.path.abspath(d), ""))
    return tuple(dirs)


def is_library(filename: str) -> bool:
    hit = _is_library.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        # A frame of a package only runs once it is imported: a file first seen
        # before the import is not one of its files.
        hit = path not in _USER_FILES and (
            path.startswith(_LIBRARY_DIRS) or path in _LIBRARY_FILES
            or path.startswith(_package_dirs())
            # torch.fx's generated code (what torch.compile runs): the user's
            # line is the call of the compiled function, further up.
            or filename.startswith("<eval_with_key>")
        )
        _is_library[filename] = hit
    return hit


_is_via: dict[str, bool] = {}


def is_via(filename: str) -> bool:
    """Whether ``filename`` is a file of a library whose line a report shows after the user's."""
    hit = _is_via.get(filename)
    if hit is None:
        hit = _is_via[filename] = os.path.abspath(filename).startswith(
            _package_dirs(_VIA_PACKAGES))
    return hit


def user_frame(skip: int = 1) -> tuple[FrameType | None, int]:
    """The first frame outside the libraries, and how many frames up it is."""
    frame: FrameType | None = sys._getframe(skip)
    level = skip
    known = _is_library
    while frame is not None:
        # The cache inline: four of these walks a training step, each a few frames.
        filename = frame.f_code.co_filename
        hit = known.get(filename)
        if hit is None:
            hit = is_library(filename)
        if not hit:
            break
        frame = frame.f_back
        level += 1
    return frame, level


def user_frame_from(frame: FrameType | None) -> FrameType | None:
    """The first frame outside the libraries, from ``frame`` (an entry point's caller) up."""
    known = _is_library
    while frame is not None:
        filename = frame.f_code.co_filename
        hit = known.get(filename)
        if hit is None:
            hit = is_library(filename)
        if not hit:
            return frame
        frame = frame.f_back
    return None


# (file, line) -> Site: a training loop asks for the same few lines at every
# step. A Site shows its path relative to the working directory when read.
_SITES: dict[tuple[str, int], Site] = {}


def site_from(frame: FrameType | None) -> Site | None:
    """``file:line`` (and the source line) of the first user frame from ``frame`` up.

    An entry point passes its caller's frame: the answer then does not
    depend on how many of our frames lie between it and the code that asks.
    """
    known = _is_library
    via: tuple[str, int] | None = None
    while frame is not None:
        # The walk and site_at's cache, inline: four of these a training step.
        filename = frame.f_code.co_filename
        hit = known.get(filename)
        if hit is None:
            hit = is_library(filename)
        if not hit:
            line = frame.f_lineno
            if via is not None:
                return _site_via(filename, line, via)
            site = _SITES.get((filename, line))
            return site if site is not None else site_at(filename, line)
        if via is None:
            # A skipped frame: torch's and ours, a few a step, one cached lookup each.
            through = _is_via.get(filename)
            if through is None:
                through = is_via(filename)
            if through:
                via = (filename, frame.f_lineno)
        frame = frame.f_back
    return None


_VIA_SITES: dict[tuple[str, int, str, int], Site] = {}



def _site_via(filename: str, line: int, via: tuple[str, int]) -> Site:
    """The user's ``filename:line``, with the library line it called into as ``via``."""
    key = (filename, line, *via)
    site = _VIA_SITES.get(key)
    if site is None:
        if len(_VIA_SITES) > 4096:
            _VIA_SITES.clear()
        lib, lib_line = via
        # A library's file reads relative to its import root (transformers/trainer.py),
        # also where the venv lies under the working directory.
        shown = import_relative(lib)
        site = Site(filename, line, linecache.getline(filename, line).strip(),
                    via=Site(shown, lib_line, linecache.getline(lib, lib_line).strip()))
        _VIA_SITES[key] = site
    return site


_STDLIB = tuple(os.path.join(os.path.abspath(p), "") for p in
                {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


_is_user: dict[str, bool] = {}


def user_frames(frame: FrameType | None) -> list[FrameType]:
    """Every user frame from ``frame`` up, innermost first: outside the libraries
    and the standard library (``runpy``, which ``versionwatch run`` starts a
    script with, is no frame of the user's). For reports: it walks the whole stack."""
    out = []
    known = _is_user
    while frame is not None:
        filename = frame.f_code.co_filename
        hit = known.get(filename)
        if hit is None:
            hit = known[filename] = not is_library(filename) \
                and not filename.startswith("<frozen") \
                and not os.path.abspath(filename).startswith(_STDLIB)
        if hit:
            out.append(frame)
        frame = frame.f_back
    return out


def user_site() -> Site | None:
    """``file:line`` (and the source line) of the user's code that called into us.

    The walk starts at the function that asks: every frame from there up to
    the user's is a library's (ours, torch's), however the code is arranged.
    """
    return site_from(sys._getframe(1))


def site_at(filename: str, line: int) -> Site:
    """The :class:`Site` of ``filename:line``, with its source line (cached)."""
    key = (filename, line)
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) > 4096:
            _SITES.clear()
        site = Site(filename, line, linecache.getline(filename, line).strip())
        _SITES[key] = site
    return site


def _short(filename: str) -> str:
    return relative_path(filename)


class StackFrame(NamedTuple):
    """One frame as faulthandler prints it: its file and its function's name."""

    file: str
    name: str


class Stack(NamedTuple):
    """A thread's frames, innermost first; ``cut`` when faulthandler stopped early."""

    frames: tuple[StackFrame, ...]
    cut: bool


_STACKS_LOCK = threading.Lock()
_FD: list[int] = []  # [pid, fd] of the process that opened it; [] until first use
_HEADER = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-fA-F]+)\b")
_FRAME = re.compile(r'^  File "(.*)", line \S+ in (.*)$')
# faulthandler's MAX_STRING_LENGTH: longer names are cut and end with "...".
_MAX_STRING = 500


def as_dumped(text: str) -> str:
    """``text`` as faulthandler writes it: printable ASCII kept, the rest escaped.

    >>> as_dumped("/home/zoë/torch/")
    '/home/zo\\\\xeb/torch/'
    """
    out = []
    for ch in text[:_MAX_STRING]:
        code = ord(ch)
        if 32 <= code <= 126:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def _descriptor() -> int:
    """This process's own descriptor (a forked child must not share its parent's offset)."""
    pid = os.getpid()
    if _FD and _FD[0] == pid:
        return _FD[1]
    if _FD:
        try:
            os.close(_FD[1])  # the parent's, inherited by fork: the parent keeps its own
        except OSError:
            pass
        _FD.clear()
    memfd = getattr(os, "memfd_create", None)
    fd = -1
    if memfd is not None:
        try:
            fd = memfd("versionwatch-stacks")
        except OSError:
            fd = -1
    if fd < 0:
        handle = tempfile.TemporaryFile()  # unlinked at once where the OS allows
        fd = os.dup(handle.fileno())
        os.set_inheritable(fd, False)
        handle.close()
    _FD[:] = [pid, fd]
    return fd


def thread_stacks() -> dict[int, Stack]:
    """Every thread's stack by ``threading.get_ident()``, read at one instant.

    >>> me = threading.get_ident()
    >>> thread_stacks()[me].frames[0].name
    'thread_stacks'
    """
    with _STACKS_LOCK:
        fd = _descriptor()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        faulthandler.dump_traceback(fd, all_threads=True)
        size = os.lseek(fd, 0, os.SEEK_CUR)
        data = os.pread(fd, size, 0)
    return parse_stacks(data.decode("ascii", "replace"))


def parse_stacks(text: str) -> dict[int, Stack]:
    """faulthandler's all-threads dump, by thread ident."""
    out: dict[int, Stack] = {}
    ident: int | None = None
    frames: list[StackFrame] = []
    cut = False

    def close() -> None:
        if ident is not None:
            out[ident] = Stack(tuple(frames), cut)

    for line in text.splitlines():
        head = _HEADER.match(line)
        if head is not None:
            close()
            ident, frames, cut = int(head.group(1), 16), [], False
            continue
        found = _FRAME.match(line)
        if found is not None:
            frames.append(StackFrame(found.group(1), found.group(2)))
        elif line.strip() == "...":
            cut = True
    close()
    return out
