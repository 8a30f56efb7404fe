"""The candidate patches of ``versionwatch fix``: pure functions of a hazard's facts and the user's
source.

It owns what fix needs to know of a hazard (``facts``: ``FixFacts``), the user's
source as fix edits it (``source``), what the families share (``shared``), and the
families themselves: edits by failure pattern (``edits``), moved or merged
statements (``moves``) and a graph freed by an earlier backward (``freed``). It sits
below the watcher, so that a report's fix line can come from the same candidates;
running and judging a candidate is ``_fix``'s.
"""
