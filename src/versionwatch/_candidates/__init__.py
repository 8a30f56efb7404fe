"""The candidate patches of ``versionwatch fix``: pure functions of a hazard's facts and the user's
source.

It owns what fix needs to know of a hazard (``facts``: ``FixFacts``), the user's
source as fix edits it (``source``), what the families share (``shared``), and the
families themselves: edits by failure pattern (``edits``), moved or merged
statements (``moves``) and a graph freed by an earlier backward (``freed``). It sits
below the watcher, so that a report's fix line can come from the same candidates;
running and judging a candidate is ``_fix``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._candidates.edits import propose as propose
    from versionwatch._candidates.facts import FixFacts as FixFacts
    from versionwatch._candidates.facts import Line as Line
    from versionwatch._candidates.facts import from_report as from_report
    from versionwatch._candidates.facts import shown as shown
    from versionwatch._candidates.facts import shown_at as shown_at
    from versionwatch._candidates.shared import Candidate as Candidate
    from versionwatch._candidates.shared import Sources as Sources
    from versionwatch._candidates.shared import backward_after as backward_after
    from versionwatch._candidates.source import decode_source as decode_source
    from versionwatch._candidates.source import line_map as line_map

_WHERE = {
    "backward_after": "versionwatch._candidates.shared",
    "Candidate": "versionwatch._candidates.shared",
    "decode_source": "versionwatch._candidates.source",
    "FixFacts": "versionwatch._candidates.facts",
    "from_report": "versionwatch._candidates.facts",
    "Line": "versionwatch._candidates.facts",
    "line_map": "versionwatch._candidates.source",
    "propose": "versionwatch._candidates.edits",
    "shown": "versionwatch._candidates.facts",
    "shown_at": "versionwatch._candidates.facts",
    "Sources": "versionwatch._candidates.shared",
}

__getattr__ = lazy_names(__name__, _WHERE)
