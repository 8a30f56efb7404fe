"""Strict mode's state per thread: the optimizer step, root forward and module calls running.

Saved-tensor hooks run on the thread that saves, and a write is seen on the
thread that makes it: what strict mode records next to each (the module
being run, the forward, whether a write is the step's own) is this thread's.
"""

from __future__ import annotations

import sys
import threading
from types import CodeType, FrameType
from typing import Any

from versionwatch._report import ForwardRef


class _Thread(threading.local):
    """Per-thread strict state; class attributes are the defaults."""

    busy = False  # inside our own reporting: our writes are not the user's
    step: str | None = None  # label of the optimizer step running, if any
    step_checked = False  # that step's writes were checked as a whole, up front
    step_frame: tuple[int, Any] | None = None  # id and code of the frame running the step
    forward: ForwardRef | None = None  # the root forward running, if any
    # Per running module call, innermost last: [its name, the user's frame above
    # it once a pack inside it has looked (``_UNSEEN`` until then)]. Those frames
    # are on the stack anyway, and each entry goes when its call returns.
    modules: list[list[Any]] | None = None
    # (node's sequence number) -> (code, line, forward) of what this thread saved
    # for that node, newest last: a freed graph's saving lines (see saved_line).
    lines: dict[int, tuple[CodeType, int, ForwardRef | None]] | None = None
    # The previous window.
    lines_old: dict[int, tuple[CodeType, int, ForwardRef | None]] | None = None

    def __init__(self) -> None:
        # Run by each thread at its first use. ``modules`` is in the thread's
        # dict from the start: a module call inside a torch.compile trace reads
        # it, and dynamo guards on that dict; an entry the trace itself added
        # would fail its guard at once ("Guard failed on the same frame").
        self.modules = []


THREAD = _Thread()


def end_step() -> None:
    """Leave the optimizer step this thread was in, if any.

    A step's post-hook does this; a step that raised never runs it, so any sign
    that the thread is past the step (a module call, a forward, a backward, a
    ``zero_grad()``) does it too, or later writes would still be skipped as the
    step's own.
    """
    THREAD.step = None
    THREAD.step_checked = False
    THREAD.step_frame = None


def begin_step(label: str, frame: FrameType | None) -> None:
    """Enter an optimizer step; ``frame`` runs it (it calls the step's pre-hooks).

    Once that frame is off the stack, the step is over even if it raised (a
    pre-hook vetoed it). Kept by id and code: a frame holds the optimizer and
    the step's arguments.
    """
    THREAD.step = label
    THREAD.step_frame = (id(frame), frame.f_code) if frame is not None else None


def in_step() -> bool:
    """Whether the optimizer step this thread entered is still running."""
    mark = THREAD.step_frame
    if mark is None:
        return True
    key, code = mark
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if id(frame) == key and frame.f_code is code:
            return True
        frame = frame.f_back
    end_step()
    return False
