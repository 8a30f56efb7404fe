"""Display names for tensors: qualified parameter and buffer names."""

from __future__ import annotations

import linecache
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any, Union

import torch
from torch import nn

from versionwatch._compat import fsdp_unsharded

Names = Union[nn.Module, Mapping[str, nn.Module], Mapping[torch.Tensor, str]]


def module_tensors(module: nn.Module, prefix: str = "") -> dict[int, tuple[str, torch.Tensor]]:
    """``id(tensor) -> (qualified name, tensor)`` for a module's parameters and buffers.

    A parameter shared by two submodules keeps its first name, as
    ``named_parameters()`` reports it. Names are the ones users write: ``cm.weight``
    for ``torch.compile``'s ``cm._orig_mod.weight``.
    """
    compiled = _wrapper_paths(module)
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (prefix + _user_name(name, compiled), p))
    for name, b in module.named_buffers(remove_duplicate=False):
        out.setdefault(id(b), (prefix + _user_name(name, compiled), b))
    if has_fsdp(module):
        quals = {id(m): q for q, m in module.named_modules(remove_duplicate=False)}
        for sub in module.modules():
            for owner, pname, t in fsdp_unsharded(sub):
                qual = quals.get(id(owner))
                if qual is not None:
                    name = f"{qual}.{pname}" if qual else pname
                    out.setdefault(id(t), (prefix + _user_name(name, compiled), t))
    return out


def has_fsdp(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` manages ``module`` or one of its submodules."""
    return any(hasattr(m, "_get_fsdp_state") for m in module.modules())


# Wrappers whose wrapped module is one attribute away, by the module that
# defines each class and the attribute: torch.compile's OptimizedModule
# (``_orig_mod``), DistributedDataParallel and DataParallel (``module``), FSDP1
# and the activation checkpoint wrapper (whose own state_dict hooks drop theirs).
_WRAPPERS = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel",
     "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
     "_checkpoint_wrapped_module"),
)


def _wrapper_paths(module: nn.Module) -> frozenset[str]:
    """The paths (``enc._orig_mod``, ``D.module``) of wrapped modules under their wrappers."""
    # Each class is looked up where it is defined, once its module is loaded:
    # a program that never wraps imports nothing for us.
    found: list[tuple[type, str]] = []
    for where, name, attr in _WRAPPERS:
        cls = getattr(sys.modules.get(where), name, None)
        if isinstance(cls, type):
            found.append((cls, attr))
    if not found:
        return frozenset()
    out = []
    for qual, sub in module.named_modules(remove_duplicate=False):
        for cls, attr in found:
            if isinstance(sub, cls):
                out.append(f"{qual}.{attr}" if qual else attr)
    return frozenset(out)


def _user_name(name: str, wrapped: frozenset[str]) -> str:
    # A wrapper forwards attribute access (OptimizedModule) or is unwrapped by
    # users (ddp.module), who write cm.weight and D.2.weight: drop the segments
    # that lead from a wrapper to the module it wraps.
    if not wrapped:
        return name
    parts = name.split(".")
    return ".".join(part for i, part in enumerate(parts)
                    if ".".join(parts[:i + 1]) not in wrapped)


def resolve_names(names: Names | None) -> dict[int, str]:
    """Turn the ``names=`` argument of :func:`versionwatch.check` into ``id -> name``."""
    if names is None:
        return {}
    if isinstance(names, nn.Module):
        return {k: v[0] for k, v in module_tensors(names).items()}
    if not isinstance(names, Mapping):
        raise TypeError(
            "names must be an nn.Module, a dict of named modules, or a dict from tensors "
            f"to names; got {type(names).__name__}"
        )
    out: dict[int, str] = {}
    for key, value in names.items():
        if isinstance(key, str) and isinstance(value, nn.Module):
            out.update({k: v[0] for k, v in module_tensors(value, key + ".").items()})
        elif isinstance(key, torch.Tensor) and isinstance(value, str):
            out[id(key)] = value
        else:
            raise TypeError(
                "names must map str -> nn.Module or torch.Tensor -> str; got "
                f"{type(key).__name__} -> {type(value).__name__}"
            )
    return out


def name_of(t: torch.Tensor, names: Mapping[int, str]) -> tuple[str | None, bool]:
    """The tensor's name and whether it is only a view of the named tensor."""
    name = names.get(id(t))
    if name is not None:
        return name, False
    base = t._base
    if base is not None:
        name = names.get(id(base))
        if name is not None:
            return name, True
    return None, False


# Values that never wrap an optimizer: skipped before ``vars()``.
_PLAIN = (int, float, str, bytes, bool, type(None), torch.Tensor, nn.Module, type)


def holds(value: Any, opt: torch.optim.Optimizer) -> bool:
    """``value`` is ``opt``, or a wrapper of it that keeps it in its instance dict.

    Lightning's ``LightningOptimizer`` (``_optimizer``), Accelerate's
    ``AcceleratedOptimizer`` (``optimizer``).
    """
    if value is opt:
        return True
    if isinstance(value, _PLAIN):
        return False
    try:
        inner = object.__getattribute__(value, "__dict__")
    except Exception:  # no instance dict (slots, builtins)
        return False
    if not isinstance(inner, dict):
        return False
    return inner.get("_optimizer") is opt or inner.get("optimizer") is opt


def optimizer_names(opt: torch.optim.Optimizer, frame: FrameType | None,
                    library: Callable[[str], bool]) -> Iterator[str]:
    """The user's names for ``opt`` (``opt_d``, ``self.critic_opt``), best first.

    The frames from ``frame`` up that lie outside the libraries (``library(filename)``
    says which), outermost first: the loop that owns ``opt_d`` names it, not a
    helper's ``opt`` parameter it was passed to. In each frame: its locals, its
    ``self``'s attributes (as ``self.name``), its globals; names that start with
    ``_`` are skipped. Within a frame the names its current line mentions come
    first (``opt.step()`` after ``opt = opt_d``), then the order of the scopes:
    deterministic for a program. Called once per optimizer, never per step: it
    reads whole namespaces.

    Example:
        >>> import sys, torch
        >>> opt_d = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> next(optimizer_names(opt_d, sys._getframe(), lambda f: False))
        'opt_d'
    """
    frames = []
    while frame is not None:
        if not library(frame.f_code.co_filename):
            frames.append(frame)
        frame = frame.f_back
    seen: set[str] = set()
    for frame in reversed(frames):
        found: list[str] = []
        local = frame.f_locals
        scopes: list[tuple[str, Mapping[str, Any]]] = [("", local)]
        me = local.get("self")
        mine = getattr(me, "__dict__", None) if me is not None else None
        if isinstance(mine, dict):
            scopes.append(("self.", mine))
        if frame.f_globals is not local:
            scopes.append(("", frame.f_globals))
        for prefix, scope in scopes:
            for var, value in list(scope.items()):
                if isinstance(var, str) and not var.startswith("_") and holds(value, opt):
                    name = prefix + var
                    if name not in seen:
                        seen.add(name)
                        found.append(name)
        del scopes, me, mine
        _drop_snapshot(frame, local)
        del local
        if found:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            # sorted() is stable: the mentioned names first, each group in order.
            yield from sorted(found, key=lambda n: re.search(
                rf"(?<![\w.]){re.escape(n)}\b", line) is None)


# The flag of a function's code: its locals live in fast slots, and f_locals (before
# Python 3.13) is a dict copied from them, kept on the frame.
_CO_OPTIMIZED = 0x1


def _drop_snapshot(frame: FrameType, local: Mapping[str, Any]) -> None:
    """Empty the copy of a running function's locals that reading ``f_locals`` made.

    Before Python 3.13 that copy stays on the frame and holds every local's value
    as it was: a model the program then deletes (``del model`` in a sweep) would
    live on in it. Emptied only when nothing but the frame holds it (a program's
    own ``d = locals()`` keeps it whole); the next ``locals()``, debugger or tracer
    refills it from the frame, as it would anyway.
    """
    if type(local) is not dict or not frame.f_code.co_flags & _CO_OPTIMIZED:
        return  # a module's or class body's namespace, or 3.13's write-through view
    # The frame's slot, ``local`` here, the caller's name and getrefcount's argument.
    if sys.getrefcount(local) <= 4:
        local.clear()


def unique_label(names: Iterator[str], fallback: str, taken: Callable[[str], bool]) -> str:
    """The first of ``names`` not ``taken``, else the first numbered (``opt[1]``).

    With no name at all, ``fallback`` (the class), numbered likewise: two
    optimizers never share a label.
    """
    first = None
    for name in names:
        if not taken(name):
            return name
        first = first or name
    base = first or fallback
    if not taken(base):
        return base
    k = 1
    while taken(f"{base}[{k}]"):
        k += 1
    return f"{base}[{k}]"
