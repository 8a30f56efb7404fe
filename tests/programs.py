"""Random autograd programs, generated as Python source text.

``generate(seed)`` writes a small, deterministic program: a few leaves, 5-20
ops, in-place mutations placed between them, and one or more backward calls
through an ``oracle`` (see ``oracle.py``), which predicts each backward with
versionwatch, runs it, and asserts that the two agree. Being source text, every
statement has a real line number in ``<program SEED>``; each line that mutates
a tensor ends with ``# mutates: NAME``, which :func:`mutation_lines` reads back.

``run_program(src, oracle)`` compiles and runs one program and returns the
outcomes of the backwards it reached (it stops at the first one that fails).
"""

from __future__ import annotations

import linecache
import random
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oracle import Oracle, Outcome

__all__ = [
    "FORWARD_ERRORS",
    "HIDDEN_SAVE",
    "SILENT",
    "SaveBoth",
    "SaveIn",
    "SaveOut",
    "WriteTrace",
    "generate",
    "mutation_lines",
    "run_program",
    "visible",
]

Shape = tuple[int, ...]
M: Shape = (3, 3)
ROW: Shape = (3,)
COL: Shape = (3, 1)


# -- the custom autograd.Functions the programs call ---------------------------


class SaveIn(torch.autograd.Function):
    """Saves its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 2.0 + 0.0 * x


class SaveOut(torch.autograd.Function):
    """Saves its output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g * y


class SaveBoth(torch.autograd.Function):
    """Saves its input and its output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors
        return g * x.cos() + 0.0 * y


# Marks the lines where an in-place op on a view saves a tensor that only a
# CopySlices node holds: Python cannot reach it (CopySlices exposes no saved
# tensors), so a graph walk cannot check it.
HIDDEN_SAVE = "saved inside CopySlices"

# Marks a write through ``.data`` in the programs ``generate(seed, silent=True)`` writes.
SILENT = "silent"

# Errors that an in-place op may legitimately raise during a program's forward.
# The generator avoids them; the test counts (and tolerates) any that slip through.
FORWARD_ERRORS = (
    "a leaf Variable that requires grad is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
    "is a view and is being modified inplace",
    "is a view and its base or another view of its base has been modified inplace",
)


# -- the generator -------------------------------------------------------------


@dataclass
class _Var:
    name: str
    shape: Shape
    kind: str  # "leaf" | "param" | "data" | "node" | "const" | "leafview"
    rg: bool  # requires grad
    leafy: bool  # a leaf or a view of one: grad-mode in-place is an error
    view: bool = False
    storage: str = ""  # the variable that owns the memory (views and detach() share it)

    def __post_init__(self) -> None:
        self.storage = self.storage or self.name


def _broadcast(a: Shape, b: Shape) -> Shape:
    return tuple(torch.broadcast_shapes(a, b))


class _Gen:
    def __init__(self, seed: int, view_relu: bool, silent: bool = False) -> None:
        self.seed = seed
        self.view_relu = view_relu
        self.silent = silent
        self.r = random.Random(seed)
        self.lines: list[str] = []
        self.vars: list[_Var] = []
        self.counter = 0
        self.uses_idx = False

    # helpers
    def emit(self, line: str) -> None:
        self.lines.append(line)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def values(self) -> str:
        lo = round(self.r.uniform(-1.5, -0.2), 2)
        hi = round(self.r.uniform(0.2, 1.5), 2)
        return f"torch.linspace({lo}, {hi}, 9).reshape(3, 3)"

    def pick(self, cond: Any = None, recent: bool = True) -> _Var | None:
        pool = [v for v in self.vars if cond is None or cond(v)]
        if not pool:
            return None
        if recent and self.r.random() < 0.6:
            pool = pool[-4:]
        return self.r.choice(pool)

    def add(self, v: _Var) -> _Var:
        self.vars.append(v)
        return v

    # the program
    def leaves(self) -> None:
        n_leaf = self.r.randint(1, 2)
        n_param = self.r.randint(0, 2)
        n_data = self.r.randint(1, 2)
        for _ in range(n_leaf):
            name = self.fresh("a")
            self.emit(f"{name} = {self.values()}.requires_grad_()")
            self.add(_Var(name, M, "leaf", rg=True, leafy=True))
        for _ in range(n_param):
            name = self.fresh("w")
            self.emit(f"{name} = torch.nn.Parameter({self.values()})")
            self.add(_Var(name, M, "param", rg=True, leafy=True))
        for _ in range(n_data):
            name = self.fresh("d")
            self.emit(f"{name} = {self.values()}")
            self.add(_Var(name, M, "data", rg=False, leafy=False))
        self.emit("idx = torch.tensor([2, 0, 1])")
        self.emit("mask = torch.tensor([[True, False, False], [False, True, False], "
                  "[False, False, True]])")
        # The oracle also asserts that check() changes none of their versions or grads.
        leaves = ", ".join([v.name for v in self.vars] + ["idx"])
        self.emit(f"oracle.watched = [{leaves}]")

    def op(self) -> None:
        r = self.r
        kind = r.choices(
            ["unary", "pow", "mul", "add", "mm", "index", "view", "detach", "cat", "custom"],
            weights=[5, 2, 5, 3, 3, 2, 3, 1, 1, 3],
        )[0]
        if kind in ("unary", "pow", "custom"):
            x = self.pick(lambda v: v.rg) if r.random() < 0.85 else self.pick()
            assert x is not None
            if kind == "unary":
                f = r.choice(["exp", "sigmoid", "tanh", "sin", "relu"])
                expr = f"torch.{f}({x.name})" if r.random() < 0.5 else f"{x.name}.{f}()"
            elif kind == "pow":
                expr = r.choice([f"{x.name}.pow(2)", f"{x.name} ** 3"])
            else:
                expr = f"{r.choice(['SaveIn', 'SaveOut', 'SaveBoth'])}.apply({x.name})"
            self.result(expr, x.shape, x.rg)
        elif kind in ("mul", "add"):
            x = self.pick(lambda v: v.rg)
            y = self.pick()
            assert x is not None and y is not None
            if r.random() < 0.5:
                x, y = y, x
            sym = "*" if kind == "mul" else "+"
            self.result(f"{x.name} {sym} {y.name}", _broadcast(x.shape, y.shape), x.rg or y.rg)
        elif kind == "mm":
            x = self.pick(lambda v: v.shape == M and v.rg)
            y = self.pick(lambda v: v.shape == M)
            if x is None or y is None:
                return
            if r.random() < 0.5:
                x, y = y, x
            expr = f"{x.name} @ {y.name}" if r.random() < 0.5 else f"torch.mm({x.name}, {y.name})"
            self.result(expr, M, x.rg or y.rg)
        elif kind == "index":
            x = self.pick(lambda v: v.shape == M and v.rg)
            if x is None:
                return
            self.result(f"{x.name}[idx]", M, True)
            self.uses_idx = True
        elif kind == "view":
            x = self.pick(lambda v: v.shape == M)
            if x is None:
                return
            k = r.randint(0, 2)
            expr, shape = r.choice(
                [(f"{x.name}[{k}]", ROW), (f"{x.name}[:, {k}:{k + 1}]", COL), (f"{x.name}.t()", M)]
            )
            name = self.fresh("v")
            self.emit(f"{name} = {expr}")
            kind_ = "node" if x.rg and not x.leafy else ("leafview" if x.rg else "const")
            self.add(_Var(name, shape, kind_, rg=x.rg, leafy=x.leafy, view=True,
                          storage=x.storage))
        elif kind == "detach":
            x = self.pick(lambda v: v.rg)
            assert x is not None
            name = self.fresh("c")
            self.emit(f"{name} = {x.name}.detach()")
            self.add(_Var(name, x.shape, "const", rg=False, leafy=False, storage=x.storage))
        elif kind == "cat":
            x = self.pick(lambda v: v.shape == M and v.rg)
            y = self.pick(lambda v: v.shape == M)
            if x is None or y is None:
                return
            name = self.fresh("h")
            self.emit(f"{name} = torch.cat([{x.name}, {y.name}])[::2]")
            self.add(_Var(name, M, "node", rg=True, leafy=False, view=True))

    def result(self, expr: str, shape: Shape, rg: bool) -> None:
        name = self.fresh("h")
        self.emit(f"{name} = {expr}")
        self.add(_Var(name, shape, "node" if rg else "const", rg=rg, leafy=False))

    def mutate(self) -> None:
        r = self.r
        if self.silent:
            self.mutate_data()
            return
        how = r.choices(["leaf", "graph", "detach", "idx"], weights=[4, 5, 2, 1])[0]
        if how == "idx" and not self.uses_idx:
            how = "leaf"
        if how == "leaf":
            # Under no_grad, as an optimizer step does: on leaves, parameters, data.
            x = self.pick(lambda v: not v.rg or v.leafy, recent=False)
            assert x is not None
            stmt = r.choice([
                f"{x.name}.add_(0.5)",
                f"{x.name}.mul_(1.1)",
                f"{x.name}.copy_(torch.full_like({x.name}, 0.25))",
                f"{x.name}.zero_()",
                f"{x.name}[0] = 1.0",
            ] + ([f"{x.name}.masked_fill_(mask, 0.0)"] if x.shape == M else []))
            self.emit("with torch.no_grad():")
            self.emit(f"    {stmt}  # mutates: {x.name}")
        elif how == "graph":
            # With autograd on: a non-leaf, or a view of one.
            x = self.pick(lambda v: v.rg and not v.leafy)
            if x is None:
                return
            ops = [f"{x.name}.add_(0.5)", f"{x.name}.mul_(1.5)", f"{x.name} += 0.25"]
            if self.view_relu or not x.view:
                ops.append(f"{x.name}.relu_()")
            # Never an operand that shares x's memory: partial overlap is an error.
            other = self.pick(lambda v: v.storage != x.storage and _fits(v.shape, x.shape))
            if other is not None:
                ops.append(f"{x.name}.add_({other.name})")
            op = r.choice(ops)
            note = ""
            if x.view and op.endswith(".relu_()"):
                # relu_ on a view: autograd wraps ReluBackward0, which saves the
                # result, inside a CopySlices node that does not expose it.
                note = f"  [{HIDDEN_SAVE}]"
            self.emit(f"{op}  # mutates: {x.name}{note}")
        elif how == "detach":
            x = self.pick(lambda v: not v.view)
            assert x is not None
            op = r.choice(["mul_(1.5)", "add_(1.0)", "zero_()"])
            self.emit(f"{x.name}.detach().{op}  # mutates: {x.name}")
        else:
            stmt = r.choice(["idx[0] = 1", "idx.zero_()", "idx.copy_(idx.flip(0))"])
            self.emit(f"{stmt}  # mutates: idx")

    def mutate_data(self) -> None:
        """A write through ``.data``: it bumps no version, so PyTorch cannot see it.

        Never to a view, or to memory that a view already shares: :func:`visible`
        bumps the version there, and a view whose base's version moved gets a new
        grad_fn (``AsStridedBackward0``), which would make the two programs differ
        in more than the version counter.
        """
        views = {v.storage for v in self.vars if v.view}
        x = self.pick(lambda v: not v.view and v.storage not in views)
        if x is None:
            return
        ops = ["add_(0.5)", "mul_(1.5)", "zero_()", f"copy_(torch.full_like({x.name}, 0.25))"]
        if x.shape == M:
            ops.append("masked_fill_(mask, 0.0)")
        self.emit(f"{x.name}.data.{self.r.choice(ops)}  # mutates: {x.name} [{SILENT}]")

    def loss(self, name: str) -> _Var:
        r = self.r
        x = self.pick(lambda v: v.kind == "node" and v.rg)
        if x is None:
            x = self.pick(lambda v: v.rg)
        assert x is not None
        y = self.pick()
        assert y is not None
        expr = r.choice([
            f"{x.name}.sum()",
            f"{x.name}.mean()",
            f"({x.name} * {y.name}).sum()",
            f"{x.name}.pow(2).sum()",
        ])
        self.emit(f"{name} = {expr}")
        return self.add(_Var(name, (), "node", rg=True, leafy=False))

    def inputs(self) -> str:
        r = self.r
        leaves = [v for v in self.vars if v.kind in ("leaf", "param")]
        nodes = [v for v in self.vars if v.rg and v.kind not in ("leaf", "param") and v.shape != ()]
        chosen: list[_Var] = []
        if leaves:
            chosen += r.sample(leaves, r.randint(1, len(leaves)))
        if nodes and (not chosen or r.random() < 0.7):
            chosen += r.sample(nodes, r.randint(1, min(2, len(nodes))))
        r.shuffle(chosen)
        return "[" + ", ".join(v.name for v in chosen) + "]"

    def backwards(self) -> None:
        r = self.r
        plan = r.choices(
            ["plain", "inputs", "grad", "twice", "list"], weights=[3, 3, 3, 4, 2]
        )[0]
        if plan == "plain":
            loss = self.loss("loss")
            self.emit(f"oracle.backward({loss.name})")
        elif plan == "inputs":
            loss = self.loss("loss")
            self.emit(f"oracle.backward({loss.name}, inputs={self.inputs()})")
        elif plan == "grad":
            loss = self.loss("loss")
            self.emit(f"grads = oracle.grad({loss.name}, {self.inputs()}, allow_unused=True)")
        elif plan == "twice":
            l1 = self.loss("l1")
            l2 = self.loss("l2") if r.random() < 0.6 else l1
            retain = ", retain_graph=True" if r.random() < 0.4 else ""
            first = r.choice(["backward", "backward", "grad"])
            if first == "backward":
                self.emit(f"oracle.backward({l1.name}{retain})")
            else:
                self.emit(f"grads = oracle.grad({l1.name}, {self.inputs()}{retain}, "
                          "allow_unused=True)")
            if r.random() < 0.4:
                self.mutate()  # between the two, like an optimizer step
            second = r.choice(["backward", "inputs", "grad"])
            if second == "backward":
                self.emit(f"oracle.backward({l2.name})")
            elif second == "inputs":
                self.emit(f"oracle.backward({l2.name}, inputs={self.inputs()})")
            else:
                self.emit(f"grads = oracle.grad({l2.name}, {self.inputs()}, allow_unused=True)")
        else:
            l1 = self.loss("l1")
            l2 = self.loss("l2")
            self.emit(f"oracle.backward([{l1.name}, {l2.name}])")

    def program(self) -> str:
        self.emit(f"# program {self.seed}")
        self.leaves()
        n_ops = self.r.randint(5, 20)
        for _ in range(n_ops):
            self.op()
            if self.r.random() < 0.22:
                self.mutate()
        self.backwards()
        return "\n".join(self.lines) + "\n"


def _fits(src: Shape, dst: Shape) -> bool:
    """``dst.add_(src)`` is valid: src broadcasts to dst's shape."""
    try:
        return _broadcast(src, dst) == dst
    except RuntimeError:
        return False


def generate(seed: int, *, view_relu: bool = True, silent: bool = False) -> str:
    """The source text of program ``seed``: same seed, same text.

    ``view_relu=False`` leaves out ``relu_()`` on views (see :data:`HIDDEN_SAVE`).
    ``silent=True`` makes every mutation a write through ``.data`` (see
    :data:`SILENT` and :func:`visible`).
    """
    return _Gen(seed, view_relu, silent).program()


def visible(src: str) -> str:
    """A silent program with each ``.data`` write made through ``.detach()`` instead.

    The same write to the same memory, but sharing the version counter: PyTorch
    raises at exactly the backwards that would read memory the silent program
    changed behind its back.
    """
    return src.replace(".data.", ".detach().").replace(SILENT, "visible")


_SEED_RE = re.compile(r"^# program (\d+)$", re.MULTILINE)
_MUTATES_RE = re.compile(r"#\s*mutates:\s*(\w+)")


def mutation_lines(src: str) -> dict[int, str]:
    """``{line number: tensor name}`` for every line that mutates a tensor in place."""
    out = {}
    for i, line in enumerate(src.splitlines(), start=1):
        m = _MUTATES_RE.search(line)
        if m is not None:
            out[i] = m.group(1)
    return out


def run_program(src: str, oracle: Oracle, *, seed: int | None = None) -> list[Outcome]:
    """Run one generated program; return the outcomes of the backwards it reached.

    The program stops at the first backward that fails in PyTorch (the oracle
    has already compared that failure with the prediction and re-raises it).
    An :class:`AssertionError` (a prediction mismatch) and any other error,
    e.g. a :data:`FORWARD_ERRORS` one, propagate.
    """
    if seed is None:
        m = _SEED_RE.search(src)
        seed = int(m.group(1)) if m else -1
    filename = f"<program {seed}>"
    # So that tracebacks and linecache-based tools can show the program's lines.
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    code = compile(src, filename, "exec")
    namespace: dict[str, Any] = {
        "__name__": f"program_{seed}",
        "torch": torch,
        "oracle": oracle,
        "SaveIn": SaveIn,
        "SaveOut": SaveOut,
        "SaveBoth": SaveBoth,
    }
    start = len(oracle.outcomes)
    try:
        exec(code, namespace)
    except RuntimeError:
        ran = oracle.outcomes[start:]
        if not ran or ran[-1].kind is None:
            raise  # not a backward's failure: an error in the forward
    finally:
        namespace.clear()
    return list(oracle.outcomes[start:])


class WriteTrace(TorchDispatchMode):
    """Ground truth for strict mode, from below autograd: every aten op that writes.

    Records ``(storage, version before, line)`` for each tensor argument an op's
    schema marks as written, with the line of program ``seed`` that ran it. This
    sees the ops themselves, not the Python entry points that strict mode wraps,
    so the two are independent. The version is read before autograd bumps it
    (the bump happens above this dispatch key, once the op has returned), so a
    write moved its tensor from ``version`` to ``version + 1``.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.filename = f"<program {seed}>"
        self.writes: list[tuple[int, int, int]] = []

    def _line(self) -> int | None:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename == self.filename:
                return f.f_lineno
            f = f.f_back  # type: ignore[assignment]
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                for x in t if isinstance(t, (list, tuple)) else (t,):
                    if isinstance(x, torch.Tensor):
                        written.append((torch._C._storage_address(x), x._version))
        out = func(*args, **kwargs)
        if written:
            line = self._line()
            if line is not None:
                self.writes += [(key, version, line) for key, version in written]
        return out

    def lines(self, saved: int, now: int) -> dict[int, list[int]]:
        """``{storage: sorted lines}`` of the writes that moved a tensor from ``saved`` to ``now``."""
        out: dict[int, list[int]] = {}
        for key, version, line in self.writes:
            if saved <= version < now:
                out.setdefault(key, []).append(line)
        return {k: sorted(v) for k, v in out.items()}
