"""versionwatch: explain and predict PyTorch's "modified by an inplace operation" errors."""

from versionwatch._errors import FreedGraphError, InplaceHazardWarning, InplaceModificationError
from versionwatch._predict import assert_backward_safe, check
from versionwatch._report import Hazard, Modification, Report, Site

__all__ = [
    "FreedGraphError",
    "Hazard",
    "InplaceHazardWarning",
    "InplaceModificationError",
    "Modification",
    "Report",
    "Site",
    "assert_backward_safe",
    "check",
]
__version__ = "0.1.0"
