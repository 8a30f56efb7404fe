"""What a watcher needs to know about ``torch.distributed``: the rank, and DDP.

Nothing here imports ``torch.distributed``: a program that uses it has imported
it already, so a lookup in ``sys.modules`` answers, and a program that does not
pays nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from torch import nn


def rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` of this process, or None when it runs alone.

    A process group, once one exists, is the truth (``mp.spawn`` sets no
    ``RANK``); before it, torchrun's ``RANK`` and ``WORLD_SIZE``.
    """
    dist: Any = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            size = int(dist.get_world_size())
            return (int(dist.get_rank()), size) if size > 1 else None
    except (RuntimeError, ValueError):  # a group torn down while we asked
        pass
    try:
        r, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (r, size) if size > 1 else None


def buffer_synced_inner(module: nn.Module) -> nn.Module | None:
    """The module that a ``DistributedDataParallel`` wraps, if it broadcasts buffers.

    DDP copies rank 0's buffers into its module in place at the start of every
    forward, before calling the module (``broadcast_buffers=True``, the default).
    """
    ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
    cls = getattr(ddp_mod, "DistributedDataParallel", None)
    if cls is None or not isinstance(module, cls):
        return None
    # forward_sync_buffers is the newer name of broadcast_buffers (torch 2.13).
    if not getattr(module, "forward_sync_buffers", getattr(module, "broadcast_buffers", True)):
        return None
    inner = getattr(module, "module", None)
    if not isinstance(inner, nn.Module) or next(inner.buffers(), None) is None:
        return None
    return inner
