"""``versionwatch demo``: the seed story, a loop that fails only on its second iteration.

A bundled copy of the story in ``inplace-error-blog.zh.txt``: two losses from
shared weights, ``loss1.backward(retain_graph=True); step(); loss2.backward()``.
It ends with the patch ``versionwatch fix`` writes for it, checked by running it.
"""

from __future__ import annotations

import os
import tempfile
import warnings

# The demo is our own program, and its output starts with our own text: torch, imported
# without numpy (the base install has none), warns "Failed to initialize NumPy" as it
# loads. That warning is dropped here, for the demo's own import of torch only; a user's
# program under `versionwatch run` imports torch itself and sees it as it would plain.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy",
                            category=UserWarning)
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
    """The loop as ``versionwatch fix`` patches it: one step, after both backwards."""
    mse = nn.MSELoss()
    x, y1, y2 = DATA
    for _ in range(iterations):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=False)
        loss1 = mse(y1_pred, y1)
        loss1.backward(retain_graph=True)
        loss2 = mse(y2_pred, y2)
        loss2.backward()
        optim.step()


# The blog's loop as a script of its own, for `versionwatch fix` to patch.
TRAIN_PY = """\
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


model = Model()
optim = torch.optim.SGD(model.parameters(), lr=0.01)
mse = nn.MSELoss()
x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
for _ in range(3):
    y1_pred, y2_pred = model(x)
    optim.zero_grad(set_to_none=False)
    loss1 = mse(y1_pred, y1)
    loss1.backward(retain_graph=True)
    optim.step()
    optim.zero_grad(set_to_none=False)
    loss2 = mse(y2_pred, y2)
    loss2.backward()
    optim.step()
"""


def show_fix(server: object) -> None:
    """``versionwatch fix train.py`` on the blog's loop: the first verified patch."""
    from versionwatch._fix import ForkServer, fix

    here = os.getcwd()
    lines = ["$ versionwatch fix train.py    # the blog's loop, as a script"]
    with tempfile.TemporaryDirectory(prefix="versionwatch-demo-") as folder:
        with open(os.path.join(folder, "train.py"), "w", encoding="utf-8") as f:
            f.write(TRAIN_PY)
        os.chdir(folder)
        try:  # in the program's folder: the diff names train.py as `git apply` wants it
            result = fix(["train.py"], jobs=2,
                         server=server if isinstance(server, ForkServer) else None)
            if not result.verified:
                lines.append("no verified patch: " + "; ".join(c.why for c in result.candidates))
            else:
                best = result.verified[0]
                lines += [f"verified: {best.summary}", f"  {best.why}", best.diff.rstrip("\n")]
            lines += [f"rejected: {c.family}: {c.why.split(';')[0]}"
                      for c in result.candidates if not c.verified]
        finally:
            os.chdir(here)
    print("\n".join(lines))


def _server() -> object:
    """A fork server for step 4, started now: it imports torch while steps 1-3 run."""
    if not hasattr(os, "fork"):
        return None
    from versionwatch._fix import ForkServer

    return ForkServer()


def _title(n: int, text: str) -> None:
    print(f"\n=== step {n}/4: {text}\n")


def main() -> None:
    print("versionwatch demo: the seed story, a training loop that fails only on its "
          "second iteration, in four steps")
    server = _server()
    try:
        _steps(server)
    finally:
        close = getattr(server, "close", None)
        if close is not None:
            close()


def _steps(server: object) -> None:
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

    _title(4, "the fix: versionwatch fix writes the patch and checks it by running it")
    show_fix(server)
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, optim) as w:
        fixed_loop(model, optim)
    print(f"\nThe patched loop, watched: 3 iterations, {len(w.reports)} hazards. "
          "`versionwatch fix --apply train.py`")
    print("writes the first verified patch: verified means each optimizer step applies the "
          "gradients the program meant (docs/fix.md).")


if __name__ == "__main__":
    main()
