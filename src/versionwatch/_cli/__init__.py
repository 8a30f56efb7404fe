"""The ``versionwatch`` command: ``run``, ``merge``, ``demo``, ``native`` and ``fix``.

It owns argument parsing and running a script as ``__main__`` (``command``), what a
run writes (``outputs``: ``--json``, ``--dot``, ``--svg``), how a run ends
(``sigterm``), ``--replay`` (``replay``), ``merge`` of ranks' reports (``merge``),
the bundled seed story (``demo``), and the script that starts our children as
``python -m`` would, without the working directory on ``sys.path`` (``boot``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch._cli.command import main as main

_WHERE = {
    "main": "versionwatch._cli.command",
}

__getattr__ = lazy_names(__name__, _WHERE)
