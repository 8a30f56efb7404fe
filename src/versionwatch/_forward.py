"""How a watcher sees a root module's forward while storing nothing on the module.

Module hooks live in the module's own hook dicts, and whatever copies a module
copies them: ``pickle`` and ``torch.save`` fail on a local function,
``copy.deepcopy`` hands them to EMA and checkpoint copies that outlive the
watcher, and ``torch.jit.script`` tries to compile them. Instead, while a
watcher is open, ``nn.Module._call_impl`` is replaced by a thin wrapper that
looks each called module up in a registry of watched roots, held by weak
reference. A module hook, even a global one, would also send every call down
``nn.Module``'s slow path; the wrapper keeps the fast path and costs a module
nobody watches one ``is_dynamo_compiling()`` call and one dict lookup.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn

# id(root module) -> (module ref, watcher ref, root name), in registration order.
_Route = tuple["weakref.ref[nn.Module]", "weakref.ref[Any]", str]
_ROOTS: dict[int, list[_Route]] = {}
# Open watchers that adopt every module run outside the roots they know (watch_all).
_ADOPTERS: list[weakref.ref[Any]] = []
_ORIGINAL: list[Callable[..., Any]] = []


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

    route: _Route = (weakref.ref(module, gone), weakref.ref(watcher), name)
    _ROOTS.setdefault(key, []).append(route)
    return Handle(key, route)


def add_adopter(watcher: Any) -> Handle:
    """Call ``watcher._adopt_root(module)`` for each module whose id is not in ``watcher._seen``.

    It runs before the module's routes are looked up, so an adopted root's
    first forward is seen too.
    """
    entry = weakref.ref(watcher)
    _ADOPTERS.append(entry)
    return Handle(None, entry)


def _wrap(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    roots, adopters = _ROOTS, _ADOPTERS
    is_compiling = torch.compiler.is_compiling
    # Folded to True inside a torch.compile trace, and three times cheaper than
    # is_compiling(), which also covers torch.export and is asked only for roots.
    is_tracing = torch.compiler.is_dynamo_compiling

    @functools.wraps(call_impl)
    def _call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # pytest: a plain run has no such frame
        # Inside a trace: record nothing, break no graph. Asked first: id(self)
        # would make the trace guard on this very module, and recompile for the next.
        if is_tracing():
            return call_impl(self, *args, **kwargs)
        if adopters:
            _adopt(self)
        routes = roots.get(id(self))
        if routes is None or is_compiling():
            return call_impl(self, *args, **kwargs)
        live = []
        for module_ref, watcher_ref, name in routes:
            w = watcher_ref()
            if module_ref() is self and w is not None and not w._closed:
                live.append((w, name))
        for w, name in live:
            w._on_forward(name, True)
        try:
            return call_impl(self, *args, **kwargs)
        finally:
            for w, name in live:
                if not w._closed:
                    w._on_forward(name, False)

    return _call_impl


def _adopt(module: nn.Module) -> None:
    for ref in _ADOPTERS:
        w = ref()
        if w is not None and id(module) not in w._seen and not w._closed and not (
                torch.compiler.is_compiling()):
            w._adopt_root(module)


def install() -> None:
    """Wrap ``nn.Module._call_impl`` (process-wide, until :func:`uninstall`)."""
    original = vars(nn.Module)["_call_impl"]
    _ORIGINAL.append(original)
    nn.Module._call_impl = _wrap(original)  # type: ignore[method-assign]


def uninstall() -> None:
    if _ORIGINAL:
        nn.Module._call_impl = _ORIGINAL.pop()  # type: ignore[method-assign]
