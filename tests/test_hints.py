"""Hints that fit the place: pytest's option under pytest, the cell magic in IPython, the
command line's elsewhere; pytest's failure text, ``--replay`` (also with the Lightning
callback), the repair summary and forward events of a watched container's members.

The command line runs through the CLI's ``main`` in this process (fast); pytest's own
output through ``pytester`` in a subprocess, as a user sees it.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch._cli.command import main
from versionwatch._report import place, strict_hint

PYTEST_HINT = "`pytest --versionwatch-strict` (or @pytest.mark.versionwatch(strict=True))"
NOTEBOOK_HINT = "`%%versionwatch --strict` on the cell (or watch(..., strict=True))"
CLI_HINT = "`versionwatch run --replay ...` (or --strict, or watch(..., strict=True))"

# Two losses of one forward, a step between them: the step's write is an event,
# the op that saved the weight is not (default mode), so the report has the hint.
STEP = textwrap.dedent("""\
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        out.abs().mean().backward()
""")


def _report_notes() -> list[str]:
    """The notes of a default-mode report of STEP's hazard, made in this process."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="log") as w:
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError):
            out.abs().mean().backward()
    (report,) = w.reports
    return report.first.notes


def test_under_pytest_the_hint_names_pytests_option() -> None:
    assert place() == "pytest"
    notes = _report_notes()
    assert any(PYTEST_HINT in n for n in notes), notes
    assert not any("versionwatch run --replay" in n for n in notes)


def test_in_an_ipython_shell_the_hint_names_the_cell_magic(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert place() == "cli"
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))  # its profile, not the user's
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    hooks = sys.displayhook, sys.excepthook
    shell = TerminalInteractiveShell.instance(config=config)
    try:
        assert place() == "notebook"
        notes = _report_notes()
        assert any(NOTEBOOK_HINT in n for n in notes), notes
    finally:
        TerminalInteractiveShell.clear_instance()
        shell.cleanup()
        sys.displayhook, sys.excepthook = hooks
    assert place() == "cli"  # IPython loaded, no shell: the command line's


def test_hint_wording_per_place() -> None:
    assert strict_hint("pytest") == PYTEST_HINT
    assert strict_hint("notebook") == NOTEBOOK_HINT
    assert strict_hint("cli") == CLI_HINT


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         src: str, *options: str) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)  # as from a shell
    (tmp_path / "prog.py").write_text(src)
    status = main(["run", *options, "prog.py"])
    return status, capsys.readouterr().err


def test_replay_prints_the_report_once_and_then_its_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _run(tmp_path, monkeypatch, capsys, STEP, "--replay")
    assert status == 1
    assert err.count("backward will fail") == 1, err
    assert CLI_HINT in err  # the first run's report, as printed with the program's error
    first, replay = err.split("versionwatch: --replay: running the same command again")
    assert "versionwatch: --replay: the strict replay met the same hazard at backward #2; " \
           "its lines for the report above:" in replay
    # Only what the replay adds: the saving op's line (strict mode's), and no other fact.
    assert "saved by     AddmmBackward0.mat2 at prog.py:8: out = model(torch.randn(8, 4))" \
        in replay
    assert "now at" not in replay and "pytorch" not in replay and CLI_HINT not in replay


def test_repair_run_says_what_it_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _run(tmp_path, monkeypatch, capsys, STEP, "--on-hazard", "repair")
    assert status == 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("versionwatch: 4 backward(s) watched, 2 graph(s) repaired (")
    assert "copies" in last and last.endswith("copied), no hazard left"), last


def test_plain_run_summary_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _run(tmp_path, monkeypatch, capsys, "import torch\n"
                       "m = torch.nn.Linear(2, 1)\nm(torch.ones(1, 2)).sum().backward()\n")
    assert status == 0
    assert err.strip().splitlines()[-1] == "versionwatch: 1 backward(s) watched, no hazard"


# -- a watched container whose members are called directly ------------------------------

@pytest.mark.parametrize("kind", ["dict", "list"])
def test_members_of_a_watched_container_get_forward_events(kind: str) -> None:
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    d = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    models = nn.ModuleDict({"G": g, "D": d}) if kind == "dict" else nn.ModuleList([g, d])
    key = "D" if kind == "dict" else "1"
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    with versionwatch.watch(models, opt_d, on_hazard="log") as w:
        fake = g(torch.randn(4, 4))
        d_fake = d(fake)                                  # the saving forward
        d_fake.mean().backward(retain_graph=True)
        opt_d.step()
        with pytest.raises(RuntimeError):
            (-d_fake).mean().backward()
    (report,) = w.reports
    h = report.first
    assert h.tensor == f"models.{key}.2.weight"
    assert h.module == f"models.{key}"
    assert h.saved_during is not None and h.saved_during.startswith(f"models.{key}.forward #1")
    events = [e["event"] for e in w.timeline().to_dict()["events"]
              if not e["event"].startswith("end of")]
    assert events[:2] == [f"models.{'G' if kind == 'dict' else '0'}.forward #1",
                          f"models.{key}.forward #1"]
    from versionwatch._runtime import installed

    assert installed() == {}  # every member's route went with the watcher


def test_a_root_called_directly_keeps_its_labels() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    with versionwatch.watch(model) as w:
        model(torch.ones(1, 2)).sum().backward()
    assert next(e["event"] for e in w.timeline().to_dict()["events"]) == "forward #1"


# -- pytest's failure text ---------------------------------------------------------------

SEED_TEST = textwrap.dedent("""\
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.tensor([2.0]))
            self.w2 = nn.Parameter(torch.tensor([3.0]))
            self.w3 = nn.Parameter(torch.tensor([4.0]))

        def forward(self, a):
            s = a * self.w1
            return s * self.w2, s * self.w3


    def test_seed_story():
        model = Model()
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        mse = nn.MSELoss()
        x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
        for _ in range(3):
            y1_pred, y2_pred = model(x)
            optim.zero_grad(set_to_none=False)
            mse(y1_pred, y1).backward(retain_graph=True)
            optim.step()
            optim.zero_grad(set_to_none=False)
            mse(y2_pred, y2).backward()
            optim.step()
""")


def test_pytest_failure_is_short_and_names_the_tests_lines(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_seed=SEED_TEST)
    result = pytester.runpytest_subprocess("--versionwatch", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    failure = out.split("= FAILURES =")[1].split("short test summary info")[0]
    lines = failure.strip("\n=").splitlines()
    assert len(lines) < 25, failure
    assert "test_seed.py:28: in test_seed_story" in failure
    assert "mse(y2_pred, y2).backward()" in failure
    assert "modified by  optim.step() #3 at test_seed.py:26" in failure
    assert PYTEST_HINT in failure
    # Neither torch's Tensor.backward (its source, its docstring) nor our frames.
    assert "Computes the gradient" not in out and "torch/_tensor.py" not in out
    assert "versionwatch/_watch" not in out and "versionwatch/_predict" not in out


# -- --replay with the Lightning callback ------------------------------------------------

GAN = textwrap.dedent("""\
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from versionwatch.integrations.lightning import VersionWatch

    torch.manual_seed(0)


    class GAN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            fake = self.generator(torch.randn(real.shape[0], 4))
            d_fake = self.discriminator(fake)
            d_loss = F.softplus(d_fake).mean() + F.softplus(-self.discriminator(real)).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss, retain_graph=True)
            opt_d.step()
            g_loss = F.softplus(-d_fake).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                    torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)


    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[VersionWatch()])
    trainer.fit(GAN())
""")


def test_replay_reproduces_with_the_lightning_callback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lightning.pytorch")
    status, err = _run(tmp_path, monkeypatch, capsys, GAN, "--replay", "--json", "out.json")
    assert status == 1
    assert "not reproduced" not in err, err
    assert "the strict replay met the same hazard at backward #2" in err
    h = json.loads((tmp_path / "out.json").read_text())["hazards"][0]
    assert "same hazard at backward #2" in h["replay"]
    assert h["saved_at"]["line"] == 23  # d_fake = self.discriminator(fake)
    assert h["module"] == "model.discriminator.2"  # the callback's names, in strict mode
    assert [(m["kind"], m["line"]) for m in h["modified_by"]] == [("optimizer.step", 27)]


def test_fix_option_without_a_candidate_gives_the_reports_own_fix() -> None:
    """``--versionwatch-fix`` where no candidate patch fits: the report's fix, not nothing."""
    from versionwatch.integrations.pytest_plugin import _advice

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        loss = (model(torch.ones(1, 2)) * model.weight).sum()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(versionwatch.InplaceModificationError) as caught:
            loss.backward()
    (report,) = w.reports
    assert _advice(caught.value, None) == report.first.fix != ""
    assert _advice(RuntimeError("one of the variables ..."), None) == ""
