"""How a watcher sees a root module's forward while storing nothing on the module.

Module hooks live in the module's own hook dicts, and whatever copies a module
copies them: ``pickle`` and ``torch.save`` fail on a local function,
``copy.deepcopy`` hands them to EMA and checkpoint copies that outlive the
watcher, and ``torch.jit.script`` tries to compile them. Instead, while a
watcher is open, the class attribute ``nn.Module._compiled_call_impl`` (``None``,
set on an instance by ``module.compile()``) is a descriptor. ``nn.Module.__call__``
reads it first, and calls what it gives instead of ``_call_impl``: for a watched
root (or, under ``watch_all``, a module not seen yet) a call that records the
forward around ``_call_impl`` (or around the module's own compiled call, which
``module.compile()`` keeps in the instance's dict); for any other module what
a plain run reads there (``None``, or that compiled call). Roots are held by
weak reference.

A module hook, even a global one, sends every call down ``nn.Module``'s slow
path; wrapping ``_call_impl`` adds a Python frame to every module call, and
shows it in every traceback. The descriptor costs an unwatched module one small
call and a dict lookup, and it leaves ``_call_impl`` as it is, so
``torch.compile`` still traces a module's ``forward`` directly.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from torch import nn

from versionwatch._compat import COMPILER_FLAG_OWNER, is_compiling, is_tracing
from versionwatch._functorch import functorch_level
from versionwatch._runtime import (
    Anchor,
    Change,
    Patch,
    Registry,
    Removable,
    Subscription,
    anchor,
    remove_all,
)

if TYPE_CHECKING:
    from versionwatch._watch.protocols import Adopter, ForwardWatcher

# torch.compiler, whose flag is_compiling() returns outside TorchScript: read
# inline at every watched forward (the call costs more than the answer).
_COMPILER: Any = COMPILER_FLAG_OWNER
_grad_enabled = torch.is_grad_enabled


class Route(NamedTuple):
    """A watcher's route for one root module: its forwards go to ``watcher``, as ``name``.

    A named tuple: the per-call lookup unpacks it as fast as a plain tuple.
    """

    module: weakref.ref[nn.Module]
    watcher: weakref.ref[ForwardWatcher]
    name: str


# Every route, oldest first; a route leaves with its watcher or its module.
ROUTES: Registry[Route] = Registry("forward routes", on_change=lambda live: _routes_changed(live))
# Open watchers that adopt every module run outside the roots they know (watch_all).
ADOPTERS: Registry[Adopter] = Registry("forward adopters", weak=True,
                                   on_change=lambda live: _adopters_changed(live))

# Lock-free copies for the per-call path, replaced (never changed) by the
# registries' on_change. id(root module) -> its routes, in registration order:
_ROOTS: dict[int, list[Route]] = {}
# id(root module) -> what the route gives for it: a call of _call with a weak
# reference to the root (a partial that held the module would keep it alive).
_CALLS: dict[int, functools.partial[Any]] = {}
_ADOPTERS: list[weakref.ref[Adopter]] = []
# With one adopter open (the usual watch_all), its dict of seen module ids:
# the route's lookup for a module it has seen, without calling its reference.
_ONE_SEEN: list[dict[int, weakref.ref[nn.Module]]] = []


def _routes_changed(live: list[Route]) -> None:
    global _ROOTS, _CALLS
    roots: dict[int, list[Route]] = {}
    calls: dict[int, functools.partial[Any]] = {}
    for route in live:
        module = route.module()
        if module is None:
            continue
        key = id(module)
        roots.setdefault(key, []).append(route)
        if key not in calls:
            # Made once per root: nn.Module.__call__ reads the attribute twice a call.
            old = _CALLS.get(key)
            calls[key] = old if old is not None and old.args[0]() is module \
                else functools.partial(_call, weakref.ref(module))
    _ROOTS, _CALLS = roots, calls


def _adopters_changed(live: list[Adopter]) -> None:
    global _ADOPTERS, _ONE_SEEN
    _ADOPTERS = [weakref.ref(w) for w in live]
    _ONE_SEEN = [live[0].seen] if len(live) == 1 else []


def add_root(module: nn.Module, watcher: ForwardWatcher, name: str) -> Subscription:
    """Call ``watcher._on_forward(name, ...)`` around every call of ``module``.

    A container with no forward of its own (``nn.ModuleDict``, ``nn.ModuleList``)
    is never called: its members are, each a root of its own, as ``name.key``.
    """
    if _is_container(module):
        return _add_members(module, watcher, name)
    place = _route_on(type(module)).subscribe()
    route: Route | None = None

    def gone(_: object) -> None:
        # A dead root's id may be reused by a module nobody watches.
        if route is not None:
            ROUTES.discard(route)

    route = Route(weakref.ref(module, gone), weakref.ref(watcher), name)
    try:
        entry = ROUTES.add(route)
    except BaseException:
        place.remove()
        raise

    def remove() -> None:
        try:
            entry.remove()
        finally:
            place.remove()

    return Subscription(remove)


def _is_container(module: nn.Module) -> bool:
    """A module that cannot be called: no ``forward`` of its class or of its own.

    ``torch.compile``'s ``OptimizedModule`` defines no ``forward`` in its class but
    sets one on the instance (and keeps the compiled module as ``_orig_mod``): it is
    called, so it is no container.
    """
    # The class's own attribute, found without calling a descriptor: a ScriptModule's
    # ``forward`` is one that fails when read from the class.
    for klass in type(module).__mro__:
        if "forward" in vars(klass):
            if vars(klass)["forward"] is not nn.Module.forward:
                return False
            break
    return "forward" not in vars(module) and "_orig_mod" not in vars(module).get("_modules", {})


def _add_members(container: nn.Module, watcher: ForwardWatcher, name: str) -> Subscription:
    """Routes for a container's members, called directly (``models["D"](x)``).

    Only a container that cannot be called gets them: a root called directly
    (the usual case) routes its own calls alone, and its members cost nothing.
    """
    held: list[Removable] = []
    try:
        for key, member in container.named_children():
            route = f"{name}.{key}"
            watcher.forwards.setdefault(route, 0)
            watcher.counters.setdefault(route, itertools.count(1))
            held.append(add_root(member, watcher, route))
    except BaseException:
        remove_all(held)
        raise
    return Subscription(lambda: remove_all(held))


def add_adopter(watcher: Adopter) -> Subscription:
    """Call ``watcher._adopt_root(module)`` for each module whose id is not in ``watcher.seen``.

    It runs before the module's routes are looked up, so an adopted root's
    first forward is recorded too.
    """
    place = _route_on(nn.Module).subscribe()
    try:
        entry = ADOPTERS.add(watcher)
    except BaseException:
        place.remove()
        raise

    def remove() -> None:
        try:
            entry.remove()
        finally:
            place.remove()

    return Subscription(remove)


def _route_on(cls: type[nn.Module]) -> Anchor:
    """The route placed on ``cls`` while anyone holds it.

    A root's own class is enough to see its calls (subclasses inherit the
    attribute), and its children, of other classes, then skip the route's
    Python call altogether: about 0.3 us per module call. Only an adopter
    (watch_all), which must see every module's first call, holds nn.Module.
    """

    def changes() -> list[Change]:
        own = vars(cls).get("_compiled_call_impl")
        if own is not None:
            # The class brings its own: the route in nn.Module (or a base)
            # would be shadowed as well; leave the class as it is.
            return []
        return [Patch(cls, "_compiled_call_impl", _ROUTE)]

    return anchor(("forward route", cls), f"forward route on {cls.__qualname__}", changes)


_OWN = "_compiled_call_impl"
# Ids of modules that may hold their own compiled call (``module.compile()``):
# set through the route, or found when the adopter first saw the module. A
# module the one adopter has seen is answered without reading its dict unless
# it is here. A hint: an id may outlive its module.
_OWNS: set[int] = set()


def note_own(module: nn.Module) -> None:
    """``module`` is seen by an adopter: remember whether it has its own compiled call."""
    if vars(module).get(_OWN) is not None:
        _OWNS.add(id(module))


class _Route:
    """``nn.Module._compiled_call_impl`` while a watcher is open.

    A data descriptor, so that a module's own compiled call (``module.compile()``
    sets one on the instance) cannot hide its forwards: it is stored in the
    instance's dict, as without the route (so it stays there, and pickles and
    copies as plain), and read from there: a watched root's call runs through
    it, any other module gets it as unwatched.
    """

    __slots__ = ()

    def __get__(self, module: nn.Module | None, owner: type | None = None) -> Any:
        if module is None:
            return None
        # Inside a trace: nothing to record, and id(module) would make the
        # trace guard on this very module, and recompile for the next one.
        if is_tracing():
            return vars(module).get(_OWN)
        key = id(module)
        call = _CALLS.get(key)
        if call is not None:
            return call
        if _ONE_SEEN and key in _ONE_SEEN[0]:
            # the one adopter saw it: every call of a submodule ends here
            return vars(module).get(_OWN) if _OWNS and key in _OWNS else None
        for ref in _ADOPTERS:
            adopter = ref()
            if adopter is not None and key not in adopter.seen and not adopter.closed:
                return functools.partial(_call, weakref.ref(module))
        return vars(module).get(_OWN)

    def __set__(self, module: nn.Module, value: Any) -> None:
        vars(module)[_OWN] = value
        if value is not None:
            _OWNS.add(id(module))

    def __delete__(self, module: nn.Module) -> None:
        try:
            del vars(module)[_OWN]
        except KeyError:
            raise AttributeError(
                f"{type(module).__name__!r} object has no attribute {_OWN!r}") from None


def _call(target: weakref.ref[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """What ``nn.Module.__call__`` runs for a watched root: its forward, recorded."""
    __tracebackhide__ = True  # pytest: a plain run has no such frame
    module = target()
    assert module is not None  # it is being called
    # Its own compiled call (module.compile()), else the plain one.
    call_impl: Callable[..., Any] = vars(module).get(_OWN) or module._call_impl
    if ((_COMPILER._is_compiling_flag if _COMPILER is not None else is_compiling())
            or (functorch_level is not None and functorch_level() is not None)):
        # torch.export; or torch.func, whose functional_call swapped the
        # parameters for its wrappers: nothing of ours to record or adopt.
        return call_impl(*args, **kwargs)
    for ref in _ADOPTERS:
        adopter = ref()
        if adopter is not None and id(module) not in adopter.seen and not adopter.closed:
            adopter._adopt_root(module, sys._getframe(1))
    routes = _ROOTS.get(id(module))
    if routes is not None and len(routes) == 1:
        # One watcher of this root (the usual case): the loop below, unrolled.
        module_ref, watcher_ref, name = routes[0]
        w = watcher_ref()
        if module_ref() is not module or w is None or w.closed:
            return call_impl(*args, **kwargs)
        if not _grad_enabled() and not (w.synced or w.sharded):
            # A forward that saves nothing (an acting forward of a reinforcement
            # learning loop): Watcher._on_forward's no-grad path, inline. The
            # versions before it are the last event's: it leaves no event unless
            # it writes a watched tensor (versions only grow, so one read after
            # it tells).
            layout = w.ledger._layout
            if layout is not None:
                # None if a watched tensor died: the full path drops it.
                before = layout.unchanged_since()
                if before is not None:
                    n = w.forwards[name] = next(w.counters[name])
                    try:
                        result = call_impl(*args, **kwargs)
                    finally:
                        # A layout replaced meanwhile (a module adopted inside this
                        # forward) tracks more: the full path reads it.
                        if not w.closed and (w.ledger._layout is not layout
                                              or layout.unchanged_since() is None):
                            w._on_forward(name, False, (n, before))
                    if w.repairer is not None and name in w.forwards:
                        w.repairer.outputs(result, w.forward_label(name, w.forwards[name]))
                    return result
        token = w._on_forward(name, True)
        try:
            result = call_impl(*args, **kwargs)
        finally:
            if not w.closed:
                w._on_forward(name, False, token)
        if w.repairer is not None and name in w.forwards:
            w.repairer.outputs(result, w.forward_label(name, w.forwards[name]))
        return result
    live = []
    for module_ref, watcher_ref, name in routes or ():
        w = watcher_ref()
        if module_ref() is module and w is not None and not w.closed:
            live.append((w, name, w._on_forward(name, True)))
    try:
        result = call_impl(*args, **kwargs)
    finally:
        for w, name, token in live:
            if not w.closed:
                w._on_forward(name, False, token)
    for w, name, _ in live:
        # on_hazard="repair" remembers the graph, weakly (not for DDP's sync mark)
        if w.repairer is not None and name in w.forwards:
            w.repairer.outputs(result, w.forward_label(name, w.forwards[name]))
    return result


_ROUTE = _Route()
