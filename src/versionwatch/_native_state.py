"""The native helper as decided: the loaded, self-tested extension, or ``None``.

A leaf that the predictor and the ledger read at every backward (one global read,
no call). Only :mod:`versionwatch._native.loader` sets it; it lives apart from the loader
because the loader's self-test runs the Python predictor, which reads it.
"""

from __future__ import annotations

from typing import Any

CURRENT: Any = None
"""The extension once it loaded and passed its self-test; ``None`` otherwise."""
