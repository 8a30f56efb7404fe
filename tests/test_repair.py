"""``on_hazard="repair"``: backward after ``step()`` computes the gradients of the forward that ran.

Each program runs 20 steps three ways: watched with repair, inside PyTorch's
``allow_mutation_on_saved_tensors()``, and written by hand with clones in the
forward. Gradients and parameters of every step must be bitwise equal.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import versionwatch
from versionwatch._runtime import installed

STEPS = 20


def _mode_ctx(mode: str, modules: dict[str, nn.Module], *opts: torch.optim.Optimizer,
              ) -> contextlib.AbstractContextManager[Any]:
    if mode in ("repair", "repair_strict"):
        return versionwatch.watch(modules, *opts, on_hazard="repair",
                                  strict=mode == "repair_strict")
    if mode == "allow_mutation":
        return torch.autograd.graph.allow_mutation_on_saved_tensors()
    return contextlib.nullcontext()


def _snap(out: list[torch.Tensor], *modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            out.append(p.detach().clone())
            out.append(p.grad.detach().clone() if p.grad is not None else torch.zeros(0))


def _same(runs: dict[str, list[torch.Tensor]]) -> None:
    ref_mode, ref = next(iter(runs.items()))
    for mode, got in runs.items():
        assert len(got) == len(ref)
        bad = [i for i, (a, b) in enumerate(zip(ref, got)) if not torch.equal(a, b)]
        assert not bad, f"{mode} differs from {ref_mode} at {bad[:5]}"


# -- the seed story ---------------------------------------------------------------------

class Seed(nn.Module):
    def __init__(self, clone: bool = False) -> None:
        super().__init__()
        self.clone = clone
        self.w1 = nn.Parameter(torch.tensor([2.0]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))
        self.w3 = nn.Parameter(torch.tensor([4.0]))

    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w2, w3 = (self.w2.clone(), self.w3.clone()) if self.clone else (self.w2, self.w3)
        s = a * self.w1
        return s * w2, s * w3


def seed_story(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Seed(clone=mode == "clone")
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mse = nn.MSELoss()
    out: list[torch.Tensor] = []
    with _mode_ctx(mode, {"model": model}, optim):
        for _ in range(STEPS):
            x, y1, y2 = torch.randn(1), torch.randn(1) + 5, torch.randn(1) + 7
            y1_pred, y2_pred = model(x)
            optim.zero_grad(set_to_none=False)
            loss1 = mse(y1_pred, y1)
            loss1.backward(retain_graph=True)
            optim.step()
            optim.zero_grad(set_to_none=False)
            loss2 = mse(y2_pred, y2)
            loss2.backward()
            _snap(out, model)
            optim.step()
    return out


# -- a GAN with alternating updates -------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...], clone: bool = False) -> None:
        super().__init__()
        self.clone = clone
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            w, b = layer.weight, layer.bias
            if self.clone:
                w, b = w.clone(), b.clone()
            x = F.linear(x, w, b)
            if i < len(self.layers) - 1:
                x = F.leaky_relu(x, 0.2)
        return x


def gan(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    G = MLP((8, 32, 4))
    D = MLP((4, 32, 1), clone=mode == "clone")
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-2, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    out: list[torch.Tensor] = []
    with _mode_ctx(mode, {"G": G, "D": D}, opt_g, opt_d):
        for _ in range(STEPS):
            z, real = torch.randn(16, 8), torch.randn(16, 4) * 0.5 + 1
            fake = G(z)
            d_real, d_fake = D(real), D(fake)
            d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            g_loss = bce(d_fake, torch.ones_like(d_fake))
            opt_d.zero_grad()
            d_loss.backward(retain_graph=True)
            opt_d.step()  # updates D's weights, which g_loss's graph saved
            opt_g.zero_grad()
            g_loss.backward()
            _snap(out, G, D)
            opt_g.step()
    return out


# -- actor-critic -------------------------------------------------------------------------

class ActorCritic(nn.Module):
    def __init__(self, clone: bool = False) -> None:
        super().__init__()
        self.trunk = MLP((6, 32, 32), clone=clone)
        self.actor = nn.Linear(32, 3)
        self.critic = nn.Linear(32, 1)

    def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(s))
        return self.actor(h), self.critic(h)


def actor_critic(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = ActorCritic(clone=mode == "clone")
    opt_a = torch.optim.SGD([*model.trunk.parameters(), *model.actor.parameters()], lr=0.05)
    opt_c = torch.optim.Adam(model.critic.parameters(), lr=1e-2)
    out: list[torch.Tensor] = []
    with _mode_ctx(mode, {"model": model}, opt_a, opt_c):
        for _ in range(STEPS):
            s, r = torch.randn(10, 6), torch.randn(10, 1)
            logits, v = model(s)
            a = torch.randint(0, 3, (10,))
            logp = logits.log_softmax(-1).gather(1, a[:, None])
            actor_loss = -(logp * (r - v).detach()).mean()
            critic_loss = (r - v).pow(2).mean()
            opt_a.zero_grad()
            actor_loss.backward(retain_graph=True)
            opt_a.step()  # the trunk, which critic_loss's graph saved
            opt_c.zero_grad()
            critic_loss.backward()
            _snap(out, model)
            opt_c.step()
    return out


# -- an activation written in place ---------------------------------------------------------

def activation(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = MLP((5, 16, 16))
    head = nn.Linear(16, 1)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.05)
    out: list[torch.Tensor] = []
    with _mode_ctx(mode, {"model": model, "head": head}, opt):
        for _ in range(STEPS):
            y = model(torch.randn(7, 5)).sigmoid()
            loss = head(y).pow(2).mean()
            if mode == "clone":
                y = y.clone()
            y.mul_(2)  # sigmoid and the head saved y
            extra = y.sum()
            opt.zero_grad()
            loss.backward()
            _snap(out, model, head)
            opt.step()
            del extra
    return out


@pytest.mark.parametrize("program", [seed_story, gan, actor_critic])
def test_repair_matches_allow_mutation_and_hand_clones(program: Callable[[str], list[torch.Tensor]]):
    runs = {m: program(m) for m in ("repair", "allow_mutation", "clone", "repair_strict")}
    _same(runs)


def test_activation_in_place_is_repaired_in_strict_mode():
    runs = {m: activation(m) for m in ("repair_strict", "allow_mutation", "clone")}
    _same(runs)


def test_activation_write_unseen_in_default_mode_raises_as_raise():
    with pytest.raises(versionwatch.InplaceModificationError) as repaired:
        activation("repair")
    with pytest.raises(versionwatch.InplaceModificationError) as raised:
        torch.manual_seed(0)
        model, head = MLP((5, 16, 16)), nn.Linear(16, 1)
        with versionwatch.watch({"model": model, "head": head}):
            y = model(torch.randn(7, 5)).sigmoid()
            loss = head(y).pow(2).mean()
            y.mul_(2)
            loss.backward()
    def lines_out(text: str) -> str:
        return re.sub(r"\.py:\d+", ".py:N", text)

    assert lines_out(str(repaired.value)) == lines_out(str(raised.value))
    assert "SigmoidBackward0" in str(repaired.value)


# -- records, memory, budget ---------------------------------------------------------------

def _story(w: Any, model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(torch.ones(3, 4)).pow(2).mean()
    loss.backward(retain_graph=True)
    opt.step()
    return loss


@pytest.mark.parametrize("strict", [False, True])
def test_repair_is_recorded_and_copies_die_with_the_graph(strict: bool):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="repair", strict=strict) as w:
        loss = _story(w, model, opt)
        (r,) = w.repairs
        weight = model[2].weight
        assert (r.tensor, r.nbytes, r.graph, r.before) == (
            "model.2.weight", weight.numel() * 4, "forward #1", "opt.step() #1")
        assert ("kept a copy of model.2.weight (64 B) for the graph of forward #1 before "
                "opt.step() #1 at ") in str(r) and "test_repair.py:" in str(r)
        s = w.repair_summary()
        # Peak extra memory is the bytes of what was copied, and nothing else.
        assert s["peak_bytes"] == s["copied_bytes"] == s["held_bytes"] == weight.numel() * 4
        report = versionwatch.check(loss)
        assert report.ok and not report.unverifiable
        loss.backward()  # frees the graph, and the copy with it
        gc.collect()
        assert w.repair_summary()["held_bytes"] == 0
        assert any(e.kind == "repair" for e in w.ledger.events)
        assert "kept model.2.weight (64 B) before opt.step() #1" in str(w.timeline())


def test_nothing_to_repair_is_bitwise_default_mode_and_copies_nothing():
    def train(policy: str) -> tuple[list[torch.Tensor], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with versionwatch.watch(model, opt, on_hazard=policy) as w:  # type: ignore[arg-type]
            for _ in range(10):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], w

    plain, _ = train("raise")
    repaired, w = train("repair")
    assert all(torch.equal(a, b) for a, b in zip(plain, repaired))
    assert w.repairs == [] and w.repair_summary()["copied_bytes"] == 0
    assert w.repairer.roots == []  # freed graphs are let go at the next step


def test_freed_graph_still_raises_freed_graph_error():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="repair") as w:
        loss = model(torch.ones(2, 3)).sum() * model.weight.sum()
        loss.backward()
        opt.step()
        with pytest.raises(versionwatch.FreedGraphError, match="backward through the graph a "
                           "second time"):
            loss.backward()
    assert w.repairs == []


def test_budget_warns_once_names_the_list_and_the_graph_then_raises():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_copy = model[2].weight.numel() * 4
    losses = []
    with versionwatch.watch(model, opt, on_hazard="repair", repair_budget=2 * per_copy) as w:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                loss = model(torch.ones(3, 4)).pow(2).mean()
                loss.backward(retain_graph=True)
                losses.append(loss)
                opt.step()
        msgs = [str(c.message) for c in caught if "repair budget" in str(c.message)]
        assert len(msgs) == 1
        assert "held in a list of" in msgs[0] and "losses.append(loss)" in msgs[0]
        assert "the graph of forward #3" in msgs[0]
        s = w.repair_summary()
        assert s["peak_bytes"] <= 2 * per_copy and s["repairs"] == 2
        losses[0].backward(retain_graph=True)  # repaired
        with pytest.raises(versionwatch.InplaceModificationError):
            losses[2].backward()  # refused: fails as it would without repair


@pytest.mark.parametrize("strict", [False, True])
def test_budget_warning_points_at_the_users_line(strict: bool):
    """The warning names the line that made the write (here the step), not one of ours."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_copy = model[2].weight.numel() * 4
    losses, step_line = [], 0
    with versionwatch.watch(model, opt, on_hazard="repair", strict=strict,
                            repair_budget=2 * per_copy):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                loss = model(torch.ones(3, 4)).pow(2).mean()
                loss.backward(retain_graph=True)
                losses.append(loss)
                step_line = sys._getframe().f_lineno + 1
                opt.step()
    budget = [c for c in caught if "repair budget" in str(c.message)]
    assert len(budget) == 1
    assert (budget[0].filename, budget[0].lineno) == (__file__, step_line)


def test_bad_budget_and_env_policy(monkeypatch: pytest.MonkeyPatch):
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="repair_budget"):
        versionwatch.watch(model, on_hazard="repair", repair_budget=-1)
    with pytest.raises(RuntimeError, match="on_hazard='repair'"):
        with versionwatch.watch(model) as w:
            w.repair_summary()
    monkeypatch.setenv("VERSIONWATCH_ON_HAZARD", "repair")
    with versionwatch.watch(model) as w:
        assert w.policy == "repair"


def test_rnn_views_share_one_copy():
    cell = nn.RNNCell(3, 5)
    opt = torch.optim.SGD(cell.parameters(), lr=0.1)
    with versionwatch.watch(cell, opt, on_hazard="repair") as w:
        h = torch.zeros(2, 5)
        loss = torch.zeros(())
        for _ in range(6):
            h = cell(torch.randn(2, 3), h)
            loss = loss + h.pow(2).sum()
        loss.backward(retain_graph=True)
        opt.step()
        before = [p.grad.clone() for p in cell.parameters()]
        for p in cell.parameters():
            p.grad = None
        loss.backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(before, cell.parameters()))
        names = {r.tensor: r.nbytes for r in w.repairs}
        assert names == {"cell.weight_hh": 5 * 5 * 4}  # six saved views, one copy


def test_cli_run_repair_writes_repairs_to_json(tmp_path: Path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.ones(2, 4)).sum()
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()
        print("done")
    """))
    r = subprocess.run([sys.executable, "-m", "versionwatch", "run", "--on-hazard", "repair",
                        "--json", "out.json", "train.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["ok"] and doc["repair_summary"]["repairs"] == 1
    (rep,) = doc["repairs"]
    assert (rep["tensor"], rep["before"], rep["file"], rep["line"]) == (
        "model.2.weight", "opt.step() #1", "train.py", 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_memory_is_the_copies():
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 1024, device=dev)

    def go(policy: str) -> int:
        with versionwatch.watch(model, opt, on_hazard=policy) as w:  # type: ignore[arg-type]
            loss = model(x).pow(2).mean()
            loss.backward(retain_graph=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            copied = w.repair_summary()["copied_bytes"] if policy == "repair" else 0
            del loss
        return peak - copied

    assert go("repair") <= go("raise")


def test_peak_extra_memory_is_the_tracked_copies():
    """What the step allocates beyond the default mode's step is exactly the copies.

    Three independent tallies must agree: the bytes PyTorch's allocator hands
    out during the step (the profiler's CPU memory events), the distinct
    storages that the repaired slots now hold, and ``repair_summary()``.
    """
    from torch.profiler import ProfilerActivity, profile

    def step(policy: str) -> tuple[int, int, dict[str, Any], int]:
        torch.manual_seed(0)
        G, D = MLP((8, 32, 16)), MLP((16, 64, 1))
        opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
        with versionwatch.watch({"G": G, "D": D}, opt_d, on_hazard=policy) as w:  # type: ignore[arg-type]
            d_fake = D(G(torch.randn(4, 8)))
            d_real = D(torch.randn(4, 16))
            d_loss = (d_real - d_fake).pow(2).mean()
            g_loss = d_fake.mean()
            d_loss.backward(retain_graph=True)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                opt_d.step()
            allocated = sum(max(0, e.self_cpu_memory_usage) for e in prof.events())
            params = {p.untyped_storage().data_ptr() for p in D.parameters()}
            shapes = {s for p in D.parameters() if p.dim() == 2
                      for s in (tuple(p.shape), tuple(p.t().shape))}
            held: dict[int, int] = {}
            # Under "raise" the stepped weights' slots are stale: only repair's are read.
            for fn in _nodes(g_loss.grad_fn) if policy == "repair" else []:
                for attr in dir(fn):
                    if not attr.startswith("_saved_"):
                        continue
                    v = getattr(fn, attr)
                    # A weight's shape (the activations here have a batch of 4), in
                    # memory other than the weight's own: one of repair's copies.
                    if isinstance(v, torch.Tensor) and tuple(v.shape) in shapes \
                            and v.untyped_storage().data_ptr() not in params:
                        st = v.untyped_storage()
                        held[st.data_ptr()] = st.nbytes()
            summary = w.repair_summary() if policy == "repair" else {}
            if policy == "repair":
                g_loss.backward()  # runs: the slots hold the weights the forward saw
        return allocated, sum(held.values()), summary, sum(
            p.numel() * 4 for p in D.parameters() if p.dim() == 2)

    plain, _, _, _ = step("raise")
    repaired, held, s, weights = step("repair")
    # Both D forwards saved every weight (as weight.t()); each weight was copied once.
    assert held == weights == s["copied_bytes"] == s["peak_bytes"] > 0
    assert repaired - plain == s["copied_bytes"]


def _nodes(root: Any) -> list[Any]:
    seen, todo = [], [root]
    while todo:
        fn = todo.pop()
        if fn is None or any(fn is s for s in seen):
            continue
        seen.append(fn)
        todo += [n for n, _ in fn.next_functions]
    return seen


def test_user_saved_tensor_hooks_are_left_as_raise_leaves_them():
    """A slot behind the user's own hooks is not copied: repair behaves as "raise".

    PyTorch checks no version through hooks, so neither policy raises; both
    report the slots as unverifiable, and the second backward uses what the
    hooks return (here the updated weights), the same under both.
    """
    def run(policy: str) -> tuple[list[torch.Tensor], Any, list[Any]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with versionwatch.watch(model, opt, on_hazard=policy) as w:  # type: ignore[arg-type]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = model(torch.ones(3, 4)).pow(2).mean()
            loss.backward(retain_graph=True)
            opt.step()
            report = versionwatch.check(loss)
            opt.zero_grad()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()], report, w.repairs

    raised, r_raise, _ = run("raise")
    repaired, r_repair, repairs = run("repair")
    assert repairs == []
    assert r_repair.unverifiable == r_raise.unverifiable
    assert ("AddmmBackward0", "mat2") in r_repair.unverifiable
    assert all(torch.equal(a, b) for a, b in zip(raised, repaired))


@pytest.mark.parametrize("strict", [False, True])
def test_write_on_another_thread_repaired_if_seen_else_raised(strict: bool):
    """Strict mode sees writes on every thread (it wraps the ops): repaired.

    Default mode sees no in-place op on an activation, on any thread: raised,
    exactly as under "raise".
    """
    def run(policy: str, strict: bool) -> tuple[list[torch.Tensor], Any, list[Any]]:
        torch.manual_seed(0)
        model, head = MLP((5, 16, 16)), nn.Linear(16, 1)
        with versionwatch.watch({"model": model, "head": head}, on_hazard=policy,  # type: ignore[arg-type]
                                strict=strict) as w:
            y = model(torch.randn(7, 5)).sigmoid()
            loss = head(y).pow(2).mean()
            t = threading.Thread(target=y.mul_, args=(2,))
            t.start()
            t.join()
            assert y._version == 1
            try:
                loss.backward()
            except versionwatch.InplaceModificationError as e:
                return [], e, w.repairs
        return [p.grad.clone() for p in [*model.parameters(), *head.parameters()]], None, w.repairs

    grads, error, repairs = run("repair", strict)
    if strict:
        assert error is None and repairs
        assert grads and all(torch.equal(a, b) for a, b in zip(grads, _activation_clone_grads()))
    else:
        _, raised, _ = run("raise", False)
        assert repairs == [] and error is not None and raised is not None
        assert re.sub(r"\.py:\d+", "", str(error)) == re.sub(r"\.py:\d+", "", str(raised))


def _activation_clone_grads() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model, head = MLP((5, 16, 16), clone=True), nn.Linear(16, 1)
    y = model(torch.randn(7, 5)).sigmoid()
    head(y).pow(2).mean().backward()
    return [p.grad.clone() for p in [*model.parameters(), *head.parameters()]]


class Strided(nn.Module):
    """Uses every other column of its weight: the graph saves a sliced, non-dense view."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[:, ::2]


@pytest.mark.parametrize("mode", ["repair", "repair_strict"])
def test_a_repaired_view_keeps_its_strides(mode: str):
    """The copy is laid out as the view the graph saved, not made contiguous."""
    torch.manual_seed(0)
    model = Strided()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, requires_grad=True)  # so that mm saves the weight's view
    with _mode_ctx(mode, {"model": model}, opt) as w:
        y = model(x)
        first = y.pow(2).sum()
        first.backward(retain_graph=True)
        saved = y.grad_fn._saved_mat2  # the view, before any step
        layout, values = saved.stride(), saved.detach().clone()
        opt.step()
        copy = y.grad_fn._saved_mat2  # the repaired slot
        assert copy.stride() == layout == (16, 2)
        assert torch.equal(copy, values) and not torch.equal(copy, model.w[:, ::2])
        y.sum().backward()
        assert w.repair_summary()["repairs"] == 1
        # Default mode copies the view's contiguous base once, for every view of it;
        # strict mode the view's span, from its first element to its last.
        span = 16 * 16 if mode == "repair" else 15 * 16 + 14 + 1
        assert w.repair_summary()["copied_bytes"] == span * 4


def test_closing_a_nested_strict_repairer_leaves_the_outer_one_repairing():
    torch.manual_seed(0)
    model, other = Seed(), nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mse = nn.MSELoss()
    with versionwatch.watch({"model": model}, optim, on_hazard="repair", strict=True) as outer:
        with versionwatch.watch({"other": other}, on_hazard="repair", strict=True):
            other(torch.randn(1, 2))
        for _ in range(3):  # the seed story: fails at its second iteration unrepaired
            y1_pred, y2_pred = model(torch.randn(1))
            optim.zero_grad(set_to_none=False)
            mse(y1_pred, torch.randn(1)).backward(retain_graph=True)
            optim.step()
            optim.zero_grad(set_to_none=False)
            mse(y2_pred, torch.randn(1)).backward()
            optim.step()
        assert outer.repair_summary()["repairs"] >= 2


def test_nested_strict_repairers_each_repair_what_they_watch():
    torch.manual_seed(0)
    big, small = nn.Linear(4, 4), nn.Linear(2, 2)
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    with versionwatch.watch({"big": big}, opt, on_hazard="repair", strict=True) as outer:
        with versionwatch.watch({"small": small}, on_hazard="repair", strict=True,
                                repair_budget=8) as inner:
            y = big(torch.randn(3, 4, requires_grad=True))
            y.sum().backward(retain_graph=True)
            opt.step()
            y.pow(2).sum().backward()  # under the inner's 8-byte budget, this would raise
        assert [r.tensor for r in outer.repairs] == ["big.weight"]
        assert inner.repairs == []


def test_a_watcher_whose_close_raises_still_hands_repair_back(monkeypatch):
    from versionwatch._strict import hookstack as _hookstack

    model = Seed()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch({"model": model}, optim, on_hazard="repair", strict=True) as outer:
        inner = versionwatch.watch({"other": nn.Linear(2, 2)}, on_hazard="repair", strict=True)
        real_pop = _hookstack.pop

        def broken(owner: object) -> None:
            real_pop(owner)  # the entry does come off: only the error is injected
            raise RuntimeError("a hook's removal failed")

        with monkeypatch.context() as m:
            m.setattr(_hookstack, "pop", broken)
            with pytest.raises(RuntimeError, match="a hook's removal failed"):
                inner.close()
        assert installed()["strict repairers"] == 1 and installed()["watchers"] == 1
        y1_pred, y2_pred = model(torch.ones(1))  # the seed story: the outer one repairs it
        y1_pred.sum().backward(retain_graph=True)
        optim.step()
        y2_pred.sum().backward()
        assert outer.repair_summary()["repairs"] >= 1
    assert installed() == {}


# -- complex parameters whose real view the graph saved (issue #23, item 7) -------------------

class ComplexReal(nn.Module):
    def __init__(self, view: str, clone: bool = False) -> None:
        super().__init__()
        self.view, self.clone = view, clone
        self.p = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        r = {"view_as_real": lambda: torch.view_as_real(p),
             "real": lambda: p.real[:, :, None].expand(3, 4, 2),
             "imag": lambda: p.imag[:, :, None].expand(3, 4, 2),
             # a complex view of p, read through its conjugate bit
             "conj": lambda: p.conj()[:, :, None].expand(3, 4, 2)}[self.view]()
        if self.clone:  # what the graph saves is then its own memory
            r = r.clone()
        if self.view == "conj":
            return (r * x).real.sum() + (r * r).abs().sum()
        return (r * x).sum() + (r * r).sum()  # mul saves r: a float view of p


def complex_real(mode: str, view: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = ComplexReal(view, clone=mode == "clone")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: list[torch.Tensor] = []
    with _mode_ctx(mode, {"model": model}, opt):
        for _ in range(STEPS):
            x = torch.randn(3, 4, 2, requires_grad=True,
                            dtype=torch.complex64 if view == "conj" else torch.float32)
            loss = model(x)
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()  # writes p, whose real view the graph saved
            (loss * 2).backward()
            out.append(x.grad.clone())
            _snap(out, model)
    return out


@pytest.mark.parametrize("view", ["view_as_real", "real", "imag", "conj"])
def test_complex_parameter_whose_real_view_was_saved_is_repaired(view: str):
    """As the hand-cloned run and allow_mutation_on_saved_tensors: bitwise."""
    modes = ["clone", "allow_mutation", "repair", "repair_strict"]
    if view == "imag":
        # allow_mutation_on_saved_tensors reads p.imag as it is after the step
        # (torch 2.13 and 2.4.1): the hand-cloned run is the reference.
        modes.remove("allow_mutation")
    if view == "conj":
        # The clone resolves the conjugate bit, and torch 2.4.1's product then rounds
        # otherwise in the forward too: the program's own forward is the reference.
        modes.remove("clone")
    _same({m: complex_real(m, view) for m in modes})
