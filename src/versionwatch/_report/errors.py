"""Exceptions and warnings raised by versionwatch.

Both errors subclass :class:`RuntimeError`, the type PyTorch raises, and their
message carries PyTorch's own error verbatim (the report's ``pytorch`` line), so
``except RuntimeError`` handlers, ``pytest.raises(match=...)`` and log searches
for "modified by an inplace operation" keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from versionwatch._report.model import Report

_E = TypeVar("_E", bound=BaseException)


def add_note(err: _E, text: str) -> _E:
    """Add ``text`` to ``err``'s notes, shown under its traceback; returns ``err``.

    ``BaseException.add_note`` where Python has it (3.11+); before, the
    ``__notes__`` list it would set.
    """
    if hasattr(err, "add_note"):
        err.add_note(text)
    else:  # Python < 3.11 has no add_note: set what it would set
        err.__notes__ = [*getattr(err, "__notes__", []), text]
    return err


class InplaceModificationError(RuntimeError):
    """A tensor saved for backward was (or would be) modified by an inplace operation.

    Attributes:
        report: the full :class:`~versionwatch.Report`; ``report.hazards[0]`` is
            the failure that backward would hit first.
    """

    __module__ = "versionwatch"

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


class FreedGraphError(RuntimeError):
    """Backward would run through a graph whose saved tensors were already freed.

    The message carries PyTorch's own text ("Trying to backward through the graph
    a second time ... Specify retain_graph=True ...") verbatim.

    Attributes:
        report: the full :class:`~versionwatch.Report`.
    """

    __module__ = "versionwatch"

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


class InplaceHazardWarning(UserWarning):
    """Issued instead of an error when a watcher runs with ``on_hazard="warn"``."""

    __module__ = "versionwatch"
