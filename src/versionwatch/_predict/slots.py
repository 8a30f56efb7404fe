"""Where each node type keeps its saved tensors, and which unpack hooks of ours to trust.

A node's saved variables are reached through generated attributes: a raw one
(``_raw_saved_self``: the ``SavedVariable`` itself, with its hooks) and a checked
one (``_saved_self``: the tensor, after PyTorch's version check). The *plan* of
a node type lists them once, on first sight, so that the predictor and the
repairer read a node with one dict lookup. Two node types are special: a custom
``autograd.Function`` keeps its tensors in ``saved_tensors`` (:data:`CUSTOM`), and
``CopySlices`` wraps a node that Python cannot reach (:data:`COPY_SLICES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

# (slot, raw getter, checked getter) for each saved-variable slot of a node type.
Plan = tuple[tuple[str, str, str], ...]

PLANS: dict[type, Plan] = {}
"""Node type -> its plan; empty for nodes that save nothing (AccumulateGrad, TBackward0)."""

CUSTOM: Plan = (("saved_tensors", "_raw_saved_tensors", "saved_tensors"),)
"""The plan of every custom ``autograd.Function`` node."""

# An in-place op on a view: CopySlices wraps the op's own node, which Python
# cannot reach (its saved tensors included); see Checker._copy_slices.
COPY_SLICES: Plan = (("fn", "", ""),)
"""The plan of ``CopySlices``: one pseudo-slot, checked by calling the node."""

_RAW_PREFIX = "_raw_saved_"


def plan_of(fn: Node) -> Plan:
    """The plan of ``fn``'s type, made and kept on first sight."""
    cls = type(fn)
    plan = PLANS.get(cls)
    if plan is None:
        if isinstance(fn, BackwardCFunction):
            plan = CUSTOM
        elif fn.name() == "torch::autograd::CopySlices":
            plan = COPY_SLICES
        else:
            plan = tuple(
                (a[len(_RAW_PREFIX):], a, "_saved_" + a[len(_RAW_PREFIX):])
                for a in dir(fn) if a.startswith(_RAW_PREFIX)
            )
        PLANS[cls] = plan
    return plan


def planned(nodes: Sequence[Node], executed: Sequence[bool] | None) -> Iterator[
        tuple[int, Node, Plan]]:
    """The nodes that run (all, or those marked in ``executed``) and save something.

    One dict lookup per node that saves nothing (AccumulateGrad, TBackward0, ...).
    """
    plans = PLANS
    for i, fn in enumerate(nodes):
        if executed is not None and not executed[i]:
            continue
        plan = plans.get(type(fn))
        if plan is None:
            plan = plan_of(fn)
        if plan:
            yield i, fn, plan


def hooked(raw: object) -> bool:
    """Whether the raw saved variable ``raw`` has an unpack hook."""
    return getattr(raw, "unpack_hook", None) is not None


# Unpack hooks of ours that return a copy taken before any write: such a slot
# is checked, never stale. Their owners register them at import (no cycle).
_TRUSTED: set[Callable[..., object]] = set()


def trust_unpack(hook: Callable[..., object]) -> None:
    """Count a slot behind ``hook`` (an unpack hook of ours) as checked, never stale."""
    _TRUSTED.add(hook)


def is_trusted(hook: object) -> bool:
    """Whether ``hook`` was registered with :func:`trust_unpack`."""
    return hook in _TRUSTED
