"""``versionwatch fix``: a candidate patch checked by running the patched program.

It owns the command and its result (``command``: ``fix``, ``FixResult``), writing a
verified patch to the user's files (``apply``), running a patched program and
judging what it did (``check``), the child process that runs the program or a
patched copy (``child``), the fork server that imports torch once (``server``) and a
notebook file as the program, its cells edited in place (``notebook``).
The candidates themselves come from ``_candidates``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._fix.command import FixResult as FixResult
    from versionwatch._fix.command import fix as fix
    from versionwatch._fix.command import main as main
    from versionwatch._fix.command import unchecked as unchecked
    from versionwatch._fix.notebook import Notebook as Notebook
    from versionwatch._fix.notebook import NotebookError as NotebookError
    from versionwatch._fix.notebook import is_notebook as is_notebook
    from versionwatch._fix.notebook import read_notebook as read_notebook
    from versionwatch._fix.server import ForkServer as ForkServer

_WHERE = {
    "fix": "versionwatch._fix.command",
    "FixResult": "versionwatch._fix.command",
    "ForkServer": "versionwatch._fix.server",
    "main": "versionwatch._fix.command",
    "Notebook": "versionwatch._fix.notebook",
    "NotebookError": "versionwatch._fix.notebook",
    "is_notebook": "versionwatch._fix.notebook",
    "read_notebook": "versionwatch._fix.notebook",
    "unchecked": "versionwatch._fix.command",
}

__getattr__ = lazy_names(__name__, _WHERE)
