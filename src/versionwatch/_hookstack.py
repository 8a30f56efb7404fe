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

No thread may pop another thread's stack: a watcher closed from another
thread leaves its entry, inert, for its own thread to pop when it next enters
versionwatch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from versionwatch._runtime import Call, Change, Patch, add_probe

_C: Any = torch._C._autograd
_NAMES = ("_push_saved_tensors_default_hooks", "_pop_saved_tensors_default_hooks",
          "_saved_tensors_hooks_disable", "_saved_tensors_hooks_enable")

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class _Thread(threading.local):
    """This thread's view of its stack, from our lowest entry up."""

    gen = 0  # the install it was kept under; stale after a later one
    # None for our entry, (pack, unpack) for someone else's pushed above ours.
    shadow: list[Hooks | None] | None = None
    suspended = 0  # our entries set aside while hooks are disabled
    token: object | None = None  # tells this thread from a later one with its ident


class _State:
    def __init__(self) -> None:
        self.ours: Hooks | None = None
        self.gen = 0
        self.local = _Thread()
        self.lock = threading.Lock()
        # thread ident -> that thread's token, for each entry it has to pop
        self.pending: dict[int, list[object]] = {}


STATE = _State()


def _shadow() -> list[Hooks | None]:
    local = STATE.local
    if local.shadow is None or local.gen != STATE.gen:
        # Kept under an earlier install: only entries left to pop are known,
        # and nothing above them (pushes since were not seen).
        left = STATE.pending.get(threading.get_ident(), [])
        local.shadow = [None] * sum(1 for t in left if t is local.token)
        local.suspended = 0
        local.gen = STATE.gen
    return local.shadow


def changes(pack: Callable[[torch.Tensor], Any],
            unpack: Callable[[Any], torch.Tensor]) -> list[Change]:
    """Wrapping the stack's entry points; ``pack``/``unpack`` are strict mode's hooks."""

    def start() -> None:
        STATE.ours = (pack, unpack)
        STATE.gen += 1

    return [Call(start, _nothing), *_PATCHES.values()]


def _nothing() -> None:
    pass


def _real(name: str) -> Any:
    """PyTorch's own entry point: what our patch replaced while it is in place."""
    patch = _PATCHES[name]
    return patch.old if patch.on else getattr(_C, name)


def push() -> tuple[int, object]:
    """Push strict mode's entry on this thread (a strict watcher opens).

    Returns what :func:`pop` takes: the thread, as its ident and its token.
    """
    settle()
    local = STATE.local
    if local.token is None:
        local.token = object()
    shadow = _shadow()
    assert STATE.ours is not None
    if not _C._saved_tensors_hooks_is_enabled():
        local.suspended += 1  # pushed when enabled again
    else:
        _real("_push_saved_tensors_default_hooks")(*STATE.ours)
        shadow.append(None)
    return threading.get_ident(), local.token


def pop(owner: tuple[int, object]) -> None:
    """Take one of strict mode's entries off the stack of ``owner``, a thread."""
    ident, token = owner
    if ident != threading.get_ident() or token is not STATE.local.token:
        with STATE.lock:
            STATE.pending.setdefault(ident, []).append(token)
        return
    _remove_ours()


def settle() -> None:
    """Pop the entries that watchers closed from other threads left on this one."""
    if not STATE.pending:
        return
    ident, token = threading.get_ident(), STATE.local.token
    _shadow()  # counts them, if kept under an earlier install
    with STATE.lock:
        left = STATE.pending.pop(ident, [])
    for t in left:
        if t is token:
            _remove_ours()


def _remove_ours() -> None:
    local = STATE.local
    shadow = _shadow()
    if local.suspended:
        local.suspended -= 1
        return
    if None not in shadow:
        return  # not on this stack (pushed under an install whose record is gone)
    i = len(shadow) - 1 - shadow[::-1].index(None)
    above = [h for h in shadow[i + 1:] if h is not None]
    real_pop = _real("_pop_saved_tensors_default_hooks")
    for _ in range(len(above) + 1):
        real_pop()
    for hooks in above:
        _real("_push_saved_tensors_default_hooks")(*hooks)
    del shadow[i]


def _in_backward() -> bool:
    # A node runs under a copy of the thread's state that the engine puts back
    # after it: a push or pop there (a hook's) lasts no longer than the node,
    # and is none of the shadow's business.
    return bool(torch._C._current_graph_task_id() != -1)


def _push(pack_hook: Any, unpack_hook: Any) -> None:
    if _in_backward():
        _real("_push_saved_tensors_default_hooks")(pack_hook, unpack_hook)
        return
    settle()
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
    if not shadow or shadow[-1] is not None:
        real_pop()
        if shadow:
            shadow.pop()
        return
    # Our entry is on top: the caller's is the topmost other one, below it.
    ours = 0
    while ours < len(shadow) and shadow[len(shadow) - 1 - ours] is None:
        ours += 1
    for _ in range(ours):
        real_pop()
    try:
        real_pop()
    finally:
        assert STATE.ours is not None
        for _ in range(ours):
            _real("_push_saved_tensors_default_hooks")(*STATE.ours)
    below = len(shadow) - 1 - ours
    if below >= 0:
        del shadow[below]


def _disable(message: str, *args: Any, **kwargs: Any) -> None:
    settle()
    real_disable = _real("_saved_tensors_hooks_disable")
    shadow = _shadow()
    fail_if_non_empty = (args[0] if args else kwargs.get("fail_if_non_empty", True))
    if not shadow or not fail_if_non_empty or any(h is not None for h in shadow):
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
        assert STATE.ours is not None
        for _ in shadow:
            _real("_push_saved_tensors_default_hooks")(*STATE.ours)
        raise
    STATE.local.suspended += len(shadow)
    shadow.clear()


def _enable() -> None:
    settle()
    _real("_saved_tensors_hooks_enable")()
    local = STATE.local
    shadow = _shadow()
    if local.suspended:
        assert STATE.ours is not None
        for _ in range(local.suspended):
            _real("_push_saved_tensors_default_hooks")(*STATE.ours)
            shadow.append(None)
        local.suspended = 0


_PATCHES = {name: Patch(_C, name, new)
            for name, new in zip(_NAMES, (_push, _pop, _disable, _enable))}


def _pending() -> int:
    """Entries that closes from other threads left for a live thread to pop."""
    alive = {t.ident for t in threading.enumerate()}
    with STATE.lock:
        for ident in [i for i in STATE.pending if i not in alive]:
            del STATE.pending[ident]  # its stack died with it
        return sum(len(tokens) for tokens in STATE.pending.values())


add_probe("saved-tensor hook entries pending", _pending)
