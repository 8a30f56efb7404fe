"""Walking an autograd graph from Python without leaving a crash behind.

Why the lease exists: on torch 2.13 an autograd node that Python has touched
(through ``grad_fn`` or ``next_functions``) is later freed through Python
deallocation, which bypasses PyTorch's iterative node deleter. Freeing a chain
of ~50,000 touched nodes then recurses once per node and overflows the C stack
(a segfault, with no version error involved; see ``docs/deep-graphs.md``).

So every walk hands the node wrappers it created to a :class:`_Lease`, which
keeps them until all the walked roots have been freed and then drops them
root-first, in topological order. Each node is then freed while its children
are still held, so no free ever cascades. The lease never extends a node's
life: every node it holds is reachable from a root that is still alive.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from itertools import islice
from typing import cast

import torch
from torch.autograd.graph import Node


class Graph:
    """The nodes reachable from some roots, with edges as index lists.

    ``nodes[i]`` are the touched wrappers, in BFS order, roots first;
    ``children[i]`` the indices of ``nodes[i].next_functions`` (``None`` edges
    skipped, repeats kept, since the engine counts each edge as a dependency),
    built on first use: a clean backward never needs them. ``ordered`` is true
    when the BFS order is already topological (every edge goes to a later
    index, as in chains and trees), so that no sort is needed to release
    root-first.
    """

    __slots__ = ("_children", "index", "nexts", "nodes", "ordered", "roots")

    def __init__(self, roots: Sequence[Node] = (),
                 visit: Callable[[int, Node], None] | None = None) -> None:
        self.nodes: list[Node] = []
        self.nexts: list[tuple[tuple[Node | None, int], ...]] = []
        self.index: dict[Node, int] = {}
        self.roots: list[int] = []
        self.ordered = True
        self._children: list[list[int]] | None = None
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
        nexts = self.nexts
        self._children = None
        for r in roots:
            j = index.get(r)
            if j is None:
                j = index[r] = len(nodes)
                nodes.append(r)
            self.roots.append(j)
        get = index.get
        ordered = self.ordered
        i = len(nexts)
        # Iterative BFS (recursion would overflow on deep chains): iterating a
        # list that grows meanwhile is well defined, and the fastest loop here.
        try:
            for node in islice(nodes, i, None):
                nf = node.next_functions
                nexts.append(nf)
                for fn, _ in nf:
                    if fn is not None:
                        j = get(fn)
                        if j is None:
                            index[fn] = len(nodes)
                            nodes.append(fn)
                        elif j <= i:
                            ordered = False  # an edge back to an earlier node
                if visit is not None:
                    visit(i, node)
                i += 1
        finally:
            self.ordered = ordered

    @property
    def children(self) -> list[list[int]]:
        if self._children is None:
            index = self.index
            self._children = [[index[fn] for fn, _ in nf if fn is not None] for nf in self.nexts]
        return self._children

    def topological_order(self) -> list[int]:
        """Indices with every parent before its children (Kahn's algorithm)."""
        n = len(self.nodes)
        if self.ordered:
            return list(range(n))
        # Straight from the next_functions tuples: building ``children`` first
        # would cost as much again. A walk cut short leaves found nodes without
        # their edges (no entry in ``nexts``).
        index = self.index
        nexts = self.nexts
        indeg = [0] * n
        for nf in nexts:
            for fn, _ in nf:
                if fn is not None:
                    indeg[index[fn]] += 1
        order = [i for i in range(n) if indeg[i] == 0]
        m = len(nexts)
        for k in order:  # grows as we go
            if k < m:
                for fn, _ in nexts[k]:
                    if fn is not None:
                        c = index[fn]
                        indeg[c] -= 1
                        if indeg[c] == 0:
                            order.append(c)
        return order


class _Lease:
    """The walked wrappers, held until every root node has been freed."""

    __slots__ = ("nodes", "pending")
    _lock = threading.Lock()  # a class attribute: still there during shutdown

    def __init__(self, nodes: list[Node | None], pending: int) -> None:
        self.nodes = nodes
        self.pending = pending

    def release_one(self) -> None:
        with self._lock:
            self.pending -= 1
            if self.pending > 0:
                return
            nodes, self.nodes = self.nodes, []
        # Root-first: each node dies while its children are still held here.
        while nodes:
            nodes.pop()


class _Sentinel:
    """Kept in a root node's ``metadata`` dict, so it is freed with the node.

    PyTorch frees a node's edges before its metadata, so by the time this dies
    the root has let go of its children, which the lease still holds: releasing
    them now frees each one alone. (A ``weakref.finalize`` on the output tensor
    fires too early: before the dying tensor lets go of its ``grad_fn``, so the
    root would then free the whole chain at once.)
    """

    __slots__ = ("lease",)

    def __init__(self, lease: _Lease) -> None:
        self.lease = lease

    def __del__(self) -> None:
        self.lease.release_one()


_METADATA_KEY = "versionwatch.leases"


def lease(graph: Graph, outputs: Sequence[torch.Tensor], extra: Sequence[Node] = ()) -> None:
    """Keep ``graph``'s wrappers (and ``extra`` ones) until its root nodes are freed.

    The roots themselves are not held (that would keep them alive forever):
    their owners (``outputs``, other graphs) free them, and a :class:`_Sentinel`
    in each root's ``metadata`` then releases the rest, root-first.
    """
    nodes = graph.nodes
    k = len(set(graph.roots))  # the distinct roots: indices 0 .. k-1
    # Stored leaves-first so that popping, and also CPython's list dealloc
    # (which runs from the end), releases roots first.
    held: list[Node | None] = list(extra)
    if graph.ordered:  # BFS order is topological: no sort needed
        held.extend(nodes[:k - 1:-1] if k else reversed(nodes))
    else:
        held.extend(nodes[i] for i in reversed(graph.topological_order()) if i >= k)
    roots = nodes[:k]
    graph.nodes = []
    graph.nexts = []
    graph.index = {}
    graph._children = None
    keeper = _Lease(held, len(roots))
    try:
        # Node.metadata is a property; torch's stubs declare a method.
        boxes = [cast("dict[str, list[_Sentinel]]", r.metadata) for r in roots]
    except Exception:  # a node without metadata: fall back to the outputs' lives
        keeper.nodes.extend(reversed(roots))
        alive = {id(t): t for t in outputs}
        keeper.pending = len(alive)
        for t in alive.values():
            weakref.finalize(t, keeper.release_one).atexit = False
        return
    for box in boxes:
        box.setdefault(_METADATA_KEY, []).append(_Sentinel(keeper))
