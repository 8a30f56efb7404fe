"""Zero-code watching: every module and optimizer a program creates.

A global forward pre-hook (``torch.nn.modules.module``) adopts each module the
first time it runs outside any adopted module: that module is a root. Its
submodules are remembered, so the hook's steady-state cost is one set lookup
per module call. Optimizers are adopted by the watcher's global step hooks the
first time they step a watched parameter.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from versionwatch._compat import is_compiling
from versionwatch._config import Policy
from versionwatch._functorch import in_functorch_transform
from versionwatch._watch import Watcher, _variable_name


class AutoWatcher(Watcher):
    """A :class:`Watcher` that adopts every root module when it first runs.

    Create it with :func:`versionwatch.watch_all`.
    """

    def __init__(self, on_hazard: Policy = "raise", strict: bool = False,
                 stop_at_write: bool = False) -> None:
        super().__init__({}, (), on_hazard, strict=strict, stop_at_write=stop_at_write)
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        ref = weakref.ref(self)

        def hook(module: nn.Module, args: Any) -> None:
            if is_compiling() or in_functorch_transform():
                # A module called inside a torch.compile trace, or inside torch.func
                # (functional_call has swapped its parameters for wrappers).
                return
            w = ref()
            if w is not None and not w._closed and module not in w._seen:
                w._adopt_root(module)

        self._handles.append(register_module_forward_pre_hook(hook))

    def _label(self, root: str, n: int) -> str:
        # Roots appear one by one here, so labels always carry the root's name.
        return f"{root}.forward #{n}"

    def _adopt_root(self, module: nn.Module) -> None:
        if next(module.parameters(), None) is None and next(module.buffers(), None) is None:
            self._seen.add(module)  # a loss function: nothing to watch
            return
        name = _variable_name(module, 2)
        taken = set(self._roots)
        unique, k = name, 1
        while unique in taken:
            k += 1
            unique = f"{name}{k}"
        for sub in module.modules():
            self._seen.add(sub)
        self._add_root(unique, module)
        # The global hook runs before the module's own hooks were registered, so
        # this first call's forward event is recorded here.
        self._on_forward(unique, True)


def watch_all(on_hazard: Policy = "raise", strict: bool = False,
              stop_at_write: bool = False) -> AutoWatcher:
    """Watch every module and optimizer the program uses from now on.

    This is what ``versionwatch run`` and ``pytest --versionwatch`` use. Root
    modules are named by the variable that holds them where the call happens
    (``model.w3``), else by their class (``Model.w3``).

    Args:
        on_hazard: as in :func:`versionwatch.watch`.
        strict: as in :func:`versionwatch.watch`.
        stop_at_write: as in :func:`versionwatch.watch`.

    Example:
        >>> import torch, versionwatch
        >>> with versionwatch.watch_all() as w:
        ...     model = torch.nn.Linear(2, 1)
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> sorted(w.ledger.by_name)
        ['model.bias', 'model.weight']
    """
    return AutoWatcher(on_hazard, strict, stop_at_write)
