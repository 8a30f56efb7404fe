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

from torch import nn

from versionwatch._compat import is_compiling, is_tracing
from versionwatch._functorch import in_functorch_transform

# id(root module) -> (module ref, watcher ref, root name), in registration order.
_Entry = tuple["weakref.ref[nn.Module]", "weakref.ref[Any]", str]
_ROOTS: dict[int, list[_Entry]] = {}
# Open watchers that adopt every module run outside the roots they know (watch_all).
_ADOPTERS: list[weakref.ref[Any]] = []
_ORIGINAL: list[Any] = []  # what nn.Module._compiled_call_impl was: None


class Handle:
    """Takes one entry out of the registry, as a ``RemovableHandle`` removes a hook."""

    __slots__ = ("_entry", "_key")

    def __init__(self, key: int | None, entry: Any) -> None:
        self._key = key
        self._entry = entry

    def remove(self) -> None:
        entries: list[Any] | None = _ADOPTERS if self._key is None else _ROOTS.get(self._key)
        if entries is None:
            return
        entries[:] = [e for e in entries if e is not self._entry]
        if not entries and self._key is not None:
            _ROOTS.pop(self._key, None)


def add_root(module: nn.Module, watcher: Any, name: str) -> Handle:
    """Call ``watcher._on_forward(name, pre)`` around every call of ``module``."""
    key = id(module)

    def gone(ref: weakref.ref[nn.Module]) -> None:
        # A dead root's id may be reused by a module nobody watches.
        routes = _ROOTS.get(key)
        if routes is not None:
            routes[:] = [r for r in routes if r[0] is not ref]
            if not routes:
                _ROOTS.pop(key, None)

    route: _Entry = (weakref.ref(module, gone), weakref.ref(watcher), name)
    _ROOTS.setdefault(key, []).append(route)
    return Handle(key, route)


def add_adopter(watcher: Any) -> Handle:
    """Call ``watcher._adopt_root(module)`` for each module whose id is not in ``watcher._seen``.

    It runs before the module's routes are looked up, so an adopted root's
    first forward is recorded too.
    """
    entry = weakref.ref(watcher)
    _ADOPTERS.append(entry)
    return Handle(None, entry)




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
        if key in _ROOTS:
            return functools.partial(_call, module)
        for ref in _ADOPTERS:
            w = ref()
            if w is not None and key not in w._seen and not w._closed:
                return functools.partial(_call, module)
        return None


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What ``nn.Module.__call__`` runs for a watched root: its forward, recorded."""
    __tracebackhide__ = True  # pytest: a plain run has no such frame
    call_impl: Callable[..., Any] = module._call_impl
    if is_compiling() or in_functorch_transform():
        # torch.export; or torch.func, whose functional_call swapped the
        # parameters for its wrappers: nothing of ours to record or adopt.
        return call_impl(*args, **kwargs)
    for ref in _ADOPTERS:
        w = ref()
        if w is not None and id(module) not in w._seen and not w._closed:
            w._adopt_root(module)
    routes = _ROOTS.get(id(module))
    live = []
    for module_ref, watcher_ref, name in routes or ():
        w = watcher_ref()
        if module_ref() is module and w is not None and not w._closed:
            live.append((w, name))
    for w, name in live:
        w._on_forward(name, True)
    try:
        result = call_impl(*args, **kwargs)
    finally:
        for w, name in live:
            if not w._closed:
                w._on_forward(name, False)
    for w, name in live:
        if w._repair is not None:  # on_hazard="repair" remembers the graph, weakly
            w._repair.outputs(result, w._label(name, w._forwards[name]))
    return result


def install() -> None:
    """Route module calls through :class:`_Route` (process-wide, until :func:`uninstall`)."""
    _ORIGINAL.append(vars(nn.Module)["_compiled_call_impl"])
    route: Any = _Route()  # the attribute is typed as a callable, which a descriptor is not
    nn.Module._compiled_call_impl = route


def uninstall() -> None:
    if _ORIGINAL:
        nn.Module._compiled_call_impl = _ORIGINAL.pop()
