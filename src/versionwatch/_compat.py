"""What the running torch can do: the one place where torch versions differ.

Every difference is a probe of a feature, read once at import, never a version
string. The rest of versionwatch asks these names and takes another route
where a feature is missing:

- ``SAVED_INTROSPECTION``: a raw saved tensor (``grad_fn._raw_saved_*``) shows
  its unpack hook and its data. Without it (torch 2.4 and 2.6 have only
  ``register_hooks``), reading a saved tensor is the only way to learn whether
  it carries hooks, and reading a hooked one would run the hook: user code, or
  a non-reentrant checkpoint's recomputation. :func:`peek` reads it with a trap
  that stops any Python hook before its first line runs.
- ``SAVED_UNPACK``: a raw saved tensor unpacks alone (``raw.unpack()``), so
  each element of a saved list is checked by itself; without it (2.10) the
  list is checked as a whole and a failure placed by its data.
- ``USER_FN_ATTR``: the method of ``BackwardCFunction`` that a custom
  Function's backward goes through (``_get_user_fn`` on new torch, ``apply``
  on old), which the predictor swaps to refuse running user code.
- ``CLEARS_ON_ACCESS``: a custom Function can ask PyTorch to drop its saved
  tensors at the first read of ``ctx.saved_tensors``
  (``clear_saved_tensors_on_access``); :func:`clears_on_access` tells such a
  node, whose saved tensors the predictor must never read.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch.autograd.function import BackwardCFunction

if TYPE_CHECKING:
    from torch import nn
    from torch.autograd.graph import Node


SavedTensor: Any = torch._C._autograd.SavedTensor

SAVED_INTROSPECTION: bool = hasattr(SavedTensor, "unpack_hook") and hasattr(SavedTensor, "data")
"""A raw saved tensor shows its unpack hook and data (else :func:`peek` reads it)."""

SAVED_UNPACK: bool = hasattr(SavedTensor, "unpack")
"""A raw saved tensor can be unpacked (checked) alone, without its node."""

USER_FN_ATTR: str = "_get_user_fn" if hasattr(BackwardCFunction, "_get_user_fn") else "apply"
"""``BackwardCFunction``'s method that every custom backward call goes through."""

CLEARS_ON_ACCESS: bool = hasattr(torch.autograd.Function, "clear_saved_tensors_on_access")
"""A custom Function can have its saved tensors cleared at their first read."""


def clears_on_access(fn: Node) -> bool:
    """Whether reading ``fn.saved_tensors`` (a custom Function's node) would clear them.

    PyTorch copies the Function class's flag into the node when it runs the
    forward; the class is the node's ``_forward_cls``.
    """
    if not CLEARS_ON_ACCESS:
        return False
    cls = getattr(type(fn), "_forward_cls", None)
    return getattr(cls, "clear_saved_tensors_on_access", False) is True


storage_address: Callable[[torch.Tensor], int] | None = getattr(
    torch._C, "_storage_address", None)
"""A storage's identity without building a storage object, where torch has it."""


sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
"""The sequence number the next autograd node of this thread will get, where torch shows it."""


def _is_compiling_fallback() -> bool:
    return False


is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", _is_compiling_fallback)
"""Whether dynamo is tracing the caller (our hooks stay out of traces)."""

_COMPILER: Any = getattr(torch, "compiler", None)
COMPILING_FLAG: bool = is_compiling is not _is_compiling_fallback and isinstance(
    getattr(_COMPILER, "_is_compiling_flag", None), bool)
"""``torch.compiler._is_compiling_flag`` exists: what :func:`is_compiling` returns
outside TorchScript, which eager code can read without the call."""
COMPILER_FLAG_OWNER: Any = _COMPILER if COMPILING_FLAG else None
"""``torch.compiler`` where it has that flag (read as ``._is_compiling_flag``), else None."""


is_tracing: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_dynamo_compiling", is_compiling)
"""Folded to True inside a torch.compile trace, and three times cheaper than
:func:`is_compiling`, which also covers torch.export."""


_EVAL_FRAME: Any = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)

set_eval_frame: Callable[[Any], Any] | None = getattr(_EVAL_FRAME, "set_eval_frame", None)
"""Dynamo's frame callback of this thread, replaced; returns the one it replaced.

``None`` lets every frame run as plain Python (what ``torch._dynamo.disable``
sets around the function it wraps). A C function: no import of ``torch._dynamo``."""


def _code_skipper() -> Callable[[CodeType], None] | None:
    skip = getattr(_EVAL_FRAME, "skip_code", None)  # torch < 2.6 or so
    if skip is not None:
        return skip  # type: ignore[no-any-return]
    strategy = getattr(_EVAL_FRAME, "set_code_exec_strategy", None)
    frame_exec = getattr(_EVAL_FRAME, "_FrameExecStrategy", None)
    action = getattr(_EVAL_FRAME, "_FrameAction", None)
    if strategy is None or frame_exec is None or action is None:
        return None

    def skip_code(code: CodeType) -> None:
        # What torch._dynamo.eval_frame.skip_code does: this frame runs as plain
        # Python, the frames it calls as dynamo decides.
        strategy(code, frame_exec(action.SKIP, action.DEFAULT))

    return skip_code


skip_code: Callable[[CodeType], None] | None = _code_skipper()
"""Dynamo skips frames of this code object, as ``torch._dynamo.skip`` marks a
function (a C function: no import of ``torch._dynamo``); None where torch has none."""


def _dynamo_tables(build: bool) -> list[dict[object, object]]:
    """Dynamo's cached tables of torch's functions (if imported), built now if ``build``."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    variables = sys.modules.get("torch._dynamo.variables.torch")
    in_graph = getattr(variables, "TorchInGraphFunctionVariable", None)
    tables = []
    for cached in (getattr(rules, "get_torch_obj_rule_map", None),
                   getattr(in_graph, "_get_handlers", None)):
        info = getattr(cached, "cache_info", None)
        if cached is None or info is None:
            continue
        try:
            if build or info().currsize:
                table = cached()
                if isinstance(table, dict):
                    tables.append(table)
        except Exception:  # dynamo's own business: it builds them at its first trace
            pass
    return tables


def warm_dynamo() -> None:
    """Have dynamo, if imported, build its cached tables of torch's functions now.

    Dynamo builds them at its first trace, by name (``torch.autograd.grad``
    is what that name holds then), and keeps them: built while a watcher's
    stand-ins hold those names, they would take a stand-in for torch's
    function. Called before the stand-ins go in.
    """
    _dynamo_tables(build=True)


def dynamo_forget(pairs: list[tuple[object, object]]) -> None:
    """In dynamo's tables built while the stand-ins were in, each ``(stand-in, original)``
    pair's stand-in gives its place back to the original (called once they are out)."""
    for table in _dynamo_tables(build=False):
        for new, old in pairs:
            if new in table and old not in table:
                table[old] = table.pop(new)


def _tracing_modes() -> Callable[[], bool]:
    get = getattr(torch._C, "_get_dispatch_mode", None)
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    found = [getattr(keys, k) for k in ("PROXY", "FUNCTIONAL") if hasattr(keys, k)]
    if get is None or not found:
        return lambda: False

    def in_graph_trace() -> bool:
        return any(get(k) is not None for k in found)

    return in_graph_trace


in_graph_trace: Callable[[], bool] = _tracing_modes()
"""Whether a graph is being traced (make_fx, AOT autograd's joint graph: a proxy or
functionalization mode is on): a backward called now is traced, not run."""


UNREAD = object()
"""What :func:`peek` returns when strict's records came back but the value did not."""


def zero_grads(fn: Node) -> list[torch.Tensor]:
    """Zero gradients to call ``fn`` (a node) with, shaped as backward would pass them.

    Old torch shows no ``_input_metadata``; then a 0-d zero stands in, which
    CopySlices (the only node called this way) broadcasts into its base.
    """
    metas = getattr(fn, "_input_metadata", None)
    if metas is None:
        return [torch.zeros(())]
    return [torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in metas]


class InputMetadata(Protocol):
    """What torch's C++ ``InputMetadata`` of a node's input shows (``Node._input_metadata``)."""

    @property
    def shape(self) -> torch.Size: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...


def input_metadata(fn: Node) -> InputMetadata | None:
    """The metadata of ``fn``'s first input (its gradient), or None where torch hides it."""
    metas: list[InputMetadata] | None = getattr(fn, "_input_metadata", None)
    return metas[0] if metas else None


class HookedSaved(Exception):
    """A saved tensor's unpack hook was about to run inside :func:`peek`."""


class ProfiledSaved(HookedSaved):
    """A C profiler holds this thread, so :func:`peek` has no trap and reads nothing."""


class _Peek(threading.local):
    active = False
    # strict mode's records (_strict.records.SavedRecord): a leaf does not import them
    records: list[object] | None = None
    holder: object = None  # a checkpoint unpack hook's argument, refused (see the end)


PEEK = _Peek()
_PROFILER_SAID = False
_ALLOWED: set[CodeType] = set()


def allow_in_peek(fn: Callable[..., object]) -> None:
    """Let ``fn`` (our own unpack hook) run inside :func:`peek`; it reads ``PEEK``."""
    _ALLOWED.add(fn.__code__)


def _anomaly_stack() -> None:
    # Anomaly mode records a stack for each node it makes, through Python:
    # reading a saved view rebuilds the view's node. That is torch's, not a hook.
    import torch.fx.traceback as fx_traceback

    _ALLOWED.add(fx_traceback.format_stack.__code__)


def _trap(frame: FrameType, event: str, arg: object) -> None:
    if event != "call" or not PEEK.active:
        return
    f: FrameType | None = frame
    while f is not None and f.f_code is not _PEEK_CODE:
        if f.f_code in _ALLOWED:
            return  # ours or torch's own, and whatever they call
        f = f.f_back
    PEEK.active = False
    raise HookedSaved


def peek(owner: Node, attr: str) -> tuple[object, list[object]]:
    """Read ``getattr(owner, attr)`` (a saved-tensor getter) with every Python call refused.

    Returns what it read and the strict records that strict mode's own
    unpack hook handed over instead of checking them. A getter of a saved
    tensor without hooks runs PyTorch's version check in C++ and calls no
    Python; one with hooks calls its unpack hook, and the trap raises
    :class:`HookedSaved` before the hook's first line (PyTorch has changed
    nothing by then). A ``RuntimeError`` is PyTorch's own verdict.

    Raises:
        HookedSaved: the getter was about to run Python code (a hook);
            :class:`ProfiledSaved` where a C profiler left no trap to set.
        RuntimeError: PyTorch's check failed (stale or freed).
    """
    previous = sys.getprofile()
    if previous is not None and not callable(previous):
        # A C profiler (cProfile before Python 3.12) cannot be set back once
        # replaced: without the trap, reading could run a hook.
        global _PROFILER_SAID
        if not _PROFILER_SAID:
            _PROFILER_SAID = True
            logging.getLogger("versionwatch").warning(
                "versionwatch: a C profiler (cProfile) runs on this thread, and this torch "
                "hides which saved tensors have hooks: saved tensors are not verified while "
                "it runs (see docs/versions.md)")
        raise ProfiledSaved
    records: list[object] = []
    PEEK.records = records
    PEEK.active = True
    # A user's dispatch mode or tensor subclass would see the unpacked tensors
    # come back (PyTorch's own unpack makes aliases); a read is not an op.
    no_dispatch = torch._C._DisableTorchDispatch()
    no_dispatch.__enter__()  # type: ignore[no-untyped-call]
    sys.setprofile(_trap)
    try:
        # getattr is C: the trap sees the getter's Python callees, not the call.
        return getattr(owner, attr), records
    except HookedSaved:
        if records:
            # Our own hook ran first; a user's dispatch mode saw the tensors
            # come back: the records are what a check needs.
            return UNREAD, records
        raise
    finally:
        sys.setprofile(previous)  # a Python profiler misses only this read
        no_dispatch.__exit__(None, None, None)
        PEEK.active = False
        PEEK.records = None


_PEEK_CODE = peek.__code__
if not SAVED_INTROSPECTION:
    _anomaly_stack()


def fsdp_unsharded(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(owning module, parameter name, unsharded parameter)`` of an FSDP2 module.

    ``fully_shard`` keeps each parameter twice: the sharded one that
    ``named_parameters()`` shows between forwards, and an unsharded one, made at
    the first forward, that the forward uses and autograd saves. The state's
    layout differs: one ``_fsdp_param_group`` (torch 2.4, under
    ``torch.distributed._composable.fsdp``) or a list ``_fsdp_param_groups``.
    """
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    try:
        state = get()
    except Exception:  # not (yet) a managed module: nothing to name
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    out = []
    for group in groups:
        for fp in getattr(group, "fsdp_params", ()):
            info = getattr(fp, "_module_info", None)
            t = getattr(fp, "_unsharded_param", None)
            if info is not None and isinstance(t, torch.Tensor):
                out.append((info.module, str(info.param_name), t))
    return out


def fully_shard_fn() -> Callable[..., object] | None:
    """FSDP2's ``fully_shard``, where this torch has it (imported on demand)."""
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            mod = __import__(where, fromlist=["fully_shard"])
        except ImportError:
            continue
        fn = getattr(mod, "fully_shard", None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def fsdp2_runs_on_cpu() -> bool:
    """Whether FSDP2 can run on CPU (gloo): its streams come from the device's module.

    torch 2.4's ``FSDPCommContext.init`` makes ``torch.cuda.Stream``s whatever the
    device; later releases take the device (``lazy_init(device)``).
    """
    if fully_shard_fn() is None:
        return False
    for where in ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                  "torch.distributed._composable.fsdp._fsdp_param_group"):
        try:
            groups = __import__(where, fromlist=["FSDPCommContext"])
        except ImportError:
            continue
        return hasattr(getattr(groups, "FSDPCommContext", None), "lazy_init")
    return False


def seq_clock() -> int:
    """The autograd sequence number now: nodes made before have a number no larger, after larger.

    The number of a node made now, less one: that is what a probe node made
    here would have got, without making one (a tensor and a node, about 10 us).
    Torch without ``sequence_nr`` makes the probe.
    """
    if sequence_nr is not None:
        return sequence_nr() - 1
    if torch.is_inference_mode_enabled():
        # An inference tensor records no node; the counter is the same outside.
        with torch.inference_mode(False):
            return seq_clock()
    with torch.enable_grad():
        probe = torch.empty(0, requires_grad=True).view(0)
    fn = probe.grad_fn
    assert fn is not None
    return int(fn._sequence_nr())


def jit_builtins() -> dict[int, str]:
    """TorchScript's table of Python functions it compiles as aten ops, by ``id``."""
    import torch.jit._builtins as builtins

    table: dict[int, str] = builtins._get_builtin_table()  # type: ignore[no-untyped-call]
    return table


def _module_call_hooks() -> tuple[dict[Any, Any], ...] | None:
    """The global hook dicts that ``nn.Module._call_impl`` checks before its fast path.

    With these and the module's own four hook dicts empty, and no JIT trace,
    ``_call_impl`` only calls ``self.forward`` (torch 2.4 to 2.13 alike); a
    wrapper of it can then call ``forward`` itself, and adds no frame to a
    module call. None where ``_call_impl`` reads other names: call it always.
    """
    from torch.nn.modules import module

    names = ("_global_backward_pre_hooks", "_global_backward_hooks",
             "_global_forward_hooks", "_global_forward_pre_hooks")
    code_names = set(module.Module._call_impl.__code__.co_names)
    own = {"_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks",
           "_get_tracing_state", "forward"}
    if not (own | set(names)) <= code_names:
        return None
    found = [d for n in names if isinstance(d := getattr(module, n, None), dict)]
    return tuple(found) if len(found) == len(names) else None


MODULE_CALL_HOOKS = _module_call_hooks()
"""The global module hook dicts that decide ``_call_impl``'s fast path, or None (unknown)."""


# --- strict fingerprints (issue #34): is a user's mode active? ------------------------
# A fingerprint runs a few tensor ops inside strict mode's pack hook and before
# backward; under a user's TorchFunctionMode or TorchDispatchMode those ops would
# reach the user's mode (a FLOP counter would count them). Fingerprints step
# aside while any mode is on the stacks; where torch has no way to tell (None),
# they step aside always, which reports nothing rather than something wrong.


def _modes_active() -> Callable[[], bool] | None:
    function = getattr(torch._C, "_len_torch_function_stack", None)
    dispatch = getattr(torch._C, "_len_torch_dispatch_stack", None)
    if function is None or dispatch is None:
        return None

    def active() -> bool:
        return bool(function() or dispatch())

    return active


MODES_ACTIVE = _modes_active()
"""Whether a TorchFunctionMode or TorchDispatchMode is active on this thread, or None."""


# --- Gradients edited in place by a hook (issue #34, cause "gradient") -------------
# PyTorch's PR #178293 (unmerged as far as we know) proposed that the engine record
# each gradient's version when its input buffer is finalized and check it when the
# next node consumes it. Where a torch does, it raises itself for a hook's in-place
# edit of a shared gradient, and strict mode reports nothing of its own. A probe,
# run once on first use: a hook scales in place the gradient that AddBackward0
# hands to both of its inputs, before the other input's node reads it.
_ENGINE_CHECKS_GRADIENTS: list[bool] = []


def engine_checks_gradients() -> bool:
    """Whether this torch raises for a hook's in-place edit of a shared gradient."""
    if not _ENGINE_CHECKS_GRADIENTS:
        _ENGINE_CHECKS_GRADIENTS.append(False)  # while probing: a write here is not reported
        try:
            # Under the caller's inference_mode or no_grad no graph would be built.
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.ones(1, requires_grad=True)
                a, b = x * 1.0, x * 1.0
                # b's node was made last and runs first; a's then reads the write.
                b.register_hook(lambda g: g.mul_(2))  # type: ignore[no-untyped-call]
                # The engine itself: no watcher's stand-in sees the probe.
                engine: Any = torch.autograd.Variable._execution_engine
                engine.run_backward((a + b,), (torch.ones(1),), False, False, (x,), False,
                                    False)
        except RuntimeError as e:
            # PyTorch's words for a stale tensor; any other failure says nothing.
            _ENGINE_CHECKS_GRADIENTS[0] = "inplace operation" in str(e)
    return _ENGINE_CHECKS_GRADIENTS[0]

# --- non-reentrant activation checkpointing (torch.utils.checkpoint) -----------------
# ``checkpoint(fn, x, use_reentrant=False)`` pushes a ``_checkpoint_hook``: a
# saved_tensors_hooks pair whose pack stores an empty ``_Holder`` and whose
# unpack reruns ``fn``; both are closures over the ``_CheckpointFrame`` (its
# ``weak_holders``, ``early_stop``, ``forward_completed``). The same layout from
# torch 2.4 to 2.13; probed from the code, never from a version string.


def _checkpoint_codes() -> tuple[Any, frozenset[Any], Any]:
    """The code objects of checkpoint's pack and unpack closures, and its generator's."""
    try:
        import torch.utils.checkpoint as ckpt
    except ImportError:  # pragma: no cover - every supported torch has it
        return None, frozenset(), None
    hook = getattr(ckpt, "_checkpoint_hook", None)
    init = getattr(getattr(hook, "__init__", None), "__code__", None)
    if init is None:
        return None, frozenset(), None
    codes = {c.co_name: c for c in init.co_consts if hasattr(c, "co_freevars")}
    pack = codes.get("pack_hook")
    unpacks = frozenset(c for n, c in codes.items()
                        if n.startswith("unpack_hook") and "frame" in c.co_freevars)
    if pack is None or "frame" not in pack.co_freevars:
        return None, frozenset(), None
    gen = getattr(getattr(ckpt, "_checkpoint_without_reentrant_generator", None),
                  "__code__", None)
    return pack, unpacks, gen


CHECKPOINT_PACK_CODE, CHECKPOINT_UNPACK_CODES, CHECKPOINT_GENERATOR_CODE = _checkpoint_codes()
"""Checkpoint's pack closure code, its unpack closures' codes, its generator's code."""


def checkpoint_frame(hook: Any) -> Any:
    """The ``_CheckpointFrame`` of a non-reentrant checkpoint's pack or unpack hook, else None."""
    code = getattr(hook, "__code__", None)
    if code is None or (code is not CHECKPOINT_PACK_CODE and code not in CHECKPOINT_UNPACK_CODES):
        return None
    cells = hook.__closure__
    frame = cells[code.co_freevars.index("frame")].cell_contents
    # The frame's parts that versionwatch reads: absent, the hook is not the one probed.
    if not hasattr(frame, "weak_holders") or not hasattr(frame, "early_stop"):
        return None
    return frame


def _early_stop_probes() -> tuple[bool, bool]:
    import inspect

    import torch.utils.checkpoint as ckpt

    globally = hasattr(ckpt, "set_checkpoint_early_stop")
    try:
        per_call = "early_stop" in inspect.signature(ckpt.checkpoint).parameters
    except (TypeError, ValueError):  # pragma: no cover
        per_call = False
    return globally, per_call


CHECKPOINT_EARLY_STOP_GLOBAL, CHECKPOINT_EARLY_STOP_PER_CALL = _early_stop_probes()
"""Early stop set by ``set_checkpoint_early_stop`` (every supported torch); per call,
``checkpoint(..., early_stop=)`` (newer torch). Either way the frame's own
``early_stop`` holds what its recomputation will do."""

SELECTIVE_CHECKPOINT = hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
"""``create_selective_checkpoint_contexts`` is public (not on torch 2.4)."""

CHECKPOINT_SLOTS_SHOWN = CHECKPOINT_PACK_CODE is not None and hasattr(
    torch._C._autograd.SavedTensor, "data")
"""A hooked saved slot shows its checkpoint ``_Holder`` (``.data``) and unpack hook:
strict mode's checkpoint records map to the slots only then (not on torch 2.4)."""


def _checkpoint_trap(frame: FrameType, event: str, arg: object) -> None:
    """:func:`peek`'s trap, which first notes the holder a checkpoint unpack hook was given.

    On torch that hides a hooked slot's data, the only sight of checkpoint's
    ``_Holder`` is the argument its unpack hook is called with: the trap sees
    the call before the hook's first line, keeps the holder in ``PEEK.holder``
    and refuses the call as before (:class:`HookedSaved`).
    """
    if event == "call" and PEEK.active and frame.f_code in CHECKPOINT_UNPACK_CODES:
        PEEK.holder = frame.f_locals.get("holder")
    _plain_trap(frame, event, arg)


_plain_trap = _trap
if CHECKPOINT_UNPACK_CODES:
    globals()["_trap"] = _checkpoint_trap  # peek() reads the global at each call

CHECKPOINT_HOLDER_PEEKED = bool(CHECKPOINT_UNPACK_CODES) and not CHECKPOINT_SLOTS_SHOWN
"""Where torch hides a hooked slot's data, :func:`peek` still finds checkpoint's holder."""
