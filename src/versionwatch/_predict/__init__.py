"""The predictor: what a backward would do, decided from its graph before it runs.

It owns ``check``, ``assert_backward_safe`` and the watcher's ``predict`` (``api``),
a backward call's own arguments judged as PyTorch judges them (``arguments``), the
graph walk (``graph``), the engine simulated (``engine``), the saved-tensor check
(``checker``) and where each node keeps its saved tensors (``slots``). ``api`` also
holds the explicit seam for observers of ``check`` (``CHECK_OBSERVERS``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._predict.api import CHECK_OBSERVERS as CHECK_OBSERVERS
    from versionwatch._predict.api import GATE as GATE
    from versionwatch._predict.api import assert_backward_safe as assert_backward_safe
    from versionwatch._predict.api import check as check
    from versionwatch._predict.api import predict as predict
    from versionwatch._predict.api import raise_for as raise_for
    from versionwatch._predict.api import unobserved as unobserved
    from versionwatch._predict.arguments import BadCall as BadCall
    from versionwatch._predict.arguments import read_once as read_once
    from versionwatch._predict.arguments import rejected as rejected
    from versionwatch._predict.graph import Graph as Graph
    from versionwatch._predict.graph import lease as lease
    from versionwatch._predict.slots import COPY_SLICES as COPY_SLICES
    from versionwatch._predict.slots import CUSTOM as CUSTOM
    from versionwatch._predict.slots import PLANS as PLANS
    from versionwatch._predict.slots import plan_of as plan_of
    from versionwatch._predict.slots import planned as planned
    from versionwatch._predict.slots import trust_unpack as trust_unpack

_WHERE = {
    "assert_backward_safe": "versionwatch._predict.api",
    "BadCall": "versionwatch._predict.arguments",
    "check": "versionwatch._predict.api",
    "CHECK_OBSERVERS": "versionwatch._predict.api",
    "COPY_SLICES": "versionwatch._predict.slots",
    "CUSTOM": "versionwatch._predict.slots",
    "GATE": "versionwatch._predict.api",
    "Graph": "versionwatch._predict.graph",
    "lease": "versionwatch._predict.graph",
    "plan_of": "versionwatch._predict.slots",
    "planned": "versionwatch._predict.slots",
    "PLANS": "versionwatch._predict.slots",
    "predict": "versionwatch._predict.api",
    "raise_for": "versionwatch._predict.api",
    "read_once": "versionwatch._predict.arguments",
    "rejected": "versionwatch._predict.arguments",
    "trust_unpack": "versionwatch._predict.slots",
    "unobserved": "versionwatch._predict.api",
}

__getattr__ = lazy_names(__name__, _WHERE)
