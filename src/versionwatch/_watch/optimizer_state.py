"""What a watcher knows of one optimizer: its label, its step in flight, its watched params.

Plain data, importing nothing else of the watcher: the interception points and
the watcher's typed faces (``protocols``) name it without importing the tracker.
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import NamedTuple

import torch
from torch.optim import Optimizer

from versionwatch._ledger import Tracked
from versionwatch._report import Site


class PendingStep(NamedTuple):
    """A step between its pre- and post-hook.

    A named tuple made with ``tuple.__new__``: one object a step, no Python
    call. Params are held weakly: a step that raised never clears it.
    """

    label: str
    site: Site | None
    # (param, its version before) of the params it may update: only for a
    # fused step, or one after zero_grad(set_to_none=False) left grad marks.
    touched: list[tuple[weakref.ref[torch.Tensor], int]]
    notes: dict[int, str]  # param id -> the note its step event carries


class ParamCache:
    """An optimizer's watched params, reused while its groups hold the same tensors.

    Weak: an open watcher must not keep a deleted model's parameters alive.
    ``alive`` drops as soon as one of them dies (a weak reference's callback),
    so the per-step check is one comparison of the groups' param ids.
    """

    __slots__ = ("__weakref__", "alive", "ids", "refs", "tracked")

    def __init__(self, ids: list[int], params: list[torch.Tensor],
                 tracked: list[Tracked | None]) -> None:
        self.ids = ids  # the ids of every param of the groups, in order
        self.alive = True
        me = weakref.ref(self)

        def dead(_: object) -> None:
            cache = me()
            if cache is not None:
                cache.alive = False

        self.refs = [weakref.ref(p, dead) for p in params]
        self.tracked = tracked  # their ledger entries


def group_ids(opt: Optimizer) -> list[int]:
    """The ids of the params of ``opt``'s groups, in order: a swapped param changes them."""
    groups = opt.param_groups
    if len(groups) == 1:
        return list(map(id, groups[0]["params"]))
    return list(map(id, chain.from_iterable([g["params"] for g in groups])))


class OptimizerState:
    """What a watcher knows of one optimizer."""

    __slots__ = ("label", "named", "params", "pending", "ref", "steps", "zero_label")

    def __init__(self, opt: Optimizer, label: str, named: bool = True) -> None:
        self.ref = weakref.ref(opt)
        self.relabel(label, named)
        self.steps = 0
        self.pending: PendingStep | None = None
        self.params: ParamCache | None = None

    def relabel(self, label: str, named: bool = True) -> None:
        """Name it ``label``; ``named=False``: a class label, to be looked for again once."""
        self.label = label
        # False while its first step or zero_grad may still find the user's variable.
        self.named = named
        # The zero_grad event's label, by set_to_none (made once, not every step).
        self.zero_label = (f"{label}.zero_grad(set_to_none=False)",
                           f"{label}.zero_grad(set_to_none=True)")
