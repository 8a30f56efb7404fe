"""Which watchers are open: the process's registry, each thread's stack, the busy flag.

A training-loop event (a backward, an optimizer step) goes to the innermost
open watcher of the thread it happens on, else to the newest open one of any
thread. While versionwatch's own code runs (a prediction, a repair's copies)
the thread is *busy*: whatever it does is no user event.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from versionwatch._runtime import Registry

if TYPE_CHECKING:
    from versionwatch._watch.protocols import OpenWatcher

# Per thread: ``busy`` (our own code runs) and ``stack`` (weak references to its
# open watchers, innermost last). Read through __dict__ on hot paths: two getattr
# calls cost more. Weak, as the registry: a watcher dropped without close() is
# collected, and its __del__ closes it.
_LOCAL = threading.local()
# Guards the opening of watchers and their backward counters (re-entrant: a
# watcher opened inside another's event).
LOCK = threading.RLock()
# Open watchers, oldest first: truthy while any is open.
ACTIVE: Registry[OpenWatcher] = Registry("watchers", weak=True)


def thread_stack() -> list[weakref.ref[OpenWatcher]]:
    """This thread's open watchers, innermost last (the list itself, to change)."""
    stack: list[weakref.ref[OpenWatcher]] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def current() -> OpenWatcher | None:
    """The innermost watcher of this thread, else the newest one of any thread."""
    local = _LOCAL.__dict__  # busy and stack, read without two getattr calls
    if local.get("busy"):
        return None
    stack: list[weakref.ref[OpenWatcher]] | None = local.get("stack")
    if stack:
        w = stack[-1]()
        if w is not None:
            return w
        for ref in reversed(stack):  # the innermost was dropped, and is being collected
            w = ref()
            if w is not None and not w.closed:
                return w
    return ACTIVE.newest()
