"""Explanations that send the user the right way (issue #24), on programs no other test has seen.

Each program under ``tests/explain_programs/`` fails with one of the seven
classes of issue #24. Every one runs through ``versionwatch run`` in default
mode, ``--strict`` and ``--replay`` (text and JSON), and the tests assert what
a senior engineer needs: the right fix, the right culprit, PyTorch's sentence
verbatim, the saving forward as a structured location, and variables and ops as
the user wrote them. Each fix a report offers is applied to a copy of the
program, which then runs plainly: the failure is gone, and the gradients the
program means to compute are those of a reference written another way.

``docs/dev/explanations-analysis.md`` says which fact each test needs, and
where the watcher finds it.

The programs run through the CLI's ``main`` in this process, once per mode
(cached for the module); ``--replay``'s strict re-run is a child process, as it
is for users.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from versionwatch._cli.command import main

PROGRAMS = Path(__file__).parent / "explain_programs"
MODES = {"default": [], "strict": ["--strict"], "replay": ["--replay"]}
# Where --replay's own report begins in its output.
REPLAYED = "versionwatch: --replay: running the same command again in strict mode"


def source(name: str) -> str:
    return (PROGRAMS / f"{name}.py").read_text()


def line(name: str, text: str, nth: int = 1) -> int:
    """The number of the ``nth`` line of program ``name`` that contains ``text``."""
    return [i for i, s in enumerate(source(name).splitlines(), 1) if text in s][nth - 1]


class Run(NamedTuple):
    status: int
    err: str  # everything the run wrote to stderr
    text: str  # the report that counts: after --replay's line, with --replay
    doc: dict[str, Any]  # the --json document

    @property
    def h(self) -> dict[str, Any]:
        """The first hazard, as JSON."""
        return self.doc["hazards"][0]

    def fact(self, label: str) -> str:
        """The value of the report's fact line ``label`` (continuation lines joined)."""
        lines = self.text.splitlines()
        pattern = re.compile(rf"^  {re.escape(label)} +(.*)$")
        for i, text in enumerate(lines):
            m = pattern.match(text)
            if m is None:
                continue
            value = [m.group(1)]
            indent = len(text) - len(m.group(1))
            for more in lines[i + 1:]:
                if more[:indent].strip() or len(more) <= indent:
                    break
                value.append(more[indent:])
            return "\n".join(value)
        raise AssertionError(f"no {label!r} line in:\n{self.text}")


_RUNS: dict[tuple[str, str], Run] = {}


def run(name: str, mode: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``versionwatch run [--strict|--replay] --json out.json prog.py``, once per program and mode."""
    key = (name, mode)
    if key not in _RUNS:
        folder = tmp_path_factory.mktemp(f"{name}-{mode}")
        shutil.copy(PROGRAMS / f"{name}.py", folder / "prog.py")
        here, err = os.getcwd(), io.StringIO()
        os.chdir(folder)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                status = main(["run", *MODES[mode], "--json", "out.json", "prog.py"])
        finally:
            os.chdir(here)
        # A process group left by another test makes torch prefix every line of an
        # uncaught error with "[rank0]: ".
        said = re.sub(r"(?m)^\[rank\d+\]: ", "", err.getvalue())
        first = said[said.find("versionwatch: backward"):] if "versionwatch: backward" in said \
            else said
        if mode == "replay" and REPLAYED in said:
            # --replay prints the report once, then only the lines its strict run filled
            # in: those first (they count), then the report's own (the pytorch line).
            first, replayed = said.split(REPLAYED, 1)
            first = first[first.find("versionwatch: backward"):]
            text = replayed + "\n" + first
        else:
            text = first
        doc = json.loads((folder / "out.json").read_text())
        _RUNS[key] = Run(status, said, text, doc)
    return _RUNS[key]


def plain(src: str, folder: Path, name: str = "fixed.py") -> dict[str, Any]:
    """Run ``src`` as a plain program, with no watcher: its globals at the end."""
    path = folder / name
    path.write_text(src)
    return runpy.run_path(str(path), run_name="__main__")


def plain_error(src: str, folder: Path) -> str:
    """PyTorch's own error for ``src``, run plainly."""
    with pytest.raises(RuntimeError) as e:
        plain(src, folder, "original.py")
    return str(e.value)


def edit(name: str, *changes: tuple[str, str]) -> str:
    """Program ``name`` with each ``(old, new)`` replaced once, as the user would edit it."""
    src = source(name)
    for old, new in changes:
        assert src.count(old) == 1, (old, name)
        src = src.replace(old, new)
    return src


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None)
            for n, p in module.named_parameters()}


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def same(a: dict[str, Any], b: dict[str, Any], exact: bool = True) -> bool:
    """Equal tensors under equal names (``exact=False``: up to float rounding)."""
    assert a.keys() == b.keys()
    equal = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=1e-6))
    return all((x is None and y is None) or (x is not None and y is not None and equal(x, y))
               for x, y in ((a[k], b[k]) for k in a))


# Lowercased node names, which no user writes.
NODE_WORDS = re.compile(r"`(nativelayernorm|nativebatchnorm|add|mul|addmm|compiledfunction|"
                        r"checkpointfunction)`")


# -- 1. the fix for a freed graph ------------------------------------------------------------

FREED = ["gan_no_detach", "gan_loop", "two_losses", "two_losses_prebuilt", "two_losses_step",
         "ppo_advantages", "targets_reused", "rnn_state"]


@pytest.mark.parametrize("name", FREED)
def test_freed_graph_is_predicted_and_names_the_freeing_backward(name, tmp_path_factory):
    r = run(name, "default", tmp_path_factory)
    assert r.status == 1 and r.h["kind"] == "freed" and r.h["detected"] == "predicted"
    assert r.h["freed_by"]["description"] == "backward #1"
    assert r.h["torch_message"].startswith("Trying to backward through the graph a second time")


@pytest.mark.parametrize("name", FREED)
@pytest.mark.parametrize("mode", ["default", "strict"])
def test_freed_graph_fix_is_never_a_wrong_sure_fix(name, mode, tmp_path_factory):
    """No fix that could stop a needed gradient is offered as sure.

    The truncated-BPTT fix, alone, would stop the generator's gradient in a GAN and is
    wrong for advantages; "a tensor from an earlier iteration" is wrong for advantages.
    """
    r = run(name, mode, tmp_path_factory)
    fix = r.h["fix"]
    assert "a tensor from an earlier iteration" not in r.text
    if name != "rnn_state":
        # The sure truncated-BPTT fix, which the old report gave every carrier.
        assert "carried from one iteration to the next" not in fix, fix
        assert "would make every backward run through all earlier iterations" not in fix


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_gan_without_detach_names_fake_and_where_it_was_made(mode, tmp_path_factory):
    r = run("gan_no_detach", mode, tmp_path_factory)
    assert r.h["carried_by"] == "fake"
    assert r.h["saved_forward"] == {"forward": "G.forward #1", "file": "prog.py",
                                    "line": line("gan_no_detach", "fake = G(z)"), "module": "G"}
    assert r.fact("freed by").startswith(
        f"backward #1 at prog.py:{line('gan_no_detach', 'd_loss.backward()')}, which ran")


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_gan_without_detach_fix_detaches_in_the_discriminator_loss(mode, tmp_path_factory):
    r = run("gan_no_detach", mode, tmp_path_factory)
    d_line = line("gan_no_detach", "d_loss = bce(")
    fix = r.h["fix"]
    assert f"`D(fake.detach())` at prog.py:{d_line}" in fix
    assert "retain_graph=True on backward #1" in fix and "also works" in fix
    assert "fake = fake.detach()" not in fix and "truncated" not in fix
    c = r.h["carrier"]
    assert (c["name"], c["line"], c["module"], c["role"]) == \
        ("fake", line("gan_no_detach", "fake = G(z)"), "G", "input")
    assert c["fed_to"]["module"] == "D"
    assert r.h["between"]["discards_grad"] is True
    assert r.h["between"]["changes_saved"] is False


def test_gan_loop_fix_detaches_samples_in_loss_d(tmp_path_factory):
    r = run("gan_loop", "default", tmp_path_factory)
    assert f"`disc(samples.detach())` at prog.py:{line('gan_loop', 'loss_d = ')}" \
        in r.h["fix"]


def _gan(src: str, tmp_path: Path, d: str = "D", g: str = "G") -> dict[str, Any]:
    out = plain(src, tmp_path)
    return {"G": params(out[g]), "D": params(out[d]), "gG": grads(out[g]),
            "gD": grads(out[d])}


def test_gan_fixes_applied_train_both_networks_as_meant(tmp_path):
    """Both fixes the report gives run, and agree: G is trained by g_loss, D by d_loss."""
    detach = _gan(edit("gan_no_detach", ("bce(D(fake), zeros)", "bce(D(fake.detach()), zeros)")),
                  tmp_path)
    retain = _gan(edit("gan_no_detach", ("d_loss.backward()", "d_loss.backward(retain_graph=True)")),
                  tmp_path)
    for key in ("G", "D", "gG", "gD"):
        assert same(detach[key], retain[key]), key
    assert all(g is not None and g.abs().sum() > 0 for g in detach["gG"].values())
    # The old fix, applied: the generator gets no gradient at all.
    old = plain(edit("gan_no_detach", ("g_loss = bce(D(fake), ones)",
                                       "fake = fake.detach()\ng_loss = bce(D(fake), ones)")),
                tmp_path)
    assert all(p.grad is None for p in old["G"].parameters())


def test_gan_loop_fixes_applied_agree(tmp_path):
    detach = _gan(edit("gan_loop", ("disc(samples).mean() - disc(real)",
                                    "disc(samples.detach()).mean() - disc(real)")),
                  tmp_path, "disc", "gen")
    retain = _gan(edit("gan_loop", ("loss_d.backward()", "loss_d.backward(retain_graph=True)")),
                  tmp_path, "disc", "gen")
    for key in ("G", "D", "gG", "gD"):
        assert same(detach[key], retain[key]), key


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_two_losses_without_a_step_keep_retain_graph(mode, tmp_path_factory):
    r = run("two_losses", mode, tmp_path_factory)
    fix = r.h["fix"]
    assert fix.startswith(
        f"pass retain_graph=True to backward #1 (at prog.py:{line('two_losses', 'mse.backward()')})")
    assert "detach" not in fix
    assert r.h["between"] == {"events": [], "changes_saved": False, "discards_grad": False}


def test_two_losses_same_graph_keeps_retain_graph(tmp_path_factory):
    r = run("two_losses_prebuilt", "default", tmp_path_factory)
    assert r.h["carried_by"] is None and r.h["carrier"] is None
    assert r.h["fix"].startswith(
        "pass retain_graph=True to backward #1 (at prog.py:"
        f"{line('two_losses_prebuilt', 'mse.backward()')}): nothing between the two backwards "
        "changes what the graph saved")
    assert r.h["between"] == {"events": [], "changes_saved": False, "discards_grad": False}


def test_two_losses_fix_applied_equals_one_backward_of_the_sum(tmp_path):
    retain = plain(edit("two_losses", ("mse.backward()", "mse.backward(retain_graph=True)")),
                   tmp_path)
    summed = plain(edit("two_losses", ("mse.backward()\n", ""),
                        ("l1.backward()", "(mse + l1).backward()")), tmp_path)
    # Two accumulations and one backward of the sum round differently.
    assert same(params(retain["net"]), params(summed["net"]), exact=False)


def test_two_losses_with_a_step_between_do_not_offer_retain_graph(tmp_path_factory):
    r = run("two_losses_step", "default", tmp_path_factory)
    fix = r.h["fix"]
    assert fix.startswith(f"opt.step() #1 at prog.py:{line('two_losses_step', 'opt.step()')}")
    assert "retain_graph=True would only make this backward fail" in fix
    assert "sum the losses" in fix and "re-run the forward after the step" in fix


def test_two_losses_with_a_step_between_choices_applied(tmp_path):
    """Each choice runs; retain_graph=True fails as the report says it would."""
    retain = edit("two_losses_step", ("mse.backward()", "mse.backward(retain_graph=True)"))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(retain, tmp_path)
    plain(edit("two_losses_step", ("mse.backward()\nopt.step()\n", ""),
               ("l1.backward()", "(mse + l1).backward()")), tmp_path)
    plain(edit("two_losses_step", ("opt.step()\nl1", "opt.step()\nout = net(x)\nl1")), tmp_path)


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_ppo_advantages_are_not_called_state_from_an_earlier_iteration(mode, tmp_path_factory):
    r = run("ppo_advantages", mode, tmp_path_factory)
    assert r.h["saved_forward"]["module"] == "critic"
    assert r.h["saved_forward"]["line"] == line("ppo_advantages", "advantages = ")
    assert "earlier iteration" not in r.fact("carried by")


@pytest.mark.parametrize("mode", ["default", "strict"])
def test_ppo_advantages_fix_detaches_where_they_are_made(mode, tmp_path_factory):
    r = run("ppo_advantages", mode, tmp_path_factory)
    made = line("ppo_advantages", "advantages = ")
    fix = r.h["fix"]
    assert fix.startswith("`advantages` is computed once at prog.py:"), fix
    assert f"`advantages = (returns - critic(obs).squeeze(-1)).detach()` at prog.py:{made}" in fix
    # (The freeing backward is "this same line, in an earlier iteration": it is.)
    assert "truncated" not in fix and "earlier iteration" not in r.fact("carried by")
    c = r.h["carrier"]
    assert (c["name"], c["line"], c["module"], c["trained"]) == \
        ("advantages", made, "critic", False)


def test_ppo_advantages_fix_applied_trains_the_actor_as_meant(tmp_path):
    made = "advantages = returns - critic(obs).squeeze(-1)"
    fixed = plain(edit("ppo_advantages",
                       (made, "advantages = (returns - critic(obs).squeeze(-1)).detach()")),
                  tmp_path)
    retain = plain(edit("ppo_advantages", ("loss.backward()", "loss.backward(retain_graph=True)")),
                   tmp_path)
    assert same(params(fixed["actor"]), params(retain["actor"]))
    assert all(p.grad is None for p in fixed["critic"].parameters())


def test_reused_targets_fix_detaches_where_they_are_made(tmp_path_factory):
    r = run("targets_reused", "default", tmp_path_factory)
    made = line("targets_reused", "soft_targets = ")
    assert f"`soft_targets = teacher(x).softmax(-1).detach()` at prog.py:{made}" in r.h["fix"]


def test_reused_targets_fix_applied_trains_the_student_as_meant(tmp_path):
    fixed = plain(edit("targets_reused", ("teacher(x).softmax(-1)",
                                          "teacher(x).softmax(-1).detach()")), tmp_path)
    retain = plain(edit("targets_reused", ("loss.backward()", "loss.backward(retain_graph=True)")),
                   tmp_path)
    assert same(params(fixed["student"]), params(retain["student"]))


def test_recurrent_state_fix_is_truncated_bptt_on_hidden(tmp_path_factory):
    r = run("rnn_state", "default", tmp_path_factory)
    assert r.h["carried_by"] == "hidden"
    assert r.h["fix"].startswith("detach `hidden` carried from one iteration to the next")
    assert "`hidden = hidden.detach()`" in r.h["fix"]


def test_recurrent_state_fix_applied_runs_and_retain_graph_fails(tmp_path):
    state = "    hidden = cell(torch.randn(2, 4), hidden)"
    fixed = plain(edit("rnn_state", (state, "    hidden = hidden.detach()\n" + state)), tmp_path)
    other = plain(edit("rnn_state", ("hidden)\n", "hidden.detach())\n")), tmp_path)
    assert same(params(fixed["cell"]), params(other["cell"]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(edit("rnn_state", ("loss.backward()", "loss.backward(retain_graph=True)")),
              tmp_path)


# -- 2. --replay matches by identity -----------------------------------------------------------

INPLACE = ["prenorm", "prenorm_scores", "checkpoint_inplace", "dropout_inplace",
           "relu_after_sigmoid", "leaky_in_module", "saved_nonleaf", "saved_nonleaf_alive"]


@pytest.mark.parametrize("name", INPLACE)
def test_replay_reproduces_every_deterministic_program(name, tmp_path_factory):
    r = run(name, "replay", tmp_path_factory)
    assert r.status == 1
    assert r.h["replay"] == ("the lines above come from a strict replay of the same command, "
                             "which met the same hazard at backward #1"), r.h["replay"]
    assert r.h["saved_at"] is not None and r.h["saved_at"]["file"] == "prog.py"
    assert "not reproduced" not in r.err


@pytest.mark.parametrize("name, write", [("prenorm", "x += self.ff2(self.n2(x))"),
                                         ("checkpoint_inplace", "h += checkpoint(")])
def test_replay_of_a_residual_added_in_place_names_the_write(name, write, tmp_path_factory):
    r = run(name, "replay", tmp_path_factory)
    at = line(name, write)
    assert [(m["kind"], m["description"], m["line"]) for m in r.h["modified_by"]] == \
        [("inplace_op", "+=", at)]
    assert r.fact("modified by").startswith(f"+= at prog.py:{at}: ")
    # The replay's lines, the first run's words: PyTorch's sentence and its producer.
    default = run(name, "default", tmp_path_factory)
    assert r.h["torch_message"] == default.h["torch_message"]
    assert r.h["producer"] == default.h["producer"] == "Add"


def test_replay_that_really_diverged_says_where(tmp_path_factory):
    r = run("flaky", "replay", tmp_path_factory)
    assert r.h["saved_at"] is None and r.h["modified_by"] == []
    assert r.h["replay"] == (
        "not reproduced: the strict replay diverged at backward #1: this run's first hazard "
        "there is SigmoidBackward0.result (float32[3, 4], version 0 -> 1), the replay's is "
        "TanhBackward0.result (float32[3, 4], version 0 -> 1); the program is not "
        "deterministic enough to replay (seed it, fix its data order), or run it with --strict")
    assert f"versionwatch: --replay: {r.h['replay']}" in r.err


# -- 3. the culprit: writes inside a library module's forward -------------------------------

LIBRARY_WRITES = [
    # program, the write, the module and its repr, the line that built it, the call line
    ("dropout_inplace", "dropout_()", "clf.2", "Dropout(p=0.5, inplace=True)",
     "nn.Dropout(0.5, inplace=True)", "loss = nn.functional.cross_entropy(clf(x), y)"),
    ("relu_after_sigmoid", "relu_()", "net.2", "ReLU(inplace=True)", "nn.ReLU(inplace=True)",
     "loss = net("),
    ("leaky_in_module", "leaky_relu_()", "head.act", "LeakyReLU(negative_slope=0.1, inplace=True)",
     "nn.LeakyReLU(0.1, inplace=True)", "return self.out(self.act(h))"),
]


@pytest.mark.parametrize("name", ["relu_after_sigmoid", "leaky_in_module"])
@pytest.mark.parametrize("mode", ["strict", "replay"])
def test_strict_sees_the_write_inside_a_library_module(name, mode, tmp_path_factory):
    r = run(name, mode, tmp_path_factory)
    assert [m["kind"] for m in r.h["modified_by"]] == ["inplace_op"]


@pytest.mark.parametrize("mode", ["strict", "replay"])
def test_strict_sees_dropouts_inplace_write(mode, tmp_path_factory):
    r = run("dropout_inplace", mode, tmp_path_factory)
    assert [m["description"] for m in r.h["modified_by"]] == ["dropout_()"]


@pytest.mark.parametrize("case", LIBRARY_WRITES, ids=[c[0] for c in LIBRARY_WRITES])
@pytest.mark.parametrize("mode", ["strict", "replay"])
def test_write_in_a_library_module_names_the_module_and_how_it_was_built(
        case, mode, tmp_path_factory):
    name, op, module, text, built, call = case
    r = run(name, mode, tmp_path_factory)
    b, c = line(name, built), line(name, call)
    assert r.fact("modified by") == f"{op} in {module} ({text}), called at prog.py:{c}"
    writer = r.h["modified_by"][0]["writer"]
    assert writer == {"module": module, "class": text.split("(")[0], "repr": text,
                      "file": "prog.py", "line": b}
    assert r.h["fix"].startswith(f"`inplace=False` on {module} ({text}), built at prog.py:{b}")
    assert "activations such as nn.ReLU" not in r.h["fix"]


def forward_only(name: str, folder: Path) -> torch.Tensor:
    """The loss of program ``name``'s forward, run plainly up to its failing backward."""
    src = source(name)
    assert src.count("\nloss.backward()") == 1
    return plain(src.replace("\nloss.backward()", "\npass"), folder, "forward_only.py")["loss"]


def trained(ns: dict[str, Any]) -> list[torch.Tensor]:
    """The leaves of the program's globals that require grad: its modules' and its own."""
    found = [p for v in ns.values() if isinstance(v, torch.nn.Module) for p in v.parameters()]
    found += [v for v in ns.values() if isinstance(v, torch.Tensor) and v.is_leaf
              and v.requires_grad]
    return found


@pytest.mark.parametrize("case", LIBRARY_WRITES, ids=[c[0] for c in LIBRARY_WRITES])
def test_inplace_false_fix_applied_keeps_the_forward_and_trains(case, tmp_path):
    name, _, _, _, built, _ = case
    plain_error(source(name), tmp_path)  # the original fails
    fixed = plain(edit(name, (built, built.replace(", inplace=True", "")
                              .replace("inplace=True", ""))), tmp_path)
    # The same forward (the same values, in the same order of random draws) ...
    assert torch.equal(fixed["loss"], forward_only(name, tmp_path))
    # ... and every parameter is trained.
    assert trained(fixed) and all(p.grad is not None for p in trained(fixed))


# The user's own write lines: the out-of-place form of that very line.
REWRITES = [
    # program, (old line, new line) for each fix the report gives
    ("prenorm", [("x += self.ff2(self.n2(x))", "x = x + self.ff2(self.n2(x))"),
                 ("x += self.ff(self.n1(x))", "x = x + self.ff(self.n1(x))")], None),
    ("checkpoint_inplace", [("h += checkpoint(inner, h, use_reentrant=True)",
                             "h = h + checkpoint(inner, h, use_reentrant=True)")], None),
    ("saved_nonleaf", [("a.add_(1)", "a = a.add(1)")], None),
    ("saved_nonleaf_alive", [("a += 1", "a = a + 1")], None),
]


@pytest.mark.parametrize("case", REWRITES, ids=[c[0] for c in REWRITES])
@pytest.mark.parametrize("mode", ["strict", "replay"])
def test_fix_rewrites_the_users_own_write_line(case, mode, tmp_path_factory):
    name, rewrites, _ = case
    r = run(name, mode, tmp_path_factory)
    fixes = r.fact("fix")
    for old, new in rewrites:
        assert f"`{new}` instead of `{old}` at prog.py:{line(name, old)}" in fixes, fixes


def test_index_assignment_fix_clones_just_before_the_write(tmp_path_factory):
    r = run("prenorm_scores", "strict", tmp_path_factory)
    assert r.h["fix"].startswith(
        "`scores = scores.clone()` just before `scores[mask] = 0.0` at prog.py:"
        f"{line('prenorm_scores', 'scores[mask] = 0.0')}: `scores` is changed in place")


@pytest.mark.parametrize("case", REWRITES, ids=[c[0] for c in REWRITES])
def test_rewrite_fix_applied_keeps_the_forward_and_the_gradients(case, tmp_path):
    name, rewrites, _ = case
    fixed = plain(edit(name, *rewrites), tmp_path)
    assert torch.equal(fixed["loss"], forward_only(name, tmp_path))
    assert trained(fixed) and all(p.grad is not None for p in trained(fixed))


def test_index_assignment_fix_applied(tmp_path):
    write = "        scores[mask] = 0.0"
    fixed = plain(edit("prenorm_scores", (write, "        scores = scores.clone()\n" + write)),
                  tmp_path)
    assert torch.equal(fixed["loss"], forward_only("prenorm_scores", tmp_path))
    assert all(p.grad is not None for p in trained(fixed))


# -- 4. PyTorch's sentence, verbatim, in every mode ---------------------------------------

VERBATIM = [(name, mode) for name in INPLACE for mode in MODES]


@pytest.mark.parametrize("name, mode", VERBATIM)
def test_pytorch_sentence_is_verbatim(name, mode, tmp_path_factory, tmp_path):
    r = run(name, mode, tmp_path_factory)
    said = plain_error(source(name), tmp_path)
    assert r.h["torch_message"] == said
    assert r.fact("pytorch") == said


# -- 5. the saving forward as a structured location -------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_saving_forward_is_a_structured_location(mode, tmp_path_factory):
    r = run("prenorm", mode, tmp_path_factory)
    call = line("prenorm", "out = block(emb(tokens))")
    assert r.h["saved_forward"] == {"forward": "block.forward #1", "file": "prog.py",
                                    "line": call, "module": "block"}
    assert r.h["saved_during"] == f"block.forward #1 at prog.py:{call}"
    # The text, as it was.
    assert "block.forward #1 " in r.fact("saved by") and f"prog.py:{call}" in r.fact("saved by")


def test_no_saving_forward_is_null(tmp_path_factory):
    r = run("saved_nonleaf", "default", tmp_path_factory)
    assert r.h["saved_during"] is None and r.h["saved_forward"] is None


# -- 6. names a user knows -------------------------------------------------------------

NAMED = [
    # program, mode, variable, the tensor fact line
    ("prenorm", "strict", "x", "`x` (the output of Add), float32[2, 5, 8]"),
    ("prenorm", "replay", "x", "`x` (the output of Add), float32[2, 5, 8]"),
    ("prenorm_scores", "strict", "scores",
     "`scores` (the output of Softmax, saved by its own backward), float32[2, 5, 5]"),
    ("saved_nonleaf_alive", "strict", "a", "`a` (the output of Add), float32[3, 4]"),
    ("leaky_in_module", "strict", "h",
     "`h` (the output of Tanh, saved by its own backward), float32[3, 8]"),
    ("checkpoint_inplace", "replay", "h", "`h` (the output of Add), float32[4, 8]"),
]


@pytest.mark.parametrize("name, mode, variable, tensor", NAMED)
def test_activation_is_named_by_the_users_variable(name, mode, variable, tensor,
                                                   tmp_path_factory):
    r = run(name, mode, tmp_path_factory)
    assert r.h["variable"] == variable
    assert r.fact("tensor") == tensor
    if mode != "replay":  # --replay prints the report once, then the lines it filled in
        assert r.text.splitlines()[0].startswith(
            f"versionwatch: backward will fail: `{variable}` ")


@pytest.mark.parametrize("name", ["relu_after_sigmoid", "dropout_inplace"])
def test_a_module_call_line_names_no_variable(name, tmp_path_factory):
    """``loss = net(x)`` made the saved activation inside net: ``loss`` is not its name."""
    r = run(name, "strict", tmp_path_factory)
    assert r.h["variable"] is None


@pytest.mark.parametrize("name", INPLACE)
@pytest.mark.parametrize("mode", list(MODES))
def test_ops_are_written_as_the_user_writes_them(name, mode, tmp_path_factory):
    r = run(name, mode, tmp_path_factory)
    assert not NODE_WORDS.search(r.text), NODE_WORDS.search(r.text)


def test_default_mode_saved_input_fix_spells_the_ops(tmp_path_factory):
    r = run("prenorm", "default", tmp_path_factory)
    assert r.h["fix"].startswith(
        "`layer_norm` saved its input (the output of `x + y`) for backward")


# -- 7. compiled regions --------------------------------------------------------------

@pytest.fixture(scope="module")
def compiles() -> None:
    try:
        torch.compile(lambda x: x * 2, backend="aot_eager")(torch.ones(1, requires_grad=True))
    except Exception as e:  # no dynamo on this Python or torch
        pytest.skip(f"torch.compile does not run here: {e}")


@pytest.mark.usefixtures("compiles")
@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_actor_critic_says_a_compiled_region_saved_it(mode, tmp_path_factory):
    r = run("compiled_ac", mode, tmp_path_factory)
    step = line("compiled_ac", "critic_opt.step()")
    # Which stepped weight the compiled graph meets first depends on the torch release.
    stepped = {f"cnet.{n}" for n in ("trunk.0.weight", "trunk.2.weight", "critic.weight")}
    assert r.h["tensor"] in stepped and r.h["saved_by"] == "CompiledFunctionBackward"
    assert r.fact("saved by").startswith(
        "a compiled region (CompiledFunctionBackward.saved_tensors")
    assert r.fact("modified by").startswith(f"critic_opt.step() #1 at prog.py:{step}")
    # The step's own line, and both ways out; never "sum the losses" for one loss.
    assert r.h["fix"].startswith(f"critic_opt.step() #1 at prog.py:{step} changed {r.h['tensor']} "
                                 "after the forward that saved it: re-run that forward")
    assert "sum the losses" not in r.h["fix"]
    if mode == "replay":
        assert "which met the same hazard at backward" in r.h["replay"]


@pytest.mark.usefixtures("compiles")
@pytest.mark.parametrize("mode", ["default", "strict"])
def test_compiled_region_names_the_forward_it_compiled(mode, tmp_path_factory):
    r = run("compiled_ac", mode, tmp_path_factory)
    at = line("compiled_ac", "def forward(self, obs):")
    assert r.h["compiled_forward"] == {"file": "prog.py", "line": at,
                                       "code": "def forward(self, obs):"}
    assert f"in cnet (compiled from the forward at prog.py:{at}" in r.fact("saved by")


@pytest.mark.usefixtures("compiles")
@pytest.mark.parametrize("mode", ["strict", "replay"])
def test_compiled_output_written_in_place_gets_the_out_of_place_fix(mode, tmp_path_factory,
                                                                    tmp_path):
    r = run("compiled_act", mode, tmp_path_factory)
    at = line("compiled_act", "out.mul_(2)")
    assert r.fact("modified by") == f"mul_() at prog.py:{at}: out.mul_(2)"
    assert r.h["fix"].startswith(f"write `out = out.mul(2)` instead of `out.mul_(2)` at "
                                 f"prog.py:{at}")
    assert not NODE_WORDS.search(r.text)
    if mode == "strict":
        fixed = plain(edit("compiled_act", ("out.mul_(2)", "out = out.mul(2)")), tmp_path)
        assert all(p.grad is not None for p in fixed["block"].parameters())


@pytest.mark.usefixtures("compiles")
def test_compiled_actor_critic_fix_applied(tmp_path):
    fixed = plain(edit("compiled_ac",
                       ("critic_loss.backward(retain_graph=True)\ncritic_opt.step()\n"
                        "actor_loss.backward()",
                        "(critic_loss + actor_loss).backward()\ncritic_opt.step()")), tmp_path)
    eager = plain(edit("compiled_ac",
                       ('cnet = torch.compile(net, backend="aot_eager")', "cnet = net"),
                       ("critic_loss.backward(retain_graph=True)\ncritic_opt.step()\n"
                        "actor_loss.backward()",
                        "(critic_loss + actor_loss).backward()\ncritic_opt.step()")), tmp_path)
    for (n, a), b in zip(fixed["net"].named_parameters(), eager["net"].parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


# -- the fix follows the facts (what the watcher will hand over) -------------------------

def _freed(**facts: Any) -> Any:
    from versionwatch._report.model import Hazard, Modification, Site

    return Hazard(kind="freed", node="AddmmBackward0", slot="mat1",
                  freed_by=Modification("backward", "backward #1", Site("prog.py", 16)),
                  **facts)


def test_fix_from_facts_gan_detaches_in_the_first_loss_and_says_why_retain_works():
    from versionwatch._report.advice import fix_for
    from versionwatch._report.model import Between, Carrier, Forward, Modification, Site

    h = _freed(carried_by="fake", carrier=Carrier(
        "fake", Site("prog.py", 14, "fake = G(z)"), "G", "input",
        Forward("D.forward #4", Site("prog.py", 17), "D"), Site("prog.py", 15), True),
        between=Between((Modification("optimizer.step", "Adam[1].step() #1", Site("prog.py", 16)),
                         Modification("zero_grad", "Adam.zero_grad()", Site("prog.py", 18))),
                        changes_saved=False, discards_grad=True))
    fix = fix_for(h)
    assert fix.startswith("detach `fake` in the loss of backward #1 (at prog.py:16): "
                          "`D(fake.detach())` at prog.py:15, so that that loss trains D only")
    assert "retain_graph=True on backward #1 (at prog.py:16) also works here" in fix
    assert "truncated" not in fix
    # A step that changed G's saved weights: retain_graph=True is then no fix.
    h.between = Between(h.between.events, changes_saved=True, discards_grad=True)
    assert "retain_graph=True on backward #1 (at prog.py:16) would fail instead" in fix_for(h)


def test_fix_from_facts_data_is_detached_where_it_is_made():
    from versionwatch._report.advice import fix_for
    from versionwatch._report.model import Carrier, Site

    made = Site("prog.py", 11, "advantages = returns - critic(obs).squeeze(-1)")
    fix = fix_for(_freed(carried_by="advantages",
                         carrier=Carrier("advantages", made, "critic", "data", trained=False)))
    assert fix.startswith("`advantages` is computed once at prog.py:11 and reused as data")
    assert "no optimizer steps critic's parameters" in fix
    assert "`advantages = (returns - critic(obs).squeeze(-1)).detach()` at prog.py:11" in fix
    call = Site("prog.py", 10, "soft_targets = teacher(x).softmax(-1)")
    fix = fix_for(_freed(carried_by="soft_targets",
                         carrier=Carrier("soft_targets", call, "teacher", "data", trained=False)))
    assert "`soft_targets = teacher(x).softmax(-1).detach()` at prog.py:10" in fix


def test_fix_from_facts_two_losses():
    from versionwatch._report.advice import fix_for
    from versionwatch._report.model import Between, Carrier, Modification, Site

    out = Carrier("out", Site("prog.py", 9, "out = net(x)"), "net", "data", trained=True)
    fix = fix_for(_freed(carried_by="out", carrier=out,
                         between=Between((), changes_saved=False, discards_grad=False)))
    assert fix.startswith("pass retain_graph=True to backward #1 (at prog.py:16): both losses")
    step = Modification("optimizer.step", "SGD.step() #1", Site("prog.py", 12), (1, 2))
    fix = fix_for(_freed(carried_by="out", carrier=out,
                         between=Between((step,), changes_saved=True, discards_grad=False)))
    assert fix.startswith("SGD.step() #1 at prog.py:12 (version 1 -> 2) between the two "
                          "backwards changes what the graph behind `out` saved, so "
                          "retain_graph=True would only make this backward fail")
    # The same graph run twice, with nothing between: retain_graph=True, sure.
    fix = fix_for(_freed(between=Between((), changes_saved=False)))
    assert fix.startswith("pass retain_graph=True to backward #1 (at prog.py:16): nothing")


def test_fix_from_facts_state_is_truncated_bptt_and_unknown_is_a_choice():
    from versionwatch._report.advice import fix_for
    from versionwatch._report.model import Carrier

    fix = fix_for(_freed(carried_by="h", carrier=Carrier("h", role="state")))
    assert fix.startswith("detach `h` carried from one iteration to the next once its "
                          "backward has run: `h = h.detach()`")
    # Nothing known but the variable: each fix, with what it does, none of them sure.
    fix = fix_for(_freed(carried_by="h"))
    assert fix.startswith("`h` carries the graph that backward #1 (at prog.py:16) freed into "
                          "this backward; the fix depends on what it is:")
    for choice in ("`h = h.detach()`", "`.detach()` it where it is made",
                   "`D(fake.detach())`", "retain_graph=True on backward #1"):
        assert choice in fix


def test_fix_from_facts_module_write_sets_inplace_false_where_it_was_built():
    from versionwatch._report.advice import fix_for
    from versionwatch._report.model import Hazard, Modification, Report, Site, Writer
    from versionwatch._report.text import render_report

    built = Site("prog.py", 6, "clf = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), ...)")
    write = Modification("inplace_op", "dropout_()", Site("prog.py", 9, "loss = f(clf(x), y)"),
                         writer=Writer("clf.2", "Dropout(p=0.5, inplace=True)", built))
    h = Hazard(kind="inplace", node="ReluBackward0", slot="result", saved_version=0,
               current_version=1, producer="Relu", saved_output=True, modified_by=[write],
               shape=(4, 16), dtype="float32")
    h.fix = fix_for(h)
    assert h.fix == ("`inplace=False` on clf.2 (Dropout(p=0.5, inplace=True)), built at "
                     "prog.py:6 (`clf = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), ...)`): its "
                     "forward overwrites the output of `relu` in place, and backward needs it "
                     "as it was")
    text = render_report(Report(hazards=[h]))
    assert "  modified by  dropout_() in clf.2 (Dropout(p=0.5, inplace=True)), called at " \
           "prog.py:9\n" in text
    d = h.to_dict()["modified_by"][0]
    assert d["writer"] == {"module": "clf.2", "class": None,
                           "repr": "Dropout(p=0.5, inplace=True)", "file": "prog.py", "line": 6}
    assert h.to_dict()["variable"] is None  # the call line names no variable


def test_json_of_the_new_facts_round_trips():
    from versionwatch._report.model import (
        Between,
        Carrier,
        Forward,
        ForwardRef,
        Modification,
        Report,
        Site,
    )

    h = _freed(carried_by="fake", saved_during="G.forward #1 at prog.py:14",
               saved_in=ForwardRef("G.forward #1", Site("prog.py", 14), None),
               carrier=Carrier("fake", Site("prog.py", 14, "fake = G(z)"), "G", "input",
                               Forward("D.forward #4", Site("prog.py", 17), "D"),
                               Site("prog.py", 15, "d = D(fake)"), True),
               between=Between((Modification("zero_grad", "Adam.zero_grad()",
                                             Site("prog.py", 18)),), False, True))
    d = Report(hazards=[h]).to_dict()["hazards"][0]
    assert json.loads(json.dumps(d)) == d
    assert d["saved_forward"] == {"forward": "G.forward #1", "file": "prog.py", "line": 14,
                                  "module": "G"}
    assert d["carrier"] == {
        "name": "fake", "file": "prog.py", "line": 14, "code": "fake = G(z)", "module": "G",
        "role": "input", "fed_to": {"forward": "D.forward #4", "file": "prog.py", "line": 17,
                                    "module": "D"},
        "entered": {"file": "prog.py", "line": 15, "code": "d = D(fake)"}, "trained": True}
    assert d["between"] == {"events": [{"kind": "zero_grad", "description": "Adam.zero_grad()",
                                        "file": "prog.py", "line": 18}],
                            "changes_saved": False, "discards_grad": True}
    assert d["compiled_forward"] is None


# -- replay matching, by identity -------------------------------------------------------

def _replayed(child: dict[str, Any], **mine: Any) -> Any:
    from versionwatch._cli.replay import merge
    from versionwatch._report.model import Hazard, Report

    facts = dict(kind="inplace", node="NativeLayerNormBackward0", slot="input", saved_version=1,
                 current_version=2, shape=(2, 5, 8), dtype="float32", producer="Add")
    facts.update(mine)
    report = Report(hazards=[Hazard(**facts)], backward=1)
    merge(report, {"hazards": [child]}, "")
    return report


CHILD = {"kind": "inplace", "saved_by": "NativeLayerNormBackward0", "slot": "input",
         "saved_version": 1, "current_version": 2, "shape": [2, 5, 8], "dtype": "float32",
         "tensor": "a tensor, float32[2, 5, 8]", "backward": 1, "order": 0,
         "saved_at": {"file": "prog.py", "line": 16, "code": "x += self.ff2(self.n2(x))"},
         "modified_by": [{"kind": "inplace_op", "description": "+=", "file": "prog.py",
                          "line": 16}]}


def test_replay_matches_whatever_each_mode_calls_the_tensor(tmp_path, monkeypatch):
    # The write's code is read from the program, as the JSON has only its line.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("\n" * 15 + "        x += self.ff2(self.n2(x))\n")
    report = _replayed(CHILD)
    assert report.replay.endswith("which met the same hazard at backward #1")
    h = report.hazards[0]
    assert h.saved_at.line == 16 and h.user_variable() == "x"
    assert h.fix.startswith("write `x = x + self.ff2(self.n2(x))` instead of")


@pytest.mark.parametrize("field, value", [("saved_version", 0), ("current_version", 3),
                                          ("shape", [2, 5, 9]), ("dtype", "float16"),
                                          ("slot", "weight"), ("backward", 2)])
def test_replay_with_another_identity_diverged(field, value):
    report = _replayed({**CHILD, field: value})
    assert report.replay.startswith("not reproduced: the strict replay diverged at backward #1: "
                                    "this run's first hazard there is "
                                    "NativeLayerNormBackward0.input (float32[2, 5, 8], "
                                    "version 1 -> 2), the replay's is ")
    assert report.hazards[0].saved_at is None


def test_replay_fact_unknown_on_one_side_is_no_difference():
    report = _replayed({**CHILD, "shape": None, "dtype": None})
    assert report.replay.endswith("which met the same hazard at backward #1")


def test_replay_slot_without_an_index_is_the_same_slot():
    """Old torch reads a compiled or custom Function's saved tensors as a whole in default
    mode (``saved_tensors``); strict mode's record knows the index (``saved_tensors[0]``)."""
    child = {**CHILD, "saved_by": "CompiledFunctionBackward", "slot": "saved_tensors[0]"}
    report = _replayed(child, node="CompiledFunctionBackward", slot="saved_tensors")
    assert report.replay.endswith("which met the same hazard at backward #1")
    report = _replayed(child, node="CompiledFunctionBackward", slot="saved_tensors[1]")
    assert report.replay.startswith("not reproduced: the strict replay diverged")
