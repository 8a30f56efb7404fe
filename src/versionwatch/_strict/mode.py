"""Strict mode: see each write to a saved tensor's memory at the line that makes it.

Installed only while a strict watcher is open (:data:`ANCHOR`), in three parts:

- **Records** (:mod:`_strict_records`): a ``saved_tensors_hooks`` pair packs
  every tensor autograd saves into a record of its version, module, forward
  and line; the unpack hook runs PyTorch's own version check. Its entry on
  the per-thread hooks stack is kept out of others' way by :mod:`_hookstack`.
- **Write interception** (:mod:`_strict_writes`): every in-place entry point
  is wrapped; a write that hits a live record's memory is recorded on it.
- **Per-thread state** (:mod:`_strict_thread`): the optimizer step, forward
  and module calls running, which label the records and the writes.

A write is only recorded: whether it matters is known when a backward would
unpack what it changed, and the prediction before that backward reads the
records. ``stop_at_write`` also reports at the write, before it happens.
A hook's in-place write to a gradient that other nodes also receive is
reported when such a node reads it (:mod:`_strict.gradients`).

Writes made inside C++ kernels (BatchNorm's running stats) are not seen;
inside ``torch.compile`` regions a write is placed at the compiled function.

This module starts and ends strict mode for a watcher (:func:`attach`), and
is the one the rest of versionwatch imports: it re-exports what they use.
"""

from __future__ import annotations

from versionwatch._compat import engine_checks_gradients
from versionwatch._runtime import Anchor, Change, Removable, Subscription, remove_all
from versionwatch._strict import gradients as _gradients
from versionwatch._strict import hookstack as _hookstack
from versionwatch._strict.records import (
    RECORDS,
    SavedRecord,
    name_modules,
    pack,
    saved_line,
    unpack,
)
from versionwatch._strict.records import changes as _record_changes
from versionwatch._strict.thread import THREAD, begin_step, end_step
from versionwatch._strict.writes import OWNERS, REPAIRERS, StrictOwner, StrictRepairer, on_write
from versionwatch._strict.writes import changes as _write_changes

__all__ = ["ANCHOR", "RECORDS", "THREAD", "SavedRecord", "StrictOwner", "StrictRepairer",
           "attach", "begin_step", "end_step", "name_modules", "on_write", "pack", "saved_line",
           "unpack"]


def _changes() -> list[Change]:
    """Every change strict mode makes to the process, in the order applied."""
    return [*_record_changes(), *_write_changes(), *_hookstack.changes(pack, unpack)]


# Strict mode's patches, in place while any strict watcher is open.
ANCHOR = Anchor("strict mode patches", _changes)


def attach(owner: StrictOwner) -> Subscription:
    """Start strict mode for ``owner`` on this thread; the subscription ends it.

    Ending it from another thread leaves this thread's hook entry inert:
    PyTorch lets no thread pop another's saved-tensor hooks, so it stays on
    the owner's stack until that thread's next contact with versionwatch (a
    save through it, a push or pop of saved-tensor hooks, a ``torch.func``
    transform), which takes it out; pack there records nothing once no strict
    watcher is open.
    """
    engine_checks_gradients()  # probed once, before any patch: see _compat
    held: list[Removable] = [ANCHOR.subscribe()]
    try:
        held.append(OWNERS.add(owner))
        if owner.repairer is not None:
            held.append(REPAIRERS.add(owner.repairer))
        entry = _hookstack.push()
    except BaseException:
        remove_all(held)
        raise

    def detach() -> None:
        try:
            _hookstack.pop(entry)
        finally:
            end_step()
            THREAD.forward = None
            remove_all(held)
            if not OWNERS:
                _gradients.end_all()  # a backward that raised left its pre-hooks

    return Subscription(detach)
