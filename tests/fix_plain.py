"""Run programs plainly, without versionwatch, and save the gradients after each one's first backward.

``python fix_plain.py OUT.pt MODE SCRIPT [MODE SCRIPT ...]`` runs each SCRIPT in
turn as ``python SCRIPT`` would (``sys.argv``, ``sys.path[0]``, ``__main__``);
MODE ``meant`` runs it under ``torch.autograd.graph.allow_mutation_on_saved_tensors()``,
which keeps every saved tensor as it was saved: the gradients the program meant;
MODE ``own`` runs a program that imports versionwatch itself (for its own
``assert_backward_safe()``), as ``plain`` does: give those last.
OUT gets, by SCRIPT, the ``.grad`` of every parameter of the modules and every
leaf tensor in the script's globals after its first backward (``grads``), and
the error that ended it, if one did (``error``), and what it printed (``out``).
Nothing imports versionwatch but an ``own`` program.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import runpy
import sys
from typing import Any

import torch

original = torch.autograd.backward
state: dict[str, Any] = {}


def grads(script: str) -> dict[str, torch.Tensor]:
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_filename != script:
        frame = frame.f_back  # type: ignore[assignment]
    assert frame is not None
    found: dict[str, torch.Tensor] = {}
    for var, value in frame.f_globals.items():
        if isinstance(value, torch.nn.Module):
            for name, p in value.named_parameters():
                if p.grad is not None:
                    found[f"{var}.{name}"] = p.grad.clone()
        elif isinstance(value, torch.Tensor) and value.is_leaf and value.grad is not None:
            found[var] = value.grad.clone()
    return found


@functools.wraps(original)
def _counting_backward(*args: Any, **kwargs: Any) -> Any:
    # Named apart from `backward`: versionwatch copies PyTorch's own function, and
    # finds it behind wrappers through __wrapped__ and the name of its code.
    outer = not state.get("inside")
    state["count"] += outer
    state["inside"] = True
    try:
        result = original(*args, **kwargs)
    finally:
        state["inside"] = not outer
    # The first backward the program called (not one a reentrant checkpoint runs inside it).
    if outer and state["count"] == 1:
        state["result"]["grads"] = grads(state["script"])
    return result


def main() -> None:
    out, pairs = sys.argv[1], sys.argv[2:]
    torch.autograd.backward = _counting_backward
    results = {}
    for mode, path in zip(pairs[::2], pairs[1::2]):
        if mode != "own":
            assert "versionwatch" not in sys.modules, f"versionwatch imported before {path}"
        script = os.path.abspath(path)
        state.update(count=0, inside=False, script=script,
                     result={"grads": None, "error": None})
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
        cwd = os.getcwd()
        os.chdir(os.path.dirname(script))
        context: Any = contextlib.nullcontext()
        if mode == "meant":
            context = torch.autograd.graph.allow_mutation_on_saved_tensors()
        printed = io.StringIO()
        try:
            with context, contextlib.redirect_stdout(printed):
                runpy.run_path(script, run_name="__main__")
        except Exception as e:
            state["result"]["error"] = f"{type(e).__name__}: {e}"
        finally:
            os.chdir(cwd)
        state["result"]["out"] = printed.getvalue()
        results[path] = state["result"]
        if mode != "own":
            assert "versionwatch" not in sys.modules, f"{path} imported versionwatch"
    torch.save(results, out)


if __name__ == "__main__":
    main()
