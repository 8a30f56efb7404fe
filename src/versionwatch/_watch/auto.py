"""Zero-code watching: every module and optimizer a program creates.

The forward route (:mod:`versionwatch._watch.forward`) offers each module call to the
watcher, which adopts a module the first time it runs outside any adopted
module: that module is a root. Its submodules are remembered, so the
steady-state cost is one set lookup per module call. Optimizers are adopted by
the watcher's global step hooks the first time they step a watched parameter.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType

from torch import nn

from versionwatch import _distributed
from versionwatch._runtime import Removable, Subscription, remove_all
from versionwatch._watch import forward as _forward
from versionwatch._watch.policy import Policy
from versionwatch._watch.watcher import _LOCK, Watcher, _variable_name


class AutoWatcher(Watcher):
    """A :class:`Watcher` that adopts every root module when it first runs.

    Create it with :func:`versionwatch.watch_all`.

    A program run under it (``versionwatch run``, ``pytest --versionwatch``) may
    watch a model itself: ``watch(model)`` borrows the model for its span. A
    root this watcher adopted stops being recorded here (its tensors stay
    tracked) and is recorded again from the borrower's ``close()``; a module
    not run yet is not adopted during the span, and is adopted when it next
    runs after it. The borrower's own policy applies to its backwards, and the
    reports it keeps are kept here too, once each.
    """

    lends_roots = True
    # Roots appear one by one here, so labels always carry the root's name.
    root_in_labels = True

    def __init__(self, on_hazard: Policy = "raise", strict: bool = False,
                 stop_at_write: bool = False, repair_budget: int | None = None,
                 fingerprint: bool = False) -> None:
        super().__init__({}, (), on_hazard, strict=strict, stop_at_write=stop_at_write,
                         repair_budget=repair_budget, fingerprint=fingerprint)
        # id -> weak reference of every module adopted or skipped: asked at each
        # module call, where a WeakSet's lookup cost four times as much.
        self.seen: dict[int, weakref.ref[nn.Module]] = {}
        try:
            self._held.append(_forward.add_adopter(self))
        except BaseException:
            self.close()
            raise
        # (rank, world_size) when a root was adopted in a process group: the
        # group may be gone by the time ``versionwatch run`` names its files.
        self.rank_seen: tuple[int, int] | None = None

    def _adopt_root(self, module: nn.Module, caller: FrameType | None = None) -> None:
        """Watch ``module``, a root seen running: named as in ``caller`` (its caller's frame)."""
        if next(module.parameters(), None) is None and next(module.buffers(), None) is None:
            self._see(module)  # a loss function: nothing to watch
            return
        # Once per root: DDP and FSDP2 roots first run inside their process group.
        self.rank_seen = _distributed.rank() or self.rank_seen
        name = _variable_name(module, caller if caller is not None else sys._getframe(1))
        taken = set(self.roots)
        unique, k = name, 1
        while unique in taken:
            k += 1
            unique = f"{name}{k}"
        for sub in module.modules():
            self._see(sub)
        self._add_root(unique, module)

    def _lend(self, module: nn.Module) -> Removable:
        with _LOCK:
            name = next((n for n, r in self.roots.items() if r() is module), None)
            if name is not None:
                routes = self._routes.pop(name, [])
                for route in routes:
                    self._held.remove(route)
                remove_all(routes)  # tensors stay tracked: the ledger goes on after
                # Weakly: a borrower left open keeps neither this watcher nor the module.
                me, lent = weakref.ref(self), weakref.ref(module)

                def give_back() -> None:
                    with _LOCK:
                        lender, module = me(), lent()
                        if lender is None or module is None or lender.closed:
                            return
                        ref = lender.roots.get(name)
                        if ref is not None and ref() is module:
                            lender._route(name, module)

                return Subscription(give_back)
            # Not adopted: its calls (and its submodules') must not adopt it meanwhile.
            added = [sub for sub in module.modules() if id(sub) not in self.seen]
            for sub in added:
                self._see(sub)
            keys = [(id(sub), self.seen[id(sub)]) for sub in added]
            seen = self.seen

            def forget() -> None:
                with _LOCK:
                    for key, ref in keys:
                        if seen.get(key) is ref:
                            del seen[key]

            return Subscription(forget)

    def _see(self, module: nn.Module) -> None:
        seen, key = self.seen, id(module)

        def forget(ref: weakref.ref[nn.Module]) -> None:
            if seen.get(key) is ref:  # its id may be reused by a module not seen yet
                del seen[key]

        seen[key] = weakref.ref(module, forget)
        _forward.note_own(module)  # its own compiled call, if any, is read through the route


def watch_all(on_hazard: Policy = "raise", strict: bool = False,
              stop_at_write: bool = False, repair_budget: int | None = None,
              fingerprint: bool = False) -> AutoWatcher:
    """Watch every module and optimizer the program uses from now on.

    This is what ``versionwatch run`` and ``pytest --versionwatch`` use. Root
    modules are named by the variable that holds them where the call happens
    (``model.w3``), else by their class (``Model.w3``).

    Args:
        on_hazard: as in :func:`versionwatch.watch`.
        strict: as in :func:`versionwatch.watch`.
        stop_at_write: as in :func:`versionwatch.watch`.
        repair_budget: as in :func:`versionwatch.watch`.
        fingerprint: as in :func:`versionwatch.watch` (with ``strict`` only).

    Example:
        >>> import torch, versionwatch
        >>> with versionwatch.watch_all() as w:
        ...     model = torch.nn.Linear(2, 1)
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> sorted(w.ledger.by_name)
        ['model.bias', 'model.weight']
    """
    return AutoWatcher(on_hazard, strict, stop_at_write, repair_budget, fingerprint)
