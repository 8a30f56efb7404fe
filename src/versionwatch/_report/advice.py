"""The fix for a hazard: chosen from the facts it has, in the words of the user's code.

:func:`fix_for` is the one place a hazard's ``fix`` is written; the text
renderer (``_render``) and ``versionwatch fix`` only read it. It depends on
the report, never the other way round.
"""

from __future__ import annotations

import ast
import os
import re
import sys

from versionwatch._report.model import BACKWARD_SUFFIX, Hazard, Writer
from versionwatch._report.silent import silent_fix
from versionwatch._report.source_lines import assigned, statement, without_comment, written_variable

__all__ = ["fix_for", "op_name", "place", "rerun_cells", "rewrite_for", "strict_hint",
           "strict_option"]


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

# A notebook's kernel, or IPython in a terminal: where ``%%versionwatch`` is a magic.
_SHELLS = ("ZMQInteractiveShell", "TerminalInteractiveShell")


def place() -> str:
    """Where the program runs, for a hint to name the option that works there.

    ``"pytest"`` while pytest runs a test (it sets ``PYTEST_CURRENT_TEST``, also
    for the plugin's tests), ``"notebook"`` in an IPython shell, else ``"cli"``.
    Cheap, and it imports nothing: IPython is only looked at if already loaded.

    >>> place() in ("pytest", "notebook", "cli")
    True
    """
    # A child process inherits the variable; pytest itself is then not loaded.
    if os.environ.get("PYTEST_CURRENT_TEST") and "pytest" in sys.modules:
        return "pytest"
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if callable(get_ipython):
        try:
            shell = get_ipython()
        except Exception:  # an IPython half torn down: no shell to name
            shell = None
        if type(shell).__name__ in _SHELLS:
            return "notebook"
    return "cli"


# The place -> the command that re-runs in strict mode, which names the line.
_STRICT_HINTS = {
    "pytest": "`pytest --versionwatch-strict` (or @pytest.mark.versionwatch(strict=True))",
    "notebook": "`%%versionwatch --strict` on the cell (or watch(..., strict=True))",
    "cli": "`versionwatch run --replay ...` (or --strict, or watch(..., strict=True))",
}


# The place -> its option for strict mode, in a fact line ("... not verified: X checks them").
_STRICT_OPTIONS = {
    "pytest": "pytest --versionwatch-strict",
    "notebook": "%%versionwatch --strict",
    "cli": "--strict",
}


def strict_option(where: str | None = None) -> str:
    """The short strict-mode option of the place the program runs in (:func:`place`).

    >>> strict_option("notebook")
    '%%versionwatch --strict'
    """
    return _STRICT_OPTIONS[where or place()]


def strict_hint(where: str | None = None) -> str:
    """The strict-mode option of the place the program runs in (:func:`place`).

    >>> strict_hint("pytest")
    '`pytest --versionwatch-strict` (or @pytest.mark.versionwatch(strict=True))'
    """
    return _STRICT_HINTS[where or place()]


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


def rerun_cells(h: Hazard) -> tuple[int, int] | None:
    """``(backward's cell, forward's cell)``: a notebook cell's backward freed a graph
    that another cell's forward built; else ``None``.

    Running that backward cell again (or another backward of the graph) needs the
    forward cell run again first: IPython keeps the graph in the forward's variables.
    """
    f = h.freed_by
    if h.kind != "freed" or f is None or f.site is None or h.carried_by is not None \
            or h.carrier is not None:
        return None
    forward = h.saved_at or (h.saved_in.site if h.saved_in is not None else None)
    back, built = f.site.cell, forward.cell if forward is not None else None
    if back is None or built is None or back == built:
        return None
    return back, built


def _freed_fix(h: Hazard) -> str:
    c, b = h.carrier, h.between
    freer = _freer(h)
    cells = rerun_cells(h)
    if cells is not None:
        return (f"re-run the forward cell In[{cells[1]}] first, or build the forward in the "
                "same cell as the backward")
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
    role = c.role if c is not None else None
    # Unnamed: words that fit each sentence below ("detach the state carried from one
    # iteration to the next", "the tensor carries the graph ...").
    var = f"`{name}`" if name else ("the state" if role == "state" else "the tensor")
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
            rhs = assigned(c.site.code, name) if name else None
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
        code = f" (`{without_comment(writer.built_at.code)}`)" if writer.built_at.code else ""
        built = f", built at {writer.built_at}{code}"
    return (
        f"`inplace=False` on {writer}{built}: its forward overwrites {victim} in place, "
        "and backward needs it as it was"
    )


def rewrite_for(h: Hazard) -> str | None:
    """The out-of-place form of the user's own write line, when strict mode saw it."""
    for m in h.modified_by:
        if m.kind != "inplace_op" or m.writer is not None or m.site is None:
            continue
        code = m.site.code
        var = written_variable(m.description, code)
        stmt = statement(code)
        if not var or stmt is None:
            continue
        text = without_comment(code)
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
        return silent_fix(h)
    if h.slot.startswith("checkpoint input"):
        variable = h.user_variable()
        who = f"argument `{variable}`" if variable else (
            f"argument {h.tensor}" if h.tensor else "tensor argument")
        return (
            f"checkpoint(use_reentrant=False) keeps its {who} to run the function "
            "again at the backward: make the write after that backward, or pass a "
            "`.clone()` to checkpoint, or write out of place (`x = x + y`)"
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
        # Strict mode records a step's writes as an op at the step's line.
        step = next((m for m in h.modified_by if m.kind == "optimizer.step"
                     or (m.kind == "inplace_op" and "step()" in m.description)), None)
        if step is not None:
            return (
                f"{step.description}" + (f" at {step.site}" if step.site else "") +
                f" changed {name} after the forward that saved it: re-run that forward "
                "after the step (the backward then sees the new weights), or move the step "
                "after this backward (one step then applies both backwards' gradients: "
                "`versionwatch fix` checks which of these trains as the program meant)"
            )
        what = ("an update under torch.no_grad(): EMA weights swapped in, a clamp, a weight "
                "merge" if h.modified_by else "an optimizer step, or an update under "
                "torch.no_grad()")
        return (
            f"{name} was changed in place after the forward that saved it ({what}): make "
            "that change after this backward, or re-run the forward after it"
        )
    rewrite = rewrite_for(h)
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
