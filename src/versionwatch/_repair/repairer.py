"""``on_hazard="repair"``: keep what a live graph saved before a seen write overwrites it.

PyTorch's ``allow_mutation_on_saved_tensors()`` sends every op through a
Python dispatch mode to find the writes. A watcher already sees the writes
that matter before they happen (every watched optimizer step; in strict mode
every in-place op), so it copies only the saved tensors that such a write is
about to overwrite, and nothing when no live graph saved them.

Which live graphs saved what:

- **Default mode** knows a graph once a backward ran on it with
  ``retain_graph=True`` (or ``create_graph``): a graph that backward freed
  needs nothing, and one never backwarded is not seen (its hazard is raised as
  with ``"raise"``). The backward's outputs are held weakly; just before a
  step, the graphs still alive are walked (the predictor's iteration) for
  slots that hold a parameter the step updates, or a view of one. Such a slot
  gets ``register_hooks`` (see ``SavedVariable::register_hooks``): the pack
  hook hands PyTorch a copy, the unpack hook returns it, so the slot no longer
  shares memory with the parameter. A program without retained graphs pays one
  empty-list check per step.
- **Strict mode** packs every saved tensor into a record already: a write
  about to hit a record's memory swaps the record's tensor for a copy.

Copies belong to the graph (the hook or the record holds them): they die with
it. A memory budget caps the bytes held; past it, a graph gets no more copies,
a warning names what keeps it alive, and its backward fails as it would.
"""

from __future__ import annotations

import gc
import logging
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from versionwatch._compat import (
    SAVED_INTROSPECTION,
    SAVED_UNPACK,
    HookedSaved,
    SavedTensor,
    allow_in_peek,
    peek,
)
from versionwatch._predict import (
    COPY_SLICES,
    CUSTOM,
    PLANS,
    Graph,
    lease,
    plan_of,
    planned,
    trust_unpack,
)
from versionwatch._repair.copies import copy_as_laid_out, span_bytes
from versionwatch._repair.strict_hits import strict_hits
from versionwatch._report import InplaceHazardWarning, Repair, Site, size
from versionwatch._sites import user_frame
from versionwatch._torch_messages import FREED

if TYPE_CHECKING:
    from versionwatch._ledger import Ledger
    from versionwatch._repair.strict_hits import Hits

logger = logging.getLogger("versionwatch")

_MIN_BUDGET = 64 << 20
_SavedTensor: Any = SavedTensor


def unpack_copy(copy: torch.Tensor) -> torch.Tensor:
    """The unpack hook of a repaired slot: the copy taken before the write."""
    return copy


trust_unpack(unpack_copy)
allow_in_peek(unpack_copy)


class _Keep:
    """The pack hook of a repaired slot: ignores the live tensor, hands over the copy."""

    __slots__ = ("copy",)

    def __init__(self, copy: torch.Tensor) -> None:
        self.copy = copy

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        copy = self.copy
        del self.copy  # the slot holds it from now on, and frees it with the graph
        return copy


class _Root:
    """A retained backward's output, held weakly, and the story it tells."""

    __slots__ = ("label", "ref", "refused", "site")

    def __init__(self, t: torch.Tensor, label: str, site: Site | None) -> None:
        self.ref = weakref.ref(t)
        self.label = label
        self.site = site
        self.refused = False  # over budget: this graph gets no more copies


class RepairHost(Protocol):
    """The watcher a :class:`Repairer` repairs for (declared here: the watcher sits above)."""

    closed: bool
    ledger: Ledger
    names: dict[int, str]  # id of each watched tensor -> its qualified name


class Repairer:
    """One watcher's repairs: retained graphs, copies held, and their accounting.

    ``host``, the watcher, is held weakly: its ledger gets the repair events.
    """

    def __init__(self, host: RepairHost, budget: int | None) -> None:
        self._host = weakref.ref(host)
        self._budget = budget
        self.roots: list[_Root] = []
        self.repairs: deque[Repair] = deque(maxlen=1000)
        self.count = 0
        self.copied = 0  # bytes copied over the run
        self.held = 0  # bytes of copies alive now
        self.peak = 0
        self.refused: list[str] = []
        self._warned = False
        self._lock = threading.Lock()
        self._alive: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._default = (-1, _MIN_BUDGET)  # (watched tensors counted, default budget)

    # -- budget and accounting -----------------------------------------------------
    @property
    def budget(self) -> int:
        """The most bytes copies may hold at once (default: twice the watched tensors)."""
        if self._budget is not None:
            return self._budget
        w = self._host()
        if w is None:
            return _MIN_BUDGET
        tracked = w.ledger.tracked
        if self._default[0] != len(tracked):  # recounted only when the watched set changes
            total = 0
            for tr in list(tracked.values()):
                t = tr.ref()
                if t is not None:
                    total += t.numel() * t.element_size()
            self._default = (len(tracked), max(_MIN_BUDGET, 2 * total))
        return self._default[1]

    def _hold(self, copy: torch.Tensor, nbytes: int | None = None) -> int:
        if nbytes is None:
            nbytes = copy.numel() * copy.element_size()
        key = id(copy)

        def freed(_: object) -> None:
            with self._lock:
                entry = self._alive.pop(key, None)
                if entry is not None:
                    self.held -= entry[1]

        with self._lock:
            self._alive[key] = (weakref.ref(copy, freed), nbytes)
            self.held += nbytes
            self.copied += nbytes
            self.peak = max(self.peak, self.held)
        return nbytes

    def fits(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.budget

    def over_budget(self, what: str, keeper: str) -> None:
        """Say once that a graph gets no more copies, and what keeps it alive.

        The warning points at the user's line that made the write (a step, an
        in-place op): the first frame up outside the libraries, however many
        of ours lie between.
        """
        self.refused.append(what)
        if self._warned:
            return
        self._warned = True
        _, level = user_frame(1)
        warnings.warn(
            f"versionwatch: repair budget of {size(self.budget)} reached ({size(self.held)} "
            f"held by copies): {what} gets no copy, so its backward fails as it would without "
            f"repair. {keeper}. Free the graphs you no longer need (del the loss, or detach "
            "what you keep), or raise watch(..., repair_budget=...)",
            InplaceHazardWarning, stacklevel=level)

    def summary(self) -> dict[str, Any]:
        """Counts and bytes: copies made, bytes copied, peak and current bytes held."""
        return {"repairs": self.count, "copied_bytes": self.copied, "peak_bytes": self.peak,
                "held_bytes": self.held, "budget_bytes": self.budget,
                "refused": list(self.refused)}

    def note(self, repair: Repair) -> None:
        self.count += 1
        self.repairs.append(repair)

    def record(self, n: int, label: str, site: Site | None) -> None:
        """Put the last ``n`` repairs, made before ``label``, in the watcher's ledger."""
        w = self._host()
        new = [self.repairs[-k] for k in range(min(n, len(self.repairs)), 0, -1)]
        nbytes = sum(r.nbytes for r in new)
        what = new[0].tensor if n == 1 else f"{n} tensors"
        if w is not None:
            w.ledger.record("repair", f"kept {what} ({size(nbytes)}) before {label}", site)
        for r in new:
            logger.debug("versionwatch: %s", r)

    @property
    def names(self) -> dict[int, str]:
        """The watcher's watched tensors' names, by id (strict mode's hits are routed by them)."""
        w = self._host()
        return w.names if w is not None else {}

    def repair_write(self, label: str, site: Site | None, hits: Hits) -> Hits:
        """Strict mode: a seen write is about to hit memory a live graph saved.

        Returns the hits left unrepaired, which strict mode records.
        """
        w = self._host()
        if w is None or w.closed:
            return hits
        before = self.count
        try:
            left = strict_hits(self, w.names, label, site, hits)
        except Exception:  # never break the user's write: unrepaired is raised as today
            logger.debug("versionwatch: repair before %s failed", label, exc_info=True)
            return hits
        if self.count > before:
            self.record(self.count - before, label, site)
        return left

    # -- default mode: live graphs ---------------------------------------------------
    def retain(self, outputs: Any, label: str, site: Site | None) -> None:
        """A backward that keeps its graph ran on ``outputs``: remember them weakly."""
        self._remember(outputs, label, site)

    def outputs(self, result: Any, label: str) -> None:
        """A watched forward returned ``result``: remember its tensors weakly.

        A graph that no backward has run on yet (the seed story's second loss,
        a GAN's generator loss through the discriminator) is known this way.
        """
        self._remember(result, label, None)

    def _remember(self, value: Any, label: str, site: Site | None) -> None:
        if isinstance(value, torch.Tensor):
            ts = [value]
        elif isinstance(value, (list, tuple)):
            ts = [t for t in value if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            ts = [t for t in value.values() if isinstance(t, torch.Tensor)]
        else:
            return
        ts = [t for t in ts if t.grad_fn is not None]
        if not ts:
            return
        with self._lock:
            roots = self.roots
            if len(roots) >= 16:  # outputs nobody backwarded (evaluation under grad)
                roots = [r for r in roots if r.ref() is not None]
            for t in ts:
                if not any(r.ref() is t for r in roots):
                    roots.append(_Root(t, label, site))
            self.roots = roots

    def before_step(self, params: Iterable[torch.Tensor], names: dict[int, str],
                    step: str, site: Site | None) -> int:
        """Copy every live saved slot holding a param the step is about to update.

        Returns how many tensors got copies. A root whose graph died (the
        common case: backward freed it), or that saves no watched tensor any
        more, is let go: later steps skip it.
        """
        if not self.roots:
            return 0
        before = self.count
        seen = list(self.roots)
        live: list[_Root] = []
        fns: list[Any] = []
        # Where a raw slot shows its data, the walk itself stops at a freed node,
        # so a freed graph costs it no more than the separate check would, and a
        # live one is not read twice. Old torch's walk cannot see a freed slot.
        check = not SAVED_INTROSPECTION
        for root in seen:
            t = root.ref()
            fn = t.grad_fn if t is not None else None
            del t
            if fn is not None and not (check and _freed(fn)):
                live.append(root)
                fns.append(fn)
        if fns:
            if not _repair_graph(self, fns, live, params, names, step, site):
                live = []
        with self._lock:
            # Roots another thread added meanwhile stay.
            self.roots = live + [r for r in self.roots if not any(r is o for o in seen)]
        return self.count - before

    def _repair_matches(self, matches: list[tuple[Any, Any, torch.Tensor, int, str]],
                        roots: list[_Root], names: dict[int, str], step: str,
                        site: Site | None) -> None:
        refused = any(r.refused for r in roots)
        done: dict[str, tuple[int, str]] = {}
        copies: dict[tuple[int, int], torch.Tensor] = {}
        for node, raw, data, how, saved_attr in matches:
            if refused or not _fresh(node, raw, saved_attr, how):
                continue
            base = data._base if data._base is not None else data
            made = self.copy(data, base, copies)
            if made is None:
                refused = True
                for r in roots:
                    r.refused = True
                self.over_budget(f"the graph of {self._graph_label(node, roots)}",
                                 _keeper(roots))
                continue
            copy, nbytes = made
            try:
                raw.register_hooks(_Keep(copy), unpack_copy)
            except RuntimeError:
                continue  # a hook set meanwhile, or freed: PyTorch decides
            name = names[id(base)]
            entry = done.get(name)
            if entry is None:
                entry = (0, self._graph_label(node, roots))
            done[name] = (entry[0] + nbytes, entry[1])
        for name, (nbytes, label) in done.items():
            self.note(Repair(tensor=name, nbytes=nbytes, graph=label, before=step, site=site))

    def copy(self, data: torch.Tensor, base: torch.Tensor,
              copies: dict[tuple[int, int], torch.Tensor]) -> tuple[torch.Tensor, int] | None:
        """A copy of ``data`` and the bytes newly copied for it, or None over budget.

        Views of one contiguous base (``weight.t()`` saved by every time step
        of an unrolled RNN) share one copy of the base. A view that reads its
        base as another dtype (``view_as_real(p)``, ``p.real`` of a complex
        ``p``) or through a conjugate or negative bit (``p.conj()``) is copied
        on its own: the base's copy, cut with the view's sizes and strides,
        would read other elements, or other values.
        """
        ckey = (id(base), base._version)
        shared = (base.is_contiguous() and not base.is_sparse and data.dtype == base.dtype
                  and data.is_conj() == base.is_conj() and data.is_neg() == base.is_neg())
        whole = copies.get(ckey) if shared else None
        nbytes = 0
        if whole is None:
            source = base if shared else data
            nbytes = span_bytes(source)
            if not self.fits(nbytes):
                return None
            whole = copy_as_laid_out(source)
            if whole.layout is torch.strided:
                nbytes = whole.untyped_storage().nbytes()
            self._hold(whole, nbytes)
            if not shared:
                return whole, nbytes
            copies[ckey] = whole
        if data is base:
            return whole, nbytes
        return whole.as_strided(data.size(), data.stride(),
                                data.storage_offset() - base.storage_offset()), nbytes

    def _graph_label(self, node: Any, roots: list[_Root]) -> str:
        """``forward #7``: the watched forward that made ``node``, else the root's story."""
        w = self._host()
        if w is not None:
            seq = node._sequence_nr()
            me = threading.get_ident()
            for ev in reversed(w.ledger.events):  # the newest forward that began before it
                if ev.kind == "forward" and ev.seq is not None and ev.thread == me \
                        and ev.seq <= seq:
                    return str(ev.label)
        return f"the output of {roots[0].label}" if roots else "a live graph"


def _repair_graph(repairer: Repairer, fns: list[Any], roots: list[_Root],
                  params: Iterable[torch.Tensor], names: dict[int, str], step: str,
                  site: Site | None) -> bool:
    """Walk the live graphs; returns whether they still save any watched tensor.

    The hot loop: per saved slot, one raw read, its hook and its data; a
    slot that holds a watched tensor is a candidate; after the walk, those
    that hold a parameter the step updates (its ``.grad`` is set) get
    PyTorch's check and a copy. The set of updated parameters is built
    only then: a freed graph (the common case) never needs it.
    The walk stops at a node whose saved tensors backward freed: a backward
    frees every node it runs, so what lies below was freed with it (a
    generator's graph under a discriminator's, after the generator's loss
    ran backward). Walked nodes are leased as the predictor's are.
    """
    graph = Graph()
    nodes, index, nexts = graph.nodes, graph.index, graph.nexts
    for f in fns:
        if f not in index:
            index[f] = len(nodes)
            nodes.append(f)
        graph.roots.append(index[f])
    graph.ordered = False
    live = False
    matches: list[tuple[Any, Any, torch.Tensor, int, str]] = []
    intro = SAVED_INTROSPECTION
    plans = PLANS
    try:
        i = 0
        while i < len(nodes):
            node = nodes[i]
            i += 1
            freed = False
            plan = plans.get(type(node))
            if plan is None:
                plan = plan_of(node)
            # Nothing saved, or (CopySlices) saved out of Python's reach.
            if plan and plan is not COPY_SLICES:
                freed = intro and plan is not CUSTOM
                for _, raw_attr, saved_attr in plan:
                    if intro:
                        try:
                            raw = getattr(node, raw_attr)
                        except RuntimeError:
                            continue
                        if raw.__class__ is _SavedTensor:
                            if raw.unpack_hook is not None:
                                freed = False
                                continue
                            data = raw.data
                            if data is None:
                                continue  # freed, or nothing saved
                            freed = False
                            base = data._base
                            key = id(data if base is None else base)
                            if key in names:
                                matches.append((node, raw, data, 1, saved_attr))
                            continue
                        freed = False
                    for raw, data, how in _slots(node, raw_attr, saved_attr):
                        base = data._base
                        key = id(data if base is None else base)
                        if key in names:
                            matches.append((node, raw, data, how, saved_attr))
            if freed:
                nexts.append(())
                continue
            nf = node.next_functions
            nexts.append(nf)
            for fn, _ in nf:
                if fn is not None and fn not in index:
                    index[fn] = len(nodes)
                    nodes.append(fn)
        live = bool(matches)
        if matches:
            stepped = {id(p) for p in params if p.grad is not None}
            matches = [m for m in matches if id(_base(m[2])) in stepped]
        if matches:
            repairer._repair_matches(matches, roots, names, step, site)
    finally:
        matches = []
        lease(graph)
    return live

def _slots(node: Any, raw_attr: str, saved_attr: str) -> list[tuple[Any, torch.Tensor, int]]:
    """``(raw, tensor, how)`` of the live, unhooked tensors in one slot.

    ``how`` says how to run PyTorch's version check on a match: 0 checked
    already (old torch's read), 1 the slot's getter, 2 ``raw.unpack()``.
    """
    try:
        raws = getattr(node, raw_attr)
    except RuntimeError:
        return []
    if SAVED_INTROSPECTION:
        if not isinstance(raws, (list, tuple)):
            if raws is None or raws.unpack_hook is not None:
                return []
            data = raws.data
            return [(raws, data, 1)] if isinstance(data, torch.Tensor) else []
        return [(raw, raw.data, 2) for raw in raws
                if raw is not None and raw.unpack_hook is None
                and isinstance(raw.data, torch.Tensor)]
    # Old torch hides a raw saved tensor's data: read the slot, refusing any hook.
    try:
        value, records = peek(node, saved_attr)
    except (HookedSaved, RuntimeError):
        return []
    if records:
        return []
    many = isinstance(raws, (list, tuple))
    raw_list = list(raws) if many else [raws]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) != len(raw_list):
        return []
    return [(raw, data, 0) for raw, data in zip(raw_list, values)
            if isinstance(data, torch.Tensor) and raw is not None]

def _fresh(node: Any, raw: Any, saved_attr: str, how: int) -> bool:
    """PyTorch's own check: a stale slot stays as it is, and fails as it would."""
    try:
        if how == 1:
            getattr(node, saved_attr)
        elif how == 2:
            if not SAVED_UNPACK:
                return False
            raw.unpack()
    except RuntimeError:
        return False
    return True

def _keeper(roots: list[_Root]) -> str:
    """What keeps the live graphs alive, in words (the rare, over-budget path)."""
    parts = []
    for root in roots[:3]:
        where = f" at {root.site}" if root.site else ""
        how = " (retain_graph=True)" if root.label.startswith("backward") else ""
        text = f"the output of {root.label}{where}{how}"
        t = root.ref()
        if t is not None:
            holders = [r for r in gc.get_referrers(t) if isinstance(r, list)]
            if holders:
                text += (f", held in a list of {len(holders[0])} items (like "
                         "losses.append(loss)), which keeps every such graph alive")
        parts.append(text)
    return "It is kept alive by " + "; ".join(parts) if parts else "It is still referenced"


def _base(t: torch.Tensor) -> torch.Tensor:
    base = t._base
    return t if base is None else base


def _freed(fn: Any) -> bool:
    """Whether backward already freed the graph under ``fn``: the common case, made cheap.

    The nearest node that saves a tensor tells (PyTorch frees a graph from its
    root down): on torch that shows a raw saved tensor's data, a freed slot
    holds none. Old torch reads the slot (refusing hooks) and PyTorch's error
    says. A slot that cannot be read, or no such node near the root, counts as
    live: the walk decides.
    """
    nodes = [fn]
    for node in nodes:
        for _, _, plan in planned([node], None):
            if plan is COPY_SLICES or plan is CUSTOM:
                return False
            for _, raw_attr, saved_attr in plan:
                if SAVED_INTROSPECTION:
                    raw = getattr(node, raw_attr)
                    if isinstance(raw, (list, tuple)):
                        return False
                    if raw.data is not None:
                        return False
                    continue  # freed, or a slot that saved nothing: the next one says
                try:
                    value, _ = peek(node, saved_attr)
                except HookedSaved:
                    return False
                except RuntimeError as e:
                    return FREED in str(e)
                if value is not None:
                    return False
            return SAVED_INTROSPECTION  # every slot of the node is empty
        if len(nodes) < 8:
            nodes += [n for n, _ in node.next_functions if n is not None]
    return False
