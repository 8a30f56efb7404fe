"""Strict mode: a hook that edits in place a gradient that another node also receives.

Each harmful program's plain run computes other gradients than its out-of-place
reference (``return g * s``), and is reported; each near-identical correct one
computes the reference's gradients, and is not. Watching changes nothing
computed, and leaves no hook on any node.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import InplaceModificationError
from versionwatch._compat import engine_checks_gradients
from versionwatch._runtime import installed
from versionwatch._strict import gradients

pytestmark = pytest.mark.skipif(
    engine_checks_gradients(), reason="this torch raises for it itself: nothing to report")

TAIL = "PyTorch will not raise, and the gradients would be wrong"
FIX = ("return a new gradient from the hook (`return g * scale`) instead of modifying it "
       "in place (`g.mul_(scale)`)")


def line_of(fn: Callable[..., object], text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def watched(program: Callable[[bool], torch.Tensor]) -> tuple[torch.Tensor, list]:
    """``program(True)`` under a strict watcher that collects its reports."""
    reports: list = []
    with versionwatch.watch(nn.Linear(1, 1), strict=True, on_hazard=reports.append):
        out = program(True)
    assert gradients.pending_hooks() == 0, "every node hook is removed with the backward"
    return out, reports


# --- tensor hooks ---------------------------------------------------------------


def residual_tensor_hook(inplace: bool) -> torch.Tensor:
    """``h + sin(h)``: AddBackward0 hands the same gradient to the branch and the skip."""
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    h = x * 3
    b = h.sin()
    if inplace:
        b.register_hook(lambda g: g.mul_(0.5))  # the skip path is scaled too
    else:
        b.register_hook(lambda g: g * 0.5)
    ((h + b) * 2).sum().backward()
    return x.grad


def test_a_tensor_hook_that_scales_a_shared_gradient_in_place_is_reported():
    plain, reference = residual_tensor_hook(True), residual_tensor_hook(False)
    assert not torch.equal(plain, reference), "the in-place hook really changes the gradient"
    out, reports = watched(residual_tensor_hook)
    assert torch.equal(out, plain), "watched computes what plain computes"
    (report,) = reports
    h = report.first
    assert (h.kind, h.cause, h.detected, h.node) == ("silent", "gradient", "at_write",
                                                     "AddBackward0")
    site = h.modified_by[0].site
    assert site.line == line_of(residual_tensor_hook, "g.mul_(0.5))  # the skip")
    assert h.hidden_by == f"the hook at {site}"
    assert str(report) == "\n".join([
        f"versionwatch: backward would compute wrong gradients: the hook at {site} modified "
        "in place the gradient that AddBackward0 passes on, which another node also receives",
        "  gradient  the gradient that AddBackward0 passes on, float32[3]",
        f"  write     mul_() at {site}: b.register_hook(lambda g: g.mul_(0.5))  "
        "# the skip path is scaled too",
        "  note      the hook runs for SinBackward0; MulBackward0 reads the same tensor after "
        "the write",
        f"  note      {TAIL}",
        f"  fix       {FIX}",
    ])


def test_under_raise_the_backward_stops_before_the_node_that_would_read_the_write():
    x = torch.randn(3, requires_grad=True)
    h = x * 3
    b = h.sin()
    b.register_hook(lambda g: g.mul_(0.5))
    with versionwatch.watch(nn.Linear(1, 1), strict=True):
        with pytest.raises(InplaceModificationError) as info:
            ((h + b) * 2).sum().backward()
    assert info.value.report.first.cause == "gradient"
    assert x.grad is None, "the node that would read the write never ran"
    assert gradients.pending_hooks() == 0


def parameter_skip(inplace: bool) -> torch.Tensor:
    """``w + sin(3w)``: the skip path's node is the parameter's own AccumulateGrad."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    w = lin.weight
    b = (w * 3).sin()
    b.register_hook((lambda g: g.mul_(0.5)) if inplace else (lambda g: g * 0.5))
    reports: list = []
    with versionwatch.watch(lin, strict=True, on_hazard=reports.append):
        ((w + b) * 2).sum().backward()
    parameter_skip.reports = reports  # type: ignore[attr-defined]
    return w.grad


def test_the_other_node_is_named_by_the_parameter_it_accumulates_into():
    reference = parameter_skip(False)
    assert parameter_skip.reports == []  # type: ignore[attr-defined]
    plain = parameter_skip(True)  # watched; the tests above check that watching changes nothing
    assert not torch.equal(plain, reference)
    (report,) = parameter_skip.reports  # type: ignore[attr-defined]
    assert report.first.notes[0] == ("the hook runs for SinBackward0; AccumulateGrad of "
                                     "lin.weight reads the same tensor after the write")


def clone_pass_through(inplace: bool) -> torch.Tensor:
    """``clone``'s backward hands the hook's gradient itself on: only as the hook meant."""
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    y = (x * 3).clone().clone()
    y.register_hook((lambda g: g.mul_(0.5)) if inplace else (lambda g: g * 0.5))
    (y * 2).sum().backward()
    return x.grad


def clone_then_in_place(inplace: bool) -> torch.Tensor:
    """The residual program with ``g.clone().mul_(s)``: a private copy, edited in place."""
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    h = x * 3
    b = h.sin()
    b.register_hook((lambda g: g.clone().mul_(0.5)) if inplace else (lambda g: g * 0.5))
    ((h + b) * 2).sum().backward()
    return x.grad


def unshared_tensor_hook(inplace: bool) -> torch.Tensor:
    """A gradient that one node alone receives (``MulBackward0``'s, of ``h * 2``)."""
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    b = (x * 3).sin()
    b.register_hook((lambda g: g.mul_(0.5)) if inplace else (lambda g: g * 0.5))
    (b * 2).sum().backward()
    return x.grad


@pytest.mark.parametrize("program", [clone_pass_through, clone_then_in_place,
                                     unshared_tensor_hook, residual_tensor_hook])
def test_correct_hooks_are_not_reported(program):
    # residual_tensor_hook(False) is the out-of-place hook itself.
    reference = program(False)
    if program is not residual_tensor_hook:
        assert torch.equal(program(True), reference), "really harmless"
    reports: list = []
    with versionwatch.watch(nn.Linear(1, 1), strict=True, on_hazard=reports.append):
        out = program(program is not residual_tensor_hook)
    assert torch.equal(out, reference)
    assert reports == []
    assert gradients.pending_hooks() == 0


# --- module backward hooks --------------------------------------------------------


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def residual_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Residual())


def pre_hook_program(inplace: bool) -> torch.Tensor:
    model = residual_model()

    def scale(module, grad_output):
        if inplace:
            grad_output[0].mul_(0.5)  # the skip path's gradient too
            return None
        return (grad_output[0] * 0.5,)

    model[1].inner.register_full_backward_pre_hook(scale)
    (model(torch.randn(2, 4)) * 2).sum().backward()
    return model[0].weight.grad


def test_a_full_backward_pre_hook_that_edits_grad_output_in_place_is_reported():
    plain, reference = pre_hook_program(True), pre_hook_program(False)
    assert not torch.equal(plain, reference)
    out, reports = watched(pre_hook_program)
    assert torch.equal(out, plain)
    (report,) = reports
    h = report.first
    assert h.modified_by[0].site.line == line_of(pre_hook_program, "grad_output[0].mul_(0.5)")
    assert h.notes == ["the hook runs for a Linear; AddmmBackward0 reads the same tensor "
                       "after the write", TAIL]
    assert h.node == "AddBackward0"


def full_hook_on_grad_output(inplace: bool) -> torch.Tensor:
    model = residual_model()

    def hook(module, grad_input, grad_output):
        if inplace:
            grad_output[0].mul_(0.5)  # after the module's backward: only the skip sees it

    model[1].inner.register_full_backward_hook(hook)
    (model(torch.randn(2, 4)) * 2).sum().backward()
    return model[0].weight.grad


def test_a_full_backward_hook_that_edits_grad_output_in_place_is_reported():
    # No out-of-place form: grad_output cannot be replaced. The write changes
    # what the skip path reads, and nothing the module's own backward used.
    plain, unhooked = full_hook_on_grad_output(True), full_hook_on_grad_output(False)
    assert not torch.equal(plain, unhooked)
    out, reports = watched(full_hook_on_grad_output)
    assert torch.equal(out, plain)
    (report,) = reports
    h = report.first
    assert h.modified_by[0].site.line == line_of(full_hook_on_grad_output, "].mul_(0.5)")
    assert h.node == "AddBackward0"


def full_hook_on_grad_input(inplace: bool) -> torch.Tensor:
    model = residual_model()

    def hook(module, grad_input, grad_output):
        if inplace:
            grad_input[0].mul_(0.5)  # the module's own new gradient: nobody else has it
            return None
        return (grad_input[0] * 0.5,)

    model[1].inner.register_full_backward_hook(hook)
    (model(torch.randn(2, 4)) * 2).sum().backward()
    return model[0].weight.grad


def test_a_full_backward_hook_that_edits_its_own_grad_input_is_not_reported():
    reference = full_hook_on_grad_input(False)
    assert torch.equal(full_hook_on_grad_input(True), reference), "really harmless"
    out, reports = watched(full_hook_on_grad_input)
    assert torch.equal(out, reference)
    assert reports == []


# --- post-accumulate-grad hooks ---------------------------------------------------


def post_accumulate(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)

    def hook(p):
        if inplace:
            p.grad.mul_(0.5)
        else:
            p.grad = p.grad * 0.5

    b.register_post_accumulate_grad_hook(hook)
    ((x * 2 + b) * 2).sum().backward()
    return x.grad, b.grad


def test_a_post_accumulate_grad_hook_edits_an_unshared_grad():
    # AccumulateGrad keeps the gradient it receives as .grad only when no other
    # node holds it (else it keeps a copy): p.grad is the parameter's own.
    reference = post_accumulate(False)
    plain = post_accumulate(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, reference)), "really harmless"
    reports: list = []
    with versionwatch.watch(nn.Linear(1, 1), strict=True, on_hazard=reports.append):
        out = post_accumulate(True)
    assert all(torch.equal(a, b) for a, b in zip(out, reference))
    assert reports == []
    assert gradients.pending_hooks() == 0


# --- invisible -------------------------------------------------------------------


def train(steps: int = 3) -> list[torch.Tensor]:
    model = residual_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def scale(module, grad_output):
        grad_output[0].mul_(0.5)

    model[1].inner.register_full_backward_pre_hook(scale)
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.randn(2, 4)) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_watched_training_is_bitwise_plain_and_leaves_no_hook():
    plain = train()
    reports: list = []
    with versionwatch.watch(nn.Linear(1, 1), strict=True, on_hazard=reports.append):
        watched_weights = train()
    assert all(torch.equal(a, b) for a, b in zip(plain, watched_weights))
    assert [r.first.cause for r in reports] == ["gradient"] * 3
    assert gradients.pending_hooks() == 0
    assert installed() == {}, "nothing of versionwatch's is left"
    # A retained graph whose backward was watched runs again, after close,
    # with no node hook of strict mode's left on it.
    x = torch.randn(3, requires_grad=True)
    h = x * 3
    b = h.sin()
    b.register_hook(lambda g: g.mul_(0.5))
    loss = ((h + b) * 2).sum()
    with versionwatch.watch(nn.Linear(1, 1), strict=True, on_hazard=reports.append):
        loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, first)
    assert len(reports) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_hooks_run_on_a_device_thread_and_are_seen():
    """On CUDA the engine runs the hooks on its device thread, not the caller's:
    the in-place wrappers are process-wide, and the graph is found from the
    caller's frame on the other thread."""
    def program(inplace: bool) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(3, device="cuda", requires_grad=True)
        h = x * 3
        b = h.sin()
        b.register_hook((lambda g: g.mul_(0.5)) if inplace else (lambda g: g * 0.5))
        ((h + b) * 2).sum().backward()
        return x.grad.cpu()

    plain, reference = program(True), program(False)
    assert not torch.equal(plain, reference)
    out, reports = watched(program)
    assert torch.equal(out, plain)
    (report,) = reports
    assert report.first.device == "cuda:0"
    assert "on cuda:0" in str(report)


def test_the_probe_says_what_this_torch_does():
    """_compat's probe against the same program run plainly: raises, or computes it wrong."""
    x = torch.ones(1, requires_grad=True)
    a, b = x * 1.0, x * 1.0
    b.register_hook(lambda g: g.mul_(2))
    try:
        (a + b).backward()
    except RuntimeError:
        raised = True
    else:
        raised = False
        assert x.grad.item() == 4.0, "b's node ran first; a's read the doubled gradient"
    assert engine_checks_gradients() is raised


@pytest.mark.parametrize("where", ["every parameter", "every layer's output"])
def test_in_place_hooks_whose_gradient_one_node_reads_are_not_reported(where: str) -> None:
    """Each hook's own node reads what its hook made: as meant. Once an earlier write
    in the same backward had set the watch up, each later hook's own node was
    reported as "another node" (gradient clipping hooks on every parameter, a
    gradient-accumulation ``g.div_(4)``)."""

    def run(in_place: bool, watch: bool) -> tuple[list[torch.Tensor], list[object]]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1))

        def hook(g: torch.Tensor) -> torch.Tensor | None:
            return g.clamp_(-0.01, 0.01) if in_place else g.clamp(-0.01, 0.01)

        reports: list[object] = []

        def step() -> None:
            if where == "every parameter":
                for p in m.parameters():
                    p.register_hook(hook)
                m(torch.randn(3, 4)).pow(2).sum().backward()
                return
            h = torch.randn(3, 4)
            for layer in m:
                h = layer(h)
                if isinstance(layer, nn.Linear):
                    h.register_hook(hook)
            h.pow(2).sum().backward()

        if watch:
            with versionwatch.watch(m, strict=True, on_hazard=reports.append):
                step()
        else:
            step()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None], reports

    reference, _ = run(False, False)
    plain, _ = run(True, False)
    watched, reports = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(reference, plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert reports == []
