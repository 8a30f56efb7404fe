"""What the package knows of itself: its version, its folder, and the old names of moved modules.

A leaf (no torch, nothing else of the package), so that any module, the native
build and the fix child included, reads these without importing the package.
"""

import importlib
import os
import sys
import types

__version__ = "0.1.0"

# The one answer to "is this frame ours?": every module of the package, in any of
# its folders, lies below it.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Moved(types.ModuleType):
    """A module that moved into a folder, importable under its old name, loaded on use."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old)
        self.__new = new

    def __getattr__(self, name: str) -> object:
        return getattr(importlib.import_module(self.__new), name)


def keep_old_names() -> None:
    """Keep the old name of each module that tools outside this repository import.

    The peer harness (shared/peer/vw_oracle.py) imports ``versionwatch._auto``,
    which is ``versionwatch._watch.auto`` now. Nothing is imported until the old
    module is used.
    """
    sys.modules.setdefault("versionwatch._auto", _Moved("versionwatch._auto",
                                                        "versionwatch._watch.auto"))
