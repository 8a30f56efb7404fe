"""The optional native helper (C++, torch's ``cpp_extension``): an exact saved-tensor check and
fast version reads.

It owns loading and deciding the helper (``loader``), building it with a build that
cannot hang (``build``), its self-test against the Python predictor (``selftest``)
and its source (``native.cpp``, shipped in the wheel). Without a compiler everything
runs in Python with the same results; what was decided lives in the leaf
``_native_state``, read at every backward.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._native.build import mode_problem as mode_problem
    from versionwatch._native.loader import command as command
    from versionwatch._native.loader import native as native

# Each name loads its module on first use, as the package's own names do: importing
# one module of the folder costs no other (the pytest plugin, at start-up), and
# ``python -m`` of a module here finds it not yet imported.
_WHERE = {
    "command": "versionwatch._native.loader",
    "mode_problem": "versionwatch._native.build",
    "native": "versionwatch._native.loader",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
