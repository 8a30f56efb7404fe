"""The child process of ``versionwatch fix``: run the program, or a patched copy, and record it.

``python -m versionwatch._fix.child SPEC.json`` runs the program as ``python``
would (``sys.argv``, ``sys.path[0]`` and ``__file__`` are the original's, in the
working directory it was given), with the edited files taken from their scratch
copies: the main script is compiled from its copy, and a meta-path finder loads
an edited module from its copy while its ``__file__`` stays the original's.

It records every backward up to a number: the user's line, the losses, which
parameters the backward reaches, whether it reaches a parameter through a node
made before an optimizer step changed that parameter (a *stale* gradient), and
the parameters' ``.grad`` after it. It stops after backward ``stop_after``, or
at the first backward that raises (a watcher's prediction, or PyTorch's own
error), and writes the record with ``torch.save``; then it ends the program as
Ctrl-C would: an exception (:class:`Stop`, a ``KeyboardInterrupt``) raised at
that point unwinds it, so that its ``finally`` blocks, ``with`` exits and
``atexit`` run in its scratch copy (a lock file removed, workers joined), within
:data:`GRACE` seconds, after which the run leaves at once (``os._exit``). A
SIGTERM (the run's time limit, ``fix`` interrupted) ends it the same way,
before its parent's SIGKILL to its group after the same grace.

The tracker wraps ``torch.autograd.backward`` and ``torch.autograd.grad``
(``Tensor.backward`` calls the first) *after* the watcher installed its own
wrappers, so it sees every backward before the watcher's prediction raises,
and needs nothing of the watcher but its public ``watch_all()``. Steps are seen
through ``torch.optim``'s public global step hooks. Parameters are named from
the user's frames at each backward (``model.0.weight``; a leaf tensor by its
variable): the same names in the original and a patched run.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import linecache
import os
import pickle
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
from torch import nn

from versionwatch._compat import is_compiling
from versionwatch._naming import optimizer_names, unique_label
from versionwatch._package import PACKAGE_DIR
from versionwatch._sites import is_library

if TYPE_CHECKING:
    from versionwatch._report import Report

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OUR_DIR = PACKAGE_DIR
_SKIP = (_TORCH_DIR, _OUR_DIR, os.path.dirname(os.path.abspath(contextlib.__file__))
         + os.sep + "contextlib.py")
_PYTORCH_SENTENCES = {
    "modified by an inplace operation": "inplace",
    "backward through the graph a second time": "freed",
}


class _Mirror:
    """A run's copy of the user's folders: a path in the copy -> the user's path."""

    def __init__(self, pairs: Sequence[Sequence[str]]) -> None:
        self.pairs = [(os.path.join(a, ""), os.path.join(b, "")) for a, b in pairs]

    def original(self, path: str) -> str:
        real = os.path.realpath(path)
        for copy, user in self.pairs:
            if real.startswith(copy):
                return user + real[len(copy):]
        return real

    def named(self, path: str) -> str:
        """``path`` as the user knows it: the user's file for one in the run's copy."""
        return self.original(path) if self.pairs and os.path.isabs(path) else path

    def in_text(self, text: str) -> str:
        for copy, user in self.pairs:
            text = text.replace(copy, user)
        return text

    def in_data(self, data: Any) -> Any:
        """Every string of plain data (dicts, lists) with the copy's paths the user's."""
        if isinstance(data, str):
            return self.in_text(data)
        if isinstance(data, dict):
            return {k: self.in_data(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.in_data(v) for v in data)
        return data

    def copy_of(self, path: str) -> str:
        """The run's copy of the user's ``path`` (``path`` where it is not under one)."""
        real = os.path.realpath(path)
        for copy, user in self.pairs:
            if real.startswith(user):
                return copy + real[len(user):]
        return path


MIRROR = _Mirror([])

# How long the program's own cleanup may take once its run is over (the record
# written): its ``finally`` blocks, threads and ``atexit``; then it is cut.
GRACE = 5.0


class Stop(KeyboardInterrupt):
    """The run is over: raised in the program where it stopped, to unwind it as Ctrl-C would.

    A ``KeyboardInterrupt``: no ``except Exception`` of the program takes it for
    its own error, and what it does on Ctrl-C (a checkpoint saved, workers
    joined) it does here. ``code``: the run's exit status.
    """

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _cut_after(seconds: float, code: int) -> None:
    """Leave after ``seconds`` whatever the program's cleanup is doing (a daemon thread)."""
    def cut() -> None:
        time.sleep(seconds)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    threading.Thread(target=cut, daemon=True, name="versionwatch-grace").start()


def _stop_on_sigterm() -> None:
    """SIGTERM (a time limit, ``fix`` interrupted) raises :class:`Stop` in the run's
    main thread; a fork of the run (a multiprocessing worker) dies of it as it would
    without us."""
    run = os.getpid()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != run:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _cut_after(GRACE, 128 + signum)
        raise Stop(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


class _CopyLoader(importlib.abc.Loader):
    """Executes a module from the run's copy; its code names the user's file (reports and
    tracebacks say the user's lines), its ``__file__`` the copy (what it writes stays
    there)."""

    def __init__(self, copy: str, original: str) -> None:
        self.copy, self.original = copy, original

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def get_code(self, fullname: str) -> Any:
        """For ``runpy`` (``fix -m pkg.mod``)."""
        with open(self.copy, "rb") as f:
            return compile(f.read(), self.original, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        exec(self.get_code(module.__name__), module.__dict__)


class _ScratchLoader(importlib.abc.Loader):
    """Executes a module's scratch copy; the module keeps its original ``__file__``."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def get_code(self, fullname: str) -> Any:
        """For ``runpy`` (``fix -m pkg.mod`` of a patched module)."""
        with open(self.scratch, "rb") as f:
            return compile(f.read(), self.scratch, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        exec(self.get_code(module.__name__), module.__dict__)


class ScratchFinder(importlib.abc.MetaPathFinder):
    """Finds modules as the path finder does, and loads the edited ones from their copies."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self.map = {os.path.realpath(k): v for k, v in mapping.items()}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not self.map and not MIRROR.pairs:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        original = MIRROR.original(spec.origin)
        scratch = self.map.get(original)
        loader: importlib.abc.Loader
        if scratch is not None:
            loader = _ScratchLoader(scratch)
        elif original != os.path.realpath(spec.origin):
            loader = _CopyLoader(spec.origin, original)
        else:
            return None
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=loader,
            submodule_search_locations=spec.submodule_search_locations)


def _library(name: str) -> bool:
    """A frame of torch, of ours, or of a training library (Lightning, Accelerate,
    pytest): as the watcher's sites skip them, so that the user's line is found."""
    return name.startswith(_SKIP) or name.startswith("<frozen") or is_library(name)


def _user_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        if not _library(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def _leaf_names(frame: FrameType | None) -> dict[int, tuple[str, torch.Tensor]]:
    """``id(leaf) -> (name, leaf)`` for the parameters and leaf tensors the user's frames hold."""
    names: dict[int, tuple[str, torch.Tensor]] = {}
    seen_scopes: set[int] = set()

    def add(key: str, t: torch.Tensor) -> None:
        if id(t) not in names:
            names[id(t)] = (key, t)

    while frame is not None:
        code = frame.f_code.co_filename
        if not _library(code):
            for scope in (frame.f_locals, frame.f_globals):
                if id(scope) in seen_scopes:
                    continue
                seen_scopes.add(id(scope))
                for var, value in list(scope.items()):
                    if var.startswith("__"):
                        continue
                    if isinstance(value, nn.Module):
                        for qn, p in value.named_parameters():
                            add(f"{var}.{qn}", p)
                    elif isinstance(value, torch.Tensor):
                        if value.is_leaf and value.requires_grad:
                            add(var, value)
                    elif isinstance(value, torch.optim.Optimizer):
                        for g, group in enumerate(value.param_groups):
                            for j, p in enumerate(group["params"]):
                                add(f"{var}.param_groups[{g}][{j}]", p)
        frame = frame.f_back
    return names


def _seq_clock() -> int:
    """The autograd sequence number now: nodes made before it have a smaller one."""
    with torch.inference_mode(False), torch.enable_grad():
        probe = torch.empty(0, requires_grad=True).view(0)
    fn = probe.grad_fn
    return int(fn._sequence_nr()) if fn is not None else 0


def _traced(t: torch.Tensor) -> bool:
    """A fake or functional tensor: torch tracing a graph, not the program computing."""
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    if type(t).__module__.startswith("torch._subclasses"):  # FakeTensor, FunctionalTensor
        return True
    functional = getattr(torch._C, "_is_functional_tensor", None)
    return bool(is_fake(t)) or (functional is not None and bool(functional(t)))


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, torch.Tensor))
    return ()


def _statements(filename: str, line: int) -> list[ast.stmt]:
    """The simple statements of ``filename`` that span ``line`` (``a; b`` share one)."""
    if filename not in _TREES:
        try:
            _TREES[filename] = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            _TREES[filename] = None
    tree = _TREES[filename]
    if tree is None:
        return []
    compound = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor,
                ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.stmt) and not isinstance(node, compound)
            and node.lineno <= line <= (node.end_lineno or line)]


_TREES: dict[str, ast.Module | None] = {}


def _terms(node: ast.expr) -> list[str]:
    """The losses a backward's root expression names: ``(a + b)`` -> ``a``, ``b``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _terms(node.left) + _terms(node.right)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [t for e in node.elts for t in _terms(e)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "sum" and node.args and isinstance(
                node.args[0], (ast.List, ast.Tuple))):
        return _terms(node.args[0])
    return [ast.unparse(node)]


def loss_names(frame: FrameType) -> list[str]:
    """The losses the backward called from ``frame`` runs: the names the program
    gives them (``d_loss``; ``d_loss``, ``g_loss`` for their sum), or
    ``backward at line N`` where the source does not say."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    found: list[tuple[ast.Call, ast.expr]] = []
    for stmt in _statements(filename, line):
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("backward", "manual_backward")):
                continue
            base = node.func.value
            through = node.func.attr == "manual_backward" or (
                (isinstance(base, ast.Name) and base.id in ("autograd", "accelerator"))
                or (isinstance(base, ast.Attribute) and base.attr in ("autograd", "accelerator")))
            if through and node.args:
                # torch.autograd.backward(loss), self.manual_backward(loss) (Lightning),
                # accelerator.backward(loss) (Accelerate)
                found.append((node, node.args[0]))
            elif not through:
                found.append((node, _unscaled(base)))  # loss.backward()
    if len(found) > 1:
        # Two backwards on one line (``a.backward(); b.backward()``): the one running,
        # by the column of the frame's instruction (Python 3.11+).
        where = _position(frame)
        if where is not None:
            hit = [f for f in found if (f[0].lineno, f[0].col_offset) <= where
                   <= (f[0].end_lineno or 0, f[0].end_col_offset or 0)]
            found = hit or found
    if found:
        return _terms(found[0][1])
    return [f"backward at line {line}"]


def _unscaled(node: ast.expr) -> ast.expr:
    """``loss`` for ``scaler.scale(loss)`` (mixed precision): the loss is what it scales."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "scale" and len(node.args) == 1):
        return node.args[0]
    return node


def _read(term: str, frame: FrameType) -> Any:
    """The value of ``a`` or ``a.b.c`` in ``frame``; ``None`` for anything else."""
    parts = term.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    scope = frame.f_locals
    value = scope.get(parts[0], frame.f_globals.get(parts[0]))
    for part in parts[1:]:
        if value is None:
            return None
        # Instance attributes only: no property or __getattr__ of the program's runs.
        value = getattr(value, "__dict__", {}).get(part)
    return value


def _position(frame: FrameType) -> tuple[int, int] | None:
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None:
        return None
    try:
        at = list(positions())[frame.f_lasti // 2]
    except (IndexError, ValueError):
        return None
    if at[0] is None or at[2] is None:
        return None
    return int(at[0]), int(at[2])


class _Sketch:
    """A gradient's or an update's fingerprint, never the tensor itself: a bitwise
    hash, and linear sketches (the sum and three fixed random projections, in
    float64) that add up as the tensors do, to compare within a tolerance.

    Taken a block at a time, with the same random block for every block (scaled by a
    number of its own): the memory stays that of one block, for any model."""

    _BLOCK = 1 << 20
    _fixed: ClassVar[dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, t: torch.Tensor | None) -> dict[str, Any] | None:
        if t is None:
            return None
        with torch.no_grad():
            flat = t.detach().to("cpu").reshape(-1)
            if flat.is_complex():
                flat = torch.view_as_real(flat).reshape(-1)
            raw = flat.contiguous().view(torch.uint8)
            weights, dirs = cls._random()
            digest = [0, 0]
            for start in range(0, int(raw.numel()), cls._BLOCK):
                bits = raw[start:start + cls._BLOCK].to(torch.int64)
                w = weights[:, :bits.numel()]
                digest[0] = (digest[0] * 1_000_003 + int((bits * w[0]).sum())) % (1 << 61)
                digest[1] = (digest[1] * 998_244_353 + int((bits * w[1]).sum())) % (1 << 61)
            sketch = [0.0, 0.0, 0.0, 0.0]
            for k, start in enumerate(range(0, int(flat.numel()), cls._BLOCK)):
                x = flat[start:start + cls._BLOCK].to(torch.float64)
                d = dirs[:, :x.numel()]
                scale = 1.0 + (k * 0.6180339887) % 1.0  # each block its own weight
                sketch[0] += float(x.sum())
                for i in range(3):
                    sketch[i + 1] += scale * float((x * d[i]).sum())
            return {"hash": digest, "dtype": str(t.dtype), "shape": list(t.shape),
                    "sketch": sketch, "norm": float(flat.to(torch.float64).norm())
                    if flat.numel() <= cls._BLOCK else _blocked_norm(flat, cls._BLOCK)}

    @classmethod
    def _random(cls) -> tuple[torch.Tensor, torch.Tensor]:
        if not cls._fixed:
            g = torch.Generator().manual_seed(20261207)
            cls._fixed["w"] = torch.randint(1, 2**31 - 1, (2, cls._BLOCK), generator=g,
                                            dtype=torch.int64)
            cls._fixed["d"] = torch.randn(3, cls._BLOCK, generator=g, dtype=torch.float64)
        return cls._fixed["w"], cls._fixed["d"]


def _blocked_norm(flat: torch.Tensor, block: int) -> float:
    total = 0.0
    for start in range(0, int(flat.numel()), block):
        total += float(flat[start:start + block].to(torch.float64).pow(2).sum())
    return float(total ** 0.5)


class Tracker:
    """Counts and records the program's backwards; see the module's docstring."""

    def __init__(self, spec: dict[str, Any], scratch: dict[str, str]) -> None:
        self.out: str = spec["out"]
        self.stop_after: int | None = spec.get("stop_after")
        self.record_upto: int = int(spec.get("record_upto") or 0)
        self.grads_upto: int = int(spec.get("grads_upto") or 0)
        self.grads_at: set[int] = set(spec.get("grads_at") or ())
        self.n = 0
        self.records: list[dict[str, Any]] = []
        self.local = threading.local()
        self.changed: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self.steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = \
            weakref.WeakKeyDictionary()
        # By the optimizer itself, held weakly: one made after another died may take its
        # id, and must not take its label or its count of steps.
        self.labels: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = \
            weakref.WeakKeyDictionary()
        self.classes: set[str] = set()  # the class labels given (Adam, Adam[1]), dead or alive
        self.before: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.names: dict[int, str] = {}  # the names found at the latest recorded backward
        self.step_log: list[dict[str, Any]] = []
        # What each parameter's .grad holds since it was last zeroed: the losses
        # of the backwards that accumulated into it (id(param) -> names).
        self.fed: dict[int, list[str]] = {}
        self.ledger: bool = bool(spec.get("ledger"))
        # id(param) -> (id, _version) of its .grad after the last backward we saw.
        self.grad_seen: dict[int, tuple[int, int]] = {}
        self.params_before: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.result: dict[str, Any] = {}
        self.finished = False
        # A scratch copy's lines stand for the original file's, in the record.
        self.back = {v: k for k, v in scratch.items()}
        # A process the program forked: what it runs is not followed (see install).
        self.forked = False  # this process is one
        self.fork_noted = False  # it has run a backward, and said so
        self.stdin = _NotedStdin()

    # -- installation ------------------------------------------------------------
    def install(self) -> None:
        import torch.autograd as autograd
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        autograd.backward = self._wrap(autograd.backward, 0, "tensors", 5)
        autograd.grad = self._wrap(autograd.grad, 0, "outputs", 1)
        register_optimizer_step_pre_hook(self._step_pre)
        register_optimizer_step_post_hook(self._step_post)
        # A process the program forks (os.fork, multiprocessing's "fork") runs on
        # with this tracker, but its record would never reach the run's: it records
        # nothing (nor writes the run's record in its stead), and one that runs a
        # backward leaves a mark by the record, so that the result can say what was
        # not followed. A fork that runs none (a DataLoader's worker) is no matter.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._in_fork)
        self.stdin.install()

    def _in_fork(self) -> None:
        self.forked, self.fork_noted = True, False

    def _fork_backward(self) -> None:
        if not self.fork_noted:
            self.fork_noted = True
            with contextlib.suppress(OSError):
                os.close(os.open(f"{self.out}.forked.{os.getpid()}",
                                 os.O_CREAT | os.O_WRONLY, 0o600))

    def install_checks(self) -> None:
        """A ``check()`` or ``assert_backward_safe()`` that finds a hazard is the failure.

        The program asks before its backward (``examples/seed_story.py`` does, and
        catches the error): the backward it asked about is the one that fails,
        whether or not the program goes on to run it. ``assert_backward_safe``
        calls ``check``, so one observer sees both.
        """
        from versionwatch._predict import CHECK_OBSERVERS

        def observe(report: Report, frame: FrameType) -> None:
            if not report.ok and not getattr(self.local, "depth", 0) and not self.forked:
                self.predicted(report, frame)

        CHECK_OBSERVERS.append(observe)

    def _label(self, opt: torch.optim.Optimizer) -> str:
        label = self.labels.get(opt)
        if label is None:
            # The program's own name where its frames hold the optimizer (the same
            # in the original and every patched run; two made by one line, one after
            # the other, share it and their steps), else its class, numbered.
            # The watcher's rule (versionwatch._naming), but a name is taken only by
            # a live optimizer: one made again under the same name shares it (the
            # same in the original and every patched run), while class labels
            # (no variable holds it) stay numbered.
            taken = {v for k, v in self.labels.items() if k is not opt} | self.classes
            cls = type(opt).__name__
            label = unique_label(optimizer_names(opt, sys._getframe(1), _library), cls,
                                 taken.__contains__)
            if label == cls or label.startswith(cls + "["):
                self.classes.add(label)
            self.labels[opt] = label
        return label

    def _step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before[id(opt)] = [(p, p._version) for g in opt.param_groups for p in g["params"]]
        if self.ledger and self.n <= self.record_upto:
            self._label(opt)
            with torch.no_grad():
                self.params_before[id(opt)] = [
                    (p, p.detach().to("cpu", copy=True)) for g in opt.param_groups
                    for p in g["params"] if id(p) in self.names]

    def _step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        n = self.steps[opt] = self.steps.get(opt, 0) + 1
        label = f"{self._label(opt)}.step() #{n}"
        clock = _seq_clock()
        changed = []
        for p, v in self.before.pop(id(opt), ()):
            if p._version != v:
                self.changed[id(p)] = (weakref.ref(p), clock, label)
            if id(p) in self.names:
                changed.append(self.names[id(p)])
        if self.n <= self.record_upto:
            entry: dict[str, Any] = {"label": label, "after": self.n, "params": changed}
            if self.ledger:
                entry["optimizer"] = self._label(opt)
                entry["applied"] = self._applied(self.params_before.pop(id(opt), []))
                # A state the next step reads (momentum, Adam's moments): merged steps
                # then differ from the program's two for that reason.
                entry["stateful"] = any(isinstance(v, torch.Tensor)
                                        for st in opt.state.values() for v in st.values())
            self.step_log.append(entry)

    def _zeroed(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` was cleared since the last backward accumulated into it:
        ``None``, or another tensor or written since, and all zeros now (a
        ``zero_grad()``; a clipped or scaled gradient still holds its losses)."""
        grad = p.grad
        if grad is None:
            return True
        if self.grad_seen.get(id(p)) == (id(grad), grad._version):
            return False
        with torch.no_grad():
            return not bool(grad.any())

    def _applied(self, before: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """What a step applied to each named parameter: the losses whose gradients
        its ``.grad`` held, that gradient's fingerprint, and the update's."""
        out: dict[str, Any] = {}
        with torch.no_grad():
            for p, old in before:
                name = self.names.get(id(p))
                if name is None:
                    continue
                grad = p.grad
                # A gradient zeroed since (zero_grad without set_to_none) applies no loss.
                live = not self._zeroed(p)
                out[name] = {
                    "losses": sorted(self.fed.get(id(p), [])) if live else [],
                    "grad": _Sketch.of(grad),
                    "update": _Sketch.of(p.detach().to("cpu") - old)
                    if p.dtype.is_floating_point or p.dtype.is_complex else None,
                    "after": _Sketch.of(p)}
        return out

    def _wrap(self, inner: Any, at: int, first: str, inputs_at: int) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # A backward inside a backward, or torch.compile tracing one (AOTAutograd's
            # joint graph, on fake tensors): none of the program's own backwards.
            if self.forked:
                self._fork_backward()
                return inner(*args, **kwargs)
            if self.finished:  # the program took the Stop for its own, and went on
                raise Stop(0)
            if getattr(self.local, "depth", 0) or is_compiling():
                return inner(*args, **kwargs)
            roots = args[at] if len(args) > at else kwargs.get(first)
            if isinstance(roots, (torch.Tensor, list, tuple)) and any(
                    _traced(t) for t in _tensors(roots)):
                return inner(*args, **kwargs)  # older torch: is_compiling() is False there
            if roots is not None and not isinstance(roots, (torch.Tensor, list, tuple)):
                roots = tuple(roots)  # an iterator: read once, here
                if len(args) > at:
                    args = (*args[:at], roots, *args[at + 1:])
                else:
                    kwargs[first] = roots
            inputs = args[inputs_at] if len(args) > inputs_at else kwargs.get("inputs")
            if inputs is not None and not isinstance(inputs, (torch.Tensor, list, tuple)):
                inputs = tuple(inputs)
                if len(args) > inputs_at:
                    args = (*args[:inputs_at], inputs, *args[inputs_at + 1:])
                else:
                    kwargs["inputs"] = inputs
            self.n += 1
            k = self.n
            frame = _user_frame(sys._getframe(1))
            rec: dict[str, Any] = {"n": k, "site": self._site(frame)}
            if threading.current_thread() is not threading.main_thread():
                # The run as meant (strict repair, allow_mutation) covers the main
                # thread only: the result says so for a backward elsewhere.
                rec["thread"] = threading.current_thread().name
            names: dict[int, tuple[str, torch.Tensor]] = {}
            if k <= self.record_upto or k in self.grads_at:
                names = _leaf_names(frame)
                self.names = {i: key for i, (key, _) in names.items()}
                rec["loss"] = [t.detach().to("cpu", copy=True) for t in _tensors(roots)]
                try:
                    rec["reach"], rec["stale"] = self._walk(_tensors(roots), _tensors(inputs),
                                                            names)
                except Exception as e:  # the record is a check's, never the program's failure
                    rec["reach"], rec["stale"] = [], []
                    rec["walk_error"] = repr(e)
            self.records.append(rec)
            fed: list[torch.Tensor] = []
            if self.ledger and names and first == "tensors" and frame is not None:
                # A backward accumulates into .grad (autograd.grad does not): which
                # losses fed each parameter's gradient since it was last zeroed.
                rec["losses"] = loss_names(frame)
                by_name = {key: t for key, t in names.values()}
                fed = [by_name[key] for key in rec.get("reach", ()) if key in by_name]
                terms = self._term_reach(rec["losses"], frame, _tensors(inputs), names)
                for t in fed:
                    if self._zeroed(t):
                        self.fed[id(t)] = []
            self.local.depth = 1
            try:
                out = inner(*args, **kwargs)
            except Exception as e:
                self.fail(k, e)
            finally:
                self.local.depth = 0
            for t in fed:
                if t.grad is not None:
                    key = self.names.get(id(t), "")
                    self.fed.setdefault(id(t), []).extend(
                        [n for n in rec["losses"] if key in terms.get(n, (key,))])
                    self.grad_seen[id(t)] = (id(t.grad), t.grad._version)
            if k <= self.grads_upto or k in self.grads_at:
                rec["grads"] = {key: (None if t.grad is None
                                      else t.grad.detach().to("cpu", copy=True))
                                for key, t in names.values()}
            if self.stop_after is not None and k >= self.stop_after:
                self.finish("stopped", 0)
            return out

        wrapped.__name__ = getattr(inner, "__name__", "backward")
        return wrapped

    def _term_reach(self, losses: list[str], frame: FrameType, inputs: tuple[torch.Tensor, ...],
                    names: dict[int, tuple[str, torch.Tensor]]) -> dict[str, set[str]]:
        """For a backward of summed losses (``(d_loss + g_loss).backward()``), which
        parameters each term reaches: a term that is a plain name (``d_loss``,
        ``self.loss``) is read from the frame, never evaluated otherwise."""
        if len(losses) < 2:
            return {}
        out: dict[str, set[str]] = {}
        for term in losses:
            value = _read(term, frame)
            if isinstance(value, torch.Tensor):
                with contextlib.suppress(Exception):
                    out[term] = set(self._walk((value,), inputs, names)[0])
        return out

    def _site(self, frame: FrameType | None) -> list[Any] | None:
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if name in self.back:
            return [self.back[name], frame.f_lineno, True]
        return [MIRROR.named(name), frame.f_lineno, False]

    def _walk(self, roots: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
              names: dict[int, tuple[str, torch.Tensor]],
              ) -> tuple[list[str], list[list[str]]]:
        reach: set[str] = set()
        stale: dict[str, str] = {}
        seen: set[int] = set()
        # Held while walking: a node's Python object lives only as long as someone
        # holds it (torch 2.4), and an id freed could come back for another node.
        alive: list[Any] = []
        stack = []
        for r in roots:
            if r.grad_fn is not None:
                stack.append(r.grad_fn)
            elif r.requires_grad and id(r) in names:
                reach.add(names[id(r)][0])
        while stack:
            fn = stack.pop()
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            alive.append(fn)
            for child, _ in fn.next_functions:
                if child is None:
                    continue
                leaf = getattr(child, "variable", None)
                if leaf is None:
                    stack.append(child)
                    continue
                named = names.get(id(leaf))
                if named is None:
                    continue
                reach.add(named[0])
                changed = self.changed.get(id(leaf))
                if changed is not None and changed[0]() is leaf and fn._sequence_nr() < changed[1]:
                    stale.setdefault(named[0], changed[2])
        if inputs:
            wanted = {names[id(t)][0] for t in inputs if id(t) in names}
            reach &= wanted
            stale = {k: v for k, v in stale.items() if k in wanted}
        return sorted(reach), [[k, v] for k, v in sorted(stale.items())]

    # -- the end -----------------------------------------------------------------
    def predicted(self, report: Any, frame: FrameType | None) -> NoReturn:
        """A hazard found before any backward ran (``check()``, or a watcher at a write):
        the failure of the next backward, at the line that found it."""
        from versionwatch._predict import raise_for

        k = self.n + 1
        self.records.append({"n": k, "site": self._site(_user_frame(frame)), "before": True})
        try:
            raise_for(report)
        except Exception as e:
            self.fail(k, e)
        raise AssertionError("raise_for raised nothing for a report with hazards")

    def fail(self, k: int, err: BaseException) -> NoReturn:
        from versionwatch._report import FreedGraphError, InplaceModificationError

        if self.finished:  # an error of the program's cleanup: the record is written
            raise Stop(0)
        r = self.result = {"status": "failed", "exit": 1, "failed_at": k,
                           "error": _one_line(err), "ours": False}
        report = getattr(err, "report", None)
        if isinstance(err, (InplaceModificationError, FreedGraphError)) and report is not None:
            from versionwatch._candidates import from_report

            h = report.hazards[0]
            r["ours"] = True
            r["hazard"] = {"kind": h.kind, "node": h.node, "slot": h.slot,
                           "tensor": h.tensor or h.describe_tensor()}
            # A module its program loaded past our finder (pytest's importlib mode) is
            # named by its path in the run's copy: the user's path, in what we record.
            r["report"] = MIRROR.in_data(report.to_dict())
            r["text"] = MIRROR.in_text(str(report))
            try:  # the report itself, for FixResult.report (plain data: it pickles)
                r["report_pickle"] = base64.b64encode(pickle.dumps(report)).decode("ascii")
            except Exception as e:  # the dict above stands without it
                r["report_pickle_error"] = repr(e)
            try:
                r["facts"] = MIRROR.in_data(from_report(report).to_dict())
            except Exception as e:  # facts are a help; the record stands without them
                r["facts_error"] = repr(e)
        else:
            text = str(err)
            kind = next((v for s, v in _PYTORCH_SENTENCES.items() if s in text), None)
            if kind is not None:
                r["ours"] = True
                r["hazard"] = {"kind": kind, "node": "", "slot": "", "tensor": ""}
                r["text"] = text
        self.finish(r["status"], 1)

    def error(self, err: BaseException) -> NoReturn:
        from versionwatch._report import FreedGraphError, InplaceModificationError

        if self.finished:  # an error of the program's cleanup: the record is written
            raise Stop(0)
        tb = traceback.extract_tb(err.__traceback__)
        if isinstance(err, (InplaceModificationError, FreedGraphError)) and getattr(
                err, "report", None) is not None:
            # Raised outside any backward (a watcher at a write, a check the program
            # made): the hazard of the next backward, at the program's line.
            user = [fr for fr in tb if not fr.filename.startswith(_SKIP)]
            site = None
            if user:
                name = user[-1].filename
                site = [self.back.get(name, MIRROR.named(name)), user[-1].lineno,
                        name in self.back]
            k = self.n + 1
            self.records.append({"n": k, "site": site, "before": True})
            self.fail(k, err)
        site = None
        for fr in reversed(tb):
            if not fr.filename.startswith(_SKIP):
                site = [self.back.get(fr.filename, MIRROR.named(fr.filename)), fr.lineno,
                        fr.filename in self.back]
                break
        # The program's traceback, its own frames only, as Python would print it.
        frames = [fr for fr in tb if not fr.filename.startswith(_SKIP)]
        trace = "Traceback (most recent call last):\n" + "".join(
            traceback.format_list(frames)) + "".join(
            traceback.format_exception_only(type(err), err))
        for scratch, original in self.back.items():
            trace = trace.replace(scratch, original)
        trace = MIRROR.in_text(trace)
        self.result = {"status": "error", "exit": 1, "error": _one_line(err),
                       "error_site": site, "trace": trace}
        self.finish("error", 1)

    def finish(self, status: str, code: int) -> NoReturn:
        """Write the record (once), then end the program: :class:`Stop` from here."""
        if self.forked:  # a process the program forked: the run's record is not its to write
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
        if self.finished:  # the program took the Stop for its own, and went on
            raise Stop(0)
        self.finished = True
        self.result.setdefault("status", status)
        self.result.setdefault("exit", code)
        self.result["backwards"] = self.n
        self.result["records"] = self.records
        self.result["steps"] = self.step_log
        # The forks that ran a backward (those that have so far: one still running
        # may run its first later).
        marks = glob.glob(glob.escape(self.out) + ".forked.*")
        self.result["forks"] = len(marks)
        for mark in marks:
            with contextlib.suppress(OSError):
                os.unlink(mark)
        self.result["stdin_read"] = self.stdin.read_at_all
        tmp = self.out + ".tmp"
        try:
            torch.save(self.result, tmp)
        except Exception as e:  # a tensor we kept cannot be saved: the record without values
            self.result["records"] = [{k: v for k, v in r.items() if k not in ("loss", "grads")}
                                      for r in self.records]
            self.result["record_error"] = repr(e)
            torch.save(self.result, tmp)
        os.replace(tmp, self.out)
        # The record is whole: whatever the program's cleanup does, within the grace.
        _cut_after(GRACE, 0)
        raise Stop(0)


class _NotedStdin(io.RawIOBase):
    """The program's standard input in a run (empty: the runs read ``/dev/null``), noting
    whether the program read it: a program that found it empty may have trained on
    nothing, and the result must not then pass for a program without a hazard.

    Under ``sys.stdin`` (text, bytes through ``.buffer``, ``input()``, iteration); a
    read of file descriptor 0 itself is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.read_at_all = False

    def install(self) -> None:
        old = sys.stdin
        if old is None:
            return
        sys.stdin = io.TextIOWrapper(io.BufferedReader(self),
                                     encoding=getattr(old, "encoding", None) or "utf-8",
                                     errors=getattr(old, "errors", None) or "strict")

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 0

    def readinto(self, buffer: Any) -> int:
        self.read_at_all = True
        data = os.read(0, len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _run_checkpoints_plainly() -> None:
    """``torch.utils.checkpoint.checkpoint(fn, *args)`` calls ``fn(*args)``, for this process.

    The same math and the same random numbers (checkpoint's forward draws them as
    a plain call does, and its recomputation puts the generator back), with
    every tensor saved as a plain forward saves it.
    """
    try:
        import torch.utils.checkpoint as ckpt
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    own = ("use_reentrant", "context_fn", "determinism_check", "debug", "early_stop",
           "preserve_rng_state")

    def checkpoint(function: Callable[..., object], *args: object, **kwargs: object) -> object:
        for name in own:
            kwargs.pop(name, None)
        return function(*args, **kwargs)

    ckpt.checkpoint = checkpoint


def _notebook_codes(filename: str, original: str, scratch: dict[str, str]) -> list[Any]:
    """A notebook's cells, each compiled under its cell name (the user's notebook's), or
    from its patched scratch copy, registered as that cell."""
    from versionwatch._fix.notebook import read_notebook, register_lines

    codes = []
    for cell in read_notebook(filename, name=original).cells:
        source = scratch.get(os.path.realpath(cell.filename))
        if source is None:
            register_lines(cell.filename, cell.text, cell.number)
            codes.append(compile(cell.text, cell.filename, "exec", dont_inherit=True))
            continue
        with open(source, encoding="utf-8") as f:
            text = f.read()
        register_lines(source, text, cell.number)
        codes.append(compile(text, source, "exec", dont_inherit=True))
    return codes


def _run_main(argv0: str, scratch: dict[str, str]) -> None:
    filename = os.path.join(os.getcwd(), argv0)
    original = MIRROR.original(filename)
    source = scratch.get(original)
    if argv0.lower().endswith(".ipynb"):
        codes = _notebook_codes(filename, original, scratch)
    else:
        # The code names the user's file (or the patched scratch copy, whose lines the
        # record maps back); ``__file__`` is the run's copy, where its writes stay.
        with open(source or filename, "rb") as f:
            codes = [compile(f.read(), source or original, "exec", dont_inherit=True)]
    main = ModuleType("__main__")
    main.__dict__.update(__file__=filename, __cached__=None, __package__=None, __spec__=None,
                         __builtins__=__builtins__)
    sys.modules["__main__"] = main
    for code in codes:
        exec(code, main.__dict__)


def main(argv: Sequence[str]) -> int:
    """Run the program of ``argv[0]`` (a spec, JSON), record it; the run's exit status.

    ``--tie PID:FD`` after it (a run in a new interpreter): die with ``fix``,
    process ``PID``, with its whole group, when the pipe ``FD`` closes.
    """
    if argv[1:2] == ["--tie"]:
        from versionwatch._process import tie_to_parent

        parent, fd = argv[2].split(":")
        # The pipe alone: PR_SET_PDEATHSIG would kill this process first, and
        # leave what the program started running.
        tie_to_parent(int(parent), int(fd), pdeathsig=False)
    _stop_on_sigterm()
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("tmp"):
        # The program's temporary files in the run's folder, which fix removes
        # whatever ends it.
        os.environ["TMPDIR"] = spec["tmp"]
        tempfile.tempdir = None
    if spec.get("cwd"):
        os.chdir(spec["cwd"])  # a fork server's run: the program's working directory
    MIRROR.pairs = _Mirror(spec.get("mirror") or []).pairs
    scratch = {os.path.realpath(k): v for k, v in (spec.get("scratch") or {}).items()}
    program: list[str] = spec["argv"]
    sys.meta_path.insert(0, ScratchFinder(scratch))
    # The program's first entry on sys.path, in the slot its interpreter made for it
    # (_process.python_module; none under -P/PYTHONSAFEPATH, as for the plain program).
    if program[0] == "-m":
        sys.argv = ["-m", *program[2:]]
        entry = os.getcwd()
    elif program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        entry = ""
    else:
        if os.path.isabs(program[0]):
            program = [MIRROR.copy_of(program[0]), *program[1:]]
        sys.argv = list(program)
        entry = os.path.dirname(os.path.realpath(program[0]))
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = entry
    watcher = None
    if spec.get("watch", "default") != "none":
        from versionwatch._watch import watch_all

        os.environ.pop("VERSIONWATCH_ON_HAZARD", None)  # a check raises at every hazard
        # "repair": the program as its author meant it (each backward sees what its
        # forward saved), the reference a candidate's training is compared with.
        repair = spec.get("on_hazard") == "repair"
        watcher = watch_all(on_hazard="repair" if repair else "raise",
                            strict=spec.get("watch") == "strict")
    tracker = Tracker(spec, scratch)
    tracker.install()  # after the watcher's own wrappers: it sees every backward first
    if watcher is not None and spec.get("on_hazard") != "repair":
        tracker.install_checks()
    context: Any = contextlib.nullcontext()
    if spec.get("allow_mutation"):
        context = torch.autograd.graph.allow_mutation_on_saved_tensors()
    if spec.get("allow_mutation") or spec.get("on_hazard") == "repair":
        # The program as its author meant it: checkpointing only saves memory, so
        # its function runs as itself. Under checkpoint the recomputation would
        # repeat a write to what the function saved, which no repair can undo.
        _run_checkpoints_plainly()
    try:
        try:
            with context:
                if program[0] == "-m":
                    runpy.run_module(program[1], run_name="__main__", alter_sys=True)
                elif program[0] == "-c":
                    code = compile(program[1], spec.get("filename", "<string>"), "exec",
                                   dont_inherit=True)
                    main_module = ModuleType("__main__")
                    main_module.__dict__["__builtins__"] = __builtins__
                    sys.modules["__main__"] = main_module
                    exec(code, main_module.__dict__)
                else:
                    _run_main(program[0], scratch)
        except Stop:
            raise
        except SystemExit as e:
            code_ = e.code
            # int() of an IntEnum (pytest.ExitCode): the record holds plain data only
            status = int(code_) if isinstance(code_, int) else (0 if code_ is None else 1)
            if not tracker.finished:
                tracker.result = {"status": "exited" if status else "completed",
                                  "exit": status}
            tracker.finish("exited", status)
        except BaseException as e:
            tracker.error(e)
        del watcher
        tracker.finish("completed", 0)
    except Stop as stop:
        return stop.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
