"""_runtime: the one mechanism for process-wide state, tested on plain objects."""

from __future__ import annotations

import gc
import threading
import types

import pytest

from versionwatch._runtime import (
    Anchor,
    Call,
    Entry,
    Patch,
    Registry,
    Subscription,
    anchor,
    installed,
    remove_all,
)


class Boom(Exception):
    pass


def test_an_anchor_applies_with_the_first_and_restores_with_the_last():
    box = types.SimpleNamespace(f="old")
    table: dict[str, str] = {}
    a = Anchor("test anchor", lambda: [Patch(box, "f", "new"), Entry(table, "k", "v")])
    first = a.subscribe()
    second = a.subscribe()
    assert (box.f, table, installed()["test anchor"]) == ("new", {"k": "v"}, 2)
    first.remove()
    first.remove()  # twice is fine
    assert box.f == "new" and table == {"k": "v"}
    second.remove()
    assert box.f == "old" and table == {} and "test anchor" not in installed()


def test_a_change_that_fails_takes_back_those_applied_before_it():
    box = types.SimpleNamespace(f="old")

    def fail() -> None:
        raise Boom

    a = Anchor("failing anchor", lambda: [Patch(box, "f", "new"), Call(fail, lambda: None)])
    with pytest.raises(Boom):
        a.subscribe()
    assert box.f == "old" and not a.active and "failing anchor" not in installed()


def test_a_patch_of_an_inherited_attribute_leaves_the_class_as_it_was():
    class Base:
        f = "base"

    class Child(Base):
        pass

    p = Patch(Child, "f", "patched")
    p.apply()
    assert Child.f == "patched"
    p.restore()
    assert "f" not in vars(Child) and Child.f == "base"
    assert p.original == "base"  # kept after the restore, for wrappers kept past it


def test_threads_asking_for_one_keyed_anchor_share_it():
    box = types.SimpleNamespace(f="old")
    applied = []

    def changes() -> list[Patch]:
        applied.append(1)
        return [Patch(box, "f", "new")]

    subs: list[Subscription] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        subs.append(anchor(("test key", id(box)), "keyed anchor", changes).subscribe())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert applied == [1] and installed()["keyed anchor"] == 8
    remove_all(subs)
    assert box.f == "old" and "keyed anchor" not in installed()


def test_remove_all_tries_every_one_and_raises_the_first_error():
    removed = []

    def broken() -> None:
        removed.append("broken")
        raise Boom

    held = [Subscription(lambda: removed.append("a")), Subscription(broken),
            Subscription(lambda: removed.append("c"))]
    with pytest.raises(Boom):
        remove_all(held)  # type: ignore[arg-type]
    assert removed == ["c", "broken", "a"] and held == []


def test_a_weak_registry_lets_a_dropped_object_go():
    class Thing:
        pass

    reg: Registry[Thing] = Registry("test things", weak=True)
    kept, dropped = Thing(), Thing()
    entry = reg.add(kept)
    reg.add(dropped)
    del dropped
    gc.collect()
    assert reg.items() == [kept] and reg.newest() is kept and installed()["test things"] == 1
    entry.remove()
    assert not reg and "test things" not in installed()
