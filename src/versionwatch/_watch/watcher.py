"""``watch()``: the training-loop watcher.

While a watcher is open, every ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` call is predicted before it runs (the entry points
are in :mod:`versionwatch._watch.intercept`). Root-module forwards (seen by
:mod:`versionwatch._watch.forward`), optimizer steps and ``zero_grad``
(:mod:`versionwatch._watch.optimizers`) feed the :class:`Ledger`, which turns a
hazard's two version numbers into the events that moved them
(:mod:`versionwatch._watch.blame`).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from versionwatch import _distributed, _native, _strict
from versionwatch._ledger import Ledger
from versionwatch._naming import has_fsdp
from versionwatch._predict import predict as predict  # the seam observers replace
from versionwatch._predict import raise_for
from versionwatch._repair import Repairer
from versionwatch._report import Hazard, InplaceHazardWarning, Repair, Report, Site, fix_for
from versionwatch._runtime import Removable, remove_all
from versionwatch._sites import user_frame, user_frame_from
from versionwatch._strict import SavedRecord
from versionwatch._timeline import Timeline, of_ledger
from versionwatch._watch import blame as _blame
from versionwatch._watch import forward as _forward
from versionwatch._watch.active import ACTIVE, LOCK, current, thread_stack
from versionwatch._watch.backward import BackwardPipeline
from versionwatch._watch.forward_events import ForwardRecorder
from versionwatch._watch.intercept import PATCHES
from versionwatch._watch.optimizer_state import OptimizerState
from versionwatch._watch.optimizers import OptimizerTracker
from versionwatch._watch.policy import Policy, resolve_policy
from versionwatch._watch.protocols import ForwardToken, InScope, Lender

logger = logging.getLogger("versionwatch")

_LOCK = LOCK


def _variable_name(module: nn.Module, caller: FrameType | None) -> str:
    """The variable holding ``module`` in the user's frame (``caller`` or above), else its class."""
    frame = user_frame_from(caller)
    if frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for name, value in scope.items():
                if value is module and not name.startswith("_"):
                    return name
    return type(module).__name__


def _check_budget(repair_budget: int | None) -> None:
    if repair_budget is not None and (
            isinstance(repair_budget, bool) or not isinstance(repair_budget, int)
            or repair_budget < 0):
        raise ValueError(f"repair_budget={repair_budget!r}: give a number of bytes (an int "
                         ">= 0), or None for the default")


def _check_modules(modules: Mapping[str, nn.Module]) -> None:
    """Refuse a module given twice, a ScriptModule, and one an explicit open watcher watches.

    A module the automatic watcher (``watch_all``) holds is not refused: it is
    lent (see :meth:`AutoWatcher._lend`).
    """
    seen: dict[int, str] = {}
    for name, module in modules.items():
        if id(module) in seen:
            raise ValueError(
                f"the same module is given twice, as {seen[id(module)]!r} and {name!r}; "
                "give each module once"
            )
        seen[id(module)] = name
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(
                f"watch() cannot watch {name!r}, a ScriptModule (the output of "
                "torch.jit.script or torch.jit.trace): TorchScript's differentiable "
                "graphs hide the tensors they save for backward, so no backward "
                "through it can be predicted. Watch the module you scripted and run "
                "it instead of the script (they share their parameters)"
            )
        for other in ACTIVE:
            if not cast("Watcher", other).lends_roots \
                    and any(r() is module for r in other.roots.values()):
                raise ValueError(
                    f"module {name!r} ({type(module).__name__}) is already watched by "
                    "an open watcher; close that one first"
                )


class Watcher:
    """Watches modules and optimizers; predicts and explains every backward.

    Create it with :func:`watch`. It is active from creation until :meth:`close`
    (or the end of its ``with`` block).

    Attributes:
        reports: the recent reports that had hazards (at most 100).
        ledger: the version ledger.
        backward_count: the backwards watched so far.
        closed: whether :meth:`close` ran.
    """

    # An automatic watcher (watch_all) lends its roots to an explicit watcher
    # of the same module for that one's span, instead of refusing it.
    lends_roots = False
    # Forward labels carry the root's name even while the watcher has one root.
    root_in_labels = False

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        optimizers: tuple[Optimizer, ...],
        on_hazard: Policy,
        *,
        strict: bool = False,
        stop_at_write: bool = False,
        repair_budget: int | None = None,
        fingerprint: bool = False,
    ) -> None:
        self.policy = resolve_policy(on_hazard)
        _check_budget(repair_budget)
        if fingerprint and not (strict or stop_at_write):
            raise ValueError("fingerprint=True needs strict mode: watch(..., strict=True, "
                             "fingerprint=True)")
        self.fingerprint = fingerprint
        self.repairer = Repairer(self, repair_budget) if self.policy == "repair" else None
        self.strict = strict or stop_at_write
        self.stop_at_write = stop_at_write
        self.ledger = Ledger()
        self.reports: deque[Report] = deque(maxlen=100)
        self.names: dict[int, str] = {}  # id of each watched tensor -> its qualified name
        self.roots: dict[str, weakref.ref[nn.Module]] = {}
        # Its parts, sharing the dicts above; each event enters through the
        # methods below (the peer harness wraps them on the class), which call
        # a part's method bound here once.
        recorder = self._forward_recorder = ForwardRecorder(
            self.names, self.roots, self.ledger, self.strict, self.root_in_labels)
        self._record_forward = recorder.record
        # The route (_forward) numbers a no-grad forward inline, on the watcher.
        self.forwards = recorder.forwards
        self.counters = recorder.counters
        self.synced = recorder.synced
        self.sharded = recorder.sharded
        tracker = self._optimizer_tracker = OptimizerTracker(
            self, self.names, self.roots, self.ledger, self.strict, self.repairer)
        # The interception points ask it three times a step: the tracker's own method.
        self._optimizer: Callable[[Optimizer], OptimizerState | None] = tracker.find
        self._zero_grad = tracker.on_zero_grad
        self._step_pre = tracker.on_step_pre
        self._step_post = tracker.on_step_post
        # Blame and the backward read these of every watcher in scope.
        self._optimizers = tracker.states
        self._silent = tracker.silent
        self._silent_on = tracker.silent_on
        pipeline = self._backward_pipeline = BackwardPipeline(
            self.names, self.ledger, tracker.silent, self.strict, self.repairer)
        self._backward = pipeline.run
        self.closed = False
        # Everything this watcher holds of the process (forward routes, the
        # patches, its registry entry, strict mode), given back newest first
        # by close(), or by a failed __init__.
        self._held: list[Removable] = []
        self._routes: dict[str, list[Removable]] = {}  # each root's forward routes
        # The automatic watchers that lent this one a module: they keep its reports too.
        self._lenders: list[weakref.ref[Watcher]] = []
        # This thread's stack of open watchers holds them weakly (as every
        # registry of ours): one dropped without close() is collected.
        self._thread_stack = cast("list[weakref.ref[Watcher]]", thread_stack())
        self._stack_ref = weakref.ref(self)
        # Saved-tensor hooks are per thread: strict mode records on this one only.
        self.strict_thread = threading.current_thread().name if self.strict else None
        with _LOCK:
            _check_modules(modules)
            try:
                for name, module in modules.items():
                    self._borrow(module)
                    self._add_root(name, module)
                for opt in optimizers:
                    tracker.add(opt, explicit=True)
                self._held.append(PATCHES.subscribe())
                self._held.append(ACTIVE.add(self))
                if self.strict:
                    self._held.append(_strict.attach(self))
                if fingerprint:
                    self._held.append(_strict.FINGERPRINT_ANCHOR.subscribe())
            except BaseException:
                remove_all(self._held)
                raise
        self._thread_stack.append(self._stack_ref)

    # -- roots and forwards ----------------------------------------------------------
    def _add_root(self, name: str, module: nn.Module) -> None:
        if self.strict:
            _strict.name_modules(module, name)
        self.roots[name] = weakref.ref(module)
        self.forwards[name] = 0
        self.counters[name] = itertools.count(1)
        self._forward_recorder.track(name, module)
        self._route(name, module)
        if has_fsdp(module):
            self.sharded.add(name)

    def _route(self, name: str, module: nn.Module) -> None:
        """Record the forwards of root ``name`` (and of a DDP root's inner module)."""
        routes = self._routes[name] = [_forward.add_root(module, self, name)]
        self._held.append(routes[0])
        inner = _distributed.buffer_synced_inner(module)
        if inner is not None:
            # What DDP writes between its forward's start and the wrapped module's
            # call is its buffer broadcast: a mark there names it.
            route = f"{name}\x00sync"
            self.synced[route] = name
            routes.append(_forward.add_root(inner, self, route))
            self._held.append(routes[1])

    def _borrow(self, module: nn.Module) -> None:
        """Take ``module`` from every automatic watcher for this watcher's span."""
        for other in ACTIVE:
            watcher = cast("Watcher", other)
            if watcher is not self and watcher.lends_roots and not watcher.closed:
                # lends_roots: an AutoWatcher, which the watcher does not import
                self._held.append(cast("Lender", watcher)._lend(module))
                if not any(r() is watcher for r in self._lenders):
                    self._lenders.append(weakref.ref(watcher))

    def _predict(self, outputs: Any, inputs: Any, api: str, names: dict[int, str],
                 silent: dict[int, int] | None) -> Report:
        # The first call in the process loads (or builds) and self-tests the helper;
        # every later one is an attribute read.
        _native.native()
        # Looked up in this module at each call: an observer assigned to
        # ``_watch.predict`` sees every prediction.
        return predict(outputs, inputs, api, names, silent)  # type: ignore[arg-type]

    def _scope(self) -> list[Watcher]:
        """This watcher, then the other open watchers of its thread, innermost first."""
        stack = self._thread_stack
        if len(stack) == 1 and stack[0] is self._stack_ref:  # the usual case: one watcher
            return [self]
        return [self, *(w for r in reversed(stack)
                        if (w := r()) is not None and w is not self and not w.closed)]

    # -- events: each one's entry, handed to the part that records it -----------------
    def forward_label(self, root: str, n: int) -> str:
        """``forward #3``, or ``G.forward #3`` when the watcher has more than one root."""
        return self._forward_recorder.label(root, n)

    def _on_forward(self, root: str, pre: bool, token: ForwardToken = None) -> ForwardToken:
        """A root's forward: ``pre`` before it runs (returns a token), then after it."""
        return self._record_forward(root, pre, token)

    def _on_zero_grad(self, opt: Optimizer, set_to_none: bool,
                      state: OptimizerState | None = None, site: Site | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, and ``site`` the user's line, when known."""
        self._zero_grad(opt, set_to_none, state, site)

    def _on_step_pre(self, opt: Optimizer, state: OptimizerState | None = None,
                     caller: FrameType | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, when known; ``caller``: the frame running the step.

        That frame is the one that calls the pre-hooks (under ``Optimizer.step``).
        """
        self._step_pre(opt, state, caller)

    def _on_step_post(self, opt: Optimizer, state: OptimizerState | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, when the caller has it already."""
        self._step_post(opt, state)

    def _run_backward(self, api: str, outputs: Any, inputs: Any, call: Callable[[], Any],
                      arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
                      site: Site | None = None) -> Any:
        """Predict a backward (``api``), explain and dispatch its hazards, then ``call()`` it."""
        __tracebackhide__ = True
        return self._backward(self, api, outputs, inputs, call, arguments, site)

    def _step_aside(self) -> None:
        """A backward inside a ``torch.func`` transform runs unpredicted: say so once."""
        self._backward_pipeline.step_aside()

    @property
    def backward_count(self) -> int:
        """The backwards watched so far."""
        return self._backward_pipeline.count

    @property
    def replay_at(self) -> int | None:
        """``versionwatch run --replay``'s strict re-run: the backward number to stop at."""
        return self._backward_pipeline.replay_at

    @replay_at.setter
    def replay_at(self, n: int | None) -> None:
        self._backward_pipeline.replay_at = n

    # -- explaining and dispatching --------------------------------------------------
    def _explain(self, report: Report, scope: Sequence[InScope] | None = None) -> InScope:
        """Blame each hazard in the ledger that tracks its tensor; return the owner.

        The owner, the watcher of the first hazard's tensor, keeps the report.
        """
        chosen: Sequence[InScope] = scope or [self]
        owner = _blame.explain(self, report, chosen)
        owner._share(report)
        return owner

    def _share(self, report: Report) -> None:
        """Give ``report``, kept by this watcher, to the watchers that lent it a module.

        ``versionwatch run`` and ``pytest --versionwatch`` write their own
        watcher's reports: a hazard that a program's own watcher found on a
        model they lent it is one of the run's.
        """
        for ref in self._lenders:
            lender = ref()
            if lender is not None and not lender.closed \
                    and not any(r is report for r in lender.reports):
                lender.reports.append(report)

    def _dispatch(self, report: Report) -> None:
        __tracebackhide__ = True
        policy = self.policy
        if policy == "raise" or policy == "repair":  # what repair could not fix is raised
            raise_for(report)
        elif policy == "warn":
            _, level = user_frame(1)
            warnings.warn(str(report), InplaceHazardWarning, stacklevel=level)
        elif policy == "log":
            logger.warning("%s", report)
        elif callable(policy):
            policy(report)

    def _after_error(self, err: RuntimeError, report: Report | None, site: Site | None) -> None:
        _blame.after_error(self, err, report, site)

    def explain_error(self, err: RuntimeError) -> None:
        """Explain PyTorch's error from a backward this watcher did not predict, as a note.

        For integrations that catch it after the fact (a backward that bypassed
        ``torch.autograd.backward``).
        """
        self._after_error(err, None, None)

    def on_strict_write(self, hazards: list[Hazard], records: list[SavedRecord]) -> None:
        """``stop_at_write``: a write is about to hit memory that a live graph saved."""
        __tracebackhide__ = True
        for h, rec in zip(hazards, records):
            _blame.name_record(self.names, h, rec)
            h.fix = fix_for(h)
            if self.policy in ("raise", "repair"):
                h.notes.append("stopped before the write: nothing was modified")
        if self.policy in ("raise", "repair"):
            # The raise unwinds the step: its post-hook will not run.
            _strict.end_step()
            self._optimizer_tracker.end_pending_steps()
        report = Report(hazards=hazards, rank=_distributed.rank())
        _blame.suggest(report)
        self.reports.append(report)
        self._share(report)
        self._dispatch(report)

    # -- public ----------------------------------------------------------------------
    def timeline(self, *names: str, report: Report | None = None) -> Timeline:
        """The version history of watched tensors, as a table of events.

        Args:
            *names: tensors to show (qualified names, e.g. ``"model.w3"``). By
                default: the tensors involved in hazards, else the first eight.
            report: mark this report's saved versions (default: the latest).
        """
        report = report or (self.reports[-1] if self.reports else None)
        return of_ledger(self.ledger, names, report.hazards if report is not None else [])

    @property
    def repairs(self) -> list[Repair]:
        """``on_hazard="repair"``: the copies kept so far (the latest 1000), oldest first."""
        return list(self.repairer.repairs) if self.repairer is not None else []

    def repair_summary(self) -> dict[str, Any]:
        """``on_hazard="repair"``: how many copies, bytes copied, peak and current bytes held.

        Keys: ``repairs``, ``copied_bytes``, ``peak_bytes``, ``held_bytes``,
        ``budget_bytes``, ``refused`` (graphs the budget left unrepaired).

        Raises:
            RuntimeError: the watcher's policy is not ``"repair"``.

        Example:
            >>> import torch, versionwatch
            >>> model = torch.nn.Linear(2, 1)
            >>> with versionwatch.watch(model, on_hazard="repair") as w:
            ...     w.repair_summary()["repairs"]
            0
        """
        if self.repairer is None:
            raise RuntimeError(f"repair_summary() needs watch(..., on_hazard='repair'); this "
                               f"watcher's policy is {self.policy!r}")
        return self.repairer.summary()

    def close(self) -> None:
        """Remove every hook and patch. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.repairer is not None:
            self.repairer.roots = []
        try:
            # Each one is given back whatever another's removal raised.
            remove_all(self._held)
        finally:
            stack = self._thread_stack
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self._stack_ref:  # by identity: dead while it is collected
                    del stack[i]
                    break

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and not sys.is_finalizing():
            self.close()


def watch(
    modules: nn.Module | Mapping[str, nn.Module],
    *optimizers: Optimizer,
    on_hazard: Policy = "raise",
    strict: bool = False,
    stop_at_write: bool = False,
    repair_budget: int | None = None,
    fingerprint: bool = False,
) -> Watcher:
    """Watch modules (and optimizers): predict and explain every backward.

    Inside ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``,
    ``vmap``) the watcher steps aside: their forwards and backwards run as
    unwatched, unpredicted, which the ``versionwatch`` logger says once, at
    debug level.

    Args:
        modules: one ``nn.Module`` (named after the variable that holds it, e.g.
            ``model``, else its class), or a dict of named modules (``{"G": gen}``
            names tensors ``G.fc.weight``).
        *optimizers: optional; optimizers that step watched parameters are found
            on their first ``step()`` or ``zero_grad()`` anyway.
        on_hazard: ``"raise"`` (an :class:`InplaceModificationError` before
            backward runs), ``"warn"`` (an :class:`InplaceHazardWarning` at your
            backward call), ``"log"`` (the ``versionwatch`` logger), ``"repair"``
            (keep a copy of what a live graph saved before a watched step, or in
            strict mode any seen write, overwrites it; what it cannot repair is
            raised as with ``"raise"``; see the "Repair" page of the docs), or a
            callable that takes the :class:`Report`. ``$VERSIONWATCH_ON_HAZARD``
            overrides it.
        strict: also record each write to a saved tensor at the line that makes
            it, including writes that bump no version (``.data``, fused
            optimizers): a backward that would fail, or read silently changed
            memory, is stopped before it runs and the report names those lines.
            See the "Strict mode" page of the docs. Costs more: opt-in.
        stop_at_write: strict mode that also stops at the write itself, before
            it happens, whenever it hits memory that a live graph saved, even if
            that graph never runs backward again. For debugging: it can stop
            training that PyTorch would accept.
        fingerprint: with ``strict``, also keep a sample of the bytes of each
            saved tensor (up to 64 elements) and compare it before backward:
            a change that no version bump and no seen write explains (a C++
            kernel, NumPy, an extension, a collective) is a ``silent`` hazard.
            See "Writes no counter sees" on the "Strict mode" page. Costs more.
        repair_budget: with ``on_hazard="repair"``, the most bytes that copies
            may hold at once; default: twice the watched tensors' bytes, at
            least 64 MiB. Past it a graph gets no more copies (one warning).

    Returns:
        A :class:`Watcher`, active until closed; use it as a context manager.

    Raises:
        TypeError: ``modules`` is not a module or a dict of them, or one is a
            ScriptModule (watch the module it was scripted from).
        ValueError: a module is given twice or already watched, an optimizer
            steps none of the watched parameters, or ``repair_budget`` is not
            a number of bytes, or ``fingerprint`` is given without strict mode.

    Example:
        >>> import torch, versionwatch
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with versionwatch.watch(model, opt) as w:
        ...     loss = model(torch.ones(1, 2)).sum()
        ...     loss.backward(retain_graph=True)
        ...     opt.step()
        ...     try:
        ...         loss.backward()
        ...     except versionwatch.InplaceModificationError as e:
        ...         print(e.report.hazards[0].modified_by[0].description)
        opt.step() #1
    """
    if isinstance(modules, nn.Module):
        named = {_variable_name(modules, sys._getframe(1)): modules}
    elif isinstance(modules, Mapping) and modules and all(
        isinstance(k, str) and isinstance(v, nn.Module) for k, v in modules.items()
    ):
        named = dict(modules)
    else:
        raise TypeError(
            "watch() takes an nn.Module or a non-empty dict of named modules; "
            f"got {type(modules).__name__}"
        )
    # `versionwatch run --replay`'s child: a watcher the program opens (a training
    # library's callback, the program's own watch()) is the innermost, so it numbers
    # and predicts the backwards as it did in the first run: it is the one to stop at
    # the replayed backward (else it raised there and the replay saw no report), in
    # strict mode as the child's own watcher, to name the lines.
    outer = current()
    replay_at = getattr(outer, "replay_at", None) if outer is not None else None
    w = Watcher(named, optimizers, on_hazard, strict=strict or replay_at is not None,
                stop_at_write=stop_at_write, repair_budget=repair_budget,
                fingerprint=fingerprint)
    if replay_at is not None:
        w.replay_at = replay_at
    return w
