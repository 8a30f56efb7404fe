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
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from versionwatch._compat import PEEK as _PEEK
from versionwatch._compat import allow_in_peek, storage_address
from versionwatch._explain import _BACKWARD_SUFFIX
from versionwatch._report import Hazard, Modification
from versionwatch._sites import user_site

_ERR = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [{type} [{shape}]] is at version {now}; expected version {saved} instead. "
    "Hint: enable anomaly detection to find the operation that failed to compute its "
    "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False)."
)
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

    __slots__ = ("__weakref__", "forward", "ids", "module", "requires_grad", "silent", "tensor",
                 "version", "writes")

    def __init__(self, t: torch.Tensor, module: str | None, forward: str | None) -> None:
        # A leaf is kept as is, so that `p.data = t` reaches backward as it does
        # unwatched; anything else as a detached alias (same storage and version
        # counter): a saved output kept with its grad_fn would form a cycle.
        base = t._base
        if t.is_leaf:
            self.tensor = t
            self.requires_grad = t.requires_grad
        else:
            self.tensor = t.detach()
            # A view of a parameter (``weight.t()``); never read grad_fn here:
            # touching nodes from Python makes deep graphs crash when freed.
            self.requires_grad = base is not None and base.is_leaf and t.requires_grad
        self.version = t._version
        self.ids = (id(t), None if base is None else id(base))
        self.module = module
        self.forward = forward
        self.writes: tuple[()] | list[Modification] = ()
        self.silent = False

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
                      modified_by=list(self.writes if modified_by is None else modified_by),
                      detected=detected)


class _Local(threading.local):
    """Per-thread strict state; class attributes are the defaults."""

    busy = False  # inside our own reporting: our writes are not the user's
    step: str | None = None  # label of the optimizer step running, if any
    step_checked = False  # that step's writes were checked as a whole, up front
    forward: str | None = None  # label of the root forward running, if any
    modules: list[str] | None = None


class _State:
    """Process-wide strict state, shared by every open strict watcher."""

    def __init__(self) -> None:
        self.registry: dict[int, list[weakref.ref[SavedRecord]]] = {}
        self.owners: list[Any] = []  # open strict watchers
        self.patches: list[tuple[Any, str, Any, bool]] = []
        # id -> weak reference of tensors handed out by ``.data`` (a WeakSet
        # would compare tensors with ==).
        self.data_aliases: dict[int, weakref.ref[torch.Tensor]] = {}
        self.local = _Local()
        self.purge_at = 1024


STATE = _State()
_LOCAL = STATE.local




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


def pack(t: torch.Tensor) -> SavedRecord:
    local = _LOCAL
    stack = local.modules
    rec = SavedRecord(t, stack[-1] if stack else None, local.forward)
    key = _storage_key(t)
    if key:
        registry = STATE.registry
        refs = registry.get(key)
        if refs is None:
            registry[key] = [weakref.ref(rec)]
            if len(registry) > STATE.purge_at:
                _purge()
        else:
            refs.append(weakref.ref(rec))
    return rec


def unpack(rec: SavedRecord) -> torch.Tensor:
    t = rec.tensor
    peeked = _PEEK.records
    if peeked is not None:  # the predictor reads the record (old torch)
        peeked.append(rec)
        return t
    if t._version != rec.version:
        # PyTorch skips its own check for hooked tensors: make the same one,
        # with what the watcher needs to explain it (a write during backward,
        # which no prediction could see).
        err = RuntimeError(_ERR.format(type=t.type(), shape=", ".join(map(str, t.shape)),
                                       now=t._version, saved=rec.version))
        node = torch._C._current_autograd_node()
        err.versionwatch_saved = (  # type: ignore[attr-defined]
            rec, node.name() if node is not None else "(unknown node)")
        raise err
    return t


def _purge() -> None:
    registry = STATE.registry
    # list() copies at once: a writer on another thread may prune meanwhile.
    for key in [k for k, refs in list(registry.items()) if all(r() is None for r in refs)]:
        registry.pop(key, None)
    STATE.purge_at = max(1024, 2 * len(registry))


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
    site = user_site(3)
    label = _LABELS.get(name, f"{name}()" if not name.endswith(")") else name)
    context = _LOCAL.step
    if context:
        if name != "step" and _LOCAL.step_checked:
            return  # the step's writes were checked, and recorded, as a whole
        label = context if name == "step" else f"{context} ({label})"
    stop = STATE.owners[-1] if STATE.owners and STATE.owners[-1].stop_at_write else None
    hazards = []
    for t, rec in hits:
        silent = silent_op or _is_silent(name, t)
        mod = Modification("inplace_op", label + (" (no version bump)" if silent else ""), site)
        if not rec.writes:
            rec.writes = []
        rec.writes.append(mod)
        rec.silent = rec.silent or silent
        if stop is None:
            continue  # the verdict waits for a backward: that graph may never run one
        # No node yet: a write does not tell which node saved the memory.
        h = rec.hazard("", "", "silent" if silent else "inplace", "at_write", [mod])
        hazards.append((h, rec))
    if stop is not None:
        stop._on_strict_write([h for h, _ in hazards], [rec for _, rec in hazards])


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


def _patch(owner: Any, attr: str, new: Any) -> None:
    had = attr in vars(owner)
    old = vars(owner)[attr] if had else getattr(owner, attr)
    STATE.patches.append((owner, attr, old, had))
    setattr(owner, attr, new)


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

    return property(get, set_, doc=original.__doc__)


def _has_out(fn: Any) -> bool:
    doc = getattr(fn, "__doc__", None) or ""
    # The signature line (``linalg.matmul(input, other, *, out=None)``) or the
    # argument list says so; builtins have no inspectable signature.
    return "out (Tensor" in doc or "out=None" in doc.lstrip().partition("\n")[0]


def install() -> None:
    """Patch the in-place entry points (process-wide, until :func:`uninstall`)."""
    tensor = torch.Tensor
    for attr in dir(tensor):
        if attr.endswith("_") and not attr.startswith("__") and attr not in _METADATA_ONLY:
            fn = getattr(tensor, attr, None)
            if callable(fn):
                _patch(tensor, attr, _wrap(attr, fn))
    for attr in _DUNDER_WRITES:
        fn = getattr(tensor, attr, None)
        if fn is not None:
            _patch(tensor, attr, _wrap(attr, fn))
    _patch(tensor, "data", _data_getter())
    for mod in (torch, torch._C._nn, torch.linalg, torch.special, torch.fft):
        prefix = "" if mod is torch or mod is torch._C._nn else mod.__name__[6:] + "."
        for attr in dir(mod):
            if attr.startswith("__"):
                continue
            fn = getattr(mod, attr, None)
            if not callable(fn) or isinstance(fn, type):
                continue
            if attr.endswith("_") and attr not in _METADATA_ONLY:
                _patch(mod, attr, _wrap(attr, fn))
            elif mod is not torch._C._nn and _has_out(fn):
                _patch(mod, attr, _wrap_out(prefix + attr, fn))
    # The module being run, for the records: a thin wrapper keeps nn.Module's
    # fast path (a module hook, even a global one, sends every call down the
    # slow path, which made strict mode 1.3x slower on small models).
    _patch(nn.Module, "_call_impl", _module_call(nn.Module._call_impl))


def uninstall() -> None:
    while STATE.patches:
        owner, attr, old, had = STATE.patches.pop()
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)
    STATE.registry.clear()
    _NAMES.clear()
    _NAME_REFS.clear()


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
        stack.append(names.get(id(self)) or type(self).__name__)
        try:
            return call_impl(self, *args, **kwargs)
        finally:
            stack.pop()

    return _call_impl


def attach(owner: Any) -> Any:
    """Start strict mode for ``owner`` on this thread; returns what :func:`detach` takes."""
    if not STATE.owners:
        install()
    STATE.owners.append(owner)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    return hooks


def detach(owner: Any, hooks: Any) -> None:
    hooks.__exit__(None, None, None)
    end_step()
    _LOCAL.forward = None
    if owner in STATE.owners:
        STATE.owners.remove(owner)
    if not STATE.owners:
        uninstall()


allow_in_peek(unpack)
