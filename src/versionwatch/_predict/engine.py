"""The engine, simulated: which nodes a backward runs, and in what order.

It follows ``torch/csrc/autograd/engine.cpp``: with ``inputs=`` only nodes on a
path to an input execute (``init_to_execute``), and the ready queue pops the
highest sequence number first. The predictor checks the nodes that run and
orders its hazards as the engine would meet them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from versionwatch._predict.arguments import Call, Edge
from versionwatch._predict.graph import Graph


def executed(graph: Graph, targets: set[int] | None, accumulate: bool) -> list[bool]:
    """Whether each node runs, given the graph indices of the inputs (None: all run).

    ``accumulate``: the call is ``backward(inputs=)``, which runs the inputs'
    own nodes too; ``grad`` only captures gradients there.
    """
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


def execution_order(graph: Graph, executed: list[bool]) -> list[int]:
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


def parents(graph: Graph) -> list[int]:
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


def path_to(graph: Graph, parent: list[int], i: int) -> list[str]:
    """The node names from a root down to node ``i``, along :func:`parents`."""
    path = []
    while i >= 0:
        path.append(graph.nodes[i].name())
        i = parent[i]
    return path[::-1]


# A node type -> whether it is AccumulateGrad, whose ``variable`` is its leaf.
_IS_ACCUMULATOR: dict[type, bool] = {}


def roots(outs: Sequence[Edge]) -> tuple[list[Node], list[tuple[Node, int]], set[int]]:
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


def targets(graph: Graph, call: Call, root_edges: list[tuple[Node, int]],
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
