"""docs/versions.md's table, cell by cell, against the torch these tests run on.

Each row is checked by what the running torch does (a behaviour or a feature probe),
never by its version string; the version only picks the table's column.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import versionwatch
from versionwatch import _compat
from versionwatch._report.model import UNSURE_PROFILER

DOC = Path(__file__).resolve().parent.parent / "docs" / "versions.md"


def _table() -> dict[str, dict[str, str]]:
    """{release: {feature: cell}} from the page's table."""
    lines = [ln for ln in DOC.read_text(encoding="utf-8").splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out: dict[str, dict[str, str]] = {v: {} for v in head[1:]}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for release, cell in zip(head[1:], cells[1:]):
            out[release][cells[0]] = cell
    return out


TABLE = _table()
RELEASE = re.match(r"\d+\.\d+\.\d+", torch.__version__).group(0)  # type: ignore[union-attr]
COLUMN = TABLE.get(RELEASE)
pytestmark = pytest.mark.skipif(
    COLUMN is None, reason=f"torch {RELEASE} is not a column of docs/versions.md")


def cell(feature: str) -> str:
    assert COLUMN is not None
    matches = [v for k, v in COLUMN.items() if k.startswith(feature)]
    assert len(matches) == 1, (feature, list(COLUMN))
    return matches[0]


def test_the_table_has_the_matrix_releases() -> None:
    sys.path.insert(0, str(DOC.parent.parent / "tools"))
    from torch_matrix import MATRIX

    assert list(TABLE) == MATRIX


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w3 = nn.Parameter(torch.tensor([4.0]))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return s * self.w3


def test_predictions() -> None:
    assert cell("predictions") == "exact"
    model = Model()
    loss = model(torch.tensor([2.0], requires_grad=True)).sum()
    with torch.no_grad():
        model.w3.add_(1)
    h = versionwatch.check(loss, names={"model": model}).hazards[0]
    assert (h.tensor, h.where, h.saved_version, h.current_version) == (
        "model.w3", "MulBackward0.other", 0, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_strict_mode_has_write_lines() -> None:
    assert cell("strict mode") == "yes"
    model = Model()
    with versionwatch.watch(model, strict=True, on_hazard=lambda r: None) as w:
        loss = model(torch.tensor([2.0], requires_grad=True)).sum()
        with torch.no_grad():
            model.w3.mul_(2)
        with pytest.raises(RuntimeError):
            loss.backward()
    h = w.reports[0].hazards[0]
    assert h.tensor == "model.w3"
    assert [m.description for m in h.modified_by] == ["mul_()"]


def test_how_a_saved_tensor_is_read() -> None:
    expected = {"through its getter, under a trap": False, "from the raw slot": True}
    assert _compat.SAVED_INTROSPECTION is expected[cell("a saved tensor is read")]


def test_hooked_saved_tensors_are_never_run() -> None:
    assert cell("saved tensors behind hooks") == "not verified, hook never run"
    calls: list[str] = []

    def unpack(t: torch.Tensor) -> torch.Tensor:
        calls.append("unpack")
        return t

    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = x.sigmoid()
    ran = []

    def f(t: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return t.exp()

    z = checkpoint(f, x, use_reentrant=False)
    r = versionwatch.check(y.sum() + z.sum())
    assert calls == [] and ran == [1]  # neither the hook nor the recomputation ran
    assert r.ok and len(r.unverifiable) >= 2


def test_stale_element_of_a_saved_list() -> None:
    x = torch.ones(4, 4, requires_grad=True)
    i0, i1 = torch.tensor([0, 1]), torch.tensor([2, 3, 1])
    y = x[i0[:, None], i1]  # IndexBackward0 saves both index tensors
    i1.zero_()
    where = versionwatch.check(y.sum()).hazards[0].where
    expected = {"yes": "IndexBackward0.indices[1]",
                "when its data is unique": "IndexBackward0.indices[1]",
                "one-element lists only": "IndexBackward0.indices"}
    assert where == expected[cell("a stale element of a saved list")]
    one = torch.tensor([1, 2])
    y = x[one]
    one.zero_()
    assert versionwatch.check(y.sum()).hazards[0].where == "IndexBackward0.indices[0]"


def test_a_stale_parameter_is_named() -> None:
    assert cell("a stale parameter is named") in ("from the node's inputs",
                                                  "from the saved tensor")
    fc = nn.Linear(3, 3)  # weight and bias at the same version: the sizes tell them apart
    out = fc(torch.ones(2, 3, requires_grad=True)).sum()
    with torch.no_grad():
        fc.weight.add_(1)
        fc.bias.add_(1)
    h = versionwatch.check(out, names={"fc": fc}).hazards[0]
    assert (h.tensor, h.view, h.shape) == ("fc.weight", True, (3, 3))


def test_checks_under_a_c_profiler(caplog: pytest.LogCaptureFixture) -> None:
    import cProfile

    x = torch.ones(3, requires_grad=True)
    y = x.sigmoid()
    y.add_(1)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        c_profiler = not callable(sys.getprofile()) and sys.getprofile() is not None
        r = versionwatch.check(y.sum())
    finally:
        profiler.disable()
    if not c_profiler:
        pytest.skip("cProfile is not a C profile function on this Python (3.12+)")
    if cell("checks under a C profiler") == "yes":
        assert not r.ok and r.hazards[0].where == "SigmoidBackward0.result"
    else:
        assert cell("checks under a C profiler") == "not verified"
        assert r.ok and r.unverifiable == [("SigmoidBackward0", "result")]
        assert "C profiler" in caplog.text  # said once, on the versionwatch logger
        # The reason is the profiler's, not hooks' (nothing here has a hook).
        assert r.why_unverifiable("SigmoidBackward0", "result") == UNSURE_PROFILER
        assert str(r).endswith("1 not verifiable (a C profiler (cProfile) runs on this thread)")


def test_a_python_profiler_is_set_back() -> None:
    events: list[str] = []

    def prof(frame: object, event: str, arg: object) -> None:
        events.append(event)

    x = torch.ones(3, requires_grad=True)
    y = x.sigmoid()
    y.add_(1)
    sys.setprofile(prof)
    try:
        r = versionwatch.check(y.sum())
        still = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert still is prof and events
    assert not r.ok


def test_checkpointed_slots_are_checked_in_strict_mode() -> None:
    expected = {"checked, its holder seen as the refused hook's argument": "peeked",
                "checked, its holder from the raw slot": "shown"}
    how = expected[cell("inside `checkpoint(use_reentrant=False)`, strict mode")]
    assert _compat.CHECKPOINT_SLOTS_SHOWN is (how == "shown")
    assert _compat.CHECKPOINT_HOLDER_PEEKED is (how == "peeked")
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(3, 3), nn.Sigmoid())
    x = torch.ones(2, 3, requires_grad=True)
    with versionwatch.watch(model, strict=True):
        report = versionwatch.check(checkpoint(model, x, use_reentrant=False).sum())
    assert report.ok and not report.unverifiable and report.saved_checked == 3
