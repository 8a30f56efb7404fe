"""The explanation's exact text, and the JSON schema."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
from torch import nn

import versionwatch


def _seed_like():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w3 = nn.Parameter(torch.tensor([4.0]))

    m = M()
    s = torch.tensor([2.0], requires_grad=True)
    loss = (s * m.w3).sum()
    with torch.no_grad():
        m.w3.add_(1)
    return m, loss


def _pytorch_says(loss: torch.Tensor) -> str:
    """What the real backward raises: the sentence the report must carry verbatim."""
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("backward did not fail")


def test_render_exact():
    m, loss = _seed_like()
    text = str(versionwatch.check(loss, names=m))
    assert text == "\n".join([
        "versionwatch: backward will fail: w3 saved by MulBackward0 was modified by an "
        "inplace operation",
        "  tensor    w3 (float32[1])",
        "  saved by  MulBackward0.other, at version 0",
        "  now at    version 1",
        # check() without a watcher knows no write: the advice names both kinds.
        "  fix       w3 was changed in place after the forward that saved it (an optimizer "
        "step, or an update under torch.no_grad()): make that change after this backward, "
        "or re-run the forward after it",
        "  pytorch   " + _pytorch_says(loss),
    ])
    assert "[torch.FloatTensor [1]] is at version 1; expected version 0 instead. Hint: " in text


def test_render_safe():
    x = torch.ones(2, requires_grad=True)
    assert str(versionwatch.check((x * x).sum())) == (
        "versionwatch: backward is safe: 3 nodes, 2 saved tensors checked")


def test_json_schema_fields():
    m, loss = _seed_like()
    d = json.loads(versionwatch.check(loss, names=m).to_json())
    assert d["schema"] == "versionwatch.report/1"
    (h,) = d["hazards"]
    for key, value in {"kind": "inplace", "detected": "predicted", "tensor": "w3",
                       "shape": [1], "dtype": "float32", "saved_by": "MulBackward0",
                       "slot": "other", "saved_version": 0, "current_version": 1,
                       "modified_by": []}.items():
        assert h[key] == value, key
    assert h["fix"].startswith("w3 was changed in place after the forward that saved it")
    assert h["fixes"] == []  # check() has no watcher: no candidates, the advice stands
    assert h["torch_message"] == _pytorch_says(loss)


def test_report_holds_no_tensor():
    m, loss = _seed_like()
    report = versionwatch.check(loss, names=m)
    for h in report.hazards:
        assert not any(isinstance(v, torch.Tensor) for v in vars(h).values())


def test_html_reprs_for_notebooks():
    import versionwatch as vw

    m, loss = _seed_like()
    report = vw.check(loss, names=m)
    html = report._repr_html_()
    assert html.startswith("<pre>") and "w3 saved by MulBackward0" in html
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
    with vw.watch(model) as w:
        model(torch.ones(1, 2)).sum().backward()
    table = w.timeline()._repr_html_()
    assert table.startswith("<table>") and "<th>model.0.weight</th>" in table
    assert "<td>forward #1</td>" in table and "<td>backward #1</td>" in table


# --- PyTorch's own sentence, verbatim -------------------------------------------------

def _output_modified() -> torch.Tensor:
    x = torch.ones(3, requires_grad=True)
    y = x.sigmoid()
    y.add_(1)
    return y.sum()


def _parameter_stepped() -> torch.Tensor:
    m = nn.Linear(3, 2)
    loss = m(torch.ones(4, 3, requires_grad=True)).pow(2).sum()
    with torch.no_grad():
        m.weight.add_(1)  # what optimizer.step() does
    return loss


def _freed() -> torch.Tensor:
    x = torch.ones(3, requires_grad=True)
    loss = (x * x).sum()
    loss.backward()
    return loss


_HELD: list[torch.Tensor] = []


def _input_modified() -> torch.Tensor:
    x = torch.ones(3, requires_grad=True)
    b = x.exp()
    loss = (b * x).sum()  # MulBackward0 saves b, an input: named by the grad_fn it has then
    b.add_(1)
    _HELD[:] = [b]  # the program still holds it (strict mode holds a saved input weakly)
    return loss


def _view_of_activation_modified() -> torch.Tensor:
    x = torch.ones(2, 3, requires_grad=True)
    h = x.exp()
    v = h[:, :2]
    loss = (v * v).sum()  # saves the view; writing h rebuilds its grad_fn
    h.mul_(2)
    return loss


CASES = {"output_modified": _output_modified, "parameter_stepped": _parameter_stepped,
         "input_modified": _input_modified, "view_modified": _view_of_activation_modified,
         "freed": _freed}


def _plain_error(case: str) -> str:
    torch.manual_seed(0)
    return _pytorch_says(CASES[case]())


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning",
                            "ignore:Anomaly Detection has been enabled:UserWarning")
@pytest.mark.parametrize("anomaly", [False, True], ids=["plain", "anomaly"])
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(CASES))
def test_raised_error_carries_pytorchs_sentence(case: str, strict: bool, anomaly: bool):
    """What matches PyTorch's error (pytest.raises(match=...), a log search) matches ours."""
    with torch.autograd.set_detect_anomaly(anomaly):
        expected = _plain_error(case)
        with versionwatch.watch_all(strict=strict):
            torch.manual_seed(0)
            loss = CASES[case]()
            with pytest.raises(RuntimeError, match=re.escape(expected)) as info:
                loss.backward()
    assert type(info.value).__name__ == (
        "FreedGraphError" if case == "freed" else "InplaceModificationError")
    h = info.value.report.hazards[0]  # type: ignore[attr-defined]
    assert h.torch_message == expected
    assert str(info.value).startswith("versionwatch: backward will fail")
    assert f"\n  pytorch      {expected}\n" in str(info.value) + "\n"
    assert json.loads(info.value.report.to_json())["hazards"][0]["torch_message"] == expected  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning",
                            "ignore:Anomaly Detection has been enabled:UserWarning")
@pytest.mark.parametrize("anomaly", [False, True], ids=["plain", "anomaly"])
@pytest.mark.parametrize("case", ["output_modified", "parameter_stepped", "input_modified",
                                  "view_modified"])
def test_strict_unpack_raises_pytorchs_exact_error(case: str, anomaly: bool):
    """Behind strict mode's hooks PyTorch checks nothing: ours must say what it would."""
    with torch.autograd.set_detect_anomaly(anomaly):
        expected = _plain_error(case)
        with versionwatch.watch_all(strict=True, on_hazard=lambda report: None):
            torch.manual_seed(0)
            loss = CASES[case]()
            with pytest.raises(RuntimeError) as info:
                loss.backward()
    assert type(info.value) is RuntimeError
    assert str(info.value) == expected
    hint = "Good luck!" if anomaly else "set_detect_anomaly(True"
    assert hint in str(info.value)


def test_wording_fallback_is_a_template():
    """Where the running torch's words cannot be probed, torch 2.13's stand in."""
    from versionwatch import _torch_messages

    tpl = _torch_messages._parse(_torch_messages._FALLBACK)
    assert tpl is not None and tpl.clause == (", which is output ", ",")
    assert not tpl.full_names and tpl.hint.startswith(" Hint: enable anomaly detection")
    assert _torch_messages._parse("some other words entirely") is None


def test_every_public_name_resolves_and_a_bare_report_renders() -> None:
    """``versionwatch.X`` for each name of ``__all__``; a report made from
    ``versionwatch._report.model`` alone (as one unpickled in a worker) still renders."""
    import subprocess
    import sys

    code = (
        "import versionwatch\n"
        "for name in versionwatch.__all__:\n"
        "    getattr(versionwatch, name)\n"
        "from versionwatch._report.model import Hazard, Report, Repair\n"
        "assert versionwatch.Repair is Repair\n"
        "print(str(Report(hazards=[Hazard(kind='inplace', node='MulBackward0', slot='other')]))"
        ".splitlines()[0])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("versionwatch: backward will fail: a tensor saved by "
                               "MulBackward0"), r.stdout


def test_a_site_shows_its_path_relative_to_the_working_directory_when_read(tmp_path, monkeypatch):
    """A watcher records the interpreter's own path; the report shows it from where you stand."""
    import copy
    import dataclasses
    import pickle

    (tmp_path / "pkg").mkdir()
    path = str(tmp_path / "pkg" / "train.py")
    monkeypatch.chdir(tmp_path)
    site = versionwatch.Site(path, 7, "loss.backward()")
    assert (site.file, str(site)) == ("pkg/train.py", "pkg/train.py:7")
    monkeypatch.chdir(tmp_path / "pkg")
    assert (site.file, str(site)) == ("train.py", "train.py:7")
    assert site == versionwatch.Site("train.py", 7, "loss.backward()")
    assert hash(site) == hash(versionwatch.Site("train.py", 7, "loss.backward()"))
    assert site != versionwatch.Site(path, 8, "loss.backward()")
    assert repr(site) == "Site(file='train.py', line=7, code='loss.backward()')"
    for back in (pickle.loads(pickle.dumps(site)), copy.deepcopy(site),
                 dataclasses.replace(site)):
        assert back == site
        assert (back.file, back.line, back.code) == ("train.py", 7, "loss.backward()")
    assert dataclasses.asdict(site) == {"file": "train.py", "line": 7, "code": "loss.backward()",
                                        "via": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.line = 8  # type: ignore[misc]
    (tmp_path / "doomed").mkdir()
    monkeypatch.chdir(tmp_path / "doomed")
    shown = str(site)  # outside the working directory (and sys.path): as recorded
    assert shown == f"{path}:7"
    os.rmdir(tmp_path / "doomed")  # the working directory deleted under the program
    assert str(site) == shown  # what it showed last
    assert str(versionwatch.Site(path, 8)) == f"{path}:8"


def test_a_watchers_sites_follow_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    prog = tmp_path / "sub" / "vw_site_prog.py"
    prog.write_text("def run(w, loss):\n    loss.backward()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "sub"))
    import importlib

    user = importlib.import_module("vw_site_prog")
    monkeypatch.delitem(sys.modules, "vw_site_prog")

    m, loss = _seed_like()
    with versionwatch.watch({"m": m}, on_hazard="log") as w:
        with pytest.raises(RuntimeError):
            user.run(w, loss)
        report = w.reports[-1]
    assert str(report.backward_site) == "sub/vw_site_prog.py:2"
    monkeypatch.chdir(tmp_path / "sub")
    assert str(report.backward_site) == "vw_site_prog.py:2"
    assert report.to_dict()["hazards"][0]["backward_site"] == {"file": "vw_site_prog.py", "line": 2}
