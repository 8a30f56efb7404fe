"""Accelerate's accelerator.backward is predicted like any backward (it ends in autograd)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import versionwatch

accelerate = pytest.importorskip("accelerate")


def test_accelerator_backward_is_predicted_with_the_users_lines():
    accelerator = accelerate.Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)

    def body():
        loss = model(torch.ones(3, 2)).sum()
        accelerator.backward(loss, retain_graph=True)
        opt.step()  # the prepared optimizer wraps SGD: its step is still seen
        accelerator.backward(loss)  # reuses the graph saved before the step

    with versionwatch.watch(model) as w, pytest.raises(versionwatch.InplaceModificationError) as e:
        body()
    src, start = inspect.getsourcelines(body)
    line = {text.strip(): start + i for i, text in enumerate(src)}
    h = e.value.report.hazards[0]
    assert h.tensor == "model.2.weight" and h.detected == "predicted"
    assert h.modified_by[0].description == "opt.step() #1"
    assert h.modified_by[0].site.line == line["opt.step()  # the prepared optimizer wraps SGD: its step is still seen"]
    assert e.value.report.backward_site.line == line["accelerator.backward(loss)  # reuses the graph saved before the step"]
    assert len(w.reports) == 1
