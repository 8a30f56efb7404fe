"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors.

The names below load on first use, so ``import versionwatch`` (and the pytest
plugin, which lives in this package) costs nothing until torch is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._fix import FixResult, fix
    from versionwatch._predict import assert_backward_safe, check
    from versionwatch._report import (
        Fix,
        FreedGraphError,
        Hazard,
        InplaceHazardWarning,
        InplaceModificationError,
        Modification,
        Repair,
        Report,
        Site,
    )
    from versionwatch._timeline import Timeline
    from versionwatch._watch import AutoWatcher, Watcher, watch, watch_all
    from versionwatch.integrations import load_ipython_extension, unload_ipython_extension

__all__ = [
    "AutoWatcher",
    "Fix",
    "FixResult",
    "FreedGraphError",
    "Hazard",
    "InplaceHazardWarning",
    "InplaceModificationError",
    "Modification",
    "Repair",
    "Report",
    "Site",
    "Timeline",
    "Watcher",
    "assert_backward_safe",
    "check",
    "fix",
    "load_ipython_extension",
    "unload_ipython_extension",
    "watch",
    "watch_all",
]
# The renderers and the JSON builder that str(report), report.to_dot() and
# report.to_dict() use register themselves when the _report folder loads: loaded
# with the package, so that a report unpickled in another process still renders.
# Plain Python, no torch.
from versionwatch import _report as _report
from versionwatch._package import __version__ as __version__
from versionwatch._package import keep_old_names, lazy_names

keep_old_names()  # old module paths that outside tools import (the peer harness)

_WHERE = {
    "AutoWatcher": "versionwatch._watch",
    "watch_all": "versionwatch._watch",
    "FreedGraphError": "versionwatch._report",
    "InplaceHazardWarning": "versionwatch._report",
    "InplaceModificationError": "versionwatch._report",
    "assert_backward_safe": "versionwatch._predict",
    "check": "versionwatch._predict",
    "Fix": "versionwatch._report",
    "FixResult": "versionwatch._fix",
    "fix": "versionwatch._fix",
    "Hazard": "versionwatch._report",
    "Modification": "versionwatch._report",
    "Repair": "versionwatch._report",
    "Report": "versionwatch._report",
    "Site": "versionwatch._report",
    "Timeline": "versionwatch._timeline",
    "Watcher": "versionwatch._watch",
    # IPython's %load_ext looks these up here; they import IPython only when called.
    "load_ipython_extension": "versionwatch.integrations",
    "unload_ipython_extension": "versionwatch.integrations",
    "watch": "versionwatch._watch",
}

__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
