"""Walking an autograd graph from Python without leaving a crash behind.

Why the lease exists: on torch 2.13 an autograd node that Python has touched
(through ``grad_fn`` or ``next_functions``) is later freed through Python
deallocation, which bypasses PyTorch's iterative node deleter. Freeing a chain
of ~50,000 touched nodes then recurses once per node and overflows the C stack
(a segfault, with no version error involved; see ``docs/deep-graphs.md``).

So a deep walk hands the node wrappers it created to a :class:`_Lease`, which
holds each node until every parent it was reached from has died: each node is
then freed while its children are still held, so no free ever cascades, in
whatever order the user drops the roots and intermediate tensors. The lease
never extends a node's life: a node is held only while a walked parent, which
holds it anyway, is alive. A shallow walk needs no lease (see :data:`SHALLOW`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from itertools import islice
from typing import cast

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


# A cascade through touched nodes is at most as deep as the graph that was
# walked; below this many nodes it stays far from the C stack's limit (a crash
# needs ~50,000 on an 8 MiB stack), so such a walk needs no lease at all.
SHALLOW = 10_000
_KEY = "versionwatch.lease"


class _Lease:
    """Wrappers of a deep walked graph, each held until all its parents have died.

    ``pending[i]`` counts node ``i``'s walked parent edges still alive. A
    :class:`_Sentinel` in each node's ``metadata`` reports the node's death;
    then each child whose count drops to zero is let go, and dies alone (its
    own children are still held here) unless something else holds it.
    """

    __slots__ = ("__weakref__", "children", "held", "pending")

    def __init__(self, held: list[Node | None], children: list[list[int]]) -> None:
        self.held = held
        self.children = children
        pending = [0] * len(held)
        for kids in children:
            for c in kids:
                pending[c] += 1
        self.pending = pending

    def dead(self, i: int) -> None:
        held, pending = self.held, self.pending
        for c in self.children[i]:
            pending[c] -= 1
            if pending[c] == 0:
                held[c] = None  # may free c now; its sentinel queues the next step


class _Trampoline(threading.local):
    """Deaths to process, per thread: drained in a loop, never by recursion."""

    queue: list[tuple[_Lease, int]] | None = None
    draining = False


_TRAMPOLINE = _Trampoline()


class _Sentinel:
    """Lives in one node's ``metadata`` dict, so it dies with the node."""

    __slots__ = ("i", "lease", "prev")

    def __init__(self, lease: _Lease, i: int, prev: _Sentinel | None) -> None:
        self.lease = lease
        self.i = i
        self.prev = prev  # an earlier lease's sentinel on the same node

    def __del__(self) -> None:
        t = _TRAMPOLINE
        queue = t.queue
        if queue is None:
            queue = t.queue = []
        queue.append((self.lease, self.i))
        if t.draining:
            return  # an outer __del__ on this thread is draining the queue
        t.draining = True
        try:
            while queue:
                lease, i = queue.pop()
                lease.dead(i)
        finally:
            t.draining = False


def lease(graph: Graph) -> None:
    """Make freeing ``graph``'s touched nodes safe, then drop the walk's references.

    A graph under :data:`SHALLOW` nodes needs nothing. A deep one gets a
    :class:`_Lease`: every node but the roots is held until all the parents it
    was walked from have died, so each dies alone, and a node kept alive by
    the user (an intermediate tensor's ``grad_fn``) is covered as well as the
    roots. Nothing outlives the graph: the roots are not held, and each node
    is let go once no walked parent can still reach it.
    """
    nodes = graph.nodes
    n = len(nodes)
    if n >= SHALLOW:
        index, nexts = graph.index, graph.nexts
        children = [[index[fn] for fn, _ in nf if fn is not None] for nf in nexts]
        children += [[] for _ in range(n - len(children))]  # a walk cut short
        roots = set(graph.roots)
        keeper = _Lease([None if i in roots else node for i, node in enumerate(nodes)], children)
        for i, node in enumerate(nodes):
            try:
                box = cast("dict[str, _Sentinel]", node.metadata)
            except Exception:  # no metadata: never let go, rather than crash
                continue
            box[_KEY] = _Sentinel(keeper, i, box.get(_KEY))
    graph.nodes = []
    graph.nexts = []
    graph.index = {}
    graph._children = None
