"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors.

The names below load on first use, so ``import versionwatch`` (and the pytest
plugin, which lives in this package) costs nothing until torch is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from versionwatch._fix.command import FixResult, fix
    from versionwatch._predict.api import assert_backward_safe, check
    from versionwatch._report.errors import (
        FreedGraphError,
        InplaceHazardWarning,
        InplaceModificationError,
    )
    from versionwatch._report.model import Fix, Hazard, Modification, Repair, Report, Site
    from versionwatch._timeline import Timeline
    from versionwatch._watch.auto import AutoWatcher, watch_all
    from versionwatch._watch.watcher import Watcher, watch

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
from versionwatch._package import __version__ as __version__

# The text and Graphviz renderers that str(report) and report.to_dot() use
# register themselves: loaded with the package, so that a report made from
# versionwatch._report.model alone, or unpickled in another process, still renders.
# Plain Python, no torch.
from versionwatch._report import text as _render  # noqa: F401

_WHERE = {
    "AutoWatcher": "_watch.auto",
    "watch_all": "_watch.auto",
    "FreedGraphError": "_report.errors",
    "InplaceHazardWarning": "_report.errors",
    "InplaceModificationError": "_report.errors",
    "assert_backward_safe": "_predict.api",
    "check": "_predict.api",
    "Fix": "_report.model",
    "FixResult": "_fix.command",
    "fix": "_fix.command",
    "Hazard": "_report.model",
    "Modification": "_report.model",
    "Repair": "_report.model",
    "Report": "_report.model",
    "Site": "_report.model",
    "Timeline": "_timeline",
    "Watcher": "_watch.watcher",
    "watch": "_watch.watcher",
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
