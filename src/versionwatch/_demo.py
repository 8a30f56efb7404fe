"""``versionwatch demo``: the seed story, a loop that fails only on its second iteration.

A bundled copy of the story in ``inplace-error-blog.zh.txt``: two losses from
shared weights, ``loss1.backward(retain_graph=True); step(); loss2.backward()``.
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
        return s * self.w2, s * self.w3


DATA = (torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0]))


def blog_loop(model: Model, optim: torch.optim.Optimizer, set_to_none: bool,
              iterations: int = 3) -> None:
    """The blog's loop, as written."""
    mse = nn.MSELoss()
    x, y1, y2 = DATA
    for _ in range(iterations):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=set_to_none)
        loss1 = mse(y1_pred, y1)
        loss1.backward(retain_graph=True)
        optim.step()
        optim.zero_grad(set_to_none=set_to_none)
        loss2 = mse(y2_pred, y2)
        loss2.backward()
        optim.step()


def fixed_loop(model: Model, optim: torch.optim.Optimizer, iterations: int = 3) -> None:
    """Both backwards before the step: one backward of the summed losses."""
    mse = nn.MSELoss()
    x, y1, y2 = DATA
    for _ in range(iterations):
        y1_pred, y2_pred = model(x)
        optim.zero_grad()
        (mse(y1_pred, y1) + mse(y2_pred, y2)).backward()
        optim.step()


def _title(n: int, text: str) -> None:
    print(f"\n=== step {n}/4: {text}\n")


def main() -> None:
    _title(1, "PyTorch's bare error (zero_grad(set_to_none=False), unwatched)")
    torch.manual_seed(0)
    try:
        model = Model()
        blog_loop(model, torch.optim.SGD(model.parameters(), lr=0.01), set_to_none=False)
    except RuntimeError as e:
        print(f"RuntimeError: {str(e).splitlines()[0]}")
    print("\nIt names no parameter, no op and no line, and it only fires on iteration 2.")

    _title(2, "versionwatch predicts it before backward runs, and explains it")
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, optim) as w:
        try:
            blog_loop(model, optim, set_to_none=False)
        except versionwatch.InplaceModificationError as e:
            print(e)
    print()
    print(w.timeline("model.w1", "model.w2", "model.w3"))
    print("\nBackward rows never bump a version: forward saved w3 at version 1, and "
          "SGD.step() #3 moved it to 2.")

    _title(3, "zero_grad(set_to_none=True) hides the bug")
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, optim) as w:
        blog_loop(model, optim, set_to_none=True)
    print("3 iterations, no error. After zero_grad(set_to_none=True) w3.grad is None, so")
    print("step() #3 skips w3 and leaves the version forward #2 saved. The loop is still")
    print("fragile: any step between the two backwards that touches w3 breaks it again.")
    print()
    print(w.timeline("model.w3"))

    _title(4, "the fixed loop: one backward of the summed losses, then step()")
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, optim) as w:
        fixed_loop(model, optim)
    print(f"3 iterations, {len(w.reports)} hazards. Alternatives: run loss2.backward() before")
    print("optim.step(), or re-run the forward after each step().")


if __name__ == "__main__":
    main()
