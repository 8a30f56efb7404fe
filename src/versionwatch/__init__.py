"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors.

The names below load on first use, so ``import versionwatch`` (and the pytest
plugin, which lives in this package) costs nothing until torch is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from versionwatch._auto import AutoWatcher, watch_all
    from versionwatch._errors import (
        FreedGraphError,
        InplaceHazardWarning,
        InplaceModificationError,
    )
    from versionwatch._fix import FixResult, fix
    from versionwatch._predict import assert_backward_safe, check
    from versionwatch._report import Fix, Hazard, Modification, Repair, Report, Site
    from versionwatch._timeline import Timeline
    from versionwatch._watch import Watcher, watch

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
__version__ = "0.1.0"

# The text and Graphviz renderers that str(report) and report.to_dot() use
# register themselves: loaded with the package, so that a report made from
# versionwatch._report alone, or unpickled in another process, still renders.
# Plain Python, no torch.
from versionwatch import _render as _render

_WHERE = {
    "AutoWatcher": "_auto",
    "watch_all": "_auto",
    "FreedGraphError": "_errors",
    "InplaceHazardWarning": "_errors",
    "InplaceModificationError": "_errors",
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
