"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors."""

from versionwatch._auto import AutoWatcher, watch_all
from versionwatch._errors import FreedGraphError, InplaceHazardWarning, InplaceModificationError
from versionwatch._predict import assert_backward_safe, check
from versionwatch._report import Hazard, Modification, Report, Site
from versionwatch._timeline import Timeline
from versionwatch._watch import Watcher, watch

__all__ = [
    "AutoWatcher",
    "FreedGraphError",
    "Hazard",
    "InplaceHazardWarning",
    "InplaceModificationError",
    "Modification",
    "Report",
    "Site",
    "Timeline",
    "Watcher",
    "assert_backward_safe",
    "check",
    "watch",
    "watch_all",
]
__version__ = "0.1.0"
