"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors.

The names below load on first use, so ``import versionwatch`` (and the pytest
plugin, which lives in this package) costs nothing until torch is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "watch",
    "watch_all",
]
# The renderers and the JSON builder that str(report), report.to_dot() and
# report.to_dict() use register themselves when the _report folder loads: loaded
# with the package, so that a report unpickled in another process still renders.
# Plain Python, no torch.
from versionwatch import _report as _report
from versionwatch._package import __version__ as __version__
from versionwatch._package import keep_old_names

keep_old_names()  # old module paths that outside tools import (the peer harness)

_WHERE = {
    "AutoWatcher": "_watch",
    "watch_all": "_watch",
    "FreedGraphError": "_report",
    "InplaceHazardWarning": "_report",
    "InplaceModificationError": "_report",
    "assert_backward_safe": "_predict",
    "check": "_predict",
    "Fix": "_report",
    "FixResult": "_fix",
    "fix": "_fix",
    "Hazard": "_report",
    "Modification": "_report",
    "Repair": "_report",
    "Report": "_report",
    "Site": "_report",
    "Timeline": "_timeline",
    "Watcher": "_watch",
    "watch": "_watch",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'versionwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"versionwatch.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
