"""The explanation's exact text, and the JSON schema."""

from __future__ import annotations

import json

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


def test_render_exact():
    m, loss = _seed_like()
    assert str(versionwatch.check(loss, names=m)) == "\n".join([
        "versionwatch: backward will fail: w3 saved by MulBackward0 was modified by an "
        "inplace operation",
        "  tensor    w3 (float32[1])",
        "  saved by  MulBackward0.other, at version 0",
        "  now at    version 1",
        "  fix       run every backward that needs w3 before optimizer.step() (or sum the "
        "losses and call backward once), or re-run the forward after step(); any in-place "
        "update under torch.no_grad() counts as well",
    ])


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
    assert h["fix"].startswith("run every backward")


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
