"""The faces of a watcher that the modules below :mod:`_watch` see.

Those modules never import ``_watch``: each takes the part of a watcher it
uses, as a typed :class:`~typing.Protocol` here, so that ``mypy --strict``
checks the coupling and a rename breaks the type check, not a run.
:class:`~versionwatch.Watcher` (and :class:`~versionwatch.AutoWatcher`)
satisfy all of them.

Some members keep a leading underscore: the peer harness wraps those methods
on the class by name (``_on_forward``, ``_adopt_root``, ``_on_zero_grad``, ...),
so the events must reach them under those names.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from versionwatch._ledger import Ledger
    from versionwatch._repair import Repairer
    from versionwatch._report import Report, Site
    from versionwatch._runtime import Removable
    from versionwatch._timeline import Timeline
    from versionwatch._watch.optimizer_state import OptimizerState

# What a forward's first call to ``_on_forward`` returns and its second takes:
# (the forward's number, the versions before it when read on the no-grad path).
ForwardToken = Optional[tuple[int, Optional[list[int]]]]


class OpenWatcher(Protocol):
    """An open watcher as the interception points see it (:mod:`_active`, :mod:`_intercept`)."""

    closed: bool
    roots: dict[str, weakref.ref[nn.Module]]

    def _optimizer(self, opt: Optimizer) -> OptimizerState | None: ...

    def _run_backward(self, api: str, outputs: Any, inputs: Any, call: Callable[[], Any],
                      arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
                      site: Site | None = None) -> Any: ...

    def _step_aside(self) -> None: ...

    def _on_zero_grad(self, opt: Optimizer, set_to_none: bool,
                      state: OptimizerState | None = None, site: Site | None = None) -> None: ...

    def _on_step_pre(self, opt: Optimizer, state: OptimizerState | None = None,
                     caller: FrameType | None = None) -> None: ...

    def _on_step_post(self, opt: Optimizer, state: OptimizerState | None = None) -> None: ...


class ForwardWatcher(Protocol):
    """A watcher of root modules as the forward route sees it (:mod:`_forward`)."""

    closed: bool
    ledger: Ledger
    forwards: dict[str, int]  # each root's last forward number
    counters: dict[str, Iterator[int]]  # each root's forward numbers to come
    synced: dict[str, str]  # route of a DDP root's inner module -> the DDP root
    sharded: set[str]  # FSDP2 roots
    repairer: Repairer | None

    def forward_label(self, root: str, n: int) -> str: ...

    def _on_forward(self, root: str, pre: bool, token: ForwardToken = None) -> ForwardToken: ...


class Adopter(Protocol):
    """A watcher that adopts every root module it sees run (:mod:`_forward`, ``watch_all``)."""

    closed: bool
    seen: dict[int, weakref.ref[nn.Module]]  # ids of modules adopted or skipped

    def _adopt_root(self, module: nn.Module, caller: FrameType | None = None) -> None: ...


class Blamed(Protocol):
    """A watcher as blame sees it (:mod:`_blame`): its ledger, names, roots, optimizers
    and reports."""

    ledger: Ledger
    names: dict[int, str]
    roots: dict[str, weakref.ref[nn.Module]]
    _optimizers: dict[int, OptimizerState]  # id of each followed optimizer -> its state
    reports: deque[Report]
    strict: bool
    strict_thread: str | None  # the thread strict mode records on

    def timeline(self, *names: str, report: Report | None = None) -> Timeline: ...


class InScope(Blamed, Protocol):
    """A watcher in a backward's scope (:mod:`_backward`): blamed, and read for its
    names and its fused steps' silent writes."""

    _silent: dict[int, int]  # param id -> the sequence clock after a fused step
    _silent_on: dict[int, int]  # param id -> the thread that clock was read on

    def _share(self, report: Report) -> None: ...


class Lender(Protocol):
    """A watcher that lends its root modules to a watcher opened inside its span
    (``watch_all``'s :class:`~versionwatch.AutoWatcher`), declared here so that the
    watcher does not import its subclass."""

    def _lend(self, module: nn.Module) -> Removable: ...
