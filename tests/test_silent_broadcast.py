"""A write inside ``torch.autograd._unsafe_preserve_version_counter``: silent.

Recent DistributedDataParallel broadcasts its buffers inside that block, which sets
each buffer's version back afterwards: a buffer a forward saved (BatchNorm's running
statistics in eval mode) then holds rank 0's values at the backward, and PyTorch
raises nothing. Strict mode keeps the saved bytes when the block begins and reports
the change before the backward; a broadcast of the very same values is no hazard.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch._runtime import installed

pytestmark = pytest.mark.skipif(
    not hasattr(torch.autograd, "_unsafe_preserve_version_counter"),
    reason="this torch has no _unsafe_preserve_version_counter")


class Broadcast(nn.Module):
    """What DistributedDataParallel._sync_buffers does on recent torch, on one process."""

    def __init__(self, module: nn.Module, same: bool) -> None:
        super().__init__()
        self.module, self.same, self.calls = module, same, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for b in self.module.buffers():
            if not b.is_floating_point():
                continue
            value = b.clone() if self.same else torch.full_like(b, float(self.calls))
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(b):
                b.copy_(value)  # rank 0's values
        return self.module(x)


def _model(same: bool) -> Broadcast:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).eval()
    return Broadcast(net, same)


def _two_forwards(ddp: Broadcast, *, before: bool = False) -> torch.Tensor:
    torch.manual_seed(1)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    out = ddp(x).sum()
    if before:  # what the author meant: the backward sees what its forward saw
        out.backward()
        ddp(y)
    else:
        ddp(y)  # the broadcast overwrites the running statistics, version restored
        out.backward()
    grad = ddp.module[0].weight.grad
    assert grad is not None
    return grad.clone()


def test_the_plain_run_is_silently_wrong() -> None:
    assert not torch.equal(_two_forwards(_model(False)), _two_forwards(_model(False), before=True))
    assert torch.equal(_two_forwards(_model(True)), _two_forwards(_model(True), before=True))


def test_strict_mode_reports_the_block_and_the_copy() -> None:
    ddp = _model(False)
    reports: list[versionwatch.Report] = []
    with versionwatch.watch(ddp, strict=True, on_hazard=reports.append):
        _two_forwards(ddp)
    assert len(reports) == 1
    h = reports[0].first
    assert h is not None and h.kind == "silent" and h.cause is None
    assert h.tensor == "ddp.module.1.running_var" or h.tensor == "ddp.module.1.running_mean"
    assert [m.description for m in h.modified_by] == [
        "a write under _unsafe_preserve_version_counter (no version bump)", "copy_()"]
    text = str(reports[0])
    assert "_unsafe_preserve_version_counter(b):" in text
    assert "broadcast_buffers=False" in h.fix


def test_the_same_values_broadcast_are_no_hazard() -> None:
    ddp = _model(True)
    reports: list[versionwatch.Report] = []
    with versionwatch.watch(ddp, strict=True, on_hazard=reports.append):
        _two_forwards(ddp)
    assert reports == []


def test_watched_training_is_bitwise_plain() -> None:
    plain = _two_forwards(_model(False))
    ddp = _model(False)
    with versionwatch.watch(ddp, strict=True, on_hazard=lambda r: None):
        watched = _two_forwards(ddp)
    assert torch.equal(plain, watched)
    assert installed() == {}


def test_running_statistics_in_training_mode_are_not_read() -> None:
    """Training-mode batch norm saves its running statistics but its backward reads the
    batch's: a broadcast over them changes no gradient, so nothing is reported."""
    def training() -> Broadcast:
        ddp = _model(False)
        ddp.module.train()
        return ddp

    assert torch.equal(_two_forwards(training()), _two_forwards(training(), before=True))
    reports: list[versionwatch.Report] = []
    for fingerprint in (False, True):
        ddp = training()
        with versionwatch.watch(ddp, strict=True, fingerprint=fingerprint,
                                on_hazard=reports.append):
            _two_forwards(ddp)
    assert reports == []
