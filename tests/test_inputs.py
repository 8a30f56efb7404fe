"""Bad input gets a precise TypeError or ValueError, never a crash inside versionwatch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import versionwatch


def test_non_tensor_output():
    with pytest.raises(TypeError, match="^outputs must be a tensor or a sequence of tensors; got int$"):
        versionwatch.check(3)  # type: ignore[arg-type]


def test_non_tensor_in_sequence():
    x = torch.ones(1, requires_grad=True)
    with pytest.raises(TypeError, match=r"^outputs\[1\] must be a tensor; got str$"):
        versionwatch.check([x, "loss"])  # type: ignore[list-item]


def test_empty_outputs():
    with pytest.raises(ValueError, match="^outputs is empty"):
        versionwatch.check([])


def test_output_without_graph():
    with torch.no_grad():
        y = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(ValueError, match=r"outputs\[0\] does not require grad and has no grad_fn"):
        versionwatch.check(y)


def test_input_without_grad():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^inputs\[0\] does not require grad$"):
        versionwatch.check((x * 2).sum(), inputs=[torch.ones(2)])


def test_empty_inputs():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="^inputs is empty"):
        versionwatch.check((x * 2).sum(), inputs=[])


def test_bad_names():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="^names must be an nn.Module"):
        versionwatch.check(x.sum(), names=[x])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^names must map str -> nn.Module or torch.Tensor -> str; got str -> int$"):
        versionwatch.check(x.sum(), names={"a": 1})  # type: ignore[dict-item]


def test_bad_api():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="api must be"):
        versionwatch.check(x.sum(), api="jvp")  # type: ignore[arg-type]


def test_names_from_dict_of_modules_and_tensors():
    gen = nn.Sequential(nn.Linear(2, 2))
    s = torch.ones(1, 2, requires_grad=True)
    out = gen(s).sum()
    with torch.no_grad():
        gen[0].weight.add_(1)
    r = versionwatch.check(out, names={"G": gen})
    assert (r.hazards[0].tensor, r.hazards[0].view) == ("G.0.weight", True)
    w = nn.Parameter(torch.ones(1))
    loss = (s.sum() * w).sum()
    with torch.no_grad():
        w.add_(1)
    assert versionwatch.check(loss, names={w: "my_w"}).hazards[0].tensor == "my_w"
