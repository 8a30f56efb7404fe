"""``versionwatch fix``'s candidate edits: exact text, formatting kept, one family at a time.

No program runs here: these tests build the facts by hand, as the watcher will,
and read the patched text. tests/test_fix.py runs the checks.
"""

from __future__ import annotations

import inspect
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch._candidates.edits import FUNCTIONAL_INPLACE, MODULE_INPLACE, Candidate, propose
from versionwatch._candidates.facts import FixFacts, Line, from_report
from versionwatch._candidates.source import Source, apply, line_map


def write(tmp_path: Path, text: str, name: str = "prog.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return str(path)


def at(path: str, line: int) -> Line:
    return Line(path, line)


def new_text(c: Candidate) -> str:
    return c.files[c.file][1]


def only(cands: list[Candidate], family: str) -> Candidate:
    found = [c for c in cands if c.family == family]
    assert len(found) == 1, [(c.family, c.new) for c in cands]
    return found[0]


# -- in-place ops on activations -------------------------------------------------------

@pytest.mark.parametrize(("line", "expected"), [
    ("y.mul_(2)  # sigmoid saved y", "y = y.mul(2)  # sigmoid saved y"),
    ("z = y.add_(1)", "z = y = y.add(1)"),
    ("h += skip", "h = h + skip"),
    ("h *= a + b   # scaled", "h = h * (a + b)  # scaled"),  # the comment not pushed right
    ("self.h -= f(x)", "self.h = self.h - f(x)"),
    ("t.relu_()", "t = t.relu()"),
    ("torch.relu_(t)", "t = torch.relu(t)"),
    ("probs.masked_fill_(mask, 0.0)", "probs = probs.masked_fill(mask, 0.0)"),
    ("probs[mask] = 0.0", "probs = probs.index_put((mask,), probs.new_tensor(0.0))"),
    ("probs[rows, cols] = vals", "probs = probs.index_put((rows, cols), vals)"),
    ("h = F.relu(h, inplace=True)", "h = F.relu(h, inplace=False)"),
    ("h = F.dropout(h, 0.5, True, True)", "h = F.dropout(h, 0.5, True, False)"),
    ("h = F.leaky_relu(h, 0.2, True)", "h = F.leaky_relu(h, 0.2, False)"),
])
def test_out_of_place(tmp_path: Path, line: str, expected: str) -> None:
    path = write(tmp_path, f"""
        def step(x):
            {line}
            return x
    """)
    cands = propose(FixFacts("inplace", node="SigmoidBackward0", write=at(path, 2)))
    assert cands and cands[0].family == "out_of_place"
    assert new_text(cands[0]).splitlines()[1] == "    " + expected
    assert cands[0].keeps_values
    assert cands[0].old == "    " + line and cands[0].new == "    " + expected


def test_index_write_with_slices_clones_first(tmp_path: Path) -> None:
    path = write(tmp_path, """
        for _ in range(3):
            probs = logits.softmax(-1)
            probs[:, 0] = 0.0          # softmax saved probs
            loss = probs.sum()
    """)
    (c,) = propose(FixFacts("inplace", node="SoftmaxBackward0", write=at(path, 3),
                            write_op="fill_"))
    assert new_text(c).splitlines()[1:4] == [
        "    probs = logits.softmax(-1)",
        "    probs = probs.clone()",
        "    probs[:, 0] = 0.0          # softmax saved probs",
    ]
    assert "clone" in c.summary and c.keeps_values


def test_index_write_offers_index_put_then_clone(tmp_path: Path) -> None:
    path = write(tmp_path, "p = x.softmax(-1); p[m] = v; q = p.sum()\n")
    cands = propose(FixFacts("inplace", write=at(path, 1)))
    assert [new_text(c) for c in cands] == [
        "p = x.softmax(-1); p = p.index_put((m,), v); q = p.sum()\n",
        "p = x.softmax(-1); p = p.clone(); p[m] = v; q = p.sum()\n",
    ]


def test_write_op_picks_among_constructs(tmp_path: Path) -> None:
    path = write(tmp_path, "h.mul_(2); g += 1\n")
    (c,) = propose(FixFacts("inplace", write=at(path, 1), write_op="add_"))
    assert new_text(c) == "h.mul_(2); g = g + 1\n"
    both = propose(FixFacts("inplace", write=at(path, 1)))
    assert len(both) == 2


def test_no_out_of_place_for_a_parameter(tmp_path: Path) -> None:
    # Rebinding a name never updates a parameter: `p = p.clamp(...)` would stop the clipping.
    path = write(tmp_path, """
        for p in critic.parameters():
            p.clamp_(-0.01, 0.01)
    """)
    assert propose(FixFacts("inplace", tensor="critic.0.weight", write=at(path, 2))) == []


def test_methods_without_a_twin_are_left_alone(tmp_path: Path) -> None:
    path = write(tmp_path, "y.zero_(); y.copy_(z); y.requires_grad_()\n")
    assert propose(FixFacts("inplace", write=at(path, 1))) == []


# -- in-place modules -----------------------------------------------------------------

def test_module_inplace_positions_match_torch() -> None:
    for name, position in MODULE_INPLACE.items():
        cls = getattr(nn, name, None)
        if cls is None:
            continue
        params = list(inspect.signature(cls.__init__).parameters)[1:]
        assert params.index("inplace") == position, name
    for name, position in FUNCTIONAL_INPLACE.items():
        fn = getattr(torch.nn.functional, name, None)
        if fn is None:
            continue
        assert list(inspect.signature(fn).parameters).index("inplace") == position, name


def test_module_built_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import torch.nn as nn
        clf = nn.Sequential(
            nn.Linear(8, 16),
            nn.ReLU(),
            nn.Dropout(0.5, True),    # drop
            nn.Linear(16, 2),
        )
    """)
    (c,) = propose(FixFacts("inplace", node="ReluBackward0", module_built=at(path, 5),
                            module_class="Dropout"))
    assert c.family == "inplace_false" and c.keeps_values
    assert c.old == "    nn.Dropout(0.5, True),    # drop"
    assert c.new == "    nn.Dropout(0.5, inplace=False),  # drop"
    assert "`relu` saved" in c.summary


def test_modules_found_in_the_script(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from torch import nn
        a = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=True),
                          nn.LeakyReLU(0.1, True), nn.Hardtanh(0, 1, True, max_value=None))
        b = nn.ReLU(inplace=False)
    """)
    cands = propose(FixFacts("inplace", node="SigmoidBackward0", write=at(path, 9)),
                    main=path)
    assert [c.new.strip() for c in cands] == [
        "a = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=False),",
        "nn.LeakyReLU(0.1, inplace=False), nn.Hardtanh(0, 1, True, max_value=None))",
        "nn.LeakyReLU(0.1, True), nn.Hardtanh(0, 1, inplace=False, max_value=None))",
    ]
    picked = propose(FixFacts("inplace", write=at(path, 9), write_op="leaky_relu_"), main=path)
    assert [c.new.strip()[:28] for c in picked] == ["nn.LeakyReLU(0.1, inplace=Fa"]


# -- a step between two backwards -----------------------------------------------------

SEED = """
    for _ in range(3):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=False)
        loss1 = mse(y1_pred, y1)
        loss1.backward(retain_graph=True)
        optim.step()
        optim.zero_grad(set_to_none=False)
        loss2 = mse(y2_pred, y2)
        loss2.backward()
        optim.step()
"""


def test_seed_story_merges_the_steps_and_sums_the_losses(tmp_path: Path) -> None:
    path = write(tmp_path, SEED)
    cands = propose(FixFacts("inplace", tensor="model.w3", step=at(path, 6),
                             failing_backward=at(path, 9)))
    assert [c.family for c in cands] == ["move_step", "sum_losses", "set_to_none"]
    move, total, hider = cands
    assert new_text(move) == textwrap.dedent("""\
        for _ in range(3):
            y1_pred, y2_pred = model(x)
            optim.zero_grad(set_to_none=False)
            loss1 = mse(y1_pred, y1)
            loss1.backward(retain_graph=True)
            loss2 = mse(y2_pred, y2)
            loss2.backward()
            optim.step()
    """)
    assert new_text(total) == textwrap.dedent("""\
        for _ in range(3):
            y1_pred, y2_pred = model(x)
            optim.zero_grad(set_to_none=False)
            loss1 = mse(y1_pred, y1)
            loss2 = mse(y2_pred, y2)
            (loss1 + loss2).backward()
            optim.step()
    """)
    assert not total.same_backwards
    assert hider.hides and "only hides" in hider.hides
    assert new_text(hider).count("set_to_none=True") == 2


def test_step_moves_out_of_a_semicolon_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        for _ in range(3):
            out = critic(obs)
            od.zero_grad(); d_loss.backward(retain_graph=True); od.step()  # D
            og.zero_grad(); g_loss.backward(); og.step()
    """)
    cands = propose(FixFacts("inplace", tensor="D.0.weight", step=at(path, 3),
                             failing_backward=at(path, 4)))
    move = only(cands, "move_step")
    assert new_text(move).splitlines()[2:4] == [
        "    od.zero_grad(); d_loss.backward(retain_graph=True)  # D",
        "    og.zero_grad(); g_loss.backward(); od.step(); og.step()",
    ]


def test_step_moves_after_the_last_backward_keeping_comments(tmp_path: Path) -> None:
    path = write(tmp_path, """
        critic_opt.zero_grad()
        critic_loss.backward(retain_graph=True)
        critic_opt.step()   # changes trunk.* in place
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()
    """)
    move = only(propose(FixFacts("inplace", tensor="net.trunk.2.weight", step=at(path, 3),
                                 failing_backward=at(path, 5))), "move_step")
    assert new_text(move) == textwrap.dedent("""\
        critic_opt.zero_grad()
        critic_loss.backward(retain_graph=True)
        actor_opt.zero_grad()
        actor_loss.backward()
        critic_opt.step()   # changes trunk.* in place
        actor_opt.step()
    """)


def test_refresh_reruns_a_plain_forward(tmp_path: Path) -> None:
    path = write(tmp_path, """
        d_fake = D(fake)
        d_loss.backward(retain_graph=True)
        opt_d.step()
        g_loss = bce(d_fake, ones)
        g_loss.backward()
    """)
    c = only(propose(FixFacts("inplace", tensor="D.2.weight", step=at(path, 3),
                              failing_backward=at(path, 5), saved_at=at(path, 1))), "refresh")
    assert c.new == "g_loss = bce(D(fake), ones)"
    # A forward that draws its input is not re-run: new data.
    path = write(tmp_path, """
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        out.abs().mean().backward()
    """, "b.py")
    assert "refresh" not in [c.family for c in propose(FixFacts(
        "inplace", tensor="model.2.weight", step=at(path, 3), failing_backward=at(path, 4),
        saved_at=at(path, 1)))]


# -- freed graphs -----------------------------------------------------------------------

@pytest.mark.parametrize(("call", "expected"), [
    ("loss.backward()", "loss.backward(retain_graph=True)"),
    ("loss.backward(g)", "loss.backward(g, retain_graph=True)"),
    ("loss.backward(retain_graph=False)", "loss.backward(retain_graph=True)"),
    ("torch.autograd.backward([a, b])", "torch.autograd.backward([a, b], retain_graph=True)"),
    ("scaler.scale(loss).backward()", "scaler.scale(loss).backward(retain_graph=True)"),
])
def test_retain_graph(tmp_path: Path, call: str, expected: str) -> None:
    path = write(tmp_path, f"{call}  # first\nloss2.backward()\n")
    c = only(propose(FixFacts("freed", first_backward=at(path, 1),
                              failing_backward=at(path, 2))), "retain_graph")
    assert c.new == f"{expected}  # first" and c.keeps_values


def test_retain_graph_after_a_trailing_comma(tmp_path: Path) -> None:
    path = write(tmp_path, "loss.backward(\n    g,\n)\nloss2.backward()\n")
    c = only(propose(FixFacts("freed", first_backward=at(path, 1),
                              failing_backward=at(path, 4))), "retain_graph")
    assert new_text(c).startswith("loss.backward(\n    g, retain_graph=True,\n)")


GAN = """
    for _ in range(3):
        fake = G(z)
        d_loss = bce(D(real), ones) + bce(D(fake), zeros)
        od.zero_grad(); d_loss.backward(); od.step()
        g_loss = bce(D(fake), ones)
        og.zero_grad(); g_loss.backward(); og.step()
"""


def test_gan_detach_in_the_first_loss_and_the_hider(tmp_path: Path) -> None:
    path = write(tmp_path, GAN)
    facts = FixFacts("freed", carried="fake", first_backward=at(path, 4),
                     failing_backward=at(path, 6))
    cands = propose(facts)
    assert [c.family for c in cands] == ["gan_detach", "detach_second", "retain_graph"]
    gan, hider, retain = cands
    assert gan.new == "    d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)"
    assert gan.cut_at == (at(path, 4),)
    assert hider.new == "    g_loss = bce(D(fake.detach()), ones)" and hider.hides
    assert retain.new == "    od.zero_grad(); d_loss.backward(retain_graph=True); od.step()"
    # Nothing between the backwards: retain_graph=True first.
    first = propose(FixFacts("freed", carried="fake", first_backward=at(path, 4),
                             failing_backward=at(path, 6), between="nothing"))
    assert first[0].family == "retain_graph"


def test_carried_state_in_a_loop(tmp_path: Path) -> None:
    path = write(tmp_path, """
        h = torch.zeros(1, 4)
        for _ in range(4):
            h = rnn(torch.randn(1, 4), h)
            loss = h.pow(2).sum()
            loss.backward()
    """)
    cands = propose(FixFacts("freed", carried="h", first_backward=at(path, 5),
                             failing_backward=at(path, 5)))
    c = only(cands, "detach_carried")
    assert c.new == "    h = rnn(torch.randn(1, 4), h.detach())"
    assert "detach_made" not in [x.family for x in cands]  # h feeds a forward


def test_data_made_once_is_detached_where_made(tmp_path: Path) -> None:
    path = write(tmp_path, """
        adv = returns - critic(obs)   # advantages
        for _ in range(3):
            loss = -(actor(obs).log_softmax(-1) * adv).mean()
            loss.backward()
    """)
    cands = propose(FixFacts("freed", carried="adv", first_backward=at(path, 4),
                             failing_backward=at(path, 4)))
    c = only(cands, "detach_made")
    assert c.new == "adv = (returns - critic(obs)).detach()  # advantages"
    assert c.cut_any


# -- no_grad updates --------------------------------------------------------------------

def test_update_block_moves_after_the_step(tmp_path: Path) -> None:
    path = write(tmp_path, """
        for _ in range(3):
            out = critic(x).mean()
            with torch.no_grad():
                for p in critic.parameters():
                    p.clamp_(-0.01, 0.01)   # clip
            opt.zero_grad()
            out.backward()
            opt.step()
    """)
    c = only(propose(FixFacts("inplace", tensor="critic.2.weight", update=(at(path, 5),),
                              failing_backward=at(path, 7))), "move_update")
    assert new_text(c) == textwrap.dedent("""\
        for _ in range(3):
            out = critic(x).mean()
            opt.zero_grad()
            out.backward()
            opt.step()
            with torch.no_grad():
                for p in critic.parameters():
                    p.clamp_(-0.01, 0.01)   # clip
    """)


def test_update_in_a_helper_moves_its_call(tmp_path: Path) -> None:
    path = write(tmp_path, """
        def swap(model, ema):
            with torch.no_grad():
                for p, q in zip(model.parameters(), ema.parameters()):
                    p.copy_(q)

        loss = model(x).sum()
        swap(model, ema)
        loss.backward()
    """)
    c = only(propose(FixFacts("inplace", tensor="model.weight", update=(at(path, 4),),
                              failing_backward=at(path, 8))), "move_update")
    assert new_text(c).endswith("loss = model(x).sum()\nloss.backward()\nswap(model, ema)\n")


# -- what is never edited ---------------------------------------------------------------

def test_installed_files_are_never_edited() -> None:
    import torch.nn.modules.activation as act

    src = Path(act.__file__).read_text(encoding="utf-8").splitlines()
    line = next(i for i, t in enumerate(src, 1) if "inplace" in t and "=" in t)
    assert propose(FixFacts("inplace", write=Line(act.__file__, line),
                            module_built=Line(act.__file__, line))) == []


def test_a_line_changed_since_the_run_is_left_alone(tmp_path: Path) -> None:
    path = write(tmp_path, "y.mul_(2)\n")
    assert propose(FixFacts("inplace", write=Line(path, 1, "y.mul_(3)"))) == []
    assert propose(FixFacts("inplace", write=Line(path, 1, "y.mul_(2)")))


def test_a_program_that_is_not_a_file() -> None:
    code = "import torch\ny = torch.ones(2, requires_grad=True).sigmoid()\ny.mul_(2)\n"
    (c,) = propose(FixFacts("inplace", write=Line("<string>", 3),
                            sources={"<string>": code}))
    assert c.file == "<string>" and c.new == "y = y.mul(2)"


def test_diffs_apply_with_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, SEED, "seed.py")
    cands = propose(FixFacts("inplace", tensor="model.w3", step=at(path, 6),
                             failing_backward=at(path, 9)))
    for c in cands:
        assert c.diff.startswith("diff --git a/seed.py b/seed.py\n--- a/seed.py\n")
        patch = tmp_path / "fix.patch"
        patch.write_text(c.diff, encoding="utf-8")
        done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    subprocess.run(["git", "apply", str(tmp_path / "fix.patch")], cwd=tmp_path, check=True)
    assert Path(path).read_text(encoding="utf-8") == new_text(cands[-1])


# -- the pieces --------------------------------------------------------------------------

def test_edits_and_line_map() -> None:
    from versionwatch._candidates.source import Edit

    text = "a = 1\nb = 2\n"
    assert apply(text, [Edit((2, 0), (2, 0), "x = 0\n"), Edit((1, 4), (1, 5), "9")]) == \
        "a = 9\nx = 0\nb = 2\n"
    assert line_map(text, "a = 1\nx = 0\nb = 2\n") == {1: 1, 2: 2, 3: 2}
    src = Source("<t>", "s = 'é'; y.mul_(2)\n")
    (_, stmt) = src.statements_at(1)
    assert src.segment(stmt) == "y.mul_(2)"  # columns in characters, not UTF-8 bytes


def test_facts_round_trip_and_bad_facts() -> None:
    facts = FixFacts("freed", carried="h", first_backward=Line("/a.py", 3, "x"),
                     update=(Line("/a.py", 1),))
    assert FixFacts.from_dict(facts.to_dict()) == facts
    with pytest.raises(ValueError, match="unknown fact"):
        FixFacts.from_dict({"kind": "freed", "carry": "h"})
    with pytest.raises(ValueError, match="kind must be"):
        FixFacts.from_dict({"kind": "broken"})


def test_from_report_of_a_strict_watcher(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        out.abs().mean().backward()
    """)
    code = compile(Path(path).read_text(encoding="utf-8"), path, "exec")
    with pytest.raises(versionwatch.InplaceModificationError) as caught:
        with versionwatch.watch_all(strict=True):
            exec(code, {"__name__": "__main__"})
    facts = from_report(caught.value.report)
    assert facts.kind == "inplace" and facts.tensor == "model.2.weight"
    assert facts.step == Line(path, 7, "opt.step()")
    assert facts.failing_backward is not None and facts.failing_backward.line == 8
    assert facts.saved_at is not None and facts.saved_at.line == 5
    assert [c.family for c in propose(facts)][:2] == ["move_step", "sum_losses"]


# -- the families added for the patterns' programs --------------------------------------

def test_every_write_to_the_variable_in_its_function(tmp_path: Path) -> None:
    path = write(tmp_path, """
        class Block:
            def forward(self, x):
                x = x + 0
                x += self.ff(self.n1(x))
                x += self.ff2(self.n2(x))  # the write the watcher named
                return x
    """)
    cands = propose(FixFacts("inplace", node="NativeLayerNormBackward0", write=at(path, 5)))
    assert [c.family for c in cands] == ["out_of_place", "out_of_place"]
    one, every = cands
    assert one.new == "        x = x + self.ff2(self.n2(x))  # the write the watcher named"
    assert new_text(every).splitlines()[3:5] == [
        "        x = x + self.ff(self.n1(x))",
        "        x = x + self.ff2(self.n2(x))  # the write the watcher named",
    ]
    assert "every in-place write to `x` in `forward` (lines 4, 5)" in every.summary
    assert every.keeps_values


def test_sum_backwards_for_an_optimizer_in_backward(tmp_path: Path) -> None:
    path = write(tmp_path, """
        out = model(torch.randn(2, 4))
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
    """)
    (c,) = propose(FixFacts("inplace", tensor="model.2.weight", update=(at(path, 9),),
                            failing_backward=at(path, 3)))
    assert c.family == "sum_backwards" and not c.same_backwards
    assert new_text(c).splitlines()[1:] == ["(out.pow(2).mean() + out.abs().mean()).backward()"]
    # A step between the two: the step families' case, not this one.
    path = write(tmp_path, "out = m(x)\na.backward(retain_graph=True)\nopt.step()\nb.backward()\n",
                 "b.py")
    assert "sum_backwards" not in [c.family for c in propose(FixFacts(
        "inplace", tensor="m.weight", failing_backward=at(path, 4)))]


def test_one_forward_for_a_write_in_the_modules_own_forward(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import torch

        class Broadcast(nn.Module):
            def forward(self, x):
                with torch.no_grad():
                    for b in self.module.buffers():
                        b.copy_(b)
                return self.module(x)

        out_real = ddp(real)
        out_fake = ddp(fake)   # the broadcast overwrites what the first forward saved
        (out_real.mean() - out_fake.mean()).backward()
    """)
    (c,) = propose(FixFacts("inplace", tensor="ddp.module.1.running_mean",
                            update=(at(path, 7),), failing_backward=at(path, 12)))
    assert c.family == "one_forward" and not c.keeps_values
    assert new_text(c).splitlines()[9:11] == [
        "out_real, out_fake = ddp(torch.cat([real, fake])).split([len(real), len(fake)])",
        "(out_real.mean() - out_fake.mean()).backward()",
    ]
    assert "the batch statistics are over both batches now" in c.summary


def test_manual_backward_losses_are_summed_as_arguments(tmp_path: Path) -> None:
    path = write(tmp_path, """
        def training_step(self, batch, batch_idx):
            out = self.net(batch)
            self.manual_backward(out.pow(2).mean(), retain_graph=True)
            opt.step()
            self.manual_backward(out.abs().mean())
    """)
    cands = propose(FixFacts("inplace", tensor="model.net.2.weight", step=at(path, 4),
                             failing_backward=at(path, 5)))
    assert [c.family for c in cands] == ["move_step", "sum_losses"]
    assert cands[1].new == "    self.manual_backward(out.pow(2).mean() + out.abs().mean())"


def test_a_step_in_a_block_of_its_own_is_not_moved_out(tmp_path: Path) -> None:
    path = write(tmp_path, """
        if reuse:
            d_loss.backward(retain_graph=True)
            opt_d.step()
        g_loss.backward()
    """)
    assert propose(FixFacts("inplace", tensor="D.2.weight", step=at(path, 3),
                            failing_backward=at(path, 4))) == []


def test_a_step_between_two_backwards_of_a_freed_graph(tmp_path: Path) -> None:
    path = write(tmp_path, """
        out = net(x)
        mse = (out - y).pow(2).mean()
        mse.backward()
        opt.step()
        l1 = (out - y).abs().mean()
        l1.backward()
        opt.step()
    """)
    cands = propose(FixFacts("freed", carried="out", first_backward=at(path, 3),
                             failing_backward=at(path, 6)))
    move = only(cands, "move_step")
    assert new_text(move).splitlines()[2:6] == [
        "mse.backward(retain_graph=True)", "l1 = (out - y).abs().mean()", "l1.backward()",
        "opt.step()"]
    assert "`retain_graph=True` on `mse.backward()` keeps its graph" in move.summary
    assert only(cands, "sum_losses").new.endswith("(mse + l1).backward()")


def test_the_carried_tensor_from_the_source(tmp_path: Path) -> None:
    path = write(tmp_path, """
        hidden = torch.zeros(2, 8)
        for _ in range(4):
            hidden = cell(torch.randn(2, 4), hidden)
            loss = head(hidden).pow(2).mean()
            loss.backward()
    """)
    # The watcher named no carrier: the line that saved the freed tensor does.
    (c,) = [c for c in propose(FixFacts("freed", saved_at=at(path, 3), first_backward=at(path, 5),
                                        failing_backward=at(path, 5)))
            if c.family == "detach_carried"]
    assert c.new == "    hidden = cell(torch.randn(2, 4), hidden.detach())"


def test_the_backward_a_check_asked_about(tmp_path: Path) -> None:
    from versionwatch._candidates.shared import backward_after

    path = write(tmp_path, """
        for n in range(3):
            loss1.backward(retain_graph=True)
            if predict:
                versionwatch.assert_backward_safe(loss2, names=model)
            other.backward()
            loss2.backward()
    """)
    src = Source(path, Path(path).read_text(encoding="utf-8"))
    found = backward_after(src, 4)
    assert found is not None and src.segment(found) == "loss2.backward()"


def test_from_report_reads_the_facts_a_report_may_have(tmp_path: Path) -> None:
    """carrier, between and a writer's construction line: read when the report has them."""
    from versionwatch._report.model import (
        Between,
        Carrier,
        Hazard,
        Modification,
        Report,
        Site,
        Writer,
    )

    path = write(tmp_path, "x = 1\n")
    freed = Hazard("freed", "AddmmBackward0", "mat1", carried_by="",
                   carrier=Carrier("fake", Site(path, 3, "fake = G(z)"), role="input"),
                   between=Between((Modification("optimizer.step", "Adam.step() #1",
                                                 Site(path, 5, "od.step()")),)))
    facts = from_report(Report(hazards=[freed]))
    assert (facts.carried, facts.carried_use, facts.between) == ("fake", "forward", "step")
    assert facts.carried_made == Line(path, 3, "fake = G(z)")
    assert facts.step == Line(path, 5, "od.step()")
    write_ = Modification("inplace_op", "dropout_()", Site(path, 9, "loss = clf(x)"),
                          writer=Writer("clf.2", "Dropout(p=0.5, inplace=True)",
                                        Site(path, 2, "nn.Dropout(0.5, True),")))
    facts = from_report(Report(hazards=[Hazard("inplace", "ReluBackward0", "result",
                                               modified_by=[write_])]))
    assert facts.module_built == Line(path, 2, "nn.Dropout(0.5, True),")
    assert facts.module_class == "Dropout"


# -- families from the program's shape (issue #32) ---------------------------------------

PROGRAMS = Path(__file__).parent / "fix_programs"


def program(name: str) -> str:
    return str(PROGRAMS / f"{name}.py")


def runs(c: Candidate) -> subprocess.CompletedProcess[str]:
    """The patched program, run by plain python."""
    import sys

    return subprocess.run([sys.executable, "-"], input=new_text(c), capture_output=True,
                          text=True, timeout=120)


def changes(c: Candidate) -> list[str]:
    """The diff's changed lines, without the file names."""
    return [ln for ln in c.diff.splitlines()
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def test_backward_inputs_trains_what_the_next_step_applies(tmp_path: Path) -> None:
    path = program("actor_critic")
    cands = propose(FixFacts("inplace", tensor="net.trunk.2.weight", step=at(path, 30),
                             failing_backward=at(path, 32), saved_at=at(path, 14)))
    c = only(cands, "backward_inputs")
    assert changes(c) == [
        "-    actor_loss.backward()",
        '+    actor_loss.backward(inputs=[p for g in actor_opt.param_groups for p in g["params"]])',
    ]
    assert "trains only what `actor_opt.step()` applies, as the program's steps did" in c.summary
    assert c.cut_at == (at(path, 32),)
    # Before move_step: that one applies the actor's gradients to the trunk too.
    families = [x.family for x in cands]
    assert families.index("backward_inputs") < families.index("move_step")
    done = runs(c)
    assert done.returncode == 0, done.stderr


def test_backward_inputs_keeps_the_backwards_own_arguments(tmp_path: Path) -> None:
    path = write(tmp_path, """
        critic_loss.backward(retain_graph=True)
        critic_opt.step()
        actor_loss.backward(retain_graph=True)
        actor_opt.step()
    """)
    c = only(propose(FixFacts("inplace", tensor="trunk.weight", step=at(path, 2),
                              failing_backward=at(path, 3))), "backward_inputs")
    assert c.new == ("actor_loss.backward(retain_graph=True, "
                     'inputs=[p for g in actor_opt.param_groups for p in g["params"]])')


def test_reorder_backwards_for_a_trunk_the_first_optimizer_trains() -> None:
    path = program("actor_critic_shared")
    c = only(propose(FixFacts("inplace", tensor="net.trunk.2.weight", step=at(path, 30),
                              failing_backward=at(path, 32), saved_at=at(path, 14))),
             "reorder_backwards")
    assert new_text(c).splitlines()[26:33] == [
        "    critic_loss = (returns - value).pow(2).mean()",
        "    critic_opt.zero_grad()",
        "    critic_loss.backward(retain_graph=True)",
        "    actor_opt.zero_grad()",
        "    actor_loss.backward(retain_graph=True)",
        "    actor_opt.step()  # changes trunk.* in place",
        "    critic_opt.step()",
    ]
    assert "`retain_graph=True` on `critic_loss.backward()`, which now runs first" in c.summary
    done = runs(c)
    assert done.returncode == 0, done.stderr


def test_reorder_backwards_moves_the_comments_above_and_needs_no_retain(tmp_path: Path) -> None:
    path = write(tmp_path, """
        a_opt.zero_grad()
        a_loss.backward()
        a_opt.step()
        # the critic's turn
        b_opt.zero_grad()
        b_loss.backward()
        b_opt.step()
    """)
    c = only(propose(FixFacts("inplace", tensor="trunk.weight", step=at(path, 3),
                              failing_backward=at(path, 6))), "reorder_backwards")
    assert new_text(c) == textwrap.dedent("""\
        # the critic's turn
        b_opt.zero_grad()
        b_loss.backward()
        a_opt.zero_grad()
        a_loss.backward()
        a_opt.step()
        b_opt.step()
    """)
    assert "retain_graph" not in c.summary


def test_refresh_when_one_forward_feeds_both_losses() -> None:
    path = program("gan_one_dfake")
    cands = propose(FixFacts("inplace", tensor="D.2.weight", step=at(path, 21),
                             failing_backward=at(path, 23), saved_at=at(path, 16)))
    c = cands[0]
    assert c.family == "refresh"
    assert changes(c) == [
        "-    g_loss = bce(d_fake, ones)  # the same D(fake) as d_loss",
        "+    d_fake = D(fake)",
        "+    g_loss = bce(d_fake, ones)  # the same D(fake) as d_loss",
    ]
    assert new_text(c).splitlines()[19:22] == [
        "    opt_d.step()", "    d_fake = D(fake)",
        "    g_loss = bce(d_fake, ones)  # the same D(fake) as d_loss"]
    done = runs(c)
    assert done.returncode == 0, done.stderr


def test_refresh_detaches_the_first_forwards_input_when_its_graph_is_freed(
        tmp_path: Path) -> None:
    path = write(tmp_path, """
        fake = G(z)
        d_fake = D(fake)
        d_loss = bce(d_fake, zeros)
        g_loss = bce(d_fake, ones)
        d_loss.backward()
        opt_d.step()
        g_loss.backward()
    """)
    c = only(propose(FixFacts("inplace", tensor="D.2.weight", step=at(path, 6),
                              failing_backward=at(path, 7), saved_at=at(path, 2))), "refresh")
    assert new_text(c) == textwrap.dedent("""\
        fake = G(z)
        d_fake = D(fake.detach())
        d_loss = bce(d_fake, zeros)
        d_loss.backward()
        opt_d.step()
        d_fake = D(fake)
        g_loss = bce(d_fake, ones)
        g_loss.backward()
    """)
    assert c.cut_at == (Line(path, 5, "d_loss.backward()"),)


@pytest.mark.parametrize(("name", "expected"), [
    ("lstm_state", "    state = tuple(s.detach() for s in state)"),
    ("gru_state", "    state = state.detach()"),
])
def test_detach_state_after_the_call_that_returns_it(name: str, expected: str) -> None:
    path = program(name)
    # The watcher names no carrier for the LSTM's tuple: the loop's shape does.
    cands = propose(FixFacts("freed", failing_backward=at(path, 31),
                             first_backward=at(path, 31), saved_at=at(path, 17),
                             step=at(path, 32)))
    c = cands[0]
    assert c.family == "detach_state"
    assert changes(c) == ["+" + expected]
    assert new_text(c).splitlines()[27:29] == ["    logits, state = model(x, state)", expected]
    done = runs(c)
    assert done.returncode == 0, done.stderr


def test_detach_state_of_unknown_modules_works_for_both(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import torch
        state = None
        for x in batches:
            out, state = model(x, state)
            out.sum().backward()
    """)
    c = only(propose(FixFacts("freed", failing_backward=at(path, 5))), "detach_state")
    assert c.new == ("    state = state.detach() if isinstance(state, torch.Tensor) "
                     "else tuple(s.detach() for s in state)")


def test_move_forward_into_the_loop_and_never_detach_the_loss() -> None:
    path = program("loss_before_loop")
    cands = propose(FixFacts("freed", failing_backward=at(path, 14), first_backward=at(path, 14),
                             saved_at=at(path, 11), step=at(path, 15), between="step"))
    assert cands[0].family == "move_forward"
    assert new_text(cands[0]).splitlines()[9:14] == [
        "for _epoch in range(3):", "    out = model(x)", "    loss = crit(out, y)",
        "    opt.zero_grad()", "    loss.backward()"]
    # Detaching the loss being back-propagated leaves its backward nothing to run.
    assert not any(".detach()" in x.new for x in cands)
    done = runs(cands[0])
    assert done.returncode == 0, done.stderr


def test_accumulator_reset_and_item() -> None:
    path = program("accumulator")
    cands = propose(FixFacts("freed", carried="total", failing_backward=at(path, 15),
                             first_backward=at(path, 15), saved_at=at(path, 12),
                             step=at(path, 16), carried_use="forward", between="step"))
    # The total kept for logging first: the reset changes what a print of it shows.
    item, reset = cands[:2]
    assert (item.family, reset.family) == ("item_accumulator", "reset_accumulator")
    assert changes(reset) == ["+    total = 0"]
    assert new_text(reset).splitlines()[15:17] == ["    opt.step()", "    total = 0"]
    assert changes(item) == ["-    total = total + loss", "+    total = total + loss.item()",
                             "-    total.backward()", "+    loss.backward()"]
    # `total = 0` first: `total.detach()` would be an int's.
    assert "detach_carried" not in [c.family for c in cands]
    for c in (reset, item):
        done = runs(c)
        assert done.returncode == 0, done.stderr


def test_item_accumulator_only_for_a_total_that_is_only_logged(tmp_path: Path) -> None:
    path = write(tmp_path, """
        total = torch.zeros(())
        for x in batches:
            loss = model(x).sum()
            total += loss
            total.backward()
            opt.step()
            print(f"{total.item():.3f}")
    """)
    cands = propose(FixFacts("freed", failing_backward=at(path, 5)))
    assert [c.family for c in cands if c.family.endswith("accumulator")] == ["reset_accumulator"]
    assert only(cands, "reset_accumulator").new == "    total = torch.zeros(())"


def test_merged_step_says_zero_grad_only_when_one_moved(tmp_path: Path) -> None:
    path = write(tmp_path, """
        out = model(x)
        a.backward(retain_graph=True)
        opt.step()
        b.backward()
        opt.step()
    """)
    c = only(propose(FixFacts("inplace", tensor="model.weight", step=at(path, 3),
                              failing_backward=at(path, 4))), "move_step")
    assert "the step between them is gone" in c.summary and "zero_grad" not in c.summary
# -- a boolean mask, comments (issue #32) ------------------------------------------------

@pytest.mark.parametrize(("made", "line", "expected"), [
    ("mask = torch.zeros(8, 5, dtype=torch.bool)", "probs[mask] = 0.0",
     "probs = probs.masked_fill(mask, 0.0)"),
    ("mask = scores > 0.5", "probs[mask] = -1e9", "probs = probs.masked_fill(mask, -1e9)"),
    ("mask = (ids == pad).bool()", "probs[~mask] = 0", "probs = probs.masked_fill(~mask, 0)"),
    ("keep = ids.ne(pad)", "probs[keep & (ids > 0)] = float('-inf')",
     "probs = probs.masked_fill(keep & (ids > 0), float('-inf'))"),
    ("mask = ids", "probs[probs < 0.1] = 0.0", "probs = probs.masked_fill(probs < 0.1, 0.0)"),
])
def test_boolean_mask_write_becomes_masked_fill(tmp_path: Path, made: str, line: str,
                                                expected: str) -> None:
    path = write_(tmp_path, made, line)
    cands = propose(FixFacts("inplace", node="SoftmaxBackward0", write=at(path, 4),
                             write_op="index_put_"))
    assert [c.new for c in cands] == ["    " + expected, "    probs = probs.clone()"]
    assert "masked_fill" in cands[0].summary and cands[0].keeps_values


def write_(tmp_path: Path, made: str, line: str) -> str:
    return write(tmp_path, f"""
        def step(model, x, ids, pad, scores):
            {made}
            probs = model(x).softmax(-1)
            {line}
            return probs
    """)


@pytest.mark.parametrize(("made", "line"), [
    ("mask = ids", "probs[mask] = 0.0"),            # not shown to be boolean: index_put
    ("mask = ids.long()", "probs[mask] = 0.0"),
    ("mask = scores > 0.5", "probs[mask] = values"),  # not a number: index_put
])
def test_index_write_without_a_boolean_mask_keeps_index_put(tmp_path: Path, made: str,
                                                            line: str) -> None:
    path = write_(tmp_path, made, line)
    cands = propose(FixFacts("inplace", write=at(path, 4)))
    assert "index_put" in cands[0].new and "masked_fill" not in cands[0].new


def test_mask_parameter_is_not_assumed_boolean(tmp_path: Path) -> None:
    path = write(tmp_path, """
        def step(probs, mask):
            probs[mask] = 0.0
            return probs
    """)
    (first, _) = propose(FixFacts("inplace", write=at(path, 2)))
    assert first.new == "    probs = probs.index_put((mask,), probs.new_tensor(0.0))"


def test_masked_fill_patch_computes_what_the_write_did() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 5, requires_grad=True)
    mask = torch.zeros(8, 5, dtype=torch.bool)
    mask[:, 0] = True
    probs = logits.softmax(-1)
    fixed = probs.masked_fill(mask, 0.0)  # the patch's line
    fixed.max(-1).values.log().mean().backward()
    with torch.no_grad():
        ref = logits.softmax(-1).clone()
        ref[mask] = 0.0
    assert torch.equal(fixed.detach(), ref)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(("line", "expected"), [
    # The longer code would push the comment right: it keeps its column ...
    ("y.mul_(2)             # sigmoid saved y", "y = y.mul(2)          # sigmoid saved y"),
    # ... or, where the code now reaches it, follows the code by its old gap.
    ("h += skip  # residual", "h = h + skip  # residual"),
    ("h += skip # residual", "h = h + skip # residual"),
    # Shorter code: the comment moves with it, as before.
    ("h = F.relu(h, inplace=True)  # act", "h = F.relu(h, inplace=False)  # act"),
])
def test_trailing_comment_is_not_pushed_right(tmp_path: Path, line: str, expected: str) -> None:
    path = write(tmp_path, f"""
        def step(y, h, skip):
            {line}
            return y
    """)
    (c, *_) = propose(FixFacts("inplace", write=at(path, 2)))
    assert c.new == "    " + expected


def test_comment_over_an_index_write_stays_with_it(tmp_path: Path) -> None:
    path = write(tmp_path, """
        for _ in range(3):
            probs = logits.softmax(-1)
            # drop the first class
            # (softmax saved probs)
            probs[:, 0] = 0.0
            loss = probs.sum()
    """)
    (c,) = propose(FixFacts("inplace", write=at(path, 5), write_op="fill_"))
    assert new_text(c).splitlines()[1:6] == [
        "    probs = logits.softmax(-1)",
        "    probs = probs.clone()",
        "    # drop the first class",
        "    # (softmax saved probs)",
        "    probs[:, 0] = 0.0",
    ]
