"""The seed story: a loop that fails only on its second iteration.

A model computes two outputs from shared weights. The loop calls
``loss1.backward(retain_graph=True); step(); loss2.backward(); step()``. With
``zero_grad(set_to_none=False)`` it fails at the second backward of the second
iteration: ``w3`` is at version 2 where version 1 was saved. Not because backward
bumps versions (it never does) but because ``zero_grad`` left a zero ``.grad`` on
``w3``, so ``SGD.step()`` #3 updated ``w3`` in place after forward #2 had saved it.

Run it: ``python examples/seed_story.py``.
"""

from __future__ import annotations

import torch
from torch import nn

import versionwatch


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([2.0]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))
        self.w3 = nn.Parameter(torch.tensor([4.0]))

    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a * self.w1
        c = s * self.w2
        d = s * self.w3
        return c, d


def train(set_to_none: bool, iterations: int = 3, *, predict: bool = True) -> None:
    """The blog's loop. With ``predict``, every backward is checked before it runs."""
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = nn.MSELoss()
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    for n in range(1, iterations + 1):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=set_to_none)
        loss1 = mse(y1_pred, y1)
        if predict:
            versionwatch.assert_backward_safe(loss1, names=model)
        loss1.backward(retain_graph=True)
        optim.step()
        optim.zero_grad(set_to_none=set_to_none)
        loss2 = mse(y2_pred, y2)
        if predict:
            versionwatch.assert_backward_safe(loss2, names=model)
        loss2.backward()
        optim.step()
        print(f"iteration {n} ok: versions w1={model.w1._version} "
              f"w2={model.w2._version} w3={model.w3._version}")


def main() -> None:
    print("== zero_grad(set_to_none=True): w3 has no .grad after zero_grad, step #3 skips it")
    train(set_to_none=True)
    print()
    print("== zero_grad(set_to_none=False): predicted before the failing backward runs")
    try:
        train(set_to_none=False)
    except versionwatch.InplaceModificationError as e:
        print(e)


if __name__ == "__main__":
    main()
