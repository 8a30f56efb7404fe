"""Candidate fixes: edits of the user's own lines, one family per failure pattern.

:func:`propose` reads :class:`~versionwatch._candidates.facts.FixFacts` and returns
:class:`Candidate` patches, most likely right first. Each family needs its own
facts and gives nothing without them:

- ``out_of_place`` (``write``, on an activation): ``y.mul_(2)`` -> ``y = y.mul(2)``,
  ``x += e`` -> ``x = x + e``, ``t.relu_()`` -> ``t = t.relu()``, ``x[i] = v`` ->
  ``x = x.index_put((i,), v)`` (``x = x.masked_fill(mask, v)`` for a boolean mask,
  as the source shows it, and a number) or ``x = x.clone()`` first, ``masked_fill_`` ->
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
- ``step_after_chunks`` (``step`` after the failing backward, in a loop over the chunks
  of a forward made before it): the step once after the loop, its ``zero_grad`` before.
- ``move_update`` (``update``): a ``no_grad`` update (EMA, clipping) after the step.
- ``gan_detach`` (``carried`` fed to a forward before the first backward):
  ``D(fake.detach())`` in that backward's loss.
- ``detach_made`` (``carried`` used as data): ``adv = (...).detach()`` where made.
- ``detach_carried`` (``carried`` rebuilt from itself in a loop): ``h.detach()``
  where it feeds the next step.
- ``backward_inputs`` (``step``, and another optimizer's step after the failing
  backward): ``loss.backward(inputs=[p for g in opt.param_groups for p in g["params"]])``,
  the loss trains only what that optimizer applies.
- ``reorder_backwards`` (the same): the failing loss's ``zero_grad()`` and backward
  (``retain_graph=True`` where the other needs the graph) before the other optimizer's.
- ``refresh`` also where one forward (``d_fake = D(fake)``) feeds both losses, made
  before the step: the forward and the failing loss made again after the step.
- ``move_forward`` (a loss made once before the loop that back-propagates it): the
  forward and the loss moved into the loop.
- ``reset_accumulator`` (``total.backward()`` of a total never reset): ``total = 0``
  again after the step; ``item_accumulator``: ``loss.backward()`` and
  ``total += loss.item()``, where the total is only logged.
- ``detach_state`` (``logits, state = model(x, state)``, an LSTM's tuple or a state
  starting as ``None``): ``state`` detached right after the call.
- ``retain_graph`` (``first_backward`` of a freed graph): ``retain_graph=True`` on it.
- ``detach_second`` (``carried`` fed to a forward): ``fake.detach()`` in the
  second loss, which only hides the failure: rejected by rule.

An edit replaces exact spans found with ``ast`` and ``tokenize``
(:mod:`versionwatch._candidates.source`), so formatting and comments stay; every
patched file must parse; installed files (site-packages, the standard
library, torch, versionwatch) are never edited.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import replace

from versionwatch._candidates.facts import FixFacts, Line, shown
from versionwatch._candidates.freed import (
    accumulator_families,
    carried_families,
    complete,
    detach_state,
    retain_graph,
)
from versionwatch._candidates.moves import (
    move_forward,
    move_update,
    one_forward,
    step_after_chunks,
    step_families,
    sum_backwards,
)
from versionwatch._candidates.shared import (
    Candidate,
    Sources,
    atomic,
    callee,
    calls,
    candidate,
    dotted,
    is_true,
    rebindable,
    saver,
)
from versionwatch._candidates.source import Edit, Source, library_file

__all__ = ["FUNCTIONAL_INPLACE", "MODULE_INPLACE", "Candidate", "Sources", "complete", "propose"]

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

def _twin(method: str) -> str | None:
    """The out-of-place twin of tensor method ``method`` (``mul_`` -> ``mul``), if any."""
    if not method.endswith("_") or method.endswith("__") or method in _NO_TWIN:
        return None
    import torch

    base = method[:-1]
    return base if hasattr(torch.Tensor, base) else None


# Tensor methods and torch functions whose result is a boolean tensor.
_BOOLEAN = {"bool", "logical_not", "logical_and", "logical_or", "logical_xor", "isnan",
            "isinf", "isfinite", "isposinf", "isneginf", "isclose", "eq", "ne", "lt", "le",
            "gt", "ge", "greater", "less", "greater_equal", "less_equal", "not_equal",
            "signbit", "isin"}


def _is_bool_dtype(e: ast.expr) -> bool:
    return dotted(e) in ("torch.bool", "bool")


def _boolean(src: Source, e: ast.expr, depth: int = 0) -> bool:
    """Whether the source shows ``e`` is a boolean tensor: a comparison, ``.bool()``,
    ``dtype=torch.bool``, ``~``/``&``/``|`` of such, or a name only ever bound to one."""
    if depth > 4:
        return False
    if isinstance(e, ast.Compare):
        return True
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.Invert, ast.Not)):
        return _boolean(src, e.operand, depth + 1)
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return _boolean(src, e.left, depth + 1) and _boolean(src, e.right, depth + 1)
    if isinstance(e, ast.Call):
        if any(k.arg == "dtype" and _is_bool_dtype(k.value) for k in e.keywords):
            return True
        if isinstance(e.func, ast.Attribute):
            if e.func.attr in _BOOLEAN:
                return True
            if e.func.attr in ("to", "type") and any(_is_bool_dtype(a) for a in e.args):
                return True
        return False
    if isinstance(e, ast.Name):
        values = src.values_of(e.id, e)
        return bool(values) and all(_boolean(src, v, depth + 1) for v in values or ())
    return False


def _scalar(e: ast.expr) -> bool:
    """A number as the user wrote it: ``0.0``, ``-1e9``, ``float("-inf")``."""
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
        e = e.operand
    if isinstance(e, ast.Constant):
        return isinstance(e.value, (int, float))  # bool too
    return (isinstance(e, ast.Call) and dotted(e.func) == "float" and len(e.args) == 1
            and isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, str))


def _out_of_place(facts: FixFacts, sources: Sources) -> list[Candidate]:
    found = _out_of_place_line(facts, sources)
    if not found:
        return found
    return found + _every_write(facts, sources, found[0])


def _every_write(facts: FixFacts, sources: Sources, first: Candidate) -> list[Candidate]:
    """``first``'s edit made at every in-place write to its variable in its function.

    A pre-norm block writes ``x += f(norm(x))`` twice: each norm saved the ``x``
    the next write changes, and fixing the line the watcher named leaves the
    other one failing the same way.
    """
    src = sources.at(facts.write)
    target = first.extra.get("target")
    if src is None or facts.write is None or not target:
        return []
    stmts = src.statements_at(facts.write.line)
    if not stmts:
        return []
    func = src.function(stmts[0])
    others = []
    for node in ast.walk(func):
        if not isinstance(node, ast.stmt) or src.function(node) is not func \
                or node.lineno == facts.write.line:
            continue
        if isinstance(node, ast.AugAssign) and dotted(node.target) == target:
            others.append(node.lineno)
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute)
              and dotted(node.value.func.value) == target and _twin(node.value.func.attr)):
            others.append(node.lineno)
    if not others:
        return []
    text = first.files[src.path][1]
    for line in sorted(others):
        # Each edit keeps the line count, so the other lines stay where they were.
        step = Sources({src.path: text})
        more = _out_of_place_line(replace(facts, write=Line(src.path, line), write_op=None), step)
        more = [c for c in more if c.extra.get("target") == target
                and c.files[src.path][1].count("\n") == text.count("\n")]
        if not more:
            return []
        text = more[0].files[src.path][1]
    lines = ", ".join(str(n) for n in sorted([facts.write.line, *others]))
    where = getattr(func, "name", "the module")
    summary = (f"the out-of-place form at every in-place write to `{target}` in `{where}` "
               f"(lines {lines}): each one changed what an op before it saved; the values "
               "stay the same")
    return [Candidate("out_of_place", summary, {src.path: (src.text, text)}, keeps_values=True,
                      extra={"target": target})]


def _out_of_place_line(facts: FixFacts, sources: Sources) -> list[Candidate]:
    src = sources.at(facts.write)
    if src is None or facts.write is None or facts.tensor is not None:
        return []
    saved_by = saver(facts)
    found: list[tuple[str, Candidate]] = []

    def add(op: str, cand: Candidate | None) -> None:
        if cand is not None:
            found.append((op, cand))

    for stmt in src.statements_at(facts.write.line):
        value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        # y.mul_(2)  ->  y = y.mul(2);   z = y.add_(1)  ->  z = y = y.add(1)
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and rebindable(value.func.value)):
            method = value.func.attr
            namespace = dotted(value.func.value) == "torch"
            twin = None if namespace else _twin(method)
            if twin is not None:
                target = src.segment(value.func.value)
                end = src.end(value.func)
                edits = [Edit(src.start(value), src.start(value), f"{target} = "),
                         Edit((end[0], end[1] - len(method)), end, twin)]
                add(method, candidate(
                    "out_of_place", f"`{target} = {target}.{twin}(...)`: the out-of-place form "
                    f"leaves the tensor {saved_by} saved as it was; the values stay the same",
                    src, edits, keeps_values=True, extra={"target": target}))
            # torch.relu_(x)  ->  x = torch.relu(x)
            elif (method.endswith("_") and namespace and value.args
                  and rebindable(value.args[0]) and hasattr(__import__("torch"), method[:-1])):
                target = src.segment(value.args[0])
                end = src.end(value.func)
                edits = [Edit(src.start(value), src.start(value), f"{target} = "),
                         Edit((end[0], end[1] - len(method)), end, method[:-1])]
                add(method, candidate(
                    "out_of_place", f"`{target} = torch.{method[:-1]}({target})`: the "
                    f"out-of-place form leaves the tensor {saved_by} saved as it was; the values "
                    "stay the same", src, edits, keeps_values=True))
        # x += e  ->  x = x + e
        if isinstance(stmt, ast.AugAssign) and rebindable(stmt.target):
            symbol, op = _AUG_OPS[type(stmt.op)]
            target = src.segment(stmt.target)
            tok = next((t for t in src.tokens_between(src.end(stmt.target), src.start(stmt.value))
                        if t.string == symbol + "="), None)
            if tok is not None:
                edits = [Edit(tok.start, tok.end, f"= {target} {symbol}")]
                if not atomic(stmt.value):
                    edits += [Edit(src.start(stmt.value), src.start(stmt.value), "("),
                              Edit(src.end(stmt.value), src.end(stmt.value), ")")]
                add(op, candidate(
                    "out_of_place", f"`{target} = {target} {symbol} ...` instead of "
                    f"`{target} {symbol}= ...`: a new tensor, and the one {saved_by} saved stays "
                    "as it was; the values stay the same", src, edits, keeps_values=True,
                    extra={"target": target}))
        # x[i] = v  ->  x = x.index_put((i,), v), or a clone first
        sub = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            sub = stmt.targets[0]
        elif isinstance(stmt, ast.AugAssign):
            sub = stmt.target
        if isinstance(sub, ast.Subscript) and rebindable(sub.value):
            target = src.segment(sub.value)
            index = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            plain = not any(isinstance(e, (ast.Slice, ast.Starred, ast.Constant)) for e in index)
            if isinstance(stmt, ast.Assign) and len(index) == 1 and _scalar(stmt.value) \
                    and _boolean(src, index[0]):
                # x[mask] = 0.0  ->  x = x.masked_fill(mask, 0.0)
                edit = (f"{target} = {target}.masked_fill({src.segment(index[0])}, "
                        f"{src.segment(stmt.value)})")
                add("masked_fill_", candidate(
                    "out_of_place", f"`{target} = {target}.masked_fill(mask, ...)`: the "
                    f"out-of-place form leaves the tensor {saved_by} saved as it was; the values "
                    "stay the same", src, [Edit(src.start(stmt), src.end(stmt), edit)],
                    keeps_values=True))
            elif isinstance(stmt, ast.Assign) and plain:
                parts = [src.segment(e) for e in index]
                idx = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
                v = stmt.value
                number = isinstance(v, ast.Constant) or (
                    isinstance(v, ast.UnaryOp) and isinstance(v.operand, ast.Constant))
                val = f"{target}.new_tensor({src.segment(v)})" if number else src.segment(v)
                add("index_put_", candidate(
                    "out_of_place", f"`{target} = {target}.index_put({idx}, ...)`: the "
                    f"out-of-place form leaves the tensor {saved_by} saved as it was; the values "
                    "stay the same", src,
                    [Edit(src.start(stmt), src.end(stmt),
                          f"{target} = {target}.index_put({idx}, {val})")],
                    keeps_values=True))
            if src.alone(stmt):
                # Above the comment lines that say what the write does: they stay with it.
                top = src.comments_above(stmt.lineno)
                clone = Edit((top, 0), (top, 0),
                             f"{src.indent(stmt.lineno)}{target} = {target}.clone()\n")
            else:
                clone = Edit(src.start(stmt), src.start(stmt), f"{target} = {target}.clone(); ")
            add("copy_", candidate(
                "out_of_place", f"`{target} = {target}.clone()` before the index write: it "
                f"writes a copy, and the tensor {saved_by} saved stays as it was; the values stay "
                "the same", src, [clone], keeps_values=True))
        # F.relu(x, inplace=True)  ->  inplace=False
        for call in calls(stmt):
            name = callee(call)
            flag = _inplace_flag(call, FUNCTIONAL_INPLACE.get(name))
            if flag is not None and name not in MODULE_INPLACE:
                add(name + "_", candidate(
                    "out_of_place", f"`{name}(..., inplace=False)`: it returns a new tensor, "
                    f"and the one {saved_by} saved stays as it was; the values stay the same",
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
            return k.value if is_true(k.value) else None
    if position is not None and len(call.args) > position and is_true(call.args[position]):
        return call.args[position]
    return None


def _module_constructions(src: Source, line: int | None) -> Iterator[tuple[ast.Call, str]]:
    calls = sorted((n for n in ast.walk(src.tree) if isinstance(n, ast.Call)),
                   key=lambda c: (c.lineno, c.col_offset))  # in functions too
    for call in calls:
        name = callee(call)
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
        cand = candidate(
            "inplace_false", f"`{name}(..., inplace=False)` at {shown(src.path)}:"
            f"{call.lineno}: its forward returns a new tensor instead of overwriting its input, "
            f"which {saver(facts)} saved; the values stay the same",
            src, [Edit(src.start(flag), src.end(flag), text)], keeps_values=True)
        if cand is not None:
            out.append(cand)
    return out


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
    # Shapes the program's loop has (a loss made before it, a total never reset, a
    # state carried through it): each fits one shape only, so first when it fits.
    out: list[Candidate] = [*move_forward(facts, sources), *accumulator_families(facts, sources),
                            *detach_state(facts, sources)]
    if facts.kind == "freed":
        carried = carried_families(facts, sources)
        retain = retain_graph(facts, sources)
        # Nothing between the two backwards: retain_graph=True is the fix; a
        # step between: detaching is, and retain_graph runs into the step.
        if facts.between == "nothing":
            out += retain + carried
        else:
            # A step between two losses of one output: sum them, or keep the graph
            # and move the step. Not for a tensor fed to another network's forward
            # (a GAN's `fake`): its step must not see the second loss.
            steps = step_families(facts, sources) if facts.carried_use != "forward" else []
            out += carried + steps + retain
    else:
        out += _out_of_place(facts, sources)
        if not any(c.family == "out_of_place" for c in out):
            out += _inplace_false(facts, sources, main)
        out += move_update(facts, sources)
        out += step_families(facts, sources)
        out += step_after_chunks(facts, sources)
        out += sum_backwards(facts, sources)
        out += one_forward(facts, sources)
    seen: set[tuple[tuple[str, str], ...]] = set()
    unique = []
    for c in out:
        key = tuple((p, new) for p, (_, new) in sorted(c.files.items()))
        if key not in seen and not any(library_file(p) for p in c.files
                                       if not p.startswith("<")):
            seen.add(key)
            c.files = sources.as_written(c.files)
            unique.append(c)
    return unique
