"""Finding the user's line: the first frame outside torch and the training libraries."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
from types import FrameType

import torch

from versionwatch._package import PACKAGE_DIR
from versionwatch._report import Site, relative_path

_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, PACKAGE_DIR)
# Frames of these packages are skipped too, so that GradScaler, Accelerate's
# accelerator.backward and Lightning's manual_backward blame the user's line.
# Matched by where each one is imported from, not by a folder's name: a user's
# project folder called "lightning" holds the user's own code.
_LIBRARY_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate",
                     "_pytest", "pluggy")
_LIBRARY_FILES = (os.path.abspath(contextlib.__file__),)
# The bundled demo plays the user's part, so its lines are the ones to blame.
_USER_FILES = (os.path.join(PACKAGE_DIR, "_cli", "demo.py"),)
_is_library: dict[str, bool] = {}


def _package_dirs() -> tuple[str, ...]:
    """The folders of the training libraries imported so far."""
    dirs = []
    for name in _LIBRARY_PACKAGES:
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
    while frame is not None:
        # The walk and site_at's cache, inline: four of these a training step.
        filename = frame.f_code.co_filename
        hit = known.get(filename)
        if hit is None:
            hit = is_library(filename)
        if not hit:
            line = frame.f_lineno
            site = _SITES.get((filename, line))
            return site if site is not None else site_at(filename, line)
        frame = frame.f_back
    return None


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
