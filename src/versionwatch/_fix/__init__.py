"""``versionwatch fix``: a candidate patch checked by running the patched program.

It owns the command and its result (``command``: ``fix``, ``FixResult``), running
a patched program and judging what it did (``check``), the child process that runs
the program or a patched copy (``child``) and the fork server that imports torch
once (``server``). The candidates themselves come from ``_candidates``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._fix.command import FixResult as FixResult
    from versionwatch._fix.command import fix as fix
    from versionwatch._fix.command import main as main
    from versionwatch._fix.command import unchecked as unchecked
    from versionwatch._fix.server import ForkServer as ForkServer

# Each name loads its module on first use, as the package's own names do: importing
# one module of the folder costs no other (the pytest plugin, at start-up), and
# ``python -m`` of a module here finds it not yet imported.
_WHERE = {
    "fix": "versionwatch._fix.command",
    "FixResult": "versionwatch._fix.command",
    "ForkServer": "versionwatch._fix.server",
    "main": "versionwatch._fix.command",
    "unchecked": "versionwatch._fix.command",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
