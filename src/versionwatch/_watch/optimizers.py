"""Optimizers: which ones a watcher follows, and their ``step()`` and ``zero_grad()`` events.

An optimizer is followed once it steps a watched parameter: given to
``watch()``, or found by the global step hooks (:mod:`_intercept`) on its
first ``step()`` or ``zero_grad()``. A step is recorded as one event between
its pre- and post-hook: the ledger blames the step for every version it moved.
Fused kernels update parameters in place without a version bump; the step
marks them as silent writes, which the next backward's prediction reads.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Sequence
from itertools import chain
from types import FrameType
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn
from torch.optim import Optimizer

from versionwatch import _strict
from versionwatch._compat import seq_clock
from versionwatch._ledger import Ledger, Tracked
from versionwatch._naming import module_tensors, optimizer_names, unique_label
from versionwatch._report import Modification, Site
from versionwatch._sites import is_library, site_from, user_site
from versionwatch._watch.active import _LOCAL
from versionwatch._watch.optimizer_state import OptimizerState, ParamCache, PendingStep, group_ids

if TYPE_CHECKING:
    from versionwatch._repair import Repairer

logger = logging.getLogger("versionwatch")

_tuple_new = tuple.__new__


_NO_GRAD = (True, None, 0)  # the grad mark after zero_grad(set_to_none=True)


def fused(opt: Optimizer) -> bool:
    """Whether a param group of ``opt`` runs a fused kernel (a loop: twice a step)."""
    for g in opt.param_groups:
        if g.get("fused"):
            return True
    return False


_HAS_OPTIMIZER_ATTR: dict[type, bool] = {}


def _class_has_optimizer(cls: type) -> bool:
    """Whether ``getattr(opt, "_optimizer")`` may find more than ``opt``'s instance dict.

    A class attribute (a property would win over the instance dict) or a
    ``__getattr__``; cached per class.
    """
    has = _HAS_OPTIMIZER_ATTR.get(cls)
    if has is None:
        has = _HAS_OPTIMIZER_ATTR[cls] = hasattr(cls, "_optimizer") or hasattr(cls, "__getattr__")
    return has


class _Named(Protocol):
    names: dict[int, str]  # id of each watched tensor -> its qualified name


class StepHost(Protocol):
    """What an :class:`OptimizerTracker` asks of its watcher: the watchers in its scope.

    A repair before a step names what it copies by every open watcher of the thread.
    """

    def _scope(self) -> Sequence[_Named]: ...


class OptimizerTracker:
    """The optimizers a watcher follows, and their step and zero_grad events.

    Held by the :class:`~versionwatch.Watcher`, whose ``_on_step_pre`` and
    friends call it; it shares the watcher's names, roots and ledger, and
    holds the watcher itself weakly (the watcher holds it).
    """

    __slots__ = ("_host", "kept_grads", "ledger", "names", "not_ours", "repairer", "roots",
                 "silent", "silent_on", "states", "strict")

    def __init__(self, host: StepHost, names: dict[int, str],
                 roots: dict[str, weakref.ref[nn.Module]], ledger: Ledger, strict: bool,
                 repairer: Repairer | None) -> None:
        self._host = weakref.ref(host)
        self.names = names
        self.roots = roots
        self.ledger = ledger
        self.strict = strict
        self.repairer = repairer
        self.states: dict[int, OptimizerState] = {}  # id of each followed optimizer -> its state
        # Set once a zero_grad(set_to_none=False) left grad marks.
        self.kept_grads = False
        # Fused steps' silent writes: param id -> the sequence clock after the
        # step, and the thread that clock was read on.
        self.silent: dict[int, int] = {}
        self.silent_on: dict[int, int] = {}
        # Optimizers found to step none of the watched params, by id: (the
        # optimizer, weakly; len(names) then, which only grows; its group ids).
        # Asked again only once either changed: their hooks run at every step.
        self.not_ours: dict[int, tuple[weakref.ref[Optimizer], int, list[int]]] = {}

    # -- which optimizers --------------------------------------------------------------
    def add(self, opt: Optimizer, explicit: bool) -> OptimizerState | None:
        if not isinstance(opt, Optimizer):
            raise TypeError(f"watch() takes torch.optim optimizers; got {type(opt).__name__}")
        params = [p for g in opt.param_groups for p in g["params"]]
        if not any(id(p) in self.names for p in params):
            if explicit:
                raise ValueError(
                    f"none of {type(opt).__name__}'s parameters belong to the watched modules; "
                    "pass the modules it optimizes to watch()"
                )
            return None
        known = self.states.get(id(opt))
        if known is not None and known.ref() is opt:
            return known  # given twice: one optimizer, one label
        label, named = self._label(opt, None)
        # Given to watch() with no variable holding it (Lightning's callback
        # passes trainer.optimizers): its first step looks again.
        state = OptimizerState(opt, label, named or not explicit)
        self.states[id(opt)] = state
        return state

    def _label(self, opt: Optimizer, state: OptimizerState | None) -> tuple[str, bool]:
        """``opt``'s label, and whether it is the user's variable (``opt_d``), not its class.

        Read from the frames that add it (``watch(model, opt_g, opt_d)``, or its
        first step or zero_grad, where ``opt_d, opt_g = self.optimizers()``
        holds Lightning's wrapper of it), never at every step. A name or class
        another optimizer of this watcher has (a helper's ``opt`` parameter,
        an optimizer made again each epoch) is numbered: ``opt[1]``, ``Adam[1]``.
        """
        labels = {s.label for s in self.states.values() if s is not state}
        names = optimizer_names(opt, sys._getframe(2), is_library)
        first = next(names, None)
        if first is None:
            return unique_label(iter(()), type(opt).__name__, labels.__contains__), False
        return unique_label(chain((first,), names), "", labels.__contains__), True

    def _name(self, opt: Optimizer, state: OptimizerState) -> None:
        """At the first step or zero_grad of an optimizer added with no variable: look again."""
        label, named = self._label(opt, state)
        state.relabel(label if named else state.label)

    def find(self, opt: Optimizer) -> OptimizerState | None:
        """``opt``'s state, following it from now on if it steps a watched param; else None."""
        # Lightning's LightningOptimizer wrapper keeps the optimizer in its
        # instance dict; a failed getattr costs about 1 us, three times a step.
        if _class_has_optimizer(type(opt)):
            inner = getattr(opt, "_optimizer", None)
        else:
            inner = opt.__dict__.get("_optimizer")
        if isinstance(inner, Optimizer):
            opt = inner
        state = self.states.get(id(opt))
        if state is not None and state.ref() is opt:
            return state
        known = self.not_ours.get(id(opt))
        if known is not None and known[0]() is opt and known[1] == len(self.names) \
                and known[2] == group_ids(opt):
            return None
        state = self.add(opt, explicit=False)
        if state is None:
            if len(self.not_ours) >= 64:  # dead ones' entries: a bound, not a sweep
                self.not_ours.clear()
            self.not_ours[id(opt)] = (weakref.ref(opt), len(self.names), group_ids(opt))
        return state

    def _watched(self, opt: Optimizer, state: OptimizerState | None = None,
                 need: bool = True) -> tuple[list[torch.Tensor], list[Tracked | None]]:
        """The optimizer's watched params and their ledger entries (cached per state).

        ``state``: ``opt``'s, when known. ``need=False``: the params are not
        needed, only adopting those added since (the list is then empty while
        the cache holds).
        """
        if state is None:
            state = self.states.get(id(opt))
        ids = group_ids(opt)
        cache = state.params if state is not None else None
        # The same ids, and the groups hold tensors with these ids alive: only a
        # dead one's id reused breaks the cache, and a death clears ``alive``.
        if cache is not None and cache.alive and cache.ids == ids:
            if not need:
                return [], cache.tracked
            return cast("list[torch.Tensor]", [r() for r in cache.refs]), cache.tracked
        out = []
        complete = True
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self.names:
                    self._adopt(p)  # e.g. add_param_group after watch() began
                if id(p) in self.names:
                    out.append(p)
                else:
                    complete = False  # try to adopt it again next time
        trs = [self.ledger.tracked.get(id(p)) for p in out]
        if state is not None and state.ref() is opt and complete:
            state.params = ParamCache(ids, out, trs)
        return out, trs

    def _adopt(self, p: torch.Tensor) -> None:
        for root, ref in self.roots.items():
            module = ref()
            if module is None:
                continue
            found = module_tensors(module, root + ".").get(id(p))
            if found is not None:
                self.names[id(p)] = found[0]
                self.ledger.track(found[0], p)
                return

    # -- events --------------------------------------------------------------------------
    def on_zero_grad(self, opt: Optimizer, set_to_none: bool,
                     state: OptimizerState | None = None, site: Site | None = None) -> None:
        """``state``: ``self.find(opt)``, and ``site`` the user's line, when known."""
        if self.strict:
            _strict.end_step()  # past any step, even one that raised
        if state is None:
            state = self.find(opt)
        if state is None:
            return
        if not state.named:
            self._name(opt, state)
        if set_to_none:  # every .grad is None now
            # Until some zero_grad keeps grads, every mark is None or _NO_GRAD,
            # and both mean the same to on_step_pre: nothing to update.
            for tr in self._watched(opt, state, need=False)[1] if self.kept_grads else ():
                if tr is not None:
                    tr.grad_mark = _NO_GRAD
        else:
            self.kept_grads = True
            params, trs = self._watched(opt, state)
            for p, tr in zip(params, trs):
                if tr is not None:
                    g = p.grad
                    tr.grad_mark = (set_to_none, None if g is None else id(g),
                                    0 if g is None else g._version)
        label = (state.zero_label[set_to_none] if set_to_none is True or set_to_none is False
                 else f"{state.label}.zero_grad(set_to_none={set_to_none})")
        self.ledger.record("zero_grad", label, site if site is not None else user_site())

    def on_step_pre(self, opt: Optimizer, state: OptimizerState | None = None,
                    caller: FrameType | None = None) -> None:
        """``state``: ``self.find(opt)``, when known; ``caller``: the frame running the step.

        That frame is the one that calls the pre-hooks (under ``Optimizer.step``).
        """
        if state is None:
            state = self.find(opt)
        if state is None:
            return
        if state.pending is not None:  # the last step raised: its post-hook never ran
            self.ledger.end_step(state.pending.label)
        if not state.named:
            self._name(opt, state)
        state.steps += 1
        label = f"{state.label}.step() #{state.steps}"
        site = site_from(caller) if caller is not None else user_site()
        self.ledger.sync(label, site)
        touched: list[tuple[weakref.ref[torch.Tensor], int]] = []
        notes: dict[int, str] = {}
        is_fused = fused(opt)
        repair = bool(self.repairer is not None and self.repairer.roots and not self.strict)
        threads = threading.active_count() > 1
        # Also adopts params added since; the params themselves only when used below.
        params, trs = self._watched(opt, state,
                                    need=repair or threads or self.kept_grads or is_fused)
        if repair:
            self._repair_step(params, label, site)
        if threads:
            # Another thread's event may scan while this step runs.
            self.ledger.begin_step(label, [id(p) for p in params],
                                   Modification("optimizer.step", label, site))
        # Only fused steps need the versions before, and only zero_grad(set_to_none=
        # False) leaves marks that make notes: otherwise skip the per-param loop.
        if not (self.kept_grads or is_fused):
            params = []
        for p, tr in zip(params, trs):
            g = p.grad
            if g is None:
                continue
            touched.append((weakref.ref(p), p._version))
            if tr is None:
                continue
            mark = tr.grad_mark
            if mark is not None and not mark[0] and mark[1] == id(g) and mark[2] == g._version:
                notes[id(p)] = (
                    f"no backward since the last zero_grad() wrote a gradient for {tr.name}: "
                    "its .grad was the zero tensor that zero_grad(set_to_none=False) left "
                    f"behind, and {state.label}.step() updates every parameter whose .grad "
                    "is not None"
                )
        state.pending = _tuple_new(PendingStep, (label, site, touched, notes))
        if self.strict:
            _strict.begin_step(label, caller)
            if _strict.RECORDS:
                # The step's writes, recorded (and, under stop_at_write, checked)
                # as one before it writes anything: raising halfway would leave
                # some parameters updated. Fused kernels bump no version.
                # Read as the step reads them: a param group it will refuse (a
                # non-tensor in it) gets the step's own error, not ours.
                with_grad = [p for g in opt.param_groups for p in g.get("params", ())
                             if isinstance(p, torch.Tensor) and p.grad is not None]
                _strict.on_write("step", (with_grad,), {}, silent=is_fused)
            _strict.THREAD.step_checked = True

    def on_step_post(self, opt: Optimizer, state: OptimizerState | None = None) -> None:
        """``state``: ``self.find(opt)``, when the caller has it already."""
        if state is None:
            state = self.find(opt)
        if state is None or state.pending is None:
            return
        label, site, touched, notes = state.pending
        state.pending = None
        if self.strict:
            _strict.end_step()
        self.ledger.record("step", label, site, cause=Modification("optimizer.step", label, site),
                           notes=notes)
        self.ledger.end_step(label)
        # ``touched`` is filled only for a fused (or a kept-grads) step: no second loop.
        if touched and fused(opt):
            # Fused kernels update parameters in place without bumping _version.
            clock = None
            for ref, v in touched:
                p = ref()
                if p is not None and p._version == v:
                    clock = clock if clock is not None else seq_clock()
                    self.silent[id(p)] = clock
                    self.silent_on[id(p)] = threading.get_ident()
                    self.ledger.silent(
                        p, Modification("optimizer.step", f"{label} (fused: no version bump)", site)
                    )

    def end_pending_steps(self) -> None:
        """Close every step under way: a raise unwinds a step, whose post-hook will not run."""
        for state in self.states.values():
            if state.pending is not None:
                self.ledger.end_step(state.pending.label)
            state.pending = None

    def _repair_step(self, params: list[torch.Tensor], label: str, site: Site | None) -> None:
        """Default mode's repair: copy what retained graphs saved of ``params``."""
        repairer = self.repairer
        assert repairer is not None
        names = self.names
        host = self._host()
        scope = host._scope() if host is not None else ()
        if len(scope) > 1:
            names = {}
            for w in reversed(scope):
                names.update(w.names)
        _LOCAL.busy = True  # our walk and copies are no user events
        try:
            n = repairer.before_step(params, names, label, site)
        except Exception:  # never break the user's step: unrepaired is raised as today
            logger.debug("versionwatch: repair before %s failed", label, exc_info=True)
            n = 0
        finally:
            _LOCAL.busy = False
        if n:
            repairer.record(n, label, site)
