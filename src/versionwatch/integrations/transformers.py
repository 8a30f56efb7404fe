"""Hugging Face integration: :class:`VersionWatchCallback`, a ``TrainerCallback`` that
watches ``trainer.train()``.

Add it to the trainer and every backward of the training loop is predicted before it
runs, the model's and the optimizer's that ``Trainer`` builds::

    from versionwatch.integrations.transformers import VersionWatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[VersionWatchCallback()])
    trainer.train()   # raises versionwatch.InplaceModificationError, explained

It works with any ``Trainer`` subclass that calls the callbacks (TRL's ``SFTTrainer``,
``DPOTrainer``, ...). ``import versionwatch`` never imports ``transformers``; only
importing this module does.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

import torch
from torch import nn

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "versionwatch.integrations.transformers needs transformers: "
        "pip install 'versionwatch[transformers]' (or transformers)"
    ) from err

from versionwatch._watch import Policy, Watcher, log_summary, resolve_policy, watch

__all__ = ["VersionWatchCallback"]

logger = logging.getLogger("versionwatch")

# Callbacks whose watcher is open, closed at interpreter exit: Trainer tells its
# callbacks nothing when train() dies with an exception (there is no on_exception).
_OPEN: weakref.WeakSet[VersionWatchCallback] = weakref.WeakSet()


class VersionWatchCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Predict and explain every backward of ``trainer.train()``.

    The callback opens :func:`versionwatch.watch` on the model when training
    begins (after ``Trainer`` has built the optimizer and Accelerate has prepared
    both) and closes it when training ends. Tensors are named from the model down,
    ``model.transformer.h.1.mlp.c_fc.weight``; the optimizer is named after the
    class ``Trainer`` built (``AdamW``; Accelerate's wrapper is looked through).
    An optimizer that ``Trainer`` creates after ``on_train_begin`` is picked up at
    the first ``on_step_begin`` that has it.

    ``Trainer`` calls its backward through Accelerate, which ends in
    ``torch.autograd.backward``: the watcher predicts it before it runs, and with
    ``on_hazard="raise"`` training stops with an
    :class:`~versionwatch.InplaceModificationError` whose message names the
    tensor, your line that saved or changed it (with ``strict=True``, the exact
    in-place op), and the fix. Frames of ``transformers``, ``trl``, ``peft`` and
    ``accelerate`` are skipped: a line inside them is given as your
    ``trainer.train()`` line.

    ``Trainer`` tells callbacks nothing when ``train()`` raises, so a watcher
    left open by a failed ``train()`` is closed by the next ``train()`` on the
    same thread with a ``VersionWatchCallback``, by :meth:`close`, at the end of
    a ``with callback:`` block, or at interpreter exit, whichever comes first.
    Use the ``with`` block where the program goes on after a failed ``train()``.

    Logging goes to the ``versionwatch`` logger: at the end of training, a
    summary and the version timeline (``WARNING`` if there were hazards, else
    ``INFO``, with the count of saved tensors not verified, e.g. inside
    activation checkpointing).

    Args:
        on_hazard: what the watcher does on a predicted hazard: ``"raise"``,
            ``"warn"``, ``"log"``, ``"repair"`` or a callable taking the
            :class:`~versionwatch.Report` (see :func:`versionwatch.watch`).
            ``$VERSIONWATCH_ON_HAZARD`` overrides it.
        strict: strict mode (see :func:`versionwatch.watch`): each write to a
            saved tensor is recorded at the line that makes it, including
            writes that bump no version and writes inside non-reentrant
            gradient checkpointing. Slower: opt-in.
        log_timeline: log the version timeline at the end of training.
        name: the root of the tensor names (``"model"`` gives ``model.lm_head.weight``).

    Attributes:
        watcher: the :class:`~versionwatch.Watcher` of the current (or last)
            ``train()``, kept after it closes so that ``watcher.reports`` and
            ``watcher.timeline()`` can be read; ``None`` before the first one.

    Example:
        >>> from versionwatch.integrations.transformers import VersionWatchCallback
        >>> callback = VersionWatchCallback(on_hazard="warn")
        >>> callback.watcher is None
        True
    """

    def __init__(
        self,
        on_hazard: Policy = "raise",
        strict: bool = False,
        *,
        log_timeline: bool = True,
        name: str = "model",
    ) -> None:
        super().__init__()
        resolve_policy(on_hazard)  # a bad policy fails here, not in the middle of train()
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string; got {name!r}")
        self.on_hazard = on_hazard
        self.strict = bool(strict)
        self.log_timeline = log_timeline
        self.name = name
        self.watcher: Watcher | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._thread: int | None = None

    # -- opening and closing -------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Whether a watcher is open (from ``on_train_begin`` to ``on_train_end``)."""
        return self.watcher is not None and not self.watcher.closed

    def close(self) -> None:
        """Close the watcher: every hook and patch is removed. Safe to call twice."""
        _OPEN.discard(self)
        if self.watcher is not None:
            self.watcher.close()

    def __enter__(self) -> VersionWatchCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, model: nn.Module, optimizer: object) -> None:
        # A watcher still open here, this callback's or another's on this thread, was
        # left by a train() that raised: train() calls do not nest.
        here = threading.get_ident()
        for other in list(_OPEN):
            if other is self or other._thread == here:
                other.close()
        self.close()
        self._optimizer = None
        opt = _unwrap(optimizer)
        self.watcher = watch({self.name: model}, on_hazard=self.on_hazard, strict=self.strict)
        self._thread = here
        _OPEN.add(self)
        self._add_optimizer(opt)

    def _add_optimizer(self, opt: torch.optim.Optimizer | None) -> None:
        if opt is None or self.watcher is None or self.watcher.closed:
            return
        if self._optimizer is not None and self._optimizer() is opt:
            return
        # Follows it from now on if it steps a watched parameter (as its first
        # step() would): a step before the first backward is then in the ledger.
        self.watcher._optimizer(opt)
        self._optimizer = weakref.ref(opt)

    # -- Trainer's events ----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: object = None, **kwargs: Any) -> None:
        if isinstance(model, nn.Module):
            self._open(model, optimizer)

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: object = None,
                      **kwargs: Any) -> None:
        # Where the optimizer is created after on_train_begin (older releases, a
        # subclass's create_optimizer), it is here by the first step.
        if self._optimizer is None:
            self._add_optimizer(_unwrap(optimizer))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            if self.is_open and self.log_timeline:
                assert self.watcher is not None
                self._log_summary(self.watcher)
        except Exception:  # a finished train() must not fail over a log line
            logger.warning("versionwatch: could not log the timeline", exc_info=True)
        finally:
            self.close()

    # -- explaining ----------------------------------------------------------------------
    def _log_summary(self, w: Watcher) -> None:
        log_summary(logger, w, "train ended", "VersionWatchCallback(strict=True)")


def _unwrap(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (and the like)."""
    seen = 0
    while not _plain(optimizer) and seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _plain(optimizer: object) -> bool:
    """A torch optimizer that wraps no other (Accelerate's wrapper is one too)."""
    return isinstance(optimizer, torch.optim.Optimizer) \
        and not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


@atexit.register
def _close_at_exit() -> None:
    for callback in list(_OPEN):
        callback.close()
