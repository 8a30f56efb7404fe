"""``versionwatch fix``'s families for a graph freed by an earlier backward.

- ``retain_graph``: ``retain_graph=True`` on the backward that freed it;
- ``gan_detach``: ``D(fake.detach())`` in the loss of that backward;
- ``detach_second``: the same in the failing backward's loss, which only hides
  the failure (rejected by rule);
- ``detach_carried``: ``h.detach()`` where carried state feeds the next step;
- ``detach_made``: a tensor used as data, detached where it is made.

:func:`complete` derives from the source what the watcher did not say: the
line that made the carried tensor, and whether it is fed to a forward.
"""

from __future__ import annotations

import ast
from dataclasses import replace

from versionwatch._candidates.facts import FixFacts, Line
from versionwatch._candidates.shared import (
    Candidate,
    Sources,
    arg_uses,
    atomic,
    backward_call,
    callee,
    calls,
    candidate,
    enclosing_loop,
    failing_in_loop,
    fed_to_forward,
    function_stmts,
    loss_of,
    retain_edit,
    stmt_with,
)
from versionwatch._candidates.source import Edit, Source


def retain_graph(facts: FixFacts, sources: Sources) -> list[Candidate]:
    src = sources.at(facts.first_backward)
    if src is None or facts.first_backward is None or facts.kind != "freed":
        return []
    stmt = stmt_with(src, facts.first_backward.line, lambda s: backward_call(s) is not None)
    call = backward_call(stmt) if stmt is not None else None
    if call is None:
        return []
    edit = retain_edit(src, call)
    if edit is None:
        return []
    same = facts.failing_backward is not None and facts.failing_backward == facts.first_backward
    text = " ".join(src.segment(call).split())
    summary = (f"`retain_graph=True` on `{text}`: its graph stays for the next backward "
               "through it; the values stay the same")
    if same:
        summary = (f"`retain_graph=True` on `{text}`: every later backward runs through the "
                   "graphs of the earlier ones again")
    cand = candidate("retain_graph", summary, src, [edit], keeps_values=True)
    return [cand] if cand is not None else []


def _detach_uses(src: Source, stmts: list[ast.stmt], name: str) -> list[Edit]:
    edits = []
    for stmt in stmts:
        for use, _ in arg_uses(stmt, name):
            edits.append(Edit(src.start(use), src.end(use), f"{name}.detach()"))
    return edits


def carried_families(facts: FixFacts, sources: Sources) -> list[Candidate]:
    name, made_line = facts.carried, facts.carried_made
    src = sources.at(made_line)
    if (facts.kind != "freed" or not name or src is None or made_line is None
            or facts.failing_backward is None or facts.failing_backward.file != made_line.file):
        return []
    made = stmt_with(src, made_line.line, lambda s: isinstance(s, ast.Assign))
    fail = stmt_with(src, facts.failing_backward.line,
                      lambda s: backward_call(s) is not None)
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
        first_stmt = stmt_with(src, first.line, lambda s: backward_call(s) is not None)
        first_call = backward_call(first_stmt) if first_stmt is not None else None
        first_text = src.segment(first_call) if first_call is not None else str(first)
        stmts = function_stmts(src, fail, made_line.line, first.line)
        for stmt in stmts:
            edits = _detach_uses(src, [stmt], name)
            if not edits:
                continue
            call = arg_uses(stmt, name)[0][1]
            callee = src.segment(call.func)
            out.append(candidate(
                "gan_detach", f"`{callee}({name}.detach())` in the loss of `{first_text}`:"
                f" that backward no longer reaches the network that made `{name}`, which its "
                "own loss trains (the standard GAN step)", src, edits, cut_at=(first,)))
        # The hider: detach it in the second loss.
        stmts = function_stmts(src, fail, first.line, facts.failing_backward.line)
        edits = _detach_uses(src, stmts, name)
        if edits:
            out.append(candidate(
                "detach_second", f"`{name}.detach()` in the loss of the failing backward",
                src, edits, hides=(
                    f"detaching `{name}` in the second loss only hides the failure: that loss "
                    f"no longer reaches the network that made `{name}`, so it is not trained "
                    "by it")))
    loss = loss_of(fail)
    if len(made.targets) == 1 and isinstance(made.targets[0], ast.Name) \
            and made.targets[0].id == name:
        self_carried = any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(value))
        if self_carried and _plain_start(src, fail, name) is not None:
            pass  # `total = 0` first: a number has no .detach() (the accumulator families)
        elif self_carried:
            # h = rnn(x, h)  ->  h = rnn(x, h.detach())
            edits = [Edit(src.start(n), src.end(n), f"{name}.detach()") for n in ast.walk(value)
                     if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
            out.append(candidate(
                "detach_carried", f"`{name}.detach()` where `{name}` feeds the next step "
                f"(line {made.lineno}): each backward runs through its own step only "
                "(truncated backpropagation through time)", src, edits))
        elif use != "forward" and not (isinstance(loss, ast.Name) and loss.id == name):
            # Never the loss being back-propagated: its backward would have no graph.
            # adv = returns - values  ->  adv = (returns - values).detach()
            if atomic(value):
                edits = [Edit(src.end(value), src.end(value), ".detach()")]
            else:
                edits = [Edit(src.start(value), src.start(value), "("),
                         Edit(src.end(value), src.end(value), ").detach()")]
            out.append(candidate(
                "detach_made", f"`{name}` is made detached (line {made.lineno}): the losses use "
                "it as data, and no backward reaches back through it into the graph that made "
                "it", src, edits, cut_any=use == "data"))
    return [c for c in out if c is not None]


def _plain_start(src: Source, at: ast.stmt, name: str) -> ast.Assign | None:
    """The assignment that gives ``name`` its first value before ``at``'s loop, when it
    is a Python number (``total = 0``, ``-1.0``), in ``at``'s function."""
    loop = enclosing_loop(src, at)
    if loop is None:
        return None
    first = None
    for stmt in function_stmts(src, at, 0, loop.lineno - 1):
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in stmt.targets):
            first = stmt
    if first is None:
        return None
    v = first.value
    if isinstance(v, ast.UnaryOp):
        v = v.operand
    number = isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) \
        and not isinstance(v.value, bool)
    return first if number else None


# -- facts the source gives ----------------------------------------------------------

def complete(facts: FixFacts, sources: Sources) -> FixFacts:
    """``facts`` with what the source tells filled in where the watcher gave nothing.

    The carried tensor's making line (the last assignment to it before the
    first backward) and its use (fed to a forward, or used as data); and the
    carried tensor itself, where the watcher named none, when the op that
    saved the freed tensor is an assignment to one name that the failing
    backward's function reads again later (``hidden = cell(x, hidden)``,
    ``advantages = returns - critic(obs)`` before the loop).
    """
    if facts.kind == "freed" and not facts.carried:
        facts = replace(facts, carried=_carried_by_source(facts, sources))
    if facts.kind == "freed" and facts.between is None:
        facts = _between_by_source(facts, sources)
    if facts.kind != "freed" or not facts.carried or facts.failing_backward is None:
        return facts
    src = sources.at(facts.failing_backward)
    if src is None:
        return facts
    fail = stmt_with(src, facts.failing_backward.line, lambda s: backward_call(s) is not None)
    if fail is None:
        return facts
    name = facts.carried
    made_line = facts.carried_made
    first = facts.first_backward
    limit = first.line if first is not None and first.line < fail.lineno else fail.lineno
    if made_line is None:
        made = None
        for stmt in function_stmts(src, fail, 0, limit - 1):
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
        stmts = function_stmts(src, fail, made_line.line - 1, fail.end_lineno or fail.lineno)
        uses = [u for s in stmts for u in arg_uses(s, name)]
        use = "forward" if fed_to_forward(uses) else "data"
    return replace(facts, carried_made=made_line, carried_use=use)




def _carried_by_source(facts: FixFacts, sources: Sources) -> str | None:
    saved, fb = facts.saved_at, facts.failing_backward
    src = sources.at(saved)
    if src is None or saved is None or fb is None or fb.file != saved.file:
        return None
    made = stmt_with(src, saved.line, lambda s: isinstance(s, ast.Assign))
    fail = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    if not (isinstance(made, ast.Assign) and len(made.targets) == 1
            and isinstance(made.targets[0], ast.Name)) or fail is None:
        return None
    if src.function(made) is not src.function(fail):
        return None
    name = made.targets[0].id
    # Read after it was made (in the loop, or by the failing backward's loss).
    later = function_stmts(src, fail, made.lineno - 1, fail.end_lineno or fail.lineno)
    reads = [n for st in later if st is not made for n in ast.walk(st)
             if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
    own = [n for n in ast.walk(made.value) if isinstance(n, ast.Name) and n.id == name]
    return name if reads or own else None


def _between_by_source(facts: FixFacts, sources: Sources) -> FixFacts:
    """What stands between the freeing backward and the failing one, in one block:
    an optimizer step (``facts.step``), other statements, or nothing."""
    first, fb = facts.first_backward, facts.failing_backward
    src = sources.at(fb)
    if src is None or first is None or fb is None or first.file != fb.file \
            or first.line >= fb.line:
        return facts
    a = stmt_with(src, first.line, lambda s: backward_call(s) is not None)
    b = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    common = src.common_block(a, b) if a is not None and b is not None else None
    if common is None or common[1] >= common[2]:
        return facts
    body, i_a, i_b = common
    between = body[i_a + 1:i_b]
    steps = [s for s in between
             if any(callee(c) == "step" and isinstance(c.func, ast.Attribute) for c in calls(s))]
    if steps:
        step = facts.step or Line(src.path, steps[0].lineno,
                                  src.line_text(steps[0].lineno).strip())
        return replace(facts, between="step", step=step)
    return replace(facts, between="write" if between else "nothing")


# -- state and totals carried by the loop ---------------------------------------------

_LOGGERS = ("print", "info", "debug", "warning", "log", "add_scalar", "write", "set_postfix")


def _loop_start(src: Source, at: ast.stmt, loop: ast.stmt, name: str) -> ast.Assign | None:
    """The last assignment to ``name`` alone before ``loop``, in ``at``'s function."""
    found = None
    for stmt in function_stmts(src, at, 0, loop.lineno - 1):
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name:
            found = stmt
    return found


def _after(src: Source, stmt: ast.stmt, line_text: str) -> Edit | None:
    """A line of its own after ``stmt``, at its indent."""
    if not src.alone(stmt):
        return None
    line = src.whole_lines(stmt)[1] + 1
    return Edit((line, 0), (line, 0), f"{src.indent(stmt.lineno)}{line_text}\n")


def detach_state(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """``logits, state = model(x, state)`` in a loop: ``state`` detached right after the
    call that returns it, where ``state.detach()`` in the call cannot be (it starts as
    ``None``, or it is an LSTM's tuple)."""
    fb = facts.failing_backward
    src = sources.at(fb)
    if src is None or fb is None or facts.kind != "freed":
        return []
    fail = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    loop = enclosing_loop(src, fail) if fail is not None else None
    if fail is None or loop is None:
        return []
    found: list[tuple[ast.Assign, str, bool]] = []
    for stmt in function_stmts(src, fail, loop.lineno, fail.lineno - 1):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.value, ast.Call)):
            continue
        target, call = stmt.targets[0], stmt.value
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        args = {a.id for a in [*call.args, *(k.value for k in call.keywords)]
                if isinstance(a, ast.Name)}
        found += [(stmt, n.id, isinstance(target, ast.Tuple)) for n in names
                  if isinstance(n, ast.Name) and n.id in args]
    if facts.carried:
        found = [f for f in found if f[1] == facts.carried] or found
    if not found:
        return []
    stmt, name, tupled = found[0]
    start = _loop_start(src, fail, loop, name)
    start_value = start.value if start is not None else None
    none_start = isinstance(start_value, ast.Constant) and start_value.value is None
    if not tupled and not none_start:
        return []  # `h = rnn(x, h)` from a tensor: detach_carried's `h.detach()` in the call
    # A tuple (an LSTM's (h, c)) or a tensor (a GRU's, an RNN's h): from how it starts,
    # else from the recurrent modules the file builds.
    built = {callee(c) for c in ast.walk(src.tree) if isinstance(c, ast.Call)}
    lstm = bool(built & {"LSTM", "LSTMCell"})
    plain = bool(built & {"GRU", "RNN", "GRUCell", "RNNCell"})
    if isinstance(start_value, ast.Tuple) or (lstm and not plain and none_start):
        text = f"{name} = tuple(s.detach() for s in {name})"
    elif (plain and not lstm) or (start_value is not None and not none_start):
        text = f"{name} = {name}.detach()"
    elif "torch" in src.text:
        text = (f"{name} = {name}.detach() if isinstance({name}, torch.Tensor) "
                f"else tuple(s.detach() for s in {name})")
    else:
        return []
    edit = _after(src, stmt, text)
    if edit is None:
        return []
    cand = candidate(
        "detach_state", f"`{text}` right after `{src.segment(stmt)}` (line {stmt.lineno}): the "
        "next batch starts from the state's values, and each backward runs through its own "
        "batch only (truncated backpropagation through time)", src, [edit])
    return [cand] if cand is not None else []


def accumulator_families(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """A total never reset (``total = 0`` before the loop, ``total = total + loss`` and
    ``total.backward()`` in it): ``reset_accumulator`` starts it again after the step;
    ``item_accumulator`` back-propagates the loss and adds up ``loss.item()``, when the
    total is only back-propagated and logged."""
    found = failing_in_loop(facts, sources)
    if found is None:
        return []
    src, fail, total, loop = found
    name = total.id
    acc: ast.stmt | None = None
    term: ast.expr | None = None
    for stmt in function_stmts(src, fail, loop.lineno, fail.lineno - 1):
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add) \
                and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            acc, term = stmt, stmt.value
        elif (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
              and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name
              and isinstance(stmt.value, ast.BinOp) and isinstance(stmt.value.op, ast.Add)):
            left, right = stmt.value.left, stmt.value.right
            if isinstance(left, ast.Name) and left.id == name:
                acc, term = stmt, right
            elif isinstance(right, ast.Name) and right.id == name:
                acc, term = stmt, left
    start = _loop_start(src, fail, loop, name)
    if acc is None or term is None or start is None:
        return []
    out: list[Candidate | None] = []
    place = src.block(fail)
    # At the end of the iteration: after the step, and after whatever logs the total
    # (``print(total.item())`` still reads the tensor the iteration made).
    anchor: ast.stmt = place[0][-1] if place is not None else fail
    init = src.segment(start.value)
    reset = _after(src, anchor, f"{name} = {init}")
    if reset is not None:
        out.append(candidate(
            "reset_accumulator", f"`{name} = {init}` again at the end of each iteration: "
            f"`{name}` adds up this iteration's loss only, so `{src.segment(fail)}` runs "
            "through this iteration's graph, on the weights its forward used", src, [reset]))
    if isinstance(term, ast.Name) and _only_logged(src, fail, name, {id(acc), id(fail)}):
        edits = [Edit(src.start(term), src.end(term), f"{term.id}.item()"),
                 Edit(src.start(total), src.end(total), term.id)]
        item = candidate(
            "item_accumulator", f"`{term.id}.backward()`, and `{name}` adds up "
            f"`{term.id}.item()`: the total is kept for logging only, and each backward runs "
            "through this iteration's loss", src, edits)
        if item is not None:
            # The check compares losses by name: this backward's is the total's, renamed.
            item.extra["renames"] = {term.id: name}
        out.append(item)
    # The total kept for logging first: the reset changes what the program prints.
    return [c for c in reversed(out) if c is not None]


def _only_logged(src: Source, at: ast.stmt, name: str, skip: set[int]) -> bool:
    """Every other read of ``name`` in ``at``'s function is a value a logging call shows
    (``print(total)``, an f-string in it): a float serves it as well as a tensor."""
    func = src.function(at)
    for node in ast.walk(func):
        if not (isinstance(node, ast.Name) and node.id == name
                and isinstance(node.ctx, ast.Load)) or src.function(node) is not func:
            continue
        stmt: ast.AST = node
        while not isinstance(stmt, ast.stmt):
            above = src.parent(stmt)
            if above is None:
                return False
            stmt = above[0]
        if id(stmt) in skip:
            continue
        up = src.parent(node)
        if up is None or isinstance(up[0], (ast.Attribute, ast.Subscript)):
            return False  # total.item(), total[0]: a tensor's
        cur: ast.AST = node
        logged = False
        while cur is not stmt:
            parent = src.parent(cur)
            if parent is None:
                break
            cur = parent[0]
            if isinstance(cur, ast.Call) and callee(cur) in _LOGGERS:
                logged = True
                break
        if not logged:
            return False
    return True
