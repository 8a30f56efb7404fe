"""What the package knows of itself: its version, its folder, and the old names of moved modules.

A leaf (no torch, nothing else of the package), so that any module, the native
build and the fix child included, reads these without importing the package.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from importlib.machinery import ModuleSpec

__version__ = "0.1.0"

# The one answer to "is this frame ours?": every module of the package, in any of
# its folders, lies below it.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# Old name -> new name of each module that tools outside this repository import.
_MOVED = {"versionwatch._auto": "versionwatch._watch.auto"}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name: the one module object, imported on use."""

    def __init__(self) -> None:
        self.specs: dict[str, ModuleSpec | None] = {}  # each moved module's own spec

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        # The module itself, not a second copy: its classes stay the ones in use.
        module = importlib.import_module(_MOVED[spec.name])
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # Imported already, under its new name. The import system has just set
        # the old name's spec on it: give it back its own (reload, find_spec).
        module.__spec__ = self.specs[module.__name__]


def keep_old_names() -> None:
    """Keep the old name of each module that tools outside this repository import.

    The peer harness (shared/peer/vw_oracle.py) imports ``versionwatch._auto``,
    which is ``versionwatch._watch.auto`` now. Nothing is imported until the old
    name is.
    """
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """A package's ``__getattr__``: each of its names loads its module on first use.

    So importing one module of a folder costs no other (the pytest plugin starts
    without torch), and ``python -m`` of a module in a folder finds it not yet
    imported. A name, once loaded, is the package's own attribute.

    Args:
        package: the package's ``__name__``.
        where: each name -> the module that defines it.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
