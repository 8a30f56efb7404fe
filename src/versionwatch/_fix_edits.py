"""Candidate fixes: edits of the user's own lines, one family per failure pattern.

:func:`propose` reads :class:`~versionwatch._fix_facts.FixFacts` and returns
:class:`Candidate` patches, most likely right first. Each family needs its own
facts and gives nothing without them:

- ``out_of_place`` (``write``, on an activation): ``y.mul_(2)`` -> ``y = y.mul(2)``,
  ``x += e`` -> ``x = x + e``, ``t.relu_()`` -> ``t = t.relu()``, ``x[i] = v`` ->
  ``x = x.index_put((i,), v)`` or ``x = x.clone()`` first, ``masked_fill_`` ->
  ``masked_fill``, ``F.relu(x, inplace=True)`` -> ``inplace=False``.
- ``inplace_false`` (``module_built``, else in-place modules found in the files):
  ``nn.ReLU(inplace=True)``, ``nn.Dropout(0.5, True)`` -> ``inplace=False``.
- ``move_step`` (``step``, ``failing_backward``): the step and its ``zero_grad``
  after the last backward, or merged into a step of the same optimizer there.
- ``sum_losses`` (the same, and a backward before the step): one backward of the
  summed losses.
- ``refresh`` (the same, and ``saved_at`` a plain forward ``y = M(x)`` before the
  step): ``M(x)`` again after the step where the second loss reads ``y``.
- ``set_to_none`` (the same): ``zero_grad(set_to_none=True)``, which only hides
  the failure: rejected by rule.
- ``move_update`` (``update``): a ``no_grad`` update (EMA, clipping) after the step.
- ``gan_detach`` (``carried`` fed to a forward before the first backward):
  ``D(fake.detach())`` in that backward's loss.
- ``detach_made`` (``carried`` used as data): ``adv = (...).detach()`` where made.
- ``detach_carried`` (``carried`` rebuilt from itself in a loop): ``h.detach()``
  where it feeds the next step.
- ``retain_graph`` (``first_backward`` of a freed graph): ``retain_graph=True`` on it.
- ``detach_second`` (``carried`` fed to a forward): ``fake.detach()`` in the
  second loss, which only hides the failure: rejected by rule.

An edit replaces exact spans found with ``ast`` and ``tokenize``
(:mod:`versionwatch._fix_source`), so formatting and comments stay; every
patched file must parse; installed files (site-packages, the standard
library, torch, versionwatch) are never edited.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from versionwatch._fix_facts import FixFacts, Line, shown
from versionwatch._fix_source import (
    Edit,
    Source,
    apply,
    changed_lines,
    library_file,
    unified_diff,
)

__all__ = ["Candidate", "Sources", "complete", "propose"]

# Module classes with an `inplace` argument -> its position among __init__'s
# arguments after self (tests check this against the running torch).
MODULE_INPLACE = {
    "ReLU": 0, "ReLU6": 0, "SELU": 0, "SiLU": 0, "Mish": 0, "Hardswish": 0,
    "Hardsigmoid": 0, "LeakyReLU": 1, "ELU": 1, "CELU": 1, "Hardtanh": 2,
    "Threshold": 2, "RReLU": 2, "Dropout": 1, "Dropout1d": 1, "Dropout2d": 1,
    "Dropout3d": 1, "AlphaDropout": 1, "FeatureAlphaDropout": 1,
}
# torch.nn.functional's in-place-able functions -> the position of `inplace`.
FUNCTIONAL_INPLACE = {
    "relu": 1, "relu6": 1, "selu": 1, "silu": 1, "mish": 1, "hardswish": 1,
    "hardsigmoid": 1, "leaky_relu": 2, "elu": 2, "celu": 2, "hardtanh": 3,
    "threshold": 3, "rrelu": 4, "dropout": 3, "dropout1d": 3, "dropout2d": 3,
    "dropout3d": 3, "alpha_dropout": 3, "feature_alpha_dropout": 3,
}
# In-place methods whose name less "_" is no out-of-place twin of the same meaning.
_NO_TWIN = {"requires_grad_", "share_memory_", "resize_", "resize_as_", "set_", "detach_",
            "copy_", "zero_", "fill_", "retain_grad", "record_stream", "uniform_",
            "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
            "log_normal_", "fill_diagonal_", "index_fill_"}
_AUG_OPS = {
    ast.Add: ("+", "add_"), ast.Sub: ("-", "sub_"), ast.Mult: ("*", "mul_"),
    ast.Div: ("/", "div_"), ast.FloorDiv: ("//", "floor_divide_"), ast.Mod: ("%", "remainder_"),
    ast.Pow: ("**", "pow_"), ast.MatMult: ("@", "matmul_"), ast.BitAnd: ("&", "bitwise_and_"),
    ast.BitOr: ("|", "bitwise_or_"), ast.BitXor: ("^", "bitwise_xor_"),
    ast.LShift: ("<<", "bitwise_left_shift_"), ast.RShift: (">>", "bitwise_right_shift_"),
}
_SETITEM_OPS = {"copy_", "fill_", "index_put_", "masked_fill_", "masked_scatter_",
                "__setitem__", "setitem"}
# Callees that take tensors as data, not as a network's input (for carried_use).
_DATA_CALLEES = ("loss", "criterion", "bce", "mse", "nll", "cross_entropy", "l1", "huber",
                 "kl_div", "print", "len", "float", "int", "isinstance", "type")
_DATA_NAMESPACES = ("torch", "F", "functional", "math", "np", "numpy")
_COMPOUND = (ast.With, ast.For, ast.If, ast.While, ast.Try, ast.AsyncWith, ast.AsyncFor)


@dataclass
class Candidate:
    """One proposed patch, and what its check found.

    Attributes:
        family: which kind of edit (see the module's table).
        summary: one line on what it changes.
        files: absolute path -> (old text, new text) of each edited file.
        keeps_values: the family claims the values stay the same (an out-of-place
            form, ``inplace=False``, ``retain_graph=True``); the check compares
            them and clears it if they differ.
        same_backwards: the patched program runs the same backward calls in the
            same order (false for summed losses), so they compare one by one.
        cut_at: backwards whose reach may shrink on purpose (the discriminator's
            loss in ``D(fake.detach())``); ``cut_any``: every backward's may.
        hides: why this edit only hides the failure, by rule (never verified).
        checked: a run of the patched program checked it.
        verified: the check found the hazard gone and the program further on.
        why: the check's finding, one line.
    """

    family: str
    summary: str
    files: dict[str, tuple[str, str]]
    keeps_values: bool = False
    same_backwards: bool = True
    cut_at: tuple[Line, ...] = ()
    cut_any: bool = False
    hides: str | None = None
    checked: bool = False
    verified: bool = False
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def file(self) -> str:
        return next(iter(self.files))

    @property
    def line(self) -> int:
        old, new = self.files[self.file]
        return changed_lines(old, new)[0]

    @property
    def old(self) -> str:
        return "\n".join(ln for o, n in self.files.values() for ln in changed_lines(o, n)[1])

    @property
    def new(self) -> str:
        return "\n".join(ln for o, n in self.files.values() for ln in changed_lines(o, n)[2])

    @property
    def diff(self) -> str:
        return "".join(unified_diff(shown(path), old, new)
                       for path, (old, new) in self.files.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family, "summary": self.summary, "file": shown(self.file),
            "line": self.line, "old": self.old, "new": self.new, "diff": self.diff,
            "checked": self.checked, "verified": self.verified,
            "keeps_values": self.keeps_values, "why": self.why,
        }


# -- reading the user's files -------------------------------------------------------

class Sources:
    """The user's files, parsed once; ``None`` for one that cannot be read or parsed."""

    def __init__(self, texts: dict[str, str] | None = None) -> None:
        self._texts = dict(texts or {})
        self._parsed: dict[str, Source | None] = {}

    def get(self, path: str) -> Source | None:
        if path not in self._parsed:
            text = self._texts.get(path)
            if text is None and not path.startswith("<"):
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError):
                    text = None
            try:
                self._parsed[path] = None if text is None else Source(path, text)
            except (SyntaxError, ValueError):
                self._parsed[path] = None
        return self._parsed[path]

    def at(self, line: Line | None) -> Source | None:
        """The source of ``line``'s file, if the line still reads as the watcher saw it."""
        if line is None or (not line.file.startswith("<") and library_file(line.file)):
            return None
        src = self.get(line.file)
        if src is None:
            return None
        if line.code and src.line_text(line.line).strip() != line.code.strip():
            return None  # edited since the run
        return src


# -- small ast helpers ---------------------------------------------------------------

def _calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node``, in source order, not those in functions defined there."""
    found = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Call):
            found.append(n)
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                      ast.ClassDef)):
                stack.append(child)
    found.sort(key=lambda c: (c.lineno, c.col_offset))
    yield from found


def _callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return ""


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _rebindable(node: ast.AST) -> bool:
    """A name or ``a.b.c``: assigning it rebinds what a later read of it finds."""
    return _dotted(node) is not None


def _atomic(node: ast.AST) -> bool:
    """Needs no parentheses as an operand of a binary operator or before ``.detach()``."""
    return isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant,
                             ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp,
                             ast.DictComp, ast.SetComp))


def _true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _backward_call(stmt: ast.AST) -> ast.Call | None:
    for call in _calls(stmt):
        name = _dotted(call.func) or ""
        if _callee(call) == "backward" or name.endswith(("autograd.grad", "autograd.backward")):
            return call
    return None


def _method_stmt(stmt: ast.stmt, attr: str, receiver: str | None, src: Source) -> bool:
    """``stmt`` is ``RECEIVER.attr(...)`` alone."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    f = stmt.value.func
    return (isinstance(f, ast.Attribute) and f.attr == attr
            and (receiver is None or src.segment(f.value) == receiver))


def _stmt_with(src: Source, line: int, pick: Callable[[ast.stmt], bool]) -> ast.stmt | None:
    return next((s for s in src.statements_at(line) if pick(s)), None)


def _arg_uses(node: ast.AST, name: str) -> list[tuple[ast.Name, ast.Call]]:
    """Reads of ``name`` passed straight to a call (``D(fake)``), not as its receiver."""
    out = []
    for call in _calls(node):
        values = [*call.args, *(k.value for k in call.keywords)]
        for v in values:
            if isinstance(v, ast.Name) and v.id == name:
                out.append((v, call))
    return out


def _fed_to_forward(uses: list[tuple[ast.Name, ast.Call]]) -> bool:
    for _, call in uses:
        dotted = _dotted(call.func) or ""
        callee = _callee(call).lower()
        if dotted.split(".")[0] in _DATA_NAMESPACES and "." in dotted:
            continue
        if any(word in callee for word in _DATA_CALLEES):
            continue
        return True
    return False


# -- statement moves -----------------------------------------------------------------

def _remove(src: Source, stmt: ast.stmt) -> Edit:
    if src.alone(stmt):
        first, last = src.whole_lines(stmt)
        return Edit((first, 0), (last + 1, 0), "")
    start, end = src.start(stmt), src.end(stmt)
    toks = list(src.tokens_between((start[0], 0), (end[0] + 1, 0)))
    after = [t for t in toks if t.start >= end]
    before = [t for t in toks if t.end <= start]
    if after and after[0].string == ";":
        rest = [t for t in after[1:] if t.start[0] == after[0].start[0]]
        return Edit(start, rest[0].start if rest else after[0].end, "")
    if before and before[-1].string == ";":
        return Edit(before[-1].start, end, "")
    raise ValueError("cannot remove")


def _moved_text(src: Source, stmt: ast.stmt, indent: str) -> str:
    """``stmt`` as lines at ``indent`` (with its own trailing comment)."""
    if src.alone(stmt):
        first, last = src.whole_lines(stmt)
        old = src.indent(first)
        out = []
        for n in range(first, last + 1):
            text = src.line_text(n)
            body = text[len(old):] if text.startswith(old) else text.lstrip(" \t")
            out.append(indent + body if body.strip() else body)
        text = "".join(out)
        return text if text.endswith("\n") else text + "\n"
    return indent + src.segment(stmt) + "\n"


def _insert_after(src: Source, anchor: ast.stmt, moved: list[ast.stmt]) -> Edit:
    end = src.end(anchor)
    rest = src.line_text(end[0])[end[1]:].strip()
    if not rest or rest.startswith("#"):
        indent = src.indent(anchor.lineno)
        text = "".join(_moved_text(src, s, indent) for s in moved)
        line = end[0] + 1
        if line > len(src.lines) and not src.text.endswith("\n"):
            return Edit(end, end, "\n" + text.rstrip("\n"))
        return Edit((line, 0), (line, 0), text)
    if any(s.lineno != s.end_lineno for s in moved):
        raise ValueError("cannot join a multi-line statement with ';'")
    return Edit(end, end, "".join("; " + src.segment(s) for s in moved))


# -- building candidates -------------------------------------------------------------

def _candidate(family: str, summary: str, src: Source, edits: list[Edit],
               **kw: Any) -> Candidate | None:
    try:
        new = apply(src.text, edits)
        ast.parse(new)
    except (ValueError, SyntaxError):
        return None
    if new == src.text:
        return None
    return Candidate(family, summary, {src.path: (src.text, new)}, **kw)


def _twin(method: str) -> str | None:
    """The out-of-place twin of tensor method ``method`` (``mul_`` -> ``mul``), if any."""
    if not method.endswith("_") or method.endswith("__") or method in _NO_TWIN:
        return None
    import torch

    base = method[:-1]
    return base if hasattr(torch.Tensor, base) else None


def _saver(facts: FixFacts) -> str:
    from versionwatch._explain import op_name

    return f"`{op_name(facts.node)}`" if facts.node else "the op that saved it"


def _out_of_place(facts: FixFacts, sources: Sources) -> list[Candidate]:
    src = sources.at(facts.write)
    if src is None or facts.write is None or facts.tensor is not None:
        return []
    saver = _saver(facts)
    found: list[tuple[str, Candidate]] = []

    def add(op: str, cand: Candidate | None) -> None:
        if cand is not None:
            found.append((op, cand))

    for stmt in src.statements_at(facts.write.line):
        value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        # y.mul_(2)  ->  y = y.mul(2);   z = y.add_(1)  ->  z = y = y.add(1)
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and _rebindable(value.func.value)):
            method = value.func.attr
            namespace = _dotted(value.func.value) == "torch"
            twin = None if namespace else _twin(method)
            if twin is not None:
                target = src.segment(value.func.value)
                end = src.end(value.func)
                edits = [Edit(src.start(value), src.start(value), f"{target} = "),
                         Edit((end[0], end[1] - len(method)), end, twin)]
                add(method, _candidate(
                    "out_of_place", f"`{target} = {target}.{twin}(...)`: the out-of-place form "
                    f"leaves the tensor {saver} saved as it was; the values stay the same",
                    src, edits, keeps_values=True))
            # torch.relu_(x)  ->  x = torch.relu(x)
            elif (method.endswith("_") and namespace and value.args
                  and _rebindable(value.args[0]) and hasattr(__import__("torch"), method[:-1])):
                target = src.segment(value.args[0])
                end = src.end(value.func)
                edits = [Edit(src.start(value), src.start(value), f"{target} = "),
                         Edit((end[0], end[1] - len(method)), end, method[:-1])]
                add(method, _candidate(
                    "out_of_place", f"`{target} = torch.{method[:-1]}({target})`: the "
                    f"out-of-place form leaves the tensor {saver} saved as it was; the values "
                    "stay the same", src, edits, keeps_values=True))
        # x += e  ->  x = x + e
        if isinstance(stmt, ast.AugAssign) and _rebindable(stmt.target):
            symbol, op = _AUG_OPS[type(stmt.op)]
            target = src.segment(stmt.target)
            tok = next((t for t in src.tokens_between(src.end(stmt.target), src.start(stmt.value))
                        if t.string == symbol + "="), None)
            if tok is not None:
                edits = [Edit(tok.start, tok.end, f"= {target} {symbol}")]
                if not _atomic(stmt.value):
                    edits += [Edit(src.start(stmt.value), src.start(stmt.value), "("),
                              Edit(src.end(stmt.value), src.end(stmt.value), ")")]
                add(op, _candidate(
                    "out_of_place", f"`{target} = {target} {symbol} ...` instead of "
                    f"`{target} {symbol}= ...`: a new tensor, and the one {saver} saved stays as "
                    "it was; the values stay the same", src, edits, keeps_values=True))
        # x[i] = v  ->  x = x.index_put((i,), v), or a clone first
        sub = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            sub = stmt.targets[0]
        elif isinstance(stmt, ast.AugAssign):
            sub = stmt.target
        if isinstance(sub, ast.Subscript) and _rebindable(sub.value):
            target = src.segment(sub.value)
            index = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            plain = not any(isinstance(e, (ast.Slice, ast.Starred, ast.Constant)) for e in index)
            if isinstance(stmt, ast.Assign) and plain:
                parts = [src.segment(e) for e in index]
                idx = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
                v = stmt.value
                number = isinstance(v, ast.Constant) or (
                    isinstance(v, ast.UnaryOp) and isinstance(v.operand, ast.Constant))
                val = f"{target}.new_tensor({src.segment(v)})" if number else src.segment(v)
                add("index_put_", _candidate(
                    "out_of_place", f"`{target} = {target}.index_put({idx}, ...)`: the "
                    f"out-of-place form leaves the tensor {saver} saved as it was; the values "
                    "stay the same", src,
                    [Edit(src.start(stmt), src.end(stmt),
                          f"{target} = {target}.index_put({idx}, {val})")],
                    keeps_values=True))
            if src.alone(stmt):
                clone = Edit((stmt.lineno, 0), (stmt.lineno, 0),
                             f"{src.indent(stmt.lineno)}{target} = {target}.clone()\n")
            else:
                clone = Edit(src.start(stmt), src.start(stmt), f"{target} = {target}.clone(); ")
            add("copy_", _candidate(
                "out_of_place", f"`{target} = {target}.clone()` before the index write: it "
                f"writes a copy, and the tensor {saver} saved stays as it was; the values stay "
                "the same", src, [clone], keeps_values=True))
        # F.relu(x, inplace=True)  ->  inplace=False
        for call in _calls(stmt):
            name = _callee(call)
            flag = _inplace_flag(call, FUNCTIONAL_INPLACE.get(name))
            if flag is not None and name not in MODULE_INPLACE:
                add(name + "_", _candidate(
                    "out_of_place", f"`{name}(..., inplace=False)`: it returns a new tensor, "
                    f"and the one {saver} saved stays as it was; the values stay the same",
                    src, [Edit(src.start(flag), src.end(flag), "False")], keeps_values=True))
    if facts.write_op:
        ops = _SETITEM_OPS if facts.write_op in _SETITEM_OPS else {facts.write_op}
        picked = [c for op, c in found if op in ops]
        if picked:
            return picked
    return [c for _, c in found]


def _inplace_flag(call: ast.Call, position: int | None) -> ast.expr | None:
    """The ``True`` that makes ``call`` in place (keyword, or positional at ``position``)."""
    for k in call.keywords:
        if k.arg == "inplace":
            return k.value if _true(k.value) else None
    if position is not None and len(call.args) > position and _true(call.args[position]):
        return call.args[position]
    return None


def _module_constructions(src: Source, line: int | None) -> Iterator[tuple[ast.Call, str]]:
    calls = sorted((n for n in ast.walk(src.tree) if isinstance(n, ast.Call)),
                   key=lambda c: (c.lineno, c.col_offset))  # in functions too
    for call in calls:
        name = _callee(call)
        if name not in MODULE_INPLACE:
            continue
        if line is not None and not (call.lineno <= line <= (call.end_lineno or call.lineno)):
            continue
        if _inplace_flag(call, MODULE_INPLACE[name]) is not None:
            yield call, name


def _inplace_false(facts: FixFacts, sources: Sources, main: str | None) -> list[Candidate]:
    if facts.kind == "freed" or facts.tensor is not None:
        return []
    places: list[tuple[Source, int | None]] = []
    if facts.module_built is not None:
        src = sources.at(facts.module_built)
        if src is not None:
            places.append((src, facts.module_built.line))
    else:
        files = dict.fromkeys([*(ln.file for ln in facts.lines()), *([main] if main else [])])
        for path in files:
            src = sources.at(Line(path, 0))
            if src is not None:
                places.append((src, None))
    found = [(src, call, name) for src, line in places
             for call, name in _module_constructions(src, line)]
    if facts.module_class:
        found = [f for f in found if f[2] == facts.module_class] or found
    elif facts.write_op:
        base = facts.write_op.rstrip("_").replace("_", "").lower()
        names = {"hardtanh": ("hardtanh", "relu6")}.get(base, (base,))
        found = [f for f in found if f[2].lower().startswith(names)] or found
    out = []
    for src, call, name in found[:6]:
        flag = _inplace_flag(call, MODULE_INPLACE[name])
        assert flag is not None
        text = "False"
        if flag in call.args and flag is call.args[-1]:
            text = "inplace=False"  # clearer, and no positional argument follows
        cand = _candidate(
            "inplace_false", f"`{name}(..., inplace=False)` at {shown(src.path)}:"
            f"{call.lineno}: its forward returns a new tensor instead of overwriting its input, "
            f"which {_saver(facts)} saved; the values stay the same",
            src, [Edit(src.start(flag), src.end(flag), text)], keeps_values=True)
        if cand is not None:
            out.append(cand)
    return out


def _step_families(facts: FixFacts, sources: Sources) -> list[Candidate]:
    src = sources.at(facts.step)
    if (src is None or facts.step is None or facts.failing_backward is None
            or facts.failing_backward.file != facts.step.file):
        return []

    def is_step(s: ast.stmt) -> bool:
        return any(_callee(c) == "step" for c in _calls(s))

    s_stmt = _stmt_with(src, facts.step.line, is_step)
    b_stmt = _stmt_with(src, facts.failing_backward.line, lambda s: _backward_call(s) is not None)
    if s_stmt is None or b_stmt is None:
        return []
    step_call = next(c for c in _calls(s_stmt) if _callee(c) == "step")
    if not isinstance(step_call.func, ast.Attribute):
        return []
    receiver = src.segment(step_call.func.value)
    common = src.common_block(s_stmt, b_stmt)
    if common is None or common[1] >= common[2]:
        return []
    body, i_s, i_b = common
    step, last = body[i_s], body[i_b]
    zeros = [body[j] for j in range(i_s + 1, i_b)
             if _method_stmt(body[j], "zero_grad", receiver, src)]
    later = None
    for j in range(i_b + 1, len(body)):
        if _backward_call(body[j]) is not None:
            break
        if _method_stmt(body[j], "step", receiver, src):
            later = body[j]
            break
    backward_text = src.segment(_backward_call(last) or last)
    try:
        moves = [_remove(src, s) for s in (step, *zeros)]
        if later is None:
            moves.append(_insert_after(src, last, [step, *zeros]))
    except ValueError:
        return []
    out = []
    if later is not None:
        summary = (f"one `{receiver}.step()` after both backwards: the step (and zero_grad) "
                   f"between them is gone, so `{backward_text}` runs on the weights its forward "
                   "used and the step applies the gradients of both losses (as one backward of "
                   "their sum would)")
    else:
        summary = (f"`{receiver}.step()` moves after `{backward_text}`: every backward runs on "
                   "the weights its forward used")
    out += _refresh(facts, src, body, i_s, i_b, receiver, backward_text)
    cand = _candidate("move_step", summary, src, moves)
    if cand is not None:
        cand.extra["merged"] = later is not None
        out.append(cand)
    # One backward of the summed losses.
    first_stmt = None
    for j in range(i_s - 1, -1, -1):
        if _backward_call(body[j]) is not None:
            first_stmt = body[j]
            break
    if first_stmt is not None:
        for c in _sum_losses(src, first_stmt, last, body, moves):
            c.extra["merged"] = later is not None
            out.append(c)
    # The hider: zero_grad(set_to_none=True).
    edits = []
    for call in _calls(src.function(step)):
        if not (_callee(call) == "zero_grad" and isinstance(call.func, ast.Attribute)
                and src.segment(call.func.value) == receiver):
            continue
        for k in call.keywords:
            if k.arg == "set_to_none" and not _true(k.value):
                edits.append(Edit(src.start(k.value), src.end(k.value), "True"))
        if call.args and not _true(call.args[0]):
            edits.append(Edit(src.start(call.args[0]), src.end(call.args[0]), "True"))
    if edits:
        cand = _candidate(
            "set_to_none", f"`{receiver}.zero_grad(set_to_none=True)`",
            src, edits, hides=(
                "set_to_none=True only hides the failure: the step then skips parameters "
                "whose .grad is None, and the second backward still runs through the "
                "forward made before the step, with gradients for weights that changed"))
        if cand is not None:
            out.append(cand)
    return out


def _refresh(facts: FixFacts, src: Source, body: list[ast.stmt], i_s: int, i_b: int,
             receiver: str, backward_text: str) -> list[Candidate]:
    """Re-run the forward after the step: ``bce(d_fake, ones)`` -> ``bce(D(fake), ones)``."""
    saved = facts.saved_at
    if saved is None or saved.file != src.path or saved.line >= body[i_s].lineno:
        return []
    made = _stmt_with(src, saved.line, lambda s: isinstance(s, ast.Assign))
    if not (isinstance(made, ast.Assign) and len(made.targets) == 1
            and isinstance(made.targets[0], ast.Name) and isinstance(made.value, ast.Call)):
        return []
    # Only a forward of plain values: re-running `model(torch.randn(...))` would draw new data.
    if not all(isinstance(a, (ast.Name, ast.Attribute, ast.Constant))
               for a in [*made.value.args, *(k.value for k in made.value.keywords)]):
        return []
    name, expr = made.targets[0].id, src.segment(made.value)
    edits = []
    for stmt in body[i_s + 1:i_b + 1]:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id == name:
                if not isinstance(node.ctx, ast.Load):
                    return []
                edits.append(Edit(src.start(node), src.end(node), expr))
    if not edits:
        return []
    cand = _candidate(
        "refresh", f"`{expr}` again after `{receiver}.step()`: `{backward_text}` runs through "
        "a new forward on the weights the step changed, not through the one made before it",
        src, edits)
    return [cand] if cand is not None else []


def _sum_losses(src: Source, first: ast.stmt, last: ast.stmt, body: list[ast.stmt],
                moves: list[Edit]) -> list[Candidate]:
    def loss_of(stmt: ast.stmt) -> ast.expr | None:
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute)
                and stmt.value.func.attr == "backward"):
            return stmt.value.func.value
        return None

    a, b = loss_of(first), loss_of(last)
    if a is None or b is None:
        return []
    i1, i2 = body.index(first), body.index(last)
    names = {n.id for n in ast.walk(a) if isinstance(n, ast.Name)}
    rebound = {n.id for s in body[i1 + 1:i2] for n in ast.walk(s)
               if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if names & rebound:
        return []
    a_text, b_text = src.segment(a), src.segment(b)
    try:
        edits = [_remove(src, first), *moves,
                 Edit(src.start(b), src.end(b), f"({a_text} + {b_text})")]
    except ValueError:
        return []
    cand = _candidate(
        "sum_losses", f"one backward of `{a_text} + {b_text}`, then the step: the same "
        "gradients as the two backwards, on the weights the forward used", src, edits,
        same_backwards=False)
    return [cand] if cand is not None else []


def _retain_graph(facts: FixFacts, sources: Sources) -> list[Candidate]:
    src = sources.at(facts.first_backward)
    if src is None or facts.first_backward is None or facts.kind != "freed":
        return []
    stmt = _stmt_with(src, facts.first_backward.line, lambda s: _backward_call(s) is not None)
    call = _backward_call(stmt) if stmt is not None else None
    if call is None:
        return []
    for k in call.keywords:
        if k.arg == "retain_graph":
            if _true(k.value):
                return []
            edit = Edit(src.start(k.value), src.end(k.value), "True")
            break
    else:
        close = src.end(call)
        close = (close[0], close[1] - 1)  # the ")"
        toks = list(src.tokens_between(src.start(call), close))
        last_tok = toks[-1] if toks else None
        if last_tok is not None and last_tok.string == ",":  # keep the trailing comma
            edit = Edit(last_tok.end, last_tok.end, " retain_graph=True,")
        else:
            sep = "" if last_tok is None or last_tok.string == "(" else ", "
            edit = Edit(close, close, f"{sep}retain_graph=True")
    same = facts.failing_backward is not None and facts.failing_backward == facts.first_backward
    text = " ".join(src.segment(call).split())
    summary = (f"`retain_graph=True` on `{text}`: its graph stays for the next backward "
               "through it; the values stay the same")
    if same:
        summary = (f"`retain_graph=True` on `{text}`: every later backward runs through the "
                   "graphs of the earlier ones again")
    cand = _candidate("retain_graph", summary, src, [edit], keeps_values=True)
    return [cand] if cand is not None else []


def _detach_uses(src: Source, stmts: list[ast.stmt], name: str) -> list[Edit]:
    edits = []
    for stmt in stmts:
        for use, _ in _arg_uses(stmt, name):
            edits.append(Edit(src.start(use), src.end(use), f"{name}.detach()"))
    return edits


def _function_stmts(src: Source, anchor: ast.stmt, lo: int, hi: int) -> list[ast.stmt]:
    """Simple statements of ``anchor``'s function whose first line is in ``(lo, hi]``."""
    func = src.function(anchor)
    out = []
    for node in ast.walk(func):
        if (isinstance(node, ast.stmt) and lo < node.lineno <= hi
                and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(node))
                and src.function(node) is func):
            out.append(node)
    return sorted(out, key=lambda s: (s.lineno, s.col_offset))


def _carried_families(facts: FixFacts, sources: Sources) -> list[Candidate]:
    name, made_line = facts.carried, facts.carried_made
    src = sources.at(made_line)
    if (facts.kind != "freed" or not name or src is None or made_line is None
            or facts.failing_backward is None or facts.failing_backward.file != made_line.file):
        return []
    made = _stmt_with(src, made_line.line, lambda s: isinstance(s, ast.Assign))
    fail = _stmt_with(src, facts.failing_backward.line,
                      lambda s: _backward_call(s) is not None)
    if made is None or fail is None:
        return []
    first = facts.first_backward
    loop = first is None or first.line >= facts.failing_backward.line
    use = facts.carried_use
    out: list[Candidate | None] = []
    assert isinstance(made, ast.Assign)
    value = made.value
    if not loop and use == "forward" and first is not None:
        # GAN: D(fake.detach()) in the first backward's loss.
        first_stmt = _stmt_with(src, first.line, lambda s: _backward_call(s) is not None)
        first_call = _backward_call(first_stmt) if first_stmt is not None else None
        first_text = src.segment(first_call) if first_call is not None else str(first)
        stmts = _function_stmts(src, fail, made_line.line, first.line)
        for stmt in stmts:
            edits = _detach_uses(src, [stmt], name)
            if not edits:
                continue
            call = _arg_uses(stmt, name)[0][1]
            callee = src.segment(call.func)
            out.append(_candidate(
                "gan_detach", f"`{callee}({name}.detach())` in the loss of `{first_text}`:"
                f" that backward no longer reaches the network that made `{name}`, which its "
                "own loss trains (the standard GAN step)", src, edits, cut_at=(first,)))
        # The hider: detach it in the second loss.
        stmts = _function_stmts(src, fail, first.line, facts.failing_backward.line)
        edits = _detach_uses(src, stmts, name)
        if edits:
            out.append(_candidate(
                "detach_second", f"`{name}.detach()` in the loss of the failing backward",
                src, edits, hides=(
                    f"detaching `{name}` in the second loss only hides the failure: that loss "
                    f"no longer reaches the network that made `{name}`, so it is not trained "
                    "by it")))
    if len(made.targets) == 1 and isinstance(made.targets[0], ast.Name) \
            and made.targets[0].id == name:
        self_carried = any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(value))
        if self_carried:
            # h = rnn(x, h)  ->  h = rnn(x, h.detach())
            edits = [Edit(src.start(n), src.end(n), f"{name}.detach()") for n in ast.walk(value)
                     if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
            out.append(_candidate(
                "detach_carried", f"`{name}.detach()` where `{name}` feeds the next step "
                f"(line {made.lineno}): each backward runs through its own step only "
                "(truncated backpropagation through time)", src, edits))
        elif use != "forward":
            # adv = returns - values  ->  adv = (returns - values).detach()
            if _atomic(value):
                edits = [Edit(src.end(value), src.end(value), ".detach()")]
            else:
                edits = [Edit(src.start(value), src.start(value), "("),
                         Edit(src.end(value), src.end(value), ").detach()")]
            out.append(_candidate(
                "detach_made", f"`{name}` is made detached (line {made.lineno}): the losses use "
                "it as data, and no backward reaches back through it into the graph that made "
                "it", src, edits, cut_any=use == "data"))
    return [c for c in out if c is not None]


def _move_update(facts: FixFacts, sources: Sources) -> list[Candidate]:
    fb = facts.failing_backward
    if not facts.update or fb is None:
        return []
    src = sources.at(fb)
    if src is None:
        return []
    b_stmt = _stmt_with(src, fb.line, lambda s: _backward_call(s) is not None)
    if b_stmt is None:
        return []
    for line in facts.update:
        if line.file != fb.file:
            continue
        stmts = src.statements_at(line.line)
        if not stmts:
            continue
        u_stmt: ast.stmt | None = stmts[0]
        helper = src.function(stmts[0])
        if helper is not src.function(b_stmt):
            # The write is in a helper the loop calls: move the call.
            u_stmt = None
            if isinstance(helper, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in _function_stmts(src, b_stmt, 0, b_stmt.lineno - 1):
                    if any(_callee(c) == helper.name for c in _calls(stmt)):
                        u_stmt = stmt
        if u_stmt is None:
            continue
        common = src.common_block(u_stmt, b_stmt)
        if common is None or common[1] >= common[2]:
            continue
        body, i_u, i_b = common
        anchor = body[i_b]
        for j in range(i_b + 1, len(body)):
            if _backward_call(body[j]) is not None:
                break
            if any(_callee(c) == "step" for c in _calls(body[j])):
                anchor = body[j]
                break
        try:
            edits = [_remove(src, body[i_u]), _insert_after(src, anchor, [body[i_u]])]
        except ValueError:
            continue
        after = src.segment(_backward_call(anchor) or next(_calls(anchor), anchor))
        moved = body[i_u]
        head = src.line_text(moved.lineno).strip()
        what = (f"the `{head}` block (line {moved.lineno})" if isinstance(moved, _COMPOUND)
                else f"`{src.segment(moved)}` (line {moved.lineno})")
        cand = _candidate(
            "move_update", f"{what} moves after `{after}`: the "
            "backward runs on the weights its forward used, and the update still happens "
            "once an iteration", src, edits)
        return [cand] if cand is not None else []
    return []


# -- facts the source gives ----------------------------------------------------------

def complete(facts: FixFacts, sources: Sources) -> FixFacts:
    """``facts`` with what the source tells filled in where the watcher gave nothing.

    The carried tensor's making line (the last assignment to it before the
    first backward) and its use (fed to a forward, or used as data).
    """
    if facts.kind != "freed" or not facts.carried or facts.failing_backward is None:
        return facts
    src = sources.at(facts.failing_backward)
    if src is None:
        return facts
    fail = _stmt_with(src, facts.failing_backward.line, lambda s: _backward_call(s) is not None)
    if fail is None:
        return facts
    name = facts.carried
    made_line = facts.carried_made
    first = facts.first_backward
    limit = first.line if first is not None and first.line < fail.lineno else fail.lineno
    if made_line is None:
        made = None
        for stmt in _function_stmts(src, fail, 0, limit - 1):
            targets: list[ast.expr] = []
            if isinstance(stmt, ast.Assign):
                targets = stmt.targets
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                targets = [stmt.target]
            stored = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if name in stored:
                made = stmt
        if made is not None:
            made_line = Line(src.path, made.lineno, src.line_text(made.lineno).strip())
    use = facts.carried_use
    if use is None and made_line is not None:
        stmts = _function_stmts(src, fail, made_line.line - 1, fail.end_lineno or fail.lineno)
        uses = [u for s in stmts for u in _arg_uses(s, name)]
        use = "forward" if _fed_to_forward(uses) else "data"
    return replace(facts, carried_made=made_line, carried_use=use)


def propose(facts: FixFacts, sources: Sources | None = None,
            main: str | None = None) -> list[Candidate]:
    """The candidate patches for ``facts``, most likely right first (none are checked).

    Args:
        facts: what the watcher knows about the failure.
        sources: the user's files (default: read from disk, ``facts.sources`` for
            programs that are not files).
        main: the program's main script, searched for in-place modules when the
            facts do not say where the module was built.
    """
    sources = sources or Sources(dict(facts.sources))
    facts = complete(facts, sources)
    out: list[Candidate] = []
    if facts.kind == "freed":
        carried = _carried_families(facts, sources)
        retain = _retain_graph(facts, sources)
        # Nothing between the two backwards: retain_graph=True is the fix; a
        # step between: detaching is, and retain_graph runs into the step.
        if facts.between == "nothing":
            out += retain + carried
        else:
            out += carried + retain
    else:
        out += _out_of_place(facts, sources)
        if not any(c.family == "out_of_place" for c in out):
            out += _inplace_false(facts, sources, main)
        out += _move_update(facts, sources)
        out += _step_families(facts, sources)
    seen: set[tuple[tuple[str, str], ...]] = set()
    unique = []
    for c in out:
        key = tuple((p, new) for p, (_, new) in sorted(c.files.items()))
        if key not in seen and not any(library_file(p) for p in c.files
                                       if not p.startswith("<")):
            seen.add(key)
            unique.append(c)
    return unique
