"""Words: the fix for each kind of hazard, and the text rendering of a report."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._report import Hazard, Report

_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def op_name(node_or_producer: str) -> str:
    """``"SigmoidBackward0"`` or ``"Sigmoid"`` -> ``"sigmoid"``; custom Functions keep theirs."""
    if node_or_producer.endswith("CopySlices"):
        return "an in-place op on a view"
    base = _BACKWARD_SUFFIX.sub("", node_or_producer)
    return base.lower() if base.isalnum() and not base.startswith("_") else base


def fix_for(h: Hazard) -> str:
    """The concrete fix for one hazard, worded for its case."""
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
    facts = [("tensor", h.describe_tensor()), ("saved", saved)]
    for m in h.modified_by:
        code = f": {m.site.code}" if m.site and m.site.code else ""
        facts.append(("write", f"{m.description} at {m.site}{code}" if m.site else m.description))
    facts += [("note", note) for note in h.notes]
    return facts


def _facts(h: Hazard) -> list[tuple[str, str]]:
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
    facts.append(("saved by", saved))
    if h.current_version is not None:
        facts.append(("now at", f"version {h.current_version}"))
    for i, m in enumerate(h.modified_by):
        # Strict mode's writes carry their source line: show the code itself.
        code = f": {m.site.code}" if m.kind == "inplace_op" and m.site and m.site.code else ""
        facts.append(("modified by" if i == 0 else "", f"{m}{code}"))
    for note in h.notes:
        facts.append(("note", note))
    return facts


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
    facts = _facts(h)
    if report.backward_site is not None:
        thread = f" on thread {report.thread}" if report.thread else ""
        facts.append(("backward at", f"{report.backward_site}{thread}"))
    if report.rank is not None:
        facts.append(("rank", f"{report.rank[0]} of {report.rank[1]}"))
    facts.append(("fix", h.fix))
    if torch_message and h.torch_message:
        facts.append(("pytorch", h.torch_message))
    width = max(len(k) for k, _ in facts)
    lines += [f"  {k:<{width}}  {v}" for k, v in facts]
    if len(report.hazards) > 1:
        lines.append(f"  also ({len(report.hazards) - 1} more):")
        for other in report.hazards[1:6]:
            versions = ""
            if other.saved_version is not None:
                versions = f", saved at version {other.saved_version}, now {other.current_version}"
            lines.append(f"    {other.kind}: {other.where}: {other.describe_tensor()}{versions}")
        if len(report.hazards) > 6:
            lines.append(f"    ... and {len(report.hazards) - 6} more")
    if report.unverifiable:
        lines.append(
            f"  note: {len(report.unverifiable)} saved tensors are behind saved_tensors_hooks "
            "and were not verified"
        )
    return "\n".join(lines)
