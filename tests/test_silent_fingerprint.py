"""Strict mode's fingerprints: saved bytes changed by writes that no version counter sees.

Each real case (a NumPy alias, a DLPack alias, BatchNorm's running statistics
updated by a training-mode forward) is shown three ways: the plain gradient
differs from the out-of-place reference (PyTorch is the oracle), strict mode
with ``fingerprint=True`` reports it, and a control (the same write putting
back the same bytes, or a write to memory no graph saved) is not reported.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils.dlpack as dlpack
from torch import nn

import versionwatch
from versionwatch._report.silent import SILENT_TAIL
from versionwatch._runtime import installed
from versionwatch._strict.fingerprint import SAMPLE, take
from versionwatch._strict.fingerprint import fingerprint_changed as changed


def line_of(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def _numpy_write(a: torch.Tensor, value: float) -> None:
    a.numpy()[:] = value  # NumPy writes the memory itself: no version bump, no wrapper


def _dlpack_write(a: torch.Tensor, value: float) -> None:
    dlpack.from_dlpack(dlpack.to_dlpack(a)).fill_(value)  # an alias with a counter of its own


class Scale(nn.Module):
    """``(weight * a).sum()``: MulBackward0 saves ``a``, which the weight's gradient is."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return (self.weight * a).sum()  # MulBackward0 saves a


def _mul_program(write, value: float | None, watch: dict | None):
    """``y = model(a)``, then ``write(a)``, then backward: the weight's gradient, the reports."""
    model = Scale()
    a = torch.tensor([1.0, 2.0, 3.0])
    reports: list = []
    ctx = (versionwatch.watch(model, on_hazard=reports.append, **watch) if watch is not None
           else None)
    y = model(a)
    if value is not None:
        write(a, value)
    y.backward()
    if ctx is not None:
        ctx.close()
    assert model.weight.grad is not None
    return model.weight.grad.clone(), reports


FP = {"strict": True, "fingerprint": True}


@pytest.mark.parametrize("write", [_numpy_write, _dlpack_write], ids=["numpy", "dlpack"])
def test_a_write_through_an_alias_is_reported_and_really_changes_gradients(write):
    reference, _ = _mul_program(write, None, None)
    plain, _ = _mul_program(write, 7.0, None)
    assert not torch.equal(reference, plain), "the write must change the plain gradient"
    # Plain strict mode sees neither write: no version bump, no Python entry point.
    _, strict_only = _mul_program(write, 7.0, {"strict": True})
    assert strict_only == []
    watched, reports = _mul_program(write, 7.0, FP)
    assert torch.equal(watched, plain)  # reported, then run: the same wrong gradient
    (report,) = reports
    (h,) = report.hazards
    assert (h.kind, h.cause, h.node, h.slot) == ("silent", "fingerprint", "MulBackward0", "other")
    assert h.hidden_by == "a write no version counter sees"
    assert h.modified_by == [] and h.notes[-1] == SILENT_TAIL
    assert h.saved_at is not None and h.saved_at.line == line_of(Scale.forward, "weight * a")
    # Control: the same write, then one putting back the bytes saved.
    restored, none = _restore_program(write)
    assert none == [] and torch.equal(restored, reference)


def _restore_program(write):
    """The write, then one that puts the saved bytes back: nothing backward reads changed."""
    model = Scale()
    a = torch.tensor([1.0, 2.0, 3.0])
    reports: list = []
    with versionwatch.watch(model, on_hazard=reports.append, **FP):
        y = model(a)
        write(a, 7.0)
        a.numpy()[:] = [1.0, 2.0, 3.0]
        y.backward()
    assert model.weight.grad is not None
    return model.weight.grad.clone(), reports


def test_a_write_to_memory_no_graph_saved_is_not_reported():
    model = Scale()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.ones(3)
    reports: list = []
    with versionwatch.watch(model, on_hazard=reports.append, **FP):
        y = model(a)
        b.numpy()[:] = 7.0
        dlpack.from_dlpack(dlpack.to_dlpack(b)).fill_(5.0)
        y.backward()
    assert reports == []


def test_memory_is_not_reused_while_the_graph_holds_it():
    """The record holds what the graph saved: dropped by the program, the memory stays
    its own until the graph goes, so no other tensor is handed its bytes meanwhile."""
    model = Scale()
    reports: list = []
    with versionwatch.watch(model, on_hazard=reports.append, **FP):
        y = model(torch.tensor([1.0, 2.0, 3.0]))  # the program keeps no reference to it
        for _ in range(20):
            torch.empty(3).numpy()[:] = 9.0  # fresh memory, written where no counter sees
        y.backward()
    assert reports == []
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.tensor([1.0, 2.0, 3.0]))


def test_the_report_text_exactly():
    _, (report,) = _mul_program(_numpy_write, 7.0, FP)
    line = line_of(Scale.forward, "weight * a")
    back = line_of(_mul_program, "y.backward()")
    call = line_of(_mul_program, "y = model(a)\n")
    me = os.path.relpath(__file__)  # sites are shown relative to the working directory
    expected = f"""\
versionwatch: backward will compute wrong gradients: a tensor, float32[3] saved by MulBackward0 was changed without a version bump (its content fingerprint changed)
  tensor       a tensor, float32[3]
  saved by     MulBackward0.other at {me}:{line}: return (self.weight * a).sum()  # MulBackward0 saves a (in model, during forward #1 called at {me}:{call}, at version 0)
  now at       version 0
  note         its sampled bytes differ from those saved, and no write that strict mode sees made the change (a C++ kernel, NumPy, DLPack, an extension, a collective): no write line is known
  note         {SILENT_TAIL}
  backward at  {me}:{back}
  fix          the tensor was changed by a write no version counter sees (a C++ kernel such as BatchNorm's running-statistics update, a NumPy or DLPack alias, an extension, a collective); run every backward that needs it before the change, or re-run the forward after it"""
    assert str(report) == expected
    doc = report.to_dict()["hazards"][0]
    assert (doc["kind"], doc["cause"], doc["hidden_by"]) == (
        "silent", "fingerprint", "a write no version counter sees")


def _batchnorm_program(momentum: float, watch: dict | None, train_between: bool = True):
    """An eval-mode forward, a training-mode forward of the same BatchNorm, then backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=momentum))
    with torch.no_grad():  # running statistics far from the batch's, so an update shows
        model[1].running_var.fill_(4.0)
        model[1].running_mean.fill_(1.0)
    model.eval()
    reports: list = []
    ctx = (versionwatch.watch(model, on_hazard=reports.append, **watch) if watch is not None
           else None)
    loss = model(torch.randn(8, 3)).pow(2).sum()  # saves running_mean and running_var
    if train_between:
        model.train()
        model(torch.randn(8, 3))  # updates them inside the kernel: no version bump
        model.eval()
    loss.backward()
    if ctx is not None:
        ctx.close()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], reports


def test_batchnorm_running_stats_updated_by_a_training_forward():
    reference, _ = _batchnorm_program(0.1, None, train_between=False)
    plain, _ = _batchnorm_program(0.1, None)
    assert any(not torch.equal(r, p) for r, p in zip(reference, plain))
    assert _batchnorm_program(0.1, {"strict": True})[1] == []  # plain strict mode: unseen
    _, (report,) = _batchnorm_program(0.1, FP)
    assert [(h.kind, h.cause, h.slot, h.tensor) for h in report.hazards] == [
        ("silent", "fingerprint", "running_mean", "model.1.running_mean"),
        ("silent", "fingerprint", "running_var", "model.1.running_var"),
    ]
    assert all(h.module == "model.1" for h in report.hazards)
    # Control: momentum 0 leaves the running statistics as they were, bytes and all.
    same, none = _batchnorm_program(0.0, FP)
    assert none == [] and all(torch.equal(r, s) for r, s in zip(reference, same))


def test_set_bumps_the_version_so_it_keeps_the_inplace_report():
    """set_() bumps the version (2.4.1 and 2.13 alike): PyTorch's own error, not a fingerprint."""
    model = Scale()
    a = torch.tensor([1.0, 2.0, 3.0])
    with versionwatch.watch(model, **FP):
        y = model(a)
        a.set_(torch.tensor([7.0, 7.0, 7.0]))
        with pytest.raises(versionwatch.InplaceModificationError) as info:
            y.backward()
    h = info.value.report.hazards[0]
    assert (h.kind, h.cause) == ("inplace", None)
    assert h.modified_by[0].description.startswith("set_")


def test_a_seen_silent_write_keeps_its_own_report():
    model = Scale()
    a = torch.tensor([1.0, 2.0, 3.0])
    reports: list = []
    with versionwatch.watch(model, on_hazard=reports.append, **FP):
        y = model(a)
        a.data.mul_(2)  # seen by strict mode, with its line
        y.backward()
    (h,) = reports[0].hazards
    assert (h.kind, h.cause) == ("silent", None)
    assert h.modified_by[0].description.startswith("mul_()")


def test_kernels_that_write_what_their_own_op_saved_are_no_alarm():
    """Training BatchNorm saves its running stats, then updates them (its backward does not
    read them); RReLU saves its noise, then fills it (its backward reads the noise as filled).
    Both are fingerprinted once the op is over: at the module call's end, or the next save."""
    def losses(model: nn.Module, x: torch.Tensor, functional: bool) -> list:
        reports: list = []
        with versionwatch.watch(model, on_hazard=reports.append, **FP):
            for _ in range(3):
                h = model(x)
                if functional:  # outside any module: the next op's save settles it
                    h = nn.functional.rrelu(h, training=True).exp()
                    h = nn.functional.rrelu(h, training=True)  # the last: never settled
                h.pow(2).sum().backward()
        return reports

    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.RReLU())
    conv = nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2),
                         nn.InstanceNorm2d(2, track_running_stats=True, affine=True))
    assert losses(bn, torch.randn(4, 3), False) == []
    assert losses(conv, torch.randn(2, 2, 3, 3), False) == []
    assert losses(nn.Linear(3, 3), torch.randn(4, 3), True) == []


def test_fingerprint_needs_strict():
    w = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="fingerprint=True needs strict mode"):
        versionwatch.watch(w, fingerprint=True)
    with pytest.raises(ValueError, match="fingerprint=True needs strict mode"):
        versionwatch.watch_all(fingerprint=True)
    assert installed() == {}


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64,
                                   torch.complex64, torch.complex128])
def test_every_dtype_and_layout_reads_the_same_and_never_writes(dtype):
    base = (torch.randn(9, 11) * 3).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        base[0, 0] = float("nan")
    written = base._version
    for t in (base, base.t()[2:, ::3], base[0], base[3, 4], base.expand(2, 9, 11),
              base.reshape(-1)[5:6].reshape(())):
        version = t._version
        fp = take(t)
        assert fp is not None and fp.sample.dtype == dtype
        assert 0 < fp.sample.numel() <= SAMPLE
        assert not changed(t, fp), "a NaN must equal itself: bytes, not values"
        assert t._version == version and base._version == written
    assert take(torch.empty(0, 3)) is None  # nothing to change
    big = torch.zeros(10_000)
    fp = take(big)
    assert fp is not None and fp.sample.numel() == SAMPLE
    big.numpy()[::2] = 1.0  # half the elements
    assert changed(big, fp)
    assert not changed(torch.zeros(5_000), fp)  # another shape: never compared


def test_a_storage_freed_to_nothing_is_not_read():
    """FSDP frees a parameter's storage after forward and gathers it again in backward."""
    t = torch.randn(16)
    fp = take(t)
    assert fp is not None
    t.untyped_storage().resize_(0)
    assert not changed(t, fp) and take(t) is None


def test_a_user_dispatch_mode_sees_no_fingerprint_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    def ops(fingerprint: bool) -> list[str]:
        seen: list[str] = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        with versionwatch.watch(model, strict=True, fingerprint=fingerprint), Log():
            model(torch.ones(2, 3)).sum().backward()
        return seen

    assert ops(True) == ops(False)


def test_training_is_bitwise_identical_and_nothing_is_left():
    def train(watch: dict | None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ctx = versionwatch.watch(model, opt, **watch) if watch is not None else None
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
        if ctx is not None:
            ctx.close()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]

    for a, b in zip(train(None), train(FP)):
        assert torch.equal(a, b)
    assert installed() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_dlpack_write_on_cuda_is_reported():
    """On CUDA: the sample is taken without a host sync and compared before backward."""
    w = nn.Linear(3, 1).cuda()
    a = torch.tensor([1.0, 2.0, 3.0], device="cuda")
    reports: list = []
    with versionwatch.watch(w, on_hazard=reports.append, **FP):
        y = (w.weight * a).sum()
        dlpack.from_dlpack(dlpack.to_dlpack(a)).fill_(7.0)
        y.backward()
    (h,) = reports[0].hazards
    assert (h.kind, h.cause, h.device) == ("silent", "fingerprint", "cuda:0")


def test_cli_strict_fingerprint(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        model = nn.Bilinear(3, 3, 1)
        a = torch.tensor([[1.0, 2.0, 3.0]])
        y = model(a, a).sum()
        a.numpy()[:] = 7.0
        y.backward()
    """))

    # This checkout's versionwatch, wherever the test runs from.
    src = str(Path(versionwatch.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": src}

    def vw(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "versionwatch", "run", *args, "train.py"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)

    alone = vw("--fingerprint")
    assert alone.returncode == 2
    assert alone.stderr == "versionwatch run: --fingerprint needs strict mode: add --strict\n"
    found = vw("--strict", "--fingerprint")
    assert found.returncode == 1, found.stderr
    assert "(its content fingerprint changed)" in found.stderr
    assert "Backward0.i1 at train.py:5: y = model(a, a).sum()" in found.stderr
