"""``watch()``: the training-loop watcher.

While a watcher is open, every ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` call is predicted before it runs (these three cover
GradScaler, Accelerate's ``accelerator.backward`` and Lightning's manual
backward, which all end in ``torch.autograd.backward``). Root-module forwards
(seen by :mod:`versionwatch._forward`), optimizer step hooks and ``zero_grad``
feed the :class:`Ledger`, which turns a hazard's two version numbers into the
events that moved them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, cast

import torch
import torch.jit._builtins as _builtins
from torch import nn
from torch.optim import Optimizer

from versionwatch import _distributed, _forward, _inflight, _repair, _strict
from versionwatch._call import BadCall, read_once, rejected
from versionwatch._compat import SAVED_INTROSPECTION, sequence_nr
from versionwatch._config import Policy, resolve_policy
from versionwatch._errors import InplaceHazardWarning
from versionwatch._explain import fix_for, render_report
from versionwatch._functorch import in_functorch_transform
from versionwatch._ledger import Ledger, Tracked, read_versions
from versionwatch._naming import has_fsdp, module_tensors
from versionwatch._predict import _GATE, _VERSION_RE, predict, raise_for
from versionwatch._repair import Repairer
from versionwatch._report import Hazard, Modification, Repair, Report, Site, size
from versionwatch._runtime import (
    Anchor,
    Change,
    Entry,
    Hook,
    Patch,
    Registry,
    Removable,
    remove_all,
)
from versionwatch._sites import user_frame, user_site
from versionwatch._timeline import Timeline

logger = logging.getLogger("versionwatch")

_LOCK = threading.RLock()
_LOCAL = threading.local()
# Open watchers, oldest first: truthy while any is open.
_ACTIVE: Registry[Watcher] = Registry("watchers")


def _stack() -> list[Watcher]:
    stack: list[Watcher] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _current() -> Watcher | None:
    """The innermost watcher of this thread, else the newest one of any thread."""
    local = _LOCAL.__dict__  # busy and stack, read without two getattr calls
    if local.get("busy"):
        return None
    stack: list[Watcher] | None = local.get("stack")
    if stack:
        return stack[-1]
    return _ACTIVE.newest()


def _owner(opt: Optimizer) -> tuple[Watcher, _OptimizerState] | None:
    """The open watcher that watches ``opt``'s parameters (innermost first), and its state.

    With nested watchers an outer model's optimizer must reach the outer
    watcher, not the innermost one, which would ignore it.
    """
    local = _LOCAL.__dict__  # busy and stack, read without two getattr calls
    if local.get("busy"):
        return None
    stack: list[Watcher] | None = local.get("stack")
    if stack is None:
        stack = _stack()
    if len(stack) == 1:  # one watcher on this thread: no list to build
        candidates = stack
    elif stack:
        candidates = stack[::-1]
    else:
        candidates = _ACTIVE.items()[::-1]
    for w in candidates:
        if not w._closed:
            state = w._optimizer(opt)
            if state is not None:
                return w, state
    return None


def _fused(opt: Optimizer) -> bool:
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


def _add_note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):
        err.add_note(text)
    else:  # Python < 3.11
        err.__notes__ = [*getattr(err, "__notes__", []), text]


# -- the process-wide patches, installed while any watcher is open ------------------

def _patched(api: str, first: str, inputs_at: int) -> Patch:
    """A stand-in for ``torch.autograd.<api>`` that predicts before it calls the original.

    ``first`` is the name of the outputs argument, ``inputs_at`` the position of
    ``inputs`` in the original's signature.
    """

    def patched(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        original = patch.old
        w = _current()
        if w is None:
            return original(*args, **kwargs)
        outputs = args[0] if args else kwargs.get(first)
        inputs = args[inputs_at] if len(args) > inputs_at else kwargs.get("inputs")
        # loss.backward() passes a tensor and no inputs: skip the ABC checks (slow).
        if (type(outputs) is not torch.Tensor or inputs is not None) and (
                isinstance(outputs, Iterator) or isinstance(inputs, Iterator)):
            args, kwargs = read_once(args, kwargs, first, inputs_at)
            outputs = args[0] if args else kwargs.get(first)
            inputs = args[inputs_at] if len(args) > inputs_at else kwargs.get("inputs")
        if in_functorch_transform(outputs, inputs):
            w._step_aside()
            return original(*args, **kwargs)
        return w._run_backward(api, outputs, inputs, lambda: original(*args, **kwargs),
                               (args, kwargs))

    patched.__name__ = patched.__qualname__ = api
    patch = Patch(torch.autograd, api, patched)
    return patch


# backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
_BACKWARD = _patched("backward", "tensors", 5)
_backward = _BACKWARD.new
# grad(outputs, inputs, ...)
_GRAD = _patched("grad", "outputs", 1)
_grad = _GRAD.new


def _zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
    _ZERO_GRAD.old(self, set_to_none)
    found = _owner(self)
    if found is not None:
        found[0]._on_zero_grad(self, set_to_none, found[1])


def _step_pre(opt: Optimizer, args: Any, kwargs: Any) -> None:
    found = _owner(opt)
    if found is not None:
        found[0]._on_step_pre(opt, found[1])


def _step_post(opt: Optimizer, args: Any, kwargs: Any) -> None:
    found = _owner(opt)
    if found is not None:
        found[0]._on_step_post(opt, found[1])


def _jit_builtins() -> dict[int, str]:
    """TorchScript's table of Python functions it compiles as aten ops, by ``id``."""
    table: dict[int, str] = _builtins._get_builtin_table()  # type: ignore[no-untyped-call]
    return table


_ZERO_GRAD = Patch(Optimizer, "zero_grad", _zero_grad)


def _changes() -> list[Change]:
    """The process-wide patches of every watcher, in the order applied."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    # TorchScript compiles torch.autograd.grad/backward to aten ops found by the
    # identity of the function it sees: ours must map to the same ops.
    table = _jit_builtins()
    return [_BACKWARD, _GRAD, _ZERO_GRAD,
            Entry(table, id(_backward), "aten::backward"), Entry(table, id(_grad), "aten::grad"),
            Hook(register_optimizer_step_pre_hook, _step_pre),
            Hook(register_optimizer_step_post_hook, _step_post)]


# In place while any watcher is open. The originals stay in the patches after
# the last close: a wrapper someone kept a reference to (``from torch.autograd
# import backward`` inside a watch block) still works.
PATCHES = Anchor("autograd and optimizer patches", _changes)


def _seq_clock() -> int:
    """The autograd sequence number now: nodes made before have a number no larger, after larger.

    The number of a node made now, less one: that is what a probe node made
    here would have got, without making one (a tensor and a node, about 10 us).
    """
    if sequence_nr is not None:
        return sequence_nr() - 1
    if torch.is_inference_mode_enabled():
        # An inference tensor records no node; the counter is the same outside.
        with torch.inference_mode(False):
            return _seq_clock()
    with torch.enable_grad():
        probe = torch.empty(0, requires_grad=True).view(0)
    fn = probe.grad_fn
    assert fn is not None
    return int(fn._sequence_nr())


def _variable_name(module: nn.Module, skip: int) -> str:
    """The name of the variable holding ``module`` in the user's frame, else its class."""
    frame, _ = user_frame(skip + 1)
    if frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for name, value in scope.items():
                if value is module and not name.startswith("_"):
                    return name
    return type(module).__name__


# Default mode sees events, not ops: a write to an activation (or any tensor
# it does not track) between two events has no line it could name.
_UNSEEN_WRITE = (
    "default mode sees forwards, backwards, steps and zero_grad, not the write itself: "
    "`versionwatch run --replay ...` (or --strict, or watch(..., strict=True)) names its line"
)
# The writes are events it saw (a step); the op that saved the tensor is not.
_UNSEEN_SAVE = (
    "default mode sees the forward, not the op in it that saved the tensor: "
    "`versionwatch run --replay ...` (or --strict, or watch(..., strict=True)) names its line"
)


class ReplayStop(BaseException):
    """A replay reached the backward it was to stop at (``versionwatch run --replay``).

    A ``BaseException``: the program's own ``except Exception`` must let it through.
    """

    def __init__(self, report: Report | None) -> None:
        super().__init__("versionwatch: replay stopped")
        self.report = report


def _carrier(frame: Any, node: str, seq: int) -> str | None:
    """The user's variable that holds the output of node ``node`` #``seq``, or a newer one.

    Exact first (the old tensor itself); else a variable rebound to a newer
    output of the same op, as recurrent state is (``h = rnn(x, h)``).
    """
    if frame is None:
        return None
    newer = None
    for scope in (frame.f_locals, frame.f_globals):
        for name, value in list(scope.items()):
            if name.startswith("_") or not isinstance(value, torch.Tensor):
                continue
            fn = value.grad_fn
            if fn is None or fn.name() != node:
                continue
            nr = int(fn._sequence_nr())
            if nr == seq:
                return str(name)
            if nr > seq and newer is None:
                newer = str(name)
    return newer


def _match_ledger(h: Hazard, scope: list[Watcher]) -> None:
    """Name a stale tensor that the predictor could not read (old torch), by its history.

    A buffer has no ``AccumulateGrad`` edge to be found by; a watched tensor now
    at the hazard's version that went through the saved one, of the same size,
    is it. Ties (``running_mean`` and ``running_var`` move together) go to the
    one named like the slot that saved it.
    """
    if h.kind != "inplace" or h.producer is not None or h.saved_version is None:
        return
    now, saved = h.current_version, h.saved_version
    found: list[tuple[int, Tracked, torch.Tensor]] = []
    for w in scope:
        for key, tr in list(w.ledger.tracked.items()):  # another thread may adopt
            t = tr.ref()
            if (t is None or t._version != now
                    or (h.shape is not None and tuple(t.shape) != h.shape)
                    or not any(tn.old <= saved < tn.new for tn in tr.history)):
                continue
            found.append((key, tr, t))
    if len(found) > 1:
        found = [f for f in found if f[1].name.rsplit(".", 1)[-1] == h.slot]
    if len(found) == 1:
        key, tr, t = found[0]
        h.tensor, h.key, h.requires_grad = tr.name, key, t.requires_grad


# The step's label, site, (param, version before) of the params it may update,
# and notes. Params are held weakly: a step that raised never clears it.
_Pending = tuple[str, Optional[Site], list[tuple["weakref.ref[torch.Tensor]", int]],
                 dict[int, str]]


class _OptimizerState:
    __slots__ = ("label", "params", "pending", "ref", "steps", "zero_label")

    def __init__(self, opt: Optimizer, label: str) -> None:
        self.ref = weakref.ref(opt)
        self.label = label
        # The zero_grad event's label, by set_to_none (made once, not every step).
        self.zero_label = (f"{label}.zero_grad(set_to_none=False)",
                           f"{label}.zero_grad(set_to_none=True)")
        self.steps = 0
        self.pending: _Pending | None = None
        # (ids of each group's params, watched params, their Tracked): reused
        # while the param groups hold the same tensors. Weak: an open watcher
        # must not keep a deleted model's parameters alive.
        self.params: tuple[list[list[int]], list[weakref.ref[torch.Tensor]],
                           list[Tracked | None]] | None = None


_NO_GRAD = (True, None, 0)  # the grad mark after zero_grad(set_to_none=True)


class Watcher:
    """Watches modules and optimizers; predicts and explains every backward.

    Create it with :func:`watch`. It is active from creation until :meth:`close`
    (or the end of its ``with`` block).

    Attributes:
        reports: the recent reports that had hazards (at most 100).
        ledger: the version ledger.
    """

    _kept_grads = False  # set once a zero_grad(set_to_none=False) left grad marks
    # `versionwatch run --replay`'s strict re-run: the backward number to stop at.
    _replay_at: int | None = None
    _stepped_aside = False  # set once a torch.func transform ran unwatched

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        optimizers: tuple[Optimizer, ...],
        on_hazard: Policy,
        *,
        strict: bool = False,
        stop_at_write: bool = False,
        repair_budget: int | None = None,
    ) -> None:
        self.policy = resolve_policy(on_hazard)
        self._repair: Repairer | None = None
        if repair_budget is not None and (
                isinstance(repair_budget, bool) or not isinstance(repair_budget, int)
                or repair_budget < 0):
            raise ValueError(f"repair_budget={repair_budget!r}: give a number of bytes (an int "
                             ">= 0), or None for the default")
        if self.policy == "repair":
            self._repair = Repairer(self, repair_budget)
        self.strict = strict or stop_at_write
        self.stop_at_write = stop_at_write
        self.ledger = Ledger()
        self.reports: deque[Report] = deque(maxlen=100)
        self._names: dict[int, str] = {}
        self._roots: dict[str, weakref.ref[nn.Module]] = {}
        self._forwards: dict[str, int] = {}  # the last forward number of each root
        self._counters: dict[str, Iterator[int]] = {}
        # Route name of a DDP root's inner module -> the DDP root's name.
        self._synced: dict[str, str] = {}
        # FSDP2 roots: their unsharded parameters appear at the first forward.
        self._sharded: set[str] = set()
        # Everything this watcher holds of the process (forward routes, the
        # patches, its registry entries, strict mode), taken back newest first
        # by close() or by a failed __init__.
        self._held: list[Removable] = []
        self._optimizers: dict[int, _OptimizerState] = {}
        self._silent: dict[int, int] = {}
        # The thread whose sequence clock each _silent entry was read on.
        self._silent_on: dict[int, int] = {}
        self._backwards = 0
        self._closed = False
        self._thread_stack = _stack()
        # Saved-tensor hooks are per thread: strict mode records on this one only.
        self._strict_thread = threading.current_thread().name if self.strict else None
        with _LOCK:
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
                for other in _ACTIVE:
                    if any(r() is module for r in other._roots.values()):
                        raise ValueError(
                            f"module {name!r} ({type(module).__name__}) is already watched by "
                            "an open watcher; close that one first"
                        )
            try:
                for name, module in modules.items():
                    self._add_root(name, module)
                for opt in optimizers:
                    self._add_optimizer(opt, explicit=True)
                self._held.append(PATCHES.subscribe())
                self._held.append(_ACTIVE.add(self))
                if self.strict:
                    self._held.append(_strict.attach(self))
            except BaseException:
                remove_all(self._held)
                raise
        self._thread_stack.append(self)

    # -- setup -----------------------------------------------------------------------
    def _add_root(self, name: str, module: nn.Module) -> None:
        if self.strict:
            _strict.name_modules(module, name)
        self._roots[name] = weakref.ref(module)
        self._forwards[name] = 0
        self._counters[name] = itertools.count(1)
        for key, (qual, t) in module_tensors(module, name + ".").items():
            if key not in self._names:
                self._names[key] = qual
                self.ledger.track(qual, t)
        self._held.append(_forward.add_root(module, self, name))
        if has_fsdp(module):
            self._sharded.add(name)
        inner = _distributed.buffer_synced_inner(module)
        if inner is not None:
            # What DDP writes between its forward's start and the wrapped module's
            # call is its buffer broadcast: a mark there names it.
            route = f"{name}\x00sync"
            self._synced[route] = name
            self._held.append(_forward.add_root(inner, self, route))

    def _track_unsharded(self, root: str) -> None:
        # The tensors an FSDP2 forward saved are its unsharded parameters: named
        # as the parameters they stand for, and tracked from their first forward.
        module = self._roots[root]()
        if module is None:
            return
        for key, (qual, t) in module_tensors(module, root + ".").items():
            if key not in self._names:
                self._names[key] = qual
                self.ledger.track(qual, t)

    def _label(self, root: str, n: int) -> str:
        return f"forward #{n}" if len(self._roots) == 1 else f"{root}.forward #{n}"

    def _add_optimizer(self, opt: Optimizer, explicit: bool) -> _OptimizerState | None:
        if not isinstance(opt, Optimizer):
            raise TypeError(f"watch() takes torch.optim optimizers; got {type(opt).__name__}")
        params = [p for g in opt.param_groups for p in g["params"]]
        if not any(id(p) in self._names for p in params):
            if explicit:
                raise ValueError(
                    f"none of {type(opt).__name__}'s parameters belong to the watched modules; "
                    "pass the modules it optimizes to watch()"
                )
            return None
        cls = type(opt).__name__
        same = sum(1 for s in self._optimizers.values() if s.label.startswith(cls))
        state = _OptimizerState(opt, cls if same == 0 else f"{cls}[{same}]")
        self._optimizers[id(opt)] = state
        return state

    def _optimizer(self, opt: Optimizer) -> _OptimizerState | None:
        # Lightning's LightningOptimizer wrapper keeps the optimizer in its
        # instance dict; a failed getattr costs about 1 us, three times a step.
        if _class_has_optimizer(type(opt)):
            inner = getattr(opt, "_optimizer", None)
        else:
            inner = opt.__dict__.get("_optimizer")
        if isinstance(inner, Optimizer):
            opt = inner
        state = self._optimizers.get(id(opt))
        if state is not None and state.ref() is opt:
            return state
        return self._add_optimizer(opt, explicit=False)

    def _watched_params(self, opt: Optimizer) -> list[torch.Tensor]:
        return self._watched(opt)[0]

    def _watched(self, opt: Optimizer) -> tuple[list[torch.Tensor], list[Tracked | None]]:
        """The optimizer's watched params and their ledger entries (cached per state)."""
        state = self._optimizers.get(id(opt))
        ids = [list(map(id, g["params"])) for g in opt.param_groups]
        if state is not None and state.params is not None and state.params[0] == ids:
            params = [r() for r in state.params[1]]
            # The same ids, and the groups hold tensors with these ids alive:
            # only a dead one's id reused breaks the cache.
            if not any(p is None for p in params):
                return cast("list[torch.Tensor]", params), state.params[2]
        out = []
        complete = True
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self._names:
                    self._adopt(p)  # e.g. add_param_group after watch() began
                if id(p) in self._names:
                    out.append(p)
                else:
                    complete = False  # try to adopt it again next time
        trs = [self.ledger.tracked.get(id(p)) for p in out]
        if state is not None and state.ref() is opt and complete:
            state.params = (ids, [weakref.ref(p) for p in out], trs)
        return out, trs

    def _adopt(self, p: torch.Tensor) -> None:
        for root, ref in self._roots.items():
            module = ref()
            if module is None:
                continue
            found = module_tensors(module, root + ".").get(id(p))
            if found is not None:
                self._names[id(p)] = found[0]
                self.ledger.track(found[0], p)
                return

    # -- events ----------------------------------------------------------------------
    def _on_forward(self, root: str, pre: bool, token: Any = None) -> Any:
        """Record a root's forward: ``pre`` before it runs (returns a token), then after it.

        A forward under ``no_grad`` or ``inference_mode`` saves nothing for
        backward, so the only fact it can add to an explanation is a write to a
        watched tensor while it runs (a BatchNorm's running stats in training
        mode). Such a forward reads the versions before and after, and records
        its events only if they moved: an acting forward in a reinforcement
        learning loop then costs two version reads instead of two events. Its
        site is read after the call if needed: the caller's line is the same.
        """
        if self._synced and root in self._synced:
            if pre:
                outer = self._synced[root]
                label = self._label(outer, self._forwards[outer])
                self.ledger.record(
                    "buffer_sync", f"DDP buffer broadcast of {label}", None,
                    cause=Modification(
                        "ddp_buffer_broadcast",
                        f"DistributedDataParallel's buffer broadcast in {label} of {outer}"))
            return None
        if pre:
            # next() is atomic: threads number from one counter, with no lock.
            n = self._forwards[root] = next(self._counters[root])
            if not torch.is_grad_enabled():
                # The watched versions, read lock-free (a layout is replaced, never
                # changed): the hot path of an acting loop.
                layout = self.ledger._layout
                if layout is not None:
                    before = read_versions(layout[1])
                    if before is not None and before == layout[3]:
                        return n, before
                seq = None
            else:
                seq = _seq_clock()  # nodes it creates get larger sequence numbers
            event = self.ledger.record("forward", self._label(root, n), user_site(3), seq=seq,
                                      module=root)
            if self.strict:
                _strict._LOCAL.forward = (
                    f"{event.label} at {event.site}" if event.site else event.label)
            return n, None
        n, before = token
        if self._sharded and root in self._sharded:
            self._track_unsharded(root)
        if before is not None:
            layout = self.ledger._layout  # as at the start: did anything move?
            if layout is not None and read_versions(layout[1]) == before:
                return None  # nothing moved: as if the forward never ran, for the ledger
        label = self._label(root, n)
        if before is not None:
            # It wrote to a watched tensor: its events after all; nothing
            # moved before it began (``before`` was the last event's versions).
            self.ledger.record("forward", label, user_site(3), module=root, unchanged=True)
        elif self.strict:
            _strict._LOCAL.forward = None
        # The clock at the end too: nodes numbered between the two were made
        # by this forward, activations included (ledger.place_forward).
        seq = _seq_clock() if torch.is_grad_enabled() else None
        self.ledger.end("forward_end", label, "module_forward", f"during {label} of {root}",
                        seq=seq)
        return None

    def _on_zero_grad(self, opt: Optimizer, set_to_none: bool,
                      state: _OptimizerState | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, when the caller has it already."""
        if self.strict:
            _strict.end_step()  # past any step, even one that raised
        if state is None:
            state = self._optimizer(opt)
        if state is None:
            return
        if set_to_none:  # every .grad is None now
            # Until some zero_grad keeps grads, every mark is None or _NO_GRAD,
            # and both mean the same to _on_step_pre: nothing to update.
            for tr in self._watched(opt)[1] if self._kept_grads else ():
                if tr is not None:
                    tr.grad_mark = _NO_GRAD
        else:
            self._kept_grads = True
            params, trs = self._watched(opt)
            for p, tr in zip(params, trs):
                if tr is not None:
                    g = p.grad
                    tr.grad_mark = (set_to_none, None if g is None else id(g),
                                    0 if g is None else g._version)
        label = (state.zero_label[set_to_none] if set_to_none is True or set_to_none is False
                 else f"{state.label}.zero_grad(set_to_none={set_to_none})")
        self.ledger.record("zero_grad", label, user_site(3))

    def _on_step_pre(self, opt: Optimizer, state: _OptimizerState | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, when the caller has it already."""
        if state is None:
            state = self._optimizer(opt)
        if state is None:
            return
        if state.pending is not None:  # the last step raised: its post-hook never ran
            self.ledger.end_step(state.pending[0])
        state.steps += 1
        label = f"{state.label}.step() #{state.steps}"
        site = user_site(3)
        self.ledger.sync(label, site)
        touched, notes = [], {}
        params, trs = self._watched(opt)  # also adopts params added since
        if self._repair is not None and self._repair.roots and not self.strict:
            self._repair_step(params, label, site)
        if threading.active_count() > 1:
            # Another thread's event may scan while this step runs.
            self.ledger.begin_step(label, [id(p) for p in params],
                                   Modification("optimizer.step", label, site))
        fused = _fused(opt)
        # Only fused steps need the versions before, and only zero_grad(set_to_none=
        # False) leaves marks that make notes: otherwise skip the per-param loop.
        if not (self._kept_grads or fused):
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
        state.pending = (label, site, touched, notes)
        if self.strict:
            _strict.begin_step(label)
            if _strict.STATE.registry:
                # The step's writes, recorded (and, under stop_at_write, checked)
                # as one before it writes anything: raising halfway would leave
                # some parameters updated. Fused kernels bump no version.
                with_grad = [p for g in opt.param_groups for p in g["params"]
                             if p.grad is not None]
                _strict.on_write("step", (with_grad,), {}, silent=fused)
            _strict._LOCAL.step_checked = True

    def _repair_step(self, params: list[torch.Tensor], label: str, site: Site | None) -> None:
        """Default mode's repair: copy what retained graphs saved of ``params``."""
        repairer = self._repair
        assert repairer is not None
        names = self._names
        scope = self._scope()
        if len(scope) > 1:
            names = {}
            for w in reversed(scope):
                names.update(w._names)
        _LOCAL.busy = True  # our walk and copies are no user events
        try:
            n = repairer.before_step(params, names, label, site)
        except Exception:  # never break the user's step: unrepaired is raised as today
            logger.debug("versionwatch: repair before %s failed", label, exc_info=True)
            n = 0
        finally:
            _LOCAL.busy = False
        if n:
            self._record_repairs(n, label, site)

    def _strict_repair(self, label: str, site: Site | None,
                       hits: list[tuple[torch.Tensor, Any]]) -> list[tuple[torch.Tensor, Any]]:
        """Strict mode's repair: a seen write is about to hit memory a live graph saved."""
        repairer = self._repair
        if repairer is None or self._closed:
            return hits
        before = repairer.count
        try:
            left = _repair.strict_hits(repairer, self._names, label, site, hits)
        except Exception:  # never break the user's write: unrepaired is raised as today
            logger.debug("versionwatch: repair before %s failed", label, exc_info=True)
            return hits
        if repairer.count > before:
            self._record_repairs(repairer.count - before, label, site)
        return left

    def _record_repairs(self, n: int, label: str, site: Site | None) -> None:
        repairer = self._repair
        assert repairer is not None
        new = [repairer.repairs[-k] for k in range(min(n, len(repairer.repairs)), 0, -1)]
        nbytes = sum(r.nbytes for r in new)
        what = new[0].tensor if n == 1 else f"{n} tensors"
        self.ledger.record("repair", f"kept {what} ({size(nbytes)}) before {label}", site)
        for r in new:
            logger.debug("versionwatch: %s", r)

    @property
    def repairs(self) -> list[Repair]:
        """``on_hazard="repair"``: the copies kept so far (the latest 1000), oldest first."""
        return list(self._repair.repairs) if self._repair is not None else []

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
        if self._repair is None:
            raise RuntimeError(f"repair_summary() needs watch(..., on_hazard='repair'); this "
                               f"watcher's policy is {self.policy!r}")
        return self._repair.summary()

    def _on_step_post(self, opt: Optimizer, state: _OptimizerState | None = None) -> None:
        """``state``: ``self._optimizer(opt)``, when the caller has it already."""
        if state is None:
            state = self._optimizer(opt)
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
        if touched and _fused(opt):
            # Fused kernels update parameters in place without bumping _version.
            clock = None
            for ref, v in touched:
                p = ref()
                if p is not None and p._version == v:
                    clock = clock if clock is not None else _seq_clock()
                    self._silent[id(p)] = clock
                    self._silent_on[id(p)] = threading.get_ident()
                    self.ledger.silent(
                        p, Modification("optimizer.step", f"{label} (fused: no version bump)", site)
                    )

    # -- backward --------------------------------------------------------------------
    def _run_backward(self, api: str, outputs: Any, inputs: Any, call: Callable[[], Any],
                      arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Any:
        __tracebackhide__ = True
        if self.strict:
            _strict.end_step()  # past any step, even one that raised (or in a closure)
        site = user_site(3)
        with _LOCK:  # threads number their backwards from one counter
            self._backwards += 1
            n = self._backwards
        frees = _inflight.frees(api, arguments)
        label = f"backward #{n}"
        # A freeing backward keeps the clock at its start: a graph it may have
        # freed is older, and one built since is newer (see _explain_freed).
        self.ledger.record("backward", label, site,
                           seq=_seq_clock() if frees else None, frees=frees)
        ended = False
        scope = self._scope()
        names, silent = self._names, self._silent
        if len(scope) > 1:  # nested watchers: name what any of them watches
            names, silent = {}, {}
            for w in reversed(scope):
                names.update(w._names)
                silent.update(w._silent)
        if silent:
            silent = self._this_thread(silent, scope)
        if self._repair is not None and not frees:
            self._repair.retain(outputs, f"backward #{n}", site)
        flight = _inflight.Flight(self, label, site, frees)
        _LOCAL.busy = True  # reset in the finally below, whatever raises
        try:
            # The prediction's gate, set inline: a generator-based context
            # manager costs about as much as the rest of this preamble.
            gate = _GATE.fn
            _GATE.fn = functools.partial(_inflight.depart, flight)
            try:
                report: Report | None = predict(outputs, inputs, api,  # type: ignore[arg-type]
                                                names, silent or None)
            except (TypeError, ValueError, BadCall):
                report = None  # PyTorch will say what is wrong with the arguments
            finally:
                _GATE.fn = gate
            if report is not None and not report.ok and arguments is not None \
                    and rejected(api, *arguments):
                report = None  # PyTorch rejects the arguments before any saved tensor: its error
            if report is not None:
                report.backward_site = site
                report.backward = n
                if self.ledger.threaded:
                    report.thread = threading.current_thread().name
                if flight.freed_by:
                    _inflight.name_freer(report, flight)
                if not report.ok:
                    if any(h.kind == "freed" for h in report.hazards):
                        self._explain_freed(report, outputs, scope)
                    self._explain(report, scope)
                if n == self._replay_at:
                    raise ReplayStop(report)
                if not report.ok:
                    self._dispatch(report)
            try:
                return call()
            except RuntimeError as e:
                # Record the end first: a write during backward (a hook, a custom
                # Function) is what the ledger must see to name the tensor.
                ended = True
                self._end_backward(n)
                self._after_error(e, report, site)
                raise
        finally:
            _LOCAL.busy = False
            _inflight.land(flight)
            if not ended:
                self._end_backward(n)

    def _step_aside(self) -> None:
        """A backward inside a ``torch.func`` transform runs unpredicted: say so once."""
        if not self._stepped_aside:
            self._stepped_aside = True
            logger.debug("versionwatch: backward inside a torch.func transform (grad, vjp, "
                         "jacrev, hessian, vmap) runs unpredicted: its tensors are functorch "
                         "wrappers; backwards outside transforms are predicted as usual")

    @staticmethod
    def _this_thread(silent: dict[int, int], scope: list[Watcher]) -> dict[int, int]:
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

    def _end_backward(self, n: int) -> None:
        label = f"backward #{n}"
        self.ledger.end("backward_end", label, "backward", f"during {label}")

    def _scope(self) -> list[Watcher]:
        """This watcher, then the other open watchers of its thread, innermost first."""
        stack = self._thread_stack
        if len(stack) == 1 and stack[0] is self:  # the usual case: one watcher
            return [self]
        return [self, *(w for w in reversed(self._thread_stack) if w is not self and not w._closed)]

    def _explain(self, report: Report, scope: list[Watcher] | None = None) -> Watcher:
        """Blame each hazard in the ledger that tracks its tensor; return the owner.

        The owner, the watcher of the first hazard's tensor, keeps the report.
        """
        scope = scope or [self]

        def tracker(key: int | None) -> Watcher:
            return next((w for w in scope if key is not None and key in w.ledger.tracked), self)

        here = threading.current_thread().name
        elsewhere = next((w._strict_thread for w in scope
                          if w._strict_thread not in (None, here)), None)
        for h in report.hazards:
            if h.key is None and not SAVED_INTROSPECTION:
                _match_ledger(h, scope)
            exact = list(h.modified_by)  # strict mode's records name the writes
            if h.key is not None:
                tracker(h.key).ledger.blame(h, h.key)
                if exact:
                    h.modified_by = exact
            if elsewhere is not None and not exact and h.kind == "inplace":
                h.notes.append(
                    f"strict mode records saved tensors on thread {elsewhere} only (saved-tensor "
                    f"hooks are per thread); this backward runs on thread {here}, and a forward "
                    "there is checked as in the default mode, without write lines")
            if h.seq is not None and (h.module is None or h.saved_during is None):
                for w in scope:
                    if w.ledger.place_forward(h):
                        break
            if not self.strict and h.kind == "inplace":
                if all(m.kind == "between_events" for m in h.modified_by):
                    h.notes.append(_UNSEEN_WRITE)
                elif h.saved_at is None:
                    h.notes.append(_UNSEEN_SAVE)
            h.fix = fix_for(h)
        owner = tracker(report.hazards[0].key if report.hazards else None)
        report.timeline = owner.timeline(report=report)
        owner.reports.append(report)
        return owner

    @staticmethod
    def _explain_freed(report: Report, outputs: Any, scope: list[Watcher]) -> None:
        """Name the backward that freed each graph, and what carried it into this one.

        The freer is the first freeing backward since the node was made. When
        this backward's own graph was built after that one (its root is newer),
        it is a new graph that reaches into the freed one: a tensor from an
        earlier iteration carried it in. The user's frame usually still holds
        that tensor's variable: bound to it (its node is the freed one), or,
        for state carried across iterations (``h = rnn(x, h)``), rebound to
        this iteration's value, made by the same op.
        """
        roots = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        root_seq = max((int(fn._sequence_nr()) for t in roots if (fn := t.grad_fn) is not None),
                       default=None)
        frame, _ = user_frame(1)
        carrier: str | None = None  # found from the first freed node met: the boundary
        for h in report.hazards:
            if h.kind != "freed" or h.seq is None:
                continue
            # Sequence numbers are per thread: with one thread, this one's are the node's.
            if h.saved_at is None and any(w.strict for w in scope) \
                    and not any(w.ledger.threaded for w in scope):
                line = _strict.saved_line(h.seq)
                if line is not None:
                    h.saved_at = line[0]
                    h.saved_during = h.saved_during or line[1]
            freer = next((ev for w in scope if (ev := w.ledger.freer(h.seq)) is not None), None)
            if freer is None:
                continue
            h.freed_by = Modification(
                "backward", freer.label, freer.site)
            if root_seq is None or freer.seq is None or root_seq <= freer.seq:
                continue  # the same graph, run a second time
            if carrier is None:
                carrier = _carrier(frame, h.node, h.seq) or ""
            h.carried_by = carrier

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
        msg = str(err)
        if report is not None and not report.ok:
            # PyTorch's own error is right above the note: no need to repeat it.
            text = render_report(report, torch_message=False)
            _add_note(err, f"versionwatch predicted this before backward ran:\n{text}")
            return
        m = _VERSION_RE.search(msg)
        if m is None:
            return
        now, saved = int(m.group(1)), int(m.group(2))
        strict = getattr(err, "versionwatch_saved", None)
        if strict is not None:
            # Strict mode's unpack hook raised it: its record names the writes.
            # The error may outlive the graph: it must not keep the saved tensor.
            del err.versionwatch_saved  # type: ignore[attr-defined]
            rec, node = strict
            h = rec.hazard(node, "", detected="after_error")
            self._name_record(h, rec)
        else:
            h = Hazard(kind="inplace", node="(unknown node)", slot="?", saved_version=saved,
                       current_version=now, detected="after_error")
        if h.tensor is None:
            candidates = [
                (k, tr) for k, tr in self.ledger.tracked.items()
                if tr.last == now and any(t.old <= saved < t.new for t in tr.history)
            ]
            if len(candidates) == 1:
                key, tr = candidates[0]
                h.tensor, h.key, h.requires_grad = tr.name, key, True
                if not h.modified_by:
                    self.ledger.blame(h, key)
        h.fix = fix_for(h)
        h.torch_message = msg
        late = Report(hazards=[h], backward_site=site, rank=_distributed.rank())
        self.reports.append(late)
        text = render_report(late, torch_message=False)
        _add_note(err, f"versionwatch explains (PyTorch raised, unpredicted):\n{text}")

    # -- public ----------------------------------------------------------------------
    def timeline(self, *names: str, report: Report | None = None) -> Timeline:
        """The version history of watched tensors, as a table of events.

        Args:
            *names: tensors to show (qualified names, e.g. ``"model.w3"``). By
                default: the tensors involved in hazards, else the first eight.
            report: mark this report's saved versions (default: the latest).
        """
        report = report or (self.reports[-1] if self.reports else None)
        hazards = report.hazards if report is not None else []
        cols = list(names) or list(dict.fromkeys(
            self.ledger.tracked[h.key].name for h in hazards
            if h.key is not None and h.key in self.ledger.tracked
        ))
        if not cols:
            cols = [tr.name for tr in list(self.ledger.tracked.values())[:8]]
        unknown = [c for c in cols if c not in self.ledger.by_name]
        if unknown:
            raise KeyError(f"not watched: {', '.join(unknown)}; watched are e.g. "
                           f"{', '.join(list(self.ledger.by_name)[:5])}")
        keys = [id(self.ledger.by_name[c].ref()) for c in cols]
        saved = {
            (self.ledger.by_name[h.tensor].name, h.saved_version): h.saved_during or ""
            for h in hazards if h.tensor in self.ledger.by_name
        }
        return Timeline(cols, self.ledger.table(keys), saved)

    def close(self) -> None:
        """Remove every hook and patch. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._repair is not None:
            self._repair.roots = []
        try:
            # Each one is taken back whatever another's removal raised.
            remove_all(self._held)
        finally:
            if self in self._thread_stack:
                self._thread_stack.remove(self)

    def _on_strict_write(self, hazards: list[Hazard], records: list[Any]) -> None:
        """``stop_at_write``: a write is about to hit memory that a live graph saved."""
        __tracebackhide__ = True
        for h, rec in zip(hazards, records):
            self._name_record(h, rec)
            h.fix = fix_for(h)
            if self.policy in ("raise", "repair"):
                h.notes.append("stopped before the write: nothing was modified")
        if self.policy in ("raise", "repair"):
            # The raise unwinds the step: its post-hook will not run.
            _strict.end_step()
            for state in self._optimizers.values():
                if state.pending is not None:
                    self.ledger.end_step(state.pending[0])
                state.pending = None
        report = Report(hazards=hazards, rank=_distributed.rank())
        self.reports.append(report)
        self._dispatch(report)

    def _name_record(self, h: Hazard, rec: Any) -> None:
        """Name a strict record's tensor if it is a watched one, or a view of one."""
        names = self._names
        own, base = rec.ids
        name = names.get(own) or (names.get(base) if base is not None else None)
        if name is not None:
            h.tensor, h.key, h.requires_grad = name, own if own in names else base, True
            h.view = own not in names

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and not sys.is_finalizing():
            self.close()


def watch(
    modules: nn.Module | Mapping[str, nn.Module],
    *optimizers: Optimizer,
    on_hazard: Policy = "raise",
    strict: bool = False,
    stop_at_write: bool = False,
    repair_budget: int | None = None,
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
            a number of bytes.

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
        SGD.step() #1
    """
    if isinstance(modules, nn.Module):
        named = {_variable_name(modules, 2): modules}
    elif isinstance(modules, Mapping) and modules and all(
        isinstance(k, str) and isinstance(v, nn.Module) for k, v in modules.items()
    ):
        named = dict(modules)
    else:
        raise TypeError(
            "watch() takes an nn.Module or a non-empty dict of named modules; "
            f"got {type(modules).__name__}"
        )
    return Watcher(named, optimizers, on_hazard, strict=strict, stop_at_write=stop_at_write,
                   repair_budget=repair_budget)
