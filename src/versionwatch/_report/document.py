"""A report as a JSON document, schema ``versionwatch.report/1``: the one builder.

``Report.to_dict()``, ``Hazard.to_dict()`` and ``versionwatch run --json`` (whose
document is that of all the run's reports, and how the run ended) all build it
here. A leaf: it imports nothing of the package at run time, so that the report
itself may use it; it reads the report's objects only through their fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from versionwatch._report.model import DOCUMENTS

if TYPE_CHECKING:
    from versionwatch._report.model import Forward, Hazard, Modification, Repair, Report, Site

SCHEMA = "versionwatch.report/1"

__all__ = ["SCHEMA", "hazard_dict", "repair_dict", "report_dict"]


def _site(site: Site | None) -> dict[str, object] | None:
    if site is None:
        return None
    d: dict[str, object] = {"file": site.file, "line": site.line, "code": site.code}
    d.update(_cell(site))
    return d


def _cell(site: Site | None) -> dict[str, object]:
    """``{"cell": 5}`` beside a site's path when its line is in notebook cell In[5], and
    ``{"via": {"file": ..., "line": ...}}`` when a training library made the event."""
    if site is None:
        return {}
    out: dict[str, object] = {}
    cell = site.cell
    if cell is not None:
        out["cell"] = cell
    if site.via is not None:
        out["via"] = {"file": site.via.file, "line": site.via.line}
    return out


def _modification(m: Modification) -> dict[str, object]:
    w = m.writer
    return {
        "kind": m.kind,
        "description": m.description,
        "file": m.site.file if m.site else None,
        "line": m.site.line if m.site else None, **_cell(m.site),
        **({"versions": list(m.versions)} if m.versions else {}),
        **({"after": _event(m.bounds[0]), "before": _event(m.bounds[1])} if m.bounds else {}),
        **({"writer": {"module": w.module, "class": w.class_name or None, "repr": w.text,
                       "file": w.built_at.file if w.built_at else None,
                       "line": w.built_at.line if w.built_at else None,
                       **_cell(w.built_at)}} if w else {}),
        **({"stack": [_site(s) for s in m.stack]} if m.stack else {}),
    }


def _forward(f: Forward | None) -> dict[str, object] | None:
    if f is None:
        return None
    return {"forward": f.label, "file": f.site.file if f.site else None,
            "line": f.site.line if f.site else None, **_cell(f.site),
            "module": f.module}


def _event(bound: tuple[str, Site | None]) -> dict[str, object]:
    label, site = bound
    return {"event": label, "file": site.file if site else None,
            "line": site.line if site else None, **_cell(site)}


def hazard_dict(h: Hazard, forward: Forward | None) -> dict[str, object]:
    """``h``'s JSON fields; ``forward`` is the forward that saved it, as the report read it."""
    d = asdict(h)
    d["tensor"] = h.tensor or h.describe_tensor()
    d["producer"] = h.made_by
    d["shape"] = list(h.shape) if h.shape is not None else None
    d["saved_by"] = h.node
    d["saved_at"] = _site(h.saved_at)
    if forward is not None and forward.module is None and h.module:
        # One watched root labels its forwards "forward #N": the root is the
        # module's first name ("model" of strict mode's innermost "model.2").
        forward = replace(forward, module=h.module.split(".", 1)[0])
    d["saved_forward"] = _forward(forward)
    d["variable"] = h.user_variable()
    f = h.freed_by
    d["freed_by"] = None if f is None else {
        "description": f.description, "file": f.site.file if f.site else None,
        "line": f.site.line if f.site else None, **_cell(f.site)}
    del d["node"], d["key"], d["seq"], d["saved_in"]
    d["modified_by"] = [_modification(m) for m in h.modified_by]
    c = h.carrier
    d["carrier"] = None if c is None else {
        "name": c.name, "file": c.site.file if c.site else None,
        "line": c.site.line if c.site else None, **_cell(c.site),
        "code": c.site.code if c.site else None,
        "module": c.module, "role": c.role, "fed_to": _forward(c.fed_to),
        "entered": _site(c.entered), "trained": c.trained}
    b = h.between
    d["between"] = None if b is None else {
        "events": [_modification(m) for m in b.events],
        "changes_saved": b.changes_saved, "discards_grad": b.discards_grad}
    d["compiled_forward"] = _site(h.compiled_forward)
    d["fixes"] = [f.to_dict() for f in h.fixes]
    return d


def repair_dict(r: Repair) -> dict[str, object]:
    """A repair's JSON fields."""
    return {"tensor": r.tensor, "bytes": r.nbytes, "graph": r.graph,
            "before": r.before, "file": r.site.file if r.site else None,
            "line": r.site.line if r.site else None, **_cell(r.site)}


def _in_report(r: Report, h: Hazard) -> dict[str, object]:
    """A hazard's fields and those of the backward of its report."""
    site = r.backward_site
    d = h.to_dict()
    d["backward"] = r.backward
    d["replay"] = r.replay
    d["backward_site"] = {"file": site.file, "line": site.line, **_cell(site)} if site else None
    if site and r.thread:
        d["backward_site"]["thread"] = r.thread
    return d


def report_dict(reports: Sequence[Report], *, timeline: dict[str, object],
                rank: tuple[int, int] | None,
                run: Mapping[str, object] | None = None) -> dict[str, object]:
    """The document of one report, or of all a run's reports (``versionwatch run --json``).

    Args:
        reports: the reports, in order; their hazards one list.
        timeline: the timeline's fields (``{}`` when none).
        rank: ``(rank, world_size)``, or None.
        run: fields of the run as a whole (target, exit status, exception),
            placed before the rank.
    """
    hazards = [_in_report(r, h) for r in reports for h in r.hazards]
    out: dict[str, object] = {
        "schema": SCHEMA,
        "ok": not hazards,
        "hazards": hazards,
        "unverifiable": [{"saved_by": n, "slot": s, "why": r.why_unverifiable(n, s)}
                         for r in reports for n, s in r.unverifiable],
        "nodes": sum(r.nodes for r in reports),
        "saved_checked": sum(r.saved_checked for r in reports),
        "timeline": timeline,
    }
    out.update(run or {})
    if rank is not None:
        out["rank"], out["world_size"] = rank
    return out


DOCUMENTS.update(hazard=hazard_dict, repair=repair_dict, report=report_dict)
