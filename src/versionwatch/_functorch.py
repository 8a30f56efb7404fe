"""Whether ``torch.func`` (functorch) is transforming the code that runs now.

Inside ``grad``, ``vjp``, ``jacrev``, ``hessian`` or ``vmap``, tensors are
functorch wrappers whose autograd graph lives at a transform level that Python
cannot walk (``vjp``'s backward runs outside any level, on wrapped tensors), so
versionwatch steps aside there: it predicts nothing and records nothing, and
the transform runs exactly as unwatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

_functorch = getattr(torch._C, "_functorch", None)
_level: Callable[[], Any] | None = getattr(_functorch, "maybe_current_level", None)
functorch_level = _level
"""``maybe_current_level``: not None inside a transform (read inline by hot callers)."""
_wrapped: Callable[[torch.Tensor], bool] | None = getattr(
    _functorch, "is_functorch_wrapped_tensor", None)


def in_functorch_transform(*values: object) -> bool:
    """True inside a ``torch.func`` transform, or when ``values`` hold its wrapped tensors.

    Args:
        *values: tensors, or sequences of tensors (a backward's outputs and inputs),
            checked for functorch wrappers; anything else is ignored.
    """
    if _level is not None and _level() is not None:
        return True
    if _wrapped is None:
        return False
    for value in values:
        if value is None:  # no inputs=: skip the Sequence check, an ABC's (slow)
            continue
        if isinstance(value, torch.Tensor):
            if _wrapped(value):
                return True
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if any(isinstance(t, torch.Tensor) and _wrapped(t) for t in value):
                return True
    return False
