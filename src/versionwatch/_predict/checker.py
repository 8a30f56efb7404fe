"""The saved-tensor check: every tensor a backward would unpack, read as backward reads it.

The verdict for each saved tensor comes from PyTorch itself: unpacking a saved
variable runs the very version check that backward runs. A slot PyTorch skips
(behind a hook) is strict mode's record, a trusted copy of ours, or not
verifiable. Which reader runs is decided once, by the running torch:
:class:`Checker` reads raw saved tensors (their hook and data are visible);
:class:`BlindChecker` reads torch that hides them (2.4, 2.6) through
:func:`~versionwatch._compat.peek`. :data:`CHECKER` is the one for this torch.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from versionwatch._compat import (
    CHECKPOINT_SLOTS_SHOWN,
    PEEK,
    SAVED_INTROSPECTION,
    SAVED_UNPACK,
    UNREAD,
    USER_FN_ATTR,
    HookedSaved,
    InputMetadata,
    ProfiledSaved,
    SavedTensor,
    checkpoint_frame,
    clears_on_access,
    input_metadata,
    peek,
    zero_grads,
)
from versionwatch._predict.slots import (
    COPY_SLICES,
    CUSTOM,
    PLANS,
    hooked,
    is_trusted,
    plan_of,
    planned,
)
from versionwatch._report import (
    BACKWARD_SUFFIX,
    UNSURE_CHECKPOINT,
    UNSURE_CLEARS,
    UNSURE_COPY_SLICES,
    UNSURE_ERROR,
    UNSURE_NONREENTRANT,
    UNSURE_PROFILER,
    Hazard,
    fingerprint_hazard,
)
from versionwatch._runtime import Anchor, Patch
from versionwatch._strict import FINGERPRINTS as _FINGERPRINTS
from versionwatch._strict import RECORDS as _RECORDS
from versionwatch._strict import SavedRecord, output_of, strict_message
from versionwatch._strict import checkpoint_hazard as _checkpoint_hazard
from versionwatch._strict import checkpoint_record as _checkpoint_record
from versionwatch._strict import fingerprint_changed as _fingerprint_changed
from versionwatch._strict import unpack as _strict_unpack
from versionwatch._torch_messages import (
    FREED,
    PRODUCER_RE,
    SAVED_RE,
    VERSION_RE,
    VIEW_NODE_RE,
    message_shape,
    message_type,
    stale_index,
)

_SavedTensor: Any = SavedTensor


class Finding:
    """A hazard the check found, where it found it, and the saved tensor it is about."""

    __slots__ = ("hazard", "index", "nth", "saved")

    def __init__(self, index: int, nth: int, hazard: Hazard,
                 saved: torch.Tensor | SavedRecord | None) -> None:
        self.index = index  # the node's index in the walked graph
        self.nth = nth  # findings before it: the order within one node
        self.hazard = hazard
        self.saved = saved  # the tensor, strict mode's record of it, or None if unseen


# -- a custom Function's backward refuses to run inside a check ---------------------

class _UserCode(Exception):
    """Raised instead of running a custom Function's backward inside a check."""


class _Guard(threading.local):
    depth = 0


_GUARD = _Guard()
_ORIGINAL_USER_FN: Any = getattr(BackwardCFunction, USER_FN_ATTR)


def _guarded_user_fn(self: Any, *args: Any) -> Any:
    if _GUARD.depth:
        raise _UserCode
    return _ORIGINAL_USER_FN(self, *args)


_USER_BACKWARD_GUARD = Anchor(
    "custom backward guard",
    lambda: [Patch(BackwardCFunction, USER_FN_ATTR, _guarded_user_fn)])


@contextlib.contextmanager
def _no_user_backward() -> Iterator[None]:
    """While active on this thread, a custom Function's backward refuses to run.

    Other threads keep running theirs: the class attribute is swapped only while
    some thread is inside, and the wrapper checks a thread-local depth.
    """
    subscription = _USER_BACKWARD_GUARD.subscribe()
    _GUARD.depth += 1
    try:
        yield
    finally:
        _GUARD.depth -= 1
        subscription.remove()


# -- the check ------------------------------------------------------------------------

class Checker:
    """Unpacks every saved tensor of the executed nodes and collects what fails (``findings``)."""

    def __init__(self, silent: dict[int, int] | None = None) -> None:
        self.findings: list[Finding] = []
        self.unverifiable: list[tuple[str, str]] = []
        # (node, slot) -> why, for what is unverifiable but not behind hooks.
        self.why: dict[tuple[str, str], str] = {}
        self.checked = 0
        # id() of the checkpoint frames whose arguments were checked (this run only).
        self.frames: set[int] = set()
        # id(tensor) -> sequence number after its last write that bumped no version.
        self.silent = silent

    def run(self, nodes: Sequence[Node], executed: Sequence[bool] | None = None) -> None:
        """Check every node (or those marked in ``executed``): the hot path.

        One dict lookup per node that saves nothing (AccumulateGrad, TBackward0,
        ...), and three attribute reads per saved tensor: the raw saved variable,
        its unpack hook, and the checked getter, which runs PyTorch's version check.
        """
        silent = self.silent
        checked = 0
        plans = PLANS
        try:
            # planned(nodes, executed), inline: a generator's resumption per node
            # costs as much as the lookup.
            for i, fn in enumerate(nodes):
                if executed is not None and not executed[i]:
                    continue
                plan = plans.get(fn.__class__)
                if plan is None:
                    plan = plan_of(fn)
                if not plan:
                    continue
                if plan is CUSTOM:
                    self._custom(i, fn)
                    continue
                if plan is COPY_SLICES:
                    self._copy_slices(i, fn)
                    continue
                for slot, raw_attr, saved_attr in plan:
                    try:
                        raw = getattr(fn, raw_attr)
                    except RuntimeError as e:
                        self._error(i, fn, slot, None, e)
                        continue
                    if raw.__class__ is not _SavedTensor or raw.unpack_hook is not None:
                        if raw.__class__ is _SavedTensor and raw.unpack_hook is _strict_unpack:
                            self._strict(i, fn, slot, raw.data)
                        else:
                            self._other(i, fn, slot, raw, saved_attr)
                        continue
                    try:
                        # The generated getter passes the node, which a saved
                        # *output* needs to unpack; raw.unpack() cannot.
                        getattr(fn, saved_attr)
                        checked += 1
                    except RuntimeError as e:
                        self._error(i, fn, slot, raw, e)
                        continue
                    if silent:
                        self._silent(i, fn, slot, raw.data)
        finally:
            self.checked += checked

    def _copy_slices(self, i: int, fn: Node) -> None:
        """Run CopySlices once on zero gradients, as backward would run it.

        The wrapped node's saved tensors (``relu_`` saves its result) are
        unpacked by its apply() with the engine's own version check, and a
        CopySlices that an earlier backward released raises "backward through
        the graph a second time" even when nothing was saved. Calling a node
        returns gradients and changes nothing: no tensor, no ``.grad``, no hook.
        If the wrapped op is a custom ``autograd.Function``, its backward (user
        code) is refused before it starts, and the node counts as not verifiable.
        """
        try:
            grads = zero_grads(fn)
            with torch.no_grad(), _no_user_backward():
                fn(*grads)  # type: ignore[operator]
            self.checked += 1
        except RuntimeError as e:
            before = len(self.findings)
            self._error(i, fn, "fn", None, e)
            if len(self.findings) > before and _RECORDS:
                _strict_writes(self.findings[-1].hazard, input_metadata(fn))
        except Exception:
            self._unsure(fn.name(), "fn", UNSURE_COPY_SLICES)

    def _unsure(self, node: str, slot: str, why: str) -> None:
        """Count ``(node, slot)`` as not verifiable for a reason other than hooks."""
        self.unverifiable.append((node, slot))
        self.why[(node, slot)] = why

    def _other(self, i: int, fn: Node, slot: str, raw: Any, saved_attr: str) -> None:
        """A slot that is not one plain saved tensor: empty, a list, or hooked."""
        if raw is None:
            return
        if isinstance(raw, (tuple, list)):
            self._sequence(i, fn, slot, raw, saved_attr)
        elif hooked(raw):
            if is_trusted(raw.unpack_hook):
                self.checked += 1
            elif not self._checkpointed(i, fn, slot, raw):
                self.unverifiable.append((fn.name(), slot))
        else:
            try:
                getattr(fn, saved_attr)
                self.checked += 1
            except RuntimeError as e:
                self._error(i, fn, slot, raw, e)
                return
            if self.silent:
                self._silent(i, fn, slot, raw.data)

    def _checkpointed(self, i: int, fn: Node, slot: str, raw: Any) -> bool:
        """A slot inside non-reentrant checkpointing: strict mode's record of it decides.

        False if ``raw`` is no checkpoint's. Without a record (the default mode,
        or a save strict mode did not see) it is not verified, and says why.
        """
        if not CHECKPOINT_SLOTS_SHOWN:
            return False
        frame = checkpoint_frame(raw.unpack_hook)
        if frame is None:
            return False
        self._checkpoint_inputs(i, fn, frame)
        return self._checkpoint_holder(i, fn, slot, raw.data)

    def _checkpoint_inputs(self, i: int, fn: Node, frame: object) -> None:
        """The recomputation's first step: PyTorch's version check of ``fn``'s arguments.

        Newer torch keeps checkpoint's explicit tensor arguments as saved tensors
        (``frame.saved_args``) and unpacks them, with its version check, before it
        reruns ``fn``: a write to one since the forward fails there, at whichever
        of the frame's slots the backward reads first. Checked once a frame.
        """
        if id(frame) in self.frames:
            return
        self.frames.add(id(frame))
        saved_type = getattr(torch._C._autograd, "SavedTensor", None)
        for k, arg in enumerate(getattr(frame, "saved_args", None) or ()):
            if saved_type is None or not isinstance(arg, saved_type):
                continue  # a plain value
            if hooked(arg):
                if arg.unpack_hook is _strict_unpack and isinstance(arg.data, SavedRecord):
                    before = len(self.findings)
                    self._strict(i, fn, f"checkpoint input {k}", arg.data)
                    # Not counted among the saved tensors checked: older torch keeps no
                    # such argument, and the counts stay the same on every torch.
                    self.checked -= 1
                    if len(self.findings) > before:
                        self.findings[-1].hazard.notes.append(_CHECKPOINT_INPUT)
                        return
                continue  # behind a hook of the user's: not unpacked here
            try:
                arg.unpack()
            except RuntimeError as e:
                before = len(self.findings)
                self._error(i, fn, f"checkpoint input {k}", None, e)
                if len(self.findings) > before:
                    self.findings[-1].hazard.notes.append(_CHECKPOINT_INPUT)
                return

    def _checkpoint_holder(self, i: int, fn: Node, slot: str, holder: object) -> bool:
        """:meth:`_checkpointed` for the slot whose checkpoint holder is ``holder``."""
        rec = _checkpoint_record(holder)
        if rec is None:
            self._unsure(fn.name(), slot, UNSURE_NONREENTRANT)
            return True
        self.checked += 1
        h, data = _checkpoint_hazard(rec, fn.name(), slot)
        if h is not None and not (h.kind == "silent" and _unread(fn, slot)):
            self.findings.append(Finding(i, len(self.findings), h, data))
        return True

    def _strict(self, i: int, fn: Node, slot: str, rec: SavedRecord) -> None:
        """A tensor strict mode packed: its record knows the versions and the writes."""
        self.checked += 1
        t = rec.tensor
        if t._version != rec.version:
            kind: Literal["inplace", "silent"] = "inplace"
        elif _unread(fn, slot):
            return  # changed bytes that this backward never reads: no wrong gradient
        elif rec.silent:
            kind = "silent"
        elif _FINGERPRINTS.on:  # opt-in: plain strict mode pays this one check
            self._fingerprint(i, fn, slot, rec)
            return
        else:
            return
        h = rec.hazard(fn.name(), slot, kind)
        if kind == "inplace":
            # PyTorch skips its check behind hooks: its words, as it would say them.
            h.torch_message = strict_message(rec, fn, slot, output_of(rec))
        self.findings.append(Finding(i, len(self.findings), h, rec))

    def _fingerprint(self, i: int, fn: Node, slot: str, rec: SavedRecord) -> None:
        """A record at its version with no silent write seen: did its sampled bytes change?

        A record that any write hit keeps that write's report (a version bump,
        or a silent write and its line); this is only for the writes no one saw.
        """
        fp = getattr(rec, "fingerprint", None)
        if fp is None or rec.writes or rec._silent or not _fingerprint_changed(rec.tensor, fp):
            return
        h = rec.hazard(fn.name(), slot, "silent")
        fingerprint_hazard(h)
        self.findings.append(Finding(i, len(self.findings), h, rec))

    def _silent(self, i: int, fn: Node, slot: str, data: Any) -> None:
        if not isinstance(data, torch.Tensor):
            return
        written = self.silent.get(id(data)) if self.silent else None
        if written is None and data._base is not None and self.silent:
            written = self.silent.get(id(data._base))
        if written is None or fn._sequence_nr() > written:
            return
        h = Hazard(kind="silent", node=fn.name(), slot=slot, saved_version=data._version,
                   current_version=data._version, requires_grad=True)
        h.shape, h.dtype, h.device = _shape(data), _dtype(data), str(data.device)
        self.findings.append(Finding(i, len(self.findings), h, data))

    def _sequence_each(self, i: int, fn: Node, slot: str, raws: Sequence[Any],
                       saved_attr: str) -> None:
        """A saved list, each element checked alone (``raw.unpack()``)."""
        for k, raw in enumerate(raws):
            if raw is None:
                continue
            if hooked(raw):
                if raw.unpack_hook is _strict_unpack:
                    self._strict(i, fn, f"{slot}[{k}]", raw.data)
                elif is_trusted(raw.unpack_hook):
                    self.checked += 1
                elif not self._checkpointed(i, fn, f"{slot}[{k}]", raw):
                    self.unverifiable.append((fn.name(), f"{slot}[{k}]"))
                continue
            try:
                raw.unpack()
                self.checked += 1
            except RuntimeError as e:
                self._error(i, fn, f"{slot}[{k}]", raw, e)

    def _sequence_whole(self, i: int, fn: Node, slot: str, raws: Sequence[Any],
                        saved_attr: str) -> None:
        """:meth:`_sequence_each` where a raw saved tensor cannot be unpacked alone.

        Hooked elements are handled one by one; the others are checked by the
        slot's getter, which runs PyTorch's check on each in order, and a
        failure is placed by the data that matches PyTorch's message.
        """
        plain = [k for k, raw in enumerate(raws) if raw is not None and not hooked(raw)]
        behind_hooks = [k for k, raw in enumerate(raws) if raw is not None and hooked(raw)]
        for k in behind_hooks:
            if raws[k].unpack_hook is _strict_unpack:
                self._strict(i, fn, f"{slot}[{k}]", raws[k].data)
            else:
                self.unverifiable.append((fn.name(), f"{slot}[{k}]"))
        if not plain:
            return
        if behind_hooks:
            # The getter would run the others' hooks: the plain ones stay unread.
            self.unverifiable += [(fn.name(), f"{slot}[{k}]") for k in plain]
            return
        try:
            getattr(fn, saved_attr)
            self.checked += len(plain)
        except RuntimeError as e:
            at = stale_index(raws, str(e))
            where = f"{slot}[{at}]" if at is not None else slot
            self._error(i, fn, where, raws[at] if at is not None else None, e)

    # Chosen once: whether this torch unpacks a raw saved tensor alone (not 2.10).
    _sequence = _sequence_each if SAVED_UNPACK else _sequence_whole

    def _custom(self, i: int, fn: Any) -> None:
        if fn.name() == "CheckpointFunctionBackward":
            # A reentrant checkpoint's backward reruns its forward and a backward
            # of its own, which no walk of this graph can see: count it.
            self._unsure(fn.name(), "recomputed forward", UNSURE_CHECKPOINT)
        try:
            raws = fn._raw_saved_tensors
        except RuntimeError as e:
            self._error(i, fn, "saved_tensors", None, e)
            return
        if not raws:
            return
        if any(hooked(r) for r in raws):
            if all(getattr(r, "unpack_hook", None) is _strict_unpack for r in raws):
                for k, r in enumerate(raws):
                    self._strict(i, fn, f"saved_tensors[{k}]", r.data)
                return
            name = fn.name()
            for k, r in enumerate(raws):
                if getattr(r, "unpack_hook", None) is _strict_unpack:
                    self._strict(i, fn, f"saved_tensors[{k}]", r.data)
                elif not (hooked(r) and self._checkpointed(i, fn, f"saved_tensors[{k}]", r)):
                    self.unverifiable.append((name, f"saved_tensors[{k}]"))
            return
        if clears_on_access(fn):
            # Reading ctx.saved_tensors would clear them: the backward would then
            # fail. Left unread, as the native helper leaves it.
            self._unsure(fn.name(), "saved_tensors", UNSURE_CLEARS)
            return
        try:
            # Unpacks in order with the node, as ctx.saved_tensors does in backward.
            _ = fn.saved_tensors
            self.checked += len(raws)
            return
        except RuntimeError as e:
            whole = e
        if not SAVED_UNPACK:
            at = stale_index(raws, str(whole))
            where = f"saved_tensors[{at}]" if at is not None else "saved_tensors"
            self._error(i, fn, where, raws[at] if at is not None else None, whole)
            return
        found = False
        outputs: list[int] = []
        for k, raw in enumerate(raws):
            try:
                raw.unpack()
            except RuntimeError as e:
                if VERSION_RE.search(str(e)):
                    self._error(i, fn, f"saved_tensors[{k}]", raw, e)
                    found = True
                else:
                    outputs.append(k)  # a saved output: only unpackable with the node
        if not found:
            k = outputs[0] if outputs else 0
            self._error(i, fn, f"saved_tensors[{k}]", raws[k] if raws else None, whole)

    def _error(self, i: int, fn: Node, slot: str, raw: Any, err: RuntimeError) -> None:
        """PyTorch's check failed on a slot: the hazard its message describes."""
        msg = str(err)
        nth = len(self.findings)
        if FREED in msg:
            h = Hazard(kind="freed", node=fn.name(), slot=slot, torch_message=msg)
            self.findings.append(Finding(i, nth, h, None))
            return
        m = VERSION_RE.search(msg)
        if m is None:
            self._unsure(fn.name(), slot, UNSURE_ERROR)
            return
        producer_m = PRODUCER_RE.search(msg)
        h = Hazard(
            kind="inplace",
            node=fn.name(),
            slot=slot,
            current_version=int(m.group(1)),
            saved_version=int(m.group(2)),
            # Older torch names the node ("SigmoidBackward0"), newer the op ("Sigmoid").
            producer=BACKWARD_SUFFIX.sub("", producer_m.group(1)) if producer_m else None,
            saved_output=slot.startswith("result")
            or (isinstance(fn, BackwardCFunction) and producer_m is not None
                and fn.name().startswith(producer_m.group(1))),
            torch_message=msg,
        )
        data = raw.data if raw is not None else None
        if isinstance(data, torch.Tensor):
            _describe(h, data)
        else:
            data = self._unseen(h, fn, msg, int(m.group(1)))
        self.findings.append(Finding(i, nth, h, data))

    def _unseen(self, h: Hazard, fn: Node, msg: str, now: int) -> torch.Tensor | None:
        """The stale tensor of a slot whose data the check did not see (None: unknown).

        This torch shows a slot's data wherever there is one to show (not for
        CopySlices, nor for a saved list that failed as a whole): nothing more
        to learn.
        """
        return None


class BlindChecker(Checker):
    """:class:`Checker` on a torch whose raw saved tensors hide their hooks and data.

    Each slot is read through its checked getter inside :func:`peek`, which
    refuses to run any hook: a slot that has one (a user's, checkpoint's,
    ``save_on_cpu``'s) is not verifiable, as on new torch. Strict mode's own
    hook hands its records over instead. A stale slot's tensor cannot be read
    at all: it is found among the node's leaves, or described from PyTorch's
    message.
    """

    def run(self, nodes: Sequence[Node], executed: Sequence[bool] | None = None) -> None:
        """:meth:`Checker.run`, each slot read through its checked getter."""
        for i, fn, plan in planned(nodes, executed):
            if plan is COPY_SLICES:
                self._copy_slices(i, fn)
                continue
            if type(fn).__name__ == "CheckpointFunctionBackward":
                self._unsure(fn.name(), "recomputed forward", UNSURE_CHECKPOINT)
            if plan is CUSTOM and clears_on_access(fn):
                self._unsure(fn.name(), "saved_tensors", UNSURE_CLEARS)
                continue
            for slot, raw_attr, saved_attr in plan:
                self._peek_slot(i, fn, slot, raw_attr, saved_attr)

    def _peek_slot(self, i: int, fn: Node, slot: str, raw_attr: str, saved_attr: str) -> None:
        PEEK.holder = None
        try:
            value, found = peek(fn, saved_attr)
            # what strict mode's unpack hook handed peek: its own records
            records = cast("list[SavedRecord]", found)
        except ProfiledSaved:
            self._unsure(fn.name(), slot, UNSURE_PROFILER)
            return
        except HookedSaved:
            holder, PEEK.holder = PEEK.holder, None
            # A list's read stops at its first hooked element: only one tensor is exact.
            if holder is not None and isinstance(getattr(fn, raw_attr, None), (tuple, list)):
                holder = None
            if holder is None or not self._checkpoint_holder(i, fn, slot, holder):
                self.unverifiable.append((fn.name(), slot))
            return
        except RuntimeError as e:
            # A list slot fails as a whole here: its one element, else no index.
            try:
                raws = getattr(fn, raw_attr)
            except RuntimeError:
                raws = None
            if isinstance(raws, (tuple, list)) and len(raws) == 1:
                slot += "[0]"
            self._error(i, fn, slot, None, e)
            return
        if value is UNREAD:
            raws = getattr(fn, raw_attr)
            many = isinstance(raws, (tuple, list))
            for k, rec in enumerate(records):
                self._strict(i, fn, f"{slot}[{k}]" if many else slot, rec)
            if many:  # the read stopped part way: the rest stay unread
                self.unverifiable += [(fn.name(), f"{slot}[{k}]")
                                      for k in range(len(records), len(raws))]
            return
        if value is None:
            # An undefined saved variable counts as checked, as on torch that shows it.
            if getattr(fn, raw_attr) is not None:
                self.checked += 1
            return
        many = isinstance(value, (tuple, list))
        values = list(cast("Sequence[object]", value)) if many else [value]
        for k, t in enumerate(values):
            if not isinstance(t, torch.Tensor):
                continue
            where = f"{slot}[{k}]" if many else slot
            if records:
                # Strict packed them all (one record per tensor, in order).
                self._strict(i, fn, where, records.pop(0))
                continue
            self.checked += 1
            if self.silent:
                self._silent(i, fn, where, t)

    def _unseen(self, h: Hazard, fn: Node, msg: str, now: int) -> torch.Tensor | None:
        """The leaf the stale slot held, else what PyTorch's message says of the tensor."""
        data, view, requires_grad = _stale_leaf(fn, msg, now)
        if data is None:
            # "[torch.FloatTensor [4, 3]]": the type and the shape.
            h.requires_grad = requires_grad
            h.shape = message_shape(msg)
            h.dtype, h.device = message_type(msg)
            return None
        _describe(h, data)
        if view:  # the leaf found for a view it saved
            h.shape = message_shape(msg) or h.shape
            h.producer, h.requires_grad, h.view = None, True, True
        return data


CHECKER: type[Checker] = Checker if SAVED_INTROSPECTION else BlindChecker
"""The checker for the running torch, chosen once (benchmarks patch its ``run``)."""


def _describe(h: Hazard, data: torch.Tensor) -> None:
    """Fill ``h`` in from the stale tensor itself."""
    h.shape = _shape(data)
    h.dtype = _dtype(data)
    h.device = str(data.device)
    h.requires_grad = data.requires_grad
    base = data._base
    if h.producer is not None and base is not None and base.is_leaf and base.requires_grad:
        # A view of a parameter (``weight.t()`` inside F.linear): for the
        # user it is the parameter that was modified.
        h.producer = None
        h.requires_grad = True


def _shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape, or ``None`` for a nested tensor, whose parts have shapes of their own."""
    return None if t.is_nested else tuple(t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


_CHECKPOINT_INPUT = ("checkpoint(use_reentrant=False) keeps its tensor arguments with "
                     "PyTorch's version check, and unpacks them to recompute the function "
                     "when the backward first reads one of its saved tensors (here "
                     "the node above)")
_RUNNING_STATS = frozenset({"running_mean", "running_var"})


def _unread(fn: Node, slot: str) -> bool:
    """A slot the node saved but whose values its backward does not read.

    Batch norm saves its running statistics in training mode too, and its
    backward then uses the batch's own (``result1``, ``result2``): PyTorch's
    version check still fails on a write to them, but a write with no version
    bump (DistributedDataParallel's buffer broadcast, the kernel's own update)
    changes no gradient, so it is no ``silent`` hazard.
    """
    return slot in _RUNNING_STATS and getattr(fn, "_saved_training", None) is True


def _strict_writes(h: Hazard, base: InputMetadata | None) -> None:
    """Strict mode: find the writes of a tensor saved out of reach (in CopySlices).

    The wrapped node's saved tensors were packed by strict mode too, but
    Python cannot reach them. The one that failed is a live record whose
    versions are the two in PyTorch's message, that saw writes, and whose
    memory can hold CopySlices' base (``base``, its input's metadata).
    Several such records (views of one base) that saw the same writes tell
    the same story; records that tell different ones name nothing.
    """
    # Graphs that are garbage but not yet collected still hold records, at
    # versions that may look the same: collect them first (this is the rare
    # path of a backward that will fail anyway).
    gc.collect()
    # Where torch hides the base's metadata, versions and writes decide alone.
    need = math.prod(base.shape) * base.dtype.itemsize if base is not None else 0
    found = [
        rec for refs in list(_RECORDS.values()) for r in refs
        if (rec := r()) is not None and rec.writes and rec.version == h.saved_version
        and rec.tensor._version == h.current_version
        and (base is None or rec.tensor.dtype == base.dtype)
        and rec.tensor.untyped_storage().nbytes() >= need
    ]
    if found and len({tuple(rec.writes) for rec in found}) == 1:
        h.modified_by = list(found[0].writes)
        h.module = h.module or found[0].module


def _stale_leaf(fn: Node, msg: str, now: int) -> tuple[torch.Tensor | None, bool, bool | None]:
    """The leaf a stale saved tensor belongs to, found without reading the slot.

    Where a raw saved tensor hides its data (old torch), the slot cannot be read
    once it is stale. The tensor a node saves for a leaf is that leaf or a view
    of it (``weight.t()``), and the leaf is one of the node's inputs: an
    ``AccumulateGrad`` edge, directly or behind one view node. The one such
    leaf at the message's version, type and size is it; none or several name
    nothing. Without a producer and without such a leaf, the tensor is a leaf
    that does not require grad (the third value says so).
    """
    m = SAVED_RE.search(msg)
    if m is None:
        return None, False, None
    type_name = m.group(1)
    shape = message_shape(msg) or ()
    numel = math.prod(shape)
    # PyTorch names the node that produced a saved non-leaf: none for a leaf,
    # the view's node for a view of one; anything else is no leaf of ours.
    producer_m = PRODUCER_RE.search(msg)
    producer = producer_m.group(1) if producer_m else None
    if producer is not None and VIEW_NODE_RE.fullmatch(producer) is None:
        return None, False, None
    found: dict[int, torch.Tensor] = {}
    for e in fn.next_functions:
        node = e[0]
        if node is None:
            continue
        if producer is not None:
            # The view's own node is rebuilt on access (AsStrided for a T), so
            # any single-input view node in front of a leaf qualifies.
            if VIEW_NODE_RE.fullmatch(node.name()) is None or len(node.next_functions) != 1:
                continue
            node = node.next_functions[0][0]
        var = getattr(node, "variable", None)
        if (isinstance(var, torch.Tensor) and var._version == now and var.numel() == numel
                and var.type() == type_name):
            found[id(var)] = var
    if len(found) != 1:
        return None, False, False if not found and producer is None else None
    (leaf,) = found.values()
    return leaf, producer is not None, None  # through a view node: saved a view of it
