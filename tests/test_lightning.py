"""The Lightning callback, with a real ``lightning`` Trainer on CPU."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import versionwatch  # noqa: E402
from versionwatch._runtime import installed  # noqa: E402
from versionwatch._watch import intercept as _intercept  # noqa: E402
from versionwatch.integrations.lightning import VersionWatch  # noqa: E402

# Captured before any watcher opens: a backward that bypasses the watcher.
_RAW_BACKWARD = torch.autograd.backward
assert _RAW_BACKWARD is not _intercept.backward


def _data() -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)


def _trainer(callback: VersionWatch) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback],
    )


class GAN(pl.LightningModule):
    """Manual optimization; ``reuse_d_graph`` is the classic bug."""

    def __init__(self, reuse_d_graph: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.reuse_d_graph = reuse_d_graph
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], 4))
        if self.reuse_d_graph:
            d_fake = self.discriminator(fake)
            d_loss = F.softplus(d_fake).mean() + F.softplus(-self.discriminator(real)).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss, retain_graph=True)
            opt_d.step()                                  # D's weights: in place, version + 1
            g_loss = F.softplus(-d_fake).mean()           # the old D graph, saved before step()
        else:
            d_fake = self.discriminator(fake.detach())
            d_loss = F.softplus(d_fake).mean() + F.softplus(-self.discriminator(real)).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            g_loss = F.softplus(-self.discriminator(fake)).mean()  # a fresh D forward
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return _data()


class Regressor(pl.LightningModule):
    """Automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return (self(x) - x.sum(1, keepdim=True)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return _data()


class Unwatched(pl.LightningModule):
    """Manual optimization through a backward captured before the watcher patched it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Linear(2, 4, bias=False)
        self.head = nn.Linear(4, 1, bias=False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        opt = self.optimizers()
        loss = self.head(self.body(x)).pow(2).mean()   # head.weight saved for body's grad
        _RAW_BACKWARD(loss, retain_graph=True)
        opt.step()
        _RAW_BACKWARD(loss)  # PyTorch raises: head.weight was stepped

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return _data()


def _find(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _assert_unpatched(backward_before: object, module: nn.Module) -> None:
    assert torch.autograd.backward is backward_before
    assert torch.autograd.backward is _RAW_BACKWARD
    assert torch.autograd.grad.__module__ == "torch.autograd"
    assert torch.optim.Optimizer.zero_grad is not _intercept.zero_grad
    assert installed() == {}  # no watcher, patch, global hook or route of ours is left
    from torch.optim import optimizer as optim_module

    hooks = [*optim_module._global_optimizer_pre_hooks.values(),
             *optim_module._global_optimizer_post_hooks.values()]
    assert _intercept.step_pre not in hooks and _intercept.step_post not in hooks
    for m in module.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_manual_gan_hazard_is_predicted_and_explained(caplog: pytest.LogCaptureFixture) -> None:
    model, cb = GAN(reuse_d_graph=True), VersionWatch()
    before = torch.autograd.backward
    with caplog.at_level(logging.ERROR, logger="versionwatch"):
        with pytest.raises(RuntimeError) as info:
            _trainer(cb).fit(model)
    err = _find(info.value, versionwatch.InplaceModificationError)
    assert isinstance(err, versionwatch.InplaceModificationError), info.value
    h = err.report.hazards[0]
    assert h.detected == "predicted"                 # before PyTorch's own error
    assert h.tensor == "model.discriminator.2.weight"
    assert h.saved_during is not None and h.saved_during.startswith("training_step #1")
    [mod] = h.modified_by
    assert mod.kind == "optimizer.step" and mod.description == "opt_d.step() #1"
    assert mod.site is not None and mod.site.code.startswith("opt_d.step()")
    assert err.report.backward_site is not None
    assert err.report.backward_site.code == "self.manual_backward(g_loss)"
    text = str(err)
    assert "model.discriminator.2.weight" in text and "opt_d.step() #1 at" in text
    # raised once, by the watcher; no PyTorch error was chained behind it
    assert _find(info.value, versionwatch.InplaceModificationError) is info.value
    assert len(cb.watcher.reports) == 1
    # logged with the timeline
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert "fit stopped before backward ran" in rec.getMessage()
    assert "training_step #1" in rec.getMessage() and "opt_d.step() #1" in rec.getMessage()
    _assert_unpatched(before, model)


def test_warn_policy_pytorch_error_carries_the_prediction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, cb = GAN(reuse_d_graph=True), VersionWatch(on_hazard="warn")
    before = torch.autograd.backward
    with caplog.at_level(logging.ERROR, logger="versionwatch"):
        with pytest.warns(versionwatch.InplaceHazardWarning), pytest.raises(RuntimeError) as info:
            _trainer(cb).fit(model)
    err = info.value
    assert not isinstance(err, versionwatch.InplaceModificationError)   # PyTorch's own
    assert "modified by an inplace operation" in str(err)
    notes = getattr(err, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("versionwatch predicted this")
    assert "model.discriminator.2.weight" in notes[0]
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert "fit stopped by PyTorch's error, as predicted" in rec.getMessage()
    assert "model.discriminator.2.weight" in rec.getMessage()
    assert "opt_d.step() #1" in rec.getMessage()   # the timeline
    _assert_unpatched(before, model)


def test_unpredicted_pytorch_error_is_explained_on_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, cb = Unwatched(), VersionWatch()
    before = torch.autograd.backward
    with caplog.at_level(logging.ERROR, logger="versionwatch"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            _trainer(cb).fit(model)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1
    assert notes[0].startswith("versionwatch explains (PyTorch raised, unpredicted)")
    assert "model.head.weight" in notes[0] and "opt.step() #1" in notes[0]
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert notes[0] in rec.getMessage()
    _assert_unpatched(before, model)


@pytest.mark.parametrize("model", [GAN(reuse_d_graph=False), Regressor()],
                         ids=["manual-gan", "automatic"])
def test_clean_training_has_no_hazard(
    model: pl.LightningModule, caplog: pytest.LogCaptureFixture,
) -> None:
    cb = VersionWatch()
    before = torch.autograd.backward
    with caplog.at_level(logging.INFO, logger="versionwatch"), warnings.catch_warnings():
        warnings.simplefilter("error", versionwatch.InplaceHazardWarning)
        trainer = _trainer(cb)
        trainer.fit(model)
    assert trainer.state.finished
    w = cb.watcher
    assert w is not None and not w.reports
    assert w.backward_count == (6 if isinstance(model, GAN) else 3)
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert rec.levelno == logging.INFO and "no hazard" in rec.getMessage()
    assert "training_step #3" in rec.getMessage()
    _assert_unpatched(before, model)


def test_callable_policy_lets_pytorch_raise(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[versionwatch.Report] = []
    model, cb = GAN(reuse_d_graph=True), VersionWatch(on_hazard=seen.append)
    with caplog.at_level(logging.INFO, logger="versionwatch"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _trainer(cb).fit(model)
    assert len(seen) == 1 and seen[0].hazards[0].tensor == "model.discriminator.2.weight"
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert rec.levelno == logging.ERROR and "as predicted" in rec.getMessage()


class FusedGAN(GAN):
    """Fused Adam updates D without a version bump: PyTorch raises nothing."""

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, fused=True)]


def test_silent_hazard_is_summarized_at_fit_end(caplog: pytest.LogCaptureFixture) -> None:
    model, cb = FusedGAN(reuse_d_graph=True), VersionWatch(on_hazard="log")
    with caplog.at_level(logging.INFO, logger="versionwatch"):
        trainer = _trainer(cb)
        trainer.fit(model)                      # wrong gradients, no error
    assert trainer.state.finished
    assert len(cb.watcher.reports) == 3         # one per training_step
    assert all(r.hazards[0].kind == "silent" for r in cb.watcher.reports)
    summary = caplog.records[-1]
    assert summary.levelno == logging.WARNING
    assert "6 backward(s) predicted, 3 with hazards" in summary.getMessage()
    assert "model.discriminator.2.weight" in summary.getMessage()
    assert "opt_d.step() #3" in summary.getMessage()   # the timeline
    _assert_unpatched(_RAW_BACKWARD, model)


def test_log_timeline_off_and_refit() -> None:
    model, cb = Regressor(), VersionWatch(on_hazard="log", log_timeline=False)
    _trainer(cb).fit(model)
    first = cb.watcher
    _trainer(cb).fit(model)                 # the same callback, a second fit: a new watcher
    assert cb.watcher is not first and not cb.watcher.reports
    _assert_unpatched(_RAW_BACKWARD, model)


def test_bad_policy_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="on_hazard"):
        VersionWatch(on_hazard="explode")  # type: ignore[arg-type]


def test_import_versionwatch_imports_no_optional_package() -> None:
    code = (
        "import sys, versionwatch, versionwatch.integrations\n"
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'rich', 'matplotlib') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class TwoLosses(pl.LightningModule):
    """Manual optimization: two backwards of one forward around a step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        opt = self.optimizers()
        out = self.net(x)
        opt.zero_grad()
        self.manual_backward(out.pow(2).mean(), retain_graph=True)
        opt.step()
        self.manual_backward(out.abs().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return _data()


def test_fix_option_logs_the_patches_unchecked(caplog: pytest.LogCaptureFixture) -> None:
    """fix=True: the patches versionwatch fix would check, from the report, not run."""
    from pathlib import Path

    source = Path(__file__).read_text(encoding="utf-8")
    model, cb = TwoLosses(), VersionWatch(fix=True)
    with caplog.at_level(logging.ERROR, logger="versionwatch"):
        with pytest.raises(RuntimeError) as info:
            _trainer(cb).fit(model)
    err = _find(info.value, versionwatch.InplaceModificationError)
    assert isinstance(err, versionwatch.InplaceModificationError), info.value
    fixes = err.report.hazards[0].fixes
    assert [f.family for f in fixes] == ["move_step", "sum_losses"]
    assert all(not f.checked and not f.verified for f in fixes)
    assert fixes[0].why.startswith("not checked: `versionwatch fix ")
    assert fixes[0].file.endswith("test_lightning.py")
    assert fixes[1].new.strip() == "self.manual_backward(out.pow(2).mean() + out.abs().mean())"
    [rec] = [r for r in caplog.records if "a patch for it" in r.getMessage()]
    assert "`opt.step()` moves after `self.manual_backward(out.abs().mean())`" in rec.getMessage()
    assert "diff --git a/" in rec.getMessage() and "test_lightning.py" in rec.getMessage()
    assert Path(__file__).read_text(encoding="utf-8") == source  # nothing written
    # Without fix=True: no patch logged; the report holds the same candidates (its fix
    # line shows the first one), each marked untested.
    caplog.clear()
    model, cb = TwoLosses(), VersionWatch()
    with caplog.at_level(logging.ERROR, logger="versionwatch"):
        with pytest.raises(RuntimeError) as info:
            _trainer(cb).fit(model)
    err = _find(info.value, versionwatch.InplaceModificationError)
    assert isinstance(err, versionwatch.InplaceModificationError)
    fixes = err.report.hazards[0].fixes
    assert [f.family for f in fixes] == ["move_step", "sum_losses"]
    assert all(not f.verified and f.why.startswith("untested; ") for f in fixes)
    assert not [r for r in caplog.records if "a patch for it" in r.getMessage()]
