"""Walking an autograd graph from Python without leaving a crash behind.

Why the lease exists: on torch 2.13 an autograd node that Python has touched
(through ``grad_fn`` or ``next_functions``) is later freed through Python
deallocation, which bypasses PyTorch's iterative node deleter. Freeing a chain
of ~50,000 touched nodes then recurses once per node and overflows the C stack
(a segfault, with no version error involved; see ``docs/deep-graphs.md``).

So every walk hands the node wrappers it created to a :class:`_Lease`, which
keeps them until all the walked outputs have died and then drops them
root-first, in topological order. Each node is then freed while its children
are still held, so no free ever cascades. The lease never extends a node's
life: every node it holds is reachable from an output that is still alive.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import Node

_LOCK = threading.Lock()


class Graph:
    """The nodes reachable from some roots, with edges as index lists.

    ``nodes[i]`` are the touched wrappers, in BFS order; ``children[i]`` the
    indices of ``nodes[i].next_functions`` (``None`` edges skipped, repeats kept,
    since the engine counts each edge as a dependency). ``ordered`` is true when
    the BFS order is already topological (every edge goes to a later index, as
    in chains and trees), so that no sort is needed to release root-first.
    """

    __slots__ = ("children", "index", "nodes", "ordered", "roots")

    def __init__(self, roots: Sequence[Node] = (),
                 visit: Callable[[int, Node], None] | None = None) -> None:
        self.nodes: list[Node] = []
        self.children: list[list[int]] = []
        self.index: dict[Node, int] = {}
        self.roots: list[int] = []
        self.ordered = True
        if roots:
            self.walk(roots, visit)

    def walk(self, roots: Sequence[Node],
             visit: Callable[[int, Node], None] | None = None) -> None:
        """Add the nodes reachable from ``roots``; call ``visit(i, node)`` on each.

        The nodes are kept in ``self`` as they are found, so that a caller can
        lease them even if ``visit`` raises half-way.
        """
        index = self.index
        nodes = self.nodes
        children = self.children
        get = index.get
        for r in roots:
            j = get(r)
            if j is None:
                j = index[r] = len(nodes)
                nodes.append(r)
            self.roots.append(j)
        ordered = self.ordered
        i = len(children)
        # Iterative BFS: recursion would overflow on deep chains.
        while i < len(nodes):
            node = nodes[i]
            kids: list[int] = []
            for fn, _ in node.next_functions:
                if fn is None:
                    continue
                j = get(fn)
                if j is None:
                    j = index[fn] = len(nodes)
                    nodes.append(fn)
                elif j <= i:
                    ordered = False  # an edge back to an earlier node
                kids.append(j)
            children.append(kids)
            self.ordered = ordered
            if visit is not None:
                visit(i, node)
            i += 1

    def topological_order(self) -> list[int]:
        """Indices with every parent before its children (Kahn's algorithm)."""
        n = len(self.nodes)
        if self.ordered:
            return list(range(n))
        # A walk cut short leaves found nodes without their edges.
        children = self.children + [[]] * (n - len(self.children))
        indeg = [0] * n
        for kids in children:
            for c in kids:
                indeg[c] += 1
        order = [i for i in range(n) if indeg[i] == 0]
        k = 0
        while k < len(order):
            for c in children[order[k]]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    order.append(c)
            k += 1
        return order


class _Lease:
    __slots__ = ("nodes", "pending")

    def __init__(self, nodes: list[Node | None], pending: int) -> None:
        self.nodes = nodes
        self.pending = pending

    def release_one(self) -> None:
        with _LOCK:
            self.pending -= 1
            if self.pending > 0:
                return
            nodes, self.nodes = self.nodes, []
        # Root-first: each node dies while its children are still held here.
        while nodes:
            nodes.pop()


def lease(graph: Graph, outputs: Sequence[torch.Tensor], extra: Sequence[Node] = ()) -> None:
    """Keep ``graph``'s wrappers (and ``extra`` ones) until every output has died."""
    # Stored leaves-first so that popping, and also CPython's list dealloc
    # (which runs from the end), releases roots first.
    held: list[Node | None] = list(extra)
    if graph.ordered:  # BFS order is topological: no sort needed
        held.extend(reversed(graph.nodes))
    else:
        nodes = graph.nodes
        held.extend(nodes[i] for i in reversed(graph.topological_order()))
    graph.nodes = []
    graph.index = {}
    alive = {id(t): t for t in outputs}
    keeper = _Lease(held, len(alive))
    for t in alive.values():
        weakref.finalize(t, keeper.release_one).atexit = False
