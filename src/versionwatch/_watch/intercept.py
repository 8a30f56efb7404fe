"""Where a training loop's events enter versionwatch, and the patches that put them there.

While any watcher is open (:data:`PATCHES`, an anchor of :mod:`_runtime`):

- ``torch.autograd.backward`` and ``grad`` are replaced by stand-ins that hand
  the call to the watcher, which predicts it before it runs (``Tensor.backward``,
  GradScaler, Accelerate's ``accelerator.backward`` and Lightning's manual
  backward all end there);
- ``Optimizer.zero_grad`` is replaced, and two global optimizer step hooks
  (pre and post) are registered;
- TorchScript's builtin table maps the stand-ins to the ops of the originals.

Each entry point finds the watcher the event belongs to (:mod:`_active`) and
captures what only it knows: the user's line, and for a step the frame that
runs it. Forwards enter through :mod:`_forward`'s route instead.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.optim import Optimizer

from versionwatch._compat import (
    dynamo_forget,
    in_graph_trace,
    jit_builtins,
    set_eval_frame,
    skip_code,
    warm_dynamo,
)
from versionwatch._functorch import in_functorch_transform
from versionwatch._predict import read_once
from versionwatch._runtime import Anchor, Call, Change, Entry, Hook, Patch
from versionwatch._sites import site_from
from versionwatch._watch.active import _LOCAL, ACTIVE, current, thread_stack

if TYPE_CHECKING:
    from versionwatch._watch.optimizer_state import OptimizerState
    from versionwatch._watch.protocols import OpenWatcher


def owner(opt: Optimizer) -> tuple[OpenWatcher, OptimizerState] | None:
    """The open watcher that watches ``opt``'s parameters (innermost first), and its state.

    With nested watchers an outer model's optimizer must reach the outer
    watcher, not the innermost one, which would ignore it.
    """
    local = _LOCAL.__dict__  # busy and stack, read without two getattr calls
    if local.get("busy"):
        return None
    stack: list[weakref.ref[OpenWatcher]] | None = local.get("stack")
    if stack is None:
        stack = thread_stack()
    candidates: Sequence[OpenWatcher | None]
    if len(stack) == 1:  # one watcher on this thread
        candidates = [stack[0]()]
    elif stack:
        candidates = [r() for r in reversed(stack)]
    else:
        candidates = ACTIVE.items()[::-1]
    for w in candidates:
        if w is not None and not w.closed:
            state = w._optimizer(opt)
            if state is not None:
                return w, state
    return None


def _patched(api: str, first: str, inputs_at: int) -> Patch:
    """A stand-in for ``torch.autograd.<api>`` that predicts before it calls the original.

    ``first`` is the name of the outputs argument, ``inputs_at`` the position of
    ``inputs`` in the original's signature.

    Invisible to ``torch.compile``, as PyTorch's own ``torch.autograd.backward``
    is (a file dynamo skips): the stand-in's frame is skipped, a trace that
    reaches it breaks there as at the original, and dynamo's frame callback is
    off while our code runs, and back on for the original's call (a user's
    hook that the backward runs is compiled as in a plain run).
    """

    def patched(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        original = patch.old
        w = current()
        if w is None:
            return original(*args, **kwargs)
        prior = set_eval_frame(None) if set_eval_frame is not None else None
        try:
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
                return _resume(prior, original, args, kwargs)
            if in_graph_trace():  # AOT autograd tracing the backward of a compiled graph
                return _resume(prior, original, args, kwargs)
            return w._run_backward(api, outputs, inputs,
                                   functools.partial(_resume, prior, original, args, kwargs),
                                   (args, kwargs), site_from(sys._getframe(1)))
        finally:
            if set_eval_frame is not None:
                set_eval_frame(prior)

    patched.__name__ = patched.__qualname__ = api
    # What torch._dynamo.disable marks: a trace that reaches it breaks there.
    patched._torchdynamo_disable = True  # type: ignore[attr-defined]
    patch = Patch(torch.autograd, api, patched)
    return patch


def _resume(prior: Any, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` under dynamo's frame callback ``prior``, as in a plain run."""
    __tracebackhide__ = True
    if set_eval_frame is None:
        return fn(*args, **kwargs)
    set_eval_frame(prior)
    try:
        return fn(*args, **kwargs)
    finally:
        set_eval_frame(None)


def _before_patching() -> None:
    """Dynamo runs the stand-ins' frames as plain Python (``torch._dynamo.skip``).

    Its tables of torch's functions are built first, if it is imported: with
    PyTorch's own functions in them, not the stand-ins.
    """
    warm_dynamo()
    if skip_code is not None:
        skip_code(_BACKWARD.new.__code__)  # the one code of both stand-ins
        for fn in EAGER:
            skip_code(fn.__code__)


def _after_restoring() -> None:
    """Tables dynamo built meanwhile (imported while we were in) get PyTorch's functions."""
    dynamo_forget([(_BACKWARD.new, _BACKWARD.original), (_GRAD.new, _GRAD.original)])


# backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
_BACKWARD = _patched("backward", "tensors", 5)
backward: Callable[..., Any] = _BACKWARD.new
# grad(outputs, inputs, ...)
_GRAD = _patched("grad", "outputs", 1)
grad: Callable[..., Any] = _GRAD.new


def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad`` while a watcher is open: the original, then the event."""
    prior = set_eval_frame(None) if set_eval_frame is not None else None
    try:
        _ZERO_GRAD.old(self, set_to_none)
        found = owner(self)
        if found is not None:
            found[0]._on_zero_grad(self, set_to_none, found[1], site_from(sys._getframe(1)))
    finally:
        if set_eval_frame is not None:
            set_eval_frame(prior)


_ZERO_GRAD = Patch(Optimizer, "zero_grad", zero_grad)


def step_pre(opt: Optimizer, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook; its caller is the frame that runs the step."""
    prior = set_eval_frame(None) if set_eval_frame is not None else None
    try:
        found = owner(opt)
        if found is not None:
            found[0]._on_step_pre(opt, found[1], sys._getframe(1))
    finally:
        if set_eval_frame is not None:
            set_eval_frame(prior)


def step_post(opt: Optimizer, args: Any, kwargs: Any) -> None:
    """The global optimizer step post-hook."""
    prior = set_eval_frame(None) if set_eval_frame is not None else None
    try:
        found = owner(opt)
        if found is not None:
            found[0]._on_step_post(opt, found[1])
    finally:
        if set_eval_frame is not None:
            set_eval_frame(prior)


# A step or zero_grad() inside a torch.compile'd function: dynamo would trace
# these, and warn at what it cannot trace (sys._getframe) where a plain run
# says nothing. Marked as torch._dynamo.disable marks a function, a trace
# breaks at them (as it does at PyTorch's own zero_grad); their frames run as
# plain Python (skip_code, in _before_patching), and what they call too (the
# eval frame callback is off inside them).
EAGER: tuple[Callable[..., None], ...] = (zero_grad, step_pre, step_post)
for _fn in EAGER:
    setattr(_fn, "_torchdynamo_disable", True)  # noqa: B010 (a function's attribute)


def _changes() -> list[Change]:
    """The process-wide patches of every watcher, in the order applied."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    # TorchScript compiles torch.autograd.grad/backward to aten ops found by the
    # identity of the function it sees: ours must map to the same ops.
    table = jit_builtins()
    return [Call(_before_patching, _after_restoring), _BACKWARD, _GRAD, _ZERO_GRAD,
            Entry(table, id(backward), "aten::backward"), Entry(table, id(grad), "aten::grad"),
            Hook(register_optimizer_step_pre_hook, step_pre),
            Hook(register_optimizer_step_post_hook, step_post)]


# In place while any watcher is open. The originals stay in the patches after
# the last close: a wrapper someone kept a reference to (``from torch.autograd
# import backward`` inside a watch block) still works.
PATCHES = Anchor("autograd and optimizer patches", _changes)
