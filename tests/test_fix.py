"""``versionwatch fix`` end to end: every failing program, checked, applied, and run plainly.

The programs: each family's in tests/fix_programs, the explanation tests' in
tests/explain_programs (but ``flaky.py``, which takes another branch each run
by design), docs/patterns.md's error patterns made plain (tests/fix_patterns.py)
and examples/seed_story.py (whose own ``assert_backward_safe()`` finds the hazard
before the backward runs). For each one ``fix()`` runs the real thing: a strict
run finds the facts, the candidates are checked. The test then applies the first
verified patch to a copy and runs it with plain Python (tests/fix_plain.py, no
versionwatch): the failure is gone, and for a patch that keeps the values the
gradients after the first backward are bitwise those of the original program
(under ``allow_mutation_on_saved_tensors()`` for an in-place write: the gradients
it meant). Patches that only hide the failure are rejected, with why.

To keep this cheap, the runs are shared: one fork server for every ``fix()``,
and one plain process for every plain run, made once for the cases the session
selected (``_shared``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import fix_patterns
from versionwatch._candidates.facts import FixFacts, Line
from versionwatch._fix.command import FixResult, apply_patch, fix
from versionwatch._fix.command import main as fix_main
from versionwatch._fix.server import ForkServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROGRAMS = HERE / "fix_programs"
EXPLAIN = HERE / "explain_programs"
SRC = ROOT / "src"


def line_of(path: Path, text: str, nth: int = 1) -> Line:
    """The ``nth`` line of ``path`` that holds ``text``, below the docstring."""
    lines = path.read_text(encoding="utf-8").splitlines()
    code = next(i for i, ln in enumerate(lines) if ln.startswith(("import ", "from ")))
    hits = [i for i, ln in enumerate(lines, 1) if text in ln and i > code]
    return Line(str(path), hits[nth - 1])


@dataclass
class Case:
    name: str
    expect: str  # the family of the first verified patch; "": none is safe (see rejected)
    keeps_values: bool = False
    rejected: dict[str, str] = field(default_factory=dict)  # family -> words of its why
    said: str = ""  # words of the chosen patch's summary
    source: Path | None = None  # the program's file; None: a pattern of docs/patterns.md
    silent: bool = False  # PyTorch raises nothing: the gradients are silently wrong
    own: bool = False  # the program imports versionwatch itself

    @property
    def file(self) -> str:
        return self.source.name if self.source is not None else f"{Path(self.name).name}.py"

    def text(self) -> str:
        if self.source is not None:
            return self.source.read_text(encoding="utf-8")
        return fix_patterns.program(PATTERN_NAMES[self.name])


def fp(name: str, expect: str, **kw: Any) -> Case:
    return Case(f"fix_programs/{name}", expect, source=PROGRAMS / f"{name}.py", **kw)


def ep(name: str, expect: str, **kw: Any) -> Case:
    return Case(f"explain_programs/{name}", expect, source=EXPLAIN / f"{name}.py", **kw)


OOP = {"expect": "out_of_place", "keeps_values": True}
MODULE = {"expect": "inplace_false", "keeps_values": True}
GAN_HIDER = {"detach_second": "no longer get gradients from backward #2"}
CASES = [
    fp("oop_mul", **OOP, said="`y = y.mul(...)`"),
    fp("oop_iadd", **OOP, said="`h = h + ...`"),
    fp("oop_relu", **OOP, said="`t = t.relu(...)`"),
    fp("oop_setitem", **OOP, said="probs.clone()"),
    fp("oop_mask", **OOP, said="masked_fill"),
    fp("oop_masked_fill", **OOP, said="masked_fill"),
    # Two in-place relus on the line: only the second one writes what sigmoid saved.
    fp("oop_functional", **OOP, rejected={"out_of_place": "still there"}),
    fp("module_relu", **MODULE, said="ReLU(..., inplace=False)"),
    fp("module_dropout", **MODULE, said="Dropout(..., inplace=False)"),
    fp("seed_story", "move_step", said="one `optim.step()` after both backwards",
       rejected={"set_to_none": "only hides the failure"}),
    fp("actor_critic", "backward_inputs",
       said="the loss then trains only what `actor_opt.step()` applies",
       rejected={"move_step": "`critic_opt.step()` would also apply `actor_loss`'s gradient to "
                              "`net.trunk`",
                 "sum_losses": "`critic_opt.step()` would also apply `actor_loss`'s gradient to "
                               "`net.trunk`"}),
    fp("actor_critic_shared", "backward_inputs",
       rejected={"move_step": "`actor_opt.step()` would also apply `critic_loss`'s gradient to "
                              "`net.trunk`"}),
    fp("gan_one_dfake", "refresh", said="`d_fake = D(fake)` again after `opt_d.step()`", rejected={
        "move_step": "`opt_d.step()` would also apply `g_loss`'s gradient to `D`",
        "sum_losses": "`opt_d.step()` would also apply `g_loss`'s gradient to `D`",
        "backward_inputs": "the hazard is still there"}),
    fp("lstm_state", "detach_state", said="tuple(s.detach() for s in state)"),
    fp("gru_state", "detach_state"),
    fp("loss_before_loop", "move_forward"),
    fp("accumulator", "item_accumulator"),
    fp("chunks", "step_after_chunks", said="`opt.step()` once after the loop"),
    fp("gan_step", "refresh", said="`D(fake)` again after `opt_d.step()`"),
    fp("gan", "gan_detach", said="`D(fake.detach())`", rejected={
        "detach_second": "G.0.bias, G.0.weight, G.2.bias (+1) no longer get gradients from "
                         "backward #2"}),
    fp("rnn", "detach_carried", said="truncated backpropagation through time",
       rejected={"retain_graph": "another hazard at backward #"}),
    fp("ppo", "detach_made", said="is made detached"),
    fp("two_losses", "retain_graph", keeps_values=True),
    fp("clip", "move_update",
       said="the `with torch.no_grad():` block (line 10) moves after `opt.step()`"),
    fp("ema", "move_update", said="`evaluate_with_ema(model, ema)` (line 24) moves after"),
    # Two fused Adam steps, no zero_grad between: the second applies both losses'
    # gradients, the first loss's a second time; one step of their sum is not that.
    fp("fused", "", silent=True, rejected={
        "move_step": "`opt.step()` would also apply `out.abs().mean()`'s gradient to `model`"}),
    fp("data_clip", "move_update", silent=True),
    ep("checkpoint_inplace", **OOP),
    # Nothing steps after the actor's backward: the merges would give the critic's step
    # the actor's gradient (the compiled region is one node: all of `net` is reached);
    # the compiled forward again after the step leaves the critic's step as it was.
    ep("compiled_ac", "refresh", rejected={
        "move_step": "`critic_opt.step()` would also apply `actor_loss`'s gradient to `net`",
        "sum_losses": "`critic_opt.step()` would also apply `actor_loss`'s gradient to `net`"}),
    ep("compiled_act", **OOP),
    ep("dropout_inplace", **MODULE),
    ep("gan_loop", "gan_detach", rejected=GAN_HIDER),
    ep("gan_no_detach", "gan_detach", rejected=GAN_HIDER),
    ep("leaky_in_module", **MODULE),
    ep("ppo_advantages", "detach_made"),
    ep("prenorm", **OOP, said="every in-place write to `x` in `forward` (lines 15, 16)",
       rejected={"out_of_place": "the hazard is still there"}),
    ep("prenorm_scores", **OOP),
    ep("relu_after_sigmoid", **MODULE),
    ep("rnn_state", "detach_carried"),
    ep("saved_nonleaf", **OOP),
    ep("saved_nonleaf_alive", **OOP),
    ep("targets_reused", "detach_made"),
    ep("two_losses", "retain_graph", keeps_values=True),
    ep("two_losses_prebuilt", "retain_graph", keeps_values=True),
    ep("two_losses_step", "refresh", rejected={
        "move_step": "`opt.step()` would also apply `l1`'s gradient to `net`"}),
    # Both keep D's step as it was; the reorder keeps the values too, so it comes first.
    Case("patterns/gan", "reorder_backwards", rejected={
        "move_step": "`opt_d.step()` would also apply `g_loss`'s gradient to `D`"}),
    Case("patterns/actor_critic", "reorder_backwards", rejected={
        "move_step": "`critic_opt.step()` would also apply `actor_loss`'s gradient to "
                     "`net.trunk`"}),
    Case("patterns/relu_inplace", **MODULE),
    Case("patterns/iadd", **OOP),
    Case("patterns/index_assignment", **OOP, said="probs.clone()"),
    Case("patterns/ema", "move_update"),
    Case("patterns/clipping", "move_update"),
    Case("patterns/ddp_broadcast", "one_forward", said="one forward of `ddp` on both batches"),
    # D's step, then a second loss through the forward it changed, and no step after: the
    # merged step would apply both losses; no forward to re-run (its input is made inline).
    Case("patterns/spectral_norm", "", rejected={
        "move_step": "`opt_d.step()` would also apply `-d_fake.mean()`'s gradient to `D`"}),
    Case("patterns/optimizer_in_backward", "sum_backwards"),
    Case("patterns/rnn", "detach_carried"),
    Case("examples/seed_story", "move_step", source=ROOT / "examples" / "seed_story.py",
         own=True, rejected={"set_to_none": "only hides the failure"},
         said="one `optim.step()` after both backwards"),
]
PATTERN_NAMES = dict(zip([c.name for c in CASES if c.name.startswith("patterns/")],
                         fix_patterns.PATTERNS))
LEFT_OUT = {
    "explain_programs/flaky.py": "not deterministic by design: each run takes another branch "
                                 "(it tests --replay's divergence report)",
}
BY_NAME = {c.name: c for c in CASES}


def test_every_program_and_pattern_has_a_case() -> None:
    files = {f"{p.parent.name}/{p.name}" for d in (PROGRAMS, EXPLAIN) for p in d.glob("*.py")}
    have = {f"{c.name}.py" for c in CASES if c.source is not None}
    assert files - have == set(LEFT_OUT), sorted(files - have)
    assert len(PATTERN_NAMES) == len(fix_patterns.PATTERNS)
    _, found = fix_patterns.sections()
    named = {fix_patterns._SUFFIX.sub("", t) for t in fix_patterns.PATTERNS}
    assert set(found) == named | set(fix_patterns.NO_ERROR), set(found) ^ (
        named | set(fix_patterns.NO_ERROR))


def plain(out: Path, *runs: tuple[str, Path]) -> dict[str, dict[str, Any]]:
    """Run programs without versionwatch (tests/fix_plain.py): their errors and gradients."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if any(mode == "own" for mode, _ in runs):
        env["PYTHONPATH"] = str(SRC)  # for the program's own `import versionwatch`
    runs = tuple(sorted(runs, key=lambda r: r[0] == "own"))  # those last
    args = [str(x) for mode, path in runs for x in (mode, path)]
    subprocess.run([sys.executable, str(HERE / "fix_plain.py"), str(out), *args], env=env,
                   cwd=out.parent, check=True, timeout=600)
    found: dict[str, dict[str, Any]] = torch.load(out, weights_only=True)
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


@dataclass
class Shared:
    """What one case's runs found: the fix, the patched copy, and the plain runs."""

    result: FixResult
    original: Path
    patched: Path
    applied: str | None
    plain: dict[str, dict[str, Any]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def _shared(request: pytest.FixtureRequest, server: ForkServer,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Shared]:
    """fix() on every selected case, the first verified patch applied, then one plain run."""
    mine = [item for item in request.session.items
            if getattr(item, "module", None) is request.module]
    names = [item.callspec.params["case"].name for item in mine
             if getattr(item, "originalname", None) == "test_fix_program"]
    if any(item.name.startswith("test_seed_story_example") for item in mine):
        names = list(dict.fromkeys([*names, "examples/seed_story"]))
    root = tmp_path_factory.mktemp("fix")
    here = os.getcwd()
    shared: dict[str, Shared] = {}
    runs: list[tuple[str, Path]] = []
    try:
        for name in names:
            case = BY_NAME[name]
            folder = root / name.replace("/", "_")
            original, patched = folder / "original" / case.file, folder / "patched" / case.file
            for p in (original, patched):
                p.parent.mkdir(parents=True)
                p.write_text(case.text(), encoding="utf-8")
            os.chdir(patched.parent)
            result = fix([case.file], check_steps=3, timeout=120, jobs=2, server=server)
            applied = None
            if result.verified:
                applied = apply_patch(result.verified[0]) or "applied"
            shared[name] = Shared(result, original, patched, applied)
            own = "own" if case.own else "plain"
            runs += [(own, patched), (own, original)]
            if case.keeps_values and result.facts is not None and result.facts.kind == "inplace":
                meant = folder / "meant" / case.file  # the original, under allow_mutation
                meant.parent.mkdir()
                meant.write_text(case.text(), encoding="utf-8")
                runs.append(("meant", meant))
    finally:
        os.chdir(here)
    if runs:
        found = plain(root / "plain.pt", *runs)
        for s in shared.values():
            s.plain = {kind: found[str(s.original.parent.parent / kind / s.original.name)]
                       for kind in ("original", "patched", "meant")
                       if str(s.original.parent.parent / kind / s.original.name) in found}
    return shared


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fix_program(case: Case, _shared: dict[str, Shared]) -> None:
    s = _shared[case.name]
    result = s.result
    # The program fails plainly (or, silent, runs with wrong gradients).
    error = s.plain["original"]["error"]
    if case.silent:
        assert error is None, error
    elif not case.own:
        assert str(error).startswith("RuntimeError: ") and (
            "modified by an inplace operation" in str(error)
            or "backward through the graph a second time" in str(error)), error
    assert result.status == "checked", (result.status, result.original)
    listing = [(c.family, c.verified, c.why) for c in result.candidates]
    for family, words in case.rejected.items():
        hits = [c for c in result.candidates if c.family == family and not c.verified]
        assert hits and any(words in c.why for c in hits), listing
    if not case.expect:
        # No patch is safe: each candidate is rejected, with its reason.
        assert not result.verified and result.candidates, listing
        assert all(c.why for c in result.candidates), listing
        assert s.applied is None
        return
    assert result.verified, listing
    chosen = result.verified[0]
    assert chosen.family == case.expect, listing
    assert chosen.keeps_values == case.keeps_values, chosen.why
    assert case.said in chosen.summary, chosen.summary
    assert chosen.why.startswith("checked: ")
    if case.keeps_values:
        assert "bitwise the original run's" in chosen.why
    # What it checked: each step against the program as meant, or, for a freed graph,
    # against the original's steps.
    if result.original is not None and result.original.steps:
        assert "the gradients of the same losses as the program" in chosen.why, chosen.why
    # The report, as the Python API gives it: the candidates on its first hazard.
    assert result.report is not None
    fixes = result.report.hazards[0].fixes
    assert [(f.family, f.verified, f.diff) for f in fixes] == [
        (c.family, c.verified, c.diff) for c in result.candidates]
    # The verified patch, applied and run plainly: no error, and the gradients of
    # the first backward bitwise those of the original (as it meant them).
    assert s.applied == "applied", s.applied
    assert s.patched.read_text(encoding="utf-8") == chosen.files[str(s.patched)][1]
    assert s.plain["patched"]["error"] is None, s.plain["patched"]["error"]
    if case.keeps_values:
        ref = s.plain["meant" if "meant" in s.plain else "original"]
        mine, meant = s.plain["patched"]["grads"], ref["grads"]
        assert isinstance(mine, dict) and isinstance(meant, dict)
        assert mine and set(mine) == set(meant)
        for key in meant:
            assert same_bits(mine[key], meant[key]), key


def test_seed_story_example_is_fixed_at_the_backward_its_check_asked_about(
        _shared: dict[str, Shared]) -> None:
    """examples/seed_story.py catches its own assert_backward_safe()'s error: still a hazard."""
    case = BY_NAME["examples/seed_story"]
    s = _shared[case.name]
    assert s.plain["original"]["error"] is None  # the example catches it and prints it
    assert "backward will fail: w3 saved by MulBackward0" in s.plain["original"]["out"]
    assert s.result.asked_at is not None
    lines = s.original.read_text(encoding="utf-8").splitlines()  # as it was before the patch
    assert lines[s.result.asked_at.line - 1].strip() == (
        "versionwatch.assert_backward_safe(loss2, names=model)")
    assert s.result.facts is not None and s.result.facts.failing_backward is not None
    assert s.result.facts.failing_backward.code == "loss2.backward()"
    patched = s.plain["patched"]["out"]
    assert patched.count("iteration 3 ok") == 2 and "backward will fail" not in patched


# -- the command ---------------------------------------------------------------------

def vw(args: list[str], cwd: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-m", "versionwatch", "fix", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
            server: ForkServer) -> Any:
    """``versionwatch fix ARGS`` in this process (on the shared fork server), in ``tmp_path``,
    with its scratch folders in ``tmp_path/tmp``."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def run(args: list[str], stdin: str | None = None) -> Done:
        if stdin is not None:
            import io

            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = fix_main(args, server=server)
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run


def ours(tmp: Path) -> list[str]:
    """What versionwatch left in TMPDIR (torch keeps its own caches there)."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("versionwatch")]


def test_cli_seed_story_apply_and_json(tmp_path: Path) -> None:
    """The command itself, once, as a user runs it: --apply and --json."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    shutil.copy(PROGRAMS / "seed_story.py", work / "train.py")
    before = (work / "train.py").read_text(encoding="utf-8")
    done = vw(["--jobs", "2", "--json", "fix.json", "--apply", "train.py"], work, tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The terminal says where the runs happen and how many there will be.
    assert done.stderr.splitlines()[1] == (
        "versionwatch fix: 4 patch(es) to check: 5 or 6 more run(s) (the program as meant, "
        "then one per patch), each up to backward #7")
    assert (f"fresh copy of the working folder (1 file(s), 1 KB) under "
            f"{tmp}") in done.stderr.splitlines()[0]
    assert out.startswith("versionwatch fix: backward #4 at train.py:35: backward will fail: "
                          "model.w3 saved by MulBackward0 was modified by an inplace operation")
    assert "4 candidate patch(es), 3 verified" in out
    first = out.index("verified: one `optim.step()` after both backwards")
    assert first < out.index("verified: one backward of `loss1 + loss2`") < out.index(
        "rejected:\n  set_to_none at train.py:29")
    assert "set_to_none=True only hides the failure" in out
    assert "diff --git a/train.py b/train.py" in out
    assert "applied the first verified patch to train.py" in out
    assert "loss1.backward(retain_graph=True)\n    loss2 = mse(y2_pred, y2)\n" in (
        work / "train.py").read_text(encoding="utf-8")
    assert ours(tmp) == []
    doc = json.loads((work / "fix.json").read_text(encoding="utf-8"))
    assert doc["schema"] == "versionwatch.report/1" and doc["ok"] is False
    assert doc["exit_status"] == 0 and doc["fix"]["applied"] == {"file": "train.py", "line": 32}
    fixes = doc["hazards"][0]["fixes"]
    assert [(f["family"], f["verified"]) for f in fixes] == [
        ("move_step", True), ("sum_losses", True), ("refresh", True), ("set_to_none", False)]
    assert set(fixes[0]) >= {"file", "line", "old", "new", "diff", "verified",
                             "keeps_values", "why"}
    assert fixes[0]["file"] == "train.py" and fixes[0]["line"] == 32
    assert doc["fix"]["facts"]["step"]["line"] == 32
    # The diff, as git apply reads it, is the first verified patch.
    if shutil.which("git"):
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        (fresh / "train.py").write_text(before, encoding="utf-8")
        (fresh / "fix.patch").write_text(fixes[0]["diff"], encoding="utf-8")
        subprocess.run(["git", "apply", "fix.patch"], cwd=fresh, check=True)
        assert (fresh / "train.py").read_text(encoding="utf-8") == (
            work / "train.py").read_text(encoding="utf-8")


def test_cli_without_apply_writes_nothing(tmp_path: Path, command: Any) -> None:
    shutil.copy(PROGRAMS / "two_losses.py", tmp_path / "two.py")
    before = (tmp_path / "two.py").read_text(encoding="utf-8")
    done = command(["--check-steps", "1", "two.py"])
    assert done.returncode == 1, done.stderr
    assert "verified: `retain_graph=True` on `out.pow(2).mean().backward()`" in done.stdout
    assert (tmp_path / "two.py").read_text(encoding="utf-8") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp", "two.py"]
    assert ours(tmp_path / "tmp") == []


def test_cli_no_hazard(tmp_path: Path, command: Any) -> None:
    (tmp_path / "ok.py").write_text(
        "import torch\nx = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n",
        encoding="utf-8")
    done = command(["ok.py"])
    assert done.returncode == 0
    where, said = done.stderr.strip().splitlines()
    # Before the first run: where every run happens (not in the user's folder).
    assert where.startswith("versionwatch fix: every run of the program happens in a fresh "
                            "copy of the working folder (1 file(s), 76 bytes) under ")
    assert where.endswith("; nothing of yours is written but by --apply")
    assert said == "versionwatch fix: no hazard (1 backward(s) ran); nothing to fix"
    assert done.stdout == ""


@pytest.mark.parametrize(("code", "status", "said"), [
    ("raise ValueError('bad data')", 1, "ValueError: bad data at prog.py:2"),
    ("import sys; sys.exit(3)", 3, "exit status 3"),
])
def test_cli_failure_not_ours(tmp_path: Path, command: Any, code: str, status: int,
                              said: str) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(f"import torch\n{code}\n", encoding="utf-8")
    done = command(["--apply", "prog.py"])
    assert done.returncode == status
    assert said in done.stderr and "nothing changed" in done.stderr
    if status == 1:  # the program's own traceback first, after where the run happened
        assert done.stderr.split("\n", 1)[1].startswith(
            "Traceback (most recent call last):\n  File ")
        assert "ValueError: bad data\n" in done.stderr
    assert prog.read_text(encoding="utf-8") == f"import torch\n{code}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.py", "tmp"]
    assert ours(tmp_path / "tmp") == []


@pytest.mark.parametrize(("args", "said"), [
    ([], "give a SCRIPT"),
    (["missing.py"], "can't open file 'missing.py'"),
    (["--check-steps", "x", "a.py"], "--check-steps takes a whole number"),
    (["--frobnicate", "a.py"], "unknown option --frobnicate"),
    (["-m"], "-m needs an argument"),
    (["--facts", "a.py", "a.py"], "--facts a.py"),
])
def test_cli_bad_invocation(tmp_path: Path, command: Any, args: list[str], said: str) -> None:
    (tmp_path / "a.py").write_text("x = 1\n", encoding="utf-8")
    done = command(args)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("versionwatch fix: error: ") and said in line
    assert line.endswith("(versionwatch fix --help)")
    assert done.stdout == ""


def test_cli_program_on_stdin_gets_text_only(tmp_path: Path, command: Any) -> None:
    code = ("import torch\nw = torch.ones(3, requires_grad=True)\n"
            "y = torch.sigmoid(w * 2)\ny.mul_(2)\ny.sum().backward()\n")
    done = command(["-"], stdin=code)
    assert done.returncode == 1, done.stderr
    assert "1 candidate patch(es), not checked" in done.stdout
    assert "not checked: the program is not a file" in done.stdout
    assert "unchecked: `y = y.mul(...)`" in done.stdout
    assert "-y.mul_(2)\n+y = y.mul(2)" in done.stdout
    assert ours(tmp_path / "tmp") == []


def test_cli_facts_by_hand(tmp_path: Path, command: Any) -> None:
    shutil.copy(PROGRAMS / "two_losses.py", tmp_path / "two.py")
    facts = FixFacts("freed", first_backward=line_of(tmp_path / "two.py", "out.pow(2)"),
                     failing_backward=line_of(tmp_path / "two.py", "out.abs()"))
    (tmp_path / "facts.json").write_text(json.dumps(facts.to_dict()), encoding="utf-8")
    done = command(["--facts", "facts.json", "--check-steps", "1", "two.py"])
    assert done.returncode == 1
    assert "1 verified (each checked by running the patched program to 1 backward(s) past #2)" \
        in done.stdout
    assert "bitwise the original run's" in done.stdout


def test_cli_fresh_interpreters(tmp_path: Path, command: Any,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--fresh: no fork server; every run a new interpreter (one run here: no hazard)."""
    import versionwatch._fix.command as fixing

    started: list[object] = []
    monkeypatch.setattr(fixing, "ForkServer", lambda: started.append(1))
    (tmp_path / "ok.py").write_text("import torch\nprint('ran')\n", encoding="utf-8")
    done = command(["--fresh", "ok.py"])  # the fixture's server is not passed on: see main
    assert done.returncode == 0, done.stderr
    assert "no hazard (0 backward(s) ran)" in done.stderr
    assert started == []


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
    # Its own fork server: started under no_process_left's tag, its runs are seen.
    # 15 s: the fork server imports torch inside the limit (4 s on an idle 2-core machine here).
    result = fix(["slow.py"], facts=facts, timeout=15)
    (cand,) = result.candidates
    assert not cand.verified
    assert cand.why == "the patched program did not reach backward #4 within 15 s"


def test_apply_writes_only_what_was_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    from versionwatch._candidates.edits import Candidate

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
