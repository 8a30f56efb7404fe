"""The facts a report's fix is chosen from (issue #24), and what ``versionwatch fix`` reads.

- Strict mode sees every in-place entry point the library modules write through
  (``torch._VF``'s ``dropout_``, ``F.elu_``, ...), and a write inside a library
  module's ``forward`` names that module and the line that built it, however it
  was built (an ``nn.Sequential`` argument, a list comprehension of an
  ``nn.ModuleList``, an ``nn.ModuleDict``, ``self.act = ...``, a variable).
- A freed graph's carrier and what ran between its two backwards, on a GAN
  whose two discriminator calls are on separate lines; the fix, applied, runs.
- :func:`versionwatch._candidates.facts.from_report` hands those facts to the fix engine.

Every program is a file, run in this process under ``watch_all`` (as
``versionwatch run`` does), so that the sites name its lines.
"""

from __future__ import annotations

import runpy
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import versionwatch
from versionwatch._candidates.facts import from_report
from versionwatch._report.model import Report


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # reports show sites relative to the working directory


def program(tmp_path: Path, src: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(src))
    return path


def watched(path: Path, strict: bool = True) -> Report:
    """The report of the failure that program ``path`` meets under ``watch_all``."""
    code = compile(path.read_text(), str(path), "exec")
    with pytest.raises((versionwatch.InplaceModificationError,
                        versionwatch.FreedGraphError)) as caught:
        with versionwatch.watch_all(strict=strict):
            exec(code, {"__name__": "__main__"})
    report: Report = caught.value.report
    return report


def line(path: Path, text: str) -> int:
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if text in s)


# -- every in-place entry point a library module writes through ---------------------------

# (how torch.nn.functional is called, the op strict mode names, the input's shape)
ENTRY_POINTS: list[tuple[str, Callable[[torch.Tensor], Any], str, tuple[int, ...]]] = [
    ("relu", lambda h: F.relu(h, inplace=True), "relu_()", (2, 4)),
    ("relu_", lambda h: F.relu_(h), "relu_()", (2, 4)),
    ("leaky_relu", lambda h: F.leaky_relu(h, 0.1, inplace=True), "leaky_relu_()", (2, 4)),
    ("leaky_relu_", lambda h: F.leaky_relu_(h, 0.1), "leaky_relu_()", (2, 4)),
    ("elu", lambda h: F.elu(h, inplace=True), "elu_()", (2, 4)),
    ("elu_", lambda h: F.elu_(h), "elu_()", (2, 4)),
    ("hardtanh", lambda h: F.hardtanh(h, inplace=True), "hardtanh_()", (2, 4)),
    ("hardtanh_", lambda h: F.hardtanh_(h), "hardtanh_()", (2, 4)),
    ("threshold", lambda h: F.threshold(h, 0.5, 0.0, inplace=True), "threshold_()", (2, 4)),
    ("threshold_", lambda h: F.threshold_(h, 0.5, 0.0), "threshold_()", (2, 4)),
    ("silu", lambda h: F.silu(h, inplace=True), "silu_()", (2, 4)),
    ("rrelu", lambda h: F.rrelu(h, training=True, inplace=True), "rrelu_()", (2, 4)),
    ("rrelu_", lambda h: F.rrelu_(h), "rrelu_()", (2, 4)),
    ("celu", lambda h: F.celu(h, inplace=True), "celu_()", (2, 4)),
    ("celu_", lambda h: F.celu_(h), "celu_()", (2, 4)),
    ("selu", lambda h: F.selu(h, inplace=True), "selu_()", (2, 4)),
    ("selu_", lambda h: F.selu_(h), "selu_()", (2, 4)),
    ("relu6", lambda h: F.relu6(h, inplace=True), "relu6_()", (2, 4)),
    ("hardswish", lambda h: F.hardswish(h, inplace=True), "hardswish_()", (2, 4)),
    ("hardsigmoid", lambda h: F.hardsigmoid(h, inplace=True), "hardsigmoid_()", (2, 4)),
    ("mish", lambda h: F.mish(h, inplace=True), "mish_()", (2, 4)),
    ("dropout", lambda h: F.dropout(h, 0.5, inplace=True), "dropout_()", (2, 4)),
    ("alpha_dropout", lambda h: F.alpha_dropout(h, 0.5, training=True, inplace=True),
     "alpha_dropout_()", (2, 4)),
    ("feature_alpha_dropout",
     lambda h: F.feature_alpha_dropout(h, 0.5, training=True, inplace=True),
     "feature_alpha_dropout_()", (2, 3, 4, 4)),
    ("dropout1d", lambda h: F.dropout1d(h, 0.5, inplace=True), "feature_dropout_()", (2, 3, 4)),
    ("dropout2d", lambda h: F.dropout2d(h, 0.5, inplace=True), "feature_dropout_()",
     (2, 3, 4, 4)),
    ("dropout3d", lambda h: F.dropout3d(h, 0.5, inplace=True), "feature_dropout_()",
     (2, 3, 2, 2, 4)),
]


@pytest.mark.parametrize("name, call, op, shape", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
def test_strict_sees_every_functional_inplace_entry_point(name, call, op, shape):
    """On the output of a sigmoid (saved for its backward), each one is the write that
    PyTorch's backward fails on, and strict mode names it."""
    def forward() -> torch.Tensor:
        torch.manual_seed(0)
        h = lin(torch.randn(*shape)).sigmoid()
        call(h)
        return h

    lin = nn.Linear(shape[-1], shape[-1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward().sum().backward()  # plainly
    with versionwatch.watch(lin, strict=True, on_hazard=lambda r: None) as w:
        h = forward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            h.sum().backward()
    assert [m.description for m in w.reports[-1].first.modified_by] == [op]


# -- a library module's write: the module, and where it was built ----------------------------

BUILT = {
    "sequential_argument": ("""\
        import torch
        from torch import nn
        net = nn.Sequential(
            nn.Linear(4, 4),
            nn.Sigmoid(),
            nn.ReLU(inplace=True),
        )
        net(torch.randn(2, 4)).sum().backward()
        """, "net.2", "nn.ReLU(inplace=True),"),
    "a_variable": ("""\
        import torch
        from torch import nn
        act = nn.ReLU(inplace=True)
        net = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), act)
        net(torch.randn(2, 4)).sum().backward()
        """, "net.2", "act = nn.ReLU(inplace=True)"),
    "a_list_comprehension": ("""\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(
                    [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.5, inplace=True))
                     for _ in range(2)])

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        model = Net()
        model(torch.randn(2, 4)).sum().backward()
        """, "model.blocks.1.2", "[nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout("),
    "a_module_dict": ("""\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.acts = nn.ModuleDict({"gate": nn.Sigmoid(),
                                           "clip": nn.Hardtanh(inplace=True)})

            def forward(self, x):
                return self.acts["clip"](self.acts["gate"](self.fc(x)))

        model = Net()
        model(torch.randn(2, 4)).sum().backward()
        """, "model.acts.clip", '"clip": nn.Hardtanh(inplace=True)})'),
    "a_tuple_in_init": ("""\
        import torch
        from torch import nn

        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.gate, self.act = nn.Sigmoid(), nn.SiLU(inplace=True)

            def forward(self, x):
                return self.act(self.gate(self.fc(x)))

        head = Head()
        head(torch.randn(2, 4)).sum().backward()
        """, "head.act", "self.gate, self.act = nn.Sigmoid(), nn.SiLU(inplace=True)"),
}


@pytest.mark.parametrize("case", list(BUILT))
def test_a_library_modules_write_names_where_it_was_built(case, tmp_path):
    src, module, built = BUILT[case]
    path = program(tmp_path, src)
    h = watched(path).first
    assert h is not None
    (write,) = h.modified_by
    assert write.writer is not None and write.writer.module == module
    assert write.writer.built_at is not None
    assert write.writer.built_at.line == line(path, built)
    assert h.fix.startswith(f"`inplace=False` on {module} (")
    assert f"built at {write.writer.built_at}" in h.fix
    # The fix, applied: the program runs, plainly.
    fixed = path.read_text().replace("inplace=True", "inplace=False")
    runpy.run_path(str(program(tmp_path, fixed, "fixed.py")), run_name="__main__")


def test_a_module_a_function_built_is_named_without_a_site(tmp_path):
    path = program(tmp_path, """\
        import torch
        from torch import nn

        def mlp():
            return nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.ReLU(inplace=True))

        net = mlp()
        net(torch.randn(2, 4)).sum().backward()
        """)
    h = watched(path).first
    assert h is not None
    writer = h.modified_by[0].writer
    assert writer is not None and (writer.module, writer.text, writer.class_name) == \
        ("net.2", "ReLU(inplace=True)", "ReLU")
    assert writer.built_at is None
    assert h.fix.startswith("`inplace=False` on net.2 (ReLU(inplace=True)): its forward")


def test_a_write_of_the_users_own_inside_a_module_has_no_writer(tmp_path):
    path = program(tmp_path, """\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                h = self.fc(x).sigmoid()
                h.mul_(2)
                return h

        net = Net()
        net(torch.randn(2, 4)).sum().backward()
        """)
    h = watched(path).first
    assert h is not None and h.modified_by[0].writer is None
    assert h.fix.startswith(f"write `h = h.mul(2)` instead of `h.mul_(2)` at prog.py:"
                            f"{line(path, 'h.mul_(2)')}")


# -- a freed graph: the carrier and what ran between -----------------------------------------

GAN = """\
    import torch
    from torch import nn

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    og = torch.optim.SGD(G.parameters(), lr=0.01)
    od = torch.optim.SGD(D.parameters(), lr=0.01)
    real, z = torch.randn(8, 2), torch.randn(8, 4)
    fake = G(z)
    d_real = D(real)
    d_fake = D(fake)
    d_loss = d_fake.mean() - d_real.mean()
    od.zero_grad()
    d_loss.backward()
    od.step()
    g_loss = -D(fake).mean()
    og.zero_grad()
    g_loss.backward()
    og.step()
    """


@pytest.mark.parametrize("strict", [False, True])
def test_gan_carrier_entered_at_its_own_discriminator_call(strict, tmp_path):
    path = program(tmp_path, GAN)
    report = watched(path, strict)
    h = report.first
    assert h is not None and h.carrier is not None and h.between is not None
    c, b = h.carrier, h.between
    assert (c.name, c.module, c.role, c.trained) == ("fake", "G", "input", True)
    assert c.site is not None and c.site.line == line(path, "fake = G(z)")
    assert c.entered is not None and c.entered.line == line(path, "d_fake = D(fake)")
    assert c.fed_to is not None and c.fed_to.module == "D"
    assert (b.changes_saved, b.discards_grad) == (False, True)
    assert [m.kind for m in b.events] == ["optimizer.step", "zero_grad"]
    assert h.fix.startswith("detach `fake` in the loss of backward #1 (at prog.py:"
                            f"{line(path, 'd_loss.backward()')}): `D(fake.detach())` at "
                            f"prog.py:{line(path, 'd_fake = D(fake)')}")
    facts = from_report(report)
    assert (facts.carried, facts.carried_use) == ("fake", "forward")
    assert facts.carried_made is not None and facts.carried_made.line == line(path, "fake = G(z)")
    # The fix, applied: both networks train, G from g_loss only.
    fixed = runpy.run_path(str(program(tmp_path, GAN.replace("d_fake = D(fake)",
                                                             "d_fake = D(fake.detach())"),
                                       "fixed.py")), run_name="__main__")
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fixed["G"].parameters())


def test_a_step_between_two_backwards_changes_what_the_graph_saved(tmp_path):
    """G steps between the freeing backward and this one: retain_graph=True would fail."""
    path = program(tmp_path, GAN.replace("    od.step()\n", "    od.step()\n    og.step()\n"))
    h = watched(path, False).first
    assert h is not None and h.between is not None
    assert h.between.changes_saved is True
    assert "retain_graph=True on backward #1 (at prog.py:" in h.fix and "would fail" in h.fix


# -- what `versionwatch fix` reads ------------------------------------------------------------

def test_from_report_a_library_modules_write(tmp_path):
    path = program(tmp_path, BUILT["sequential_argument"][0])
    facts = from_report(watched(path))
    assert facts.kind == "inplace" and facts.tensor is None
    assert facts.write is not None and facts.write.line == line(path, "net(torch.randn")
    assert facts.write_op == "relu_"
    assert facts.module_built is not None
    assert facts.module_built.line == line(path, "nn.ReLU(inplace=True)")
    assert facts.module_built.code == "nn.ReLU(inplace=True),"
    assert facts.module_class == "ReLU"


def test_from_report_a_no_grad_update_in_a_helper_gives_its_whole_stack(tmp_path):
    path = program(tmp_path, """\
        import torch
        from torch import nn

        def clip(model):
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.01, 0.01)

        def train(model):
            loss = model(torch.randn(8, 2)).pow(2).mean()
            clip(model)
            loss.backward()

        critic = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
        train(critic)
        """)
    report = watched(path)
    facts = from_report(report)
    assert facts.tensor == "model.2.weight"  # named where it first ran: train(model)
    # Outermost first: the script's call, the loop's call of the helper, the write
    # (this test's own frames, which run the script, come before them).
    assert [u.line for u in facts.update if u.file == str(path)] == [
        line(path, "train(critic)"), line(path, "    clip(model)"), line(path, "p.clamp_(")]
    stack = report.first.modified_by[0].stack if report.first else ()
    assert [s.code for s in stack][-3:] == ["train(critic)", "clip(model)",
                                            "p.clamp_(-0.01, 0.01)"]


def test_from_report_data_carrier(tmp_path):
    path = program(tmp_path, """\
        import torch
        from torch import nn

        torch.manual_seed(0)
        actor = nn.Linear(4, 2)
        critic = nn.Linear(4, 1)
        opt = torch.optim.SGD(actor.parameters(), lr=0.1)
        obs = torch.randn(16, 4)
        advantages = torch.randn(16) - critic(obs).squeeze(-1)
        for _ in range(2):
            loss = -(actor(obs).log_softmax(-1)[:, 0] * advantages).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        """)
    report = watched(path, strict=False)
    h = report.first
    assert h is not None and h.carrier is not None
    assert (h.carrier.role, h.carrier.trained, h.carrier.module) == ("data", False, "critic")
    facts = from_report(report)
    assert (facts.carried, facts.carried_use) == ("advantages", "data")
    assert facts.carried_made is not None
    assert facts.carried_made.line == line(path, "advantages = ")
