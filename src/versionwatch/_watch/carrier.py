"""A freed graph's facts: what carried it into this backward, and what ran in between.

"Backward through the graph a second time" has several fixes, and the right one
depends on the program's shape (see ``docs/dev/explanations-analysis.md``). The
facts, found once a report is being built (never on the training path):

- **the boundary**: walking from this backward's roots along ``next_functions``,
  the first node made before the freeing backward began (its sequence number is
  at most the freer's clock). It is the ``grad_fn`` of the tensor that carries
  the old graph in;
- **the carrier** (:class:`~versionwatch.Carrier`): the user's variable that
  holds that tensor (or a newer output of the same op: recurrent state rebound
  by ``h = rnn(x, h)``), the line that assigned it (:mod:`ast` on the frame's
  code), the watched forward that made it, and its role: ``state`` (rebound, or
  fed back into the module that made it), ``input`` (fed to another watched
  forward that began after the freeing backward: a GAN's ``D(fake)``) or
  ``data`` (neither: advantages, targets); whether an optimizer trains a
  parameter of the graph behind it;
- **between** (:class:`~versionwatch.Between`): the steps, ``zero_grad`` calls
  and unattributed writes between the two backwards, whether one of them
  changed what the freed graph saved (a step of an optimizer that holds one of
  the parameters that graph reaches), and whether a ``zero_grad`` threw away
  the gradient the freeing backward sent into them.

Unknown stays ``None``: the fix is then worded as a choice.
"""

from __future__ import annotations

import ast
import threading
import weakref
from collections.abc import Iterable, Sequence
from types import FrameType, ModuleType
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from versionwatch._built import assignment, parsed
from versionwatch._ledger import Event, Ledger
from versionwatch._report import Between, Carrier, Forward, Hazard, Modification, Site
from versionwatch._sites import site_at

# The walk to the boundary gives up past this many nodes (a huge graph): the
# facts are then unknown, not slow.
_MAX_NODES = 200_000
_QUIET = ("forward", "forward_end", "backward", "backward_end")


def freed_facts(h: Hazard, ledger: Ledger, freer: Event, outputs: Any,
                roots: dict[str, weakref.ref[nn.Module]], optimizers: Sequence[tuple[str, Any]],
                frame: FrameType | None, same_graph: bool) -> tuple[Carrier | None, Between]:
    """The carrier (``None`` for the same graph run twice) and what ran between.

    Args:
        h: the first freed hazard, placed in its forward (``h.module``).
        ledger: the ledger that saw the freeing backward ``freer``.
        outputs: this backward's roots, as passed to it.
        roots: the watched root modules, by name.
        optimizers: the watched optimizers, ``(label, optimizer)`` each.
        frame: the user's frame that called this backward.
        same_graph: this backward's graph was built before the freer ran.
    """
    me = threading.get_ident()
    events = [ev for ev in list(ledger.events) if ev.thread == me]
    current = next((ev for ev in reversed(events) if ev.kind == "backward"), None)
    end = current.index if current is not None and current.index > freer.index else None
    after = [ev for ev in events if ev.index > freer.index and (end is None or ev.index < end)]
    forwards = _forward_ranges(events)
    opts = _optimizers(optimizers, frame)
    carrier = None
    params: set[int] | None = None
    if not same_graph and not ledger.threaded and freer.seq is not None:
        carrier, params = _carrier(h, freer, outputs, roots, opts, frame, forwards)
    elif same_graph:
        params = _leaves(_grad_fns(outputs))
    if params is None:
        params = _params(carrier.module if carrier is not None and carrier.module
                         else _root(h.module, roots), roots)
    return carrier, _between(after, params, opts)


def _grad_fns(outputs: Any) -> list[Any]:
    tensors = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [fn for t in tensors if isinstance(t, torch.Tensor) and (fn := t.grad_fn) is not None]


def _leaves(start: list[Any]) -> set[int] | None:
    """The ids of the leaves (parameters) a graph reaches from ``start``: what its
    backward would send gradients into, and the tensors of it an optimizer steps.

    The graph's nodes outlive the saved tensors a backward freed, so an old
    graph is walked as well as a live one. ``None`` past ``_MAX_NODES``.
    """
    seen = {id(fn): fn for fn in start}
    queue = list(start)
    found: set[int] = set()
    for fn in queue:
        if len(seen) > _MAX_NODES:
            return None
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node
        if isinstance(leaf, torch.Tensor):
            found.add(id(leaf))
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                queue.append(nxt)
    return found


def _forward_ranges(events: Iterable[Event]) -> list[tuple[Event, int]]:
    """Each watched forward with grad: its start event and the clock at its end."""
    starts: dict[str, Event] = {}
    out = []
    for ev in events:
        if ev.seq is None:
            continue
        if ev.kind == "forward":
            starts[ev.name] = ev
        elif ev.kind == "forward_end":
            start = starts.pop(ev.name, None)
            if start is not None and start.seq is not None:
                out.append((start, ev.seq))
    return out


def _made_in(seq: int, forwards: list[tuple[Event, int]]) -> Event | None:
    """The innermost watched forward that made node ``seq``."""
    best: tuple[int, Event] | None = None
    for start, end in forwards:
        assert start.seq is not None
        if start.seq < seq <= end and (best is None or end - start.seq < best[0]):
            best = (end - start.seq, start)
    return best[1] if best is not None else None


def _made_below(node: Any, forwards: list[tuple[Event, int]],
                limit: int = 1000) -> Event | None:
    """The watched forward that made the nearest node under ``node`` (what it was computed
    from: ``teacher(x).softmax(-1)`` is the teacher's), if any within ``limit`` nodes."""
    seen = {id(node): node}
    queue = [node]
    for fn in queue:
        if len(seen) > limit:
            break
        made = _made_in(int(fn._sequence_nr()), forwards) if fn is not node else None
        if made is not None:
            return made
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                queue.append(nxt)
    return None


def _root(module: str | None, roots: dict[str, weakref.ref[nn.Module]]) -> str | None:
    """The watched root a module's qualified name is under (``"clf.2"`` -> ``"clf"``)."""
    if module is None:
        return None
    found = [r for r in roots if module == r or module.startswith(r + ".")]
    return max(found, key=len) if found else module.split(".", 1)[0]


def _boundary(outputs: Any, clock: int) -> list[Any] | None:
    """The nodes from this backward's root to the first one made by ``clock``, that one last."""
    start = _grad_fns(outputs)
    # Breadth first: the boundary nearest the root. The wrappers are kept in
    # ``seen`` while the walk runs, so their ids name them.
    seen: dict[int, tuple[Any, int | None]] = {id(fn): (fn, None) for fn in start}
    queue = list(start)
    for fn in queue:
        if len(seen) > _MAX_NODES:
            return None
        if int(fn._sequence_nr()) <= clock:
            path = [fn]
            parent = seen[id(fn)][1]
            while parent is not None:
                node, parent = seen[parent]
                path.append(node)
            return path[::-1]
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = (nxt, id(fn))
                queue.append(nxt)
    return None


def _variable(frame: FrameType | None, node: str, seq: int) -> tuple[str, bool] | None:
    """The user's variable holding the output of node ``node`` #``seq``; True if rebound.

    Exact first (the old tensor itself); else a variable rebound to a newer
    output of the same op, as recurrent state is (``h = rnn(x, h)``).
    """
    if frame is None:
        return None
    newer = None
    for scope in (frame.f_locals, frame.f_globals):
        for name, value in list(scope.items()):
            if name.startswith("_") or not isinstance(value, torch.Tensor):
                continue
            fn = value.grad_fn
            if fn is None or fn.name() != node:
                continue
            nr = int(fn._sequence_nr())
            if nr == seq:
                return str(name), False
            if nr > seq and newer is None:
                newer = str(name)
    return (newer, True) if newer is not None else None


def _scope_of(tree: ast.Module, frame: FrameType) -> ast.AST:
    """The function (or module) of ``tree`` that ``frame`` runs."""
    code = frame.f_code
    if code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if code.co_firstlineno in (node.lineno, first):
                return node
    return tree


def made_at(frame: FrameType | None, name: str) -> Site | None:
    """The line that last assigned ``name`` in ``frame``'s function, up to the line it runs."""
    if frame is None or not name:
        return None
    filename = frame.f_code.co_filename
    tree = parsed(filename)
    if tree is None:
        return None
    scope = _scope_of(tree, frame)
    found = assignment(scope, name, before=frame.f_lineno + 1) or assignment(scope, name)
    return site_at(filename, found[0].lineno) if found is not None else None


def _entered(fed: Event, name: str, made: int, freer: Event,
             forwards: list[tuple[Event, int]]) -> Site | None:
    """Where the carrier entered the freeing backward's loss: ``fed``'s module's
    forward between the carrier's making and the freer (``D(fake)``)."""
    sites = [start.site for start, _ in forwards
             if start.module == fed.module and start.seq is not None
             and made <= start.seq and start.index < freer.index and start.site is not None]
    if not sites:
        return None
    for site in sites:  # the call that takes the carrier: `D(fake)`
        try:
            tree = ast.parse(site.code.strip())
        except (SyntaxError, ValueError):
            continue
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == fed.module \
                    and any(isinstance(n, ast.Name) and n.id == name
                            for a in call.args for n in ast.walk(a)):
                return site
    return sites[0] if len(set(sites)) == 1 else None


def _optimizers(watched: Sequence[tuple[str, Any]],
                frame: FrameType | None) -> list[tuple[str, Optimizer]]:
    """The optimizers the program has: watched ones (by label), and those in its frame.

    A watcher adopts an optimizer at its first ``step()`` or ``zero_grad()``; one
    that has not run yet (its step comes after this backward) is in the user's
    variables, or one attribute down (a trainer's ``self.opt``).
    """
    found: dict[int, tuple[str, Optimizer]] = {id(o): (label, o) for label, o in watched}
    if frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            for value in list(scope.values()):
                if isinstance(value, Optimizer):
                    found.setdefault(id(value), ("", value))
                elif not isinstance(value, (type, ModuleType, torch.Tensor, nn.Module)) \
                        and hasattr(value, "__dict__") and not callable(value):
                    for inner in list(vars(value).values()):
                        if isinstance(inner, Optimizer):
                            found.setdefault(id(inner), ("", inner))
    return list(found.values())


def _params(module: str | None, roots: dict[str, weakref.ref[nn.Module]]) -> set[int] | None:
    ref = roots.get(module) if module is not None else None
    m = ref() if ref is not None else None
    return None if m is None else {id(p) for p in m.parameters()}


def _steps(opt: Optimizer, params: set[int]) -> bool:
    return any(id(p) in params for g in opt.param_groups for p in g["params"])


def _carrier(h: Hazard, freer: Event, outputs: Any, roots: dict[str, weakref.ref[nn.Module]],
             opts: list[tuple[str, Optimizer]], frame: FrameType | None,
             forwards: list[tuple[Event, int]]) -> tuple[Carrier, set[int] | None]:
    """The carrier, and the parameters of the graph behind it (``None``: unknown)."""
    assert freer.seq is not None
    path = _boundary(outputs, freer.seq)
    if path is None:
        # No node older than the freer on the way: name what holds the freed node.
        found = _variable(frame, h.node, h.seq) if h.seq is not None else None
        return Carrier(found[0] if found else "", made_at(frame, found[0]) if found else None,
                       _root(h.module, roots)), None
    boundary = path[-1]
    seq, node = int(boundary._sequence_nr()), boundary.name()
    found = _variable(frame, node, seq)
    name, rebound = found if found is not None else ("", False)
    made = _made_in(seq, forwards) or _made_below(boundary, forwards)
    module = made.module if made is not None else _root(h.module, roots)
    # The watched forwards this backward goes through on its way to the
    # boundary that began after the freer: the carrier was fed to them.
    fed = [ev for n in path[:-1] if (ev := _made_in(int(n._sequence_nr()), forwards))
           is not None and ev.index > freer.index]
    role: Any
    fed_to = entered = None
    if rebound or (module is not None and any(ev.module == module for ev in fed)):
        role = "state"
    elif fed:
        role = "input"
        last = fed[-1]  # the one that took the carrier in
        fed_to = Forward(last.label, last.site, last.module)
        entered = _entered(last, name, seq, freer, forwards)
    else:
        role = "data"
    # What the graph behind the carrier sends gradients into: its leaves (the
    # module's parameters, and those of whatever fed that module).
    params = _leaves([boundary])
    if params is None:
        params = _params(module, roots)
    trained = None
    if params is not None and opts:
        trained = any(_steps(o, params) for _, o in opts)
    return Carrier(name, made_at(frame, name), module, role, fed_to, entered, trained), params


def _between(after: list[Event], params: set[int] | None,
             opts: list[tuple[str, Optimizer]]) -> Between:
    """What ran between the freeing backward and this one, and what it did to the graph
    whose parameters are ``params`` (``None``: unknown)."""
    events = []
    by_label = {label: o for label, o in opts if label}
    changes: bool | None = False
    discards = False
    for ev in after:
        if ev.kind in _QUIET:
            continue
        if ev.kind == "step":
            events.append(Modification("optimizer.step", ev.label, ev.site))
            opt = by_label.get(ev.label.partition(".step() #")[0])
            if params is None or opt is None:
                changes = None if changes is False else changes
            elif _steps(opt, params):
                changes = True
        elif ev.kind == "zero_grad":
            events.append(Modification("zero_grad", ev.label, ev.site))
            opt = by_label.get(ev.label.partition(".zero_grad(")[0])
            if params is not None and opt is not None and _steps(opt, params):
                discards = True
        else:  # a version moved outside any event: which tensor, unknown here
            events.append(Modification("between_events", ev.label, ev.site))
            changes = None if changes is False else changes
    return Between(tuple(events), changes, discards)
