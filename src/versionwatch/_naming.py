"""Display names for tensors: qualified parameter and buffer names."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Union

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
    compiled = _compiled_paths(module)
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


def _compiled_paths(module: nn.Module) -> frozenset[str]:
    """The paths (``enc._orig_mod``) of the modules that ``torch.compile`` wrapped."""
    # Loaded by torch.compile itself: no OptimizedModule exists before.
    frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(frame, "OptimizedModule", None)
    if cls is None:
        return frozenset()
    return frozenset(
        f"{qual}._orig_mod" if qual else "_orig_mod"
        for qual, sub in module.named_modules(remove_duplicate=False) if isinstance(sub, cls)
    )


def _user_name(name: str, compiled: frozenset[str]) -> str:
    # An OptimizedModule forwards attribute access to the module it wraps, so
    # users write cm.weight: drop the _orig_mod segments of wrapped modules.
    if not compiled or "_orig_mod" not in name:
        return name
    parts = name.split(".")
    return ".".join(part for i, part in enumerate(parts)
                    if part != "_orig_mod" or ".".join(parts[:i + 1]) not in compiled)


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
