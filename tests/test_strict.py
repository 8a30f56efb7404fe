"""Strict mode: writes to saved memory caught at their line; silent writes; no false alarms."""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import InplaceModificationError


def line_of(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def mlp(act: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), act, nn.Linear(4, 1))


def test_write_to_a_saved_activation_is_named_before_backward_runs():
    model = mlp(nn.Sigmoid())
    x = torch.ones(2, 3)

    def body():
        h = model[1](model[0](x))
        h.mul_(2)  # the write
        with pytest.raises(InplaceModificationError) as info:
            h.sum().backward()
        return info.value

    with versionwatch.watch(model, strict=True) as w:
        err = body()
    assert model[0].weight.grad is None, "stopped before backward ran"
    (hz,) = err.report.hazards
    assert (hz.detected, hz.kind, hz.node, hz.slot) == (
        "predicted", "inplace", "SigmoidBackward0", "result")
    assert hz.module == "model.1" and "modified by an inplace operation" in str(err)
    (m,) = hz.modified_by
    assert m.kind == "inplace_op" and m.description == "mul_()"
    assert m.site is not None and m.site.line == line_of(body, "h.mul_(2)")
    assert m.site.code == "h.mul_(2)  # the write"
    assert "h.mul_(2)  # the write" in str(err)
    assert list(w.reports) == [err.report], "one report: the write itself raised nothing"


def test_stop_at_write_raises_before_the_write_happens():
    model = mlp(nn.Sigmoid())

    def body():
        h = model[1](model[0](torch.ones(2, 3)))
        before = h.clone()
        with pytest.raises(InplaceModificationError) as info:
            h.mul_(2)  # the write
        return h, before, info.value

    with versionwatch.watch(model, stop_at_write=True) as w:
        h, before, err = body()
    assert w.strict, "stop_at_write implies strict"
    assert torch.equal(h, before), "the write must not have happened"
    (hz,) = err.report.hazards
    assert hz.detected == "at_write" and hz.kind == "inplace" and hz.module == "model.1"
    assert "modified by an inplace operation" in str(err)
    (m,) = hz.modified_by
    assert m.site is not None and m.site.line == line_of(body, "h.mul_(2)")
    assert "stopped before the write" in str(err)


def seed_story(**kwargs):
    """loss1.backward(retain_graph=True); step(); loss2.backward() through the same graph."""
    model = mlp(nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, **kwargs) as w:
        h = model(torch.ones(2, 3))
        h.sum().backward(retain_graph=True)
        w2 = model[2].weight.detach().clone()
        try:
            opt.step()
            (h * 2).sum().backward()
        except InplaceModificationError as e:
            return model, w2, w, e
    raise AssertionError("no error")


def test_optimizer_step_on_a_retained_graph_is_named_at_the_second_backward():
    model, before, w, err = seed_story(strict=True)
    h = err.report.hazards[0]
    assert h.detected == "predicted" and h.tensor == "model.2.weight"
    assert h.modified_by[0].description.startswith("opt.step() #1")
    assert not torch.equal(model[2].weight, before), "the step ran: only backward was stopped"


def test_stop_at_write_stops_the_whole_step_before_it_writes():
    model, before, _, err = seed_story(stop_at_write=True)
    h = err.report.hazards[0]
    assert h.detected == "at_write" and h.tensor == "model.2.weight"
    assert h.modified_by[0].description.startswith("opt.step() #1")
    assert torch.equal(model[2].weight, before), "no parameter was updated"


def test_a_write_to_a_graph_that_never_runs_backward_again_is_no_hazard():
    # retain_graph=True out of habit: the step writes weights that graph saved,
    # but the graph is dropped, so PyTorch accepts the program; so does strict mode.
    model = mlp(nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, strict=True) as w:
        for _ in range(3):
            loss = model(torch.ones(2, 3)).sum()
            loss.backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
    assert list(w.reports) == []
    # stop_at_write cannot know the graph is done with: it stops at the step.
    with pytest.raises(InplaceModificationError, match="stopped before the write"):
        with versionwatch.watch(model, opt, stop_at_write=True):
            loss = model(torch.ones(2, 3)).sum()
            loss.backward(retain_graph=True)
            opt.step()


def test_relu_inplace_after_sigmoid_under_log_policy_predicts_with_the_write_site(caplog):
    model = mlp(nn.Sigmoid())
    relu = nn.ReLU(inplace=True)
    with versionwatch.watch(model, strict=True, on_hazard="log") as w:
        out = relu(model[1](model[0](torch.ones(2, 3))))  # writes sigmoid's saved result
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    (report,) = w.reports
    first = report.hazards[0]
    assert first.detected == "predicted" and first.node == "SigmoidBackward0"
    assert first.modified_by[0].description == "relu_()" and first.module == "model.1"
    # The user's line that ran nn.ReLU(inplace=True), not torch's own.
    assert first.modified_by[0].site.code.startswith("out = relu(model[1]")


def test_no_alarm_for_memory_no_live_graph_saved():
    model = mlp(nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    buf = torch.zeros(3)
    with versionwatch.watch(model, opt, strict=True) as w:
        x = torch.ones(3)
        x += 1  # a fresh tensor
        for _ in range(3):
            loss = model(torch.ones(2, 3)).sum()
            loss.backward()  # frees the graph
            opt.step()  # so this step writes memory no live graph saved
            opt.zero_grad()
            with torch.no_grad():
                buf.add_(1)
    assert list(w.reports) == []


def test_writes_through_data_are_silent_and_really_change_gradients():
    def grads(modify: bool, strict: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
        reports = []
        with versionwatch.watch(model, strict=strict, on_hazard=reports.append):
            loss = model(torch.ones(2, 3)).sum()
            if modify:
                model[2].weight.data.mul_(3)  # bumps no version: PyTorch can't see it
            loss.backward()
        return model[0].weight.grad.clone(), reports

    clean, none = grads(False, True)
    dirty, reports = grads(True, True)
    assert not torch.equal(clean, dirty), "the .data write must change the gradients"
    assert none == []
    (before_backward,) = reports
    h = before_backward.hazards[0]
    assert h.kind == "silent" and h.tensor == "model.2.weight"
    assert "without a version bump" in str(before_backward)
    assert (h.detected, h.node, h.slot) == ("predicted", "AddmmBackward0", "mat2")
    assert h.modified_by[0].kind == "inplace_op" and "mul_()" in h.modified_by[0].description
    _, default_mode = grads(True, False)
    assert default_mode == []  # only strict mode sees .data writes


def test_fused_adam_step_between_backwards_is_a_silent_hazard_in_default_mode():
    def run(fused: bool):
        torch.manual_seed(0)
        G, D = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
        opt_d = torch.optim.Adam(D.parameters(), lr=0.1, fused=fused)
        reports = []
        with versionwatch.watch({"G": G, "D": D}, opt_d, on_hazard=reports.append):
            fake = G(torch.randn(4, 2))
            d_loss = D(fake).mean()
            d_loss.backward(retain_graph=True)
            opt_d.step()
            err = None
            try:
                d_loss.backward()  # reuses D's graph, saved before the step
            except RuntimeError as e:
                err = e
        return G.weight.grad.clone(), reports, err

    g_unfused, rep_unfused, err_unfused = run(False)
    g_fused, rep_fused, err_fused = run(True)
    assert err_unfused is not None and "modified by an inplace operation" in str(err_unfused)
    assert rep_unfused[0].hazards[0].kind == "inplace"
    assert err_fused is None, "fused Adam bumps no version, so PyTorch raises nothing"
    kinds = {h.kind for h in rep_fused[0].hazards}
    assert kinds == {"silent"}
    assert {h.tensor for h in rep_fused[0].hazards} <= {"D.0.weight", "D.2.weight"}
    assert "fused: no version bump" in str(rep_fused[0])
    # The silent hazard is real: the second backward used the updated weights.
    torch.manual_seed(0)
    G, D = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    fake = G(torch.randn(4, 2))
    (D(fake).mean() * 2).backward()  # both backwards on the pre-step weights
    assert not torch.equal(g_fused, G.weight.grad)


def test_strict_training_is_bitwise_identical():
    def train(strict: bool | None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ctx = versionwatch.watch(model, opt, strict=strict) if strict is not None else None
        for _ in range(10):
            opt.zero_grad()
            loss = model(torch.randn(5, 4)).pow(2).mean()
            loss.backward()
            opt.step()
        if ctx is not None:
            ctx.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(None), train(True)):
        assert torch.equal(a, b)


def test_strict_patches_are_removed_on_exit_even_on_error():
    add_, relu_, setitem = torch.Tensor.add_, torch.relu_, torch.Tensor.__setitem__
    model = mlp(nn.Tanh())
    with pytest.raises(ZeroDivisionError), versionwatch.watch(model, strict=True):
        assert torch.Tensor.add_ is not add_
        1 / 0
    assert torch.Tensor.add_ is add_ and torch.relu_ is relu_
    assert torch.Tensor.__setitem__ is setitem
    assert "add_" not in vars(torch.Tensor)
    x = torch.ones(2, requires_grad=True)
    y = x.exp()
    # No saved-tensor hooks left: only an unhooked saved tensor takes new ones.
    y.grad_fn._raw_saved_result.register_hooks(lambda t: t, lambda t: t)


def test_user_function_mode_inside_strict():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    model = mlp(nn.Sigmoid())
    with versionwatch.watch(model, strict=True), Count():
        s = model[1](model(torch.ones(2, 3)))
        s.add_(1)
        with pytest.raises(InplaceModificationError) as info:
            s.sum().backward()
    assert Count.calls > 0
    assert info.value.report.hazards[0].modified_by[0].description == "add_()"


def test_user_dispatch_mode_inside_strict():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = mlp(nn.Sigmoid())
    with versionwatch.watch(model, strict=True), Writes():
        s = model[1](model(torch.ones(2, 3)))
        s.mul_(3)
        with pytest.raises(InplaceModificationError) as info:
            s.sum().backward()
    assert "aten.mul_.Tensor" in seen
    assert info.value.report.hazards[0].modified_by[0].description == "mul_()"


def test_threads_strict_in_one_forward_in_another():
    """Saved-tensor hooks are per thread: another thread's forward gets the default mode."""
    import threading

    def train(model, opt, out):
        try:
            for _ in range(5):
                opt.zero_grad()
                model(torch.ones(4, 3)).pow(2).sum().backward()
                opt.step()
            h = model[1](model[0](torch.ones(2, 3)))
            h.mul_(2)
            try:
                h.sum().backward()
            except InplaceModificationError as e:
                out.append(e.report.hazards[0])
            except RuntimeError as e:  # unwatched: PyTorch's own error, after all
                out.append(str(e))
        except BaseException as e:  # pragma: no cover - reported by the assert below
            out.append(e)

    def run(watched: bool):
        torch.manual_seed(0)
        main, other = mlp(nn.Sigmoid()), mlp(nn.Sigmoid())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (main, other)]
        out: list = []
        with (versionwatch.watch({"main": main, "other": other}, *opts, strict=True)
              if watched else contextlib.nullcontext()):
            t = threading.Thread(target=train, args=(other, opts[1], out))
            t.start()
            h = main[1](main[0](torch.ones(2, 3)))
            h.add_(1)  # main's thread: strict, with the line
            with pytest.raises(RuntimeError) as info:
                main[2](h).sum().backward()
            t.join()
        return [p.detach().clone() for p in other.parameters()], out, info.value

    params, out, err = run(True)
    unwatched, plain, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(params, unwatched)), "the worker trained alike"
    assert "modified by an inplace operation" in plain[0]
    (hz,) = out
    assert isinstance(hz, versionwatch.Hazard), hz
    # The worker's forward was not packed: predicted from PyTorch's own record, no line.
    assert hz.node == "SigmoidBackward0" and hz.detected == "predicted"
    assert [m.kind for m in hz.modified_by] != ["inplace_op"]
    assert err.report.hazards[0].modified_by[0].description == "add_()"


def test_strict_under_torch_compile():
    def f(model, x):
        h = model[1](model[0](x))
        h.mul_(2)
        return model[2](h)

    def train(strict: bool | None):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = mlp(nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="eager")
        ctx = versionwatch.watch(model, opt, strict=strict) if strict is not None else None
        with ctx if ctx is not None else contextlib.nullcontext():
            for _ in range(3):
                opt.zero_grad()
                compiled(torch.ones(4, 3)).pow(2).sum().backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(None), train(True)):
        assert torch.equal(a, b)
    model = mlp(nn.Sigmoid())
    g = torch.compile(f, backend="eager")
    with versionwatch.watch(model, strict=True):
        with pytest.raises(InplaceModificationError) as info:
            g(model, torch.ones(2, 3)).sum().backward()
    (m,) = info.value.report.hazards[0].modified_by
    # torch.fx's generated code is skipped: the write is placed in f, the function
    # torch.compile ran, not in <eval_with_key>.
    assert m.description == "mul_()" and m.site.file.endswith("test_strict.py")


def test_fused_step_between_backwards_is_silent_in_strict_mode_too():
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = torch.optim.Adam(D.parameters(), lr=0.1, fused=True)
    reports = []
    with versionwatch.watch(D, opt, strict=True, on_hazard=reports.append):
        loss = D(torch.randn(4, 2)).mean()
        loss.backward(retain_graph=True)
        opt.step()  # the step
        loss.backward()  # PyTorch raises nothing: the fused kernel bumped no version
    (report,) = reports
    (h,) = report.hazards
    assert (h.kind, h.tensor, h.node) == ("silent", "D.2.weight", "AddmmBackward0")
    (m,) = h.modified_by
    assert m.description == "opt.step() #1 (no version bump)" and m.site.code.startswith("opt.step()")


@pytest.mark.parametrize("write", [
    lambda h, x: torch.exp(x, out=h),
    lambda h, x: torch.linalg.matmul(x, torch.eye(4), out=h),
    lambda h, x: torch.special.expit(x, out=h),
    lambda h, x: h.index_put_((torch.tensor([0]),), torch.zeros(4)),
    lambda h, x: h.masked_fill_(x > 0, 0.0),
    lambda h, x: torch._foreach_add_([h], 1.0),
    lambda h, x: h.view(-1)[:2].zero_(),  # through a view
    lambda h, x: h.set_(torch.zeros(2, 4)),
], ids=["out=", "linalg out=", "special out=", "index_put_", "masked_fill_", "_foreach_add_",
        "view", "set_"])
def test_each_kind_of_write_is_named(write):
    model = mlp(nn.Sigmoid())
    x = torch.ones(2, 4)
    with versionwatch.watch(model, strict=True):
        h = model[1](model[0](torch.ones(2, 3)))
        write(h.detach(), x)  # the write, through an alias PyTorch tracks
        with pytest.raises(InplaceModificationError) as info:
            model[2](h).sum().backward()
    (m,) = info.value.report.hazards[0].modified_by
    assert m.kind == "inplace_op" and m.site.code.startswith("lambda h, x:")


def test_patches_cover_linalg_and_are_removed():
    matmul = torch.linalg.matmul
    with versionwatch.watch(mlp(nn.Tanh()), strict=True):
        assert torch.linalg.matmul is not matmul
    assert torch.linalg.matmul is matmul


def _gan_round(cls, scenario: str, fused: bool, watch: bool, allow: bool = False):
    """One round of a two-network loop; returns G's grads, the reports and PyTorch's error."""
    torch.manual_seed(0)
    G = nn.Linear(2, 2)
    D = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    kwargs = {"lr": 0.1, "fused": fused} if fused else {"lr": 0.1, "foreach": False}
    opt_d = cls(D.parameters(), **kwargs)
    reports: list = []
    err = None
    ctx = (versionwatch.watch({"G": G, "D": D}, opt_d, on_hazard=reports.append) if watch
           else contextlib.nullcontext())
    mode = torch.autograd.graph.allow_mutation_on_saved_tensors() if allow else contextlib.nullcontext()
    with ctx, mode:
        z = torch.randn(4, 2)
        if scenario == "step between backwards":  # the GAN bug: D steps, then G's loss reuses D's graph
            d_out = D(G(z))
            d_out.mean().backward(retain_graph=True)
            opt_d.step()
            loss = -d_out.mean()
        elif scenario == "step after every backward":  # the fix: G's loss gets a fresh forward
            D(G(z).detach()).mean().backward()
            opt_d.step()
            loss = -D(G(z)).mean()
        else:  # "step on a graph that saved none of D": only G's own graph is pending
            h = G(z).pow(2)
            D(torch.randn(4, 2)).mean().backward()
            opt_d.step()
            loss = h.mean()
        try:
            loss.backward()
        except RuntimeError as e:
            err = e
    return G.weight.grad.clone(), reports, err


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                 torch.optim.Adagrad], ids=lambda c: c.__name__)
@pytest.mark.parametrize("scenario", ["step between backwards", "step after every backward",
                                      "step on a graph that saved none of D"])
def test_fused_steps_are_flagged_exactly_where_gradients_go_wrong(cls, scenario):
    _, _, unfused_err = _gan_round(cls, scenario, fused=False, watch=False)
    truth, _, _ = _gan_round(cls, scenario, fused=False, watch=False, allow=True)
    fused_grad, reports, fused_err = _gan_round(cls, scenario, fused=True, watch=True)
    assert fused_err is None, "a fused step bumps no version: PyTorch raises nothing"
    hazard = bool(reports)
    # PyTorch rejects the unfused run exactly where the fused one is flagged...
    assert hazard == (unfused_err is not None), (scenario, reports, unfused_err)
    # ...and the fused gradients are wrong exactly there (a fused kernel rounds
    # differently from the unfused one: compare up to that).
    assert hazard == (not torch.allclose(fused_grad, truth, rtol=1e-5, atol=1e-7)), scenario
    if hazard:
        assert {h.kind for r in reports for h in r.hazards} == {"silent"}


def test_a_write_during_backward_is_explained_with_its_line():
    """A hook that writes a saved tensor mid-backward: no prediction can see it coming."""
    model = mlp(nn.Sigmoid())

    def body():
        s = model[1](model[0](torch.ones(2, 3)))
        y = model[2](s)

        def hook(g):
            with torch.no_grad():
                s.mul_(2)  # the write, during backward
            return g

        y.register_hook(hook)
        with pytest.raises(RuntimeError) as info:
            y.sum().backward()
        return info.value

    with versionwatch.watch(model, strict=True) as w:
        err = body()
    assert str(err).startswith("one of the variables needed for gradient computation has been "
                               "modified by an inplace operation: [torch.FloatTensor [2, 4]]")
    (late,) = w.reports
    (h,) = late.hazards
    assert (h.detected, h.node, h.module) == ("after_error", "AddmmBackward0", "model.2")
    (m,) = h.modified_by
    assert m.site.line == line_of(body, "s.mul_(2)")
    assert "s.mul_(2)  # the write, during backward" in "\n".join(err.__notes__)
    assert not hasattr(err, "versionwatch_saved"), "the error keeps no saved tensor alive"


def test_nested_strict_watchers():
    add_ = torch.Tensor.add_
    outer_model, inner_model = mlp(nn.Sigmoid()), mlp(nn.Sigmoid())
    with versionwatch.watch(outer_model, strict=True, on_hazard=lambda r: None) as outer:
        with versionwatch.watch(inner_model, strict=True) as inner:
            s = inner_model[1](inner_model[0](torch.ones(2, 3)))
            s.add_(1)
            with pytest.raises(InplaceModificationError) as info:
                inner_model[2](s).sum().backward()
        assert torch.Tensor.add_ is not add_, "the outer watcher is still strict"
        s = outer_model[1](outer_model[0](torch.ones(2, 3)))
        s.mul_(2)  # recorded by the outer watcher alone now
        with pytest.raises(RuntimeError):
            outer_model[2](s).sum().backward()
    assert torch.Tensor.add_ is add_
    assert info.value.report.hazards[0].modified_by[0].description == "add_()"
    assert inner.reports[0] is info.value.report
    assert outer.reports[-1].hazards[0].modified_by[0].description == "mul_()"


def test_a_step_that_raised_does_not_hide_later_writes():
    """A step's post-hook never runs if it raises: later writes must still be recorded."""
    model = mlp(nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        raise ValueError("the closure failed")

    def body():
        model(torch.ones(2, 3)).sum().backward(retain_graph=True)  # a live graph, .grads
        with pytest.raises(ValueError):
            opt.step(closure)
        s = model[1](model[0](torch.ones(2, 3)))
        s.mul_(2)  # the write
        with pytest.raises(InplaceModificationError) as info:
            model[2](s).sum().backward()
        return info.value

    with versionwatch.watch(model, opt, strict=True):
        err = body()
    (m,) = err.report.hazards[0].modified_by
    assert m.description == "mul_()" and m.site.line == line_of(body, "s.mul_(2)")


def test_lbfgs_closure_forward_writes_are_recorded_and_training_is_identical():
    def train(strict: bool | None):
        torch.manual_seed(0)
        model = mlp(nn.Tanh())
        opt = torch.optim.LBFGS(model.parameters(), max_iter=3)

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(4, 3)).pow(2).sum()
            loss.backward()
            return loss

        with (versionwatch.watch(model, opt, strict=True) if strict
              else contextlib.nullcontext()) as w:
            for _ in range(2):
                opt.step(closure)
            h = model[1](model[0](torch.ones(2, 3)))
            h.add_(1)  # after the steps, outside any of them
            with pytest.raises(RuntimeError) as info:
                model[2](h).sum().backward()
        return [p.detach().clone() for p in model.parameters()], info.value, w

    plain, _, _ = train(None)
    watched, err, w = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert err.report.hazards[0].modified_by[0].description == "add_()"
    assert len(w.reports) == 1


_DEEP = textwrap.dedent("""\
    import sys
    import torch
    from torch import nn
    import versionwatch

    mode, depth, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sys.setrecursionlimit(limit)

    class Wrap(nn.Module):
        def __init__(self, child):
            super().__init__()
            self.child = child
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.child(x) * self.scale

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    for i in range(depth):  # a Sequential in a module of the user's, and so on
        model = nn.Sequential(model) if i % 2 else Wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train():
        for _ in range(2):
            loss = model(torch.randn(3, 4)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

    if mode == "plain":
        train()
    else:
        with versionwatch.watch(model, opt, strict=mode == "strict") as w:
            train()
        assert not w.reports
    print(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
""")


@pytest.mark.parametrize(("depth", "limit"), [(200, 1000), (1000, 6000)])
def test_a_model_nested_deep_trains_under_strict_as_it_does_plain(tmp_path, depth, limit):
    """Strict mode adds no frame to a module call: where plain runs, strict runs too."""
    (tmp_path / "deep.py").write_text(_DEEP)

    def run(mode: str) -> str:
        r = subprocess.run([sys.executable, "deep.py", mode, str(depth), str(limit)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{mode}: {r.stderr[-2000:]}"
        return r.stdout

    plain = run("plain")
    assert run("strict") == plain
