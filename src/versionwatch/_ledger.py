"""The version ledger: every watched tensor's ``_version`` at every training event.

A change between two events is attributed to the interval, or to the event
itself when that event is what changes versions (an optimizer step, a module's
forward). Memory is bounded: the last ``max_events`` events and, per tensor, the
last ``max_history`` version changes. Tensors are held by weak reference.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

import torch

from versionwatch import _native_state
from versionwatch._report import ForwardRef, Hazard, Modification, Site


class Event(NamedTuple):
    """One point of the training loop: ``forward #2``, ``SGD.step() #3``, ...

    A named tuple, not a frozen dataclass: a training step makes six, and a
    frozen dataclass costs about 2 us to make.
    """

    index: int  # type: ignore[assignment]  # (shadows tuple.index)
    kind: str  # forward, forward_end, backward, backward_end, step, zero_grad, between
    label: str
    site: Site | None = None
    # For a forward: the autograd sequence number at its start. Nodes it creates
    # get larger ones, so a hazard's node tells which forward saved its tensor.
    # Sequence numbers are counted per thread: only ``thread``'s compare.
    seq: int | None = None
    thread: int = 0  # threading.get_ident() of the thread it happened on
    module: str | None = None  # a forward's root module, by its watched name
    frees: bool = False  # a backward without retain_graph: it frees the graph it runs
    # ``label``'s pieces: the label as its caller gave it (an end event's is its
    # start's), and the name of the thread once several threads record events.
    # ``label`` is their text: "end of backward #2 on thread worker-1".
    name: str = ""
    thread_name: str | None = None

    def forward_ref(self) -> ForwardRef:
        """This event (a forward's) as a hazard names the forward that saved it."""
        return ForwardRef(self.name, self.site, self.thread_name)


class Transition(NamedTuple):
    """A tensor's version moved from ``old`` to ``new`` (equal for a silent write).

    A named tuple, not a frozen dataclass: a step makes one per parameter, and
    a tuple is five times cheaper to make.
    """

    old: int
    new: int
    event: int  # index of the event at (or before) which it was seen
    modification: Modification
    note: str = ""


class Tracked:
    """One watched tensor: its name, a weak reference, and its version history."""

    __slots__ = ("grad_mark", "history", "last", "name", "ref")

    def __init__(self, name: str, t: torch.Tensor, max_history: int) -> None:
        self.name = name
        self.ref: weakref.ref[torch.Tensor] = weakref.ref(t)
        self.last = t._version
        self.history: deque[Transition] = deque(maxlen=max_history)
        # (set_to_none, id of .grad, .grad._version) right after the last zero_grad.
        self.grad_mark: tuple[bool, int | None, int] | None = None


# Event(...) and Transition(...) run a Python __new__; tuple.__new__ with the
# class makes the same named tuple in half the time (a training step makes
# six events and one transition per stepped parameter).
_tuple_new = tuple.__new__


def read_versions(refs: list[weakref.ref[torch.Tensor]]) -> list[int] | None:
    """The versions of the tensors behind ``refs``, in order; None if one of them died.

    The one version read of every event: lock-free (a layout is replaced,
    never changed), a list comprehension (faster here than map over the getters).
    """
    try:
        return [r()._version for r in refs]  # type: ignore[union-attr]
    except AttributeError:  # a dead reference gave None
        return None


class Layout(NamedTuple):
    """The watched tensors in ``tracked`` order, as of the last scan: the ledger's fast path.

    Replaced, never changed: read without the lock. A named tuple, made with
    ``tuple.__new__``: a training step that moves versions makes one.
    """

    keys: list[int]
    refs: list[weakref.ref[torch.Tensor]]
    tracked: list[Tracked]
    versions: list[int]  # at the scan
    snapshot: dict[int, int]  # the scan's versions, by key
    native: Any  # a VersionSet of refs whose baseline is ``versions``, or None

    def unchanged_since(self, before: list[int] | None = None) -> list[int] | None:
        """The versions now if none moved since ``before`` (by default, the scan's); else None.

        None too after a watched tensor died. Against the scan, natively where
        the helper is loaded (no version list is read): then ``versions`` itself.
        """
        if before is None or before is self.versions:
            vs = self.native
            if vs is not None:
                return self.versions if vs.changed() is False else None
            before = self.versions
        now = read_versions(self.refs)
        return now if now == before else None


def moved(layout: Layout) -> bool:
    """Whether a version moved since ``layout``'s scan (or a watched tensor died)."""
    return layout.unchanged_since() is None


def _version_set(refs: list[weakref.ref[torch.Tensor]], now: list[int]) -> Any:
    """A VersionSet of ``refs`` whose baseline is ``now``, or None (no helper, or a
    version moved meanwhile on another thread: the layout then reads in Python)."""
    ext = _native_state.CURRENT
    if ext is None:
        return None
    vs = ext.VersionSet(refs)
    return vs if vs.versions() == now else None


_F = TypeVar("_F", bound=Callable[..., object])



def _locked(method: _F) -> _F:
    """Run under the ledger's lock: threads record, scan and blame at once."""

    @functools.wraps(method)
    def run(self: LedgerQueries, *args: object, **kwargs: object) -> object:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class LedgerQueries:
    """The reading side of a :class:`Ledger`: what a report, a timeline and blame ask of it.

    Apart from the recording side, which runs at every training event; both
    take the ledger's lock.
    """

    tracked: dict[int, Tracked]
    events: deque[Event]
    versions: deque[dict[int, int]]
    _lock: threading.RLock

    @_locked
    def blame(self, h: Hazard, key: int) -> None:
        """Fill ``h.modified_by`` and ``h.saved_during`` from the history of tensor ``key``."""
        tr = self.tracked.get(key)
        if tr is None or h.saved_version is None or h.current_version is None:
            return
        saved, now = h.saved_version, h.current_version
        began, left = 0, None
        for tn in tr.history:
            if tn.new == saved and tn.old != saved:
                began, left = tn.event, None
            if tn.old == saved and tn.new != saved and left is None:
                left = tn.event
            silent = tn.old == tn.new
            if silent and h.kind == "silent" and tn.new == saved:
                h.modified_by.append(tn.modification)
            elif not silent and saved <= tn.old and tn.new <= now:
                m = tn.modification
                h.modified_by.append(replace(m, versions=(tn.old, tn.new)))
            else:
                continue
            if tn.note and tn.note not in h.notes:
                h.notes.append(tn.note)
        if h.saved_during:
            return
        forwards = [ev for ev in self.events if ev.kind == "forward"]
        chosen = None
        if h.seq is not None:
            # The last forward that began before the saving node was created,
            # on this thread: the backward's, taken for the node's (the node
            # does not say which thread's counter numbered it).
            me = threading.get_ident()
            timed = [ev for ev in forwards
                     if ev.seq is not None and ev.seq < h.seq and ev.thread == me]
            chosen = timed[-1] if timed else None
        if chosen is None:  # by versions: the last forward while the tensor was at `saved`
            chosen = next((ev for ev in reversed(forwards) if ev.index >= began
                           and (left is None or ev.index < left)), None)
        if chosen is not None:
            h.saved_during_forward(chosen.forward_ref())

    @_locked
    def place_forward(self, h: Hazard) -> bool:
        """Name the forward (and its module) that made ``h``'s saving node, by sequence number.

        A forward's events hold the autograd clock at its start and end (the
        number of the last node made by then): a node numbered above the first
        and at most the second was made inside it. Clocks count per thread, so
        only this thread's forwards compare (the backward's thread stands in
        for the forward's, as in :meth:`blame`); the innermost range wins.
        """
        seq = h.seq
        if seq is None:
            return False
        me = threading.get_ident()
        starts: dict[str, Event] = {}
        best: tuple[int, Event] | None = None
        for ev in self.events:
            if ev.thread != me or ev.seq is None:
                continue
            # By the name, not the label: a second thread that started during
            # this forward named its thread in the end's label, not the start's.
            if ev.kind == "forward":
                starts[ev.name] = ev
            elif ev.kind == "forward_end":
                start = starts.pop(ev.name, None)
                if start is not None and start.seq is not None \
                        and start.seq < seq <= ev.seq \
                        and (best is None or ev.seq - start.seq < best[0]):
                    best = (ev.seq - start.seq, start)
        if best is None:
            return False
        start = best[1]
        if h.module is None:
            h.module = start.module
        if h.saved_during is None:
            h.saved_during_forward(start.forward_ref())
        return True

    @_locked
    def freer(self, seq: int) -> Event | None:
        """The first freeing backward on this thread that began after node ``seq`` was made.

        The last backward recorded is the one being predicted: never its own freer.
        """
        me = threading.get_ident()
        backwards = [ev for ev in self.events if ev.kind == "backward"]
        for ev in backwards[:-1]:
            if ev.frees and ev.thread == me and ev.seq is not None and ev.seq >= seq:
                return ev
        return None

    @_locked
    def table(self, keys: list[int]) -> list[tuple[Event, list[int | None]]]:
        return [
            (ev, [vs.get(k) for k in keys]) for ev, vs in zip(self.events, self.versions)
        ]


class Ledger(LedgerQueries):
    """Versions of the watched tensors at each event. Safe to use from several threads."""

    def __init__(self, max_events: int = 512, max_history: int = 256) -> None:
        self.tracked: dict[int, Tracked] = {}
        self.by_name: dict[str, Tracked] = {}
        self.events: deque[Event] = deque(maxlen=max_events)
        self.versions: deque[dict[int, int]] = deque(maxlen=max_events)
        self.max_history = max_history
        self.count = 0
        # The fast path of _scan; None after ``tracked`` changed.
        self._layout: Layout | None = None
        self._lock = threading.RLock()
        # Keys of the tensors that an optimizer step in progress (on any
        # thread) may update, with that step: another thread's event that
        # sees them move meanwhile must blame the step, not its own interval.
        # Hogwild: several steps at once may update one tensor; the newest is blamed.
        self._stepping: dict[int, list[Modification]] = {}
        self._steps: dict[str, tuple[list[int], Modification]] = {}
        # The first thread that recorded; once another one records, labels
        # and causes name their thread.
        self._first_thread: int | None = None
        self._first_alive: weakref.ref[threading.Thread] | None = None
        self.threaded = False

    # -- tensors -------------------------------------------------------------------
    @_locked
    def track(self, name: str, t: torch.Tensor) -> None:
        if id(t) in self.tracked and self.tracked[id(t)].ref() is t:
            return
        tr = Tracked(name, t, self.max_history)
        self.tracked[id(t)] = tr
        self.by_name[name] = tr
        self._layout = None

    # -- events --------------------------------------------------------------------
    @_locked
    def begin_step(self, label: str, keys: list[int], mod: Modification) -> None:
        """A step labelled ``label`` may now update the tensors ``keys``."""
        mod = replace(mod, description=self.on_thread(mod.description))
        self._steps[label] = (keys, mod)
        for k in keys:
            self._stepping.setdefault(k, []).append(mod)

    def on_thread(self, text: str) -> str:
        """``text`` naming the current thread, once several threads record events."""
        return f"{text} on thread {threading.current_thread().name}" if self.threaded else text

    def end_step(self, label: str) -> None:
        with self._lock:  # inline, not @_locked: once a training step
            keys, mod = self._steps.pop(label, ((), None))
            for k in keys:
                mods = self._stepping.get(k)
                if mods is not None and mod in mods:
                    mods.remove(mod)
                    if not mods:
                        del self._stepping[k]

    @property
    def last_event(self) -> Event | None:
        return self.events[-1] if self.events else None

    def sync(self, upcoming: str, site: Site | None = None) -> None:
        """Attribute changes since the last event to the interval before ``upcoming``."""
        with self._lock:  # inline, not @_locked: once a training step
            self._between_row(self._scan(None, upcoming, site), upcoming)

    def _between_row(self, versions: dict[int, int], upcoming: str) -> None:
        """A timeline row for changes seen before ``upcoming`` but not made by it."""
        if self.versions and self.events:
            prev = self.versions[-1]
            if versions is not prev and versions != prev:
                text = f"(between {self.events[-1].label} and {upcoming})"
                self.events.append(Event(self.count, "between", text,
                                         thread=threading.get_ident(), name=text))
                self.versions.append(versions)

    def record(
        self,
        kind: str,
        label: str,
        site: Site | None = None,
        cause: Modification | None = None,
        notes: dict[int, str] | None = None,
        seq: int | None = None,
        module: str | None = None,
        frees: bool = False,
        unchanged: bool = False,
    ) -> Event:
        """Add an event; changes since the last one go to ``cause`` or to the interval.

        Once events come from more than one thread, ``label`` and ``cause``
        name the thread they happen on. ``unchanged``: the caller saw (with
        :class:`Layout`'s versions) that no version moved between the last event and this
        one, and versions have moved since; the event gets the last event's.
        """
        name, thread_name = label, None
        me = threading.get_ident()
        with self._lock:  # inline, not @_locked: six of these a training step
            self.count += 1
            if me != self._first_thread:
                if self._first_thread is None:
                    self._first_thread = me
                    # A thread that ends hands its ident on to a later one; the
                    # main one ends last. Another first thread is kept (weakly) to
                    # tell a later thread with its ident apart.
                    if me != threading.main_thread().ident:
                        self._first_alive = weakref.ref(threading.current_thread())
                else:
                    self.threaded = True
            elif self._first_alive is not None and not self.threaded \
                    and self._first_alive() is not threading.current_thread():
                self.threaded = True
            if self.threaded:
                thread_name = threading.current_thread().name
                label = f"{name} on thread {thread_name}"
                if cause is not None:
                    cause = replace(cause, description=f"{cause.description} on thread "
                                                       f"{thread_name}")
            if kind.endswith("_end"):
                # "end of backward #2", placed at the line that started it. A second
                # thread may have started between the two: the start's label may
                # lack the thread's name that this one has; its name does not.
                if self.threaded:
                    start = next((e for e in reversed(self.events)
                                  if e.thread == me and e.name == name and e.kind != kind),
                                 None)
                elif self.events and self.events[-1].label == label:
                    start = self.events[-1]  # the usual case: the start just before
                else:
                    start = next((e for e in reversed(self.events) if e.label == label), None)
                label, site = f"end of {label}", site or (start.site if start else None)
            event = _tuple_new(Event, (self.count, kind, label, site, seq, me, module, frees,
                                       name, thread_name))
            layout = self._layout
            if layout is not None:
                # _scan's fast path inline, for the usual event that moved nothing
                # (a watched tensor that died gives None: _scan drops it).
                vs = layout.native
                now: list[int] | None
                if unchanged or (vs is not None and vs.changed() is False):
                    now = layout.versions
                else:
                    now = read_versions(layout.refs)
                if now == layout.versions:
                    versions = layout.snapshot
                    if (cause is None and not unchanged and self.versions
                            and versions is not self.versions[-1]):
                        self._between_row(versions, label)
                    self.events.append(event)
                    self.versions.append(versions)
                    return event
                versions = self._scan(cause, label, site, notes, now)
            else:
                versions = self._scan(cause, label, site, notes)
            if cause is None:
                # A change made before this event, not by it, gets its own row, so
                # that e.g. a backward row never shows a bump.
                self._between_row(versions, label)
            self.events.append(event)
            self.versions.append(versions)
            return event

    def end(self, kind: str, label: str, cause_kind: str, cause_text: str,
            seq: int | None = None) -> Event:
        """:meth:`record` an end event (``forward_end``, ``backward_end``).

        ``Modification(cause_kind, cause_text)`` is the cause, which only a
        version that moved during the forward or backward needs: usually none did.
        """
        with self._lock:
            layout = self._layout
            if layout is not None and not self.threaded \
                    and layout.unchanged_since() is not None:
                return self.record(kind, label, seq=seq, unchanged=True)
            return self.record(kind, label, None, cause=Modification(cause_kind, cause_text),
                               seq=seq)

    def _scan(
        self,
        cause: Modification | None,
        upcoming: str,
        site: Site | None,
        notes: dict[int, str] | None = None,
        now: list[int] | None = None,
    ) -> dict[int, int]:
        """The versions now, by key; moves since the last scan go to the history.

        ``now``: the versions in layout order, just read by the caller (else
        read here); None after a watched tensor died.
        """
        layout = self._layout
        if layout is not None:
            keys, refs, trs, last, snapshot, vs = layout
            if now is None:
                if vs is not None and vs.changed() is False:
                    return snapshot  # nothing moved, as below
                now = read_versions(refs)  # None if a watched tensor died: the slow path
            if now is not None:
                if now == last:  # nothing moved: share the previous snapshot
                    return snapshot
                mod = cause or self._between(upcoming, site)
                count = self.count
                stepping = self._stepping
                for k, (v, old) in enumerate(zip(now, last)):
                    if v != old:
                        tr = trs[k]
                        note = notes.get(keys[k], "") if notes else ""
                        m = stepping[keys[k]][-1] if stepping and keys[k] in stepping else mod
                        tr.history.append(_tuple_new(Transition, (old, v, count, m, note)))
                        tr.last = v
                snapshot = dict(zip(keys, now))
                self._layout = _tuple_new(Layout, (keys, refs, trs, now, snapshot,
                                                   _version_set(refs, now)))
                return snapshot
        versions: dict[int, int] = {}
        dead = []
        for key, tr in self.tracked.items():
            t = tr.ref()
            if t is None:
                dead.append(key)
                continue
            v = t._version
            versions[key] = v
            if v != tr.last:
                steps = self._stepping.get(key)
                mod = steps[-1] if steps else cause or self._between(upcoming, site)
                tr.history.append(
                    Transition(tr.last, v, self.count, mod, (notes or {}).get(key, ""))
                )
                tr.last = v
        for key in dead:
            tr = self.tracked.pop(key)
            if self.by_name.get(tr.name) is tr:
                del self.by_name[tr.name]
        trs = list(self.tracked.values())
        refs = [tr.ref for tr in trs]
        last = [tr.last for tr in trs]
        self._layout = _tuple_new(Layout, (list(self.tracked), refs, trs, last, versions,
                                           _version_set(refs, last)))
        return versions

    def _between(self, upcoming: str, site: Site | None) -> Modification:
        prev = self.last_event
        if prev is None:
            return Modification("between_events", f"before {upcoming}", site)
        where = f" ({prev.site})" if prev.site else ""
        here = f" ({site})" if site else ""
        # Not a watched forward, backward or step: code of the user's own
        # (a no_grad update, a clip, a weight merge) or an unwatched library.
        return Modification("between_events",
                            f"in user code between {prev.label}{where} and {upcoming}{here}",
                            bounds=((prev.label, prev.site), (upcoming, site)))

    @_locked
    def silent(self, t: torch.Tensor, mod: Modification, note: str = "") -> None:
        """A write that did not bump the version (a fused optimizer kernel)."""
        tr = self.tracked.get(id(t))
        if tr is not None:
            tr.history.append(Transition(t._version, t._version, self.count, mod, note))
