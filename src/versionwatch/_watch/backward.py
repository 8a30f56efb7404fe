"""A watched backward: predicted, explained and dispatched before it runs, then run.

``_intercept`` routes every backward call (``Tensor.backward``,
``torch.autograd.backward``, ``torch.autograd.grad``) to
the watcher's ``_run_backward``, which hands it to :meth:`BackwardPipeline.run`.
That records the ``backward`` event, predicts the backward over the names of
every open watcher of the thread, has the hazards blamed (``_blame``) and
handed to the policy (the watcher's ``_dispatch``), then calls the backward
itself; an error PyTorch raises after all is explained as a note.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol

from versionwatch import _strict
from versionwatch._compat import seq_clock
from versionwatch._ledger import Ledger
from versionwatch._predict import GATE, BadCall, rejected
from versionwatch._report import Report, Site
from versionwatch._watch import blame as _blame
from versionwatch._watch import inflight as _inflight
from versionwatch._watch.active import _LOCAL, LOCK
from versionwatch._watch.protocols import InScope

if TYPE_CHECKING:
    from versionwatch._repair import Repairer

__all__ = ["BackwardPipeline", "ReplayStop"]

logger = logging.getLogger("versionwatch")


class ReplayStop(BaseException):
    """A replay reached the backward it was to stop at (``versionwatch run --replay``).

    A ``BaseException``: the program's own ``except Exception`` must let it through.
    """

    def __init__(self, report: Report | None) -> None:
        super().__init__("versionwatch: replay stopped")
        self.report = report


def _this_thread(silent: dict[int, int], scope: Sequence[InScope]) -> dict[int, int]:
    """The silent writes whose clock this thread's nodes can be compared with.

    Sequence numbers count per thread: a clock read on the stepping thread
    says nothing of nodes another thread made (it would call a graph made
    after the step stale). The backward's thread stands in for the
    forward's; a write on another thread goes unchecked (see docs/threads.md).
    """
    me = threading.get_ident()
    on: dict[int, int] = {}
    for w in reversed(scope):
        on.update(w._silent_on)
    if all(t == me for t in on.values()):
        return silent
    return {k: c for k, c in silent.items() if on.get(k, me) == me}


def _tally(into: dict[str, int], report: Report) -> None:
    """Add ``report``'s unverified saved tensors to ``into`` (why -> count; "" -> backwards)."""
    into[""] = into.get("", 0) + 1
    for node, slot in report.unverifiable:
        why = report.why_unverifiable(node, slot)
        into[why] = into.get(why, 0) + 1


class BackwardHost(Protocol):
    """What a :class:`BackwardPipeline` asks of its watcher, at each backward.

    Looked up on the watcher then, not bound once: the peer harness wraps
    ``_explain``, ``_dispatch`` and ``_after_error`` on the class by name, and
    an observer sees every prediction through ``_predict``.
    """

    def _scope(self) -> Sequence[InScope]: ...  # it, then its thread's other open watchers

    def _predict(self, outputs: Any, inputs: Any, api: str, names: dict[int, str],
                 silent: dict[int, int] | None) -> Report: ...

    def _explain(self, report: Report, scope: Sequence[InScope] | None = None) -> InScope: ...

    def _dispatch(self, report: Report) -> None: ...

    def _after_error(self, err: RuntimeError, report: Report | None,
                     site: Site | None) -> None: ...


class BackwardPipeline:
    """A watcher's backwards: their numbers, and each one's prediction before it runs.

    Held by the :class:`~versionwatch.Watcher`, whose ``_run_backward`` calls
    :meth:`run` with itself as the host; it shares the watcher's names,
    ledger and silent writes, and holds no reference to the watcher.
    """

    __slots__ = ("count", "ledger", "names", "repairer", "replay_at", "silent", "stepped_aside",
                 "strict", "unverified")

    def __init__(self, names: dict[int, str], ledger: Ledger, silent: dict[int, int],
                 strict: bool, repairer: Repairer | None) -> None:
        self.names = names
        self.ledger = ledger
        self.silent = silent  # param id -> the sequence clock after a fused step
        self.strict = strict
        self.repairer = repairer
        self.count = 0  # the backwards watched so far
        # `versionwatch run --replay`'s strict re-run: the backward number to stop at.
        self.replay_at: int | None = None
        self.stepped_aside = False  # set once a torch.func transform ran unwatched
        # Saved tensors not verified, summed over the backwards: why -> how many,
        # and "" -> how many backwards had some (a clean run's summary says so).
        self.unverified: dict[str, int] = {}

    def run(self, host: BackwardHost, api: str, outputs: Any, inputs: Any,
            call: Callable[[], Any], arguments: tuple[tuple[Any, ...], dict[str, Any]] | None,
            site: Site | None) -> Any:
        """Predict a backward (``api``), explain and dispatch its hazards, then ``call()`` it.

        ``site`` is the user's line of the call, read where it entered.
        """
        __tracebackhide__ = True
        if self.strict:
            _strict.end_step()  # past any step, even one that raised (or in a closure)
        with LOCK:  # threads number their backwards from one counter
            self.count += 1
            n = self.count
        frees = _inflight.frees(api, arguments)
        label = f"backward #{n}"
        # A freeing backward keeps the clock at its start: a graph it may have
        # freed is older, and one built since is newer (see _blame.explain_freed).
        self.ledger.record("backward", label, site,
                           seq=seq_clock() if frees else None, frees=frees)
        ended = False
        scope = host._scope()
        names, silent = self.names, self.silent
        if len(scope) > 1:  # nested watchers: name what any of them watches
            names, silent = {}, {}
            for w in reversed(scope):
                names.update(w.names)
                silent.update(w._silent)
        if silent:
            silent = _this_thread(silent, scope)
        if self.repairer is not None and not frees:
            self.repairer.retain(outputs, f"backward #{n}", site)
        flight = _inflight.Flight(host, label, site, frees)
        _LOCAL.busy = True  # reset in the finally below, whatever raises
        try:
            # The prediction's gate, set inline: a generator-based context
            # manager costs about as much as the rest of this preamble.
            gate = GATE.fn
            GATE.fn = functools.partial(_inflight.depart, flight)
            try:
                report: Report | None = host._predict(outputs, inputs, api, names,
                                                      silent or None)
            except (TypeError, ValueError, BadCall):
                report = None  # PyTorch will say what is wrong with the arguments
            finally:
                GATE.fn = gate
            if report is not None and not report.ok and arguments is not None \
                    and rejected(api, *arguments):
                report = None  # PyTorch rejects the arguments before any saved tensor: its error
            if report is not None:
                if report.unverifiable:
                    _tally(self.unverified, report)
                report.backward_site = site
                report.backward = n
                if self.ledger.threaded:
                    report.thread = threading.current_thread().name
                if flight.freed_by:
                    _inflight.name_freer(report, flight)
                if not report.ok:
                    if any(h.kind == "freed" for h in report.hazards):
                        _blame.explain_freed(report, outputs, scope)
                    host._explain(report, scope)
                if n == self.replay_at:
                    raise ReplayStop(report)
                if not report.ok:
                    host._dispatch(report)
            try:
                return call()
            except RuntimeError as e:
                # Record the end first: a write during backward (a hook, a custom
                # Function) is what the ledger must see to name the tensor.
                ended = True
                self._end(n)
                host._after_error(e, report, site)
                raise
        finally:
            _LOCAL.busy = False
            _inflight.land(flight)
            if not ended:
                self._end(n)

    def step_aside(self) -> None:
        """A backward inside a ``torch.func`` transform runs unpredicted: say so once."""
        if not self.stepped_aside:
            self.stepped_aside = True
            logger.debug("versionwatch: backward inside a torch.func transform (grad, vjp, "
                         "jacrev, hessian, vmap) runs unpredicted: its tensors are functorch "
                         "wrappers; backwards outside transforms are predicted as usual")

    def _end(self, n: int) -> None:
        label = f"backward #{n}"
        self.ledger.end("backward_end", label, "backward", f"during {label}")
