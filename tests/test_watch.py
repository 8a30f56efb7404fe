"""watch(): the seed story, policies, training-loop integrations, bad input, missed predictions.

Every test drives real PyTorch through a watched loop. Lines that a report must
blame carry a ``# <tag>`` comment; :func:`line_of` finds them, so the asserted
line numbers follow the file when it is edited.
"""

from __future__ import annotations

import logging
import os
import re
import runpy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import InplaceHazardWarning, InplaceModificationError, Report

ROOT = Path(__file__).resolve().parents[1]
PYTORCH_PHRASE = "one of the variables needed for gradient computation has been modified by an inplace operation"
VERSIONS = re.compile(r"is at version (\d+); expected version (\d+) instead")


def line_of(tag: str) -> int:
    """The line of this file that ends with ``# <tag>``."""
    hits = [
        i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.rstrip().endswith(f"# <{tag}>")
    ]
    assert len(hits) == 1, (tag, hits)
    return hits[0]


def here(site: versionwatch.Site | None) -> bool:
    """The site is in this test file."""
    return site is not None and os.path.samefile(site.file, __file__)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.fixture(autouse=True)
def _no_env_policy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VERSIONWATCH_ON_HAZARD", raising=False)
    yield


# --- 1. the seed story ------------------------------------------------------------

SeedModel = runpy.run_path(str(ROOT / "examples" / "seed_story.py"))["Model"]


def seed_loop(model: nn.Module, optim: torch.optim.Optimizer, set_to_none: bool,
              progress: list[str], iterations: int = 3) -> None:
    mse = nn.MSELoss()
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    for n in range(1, iterations + 1):
        y1_pred, y2_pred = model(x)  # <seed-forward>
        optim.zero_grad(set_to_none=set_to_none)
        loss1 = mse(y1_pred, y1)
        loss1.backward(retain_graph=True)
        progress.append(f"{n}.1")
        optim.step()  # <seed-step1>
        optim.zero_grad(set_to_none=set_to_none)
        loss2 = mse(y2_pred, y2)
        loss2.backward()  # <seed-backward2>
        progress.append(f"{n}.2")
        optim.step()


def run_seed(set_to_none: bool) -> tuple[versionwatch.Watcher, list[str], BaseException | None]:
    model = SeedModel()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    progress: list[str] = []
    err = None
    with versionwatch.watch(model, optim) as w:
        try:
            seed_loop(model, optim, set_to_none, progress)
        except RuntimeError as e:
            err = e
    return w, progress, err


def test_seed_story_raises_at_iteration_2_second_backward_and_explains():
    w, progress, err = run_seed(set_to_none=False)
    assert progress == ["1.1", "1.2", "2.1"]
    assert isinstance(err, InplaceModificationError)
    msg = str(err)
    assert "model.w3" in msg and "MulBackward0" in msg
    assert "at version 1, during forward #2" in msg
    assert "now at       version 2" in msg
    assert "optim.step() #3" in msg and "(version 1 -> 2)" in msg
    assert "zero_grad(set_to_none=False)" in msg
    # The fix line is the patch `versionwatch fix` would check first, marked untested.
    assert "fix          (untested; `versionwatch fix -m pytest tests/test_watch.py::" in msg
    assert (f"checks it) at tests/test_watch.py:{line_of('seed-step1')}, one `optim.step()` "
            "after both backwards") in msg, msg

    h = err.report.hazards[0]
    assert (h.tensor, h.node, h.slot) == ("model.w3", "MulBackward0", "other")
    assert (h.saved_version, h.current_version) == (1, 2)
    assert h.saved_during is not None and h.saved_during.startswith("forward #2 at ")
    assert h.saved_during.endswith(f":{line_of('seed-forward')}")
    assert len(h.modified_by) == 1
    m = h.modified_by[0]
    assert m.description == "optim.step() #3"
    assert m.kind == "optimizer.step" and m.versions == (1, 2)
    assert here(m.site) and m.site is not None and m.site.line == line_of("seed-step1")
    assert m.site.code == "optim.step()  # <seed-step1>"
    assert any("zero_grad(set_to_none=False)" in note for note in h.notes)
    site = err.report.backward_site
    assert here(site) and site is not None and site.line == line_of("seed-backward2")
    assert list(w.reports) == [err.report]


def test_seed_story_prediction_matches_pytorch():
    """The predicted failure is the one PyTorch raises when nothing is watched."""
    model = SeedModel()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    progress: list[str] = []
    with pytest.raises(RuntimeError, match=PYTORCH_PHRASE) as info:
        seed_loop(model, optim, False, progress)
    assert not isinstance(info.value, InplaceModificationError)
    assert progress == ["1.1", "1.2", "2.1"]
    m = VERSIONS.search(str(info.value))
    assert m is not None and (m.group(1), m.group(2)) == ("2", "1")


def test_seed_story_timeline_shows_backward_never_bumps_a_version():
    w, _, err = run_seed(set_to_none=False)
    assert isinstance(err, InplaceModificationError)
    text = str(w.timeline("model.w1", "model.w2", "model.w3"))
    lines = text.splitlines()
    assert lines[0].split() == ["event", "at", "model.w1", "model.w2", "model.w3"]
    assert lines[-1].startswith("(+ version changed at this event")
    rows = lines[1:-1]
    backward_rows = [r for r in rows if r.startswith("backward #")]
    step_rows = [r for r in rows if r.startswith("optim.step() #")]
    assert len(backward_rows) == 4 and len(step_rows) == 3
    for row in backward_rows:
        assert "+" not in row, row
        assert "test_watch.py:" in row
    for row in step_rows:
        assert "+" in row, row
    assert not any(r.startswith("end of ") for r in rows)  # quiet end rows are hidden
    forward2 = next(r for r in rows if r.startswith("forward #2"))
    assert forward2.split()[-1] == "1*"
    step3 = next(r for r in rows if r.startswith("optim.step() #3"))
    assert step3.split()[-3:] == ["3+", "3+", "2+"]
    # Step #2 is where zero_grad's zero .grad first let SGD move w3.
    step2 = next(r for r in rows if r.startswith("optim.step() #2"))
    assert step2.split()[-1] == "1+"


def test_seed_story_timeline_to_dict():
    w, _, err = run_seed(set_to_none=False)
    assert isinstance(err, InplaceModificationError)
    d = w.timeline("model.w1", "model.w2", "model.w3").to_dict()
    assert set(d) == {"columns", "events", "saved"}
    assert d["columns"] == ["model.w1", "model.w2", "model.w3"]
    for ev in d["events"]:
        assert set(ev) == {"event", "kind", "file", "line", "versions"}
        assert list(ev["versions"]) == d["columns"]
        assert ev["kind"] in {"forward", "forward_end", "backward", "backward_end", "step",
                              "zero_grad"}
        assert os.path.samefile(ev["file"], __file__) and isinstance(ev["line"], int)
    zg = "optim.zero_grad(set_to_none=False)"
    assert [e["event"] for e in d["events"] if not e["kind"].endswith("_end")] == [
        "forward #1", zg, "backward #1", "optim.step() #1", zg, "backward #2", "optim.step() #2",
        "forward #2", zg, "backward #3", "optim.step() #3", zg, "backward #4",
    ]
    # Each start is followed by its end, at the same line; a backward's end has the
    # versions its start had: backward bumps nothing.
    start: dict[str, Any] = {}
    for ev in d["events"]:
        if ev["kind"] in ("forward", "backward"):
            start[ev["event"]] = ev
        elif ev["kind"].endswith("_end"):
            begun = start[ev["event"].removeprefix("end of ")]
            assert (ev["file"], ev["line"]) == (begun["file"], begun["line"])
            if ev["kind"] == "backward_end":
                assert ev["versions"] == begun["versions"]
    assert sum(k.startswith("backward") for k in start) == 4
    assert sum(e["kind"] == "backward_end" for e in d["events"]) == 4
    assert sum(e["kind"] == "forward_end" for e in d["events"]) == 2
    by_label = {e["event"]: e["versions"] for e in d["events"]}
    assert by_label["forward #2"] == {"model.w1": 2, "model.w2": 2, "model.w3": 1}
    assert by_label["optim.step() #3"] == {"model.w1": 3, "model.w2": 3, "model.w3": 2}
    assert by_label["backward #4"]["model.w3"] == 2
    assert d["events"][-1]["kind"] == "backward_end"  # recorded although it raised
    assert len(d["saved"]) == 1
    saved = d["saved"][0]
    assert (saved["tensor"], saved["version"]) == ("model.w3", 1)
    assert saved["during"].startswith("forward #2 at ")
    # The report carries the same table.
    assert err.report.timeline is not None
    assert err.report.to_dict()["timeline"]["saved"] == d["saved"]


def test_seed_story_set_to_none_runs_clean():
    w, progress, err = run_seed(set_to_none=True)
    assert err is None
    assert progress == ["1.1", "1.2", "2.1", "2.2", "3.1", "3.2"]
    assert len(w.reports) == 0
    kinds = [ev.kind for ev in w.ledger.events]
    assert kinds.count("backward") == 6 and kinds.count("step") == 6
    assert kinds.count("forward") == 3


# --- 5. policies ------------------------------------------------------------------

def stale_loss(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """A loss whose graph saved model.2.weight at the version before opt.step()."""
    out = model(torch.randn(8, 4))
    first, second = out.pow(2).mean(), out.abs().mean()
    first.backward(retain_graph=True)
    opt.step()
    return second


def test_warn_points_at_the_users_backward_and_pytorch_error_gets_a_note():
    torch.manual_seed(1)
    unwatched = mlp()
    loss_ref = stale_loss(unwatched, torch.optim.SGD(unwatched.parameters(), lr=0.1))
    with pytest.raises(RuntimeError) as ref:
        loss_ref.backward()
    torch.manual_seed(1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="warn") as w:
        loss = stale_loss(model, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError) as info:
                loss.backward()  # <warn-backward>
    assert w.policy == "warn"
    assert len(caught) == 1
    warning = caught[0]
    assert warning.category is InplaceHazardWarning
    assert issubclass(InplaceHazardWarning, UserWarning)
    assert os.path.samefile(warning.filename, __file__)
    assert warning.lineno == line_of("warn-backward")
    assert "model.2.weight" in str(warning.message)
    assert "opt.step() #1" in str(warning.message)
    err = info.value
    assert type(err) is RuntimeError  # PyTorch's own error, not ours
    assert str(err) == str(ref.value)  # its message untouched
    assert str(err).startswith(PYTORCH_PHRASE)
    notes = getattr(err, "__notes__", [])
    assert len(notes) == 1
    assert notes[0].startswith("versionwatch predicted this before backward ran:")
    # The report, less PyTorch's sentence, which the error itself says right above.
    report = str(w.reports[-1])
    assert report.endswith("\n  pytorch      " + str(ref.value))
    assert report[:report.rindex("\n  pytorch")] in notes[0]
    assert PYTORCH_PHRASE not in notes[0]
    assert str(ref.value) in str(warning.message)  # the warning carries it
    assert "model.2.weight" in notes[0]


def test_log_policy_uses_the_versionwatch_logger(caplog: pytest.LogCaptureFixture):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="log") as w:
        loss = stale_loss(model, opt)
        with caplog.at_level(logging.WARNING, logger="versionwatch"):
            with pytest.raises(RuntimeError, match=PYTORCH_PHRASE):
                loss.backward()
    records = [r for r in caplog.records if r.name == "versionwatch"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert records[0].getMessage() == str(w.reports[-1])
    assert "model.2.weight saved by AddmmBackward0" in records[0].getMessage()


def test_callable_policy_receives_the_report():
    got: list[Report] = []
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard=got.append):
        loss = stale_loss(model, opt)
        with pytest.raises(RuntimeError, match=PYTORCH_PHRASE):
            loss.backward()  # <callable-backward>
    assert len(got) == 1
    report = got[0]
    assert isinstance(report, Report) and not report.ok
    h = report.hazards[0]
    assert h.tensor == "model.2.weight"
    assert [m.description for m in h.modified_by] == ["opt.step() #1"]
    assert report.backward_site is not None and report.backward_site.line == line_of(
        "callable-backward")


def test_callable_policy_may_raise_its_own_error():
    class Stop(Exception):
        pass

    def policy(report: Report) -> None:
        raise Stop(report.hazards[0].tensor)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard=policy):
        loss = stale_loss(model, opt)
        before = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(Stop, match=r"^model\.2\.weight$"):
            loss.backward()
    # Backward never ran: no gradient was touched.
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


def test_env_overrides_on_hazard(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERSIONWATCH_ON_HAZARD", "warn")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="raise") as w:
        assert w.policy == "warn"
        loss = stale_loss(model, opt)
        with pytest.warns(InplaceHazardWarning, match="model.2.weight"):
            with pytest.raises(RuntimeError) as info:
                loss.backward()
    assert not isinstance(info.value, InplaceModificationError)


def test_bad_env_value_lists_the_policies(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERSIONWATCH_ON_HAZARD", "explode")
    model = mlp()
    with pytest.raises(ValueError, match="explode") as info:
        versionwatch.watch(model)
    for policy in ("raise", "warn", "log"):
        assert policy in str(info.value)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_bad_on_hazard_argument():
    with pytest.raises(ValueError, match="raise, warn, log"):
        versionwatch.watch(mlp(), on_hazard="ignore")  # type: ignore[arg-type]


# --- 4. training-loop integrations ------------------------------------------------

def test_gan_dict_names_and_two_optimizers():
    G = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2))
    D = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    opt_g = torch.optim.SGD(G.parameters(), lr=0.1)
    opt_d = torch.optim.Adam(D.parameters(), lr=0.1)
    z = torch.randn(8, 2)
    with versionwatch.watch({"G": G, "D": D}, opt_g, opt_d) as w:
        # Two clean iterations of the usual alternating loop.
        for _ in range(2):
            fake = G(z)
            opt_d.zero_grad()
            D(fake.detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-D(fake).mean()).backward()
            opt_g.step()
        assert len(w.reports) == 0
        # The classic bug: D steps, then G's loss reuses D's output from before the step.
        fake = G(z)
        d_out = D(fake)
        d_loss = d_out.mean()
        opt_d.zero_grad()
        d_loss.backward(retain_graph=True)
        opt_d.step()  # <gan-step>
        g_loss = -d_out.mean()
        opt_g.zero_grad()
        with pytest.raises(InplaceModificationError) as info:
            g_loss.backward()  # <gan-backward>
    hazards = info.value.report.hazards
    names = [h.tensor for h in hazards]
    assert "D.0.weight" in names and "D.2.weight" in names
    assert all(n is not None and n.startswith("D.") for n in names)
    h = hazards[names.index("D.0.weight")]
    assert [m.description for m in h.modified_by] == ["opt_d.step() #3"]
    assert h.modified_by[0].site is not None
    assert h.modified_by[0].site.line == line_of("gan-step")
    assert h.saved_during is not None and h.saved_during.startswith("D.forward #5 at ")
    labels = [ev.label for ev in w.ledger.events]
    assert "opt_g.step() #2" in labels and "opt_g.step() #3" not in labels
    assert "G.forward #3" in labels and "D.forward #5" in labels
    assert {"G.0.weight", "G.2.bias", "D.0.weight"} <= set(w.ledger.by_name)
    tl = w.timeline("G.0.weight", "D.0.weight")
    assert tl.columns == ["G.0.weight", "D.0.weight"]


def test_add_param_group_after_watch_starts():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        model.add_module("2", nn.Linear(8, 1))  # a head added while watched
        opt.add_param_group({"params": model[2].parameters(), "lr": 0.01})
        loss = stale_loss(model, opt)
        with pytest.raises(InplaceModificationError) as info:
            loss.backward()
    h = info.value.report.hazards[0]
    assert h.tensor == "model.2.weight"
    assert [m.description for m in h.modified_by] == ["opt.step() #1"]
    assert "model.2.weight" in w.ledger.by_name


def test_lr_scheduler_keeps_the_blame_on_the_users_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with versionwatch.watch(model, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            sched.step()
        assert len(w.reports) == 0
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()  # <sched-step>
        sched.step()
        with pytest.raises(InplaceModificationError) as info:
            out.abs().mean().backward()
    h = info.value.report.hazards[0]
    assert [m.description for m in h.modified_by] == ["opt.step() #4"]
    assert here(h.modified_by[0].site)
    assert h.modified_by[0].site is not None and h.modified_by[0].site.line == line_of("sched-step")
    assert not any("lr_scheduler" in ev.label for ev in w.ledger.events)


def test_grad_scaler_blames_the_users_lines():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    with versionwatch.watch(model, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        assert len(w.reports) == 0
        out = model(torch.randn(8, 4))
        scaler.scale(out.pow(2).mean()).backward(retain_graph=True)
        scaler.step(opt)  # <scaler-step>
        scaler.update()
        with pytest.raises(InplaceModificationError) as info:
            scaler.scale(out.abs().mean()).backward()  # <scaler-backward>
    report = info.value.report
    h = report.hazards[0]
    assert h.tensor == "model.2.weight"
    m = h.modified_by[0]
    assert m.description == "opt.step() #3"
    assert here(m.site) and m.site is not None and m.site.line == line_of("scaler-step")
    assert here(report.backward_site)
    assert report.backward_site is not None
    assert report.backward_site.line == line_of("scaler-backward")


def test_gradient_accumulation_is_no_false_alarm():
    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        w = versionwatch.watch(model, opt) if watched else None
        try:
            for _ in range(3):
                opt.zero_grad(set_to_none=False)
                for _ in range(4):
                    (model(torch.randn(8, 4)).pow(2).mean() / 4).backward()
                opt.step()
            if w is not None:
                assert len(w.reports) == 0
                kinds = [ev.kind for ev in w.ledger.events]
                assert kinds.count("backward") == 12 and kinds.count("step") == 3
        finally:
            if w is not None:
                w.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_loops(mode: str):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with versionwatch.watch(model, opt) as w:
        for _epoch in range(2):
            model.train()
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
            model.eval()
            with ctx():
                for _ in range(3):
                    out = model(torch.randn(8, 4))
                    assert not out.requires_grad
            with ctx():  # BatchNorm in train mode updates buffers in place
                model.train()
                model(torch.randn(8, 4))
        # A training step right after eval is still predicted, and clean.
        model.train()
        out = model(torch.randn(8, 4))
        out.sum().backward(retain_graph=True)
        opt.step()
        with pytest.raises(InplaceModificationError):
            out.sum().backward()
    assert len(w.reports) == 1
    # A forward that saves nothing and writes nothing (eval) is counted but
    # adds no event; the one that updates BatchNorm's running stats is one,
    # and those writes are blamed on it.
    forwards = [ev.label for ev in w.ledger.events if ev.kind == "forward"]
    assert forwards == [f"forward #{n}" for n in (1, 2, 3, 7, 8, 9, 10, 14, 15)]
    counts = w.ledger.by_name["model.1.num_batches_tracked"].history
    assert [t.modification.description for t in counts] == [
        f"during forward #{n} of model" for n in (1, 2, 3, 7, 8, 9, 10, 14, 15)]


def test_module_called_twice_in_one_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean() + model(torch.randn(8, 4)).abs().mean()
            loss.backward()
            opt.step()
        assert len(w.reports) == 0
        a = model(torch.randn(8, 4))
        b = model(torch.randn(8, 4))  # <twice-forward-b>
        opt.zero_grad()
        a.sum().backward()
        opt.step()
        with pytest.raises(InplaceModificationError) as info:
            b.sum().backward()
    h = info.value.report.hazards[0]
    assert h.tensor == "model.2.weight"
    assert h.saved_during == f"forward #8 at {h.saved_during.split(' at ')[1]}"
    assert h.saved_during.endswith(f":{line_of('twice-forward-b')}")
    assert [m.description for m in h.modified_by] == ["opt.step() #4"]


def test_parameters_shared_between_two_modules():
    enc = nn.Linear(4, 4)
    dec = nn.Linear(4, 4)
    dec.weight = enc.weight  # tied
    opt = torch.optim.SGD([*enc.parameters(), dec.bias], lr=0.1)
    with versionwatch.watch({"enc": enc, "dec": dec}, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            dec(torch.tanh(enc(torch.randn(8, 4)))).pow(2).mean().backward()
            opt.step()
        assert len(w.reports) == 0
        assert len(w.ledger.tracked) == 3  # enc.weight, enc.bias, dec.bias
        assert "dec.weight" not in w.ledger.by_name
        v0 = enc.weight._version
        h_in = torch.tanh(enc(torch.randn(8, 4)))
        out = dec(h_in)
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        assert enc.weight._version == v0 + 1  # one update, though two modules use it
        with pytest.raises(InplaceModificationError) as info:
            out.abs().mean().backward()
    names = {h.tensor for h in info.value.report.hazards}
    assert "enc.weight" in names and "dec.weight" not in names
    h = next(h for h in info.value.report.hazards if h.tensor == "enc.weight")
    assert [m.description for m in h.modified_by] == ["opt.step() #3"]
    tr = w.ledger.by_name["enc.weight"]
    assert [(t.old, t.new) for t in tr.history][-1] == (v0, v0 + 1)


def test_optimizer_found_without_being_passed():
    model = mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    with versionwatch.watch(model):
        loss = stale_loss(model, opt)
        with pytest.raises(InplaceModificationError) as info:
            loss.backward()
    assert [m.description for m in info.value.report.hazards[0].modified_by] == [
        "opt.step() #1"]


def test_autograd_grad_is_predicted():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt):
        out = model(torch.randn(8, 4))
        out.sum().backward(retain_graph=True)
        opt.step()
        with pytest.raises(InplaceModificationError) as info:
            torch.autograd.grad(out.sum(), [model[2].bias, model[0].weight])  # <grad-call>
    report = info.value.report
    assert report.hazards[0].tensor == "model.2.weight"
    assert report.backward_site is not None and report.backward_site.line == line_of("grad-call")


# --- 7. bad input -----------------------------------------------------------------

def test_watch_rejects_non_modules():
    with pytest.raises(TypeError, match="got int"):
        versionwatch.watch(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        versionwatch.watch({})
    with pytest.raises(TypeError):
        versionwatch.watch({"a": torch.ones(1)})  # type: ignore[dict-item]


def test_optimizer_of_unwatched_parameters():
    model, other = mlp(), mlp()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = torch.autograd.backward
    with pytest.raises(ValueError, match="SGD"):
        versionwatch.watch(model, opt)
    assert torch.autograd.backward is before
    assert not model._forward_hooks and not model._forward_pre_hooks
    with pytest.raises(TypeError, match="optimizers"):
        versionwatch.watch(model, "sgd")  # type: ignore[arg-type]
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_same_module_in_two_open_watchers():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        with pytest.raises(ValueError, match="already watched"):
            versionwatch.watch({"again": model})
        # The first watcher is unharmed: it still sees the forward (stored nothing on it).
        assert not model._forward_pre_hooks and not model._forward_hooks
        loss = stale_loss(model, opt)
        with pytest.raises(InplaceModificationError):
            loss.backward()
    assert len(w.reports) == 1
    assert (w.reports[0].hazards[0].saved_during or "").startswith("forward #1 at ")
    with versionwatch.watch(model):  # after closing, watching it again is fine
        pass


def test_timeline_of_unknown_name():
    model = mlp()
    with versionwatch.watch(model) as w:
        with pytest.raises(KeyError, match="nope"):
            w.timeline("nope")
        assert w.timeline("model.0.weight").columns == ["model.0.weight"]


# --- 8. PyTorch raises where nothing was predicted --------------------------------

class ScaleBack(torch.autograd.Function):
    """Identity forward; its backward bumps ``target`` in place, as a buggy op might."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.target = target
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            ctx.target.mul_(1.0)
        return g, None


def modified_during_backward(model: nn.Sequential, how: str) -> torch.Tensor:
    x = torch.randn(8, 4, requires_grad=True)
    h = model[0](x)
    weight = model[0].weight
    if how == "tensor_hook":
        def hook(g: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                weight.mul_(1.0)
            return g
        h.register_hook(hook)
    else:
        h = ScaleBack.apply(h, weight)
    return model[2](model[1](h)).sum()


@pytest.mark.parametrize("how", ["tensor_hook", "custom_function"])
def test_unpredicted_pytorch_error_is_kept_and_explained(how: str):
    torch.manual_seed(5)
    ref_model = mlp()
    with pytest.raises(RuntimeError) as ref:
        modified_during_backward(ref_model, how).backward()
    torch.manual_seed(5)
    model = mlp()
    with versionwatch.watch(model) as w:
        loss = modified_during_backward(model, how)
        assert versionwatch.check(loss).ok  # nothing to predict: the write comes later
        with pytest.raises(RuntimeError) as info:
            loss.backward()
    err = info.value
    assert type(err) is RuntimeError
    assert str(err) == str(ref.value)
    assert str(err).startswith(PYTORCH_PHRASE)
    notes = getattr(err, "__notes__", [])
    assert len(notes) == 1
    assert notes[0].startswith("versionwatch explains (PyTorch raised, unpredicted):")
    assert "model.0.weight" in notes[0]
    late = w.reports[-1]
    h = late.hazards[0]
    assert h.detected == "after_error"
    assert h.tensor == "model.0.weight"
    assert (h.saved_version, h.current_version) == (1, 2)
    assert [m.description for m in h.modified_by] == ["during backward #1"]


def test_unpredicted_error_on_an_unwatched_tensor_keeps_the_message():
    model = mlp()
    free = torch.randn(8, 4, requires_grad=True)
    with versionwatch.watch(model) as w:
        a = torch.randn(8, 4, requires_grad=True)
        y = a * free
        y.register_hook(lambda g: _bump(free))
        with pytest.raises(RuntimeError) as info:
            (model(y).sum()).backward()
    err = info.value
    assert type(err) is RuntimeError and str(err).startswith(PYTORCH_PHRASE)
    assert VERSIONS.search(str(err)) is not None
    notes = getattr(err, "__notes__", [])
    assert all("model." not in n for n in notes)  # no watched tensor is blamed
    assert all(h.tensor is None for r in w.reports for h in r.hazards)


def _bump(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.add_(0.0)


def test_saved_during_names_the_first_of_two_forwards():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt):
        a = model(torch.randn(8, 4))  # <first-of-two>
        b = model(torch.randn(8, 4))
        b.sum().backward()
        opt.step()
        with pytest.raises(InplaceModificationError) as info:
            a.sum().backward()
    saved_during = info.value.report.hazards[0].saved_during
    assert saved_during is not None and saved_during.startswith("forward #1 at ")
    assert saved_during.endswith(f":{line_of('first-of-two')}")


def test_the_same_module_twice_in_one_dict_is_refused():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="the same module is given twice, as 'a' and 'b'"):
        versionwatch.watch({"a": m, "b": m})
    assert not m._forward_pre_hooks and not m._forward_hooks


def test_between_events_json_names_both_bounding_events():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    with versionwatch.watch(model, on_hazard=lambda r: None) as w:
        loss = model(torch.ones(1, 2)).sum()
        loss.backward(retain_graph=True)
        with torch.no_grad():
            model[2].weight.mul_(0.9)  # e.g. weight decay by hand, between two events
        with pytest.raises(RuntimeError):
            loss.backward()
    (m,) = w.reports[0].to_dict()["hazards"][0]["modified_by"]
    assert m["kind"] == "between_events" and m["versions"] == [1, 2]
    assert m["after"]["event"] == "end of backward #1" and m["before"]["event"] == "backward #2"
    assert m["before"]["line"] == m["after"]["line"] + 4
    assert m["after"]["file"].endswith("test_watch.py")


def test_an_observer_of_predict_sees_every_prediction(monkeypatch):
    """The peer harness wraps the watcher's predict with its five arguments."""
    from versionwatch._watch import watcher as _watch

    real, seen = _watch.predict, []

    def observer(outputs, inputs, api, name_map, silent=None):
        report = real(outputs, inputs, api, name_map, silent)
        seen.append(report.ok)
        return report

    monkeypatch.setattr(_watch, "predict", observer)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt):
        loss = model(torch.randn(8, 4)).sum()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(InplaceModificationError):
            loss.backward()
    assert seen == [True, False]


def test_an_acting_forward_is_blamed_for_its_own_writes_only():
    """Under no_grad a forward leaves no event unless it writes; a write just before it is not its."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        with torch.no_grad():
            model.eval()
            model(torch.randn(8, 4))  # writes nothing: no event
            model.train()
            model[0].weight.mul_(0.5)  # user code, before the next forward
            model(torch.randn(8, 4))  # BatchNorm's running stats: its own writes
            with pytest.raises(RuntimeError):
                model(torch.randn(8, 5))  # raises inside: nothing written, nothing recorded
            model.eval()
            model(torch.randn(8, 4))
    forwards = [ev.label for ev in w.ledger.events if ev.kind == "forward"]
    assert forwards == ["forward #1", "forward #3"]
    weight = w.ledger.by_name["model.0.weight"].history[-1].modification
    assert weight.kind == "between_events"
    assert weight.description.startswith("in user code between opt.step() #1")
    stats = w.ledger.by_name["model.1.num_batches_tracked"].history[-1].modification
    assert stats.description == "during forward #3 of model"
    assert w.forwards["model"] == 5


def test_an_acting_forward_that_adopts_a_module_and_writes_it_is_recorded():
    """watch_all adopts a module first called inside a root's no_grad forward, which writes it."""
    helpers: list[nn.Module] = []

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if helpers:
                y = helpers[-1](y)
                helpers[-1].running_mean.add_(1)  # the root's forward writes the helper
            return y

    with versionwatch.watch_all(on_hazard="warn") as w:
        root = Root()
        with torch.no_grad():
            root(torch.randn(4, 2))
            helpers.append(nn.BatchNorm1d(2).eval())
            root(torch.randn(4, 2))
    stats = [tr for name, tr in w.ledger.by_name.items() if name.endswith("running_mean")]
    assert len(stats) == 1 and len(stats[0].history) == 1
    moved = stats[0].history[0].modification
    assert (moved.kind, moved.description) == ("module_forward", "during root.forward #2 of root")


def test_an_optimizer_given_twice_is_one_optimizer():
    """Issue #23: the same optimizer passed twice is SGD, not SGD and SGD[1]; AdamW is no Adam."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, opt) as w:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert [e.label for e in w.ledger.events if e.kind == "step"] == ["opt.step() #1"]
    first, second = mlp(), mlp()
    adamw = torch.optim.AdamW(first.parameters())
    adam = torch.optim.Adam(second.parameters())
    with versionwatch.watch({"a": first, "b": second}, adamw, adam) as w:
        for model, opt in ((first, adamw), (second, adam)):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    assert [e.label for e in w.ledger.events if e.kind == "step"] == [
        "adamw.step() #1", "adam.step() #1"]


def test_a_param_swapped_in_place_in_a_group_is_adopted() -> None:
    """The step's cache of an optimizer's params holds only while its groups hold the
    same tensors: a param put in place of another inside a group's own list (same list,
    same length) is adopted at the next step, and its writes are the step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    extra = nn.Linear(3, 3)  # an unrelated module's weight: not the model's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with versionwatch.watch(model, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        group = opt.param_groups[0]["params"]
        group[0] = model[0].weight  # same list, same length, another tensor
        assert id(model[0].weight) not in w.names
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert w.names[id(model[0].weight)] == "model.0.weight"
        history = w.ledger.tracked[id(model[0].weight)].history
        assert [t.modification.description for t in history][-1] == "opt.step() #3"
        group[0] = extra.weight  # not watched: the guard sees it, and adopts nothing
        opt.zero_grad()
        extra.weight.grad = torch.zeros_like(extra.weight)
        opt.step()
        assert id(extra.weight) not in w.names
