"""Words: the fix for each kind of hazard, and the text rendering of a report.

It depends on the report, which knows nothing of it: loading this module
registers the text renderer (and, through ``_dot``, the Graphviz one) that
``str(report)`` and ``report.to_dot()`` use. The package loads it at import.
"""

from __future__ import annotations

from versionwatch import _dot  # noqa: F401  (loads and registers the Graphviz renderer)
from versionwatch._report import Hazard, Report, register_renderer
from versionwatch._torch_messages import BACKWARD_SUFFIX

__all__ = ["fix_for", "op_name", "render_report"]


def op_name(node_or_producer: str) -> str:
    """``"SigmoidBackward0"`` or ``"Sigmoid"`` -> ``"sigmoid"``; custom Functions keep theirs."""
    if node_or_producer.endswith("CopySlices"):
        return "an in-place op on a view"
    base = BACKWARD_SUFFIX.sub("", node_or_producer)
    return base.lower() if base.isalnum() and not base.startswith("_") else base


def fix_for(h: Hazard) -> str:
    """The concrete fix for one hazard, worded for its case."""
    if h.kind == "freed" and h.carried_by is not None:
        state = f"`{h.carried_by}`" if h.carried_by else "the state"
        detach = (f"`{h.carried_by} = {h.carried_by}.detach()`" if h.carried_by
                  else "`.detach()` on it")
        return (
            f"detach {state} carried from one iteration to the next once its backward has "
            f"run: {detach} before it feeds the next forward (truncated backpropagation "
            "through time); retain_graph=True would make every backward run through all "
            "earlier iterations again, and fail once an optimizer step changed their weights"
        )
    if h.kind == "freed":
        return (
            "an earlier backward already freed this graph's saved tensors: pass "
            "retain_graph=True to that earlier backward, or sum the losses and call "
            "backward once, or re-run the forward before this backward"
        )
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
    if h.producer is not None and h.saved_output:
        op = op_name(h.producer)
        return (
            f"don't modify the output of `{op}` in place: use `x = x + y` instead of "
            "`x += y`, `inplace=False` for activations such as nn.ReLU, or `.clone()` "
            "the output before changing it"
        )
    if h.producer is not None:
        user = op_name(h.node)
        return (
            f"`{user}` saved its input (the output of `{op_name(h.producer)}`) for "
            "backward: use the out-of-place form of the later in-place op "
            "(`x = x + y`, `x = x.masked_fill(m, v)`, `torch.where`) or `.clone()` "
            "before modifying it"
        )
    return (
        f"{name} was modified in place after `{op_name(h.node)}` saved it: make the "
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
        f"versionwatch: {verb}: {h.tensor or 'a tensor'} saved by {h.node} was "
        "modified by an inplace operation"
    )


def _write_facts(h: Hazard) -> list[tuple[str, str]]:
    saved = f"at version {h.saved_version}"
    if h.module:
        saved += f" in {h.module}"
    if h.saved_during:
        saved += f", during {h.saved_during}"
    if h.saved_at is not None:
        saved = _saved_at(h, by=False)
    facts = [("tensor", h.describe_tensor()), ("saved", saved)]
    for m in h.modified_by:
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
    text = (f"{h.where} " if by else "") + f"at {site}" + (f": {site.code}" if site.code else "")
    context = []
    if h.module:
        context.append(f"in {h.module}")
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
    if h.carried_by is not None:
        what = f"`{h.carried_by}`" if h.carried_by else "a tensor from an earlier iteration"
        facts.append(("carried by", f"{what}: this backward's graph was built after that "
                                    "backward, and reaches into the freed graph through it"))
    return facts


def _facts(h: Hazard, report: Report | None = None) -> list[tuple[str, str]]:
    if h.detected == "at_write":
        return _write_facts(h)
    facts: list[tuple[str, str]] = []
    if h.kind != "freed":
        facts.append(("tensor", h.describe_tensor()))
    saved = f"{h.where}"
    if h.module:
        saved += f" in {h.module}"
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
        exact = m.kind == "inplace_op" or h.saved_at is not None
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
            text += f", {len(report.unverifiable)} not verifiable (behind saved_tensors_hooks)"
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
        lines.append(
            f"  note: {len(report.unverifiable)} saved tensors are behind saved_tensors_hooks "
            "and were not verified"
        )
    return "\n".join(lines)


register_renderer("text", render_report)
