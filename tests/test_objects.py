"""Objects that leave a watcher carry nothing of ours, and a watcher holds nothing.

A watched model pickles (``torch.save``, ``torch.multiprocessing.spawn``),
deep-copies (EMA, best checkpoints) and scripts exactly as the plain model does,
because the watcher stores nothing on it; an open watcher keeps no deleted model
alive.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import pickle
import subprocess
import sys
import textwrap
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import InplaceModificationError
from versionwatch._runtime import installed

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
              "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_load_state_dict_pre_hooks")
MODES = ["watch", "watch_strict", "watch_all", "watch_all_strict"]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@contextlib.contextmanager
def watched(mode: str, model: nn.Module) -> Iterator[versionwatch.Watcher]:
    strict = mode.endswith("_strict")
    w = (versionwatch.watch_all(strict=strict) if mode.startswith("watch_all")
         else versionwatch.watch(model, strict=strict))
    with w:
        yield w


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()


def hooks_of(model: nn.Module) -> list[dict[str, int]]:
    return [{d: len(getattr(m, d, {})) for d in HOOK_DICTS} for m in model.modules()]


def assert_registry_empty() -> None:
    assert installed() == {}  # no route, adopter, patch or watcher of ours is left


def test_pickle_and_torch_save_inside_a_watch(tmp_path: Path):
    """The pickle of a watched model is the plain model's pickle, to the byte."""
    files = []
    for mode in MODES:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watched(mode, model) as w:
            train_step(model, opt)
            assert w.forwards  # the forward was seen: the model is watched
            inside = pickle.dumps(model)
            with_opt = pickle.dumps((model, opt))
            buf = io.BytesIO()
            torch.save(model, buf)  # what word_language_model does with its best model
        assert pickle.dumps(model) == inside
        assert pickle.dumps((model, opt)) == with_opt
        assert b"versionwatch" not in inside and b"versionwatch" not in buf.getvalue()
        expected = model(torch.ones(1, 4)).item()
        (tmp_path / f"{mode}.pkl").write_bytes(inside)
        (tmp_path / f"{mode}.pt").write_bytes(buf.getvalue())
        files.append((mode, expected))
    assert_registry_empty()
    # A fresh interpreter that never imports versionwatch loads them all.
    code = textwrap.dedent(f"""\
        import pickle, sys, torch
        for mode, expected in {files!r}:
            a = pickle.loads(open(mode + ".pkl", "rb").read())
            b = torch.load(mode + ".pt", weights_only=False)
            for m in (a, b):
                assert m(torch.ones(1, 4)).item() == expected, mode
        assert "versionwatch" not in sys.modules
        print("loaded", len({files!r}))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"loaded {len(MODES)}"


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_inside_a_watch_carries_nothing(mode: str):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = hooks_of(copy.deepcopy(model))
    with watched(mode, model) as w:
        train_step(model, opt)
        ema = copy.deepcopy(model)  # an EMA or best-checkpoint copy
        best = copy.deepcopy(model)
        assert hooks_of(ema) == plain == hooks_of(model)
        before = dict(w.forwards)
        with torch.no_grad():
            best(torch.randn(2, 4))
        if mode.startswith("watch_all"):
            # A copy that runs is a model of its own, under its own name.
            assert w.forwards == {**before, "best": 1}
            assert "best.0.weight" in w.ledger.by_name
        else:
            assert w.forwards == before  # the copy is not the watched model
        # The original is still watched: a stale backward is still predicted.
        out = model(torch.randn(8, 4))
        out.sum().backward(retain_graph=True)
        opt.step()
        with pytest.raises(InplaceModificationError):
            out.pow(2).sum().backward()
    assert_registry_empty()
    # After the watch, the copies save, script and run with nothing of ours.
    for m in (ema, best):
        assert b"versionwatch" not in pickle.dumps(m)
        x = torch.randn(3, 4)
        assert torch.equal(torch.jit.script(m)(x), m(x))


@pytest.mark.parametrize("mode", MODES)
def test_script_inside_a_watch(mode: str):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watched(mode, model) as w:
        train_step(model, opt)
        scripted = torch.jit.script(model)  # no backward needed to fail before
        x = torch.randn(3, 4)
        assert torch.equal(scripted(x), model(x))
        if mode.startswith("watch_all"):
            # A scripted module run under watch_all is adopted, not refused; it
            # shares the model's parameters, which keep their first names.
            assert w.forwards["scripted"] == 1 and "model.0.weight" in w.ledger.by_name
    assert_registry_empty()


def test_watching_a_script_module_says_what_to_watch_instead():
    model = mlp()
    for scripted in (torch.jit.script(model), torch.jit.trace(model, torch.randn(2, 4))):
        with pytest.raises(TypeError, match=r"cannot watch 'scripted', a ScriptModule .*"
                                             r"Watch the module you scripted"):
            versionwatch.watch(scripted)
    assert_registry_empty()  # refused before anything was installed


def test_a_compiled_module_is_named_as_the_user_writes_it():
    torch._dynamo.reset()
    model = mlp()
    cm = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    with versionwatch.watch(cm, opt) as w:
        assert sorted(w.ledger.by_name) == ["cm.0.bias", "cm.0.weight", "cm.2.bias",
                                            "cm.2.weight"]
        out = cm(torch.randn(8, 4))
        out.sum().backward(retain_graph=True)
        opt.step()
        with pytest.raises(InplaceModificationError) as info:
            out.pow(2).sum().backward()
    assert info.value.report.hazards[0].tensor == "cm.2.weight"
    # A compiled submodule: model.enc.weight, as attribute access spells it.
    outer = nn.Sequential()
    outer.enc = torch.compile(nn.Linear(2, 2), backend="eager")
    assert outer.enc.weight is outer.enc._orig_mod.weight
    report = versionwatch.check(outer.enc(torch.ones(1, 2)).sum(), names=outer)
    assert report.ok
    assert set(versionwatch._naming.resolve_names(outer).values()) == {"enc.weight", "enc.bias"}


def test_a_compiled_function_is_not_recompiled_for_each_module_nor_after_a_watch():
    torch._dynamo.reset()

    def f(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).sum()

    g = torch.compile(f, backend="eager", fullgraph=True)
    a, b = mlp(), mlp()
    with versionwatch.watch_all():
        g(a, torch.ones(2, 4))
        with torch._dynamo.config.patch(error_on_recompile=True):
            # The forward route asks is_dynamo_compiling() before id(module),
            # which would make the trace guard on the first module.
            assert torch.equal(g(b, torch.ones(2, 4)), f(b, torch.ones(2, 4)))
        # No global module hook either, which makes torch.compile'd modules warn.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cm = torch.compile(mlp(), backend="eager")
            cm(torch.ones(2, 4))
    with torch._dynamo.config.patch(error_on_recompile=True):
        # Nor is the code compiled inside the watch stale once it closed.
        assert torch.equal(g(a, torch.ones(2, 4)), f(a, torch.ones(2, 4)))


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_an_open_watcher_keeps_no_deleted_model_alive(strict: bool):
    with versionwatch.watch_all(strict=strict) as w:
        refs = []
        for _ in range(3):  # a sweep: many models in one watch_all()
            model = mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            train_step(model, opt)
            opt.zero_grad(set_to_none=False)  # the path that notes each param's grad
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            refs += [weakref.ref(model), weakref.ref(model[0].weight), weakref.ref(opt)]
            del model, opt
            gc.collect()
            assert [r() for r in refs] == [None] * len(refs)
        assert len(w.roots) == 3  # they were watched
    assert_registry_empty()


def test_torch_multiprocessing_spawn_under_versionwatch_run(tmp_path: Path):
    (tmp_path / "hogwild.py").write_text(textwrap.dedent("""\
        import torch
        import torch.multiprocessing as mp

        def work(rank, model, q):
            with torch.no_grad():
                q.put(model(torch.ones(1, 2)).item())

        if __name__ == "__main__":
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            q = mp.get_context("spawn").SimpleQueue()
            mp.spawn(work, args=(model, q), nprocs=1, join=True)
            with torch.no_grad():
                print(q.get() == model(torch.ones(1, 2)).item())
    """))
    r = subprocess.run([sys.executable, "-m", "versionwatch", "run", "hogwild.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
    assert "1 backward(s) watched, no hazard" in r.stderr


def test_an_error_in_forward_shows_no_frame_of_ours_under_versionwatch_run(tmp_path: Path):
    (tmp_path / "err.py").write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        class Bad(nn.Module):
            def forward(self, x):
                raise ValueError("bad input")

        model = nn.Sequential(nn.Linear(2, 2), Bad())
        model(torch.ones(1, 2))
    """))
    r = subprocess.run([sys.executable, "-m", "versionwatch", "run", "err.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    trace = r.stderr[:r.stderr.index("ValueError: bad input")]
    assert 'line 6, in forward\n    raise ValueError("bad input")' in trace
    assert trace.count("in _wrapped_call_impl") == 2  # torch's frames are kept
    assert "versionwatch" not in trace
