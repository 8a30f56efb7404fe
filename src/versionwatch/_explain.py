"""Words: the fix for each kind of hazard, and the text rendering of a report.

It depends on the report, which knows nothing of it: loading this module
registers the text renderer (and, through ``_dot``, the Graphviz one) that
``str(report)`` and ``report.to_dot()`` use. The package loads it at import.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

from versionwatch import _dot  # noqa: F401  (loads and registers the Graphviz renderer)
from versionwatch._report import (
    UNSURE_HOOKS,
    Hazard,
    Report,
    Writer,
    register_renderer,
    statement,
    written_variable,
)
from versionwatch._torch_messages import BACKWARD_SUFFIX

__all__ = ["fix_for", "op_name", "render_report"]


# Node names (less "Backward0") -> the op as the user writes it.
_OPS = {
    "Add": "x + y", "Sub": "x - y", "Rsub": "x - y", "Mul": "x * y", "Div": "x / y",
    "Pow": "x ** y", "Neg": "-x", "Mm": "x @ y", "Bmm": "x @ y", "Mv": "x @ y",
    "Addmm": "linear", "Addmv": "linear", "Addbmm": "linear", "Baddbmm": "baddbmm",
    "NativeLayerNorm": "layer_norm", "NativeBatchNorm": "batch_norm",
    "CudnnBatchNorm": "batch_norm", "MiopenBatchNorm": "batch_norm",
    "NativeGroupNorm": "group_norm", "Convolution": "conv", "CudnnConvolution": "conv",
    "MkldnnConvolution": "conv", "Index": "x[i]", "IndexPut": "x[i] = v",
    "Threshold": "relu", "CompiledFunction": "a compiled region",
    "CheckpointFunction": "checkpoint",
}
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def op_name(node_or_producer: str) -> str:
    """The op as the user writes it: ``"SigmoidBackward0"`` -> ``"sigmoid"``.

    ``NativeLayerNormBackward0`` -> ``layer_norm``, ``AddBackward0`` -> ``x + y``;
    a custom ``autograd.Function``'s node keeps its class's name.

    >>> op_name("NativeLayerNormBackward0"), op_name("LogSoftmax"), op_name("AddBackward0")
    ('layer_norm', 'log_softmax', 'x + y')
    >>> op_name("MyScaleBackward")
    'MyScale'
    """
    if node_or_producer.endswith("CopySlices"):
        return "an in-place op on a view"
    base = BACKWARD_SUFFIX.sub("", node_or_producer)
    if base in _OPS:
        return _OPS[base]
    custom = node_or_producer.endswith("Backward")  # built-in nodes are numbered
    if custom or not base.isalnum() or base.startswith("_"):
        return base
    return _CAMEL.sub("_", base).lower()


def _op(node_or_producer: str) -> str:
    """:func:`op_name` as a report writes it: code in backticks, a description without."""
    name = op_name(node_or_producer)
    return name if name.startswith(("a ", "an ")) else f"`{name}`"


def _freer(h: Hazard) -> str:
    f = h.freed_by
    if f is None:
        return "the earlier backward"
    return f.description + (f" (at {f.site})" if f.site else "")


def _assigned(code: str, name: str) -> str | None:
    """``name = EXPR`` -> ``EXPR`` as written, if ``code`` is that assignment."""
    stmt = statement(code)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
            and _same_name(stmt.targets[0], name):
        return ast.get_source_segment(code.strip(), stmt.value)
    return None


def _code(code: str) -> str:
    """A source line without its comment: ``h = rnn(x, h)  # carries`` -> ``h = rnn(x, h)``.

    >>> _code("s = '#'  # a hash")
    "s = '#'"
    """
    text = code.strip()
    if "#" not in text:
        return text
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                return text[:tok.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):  # an unfinished line: as it is
        pass
    return text


def _same_name(node: ast.expr, name: str) -> bool:
    return ast.unparse(node) == name


def _freed_fix(h: Hazard) -> str:
    c, b = h.carrier, h.between
    freer = _freer(h)
    if h.carried_by is None and c is None:
        # The same graph, backpropagated a second time.
        if b is not None and b.changes_saved:
            what = ", ".join(str(m) for m in b.events if m.kind != "zero_grad") or "a write"
            return (
                f"{freer} freed this graph, and {what} changed tensors it saved since: "
                "retain_graph=True there would only make this backward fail with \"modified "
                "by an inplace operation\"; sum the losses and call backward once, before "
                "the step, or re-run the forward after the step (the second loss then sees "
                "the new weights)"
            )
        if b is not None and b.changes_saved is False:
            return (
                f"pass retain_graph=True to {freer}: nothing between the two backwards "
                "changes what the graph saved; or sum the losses and call backward once"
            )
        return (
            "an earlier backward already freed this graph's saved tensors: pass "
            "retain_graph=True to that earlier backward, or sum the losses and call "
            "backward once, or re-run the forward before this backward"
        )
    name = (c.name if c is not None and c.name else h.carried_by) or ""
    var = f"`{name}`" if name else "the tensor that carries it"
    role = c.role if c is not None else None
    if role == "state":
        detach = f"`{name} = {name}.detach()`" if name else "`.detach()` on it"
        return (
            f"detach {var} carried from one iteration to the next once its backward has "
            f"run: {detach} before it feeds the next forward (truncated backpropagation "
            "through time); retain_graph=True would make every backward run through all "
            "earlier iterations again, and fail once an optimizer step changed their weights"
        )
    module = c.module if c is not None else None
    if c is not None and c.trained is False:
        whose = f"{module}'s parameters" if module else "what made it"
        made = ""
        rewrite = f"`{name} = {name}.detach()` right after it is made" if name else \
            "`.detach()` where it is made"
        if c.site is not None:
            made = f" at {c.site}"
            rhs = _assigned(c.site.code, name) if name else None
            if rhs is not None:
                if not isinstance(statement(rhs), ast.Expr) or not isinstance(
                        getattr(statement(rhs), "value", None),
                        (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
                    rhs = f"({rhs})"
                rewrite = f"`{name} = {rhs}.detach()`"
        return (
            f"{var} is computed once{made} and reused as data by every backward, and each "
            f"one goes through it into the graph that {freer} freed; no optimizer steps "
            f"{whose}: detach it where it is made, {rewrite}{made} (or compute it under "
            "torch.no_grad()), so that no backward goes into that graph again"
        )
    fed = c.fed_to if c is not None else None
    if b is not None and b.discards_grad and role == "input":
        other = fed.module if fed is not None else None
        det = f"`{other}({name}.detach())`" if other and name else f"`{name}.detach()`"
        where = f" at {c.entered}" if c is not None and c.entered is not None else ""
        made_in = module or "what made it"
        text = (
            f"detach {var} in the loss of {freer}: {det}{where}, so that that loss trains "
            f"{other or 'its own model'} only and leaves the graph of {made_in} to this "
            f"backward (the gradient it sent into {made_in} is discarded before this "
            "backward anyway)"
        )
        if b.changes_saved is False:
            text += (f"; retain_graph=True on {freer} also works here, since no step between "
                     f"changes what that graph saved, but computes the discarded gradient "
                     "for nothing")
        elif b.changes_saved:
            text += (f"; retain_graph=True on {freer} would fail instead: a step between "
                     "changes what that graph saved")
        return text
    if c is not None and c.trained and b is not None and b.discards_grad is False:
        if b.changes_saved is False:
            return (
                f"pass retain_graph=True to {freer}: both losses then train "
                f"{module or 'the model'} through {var}, and nothing between the two "
                "backwards changes what its graph saved; or sum the losses and call "
                "backward once"
            )
        if b.changes_saved:
            step = next((str(m) for m in b.events if m.kind == "optimizer.step"), "a step")
            return (
                f"{step} between the two backwards changes what the graph behind {var} "
                "saved, so retain_graph=True would only make this backward fail with "
                "\"modified by an inplace operation\": sum the losses and call backward "
                "once before the step (both gradients at the weights the forward used), "
                "or re-run the forward after the step (the second loss then sees the new "
                "weights); which one depends on what the second loss should see"
            )
    # What the tensor is to the program is unknown: each fix, with what it does.
    detach = f"`{name} = {name}.detach()`" if name else "`.detach()` on it"
    return (
        f"{var} carries the graph that {freer} freed into this backward; the fix depends "
        f"on what it is: state carried across iterations (an RNN's hidden state): "
        f"{detach} once its backward has run (truncated backpropagation through time); "
        "a value computed once and reused as data (advantages, targets): `.detach()` it "
        "where it is made (no gradient goes back into what made it); a model's output "
        "fed to a second model whose loss must still train the first (a GAN's `fake`): "
        "detach it in the earlier loss instead (`D(fake.detach())`); retain_graph=True on "
        f"{freer} keeps every gradient, and fails once an optimizer step changed weights "
        "that graph saved"
    )


def _module_fix(h: Hazard, writer: Writer) -> str:
    victim = (f"the output of {_op(h.producer)}" if h.saved_output and h.producer
              else f"a tensor that {_op(h.node)} saved" if h.node
              else "a tensor that a live graph saved")
    built = ""
    if writer.built_at is not None:
        code = f" (`{_code(writer.built_at.code)}`)" if writer.built_at.code else ""
        built = f", built at {writer.built_at}{code}"
    return (
        f"`inplace=False` on {writer}{built}: its forward overwrites {victim} in place, "
        "and backward needs it as it was"
    )


def _rewrite(h: Hazard) -> str | None:
    """The out-of-place form of the user's own write line, when strict mode saw it."""
    for m in h.modified_by:
        if m.kind != "inplace_op" or m.writer is not None or m.site is None:
            continue
        code = m.site.code
        var = written_variable(m.description, code)
        stmt = statement(code)
        if not var or stmt is None:
            continue
        text = _code(code)
        saver = (f"{_op(h.producer)} saved it as its output" if h.saved_output and h.producer
                 else f"{_op(h.node)} saved it")
        why = f"`{var}` is changed in place after {saver} for backward"
        if isinstance(stmt, ast.AugAssign):
            value = ast.get_source_segment(code.strip(), stmt.value)
            new = f"{var} = {var} {m.description[:-1]} {value}"
            return (f"write `{new}` instead of `{text}` at {m.site}: {why}; the out-of-place "
                    "form makes a new tensor and leaves the saved one as it was")
        if isinstance(stmt, ast.Assign) and m.description == "x[...] = v":
            return (f"`{var} = {var}.clone()` just before `{text}` at {m.site}: {why}; the "
                    "write then changes a copy (an out-of-place mask such as "
                    f"`{var}.masked_fill(mask, v)` or `torch.where` does the same)")
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Attribute) \
                and stmt.value.func.attr.endswith("_") and m.description != "copy_()":
            call = stmt.value
            func = call.func
            assert isinstance(func, ast.Attribute)
            args = ", ".join(ast.get_source_segment(code.strip(), a) or "" for a in
                             [*call.args, *call.keywords])
            owner = ast.unparse(func.value)
            if owner in ("torch", "F", "torch.nn.functional", "nn.functional"):
                new = f"{var} = {owner}.{func.attr[:-1]}({args})"
            else:
                new = f"{var} = {var}.{func.attr[:-1]}({args})"
            return (f"write `{new}` instead of `{text}` at {m.site}: {why}; the out-of-place "
                    "form makes a new tensor and leaves the saved one as it was")
    return None


def fix_for(h: Hazard) -> str:
    """The concrete fix for one hazard, chosen from the facts it has.

    A fact a watcher does not know (``None``) never picks a fix that could stop
    a gradient the program needs: the fix is then worded as a choice.
    """
    if h.kind == "freed":
        return _freed_fix(h)
    name = h.tensor or "the tensor"
    if h.kind == "inplace" and any(m.kind == "ddp_buffer_broadcast" for m in h.modified_by):
        return (
            "run one forward on the concatenated batch (`ddp(torch.cat([a, b]))`) before "
            "backward, or pass broadcast_buffers=False (forward_sync_buffers=False on newer "
            "torch) to DistributedDataParallel, or convert BatchNorm with "
            "nn.SyncBatchNorm.convert_sync_batchnorm(model), which syncs in the forward itself"
        )
    if h.kind == "silent":
        return (
            f"{name} was changed without a version bump (fused optimizer, .data, or a "
            "no_grad write through .data); run every backward that needs it before the "
            "change, or re-run the forward after it"
        )
    # A library module built with inplace=True: the fix is its own argument. Any
    # other module's write (a library's own in-place op) gets the words below.
    writer = next((m.writer for m in h.modified_by
                   if m.writer is not None and "inplace=True" in m.writer.text), None)
    if writer is not None and not h.requires_grad:
        return _module_fix(h, writer)
    if h.detected == "at_write" and not h.requires_grad:
        return (
            "don't modify a tensor that backward still needs: use the out-of-place form "
            "(`x = x + y` instead of `x += y`, `inplace=False` for activations) or modify a "
            "`.clone()`; or run the backward first"
        )
    if h.producer is None and h.requires_grad:
        return (
            f"run every backward that needs {name} before optimizer.step() (or sum the "
            "losses and call backward once), or re-run the forward after step(); any "
            "in-place update under torch.no_grad() counts as well"
        )
    rewrite = _rewrite(h)
    if rewrite is not None:
        return rewrite
    producer = h.made_by
    if producer is not None and h.saved_output:
        return (
            f"don't modify the output of {_op(producer)} in place: use `x = x + y` instead of "
            "`x += y`, `inplace=False` for activations such as nn.ReLU, or `.clone()` "
            "the output before changing it"
        )
    if producer is not None:
        return (
            f"{_op(h.node)} saved its input (the output of {_op(producer)}) for "
            "backward: use the out-of-place form of the later in-place op "
            "(`x = x + y`, `x = x.masked_fill(m, v)`, `torch.where`) or `.clone()` "
            "before modifying it"
        )
    if not h.tensor and h.user_variable():
        name = f"`{h.user_variable()}`"
    return (
        f"{name} was modified in place after {_op(h.node)} saved it: make the "
        "change before the forward that uses it, or modify a `.clone()` instead"
    )


def _headline(report: Report, h: Hazard) -> str:
    if h.detected == "at_write":
        write = h.modified_by[0] if h.modified_by else None
        what = f"{write.description} at {write.site}" if write and write.site else "this write"
        if h.kind == "silent":
            return (f"versionwatch: {what} changes {h.tensor or 'a tensor'}, which a live graph "
                    "saved for backward, without a version bump: backward would silently "
                    "compute wrong gradients")
        return (f"versionwatch: {what} would invalidate {h.tensor or 'a tensor'}, which a live "
                "graph saved for backward: it would be modified by an inplace operation")
    verb = "backward will fail" if h.detected == "predicted" else "backward failed"
    if h.kind == "freed":
        return (
            f"versionwatch: {verb}: it would backward through the graph a second time; "
            f"the tensors saved by {h.node} were already freed"
        )
    if h.kind == "silent":
        return (
            f"versionwatch: backward will compute wrong gradients: {h.describe_tensor()} "
            f"saved by {h.node} was changed without a version bump"
        )
    return (
        f"versionwatch: {verb}: {_called(h)} saved by {h.node} was "
        "modified by an inplace operation"
    )


def _called(h: Hazard) -> str:
    """The tensor's name, else the user's variable for it, else ``a tensor``."""
    if h.tensor:
        return h.tensor
    variable = h.user_variable()
    return f"`{variable}`" if variable else "a tensor"


def _where(h: Hazard) -> str:
    """``Node.slot``; a compiled region's node says that it is one."""
    if h.node == "CompiledFunctionBackward":
        return f"a compiled region ({h.where})"
    return h.where


def _module(h: Hazard) -> str:
    """`` in module`` (and a compiled module's forward), or nothing."""
    text = f" in {h.module}" if h.module else ""
    if h.compiled_forward is not None:
        code = f": {h.compiled_forward.code}" if h.compiled_forward.code else ""
        text += f" (compiled from the forward at {h.compiled_forward}{code})"
    return text


def _write_facts(h: Hazard) -> list[tuple[str, str]]:
    saved = f"at version {h.saved_version}" + _module(h)
    if h.saved_during:
        saved += f", during {h.saved_during}"
    if h.saved_at is not None:
        saved = _saved_at(h, by=False)
    facts = [("tensor", h.describe_tensor()), ("saved", saved)]
    for m in h.modified_by:
        if m.writer is not None:  # inside a library module's forward: the module, its call
            facts.append(("write", str(m)))
            continue
        code = f": {m.site.code}" if m.site and m.site.code else ""
        facts.append(("write", f"{m.description} at {m.site}{code}" if m.site else m.description))
    facts += [("note", note) for note in h.notes]
    return facts


def _saved_at(h: Hazard, by: bool = True) -> str:
    """``Node.slot at file:line: code (in module, during forward #1 called at file:line)``.

    ``by=False``: a write's report, which knows no node yet: ``at file:line: code (...)``.
    """
    site = h.saved_at
    assert site is not None
    text = (f"{_where(h)} " if by else "") + f"at {site}" + (f": {site.code}" if site.code else "")
    context = []
    if h.module:
        context.append(_module(h)[1:])
    if h.saved_during:
        # The forward's own site is the call, the op's line is above: say which is which.
        label, sep, where = h.saved_during.rpartition(" at ")
        context.append(f"during {label} called at {where}" if sep else f"during {where}")
    if h.saved_version is not None:
        context.append(f"at version {h.saved_version}")
    return text + (f" ({', '.join(context)})" if context else "")


def _freed_facts(h: Hazard, report: Report) -> list[tuple[str, str]]:
    facts: list[tuple[str, str]] = []
    f = h.freed_by
    if f is not None:
        text = f"{f.description}" + (f" at {f.site}" if f.site else "")
        if f.site is not None and f.site == report.backward_site:
            text += " (this same line, in an earlier iteration)"
        text += ", which ran without retain_graph=True"
        facts.append(("freed by", text))
    c = h.carrier
    if h.carried_by is not None or c is not None:
        name = (c.name if c is not None and c.name else h.carried_by) or ""
        what = f"`{name}`" if name else "a tensor made before that backward"
        if c is not None:
            if c.site is not None:
                code = f" (`{_code(c.site.code)}`)" if c.site.code else ""
                what += f", made at {c.site}{code}"
                if c.module:
                    what += f" by {c.module}"
            elif c.module:
                what += f", made by {c.module}"
            if c.fed_to is not None:
                what += f", fed to {c.fed_to}"
        facts.append(("carried by", f"{what}: this backward's graph was built after that "
                                    "backward, and reaches into the freed graph through it"))
    b = h.between
    if b is not None:
        events = ", ".join(str(m) for m in b.events) if b.events else "nothing ran"
        after = f.description if f is not None else "the backward that freed the graph"
        facts.append(("between", f"{events} (after {after}, before this backward)"))
    return facts


def _facts(h: Hazard, report: Report | None = None) -> list[tuple[str, str]]:
    if h.detected == "at_write":
        return _write_facts(h)
    facts: list[tuple[str, str]] = []
    if h.kind != "freed":
        facts.append(("tensor", h.describe_tensor()))
    saved = f"{_where(h)}" + _module(h)
    if h.saved_version is not None:
        saved += f", at version {h.saved_version}"
    if h.saved_during:
        saved += f", during {h.saved_during}"
    if h.saved_at is not None:
        facts.append(("saved by", _saved_at(h)))
    else:
        facts.append(("saved by", saved))
    if h.current_version is not None:
        facts.append(("now at", f"version {h.current_version}"))
    if h.kind == "freed" and report is not None:
        facts += _freed_facts(h, report)
    for i, m in enumerate(h.modified_by):
        # Strict mode's writes carry their source line: show the code itself; so do
        # the events of a report that has strict's lines (merged by --replay).
        exact = (m.kind == "inplace_op" or h.saved_at is not None) and m.writer is None
        code = f": {m.site.code}" if exact and m.site and m.site.code else ""
        facts.append(("modified by" if i == 0 else "", f"{m}{code}"))
    for note in h.notes:
        facts.append(("note", note))
    return facts


def _also(hazards: list[Hazard]) -> list[tuple[str, int]]:
    """One line per distinct hazard, with how many times it occurs, in order."""
    counts: dict[str, int] = {}
    for other in hazards:
        what = other.describe_tensor()
        # A freed slot's tensor is gone: "a tensor" would say nothing.
        text = f"{other.kind}: {other.where}"
        if other.kind != "freed" or other.tensor or other.producer:
            text += f": {what}"
        if other.saved_version is not None:
            text += f", saved at version {other.saved_version}, now {other.current_version}"
        counts[text] = counts.get(text, 0) + 1
    return list(counts.items())


def render_report(report: Report, *, torch_message: bool = True) -> str:
    """One headline, one fact a line, then the fix; other hazards one line each.

    Args:
        report: the report.
        torch_message: end the facts with PyTorch's own error, verbatim, so that
            what matches PyTorch's words (``pytest.raises(match=...)``, a log
            search) matches ours; off in a note under PyTorch's own error.
    """
    h = report.first
    if h is None:
        text = (
            f"versionwatch: backward is safe: {report.nodes} nodes, "
            f"{report.saved_checked} saved tensors checked"
        )
        if report.unverifiable:
            text += f", {len(report.unverifiable)} not verifiable ({_unsure_why(report)})"
        return text
    lines = [_headline(report, h)]
    facts = _facts(h, report)
    if report.backward_site is not None:
        thread = f" on thread {report.thread}" if report.thread else ""
        facts.append(("backward at", f"{report.backward_site}{thread}"))
    if report.replay:
        facts.append(("replay", report.replay))
    if report.rank is not None:
        facts.append(("rank", f"{report.rank[0]} of {report.rank[1]}"))
    facts.append(("fix", h.fix))
    # The same kind of write on the other hazards' tensors: fixed the same way,
    # or the program fails again at the next one.
    seen = {h.fix}
    for other in report.hazards[1:]:
        if other.fix not in seen and _rewrite(other) is not None:
            seen.add(other.fix)
            facts.append(("", f"and {other.fix}"))
    if torch_message and h.torch_message:
        facts.append(("pytorch", h.torch_message))
    width = max(len(k) for k, _ in facts)
    lines += [f"  {k:<{width}}  {v}" for k, v in facts]
    if len(report.hazards) > 1:
        lines.append(f"  also ({len(report.hazards) - 1} more):")
        others = _also(report.hazards[1:])
        for text, count in others[:5]:
            lines.append(f"    {text}" + (f" (x{count})" if count > 1 else ""))
        if len(others) > 5:
            lines.append(f"    ... and {sum(c for _, c in others[5:])} more")
    if report.unverifiable:
        why = _unsure_why(report)
        lines.append(
            f"  note: {len(report.unverifiable)} saved tensors are behind saved_tensors_hooks "
            "and were not verified" if why == UNSURE_HOOKS
            else f"  note: {len(report.unverifiable)} not verified ({why})")
    return "\n".join(lines)


def _unsure_why(report: Report) -> str:
    """Why the unverifiable were not verified: one reason, else each with its count."""
    counts: dict[str, int] = {}
    for node, slot in report.unverifiable:
        why = report.why_unverifiable(node, slot)
        counts[why] = counts.get(why, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(f"{n} {why}" for why, n in counts.items())


register_renderer("text", render_report)
