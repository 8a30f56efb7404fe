"""Integrations with training frameworks; each lives in its own submodule, imported on demand."""

from __future__ import annotations

from typing import TYPE_CHECKING

from versionwatch._package import lazy_names

if TYPE_CHECKING:
    from versionwatch.integrations.ipython import (
        load_ipython_extension as load_ipython_extension,
    )
    from versionwatch.integrations.ipython import (
        unload_ipython_extension as unload_ipython_extension,
    )

# IPython's entry points, re-exported by the package: each loads its module (never
# IPython itself) on first use, so the pytest plugin, which lives here, stays light.
_WHERE = {
    "load_ipython_extension": "versionwatch.integrations.ipython",
    "unload_ipython_extension": "versionwatch.integrations.ipython",
}

__getattr__ = lazy_names(__name__, _WHERE)
