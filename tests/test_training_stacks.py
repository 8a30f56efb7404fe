"""torch.compile (inductor), autocast with GradScaler, activation checkpointing and
``save_on_cpu``: each watched in both modes, each prediction compared with the real
backward, which decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

import versionwatch
from versionwatch._compat import CHECKPOINT_HOLDER_PEEKED, CHECKPOINT_SLOTS_SHOWN

Body = Callable[[nn.Module, torch.optim.Optimizer], Any]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _real(body: Body) -> str | None:
    model = _mlp()
    try:
        body(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except RuntimeError as e:
        return str(e)
    return None


def _watched(body: Body, strict: bool) -> tuple[str | None, list[versionwatch.Report]]:
    """The watched run's outcome (the real backward runs: the policy only collects)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[versionwatch.Report] = []
    with versionwatch.watch(model, opt, on_hazard=seen.append, strict=strict):
        try:
            body(model, opt)
        except RuntimeError as e:
            return str(e), seen
    return None, seen


def _agrees(body: Body, strict: bool) -> list[versionwatch.Report]:
    real = _real(body)
    got, seen = _watched(body, strict)
    assert got == real, (got, real)  # watching changes nothing
    assert bool(seen) == (real is not None), (real, [str(r) for r in seen])
    return seen


# -- torch.compile ----------------------------------------------------------------------

@pytest.mark.compile
def test_compile_inductor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor on CPU: no graph break from watching; a saved parameter is named."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, fullgraph=True)  # inductor; a break would raise
        x = torch.randn(8, 4)

        def step_between() -> str | None:
            loss = compiled(x).pow(2).mean()
            loss.backward(retain_graph=True)
            opt.step()
            try:
                loss.backward()
            except RuntimeError as e:
                return str(e)
            return None

        real = step_between()  # the oracle: this torch's compiled backward, unwatched
        seen: list[versionwatch.Report] = []
        with versionwatch.watch(compiled, opt, on_hazard=seen.append):
            explained = torch._dynamo.explain(model)(x)
            got = step_between()
        assert explained.graph_break_count == 0
        # The same outcome (the watched run comes one step later: other versions).
        assert (got is None) == (real is None), (got, real)
        assert len(seen) == (real is not None), [str(r) for r in seen]
        if real is not None:
            h = seen[0].hazards[0]
            assert h.node == "CompiledFunctionBackward", h.node  # compiled nodes save too
            assert h.tensor == "compiled.2.weight"
            assert [m.description for m in h.modified_by] == ["opt.step() #1"]
            assert h.torch_message is not None
            assert h.torch_message.split("Hint")[0] in str(got)
    finally:
        torch._dynamo.reset()


@pytest.mark.compile
def test_dynamo_first_used_inside_a_watch_keeps_pytorchs_functions() -> None:
    """Dynamo builds its tables of torch's functions at its first trace and keeps them: a
    first trace inside a watch must not leave our stand-ins there (a fresh process)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, versionwatch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_training_stacks as t\n"
        "with versionwatch.watch(torch.nn.Linear(2, 1)):\n"
        "    torch.compile(lambda x: x * 2, backend='eager')(torch.ones(2))\n"
        "from torch._dynamo import trace_rules\n"
        "assert not [f for f in trace_rules.get_torch_obj_rule_map()\n"
        "            if getattr(f, '__module__', '') == 'versionwatch._watch.intercept']\n"
        "*plain, _ = t._compiled_training_step(False)\n"
        "*watched, n = t._compiled_training_step(True)\n"
        "assert watched == plain and n == 9, (watched[:3], plain[:3], n)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


# -- autocast and GradScaler ------------------------------------------------------------

class _Net(nn.Module):
    """A model of the program's own: dynamo compiles its forward (torch's own are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _counting(calls: list[int]) -> Callable[..., Any]:
    """A dynamo backend whose graphs count their runs in ``calls``."""

    def backend(gm: Any, example: Any) -> Any:
        def run(*args: Any) -> Any:
            calls.append(1)  # a compiled graph ran
            return gm.forward(*args)

        return run

    return backend


@pytest.mark.compile
@pytest.mark.parametrize("how", ["before", "after"])
def test_module_compile_in_place_keeps_the_forward(how: str) -> None:
    """Issue #23, item 11: ``model.compile()`` sets the instance's own compiled call; the
    watcher still sees its forwards, as with ``torch.compile(model)``; other compiled
    modules run their compiled call as unwatched."""
    torch._dynamo.reset()
    try:
        calls: list[int] = []
        backend = _counting(calls)
        model, other = _Net(), _Net()  # other: unwatched, of the root's class, compiled too
        other.compile(backend=backend)
        if how == "before":
            model.compile(backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen: list[versionwatch.Report] = []
        with versionwatch.watch(model, opt, on_hazard=seen.append) as w:
            if how == "after":
                model.compile(backend=backend)
            own = vars(model)["_compiled_call_impl"]
            out = model(torch.randn(8, 4))  # <model.compile forward>
            other(torch.randn(8, 4))
            loss = out.pow(2).mean()
            loss.backward(retain_graph=True)
            opt.step()
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
        assert calls == [1, 1]  # both ran their compiled graphs (no eager fallback)
        assert vars(model)["_compiled_call_impl"] is own  # kept on the instance, as plain
        assert [e.label for e in w.ledger.events if e.kind == "forward"] == ["forward #1"]
        (h,) = seen[0].hazards
        assert (h.tensor, h.module) == ("model.body.2.weight", "model")
        forward_line = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                            if line.rstrip().endswith("# <model.compile forward>"))
        assert (h.saved_during or "").startswith("forward #1 at ")
        assert (h.saved_during or "").endswith(f"{Path(__file__).name}:{forward_line}")
    finally:
        torch._dynamo.reset()


@pytest.mark.compile
def test_submodule_compiled_in_place_runs_compiled_under_watch_all() -> None:
    """A submodule's own compiled call (``module.compile()``, before or after its root was
    adopted) is what its calls run under ``watch_all``, as unwatched."""
    torch._dynamo.reset()
    try:
        calls: list[int] = []
        early, late = nn.Sequential(_Net()), nn.Sequential(_Net())
        early[0].compile(backend=_counting(calls))
        with versionwatch.watch_all() as w:
            early(torch.randn(2, 4))
            late(torch.randn(2, 4))  # adopted: its body is seen uncompiled
            late[0].compile(backend=_counting(calls))
            late(torch.randn(2, 4))
            early(torch.randn(2, 4))
        # torch 2.4's dynamo also runs copies of the submodules it traced, which
        # watch_all adopts (as it does for torch.compile(model)): not this test's point.
        assert {"early", "late"} <= set(w.roots)
        assert calls == [1, 1, 1]
    finally:
        torch._dynamo.reset()


def _compiled_training_step(watched: bool) -> tuple[Any, ...]:
    """Three calls of a compiled step that runs backward and grad inside (aot_eager)."""
    import warnings

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        out.pow(2).mean().backward(retain_graph=True)
        torch.autograd.backward(out.sum(), retain_graph=True)
        (g,) = torch.autograd.grad(out.abs().mean(), [x])
        return g

    compiled = torch.compile(step, backend="aot_eager")
    w = versionwatch.watch(model, opt) if watched else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = []
            for _ in range(3):
                grads.append(compiled(torch.randn(2, 4, requires_grad=True)))
                opt.step()
                opt.zero_grad()
    finally:
        if w is not None:
            w.close()
    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            [str(c.message) for c in caught], [g.tolist() for g in grads],
            [p.tolist() for p in model.parameters()], w.backward_count if w else 9)


@pytest.mark.compile
def test_compiled_step_with_backward_inside_is_as_plain() -> None:
    """Issue #23, item 4: dynamo does not trace into our backward stand-in (no extra graph,
    break or warning), and AOT autograd's own grad while compiling is no backward of ours."""
    *plain, _ = _compiled_training_step(watched=False)
    graphs, breaks, caught, grads, params, backwards = _compiled_training_step(watched=True)
    assert [graphs, breaks, caught, grads, params] == plain
    assert backwards == 9  # three per call, none counted while compiling


def _amp_step_between(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    # Linear runs in bf16: autocast saves the weight's cast, which step() leaves alone.
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    scaler.scale(loss).backward(retain_graph=True)
    scaler.step(opt)
    scaler.update()
    loss.backward()


def _amp_fp32_op_step_between(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    # An op autocast leaves in float32 saves the parameter itself: step() breaks it.
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[1](model[0](torch.randn(8, 4)))
        loss = (h.float() * model[0].bias).pow(2).mean()
    scaler.scale(loss).backward(retain_graph=True)
    scaler.step(opt)
    scaler.update()
    loss.backward()


def _amp_loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="no torch.amp.GradScaler")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_autocast_grad_scaler(strict: bool) -> None:
    assert not _agrees(_amp_step_between, strict)
    assert not _agrees(_amp_loop, strict)
    seen = _agrees(_amp_fp32_op_step_between, strict)
    assert seen[0].hazards[0].tensor == "model.0.bias"


# -- activation checkpointing and save_on_cpu -------------------------------------------

def _checkpointed(reentrant: bool, whole: bool) -> Body:
    def body(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        x = torch.randn(8, 4, requires_grad=True)
        if whole:  # recomputed in backward, with the weights of that moment
            loss = checkpoint(model, x, use_reentrant=reentrant).pow(2).mean()
        else:  # model.2 runs outside the checkpoint and saves its weight plainly
            h = checkpoint(model[0], x, use_reentrant=reentrant)
            loss = model[2](h.tanh()).pow(2).mean()
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()

    return body


def _step_after_save_on_cpu(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with save_on_cpu():
        loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(retain_graph=True)
    opt.step()
    loss.backward()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_checkpoint_and_save_on_cpu_no_false_alarm(strict: bool) -> None:
    # Outside the checkpoint, model.2.weight was saved plainly: step() breaks it.
    for reentrant in (True, False):
        whole = _checkpointed(reentrant, whole=True)
        if strict and not reentrant and (CHECKPOINT_SLOTS_SHOWN or CHECKPOINT_HOLDER_PEEKED):
            # The step changes the weights that the recomputation reads: PyTorch raises
            # nothing, and strict mode reports it (tests/test_silent_checkpoint.py).
            got, reports = _watched(whole, strict)
            assert got == _real(whole) is None
            assert reports and {h.cause for r in reports for h in r.hazards} == {"checkpoint"}
        else:
            assert not _agrees(whole, strict)
        seen = _agrees(_checkpointed(reentrant, whole=False), strict)
        assert [r.hazards[0].tensor for r in seen] == ["model.2.weight"]
    assert not _agrees(_step_after_save_on_cpu, strict)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_counts_what_it_cannot_verify(reentrant: bool) -> None:
    model = _mlp()
    x = torch.randn(8, 4, requires_grad=True)
    loss = model[2](checkpoint(model[0], x, use_reentrant=reentrant).tanh()).sum()
    report = versionwatch.check(loss, names=model)
    assert report.ok and report.unverifiable
    expected = ([("CheckpointFunctionBackward", "recomputed forward")] if reentrant
                else [("AddmmBackward0", "mat1"), ("AddmmBackward0", "mat2")])
    assert report.unverifiable == expected
    # A reentrant checkpoint hooks nothing: the old "(behind saved_tensors_hooks)" was wrong.
    why = "a reentrant checkpoint reruns its forward" if reentrant else "behind saved_tensors_hooks"
    if not reentrant and (CHECKPOINT_SLOTS_SHOWN or CHECKPOINT_HOLDER_PEEKED):
        assert str(report).endswith(
            f", {len(expected)} saved tensors inside checkpoint(use_reentrant=False) not "
            "verified: pytest --versionwatch-strict checks them")
    else:
        assert str(report).endswith(f", {len(expected)} not verifiable ({why})")
    with save_on_cpu():
        loss = model(x).sum()
    report = versionwatch.check(loss, names=model)
    assert report.ok and report.saved_checked == 0 and len(report.unverifiable) == 5
