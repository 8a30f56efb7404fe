"""The watcher: ``watch()``, ``watch_all()`` and everything that happens while one is open.

It owns the ``Watcher`` and its parts (forward recording, optimizer tracking, the
backward pipeline, blame), the policy on a hazard (``policy``), which watchers are
open (``active``), where the training loop's events enter (``intercept``, and
``forward`` for a root module's forward), freed graphs' carriers (``carrier``),
backwards in flight on other threads (``inflight``), zero-code watching (``auto``),
a training library's closing summary (``summary``) and the typed faces the
interception points call (``protocols``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._report import Report
    from versionwatch._runtime import Registry
    from versionwatch._watch.active import current as current
    from versionwatch._watch.auto import AutoWatcher as AutoWatcher
    from versionwatch._watch.auto import watch_all as watch_all
    from versionwatch._watch.backward import ReplayStop as ReplayStop
    from versionwatch._watch.policy import POLICIES as POLICIES
    from versionwatch._watch.policy import Policy as Policy
    from versionwatch._watch.policy import env_problem as env_problem
    from versionwatch._watch.policy import resolve_policy as resolve_policy
    from versionwatch._watch.protocols import OpenWatcher
    from versionwatch._watch.summary import log_summary as log_summary
    from versionwatch._watch.watcher import Watcher as Watcher
    from versionwatch._watch.watcher import watch as watch

_WHERE = {
    "AutoWatcher": "versionwatch._watch.auto",
    "current": "versionwatch._watch.active",
    "env_problem": "versionwatch._watch.policy",
    "log_summary": "versionwatch._watch.summary",
    "POLICIES": "versionwatch._watch.policy",
    "Policy": "versionwatch._watch.policy",
    "ReplayStop": "versionwatch._watch.backward",
    "resolve_policy": "versionwatch._watch.policy",
    "watch": "versionwatch._watch.watcher",
    "watch_all": "versionwatch._watch.auto",
    "Watcher": "versionwatch._watch.watcher",
}

__getattr__ = lazy_names(__name__, _WHERE)

# -- by hand: the peer harness's names ---------------------------------------------
# The peer harness (shared/peer/vw_oracle.py, outside this repository) was written
# when this folder was one module: it reads ``Watcher`` and ``_ACTIVE`` here (and
# tries ``_LOCAL``, which that module never had: it still gets no answer), and
# replaces ``predict`` here to observe each prediction. The old names stay readable,
# and a ``predict`` set here becomes the watcher's (``watcher.predict``, which it
# looks up at each backward). Nothing of ours uses these names.


class _Folder(types.ModuleType):
    @property
    def predict(self) -> Callable[..., Report]:
        from versionwatch._watch import watcher

        return watcher.predict

    @predict.setter
    def predict(self, fn: Callable[..., Report]) -> None:
        from versionwatch._watch import watcher

        watcher.predict = fn

    @property
    def _ACTIVE(self) -> Registry[OpenWatcher]:
        from versionwatch._watch.active import ACTIVE

        return ACTIVE


sys.modules[__name__].__class__ = _Folder
