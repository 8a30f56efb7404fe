"""Strict mode: see each write to a saved tensor's memory at the line that makes it.

Two parts, both installed only while a strict watcher is open:

- **Saved-tensor records.** A ``saved_tensors_hooks`` pair packs every tensor
  autograd saves into a :class:`SavedRecord` (a detached alias, which shares the
  storage and the version counter, plus the version at save time and the module
  being run, which a thin wrapper of ``nn.Module._call_impl`` keeps). Records
  are indexed by storage, held weakly: they die with their graph. Since PyTorch
  skips its own version check for hooked tensors, the unpack hook runs that
  check itself and raises PyTorch's exact error.
- **Write interception.** The Python entry points of every in-place op (the
  ``Tensor`` methods ending in ``_``, ``x[i] = v``, ``+=`` and friends, the
  ``torch``/``torch._C._nn`` in-place functions, ``_foreach_*_``, ``_fused_*_``,
  ``set_``, ``resize_``, and ``out=`` on the functions of ``torch``,
  ``torch.linalg``, ``torch.special`` and ``torch.fft``) are wrapped. A write
  whose target shares storage with a live record is recorded with the op, the
  user's ``file:line`` and source line; a write to any other memory costs one
  dict lookup. Writes through ``.data`` and by fused optimizer kernels bump no
  version: they are recorded as ``silent``.

A write is only recorded: whether it matters is known when a backward would
unpack what it changed, and the prediction before that backward reads the
records. ``stop_at_write`` also reports at the write, before it happens.

Writes made inside C++ kernels (BatchNorm's running stats) are not seen;
inside ``torch.compile`` regions a write is placed at the compiled function.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from versionwatch import _hookstack
from versionwatch._compat import PEEK as _PEEK
from versionwatch._compat import HookedSaved, allow_in_peek, peek, sequence_nr, storage_address
from versionwatch._explain import _BACKWARD_SUFFIX
from versionwatch._report import Hazard, Modification, Site
from versionwatch._runtime import (
    Anchor,
    Call,
    Change,
    Entry,
    Patch,
    Registry,
    Removable,
    Subscription,
    add_probe,
    remove_all,
)
from versionwatch._sites import _is_library, is_library, site_at, user_site
from versionwatch._torchtext import strict_message

if TYPE_CHECKING:
    from versionwatch._protocols import StrictOwner
    from versionwatch._repair import Repairer

# In-place methods that change metadata only, never memory.
_METADATA_ONLY = frozenset({
    "requires_grad_", "share_memory_", "detach_", "squeeze_", "unsqueeze_", "t_",
    "transpose_", "swapaxes_", "swapdims_", "as_strided_", "_coalesced_", "rename_",
    "_dtensor__new__", "resize_as_sparse_", "sparse_resize_", "sparse_resize_and_clear_",
    "retain_grad_", "_mkldnn_transpose_",
})
_DUNDER_WRITES = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                  "__idiv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__",
                  "__ior__", "__ixor__", "__ilshift__", "__irshift__")


_LABELS = {
    "__setitem__": "x[...] = v", "__iadd__": "+=", "__isub__": "-=", "__imul__": "*=",
    "__itruediv__": "/=", "__idiv__": "/=", "__ifloordiv__": "//=", "__imod__": "%=",
    "__ipow__": "**=", "__iand__": "&=", "__ior__": "|=", "__ixor__": "^=",
    "__ilshift__": "<<=", "__irshift__": ">>=", "data": ".data = ...",
}


class SavedRecord:
    """What strict mode keeps of one saved tensor (the graph owns it).

    Built once per saved tensor on the forward's hot path, so it computes only
    what is cheap; ``writes`` stays an empty tuple until a write hits it.
    """

    __slots__ = ("__weakref__", "_silent", "before", "code", "forward", "ids", "line", "module",
                 "original", "requires_grad", "tensor", "version", "writes")

    def __init__(self, t: torch.Tensor, module: str | None, forward: str | None,
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
        try:
            return not torch.equal(before, _bytes(self.tensor))
        except (RuntimeError, TypeError):  # no plain bytes to compare (quantized)
            return True

    def saw_silent_write(self) -> None:
        """Note a silent write about to happen; keep the bytes it may change."""
        if not self._silent:
            self._silent = True
            self.before: torch.Tensor | None = None
            if self.tensor._version == self.version:
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
                      saved_during=self.forward,
                      saved_at=(site_at(self.code.co_filename, self.line)
                                if self.code is not None else None),
                      modified_by=list(self.writes if modified_by is None else modified_by),
                      detected=detected)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s contents as a flat byte tensor (a view where the layout allows)."""
    return t.detach().reshape(-1).view(torch.uint8)


class _Local(threading.local):
    """Per-thread strict state; class attributes are the defaults."""

    busy = False  # inside our own reporting: our writes are not the user's
    step: str | None = None  # label of the optimizer step running, if any
    step_checked = False  # that step's writes were checked as a whole, up front
    step_frame: tuple[int, Any] | None = None  # id and code of the frame running the step
    forward: str | None = None  # label of the root forward running, if any
    # Per running module call, innermost last: [its name, the user's frame above
    # it once a pack inside it has looked (``_UNSEEN`` until then)]. Those frames
    # are on the stack anyway, and each entry goes when its call returns.
    modules: list[list[Any]] | None = None
    # (node's sequence number) -> (code, line, forward) of what this thread saved
    # for that node, newest last: a freed graph's saving lines (see saved_line).
    lines: dict[int, tuple[CodeType, int, str | None]] | None = None
    lines_old: dict[int, tuple[CodeType, int, str | None]] | None = None  # the previous window


_UNSEEN = object()

# Dead storages the registry may hold before a sweep; sweeping at twice the
# live count keeps the cost per saved tensor constant.
_PURGE_MIN = 256


class _State:
    """Process-wide strict state, shared by every open strict watcher."""

    def __init__(self) -> None:
        self.registry: dict[int, list[weakref.ref[SavedRecord]]] = {}
        # id -> weak reference of tensors handed out by ``.data`` (a WeakSet
        # would compare tensors with ==).
        self.data_aliases: dict[int, weakref.ref[torch.Tensor]] = {}
        self.local = _Local()
        self.purge_at = _PURGE_MIN
        self.recording = False  # while installed: a hook left behind records nothing


STATE = _State()
_LOCAL = STATE.local
THREAD = _LOCAL
# Storage key -> weak references of the records saved there.
RECORDS = STATE.registry
_Hits = list[tuple[torch.Tensor, "SavedRecord"]]
# Open strict watchers, oldest first; weakly: one dropped without close() is
# not kept alive by strict mode.
OWNERS: Registry[StrictOwner] = Registry("strict watchers", weak=True)
# ``on_hazard="repair"``: each open strict watcher's repairer, oldest first,
# weakly. Its ``repair_write`` is called with (label, site, hits) before a
# write is recorded, and returns the hits it could not repair.
REPAIRERS: Registry[Repairer] = Registry("strict repairers", weak=True)


def _repair(label: str, site: Site | None, hits: _Hits) -> _Hits:
    """Hand each hit to the innermost repairing watcher that watches its tensor.

    An activation (no watcher knows it) goes to the innermost one, as does
    every hit while only one is open.
    """
    live = REPAIRERS.items()
    if not live:
        return hits
    if len(live) == 1:
        return live[0].repair_write(label, site, hits)
    groups: dict[int, _Hits] = {}
    for t, rec in hits:
        own, base = rec.ids
        owner = len(live) - 1
        for k in range(len(live) - 1, -1, -1):
            names = live[k].names
            if own in names or (base is not None and base in names):
                owner = k
                break
        groups.setdefault(owner, []).append((t, rec))
    left: _Hits = []
    for k, group in groups.items():
        left += live[k].repair_write(label, site, group)
    return left




def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by its views and ``.data`` aliases."""
    try:
        if storage_address is not None:
            return storage_address(t)
        return int(t.untyped_storage().data_ptr())  # torch < 2.3
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage to write
        return 0


def end_step() -> None:
    """Leave the optimizer step this thread was in, if any.

    A step's post-hook does this; a step that raised never runs it, so any sign
    that the thread is past the step (a module call, a forward, a backward, a
    ``zero_grad()``) does it too, or later writes would still be skipped as the
    step's own.
    """
    _LOCAL.step = None
    _LOCAL.step_checked = False
    _LOCAL.step_frame = None


def begin_step(label: str, frame: FrameType | None) -> None:
    """Enter an optimizer step; ``frame`` runs it (it calls the step's pre-hooks).

    Once that frame is off the stack, the step is over even if it raised (a
    pre-hook vetoed it). Kept by id and code: a frame holds the optimizer and
    the step's arguments.
    """
    _LOCAL.step = label
    _LOCAL.step_frame = (id(frame), frame.f_code) if frame is not None else None


def _in_step() -> bool:
    """Whether the optimizer step this thread entered is still running."""
    mark = _LOCAL.step_frame
    if mark is None:
        return True
    key, code = mark
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if id(frame) == key and frame.f_code is code:
            return True
        frame = frame.f_back
    end_step()
    return False


def pack(t: torch.Tensor) -> SavedRecord:
    if not STATE.recording:  # a hook left on a thread by a close from another: inert
        return SavedRecord(t, None, None)
    local = _LOCAL
    stack = local.modules
    # The user's frame running the op that saves ``t``: the first one up the
    # stack outside torch and versionwatch (our hook stack, nn.Module's call,
    # F.linear). A few frames, one cached dict lookup each; no record keeps a
    # frame (``modules`` holds one only while its module call runs).
    # f_back, not _getframe(1): a backward's engine thread may call pack with
    # no Python frame above it.
    frame: FrameType | None = sys._getframe().f_back
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
    key = _storage_key(t)
    if key:
        registry = STATE.registry
        refs = registry.get(key)
        if refs is None:
            registry[key] = [weakref.ref(rec)]
            if len(registry) > STATE.purge_at:
                _purge()
        else:
            # Memory saved again and again (a frozen weight, an address the
            # allocator hands out anew) would keep every dead record's ref:
            # the oldest being dead says the list has some to drop.
            if len(refs) > 3 and refs[0]() is None:
                refs[:] = [r for r in refs if r() is not None]
            refs.append(weakref.ref(rec))
    return rec


# A bounded window per thread: a freed graph's saving lines are needed only
# until its next backward.
_LINES_KEPT = 4096


def saved_line(seq: int) -> tuple[Site, str | None] | None:
    """Where this thread's node ``seq`` saved a tensor, and in which forward, if recorded."""
    found = None
    for lines in (_LOCAL.lines, _LOCAL.lines_old):
        found = lines.get(seq) if lines is not None else None
        if found is not None:
            break
    if found is None:
        return None
    code, line, forward = found
    return site_at(code.co_filename, line), forward


_RAW_DATA = hasattr(torch._C._autograd.SavedTensor, "data")
_DETACHED_ERR = (
    "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_()."
    "This is not supported, please use out-of-place `.detach()` instead"
)


class _Mark:
    """What the rare paths of :func:`unpack` need to know about one record."""

    __slots__ = ("detached", "ref", "user")

    def __init__(self, rec: SavedRecord) -> None:
        key = id(rec)

        def forget(_: object) -> None:
            _MARKS.pop(key, None)

        self.ref = weakref.ref(rec, forget)
        self.detached = False  # a saved non-leaf, detached in place since
        # A user's register_hooks on the slot: (what their pack returned, their unpack).
        self.user: tuple[Any, Callable[[Any], Any]] | None = None


# id(record) -> its mark; one dict, so that unpack pays one check for all.
_MARKS: dict[int, _Mark] = {}


def _mark(rec: SavedRecord) -> _Mark:
    m = _MARKS.get(id(rec))
    if m is None or m.ref() is not rec:
        m = _MARKS[id(rec)] = _Mark(rec)
    return m


def unpack(rec: SavedRecord) -> torch.Tensor:
    t = rec.tensor
    peeked = _PEEK.records
    if peeked is not None:  # the predictor reads the record (old torch)
        peeked.append(rec)
        return t
    mark = _MARKS.get(id(rec)) if _MARKS else None
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
    err = RuntimeError(strict_message(rec, node))
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


def _on_detach(t: torch.Tensor) -> None:
    """``t.detach_()`` is about to run: mark the records that saved ``t`` itself."""
    if t.is_leaf:
        return  # a leaf was saved as a leaf: PyTorch checks nothing
    key = _storage_key(t)
    for rec in _live(key) if key else ():
        # A non-leaf is recorded as an alias: the id says which tensor it was.
        if rec.ids[0] == id(t) and rec.tensor is not t:
            _mark(rec).detached = True


_ALREADY_HOOKED = (
    "Calling register_hooks on a saved tensor whose hooks have already been set. "
    "Hint: only one pair of hooks is allowed at a time."
)
_PACK_MODIFIED = (
    "A saved tensor pack hook is modifying its input in place. Tensors provided as input to "
    "pack hook can not be modified by in-place operations as this can lead to unexpected "
    "side-effects. Please open an issue if you need to perform in-place operations on the "
    "input to a pack hook."
)


def _hook_pair(*args: Any, **kwargs: Any) -> tuple[Any, Any] | None:
    """``(pack_hook, unpack_hook)`` if these are arguments ``register_hooks`` accepts."""
    def bind(pack_hook: Any, unpack_hook: Any) -> tuple[Any, Any]:
        return pack_hook, unpack_hook

    try:
        pair = bind(*args, **kwargs)
    except TypeError:
        return None
    return pair if callable(pair[0]) and callable(pair[1]) else None


def _wrap_register_hooks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``SavedTensor.register_hooks``: on a slot strict packed, the user's hooks go inside.

    PyTorch allows one pair per slot and strict holds it: the user's pack runs
    now on the saved tensor, as PyTorch would run it, and the slot's unpack
    runs the user's after strict's own check.
    """

    @functools.wraps(fn)
    def register_hooks(self: Any, *args: Any, **kwargs: Any) -> None:
        hooks = _hook_pair(*args, **kwargs)
        if hooks is None or getattr(self, "unpack_hook", None) is not unpack:
            # Not ours, or arguments PyTorch rejects with its own TypeError.
            return fn(self, *args, **kwargs)  # type: ignore[no-any-return]
        pack_hook, unpack_hook = hooks
        rec = self.data
        mark = _mark(rec)
        if mark.user is not None:
            raise RuntimeError(_ALREADY_HOOKED)
        t = rec.tensor
        version = t._version
        with torch.no_grad():
            packed = pack_hook(t)
        if t._version != version:
            raise RuntimeError(_PACK_MODIFIED)
        mark.user = (packed, unpack_hook)
        return None

    return register_hooks


def _wrap_detach(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def detach_(self: torch.Tensor) -> torch.Tensor:
        if STATE.registry:
            _on_detach(self)
        return fn(self)  # type: ignore[no-any-return]

    return detach_


def _purge() -> None:
    registry = STATE.registry
    # list() copies at once: a writer on another thread may prune meanwhile.
    for key in [k for k, refs in list(registry.items()) if all(r() is None for r in refs)]:
        registry.pop(key, None)
    STATE.purge_at = max(_PURGE_MIN, 2 * len(registry))


def _live(key: int) -> list[SavedRecord]:
    refs = STATE.registry.get(key)
    if not refs:
        return []
    live = [rec for r in refs if (rec := r()) is not None]
    if len(live) != len(refs):
        if live:
            STATE.registry[key] = [weakref.ref(rec) for rec in live]
        else:
            STATE.registry.pop(key, None)  # another thread's write may have pruned it
    return live


def _targets(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    out = kwargs.get("out")
    if out is not None:
        yield from (out if isinstance(out, (tuple, list)) else (out,))
    if args:
        first = args[0]
        if isinstance(first, torch.Tensor):
            yield first
        elif isinstance(first, (list, tuple)):
            yield from (t for t in first if isinstance(t, torch.Tensor))


def _is_silent(name: str, t: torch.Tensor) -> bool:
    if name.startswith("_fused_") or name == "data":
        # Fused optimizer kernels update in place without a version bump, and
        # `p.data = t` swaps the storage without one.
        return True
    aliases = STATE.data_aliases
    for x in (t, t._base):
        if x is not None:
            r = aliases.get(id(x))
            if r is not None and r() is x:
                return True
    return False


def on_write(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             silent: bool = False) -> None:
    """Called before an in-place op; records it on the records it hits.

    ``silent``: the write bumps no version (a fused optimizer step).
    With ``stop_at_write`` it reports there too, and raises under ``raise``.
    """
    __tracebackhide__ = True
    if not STATE.registry or _LOCAL.busy:
        return
    hits: list[tuple[torch.Tensor, SavedRecord]] = []
    for t in _targets(name, args, kwargs):
        key = _storage_key(t)
        if key:
            hits += [(t, rec) for rec in _live(key)]
    if not hits:
        return
    _LOCAL.busy = True
    try:
        _report_write(name, hits, silent)
    finally:
        _LOCAL.busy = False


def _report_write(name: str, hits: list[tuple[torch.Tensor, SavedRecord]],
                  silent_op: bool = False) -> None:
    """Record the write on every record it hits; stop here if a watcher asks to."""
    __tracebackhide__ = True
    site = user_site()
    label = _LABELS.get(name, f"{name}()" if not name.endswith(")") else name)
    context = _LOCAL.step
    if context:
        if name != "step" and _LOCAL.step_checked and _in_step():
            return  # the step's writes were checked, and recorded, as a whole
        context = _LOCAL.step
    if context:
        label = context if name == "step" else f"{context} ({label})"
    if REPAIRERS:  # on_hazard="repair": copies first; what is left is recorded
        hits = _repair(label, site, hits)
        if not hits:
            return
    newest = OWNERS.newest()
    stop = newest if newest is not None and newest.stop_at_write else None
    hazards = []
    for t, rec in hits:
        silent = silent_op or _is_silent(name, t)
        mod = Modification("inplace_op", label + (" (no version bump)" if silent else ""), site)
        if not rec.writes:
            rec.writes = []
        rec.writes.append(mod)
        if silent:
            rec.saw_silent_write()
        if stop is None:
            continue  # the verdict waits for a backward: that graph may never run one
        # No node yet: a write does not tell which node saved the memory.
        h = rec.hazard("", "", "silent" if silent else "inplace", "at_write", [mod])
        hazards.append((h, rec))
    if stop is not None:
        stop.on_strict_write([h for h, _ in hazards], [rec for _, rec in hazards])


def _wrap(attr: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    name = attr
    registry, local = STATE.registry, _LOCAL

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if registry and not local.step_checked:
            on_write(name, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _wrap_out(attr: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    name = f"{attr}(out=)"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs and STATE.registry and kwargs.get("out") is not None:
            on_write(name, (), kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _data_getter() -> property:
    original: Any = vars(torch._C.TensorBase)["data"]

    def get(self: torch.Tensor) -> torch.Tensor:
        alias = original.__get__(self)
        if STATE.registry:
            aliases = STATE.data_aliases
            key = id(alias)
            def forget(_: object, k: int = key) -> None:
                aliases.pop(k, None)

            aliases[key] = weakref.ref(alias, forget)
        return alias  # type: ignore[no-any-return]

    def set_(self: torch.Tensor, value: torch.Tensor) -> None:
        if STATE.registry:
            on_write("data", (self,), {})
        original.__set__(self, value)

    def delete(self: torch.Tensor) -> None:
        original.__delete__(self)  # PyTorch's own error

    return property(get, set_, delete, doc=original.__doc__)


def _has_out(fn: Any) -> bool:
    doc = getattr(fn, "__doc__", None) or ""
    # The signature line (``linalg.matmul(input, other, *, out=None)``) or the
    # argument list says so; builtins have no inspectable signature.
    return "out (Tensor" in doc or "out=None" in doc.lstrip().partition("\n")[0]


def _jit_builtins() -> dict[int, str]:
    """TorchScript's table of builtins: id of a Python function -> its aten op."""
    table: dict[int, str] = torch.jit._builtins._get_builtin_table()  # type: ignore[no-untyped-call]
    return table


def _changes() -> list[Change]:
    """Every change strict mode makes to the process, in the order applied."""
    changes: list[Change] = [Call(_start_recording, _stop_recording)]
    tensor = torch.Tensor
    for attr in dir(tensor):
        if attr.endswith("_") and not attr.startswith("__") and attr not in _METADATA_ONLY:
            fn = getattr(tensor, attr, None)
            if callable(fn):
                changes.append(Patch(tensor, attr, _wrap(attr, fn)))
    for attr in _DUNDER_WRITES:
        fn = getattr(tensor, attr, None)
        if fn is not None:
            changes.append(Patch(tensor, attr, _wrap(attr, fn)))
    changes.append(Patch(tensor, "data", _data_getter()))
    changes.append(Patch(tensor, "detach_", _wrap_detach(tensor.detach_)))
    saved: Any = torch._C._autograd.SavedTensor
    changes.append(Patch(saved, "register_hooks", _wrap_register_hooks(saved.register_hooks)))
    # TorchScript compiles a call to a torch function by the function's identity
    # (torch.jit._builtins): our wrappers map to the same aten op, or scripting
    # code that calls torch.relu_ (forward AD's decompositions do) would fail.
    # Built now, before any patch, the table keeps the originals too.
    builtins = _jit_builtins()
    for mod in (torch, torch._C._nn, torch.linalg, torch.special, torch.fft):
        prefix = "" if mod is torch or mod is torch._C._nn else mod.__name__[6:] + "."
        for attr in dir(mod):
            if attr.startswith("__"):
                continue
            fn = getattr(mod, attr, None)
            if not callable(fn) or isinstance(fn, type):
                continue
            if attr.endswith("_") and attr not in _METADATA_ONLY:
                new = _wrap(attr, fn)
            elif mod is not torch._C._nn and _has_out(fn):
                new = _wrap_out(prefix + attr, fn)
            else:
                continue
            changes.append(Patch(mod, attr, new))
            op = builtins.get(id(fn))
            if op is not None:
                # A dead wrapper's id may be reused by anything: taken out with it.
                changes.append(Entry(builtins, id(new), op))
    # The module being run, for the records: a thin wrapper keeps nn.Module's
    # fast path (a module hook, even a global one, sends every call down the
    # slow path, which made strict mode 1.3x slower on small models).
    changes.append(Patch(nn.Module, "_call_impl", _module_call(nn.Module._call_impl)))
    changes += _hookstack.changes(pack, unpack)
    return changes


def _start_recording() -> None:
    STATE.recording = True


def _stop_recording() -> None:
    STATE.recording = False
    STATE.registry.clear()
    _NAMES.clear()
    _NAME_REFS.clear()


# Strict mode's patches, in place while any strict watcher is open.
ANCHOR = Anchor("strict mode patches", _changes)
# Storages with saved records: emptied when the last strict watcher closes.
add_probe("strict records", lambda: len(STATE.registry))


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


def _module_call(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    names, local = _NAMES, _LOCAL

    @functools.wraps(call_impl)
    def _call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        stack = local.modules
        if stack is None:
            stack = local.modules = []
        if local.step is not None:
            end_step()  # optimizers run no modules: that step is over, or a closure runs
        stack.append([names.get(id(self)) or type(self).__name__, _UNSEEN])
        try:
            return call_impl(self, *args, **kwargs)
        finally:
            stack.pop()

    return _call_impl


# Every wrapper _module_call makes runs this code: pack finds module calls by it.
_CALL_CODE = _module_call(nn.Module._call_impl).__code__


def attach(owner: StrictOwner) -> Subscription:
    """Start strict mode for ``owner`` on this thread; the subscription ends it.

    Ending it from another thread leaves this thread's hook entry inert:
    PyTorch lets no thread pop another's saved-tensor hooks, so it stays on
    the owner's stack until its thread next enters versionwatch, and pack
    there records nothing once no strict watcher is open.
    """
    held: list[Removable] = [ANCHOR.subscribe()]
    try:
        held.append(OWNERS.add(owner))
        if owner.repairer is not None:
            held.append(REPAIRERS.add(owner.repairer))
        token = _hookstack.push()
    except BaseException:
        remove_all(held)
        raise

    def detach() -> None:
        try:
            _hookstack.pop(token)
        finally:
            end_step()
            _LOCAL.forward = None
            remove_all(held)

    return Subscription(detach)


allow_in_peek(unpack)
