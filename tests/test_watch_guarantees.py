"""watch(): what it promises not to do. It changes no number, leaks nothing, and
leaves nothing behind when it closes, however it closes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.optim.optimizer as optim_mod
from torch import nn

import versionwatch
from versionwatch import InplaceModificationError
from versionwatch._runtime import installed

ORIGINAL_BACKWARD = torch.autograd.backward
ORIGINAL_GRAD = torch.autograd.grad
ORIGINAL_ZERO_GRAD = torch.optim.Optimizer.zero_grad
ORIGINAL_CALL_IMPL = vars(nn.Module)["_call_impl"]
ORIGINAL_COMPILED_CALL_IMPL = vars(nn.Module)["_compiled_call_impl"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VERSIONWATCH_ON_HAZARD", raising=False)
    assert_unpatched()
    yield
    assert_unpatched()


def assert_unpatched() -> None:
    assert torch.autograd.backward is ORIGINAL_BACKWARD
    assert torch.autograd.grad is ORIGINAL_GRAD
    assert torch.optim.Optimizer.zero_grad is ORIGINAL_ZERO_GRAD
    assert vars(nn.Module)["_call_impl"] is ORIGINAL_CALL_IMPL
    assert vars(nn.Module)["_compiled_call_impl"] is ORIGINAL_COMPILED_CALL_IMPL
    assert installed() == {}  # no patch, route, registry entry or hook entry of ours
    assert not any("_compiled_call_impl" in vars(c) for c in (nn.Sequential, nn.Linear))
    assert not optim_mod._global_optimizer_pre_hooks
    assert not optim_mod._global_optimizer_post_hooks
    from versionwatch._watch import intercept as _intercept

    table = torch.jit._builtins._get_builtin_table()
    assert id(_intercept.backward) not in table and id(_intercept.grad) not in table


def assert_no_module_hooks(model: nn.Module) -> None:
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not getattr(m, "_forward_hooks_always_called", {})


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def stale_loss(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    out = model(torch.randn(8, 4))
    first, second = out.pow(2).mean(), out.abs().mean()
    first.backward(retain_graph=True)
    opt.step()
    return second


# --- 2. bitwise-identical training ------------------------------------------------

def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 3),
    )


class SmallTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                           dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cnn": (small_cnn, (4, 3, 8, 8)),
    "transformer": (SmallTransformer, (4, 5, 32)),
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
}


def train(model_name: str, opt_name: str, watched: bool, steps: int = 50):
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    opt = OPTIMIZERS[opt_name](model.parameters())
    data = torch.Generator().manual_seed(1)
    w = versionwatch.watch(model, opt) if watched else None
    try:
        torch.manual_seed(2)  # dropout draws the same masks in both runs
        for _ in range(steps):
            x = torch.randn(*shape, generator=data)
            y = torch.randint(0, 3, (shape[0],), generator=data)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    finally:
        if w is not None:
            assert len(w.reports) == 0
            assert sum(ev.kind == "step" for ev in w.ledger.events) == min(steps, 512)
            w.close()
    return model


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Two runs of 50 steps are quick on one thread; two threads fight the rest of a CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_bitwise_identical_after_50_steps(model_name: str, opt_name: str):
    plain = train(model_name, opt_name, watched=False)
    watched = train(model_name, opt_name, watched=True)
    pairs = list(zip(plain.state_dict().items(), watched.state_dict().items()))
    assert pairs
    for (name, a), (name_w, b) in pairs:
        assert name == name_w
        assert torch.equal(a, b), name
    params = list(zip(plain.named_parameters(), watched.named_parameters()))
    for (name, a), (_, b) in params:
        assert a.grad is not None and b.grad is not None, name
        assert torch.equal(a.grad, b.grad), name
        assert a._version == b._version, name  # the watcher wrote nothing in place


# --- 3. no leaks ------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_two_thousand_steps_stay_bounded():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def snapshot(w: versionwatch.Watcher) -> dict[str, int]:
        gc.collect()  # earlier tests' garbage with finalizers goes whenever the GC runs
        return {
            "events": len(w.ledger.events),
            "versions": len(w.ledger.versions),
            "history": sum(len(tr.history) for tr in w.ledger.tracked.values()),
            "tracked": len(w.ledger.tracked),
            "names": len(w.ledger.by_name),
            "reports": len(w.reports),
            "finalizers": len(getattr(weakref.finalize, "_registry", ())),
        }

    with versionwatch.watch(model, opt) as w:
        for step in range(1, 2001):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if step == 500:
                del loss
                at_500, tensors_500, rss_500 = snapshot(w), live_tensors(), rss_bytes()
        del loss
        at_2000, tensors_2000, rss_2000 = snapshot(w), live_tensors(), rss_bytes()
    assert at_2000 == at_500
    assert at_2000["tracked"] == 4 and at_2000["reports"] == 0
    assert at_2000["events"] <= 512
    assert at_2000["history"] <= 4 * 256
    assert tensors_2000 <= tensors_500 + 5
    assert rss_2000 - rss_500 < 64 * 2**20


class Marker(torch.Tensor):
    """A tensor subclass, so that the test can find every live instance."""


class Twice(torch.autograd.Function):
    """A custom node: unlike built-in nodes, its Python object can be weakly referenced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 + x * 0


class Refs:
    """Weak references to a saved activation and to an autograd node of one graph."""

    def __init__(self, tensor: torch.Tensor, node: Any) -> None:
        self.tensor = weakref.ref(tensor)
        self.node = weakref.ref(node)

    def alive(self) -> tuple[bool, bool]:
        gc.collect()
        return self.tensor() is not None, self.node() is not None


def graph_with_marked_activation(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, Refs]:
    h = model[0](torch.randn(8, 4)).as_subclass(Marker)
    mid = Twice.apply(torch.tanh(h))  # TanhBackward0 saves its result; the next mul saves h
    out = model[2](mid * h)
    refs = Refs(h, mid.grad_fn)
    first, second = out.pow(2).mean(), out.abs().mean()
    return first, second, refs


def marked_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Marker)


def test_graph_is_freed_after_a_watched_backward():
    model = mlp()
    with versionwatch.watch(model):
        first, second, refs = graph_with_marked_activation(model)
        first.backward(retain_graph=True)
        assert refs.alive() == (True, True)  # the retained graph still holds them
        del first
        assert refs.alive() == (True, True)  # second still needs them
        second.backward(retain_graph=True)
        del second
        assert refs.alive() == (False, False)
        assert marked_alive() == 0


def test_graph_is_freed_after_a_backward_that_raised():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt) as w:
        first, second, refs = graph_with_marked_activation(model)
        first.backward(retain_graph=True)
        opt.step()
        kept = None
        try:
            second.backward()
        except InplaceModificationError as e:
            kept = e.with_traceback(None)  # a user may keep the error and its report
        assert kept is not None and kept.report.hazards[0].tensor == "model.2.weight"
        assert refs.alive() == (True, True)  # the graph was not run, so still there
        del first, second
        assert refs.alive() == (False, False)
        assert marked_alive() == 0
    assert len(w.reports) == 1  # the report outlives the graph


def test_graph_is_freed_after_pytorchs_own_error():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch(model, opt, on_hazard="warn"):
        first, second, refs = graph_with_marked_activation(model)
        first.backward(retain_graph=True)
        opt.step()
        kept = None
        with pytest.warns(versionwatch.InplaceHazardWarning):
            try:
                second.backward()
            except RuntimeError as e:
                kept = e.with_traceback(None)
        assert kept is not None and getattr(kept, "__notes__", None)
        del first, second
        assert refs.alive() == (False, False)
        assert marked_alive() == 0


# --- 6. cleanup -------------------------------------------------------------------

class Boom(Exception):
    pass


@pytest.mark.parametrize("how", ["normal", "exception", "keyboard_interrupt",
                                 "interrupt_in_forward", "interrupt_in_backward"])
def test_everything_is_removed_on_exit(how: str):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    expected: type[BaseException] | None = {
        "normal": None, "exception": Boom,
    }.get(how, KeyboardInterrupt)
    try:
        with versionwatch.watch(model, opt) as w:
            assert torch.autograd.backward is not ORIGINAL_BACKWARD
            assert torch.autograd.grad is not ORIGINAL_GRAD
            assert torch.optim.Optimizer.zero_grad is not ORIGINAL_ZERO_GRAD
            assert optim_mod._global_optimizer_pre_hooks
            assert optim_mod._global_optimizer_post_hooks
            # Forwards are seen through a class attribute of the root's class,
            # not by hooks that a copy, a pickle or a script of the model would
            # carry; nn.Module's own is left alone (watch_all's is the exception).
            assert "_compiled_call_impl" in vars(nn.Sequential)
            assert vars(nn.Module)["_compiled_call_impl"] is ORIGINAL_COMPILED_CALL_IMPL
            assert "_compiled_call_impl" not in vars(nn.Linear)
            assert_no_module_hooks(model)
            loss = model(torch.randn(8, 4)).sum()
            if how == "exception":
                raise Boom
            if how == "keyboard_interrupt":
                raise KeyboardInterrupt
            if how == "interrupt_in_forward":
                model[1].register_forward_hook(interrupt)
                model(torch.randn(8, 4))
            if how == "interrupt_in_backward":
                loss.register_hook(interrupt)
            loss.backward()
            opt.step()
    except BaseException as e:
        assert expected is not None and type(e) is expected
    else:
        assert expected is None
    assert w.closed
    assert_unpatched()
    model[1]._forward_hooks.clear()  # the test's own hook, if any
    assert_no_module_hooks(model)
    # Fresh watchers in this thread still work: nothing was left half-done.
    with versionwatch.watch(model, opt):
        loss = stale_loss(model, opt)
        with pytest.raises(InplaceModificationError):
            loss.backward()


@pytest.mark.parametrize("fails_at", ["optimizer", "strict"])
def test_a_watch_that_fails_to_open_leaves_nothing_installed(fails_at: str,
                                                              monkeypatch: pytest.MonkeyPatch):
    """Whatever __init__ took before it raised (routes, patches, strict mode) is given back."""
    model = mlp()
    if fails_at == "optimizer":  # refused after the model's route is placed
        with pytest.raises(ValueError, match="belong to the watched modules"):
            versionwatch.watch(model, torch.optim.SGD(mlp().parameters(), lr=0.1))
    else:  # refused after the patches, the registry entry and strict mode's patches
        from versionwatch._strict import hookstack as _hookstack

        def refuse() -> None:
            raise Boom("no hook entry")

        monkeypatch.setattr(_hookstack, "push", refuse)
        with pytest.raises(Boom):
            versionwatch.watch(model, strict=True)
    assert_unpatched()
    assert torch.relu_ is torch._C._VariableFunctions.relu_  # strict's wrappers came off
    assert_no_module_hooks(model)


def test_close_twice_and_close_without_with():
    model = mlp()
    w = versionwatch.watch(model)
    assert torch.autograd.backward is not ORIGINAL_BACKWARD
    w.close()
    w.close()
    assert_unpatched()
    assert_no_module_hooks(model)


def test_a_patched_function_kept_after_close_still_works():
    """``from torch.autograd import backward`` inside a watch block keeps our wrapper."""
    model = mlp()
    with versionwatch.watch(model):
        backward, grad = torch.autograd.backward, torch.autograd.grad
    x = torch.ones(3, requires_grad=True)
    backward((x * 2).sum())
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    (g,) = grad((x * 3).sum(), [x])
    assert torch.equal(g, torch.full((3,), 3.0))


def test_nested_watchers_on_two_models():
    outer_model, inner_model = mlp(), mlp()
    outer_opt = torch.optim.SGD(outer_model.parameters(), lr=0.1)
    inner_opt = torch.optim.Adam(inner_model.parameters(), lr=0.1)
    with versionwatch.watch({"outer": outer_model}, outer_opt) as outer:
        with versionwatch.watch({"inner": inner_model}, inner_opt) as inner:
            loss = stale_loss(inner_model, inner_opt)
            with pytest.raises(InplaceModificationError) as info:
                loss.backward()
            assert info.value.report.hazards[0].tensor == "inner.2.weight"
            assert [m.description for m in info.value.report.hazards[0].modified_by] == [
                "inner_opt.step() #1"]
            # The outer model trains while the inner watcher is open.
            outer_loss = stale_loss(outer_model, outer_opt)
            with pytest.raises(InplaceModificationError) as info:
                outer_loss.backward()
            h = info.value.report.hazards[0]
            assert h.tensor == "outer.2.weight"
            assert [m.description for m in h.modified_by] == ["outer_opt.step() #1"]
        assert inner.closed and not outer.closed
        assert_no_module_hooks(inner_model)
        assert "_compiled_call_impl" in vars(type(outer_model))
        assert torch.autograd.backward is not ORIGINAL_BACKWARD
        assert optim_mod._global_optimizer_pre_hooks
        loss = stale_loss(outer_model, outer_opt)
        with pytest.raises(InplaceModificationError) as info:
            loss.backward()
        h = info.value.report.hazards[0]
        assert h.tensor == "outer.2.weight"
        assert [m.description for m in h.modified_by] == ["outer_opt.step() #2"]
    assert all(r.hazards[0].tensor.startswith("inner.") for r in inner.reports)
    assert all(r.hazards[0].tensor.startswith("outer.") for r in outer.reports)
    assert_no_module_hooks(outer_model)


def test_two_watchers_in_two_threads():
    steps = {"left": 7, "right": 11}
    barrier = threading.Barrier(2, timeout=30)
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            torch.manual_seed(len(name))
            model = mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with versionwatch.watch({name: model}, opt) as w:
                barrier.wait()  # both watchers open at once
                for _ in range(steps[name]):
                    opt.zero_grad()
                    model(torch.randn(8, 4)).pow(2).mean().backward()
                    opt.step()
                loss = stale_loss(model, opt)
                try:
                    loss.backward()
                except InplaceModificationError as e:
                    results[name] = (e.report, w)
                barrier.wait()  # neither closes before the other raised
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n,)) for n in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert set(results) == set(steps)
    for name, (report, w) in results.items():
        h = report.hazards[0]
        assert h.tensor == f"{name}.2.weight"
        assert [m.description for m in h.modified_by] == [f"opt.step() #{steps[name] + 1}"]
        assert list(w.reports) == [report]
        assert all(tr.name.startswith(f"{name}.") for tr in w.ledger.tracked.values())
        assert sum(ev.kind == "backward" for ev in w.ledger.events) == steps[name] + 2
        assert sum(ev.kind == "step" for ev in w.ledger.events) == steps[name] + 1


# --- 7. transparency: inference mode, torch.func, TorchScript ------------------------

def test_inference_mode_with_enable_grad_inside():
    def run(watched: bool) -> tuple[torch.Tensor, bool, bool]:
        torch.manual_seed(0)
        model = mlp()
        with versionwatch.watch(model) if watched else contextlib.nullcontext():
            with torch.inference_mode(), torch.enable_grad():
                out = model(torch.ones(2, 4))
            again = model(torch.ones(2, 4))  # the watcher still records forwards after
        return out, out.requires_grad, again.requires_grad

    plain, watched = run(False), run(True)
    assert torch.equal(plain[0], watched[0]) and plain[1:] == watched[1:]


TRANSFORMS = ["grad", "vjp", "jacrev", "hessian", "vmap_grad", "vmap_functional_call"]


def _transform(name: str, model: nn.Module, x: torch.Tensor) -> Any:
    from torch.func import functional_call, grad, hessian, jacrev, vjp, vmap

    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).pow(2).sum()

    def f(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    if name == "grad":
        return grad(loss)(params, x)
    if name == "vjp":
        return vjp(f, x)[1](torch.tensor(1.0))
    if name == "jacrev":
        return jacrev(f)(x)
    if name == "hessian":
        return hessian(f)(x[0])
    if name == "vmap_grad":
        return vmap(grad(f))(x)
    return vmap(lambda xi: functional_call(model, params, (xi,)))(x)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_torch_func_transforms_run_as_unwatched(name: str, caplog: pytest.LogCaptureFixture):
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(3, 4)
    plain = _transform(name, model, x)
    with caplog.at_level("DEBUG", logger="versionwatch"):
        with versionwatch.watch(model) as w:
            watched = _transform(name, model, x)
            _transform(name, model, x)
            # Outside the transform the watcher is back: a stale backward is caught.
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with pytest.raises(InplaceModificationError):
                stale_loss(model, opt).backward()
    flat_plain, _ = torch.utils._pytree.tree_flatten(plain)
    flat_watched, _ = torch.utils._pytree.tree_flatten(watched)
    assert len(flat_plain) == len(flat_watched)
    assert all(torch.equal(a, b) for a, b in zip(flat_plain, flat_watched))
    # No forward or backward of the transforms reached the ledger: only the stale story.
    assert [ev.label for ev in w.ledger.events if ev.kind in ("forward", "backward")] == [
        "forward #1", "backward #1", "backward #2"]
    said = [r for r in caplog.records if "torch.func" in r.getMessage()]
    stepped = name != "vmap_functional_call"  # a forward alone runs no backward
    assert len(said) == (1 if stepped else 0)
    assert all(r.levelname == "DEBUG" for r in said)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_compiles_autograd_calls_while_watched():
    def make() -> Any:
        @torch.jit.script
        def f(x: torch.Tensor):  # type: ignore[no-untyped-def]
            return torch.autograd.grad([(x * x).sum()], [x])

        return f

    model = mlp()
    with versionwatch.watch(model):
        f = make()
        x = torch.ones(3, requires_grad=True)
        (g,) = f(x)
        assert torch.equal(g, torch.full((3,), 2.0))
        # The watcher's own wrappers still predict plain calls.
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(InplaceModificationError):
            stale_loss(model, opt).backward()
    assert "aten::grad" in f.graph.str()
    (g,) = f(torch.ones(3, requires_grad=True))
    assert torch.equal(g, torch.full((3,), 2.0))


def test_watch_all_adopts_no_module_inside_torch_func():
    """functional_call swaps a module's parameters for functorch wrappers while it runs."""
    from torch.func import functional_call, grad

    model, x = mlp(), torch.randn(3, 4)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    with versionwatch.watch_all() as w:
        grad(lambda p: functional_call(model, p, (x,)).sum())(params)
        assert not w.ledger.tracked
        model(x).sum().backward()
        tracked = [tr.ref() for tr in w.ledger.tracked.values()]
    assert len(tracked) == 4
    assert all(any(t is p for p in model.parameters()) for t in tracked)


_WRAPPED_FIRST = '''
import functools, sys
import torch

real = torch.autograd.backward
if sys.argv[1] == "wraps":
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        return real(*args, **kwargs)
else:
    def wrapper(*args, **kwargs):  # says nothing of what it wraps
        return real(*args, **kwargs)
torch.autograd.backward = wrapper  # a profiler or harness, before versionwatch is imported

import versionwatch

runs = []
with versionwatch.watch_all(on_hazard=lambda r: print("predicted:", r.hazards[0].kind)):
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: runs.append(1))
    (x * 2).sum().backward()
    print("engine runs:", len(runs))
    y = x.exp()
    y.add_(1)
    try:
        y.sum().backward()
    except RuntimeError as e:
        print("raised:", str(e)[:40])
'''


@pytest.mark.parametrize("kind", ["wraps", "bare"])
def test_backward_wrapped_before_import_runs_once(tmp_path, kind):
    """A wrapper installed before versionwatch is never run by a prediction."""
    script = tmp_path / "wrapped_first.py"
    script.write_text(_WRAPPED_FIRST)
    out = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "engine runs: 1" in lines
    assert "raised: one of the variables needed for gradient" in lines
    # Through __wrapped__ the call is still predicted; a wrapper that hides what it
    # wraps leaves the call unpredicted, and PyTorch's error still reaches the user.
    assert ("predicted: inplace" in lines) == (kind == "wraps")
    said = "calls to torch.autograd.backward are not predicted"
    assert out.stderr.count(said) == (kind == "bare"), out.stderr


# --- a program that watches its own model, run under watch_all (issue #23, item 2) ----

def forward_labels(w: versionwatch.Watcher) -> list[str]:
    return [e.label for e in w.ledger.events if e.kind == "forward"]


@pytest.mark.parametrize("ran_first", [True, False], ids=["adopted", "not-yet-run"])
@pytest.mark.parametrize(("auto_strict", "own_strict"),
                         [(False, False), (True, False), (False, True), (True, True)])
def test_own_watcher_inside_watch_all_borrows_the_model(ran_first: bool, auto_strict: bool,
                                                        own_strict: bool):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with versionwatch.watch_all(strict=auto_strict) as auto:
        if ran_first:
            model(torch.randn(2, 4))
            assert list(auto.roots) == ["model"]
        with versionwatch.watch(model, opt, strict=own_strict) as own:
            loss = stale_loss(model, opt)
            with pytest.raises(InplaceModificationError) as info:
                loss.backward()
            # Each forward is the borrower's alone; the lender records none meanwhile.
            assert forward_labels(own) == ["forward #1"]
        report = info.value.report
        assert report.hazards[0].tensor == "model.2.weight"
        assert list(own.reports) == [report]
        # The run's report (versionwatch run's JSON) holds it, once.
        assert [r for r in auto.reports] == [report]
        before = len(forward_labels(auto))
        assert before == (1 if ran_first else 0)
        model(torch.randn(2, 4))  # given back: the automatic watcher sees it again
        assert forward_labels(auto)[before:] == ["model.forward #2" if ran_first
                                                 else "model.forward #1"]
        assert list(auto.roots) == ["model"]
        with versionwatch.watch(model):  # and lends it again
            with pytest.raises(ValueError, match="already watched"):
                versionwatch.watch({"again": model})  # two explicit watchers: refused
    assert_no_module_hooks(model)


def test_watch_all_closed_before_the_borrower_is_left_closed():
    model = mlp()
    auto = versionwatch.watch_all()
    model(torch.randn(2, 4))
    own = versionwatch.watch(model)
    auto.close()
    own.close()  # gives nothing back to a closed watcher
    assert installed() == {}


# --- a watcher dropped without close() (issue #23) -------------------------------

@pytest.mark.parametrize("how", ["never_entered", "used", "strict", "repair", "watch_all"])
def test_a_watcher_dropped_without_close_is_collected_and_lets_its_model_go(how: str):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def drop() -> weakref.ref[versionwatch.Watcher]:
        if how == "watch_all":
            w: versionwatch.Watcher = versionwatch.watch_all()
        else:
            w = versionwatch.watch(model, opt, strict=how == "strict",
                                   on_hazard="repair" if how == "repair" else "raise")
        if how != "never_entered":
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        return weakref.ref(w)

    ref = drop()
    gc.collect()
    assert ref() is None, gc.get_referrers(ref()) if ref() is not None else None
    assert installed() == {}  # its __del__ closed it: nothing of ours is left
    with versionwatch.watch(model, opt) as again:  # the model can be watched again
        model(torch.randn(2, 4)).sum().backward()
    assert again.backward_count == 1


def test_a_borrower_dropped_without_close_gives_the_model_back():
    model = mlp()
    with versionwatch.watch_all() as auto:
        model(torch.randn(2, 4))
        ref = weakref.ref(versionwatch.watch(model))
        gc.collect()
        assert ref() is None
        model(torch.randn(2, 4))
        assert [e.label for e in auto.ledger.events if e.kind == "forward"] == [
            "model.forward #1", "model.forward #2"]


COMPILED_STEP = """\
import re, sys, warnings
import torch
from torch import nn

mode = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


@torch.compile(backend="eager")
def train_step(x):  # the first module call of the thread runs inside the trace
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()  # a graph break, as in a plain run
    opt.step()
    return loss


with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    if mode == "plain":
        for _ in range(3):
            train_step(torch.randn(3, 4))
    else:
        import versionwatch
        with versionwatch.watch(model, opt, strict=mode == "strict") as w:
            for _ in range(3):
                train_step(torch.randn(3, 4))
        assert not w.reports
for m in got:
    print(m.category.__name__, str(m.message).splitlines()[0])
print(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
"""


def test_a_compiled_train_step_says_under_a_watch_what_it_says_plain(tmp_path):
    """zero_grad(), backward() and step() inside a torch.compile'd function: dynamo
    traced our step hooks and warned at sys._getframe, and strict mode's module
    call wrapper failed dynamo's guard when the thread's first module call was in
    the trace. Warnings, torch's log lines and the weights: the same as plain."""
    (tmp_path / "compiled_step.py").write_text(COMPILED_STEP)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src}
    said = {}
    for mode in ("plain", "default", "strict"):
        r = subprocess.run([sys.executable, "compiled_step.py", mode], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{mode}: {r.stderr[-3000:]}"
        # torch's log lines carry a time, a process id and the number of the
        # frame dynamo compiled (strict mode's graph breaks number them apart).
        log = [re.sub(r"^\[\d+/\d+\] ", "", line.split("] ", 1)[-1])
               for line in r.stderr.splitlines()]
        said[mode] = (r.stdout, log)
    assert said["default"] == said["plain"]
    assert said["strict"] == said["plain"]
