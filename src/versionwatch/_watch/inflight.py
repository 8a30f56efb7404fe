"""Backwards in flight: a prediction waits for other threads' backwards over its graph.

Why: a backward with ``retain_graph=False`` frees the saved tensors of every
node it runs. A prediction made on thread B while thread A's backward is
still running over a shared part of the graph reads those tensors before A
frees them, and predicts "ok" for a backward that PyTorch then fails. So each
watched backward holds a :class:`Flight` on the nodes it walked from its
prediction to its end, and a prediction that shares a node with another
thread's flight waits for that flight to land, then predicts what PyTorch
will see.

What never waits: a backward started while this thread runs a graph task (a
reentrant checkpoint, a hook that calls backward, on the caller's or a device
thread), whose outer backward may be the very flight it would wait for.
Flights over disjoint graphs run concurrently.

Nor does a prediction wait for a flight that may be waiting for it: one whose
backward's engine has called into the program's own Python code (a hook, a
custom Function's backward). That code can wait for anything, such as a thread
it started to run this very backward and then joined; the flight could then
never land before the waiter does. While the engine runs only PyTorch's code
(wrappers of the program's around ``backward`` or the engine wait for the
engine, below it on the stack), a flight lands on its own, and waiting for it
is safe. A waiter re-checks
this every ``RECHECK_S`` (a flight cannot say when its engine calls into a
hook), so it stops waiting as soon as the flight's backward enters the
program's code; it waits for nothing else, and for no fixed time. A prediction
that does not wait races the flight's backward as it would without a watcher,
and is exact whenever that backward stays in its hook until the waiter's
backward ends (a hook that joins the thread it started).

Node identity: a node's Python wrapper lives only while something holds it,
and the next walk may get a new one, at a reused address. So a flight in the
air holds the wrappers its prediction walked (only while the process runs
several threads, and only until it lands: what a backward runs is alive
anyway), and another thread's walk then meets the very same wrappers, whose
``id()``s compare exactly. A landed flight keeps a fingerprint instead (each
node's class and sequence number), used only to name who freed a graph.

While the process runs one Python thread, flights record no nodes: a
single-threaded program pays one lock round trip per backward. A flight
without nodes (its thread was alone when it took off) blocks every other
thread's prediction until it lands.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from versionwatch import _sites
from versionwatch._package import PACKAGE_DIR
from versionwatch._report import Report, Site

# How often a waiting prediction looks again at what the flights it waits for
# run (see the module's docstring): a wait ends on a condition, never after a
# fixed time.
RECHECK_S = 0.01
# Frames of these folders are not the program's: PyTorch's and versionwatch's.
# As faulthandler prints paths (see versionwatch._sites.thread_stacks).
_OWN_DIR = _sites.as_dumped(PACKAGE_DIR)
_TORCH_DIR = _sites.as_dumped(os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), ""))
_LIBRARY_DIRS = (_TORCH_DIR, _OWN_DIR)
# PyTorch's Python frame that calls into the C++ engine (torch/autograd/graph.py,
# every supported release): what runs above it on that thread, the engine called.
_ENGINE_ENTRY = "_engine_run_backward"

# _MUTEX is _COND's lock: taken directly on the hot paths (Condition's own
# __enter__ is a Python call), with the same effect.
_MUTEX = threading.Lock()
_COND = threading.Condition(_MUTEX)
_FLYING: dict[int, Flight] = {}
# Landed flights, newest last: who freed a graph that a later prediction finds freed.
_LANDED: deque[Flight] = deque(maxlen=32)
_TOKENS = iter(range(1, 1 << 62))
# Predictions waiting in depart() (changed under _COND): land() notifies only then.
_WAITING = 0


class _Serial(threading.local):
    # get_ident() is reused once a thread ends: a landed flight of a dead
    # thread must not pass for the current thread's own.
    value = 0


_SERIAL = _Serial()
_SERIALS = iter(range(1, 1 << 62))


def _thread_serial() -> int:
    if not _SERIAL.value:
        with _COND:
            _SERIAL.value = next(_SERIALS)
    return _SERIAL.value


def _in_graph_task() -> bool:
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and int(task_id()) != -1


class Flight:
    """One watched backward, from its prediction to its end.

    Attributes:
        thread: a number for the thread that called it, unique in the process.
        thread_name: that thread's name.
        label: the watcher's event label (``"backward #3"``).
        site: where the user called it.
        nodes: ``id()`` of each node its prediction walked (``held`` keeps
            them valid until it lands); ``None`` while the program had one thread.
        prints: after landing, the fingerprint of the nodes it freed.
        frees: it runs without ``retain_graph``: it frees what it runs.
        owner: ``id()`` of the watcher that labelled it.
        freed_by: freeing flights of other threads of the same watcher that
            may have freed part of its graph: the landed ones first, then the
            last ``exact`` ones, which shared a node with it in the air.
    """

    __slots__ = ("exact", "freed_by", "frees", "held", "ident", "label", "nodes", "owner",
                 "prints", "site", "thread", "thread_name", "token")

    def __init__(self, owner: object, label: str, site: Site | None,
                 frees: bool = True) -> None:
        self.owner = id(owner)
        self.exact = 0
        self.thread = _SERIAL.value or _thread_serial()
        self.ident = threading.get_ident()
        self.thread_name = threading.current_thread().name
        self.label = label
        self.site = site
        self.frees = frees
        self.nodes: frozenset[int] | None = None
        self.held: list[Any] = []
        self.prints: frozenset[tuple[str, int]] = frozenset()
        self.freed_by: list[Flight] = []
        self.token = 0

    def describe(self) -> str:
        """``backward #3 on thread worker-1 at train.py:12``."""
        text = f"{self.label} on thread {self.thread_name}"
        return f"{text} at {self.site}" if self.site is not None else text


def _shares(a: Flight, nodes: frozenset[int] | None) -> bool:
    if a.nodes is None or nodes is None:
        return True  # unknown graph: assume the worst
    return not a.nodes.isdisjoint(nodes)


def depart(flight: Flight, nodes: Sequence[Any]) -> None:
    """Wait until no other thread's flight shares a node with ``nodes``, then take off.

    Called with the walked graph, before any saved tensor is read.
    """
    me = flight.thread
    if threading.active_count() == 1:
        with _MUTEX:
            for f in _FLYING.values():
                if f.thread != me:
                    break
            else:
                # One thread, and no other thread's flight in the air (the usual
                # training loop): nothing to wait for or record, as below,
                # without asking whether this thread runs a graph task.
                flight.nodes, flight.held = None, []
                flight.token = next(_TOKENS)
                _FLYING[flight.token] = flight
                return
    held = list(nodes) if threading.active_count() > 1 else []
    ids = frozenset(map(id, held)) if held else None
    nested = _in_graph_task()
    with _COND:
        if ids is None and threading.active_count() > 1:
            held = list(nodes)  # a thread started meanwhile
            # No nodes (the native check walks none): unknown, as a lone flight.
            ids = frozenset(map(id, held)) if held else None
        flight.nodes, flight.held = ids, held

        def blocking() -> list[Flight]:
            return [f for f in _FLYING.values() if f.thread != me and _shares(f, ids)]

        if not nested and blocking():
            global _WAITING
            _WAITING += 1
            try:
                while True:
                    flights = blocking()
                    if not flights or not _may_wait_for(flights):
                        break
                    _COND.wait(RECHECK_S)
            finally:
                _WAITING -= 1
        if ids is not None:
            exact = [f for f in _FLYING.values() if f.thread != me and f.frees
                     and f.nodes is not None and not f.nodes.isdisjoint(ids)]
            landed = [f for f in _LANDED if f.thread != me and f.owner == flight.owner]
            flight.freed_by, flight.exact = landed + exact, len(exact)
        flight.token = next(_TOKENS)
        _FLYING[flight.token] = flight


def _may_wait_for(flights: list[Flight]) -> bool:
    """Whether each of ``flights`` will land without the program's help.

    No, if its thread runs the program's own code inside its backward (a hook
    that may be waiting for the waiter); no, too, if a thread that Python did
    not start (autograd's device threads, which run the hooks of CUDA nodes)
    runs the program's code, since which backward it serves is unknown. The
    stacks are read in one step (:func:`versionwatch._sites.thread_stacks`):
    walking another running thread's ``f_back`` can crash CPython.
    """
    stacks = _sites.thread_stacks()
    # A thread that Python did not start shows as a dummy once it asks for
    # current_thread(), if ever.
    dummy = getattr(threading, "_DummyThread", ())
    started = {t.ident for t in threading.enumerate() if not isinstance(t, dummy)}
    for ident, stack in stacks.items():
        if ident not in started and _runs_program_code(stack, stop_at_backward=False):
            return False
    for f in flights:
        flying = stacks.get(f.ident)
        if flying is not None and _runs_program_code(flying, stop_at_backward=True):
            return False
    return True


def _runs_program_code(stack: _sites.Stack, stop_at_backward: bool) -> bool:
    """Whether the thread with ``stack`` runs the program's own code (neither
    PyTorch's nor versionwatch's) that may wait for anything.

    For a flight's thread (``stop_at_backward``), only code that the engine
    called counts (a hook, a custom Function's backward): a frame of the
    program above PyTorch's entry into the engine. Code below that entry, on
    the way in (a profiler's or a test harness's wrapper of ``backward`` or of
    the engine itself), waits for the engine, which lands on its own; so does
    the program below its backward call. A stack cut short before that entry
    (over 100 frames deep) with the program's code in what was read counts as
    the program's: not waiting can only race, waiting could hang.
    """
    program = False  # a frame of the program seen above the frames walked so far
    for frame in stack.frames:
        if (stop_at_backward and frame.name == _ENGINE_ENTRY
                and frame.file.startswith(_TORCH_DIR)):
            if program:
                return True  # the engine called it
        elif not frame.file.startswith(_LIBRARY_DIRS):
            if not stop_at_backward:
                return True
            program = True
    return program and stack.cut


def _fingerprint(nodes: Sequence[Any]) -> frozenset[tuple[str, int]]:
    # AccumulateGrad nodes all share the largest sequence number, and save nothing.
    # The class name is the node's name() (CopySlices less its namespace), cheaper.
    return frozenset((type(n).__name__, s) for n in nodes if (s := n._sequence_nr()) != _NO_SEQ)


def _short(name: str) -> str:
    return name.rsplit("::", 1)[-1]


_NO_SEQ = (1 << 64) - 1


def land(flight: Flight) -> None:
    """The backward ended (or raised): release every prediction waiting for it."""
    held, flight.held = flight.held, []
    if flight.frees and held:
        flight.prints = _fingerprint(held)
    with _MUTEX:
        flight.freed_by = []  # landed flights must not chain to older ones
        flight.nodes = None
        if _FLYING.pop(flight.token, None) is not None:
            if flight.prints:
                _LANDED.append(flight)
            if _WAITING:  # counted under _COND: no waiter can be missed
                _COND.notify_all()
    del held  # outside the lock: the last reference to a graph may go with it


def name_freer(report: Report, flight: Flight) -> None:
    """Note on each freed hazard the other thread's backward that freed it.

    A flight that shared a node with this one in the air is known exactly. A
    landed one is matched by the freed node's name and sequence number; a
    node of the same name and number on another thread's own graph can match
    too (sequence numbers are per thread), so the newest match is named.
    """
    for h in report.hazards:
        if h.kind != "freed":
            continue
        freer = None
        if flight.exact:
            freer = flight.freed_by[-1]
        elif h.seq is not None:
            key = (_short(h.node), h.seq)
            freer = next((f for f in reversed(flight.freed_by) if key in f.prints), None)
        if freer is not None:
            h.notes.append(f"freed by {freer.describe()}, which shares this part of the "
                           "graph and ran first without retain_graph=True")


def frees(api: str, arguments: tuple[tuple[Any, ...], dict[str, Any]] | None) -> bool:
    """Whether a ``backward``/``grad`` call with these arguments frees the graph it runs."""
    if arguments is None:
        return True
    args, kwargs = arguments
    # backward(tensors, grad_tensors, retain_graph, create_graph, ...);
    # grad(outputs, inputs, grad_outputs, retain_graph, create_graph, ...)
    at = 2 if api == "backward" else 3
    retain = args[at] if len(args) > at else kwargs.get("retain_graph")
    create = args[at + 1] if len(args) > at + 1 else kwargs.get("create_graph", False)
    return not (create if retain is None else retain)
