"""The optional native helper (C++, torch's ``cpp_extension``): an exact saved-tensor check and
fast version reads.

It owns loading and deciding the helper (``loader``), building it with a build that
cannot hang (``build``), its self-test against the Python predictor (``selftest``)
and its source (``native.cpp``, shipped in the wheel). Without a compiler everything
runs in Python with the same results; what was decided lives in the leaf
``_native_state``, read at every backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._native.build import mode_problem as mode_problem
    from versionwatch._native.loader import command as command
    from versionwatch._native.loader import native as native

_WHERE = {
    "command": "versionwatch._native.loader",
    "mode_problem": "versionwatch._native.build",
    "native": "versionwatch._native.loader",
}

__getattr__ = lazy_names(__name__, _WHERE)
