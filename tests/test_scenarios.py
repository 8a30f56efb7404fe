"""Hand-written scenarios: every backward is predicted, then run; they must agree."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import versionwatch
from oracle import Oracle
from versionwatch._compat import SAVED_INTROSPECTION

ROOT = Path(__file__).resolve().parents[1]


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def expect_failure(oracle: Oracle, fn, kind: str = "inplace") -> versionwatch.Report:
    with pytest.raises(RuntimeError):
        fn()
    assert oracle.failures and oracle.failures[-1].kind == kind
    return oracle.reports[-1]


# --- the seed story -------------------------------------------------------------

def seed_loop(oracle: Oracle, set_to_none: bool, iterations: int = 3) -> list[str]:
    model = runpy.run_path(str(ROOT / "examples" / "seed_story.py"))["Model"]()
    oracle.names = model
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = nn.MSELoss()
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    log = []
    for n in range(1, iterations + 1):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=set_to_none)
        oracle.backward(mse(y1_pred, y1), retain_graph=True)
        log.append(f"{n}.1")
        optim.step()
        optim.zero_grad(set_to_none=set_to_none)
        oracle.backward(mse(y2_pred, y2))
        log.append(f"{n}.2")
        optim.step()
    return log


def test_seed_story_set_to_none_false_fails_at_second_backward_of_second_iteration(oracle):
    log: list[str] = []
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        log = seed_loop(oracle, set_to_none=False)
    assert [o.kind for o in oracle.outcomes] == [None, None, None, "inplace"]
    h = oracle.reports[-1].hazards[0]
    assert (h.tensor, h.node, h.slot, h.saved_version, h.current_version) == (
        "w3", "MulBackward0", "other", 1, 2)
    # check() saw no write: the fix names both kinds it can be, and both ways out.
    assert "(an optimizer step, or an update under torch.no_grad())" in h.fix
    assert "make that change after this backward, or re-run the forward after it" in h.fix
    assert log == []


def test_seed_story_set_to_none_true_never_fails(oracle):
    assert seed_loop(oracle, set_to_none=True, iterations=4) == [
        f"{n}.{k}" for n in range(1, 5) for k in (1, 2)]
    assert all(r.ok for r in oracle.reports)


# --- saved outputs and activations ------------------------------------------------

def test_clean_mlp_is_safe(oracle):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    oracle.backward(model(torch.randn(3, 4)).sum())
    assert oracle.reports[0].ok and oracle.reports[0].saved_checked > 0


@pytest.mark.parametrize("act", [torch.sigmoid, torch.tanh, torch.exp])
def test_relu_inplace_after_saved_output(oracle, act):
    x = leaf(5)
    y = nn.ReLU(inplace=True)(act(x))
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    h = r.hazards[0]
    assert h.saved_output and h.slot == "result"
    assert f"output of `{act.__name__}`" in h.fix


def test_plus_equals_on_saved_output(oracle):
    x = leaf(3)
    y = x.sigmoid()
    y += 1
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    assert "`x = x + y`" in r.hazards[0].fix


def test_index_assignment_on_saved_input(oracle):
    a, b = leaf(4), leaf(4)
    h = a.exp()
    y = h * b
    h[0] = 0.0
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    assert {x.where for x in r.hazards} >= {"MulBackward0.self"}


def test_masked_fill_on_saved_input(oracle):
    a, b = leaf(4), leaf(4)
    h = a * 2
    y = h * b
    h.masked_fill_(h > 0, 0.0)
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    assert "masked_fill" in r.hazards[0].fix


def test_out_of_place_version_is_safe(oracle):
    x = leaf(3)
    y = x.sigmoid()
    y = y + 1
    oracle.backward(y.sum())


def test_mutating_a_view_of_a_saved_tensor(oracle):
    x = leaf(4)
    y = x.exp()
    z = y.sin()
    y[1:3].mul_(2)  # a view shares y's version counter
    expect_failure(oracle, lambda: oracle.backward(z.sum()))


def test_mutating_the_base_of_a_saved_view(oracle):
    x = leaf(4)
    y = x.exp()
    v = y[1:]
    z = v.sin()
    with torch.no_grad():
        y.add_(1)
    expect_failure(oracle, lambda: oracle.backward(z.sum()))


def test_detach_shares_the_version_counter(oracle):
    x = leaf(3)
    y = x.exp()
    y.detach().zero_()
    expect_failure(oracle, lambda: oracle.backward(y.sum()))


def test_modifying_an_unsaved_tensor_is_safe(oracle):
    x = leaf(3)
    y = x + 1  # AddBackward saves nothing
    z = y * 2  # a scalar multiplier: MulBackward1 saves no tensor
    y.mul_(3)
    oracle.backward(z.sum())


def test_linear_weight_modified_through_parameter(oracle):
    fc = nn.Linear(3, 2)
    oracle.names = {"model": fc}
    out = fc(leaf(4, 3)).sum()
    with torch.no_grad():
        fc.weight.mul_(0.5)
    r = expect_failure(oracle, lambda: oracle.backward(out))
    h = r.hazards[0]
    assert h.tensor is not None and h.tensor.startswith("model.weight")
    assert "an optimizer step, or an update under torch.no_grad()" in h.fix


def test_leaf_data_input_modified(oracle):
    w = leaf(3)
    x = torch.randn(3)  # data, no grad
    y = (x * w).sum()
    x.add_(1)
    r = expect_failure(oracle, lambda: oracle.backward(y))
    assert r.hazards[0].requires_grad is False


def test_two_stale_tensors_in_one_node(oracle):
    a, b = leaf(3), leaf(3)
    ea, eb = a.exp(), b.exp()
    y = ea * eb
    with torch.no_grad():
        ea.add_(1)
        eb.add_(1)
        eb.add_(1)
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    mul = [h for h in r.hazards if h.node == "MulBackward0"]
    assert {(h.saved_version, h.current_version) for h in mul} == {(0, 1), (0, 2)}


# --- which nodes run: inputs= and autograd.grad -----------------------------------

def _branches():
    a, b, c = leaf(3), leaf(3), leaf(3)
    e = a.exp()
    loss = e.sum() + (b * c).sum()
    with torch.no_grad():
        e.add_(1)  # stale, but only on the branch to `a`
    return a, b, c, loss


def test_inputs_skip_a_branch_that_does_not_lead_to_them(oracle):
    _, _, c, loss = _branches()
    oracle.backward(loss, inputs=[c])
    assert oracle.reports[0].ok


def test_without_inputs_the_same_branch_fails(oracle):
    _, _, _, loss = _branches()
    expect_failure(oracle, lambda: oracle.backward(loss))


def test_inputs_that_reach_the_stale_branch_fail(oracle):
    a, _, _, loss = _branches()
    expect_failure(oracle, lambda: oracle.backward(loss, inputs=[a]))


def test_autograd_grad_skips_a_stale_branch(oracle):
    _, b, _, loss = _branches()
    (g,) = oracle.grad(loss, [b])
    assert g is not None


def test_an_executed_node_unpacks_every_saved_tensor(oracle):
    p, q = leaf(3), leaf(3)
    y = p * q  # saves self=p (for q's grad) and other=q (for p's grad)
    with torch.no_grad():
        p.add_(1)
    # Only p's gradient is wanted, which needs q alone; MulBackward0 still unpacks p.
    r = expect_failure(oracle, lambda: oracle.backward(y.sum(), inputs=[p]))
    assert r.hazards[0].where == "MulBackward0.self"


def _nonleaf_input():
    x, w = leaf(3), leaf(3)
    y = x.exp()  # ExpBackward saves its result, y
    z = y + w  # AddBackward saves nothing
    with torch.no_grad():
        y.add_(1)
    return y, z


def test_grad_wrt_a_non_leaf_does_not_run_its_node(oracle):
    y, z = _nonleaf_input()
    oracle.grad(z.sum(), [y])


def test_backward_inputs_a_non_leaf_runs_its_node(oracle):
    y, z = _nonleaf_input()
    expect_failure(oracle, lambda: oracle.backward(z.sum(), inputs=[y]))


def test_multiple_outputs_share_nodes(oracle):
    x = leaf(3)
    h = x.sigmoid()
    l1, l2 = h.sum(), (h * 2).sum()
    oracle.backward([l1, l2], retain_graph=True)
    h.mul_(1.0)
    expect_failure(oracle, lambda: oracle.backward([l1, l2]))


def test_multiple_outputs_with_inputs(oracle):
    a, b = leaf(3), leaf(3)
    ea = a.exp()
    l1, l2 = ea.sum(), (b * b).sum()
    with torch.no_grad():
        ea.add_(1)
    oracle.backward([l1, l2], inputs=[b])
    expect_failure(oracle, lambda: oracle.backward([l1, l2], inputs=[a]))


def test_leaf_output_runs_only_accumulate_grad(oracle):
    w = leaf(3)
    r = versionwatch.check(w, grad_outputs=torch.ones(3))
    assert r.ok and r.nodes == 1
    oracle.backward(w.sum())


# --- retain_graph, freed graphs, double backward ---------------------------------

def test_retain_graph_then_second_backward(oracle):
    x = leaf(3)
    y = (x.exp() * x).sum()
    oracle.backward(y, retain_graph=True)
    oracle.backward(y)


def test_second_backward_on_a_freed_graph(oracle):
    x = leaf(3)
    y = (x.exp() * x).sum()
    oracle.backward(y)
    r = expect_failure(oracle, lambda: oracle.backward(y), kind="freed")
    assert "second time" in str(r) and "retain_graph=True" in r.hazards[0].fix


def test_gan_alternating_updates_with_retain_graph(oracle):
    G, D = nn.Linear(2, 2), nn.Linear(2, 1)
    oracle.names = {"G": G, "D": D}
    opt_g = torch.optim.Adam(G.parameters())
    opt_d = torch.optim.Adam(D.parameters())
    fake = G(torch.randn(4, 2))
    d_loss = D(fake).mean()
    oracle.backward(d_loss, retain_graph=True)
    opt_d.step()  # updates D's weight in place, after its forward saved it
    g_loss = -D(fake).mean() + d_loss * 0  # reuses the old D graph through d_loss
    r = expect_failure(oracle, lambda: oracle.backward(g_loss))
    assert r.hazards[0].tensor is not None and r.hazards[0].tensor.startswith("D.weight")
    opt_g.zero_grad()


def test_gan_done_right(oracle):
    G, D = nn.Linear(2, 2), nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    for _ in range(2):
        fake = G(torch.randn(4, 2))
        opt_d.zero_grad()
        oracle.backward(D(fake.detach()).mean())
        opt_d.step()
        opt_g.zero_grad()
        oracle.backward(-D(fake).mean())
        opt_g.step()


def test_double_backward(oracle):
    x = leaf(3)
    y = (x ** 3).sum()
    (g,) = oracle.grad(y, [x], create_graph=True)
    oracle.backward(g.sum(), retain_graph=True)
    with torch.no_grad():
        x.mul_(2)
    expect_failure(oracle, lambda: oracle.backward(g.sum()))


# --- custom Functions, saved sequences, non-tensor saved values -------------------

class SaveBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        y = x.exp()
        ctx.save_for_backward(x, y)
        ctx.k = k  # a non-tensor saved value
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y * ctx.k, None


def test_custom_function_clean(oracle):
    oracle.backward(SaveBoth.apply(leaf(3), 2.0).sum())


def test_custom_function_input_modified(oracle):
    x = leaf(3)
    h = x * 1.0
    y = SaveBoth.apply(h, 2.0)
    with torch.no_grad():
        h.add_(1)
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    # Without saved-tensor introspection the list fails as a whole (docs/versions.md).
    assert r.hazards[0].slot == ("saved_tensors[0]" if SAVED_INTROSPECTION else "saved_tensors")
    assert r.hazards[0].node == "SaveBothBackward"


def test_custom_function_output_modified(oracle):
    y = SaveBoth.apply(leaf(3), 2.0)
    with torch.no_grad():
        y.mul_(2)
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    assert r.hazards[0].slot == ("saved_tensors[1]" if SAVED_INTROSPECTION else "saved_tensors")


def test_custom_function_freed(oracle):
    y = SaveBoth.apply(leaf(3), 2.0).sum()
    oracle.backward(y)
    expect_failure(oracle, lambda: oracle.backward(y), kind="freed")


def test_tuple_of_saved_tensors(oracle):
    x = leaf(5)
    idx = torch.tensor([0, 2])
    y = x[idx]  # IndexBackward0 saves a list of index tensors
    idx.zero_()
    r = expect_failure(oracle, lambda: oracle.backward(y.sum()))
    assert r.hazards[0].where == "IndexBackward0.indices[0]"


def test_non_tensor_saved_values(oracle):
    x = leaf(3)
    oracle.backward(x.pow(2).clamp(min=0.1).sum())
    assert oracle.reports[0].ok


# --- saved tensors behind hooks are never unpacked ---------------------------------

def test_saved_tensors_hooks_are_not_verifiable_and_never_called(oracle):
    calls = []

    def unpack(t):
        calls.append(1)
        return t

    x = leaf(3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = x.exp()
    with torch.no_grad():
        y.add_(1)  # PyTorch cannot check versions through hooks: no error
    r = versionwatch.check(y.sum())
    assert calls == [] and r.ok and r.unverifiable == [("ExpBackward0", "result")]
    assert "not verifiable" in str(r)
    oracle.backward(y.sum())


def test_save_on_cpu_is_not_verifiable(oracle):
    x = leaf(3)
    with torch.autograd.graph.save_on_cpu():
        y = (x.exp() * x).sum()
    r = versionwatch.check(y)
    assert r.ok and len(r.unverifiable) == 3
    oracle.backward(y)


def test_non_reentrant_checkpoint_is_not_verifiable(oracle):
    lin = nn.Linear(3, 3)
    x = leaf(2, 3)
    y = checkpoint(lambda t: F.gelu(lin(t)), x, use_reentrant=False).sum()
    r = versionwatch.check(y)
    assert r.ok and r.unverifiable
    oracle.backward(y)


# --- what check() must not do ----------------------------------------------------

def test_check_changes_nothing():
    w = nn.Parameter(torch.ones(3))
    s = leaf(3)
    loss = (s * w).sum()
    loss.backward(retain_graph=True)
    with torch.no_grad():
        w.add_(1)
    before = (w._version, w.grad.clone(), w.grad._version, s.grad.clone())
    assert not versionwatch.check(loss).ok
    assert (w._version, w.grad._version) == (before[0], before[2])
    assert torch.equal(w.grad, before[1]) and torch.equal(s.grad, before[3])


def test_assert_backward_safe_raises_runtime_error_subclasses():
    x = leaf(3)
    y = x.sigmoid()
    y.add_(1)
    with pytest.raises(versionwatch.InplaceModificationError) as info:
        versionwatch.assert_backward_safe(y.sum())
    assert isinstance(info.value, RuntimeError)
    assert "modified by an inplace operation" in str(info.value)
    assert info.value.report.hazards[0].where == "SigmoidBackward0.result"
    z = (x * x).sum()
    z.backward()
    with pytest.raises(versionwatch.FreedGraphError, match="backward through the graph a second"):
        versionwatch.assert_backward_safe(z)
    versionwatch.assert_backward_safe((x * x).sum())


class DoubleInPlace(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        DoubleInPlace.calls += 1
        return g * 2


def test_check_never_runs_a_custom_backward_inside_copyslices(oracle):
    DoubleInPlace.calls = 0  # other tests run this one too (test_native's scenarios)
    x = leaf(3)
    h = x.clone()
    DoubleInPlace.apply(h[:2])  # a custom in-place op on a view: CopySlices wraps it
    r = versionwatch.check(h.sum())
    assert DoubleInPlace.calls == 0, "check() ran user code"
    assert r.ok and r.unverifiable == [("torch::autograd::CopySlices", "fn")]
    # Not "behind saved_tensors_hooks": no hook is involved (the old text said so).
    assert str(r).endswith(
        ", 1 not verifiable (an in-place custom Function on a view (CopySlices), not run)")
    oracle.backward(h.sum())
    assert DoubleInPlace.calls == 1


def test_unverifiable_reasons_are_counted_each(oracle):
    x = leaf(3)
    h = x.clone()
    DoubleInPlace.apply(h[:2])
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = (h.exp() * 2).sum()
    r = versionwatch.check(y)
    assert r.ok and r.unverifiable == [("ExpBackward0", "result"),
                                       ("torch::autograd::CopySlices", "fn")]
    assert str(r).endswith(
        ", 2 not verifiable (1 behind saved_tensors_hooks; "
        "1 an in-place custom Function on a view (CopySlices), not run)")
    assert [u["why"] for u in r.to_dict()["unverifiable"]] == [
        "behind saved_tensors_hooks",
        "an in-place custom Function on a view (CopySlices), not run"]
    oracle.backward(y)
