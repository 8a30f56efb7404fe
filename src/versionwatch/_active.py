"""Which watchers are open: the process's registry, each thread's stack, the busy flag.

A training-loop event (a backward, an optimizer step) goes to the innermost
open watcher of the thread it happens on, else to the newest open one of any
thread. While versionwatch's own code runs (a prediction, a repair's copies)
the thread is *busy*: whatever it does is no user event.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from versionwatch._runtime import Registry

if TYPE_CHECKING:
    from versionwatch._protocols import OpenWatcher

# Per thread: ``busy`` (our own code runs) and ``stack`` (its open watchers,
# innermost last). Read through __dict__ on hot paths: two getattr calls cost more.
_LOCAL = threading.local()
# Open watchers, oldest first: truthy while any is open.
ACTIVE: Registry[OpenWatcher] = Registry("watchers")


def thread_stack() -> list[OpenWatcher]:
    """This thread's open watchers, innermost last (the list itself, to change)."""
    stack: list[OpenWatcher] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def current() -> OpenWatcher | None:
    """The innermost watcher of this thread, else the newest one of any thread."""
    local = _LOCAL.__dict__  # busy and stack, read without two getattr calls
    if local.get("busy"):
        return None
    stack: list[OpenWatcher] | None = local.get("stack")
    if stack:
        return stack[-1]
    return ACTIVE.newest()
