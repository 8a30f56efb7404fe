"""Strict mode's entries on PyTorch's saved-tensor hooks stack, kept out of others' way.

Saved-tensor hooks are a per-thread stack, and everything else that uses it
(``saved_tensors_hooks`` blocks, checkpoint, ``save_on_cpu``,
``disable_saved_tensors_hooks``, ``torch.func``) assumes it owns the top when it
pops. A strict watcher's entry lives from ``watch()`` to ``close()``, which
need not nest with those blocks, so while strict is installed the stack's
Python entry points are wrapped:

- a pop that would take our entry pops the caller's own (the topmost other
  entry) and leaves ours in place;
- closing a watcher takes its entry out from under entries pushed since,
  which go back in the same order;
- disabling the hooks (``torch.func`` does) sets our entries aside while
  they are disabled, where PyTorch would refuse, and ``enable`` puts them back.

A non-reentrant checkpoint's pair is pushed with its pack hook wrapped, so that
strict mode keeps a record of each tensor saved inside it (see
:mod:`versionwatch._strict.checkpoint`); checkpoint stores and returns the same.

No thread may pop another thread's stack: a watcher closed from another
thread leaves its entry, inert, for its own thread to take out at its next
contact with versionwatch: a save through that entry (the pack hook takes it
out: PyTorch copied the hook pair for the save in progress, see
``SavedVariable``'s constructor in ``torch/csrc/autograd/saved_variable.cpp``),
a push or pop, a ``torch.func`` transform's disable/enable, a new strict
watcher. The wrappers, which those contacts go through, stay installed until
every such entry is taken out or its thread has ended (:data:`WRAPPERS`).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, Union

import torch

from versionwatch._runtime import Anchor, Call, Change, Patch, Subscription, add_probe

_C: Any = torch._C._autograd
_NAMES = ("_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks",
          "_saved_tensors_hooks_disable", "_saved_tensors_hooks_enable")

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
_Packed = TypeVar("_Packed")


class _Alive:
    """Kept by a thread's local state only: it dies when the thread ends."""

    __slots__ = ("__weakref__",)


class Entry:
    """One strict watcher's entry on a thread's stack (what :func:`push` returns)."""

    __slots__ = ("ident", "thread")

    def __init__(self, ident: int, thread: weakref.ref[_Alive]) -> None:
        self.ident = ident
        self.thread = thread  # dead once the thread has ended


class _Thread(threading.local):
    """This thread's view of its stack, from our lowest entry up."""

    gen = 0  # the install it was kept under; stale after a later one
    # An Entry for ours, (pack, unpack) for someone else's pushed above ours.
    shadow: list[Union[Entry, Hooks]] | None = None
    suspended: list[Entry] | None = None  # ours, set aside while hooks are disabled
    alive: _Alive | None = None  # tells this thread from a later one with its ident


class _State:
    def __init__(self) -> None:
        self.ours: Hooks | None = None
        self.gen = 0
        self.local = _Thread()
        self.lock = threading.Lock()
        # thread ident -> the entries closed from other threads that it has to
        # take out, each with its hold on the wrappers.
        self.pending: dict[int, list[tuple[Entry, Subscription]]] = {}
        self.held: Subscription | None = None  # strict mode's hold on the wrappers


STATE = _State()


def _shadow() -> list[Union[Entry, Hooks]]:
    local = STATE.local
    if local.shadow is None or local.gen != STATE.gen:
        # Kept under an earlier install of the wrappers: pushes since were not
        # seen. Entries are left only while the wrappers are in (their holds),
        # so none of ours is known to be here.
        local.shadow = []
        local.suspended = []
        local.gen = STATE.gen
    return local.shadow


def _suspended() -> list[Entry]:
    _shadow()
    suspended = STATE.local.suspended
    assert suspended is not None
    return suspended


# Filled by :mod:`versionwatch._strict.checkpoint`, which sits above this module
# (it reads strict mode's records): how a pushed pair's pack hook is wrapped, and
# what to forget when strict mode stops.
PACK_WRAPPERS: list[Callable[[Callable[[torch.Tensor], Any], Callable[..., torch.Tensor]],
                             Callable[[torch.Tensor], Any]]] = []
ON_STOP: list[Callable[[], None]] = []


def changes(pack: Callable[[torch.Tensor], _Packed],
            unpack: Callable[[_Packed], torch.Tensor]) -> list[Change]:
    """Strict mode's part: its hook pair, and a hold on the stack's wrappers."""

    def start() -> None:
        STATE.ours = (pack, unpack)
        STATE.held = WRAPPERS.subscribe()

    def stop() -> None:
        for forget in ON_STOP:
            forget()
        held, STATE.held = STATE.held, None
        if held is not None:
            held.remove()

    return [Call(start, stop)]


def _real(name: str) -> Callable[..., object]:
    """PyTorch's own entry point: what our patch replaced while it is in place."""
    patch = _PATCHES[name]
    real: Callable[..., object] = patch.old if patch.on else getattr(_C, name)
    return real


def push() -> Entry:
    """Push strict mode's entry on this thread (a strict watcher opens).

    Returns what :func:`pop` takes.
    """
    settle()
    local = STATE.local
    if local.alive is None:
        local.alive = _Alive()
    # Its thread's end drops what is left of its entries (their stack is gone).
    entry = Entry(threading.get_ident(), weakref.ref(local.alive, _forget_ended))
    shadow = _shadow()
    assert STATE.ours is not None
    if not _C._saved_tensors_hooks_is_enabled():
        _suspended().append(entry)  # pushed when enabled again
    else:
        _real("_push_saved_tensors_default_hooks")(*STATE.ours)
        shadow.append(entry)
    return entry


def _mine(entry: Entry) -> bool:
    alive = STATE.local.alive
    return entry.ident == threading.get_ident() and alive is not None \
        and entry.thread() is alive


def pop(entry: Entry) -> None:
    """Take ``entry`` off its thread's stack; from another thread, leave it for that one."""
    if not _mine(entry):
        if entry.thread() is None:
            return  # its thread has ended, and its stack with it
        hold = WRAPPERS.subscribe()  # the contacts go through the wrappers
        with STATE.lock:
            STATE.pending.setdefault(entry.ident, []).append((entry, hold))
        # Its thread may have ended meanwhile: then nothing is left to take out.
        if entry.thread() is None:
            _forget_ended()
        return
    settle()
    _remove(entry)


def settle() -> None:
    """Take out the entries that watchers closed from other threads left on this one."""
    if not STATE.pending:
        return
    ident = threading.get_ident()
    if ident not in STATE.pending:
        return
    with STATE.lock:
        left = STATE.pending.get(ident)
        if not left:
            return
        mine = [(e, h) for e, h in left if _mine(e)]
        if not mine:
            return
        rest = [(e, h) for e, h in left if not _mine(e)]
        if rest:
            STATE.pending[ident] = rest
        else:
            del STATE.pending[ident]
    try:
        for entry, _ in mine:
            _remove(entry)
    finally:
        for _, hold in mine:
            hold.remove()  # the last one takes the wrappers out


def settle_in_pack() -> None:
    """A save went through one of our entries while this thread has some left to take out.

    The pack hook's contact: PyTorch copied the hook pair for this save
    before calling it, so the stack may change under it. Not inside a
    backward's node, whose changes to the stack the engine undoes after it.
    """
    if not _in_backward():
        settle()


def _forget_ended(_: object = None, state: _State = STATE,
                  finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
    """Drop the entries of threads that have ended (their stacks went with them).

    Also a weak reference's callback: at interpreter exit the main thread's
    state dies after this module's globals are cleared (hence the defaults),
    and then there is nothing left to take out.
    """
    if finalizing():
        return
    gone: list[Subscription] = []
    with state.lock:
        for ident in list(state.pending):
            left = state.pending[ident]
            live = [(e, h) for e, h in left if e.thread() is not None]
            gone += [h for e, h in left if e.thread() is None]
            if live:
                state.pending[ident] = live
            else:
                del state.pending[ident]
    for hold in gone:
        hold.remove()


def _remove(entry: Entry) -> None:
    """Take ``entry`` off this thread's stack; entries pushed above it go back in order."""
    suspended = _suspended()
    for i, e in enumerate(suspended):
        if e is entry:
            del suspended[i]
            return
    shadow = _shadow()
    at = next((i for i in range(len(shadow) - 1, -1, -1) if shadow[i] is entry), None)
    if at is None:
        return  # not on this stack (pushed under an install whose record is gone)
    above = shadow[at + 1:]
    real_pop = _real("_pop_saved_tensors_default_hooks")
    for _ in range(len(above) + 1):
        real_pop()
    for hooks in above:
        _repush(hooks)
    del shadow[at]


def _repush(hooks: Union[Entry, Hooks]) -> None:
    assert STATE.ours is not None or not isinstance(hooks, Entry)
    pair = STATE.ours if isinstance(hooks, Entry) else hooks
    assert pair is not None
    _real("_push_saved_tensors_default_hooks")(*pair)


def _in_backward() -> bool:
    # A node runs under a copy of the thread's state that the engine puts back
    # after it: a push or pop there (a hook's) lasts no longer than the node,
    # and is none of the shadow's business.
    return bool(torch._C._current_graph_task_id() != -1)


def _push(pack_hook: Callable[[torch.Tensor], object],
          unpack_hook: Callable[..., torch.Tensor]) -> None:
    if _in_backward():
        _real("_push_saved_tensors_default_hooks")(pack_hook, unpack_hook)
        return
    settle()
    # A non-reentrant checkpoint's pack gets a record of each save beside its
    # holder (what it stores and returns is unchanged): see _strict.checkpoint.
    for wrap in PACK_WRAPPERS:
        pack_hook = wrap(pack_hook, unpack_hook)
    _real("_push_saved_tensors_default_hooks")(pack_hook, unpack_hook)
    shadow = _shadow()
    if shadow:
        shadow.append((pack_hook, unpack_hook))


def _pop() -> None:
    if _in_backward():
        _real("_pop_saved_tensors_default_hooks")()
        return
    settle()
    shadow = _shadow()
    real_pop = _real("_pop_saved_tensors_default_hooks")
    if not shadow or not isinstance(shadow[-1], Entry):
        real_pop()
        if shadow:
            shadow.pop()
        return
    # Our entries are on top: the caller's is the topmost other one, below them.
    ours = 0
    while ours < len(shadow) and isinstance(shadow[len(shadow) - 1 - ours], Entry):
        ours += 1
    top = shadow[len(shadow) - ours:]
    for _ in range(ours):
        real_pop()
    try:
        real_pop()
    finally:
        for entry in top:
            _repush(entry)
    below = len(shadow) - 1 - ours
    if below >= 0:
        del shadow[below]


def _disable(message: str, *args: object, **kwargs: object) -> None:
    settle()
    real_disable = _real("_saved_tensors_hooks_disable")
    shadow = _shadow()
    fail_if_non_empty = (args[0] if args else kwargs.get("fail_if_non_empty", True))
    if not shadow or not fail_if_non_empty or any(not isinstance(h, Entry) for h in shadow):
        real_disable(message, *args, **kwargs)
        return
    # Only our entries are there: PyTorch would refuse them, and would accept
    # the stack without them. They go aside until the hooks are enabled again.
    real_pop = _real("_pop_saved_tensors_default_hooks")
    for _ in shadow:
        real_pop()
    try:
        real_disable(message, *args, **kwargs)
    except BaseException:
        for entry in shadow:
            _repush(entry)
        raise
    _suspended().extend(e for e in shadow if isinstance(e, Entry))
    shadow.clear()


def _enable() -> None:
    settle()
    _real("_saved_tensors_hooks_enable")()
    suspended = _suspended()
    shadow = _shadow()
    if suspended:
        for entry in suspended:
            _repush(entry)
            shadow.append(entry)
        suspended.clear()


def _bump() -> None:
    STATE.gen += 1  # every thread's shadow was kept under the previous install


def _nothing() -> None:
    pass


_PATCHES = {name: Patch(_C, name, new)
            for name, new in zip(_NAMES, (_push, _pop, _disable, _enable))}
# The stack's entry points wrapped, while a strict watcher is open or an entry
# left by a close from another thread waits for its thread.
WRAPPERS = Anchor("saved-tensor hook stack wrappers",
                  lambda: [Call(_bump, _nothing), *_PATCHES.values()])


def _pending() -> int:
    """Entries that closes from other threads left for a live thread to take out."""
    with STATE.lock:
        return sum(1 for left in STATE.pending.values() for e, _ in left
                   if e.thread() is not None)


add_probe("saved-tensor hook entries pending", _pending)
