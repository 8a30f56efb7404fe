"""``versionwatch fix``'s families that move or merge statements: a step, a ``no_grad`` update.

- ``move_step``: the optimizer step (and its ``zero_grad``) after the last
  backward of the forward, or merged into a step of the same optimizer there;
- ``sum_losses``: one backward of the summed losses, then the step;
- ``refresh``: the forward again after the step, where the second loss reads it;
- ``set_to_none``: ``zero_grad(set_to_none=True)``, which only hides the
  failure (rejected by rule);
- ``move_update``: a ``torch.no_grad()`` update (EMA swap, clipping) after the step.
"""

from __future__ import annotations

import ast
import builtins

from versionwatch._candidates.facts import FixFacts, Line
from versionwatch._candidates.shared import (
    COMPOUND,
    DATA_NAMESPACES,
    Candidate,
    Sources,
    backward_call,
    callee,
    calls,
    candidate,
    dotted,
    enclosing_loop,
    failing_in_loop,
    function_stmts,
    insert_after,
    insert_before,
    is_true,
    keyword_edit,
    loss_of,
    method_stmt,
    moved_text,
    remove,
    retain_edit,
    stmt_with,
)
from versionwatch._candidates.source import Edit, Source, apply


def _step_site(facts: FixFacts, sources: Sources,
               ) -> tuple[Source, list[ast.stmt], int, int, str] | None:
    """The step and the failing backward after it in one block: (source, the block, the
    step's index, the backward's index, the stepping optimizer)."""
    src = sources.at(facts.step)
    if (src is None or facts.step is None or facts.failing_backward is None
            or facts.failing_backward.file != facts.step.file):
        return None

    def is_step(s: ast.stmt) -> bool:
        return any(callee(c) == "step" for c in calls(s))

    s_stmt = stmt_with(src, facts.step.line, is_step)
    b_stmt = stmt_with(src, facts.failing_backward.line, lambda s: backward_call(s) is not None)
    if s_stmt is None or b_stmt is None:
        return None
    step_call = next(c for c in calls(s_stmt) if callee(c) == "step")
    if not isinstance(step_call.func, ast.Attribute):
        return None
    receiver = src.segment(step_call.func.value)
    common = src.common_block(s_stmt, b_stmt)
    if common is None or common[1] >= common[2]:
        return None
    body, i_s, i_b = common
    if body[i_s] is not s_stmt or body[i_b] is not b_stmt:
        return None  # one of them sits in a block (`if ...:`) of its own: not moved out of it
    return src, body, i_s, i_b, receiver


def _stepper(stmt: ast.stmt, src: Source) -> str | None:
    """The optimizer ``stmt`` steps (``opt`` of ``opt.step()``), if it is one step call."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
            and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "step":
        return src.segment(stmt.value.func.value)
    return None


def step_families(facts: FixFacts, sources: Sources) -> list[Candidate]:
    site = _step_site(facts, sources)
    if site is None:
        return []
    src, body, i_s, i_b, receiver = site
    step, last = body[i_s], body[i_b]
    zeros = [body[j] for j in range(i_s + 1, i_b)
             if method_stmt(body[j], "zero_grad", receiver, src)]
    later = None
    for j in range(i_b + 1, len(body)):
        if backward_call(body[j]) is not None:
            break
        if method_stmt(body[j], "step", receiver, src):
            later = body[j]
            break
    backward_text = src.segment(backward_call(last) or last)
    try:
        moves = [remove(src, s) for s in (step, *zeros)]
        if later is None:
            moves.append(insert_after(src, last, [step, *zeros]))
    except ValueError:
        return []
    out = []
    if later is not None:
        moved = "the step (and zero_grad)" if zeros else "the step"
        summary = (f"one `{receiver}.step()` after both backwards: {moved} "
                   f"between them is gone, so `{backward_text}` runs on the weights its forward "
                   "used and the step applies the gradients of both losses (as one backward of "
                   "their sum would)")
    else:
        summary = (f"`{receiver}.step()` moves after `{backward_text}`: every backward runs on "
                   "the weights its forward used, and the step then applies this backward's "
                   "gradient too")
    # The forward again after the step: first when the step is another network's
    # (a GAN's opt_d between D's loss and G's); after the merges when the same
    # optimizer steps again after the last backward (two losses of one model).
    refresh = _refresh(facts, src, body, i_s, i_b, receiver, backward_text)
    if later is None:
        out += refresh
    # Another optimizer's step follows the failing backward: that loss trains only
    # what that optimizer holds (an actor-critic's two heads over one trunk).
    out += _other_optimizer(facts, src, body, i_s, i_b, receiver)
    first_stmt = None
    for j in range(i_s - 1, -1, -1):
        if backward_call(body[j]) is not None:
            first_stmt = body[j]
            break
    retain: list[Edit] = []
    if facts.kind == "freed":
        # The first backward freed the graph: moving the step is not enough.
        first_call = backward_call(first_stmt) if first_stmt is not None else None
        keep = retain_edit(src, first_call) if first_call is not None else None
        if keep is None or first_call is None:
            moves = []
        else:
            retain = [keep]
            summary += (f", and `retain_graph=True` on `{src.segment(first_call)}` keeps "
                        "its graph for the second")
    # Another optimizer steps after the last backward (an actor's, a generator's): the
    # moved step may then apply that loss's gradients to what it should not train.
    other = any(callee(c) == "step" and isinstance(c.func, ast.Attribute)
                and src.segment(c.func.value) != receiver
                for st in body[i_b + 1:] for c in calls(st))
    cand = candidate("move_step", summary, src, moves + retain) if moves else None
    if cand is not None:
        cand.extra.update(merged=later is not None, other_step=other)
        out.append(cand)
    # One backward of the summed losses.
    if first_stmt is not None:
        for c in _sum_losses(src, first_stmt, last, body, moves):
            c.extra.update(merged=later is not None, other_step=other)
            out.append(c)
    if later is not None:
        out += refresh
    # The hider: zero_grad(set_to_none=True).
    edits = []
    for call in calls(src.function(step)):
        if not (callee(call) == "zero_grad" and isinstance(call.func, ast.Attribute)
                and src.segment(call.func.value) == receiver):
            continue
        for k in call.keywords:
            if k.arg == "set_to_none" and not is_true(k.value):
                edits.append(Edit(src.start(k.value), src.end(k.value), "True"))
        if call.args and not is_true(call.args[0]):
            edits.append(Edit(src.start(call.args[0]), src.end(call.args[0]), "True"))
    if edits:
        cand = candidate(
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
    made = stmt_with(src, saved.line, lambda s: isinstance(s, ast.Assign))
    if not (isinstance(made, ast.Assign) and len(made.targets) == 1
            and isinstance(made.targets[0], ast.Name) and isinstance(made.value, ast.Call)):
        return _refresh_unpacked(src, body, i_s, i_b, receiver, backward_text)
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
        return (_refresh_before(src, body, i_s, i_b, made, receiver, backward_text)
                or _refresh_unpacked(src, body, i_s, i_b, receiver, backward_text))
    cand = candidate(
        "refresh", f"`{expr}` again after `{receiver}.step()`: `{backward_text}` runs through "
        "a new forward on the weights the step changed, not through the one made before it",
        src, edits)
    return [cand] if cand is not None else []


def _sum_losses(src: Source, first: ast.stmt, last: ast.stmt, body: list[ast.stmt],
                moves: list[Edit], family: str = "sum_losses") -> list[Candidate]:
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
    # `(a + b).backward()`; an argument needs no parentheses: `manual_backward(a + b)`.
    receiver = isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) \
        and isinstance(last.value.func, ast.Attribute) and last.value.func.value is b
    total = f"({a_text} + {b_text})" if receiver else f"{a_text} + {b_text}"
    try:
        edits = [remove(src, first), *moves,
                 Edit(src.start(b), src.end(b), total)]
    except ValueError:
        return []
    summary = (f"one backward of `{a_text} + {b_text}`, then one step: both losses' "
               "gradients, taken on the weights the forward used, applied together")
    if family == "sum_backwards":
        summary = (f"one backward of `{a_text} + {b_text}`: the first backward no longer "
                   "changes (through the hooks it runs) the weights the second one needs, and "
                   "each forward gets one backward")
    cand = candidate(family, summary, src, edits, same_backwards=False)
    return [cand] if cand is not None else []


def sum_backwards(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """Two backwards of one forward, nothing stepped between them in the loop, and the
    first one changed what the second needs (an optimizer in backward: hooks that step
    each parameter as its gradient arrives): one backward of the summed losses."""
    fb = facts.failing_backward
    src = sources.at(fb)
    if src is None or fb is None or facts.kind == "freed":
        return []
    last = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    place = src.block(last) if last is not None else None
    if last is None or place is None:
        return []
    body, i_b = place
    for j in range(i_b - 1, -1, -1):
        stmt = body[j]
        if any(callee(c) in ("step", "zero_grad") for c in calls(stmt)):
            return []  # a step between them: the step families' case
        if backward_call(stmt) is not None:
            return _sum_losses(src, stmt, last, body, [], family="sum_backwards")
    return []


def one_forward(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """Two forwards of one module before one backward, where the module's own forward
    writes what the first one saved (DDP's buffer broadcast, a stand-in for it):
    one forward of both batches, concatenated, split after."""
    fb = facts.failing_backward
    src = sources.at(fb)
    if src is None or fb is None or not facts.tensor or not facts.update:
        return []
    writers = [sources.at(u) for u in facts.update]
    in_forward = False
    for w_src, u in zip(writers, facts.update):
        stmts = w_src.statements_at(u.line) if w_src is not None else []
        func = w_src.function(stmts[0]) if w_src is not None and stmts else None
        in_forward = in_forward or getattr(func, "name", "") == "forward"
    last = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    place = src.block(last) if last is not None else None
    if not in_forward or last is None or place is None:
        return []
    body, i_b = place

    def forward_of(stmt: ast.stmt) -> tuple[str, str, ast.expr] | None:
        """``out = M(x)``: (out, M, x)."""
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Call)
                and len(stmt.value.args) == 1 and not stmt.value.keywords
                and dotted(stmt.value.func) is not None):
            return None
        return stmt.targets[0].id, src.segment(stmt.value.func), stmt.value.args[0]

    pairs = []
    for j in range(i_b - 1, 0, -1):
        if backward_call(body[j]) is not None:
            break
        a, b = forward_of(body[j - 1]), forward_of(body[j])
        if a is not None and b is not None and a[1] == b[1] and src.alone(body[j - 1]) \
                and src.alone(body[j]):
            pairs.append((j - 1, a, b))
    if not pairs:
        return []
    j, (out_a, module, x_a), (out_b, _, x_b) = pairs[0]
    indent = src.indent(body[j].lineno)
    if isinstance(x_a, ast.Name) and isinstance(x_b, ast.Name):
        in_a, in_b, bind = x_a.id, x_b.id, ""
    else:
        in_a, in_b = f"{out_a}_input", f"{out_b}_input"
        bind = f"{indent}{in_a}, {in_b} = {src.segment(x_a)}, {src.segment(x_b)}\n"
    text = (f"{bind}{indent}{out_a}, {out_b} = {module}(torch.cat([{in_a}, {in_b}]))"
            f".split([len({in_a}), len({in_b})])\n")
    first, end = src.whole_lines(body[j])[0], src.whole_lines(body[j + 1])[1]
    cand = candidate(
        "one_forward", f"one forward of `{module}` on both batches, concatenated, then split: "
        f"the write in `{module}`'s forward (line {facts.update[-1].line}) happens once, before "
        "the forward that saves what the backward needs; the batch statistics are over both "
        "batches now", src, [Edit((first, 0), (end + 1, 0), text)])
    return [cand] if cand is not None and "torch" in _imported(src) else []


def _imported(src: Source) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def move_update(facts: FixFacts, sources: Sources) -> list[Candidate]:
    fb = facts.failing_backward
    if not facts.update or fb is None:
        return []
    src = sources.at(fb)
    if src is None:
        return []
    b_stmt = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
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
                for stmt in function_stmts(src, b_stmt, 0, b_stmt.lineno - 1):
                    if any(callee(c) == helper.name for c in calls(stmt)):
                        u_stmt = stmt
        if u_stmt is None:
            continue
        common = src.common_block(u_stmt, b_stmt)
        if common is None or common[1] >= common[2]:
            continue
        body, i_u, i_b = common
        anchor = body[i_b]
        for j in range(i_b + 1, len(body)):
            if backward_call(body[j]) is not None:
                break
            if any(callee(c) == "step" for c in calls(body[j])):
                anchor = body[j]
                break
        try:
            edits = [remove(src, body[i_u]), insert_after(src, anchor, [body[i_u]])]
        except ValueError:
            continue
        after = src.segment(backward_call(anchor) or next(calls(anchor), anchor))
        moved = body[i_u]
        head = src.line_text(moved.lineno).strip()
        what = (f"the `{head}` block (line {moved.lineno})" if isinstance(moved, COMPOUND)
                else f"`{src.segment(moved)}` (line {moved.lineno})")
        cand = candidate(
            "move_update", f"{what} moves after `{after}`: the "
            "backward runs on the weights its forward used, and the update still happens "
            "once an iteration", src, edits)
        return [cand] if cand is not None else []
    return []




def _names(stmt: ast.AST, ctx: type[ast.expr_context]) -> set[str]:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _other_optimizer(facts: FixFacts, src: Source, body: list[ast.stmt], i_s: int, i_b: int,
                     receiver: str) -> list[Candidate]:
    """``backward_inputs`` and ``reorder_backwards``: the failing backward is followed by
    the step of another optimizer than the one that stepped before it."""
    last = body[i_b]
    other = None
    ends = True  # nothing steps or backwards after the failing backward, in its block
    for st in body[i_b + 1:]:
        if backward_call(st) is not None:
            ends = False
            break
        opt = _stepper(st, src)
        if opt is not None:
            ends = False
            other = opt if opt != receiver else None
            break
    if facts.failing_backward is None:
        return []
    call = backward_call(last)
    backward_text = src.segment(call) if call is not None else src.segment(last)
    if other is None:
        # A backward whose gradients no step applies here (the block ends with it), in a
        # program of two optimizers (an actor's loss after the critic's step): run it
        # before the step's zero_grad, which then clears what it left on the weights the
        # step changes; the check says whether that trains as the program did.
        reorder = _reorder_backwards(facts, src, body, i_s, i_b, receiver, "", backward_text) \
            if ends and len(_optimizers(src, src.function(last))) >= 2 else None
        return [reorder] if reorder is not None else []
    out: list[Candidate] = []
    loss = loss_of(last)
    if (call is not None and loss is not None and isinstance(call.func, ast.Attribute)
            and call.func.attr == "backward"
            and not any(k.arg == "inputs" for k in call.keywords)):
        params = f'[p for g in {other}.param_groups for p in g["params"]]'
        edit = keyword_edit(src, call, "inputs", params)
        loss_text = src.segment(loss)
        cand = candidate(
            "backward_inputs", f"`{loss_text}.backward(inputs=...)` over the parameters of "
            f"`{other}`: the loss then trains only what `{other}.step()` applies, as the "
            f"program's steps did, and its backward no longer runs through the weights "
            f"`{receiver}.step()` changed",
            src, [edit] if edit is not None else [], cut_at=(facts.failing_backward,))
        if cand is not None:
            out.append(cand)
    reorder = _reorder_backwards(facts, src, body, i_s, i_b, receiver, other, backward_text)
    return out + ([reorder] if reorder is not None else [])


def _optimizers(src: Source, scope: ast.AST) -> set[str]:
    """The optimizers ``scope`` (a function, or the module) makes
    (``opt = torch.optim.Adam(...)``) or steps."""
    out = {_stepper(st, src) for st in ast.walk(scope) if isinstance(st, ast.stmt)}
    for node in ast.walk(scope):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and "optim" in (dotted(node.value.func) or "").split(".")[:-1]):
            out |= {src.segment(t) for t in node.targets}
    return {o for o in out if o}


def _reorder_backwards(facts: FixFacts, src: Source, body: list[ast.stmt], i_s: int, i_b: int,
                       receiver: str, other: str, backward_text: str) -> Candidate | None:
    """The failing loss's statements after the step (its ``zero_grad()``, its backward)
    moved before the other optimizer's ``zero_grad()``/backward/step."""
    moved = body[i_s + 1:i_b + 1]
    if any(backward_call(st) is not None or _stepper(st, src) is not None
           or isinstance(st, COMPOUND) for st in moved[:-1]):
        return None
    i_1 = next((j for j in range(i_s - 1, -1, -1) if backward_call(body[j]) is not None), None)
    if i_1 is None:
        return None
    # Before the stepping optimizer's zero_grad: else its step would also apply the
    # moved loss's gradients to the weights both losses reach.
    ins = i_1
    for j in range(i_1 - 1, -1, -1):
        if backward_call(body[j]) is not None or _stepper(body[j], src) is not None:
            break
        if method_stmt(body[j], "zero_grad", receiver, src):
            ins = j
            break
    if not other and ins == i_1:
        return None  # no zero_grad to clear what it leaves: the step would apply it too
    reads = set().union(*(_names(st, ast.Load) for st in moved))
    if reads & set().union(*(_names(st, ast.Store) for st in body[ins:i_s + 1])):
        return None  # it reads what is made between: it cannot run before
    # The moved backward now runs first, through the graph the other one needs too.
    first_call = backward_call(body[i_1])
    shared = facts.kind == "freed" or (first_call is not None and any(
        k.arg == "retain_graph" and is_true(k.value) for k in first_call.keywords))
    last_call = backward_call(body[i_b])
    keep = retain_edit(src, last_call) if shared and last_call is not None else None
    text = apply(src.text, [keep]) if keep is not None else src.text
    # The retain edit keeps every line where it was: the same statements, in a new parse.
    new_src = Source(src.path, text)
    new_last = stmt_with(new_src, body[i_b].lineno, lambda s: backward_call(s) is not None)
    place = new_src.block(new_last) if new_last is not None else None
    if place is None:
        return None
    new_body = place[0]
    anchor = new_body[ins]
    indent = new_src.indent(anchor.lineno)
    try:
        edits = [remove(new_src, st) for st in new_body[i_s + 1:i_b + 1]]
        edits.append(insert_before(new_src, anchor, "".join(
            moved_text(new_src, st, indent) for st in new_body[i_s + 1:i_b + 1])))
    except ValueError:
        return None
    zero = any(method_stmt(st, "zero_grad", other, src) for st in moved)
    what = f"`{backward_text}`" + (f" and `{other}.zero_grad()`" if zero else "")
    summary = (f"{what} move before `{src.segment(body[ins])}`: the backward runs on the "
               f"weights its forward used, and each step still applies only its own loss's "
               "gradients")
    if keep is not None:
        summary += (f"; `retain_graph=True` on `{backward_text}`, which now runs first, keeps "
                    "the graph the other backward needs")
    cand = candidate("reorder_backwards", summary, new_src, edits)
    if cand is not None:
        cand.files = {src.path: (src.text, cand.files[src.path][1])}
    return cand


def move_forward(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """A loss (and the forward it reads) made once before the loop whose every iteration
    back-propagates it: both moved to the top of the loop's body."""
    found = failing_in_loop(facts, sources)
    if found is None:
        return []
    src, fail, loss, loop = found
    name = loss.id
    if any(name in _names(st, ast.Store)
           for st in function_stmts(src, fail, loop.lineno - 1, loop.end_lineno or loop.lineno)):
        return []  # made in the loop: not this shape
    place = src.block(loop)
    if place is None:
        return []
    body, i_loop = place

    def made_at(n: str, upto: int) -> int | None:
        for j in range(upto - 1, -1, -1):
            if n in _names(body[j], ast.Store):
                return j if isinstance(body[j], ast.Assign) else None
        return None

    # A forward calls a value the program made (a model, a criterion), not an import, a
    # class it defines or a builtin: those make models and data, which stay where they are.
    makers = {a.asname or a.name.split(".")[0] for node in ast.walk(src.tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    makers |= {node.name for node in ast.walk(src.tree) if isinstance(node, ast.ClassDef)}
    makers |= set(dir(builtins)) | set(DATA_NAMESPACES)

    def forward(st: ast.stmt) -> bool:
        return isinstance(st, ast.Assign) and any(
            (dotted(c.func) or "").split(".")[0] not in makers for c in calls(st.value))

    first = made_at(name, i_loop)
    if first is None:
        return []
    picked, queue = {first}, [first]
    while queue:
        k = queue.pop()
        for n in _names(body[k], ast.Load):
            m = made_at(n, k)
            if m is not None and m not in picked and forward(body[m]):
                picked.add(m)
                queue.append(m)
    moved = [body[k] for k in sorted(picked)]
    made = set().union(*(_names(st, ast.Store) for st in moved))
    if any(_names(body[k], ast.Load) & made for k in range(min(picked), i_loop)
           if k not in picked):
        return []  # a statement left before the loop reads what would move
    anchor = loop.body[0]
    indent = src.indent(anchor.lineno)
    try:
        edits = [remove(src, st) for st in moved]
        edits.append(insert_before(src, anchor, "".join(moved_text(src, st, indent)
                                                        for st in moved)))
    except ValueError:
        return []
    what = ", ".join(f"`{src.segment(st)}`" for st in moved)
    cand = candidate(
        "move_forward", f"{what} move into the loop (line {loop.lineno}): each iteration's "
        f"`{src.segment(fail)}` runs through a forward made on that iteration's weights, not "
        "through the one made once before the loop, which the first backward freed", src, edits)
    return [cand] if cand is not None else []


def _refresh_unpacked(src: Source, body: list[ast.stmt], i_s: int, i_b: int, receiver: str,
                      backward_text: str) -> list[Candidate]:
    """The forward the failing loss reads, made before the step by ``a, b = model(x)``
    (or saved inside the model's ``forward``): the same statement again after the step."""
    after = body[i_s + 1:i_b + 1]
    reads = set().union(*(_names(st, ast.Load) for st in after))
    written = set().union(*(_names(st, ast.Store) for st in after))
    for j in range(i_s - 1, -1, -1):
        st = body[j]
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1
                and isinstance(st.value, ast.Call)):
            continue
        target = st.targets[0]
        names = [target.id] if isinstance(target, ast.Name) else [
            e.id for e in target.elts if isinstance(e, ast.Name)] if isinstance(
            target, ast.Tuple) else []
        if not names or not set(names) & reads:
            continue
        if set(names) & written:
            return []
        # Only a forward of plain values (a new torch.randn(...) would be new data), that
        # reads nothing made between it and the step.
        args = [*st.value.args, *(k.value for k in st.value.keywords)]
        if not all(isinstance(a, (ast.Name, ast.Attribute, ast.Constant)) for a in args):
            return []
        between = set().union(*(_names(x, ast.Store) for x in body[j + 1:i_s + 1]))
        if (_names(st, ast.Load) - set(names)) & between:
            return []
        step = body[i_s]
        try:
            edits = [insert_after(src, step, [st])]
        except ValueError:
            return []
        text = src.segment(st)
        cand = candidate(
            "refresh", f"`{text}` again after `{receiver}.step()`: `{backward_text}` runs "
            "through a new forward on the weights the step changed, not through the one made "
            "before it", src, edits)
        return [cand] if cand is not None else []
    return _refresh_chain(src, body, i_s, i_b, receiver, backward_text)


# Calls that draw new random values: re-running them would train on other data.
_DRAWS = {"sample", "rsample", "multinomial", "bernoulli", "randint", "rand", "randn",
          "randn_like", "rand_like", "randint_like", "normal", "normal_", "dropout", "randperm"}


def _refresh_chain(src: Source, body: list[ast.stmt], i_s: int, i_b: int, receiver: str,
                   backward_text: str) -> list[Candidate]:
    """The failing loss made before the step from a forward (an A2C's ``policy_loss``
    from ``logits, values = net(obs)``): the forward, and the statements between it and
    the loss that the loss needs, again after the step. Statements that draw random
    values (``actions = dist.sample()``) are not run again: the loss keeps its data."""
    loss = loss_of(body[i_b])
    if not isinstance(loss, ast.Name):
        return []
    after = body[i_s + 1:i_b]
    if loss.id in set().union(*(_names(st, ast.Store) for st in after)):
        return []
    j_loss = next((j for j in range(i_s - 1, -1, -1)
                   if loss.id in _names(body[j], ast.Store)), None)
    if j_loss is None or not isinstance(body[j_loss], ast.Assign):
        return []
    needed = set(_names(body[j_loss], ast.Load))
    chain = [j_loss]
    forward = None
    for j in range(j_loss - 1, -1, -1):
        st = body[j]
        stored = _names(st, ast.Store)
        if not stored & needed:
            continue
        if not isinstance(st, ast.Assign) or isinstance(st, COMPOUND):
            return []
        chain.append(j)
        needed |= _names(st, ast.Load)
        value = st.value
        if (isinstance(value, ast.Call) and not isinstance(value.func, ast.Attribute)
                and isinstance(value.func, ast.Name) and value.func.id[:1].islower()
                and value.func.id not in dir(builtins)
                and all(isinstance(a, (ast.Name, ast.Attribute, ast.Constant))
                        for a in [*value.args, *(k.value for k in value.keywords)])):
            forward = j  # `net(obs)`: a module the program made, on plain values
            break
    if forward is None:
        return []
    rerun = [body[j] for j in sorted(chain)
             if not any(callee(c) in _DRAWS for c in calls(body[j]))]
    # What the re-run reads must be what it read before the step.
    made_between = set().union(*(_names(x, ast.Store) for x in body[forward + 1:i_s + 1]))
    made_here = set().union(*(_names(x, ast.Store) for x in rerun))
    reads = set().union(*(_names(x, ast.Load) for x in rerun))
    if (reads - made_here) & made_between - {n for j in chain for n in _names(body[j], ast.Store)}:
        return []
    try:
        edits = [insert_after(src, body[i_s], rerun)]
    except ValueError:
        return []
    text = src.segment(body[forward])
    cand = candidate(
        "refresh", f"`{text}` again after `{receiver}.step()`, and `{loss.id}` made from it "
        f"there: `{backward_text}` runs through a new forward on the weights the step "
        "changed, not through the one made before it", src, edits)
    return [cand] if cand is not None else []


def _refresh_before(src: Source, body: list[ast.stmt], i_s: int, i_b: int, made: ast.Assign,
                    receiver: str, backward_text: str) -> list[Candidate]:
    """One forward ``d_fake = D(fake)`` feeds both losses, both made before the step: the
    forward again after the step, and the failing loss made again from it there.

    Where the backward before the step frees the graph that made the forward's input
    (no ``retain_graph=True``), that forward takes the input detached
    (``D(fake.detach())``): the loss after the step reaches it through the new forward.
    """
    target, value = made.targets[0], made.value
    loss = loss_of(body[i_b])
    if not (isinstance(target, ast.Name) and isinstance(value, ast.Call)
            and isinstance(loss, ast.Name)) or made not in body[:i_s]:
        return []
    name, expr = target.id, src.segment(value)
    i_l = next((j for j in range(i_s - 1, -1, -1) if isinstance(body[j], ast.Assign)
                and loss.id in _names(body[j], ast.Store)), None)
    if i_l is None or name not in _names(body[i_l], ast.Load) or body.index(made) > i_l:
        return []
    made_again = body[i_l]
    if (_names(made_again, ast.Load) - {name}) & set().union(
            *(_names(st, ast.Store) for st in body[i_l + 1:i_s + 1])):
        return []  # it reads what changes before the step: not made again the same
    i_1 = next((j for j in range(i_s - 1, -1, -1) if backward_call(body[j]) is not None), None)
    first_call = backward_call(body[i_1]) if i_1 is not None else None
    detach: list[Edit] = []
    if first_call is not None and not any(k.arg == "retain_graph" and is_true(k.value)
                                          for k in first_call.keywords):
        # The graph that made the input is freed by that backward: the forward before the
        # step takes it detached (its loss trains the network of the forward only).
        i_m = body.index(made)
        makers = [st for st in body[:i_m]
                  if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call)]
        for arg in value.args:
            if isinstance(arg, ast.Name) and any(arg.id in _names(st, ast.Store)
                                                 for st in makers):
                detach.append(Edit(src.start(arg), src.end(arg), f"{arg.id}.detach()"))
    step = body[i_s]
    if not src.alone(step):
        return []
    indent = src.indent(step.lineno)
    text = f"{indent}{name} = {expr}\n" + moved_text(src, made_again, indent)
    line = src.whole_lines(step)[1] + 1
    edits = [*detach, Edit((line, 0), (line, 0), text)]
    read_between = any(loss.id in _names(st, ast.Load) for st in body[i_l + 1:i_s + 1])
    if not read_between:
        try:
            edits.append(remove(src, made_again))
        except ValueError:
            return []
    summary = (f"`{name} = {expr}` again after `{receiver}.step()`, and "
               f"`{src.segment(made_again)}` made from it there: `{backward_text}` runs "
               "through a new forward on the weights the step changed, not through the one "
               "made before it")
    cut: tuple[Line, ...] = ()
    if detach and i_1 is not None and first_call is not None:
        arg_text = ", ".join(src.span_text(e.start, e.end) for e in detach)
        summary += (f"; the forward before the step takes `{arg_text}` detached, so that "
                    f"`{src.segment(first_call)}` does not free the graph the new one needs")
        cut = (Line(src.path, body[i_1].lineno, src.line_text(body[i_1].lineno).strip()),)
    cand = candidate("refresh", summary, src, edits, cut_at=cut)
    return [cand] if cand is not None else []


def step_after_chunks(facts: FixFacts, sources: Sources) -> list[Candidate]:
    """One forward, then a loop of backwards over its chunks with a step in each
    (``for hc in h.split(4): ...; loss.backward(retain_graph=True); opt.step()``): the
    step (and its ``zero_grad``) once, after the loop (before it): every chunk's backward
    runs on the weights the forward used, and one step applies all their gradients."""
    src = sources.at(facts.step)
    if (src is None or facts.step is None or facts.failing_backward is None
            or facts.saved_at is None or facts.failing_backward.file != facts.step.file):
        return []
    s_stmt = stmt_with(src, facts.step.line, lambda s: _stepper(s, src) is not None)
    b_stmt = stmt_with(src, facts.failing_backward.line, lambda s: backward_call(s) is not None)
    if s_stmt is None or b_stmt is None:
        return []
    place = src.block(b_stmt)
    loop = enclosing_loop(src, b_stmt)
    if place is None or loop is None or not isinstance(loop, ast.For):
        return []
    body = place[0]
    if body is not loop.body or s_stmt not in body or body.index(s_stmt) < body.index(b_stmt):
        return []
    # The saved forward ran before this loop, once: what it iterates over are its chunks.
    if facts.saved_at.file == src.path and loop.lineno <= facts.saved_at.line <= (
            loop.end_lineno or loop.lineno):
        return []
    receiver = _stepper(s_stmt, src) or ""
    zeros = [st for st in body if method_stmt(st, "zero_grad", receiver, src)]
    indent = src.indent(loop.lineno)
    try:
        edits = [remove(src, st) for st in (*zeros, s_stmt)]
        if zeros:
            edits.append(insert_before(src, loop, moved_text(src, zeros[0], indent)))
        edits.append(insert_after(src, loop, [s_stmt]))
    except ValueError:
        return []
    said = f" (and `{src.segment(zeros[0])}` once before it)" if zeros else ""
    cand = candidate(
        "step_after_chunks", f"`{receiver}.step()` once after the loop{said}: every "
        "chunk's backward runs on the weights the forward used, and one step applies the "
        "gradients of all chunks", src, edits)
    return [cand] if cand is not None else []
