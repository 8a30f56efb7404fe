"""``versionwatch fix`` end to end: each family's program, checked, applied, and run plainly.

Every program in tests/fix_programs fails plainly. For each one the facts are
written by hand (as the watcher will give them), the engine proposes and checks
its candidates, and the test then applies the first verified patch to a copy and
runs that copy with plain Python (tests/fix_plain.py, no versionwatch): it must
end without error, and for a patch that keeps the values, the gradients after
the first backward must be bitwise those of the original program (under
``allow_mutation_on_saved_tensors()`` for an in-place write: the gradients it
meant). Patches that only hide the failure are rejected, with why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from versionwatch._fix import apply_patch, fix
from versionwatch._fix_check import ForkServer
from versionwatch._fix_facts import FixFacts, Line

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "fix_programs"
SRC = HERE.parent / "src"


def line_of(path: Path, text: str, nth: int = 1) -> Line:
    """The ``nth`` line of ``path`` that holds ``text``, below the docstring."""
    lines = path.read_text(encoding="utf-8").splitlines()
    code = next(i for i, ln in enumerate(lines) if ln.startswith(("import ", "from ")))
    hits = [i for i, ln in enumerate(lines, 1) if text in ln and i > code]
    return Line(str(path), hits[nth - 1])


@dataclass
class Case:
    program: str
    facts: Callable[[Path], FixFacts]
    expect: str  # the family of the first verified patch
    keeps_values: bool = False
    rejected: dict[str, str] = field(default_factory=dict)  # family -> words of its why
    said: str = ""  # words of the chosen patch's summary


def _inplace(write: str, node: str, op: str | None = None) -> Callable[[Path], FixFacts]:
    return lambda p: FixFacts("inplace", node=node, write=line_of(p, write), write_op=op,
                              failing_backward=line_of(p, ".backward()"))


CASES = [
    Case("oop_mul.py", _inplace("y.mul_(2)", "SigmoidBackward0", "mul_"), "out_of_place",
         keeps_values=True, said="`y = y.mul(...)`"),
    Case("oop_iadd.py", _inplace("h += skip", "TanhBackward0", "add_"), "out_of_place",
         keeps_values=True, said="`h = h + ...`"),
    Case("oop_relu.py", _inplace("t.relu_()", "ExpBackward0", "relu_"), "out_of_place",
         keeps_values=True, said="`t = t.relu(...)`"),
    Case("oop_setitem.py", _inplace("probs[:, 0]", "SoftmaxBackward0", "fill_"),
         "out_of_place", keeps_values=True, said="probs.clone()"),
    Case("oop_mask.py", _inplace("probs[mask]", "SoftmaxBackward0", "index_put_"),
         "out_of_place", keeps_values=True, said="index_put"),
    Case("oop_masked_fill.py", _inplace("masked_fill_", "SoftmaxBackward0", "masked_fill_"),
         "out_of_place", keeps_values=True, said="masked_fill"),
    # Two in-place relus on the line: only the second one writes what sigmoid saved.
    Case("oop_functional.py", _inplace("F.relu(h - 0.5", "SigmoidBackward0", "relu_"),
         "out_of_place", keeps_values=True, rejected={"out_of_place": "still there"}),
    Case("module_relu.py", lambda p: FixFacts(
        "inplace", node="SigmoidBackward0", module_built=line_of(p, "nn.ReLU(inplace=True)"),
        module_class="ReLU", failing_backward=line_of(p, "loss.backward()")),
        "inplace_false", keeps_values=True, said="ReLU(..., inplace=False)"),
    Case("module_dropout.py", lambda p: FixFacts(
        "inplace", node="ReluBackward0", module_built=line_of(p, "nn.Dropout(0.5, True)"),
        module_class="Dropout", failing_backward=line_of(p, "loss.backward()")),
        "inplace_false", keeps_values=True, said="Dropout(..., inplace=False)"),
    Case("seed_story.py", lambda p: FixFacts(
        "inplace", tensor="model.w3", node="MulBackward0", step=line_of(p, "optim.step()"),
        failing_backward=line_of(p, "loss2.backward()")),
        "move_step", said="one `optim.step()` after both backwards",
        rejected={"set_to_none": "only hides the failure"}),
    Case("actor_critic.py", lambda p: FixFacts(
        "inplace", tensor="net.trunk.2.weight", node="AddmmBackward0",
        step=line_of(p, "critic_opt.step()"), failing_backward=line_of(p, "actor_loss.back")),
        "move_step", said="also applies the gradients of backward #2 to net.trunk."),
    Case("gan_step.py", lambda p: FixFacts(
        "inplace", tensor="D.2.weight", node="AddmmBackward0", step=line_of(p, "opt_d.step()"),
        failing_backward=line_of(p, "g_loss.backward()"),
        saved_at=line_of(p, "d_fake = D(fake)")),
        "refresh", said="`D(fake)` again after `opt_d.step()`"),
    Case("gan.py", lambda p: FixFacts(
        "freed", node="AddmmBackward0", carried="fake",
        first_backward=line_of(p, "d_loss.backward()"),
        failing_backward=line_of(p, "g_loss.backward()"), between="step"),
        "gan_detach", said="`D(fake.detach())`",
        rejected={"detach_second": "G.0.bias, G.0.weight, G.2.bias (+1) no longer get "
                                   "gradients from backward #2"}),
    Case("rnn.py", lambda p: FixFacts(
        "freed", node="TanhBackward0", carried="h", first_backward=line_of(p, "loss.backward"),
        failing_backward=line_of(p, "loss.backward")),
        "detach_carried", said="truncated backpropagation through time",
        rejected={"retain_graph": "another hazard at backward #"}),
    Case("ppo.py", lambda p: FixFacts(
        "freed", node="AddmmBackward0", carried="adv", carried_use="data",
        first_backward=line_of(p, "loss.backward"), failing_backward=line_of(p, "loss.back")),
        "detach_made", said="`adv` is made detached"),
    Case("two_losses.py", lambda p: FixFacts(
        "freed", node="AddmmBackward0", first_backward=line_of(p, "out.pow(2)"),
        failing_backward=line_of(p, "out.abs()"), between="nothing"),
        "retain_graph", keeps_values=True),
    Case("clip.py", lambda p: FixFacts(
        "inplace", tensor="critic.2.weight", node="AddmmBackward0",
        update=(line_of(p, "p.clamp_"),), failing_backward=line_of(p, "out.backward()")),
        "move_update", said="the `with torch.no_grad():` block (line 10) moves after `opt.step()`"),
    Case("ema.py", lambda p: FixFacts(
        "inplace", tensor="model.2.weight", node="AddmmBackward0",
        update=(line_of(p, "p.copy_(q)"), line_of(p, "p.copy_(b)")),
        failing_backward=line_of(p, "loss.backward()")),
        "move_update", said="`evaluate_with_ema(model, ema)` (line 24) moves after"),
]


def plain(out: Path, *runs: tuple[str, Path]) -> dict[str, dict[str, object]]:
    """Run programs without versionwatch (tests/fix_plain.py): their errors and gradients."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [str(x) for mode, path in runs for x in (mode, path)]
    subprocess.run([sys.executable, str(HERE / "fix_plain.py"), str(out), *args], env=env,
                   cwd=out.parent, check=True, timeout=300)
    found: dict[str, dict[str, object]] = torch.load(out, weights_only=True)
    return found


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """One fork server for the module's fix() calls (each run takes the caller's cwd)."""
    s = ForkServer()
    yield s
    s.close()


def test_programs_fail_plainly(tmp_path: Path) -> None:
    programs = sorted({c.program for c in CASES})
    found = plain(tmp_path / "out.pt", *(("plain", PROGRAMS / p) for p in programs))
    for p in programs:
        error = str(found[str(PROGRAMS / p)]["error"])
        assert error.startswith("RuntimeError: "), (p, error)
        assert ("modified by an inplace operation" in error
                or "backward through the graph a second time" in error), (p, error)


@pytest.mark.parametrize("case", CASES, ids=[c.program[:-3] for c in CASES])
def test_fix_program(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     server: ForkServer) -> None:
    original = tmp_path / "original" / case.program
    patched = tmp_path / "patched" / case.program
    for p in (original, patched):
        p.parent.mkdir()
        shutil.copy(PROGRAMS / case.program, p)
    monkeypatch.chdir(patched.parent)
    result = fix([case.program], facts=case.facts(patched), check_steps=3, timeout=120,
                 jobs=2, server=server)
    assert result.status == "checked", result
    listing = [(c.family, c.verified, c.why) for c in result.candidates]
    assert result.verified, listing
    chosen = result.verified[0]
    assert chosen.family == case.expect, listing
    assert chosen.keeps_values == case.keeps_values, chosen.why
    assert case.said in chosen.summary
    assert chosen.why.startswith("checked: ")
    if case.keeps_values:
        assert "bitwise the original run's" in chosen.why
    for family, words in case.rejected.items():
        hits = [c for c in result.candidates if c.family == family and not c.verified]
        assert hits and any(words in c.why for c in hits), listing
    # The verified patch, applied and run plainly: no error, and the gradients of
    # the first backward bitwise those of the original (as it meant them).
    assert apply_patch(chosen) is None
    assert patched.read_text(encoding="utf-8") == chosen.files[str(patched)][1]
    mode = "plain" if result.facts and result.facts.kind == "freed" else "meant"
    found = plain(tmp_path / "plain.pt", ("plain", patched), (mode, original))
    assert found[str(patched)]["error"] is None, found[str(patched)]["error"]
    if case.keeps_values:
        mine, meant = found[str(patched)]["grads"], found[str(original)]["grads"]
        assert isinstance(mine, dict) and isinstance(meant, dict)
        assert mine and set(mine) == set(meant)
        for key in meant:
            assert same_bits(mine[key], meant[key]), key


# -- the command ---------------------------------------------------------------------

def vw(args: list[str], cwd: Path, tmp: Path, stdin: str | None = None,
       ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-m", "versionwatch", "fix", *args], cwd=cwd,
                          env=env, input=stdin, capture_output=True, text=True, timeout=300)


def ours(tmp: Path) -> list[str]:
    """What versionwatch left in TMPDIR (torch keeps its own caches there)."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("versionwatch")]


@pytest.fixture
def scratch_tmp(tmp_path: Path) -> Path:
    """TMPDIR for the command: every check's scratch folder goes there, and must go away."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def test_cli_seed_story_apply_and_json(tmp_path: Path, scratch_tmp: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(PROGRAMS / "seed_story.py", work / "train.py")
    before = (work / "train.py").read_text(encoding="utf-8")
    done = vw(["--jobs", "2", "--json", "fix.json", "train.py"], work, scratch_tmp)
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert out.startswith("versionwatch fix: backward #4 at train.py:35: backward will fail: "
                          "model.w3 saved by MulBackward0 was modified by an inplace operation")
    assert "3 candidate patch(es), 2 verified" in out
    first = out.index("verified: one `optim.step()` after both backwards")
    assert first < out.index("verified: one backward of `loss1 + loss2`") < out.index(
        "rejected:\n  set_to_none at train.py:29")
    assert "set_to_none=True only hides the failure" in out
    assert "diff --git a/train.py b/train.py" in out
    assert (work / "train.py").read_text(encoding="utf-8") == before  # no --apply
    assert ours(scratch_tmp) == []
    doc = json.loads((work / "fix.json").read_text(encoding="utf-8"))
    assert doc["schema"] == "versionwatch.report/1" and doc["ok"] is False
    fixes = doc["hazards"][0]["fixes"]
    assert [(f["family"], f["verified"]) for f in fixes] == [
        ("move_step", True), ("sum_losses", True), ("set_to_none", False)]
    assert set(fixes[0]) >= {"file", "line", "old", "new", "diff", "verified",
                             "keeps_values", "why"}
    assert fixes[0]["file"] == "train.py" and fixes[0]["line"] == 32
    assert doc["fix"]["facts"]["step"]["line"] == 32
    # The whole output, as git apply reads it, is the first verified patch.
    if shutil.which("git"):
        patch = work / "fix.patch"
        patch.write_text(fixes[0]["diff"], encoding="utf-8")
        subprocess.run(["git", "apply", "--check", "fix.patch"], cwd=work, check=True)
    done = vw(["--apply", "train.py"], work, scratch_tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "applied the first verified patch to train.py" in done.stdout
    assert "loss1.backward(retain_graph=True)\n    loss2 = mse(y2_pred, y2)\n" in (
        work / "train.py").read_text(encoding="utf-8")
    ran = subprocess.run([sys.executable, "train.py"], cwd=work, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ours(scratch_tmp) == []


def test_cli_no_hazard(tmp_path: Path, scratch_tmp: Path) -> None:
    (tmp_path / "ok.py").write_text(
        "import torch\nx = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n",
        encoding="utf-8")
    done = vw(["ok.py"], tmp_path, scratch_tmp)
    assert done.returncode == 0
    assert done.stderr.strip() == "versionwatch fix: no hazard (1 backward(s) ran); nothing to fix"
    assert done.stdout == ""


@pytest.mark.parametrize(("code", "status", "said"), [
    ("raise ValueError('bad data')", 1, "ValueError: bad data at prog.py:2"),
    ("import sys; sys.exit(3)", 3, "exit status 3"),
])
def test_cli_failure_not_ours(tmp_path: Path, scratch_tmp: Path, code: str, status: int,
                              said: str) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(f"import torch\n{code}\n", encoding="utf-8")
    done = vw(["--apply", "prog.py"], tmp_path, scratch_tmp)
    assert done.returncode == status
    assert said in done.stderr and "nothing changed" in done.stderr
    if status == 1:  # the program's own traceback first
        assert done.stderr.startswith("Traceback (most recent call last):\n  File ")
        assert "ValueError: bad data\n" in done.stderr
    assert prog.read_text(encoding="utf-8") == f"import torch\n{code}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.py", "tmp"]


@pytest.mark.parametrize(("args", "said"), [
    ([], "give a SCRIPT"),
    (["missing.py"], "can't open file 'missing.py'"),
    (["--check-steps", "x", "a.py"], "--check-steps takes a whole number"),
    (["--frobnicate", "a.py"], "unknown option --frobnicate"),
    (["-m"], "-m needs an argument"),
])
def test_cli_bad_invocation(tmp_path: Path, scratch_tmp: Path, args: list[str],
                            said: str) -> None:
    done = vw(args, tmp_path, scratch_tmp)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("versionwatch fix: error: ") and said in line
    assert line.endswith("(versionwatch fix --help)")


def test_cli_program_on_stdin_gets_text_only(tmp_path: Path, scratch_tmp: Path) -> None:
    code = ("import torch\nw = torch.ones(3, requires_grad=True)\n"
            "y = torch.sigmoid(w * 2)\ny.mul_(2)\ny.sum().backward()\n")
    done = vw(["-"], tmp_path, scratch_tmp, stdin=code)
    assert done.returncode == 1, done.stderr
    assert "1 candidate patch(es), not checked" in done.stdout
    assert "not checked: the program is not a file" in done.stdout
    assert "unchecked: `y = y.mul(...)`" in done.stdout
    assert "-y.mul_(2)\n+y = y.mul(2)" in done.stdout
    assert ours(scratch_tmp) == []


def test_cli_facts_by_hand(tmp_path: Path, scratch_tmp: Path) -> None:
    shutil.copy(PROGRAMS / "two_losses.py", tmp_path / "two.py")
    facts = FixFacts("freed", first_backward=line_of(tmp_path / "two.py", "out.pow(2)"),
                     failing_backward=line_of(tmp_path / "two.py", "out.abs()"))
    (tmp_path / "facts.json").write_text(json.dumps(facts.to_dict()), encoding="utf-8")
    done = vw(["--facts", "facts.json", "--check-steps", "1", "two.py"], tmp_path, scratch_tmp)
    assert done.returncode == 1
    assert "1 verified (each checked by running the patched program to 1 backward(s) past #2)" \
        in done.stdout
    assert "bitwise the original run's" in done.stdout
    bad = vw(["--facts", "two.py", "two.py"], tmp_path, scratch_tmp)
    assert bad.returncode == 2 and "--facts two.py" in bad.stderr


def test_edited_module_of_a_package_runs_from_its_scratch_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: ForkServer) -> None:
    """`-m pkg.train`: the edited module is imported from its copy, its __file__ the original."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "scale.txt").write_text("0.5\n", encoding="utf-8")
    (pkg / "model.py").write_text(
        "import os\n\nfrom torch import nn\n\n"
        "SCALE = float(open(os.path.join(os.path.dirname(__file__), 'scale.txt')).read())\n\n\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=True),\n"
        "                         nn.Linear(8, 1))\n", encoding="utf-8")
    (pkg / "train.py").write_text(
        "import torch\n\nfrom pkg.model import SCALE, build\n\n"
        "torch.manual_seed(0)\nnet = build()\n"
        "for _ in range(2):\n"
        "    (net(torch.randn(4, 4)) * SCALE).sum().backward()\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    model = pkg / "model.py"
    facts = FixFacts("inplace", node="SigmoidBackward0",
                     module_built=line_of(model, "nn.ReLU(inplace=True)"), module_class="ReLU")
    result = fix(["-m", "pkg.train"], facts=facts, server=server)
    assert result.status == "checked", (result.status, result.original)
    (chosen,) = result.candidates
    assert chosen.verified, chosen.why
    assert chosen.file == str(model) and chosen.new.strip().startswith(
        "return nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=False),")
    assert "bitwise the original run's" in chosen.why
    assert "inplace=True" in model.read_text(encoding="utf-8")  # nothing written
    assert sorted(p.name for p in pkg.iterdir() if p.name != "__pycache__") == [
        "__init__.py", "model.py", "scale.txt", "train.py"]


def test_a_check_that_runs_too_long_is_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             no_process_left: None) -> None:
    # Fixed, the program goes on forever: the check ends it at its time limit.
    (tmp_path / "slow.py").write_text(
        "import time\n\nimport torch\n\n"
        "w = torch.ones(3, requires_grad=True)\n"
        "y = torch.sigmoid(w * 2)\n"
        "y.mul_(2)\n"
        "y.sum().backward()\n"
        "while True:\n"
        "    time.sleep(0.05)\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    facts = FixFacts("inplace", node="SigmoidBackward0", write=line_of(tmp_path / "slow.py",
                                                                         "y.mul_(2)"))
    result = fix(["slow.py"], facts=facts, timeout=20)
    (cand,) = result.candidates
    assert not cand.verified
    assert cand.why == "the patched program did not reach backward #4 within 20 s"


def test_apply_writes_only_what_was_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    from versionwatch._fix_edits import Candidate

    monkeypatch.chdir(tmp_path)
    inside = tmp_path / "a.py"
    inside.write_text("y.mul_(2)\n", encoding="utf-8")
    c = Candidate("out_of_place", "", {str(inside): ("y.mul_(2)\n", "y = y.mul(2)\n")})
    inside.write_text("y.mul_(3)\n", encoding="utf-8")
    assert apply_patch(c) == "a.py changed since the run; run versionwatch fix again"
    assert inside.read_text(encoding="utf-8") == "y.mul_(3)\n"
    inside.write_text("y.mul_(2)\n", encoding="utf-8")
    assert apply_patch(c) is None
    assert inside.read_text(encoding="utf-8") == "y = y.mul(2)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py"]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    c = Candidate("out_of_place", "", {str(inside): ("y = y.mul(2)\n", "z\n")})
    assert "is not under the working directory" in str(apply_patch(c))
    assert inside.read_text(encoding="utf-8") == "y = y.mul(2)\n"
