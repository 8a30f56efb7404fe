"""Lightning integration: :class:`VersionWatch`, a callback that watches ``trainer.fit``.

Add it to the trainer and every backward of the fit is predicted before it
runs, automatic and manual optimization alike::

    from versionwatch.integrations.lightning import VersionWatch

    trainer = lightning.Trainer(callbacks=[VersionWatch()])
    trainer.fit(model)   # raises versionwatch.InplaceModificationError, explained

It works with ``lightning`` 2.x (``lightning.pytorch``) and falls back to the
standalone ``pytorch_lightning`` package. ``import versionwatch`` never imports
either; only importing this module does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import FunctionType

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef,unused-ignore]
    except ImportError as err:
        raise ImportError(
            "versionwatch.integrations.lightning needs Lightning 2.x: "
            "pip install 'versionwatch[lightning]' (or lightning>=2.0, or pytorch_lightning)"
        ) from err

from versionwatch._report import FreedGraphError, InplaceModificationError, Report, Site
from versionwatch._sites import _short
from versionwatch._timeline import Timeline
from versionwatch._watch import Policy, Watcher, log_summary, resolve_policy, watch

__all__ = ["VersionWatch"]

logger = logging.getLogger("versionwatch")

# PyTorch's own phrase for a stale saved tensor (versionwatch's errors keep it too).
_INPLACE_PHRASE = "modified by an inplace operation"


class VersionWatch(pl.Callback):
    """Predict and explain every backward of ``trainer.fit``.

    The callback opens :func:`versionwatch.watch` on the LightningModule when fit
    starts (after the strategy has moved it to its device and set up the
    optimizers) and closes it when fit ends, is torn down, or dies with an
    exception, so no patch or hook outlives the fit. Tensors are named from the
    module down, ``model.discriminator.2.weight``; each ``training_step`` call is
    a ``training_step #n`` row of the timeline. Each optimizer is named after the
    variable that holds it at its first step (``opt_d`` of ``opt_g, opt_d =
    self.optimizers()``, Lightning's wrapper of it), else after its class in
    ``configure_optimizers`` order (``Adam``, ``Adam[1]``, ...: automatic
    optimization steps it where no variable of yours holds it).

    Both ``Tensor.backward`` (automatic optimization) and ``manual_backward``
    (manual optimization) end in ``torch.autograd.backward``, which the watcher
    predicts before it runs: with ``on_hazard="raise"`` the fit stops with an
    :class:`~versionwatch.InplaceModificationError` (or
    :class:`~versionwatch.FreedGraphError`) whose message names the tensor, the
    optimizer step or in-place op that modified it, and the fix.

    If PyTorch raises its own "modified by an inplace operation" error anyway (a
    backward that bypassed the watcher, or ``on_hazard="warn"``), the callback
    makes sure the error carries versionwatch's explanation as a note (PEP 678)
    and logs it.

    Logging goes to the ``versionwatch`` logger: on a hazard that stops the fit,
    the explanation and the version timeline (``ERROR``); at the end of fit, a
    summary and the timeline (``WARNING`` if there were hazards, else ``INFO``).

    Args:
        on_hazard: what the watcher does on a predicted hazard: ``"raise"``,
            ``"warn"``, ``"log"`` or a callable taking the
            :class:`~versionwatch.Report` (see :func:`versionwatch.watch`).
            ``$VERSIONWATCH_ON_HAZARD`` overrides it.
        log_timeline: log the version timeline at the end of fit and on a hazard.
        name: the root of the tensor names (``"model"`` gives ``model.fc.weight``).
        fix: on a hazard that stops the fit, also log the patches of your lines
            that ``versionwatch fix`` would check (made from the report, not
            checked: running ``versionwatch fix train.py`` checks each one by
            running the patched program), and put them in the report's
            ``hazards[0].fixes``.

    Attributes:
        watcher: the :class:`~versionwatch.Watcher` of the current (or last) fit,
            kept after it closes so that ``watcher.reports`` and
            ``watcher.timeline()`` can be read; ``None`` before the first fit.
    """

    def __init__(
        self,
        on_hazard: Policy = "raise",
        log_timeline: bool = True,
        *,
        name: str = "model",
        fix: bool = False,
    ) -> None:
        super().__init__()
        resolve_policy(on_hazard)  # a bad policy fails here, not in the middle of fit
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string; got {name!r}")
        self.on_hazard = on_hazard
        self.log_timeline = log_timeline
        self.name = name
        self.fix = bool(fix)
        self.watcher: Watcher | None = None
        self._open = False
        self._steps = 0
        self._step_site: Site | None = None

    # -- opening and closing -------------------------------------------------------------
    def _ensure_open(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Watcher:
        if self.watcher is not None and self._open:
            return self.watcher
        params = {id(p) for p in pl_module.parameters()}
        optimizers = [
            opt for opt in trainer.optimizers
            if isinstance(opt, torch.optim.Optimizer)
            and any(id(p) in params for g in opt.param_groups for p in g["params"])
        ]
        # Under `versionwatch run --replay`, watch() itself stops at the replayed backward.
        self.watcher = watch({self.name: pl_module}, *optimizers, on_hazard=self.on_hazard)
        self._open = True
        self._steps = 0
        self._step_site = _definition_site(type(pl_module).training_step)
        return self.watcher

    def _close(self) -> None:
        if self.watcher is not None and self._open:
            self._open = False
            self.watcher.close()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()  # a watcher left open by an earlier fit that never tore down

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure_open(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self.watcher is not None and self._open and self.log_timeline:
                self._log_summary(self.watcher)
        except Exception:  # a finished fit must not fail over a log line
            logger.warning("versionwatch: could not log the timeline", exc_info=True)
        finally:
            self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    # -- training ------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if self.watcher is not None and self._open:
            # A row of the timeline, and the "saved during" of a hazard when
            # training_step calls submodules rather than self(...).
            self._steps += 1
            self.watcher.ledger.record("forward", f"training_step #{self._steps}",
                                       self._step_site)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # The backward that follows goes through torch.autograd.backward, which the
        # open watcher predicts (and, with on_hazard="raise", stops) before it runs:
        # predicting here as well would report every hazard twice.
        self._ensure_open(trainer, pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            if self.watcher is not None and self._open:
                self._explain_exception(self.watcher, exception)
        except Exception:  # never mask the error that stopped the fit
            logger.warning("versionwatch: could not explain the error", exc_info=True)
        finally:
            self._close()

    # -- explaining ----------------------------------------------------------------------
    def _explain_exception(self, w: Watcher, exception: BaseException) -> None:
        for err in _chain(exception):
            if isinstance(err, (InplaceModificationError, FreedGraphError)):
                report = err.report
                headline = str(report).splitlines()[0]
                logger.error("versionwatch: fit stopped before backward ran: %s%s",
                             headline.removeprefix("versionwatch: "),
                             self._timeline_text(w, report))
                if self.fix:
                    self._log_fixes(report)
                return
            if isinstance(err, RuntimeError) and _INPLACE_PHRASE in str(err):
                notes = _notes(err)
                if not notes:
                    # PyTorch's own error, from a backward the watcher did not predict
                    # (it bypassed torch.autograd.backward): explain it from the ledger.
                    w.ledger.sync("the failed backward")
                    w.explain_error(err)
                    notes = _notes(err)
                if not notes:
                    return
                latest = w.reports[-1] if w.reports else None
                if notes[-1].startswith("versionwatch predicted this"):
                    # on_hazard="warn"/"log"/callable already reported it: just the timeline
                    headline = str(latest).splitlines()[0] if latest is not None else ""
                    logger.error("versionwatch: fit stopped by PyTorch's error, as predicted: %s%s",
                                 headline.removeprefix("versionwatch: "),
                                 self._timeline_text(w, latest))
                else:
                    logger.error("%s%s", notes[-1], self._timeline_text(w, latest))
                return

    def _log_fixes(self, report: Report) -> None:
        """The patches ``versionwatch fix`` would check, unchecked, into the report and the log."""
        import os
        import sys

        from versionwatch._fix import unchecked

        main = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else None
        fixes = unchecked(report, main=os.path.abspath(main) if main else None)
        if report.hazards:
            report.hazards[0].fixes = fixes
        offered = [f for f in fixes if "only hides" not in f.why]  # not the hiders
        if not offered:
            logger.error("versionwatch: no patch of your lines for it; the report's fix says "
                         "what to change")
            return
        first = offered[0]
        more = f" ({len(offered) - 1} more in the report's fixes)" if len(offered) > 1 else ""
        logger.error("versionwatch: a patch for it, %s%s:\n%s\n%s", first.why, more,
                     first.summary, first.diff.rstrip("\n"))

    def _timeline_text(self, w: Watcher, report: Report | None) -> str:
        if not self.log_timeline:
            return ""
        timeline = report.timeline if report is not None else None
        if not isinstance(timeline, Timeline):
            timeline = w.timeline(report=report)
        return f"\n{timeline}"

    def _log_summary(self, w: Watcher) -> None:
        log_summary(logger, w, "fit ended", "VersionWatch(strict=True)")


def _chain(exception: BaseException) -> Iterator[BaseException]:
    """The exception, then its causes and contexts (Lightning may wrap errors)."""
    seen: set[int] = set()
    err: BaseException | None = exception
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _notes(err: BaseException) -> list[str]:
    notes = getattr(err, "__notes__", None) or []
    return [n for n in notes if isinstance(n, str) and n.startswith("versionwatch")]


def _definition_site(fn: object) -> Site | None:
    """``file:line`` of a method's ``def``, for the ``training_step #n`` rows."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if not isinstance(fn, FunctionType):
        return None
    code = fn.__code__
    return Site(_short(code.co_filename), code.co_firstlineno, f"def {fn.__name__}(...)")
