"""Everything versionwatch installs in the process, and the one way it is installed.

A watcher changes process-wide state: it replaces ``torch.autograd.backward``
and ``grad``, registers global optimizer hooks, places the forward route on
module classes, wraps every in-place entry point in strict mode, and keeps
registries of open watchers. Each such thing is an :class:`Anchor`: a set of
:class:`Change`\\ s installed with its first subscriber and taken out with its
last (pyinstrument's subscribe/unsubscribe), with one rollback path: a change
that fails to apply takes back the ones applied before it. A subscription is a
:class:`Subscription`, which removes like ``torch.utils.hooks.RemovableHandle``
and doubles as a context manager; :func:`remove_all` gives back a list of them
(and of torch's handles) newest first, whatever one of them raises.

Live objects of one kind (open watchers, forward routes) are kept in a
:class:`Registry`, also visible here; state kept in a form of its own (strict
mode's saved records, hook entries left for another thread) is shown through a
probe (:func:`add_probe`). :func:`installed` lists every anchor with
subscribers, every non-empty registry and every probe that is not zero: empty
once every watcher is closed, whatever raised and whichever thread closed it.
Tests assert on it instead of reading private state.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, MutableMapping
from typing import Any, Generic, Protocol, TypeVar

from typing_extensions import Self

_LOCK = threading.RLock()
_MISSING = object()


class Change(Protocol):
    """One reversible change to process-wide state."""

    def apply(self) -> None: ...

    def restore(self) -> None: ...


class Patch:
    """``owner.attr`` replaced by ``new`` while applied (a module, a class, an object).

    Restored to what the owner's own ``__dict__`` held, or deleted if it held
    nothing (the attribute was inherited), so a class goes back exactly as it was.
    """

    __slots__ = ("attr", "had", "new", "old", "on", "owner")

    def __init__(self, owner: object, attr: str, new: Any) -> None:
        self.owner = owner
        self.attr = attr
        self.new = new
        # What ``owner.attr`` was when last applied. It stays after the
        # restore: a wrapper someone kept (``from torch.autograd import
        # backward`` inside a watch block) still reaches the original.
        self.old: Any = _MISSING
        self.had = False
        self.on = False  # applied now

    def apply(self) -> None:
        own = vars(self.owner)
        self.had = self.attr in own
        self.old = own[self.attr] if self.had else getattr(self.owner, self.attr, _MISSING)
        setattr(self.owner, self.attr, self.new)
        self.on = True

    def restore(self) -> None:
        self.on = False
        if self.had:
            setattr(self.owner, self.attr, self.old)
        elif self.attr in vars(self.owner):
            delattr(self.owner, self.attr)

    @property
    def original(self) -> Any:
        """What ``owner.attr`` was before the patch (kept after the restore)."""
        return self.old

    def __repr__(self) -> str:
        owner = getattr(self.owner, "__name__", type(self.owner).__name__)
        return f"Patch({owner}.{self.attr})"


_K = TypeVar("_K")
_V = TypeVar("_V")


class Entry(Generic[_K, _V]):
    """``table[key] = value`` while applied (TorchScript's builtin table, say)."""

    __slots__ = ("key", "table", "value")

    def __init__(self, table: MutableMapping[_K, _V], key: _K, value: _V) -> None:
        self.table = table
        self.key = key
        self.value = value

    def apply(self) -> None:
        self.table[self.key] = self.value

    def restore(self) -> None:
        if self.table.get(self.key) is self.value:
            del self.table[self.key]


class _Handle(Protocol):
    def remove(self) -> None: ...


_F = TypeVar("_F")


class Hook(Generic[_F]):
    """A hook registered with ``register(fn)`` while applied, removed by its handle."""

    __slots__ = ("fn", "handle", "register")

    def __init__(self, register: Callable[[_F], _Handle], fn: _F) -> None:
        self.register = register
        self.fn = fn
        self.handle: _Handle | None = None

    def apply(self) -> None:
        self.handle = self.register(self.fn)

    def restore(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()


class Call:
    """``on()`` when applied and ``off()`` when restored: state that is not an attribute."""

    __slots__ = ("off", "on")

    def __init__(self, on: Callable[[], None], off: Callable[[], None]) -> None:
        self.on = on
        self.off = off

    def apply(self) -> None:
        self.on()

    def restore(self) -> None:
        self.off()


def apply_all(changes: Iterable[Change]) -> list[Change]:
    """Apply ``changes`` in order; if one raises, restore those applied and re-raise."""
    done: list[Change] = []
    try:
        for change in changes:
            change.apply()
            done.append(change)
    except BaseException:
        restore_all(done)
        raise
    return done


def restore_all(changes: list[Change]) -> None:
    """Restore ``changes`` newest first; every one is tried, the first error is raised."""
    error: BaseException | None = None
    while changes:
        try:
            changes.pop().restore()
        except BaseException as e:  # the rest must still go back
            error = error or e
    if error is not None:
        raise error


class Removable(Protocol):
    """Anything removed by ``remove()``: a :class:`Subscription`, a ``RemovableHandle``."""

    def remove(self) -> None: ...


class Subscription:
    """One hold on process-wide state; ``remove()`` lets go (twice is fine).

    Like ``torch.utils.hooks.RemovableHandle``, it is also a context manager.
    """

    __slots__ = ("__weakref__", "_release")

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def remove(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def active(self) -> bool:
        return self._release is not None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def remove_all(held: list[Removable]) -> None:
    """Remove ``held`` newest first, emptying it; every one is tried, the first error is raised.

    The one rollback path: what a failed setup took, and what a close gives back.
    """
    error: BaseException | None = None
    while held:
        try:
            held.pop().remove()
        except BaseException as e:  # the rest must still go
            error = error or e
    if error is not None:
        raise error


_ANCHORS: dict[Hashable, Anchor] = {}


class Anchor:
    """Process-wide changes shared by subscribers: applied with the first, restored with the last.

    ``changes`` makes the list when the first subscriber comes (so each install
    reads what is there then). An anchor made with :func:`anchor` is kept by
    key while it has subscribers and dropped after its last.
    """

    __slots__ = ("__weakref__", "_applied", "_changes", "_key", "count", "name")

    def __init__(self, name: str, changes: Callable[[], Iterable[Change]],
                 key: Hashable = None) -> None:
        self.name = name
        self._changes = changes
        self._applied: list[Change] = []
        self._key = key
        self.count = 0  # subscribers now; read as is on hot paths (no call)

    def subscribe(self) -> Subscription:
        """Hold the anchor; the first holder applies its changes (all or none).

        A keyed anchor let go by its last holder meanwhile hands over to the
        one now kept under its key, if another was made since: one key, one
        set of changes in place.
        """
        with _LOCK:
            if self._key is not None:
                kept = _ANCHORS.get(self._key)
                if kept is not None and kept is not self:
                    return kept.subscribe()
            if self.count == 0:
                self._applied = apply_all(self._changes())
                if self._key is not None:
                    _ANCHORS[self._key] = self
            self.count += 1
        _SUBSCRIBED.add(self)
        return Subscription(self._release)

    def _release(self) -> None:
        with _LOCK:
            self.count -= 1
            if self.count > 0:
                return
            self.count = 0
            applied, self._applied = self._applied, []
            if self._key is not None and _ANCHORS.get(self._key) is self:
                del _ANCHORS[self._key]
            restore_all(applied)

    @property
    def active(self) -> bool:
        return self.count > 0


# Every anchor ever subscribed, weakly: for installed().
_SUBSCRIBED: weakref.WeakSet[Anchor] = weakref.WeakSet()


def anchor(key: Hashable, name: str, changes: Callable[[], Iterable[Change]]) -> Anchor:
    """The anchor kept under ``key`` (one per class, say), made if there is none.

    Kept from now until its last subscriber lets go, so that two threads
    asking at once get the same one.
    """
    with _LOCK:
        found = _ANCHORS.get(key)
        if found is None:
            found = _ANCHORS[key] = Anchor(name, changes, key)
        return found


_T = TypeVar("_T")


class Registry(Generic[_T]):
    """Live objects of one kind (open watchers, say), oldest first, shown by :func:`installed`.

    ``add`` returns the :class:`Subscription` that takes the entry out again.
    Entries are told apart by identity, never by ``==``.

    Args:
        name: what :func:`installed` calls it.
        weak: entries are held by weak reference, so that an object dropped
            without being taken out can still be collected; they drop out then.
        on_change: called with the live entries after each add and removal,
            under the registry's lock: a hot path's lock-free copy is made there.
    """

    __slots__ = ("_items", "name", "on_change", "weak")

    def __init__(self, name: str, weak: bool = False,
                 on_change: Callable[[list[_T]], None] | None = None) -> None:
        self.name = name
        self.weak = weak
        self.on_change = on_change
        self._items: list[Any] = []
        _REGISTRIES.append(self)

    def add(self, item: _T) -> Subscription:
        """Enter ``item`` (newest last); the subscription takes it out."""
        entry: Any = weakref.ref(item) if self.weak else item
        with _LOCK:
            self._items.append(entry)
            self._changed()
        return Subscription(lambda: self._take(entry))

    def _take(self, entry: object) -> None:
        with _LOCK:
            for i, e in enumerate(self._items):
                if e is entry:
                    del self._items[i]
                    self._changed()
                    return

    def discard(self, item: _T) -> None:
        """Take out every entry of ``item`` (an object that died, say)."""
        with _LOCK:
            kept = [e for e in self._items if (e() if self.weak else e) is not item]
            if len(kept) != len(self._items):
                self._items[:] = kept
                self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.items())

    def items(self) -> list[_T]:
        """The live entries, oldest first (a copy: safe while others add)."""
        with _LOCK:
            if not self.weak:
                return list(self._items)
            live = [x for x in (r() for r in self._items) if x is not None]
            if len(live) != len(self._items):
                self._items[:] = [r for r in self._items if r() is not None]
            return live

    def newest(self) -> _T | None:
        """The entry added last that is still alive, else None."""
        with _LOCK:
            for e in reversed(self._items):
                item = e() if self.weak else e
                if item is not None:
                    return item  # type: ignore[no-any-return]
        return None

    def __bool__(self) -> bool:
        # No lock and no call per entry: read on paths that run per write. A
        # weak entry whose object just died still counts until items() prunes it.
        return bool(self._items)

    def __len__(self) -> int:
        return len(self.items())

    def __iter__(self) -> Iterator[_T]:
        return iter(self.items())


_REGISTRIES: list[Registry[Any]] = []
# Extra probes for state that lives elsewhere (per-thread hook stacks): name -> count.
_PROBES: dict[str, Callable[[], int]] = {}


def add_probe(name: str, count: Callable[[], int]) -> None:
    """Show ``count()`` under ``name`` in :func:`installed` whenever it is not zero."""
    _PROBES[name] = count


def installed() -> dict[str, int]:
    """What of versionwatch is in the process now: empty when nothing is.

    Each anchor with subscribers (its subscriber count), each non-empty
    registry (its size) and each probe that is not zero.

    Example:
        >>> import torch, versionwatch
        >>> from versionwatch._runtime import installed
        >>> with versionwatch.watch(torch.nn.Linear(2, 1)):
        ...     "watchers" in installed()
        True
        >>> installed()
        {}
    """
    with _LOCK:
        found: dict[str, int] = {}
        for a in list(_SUBSCRIBED):
            if a.count > 0:
                found[a.name] = found.get(a.name, 0) + a.count
        for r in _REGISTRIES:
            n = len(r)
            if n:
                found[r.name] = found.get(r.name, 0) + n
        for name, count in _PROBES.items():
            n = count()
            if n:
                found[name] = n
    return found
