"""The predictor: what a backward would do, decided from the graph before it runs.

The verdict for each saved tensor comes from PyTorch itself: unpacking a saved
variable runs the very version check that backward runs, so a prediction can
only disagree with backward about *which* nodes run, never about a tensor.
Which nodes run, and in what order, follows ``torch/csrc/autograd/engine.cpp``:
with ``inputs=`` only nodes on a path to an input execute, and the ready queue
pops the highest sequence number first.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Union

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from versionwatch import _strict
from versionwatch._call import Api, BadCall, Call, Edge, after_run, bind, parse
from versionwatch._compat import (
    SAVED_INTROSPECTION,
    SAVED_UNPACK,
    UNREAD,
    USER_FN_ATTR,
    HookedSaved,
    SavedTensor,
    input_metadata,
    peek,
    zero_grads,
)
from versionwatch._distributed import rank
from versionwatch._errors import FreedGraphError, InplaceModificationError
from versionwatch._explain import _BACKWARD_SUFFIX, fix_for
from versionwatch._graph import Graph, lease
from versionwatch._naming import Names, name_of, resolve_names
from versionwatch._report import Hazard, Report
from versionwatch._strict import SavedRecord
from versionwatch._strict import unpack as _strict_unpack
from versionwatch._torchtext import strict_message

TensorOrTensors = Union[Edge, Sequence[Edge]]

_VERSION_RE = re.compile(r"is at version (\d+); expected version (\d+) instead")
_PRODUCER_RE = re.compile(r"which is output \d+ of ([\w:]+)")
_VIEW_NODE_RE = re.compile(
    r"(T|Transpose|Permute|View|Reshape|UnsafeView|Expand|AsStrided|Slice|Select|Squeeze|"
    r"Unsqueeze|Alias|Diagonal|Narrow)(Backward\d*)?")
_SAVED_RE = re.compile(r"\[(\S+) \[([\d, ]*)\]\]")  # "[torch.FloatTensor [8, 1]]"
_FREED = "backward through the graph a second time"
_RAW_PREFIX = "_raw_saved_"


# Per node type: (slot, raw getter, checked getter) for each saved-variable slot;
# empty for nodes that save nothing (AccumulateGrad, TBackward0, ...), and
# _CUSTOM for custom autograd.Function nodes, which keep theirs in saved_tensors.
_Plan = tuple[tuple[str, str, str], ...]
_PLANS: dict[type, _Plan] = {}
_CUSTOM: _Plan = (("saved_tensors", "_raw_saved_tensors", "saved_tensors"),)
# An in-place op on a view: CopySlices wraps the op's own node, which Python
# cannot reach (its saved tensors included); see _Checker._copy_slices.
_COPY_SLICES: _Plan = (("fn", "", ""),)
_SavedTensor: Any = SavedTensor


def _plan(fn: Node) -> _Plan:
    cls = type(fn)
    plan = _PLANS.get(cls)
    if plan is None:
        if isinstance(fn, BackwardCFunction):
            plan = _CUSTOM
        elif fn.name() == "torch::autograd::CopySlices":
            plan = _COPY_SLICES
        else:
            plan = tuple(
                (a[len(_RAW_PREFIX):], a, "_saved_" + a[len(_RAW_PREFIX):])
                for a in dir(fn) if a.startswith(_RAW_PREFIX)
            )
        _PLANS[cls] = plan
    return plan


def _planned(nodes: Sequence[Node], executed: Sequence[bool] | None) -> Iterator[
        tuple[int, Node, _Plan]]:
    """The nodes that run (all, or those marked in ``executed``) and save something.

    One dict lookup per node that saves nothing (AccumulateGrad, TBackward0, ...).
    """
    plans = _PLANS
    for i, fn in enumerate(nodes):
        if executed is not None and not executed[i]:
            continue
        plan = plans.get(type(fn))
        if plan is None:
            plan = _plan(fn)
        if plan:
            yield i, fn, plan


# Unpack hooks of ours that return a copy taken before any write: such a slot
# is checked, never stale (``_repair`` adds its own; no import cycle).
TRUSTED_UNPACK: set[Any] = set()


def _hooked(raw: Any) -> bool:
    return getattr(raw, "unpack_hook", None) is not None


class _UserCode(Exception):
    """Raised instead of running a custom Function's backward inside a check."""


class _Guard(threading.local):
    depth = 0


_GUARD = _Guard()
_GUARD_LOCK = threading.Lock()
_GUARD_USERS = 0
_ORIGINAL_USER_FN: Any = getattr(BackwardCFunction, USER_FN_ATTR)


def _guarded_user_fn(self: Any, *args: Any) -> Any:
    if _GUARD.depth:
        raise _UserCode
    return _ORIGINAL_USER_FN(self, *args)


@contextlib.contextmanager
def _no_user_backward() -> Iterator[None]:
    """While active on this thread, a custom Function's backward refuses to run.

    Other threads keep running theirs: the class attribute is swapped only for
    the duration, and the wrapper checks a thread-local flag.
    """
    global _GUARD_USERS
    with _GUARD_LOCK:
        if _GUARD_USERS == 0:
            setattr(BackwardCFunction, USER_FN_ATTR, _guarded_user_fn)
        _GUARD_USERS += 1
    _GUARD.depth += 1
    try:
        yield
    finally:
        _GUARD.depth -= 1
        with _GUARD_LOCK:
            _GUARD_USERS -= 1
            if _GUARD_USERS == 0:
                setattr(BackwardCFunction, USER_FN_ATTR, _ORIGINAL_USER_FN)


class _Checker:
    """Unpacks every saved tensor of the executed nodes and collects hazards."""

    def __init__(self, silent: dict[int, int] | None = None) -> None:
        self.hazards: list[tuple[int, int, Hazard, torch.Tensor | SavedRecord | None]] = []
        self.unverifiable: list[tuple[str, str]] = []
        self.checked = 0
        # id(tensor) -> sequence number after its last write that bumped no version.
        self.silent = silent

    def run(self, nodes: Sequence[Node], executed: Sequence[bool] | None = None) -> None:
        """Check every node (or those marked in ``executed``): the hot path.

        One dict lookup per node that saves nothing (AccumulateGrad, TBackward0,
        ...), and three attribute reads per saved tensor: the raw saved variable,
        its unpack hook, and the checked getter, which runs PyTorch's version check.
        """
        if not SAVED_INTROSPECTION:
            self._run_blind(nodes, executed)
            return
        silent = self.silent
        checked = 0
        plans = _PLANS
        try:
            # _planned(nodes, executed), inline: a generator's resumption per node
            # costs as much as the lookup.
            for i, fn in enumerate(nodes):
                if executed is not None and not executed[i]:
                    continue
                plan = plans.get(fn.__class__)
                if plan is None:
                    plan = _plan(fn)
                if not plan:
                    continue
                if plan is _CUSTOM:
                    self._custom(i, fn)
                    continue
                if plan is _COPY_SLICES:
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

    def _run_blind(self, nodes: Sequence[Node], executed: Sequence[bool] | None) -> None:
        """:meth:`run` on a torch whose raw saved tensors hide their hooks and data.

        Each slot is read through its checked getter inside :func:`peek`, which
        refuses to run any hook: a slot that has one (a user's, checkpoint's,
        ``save_on_cpu``'s) is not verifiable, as on new torch. Strict mode's
        own hook hands its records over instead.
        """
        for i, fn, plan in _planned(nodes, executed):
            if plan is _COPY_SLICES:
                self._copy_slices(i, fn)
                continue
            if type(fn).__name__ == "CheckpointFunctionBackward":
                self.unverifiable.append((fn.name(), "recomputed forward"))
            for slot, raw_attr, saved_attr in plan:
                self._peek_slot(i, fn, slot, raw_attr, saved_attr)

    def _peek_slot(self, i: int, fn: Node, slot: str, raw_attr: str, saved_attr: str) -> None:
        try:
            value, records = peek(fn, saved_attr)
        except HookedSaved:
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
        values = list(value) if many else [value]
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
            before = len(self.hazards)
            self._error(i, fn, "fn", None, e)
            if len(self.hazards) > before and _strict.RECORDS:
                self._strict_writes(self.hazards[-1][2], input_metadata(fn))
        except Exception:
            self.unverifiable.append((fn.name(), "fn"))

    @staticmethod
    def _strict_writes(h: Hazard, base: Any) -> None:
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
            rec for refs in list(_strict.RECORDS.values()) for r in refs
            if (rec := r()) is not None and rec.writes and rec.version == h.saved_version
            and rec.tensor._version == h.current_version
            and (base is None or rec.tensor.dtype == base.dtype)
            and rec.tensor.untyped_storage().nbytes() >= need
        ]
        if found and len({tuple(rec.writes) for rec in found}) == 1:
            h.modified_by = list(found[0].writes)
            h.module = h.module or found[0].module

    def _other(self, i: int, fn: Node, slot: str, raw: Any, saved_attr: str) -> None:
        """A slot that is not one plain saved tensor: empty, a list, or hooked."""
        if raw is None:
            return
        if isinstance(raw, (tuple, list)):
            self._sequence(i, fn, slot, raw, saved_attr)
        elif _hooked(raw):
            if raw.unpack_hook in TRUSTED_UNPACK:
                self.checked += 1
            else:
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

    def _strict(self, i: int, fn: Node, slot: str, rec: SavedRecord) -> None:
        """A tensor strict mode packed: its record knows the versions and the writes."""
        self.checked += 1
        t = rec.tensor
        if t._version != rec.version:
            kind: Literal["inplace", "silent"] = "inplace"
        elif rec.silent:
            kind = "silent"
        else:
            return
        h = rec.hazard(fn.name(), slot, kind)
        if kind == "inplace":
            # PyTorch skips its check behind hooks: its words, as it would say them.
            h.torch_message = strict_message(rec, fn, slot)
        self.hazards.append((i, len(self.hazards), h, rec))

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
        self.hazards.append((i, len(self.hazards), h, data))

    def _sequence(self, i: int, fn: Node, slot: str, raws: Sequence[Any], saved_attr: str) -> None:
        if not SAVED_UNPACK:
            self._sequence_whole(i, fn, slot, raws, saved_attr)
            return
        for k, raw in enumerate(raws):
            if raw is None:
                continue
            if _hooked(raw):
                if raw.unpack_hook is _strict_unpack:
                    self._strict(i, fn, f"{slot}[{k}]", raw.data)
                elif raw.unpack_hook in TRUSTED_UNPACK:
                    self.checked += 1
                else:
                    self.unverifiable.append((fn.name(), f"{slot}[{k}]"))
                continue
            try:
                raw.unpack()
                self.checked += 1
            except RuntimeError as e:
                self._error(i, fn, f"{slot}[{k}]", raw, e)

    def _sequence_whole(self, i: int, fn: Node, slot: str, raws: Sequence[Any],
                        saved_attr: str) -> None:
        """:meth:`_sequence` where a raw saved tensor cannot be unpacked alone.

        Hooked elements are handled one by one; the others are checked by the
        slot's getter, which runs PyTorch's check on each in order, and a
        failure is placed by the data that matches PyTorch's message.
        """
        plain = [k for k, raw in enumerate(raws) if raw is not None and not _hooked(raw)]
        hooked = [k for k, raw in enumerate(raws) if raw is not None and _hooked(raw)]
        for k in hooked:
            if raws[k].unpack_hook is _strict_unpack:
                self._strict(i, fn, f"{slot}[{k}]", raws[k].data)
            else:
                self.unverifiable.append((fn.name(), f"{slot}[{k}]"))
        if not plain:
            return
        if hooked:
            # The getter would run the others' hooks: the plain ones stay unread.
            self.unverifiable += [(fn.name(), f"{slot}[{k}]") for k in plain]
            return
        try:
            getattr(fn, saved_attr)
            self.checked += len(plain)
        except RuntimeError as e:
            at = _stale_index(raws, str(e))
            where = f"{slot}[{at}]" if at is not None else slot
            self._error(i, fn, where, raws[at] if at is not None else None, e)

    def _custom(self, i: int, fn: Any) -> None:
        if fn.name() == "CheckpointFunctionBackward":
            # A reentrant checkpoint's backward reruns its forward and a backward
            # of its own, which no walk of this graph can see: count it.
            self.unverifiable.append((fn.name(), "recomputed forward"))
        try:
            raws = fn._raw_saved_tensors
        except RuntimeError as e:
            self._error(i, fn, "saved_tensors", None, e)
            return
        if not raws:
            return
        if any(_hooked(r) for r in raws):
            if all(getattr(r, "unpack_hook", None) is _strict_unpack for r in raws):
                for k, r in enumerate(raws):
                    self._strict(i, fn, f"saved_tensors[{k}]", r.data)
                return
            name = fn.name()
            self.unverifiable += [(name, f"saved_tensors[{k}]") for k in range(len(raws))]
            return
        try:
            # Unpacks in order with the node, as ctx.saved_tensors does in backward.
            _ = fn.saved_tensors
            self.checked += len(raws)
            return
        except RuntimeError as e:
            whole = e
        if not SAVED_UNPACK:
            at = _stale_index(raws, str(whole))
            where = f"saved_tensors[{at}]" if at is not None else "saved_tensors"
            self._error(i, fn, where, raws[at] if at is not None else None, whole)
            return
        found = False
        outputs: list[int] = []
        for k, raw in enumerate(raws):
            try:
                raw.unpack()
            except RuntimeError as e:
                if _VERSION_RE.search(str(e)):
                    self._error(i, fn, f"saved_tensors[{k}]", raw, e)
                    found = True
                else:
                    outputs.append(k)  # a saved output: only unpackable with the node
        if not found:
            k = outputs[0] if outputs else 0
            self._error(i, fn, f"saved_tensors[{k}]", raws[k] if raws else None, whole)

    def _error(self, i: int, fn: Node, slot: str, raw: Any, err: RuntimeError) -> None:
        msg = str(err)
        seq = len(self.hazards)
        if _FREED in msg:
            h = Hazard(kind="freed", node=fn.name(), slot=slot, torch_message=msg)
            self.hazards.append((i, seq, h, None))
            return
        m = _VERSION_RE.search(msg)
        if m is None:
            self.unverifiable.append((fn.name(), slot))
            return
        data = raw.data if raw is not None else None
        if not isinstance(data, torch.Tensor):
            data = None
        view = False
        requires_grad: bool | None = None
        if data is None and not SAVED_INTROSPECTION:
            data, view, requires_grad = _stale_leaf(fn, msg, int(m.group(1)))
        producer_m = _PRODUCER_RE.search(msg)
        h = Hazard(
            kind="inplace",
            node=fn.name(),
            slot=slot,
            current_version=int(m.group(1)),
            saved_version=int(m.group(2)),
            # Older torch names the node ("SigmoidBackward0"), newer the op ("Sigmoid").
            producer=_BACKWARD_SUFFIX.sub("", producer_m.group(1)) if producer_m else None,
            saved_output=slot.startswith("result")
            or (isinstance(fn, BackwardCFunction) and producer_m is not None
                and fn.name().startswith(producer_m.group(1))),
            torch_message=msg,
        )
        if data is not None:
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
            if view:  # the leaf found for a view it saved (old torch)
                h.shape = _message_shape(msg) or h.shape
                h.producer, h.requires_grad, h.view = None, True, True
        elif not SAVED_INTROSPECTION:
            # What PyTorch's message says of the tensor: "[torch.FloatTensor [4, 3]]".
            h.requires_grad = requires_grad
            h.shape = _message_shape(msg)
            h.dtype, h.device = _message_type(msg)
        self.hazards.append((i, seq, h, data))


def _shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape, or ``None`` for a nested tensor, whose parts have shapes of their own."""
    return None if t.is_nested else tuple(t.shape)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _stale_index(raws: Sequence[Any], msg: str) -> int | None:
    """The element of a saved list that PyTorch's message is about, if only one fits."""
    m = _VERSION_RE.search(msg)
    t = _SAVED_RE.search(msg)
    if m is None or t is None:
        return None
    now, shape = int(m.group(1)), _message_shape(msg)
    hits = [k for k, r in enumerate(raws)
            if r is not None and isinstance(d := r.data, torch.Tensor) and d._version == now
            and tuple(d.shape) == shape and d.type() == t.group(1)]
    return hits[0] if len(hits) == 1 else None


_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


def _message_type(msg: str) -> tuple[str | None, str | None]:
    """dtype and device from PyTorch's type name: torch.cuda.HalfTensor -> float16, cuda."""
    m = _SAVED_RE.search(msg)
    if m is None:
        return None, None
    parts = m.group(1).split(".")
    dtype = _DTYPES.get(parts[-1].removesuffix("Tensor"))
    return dtype, parts[1] if len(parts) == 3 else "cpu"


def _message_shape(msg: str) -> tuple[int, ...] | None:
    m = _SAVED_RE.search(msg)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(2).split(",") if d.strip())


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
    m = _SAVED_RE.search(msg)
    if m is None:
        return None, False, None
    type_name = m.group(1)
    shape = _message_shape(msg) or ()
    numel = math.prod(shape)
    # PyTorch names the node that produced a saved non-leaf: none for a leaf,
    # the view's node for a view of one; anything else is no leaf of ours.
    producer_m = _PRODUCER_RE.search(msg)
    producer = producer_m.group(1) if producer_m else None
    if producer is not None and _VIEW_NODE_RE.fullmatch(producer) is None:
        return None, False, None
    found: dict[int, torch.Tensor] = {}
    for e in fn.next_functions:
        node = e[0]
        if node is None:
            continue
        if producer is not None:
            # The view's own node is rebuilt on access (AsStrided for a T), so
            # any single-input view node in front of a leaf qualifies.
            if _VIEW_NODE_RE.fullmatch(node.name()) is None or len(node.next_functions) != 1:
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


def _executed(graph: Graph, targets: set[int] | None, accumulate: bool) -> list[bool]:
    n = len(graph.nodes)
    if targets is None:
        return [True] * n
    children = graph.children
    needed = [False] * n
    # engine.cpp init_to_execute: a node runs when a child runs or is captured;
    # backward(inputs=) also runs the inputs' own nodes, grad() only captures there.
    # The root is no exception, even a single one (which skips GraphRoot): with
    # no input behind it, it does not run (pytorch#51940).
    for i in reversed(graph.topological_order()):
        need = accumulate and i in targets
        if not need:
            for c in children[i]:
                if needed[c] or c in targets:
                    need = True
                    break
        needed[i] = need
    return needed


def _execution_order(graph: Graph, executed: list[bool]) -> list[int]:
    """Position of each node in the engine's order (-1: not run)."""
    n = len(graph.nodes)
    deps = [0] * n
    for kids in graph.children:
        for c in kids:
            deps[c] += 1
    heap: list[tuple[int, int, int]] = []
    tick = 0

    def release(kids: Sequence[int]) -> None:
        nonlocal tick
        for c in kids:
            deps[c] -= 1
            if deps[c] == 0 and executed[c]:
                heapq.heappush(heap, (-graph.nodes[c]._sequence_nr(), tick, c))
                tick += 1

    if len(graph.roots) == 1:
        heap.append((0, 0, graph.roots[0]))
    else:
        for r in graph.roots:
            deps[r] += 1
        release(graph.roots)
    position = [-1] * n
    k = 0
    while heap:
        _, _, i = heapq.heappop(heap)
        position[i] = k
        k += 1
        release(graph.children[i])
    return position


def _parents(graph: Graph) -> list[int]:
    """A BFS parent of each node (-1 for roots), for the path shown in pictures."""
    parent = [-2] * len(graph.nodes)
    queue = list(dict.fromkeys(graph.roots))
    for r in queue:
        parent[r] = -1
    k = 0
    while k < len(queue):
        i = queue[k]
        k += 1
        for c in graph.children[i]:
            if parent[c] == -2:
                parent[c] = i
                queue.append(c)
    return parent


def _path_to(graph: Graph, parent: list[int], i: int) -> list[str]:
    path = []
    while i >= 0:
        path.append(graph.nodes[i].name())
        i = parent[i]
    return path[::-1]


# A node type -> whether it is AccumulateGrad, whose ``variable`` is its leaf.
_IS_ACCUMULATOR: dict[type, bool] = {}
Inputs = Union[Edge, Iterable[Edge], Mapping[str, torch.Tensor]]


def _roots(outs: Sequence[Edge]) -> tuple[list[Node], list[tuple[Node, int]], set[int]]:
    """The root nodes to walk, the edges backward feeds, and the ids of leaf outputs."""
    nodes: list[Node] = []
    edges: list[tuple[Node, int]] = []
    leaves: set[int] = set()
    for t in outs:
        if isinstance(t, GradientEdge):
            node, nr = t.node, t.output_nr
        elif t.grad_fn is not None:
            node, nr = t.grad_fn, t.output_nr
        else:
            # A leaf: the engine feeds its AccumulateGrad, which saves nothing.
            leaves.add(id(t))
            try:
                node, nr = get_gradient_edge(t).node, 0
            except (RuntimeError, NotImplementedError):
                continue  # sparse, mkldnn: Python reaches the node only through a view
        nodes.append(node)
        edges.append((node, nr))
    return nodes, edges, leaves


def _accumulators(graph: Graph) -> dict[int, int]:
    """``id(leaf)`` -> index of its AccumulateGrad in the graph.

    Found in the walked graph rather than made through a view of the leaf, which
    sparse and mkldnn tensors do not support: a leaf whose accumulator the graph
    does not hold gets no gradient anyway.
    """
    found: dict[int, int] = {}
    for j, fn in enumerate(graph.nodes):
        cls = type(fn)
        is_acc = _IS_ACCUMULATOR.get(cls)
        if is_acc is None:
            is_acc = _IS_ACCUMULATOR[cls] = fn.name() == "torch::autograd::AccumulateGrad"
        if is_acc:
            found[id(fn.variable)] = j  # type: ignore[attr-defined]
    return found


def _targets(graph: Graph, call: Call, root_edges: list[tuple[Node, int]],
             leaf_roots: set[int]) -> tuple[set[int], list[int]]:
    """The graph nodes of the inputs, and (for ``grad``) the inputs no gradient reaches.

    The engine captures an input's gradient where its edge (node, slot) enters
    the graph; an edge that no walked node and no root leads to gets none. A
    leaf that is also an output is fed by the gradient given for it.
    """
    assert call.inputs is not None
    targets: set[int] = set()
    keys: list[tuple[Node, int]] = []
    fed: list[bool] = []
    acc: dict[int, int] | None = None
    for x in call.inputs:
        if isinstance(x, GradientEdge):
            key = (x.node, x.output_nr)
        elif x.grad_fn is not None:
            key = (x.grad_fn, x.output_nr)
        else:
            if acc is None:
                acc = _accumulators(graph)
            j = acc.get(id(x))
            key = (graph.nodes[j], 0) if j is not None else (_NOWHERE, 0)
        keys.append(key)
        fed.append(isinstance(x, torch.Tensor) and id(x) in leaf_roots)
        j = graph.index.get(key[0])
        if j is not None:
            targets.add(j)
    if call.api != "grad":
        return targets, []
    wanted = set(keys)
    reached = wanted.intersection(root_edges)
    for nf in graph.nexts:
        for edge in nf:
            if edge in wanted:
                reached.add(edge)
    return targets, [k for k, key in enumerate(keys) if key not in reached and not fed[k]]


class _Nowhere:
    """Stands for the accumulator of a leaf the graph does not reach."""


_NOWHERE: Any = _Nowhere()


def check(
    outputs: TensorOrTensors,
    *,
    inputs: Inputs | None = None,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    names: Names | None = None,
    api: Api = "backward",
) -> Report:
    """Predict what a backward through ``outputs`` would do, without running it.

    It reads every tensor that the backward would unpack and runs PyTorch's own
    version check on it. It changes nothing: no tensor, no ``.grad``, no version.

    It takes the call's own arguments and mirrors the call: when PyTorch would
    reject them, ``check`` raises PyTorch's exception, of the same type and with
    PyTorch's own message (a ``RuntimeError`` "grad can be implicitly created only
    for scalar outputs" for ``check(a * a)``). The call would raise it before
    reading any saved tensor, so no report could describe it. The one rejection
    ``torch.autograd.grad`` makes after running, an input that the graph never
    reaches ("The differentiated Tensor at index 0 appears to not have been used
    in the graph"), is raised only when the report has no hazard: with one, the
    run fails on that hazard first, as the report says. An input that the graph
    reaches but that gets no gradient all the same (a custom Function returning
    ``None`` for it) is beyond foreseeing without running user code.

    Args:
        outputs: the tensor(s) you would call backward on (``loss``), or
            ``GradientEdge``s.
        inputs: as in ``torch.autograd.backward(..., inputs=)`` or
            ``torch.autograd.grad(outputs, inputs)``: tensors, ``GradientEdge``s
            or a dict of tensors; only nodes on a path to them run.
        grad_outputs: the gradients of ``outputs``: ``gradient`` of
            ``Tensor.backward``, ``grad_tensors`` of ``torch.autograd.backward``,
            ``grad_outputs`` of ``torch.autograd.grad``.
        retain_graph: as in the call. It decides whether a *later* backward
            through this graph fails, not this one.
        create_graph: as in the call.
        allow_unused: ``torch.autograd.grad`` only: whether an input that the
            graph never reaches is allowed (default: ``materialize_grads``).
        materialize_grads: ``torch.autograd.grad`` only.
        names: an ``nn.Module`` (its parameters and buffers are named by qualified
            name), a dict of named modules (``{"G": gen}`` gives ``G.fc.weight``), or
            a dict from tensors to names.
        api: ``"backward"`` for ``Tensor.backward``/``torch.autograd.backward``,
            ``"grad"`` for ``torch.autograd.grad``; they run different nodes when
            ``inputs`` are not leaves.

    Returns:
        A :class:`Report`; ``report.hazards[0]`` is the error backward would raise.

    Raises:
        RuntimeError: PyTorch would reject the call's arguments (an output with
            no graph, a non-scalar output without ``grad_outputs``, a gradient
            of the wrong shape, an input that does not require grad or, for
            ``grad`` without ``allow_unused``, that the graph never reaches);
            the message is PyTorch's.
        TypeError: PyTorch would raise one for the arguments (its message), or
            ``outputs``, ``inputs`` or ``names`` is not tensors at all, or
            ``allow_unused``/``materialize_grads`` is given with
            ``api="backward"``, or ``api="grad"`` has no ``inputs``.
        ValueError: ``api`` is unknown, or ``materialize_grads=True`` with
            ``allow_unused=False`` (PyTorch's message).
        OverflowError: a flag is an integer outside 0..255 (PyTorch's message).

    Example:
        >>> import torch, versionwatch
        >>> s = torch.tensor([2.0], requires_grad=True)
        >>> w = torch.nn.Parameter(torch.tensor([4.0]))
        >>> loss = (s * w).sum()
        >>> with torch.no_grad():
        ...     _ = w.add_(1.0)       # what optimizer.step() does
        >>> report = versionwatch.check(loss, names={w: "w3"})
        >>> h = report.hazards[0]
        >>> (h.tensor, h.where, h.saved_version, h.current_version)
        ('w3', 'MulBackward0.other', 0, 1)
    """
    __tracebackhide__ = True
    if api not in ("backward", "grad"):
        raise ValueError(f'api must be "backward" or "grad"; got {api!r}')
    if api == "backward" and (allow_unused is not None or materialize_grads):
        raise TypeError(
            'allow_unused and materialize_grads are arguments of torch.autograd.grad: '
            'pass api="grad" with them'
        )
    name_map = resolve_names(names)
    try:
        call = bind(api, outputs, inputs, grad_outputs, retain_graph, create_graph,
                    allow_unused, materialize_grads)
        report, unreached = _predict(call, name_map)
        if report.ok:
            after_run(call, unreached)
    except BadCall as e:
        raise e.error from None
    return report


def predict(
    outputs: TensorOrTensors,
    inputs: Inputs | None,
    api: Api,
    name_map: dict[int, str],
    silent: dict[int, int] | None = None,
) -> Report:
    """:func:`check` for a watcher: names resolved, silent writes known.

    Only the outputs and inputs are judged here; a watcher leaves the rest of
    the call's arguments to PyTorch. The gate set on this
    thread gets the walked nodes before any saved tensor is read (it may wait
    for other threads' backwards). The signature stays the five arguments that
    observers of the watcher (the peer harness) wrap.

    Raises:
        TypeError: ``outputs`` or ``inputs`` is not tensors at all.
        BadCall: PyTorch rejects the outputs or inputs.
    """
    return _predict(parse(api, outputs, inputs), name_map, silent, _GATE.fn)[0]


class _Gate(threading.local):
    fn: Callable[[Sequence[Node]], None] | None = None


_GATE = _Gate()


def _predict(
    call: Call, name_map: dict[int, str], silent: dict[int, int] | None = None,
    gate: Callable[[Sequence[Node]], None] | None = None,
) -> tuple[Report, list[int]]:
    """The report, and the indices of the inputs that no gradient would reach."""
    outs, ins = call.outputs, call.inputs
    roots, root_edges, leaf_roots = _roots(outs)
    graph = Graph()
    unreached: list[int] = []
    # The walk creates a wrapper per node, which would trigger the cyclic GC
    # again and again on a big graph (it made a 100k-node check 5x slower);
    # nothing here makes cycles, so it is paused for the walk, as a bulk load.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        checker = _Checker(silent)
        targets: set[int] | None = None
        if ins is None:
            # Every reachable node runs: no need to work out which.
            graph.walk(roots)
            if gate is not None:
                gate(graph.nodes)
            checker.run(graph.nodes)
            executed = [True] * len(graph.nodes)
            count = len(graph.nodes)
        else:
            graph.walk(roots)
            if gate is not None:
                gate(graph.nodes)
            targets, unreached = _targets(graph, call, root_edges, leaf_roots)
            executed = _executed(graph, targets, accumulate=call.api == "backward")
            checker.run(graph.nodes, executed)
            count = sum(executed)
        report = Report(
            unverifiable=checker.unverifiable,
            nodes=count,
            saved_checked=checker.checked,
        )
        if checker.hazards:
            report.rank = rank()
            position = _execution_order(graph, executed)
            checker.hazards.sort(key=lambda e: (position[e[0]], e[1]))
            parents = _parents(graph)
            for i, _, h, data in checker.hazards:
                h.order = position[i]
                h.seq = int(graph.nodes[i]._sequence_nr())
                h.path = _path_to(graph, parents, i)
                if isinstance(data, SavedRecord):
                    own, base = data.ids
                    key = own if own in name_map else base
                    if key is not None and key in name_map:
                        h.tensor, h.view, h.key = name_map[key], key == base, key
                elif data is not None:
                    name, via_view = name_of(data, name_map)
                    if name is not None:
                        h.tensor, h.view = name, via_view or h.view
                        h.key = id(data._base if via_view else data)
                h.fix = fix_for(h)
                report.hazards.append(h)
    finally:
        try:
            lease(graph)  # (it reads no outputs: no list to build)
        finally:
            if gc_was_enabled:
                gc.enable()
    return report, unreached


def raise_for(report: Report) -> None:
    """Raise the error that backward would raise for ``report``'s first hazard."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ours
    first = report.first
    if first is None:
        return
    if first.kind == "freed":
        raise FreedGraphError(report)
    raise InplaceModificationError(report)


def assert_backward_safe(
    outputs: TensorOrTensors,
    *,
    inputs: Inputs | None = None,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    names: Names | None = None,
    api: Api = "backward",
) -> None:
    """Raise before backward runs if it would fail; return quietly if it would not.

    Takes the arguments of :func:`check`, and so the call's own: pass them as
    you pass them to the call, and a call that its arguments doom is never
    called safe.

    Raises:
        InplaceModificationError: a saved tensor was modified by an inplace operation.
        FreedGraphError: the graph's saved tensors were freed by an earlier backward.
        RuntimeError: PyTorch would reject the call's arguments: PyTorch's own
            exception and message, as :func:`check` raises it (also
            ``TypeError`` or ``ValueError`` where PyTorch raises those).

    Example:
        >>> import torch, versionwatch
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = torch.sigmoid(x)
        >>> y += 1
        >>> try:
        ...     versionwatch.assert_backward_safe(y.sum())
        ... except versionwatch.InplaceModificationError as e:
        ...     print(e.report.hazards[0].where)
        SigmoidBackward0.result
        >>> try:
        ...     versionwatch.assert_backward_safe(x * x)   # as (x * x).backward()
        ... except RuntimeError as e:
        ...     print(e)
        grad can be implicitly created only for scalar outputs
    """
    __tracebackhide__ = True
    raise_for(check(outputs, inputs=inputs, grad_outputs=grad_outputs, retain_graph=retain_graph,
                    create_graph=create_graph, allow_unused=allow_unused,
                    materialize_grads=materialize_grads, names=names, api=api))
