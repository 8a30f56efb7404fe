"""The report as data, and every rendering of it: the lowest layer, importing nothing else of ours.

It owns the result of a prediction (``Hazard``, ``Report``, ``Site``, ...), its JSON
document (schema ``versionwatch.report/1``), its text and Graphviz renderings, the
fix written as advice, the user's source lines a report quotes, and the exceptions
and warnings that carry a report. Loading the folder registers the renderers and
the JSON builders with the model, so a report made or unpickled anywhere renders.
"""

from __future__ import annotations

from versionwatch._report import document as document
from versionwatch._report import text as text
from versionwatch._report.advice import fix_for, op_name, place, strict_hint
from versionwatch._report.document import SCHEMA, report_dict
from versionwatch._report.errors import (
    FreedGraphError,
    InplaceHazardWarning,
    InplaceModificationError,
    add_note,
)
from versionwatch._report.model import (
    BACKWARD_SUFFIX,
    CELL_LOOKUPS,
    UNSURE_CHECKPOINT,
    UNSURE_CLEARS,
    UNSURE_COPY_SLICES,
    UNSURE_ERROR,
    UNSURE_NONREENTRANT,
    UNSURE_PROFILER,
    Between,
    Carrier,
    Fix,
    Forward,
    ForwardRef,
    Hazard,
    Modification,
    Repair,
    Report,
    Site,
    Writer,
    cell_of,
    import_relative,
    register_cell,
    relative_path,
    size,
)
from versionwatch._report.silent import (
    SILENT_TAIL,
    fingerprint_hazard,
    gradient_consumer,
    silent_fix,
)
from versionwatch._report.text import render_report, unverified_summary

__all__ = [
    "BACKWARD_SUFFIX",
    "CELL_LOOKUPS",
    "SCHEMA",
    "SILENT_TAIL",
    "UNSURE_CHECKPOINT",
    "UNSURE_CLEARS",
    "UNSURE_COPY_SLICES",
    "UNSURE_ERROR",
    "UNSURE_NONREENTRANT",
    "UNSURE_PROFILER",
    "Between",
    "Carrier",
    "Fix",
    "Forward",
    "ForwardRef",
    "FreedGraphError",
    "Hazard",
    "InplaceHazardWarning",
    "InplaceModificationError",
    "Modification",
    "Repair",
    "Report",
    "Site",
    "Writer",
    "add_note",
    "cell_of",
    "fingerprint_hazard",
    "fix_for",
    "gradient_consumer",
    "import_relative",
    "op_name",
    "place",
    "register_cell",
    "relative_path",
    "render_report",
    "report_dict",
    "silent_fix",
    "size",
    "strict_hint",
    "unverified_summary",
]
