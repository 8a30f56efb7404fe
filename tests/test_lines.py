"""Explanations point at the right lines (issue #14): the op that saved the tensor,
the write, the backward that freed a graph; in strict mode, default mode, and
default mode with ``--replay``; in the text report and in the JSON.

The programs run through the CLI's ``main`` in this process (fast); ``--replay``'s
strict re-run is a child process, as it is for users.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from versionwatch._cli.command import main

ACT = textwrap.dedent("""\
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x).sigmoid()
            s = h * 2
            h.mul_(2)
            return s.sum()

    torch.manual_seed(0)
    m = Net()
    loss = m(torch.randn(2, 4))
    loss.backward()
""")

SAM = textwrap.dedent("""\
    import torch
    from torch import nn

    class SAM(torch.optim.SGD):
        @torch.no_grad()
        def first_step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad * 0.05)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = SAM(model.parameters(), lr=0.1)
    out = model(torch.randn(8, 4))
    out.pow(2).mean().backward(retain_graph=True)
    opt.first_step()
    out.abs().mean().backward()
""")

RNN = textwrap.dedent("""\
    import torch
    from torch import nn

    rnn = nn.RNNCell(4, 4)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    h = torch.zeros(1, 4)
    for step in range(3):
        x = torch.randn(1, 4)
        h = rnn(x, h)
        loss = h.pow(2).sum()
        loss.backward()
        opt.zero_grad()
""")

# A parameter that a step changes between the forward and the second backward.
STEP = textwrap.dedent("""\
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.w3 = nn.Parameter(torch.ones(4))

        def forward(self, x):
            s = self.fc(x).tanh()
            return s * self.w3

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = m(torch.randn(2, 4))
    out.pow(2).mean().backward(retain_graph=True)
    opt.step()
    out.abs().mean().backward()
""")

# A weight clip in user code, under no_grad, between the forward and its backward.
CLIP = textwrap.dedent("""\
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.1, 0.1)
    loss.backward()
""")

TWICE = textwrap.dedent("""\
    import torch

    m = torch.nn.Linear(3, 1)
    loss = m(torch.randn(2, 3)).sigmoid().sum()
    loss.backward()
    loss.backward()
""")

# Not deterministic: the replay (the second run) finds the marker and writes nothing.
FLAKY = textwrap.dedent("""\
    import os
    import torch

    first = not os.path.exists("marker")
    open("marker", "w").close()
    model = torch.nn.Linear(3, 1)
    out = model(torch.randn(2, 3)).sigmoid()
    if first:
        out.mul_(2)
    out.sum().backward()
""")


def line(src: str, text: str, nth: int = 1) -> int:
    return [i for i, s in enumerate(src.splitlines(), 1) if text in s][nth - 1]


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        src: str, *options: str) -> tuple[int, str, dict[str, Any]]:
    """``versionwatch run OPTIONS --json out.json prog.py``: exit status, stderr, first hazard.

    Run once per program and options in this module: a second test that asks for the
    same run (SAM's default and --replay runs) reads the first one's answer, and
    finds no out.json in its own folder.
    """
    key = (src, options)
    if key not in _RUNS:
        # As from a shell: under pytest's own variable a hint names pytest's option.
        monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
        monkeypatch.chdir(tmp_path)
        (tmp_path / "prog.py").write_text(src)
        status = main(["run", *options, "--json", "out.json", "prog.py"])
        err = capsys.readouterr().err
        doc = json.loads((tmp_path / "out.json").read_text())
        _RUNS[key] = (status, err, doc["hazards"][0])
    status, err, h = _RUNS[key]
    return status, err, copy.deepcopy(h)


_RUNS: dict[tuple[str, tuple[str, ...]], tuple[int, str, dict[str, Any]]] = {}


def at(file: str, n: int, code: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"file": file, "line": n}
    if code is not None:
        d["code"] = code
    return d


def test_strict_names_the_op_line_that_saved_an_activation(tmp_path, monkeypatch, capsys):
    status, err, h = run(tmp_path, monkeypatch, capsys, ACT, "--strict")
    assert status == 1
    saved, call, write = line(ACT, ".sigmoid()"), line(ACT, "loss = m("), line(ACT, "h.mul_(2)")
    assert (f"saved by     SigmoidBackward0.result at prog.py:{saved}: h = self.fc(x).sigmoid() "
            f"(in m, during m.forward #1 called at prog.py:{call}, at version 0)") in err
    assert f"modified by  mul_() at prog.py:{write}: h.mul_(2)" in err
    assert h["saved_at"] == at("prog.py", saved, "h = self.fc(x).sigmoid()")
    assert [(m["file"], m["line"]) for m in h["modified_by"]] == [("prog.py", write)]


def test_default_mode_names_module_and_forward_and_points_at_replay(tmp_path, monkeypatch,
                                                                    capsys):
    status, err, h = run(tmp_path, monkeypatch, capsys, ACT)
    assert status == 1
    call = line(ACT, "loss = m(")
    assert f"saved by     SigmoidBackward0.result in m, at version 0, during m.forward #1 " \
           f"at prog.py:{call}" in err
    assert "`versionwatch run --replay ...`" in err and "names its line" in err
    assert (h["module"], h["saved_during"]) == ("m", f"m.forward #1 at prog.py:{call}")
    assert h["saved_at"] is None and h["modified_by"] == []
    assert any("--replay" in note for note in h["notes"])


def test_replay_fills_in_the_op_line_and_the_write(tmp_path, monkeypatch, capsys):
    status, err, h = run(tmp_path, monkeypatch, capsys, ACT, "--replay")
    assert status == 1
    saved, write = line(ACT, ".sigmoid()"), line(ACT, "h.mul_(2)")
    report = err.split("versionwatch: --replay: running the same command again")[1]
    assert f"SigmoidBackward0.result at prog.py:{saved}: h = self.fc(x).sigmoid()" in report
    assert f"modified by  mul_() at prog.py:{write}: h.mul_(2)" in report
    assert "same hazard at backward #1" in report
    assert h["saved_at"] == at("prog.py", saved, "h = self.fc(x).sigmoid()")
    assert [(m["kind"], m["file"], m["line"]) for m in h["modified_by"]] == [
        ("inplace_op", "prog.py", write)]
    assert h["backward"] == 1 and "same hazard at backward #1" in h["replay"]
    assert not any("--replay" in note for note in h["notes"])


def test_no_grad_write_in_an_optimizer_is_bounded_then_replayed(tmp_path, monkeypatch,
                                                                 capsys):
    first, perturb = line(SAM, "backward(retain_graph=True)"), line(SAM, "p.add_(")
    second = line(SAM, "out.abs().mean().backward()")
    status, err, h = run(tmp_path, monkeypatch, capsys, SAM)
    assert status == 1
    bounded = (f"in user code between end of backward #1 (prog.py:{first}) "
               f"and backward #2 (prog.py:{second})")
    assert f"modified by  {bounded} (version 1 -> 2)" in err
    (m,) = h["modified_by"]
    assert m["after"] == {"event": "end of backward #1", "file": "prog.py", "line": first}
    assert m["before"] == {"event": "backward #2", "file": "prog.py", "line": second}

    status, err, h = run(tmp_path, monkeypatch, capsys, SAM, "--replay")
    assert status == 1
    assert f"modified by  add_() at prog.py:{perturb} (version 1 -> 2): " \
           "p.add_(p.grad * 0.05)" in err
    # The user's frames of the write, outermost first: what `versionwatch fix` moves.
    call = line(SAM, "opt.first_step()")
    assert h["modified_by"] == [{"kind": "inplace_op", "description": "add_()", "file": "prog.py",
                                 "line": perturb, "versions": [1, 2],
                                 "stack": [at("prog.py", call, "opt.first_step()"),
                                           at("prog.py", perturb, "p.add_(p.grad * 0.05)")]}]
    assert h["tensor"] == "model.2.weight" and h["module"] == "model.2"


@pytest.mark.parametrize("mode", [(), ("--strict",)])
def test_recurrent_state_names_the_freeing_backward_and_h(tmp_path, monkeypatch, capsys, mode):
    status, err, h = run(tmp_path, monkeypatch, capsys, RNN, *mode)
    assert status == 1
    back, fwd = line(RNN, "loss.backward()"), line(RNN, "h = rnn(x, h)")
    assert (f"freed by     backward #1 at prog.py:{back} (this same line, in an earlier "
            "iteration), which ran without retain_graph=True") in err
    assert "carried by   `h`" in err
    # The fix line: the patch `versionwatch fix` checks first, on the user's line.
    assert f"`h = rnn(x, h.detach())` instead of `h = rnn(x, h)` at prog.py:{fwd}" in err
    assert "retain_graph=True" not in err.split("fix          ")[1].splitlines()[0]
    assert "freed: AddmmBackward0.mat1 (x2)" in err and "a tensor" not in err
    assert h["freed_by"] == {"description": "backward #1", "file": "prog.py", "line": back}
    assert h["carried_by"] == "h" and h["backward"] == 2
    assert h["saved_during"] == f"rnn.forward #1 at prog.py:{fwd}"
    if mode:  # strict recorded the saving op's line before the graph was freed
        assert h["saved_at"] == at("prog.py", fwd, "h = rnn(x, h)")
        assert f"saved by     TanhBackward0.result at prog.py:{fwd}: h = rnn(x, h)" in err
    else:
        assert h["saved_at"] is None


def test_second_backward_on_one_graph_keeps_retain_graph(tmp_path, monkeypatch, capsys):
    status, err, h = run(tmp_path, monkeypatch, capsys, TWICE)
    assert status == 1
    first = line(TWICE, "loss.backward()")
    assert f"freed by     backward #1 at prog.py:{first}, which ran without " in err
    assert "`loss.backward(retain_graph=True)` instead of `loss.backward()`" in err
    assert "carried by" not in err
    assert h["carried_by"] is None
    assert h["freed_by"] == {"description": "backward #1", "file": "prog.py", "line": first}


def test_replay_says_when_the_program_is_not_deterministic(tmp_path, monkeypatch, capsys):
    status, err, h = run(tmp_path, monkeypatch, capsys, FLAKY, "--replay")
    assert status == 1
    assert "--replay: not reproduced: the strict replay of the same command found no " \
           "hazard at backward #1" in err
    assert h["replay"].startswith("not reproduced") and h["saved_at"] is None


def test_replay_refuses_torchrun_and_strict(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("open('ran', 'w').close()\n")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["run", "--replay", "prog.py"]) == 2
    assert "--replay does not support distributed runs yet (WORLD_SIZE=4)" in \
        capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["run", "--replay", "--strict", "prog.py"]) == 2
    assert "with --strict or --stop-at-write the lines are there already" in \
        capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


HINT = ("`versionwatch run --replay ...` (or --strict, or watch(..., strict=True)) names "
        "its line")


def test_parameter_changed_by_a_step_in_every_mode(tmp_path, monkeypatch, capsys):
    saved, call = line(STEP, "return s * self.w3"), line(STEP, "out = m(")
    step, back = line(STEP, "opt.step()"), line(STEP, "out.abs().mean().backward()")
    by_op = (f"saved by     MulBackward0.other at prog.py:{saved}: return s * self.w3 "
             f"(in m, during m.forward #1 called at prog.py:{call}, at version 0)")
    stepped = {"kind": "optimizer.step", "description": "opt.step() #1", "file": "prog.py",
               "line": step, "versions": [0, 1]}

    status, err, h = run(tmp_path, monkeypatch, capsys, STEP, "--strict")
    assert status == 1
    assert by_op in err and f"modified by  opt.step() #1 at prog.py:{step}: opt.step()" in err
    assert h["saved_at"] == at("prog.py", saved, "return s * self.w3")
    assert [(m["file"], m["line"]) for m in h["modified_by"]] == [("prog.py", step)]

    # Default mode: the module, the forward, the step that wrote (the bounding
    # event), and the one command that names the saving op's line.
    status, err, h = run(tmp_path, monkeypatch, capsys, STEP)
    assert status == 1
    assert (f"saved by     MulBackward0.other in m, at version 0, during m.forward #1 at "
            f"prog.py:{call}") in err
    assert f"modified by  opt.step() #1 at prog.py:{step} (version 0 -> 1)" in err
    assert f"backward at  prog.py:{back}" in err and HINT in err
    assert (h["module"], h["saved_during"]) == ("m", f"m.forward #1 at prog.py:{call}")
    assert h["saved_at"] is None and h["modified_by"] == [stepped]
    assert h["backward_site"] == {"file": "prog.py", "line": back}
    assert [note for note in h["notes"] if HINT in note]

    # --replay: strict's op line; the step stays a step, with its code.
    status, err, h = run(tmp_path, monkeypatch, capsys, STEP, "--replay")
    assert status == 1
    report = err.split("versionwatch: --replay: running the same command again")[1]
    assert by_op in report and HINT not in report
    assert f"modified by  opt.step() #1 at prog.py:{step} (version 0 -> 1): opt.step()" in report
    assert h["saved_at"] == at("prog.py", saved, "return s * self.w3")
    assert h["modified_by"] == [stepped] and h["notes"] == []
    assert "same hazard at backward #2" in h["replay"]


def test_no_grad_write_in_an_optimizer_strict(tmp_path, monkeypatch, capsys):
    call, perturb = line(SAM, "out = model("), line(SAM, "p.add_(")
    status, err, h = run(tmp_path, monkeypatch, capsys, SAM, "--strict")
    assert status == 1
    # nn.Linear's op runs in torch: the user's line of it is the forward's call.
    assert (f"saved by     AddmmBackward0.mat2 at prog.py:{call}: "
            "out = model(torch.randn(8, 4)) (in model.2, during model.forward #1 called at "
            f"prog.py:{call}, at version 1)") in err
    assert f"modified by  add_() at prog.py:{perturb}: p.add_(p.grad * 0.05)" in err
    assert h["saved_at"] == at("prog.py", call, "out = model(torch.randn(8, 4))")
    assert [(m["kind"], m["file"], m["line"]) for m in h["modified_by"]] == [
        ("inplace_op", "prog.py", perturb)]


def test_no_grad_write_default_mode_names_forward_and_hint(tmp_path, monkeypatch, capsys):
    call = line(SAM, "out = model(")
    status, err, h = run(tmp_path, monkeypatch, capsys, SAM)
    assert status == 1
    assert (f"saved by     AddmmBackward0.mat2 in model, at version 1, during model.forward #1 "
            f"at prog.py:{call}") in err
    assert "`versionwatch run --replay ...`" in err
    assert (h["module"], h["saved_during"]) == ("model", f"model.forward #1 at prog.py:{call}")
    assert any("--replay" in note for note in h["notes"])

    status, err, h = run(tmp_path, monkeypatch, capsys, SAM, "--replay")
    assert h["saved_at"] == at("prog.py", call, "out = model(torch.randn(8, 4))")
    assert h["notes"] == []


def test_weight_clip_in_user_code_in_every_mode(tmp_path, monkeypatch, capsys):
    call, clip, back = line(CLIP, "loss = model("), line(CLIP, "p.clamp_("), \
        line(CLIP, "loss.backward()")
    code = "loss = model(torch.randn(8, 4)).pow(2).mean()"

    status, err, h = run(tmp_path, monkeypatch, capsys, CLIP, "--strict")
    assert status == 1
    assert f"saved by     AddmmBackward0.mat2 at prog.py:{call}: {code} (in model.2" in err
    assert f"modified by  clamp_() at prog.py:{clip}: p.clamp_(-0.1, 0.1)" in err
    assert h["saved_at"] == at("prog.py", call, code)
    assert [(m["kind"], m["line"]) for m in h["modified_by"]] == [("inplace_op", clip)]

    status, err, h = run(tmp_path, monkeypatch, capsys, CLIP)
    assert status == 1
    bounded = (f"in user code between end of model.forward #1 (prog.py:{call}) "
               f"and backward #1 (prog.py:{back})")
    assert f"modified by  {bounded} (version 1 -> 2)" in err
    assert "`versionwatch run --replay ...`" in err
    assert (h["module"], h["saved_during"]) == ("model", f"model.forward #1 at prog.py:{call}")
    (m,) = h["modified_by"]
    assert m["kind"] == "between_events"
    assert m["after"] == {"event": "end of model.forward #1", "file": "prog.py", "line": call}
    assert m["before"] == {"event": "backward #1", "file": "prog.py", "line": back}

    status, err, h = run(tmp_path, monkeypatch, capsys, CLIP, "--replay")
    assert status == 1
    report = err.split("versionwatch: --replay: running the same command again")[1]
    assert f"saved by     AddmmBackward0.mat2 at prog.py:{call}: {code} (in model.2" in report
    assert f"modified by  clamp_() at prog.py:{clip} (version 1 -> 2): p.clamp_(-0.1, 0.1)" \
        in report
    assert h["saved_at"] == at("prog.py", call, code)
    assert h["modified_by"] == [{"kind": "inplace_op", "description": "clamp_()",
                                 "file": "prog.py", "line": clip, "versions": [1, 2]}]


def test_recurrent_state_with_replay_keeps_the_freeing_backward(tmp_path, monkeypatch,
                                                               capsys):
    back = line(RNN, "loss.backward()")
    status, err, h = run(tmp_path, monkeypatch, capsys, RNN, "--replay")
    assert status == 1
    # A freed graph is not replayed: default mode names the freeing backward itself.
    assert "running the same command again" not in err
    assert f"freed by     backward #1 at prog.py:{back} (this same line" in err
    assert h["freed_by"] == {"description": "backward #1", "file": "prog.py", "line": back}
    assert h["carried_by"] == "h" and h["replay"] is None


def test_sites_in_a_project_folder_named_like_a_library(tmp_path, monkeypatch, capsys):
    """A user's folder called ``lightning`` holds the user's code, not Lightning's."""
    project = tmp_path / "lightning"
    project.mkdir()
    status, err, h = run(project, monkeypatch, capsys, ACT, "--strict")
    assert status == 1
    assert h["saved_at"] == at("prog.py", line(ACT, ".sigmoid()"), "h = self.fc(x).sigmoid()")
    assert h["backward_site"] == {"file": "prog.py", "line": line(ACT, "loss.backward()")}


def test_report_does_not_import_its_renderers():
    """Rendering depends on the report, never the other way round (no import cycle).

    The report may use the leaf modules that read source lines and build its
    JSON document, which import nothing of the package at run time.
    """
    import ast

    import versionwatch._report.model as report_module

    def imports(path: str) -> set[str]:
        tree = ast.parse(Path(path).read_text())
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 and id(node) not in guarded for alias in node.names}
        found |= {f"{node.module}.{alias.name}" if node.module == "versionwatch" else
                  str(node.module) for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and id(node) not in guarded
                  for alias in node.names}
        return {name for name in found if name.startswith("versionwatch")}

    leaves = {"versionwatch._report.source_lines", "versionwatch._report.document"}
    imported = imports(report_module.__file__)
    assert imported <= leaves, imported
    for leaf in imported:
        path = Path(report_module.__file__).with_name(leaf.rpartition(".")[2] + ".py")
        assert not imports(str(path)), (leaf, imports(str(path)))


NESTED = textwrap.dedent("""\
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 1)))

        def forward(self, x):
            h = self.body(x)
            return h.sigmoid()

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):  # the second forward finds the first's answers gone with their calls
        out = net(torch.ones(2, 4)).sum()
    opt.zero_grad()
    out.backward(retain_graph=True)
    opt.step()
    out.backward()
""")


def test_strict_lines_through_nested_library_modules(tmp_path, monkeypatch, capsys):
    """Every tensor saved inside library modules gets the user's line that called them."""
    status, err, h = run(tmp_path, monkeypatch, capsys, NESTED, "--strict")
    assert status == 1
    assert h["saved_at"] == at("prog.py", line(NESTED, "h = self.body(x)"), "h = self.body(x)")
    doc = json.loads((tmp_path / "out.json").read_text())
    sites = {(x["slot"], x["saved_at"]["line"]) for x in doc["hazards"] if x.get("saved_at")}
    assert sites and all(n == line(NESTED, "h = self.body(x)") for _, n in sites), sites
