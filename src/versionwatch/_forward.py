"""How a watcher sees a root module's forward while storing nothing on the module.

Module hooks live in the module's own hook dicts, and whatever copies a module
copies them: ``pickle`` and ``torch.save`` fail on a local function,
``copy.deepcopy`` hands them to EMA and checkpoint copies that outlive the
watcher, and ``torch.jit.script`` tries to compile them. Instead, while a
watcher is open, the class attribute ``nn.Module._compiled_call_impl`` (``None``,
set on an instance by ``module.compile()``) is a descriptor. ``nn.Module.__call__``
reads it first, and calls what it gives instead of ``_call_impl``: for a watched
root (or, under ``watch_all``, a module not seen yet) a call that records the
forward around ``_call_impl``; for any other module ``None``, so the call goes
on as in a plain run. Roots are held by weak reference.

A module hook, even a global one, sends every call down ``nn.Module``'s slow
path; wrapping ``_call_impl`` adds a Python frame to every module call, and
shows it in every traceback. The descriptor costs an unwatched module one small
call and a dict lookup, and it leaves ``_call_impl`` as it is, so
``torch.compile`` still traces a module's ``forward`` directly.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn

from versionwatch._compat import COMPILER_FLAG_OWNER, is_compiling, is_tracing
from versionwatch._functorch import functorch_level
from versionwatch._ledger import read_versions

# torch.compiler, whose flag is_compiling() returns outside TorchScript: read
# inline at every watched forward (the call costs more than the answer).
_COMPILER: Any = COMPILER_FLAG_OWNER
_grad_enabled = torch.is_grad_enabled

# id(root module) -> (module ref, watcher ref, root name), in registration order.
_Entry = tuple["weakref.ref[nn.Module]", "weakref.ref[Any]", str]
_ROOTS: dict[int, list[_Entry]] = {}
# Open watchers that adopt every module run outside the roots they know (watch_all).
_ADOPTERS: list[weakref.ref[Any]] = []
# id(root module) -> what the route gives for it: a call of _call with a weak
# reference to the root (a partial that held the module would keep it alive).
_CALLS: dict[int, functools.partial[Any]] = {}
# With one adopter open (the usual watch_all), its dict of seen module ids:
# the route's lookup for a module it has seen, without calling its reference.
_ONE_SEEN: list[dict[int, Any]] = []


class Handle:
    """Takes one entry out of the registry, as a ``RemovableHandle`` removes a hook."""

    __slots__ = ("_cls", "_entry", "_key")

    def __init__(self, key: int | None, entry: Any, cls: type[nn.Module]) -> None:
        self._key = key
        self._entry = entry
        self._cls: type[nn.Module] | None = cls

    def remove(self) -> None:
        cls, self._cls = self._cls, None
        if cls is not None:
            _release(cls)
        entries: list[Any] | None = _ADOPTERS if self._key is None else _ROOTS.get(self._key)
        if entries is None:
            return
        entries[:] = [e for e in entries if e is not self._entry]
        if self._key is None:
            _adopters_changed()
        if not entries and self._key is not None:
            _ROOTS.pop(self._key, None)
            _CALLS.pop(self._key, None)


def add_root(module: nn.Module, watcher: Any, name: str) -> Handle:
    """Call ``watcher._forward_pre(name)``/``_forward_post`` around every call of ``module``."""
    key = id(module)

    def gone(ref: weakref.ref[nn.Module]) -> None:
        # A dead root's id may be reused by a module nobody watches.
        routes = _ROOTS.get(key)
        if routes is not None:
            routes[:] = [r for r in routes if r[0] is not ref]
            if not routes:
                _ROOTS.pop(key, None)
                _CALLS.pop(key, None)

    route: _Entry = (weakref.ref(module, gone), weakref.ref(watcher), name)
    _ROOTS.setdefault(key, []).append(route)
    if key not in _CALLS:
        # Made once: nn.Module.__call__ reads the attribute twice a call.
        _CALLS[key] = functools.partial(_call, weakref.ref(module))
    return Handle(key, route, _hold(type(module)))


def add_adopter(watcher: Any) -> Handle:
    """Call ``watcher._adopt_root(module)`` for each module whose id is not in ``watcher._seen``.

    It runs before the module's routes are looked up, so an adopted root's
    first forward is recorded too.
    """
    entry = weakref.ref(watcher)
    _ADOPTERS.append(entry)
    _adopters_changed()
    return Handle(None, entry, _hold(nn.Module))


def _adopters_changed() -> None:
    live = [w for w in (ref() for ref in _ADOPTERS) if w is not None]
    _ONE_SEEN[:] = [live[0]._seen] if len(live) == 1 else []


# Where the route is placed: class -> [holders, what the class's own dict had].
# A root's own class is enough to see its calls (subclasses inherit the
# attribute), and its children, of other classes, then skip the route's
# Python call altogether: about 0.3 us per module call. Only an adopter
# (watch_all), which must see every module's first call, holds nn.Module.
_PLACED: dict[type, list[Any]] = {}
_ABSENT = object()


def _hold(cls: type[nn.Module]) -> type[nn.Module]:
    placed = _PLACED.get(cls)
    if placed is None:
        own = vars(cls).get("_compiled_call_impl", _ABSENT)
        if own is not None and own is not _ABSENT:
            # The class brings its own: the route in nn.Module (or a base)
            # would be shadowed as well; leave the class as it is.
            _PLACED[cls] = [1, _ABSENT, False]
            return cls
        placed = _PLACED[cls] = [0, own, True]
        route: Any = _ROUTE  # the attribute is typed as a callable, which a descriptor is not
        cls._compiled_call_impl = route
    placed[0] += 1
    return cls


def _release(cls: type) -> None:
    placed = _PLACED.get(cls)
    if placed is None:
        return
    placed[0] -= 1
    if placed[0] <= 0:
        _unplace(cls)


def _unplace(cls: type) -> None:
    _, own, ours = _PLACED.pop(cls)
    if not ours:
        return
    if own is _ABSENT:
        if vars(cls).get("_compiled_call_impl") is _ROUTE:
            delattr(cls, "_compiled_call_impl")
    else:
        setattr(cls, "_compiled_call_impl", own)  # noqa: B010 (a class of any kind)


class _Route:
    """``nn.Module._compiled_call_impl`` while a watcher is open.

    A non-data descriptor: ``module.compile()`` still sets the instance's own.
    """

    __slots__ = ()

    def __get__(self, module: nn.Module | None, owner: type | None = None) -> Any:
        # Inside a trace: nothing to record, and id(module) would make the
        # trace guard on this very module, and recompile for the next one.
        if module is None or is_tracing():
            return None
        key = id(module)
        call = _CALLS.get(key)
        if call is not None:
            return call
        if _ONE_SEEN and key in _ONE_SEEN[0]:
            return None  # the one adopter saw it: every call of a submodule ends here
        for ref in _ADOPTERS:
            w = ref()
            if w is not None and key not in w._seen and not w._closed:
                return functools.partial(_call, weakref.ref(module))
        return None


def _call(target: weakref.ref[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """What ``nn.Module.__call__`` runs for a watched root: its forward, recorded."""
    __tracebackhide__ = True  # pytest: a plain run has no such frame
    module = target()
    assert module is not None  # it is being called
    call_impl: Callable[..., Any] = module._call_impl
    if ((_COMPILER._is_compiling_flag if _COMPILER is not None else is_compiling())
            or (functorch_level is not None and functorch_level() is not None)):
        # torch.export; or torch.func, whose functional_call swapped the
        # parameters for its wrappers: nothing of ours to record or adopt.
        return call_impl(*args, **kwargs)
    for ref in _ADOPTERS:
        w = ref()
        if w is not None and id(module) not in w._seen and not w._closed:
            w._adopt_root(module)
    routes = _ROOTS.get(id(module))
    if routes is not None and len(routes) == 1:
        # One watcher of this root (the usual case): the loop below, unrolled.
        module_ref, watcher_ref, name = routes[0]
        w = watcher_ref()
        if module_ref() is not module or w is None or w._closed:
            return call_impl(*args, **kwargs)
        if not _grad_enabled() and not (w._synced or w._sharded):
            # A forward that saves nothing (an acting forward of a reinforcement
            # learning loop): Watcher._on_forward's no-grad path, inline. The
            # versions before it are the last event's: it leaves no event unless
            # it writes a watched tensor (versions only grow, so one read after
            # it tells).
            layout = w.ledger._layout
            if layout is not None:
                refs, last = layout[1], layout[3]
                # None if a watched tensor died: the full path drops it.
                before = read_versions(refs)
                if before == last:
                    n = w._forwards[name] = next(w._counters[name])
                    try:
                        result = call_impl(*args, **kwargs)
                    finally:
                        # A layout replaced meanwhile (a module adopted inside this
                        # forward) tracks more: the full path reads it.
                        if not w._closed and (w.ledger._layout is not layout
                                              or read_versions(refs) != last):
                            w._on_forward(name, False, (n, before))
                    if w._repair is not None and name in w._forwards:
                        w._repair.outputs(result, w._label(name, w._forwards[name]))
                    return result
        token = w._on_forward(name, True)
        try:
            result = call_impl(*args, **kwargs)
        finally:
            if not w._closed:
                w._on_forward(name, False, token)
        if w._repair is not None and name in w._forwards:
            w._repair.outputs(result, w._label(name, w._forwards[name]))
        return result
    live = []
    for module_ref, watcher_ref, name in routes or ():
        w = watcher_ref()
        if module_ref() is module and w is not None and not w._closed:
            live.append((w, name, w._on_forward(name, True)))
    try:
        result = call_impl(*args, **kwargs)
    finally:
        for w, name, token in live:
            if not w._closed:
                w._on_forward(name, False, token)
    for w, name, _ in live:
        # on_hazard="repair" remembers the graph, weakly (not for DDP's sync mark)
        if w._repair is not None and name in w._forwards:
            w._repair.outputs(result, w._label(name, w._forwards[name]))
    return result


_ROUTE = _Route()


def install() -> None:
    """Nothing process-wide: each root's class (or nn.Module, for an adopter) gets the route."""


def uninstall() -> None:
    """Take the route out of every class it is still in."""
    for cls in list(_PLACED):
        _unplace(cls)
