"""Run one program plainly and save what each of its optimizer steps applied.

``python fix_steps.py OUT.pt SCRIPT`` runs SCRIPT as ``python SCRIPT`` would and
saves, in order, one entry per ``optimizer.step()``: the optimizer's variable
name in the script's globals, and a copy of each of its parameters' ``.grad``
(``None`` where the step skips it), by the parameter's name in the script's
modules (``D.0.weight``); and every parameter at the end (``final``). Nothing imports versionwatch: these are the values the
hand-written references of tests/test_fix_training.py are compared with.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

SCRIPT = ""
steps: list[dict[str, Any]] = []


def _globals() -> dict[str, Any]:
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_filename != SCRIPT:
        frame = frame.f_back  # type: ignore[assignment]
    assert frame is not None, "a step outside the script"
    return frame.f_globals


def _pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    scope = _globals()
    names: dict[int, str] = {}
    for var, value in list(scope.items()):
        if isinstance(value, torch.nn.Module):
            for name, p in value.named_parameters():
                names.setdefault(id(p), f"{var}.{name}")
    label = next((var for var, value in scope.items() if value is opt), type(opt).__name__)
    params = [p for g in opt.param_groups for p in g["params"]]
    steps.append({"optimizer": label, "grads": {
        names.get(id(p), f"{label}[{i}]"): None if p.grad is None else p.grad.detach().clone()
        for i, p in enumerate(params)}})


if __name__ == "__main__":
    out, SCRIPT = sys.argv[1], os.path.abspath(sys.argv[2])
    register_optimizer_step_pre_hook(_pre)
    sys.argv = [SCRIPT]
    sys.path[0] = os.path.dirname(SCRIPT)
    scope = runpy.run_path(SCRIPT, run_name="__main__")
    final = {f"{var}.{name}": p.detach().clone() for var, value in scope.items()
             if isinstance(value, torch.nn.Module) for name, p in value.named_parameters()}
    torch.save({"steps": steps, "final": final}, out)
