"""The predictor: what a backward would do, decided from the graph before it runs.

:func:`check` and :func:`assert_backward_safe` for users; :func:`predict`, the
gate and :func:`raise_for` for a watcher. A prediction walks the graph
(``_graph``), works out which nodes run and in what order as
``torch/csrc/autograd/engine.cpp`` would (``_engine``), and reads every tensor
those nodes would unpack (``_checker``). The verdict for each saved tensor comes
from PyTorch itself: unpacking a saved variable runs the very version check
that backward runs, so a prediction can only disagree with backward about
*which* nodes run, never about a tensor.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Union

import torch
from torch.autograd.graph import Node

from versionwatch import _native_state
from versionwatch._distributed import rank
from versionwatch._naming import Names, name_of, resolve_names
from versionwatch._predict import engine as _engine
from versionwatch._predict.arguments import Api, BadCall, Call, Edge, after_run, bind, parse
from versionwatch._predict.checker import CHECKER
from versionwatch._predict.graph import Graph, lease
from versionwatch._report import FreedGraphError, InplaceModificationError, Report, fix_for
from versionwatch._strict import SavedRecord

TensorOrTensors = Union[Edge, Sequence[Edge]]
Inputs = Union[Edge, Iterable[Edge], Mapping[str, torch.Tensor]]
# One gradient per output, as torch.autograd.backward's grad_tensors (None: ones for a scalar).
GradOutputs = Union[torch.Tensor, Sequence[Union[torch.Tensor, None]]]


def check(
    outputs: TensorOrTensors,
    *,
    inputs: Inputs | None = None,
    grad_outputs: GradOutputs | None = None,
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
    if CHECK_OBSERVERS and not _QUIET.on:
        frame = sys._getframe(1)
        for observe in tuple(CHECK_OBSERVERS):
            observe(report, frame)
    return report


# Told of each report that check() (and so assert_backward_safe) hands out, with
# the caller's frame: the explicit seam for whoever must see a program's own checks
# (versionwatch fix's child takes a hazard found there for the program's failure),
# so that nobody replaces check itself.
CheckObserver = Callable[[Report, FrameType], None]
CHECK_OBSERVERS: list[CheckObserver] = []


class _Quiet(threading.local):
    on = False


_QUIET = _Quiet()


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Checks made inside are none of the program's: observers are not told of them.

    The native helper's self-test checks graphs of its own, and a watching
    ``versionwatch fix`` child must not take them for the program's failures.
    """
    before, _QUIET.on = _QUIET.on, True
    try:
        yield
    finally:
        _QUIET.on = before


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
    call = parse(api, outputs, inputs)
    gate = GATE.fn
    if call.inputs is None and not silent:
        ext = _native_state.CURRENT  # decided by the watcher's first backward
        # Native only while this thread is alone: the gate then needs no nodes
        # (a thread started meanwhile makes an empty one block, as unknown).
        if ext is not None and (gate is None or threading.active_count() == 1):
            if gate is not None:
                gate(())  # once, before any saved tensor is read
            nodes, checked, flagged = ext.check(_engine.roots(call.outputs)[0])
            if not flagged:
                # Exact: every reachable node (a superset of what runs) has
                # passed PyTorch's own check, as the Python predictor's walk.
                return Report(nodes=nodes, saved_checked=checked)
            gate = None  # anything found, or any doubt: Python writes the report
    return _predict(call, name_map, silent, gate)[0]


class _Gate(threading.local):
    fn: Callable[[Sequence[Node]], None] | None = None


GATE = _Gate()


def _predict(
    call: Call, name_map: dict[int, str], silent: dict[int, int] | None = None,
    gate: Callable[[Sequence[Node]], None] | None = None,
) -> tuple[Report, list[int]]:
    """The report, and the indices of the inputs that no gradient would reach."""
    outs, ins = call.outputs, call.inputs
    roots, root_edges, leaf_roots = _engine.roots(outs)
    graph = Graph()
    unreached: list[int] = []
    # The walk creates a wrapper per node, which would trigger the cyclic GC
    # again and again on a big graph (it made a 100k-node check 5x slower);
    # nothing here makes cycles, so it is paused for the walk, as a bulk load.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        checker = CHECKER(silent)
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
            targets, unreached = _engine.targets(graph, call, root_edges, leaf_roots)
            executed = _engine.executed(graph, targets, accumulate=call.api == "backward")
            checker.run(graph.nodes, executed)
            count = sum(executed)
        report = Report(
            unverifiable=checker.unverifiable,
            unverifiable_why=checker.why,
            nodes=count,
            saved_checked=checker.checked,
        )
        if checker.findings:
            report.rank = rank()
            position = _engine.execution_order(graph, executed)
            checker.findings.sort(key=lambda f: (position[f.index], f.nth))
            parents = _engine.parents(graph)
            for found in checker.findings:
                i, h, data = found.index, found.hazard, found.saved
                h.order = position[i]
                h.seq = int(graph.nodes[i]._sequence_nr())
                h.path = _engine.path_to(graph, parents, i)
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
            lease(graph)
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
    grad_outputs: GradOutputs | None = None,
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
