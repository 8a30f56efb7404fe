"""The ``versionwatch`` command: ``run``, ``merge``, ``demo``, ``native`` and ``fix``.

It owns argument parsing and running a script as ``__main__`` (``command``), what a
run writes (``outputs``: ``--json``, ``--dot``, ``--svg``), how a run ends
(``sigterm``), ``--replay`` (``replay``), ``merge`` of ranks' reports (``merge``)
and the bundled seed story (``demo``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._cli.command import main as main

# Each name loads its module on first use, as the package's own names do: importing
# one module of the folder costs no other (the pytest plugin, at start-up), and
# ``python -m`` of a module here finds it not yet imported.
_WHERE = {
    "main": "versionwatch._cli.command",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
