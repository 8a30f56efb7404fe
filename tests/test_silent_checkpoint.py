"""Writes hidden by non-reentrant activation checkpointing: silent in PyTorch, reported by strict.

``checkpoint(fn, x, use_reentrant=False)`` saves no tensor while ``fn`` runs and
recomputes them at the backward, without a version check. Each silent case here
is a program that trains wrongly without an error (its gradient differs from
the out-of-place program's), and is reported by strict mode before the
backward; each near-identical correct program is not reported. The default
mode names the checkpointed slots among those it did not verify.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import versionwatch
from versionwatch._compat import (
    CHECKPOINT_EARLY_STOP_GLOBAL,
    CHECKPOINT_EARLY_STOP_PER_CALL,
    CHECKPOINT_HOLDER_PEEKED,
    CHECKPOINT_PACK_CODE,
    CHECKPOINT_SLOTS_SHOWN,
    SELECTIVE_CHECKPOINT,
)
from versionwatch._report.text import unverified_summary

# A slot's checkpoint holder: shown by new torch, or seen as its unpack hook's argument.
SEEN = CHECKPOINT_SLOTS_SHOWN or CHECKPOINT_HOLDER_PEEKED
shown = pytest.mark.skipif(
    not SEEN, reason="no sight of a slot's checkpoint holder: strict mode cannot map its "
                     "checkpoint records to the slots, and reports nothing there")
HERE = os.path.relpath(__file__)


def line_of(fn: Callable[..., object], text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


class Gated(nn.Module):
    """A gated block, checkpointed; ``mode`` says what it does to the gate."""

    def __init__(self, mode: str = "inplace") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate_proj = nn.Linear(4, 4)
        self.up = nn.Linear(4, 4)
        self.mode = mode

    def block(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(x))
        if self.mode == "inplace":
            gate.mul_(0.5)  # the write: sigmoid saved gate
        elif self.mode == "out_of_place":
            gate = gate * 0.5
        elif self.mode == "unsaved":
            h = x + 1  # nobody saves h
            h.mul_(0.5)
            return x + gate * self.up(h)
        out = x + gate * self.up(x)
        if self.mode == "after_last":
            gate.mul_(0.5)  # after the last save: early stop never repeats it
        self.kept = gate
        return out

    def forward(self, x: torch.Tensor, early_stop: bool = True) -> torch.Tensor:
        if CHECKPOINT_EARLY_STOP_PER_CALL:
            return ckpt.checkpoint(self.block, x, use_reentrant=False,  # type: ignore[no-any-return]
                                   early_stop=early_stop)
        with ckpt.set_checkpoint_early_stop(early_stop):
            return ckpt.checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in model.parameters()]


def _train(mode: str, strict: bool | None, between: Callable[[Gated], None] | None = None,
           early_stop: bool = True) -> tuple[list[torch.Tensor], list[versionwatch.Report]]:
    """One forward and backward of ``Gated(mode)``; ``strict`` None: unwatched."""
    model = Gated(mode)
    torch.manual_seed(1)
    x = torch.randn(3, 4, requires_grad=True)
    reports: list[versionwatch.Report] = []

    def body() -> None:
        loss = model(x, early_stop).sum()
        if between is not None:
            between(model)
        loss.backward()

    if strict is None:
        body()
    else:
        with versionwatch.watch(model, strict=strict, on_hazard=reports.append):
            body()
    return [*_grads(model), x.grad.clone()], reports


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# -- a write inside the checkpointed function, repeated by the recomputation ------------

def test_probes() -> None:
    assert CHECKPOINT_PACK_CODE is not None  # every supported torch has the hook
    assert CHECKPOINT_EARLY_STOP_GLOBAL
    assert SEEN  # every supported torch: shown, or through the unpack hook's argument


@shown
def test_write_inside_is_silent_and_reported() -> None:
    plain, _ = _train("inplace", None)
    reference, _ = _train("out_of_place", None)
    assert not _same(plain, reference)  # trains wrongly, and PyTorch raises nothing
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        m = Gated("inplace")
        m.block(torch.randn(3, 4, requires_grad=True)).sum().backward()  # eager raises
    watched, reports = _train("inplace", True)
    assert _same(watched, plain)  # watching changes nothing
    assert len(reports) == 1
    h = reports[0].first
    assert h is not None
    assert (h.kind, h.cause, h.hidden_by, h.where) == (
        "silent", "checkpoint", "checkpoint(use_reentrant=False)", "SigmoidBackward0.result")
    save = line_of(Gated.block, "gate = torch.sigmoid")
    write = line_of(Gated.block, "gate.mul_(0.5)  # the write")
    call = line_of(_train, "loss = model(x, early_stop)")
    backward = line_of(_train, "loss.backward()")
    text, fix = str(reports[0]).rsplit("\n", 1)
    assert text == textwrap.dedent(f"""\
        versionwatch: backward will compute wrong gradients: `gate` (the output of Sigmoid, saved by its own backward), float32[3, 4] saved by SigmoidBackward0 inside checkpoint(use_reentrant=False) was modified in place after it was saved, and the recomputation during backward repeats the write
          tensor       `gate` (the output of Sigmoid, saved by its own backward), float32[3, 4]
          saved by     SigmoidBackward0.result at {HERE}:{save}: gate = torch.sigmoid(self.gate_proj(x)) (in model, during forward #1 called at {HERE}:{call}, at version 0)
          now at       version 1
          modified by  mul_() at {HERE}:{write}: gate.mul_(0.5)  # the write: sigmoid saved gate
          note         under checkpoint(use_reentrant=False) the recomputation during backward repeats this write, so SigmoidBackward0 gets the written value; PyTorch raises here without checkpointing
          note         PyTorch will not raise, and the gradients would be wrong
          backward at  {HERE}:{backward}""")
    # The patch offered: the out-of-place form, which is right under checkpointing too.
    assert fix.endswith(
        f"`gate = gate.mul(0.5)` instead of `gate.mul_(0.5)` at {HERE}:{write}: the out-of-place "
        "form leaves the tensor `sigmoid` saved as it was; the values stay the same")
    # Without the patch offered, the cause's own advice.
    assert h.fix == (
        "don't modify in place a tensor that an op inside the checkpointed function saved: use "
        "the out-of-place form (`x = x * s` instead of `x.mul_(s)`) or modify a `.clone()`")


@shown
def test_write_inside_raises_under_the_default_policy() -> None:
    model = Gated("inplace")
    x = torch.randn(3, 4, requires_grad=True)
    with versionwatch.watch(model, strict=True):
        loss = model(x).sum()
        with pytest.raises(versionwatch.InplaceModificationError, match="wrong gradients"):
            loss.backward()
    assert model.gate_proj.weight.grad is None  # stopped before the backward ran


@pytest.mark.parametrize("mode", ["out_of_place", "unsaved"])
def test_correct_programs_are_not_reported(mode: str) -> None:
    plain, _ = _train(mode, None)
    watched, reports = _train(mode, True)
    assert _same(watched, plain) and not reports
    if mode == "unsaved":  # the write to memory nobody saved changes no gradient
        model = Gated(mode)
        x = torch.randn(3, 4, requires_grad=True)
        model.block(x).sum().backward()  # eager PyTorch agrees: no error


def test_write_after_the_last_save_is_harmless_with_early_stop() -> None:
    # Eager PyTorch raises (the mul saved gate), but early stop ends the
    # recomputation at the last save, before the write: the gradient is right.
    plain, _ = _train("after_last", None)
    reference, _ = _train("none", None)
    assert _same(plain, reference)
    watched, reports = _train("after_last", True)
    assert _same(watched, plain) and not reports


@shown
def test_write_after_the_last_save_without_early_stop_is_reported() -> None:
    plain, _ = _train("after_last", None, early_stop=False)
    reference, _ = _train("none", None, early_stop=False)
    assert not _same(plain, reference)
    watched, reports = _train("after_last", True, early_stop=False)
    assert _same(watched, plain)
    # The mul saved gate too: both slots read the written gate.
    assert [(h.cause, h.where) for h in reports[0].hazards] == [
        ("checkpoint", "MulBackward0.self"), ("checkpoint", "SigmoidBackward0.result")]
    assert [str(m) for m in reports[0].hazards[1].modified_by] == [
        f"mul_() at {HERE}:{line_of(Gated.block, 'after the last save')}"]


# -- a write after the forward to what the recomputation reads again --------------------

def _scale_weight(model: Gated) -> None:
    with torch.no_grad():
        model.gate_proj.weight.mul_(2)  # a weight the checkpointed block reads again


def _scale_kept_gate(model: Gated) -> None:
    with torch.no_grad():
        model.kept.mul_(2)  # made inside the block: the recomputation makes it afresh


@shown
def test_write_to_a_parameter_after_the_forward_is_silent_and_reported() -> None:
    plain, _ = _train("none", None, _scale_weight)
    reference, _ = _train("none", None)
    assert not _same(plain, reference)
    watched, reports = _train("none", True, _scale_weight)
    assert _same(watched, plain)
    # gate_proj's weight: saved by its addmm (read again as it is), and the gate and
    # the mul's input are made again from it.
    assert [(h.kind, h.cause, h.where) for h in reports[0].hazards] == [
        ("silent", "checkpoint", "MulBackward0.self"),
        ("silent", "checkpoint", "SigmoidBackward0.result"),
        ("silent", "checkpoint", "AddmmBackward0.mat2")]
    write = line_of(_scale_weight, "mul_(2)")
    save = line_of(Gated.block, "out = x + gate")
    call = line_of(_train, "loss = model(x, early_stop)")
    backward = line_of(_train, "loss.backward()")
    assert str(reports[0]).splitlines()[:10] == textwrap.dedent(f"""\
        versionwatch: backward will compute wrong gradients: a tensor, float32[3, 4] saved by MulBackward0 inside checkpoint(use_reentrant=False) is made again during backward from a tensor that was changed after the forward
          tensor       a tensor, float32[3, 4]
          saved by     MulBackward0.self at {HERE}:{save}: out = x + gate * self.up(x) (in model, during forward #1 called at {HERE}:{call}, at version 0)
          now at       version 0
          note         under checkpoint(use_reentrant=False) the recomputation during backward makes this tensor again from model.gate_proj.weight as it is then, so MulBackward0 gets a value the forward never computed; without checkpointing the backward would use the forward's
          note         model.gate_proj.weight modified by mul_() at {HERE}:{write}: model.gate_proj.weight.mul_(2)  # a weight the checkpointed block reads again
          note         PyTorch will not raise, and the gradients would be wrong
          backward at  {HERE}:{backward}
          fix          model.gate_proj.weight was changed between the checkpointed forward and its backward, which recomputes from it: make that change after this backward, or re-run the forward after it
          also (2 more):""").splitlines()
    h = reports[0].hazards[2]  # the weight itself, saved and read again
    report = versionwatch.Report(hazards=[h])
    lines = str(report).splitlines()
    assert lines[0] == (
        "versionwatch: backward will compute wrong gradients: model.gate_proj.weight (saved as "
        "a view of it, float32[4, 4]) saved by AddmmBackward0 inside "
        "checkpoint(use_reentrant=False) was changed after the forward, and the recomputation "
        "during backward reads it as it is then")
    assert f"  modified by  mul_() at {HERE}:{write}: model.gate_proj.weight.mul_(2)" in lines[4]
    assert lines[5] == (
        "  note         under checkpoint(use_reentrant=False) the recomputation during backward "
        "reads it as it is then, after this write, so AddmmBackward0 gets the new value; "
        "PyTorch raises here without checkpointing")
    assert lines[6] == "  note         PyTorch will not raise, and the gradients would be wrong"
    assert h.fix == (
        "model.gate_proj.weight was changed between the checkpointed forward and its backward, "
        "which recomputes from it: make that change after this backward, or re-run the forward "
        "after it")


def test_write_to_an_intermediate_after_the_forward_is_not_reported() -> None:
    plain, _ = _train("none", None, _scale_kept_gate)
    reference, _ = _train("none", None)
    assert _same(plain, reference)  # the recomputation made the gate afresh
    watched, reports = _train("none", True, _scale_kept_gate)
    assert _same(watched, plain) and not reports


def test_a_swap_undone_before_the_backward_is_not_reported() -> None:
    def swap(model: Gated) -> None:
        w = model.gate_proj.weight
        backup = w.detach().clone()
        with torch.no_grad():
            w.mul_(2)
            w.copy_(backup)

    plain, _ = _train("none", None, swap)
    reference, _ = _train("none", None)
    assert _same(plain, reference)
    watched, reports = _train("none", True, swap)
    assert _same(watched, plain) and not reports


@shown
def test_optimizer_step_between_forward_and_backward() -> None:
    def run(strict: bool | None, step: bool) -> tuple[list[torch.Tensor], list[versionwatch.Report]]:
        model = Gated("none")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(3, 4)
        reports: list[versionwatch.Report] = []
        with (versionwatch.watch(model, opt, strict=True, on_hazard=reports.append)
              if strict else _nothing()):
            loss = model(x).pow(2).sum()
            loss.backward(retain_graph=True)
            if step:
                opt.step()
            opt.zero_grad()
            loss.backward()
        return _grads(model), reports

    plain, _ = run(None, True)
    reference, _ = run(None, False)
    assert not _same(plain, reference)
    watched, reports = run(True, True)
    assert _same(watched, plain)
    firsts = [r.first for r in reports if r.first is not None]
    assert firsts and {h.cause for h in firsts} == {"checkpoint"}
    # x needs no grad: no weight is saved, but the block's tensors are made again from them.
    assert firsts[0].notes[1].startswith("model.up.weight modified by opt.step() #1 at ")


def test_explicit_argument_written_after_the_forward_raises_as_plain() -> None:
    # checkpoint keeps fn's arguments with PyTorch's version check: not silent.
    def run(strict: bool | None) -> str:
        model = Gated("none")
        x = torch.randn(3, 4, requires_grad=True)
        h = x * 1
        reports: list[versionwatch.Report] = []
        with (versionwatch.watch(model, strict=True, on_hazard=reports.append)
              if strict else _nothing()):
            loss = model(h).sum()
            with torch.no_grad():
                h.mul_(2)
            try:
                loss.backward()
            except RuntimeError as e:
                # Predicted where torch keeps the arguments as saved tensors (as
                # PyTorch's own error: not silent); unpredicted on older torch.
                assert [r.first.kind for r in reports if r.first is not None] in (
                    [], ["inplace"]) if strict else not reports
                return str(e).split("\n")[0]
        return "no error"

    assert run(None) == run(True)
    assert "modified by an inplace operation" in run(None)


def _nothing() -> versionwatch.Watcher | object:
    import contextlib

    return contextlib.nullcontext()


# -- selective checkpointing --------------------------------------------------------------

def _selective(save: object) -> Callable[..., object]:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        return (ckpt.CheckpointPolicy.MUST_SAVE if op == save  # type: ignore[attr-defined]
                else ckpt.CheckpointPolicy.PREFER_RECOMPUTE)  # type: ignore[attr-defined]

    return functools.partial(ckpt.create_selective_checkpoint_contexts,  # type: ignore[attr-defined]
                             policy)


def _sac_run(save: object, inplace: bool, strict: bool | None
             ) -> tuple[list[torch.Tensor] | str, list[versionwatch.Report]]:
    torch.manual_seed(0)
    g, u = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(g(x))
        if inplace:
            gate.mul_(2)
        else:
            gate = gate * 2
        return x + gate * u(x)

    reports: list[versionwatch.Report] = []
    try:
        with (versionwatch.watch(g, strict=True, on_hazard=reports.append)
              if strict else _nothing()):
            y = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=_selective(save))
            y.sum().backward()
    except RuntimeError as e:
        return str(e), reports
    return [g.weight.grad.clone(), x.grad.clone()], reports


@pytest.mark.skipif(not SELECTIVE_CHECKPOINT, reason="no selective checkpointing in this torch")
@shown
def test_selective_checkpoint_recomputed_op_is_silent_and_reported() -> None:
    # addmm's outputs are cached; sigmoid is recomputed, and its output written.
    addmm = torch.ops.aten.addmm.default
    plain, _ = _sac_run(addmm, True, None)
    reference, _ = _sac_run(addmm, False, None)
    assert isinstance(plain, list) and isinstance(reference, list)
    assert not _same(plain, reference)
    watched, reports = _sac_run(addmm, True, True)
    assert isinstance(watched, list) and _same(watched, plain)
    h = reports[0].first
    assert h is not None
    assert (h.cause, h.hidden_by, h.where) == (
        "checkpoint", "selective checkpoint", "SigmoidBackward0.result")


@pytest.mark.skipif(not SELECTIVE_CHECKPOINT, reason="no selective checkpointing in this torch")
def test_selective_checkpoint_cached_output_raises_as_plain() -> None:
    # sigmoid's output is cached, with a version check: PyTorch raises, nothing silent.
    sigmoid = torch.ops.aten.sigmoid.default
    plain, _ = _sac_run(sigmoid, True, None)
    assert isinstance(plain, str) and "has been mutated" in plain
    watched, reports = _sac_run(sigmoid, True, True)
    assert watched == plain and not reports


# -- reentrant checkpointing --------------------------------------------------------------

def test_reentrant_write_inside_raises_as_plain() -> None:
    # The recomputed graph's own backward raises PyTorch's error; the prediction
    # cannot see that graph (it does not exist yet), and counts the node as not
    # verified. Strict mode packed the recomputed forward's saves: after the error it
    # names the write's line.
    notes: list[str] = []

    def run(strict: bool | None) -> str:
        model = Gated("inplace")
        x = torch.randn(3, 4, requires_grad=True)
        with versionwatch.watch(model, strict=True) if strict else _nothing():
            loss = ckpt.checkpoint(model.block, x, use_reentrant=True).sum()
            try:
                loss.backward()
            except RuntimeError as e:
                if strict:
                    notes[:] = getattr(e, "__notes__", [])
                return str(e)
        return "no error"

    assert run(None) == run(True)
    assert "modified by an inplace operation" in run(None)
    write = line_of(Gated.block, "gate.mul_(0.5)  # the write")
    assert f"  modified by  mul_() at {HERE}:{write}: gate.mul_(0.5)" in notes[0]


# -- the default mode, and watching changes nothing --------------------------------------

def test_default_mode_names_checkpointed_slots() -> None:
    model = Gated("none")
    x = torch.randn(3, 4, requires_grad=True)
    report = versionwatch.check(model(x).sum(), names=model)
    assert report.ok
    if SEEN:
        assert str(report) == (
            "versionwatch: backward is safe: 13 nodes, 0 saved tensors checked, 7 saved "
            "tensors inside checkpoint(use_reentrant=False) not verified: "
            "pytest --versionwatch-strict checks them")
    else:
        assert str(report).endswith(", 7 not verifiable (behind saved_tensors_hooks)")
    with versionwatch.watch(model) as w:
        model(x).sum().backward()
        model(x).sum().backward()
    assert not w.reports
    summary = unverified_summary(w._backward_pipeline.unverified)
    if SEEN:
        assert summary == ("; 14 saved tensors inside checkpoint(use_reentrant=False) not "
                           "verified (in 2 of them): pytest --versionwatch-strict checks them")
    else:
        assert summary == "; 14 saved tensors not verified (in 2 of them: 14 behind " \
                          "saved_tensors_hooks)"


@shown
def test_strict_mode_verifies_checkpointed_slots() -> None:
    model = Gated("none")
    x = torch.randn(3, 4, requires_grad=True)
    with versionwatch.watch(model, strict=True):
        report = versionwatch.check(model(x).sum(), names=model)
    # Seven saves inside fn (fn's argument, where torch keeps it, is not counted).
    assert report.ok and not report.unverifiable and report.saved_checked == 7


def test_cli_summary_is_not_a_bare_no_hazard(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        for _ in range(2):
            checkpoint(model, torch.randn(3, 4), use_reentrant=False).sum().backward()
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(versionwatch.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "versionwatch", "run", str(script)],
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    if SEEN:
        assert last == ("versionwatch: 2 backward(s) watched, no hazard; 8 saved tensors inside "
                        "checkpoint(use_reentrant=False) not verified (in 2 of them): --strict "
                        "checks them")
    else:
        assert last.startswith("versionwatch: 2 backward(s) watched, no hazard; 8 saved tensors "
                               "not verified")


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_training_is_bitwise_the_same_watched(strict: bool) -> None:
    def train(watch: bool) -> list[torch.Tensor]:
        model = Gated("none")
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.manual_seed(2)
        with versionwatch.watch(model, opt, strict=strict) if watch else _nothing():
            for _ in range(4):
                loss = model(torch.randn(5, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert _same(train(True), train(False))


def test_write_to_other_bytes_of_a_saved_weight_is_not_reported() -> None:
    # The block saves rows 2: of a weight (a view); rows :2 are written after the
    # forward. The version moves, the saved bytes do not: the gradient is right.
    # (A tensor made inside the block from part of a weight counts the whole weight:
    # docs/strict.md says so.)
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4))

    def block(x: torch.Tensor) -> torch.Tensor:
        return x @ weight[2:]

    def run(strict: bool | None, write: bool) -> tuple[list[torch.Tensor], list[versionwatch.Report]]:
        weight.grad = None
        x = torch.ones(3, 2, requires_grad=True)
        reports: list[versionwatch.Report] = []
        with (versionwatch.watch(nn.Module(), strict=True, on_hazard=reports.append)
              if strict else _nothing()):
            loss = ckpt.checkpoint(block, x, use_reentrant=False).sum()
            if write:
                with torch.no_grad():
                    weight[:2].mul_(2)
            loss.backward()
            with torch.no_grad():
                weight[:2].div_(2) if write else None
        return [weight.grad.clone(), x.grad.clone()], reports

    plain, _ = run(None, True)
    reference, _ = run(None, False)
    assert _same(plain, reference)
    watched, reports = run(True, True)
    assert _same(watched, plain) and not reports


def test_lightning_summary_is_not_a_bare_no_hazard(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("lightning")
    import logging

    from versionwatch.integrations.lightning import VersionWatch

    model = Gated("none")
    with versionwatch.watch(model) as w:
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    with caplog.at_level(logging.INFO, logger="versionwatch"):
        VersionWatch()._log_summary(w)
    [rec] = [r for r in caplog.records if r.name == "versionwatch"]
    assert rec.getMessage().startswith(
        "versionwatch: fit ended; 1 backward(s) predicted, no hazard; 7 saved tensors "
        + ("inside checkpoint(use_reentrant=False) not verified (in 1 of them): "
           "VersionWatch(strict=True) checks them; the latest events:" if SEEN
           else "not verified"))


@pytest.mark.parametrize("act", ["sigmoid", "tanh"])
def test_a_write_inside_is_reported_only_where_it_changes_the_saved_output(act: str) -> None:
    # relu_ after a sigmoid leaves every value as it was: eager PyTorch raises, but under
    # checkpointing the recomputed output is the same, and so is the gradient. add_(1)
    # after a tanh changes it: the gradient is wrong.
    def run(strict: bool | None, in_place: bool
            ) -> tuple[list[torch.Tensor], list[versionwatch.Report]]:
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)

        def fn(x: torch.Tensor) -> torch.Tensor:
            h = getattr(torch, act)(lin(x))
            if act == "sigmoid":
                h = torch.relu_(h) if in_place else torch.relu(h)
            else:
                h = h.add_(1) if in_place else h.add(1)
            return h * x  # a save after the write: early stop does not end before it

        reports: list[versionwatch.Report] = []
        with (versionwatch.watch(lin, strict=True, on_hazard=reports.append)
              if strict else _nothing()):
            ckpt.checkpoint(fn, x, use_reentrant=False).sum().backward()
        return [lin.weight.grad.clone(), x.grad.clone()], reports

    plain, _ = run(None, True)
    reference, _ = run(None, False)
    watched, reports = run(True, True)
    assert _same(watched, plain)
    if act == "sigmoid":
        assert _same(plain, reference) and not reports
    else:
        assert not _same(plain, reference)
        assert [h.where for h in reports[0].hazards] == ["TanhBackward0.result"]


def test_fix_verifies_the_out_of_place_write_against_the_program_as_meant(
        tmp_path: Path) -> None:
    """``versionwatch fix`` compares a patch with the program as its author meant it;
    under checkpointing that run calls the checkpointed function plainly (the
    recomputation would repeat the write, which no repair undoes), so the
    out-of-place patch is verified, not rejected for "values differ"."""
    (tmp_path / "train.py").write_text(textwrap.dedent('''\
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint


        class Gated(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj = nn.Linear(4, 4)
                self.up = nn.Linear(4, 4)

            def block(self, x):
                gate = torch.sigmoid(self.gate_proj(x))
                gate.mul_(0.5)
                return x + gate * self.up(x)

            def forward(self, x):
                return checkpoint(self.block, x, use_reentrant=False)


        torch.manual_seed(0)
        model = Gated()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(3, 4, requires_grad=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        '''))
    out = subprocess.run([sys.executable, "-m", "versionwatch", "fix", "train.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr  # a hazard, nothing applied
    assert "verified: `gate = gate.mul(...)`" in out.stdout, out.stdout + out.stderr
    assert "each optimizer step applies the gradients of the same losses as the program " \
        "meant, with the same values" in out.stdout
    assert "-        gate.mul_(0.5)\n+        gate = gate.mul(0.5)" in out.stdout


@pytest.mark.skipif(not hasattr(ckpt, "create_selective_checkpoint_contexts"),
                    reason="no selective checkpointing in this torch")
def test_records_make_no_cycle_that_keeps_the_cache_alive() -> None:
    """PyTorch's own test_storage_lifetime, under strict mode: with the garbage
    collector off, selective checkpointing's cached output dies with its graph.
    (A frame's records and its parameter records once held each other.)"""
    import gc
    import weakref

    from torch.utils._python_dispatch import _get_current_dispatch_mode

    found: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = x.cos().exp()
        mode = _get_current_dispatch_mode()
        if isinstance(mode, ckpt._CachingTorchDispatchMode):
            found.append(weakref.ref(mode.storage[torch.ops.aten.exp.default][0].val))
        return out.sin()

    def must_save(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        return ckpt.CheckpointPolicy.MUST_SAVE

    lin = nn.Linear(3, 3)
    with versionwatch.watch(lin, strict=True):
        gc.disable()
        try:
            x = torch.randn(3, requires_grad=True)
            out = ckpt.checkpoint(fn, x, use_reentrant=False, context_fn=functools.partial(
                ckpt.create_selective_checkpoint_contexts, must_save))
            assert found and found[0]() is not None
            del out
            assert found[0]() is None
        finally:
            gc.enable()


def test_records_do_not_pile_up_over_steps() -> None:
    """Memory flat over many steps: after each backward no checkpoint record is left,
    with the garbage collector off (no cycle needs it)."""
    import gc

    from versionwatch._runtime import installed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, opt, strict=True):
        gc.disable()
        try:
            for _ in range(300):
                x = torch.randn(2, 4, requires_grad=True)
                loss = ckpt.checkpoint(model, x, use_reentrant=False).pow(2).mean()
                assert installed().get("checkpoint records", 0) > 0  # the graph's, now
                opt.zero_grad()
                loss.backward()
                opt.step()
                assert installed().get("checkpoint records", 0) == 0
        finally:
            gc.enable()


def _reports_and_grads(model: nn.Module, step: Callable[[], None], watch: bool
                       ) -> tuple[list[object], list[torch.Tensor]]:
    reports: list[object] = []
    if watch:
        with versionwatch.watch(model, strict=True, on_hazard=reports.append):
            step()
    else:
        step()
    return reports, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _as_meant_and_unreported(
        run: Callable[[bool, bool], tuple[list[object], list[torch.Tensor]]]) -> None:
    """``run(checkpointed, watch)``: checkpointed plainly as the reference computes, the
    same watched, and no report."""
    _, reference = run(False, False)
    _, plain = run(True, False)
    reports, watched = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(reference, plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert reports == []


def test_a_write_to_other_rows_of_a_buffer_is_no_hazard() -> None:
    """An RNN that writes each state into a preallocated buffer (``hs[t + 1] = ...``)
    while the step before saved ``hs[t]``: the write covers other bytes of the same
    storage. Only the saved view's own bytes are compared, not the whole buffer's."""

    def run(checkpointed: bool, watch: bool) -> tuple[list[object], list[torch.Tensor]]:
        torch.manual_seed(0)
        cell = nn.Linear(4, 4)
        x = torch.randn(5, 2, 4)

        def unroll(x: torch.Tensor) -> torch.Tensor:
            hs = torch.zeros(6, 2, 4)
            for t in range(5):
                hs[t + 1] = torch.tanh(cell(hs[t]) + x[t])
            return hs

        def unroll_out_of_place(x: torch.Tensor) -> torch.Tensor:
            hs = [torch.zeros(2, 4)]
            for t in range(5):
                hs.append(torch.tanh(cell(hs[t]) + x[t]))
            return torch.stack(hs)

        def step() -> None:
            # Plainly the in-place unroll raises (hs[t] is saved, hs is written): the
            # reference is the out-of-place one.
            hs = ckpt.checkpoint(unroll, x, use_reentrant=False) if checkpointed \
                else unroll_out_of_place(x)
            hs.pow(2).sum().backward()

        return _reports_and_grads(cell, step, watch)

    _as_meant_and_unreported(run)


def test_a_write_to_rows_an_embedding_did_not_look_up_is_no_hazard() -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes, in place, the rows the second
    micro-batch looks up; the first one's backward reads only its own rows. What an
    embedding (an index, a slice) made is not counted as made from all the weight."""

    def run(checkpointed: bool, watch: bool) -> tuple[list[object], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": nn.Embedding(20, 4, max_norm=1.0), "lin": nn.Linear(4, 4)})

        def block(idx: torch.Tensor) -> torch.Tensor:
            e = model["emb"](idx)
            return torch.tanh(model["lin"](e)) * e

        def forward(idx: torch.Tensor) -> torch.Tensor:
            return ckpt.checkpoint(block, idx, use_reentrant=False) if checkpointed \
                else block(idx)

        def step() -> None:
            first = forward(torch.tensor([0, 1, 2])).pow(2).sum()
            second = forward(torch.tensor([3, 4, 5])).pow(2).sum()
            first.backward()
            second.backward()

        with torch.no_grad():
            model["emb"].weight.mul_(3)  # every row over max_norm: each lookup renormalizes
        return _reports_and_grads(model, step, watch)

    _as_meant_and_unreported(run)


@pytest.mark.skipif(not hasattr(ckpt._CheckpointFrame, "save_inputs"),
                    reason="this torch keeps checkpoint's arguments otherwise")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_write_to_an_explicit_argument_is_predicted(strict: bool) -> None:
    """PyTorch raises for it, when the recomputation unpacks checkpoint's saved
    arguments; the prediction checks them first (it was a miss in both modes)."""
    lin = nn.Linear(3, 3)
    reports: list[versionwatch.Report] = []
    with versionwatch.watch(lin, strict=strict, on_hazard=reports.append):
        x = torch.randn(2, 3, requires_grad=True)
        a = x * 2
        y = ckpt.checkpoint(lambda t: lin(t).sin(), a, use_reentrant=False)
        with torch.no_grad():
            a.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            y.sum().backward()
    assert len(reports) == 1
    h = reports[0].first
    assert h is not None and h.kind == "inplace" and h.slot == "checkpoint input 0"
    assert h.torch_message == str(e.value).split("\n")[0] or h.torch_message in str(e.value)
    assert any("keeps its tensor arguments" in n for n in h.notes)
    assert h.fix.startswith("checkpoint(use_reentrant=False) keeps its "), h.fix
