"""``on_hazard="repair"``: a backward after ``step()`` works, from copies kept before a seen write.

It owns the repairer (``repairer``), which copies what a live graph saved just
before a watched step overwrites it; those copies laid out as backward reads them
(``copies``); and the repair of strict mode's records before a seen write hits them
(``strict_hits``). It declares the face it needs of its watcher (``RepairHost``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._repair.repairer import Repairer as Repairer

_WHERE = {
    "Repairer": "versionwatch._repair.repairer",
}

__getattr__ = lazy_names(__name__, _WHERE)
