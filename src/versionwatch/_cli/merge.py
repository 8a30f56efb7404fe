"""One JSON report per rank, and the summary of several: ``versionwatch merge``.

Under torchrun every rank runs the same ``versionwatch run --json report.json``;
each writes ``report.rank<N>.json`` instead of all of them overwriting one file.
``versionwatch merge report.rank*.json`` reads them back and says which ranks hit
which hazard, and where the ranks disagree: a hazard on some ranks only, a
different exit status, a tensor that ended at different versions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TypedDict, Union, cast

MERGED_SCHEMA = "versionwatch.ranks/1"


def rank_path(path: str, rank: int) -> str:
    """``report.json`` -> ``report.rank1.json`` (``out`` -> ``out.rank1``)."""
    head, tail = os.path.split(path)
    stem, dot, ext = tail.rpartition(".")
    name = f"{stem}.rank{rank}.{ext}" if dot and stem else f"{tail}.rank{rank}"
    return os.path.join(head, name)


class _SiteDoc(TypedDict, total=False):
    file: str | None
    line: int | None


class _ModificationDoc(TypedDict, total=False):
    description: str | None


class _HazardDoc(TypedDict, total=False):
    kind: str | None
    tensor: str | None
    saved_by: str | None
    slot: str | None
    backward_site: _SiteDoc | None
    modified_by: list[_ModificationDoc] | None


class _EventDoc(TypedDict, total=False):
    versions: dict[str, int | None] | None


class _TimelineDoc(TypedDict, total=False):
    events: list[_EventDoc] | None


class _ReportDoc(TypedDict, total=False):
    """The fields of a run's report that merge reads, as :data:`_REPORT` lets them through."""

    ok: bool
    hazards: list[_HazardDoc] | None
    rank: int | None
    world_size: int | None
    exit_status: int | None
    exception: str | None
    timeline: _TimelineDoc | None


class MergedHazard(TypedDict):
    kind: str | None
    tensor: str | None
    saved_by: str
    backward_site: str | None
    modified_by: list[str | None]
    ranks: list[int]


class MergedRank(TypedDict):
    rank: int
    file: str
    ok: bool | None
    exit_status: int | None
    exception: str | None
    hazards: int


class Merged(TypedDict):
    """The summary :func:`merge` makes (schema ``versionwatch.ranks/1``)."""

    schema: str
    ok: bool
    ranks: list[MergedRank]
    hazards: list[MergedHazard]
    disagree: list[str]


class MergeError(Exception):
    """A file given to ``versionwatch merge`` cannot be read as a run's report."""


def _load(path: str) -> _ReportDoc:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise MergeError(f"cannot read {path}: {e.strerror or e}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise MergeError(f"{path} is nested too deeply to be a versionwatch report") from None
    except ValueError as e:
        raise MergeError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith(
            "versionwatch.report/"):
        raise MergeError(f"{path} is not a versionwatch report (no versionwatch.report schema)")
    _check(path, doc, _REPORT, "")
    return cast(_ReportDoc, doc)  # _check let only these types through


# The fields that merge reads, and the JSON types each may hold (None: null).
# A field may be absent; present, it must have one of its types.
_Spec = Union[None, type, list["_Spec"], dict[str, "_Field"]]
_Field = Union[_Spec, tuple[_Spec, ...]]  # a field's types
_SITE: _Spec = {"file": (str, None), "line": (int, None)}
_HAZARD: _Spec = {"kind": (str, None), "tensor": (str, None), "saved_by": (str, None),
                  "slot": (str, None), "backward_site": (_SITE, None),
                  "modified_by": ([{"description": (str, None)}], None)}
_EVENT: _Spec = {"versions": ({"*": (int, None)}, None)}
_REPORT: _Spec = {"ok": (bool,), "hazards": ([_HAZARD], None), "rank": (int, None),
                  "world_size": (int, None), "exit_status": (int, None),
                  "exception": (str, None), "timeline": ({"events": ([_EVENT], None)}, None)}
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          list: "a list", dict: "an object", type(None): "null"}


def _kind(spec: _Spec) -> str:
    return ("null" if spec is None else _NAMES[spec] if isinstance(spec, type)
            else "a list" if isinstance(spec, list) else "an object")


def _fits(value: object, spec: _Spec) -> bool:
    if spec is None:
        return value is None
    if isinstance(spec, list):
        return isinstance(value, list)
    if isinstance(spec, dict):
        return isinstance(value, dict)
    # JSON's true and false are not numbers here, though Python's bool is an int.
    return isinstance(value, spec) and (spec is bool or not isinstance(value, bool))


def _check(path: str, value: object, spec: _Spec, where: str) -> None:
    """Raise MergeError naming ``path`` and the field if ``value`` does not fit ``spec``."""
    if isinstance(spec, list):
        for i, item in enumerate(cast("list[object]", value)):  # _fits: a list
            _check_field(path, item, spec[0], f"{where}[{i}]")
    elif isinstance(spec, dict):
        for key, item in cast("dict[str, object]", value).items():  # _fits: an object
            sub = spec.get(key, spec.get("*"))
            if sub is not None:
                _check_field(path, item, sub, f"{where}.{key}" if where else key)


def _check_field(path: str, value: object, specs: _Field, where: str) -> None:
    specs = specs if isinstance(specs, tuple) else (specs,)
    spec = next((s for s in specs if _fits(value, s)), _MISSING)
    if spec is _MISSING:
        found = _NAMES.get(type(value), type(value).__name__)
        expected = " or ".join(_kind(s) for s in specs)
        raise MergeError(f"{path}: field {where} is {found}, not {expected}: the file is not "
                         "a report that versionwatch run wrote")
    if spec is not None:
        _check(path, value, cast(_Spec, spec), where)  # one of specs


_MISSING = object()


def _key(h: _HazardDoc) -> tuple[str, str, str, str]:
    site = h.get("backward_site") or {}
    at = f"{site.get('file')}:{site.get('line')}" if site else ""
    return (str(h.get("kind")), str(h.get("tensor")), str(h.get("saved_by")) + (
        f".{h['slot']}" if h.get("slot") else ""), at)


def _final_versions(doc: _ReportDoc) -> dict[str, int]:
    events = (doc.get("timeline") or {}).get("events") or []
    return {k: v for k, v in (events[-1].get("versions") or {}).items()
            if isinstance(v, int)} if events else {}


def merge(paths: Sequence[str]) -> Merged:
    """The summary of the per-rank reports at ``paths`` (schema ``versionwatch.ranks/1``).

    Raises:
        MergeError: a file is missing, not JSON, or not a versionwatch report;
            or two files are the reports of one rank.
    """
    loaded = [(path, _load(path)) for path in paths]
    ranked = [type(doc.get("rank")) is int for _, doc in loaded]
    if any(ranked) and not all(ranked):
        path = next(p for (p, _), has in zip(loaded, ranked) if not has)
        raise MergeError(f"{path} has no rank, unlike the others: it is not the report of a "
                         "rank of the same distributed run")
    # Reports without ranks (single processes) are numbered in the order given.
    docs = [(cast(int, doc["rank"]) if has else i, path, doc)  # has: an int
            for i, ((path, doc), has) in enumerate(zip(loaded, ranked))]
    docs.sort(key=lambda d: d[0])
    for (r, first, _), (s, second, _) in zip(docs, docs[1:]):
        if r == s:
            raise MergeError(f"{first} and {second} are both the report of rank {r}: "
                             "give one report per rank")
    ranks = [r for r, _, _ in docs]
    hazards: dict[tuple[str, str, str, str], MergedHazard] = {}
    for r, _, doc in docs:
        for h in doc.get("hazards") or []:
            entry = hazards.setdefault(_key(h), {
                "kind": h.get("kind"), "tensor": h.get("tensor"),
                "saved_by": _key(h)[2], "backward_site": _key(h)[3] or None,
                "modified_by": [m.get("description") for m in h.get("modified_by") or []],
                "ranks": []})
            if r not in entry["ranks"]:
                entry["ranks"].append(r)
    disagree = []
    sizes = {r: w for r, _, doc in docs if type(w := doc.get("world_size")) is int}
    if len(set(sizes.values())) > 1 or (sizes and len(sizes) < len(docs)):
        disagree.append("world size: " + ", ".join(
            f"{sizes[r]} on rank {r}" if r in sizes else f"none on rank {r}" for r in ranks))
    elif sizes:
        size = next(iter(sizes.values()))
        outside = [r for r in ranks if not 0 <= r < size]
        if outside:
            disagree.append(f"{_ranks_text(outside)} outside world size {size}")
        missing = [r for r in range(size) if r not in ranks]
        if missing:
            disagree.append(f"no report from {_ranks_text(missing)} of world size {size}")
    for entry in hazards.values():
        if entry["ranks"] != ranks:
            disagree.append(f"{entry['tensor']} ({entry['kind']}, {entry['saved_by']}): "
                            f"only on {_ranks_text(entry['ranks'])}")
    statuses = {r: doc.get("exit_status") for r, _, doc in docs}
    if len(set(map(str, statuses.values()))) > 1:
        disagree.append("exit status: " + ", ".join(
            f"rank {r} {_status_text(s)}" for r, s in statuses.items()))
    finals = {r: _final_versions(doc) for r, _, doc in docs}
    for name in sorted({n for f in finals.values() for n in f}):
        seen = {r: f.get(name) for r, f in finals.items()}
        if len({v for v in seen.values() if v is not None}) > 1:
            disagree.append(f"{name} ends at version " + ", ".join(
                f"{v} on rank {r}" for r, v in seen.items() if v is not None))
    return {
        "schema": MERGED_SCHEMA,
        "ok": not hazards and all(doc.get("ok", True) for _, _, doc in docs),
        "ranks": [{"rank": r, "file": p, "ok": doc.get("ok"),
                   "exit_status": doc.get("exit_status"), "exception": doc.get("exception"),
                   "hazards": len(doc.get("hazards") or [])} for r, p, doc in docs],
        "hazards": list(hazards.values()),
        "disagree": disagree,
    }


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _status_text(status: int | None) -> str:
    if isinstance(status, int) and status > 128:
        return f"{status} (signal {status - 128})"
    return str(status)


def render_merged(summary: Merged) -> str:
    """The text ``versionwatch merge`` prints."""
    ranks = summary["ranks"]
    lines = [f"versionwatch: {len(ranks)} rank reports, "
             f"{len(summary['hazards'])} distinct hazard(s)"]
    for r in ranks:
        what = f"{r['hazards']} hazard(s)" if r["hazards"] else "no hazard"
        died = f", {str(r['exception']).splitlines()[0]}" if r.get("exception") else ""
        lines.append(f"  rank {r['rank']}  exit status {_status_text(r['exit_status'])}, "
                     f"{what}{died}")
    if summary["hazards"]:
        lines.append("hazards:")
        for h in summary["hazards"]:
            by = f", modified by {h['modified_by'][0]}" if h["modified_by"] else ""
            lines.append(f"  {_ranks_text(h['ranks'])}: {h['kind']} {h['tensor']} saved by "
                         f"{h['saved_by']}{by}")
    if summary["disagree"]:
        lines.append("ranks disagree:")
        lines += [f"  {d}" for d in summary["disagree"]]
    else:
        lines.append("ranks agree")
    return "\n".join(lines)
