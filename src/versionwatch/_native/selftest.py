"""The native helper's self-test: its answers against the Python predictor's.

Run once when the helper loads. Each small graph has the answer the native
check must give (``clean``, ``error``: PyTorch raised on a saved tensor, or
``unsure``: left to Python), and every answer is held against
:func:`versionwatch.check` on the same graph: a clean native answer must be a
report with no hazard and nothing unverifiable, over the same number of nodes
and saved tensors; an error must be a report with a hazard. Any mismatch
disables the helper.

The graphs are built in a thread of their own, so that nothing of the caller's
thread (grad mode, saved-tensor hooks, modes, autocast) shapes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import Node, get_gradient_edge

from versionwatch._predict import check, unobserved

Verdict = str  # "clean", "error" or "unsure"


def roots_of(outputs: Sequence[torch.Tensor]) -> list[Node]:
    """The nodes a backward through ``outputs`` starts from, as the predictor finds them."""
    found: list[Node] = []
    for t in outputs:
        if t.grad_fn is not None:
            found.append(t.grad_fn)
        else:
            found.append(get_gradient_edge(t).node)
    return found


class Extension(Protocol):
    """The native helper's calls that the self-test makes (``native.cpp``'s module methods)."""

    def check(self, roots: Sequence[Node], /) -> tuple[int, int, int]: ...

    def explain(self, roots: Sequence[Node], /) -> list[tuple[str, str, str, str]]: ...


def verdict(ext: Extension, roots: Sequence[Node]
            ) -> tuple[Verdict, tuple[int, int, int], list[tuple[str, str, str, str]]]:
    """The native answer for ``roots``: its verdict, ``check``'s triple, ``explain``'s list."""
    triple = ext.check(roots)
    if triple[2] == 0:
        return "clean", triple, []
    found = ext.explain(roots)
    return ("error" if any(f[2] == "error" for f in found) else "unsure"), triple, found


class _SavedCtx(Protocol):
    # torch's stub types saved_tensors as a 1-tuple.
    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]: ...


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: _SavedCtx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return g * b, g * a


def _apply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _Custom.apply(a, b)  # type: ignore[no-untyped-call]
    return out


def _t(*shape: int, grad: bool = False) -> torch.Tensor:
    """A tensor of fixed values: the caller's random stream stays untouched."""
    n = 1
    for d in shape:
        n *= d
    return torch.linspace(-1.0, 1.0, n).reshape(shape).requires_grad_(grad)


def _mlp() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _t(5, 4, grad=True)
    w1 = torch.nn.Parameter(_t(4, 8))
    w2 = torch.nn.Parameter(_t(8, 1))
    loss = torch.sigmoid(torch.relu(x @ w1) @ w2).sum()
    return loss, x, w2


def _free(loss: torch.Tensor, leaf: torch.Tensor) -> None:
    """Run a backward through the engine itself: a watcher's wrapper of
    ``torch.autograd.backward`` would record it, and nothing gets a ``.grad``."""
    engine: Any = torch.autograd.Variable._execution_engine
    engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (leaf,), False, False)


def _graphs() -> Iterator[tuple[str, Verdict, Callable[[], list[torch.Tensor]]]]:
    """(name, the native answer it must give, a function that builds its outputs)."""

    def clean() -> list[torch.Tensor]:
        return [_mlp()[0]]

    def stale_leaf() -> list[torch.Tensor]:
        loss, _, w2 = _mlp()
        with torch.no_grad():
            w2.add_(1.0)  # what optimizer.step() does
        return [loss]

    def stale_activation() -> list[torch.Tensor]:
        x = _t(6, grad=True)
        s = torch.sigmoid(x)  # saves its result
        loss = (s * 2.0).sum()
        s.mul_(3.0)
        return [loss]

    def freed() -> list[torch.Tensor]:
        loss, x, _ = _mlp()
        _free(loss, x)
        return [loss]

    def custom() -> list[torch.Tensor]:
        a = _t(3, grad=True)
        return [_apply(a * 2.0, a.exp()).sum()]

    def custom_stale() -> list[torch.Tensor]:
        a = _t(3, grad=True)
        b = a.exp()
        out = _apply(a * 2.0, b).sum()
        b.add_(1.0)
        return [out]

    def copy_slices() -> list[torch.Tensor]:
        a = _t(4, grad=True)
        h = a.clone()
        h[:2].mul_(a[2:])
        return [h.sum()]

    def hooks() -> list[torch.Tensor]:
        a = _t(3, grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return [a.sigmoid().sum()]

    def list_slot() -> list[torch.Tensor]:
        a = _t(4, grad=True)
        return [(a[torch.tensor([0, 2])] * 2.0).sum()]

    def detached() -> list[torch.Tensor]:
        a = _t(3, grad=True)
        p = a.sigmoid()
        out = (p * a).sum()  # saves p as an input
        p.detach_()  # backward raises; neither unpack with the node sees it
        return [out]

    def leaf() -> list[torch.Tensor]:
        return [torch.tensor(0.5, requires_grad=True)]

    def two_roots() -> list[torch.Tensor]:
        x = _t(4, grad=True)
        h = torch.tanh(x)
        return [(h * h).sum(), h.exp().sum()]

    yield "clean MLP", "clean", clean
    yield "stale leaf", "error", stale_leaf
    yield "stale activation", "error", stale_activation
    yield "freed graph", "error", freed
    yield "custom Function", "clean", custom
    yield "custom Function, stale input", "error", custom_stale
    yield "CopySlices", "unsure", copy_slices
    yield "saved-tensor hooks", "unsure", hooks
    yield "list of saved tensors", "unsure", list_slot
    yield "input detached in place", "unsure", detached
    yield "leaf output", "clean", leaf
    yield "two outputs", "clean", two_roots


def _compare(ext: Extension) -> tuple[str | None, int]:
    # check as defined (bound at import) and unobserved: versionwatch fix's child
    # observes check(), and a program may wrap it; either would take this test's
    # stale graphs for the program's own failures.
    count = 0
    for name, expected, make in _graphs():
        outputs = make()
        got, (nodes, checked, _), found = verdict(ext, roots_of(outputs))
        with unobserved():
            report = check(outputs)
        count += 1
        if got != expected:
            why = f" ({found[0][3]})" if found else ""
            return f"{name}: the native check said {got}{why}, expected {expected}", count
        if got == "clean" and not (report.ok and not report.unverifiable
                                   and report.nodes == nodes
                                   and report.saved_checked == checked):
            return (f"{name}: the native check said clean over {nodes} nodes and {checked} "
                    f"saved tensors; the Python predictor found {len(report.hazards)} "
                    f"hazard(s), {len(report.unverifiable)} unverifiable, over "
                    f"{report.nodes} nodes and {report.saved_checked} saved tensors"), count
        if got == "error" and report.ok:
            return (f"{name}: the native check found an error ({found[0][3][:80]}); the "
                    "Python predictor found none"), count
    return None, count


def run(ext: Extension) -> tuple[str | None, int]:
    """Compare ``ext`` with the Python predictor: (the first mismatch or None, graphs run)."""
    result: list[tuple[str | None, int]] = []

    def target() -> None:
        try:
            result.append(_compare(ext))
        except Exception as e:  # any failure disables the helper; say which
            result.append((f"the self-test raised {type(e).__name__}: {e}", 0))

    thread = threading.Thread(target=target, name="versionwatch-native-selftest", daemon=True)
    thread.start()
    thread.join()
    return result[0] if result else ("the self-test did not finish", 0)
