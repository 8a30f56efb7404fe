"""Strict mode's fingerprints: writes that no version counter and no wrapper sees.

Strict mode sees a write through a Python entry point (``add_``, ``.data``, a
fused step), and PyTorch's check sees a write that bumps a version. A write
made inside a C++ kernel that bumps none (BatchNorm's update of its running
statistics in a training-mode forward), through NumPy (``t.numpy()[...] = v``),
DLPack's consumers, an extension or a custom kernel, or a collective writing a
buffer, is seen by neither. With ``fingerprint=True`` strict mode keeps, for
every tensor it packs, a copy of a fixed sample of its bytes
(:func:`take`), and the prediction before backward reads the same sample again
(:func:`fingerprint_changed`): bytes that differ are a write that backward will read.

The sample: up to :data:`SAMPLE` elements, spread over the tensor (every
``numel / 64``-th element of a contiguous one; a grid of evenly spaced indices
along each dimension of any other layout), read as one strided view of the
storage and copied. It is compared by value and, where values differ, by raw
bytes, so that every dtype compares exactly and a NaN equals itself (a
``-0.0`` written over ``0.0`` compares equal by value: missed, never reported).
It is taken once the op that saved the tensor is over (:func:`note`).
Only the tensor's own elements are read, never the gaps of a strided view,
which backward does not read either: a difference is always a change of what
backward reads. A write to elements outside the sample is missed; the writes
this is for rewrite the whole tensor.

A fingerprint reads nothing that is not there: before backward the bytes the
sample spans are checked against the storage's size (FSDP frees a parameter's storage
after forward and gathers it again in backward: a storage too small now is
skipped, not reported). Subclasses (whose ops run user code), other layouts,
meta tensors, CUDA graph capture and active Torch function or dispatch modes
(which would see our ops) get no fingerprint: nothing is reported for them.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
from torch import nn

from versionwatch._compat import MODES_ACTIVE, is_compiling, sequence_nr
from versionwatch._runtime import Anchor, Call

__all__ = ["FINGERPRINTS", "FINGERPRINT_ANCHOR", "SAMPLE", "Fingerprint", "fingerprint_changed",
           "note", "settle", "take"]

SAMPLE = 64
"""The most elements a fingerprint copies (at most 64 x 16 bytes, for complex128).

A write that rewrites a tensor (running statistics, a broadcast, a new
storage) changes almost every element, so a handful would do; 64 also catch a
write to a twentieth of the elements 96 times in 100 (``1 - 0.95 ** 64``), at
a cost that does not grow with the tensor: one small copy per saved tensor.
"""

_PLAIN = (torch.Tensor, nn.Parameter)


class _State:
    """Whether any open strict watcher asked for fingerprints (the one check on the hot paths)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


FINGERPRINTS = _State()


def _on() -> None:
    FINGERPRINTS.on = True


def _off() -> None:
    FINGERPRINTS.on = False
    PENDING.records = []


class _Pending(threading.local):
    """This thread's records saved by ops that may not be over yet (weakly: graphs own them)."""

    def __init__(self) -> None:
        self.seq = -1  # the node that saved the newest of them
        self.records: list[weakref.ref[Any]] = []


PENDING = _Pending()


def note(rec: Any) -> None:
    """A record just packed: fingerprint it once the op that saved it is over.

    An op saves its inputs before its kernel runs, and some kernels then write
    an input they saved with no version bump: BatchNorm's running statistics
    in a training-mode forward (whose backward does not read them), RReLU's
    noise (which it does, as written). Their bytes at the save are not what
    backward will read. So a record is fingerprinted when the op is over: at
    a save by a later node (every earlier node's op has returned), or at the
    end of a module call (:func:`settle`). One never settled before the
    backward is not compared: a miss, never a false alarm.
    """
    p = PENDING
    seq = sequence_nr() - 1 if sequence_nr is not None else -1
    if seq != p.seq:
        if p.records:
            settle()
        p.seq = seq
    p.records.append(weakref.ref(rec))


def settle() -> None:
    """Fingerprint this thread's pending records: the ops that saved them are over."""
    p = PENDING
    if not p.records:
        return
    refs, p.records = p.records, []
    if is_compiling():
        return  # traced by torch.compile: no tensor op of ours may enter the graph
    for r in refs:
        rec = r()
        # A write seen since, or a version moved: those keep their own reports.
        if rec is None or rec.writes or rec._silent or rec.tensor._version != rec.version:
            continue
        rec.fingerprint = take(rec.tensor)


# Held by each open watcher with fingerprint=True: on with the first, off with the last.
FINGERPRINT_ANCHOR = Anchor("strict fingerprints", lambda: [Call(_on, _off)])


class Fingerprint:
    """Which elements were sampled (a strided view of the storage), and their values then."""

    __slots__ = ("meta", "offset", "sample", "size", "stride")

    def __init__(self, meta: tuple[torch.Size, tuple[int, ...], int],
                 size: tuple[int, ...], stride: tuple[int, ...], offset: int,
                 sample: torch.Tensor) -> None:
        self.meta = meta  # the tensor's shape, strides and offset: read again only if the same
        self.size = size  # the sample, as a view of the storage: one as_strided
        self.stride = stride
        self.offset = offset
        self.sample = sample  # a copy, on the tensor's device


def _readable(t: torch.Tensor) -> bool:
    """``t`` is a plain strided tensor, and nothing would see our ops on it."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_quantized:
        return False
    if MODES_ACTIVE is None or MODES_ACTIVE():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # a copy would be captured into the user's graph
    return not t.is_meta


def _held(t: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], offset: int) -> bool:
    """The storage holds every element of ``t`` now (FSDP frees one to nothing)."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # functorch wrappers: no storage
        return False
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    return (last + 1) * t.element_size() <= nbytes


def _sampled(shape: torch.Size, stride: tuple[int, ...],
             contiguous: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sample's sizes and strides (elements, from the tensor's offset)."""
    n = math.prod(shape)
    if contiguous:
        if n <= SAMPLE:
            return (n,), (1,)
        step = -(-n // SAMPLE)
        return (-(-n // step),), (step,)
    # Indices evenly spaced along each dimension, at most SAMPLE in all.
    per_dim = max(1, int(SAMPLE ** (1 / len(shape)) + 1e-9))
    steps = [max(1, math.ceil(size / per_dim)) for size in shape]
    return (tuple(math.ceil(size / k) for size, k in zip(shape, steps)),
            tuple(s * k for s, k in zip(stride, steps)))


# (shape, strides, contiguous) -> the sample's sizes and strides: a model saves the same few.
_PLANS: dict[tuple[torch.Size, tuple[int, ...], bool],
             tuple[tuple[int, ...], tuple[int, ...]]] = {}


def take(t: torch.Tensor) -> Fingerprint | None:
    """The fingerprint of ``t`` as it is now; None where none can be taken safely.

    Never writes ``t``: a detached alias, a strided view of it and a copy of
    that view (one small kernel, no sync on CUDA), all out of place.
    """
    if not _readable(t):
        return None
    shape, stride, offset = t.shape, t.stride(), int(t.storage_offset())
    if 0 in shape:
        return None  # no elements: nothing to change
    # Its op has just read or written every element: the storage holds them.
    key = (shape, stride, t.is_contiguous())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 4096:  # shapes seen come back: a bound, not an eviction policy
            _PLANS.clear()
        plan = _PLANS[key] = _sampled(*key)
    size, step = plan
    try:
        sample = t.detach().as_strided(size, step, offset).clone()
    except (RuntimeError, TypeError, ValueError):
        return None
    return Fingerprint((shape, stride, offset), size, step, offset, sample)


def fingerprint_changed(t: torch.Tensor, fp: Fingerprint) -> bool:
    """The sampled bytes of ``t`` differ from ``fp``'s: a write that no counter saw.

    False wherever the bytes cannot be read as they were (a new shape or
    layout, a storage freed to nothing since): no report rather than a wrong
    one. Values first (a NaN never equals itself), then bytes where those
    differ, so that every dtype compares exactly: a sample whose bytes are
    the same is unchanged. On CUDA the comparison waits for the device (one
    sync per saved tensor).
    """
    shape, stride, offset = fp.meta
    if (t.shape != shape or t.stride() != stride or t.storage_offset() != offset
            or not _readable(t) or not _held(t, shape, stride, offset)):
        return False
    try:
        now = t.detach().as_strided(fp.size, fp.stride, fp.offset)
        if torch.equal(now, fp.sample):
            return False
        return not torch.equal(_bytes(now), _bytes(fp.sample))
    except (RuntimeError, TypeError, ValueError):
        return False


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as flat raw bytes (a copy where ``t`` is a strided view)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
