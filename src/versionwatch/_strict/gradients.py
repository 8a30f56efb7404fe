"""Strict mode: a hook that edits in place a gradient that another node also receives.

The engine hands one gradient tensor to several consumers: ``AddBackward0``
passes the same tensor to both of its inputs, a ``BackwardHookFunction`` passes
its own through, and ``AccumulateGrad`` may keep the tensor it receives as
``.grad``. A hook that modifies such a tensor in place (``g.mul_(s)`` instead of
``return g * s``) changes what the other consumers read too, and no version
check sees it: the gradients are silently wrong.

Nothing is paid until a write happens during a backward to a tensor that could
be a gradient in flight (no ``grad_fn``, no ``requires_grad``): the write
interception (:mod:`writes`) calls :func:`on_gradient_write` then. It finds the
backward's roots (the engine's caller frame, ``_engine_run_backward``, on this
thread or, for a device thread's backward, on another), walks the graph once
per backward, and registers a pre-hook on every node that could still read
the written tensor; a node whose input *is* that tensor (the same
``TensorImpl``), changed since, reads the write: that is the hazard, reported
before that node runs. (``AccumulateGrad`` keeps the tensor it receives as
``.grad`` only when no other node holds it, else a copy: another parameter's
``.grad`` is never the shared tensor, in every tested release.)
The pre-hooks are removed when the backward ends (``queue_callback``), when
the next backward needs them, and when the last strict watcher closes.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import torch
from torch.autograd.graph import Node

from versionwatch import _sites
from versionwatch._report import Hazard, Modification, Site
from versionwatch._runtime import add_probe
from versionwatch._strict.thread import THREAD


class StrictOwner(Protocol):
    """The watcher a report goes to, as this module needs it (``writes.StrictOwner``'s
    face, declared here: :mod:`writes` calls into this module)."""

    def on_strict_write(self, hazards: list[Hazard], records: list[Any]) -> None: ...

# PyTorch's frame that calls into the C++ engine (torch/autograd/graph.py).
_ENGINE_ENTRY = "_engine_run_backward"
# A BackwardHookFunction's backward passes its gradients through unchanged: its
# children receive the hook's gradient as the hook meant them to.
_PASS_THROUGH = "BackwardHookFunctionBackward"

_HOOKS_FILE = torch.utils.hooks.__file__

_LOCK = threading.Lock()


@dataclass
class _Write:
    """One in-place write to a tensor that may be a gradient in flight."""

    ref: weakref.ref[torch.Tensor]
    before: int  # its version before the write
    label: str
    site: Site | None
    receiver: Any  # the node whose hook wrote
    receiver_name: str  # it, in the user's words where known (a module's hooks: the module)
    reported: bool = False  # one report a write: at the first other node that reads it
    # id() of the nodes that receive the tensor through the hook's own node: it
    # hands the tensor itself on (``clone``'s backward, a custom Function that
    # returns its gradient, a BackwardHookFunction), as the hook meant them to.
    via: set[int] = field(default_factory=set)


@dataclass
class _Task:
    """What one backward (graph task) needs: its nodes, and the writes to watch."""

    task_id: int
    nodes: list[Any]
    writes: dict[int, list[_Write]] = field(default_factory=dict)  # by id() of the tensor
    handles: list[Any] = field(default_factory=list)
    hooked: bool = False
    parents: dict[int, list[Any]] | None = None  # id() of a node -> the nodes with an edge to it


# graph task id -> its state; a task ends through its queued callback or is
# swept at the next backward's first write.
_TASKS: dict[int, _Task] = {}


def _roots_from(frame: FrameType | None) -> list[Node] | None:
    """The ``grad_fn``s (or gradient edges' nodes) ``_engine_run_backward`` was called with."""
    while frame is not None:
        if frame.f_code.co_name == _ENGINE_ENTRY:
            outputs = frame.f_locals.get("t_outputs")
            if outputs is None:
                return None
            roots = []
            for t in outputs:
                fn = t.grad_fn if isinstance(t, torch.Tensor) else getattr(t, "node", None)
                if fn is not None:
                    roots.append(fn)
            return roots
        frame = frame.f_back
    return None


def _walk(roots: list[Node]) -> list[Node]:
    """Every node reachable from ``roots``, once each."""
    seen: set[int] = set()
    out: list[Any] = []
    todo = list(roots)
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(fn)
        todo += [c for c, _ in fn.next_functions if c is not None and id(c) not in seen]
    return out


def _graph_of(node: Node) -> list[Node] | None:
    """The nodes of the backward that runs ``node``: from this thread's frames, else another's."""
    roots = _roots_from(sys._getframe(2))
    if roots is not None:
        nodes = _walk_with(roots, node)
        if nodes is not None:
            return nodes
    # A device thread's backward: its caller waits inside _engine_run_backward,
    # the top of that thread's stack. Only such a frame is read, never walked
    # down by f_back: another running thread's f_back can crash CPython
    # (versionwatch._sites).
    waiting = [ident for ident, stack in _sites.thread_stacks().items()
               if stack.frames and stack.frames[0].name == _ENGINE_ENTRY]
    if not waiting:
        return None
    tops = sys._current_frames()
    for ident in waiting:
        top = tops.get(ident)
        if top is None or top.f_code.co_name != _ENGINE_ENTRY:
            continue  # it has left the engine since
        roots = _roots_from(top)
        if roots:
            nodes = _walk_with(roots, node)
            if nodes is not None:
                return nodes
    return None


def _walk_with(roots: list[Node], node: Node) -> list[Node] | None:
    """The nodes reachable from ``roots``, if ``node`` is one of them."""
    nodes = _walk(roots)
    return nodes if any(n is node for n in nodes) else None


def candidates(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    """Of the tensors a write hits, those that may be gradients in flight."""
    # A gradient in flight (no create_graph) has no grad_fn and needs no grad.
    return [t for t in tensors if t.grad_fn is None and not t.requires_grad]


def on_gradient_write(label: str, site: Site | None, targets: list[torch.Tensor],
                      owner: StrictOwner | None) -> None:
    """Before an in-place write during a backward: watch it if it may hit a shared gradient."""
    if not targets or owner is None:
        return
    node = torch._C._current_autograd_node()
    task_id = torch._C._current_graph_task_id()
    if node is None or task_id == -1:
        return
    with _LOCK:
        task = _TASKS.get(task_id)
    if task is None:
        nodes = _graph_of(node)
        if nodes is None:
            return
        task = _Task(task_id, nodes)
        with _LOCK:
            for old in [k for k in _TASKS if k != task_id]:
                # A backward that raised (its callback never ran), or one running
                # on another thread now, which then reports nothing more: a miss,
                # never a false report.
                _end(old)
            _TASKS[task_id] = task
        engine: Any = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: _end(task_id))
    who = _hooked_module(owner) or _consumer_name(owner, node)
    for t in targets:
        w = _Write(weakref.ref(t), t._version, label, site, node, who)
        task.writes.setdefault(id(t), []).append(w)
        _follow(task, w, node)
    if not task.hooked:
        task.hooked = True
        for n in task.nodes:
            if n is node:
                continue
            task.handles.append(n.register_prehook(_reader(task, n, owner)))


def _grad_input_of_hook() -> tuple[Any, ...] | None:
    """``grad_input`` of torch's BackwardHook post-hook running on this thread, if one is."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "hook" and code.co_filename == _HOOKS_FILE:
            found = frame.f_locals.get("grad_input")
            return tuple(found) if isinstance(found, (tuple, list)) else None
        if code.co_name == _ENGINE_ENTRY:
            return None
        frame = frame.f_back
    return None


def _hooked_module(owner: StrictOwner) -> str | None:
    """A module's backward hook writing: ``block.1.inner (Linear)``, from torch's BackwardHook."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _HOOKS_FILE and code.co_name == "hook":
            module = getattr(frame.f_locals.get("self"), "module", None)
            if not isinstance(module, torch.nn.Module):
                return None
            kind = type(module).__name__
            for pname, p in module.named_parameters():
                full = _name_of(owner, p)
                if full is not None and full.endswith("." + pname):
                    return f"{full[:-len(pname) - 1]} ({kind})"
            return f"a {kind}"
        if code.co_name == _ENGINE_ENTRY:
            return None
        frame = frame.f_back
    return None


def _follow(task: _Task, w: _Write, node: Node) -> None:
    """Note which of ``node``'s children it hands the written tensor itself to."""
    nexts = [c for c, _ in node.next_functions]
    if not any(c is not None for c in nexts):
        return
    name = node.name()
    if name == _PASS_THROUGH:
        # It hands each gradient through unchanged, and a post-hook cannot be
        # added inside its own hooks. In a full backward hook (BackwardHook's
        # post-hook, whose frame holds the node's outputs as ``grad_input``) the
        # children at the slots that hold the tensor receive it; elsewhere every
        # child may.
        outputs = _grad_input_of_hook()
        w.via.update(id(c) for i, c in enumerate(nexts) if c is not None and (
            outputs is None or (i < len(outputs) and outputs[i] is w.ref())))
        return
    if name == "torch::autograd::AccumulateGrad":
        return  # no children; and a post-hook would change whether it keeps the tensor

    def post_hook(grad_inputs: tuple[torch.Tensor | None, ...],
                  grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        t = w.ref()
        if t is not None:
            w.via.update(id(c) for c, g in zip(nexts, grad_inputs)
                         if c is not None and g is t)
        return None

    task.handles.append(node.register_hook(post_hook))


def _reader(task: _Task, consumer: Any, owner: StrictOwner) -> Any:
    """A pre-hook for ``consumer``: does it read a watched write's tensor, changed?"""
    ref = weakref.ref(owner)

    def pre_hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if torch._C._current_graph_task_id() != task.task_id:
            return None  # left by a backward that raised, on a graph run again
        writes = task.writes
        for g in grad_outputs:
            if g is None:
                continue
            for w in writes.get(id(g), ()):
                # The very tensor written (an id is reused only once it is dead).
                if w.ref() is not g or w.reported or g._version == w.before:
                    continue
                if _same_node(consumer, w.receiver):
                    continue  # the hook's own node reads what its hook made: as meant
                if id(consumer) in w.via:
                    _follow(task, w, consumer)  # received through the hook's node: as meant
                    continue
                w.reported = True
                o = ref()
                if o is not None:
                    _report(o, task, w, consumer)
        return None

    return pre_hook


def _same_node(a: Node, b: Node) -> bool:
    """The same autograd node, though torch may hand out two Python objects for it.

    AccumulateGrad nodes all share one sequence number: theirs is their leaf.
    """
    if a is b:
        return True
    va, vb = getattr(a, "variable", None), getattr(b, "variable", None)
    if va is not None or vb is not None:
        return va is not None and va is vb
    return bool(a.name() == b.name() and a._sequence_nr() == b._sequence_nr())


def _producers(task: _Task, receiver: Node, consumer: Node) -> list[str]:
    """The node that handed the tensor to ``consumer``: one with an edge to both, else
    the one other node with an edge to ``consumer``."""
    if task.parents is None:
        task.parents = {}
        for n in task.nodes:
            for c, _ in n.next_functions:
                if c is not None:
                    task.parents.setdefault(id(c), []).append(n)
    above = {id(n) for n in task.parents.get(id(receiver), [])}
    others = [n for n in task.parents.get(id(consumer), []) if n is not receiver]
    both = [str(n.name()) for n in others if id(n) in above]
    return both or ([str(others[0].name())] if len(others) == 1 else [])


def _name_of(owner: StrictOwner, t: torch.Tensor) -> str | None:
    """The watcher's name for ``t``, if it watches ``t`` itself.

    By the watcher's ledger, which holds each tensor weakly beside its name: an
    ``id()`` alone may be a dead tensor's, reused (a module watched as a
    temporary is gone, and its parameters' ids are a new model's).
    """
    ledger = getattr(owner, "ledger", None)
    tracked = getattr(ledger, "tracked", None)
    found = tracked.get(id(t)) if isinstance(tracked, dict) else None
    if found is None or found.ref() is not t:
        return None
    name = found.name
    return name if isinstance(name, str) else None


def _consumer_name(owner: StrictOwner, consumer: Node) -> str:
    variable = getattr(consumer, "variable", None)
    if variable is None:
        return str(consumer.name())
    name = _name_of(owner, variable)
    return f"AccumulateGrad of {name}" if name else "AccumulateGrad of a leaf tensor"


def _report(owner: StrictOwner, task: _Task, w: _Write, consumer: Node) -> None:
    """Deliver the hazard through the watcher's on_hazard, as a write's report."""
    from versionwatch._report import SILENT_TAIL, gradient_consumer, silent_fix

    __tracebackhide__ = True
    t = w.ref()
    producers = _producers(task, w.receiver, consumer)
    h = Hazard(
        "silent", producers[0] if producers else "", "", cause="gradient",
        hidden_by=f"the hook at {w.site}" if w.site else "a hook",
        detected="at_write",
        modified_by=[Modification("inplace_op", w.label, w.site)],
    )
    if t is not None:
        h.shape, h.dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")
        h.device = str(t.device)
    h.notes.append(gradient_consumer(w.receiver_name, _consumer_name(owner, consumer)))
    h.notes.append(SILENT_TAIL)
    h.fix = silent_fix(h)
    prior, THREAD.busy = THREAD.busy, True  # the report's own writes are not the user's
    try:
        owner.on_strict_write([h], [])
    finally:
        THREAD.busy = prior


def _end(task_id: int) -> None:
    """The backward ended (or was abandoned): its pre-hooks come off."""
    task = _TASKS.pop(task_id, None)
    if task is not None:
        for handle in task.handles:
            handle.remove()


def end_all() -> None:
    """The last strict watcher closed: every pre-hook comes off."""
    with _LOCK:
        for task_id in list(_TASKS):
            _end(task_id)


def pending_hooks() -> int:
    """How many node pre-hooks strict mode holds now (for tests: 0 after close)."""
    return sum(len(t.handles) for t in _TASKS.values())


# versionwatch.installed() counts them: none once the backwards and watchers are done.
add_probe("gradient node hooks", pending_hooks)
