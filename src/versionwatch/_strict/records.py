"""Strict mode's records: what it keeps of every tensor autograd saves.

A ``saved_tensors_hooks`` pair packs every tensor autograd saves into a
:class:`SavedRecord` (a detached alias, which shares the storage and the
version counter, plus the version at save time and the module being run,
which a thin wrapper of ``nn.Module._call_impl`` keeps). Records are indexed by
storage in :data:`RECORDS`, held weakly: they die with their graph. Since
PyTorch skips its own version check for hooked tensors, :func:`unpack` runs
that check itself and raises PyTorch's exact error.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import Node

from versionwatch._built import built_at
from versionwatch._compat import (
    MODULE_CALL_HOOKS,
    HookedSaved,
    allow_in_peek,
    peek,
    sequence_nr,
    storage_address,
)
from versionwatch._compat import PEEK as _PEEK
from versionwatch._report import BACKWARD_SUFFIX as _BACKWARD_SUFFIX
from versionwatch._report import ForwardRef, Hazard, Modification, Site, Writer
from versionwatch._runtime import Call, Change, Patch, add_probe
from versionwatch._sites import _is_library, is_library, site_at
from versionwatch._strict import hookstack as _hookstack
from versionwatch._strict.fingerprint import FINGERPRINTS as _FINGERPRINTS
from versionwatch._strict.fingerprint import Fingerprint
from versionwatch._strict.fingerprint import note as _note_fingerprint
from versionwatch._strict.fingerprint import settle as _settle_fingerprints
from versionwatch._strict.thread import THREAD, end_step
from versionwatch._torch_messages import output_slot, result_nr, stale_message


class SavedRecord:
    """What strict mode keeps of one saved tensor (the graph owns it).

    Built once per saved tensor on the forward's hot path, so it computes only
    what is cheap; ``writes`` stays an empty tuple until a write hits it.
    """

    # ``written_fn`` is set only by a write that hits the record (never here: a
    # slot left unset costs nothing on the forward's hot path).
    __slots__ = ("__weakref__", "_silent", "before", "code", "fingerprint", "forward", "ids",
                 "line", "module", "original", "requires_grad", "tensor", "version", "writes",
                 "written_fn")
    written_fn: tuple[str, int]  # (grad_fn name, output_nr) after the last write that hit it
    # Set only with fingerprints on (see _strict.fingerprint); None: none could be taken.
    fingerprint: Fingerprint | None

    def __init__(self, t: torch.Tensor, module: str | None, forward: ForwardRef | None,
                 code: CodeType | None = None, line: int = 0) -> None:
        # A leaf is kept as is, so that `p.data = t` reaches backward as it does
        # unwatched; anything else as a detached alias (same storage and version
        # counter): a saved output kept with its grad_fn would form a cycle.
        base = t._base
        if t.is_leaf:
            self.tensor = t
            self.original: weakref.ref[torch.Tensor] | None = None
            self.requires_grad = t.requires_grad
        else:
            self.tensor = t.detach()
            # Weakly, for PyTorch's error: it names the grad_fn this tensor has
            # *then* (", which is output 0 of Add,"), and unwatched it is alive.
            self.original = weakref.ref(t)
            # A view of a parameter (``weight.t()``); never read grad_fn here:
            # touching nodes from Python makes deep graphs crash when freed.
            self.requires_grad = base is not None and base.is_leaf and t.requires_grad
        self.version = t._version
        self.ids = (id(t), None if base is None else id(base))
        self.module = module
        self.forward = forward
        # The user's line of the op that saved it: a code object and a number,
        # made into a Site only when a report needs it.
        self.code = code
        self.line = line
        self.writes: tuple[()] | list[Modification] = ()
        self._silent = False  # and only then ``before``: the bytes a first silent write found

    @property
    def silent(self) -> bool:
        """A write without a version bump hit this memory, and left other bytes.

        A silent write that puts back what was there (gradcheck perturbs an
        input through ``.data`` and restores it) changes nothing backward reads.
        """
        if not self._silent:
            return False
        before = self.before
        if before is None:
            return True
        if not holds(self.tensor):
            return False  # its memory is not there now (FSDP2 resharded it): nothing read
        try:
            return not torch.equal(before, _bytes(self.tensor))
        except (RuntimeError, TypeError):  # no plain bytes to compare (quantized)
            return True

    def saw_silent_write(self) -> None:
        """Note a silent write about to happen; keep the bytes it may change."""
        if not self._silent:
            self._silent = True
            self.before: torch.Tensor | None = None
            if self.tensor._version == self.version and holds(self.tensor):
                try:
                    self.before = _bytes(self.tensor).clone()
                except (RuntimeError, TypeError):
                    pass

    def hazard(self, node: str, slot: str, kind: Literal["inplace", "silent"] = "inplace",
               detected: Literal["predicted", "at_write", "after_error"] = "predicted",
               modified_by: list[Modification] | None = None) -> Hazard:
        """A hazard on this tensor: the versions, the module, and the writes seen so far."""
        t = self.tensor
        output = slot.startswith("result")
        return Hazard(kind=kind, node=node, slot=slot, saved_version=self.version,
                      current_version=t._version,
                      shape=None if t.is_nested else tuple(t.shape),  # nested: no one shape
                      dtype=str(t.dtype).replace("torch.", ""), device=str(t.device),
                      requires_grad=self.requires_grad, saved_output=output, module=self.module,
                      producer=_BACKWARD_SUFFIX.sub("", node) if output else None,
                      saved_during=str(self.forward) if self.forward is not None else None,
                      saved_in=self.forward,
                      saved_at=(site_at(self.code.co_filename, self.line)
                                if self.code is not None else None),
                      modified_by=list(self.writes if modified_by is None else modified_by),
                      detected=detected)


def holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds all its elements now.

    FSDP2 frees an unsharded parameter by resizing its storage to zero, and
    all-gathers it back (inside ``_unsafe_preserve_version_counter``) when a
    forward or backward needs it: memory that is not there must not be read.
    """
    try:
        if t.numel() == 0:
            return False
        return t.untyped_storage().nbytes() >= (t.storage_offset() + extent(t)) * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage
        return False


def extent(t: torch.Tensor) -> int:
    """How many elements of its storage a non-empty ``t`` spans, from its first."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents as a flat byte tensor (a view where the layout allows)."""
    return t.detach().reshape(-1).view(torch.uint8)


_UNSEEN = object()

# Dead storages the registry may hold before a sweep; sweeping at twice the
# live count keeps the cost per saved tensor constant.
_PURGE_MIN = 256
_purge_at = _PURGE_MIN
# Storage key -> weak references of the records saved there.
RECORDS: dict[int, list[weakref.ref[SavedRecord]]] = {}
_recording = False  # while strict mode is installed: a hook left behind records nothing
_LEFT = _hookstack.STATE.pending  # entries left on a thread by a close from another


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views and ``.data`` aliases."""
    try:
        if storage_address is not None:
            return storage_address(t)
        return int(t.untyped_storage().data_ptr())  # torch < 2.3
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage to write
        return 0


def pack(t: torch.Tensor) -> SavedRecord:
    if _LEFT:  # an entry closed from another thread waits: this save may be its thread's contact
        _hookstack.settle_in_pack()
    if not _recording:  # a hook left on a thread by a close from another: inert
        return SavedRecord(t, None, None)
    local = THREAD
    stack = local.modules
    # The user's frame running the op that saves ``t``: the first one up the
    # stack outside torch and versionwatch (our hook stack, nn.Module's call,
    # F.linear). A few frames, one cached dict lookup each; no record keeps a
    # frame (``modules`` holds one only while its module call runs).
    # f_back, not _getframe(1): a backward's engine thread may call pack with
    # no Python frame above it.
    frame: FrameType | None = sys._getframe().f_back
    first = frame
    library = _is_library
    # Above a module call, the answer is the same for every tensor saved inside
    # it (a Sequential of 100 layers): found once per call, kept in ``modules``.
    depth = len(stack) - 1 if stack else -1
    pending: list[int] | None = None
    while frame is not None:
        code = frame.f_code
        if code is _CALL_CODE and depth >= 0:
            assert stack is not None
            found = stack[depth][1]
            if found is not _UNSEEN:
                frame = found
                break
            if pending is None:
                pending = [depth]
            else:
                pending.append(depth)
            depth -= 1
        else:
            hit = library.get(code.co_filename)
            if hit is None:
                hit = is_library(code.co_filename)
            if not hit:
                break
        frame = frame.f_back
    if pending:
        assert stack is not None
        for d in pending:  # every frame passed was a library's: the same answer
            stack[d][1] = frame
    if frame is not None:
        code, line = frame.f_code, frame.f_lineno
        rec = SavedRecord(t, stack[-1][0] if stack else None, local.forward, code, line)
        if sequence_nr is not None:
            # The node saving ``t`` was numbered just before (a node takes its
            # number when made, and saves after). A freed graph's records are
            # gone with it; this keeps its line for the "freed" report.
            lines = local.lines
            if lines is None:
                lines = local.lines = {}
            lines[sequence_nr() - 1] = (code, line, local.forward)
            if len(lines) >= _LINES_KEPT:  # two windows: no eviction per save
                local.lines_old, local.lines = lines, {}
    else:
        rec = SavedRecord(t, stack[-1][0] if stack else None, local.forward)
    if _FINGERPRINTS.on:  # opt-in: plain strict mode pays this one check
        _note_fingerprint(rec)
    if first is not None and first.f_code is _APPLY_CODE:
        _custom_output(rec, t)
    key = storage_key(t)
    if key:
        registry = RECORDS
        refs = registry.get(key)
        if refs is None:
            registry[key] = [weakref.ref(rec)]
            if len(registry) > _purge_at:
                _purge()
        else:
            # Memory saved again and again (a frozen weight, an address the
            # allocator hands out anew) would keep every dead record's ref:
            # the oldest being dead says the list has some to drop.
            if len(refs) > 3 and refs[0]() is None:
                refs[:] = [r for r in refs if r() is not None]
            refs.append(weakref.ref(rec))
    return rec


# A custom Function's apply: the Python frame a pack of its saved tensors is called from.
_APPLY_CODE = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)


def _custom_output(rec: SavedRecord, t: torch.Tensor) -> None:
    """A custom Function saves ``t``: mark it if it is one of that Function's outputs.

    PyTorch names the node that saved its own output in its error, whatever
    ``t``'s grad_fn is by then; only while it saves can we tell (its grad_fn is
    the node just made). An output of an earlier node is an input here.
    """
    if t.is_leaf or sequence_nr is None:
        return
    fn = t.grad_fn
    if fn is not None and fn._sequence_nr() == sequence_nr() - 1:
        mark_of(rec).output = t.output_nr


# A bounded window per thread: a freed graph's saving lines are needed only
# until its next backward.
_LINES_KEPT = 4096


def saved_line(seq: int) -> tuple[Site, ForwardRef | None] | None:
    """Where this thread's node ``seq`` saved a tensor, and in which forward, if recorded."""
    found = None
    for lines in (THREAD.lines, THREAD.lines_old):
        found = lines.get(seq) if lines is not None else None
        if found is not None:
            break
    if found is None:
        return None
    code, line, forward = found
    return site_at(code.co_filename, line), forward


def _purge() -> None:
    global _purge_at
    registry = RECORDS
    # list() copies at once: a writer on another thread may prune meanwhile.
    for key in [k for k, refs in list(registry.items()) if all(r() is None for r in refs)]:
        registry.pop(key, None)
    _purge_at = max(_PURGE_MIN, 2 * len(registry))


def live(key: int) -> list[SavedRecord]:
    refs = RECORDS.get(key)
    if not refs:
        return []
    live = [rec for r in refs if (rec := r()) is not None]
    if len(live) != len(refs):
        if live:
            RECORDS[key] = [weakref.ref(rec) for rec in live]
        else:
            RECORDS.pop(key, None)  # another thread's write may have pruned it
    return live


_RAW_DATA = hasattr(torch._C._autograd.SavedTensor, "data")


_DETACHED_ERR = (
    "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_()."
    "This is not supported, please use out-of-place `.detach()` instead"
)


class _Mark:
    """What the rare paths of :func:`unpack` need to know about one record."""

    __slots__ = ("detached", "output", "ref", "user")

    def __init__(self, rec: SavedRecord) -> None:
        key = id(rec)

        def forget(_: object) -> None:
            MARKS.pop(key, None)

        self.ref = weakref.ref(rec, forget)
        self.detached = False  # a saved non-leaf, detached in place since
        self.output: int | None = None  # a custom Function's own output, its output_nr
        # A user's register_hooks on the slot: (what their pack returned, their unpack).
        self.user: tuple[Any, Callable[[Any], Any]] | None = None


# id(record) -> its mark; one dict, so that unpack pays one check for all.
MARKS: dict[int, _Mark] = {}


def mark_of(rec: SavedRecord) -> _Mark:
    m = MARKS.get(id(rec))
    if m is None or m.ref() is not rec:
        m = MARKS[id(rec)] = _Mark(rec)
    return m


def output_of(rec: SavedRecord) -> int | None:
    """The output_nr of ``rec``'s tensor if a custom Function saved it as its own output."""
    m = MARKS.get(id(rec)) if MARKS else None
    return m.output if m is not None and m.ref() is rec else None


def unpack(rec: SavedRecord) -> torch.Tensor:
    t = rec.tensor
    peeked = _PEEK.records
    if peeked is not None:  # the predictor reads the record (old torch)
        peeked.append(rec)
        return t
    mark = MARKS.get(id(rec)) if MARKS else None
    if mark is not None:
        if mark.detached:
            _check_detached(rec)
        if mark.user is not None:
            if t._version != rec.version:
                _stale(rec)
            packed, user_unpack = mark.user
            return user_unpack(packed)  # type: ignore[no-any-return]
    if t._version != rec.version:
        _stale(rec)
    return t


def _stale(rec: SavedRecord) -> None:
    """PyTorch skips its own version check for hooked tensors: make the same one.

    With what the watcher needs to explain it (a write during backward, which
    no prediction could see).
    """
    node = torch._C._current_autograd_node()
    err = RuntimeError(strict_message(rec, node, output=output_of(rec)))
    err.versionwatch_saved = (  # type: ignore[attr-defined]
        rec, node.name() if node is not None else "(unknown node)")
    raise err


def _check_detached(rec: SavedRecord) -> None:
    """Raise PyTorch's error for a saved *input* detached in place since.

    Unhooked, PyTorch keeps a saved input as is and finds its grad_fn gone;
    our hook hides that. A saved output is fine (its node is the one running).
    Only the backward's own unpack fails: the node running names the slot.
    """
    node = torch._C._current_autograd_node()
    if node is None:
        return
    for attr in dir(node):
        if not attr.startswith("_raw_saved_") or attr.startswith("_raw_saved_result"):
            continue
        if attr == "_raw_saved_tensors":  # a custom Function's: outputs are not told apart
            return
        if _RAW_DATA:
            raws = getattr(node, attr)
            found = any(getattr(raw, "data", None) is rec
                        for raw in (raws if isinstance(raws, (list, tuple)) else (raws,)))
        else:  # torch 2.4-2.6 hide a raw saved tensor's data: read the slot as the predictor does
            try:
                _, records = peek(node, "_saved_" + attr[len("_raw_saved_"):])
            except (HookedSaved, RuntimeError, AttributeError):
                continue
            found = any(r is rec for r in records)
        if found:
            raise RuntimeError(_DETACHED_ERR)


def on_detach(t: torch.Tensor) -> None:
    """``t.detach_()`` is about to run: mark the records that saved ``t`` itself."""
    if t.is_leaf:
        return  # a leaf was saved as a leaf: PyTorch checks nothing
    key = storage_key(t)
    for rec in live(key) if key else ():
        # A non-leaf is recorded as an alias: the id says which tensor it was.
        if rec.ids[0] == id(t) and rec.tensor is not t:
            mark_of(rec).detached = True


# id(module) -> qualified name; an entry goes when its module dies, so an id
# reused by a later module never finds a stale name.
_NAMES: dict[int, str] = {}
_NAME_REFS: dict[int, weakref.ref[nn.Module]] = {}


def _forget(key: int) -> Callable[[object], None]:
    def forget(_: object) -> None:
        _NAMES.pop(key, None)
        _NAME_REFS.pop(key, None)

    return forget


def name_modules(root: nn.Module, prefix: str) -> None:
    """Remember qualified names of ``root``'s submodules for the records."""
    for qual, sub in root.named_modules():
        key = id(sub)
        if key not in _NAMES:
            _NAMES[key] = f"{prefix}.{qual}" if qual else prefix
            _NAME_REFS[key] = weakref.ref(sub, _forget(key))


def module_named(qualified: str) -> nn.Module | None:
    """The live module that strict mode named ``qualified``, if any (for reports: a scan)."""
    for key, name in list(_NAMES.items()):
        if name == qualified:
            ref = _NAME_REFS.get(key)
            module = ref() if ref is not None else None
            if module is not None:
                return module
    return None


# id(module) -> (a weak reference to it, where it was built): found once per module.
_BUILT: dict[int, tuple[weakref.ref[nn.Module], Site | None]] = {}


def writer_at(frame: FrameType | None, files: list[str]) -> Writer | None:
    """The module whose ``forward`` makes a write, when that write is a library's.

    ``frame``: the frame that called the write's entry point. Up from it, a
    frame of the user's own (``x += 1`` in their module's ``forward``) means the
    write is theirs; the module call wrapper first, past library frames only
    (``F.dropout`` inside ``nn.Dropout.forward``), means it is that module's.
    ``files``: the user's files on the stack, where its root may have been built.
    """
    while frame is not None:
        code = frame.f_code
        if code is _CALL_CODE:
            module = frame.f_locals.get("self")
            return _writer(module, files) if isinstance(module, nn.Module) else None
        hit = _is_library.get(code.co_filename)
        if not (hit if hit is not None else is_library(code.co_filename)):
            return None
        frame = frame.f_back
    return None


def _writer(module: nn.Module, files: list[str]) -> Writer:
    cls = type(module).__name__
    try:
        text = f"{cls}({module.extra_repr()})"
    except Exception:  # a user's extra_repr that fails: the class alone
        text = cls
    name = _NAMES.get(id(module))
    cached = _BUILT.get(id(module))
    if cached is not None and cached[0]() is module:
        built = cached[1]
    else:
        built = built_at(name, module_named, files) if name is not None else None
        key = id(module)

        def forget(_: object) -> None:
            _BUILT.pop(key, None)

        _BUILT[key] = (weakref.ref(module, forget), built)
    return Writer(name or cls, text, built, cls)


def _module_call(call_impl: Callable[..., object]) -> Callable[..., object]:
    names, local = _NAMES, THREAD
    # nn.Module's fast path, taken here: where _call_impl would only call
    # forward, this wrapper calls it in its place. A wrapper that called
    # _call_impl would add a frame to every module call, and a model nested
    # 200 deep that runs plain would exceed the recursion limit under strict.
    hooks = MODULE_CALL_HOOKS
    fast = hooks is not None
    g1, g2, g3, g4 = hooks if hooks is not None else ({}, {}, {}, {})
    tracing = torch._C._get_tracing_state
    fingerprints = _FINGERPRINTS

    @functools.wraps(call_impl)
    def _call_impl(self: nn.Module, *args: object, **kwargs: object) -> object:
        stack = local.modules
        if stack is None:
            stack = local.modules = []
        if local.step is not None:
            end_step()  # optimizers run no modules: that step is over, or a closure runs
        stack.append([names.get(id(self)) or type(self).__name__, _UNSEEN])
        try:
            if fast and not (self._backward_hooks or self._backward_pre_hooks
                             or self._forward_hooks or self._forward_pre_hooks
                             or g1 or g2 or g3 or g4 or tracing()):
                return self.forward(*args, **kwargs)
            return call_impl(self, *args, **kwargs)
        finally:
            stack.pop()
            if fingerprints.on:  # opt-in: the ops this call ran are over
                _settle_fingerprints()

    return _call_impl


# Every wrapper _module_call makes runs this code: pack finds module calls by it.
_CALL_CODE = _module_call(nn.Module._call_impl).__code__


def changes() -> list[Change]:
    """Recording on, and the module call wrapper: the records' part of strict mode."""
    # The module being run, for the records: a thin wrapper keeps nn.Module's
    # fast path (a module hook, even a global one, sends every call down the
    # slow path, which made strict mode 1.3x slower on small models).
    return [Call(_start, _stop), Patch(nn.Module, "_call_impl", _module_call(nn.Module._call_impl))]


def _start() -> None:
    global _recording
    _recording = True


def _stop() -> None:
    global _recording
    _recording = False
    RECORDS.clear()
    _NAMES.clear()
    _NAME_REFS.clear()
    _BUILT.clear()


# Storages with saved records: emptied when the last strict watcher closes.
add_probe("strict records", lambda: len(RECORDS))
allow_in_peek(unpack)


def strict_message(rec: SavedRecord, node: Node | None, slot: str | None = None,
                   output: int | None = None) -> str:
    """PyTorch's error for strict mode's record ``rec`` of a tensor that ``node`` saved.

    PyTorch names a producer for a saved output (its own node) and for a view
    of a leaf that requires grad (the ``AsStrided`` node that a stale view's
    grad_fn is rebuilt as), and for a saved input the grad_fn that input has
    now; a leaf has none. Strict mode holds that input weakly: once the
    program has dropped it (a helper's local), the name is the one it had after
    the last write that hit the record (``rec.written_fn``), as PyTorch's would be.

    Args:
        rec: the :class:`~versionwatch._strict.mode.SavedRecord`.
        node: the node that saved it (the one unpacking it), or None.
        slot: the node's slot that holds it, when known (else it is looked for).
        output: which output of ``node`` it is, when strict mode saw it saved as
            one (a custom Function's ``save_for_backward`` of its own output).
    """
    t = rec.tensor
    producer, nr = None, 0
    if node is not None and output is not None:
        producer, nr = node.name(), output
    elif node is not None:
        found = result_nr(slot) if slot is not None else output_slot(node, rec)
        if found is not None:
            producer, nr = node.name(), found
    if producer is None:
        # Unwatched, PyTorch keeps a saved input itself and names the grad_fn it
        # has when backward reads it (after `b.add_(1)`, AddBackward0).
        ref = getattr(rec, "original", None)
        original = ref() if ref is not None else None
        written = getattr(rec, "written_fn", None)
        if original is not None:
            fn = original.grad_fn
            if fn is not None:
                producer, nr = fn.name(), original.output_nr
        elif written is not None:
            # Dropped since: the grad_fn it had after the last write that hit it.
            producer, nr = written
        elif rec.ids[1] is not None and (ref is not None or rec.requires_grad):
            # A stale view's grad_fn is rebuilt from its base as AsStrided.
            producer = "AsStridedBackward0"
    return stale_message(t, t._version, rec.version, producer, nr)
