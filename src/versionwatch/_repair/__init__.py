"""``on_hazard="repair"``: a backward after ``step()`` works, from copies kept before a seen write.

It owns the repairer (``repairer``), which copies what a live graph saved just
before a watched step overwrites it; those copies laid out as backward reads them
(``copies``); and the repair of strict mode's records before a seen write hits them
(``strict_hits``). It declares the face it needs of its watcher (``RepairHost``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from versionwatch._repair.repairer import Repairer as Repairer

# Each name loads its module on first use, as the package's own names do: importing
# one module of the folder costs no other (the pytest plugin, at start-up), and
# ``python -m`` of a module here finds it not yet imported.
_WHERE = {
    "Repairer": "versionwatch._repair.repairer",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
