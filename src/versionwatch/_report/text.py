"""Words: a report rendered as text, one headline, one fact a line, then the fix.

It depends on the report, which knows nothing of it: loading this module
registers the text renderer (and, through ``_dot``, the Graphviz one) that
``str(report)`` and ``report.to_dot()`` use. The package loads it at import.
The fix itself is a candidate patch (``Hazard.fixes``, filled by whoever made the
report), else the advice of ``_advice``; this module only places it.
"""

from __future__ import annotations

import re

from versionwatch._report import dot as _dot  # noqa: F401  (loads and registers the Graphviz renderer)
from versionwatch._report.advice import rerun_cells, rewrite_for, strict_option
from versionwatch._report.model import (
    UNSURE_HOOKS,
    UNSURE_NONREENTRANT,
    Fix,
    Hazard,
    Report,
    cell_of,
    register_renderer,
)
from versionwatch._report.silent import gradient_facts, silent_headline
from versionwatch._report.source_lines import without_comment

__all__ = ["fix_line", "render_report"]


def _headline(report: Report, h: Hazard) -> str:
    if h.detected == "at_write" and h.cause == "gradient":
        return silent_headline(h)
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
    ran_again = _ran_again(report, h)
    if ran_again is not None:
        return (f"versionwatch: {verb}: this cell ran again on the graph of In[{ran_again}], "
                "which its earlier run's backward already freed")
    if h.kind == "freed":
        return (
            f"versionwatch: {verb}: it would backward through the graph a second time; "
            f"the tensors saved by {h.node} were already freed"
        )
    if h.kind == "silent":
        return silent_headline(h)
    return (
        f"versionwatch: {verb}: {_called(h)} saved by {h.node} was "
        "modified by an inplace operation"
    )


def _ran_again(report: Report, h: Hazard) -> int | None:
    """The forward's cell, when this backward's notebook cell ran again on its graph."""
    cells = rerun_cells(h)
    site = report.backward_site
    if cells is None or site is None or site.cell != cells[0] or h.freed_by is None \
            or h.freed_by.site != site:
        return None
    return cells[1]


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
    forward = h.saved_in
    if forward is not None and forward.site is not None:
        # The forward's own site is the call, the op's line is above: say which is which.
        context.append(f"during {forward.named} called at {forward.site}")
    elif h.saved_during:
        context.append(f"during {h.saved_during}")
    if h.saved_version is not None:
        context.append(f"at version {h.saved_version}")
    return text + (f" ({', '.join(context)})" if context else "")


def _freed_facts(h: Hazard, report: Report) -> list[tuple[str, str]]:
    facts: list[tuple[str, str]] = []
    f = h.freed_by
    if f is not None:
        text = f"{f.description}" + (f" at {f.site}" if f.site else "")
        if _ran_again(report, h) is not None:
            text += " (this cell's earlier run)"
        elif f.site is not None and f.site == report.backward_site:
            text += " (this same line, in an earlier iteration)"
        text += ", which ran without retain_graph=True"
        facts.append(("freed by", text))
    c = h.carrier
    if h.carried_by is not None or c is not None:
        name = (c.name if c is not None and c.name else h.carried_by) or ""
        what = f"`{name}`" if name else "a tensor made before that backward"
        if c is not None:
            if c.site is not None:
                code = f" (`{without_comment(c.site.code)}`)" if c.site.code else ""
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
    if h.cause == "gradient":
        return gradient_facts(h)
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


def fix_line(h: Hazard) -> str:
    """The fix a report shows: the first patch it may offer, else the advice (``h.fix``).

    A patch is one of the candidates ``versionwatch fix`` checks (a watcher puts
    them in ``h.fixes`` unchecked): the line says whether a run checked it and,
    if not, how to, then where it edits and what it changes.
    """
    fix = next((f for f in h.fixes if f.offered), None)
    if fix is None:
        return h.fix
    status = "verified by versionwatch fix" if fix.verified else fix.why or "untested"
    if fix.old and fix.new and "\n" not in fix.old + fix.new \
            and without_comment(fix.old).strip() != without_comment(fix.new).strip():
        # One line changed: the line itself, as the user will read it in the file.
        old, new = without_comment(fix.old).strip(), without_comment(fix.new).strip()
        # The summary's own head (`new code` [at file:line]:) is what this line shows.
        head = re.match(r"`[^`]*`(?: at \S+:\d+)?: ", fix.summary)
        why = fix.summary[head.end():] if head else fix.summary
        return f"({status}) `{new}` instead of `{old}` at {_place(fix)}: {why}"
    said = f"{fix.file}:{fix.line}" in fix.summary or f"line {fix.line}" in fix.summary
    return f"({status}) " + ("" if said else f"at {_place(fix)}, ") + fix.summary


def _place(fix: Fix) -> str:
    """``file:line`` of a patch, or ``Cell In[5], line 3`` in a notebook cell."""
    cell = cell_of(fix.file)
    return f"Cell In[{cell}], line {fix.line}" if cell is not None else f"{fix.file}:{fix.line}"


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
            why = _unsure_why(report)
            if why == UNSURE_NONREENTRANT:
                text += (f", {len(report.unverifiable)} saved tensors {UNSURE_NONREENTRANT} "
                         f"not verified: {strict_option()} checks them")
            else:
                text += f", {len(report.unverifiable)} not verifiable ({why})"
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
    facts.append(("fix", fix_line(h)))
    # The same kind of write on the other hazards' tensors: fixed the same way,
    # or the program fails again at the next one.
    seen = {h.fix}
    for other in report.hazards[1:]:
        if other.fix not in seen and rewrite_for(other) is not None:
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
            else f"  note: {len(report.unverifiable)} saved tensors {why} not verified: "
            f"{strict_option()} checks them" if why == UNSURE_NONREENTRANT
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


def unverified_summary(unverified: dict[str, int], option: str | None = None) -> str:
    """What a clean run's closing line adds for saved tensors it did not verify, or "".

    ``unverified``: why -> how many saved tensors, summed over the backwards,
    and ``""`` -> how many backwards had some (a watcher's tally). ``option``: what
    turns strict mode on where the summary is read (a callback's ``strict=True``);
    by default the option of the place the program runs in.
    """
    counts = {why: n for why, n in unverified.items() if why}
    if not counts:
        return ""
    total = sum(counts.values())
    of = f"in {unverified.get('', 0)} of them"
    if list(counts) == [UNSURE_NONREENTRANT]:
        return (f"; {total} saved tensors {UNSURE_NONREENTRANT} not verified ({of}): "
                f"{option or strict_option()} checks them")
    why = "; ".join(f"{n} {w}" for w, n in counts.items())
    return f"; {total} saved tensors not verified ({of}: {why})"


register_renderer("text", render_report)
