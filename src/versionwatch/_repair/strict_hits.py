"""``on_hazard="repair"`` in strict mode: copy a record's tensor before a seen write hits it.

Strict mode packs every saved tensor into a record already (:mod:`_strict_records`):
a write about to hit a record's memory swaps the record's tensor for a copy,
within the repairer's budget (:mod:`_repair`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from versionwatch._report import Repair, Site

if TYPE_CHECKING:
    from versionwatch._strict import SavedRecord

    # Tensors a write is about to hit, each with a record that saved its memory.
    Hits = list[tuple[torch.Tensor, SavedRecord]]


class Copier(Protocol):
    """The repairer as this module uses it (it calls this module, so it is not imported)."""

    def copy(self, data: torch.Tensor, base: torch.Tensor,
             copies: dict[tuple[int, int], torch.Tensor]) -> tuple[torch.Tensor, int] | None: ...

    def over_budget(self, what: str, keeper: str) -> None: ...

    def note(self, repair: Repair) -> None: ...


def strict_hits(repairer: Copier, names: dict[int, str], label: str, site: Site | None,
                hits: Hits) -> Hits:
    """Swap each hit record's tensor for a copy; return the hits left to record.

    A record that is stale already, or was written silently before, keeps its
    hazard. Records repaired earlier are written no more: their tensor is a copy.
    """
    left: Hits = []
    done: dict[str, tuple[int, str]] = {}
    # Records of one memory (sigmoid's result and the next layer's input are
    # one tensor, saved twice) share one copy.
    shared: dict[tuple[Any, ...], torch.Tensor] = {}
    for t, rec in hits:
        if rec in _REPAIRED:
            continue
        cur = rec.tensor
        if cur._version != rec.version or rec._silent or rec in _REFUSED:
            left.append((t, rec))
            continue
        geometry = (cur.data_ptr(), cur.dtype, tuple(cur.shape), cur.stride(), cur._version)
        copy = shared.get(geometry)
        nbytes = 0
        if copy is None:
            made = repairer.copy(cur, cur, {})
            if made is None:
                _REFUSED.add(rec)
                repairer.over_budget(f"the graph of {_forward_of(rec)}",
                                     "It is kept alive by a tensor (a loss, an output) you "
                                     "still hold")
                left.append((t, rec))
                continue
            copy, nbytes = made
            shared[geometry] = copy
        rec.tensor = copy
        rec.version = copy._version
        _REPAIRED.add(rec)
        own, base_id = rec.ids
        name = names.get(own) or (names.get(base_id) if base_id is not None else None)
        if name is None:
            what = f"{str(cur.dtype).replace('torch.', '')}{list(cur.shape)}"
            name = f"an activation ({what}"
            name += f", saved in {rec.module})" if rec.module else ")"
        entry = done.get(name)
        if entry is None:
            entry = (0, _forward_of(rec))
        done[name] = (entry[0] + nbytes, entry[1])
    for name, (nbytes, graph) in done.items():
        repairer.note(Repair(tensor=name, nbytes=nbytes, graph=graph, before=label, site=site))
    return left


def _forward_of(rec: SavedRecord) -> str:
    return rec.forward.named if rec.forward is not None else "code outside watched forwards"


# Records whose tensor is a copy already, and those the budget refused.
_REPAIRED: weakref.WeakSet[SavedRecord] = weakref.WeakSet()
_REFUSED: weakref.WeakSet[SavedRecord] = weakref.WeakSet()
