"""A repair's copy of a saved tensor, laid out so that backward reads it as it read the tensor.

The copy keeps the tensor's strides where that is cheap, and is compact
otherwise. A leaf under ``_repair``: torch only.
"""

from __future__ import annotations

import torch

__all__ = ["copy_as_laid_out", "span_bytes"]


def _laid_out(t: torch.Tensor) -> bool:
    """Whether :func:`copy_as_laid_out` keeps ``t``'s strides (else it clones compactly).

    A dense strided tensor that is not contiguous, whose elements span at most
    twice their number (a sliced ``w[:, ::2]``, not a column ``w[:, 0]`` of a
    large weight, which would hold the whole weight), with no dimension of
    size above one repeated at stride 0 (``expand``: no copy can be written so).
    """
    if t.layout is not torch.strided or t.is_nested or t.is_contiguous():
        return False
    n = t.numel()
    if n == 0 or any(st == 0 and size > 1 for size, st in zip(t.shape, t.stride())):
        return False
    return _span(t) <= 2 * n


def _span(t: torch.Tensor) -> int:
    return 1 + sum((size - 1) * st for size, st in zip(t.shape, t.stride()))


def span_bytes(t: torch.Tensor) -> int:
    """At most what :func:`copy_as_laid_out` allocates for ``t``."""
    n = t.numel()
    return (max(n, _span(t)) if _laid_out(t) else n) * t.element_size()


def copy_as_laid_out(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides, so that a kernel reads it as it read ``t``.

    ``clone()`` makes a sliced view (``w[:, ::2]``) contiguous, and a backward
    given other strides may pick another kernel, and round differently. See
    :func:`_laid_out` for the views that are cloned compactly all the same.
    """
    src = t.detach()  # no graph: cheaper than entering no_grad
    if not _laid_out(src):
        return src.clone()
    try:
        # new_empty_strided keeps a tensor subclass, as clone() does.
        out = src.new_empty_strided(src.size(), src.stride())
        out.copy_(src)
    except RuntimeError:  # strides no copy can write to (an overlap)
        return src.clone()
    return out
