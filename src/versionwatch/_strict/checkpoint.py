"""Strict mode inside non-reentrant activation checkpointing: the writes its recomputation hides.

``checkpoint(fn, x, use_reentrant=False)`` saves nothing while ``fn`` runs: its
pack hook stores an empty ``_Holder`` per saved tensor, and the backward's first
unpack reruns ``fn`` under a hook that stores, for each save in order, an alias
of the tensor being saved (``x.detach()``), stopping right after the frame's
last save (early stop, the default). No version is checked, so:

- a write inside ``fn`` to a tensor saved earlier in ``fn`` is repeated by the
  recomputation, and the alias sees it: the backward reads the written value
  (when early stop ends the recomputation before the write, it is not repeated);
- a tensor ``fn`` saved that the recomputation does not make afresh (a
  parameter, a buffer, a tensor ``fn`` closes over) is read as it is at the
  backward: a write after the forward changes what the backward reads;
- a tensor made inside ``fn`` is made again from the parameters it was computed
  from (found by walking its graph back to their AccumulateGrad nodes, once per
  node): a write to one of them after the forward changes it too.

A write that leaves the bytes as they were (``relu_`` on a sigmoid's output, a
swap undone) changes nothing, and is no hazard: the bytes are compared after a
write inside ``fn``, and before the backward for a write after it. A write to
other bytes of the same storage (another slice) is no hazard either.

``fn``'s explicit tensor arguments are saved by checkpoint itself with PyTorch's
version check (it raises for a write that bumps a version), and the outputs of
ops that selective checkpointing caches are checked too ("Tensor cached during
selective activation checkpoint has been mutated"): those are silent only for
writes that bump no version. A write after ``fn`` to a tensor made inside it
changes nothing: the recomputation makes it afresh.

While strict mode is installed, the pack hook of each checkpoint pushed on this
thread's saved-tensor hooks stack is wrapped (:func:`wrap_pack`, called by
:mod:`~versionwatch._strict.hookstack`): checkpoint still stores and returns the
same holder, and a light :class:`CheckpointRecord` is kept for it, keyed by the
holder (weakly: it dies with the graph's slot), holding no tensor made inside
``fn``. Writes reach :func:`on_write` from strict mode's in-place wrappers; the
prediction before a backward asks :func:`hazard_for` about each slot it would
read, by the slot's holder (torch that hides a hooked slot's data, 2.4, gets
nothing from here).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

from versionwatch._compat import CHECKPOINT_GENERATOR_CODE, checkpoint_frame, sequence_nr
from versionwatch._report import BACKWARD_SUFFIX, SILENT_TAIL, ForwardRef, Hazard, Modification
from versionwatch._runtime import add_probe
from versionwatch._sites import site_at, user_frame_from, user_site
from versionwatch._strict import hookstack as _hookstack
from versionwatch._strict import records
from versionwatch._strict.records import extent, module_named, storage_key
from versionwatch._strict.thread import THREAD

HIDDEN_BY = "checkpoint(use_reentrant=False)"
SELECTIVE = "selective checkpoint"


class _Frame:
    """What is known of one checkpoint frame beyond torch's own ``_CheckpointFrame``."""

    __slots__ = ("__weakref__", "arg_keys", "cache", "frame", "masks", "names", "params", "start")

    def __init__(self, frame: Any, start: int | None, arg_keys: frozenset[int] | None,
                 cache: Any) -> None:
        self.frame = weakref.ref(frame)
        self.start = start  # the sequence clock when fn began: nodes made since are fn's
        # Storages of fn's explicit tensor arguments, which checkpoint keeps with a
        # version check (None: unknown, so only writes with no version bump count).
        self.arg_keys = arg_keys
        self.cache = cache  # selective checkpointing's storage of cached outputs, if any
        # The leaves (parameters) fn's recomputed tensors are made from, each as a
        # record of its own (seen by the writes); a saved tensor's ``deps`` is a
        # bit mask over them. ``masks``: node sequence number -> that mask (the
        # walk's memo: numbers, never nodes).
        self.params: list[CheckpointRecord] = []
        self.masks: dict[int, int] = {}
        self.names: dict[int, str] | None = None  # id(parameter) -> its qualified name


class CheckpointRecord:
    """One tensor saved inside a checkpointed function (the graph's holder owns it)."""

    __slots__ = (
        "__weakref__",
        "before",
        "code",
        "deps",
        "device",
        "dtype",
        "forward",
        "geometry",
        "index",
        "info",
        "inside",
        "key",
        "line",
        "missed",
        "module",
        "name",
        "output",
        "requires_grad",
        "root",
        "shape",
        "span",
        "version",
        "view",
        "writes",
    )

    def __init__(self, t: torch.Tensor, info: _Frame, index: int, inside: bool) -> None:
        base = t._base
        root = base if base is not None else t
        # Weakly: a tensor made inside fn is meant to be freed after it (that is
        # checkpointing's whole point); one from outside is alive anyway.
        self.root = weakref.ref(root)
        self.key = _storage_key(t)
        self.span = _span(t)  # the bytes it covers: a write elsewhere in the storage misses it
        self.version = t._version
        self.index = index  # its place among the frame's saves (the holder's)
        # Weakly: the frame's parameter records are held by the frame's info, and
        # a cycle would keep selective checkpointing's cache alive until a gc.
        self.info = weakref.ref(info)
        self.inside = inside  # made inside fn: the recomputation makes it afresh
        self.view = base is not None
        # A view's place in its base: its own bytes are compared, not the base's (a
        # write to another row of the same buffer leaves them as they were).
        self.geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset()) \
            if base is not None and not t.is_nested else None
        self.output = False
        self.requires_grad = t.requires_grad
        self.shape = None if t.is_nested else tuple(t.shape)
        self.dtype = str(t.dtype).replace("torch.", "")
        self.device = str(t.device)
        self.module: str | None = None
        self.forward: ForwardRef | None = None
        self.code: CodeType | None = None
        self.line = 0
        # (the write, whether fn was running then, the frame's saves so far)
        self.writes: list[tuple[Modification, bool, int]] = []
        self.before: torch.Tensor | None = None  # bytes before the first write after fn
        self.missed = 0  # writes seen to other bytes of its storage (each bumps the version)
        self.deps = 0  # which of the frame's params its recomputation reads (made inside fn)
        self.name: str | None = None  # a parameter's qualified name (a dependency's record)


# holder -> its record; weakly keyed: the holder lives as long as the graph's slot.
HOLDERS: weakref.WeakKeyDictionary[Any, CheckpointRecord] = weakref.WeakKeyDictionary()
# storage key -> weak references of the records saved there (for the writes).
REGISTRY: dict[int, list[weakref.ref[CheckpointRecord]]] = {}
_FRAMES: weakref.WeakKeyDictionary[Any, _Frame] = weakref.WeakKeyDictionary()
_PURGE_MIN = 256
_purge_at = _PURGE_MIN


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[start, end)`` of the addresses ``t`` covers (None: unknown, assume all)."""
    try:
        if t.numel() == 0:
            return (0, 0)
        start = t.data_ptr()
        return start, start + extent(t) * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta
        return None


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is None or b is None or (a[0] < b[1] and b[0] < a[1])


def _storage_key(t: torch.Tensor) -> int:
    return storage_key(t)


def wrap_pack(pack_hook: Callable[[torch.Tensor], Any],
              unpack_hook: Callable[[Any], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    """``pack_hook`` itself, or, for a non-reentrant checkpoint's, one that also records.

    Called as the hook pair is pushed (strict mode's stack wrapper), outside
    any backward. The wrapper returns what checkpoint's own pack returns.
    """
    frame = checkpoint_frame(pack_hook)
    if frame is None or not records._recording:  # wrappers kept for another thread's entry
        return pack_hook
    info = _FRAMES.get(frame)
    if info is None:
        info = _FRAMES[frame] = _Frame(frame, sequence_nr() if sequence_nr is not None else None,
                                       *_generator_state(sys._getframe(1)))
    own = pack_hook

    def pack(t: torch.Tensor) -> Any:
        holder = own(t)
        try:
            _record(frame, info, holder, t)
        except Exception:
            pass
        return holder

    return pack


def _generator_state(frame: FrameType | None) -> tuple[frozenset[int] | None, Any]:
    """fn's argument storages and the selective cache, read from checkpoint's generator.

    The generator pushes the hook from its own frame (``with _checkpoint_hook(...)``),
    a few frames up: its locals hold ``args`` and the ``forward_context``.
    """
    while frame is not None and frame.f_code is not CHECKPOINT_GENERATOR_CODE:
        frame = frame.f_back
    if frame is None:
        return None, None
    local = frame.f_locals
    args = local.get("args")
    keys = None
    if isinstance(args, (tuple, list)):
        keys = frozenset(_storage_key(a) for a in args if isinstance(a, torch.Tensor))
    cache = getattr(local.get("forward_context"), "storage", None)
    allow = getattr(local.get("recompute_context"), "allow_cache_entry_mutation", False)
    # With mutation allowed, a cached output is not checked: as if recomputed.
    return keys, (None if allow or not isinstance(cache, dict) else cache)


def _record(frame: Any, info: _Frame, holder: Any, t: torch.Tensor) -> None:
    index = len(frame.weak_holders) - 1
    base = t._base
    root = base if base is not None else t
    inside = False
    if not root.is_leaf and info.start is not None:
        fn = root.grad_fn
        inside = fn is not None and fn._sequence_nr() >= info.start
    rec = CheckpointRecord(t, info, index, inside)
    if inside:
        rec.deps = _deps(info, root, index)
    if not t.is_leaf and sequence_nr is not None:
        fn = t.grad_fn
        rec.output = fn is not None and fn._sequence_nr() == sequence_nr() - 1
    local = THREAD
    stack = local.modules
    rec.module = stack[-1][0] if stack else None
    rec.forward = local.forward
    user = user_frame_from(sys._getframe(2))
    if user is not None:
        rec.code, rec.line = user.f_code, user.f_lineno
    HOLDERS[holder] = rec
    _register(rec)


def _register(rec: CheckpointRecord) -> None:
    """Index ``rec`` by its storage, for the writes."""
    key = rec.key
    if key:
        refs = REGISTRY.get(key)
        if refs is None:
            REGISTRY[key] = [weakref.ref(rec)]
            if len(REGISTRY) > _purge_at:
                _purge()
        else:
            if len(refs) > 3 and refs[0]() is None:
                refs[:] = [r for r in refs if r() is not None]
            refs.append(weakref.ref(rec))


def _deps(info: _Frame, t: torch.Tensor, index: int) -> int:
    """The bit mask of the parameters ``t`` is computed from inside fn (its recomputation's).

    Walks ``t``'s graph back through the nodes made since fn began, to the
    leaves' AccumulateGrad; each node's mask is kept by its sequence number, so
    a frame's walks visit each node once.
    """
    fn = t.grad_fn
    if fn is None:
        return 0
    start = info.start
    assert start is not None
    masks = info.masks
    mask = 0
    # Iterative post-order: a node's mask once its inputs' are known.
    stack: list[tuple[Any, bool]] = [(fn, False)]
    while stack:
        node, done = stack.pop()
        seq = node._sequence_nr()
        if seq in masks and not done:
            continue
        edges = [e[0] for e in node.next_functions if e[0] is not None]
        if not done:
            stack.append((node, True))
            stack += [(e, False) for e in edges
                      if not hasattr(e, "variable") and start <= e._sequence_nr() < seq
                      and e._sequence_nr() not in masks]
            continue
        m = 0
        partial = node.name() in _PARTIAL_READS
        for e in edges:
            var = getattr(e, "variable", None)
            if isinstance(var, torch.Tensor):
                if not partial:
                    m |= 1 << _param_bit(info, var, index)
            else:
                m |= masks.get(e._sequence_nr(), 0)
        masks[seq] = m
    mask = masks.get(fn._sequence_nr(), 0)
    return mask


# Ops that read part of a parameter (an embedding's looked-up rows, an index, a
# slice): a write to the parameter may leave what they read as it was (an
# embedding's max_norm renormalizes the rows a batch did not look up), so what
# is made from them is not counted as made from the parameter. A miss, where
# the write did change those rows; never a false report.
_PARTIAL_READS = frozenset({
    "EmbeddingBackward0", "EmbeddingBagBackward0", "IndexBackward0", "IndexSelectBackward0",
    "SelectBackward0", "SliceBackward0", "GatherBackward0", "TakeBackward0",
    "MaskedSelectBackward0", "AsStridedBackward0", "AsStridedBackward1", "NarrowBackward0",
    "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0", "DiagonalBackward0",
})


def _param_bit(info: _Frame, var: torch.Tensor, index: int) -> int:
    """The bit of leaf ``var`` among the frame's params (a record for it on first sight)."""
    for bit, rec in enumerate(info.params):
        if rec.root() is var:
            return bit
    rec = CheckpointRecord(var, info, index, False)
    if info.names is None:
        info.names = _param_names()
    rec.name = info.names.get(id(var))
    info.params.append(rec)
    _register(rec)
    return len(info.params) - 1


def _param_names() -> dict[int, str]:
    """id(parameter) -> qualified name, from the root module strict mode runs (if any)."""
    stack = THREAD.modules
    if not stack:
        return {}
    root_name = stack[0][0]
    root = module_named(root_name) if isinstance(root_name, str) else None
    if root is None:
        return {}
    return {id(p): f"{root_name}.{n}" for n, p in root.named_parameters()}


def _purge() -> None:
    global _purge_at
    for key in [k for k, refs in list(REGISTRY.items()) if all(r() is None for r in refs)]:
        REGISTRY.pop(key, None)
    _purge_at = max(_PURGE_MIN, 2 * len(REGISTRY))


def clear() -> None:
    """Strict mode is taken out: nothing it recorded is kept."""
    REGISTRY.clear()
    HOLDERS.clear()
    _FRAMES.clear()


def on_write(label: str, targets: list[torch.Tensor], silent: bool) -> None:
    """An in-place write to ``targets`` is about to happen: note it on their records.

    ``label`` is how a report names the write (``mul_()``, ``SGD.step() #1``).
    Nothing here may stop the write: the user's op runs whatever happens.
    """
    _PENDING.changes = None  # what an earlier write left (an out= write) is not this one's
    try:
        _on_write(label, targets, silent)
    except Exception:
        pass


def _on_write(label: str, targets: list[torch.Tensor], silent: bool) -> None:
    hits: list[CheckpointRecord] = []
    for t in targets:
        key = _storage_key(t)
        refs = REGISTRY.get(key) if key else None
        if not refs:
            continue
        span = _span(t)
        for r in refs:
            found = r()
            # Alive, its root still holds that storage: the memory was not reused.
            if found is None or (root := found.root()) is None \
                    or _storage_key(root) != key or found in hits:
                continue
            if _overlap(span, found.span):
                hits.append(found)
            elif not silent:
                found.missed += 1  # the version moves, the bytes it covers do not
    if not hits:
        return
    mod = Modification("inplace_op", label + (" (no version bump)" if silent else ""),
                       user_site())
    pending: list[tuple[CheckpointRecord, Modification, torch.Tensor]] = []
    for rec in hits:
        info = rec.info()
        frame = info.frame() if info is not None else None
        if frame is None:
            continue
        running = not getattr(frame, "forward_completed", True)
        rec.writes.append((mod, running, len(frame.weak_holders)))
        if running and (root := rec.root()) is not None:
            # Repeated by the recomputation: it matters only if it changes the bytes
            # (relu_ on a sigmoid's output leaves them): compared after the op.
            before = _saved_bytes(rec, root)
            if before is not None:
                pending.append((rec, mod, before.clone()))
        if not rec.inside and rec.before is None and not running:
            root = rec.root()
            if root is not None:
                # The bytes the recomputation would have read: a write undone is none.
                before = _saved_bytes(rec, root)
                rec.before = before.clone() if before is not None else None
    if pending:
        _PENDING.changes = pending


class _Pending(threading.local):
    changes: list[tuple[CheckpointRecord, Modification, torch.Tensor]] | None = None


_PENDING = _Pending()


def take_pending() -> list[tuple[CheckpointRecord, Modification, torch.Tensor]] | None:
    """The writes :func:`on_write` just saw inside a running checkpointed function, if any."""
    changes, _PENDING.changes = _PENDING.changes, None
    return changes


def after_write(changes: list[tuple[CheckpointRecord, Modification, torch.Tensor]]) -> None:
    """After the op: a write that left a record's bytes as they were is no write to it."""
    try:
        for rec, mod, before in changes:
            root = rec.root()
            now = _saved_bytes(rec, root) if root is not None else None
            if now is not None and torch.equal(before, now):
                rec.writes = [w for w in rec.writes if w[0] is not mod]
    except Exception:
        pass


def _saved_bytes(rec: CheckpointRecord, root: torch.Tensor) -> torch.Tensor | None:
    """The bytes of what ``rec``'s slot saved: its view of ``root``, else ``root``'s."""
    t = root.detach()
    if rec.geometry is not None:
        shape, stride, offset = rec.geometry
        try:
            t = t.as_strided(shape, stride, offset)
        except RuntimeError:  # the base was resized since: compare it whole
            pass
    return _bytes(t)


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    try:
        return t.detach().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError):  # no plain bytes (quantized, sparse)
        return None


def record_of(holder: Any) -> CheckpointRecord | None:
    """The record of the slot whose checkpoint holder is ``holder``, if strict mode made one."""
    try:
        return HOLDERS.get(holder)
    except TypeError:  # not weakly referenceable: not checkpoint's holder
        return None


def _cached(info: _Frame, key: int) -> bool:
    """Whether selective checkpointing cached (and checks) an output at storage ``key``."""
    cache = info.cache
    if not cache or not key:
        return False
    for entries in list(cache.values()):
        for entry in list(getattr(entries, "values", lambda: ())()):
            for w in (entry if isinstance(entry, (tuple, list)) else (entry,)):
                val = getattr(w, "val", None)
                if isinstance(val, torch.Tensor) and getattr(w, "version", None) is not None \
                        and _storage_key(val) == key:
                    return True
    return False


def hazard_for(rec: CheckpointRecord, node: str, slot: str
               ) -> tuple[Hazard | None, torch.Tensor | None]:
    """The silent hazard on ``rec``'s slot of ``node``, if the recomputation reads a write.

    Also the tensor a report may name (the root, for one that is not made
    inside the function: a parameter).
    """
    info = rec.info()
    frame = info.frame() if info is not None else None
    root = rec.root()
    if info is None or frame is None:
        return None, None
    total = len(frame.weak_holders)
    early = bool(getattr(frame, "early_stop", True))
    # PyTorch checks the versions of fn's arguments and of the outputs selective
    # checkpointing cached: only a write that bumps no version escapes it there.
    checked = (info.arg_keys is None and not rec.inside) or rec.key in (info.arg_keys or ()) \
        or _cached(info, rec.key)
    selective = info.cache is not None
    hidden = SELECTIVE if selective else HIDDEN_BY
    # Writes while fn ran, after this save, before the recomputation stops.
    repeated = [m for m, running, packs in rec.writes
                if running and packs > rec.index and (not early or packs < total)
                and (not checked or m.description.endswith("(no version bump)"))]
    stale: list[Modification] = []
    if not rec.inside and root is not None and not repeated:
        stale = _changed(rec, root, checked)
    # Made inside fn, and made again at the backward from parameters changed since.
    # Their writes are not this tensor's: facts of their own, not ``modified_by``.
    sources: list[tuple[CheckpointRecord, list[Modification]]] = []
    if rec.inside and not repeated and rec.deps:
        for bit, dep in enumerate(info.params):
            if rec.deps >> bit & 1 and (r := dep.root()) is not None:
                writes = _changed(dep, r, dep.key in (info.arg_keys or ()))
                if writes:
                    sources.append((dep, writes))
    if not repeated and not stale and not sources:
        return None, None
    h = Hazard(kind="silent", node=node, slot=slot, saved_version=rec.version,
               current_version=root._version if root is not None else None,
               shape=rec.shape, dtype=rec.dtype, device=rec.device,
               requires_grad=rec.requires_grad, saved_output=rec.output, module=rec.module,
               producer=BACKWARD_SUFFIX.sub("", node) if rec.output else None,
               saved_during=str(rec.forward) if rec.forward is not None else None,
               saved_in=rec.forward,
               saved_at=site_at(rec.code.co_filename, rec.line) if rec.code is not None else None,
               modified_by=repeated or stale, view=rec.view,
               cause="checkpoint", hidden_by=hidden)
    version_bump = any(not m.description.endswith("(no version bump)") for m in h.modified_by)
    without = "; PyTorch raises here without checkpointing" if version_bump else ""
    if repeated:
        h.notes.append(f"under {hidden} the recomputation during backward repeats this write, "
                       f"so {node} gets the written value{without}")
    elif sources:
        names = ", ".join(d.name or f"a parameter {_size(d)}" for d, _ in sources)
        h.notes.append(f"under {hidden} the recomputation during backward makes this tensor "
                       f"again from {names} as it is then, so {node} gets a value the forward "
                       "never computed; without checkpointing the backward would use the "
                       "forward's")
        for d, writes in sources:
            for m in writes:
                code = f": {m.site.code}" if m.site is not None and m.site.code else ""
                h.notes.append(f"{d.name or 'the parameter'} modified by {m}{code}")
    else:
        what = "this tensor" if root is None else "it"
        h.notes.append(f"under {hidden} the recomputation during backward reads {what} as it "
                       f"is then, after this write, so {node} gets the new value{without}")
    h.notes.append(SILENT_TAIL)
    return h, (None if rec.inside else root)


def _changed(rec: CheckpointRecord, root: torch.Tensor, checked: bool) -> list[Modification]:
    """The writes since ``rec``'s save that changed what the recomputation reads (none: [])."""
    later = [m for m, running, packs in rec.writes if packs > rec.index or not running]
    silent = [m for m in later if m.description.endswith("(no version bump)")]
    if checked:  # PyTorch's own check raises for the others
        changed = bool(silent)
        later = silent
    else:
        changed = root._version - rec.version > rec.missed or bool(silent)
    if not changed or _restored(rec, root):
        return []
    return later


def _size(rec: CheckpointRecord) -> str:
    shape = "" if rec.shape is None else ", ".join(map(str, rec.shape))
    return f"{rec.dtype}[{shape}]"


def _restored(rec: CheckpointRecord, root: torch.Tensor) -> bool:
    """The bytes are back to what they were before the first write after fn (a swap undone)."""
    before = rec.before
    if before is None:
        return False
    try:
        now = _saved_bytes(rec, root)
        return now is not None and bool(torch.equal(before, now))
    except (RuntimeError, TypeError):
        return False


add_probe("checkpoint records", lambda: len(HOLDERS))
# The names the predictor imports through the folder's __init__.
checkpoint_hazard = hazard_for
checkpoint_record = record_of

# The saved-tensor hook stack sits below this module: it calls up through these.
_hookstack.PACK_WRAPPERS.append(wrap_pack)
_hookstack.ON_STOP.append(clear)
