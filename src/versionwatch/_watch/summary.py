"""A training library's closing line: what its callback logs when training ends.

The Lightning callback (``fit ended``) and the Hugging Face one (``train ended``)
say the same thing the same way: how many backwards were predicted, the latest
hazard with the whole timeline, or the latest events and what was not verified.
"""

from __future__ import annotations

import logging

from versionwatch._report import unverified_summary
from versionwatch._timeline import Timeline
from versionwatch._watch.watcher import Watcher

# How many of the latest events a clean run's summary shows.
TAIL = 24


def log_summary(logger: logging.Logger, w: Watcher, ended: str, strict_option: str) -> None:
    """Log ``w``'s summary as ``versionwatch: {ended}; ...``.

    ``strict_option`` is what turns strict mode on in the caller's place
    (``VersionWatch(strict=True)``), named where saved tensors went unverified.
    """
    hazards = len(w.reports)
    backwards = w.backward_count
    if hazards:
        kept = w.reports.maxlen
        count = f"{hazards}+" if kept is not None and hazards >= kept else str(hazards)
        headline = str(w.reports[-1]).splitlines()[0].removeprefix("versionwatch: ")
        logger.warning(
            "versionwatch: %s; %d backward(s) predicted, %s with hazards; "
            "the latest: %s\n%s", ended, backwards, count, headline, w.timeline(),
        )
        return
    t = w.timeline()
    tail = Timeline(t.columns, t.rows[-TAIL:], t.saved)
    # Not a bare "no hazard" where some saved tensors were not verified.
    unsure = unverified_summary(w._backward_pipeline.unverified, strict_option)
    logger.info(
        "versionwatch: %s; %d backward(s) predicted, no hazard%s; "
        "the latest events:\n%s", ended, backwards, unsure, tail,
    )
