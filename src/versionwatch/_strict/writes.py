"""Strict mode's write interception: each write to saved memory, seen before it happens.

The Python entry points of every in-place op (the ``Tensor`` methods ending in
``_``, ``x[i] = v``, ``+=`` and friends, the ``torch``/``torch._C._nn`` in-place
functions, ``_foreach_*_``, ``_fused_*_``, ``set_``, ``resize_``, ``out=`` on
the functions of ``torch``, ``torch.linalg``, ``torch.special`` and
``torch.fft``, and the in-place functions ``torch.nn.functional`` calls through
``torch._VF`` (``dropout_``, ``threshold_``, ...) or holds itself (``F.elu_``))
are wrapped (:func:`changes`).
A write whose target shares storage with a live record is recorded with the
op, the user's ``file:line`` and source line, and, for a write inside a library
module's ``forward`` (``nn.Dropout(inplace=True)``), that module and where it
was built (:mod:`_built`); a write to any other memory costs one dict lookup. Writes
through ``.data`` and by fused optimizer kernels bump no version: they are
recorded as ``silent``. ``SavedTensor.register_hooks`` and ``detach_`` are
wrapped too, so that strict's own hooks stay out of the user's way.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from versionwatch._compat import engine_checks_gradients, jit_builtins
from versionwatch._report import Modification, Site, Writer
from versionwatch._runtime import Change, Entry, Patch, Registry
from versionwatch._sites import site_at, user_frames, user_site
from versionwatch._strict import checkpoint as _checkpoint
from versionwatch._strict.gradients import candidates, on_gradient_write
from versionwatch._strict.records import (
    RECORDS,
    SavedRecord,
    holds,
    live,
    mark_of,
    on_detach,
    storage_key,
    unpack,
    writer_at,
)
from versionwatch._strict.thread import THREAD, in_step

if TYPE_CHECKING:
    from versionwatch._report import Hazard

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
    "_unsafe_preserve_version_counter": "a write under _unsafe_preserve_version_counter",
}


_Hits = list[tuple[torch.Tensor, SavedRecord]]


# Strict mode calls up into the watcher and its repairer; it declares the faces it
# needs here, so that nothing below the watcher imports it.
class StrictRepairer(Protocol):
    """A repairer as strict mode sees it: it copies what a write is about to hit."""

    @property
    def names(self) -> dict[int, str]: ...  # id of each watched tensor -> its qualified name

    def repair_write(self, label: str, site: Site | None, hits: _Hits) -> _Hits: ...


class StrictOwner(Protocol):
    """A strict watcher as strict mode sees it."""

    stop_at_write: bool

    @property
    def repairer(self) -> StrictRepairer | None: ...  # read-only here: a Repairer will do

    def on_strict_write(self, hazards: list[Hazard], records: list[SavedRecord]) -> None: ...


# Open strict watchers, oldest first; weakly: one dropped without close() is
# not kept alive by strict mode.
OWNERS: Registry[StrictOwner] = Registry("strict watchers", weak=True)
# ``on_hazard="repair"``: each open strict watcher's repairer, oldest first,
# weakly. Its ``repair_write`` is called with (label, site, hits) before a
# write is recorded, and returns the hits it could not repair.
REPAIRERS: Registry[StrictRepairer] = Registry("strict repairers", weak=True)
# id -> weak reference of tensors handed out by ``.data`` (a WeakSet would
# compare tensors with ==).
_DATA_ALIASES: dict[int, weakref.ref[torch.Tensor]] = {}


def _to_repairers(label: str, site: Site | None, hits: _Hits) -> _Hits:
    """Hand each hit to the innermost repairing watcher that watches its tensor.

    An activation (no watcher knows it) goes to the innermost one, as does
    every hit while only one is open.
    """
    repairers = REPAIRERS.items()
    if not repairers:
        return hits
    if len(repairers) == 1:
        return repairers[0].repair_write(label, site, hits)
    groups: dict[int, _Hits] = {}
    for t, rec in hits:
        own, base = rec.ids
        owner = len(repairers) - 1
        for k in range(len(repairers) - 1, -1, -1):
            names = repairers[k].names
            if own in names or (base is not None and base in names):
                owner = k
                break
        groups.setdefault(owner, []).append((t, rec))
    left: _Hits = []
    for k, group in groups.items():
        left += repairers[k].repair_write(label, site, group)
    return left


def written_tensors(name: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an in-place op ``name`` called with these arguments writes to."""
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
    aliases = _DATA_ALIASES
    for x in (t, t._base):
        if x is not None:
            r = aliases.get(id(x))
            if r is not None and r() is x:
                return True
    return False


def on_write(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             silent: bool = False) -> _Hits | None:
    """Called before an in-place op; records it on the records it hits, and returns those.

    ``silent``: the write bumps no version (a fused optimizer step).
    With ``stop_at_write`` it reports there too, and raises under ``raise``.
    """
    __tracebackhide__ = True
    if _in_backward() != -1 and OWNERS and not THREAD.busy:
        # A hook's write during a backward may hit a gradient that other nodes
        # also receive (:mod:`gradients`).
        THREAD.busy = True
        try:
            _gradient_write(name, args, kwargs)
        finally:
            THREAD.busy = False
    if _checkpoint.REGISTRY and not THREAD.busy:
        _checkpoint_write(name, args, kwargs, silent)
    if not RECORDS or THREAD.busy:
        return None
    hits: list[tuple[torch.Tensor, SavedRecord]] = []
    for t in written_tensors(name, args, kwargs):
        key = storage_key(t)
        if key:
            hits += [(t, rec) for rec in live(key)]
    if not hits:
        return None
    THREAD.busy = True
    try:
        _report_write(name, hits, silent)
    finally:
        THREAD.busy = False
    return hits


_in_backward = torch._C._current_graph_task_id


def _gradient_write(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A write during a backward: watched if it may hit a gradient in flight."""
    __tracebackhide__ = True
    if engine_checks_gradients():
        return  # PyTorch raises for it itself
    targets = candidates(written_tensors(name, args, kwargs))
    if targets:
        label = _LABELS.get(name, f"{name}()" if not name.endswith(")") else name)
        on_gradient_write(label, user_site(), targets, OWNERS.newest())


def _checkpoint_write(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      silent: bool) -> None:
    """Hand a write to the records of tensors saved inside activation checkpointing."""
    targets = list(written_tensors(name, args, kwargs))
    registry = _checkpoint.REGISTRY
    if not any(registry.get(storage_key(t)) for t in targets):
        return  # the usual write: one lookup per target
    if name == "step" and THREAD.step:
        label = THREAD.step
    else:
        label = _LABELS.get(name, f"{name}()" if not name.endswith(")") else name)
    silent = silent or any(_is_silent(name, t) for t in targets)
    THREAD.busy = True
    try:
        _checkpoint.on_write(label, targets, silent)
    finally:
        THREAD.busy = False


def written(hits: _Hits) -> None:
    """After a write that hit ``hits``: the producer PyTorch will name for a saved tensor.

    PyTorch holds a saved input itself and names the ``grad_fn`` it has when
    backward reads it (after ``a.add_(1)``: ``AddBackward0``); strict mode holds
    it weakly, and a helper's local is gone by then. The written tensor's own
    ``grad_fn``, read once the op has made it, is that name.
    """
    for t, rec in hits:
        ref = rec.original
        if ref is not None and ref() is t:
            fn = t.grad_fn
            if fn is not None:
                rec.written_fn = (fn.name(), t.output_nr)


def _report_write(name: str, hits: list[tuple[torch.Tensor, SavedRecord]],
                  silent_op: bool = False) -> None:
    """Record the write on every record it hits; stop here if a watcher asks to."""
    __tracebackhide__ = True
    site = user_site()
    label = _LABELS.get(name, f"{name}()" if not name.endswith(")") else name)
    context = THREAD.step
    if context and name != "step":
        # A step that raised (a vetoing pre-hook, a failing closure, a param group
        # that broke the step's own check before it was done) has left its
        # window: in_step() finds its frame gone and ends it, and the write is
        # the user's, named by its own line.
        if in_step():
            if THREAD.step_checked:
                return  # the step's writes were checked, and recorded, as a whole
        else:
            context = None
    writer: Writer | None = None
    stack: tuple[Site, ...] = ()
    if context:
        label = context if name == "step" else f"{context} ({label})"
    else:
        # The user's frames that led here (a no_grad update in a helper: the
        # loop's call, then the write), and the library module whose forward
        # writes, if it is one's (F.dropout inside nn.Dropout(inplace=True)).
        caller = sys._getframe(2)  # on_write's caller: the entry point's wrapper
        frames = user_frames(caller)
        writer = writer_at(caller, [f.f_code.co_filename for f in frames])
        if len(frames) > 1:
            stack = tuple(site_at(f.f_code.co_filename, f.f_lineno) for f in reversed(frames))
    if REPAIRERS:  # on_hazard="repair": copies first; what is left is recorded
        hits = _to_repairers(label, site, hits)
        if not hits:
            return
    newest = OWNERS.newest()
    stop = newest if newest is not None and newest.stop_at_write else None
    hazards = []
    for t, rec in hits:
        silent = silent_op or _is_silent(name, t)
        mod = Modification("inplace_op", label + (" (no version bump)" if silent else ""), site,
                           writer=writer, stack=stack)
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
    registry, local, owners, in_backward = RECORDS, THREAD, OWNERS, _in_backward
    ckpt = _checkpoint.REGISTRY

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        # A checked step's own writes are skipped; one that raised has left its
        # window, and in_step() finds its frame gone (ending the step). During a
        # backward every write is looked at: it may hit a gradient in flight.
        if (registry or ckpt or (in_backward() != -1 and owners)) and (
                not local.step_checked or not in_step()):
            hits = on_write(name, args, kwargs)
            # A write inside a checkpointed function: did it change the saved bytes?
            changes = _checkpoint.take_pending() if ckpt else None
            if hits or changes:
                out = fn(*args, **kwargs)
                if hits:
                    written(hits)
                if changes:
                    _checkpoint.after_write(changes)
                return out
        return fn(*args, **kwargs)

    return wrapper


def _wrap_out(attr: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    name = f"{attr}(out=)"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs and (RECORDS or _checkpoint.REGISTRY) and kwargs.get("out") is not None:
            on_write(name, (), kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _preserve_class() -> type | None:
    """``torch.autograd._unsafe_preserve_version_counter``, where this torch has it."""
    cls = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    return cls if isinstance(cls, type) and "__enter__" in vars(cls) else None


def _wrap_preserve(enter: Callable[[Any], None]) -> Callable[[Any], None]:
    """Whatever is written inside the block ends at its old version: a silent write.

    DistributedDataParallel broadcasts its buffers inside this block (recent
    torch), from C++, where no wrapper of ours sees the copy; the block is the
    one Python entry it has. Its tensors (``tensors`` on new torch, ``tensor``
    on 2.4) are named before the block runs, so a record they hit keeps its
    bytes now, and the prediction compares them: a broadcast of the same values
    is no hazard.
    """

    @functools.wraps(enter)
    def __enter__(self: Any) -> None:
        __tracebackhide__ = True
        if RECORDS and not THREAD.busy:
            tensors = getattr(self, "tensors", None)
            if tensors is None:
                tensors = (getattr(self, "tensor", None),)
            on_write("_unsafe_preserve_version_counter",
                     ([t for t in tensors if isinstance(t, torch.Tensor) and holds(t)],), {},
                     silent=True)
        return enter(self)

    return __enter__


def _data_getter() -> property:
    original: Any = vars(torch._C.TensorBase)["data"]

    def get(self: torch.Tensor) -> torch.Tensor:
        alias = original.__get__(self)
        if RECORDS:
            aliases = _DATA_ALIASES
            key = id(alias)
            def forget(_: object, k: int = key) -> None:
                aliases.pop(k, None)

            aliases[key] = weakref.ref(alias, forget)
        return alias  # type: ignore[no-any-return]

    def set_(self: torch.Tensor, value: torch.Tensor) -> None:
        if RECORDS:
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
        mark = mark_of(rec)
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
        if RECORDS:
            on_detach(self)
        return fn(self)  # type: ignore[no-any-return]

    return detach_


def changes() -> list[Change]:
    """The wrappers of every write entry point, in the order applied."""
    changes: list[Change] = []
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
    preserve = _preserve_class()
    if preserve is not None:
        changes.append(Patch(preserve, "__enter__", _wrap_preserve(vars(preserve)["__enter__"])))
    changes.append(Patch(tensor, "detach_", _wrap_detach(tensor.detach_)))
    saved: Any = torch._C._autograd.SavedTensor
    changes.append(Patch(saved, "register_hooks", _wrap_register_hooks(saved.register_hooks)))
    # TorchScript compiles a call to a torch function by the function's identity
    # (torch.jit._builtins): our wrappers map to the same aten op, or scripting
    # code that calls torch.relu_ (forward AD's decompositions do) would fail.
    # Built now, before any patch, the table keeps the originals too.
    builtins = jit_builtins()
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
    # torch.nn.functional writes through torch._VF (F.dropout(..., inplace=True)
    # calls _VF.dropout_, F.threshold _VF.threshold_): a module whose __getattr__
    # reads the read-only torch._C._VariableFunctions, not torch, so the wrappers
    # above miss those calls. An attribute set on the module itself wins over its
    # __getattr__ (and is deleted again on restore). And F's own in-place names
    # (F.leaky_relu_, F.elu_, F.threshold_, ...) hold the builtins they were
    # bound to at import, not torch's attributes.
    vf: Any = torch._VF
    functional: Any = torch.nn.functional
    for mod, names in ((vf, dir(torch._C._VariableFunctions)), (functional, dir(functional))):
        for attr in names:
            if not attr.endswith("_") or attr.startswith("__") or attr in _METADATA_ONLY:
                continue
            fn = getattr(mod, attr, None)
            if not isinstance(fn, types.BuiltinFunctionType):
                continue
            new = _wrap(attr, fn)
            changes.append(Patch(mod, attr, new))
            op = builtins.get(id(fn))
            if op is not None:
                changes.append(Entry(builtins, id(new), op))
    return changes
