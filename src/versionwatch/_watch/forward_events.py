"""A watched root's forwards: their numbers, their labels, their events in the ledger.

This is where a forward is recorded. ``_forward`` routes every call of a
watched root to the watcher's ``_on_forward``, which hands it to
:meth:`ForwardRecorder.record`, once before it runs and once after; the
ledger then holds a ``forward`` event (its label, the user's line, the
sequence clock) and a ``forward_end`` one, which ``_blame`` reads to say
which forward saved a tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn

from versionwatch import _strict
from versionwatch._compat import seq_clock
from versionwatch._ledger import Ledger
from versionwatch._naming import module_tensors
from versionwatch._report import Modification
from versionwatch._sites import user_site
from versionwatch._watch.protocols import ForwardToken

__all__ = ["ForwardRecorder"]


class ForwardRecorder:
    """A watcher's forward numbers and events, held by the :class:`~versionwatch.Watcher`.

    The watcher's ``_on_forward`` calls :meth:`record`; it shares the
    watcher's names, roots and ledger. The route (``_forward``) reads and
    numbers a no-grad forward inline: the watcher exposes :attr:`forwards`,
    :attr:`counters`, :attr:`synced` and :attr:`sharded` as its own.
    """

    __slots__ = ("counters", "forwards", "ledger", "named", "names", "roots", "sharded",
                 "strict", "synced")

    def __init__(self, names: dict[int, str], roots: dict[str, weakref.ref[nn.Module]],
                 ledger: Ledger, strict: bool, named: bool) -> None:
        self.names = names  # id of each watched tensor -> its qualified name
        self.roots = roots
        self.ledger = ledger
        self.strict = strict
        self.named = named  # labels carry the root's name even with one root
        self.forwards: dict[str, int] = {}  # the last forward number of each root
        self.counters: dict[str, Iterator[int]] = {}
        # Route name of a DDP root's inner module -> the DDP root's name.
        self.synced: dict[str, str] = {}
        # FSDP2 roots: their unsharded parameters appear at the first forward.
        self.sharded: set[str] = set()

    def track(self, root: str, module: nn.Module) -> None:
        """Watch the tensors of ``module`` not watched yet, named under ``root``.

        Also at an FSDP2 root's forwards: the tensors it saved are its
        unsharded parameters, named as the parameters they stand for, and
        tracked from their first forward.
        """
        for key, (qual, t) in module_tensors(module, root + ".").items():
            if key not in self.names:
                self.names[key] = qual
                self.ledger.track(qual, t)

    def label(self, root: str, n: int) -> str:
        """``forward #3``, or ``G.forward #3`` when the watcher has more than one root."""
        # A member of a container root (``models.D``, :func:`_forward.add_root`) is
        # named even with one root: its container is never called.
        if len(self.roots) == 1 and not self.named and root in self.roots:
            return f"forward #{n}"
        return f"{root}.forward #{n}"

    def record(self, root: str, pre: bool, token: ForwardToken = None) -> ForwardToken:
        """Record a root's forward: ``pre`` before it runs (returns a token), then after it.

        A forward under ``no_grad`` or ``inference_mode`` saves nothing for
        backward, so the only fact it can add to an explanation is a write to a
        watched tensor while it runs (a BatchNorm's running stats in training
        mode). Such a forward reads the versions before and after, and records
        its events only if they moved: an acting forward in a reinforcement
        learning loop then costs two version reads instead of two events. Its
        site is read after the call if needed: the caller's line is the same.
        """
        if self.synced and root in self.synced:
            if pre:
                outer = self.synced[root]
                label = self.label(outer, self.forwards[outer])
                self.ledger.record(
                    "buffer_sync", f"DDP buffer broadcast of {label}", None,
                    cause=Modification(
                        "ddp_buffer_broadcast",
                        f"DistributedDataParallel's buffer broadcast in {label} of {outer}"))
            return None
        if pre:
            # next() is atomic: threads number from one counter, with no lock.
            n = self.forwards[root] = next(self.counters[root])
            if not torch.is_grad_enabled():
                # The watched versions, read lock-free (a layout is replaced, never
                # changed): the hot path of an acting loop.
                layout = self.ledger._layout
                if layout is not None:
                    before = layout.unchanged_since()
                    if before is not None:
                        return n, before
                seq = None
            else:
                seq = seq_clock()  # nodes it creates get larger sequence numbers
            event = self.ledger.record("forward", self.label(root, n), user_site(),
                                       seq=seq, module=root)
            if self.strict:
                _strict.THREAD.forward = event.forward_ref()
            return n, None
        assert token is not None
        n, before = token
        if self.sharded and root in self.sharded:
            module = self.roots[root]()
            if module is not None:
                self.track(root, module)
        if before is not None:
            layout = self.ledger._layout  # as at the start: did anything move?
            if layout is not None and layout.unchanged_since(before) is not None:
                return None  # nothing moved: as if the forward never ran, for the ledger
        label = self.label(root, n)
        if before is not None:
            # It wrote to a watched tensor: its events after all; nothing
            # moved before it began (``before`` was the last event's versions).
            self.ledger.record("forward", label, user_site(), module=root, unchanged=True)
        elif self.strict:
            _strict.THREAD.forward = None
        # The clock at the end too: nodes numbered between the two were made
        # by this forward, activations included (ledger.place_forward).
        seq = seq_clock() if torch.is_grad_enabled() else None
        self.ledger.end("forward_end", label, "module_forward", f"during {label} of {root}",
                        seq=seq)
        return None
