"""The user's own names: optimizers by their variables, DDP's ``.module`` dropped.

Each optimizer is named once (at ``watch()`` or its first step), from the
frames that hold it; class and index only where no variable does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import versionwatch
from versionwatch import InplaceModificationError
from versionwatch._naming import optimizer_names, unique_label


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2))
    D = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    return G, D


def _gan_bug(G: nn.Module, D: nn.Module, opt_g: torch.optim.Optimizer,
             opt_d: torch.optim.Optimizer) -> None:
    """The classic bug: G's loss backward through D's graph after D's step."""
    fake = G(torch.randn(3, 2))
    d_out = D(fake)
    opt_d.zero_grad()
    d_out.mean().backward(retain_graph=True)
    opt_d.step()
    opt_g.zero_grad()
    (-d_out.mean()).backward()
    opt_g.step()


def _steps(w: versionwatch.Watcher) -> list[str]:
    return [e.label for e in w.ledger.events if e.kind == "step"]


def test_watch_names_two_adams_by_their_variables() -> None:
    G, D = _gan()
    opt_g = torch.optim.Adam(G.parameters())
    opt_d = torch.optim.Adam(D.parameters())
    with versionwatch.watch({"G": G, "D": D}, opt_g, opt_d) as w:
        with pytest.raises(InplaceModificationError) as info:
            _gan_bug(G, D, opt_g, opt_d)
    [mod] = info.value.report.hazards[0].modified_by
    assert mod.description == "opt_d.step() #1"
    assert "modified by  opt_d.step() #1 at " in str(info.value)
    assert "opt_d.zero_grad(set_to_none=True)" in str(w.timeline())
    d = info.value.report.to_dict()
    assert d["hazards"][0]["modified_by"][0]["description"] == "opt_d.step() #1"


def test_watch_all_names_optimizers_at_their_first_step() -> None:
    G, D = _gan()
    opt_g = torch.optim.Adam(G.parameters())
    opt_d = torch.optim.Adam(D.parameters())
    with versionwatch.watch_all(on_hazard="warn") as w:
        with pytest.warns(versionwatch.InplaceHazardWarning) as warned, \
                pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _gan_bug(G, D, opt_g, opt_d)
    assert "opt_d.step() #1" in str(warned[0].message)
    assert _steps(w) == ["opt_d.step() #1"]   # opt_g's step never ran
    assert sorted(s.label for s in w._optimizers.values()) == ["opt_d", "opt_g"]


def test_a_helpers_parameter_does_not_name_two_optimizers() -> None:
    """``update(opt)`` steps both: each is named by the loop that owns it."""
    G, D = _gan()
    opt_g = torch.optim.Adam(G.parameters())
    opt_d = torch.optim.Adam(D.parameters())

    def update(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()

    with versionwatch.watch({"G": G, "D": D}) as w:
        update(opt_d, D(G(torch.randn(3, 2)).detach()).mean())
        update(opt_g, -D(G(torch.randn(3, 2))).mean())
    assert _steps(w) == ["opt_d.step() #1", "opt_g.step() #1"]


def test_one_optimizer_held_by_two_names_is_named_by_its_line() -> None:
    G, D = _gan()
    opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
    critic_opt = opt_d
    labels = []
    for _ in range(2):  # the same program names it the same way every time
        with versionwatch.watch(D) as w:
            D(torch.randn(3, 2)).sum().backward()
            critic_opt.step()
        labels.append(_steps(w))
    assert labels == [["critic_opt.step() #1"]] * 2
    assert critic_opt is opt_d


def test_no_variable_falls_back_to_class_and_index() -> None:
    G, D = _gan()
    opts = {"g": torch.optim.Adam(G.parameters()), "d": torch.optim.Adam(D.parameters())}
    with versionwatch.watch({"G": G, "D": D}) as w:
        for key, model in (("d", D), ("g", G)):
            model(torch.randn(3, 2)).sum().backward()
            opts[key].step()
    assert _steps(w) == ["Adam.step() #1", "Adam[1].step() #1"]


def test_an_optimizer_made_again_gets_a_new_label() -> None:
    model = nn.Linear(2, 1)
    with versionwatch.watch(model) as w:
        for _ in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    assert _steps(w) == ["opt.step() #1", "opt[1].step() #1"]


def test_self_attribute_and_lightning_like_wrapper() -> None:
    class Wrapper:  # keeps the optimizer in its instance dict, as LightningOptimizer does
        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self._optimizer = opt

    class Loop:
        def __init__(self) -> None:
            self.model = nn.Linear(2, 1)
            self.critic_opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def run(self) -> list[str]:
            with versionwatch.watch(self.model) as w:
                self.model(torch.ones(1, 2)).sum().backward()
                self.critic_opt.step()
            return _steps(w)

    assert Loop().run() == ["self.critic_opt.step() #1"]
    inner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    wrapped = Wrapper(inner)
    assert wrapped._optimizer is inner
    assert list(optimizer_names(inner, sys._getframe(), lambda f: False))[:2] == \
        ["inner", "wrapped"]


def test_unique_label() -> None:
    taken = {"opt", "Adam"}.__contains__
    assert unique_label(iter(["opt", "opt_d"]), "Adam", taken) == "opt_d"
    assert unique_label(iter(["opt"]), "Adam", taken) == "opt[1]"
    assert unique_label(iter(()), "Adam", taken) == "Adam[1]"
    assert unique_label(iter(()), "SGD", taken) == "SGD"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_ddp_module_is_dropped_from_names(tmp_path: Path) -> None:
    """A 1-process gloo group: ``D.module.2.weight`` reads ``D.2.weight``."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        D = DistributedDataParallel(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)))
        opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
        with versionwatch.watch(D, opt_d) as w:
            loss = D(torch.randn(3, 2)).sum()
            loss.backward(retain_graph=True)
            opt_d.step()
            with pytest.raises(InplaceModificationError) as info:
                loss.backward()
        assert info.value.report.hazards[0].tensor == "D.2.weight"
        assert info.value.report.hazards[0].modified_by[0].description == "opt_d.step() #1"
        assert set(w.ledger.by_name) == {"D.0.weight", "D.0.bias", "D.2.weight", "D.2.bias"}
    finally:
        dist.destroy_process_group()


def test_step_benchmark_runs_quick() -> None:
    """benchmarks/step_names.py end to end (a smoke run: no timing is asserted)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "step_names.py"), "--quick"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "watch x" in ln]
    assert [ln.split()[0] for ln in lines] == ["SGD", "Adam"]
    assert all("watch_all x" in ln for ln in lines)
