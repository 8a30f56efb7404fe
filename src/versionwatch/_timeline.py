"""The timeline: versions of chosen tensors at each recorded event, as a table."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

from versionwatch._ledger import Event

if TYPE_CHECKING:
    from versionwatch._ledger import Ledger
    from versionwatch._report import Hazard


class Timeline:
    """A table of events (rows) by tensors (columns).

    A version that changed at an event is marked ``+``; a saved version that a
    later hazard found stale is marked ``*`` at the forward that saved it.
    ``backward`` rows never show a ``+``: backward does not bump versions.
    """

    def __init__(
        self,
        columns: list[str],
        rows: list[tuple[Event, list[int | None]]],
        saved: dict[tuple[str, int | None], str],
    ) -> None:
        self.columns = columns
        self.rows = rows
        self.saved = saved

    def _cells(self) -> list[tuple[Event, list[str]]]:
        out = []
        prev: list[int | None] = [None] * len(self.columns)
        for ev, versions in self.rows:
            cells = []
            for j, v in enumerate(versions):
                mark = ""
                if v is not None and prev[j] is not None and v != prev[j]:
                    mark = "+"
                saved_at = self.saved.get((self.columns[j], v))
                if saved_at is not None and ev.kind == "forward" and saved_at.startswith(ev.label):
                    mark += "*"
                cells.append("" if v is None else f"{v}{mark}")
            quiet = (ev.kind.endswith("_end") or ev.kind == "buffer_sync") and not any(
                c.endswith("+") for c in cells)
            prev = versions
            if not quiet:  # an end row matters only when something changed during it
                out.append((ev, cells))
        return out

    def __str__(self) -> str:
        body = [(ev.label, ev.site.place() if ev.site else "", cells)
                for ev, cells in self._cells()]
        w_ev = max([len("event")] + [len(b[0]) for b in body])
        w_site = max([len("at")] + [len(b[1]) for b in body])
        widths = [max(len(c), 4) for c in self.columns]
        head = f"{'event':<{w_ev}}  {'at':<{w_site}}  " + "  ".join(
            f"{c:>{w}}" for c, w in zip(self.columns, widths))
        lines = [head.rstrip()]
        for label, site, cells in body:
            row = f"{label:<{w_ev}}  {site:<{w_site}}  " + "  ".join(
                f"{c:>{w}}" for c, w in zip(cells, widths))
            lines.append(row.rstrip())
        lines.append("(+ version changed at this event; * version saved for backward there, "
                     "found stale later)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """Plain data: columns, and one entry per event."""
        return {
            "columns": self.columns,
            "events": [
                {"event": ev.label, "kind": ev.kind,
                 "file": ev.site.file if ev.site else None,
                 "line": ev.site.line if ev.site else None,
                 # Beside the path, a notebook cell's number (In[5]), as the reports say it.
                 **({"cell": ev.site.cell} if ev.site and ev.site.cell is not None else {}),
                 "versions": dict(zip(self.columns, versions))}
                for ev, versions in self.rows
            ],
            "saved": [{"tensor": t, "version": v, "during": d} for (t, v), d in self.saved.items()],
        }

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        rows = "".join(
            f"<tr><td>{html.escape(ev.label)}</td><td>{html.escape(str(ev.site or ''))}</td>"
            + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
            for ev, cells in self._cells()
        )
        return f"<table><tr><th>event</th><th>at</th>{head}</tr>{rows}</table>"


def of_ledger(ledger: Ledger, names: Sequence[str], hazards: list[Hazard]) -> Timeline:
    """The timeline of ``names`` in ``ledger``, marking ``hazards``' saved versions.

    By default: the tensors involved in the hazards, else the first eight watched.

    Raises:
        KeyError: a name that the ledger does not watch.
    """
    cols = list(names) or list(dict.fromkeys(
        ledger.tracked[h.key].name for h in hazards
        if h.key is not None and h.key in ledger.tracked
    ))
    if not cols:
        cols = [tr.name for tr in list(ledger.tracked.values())[:8]]
    unknown = [c for c in cols if c not in ledger.by_name]
    if unknown:
        raise KeyError(f"not watched: {', '.join(unknown)}; watched are e.g. "
                       f"{', '.join(list(ledger.by_name)[:5])}")
    keys = [id(ledger.by_name[c].ref()) for c in cols]
    saved = {
        (ledger.by_name[h.tensor].name, h.saved_version): h.saved_during or ""
        for h in hazards if h.tensor in ledger.by_name
    }
    return Timeline(cols, ledger.table(keys), saved)
