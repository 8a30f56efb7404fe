"""PyTorch's sentences, both ways: read from its errors, and written as it words them.

Reading: PyTorch's errors say what a failed check saw ("[torch.FloatTensor
[8, 1]], which is output 0 of SigmoidBackward0, is at version 1; expected
version 0 instead"), and the predictor takes the versions, the producer, the
type and the shape from them where torch shows them nowhere else.

Writing: strict mode raises (and predicts) where PyTorch's check never runs,
since PyTorch skips it for tensors behind saved-tensor hooks; its message must
still be the one PyTorch would give, so that code and tests that match on it
keep working. The wording differs between releases (the producer's name, the
anomaly hint), so it is learnt from the running torch: the first time a state
of anomaly mode needs it, a tiny stale tensor is read in a fresh thread, which
has no saved-tensor hooks and no dispatch modes of the caller's, and PyTorch's
message is cut into a template.

Importing this module loads no torch: the text renderer reads node names with
it, and ``import versionwatch`` stays light. Torch is imported where a function
needs it, when torch is loaded already.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from versionwatch._report import BACKWARD_SUFFIX

if TYPE_CHECKING:
    import torch
    from torch.autograd.graph import Node


# -- reading ------------------------------------------------------------------------

VERSION_RE = re.compile(r"is at version (\d+); expected version (\d+) instead")
"""A stale saved tensor: its version now (group 1) and when saved (group 2)."""
PRODUCER_RE = re.compile(r"which is output \d+ of ([\w:]+)")
"""The node (or, on newer torch, the op) that produced a stale saved non-leaf."""
VIEW_NODE_RE = re.compile(
    r"(T|Transpose|Permute|View|Reshape|UnsafeView|Expand|AsStrided|Slice|Select|Squeeze|"
    r"Unsqueeze|Alias|Diagonal|Narrow)(Backward\d*)?")
"""The name of a view's node, as a producer or a node's own name."""
SAVED_RE = re.compile(r"\[(\S+) \[([\d, ]*)\]\]")  # "[torch.FloatTensor [8, 1]]"
"""The stale tensor's type name (group 1) and sizes (group 2)."""
FREED = "backward through the graph a second time"
"""In every error about a graph whose saved tensors backward already freed."""
"""A node's name past its op's: ``SigmoidBackward0`` is ``Sigmoid``'s node."""

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


def message_type(msg: str) -> tuple[str | None, str | None]:
    """dtype and device from PyTorch's type name: torch.cuda.HalfTensor -> float16, cuda."""
    m = SAVED_RE.search(msg)
    if m is None:
        return None, None
    parts = m.group(1).split(".")
    dtype = _DTYPES.get(parts[-1].removesuffix("Tensor"))
    return dtype, parts[1] if len(parts) == 3 else "cpu"


def message_shape(msg: str) -> tuple[int, ...] | None:
    """The stale tensor's shape, as PyTorch's message prints it."""
    m = SAVED_RE.search(msg)
    if m is None:
        return None
    return tuple(int(d) for d in m.group(2).split(",") if d.strip())


def stale_index(raws: Sequence[Any], msg: str) -> int | None:
    """The element of a saved list that PyTorch's message is about, if only one fits."""
    import torch

    m = VERSION_RE.search(msg)
    t = SAVED_RE.search(msg)
    if m is None or t is None:
        return None
    now, shape = int(m.group(1)), message_shape(msg)
    hits = [k for k, r in enumerate(raws)
            if r is not None and isinstance(d := r.data, torch.Tensor) and d._version == now
            and tuple(d.shape) == shape and d.type() == t.group(1)]
    return hits[0] if len(hits) == 1 else None


# -- writing ------------------------------------------------------------------------

_TENSOR = "[torch.FloatTensor [1]]"
_VERSIONS = " is at version 1; expected version 0 instead."
_OUTPUT = "output 0 of "

# torch 2.13's words: used only if the running torch's cannot be read.
_FALLBACK = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: [torch.FloatTensor [1]], which is output 0 of Exp, is at version 1; expected "
    "version 0 instead. Hint: enable anomaly detection to find the operation that failed to "
    "compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False)."
)


@dataclass(frozen=True)
class _Template:
    head: str  # up to the tensor's type
    clause: tuple[str, str] | None  # around "{output_nr} of {producer}"
    full_names: bool  # the producer named as its node ("ExpBackward0"), else as its op
    hint: str  # after the versions


_TEMPLATES: dict[bool, _Template] = {}
_LOCK = threading.Lock()


def _probe(dtype: torch.dtype | None = None, device: torch.device | None = None) -> str | None:
    """PyTorch's error for a stale saved tensor, read in a fresh thread.

    By default a float32 output saved by its own node (``ExpBackward0``), for
    the sentence's words; with ``dtype``, a tensor of that dtype and device
    saved as an input (``MulBackward0``'s ``other``), for its type's name.
    """
    import torch

    said: list[str] = []

    def run() -> None:
        try:
            if dtype is None:
                a = torch.ones(1, requires_grad=True)
                b = a.exp()  # ExpBackward0 saves its output
                with torch.no_grad():
                    b.add_(1)
                b.grad_fn._saved_result  # type: ignore[union-attr]  # noqa: B018
            else:
                w = torch.ones(1, device=device, requires_grad=True)
                other = torch.ones(1, dtype=dtype, device=device)
                out = w * other  # MulBackward0 saves `other`
                torch.autograd.graph.increment_version(other)
                out.grad_fn._saved_other  # type: ignore[union-attr]  # noqa: B018
        except RuntimeError as e:
            said.append(str(e))
        except Exception:  # any other failure: the fallback's words
            pass

    t = threading.Thread(target=run, name="versionwatch-wording", daemon=True)
    try:
        t.start()
    except RuntimeError:  # no new thread at interpreter shutdown
        return None
    t.join()
    return said[0] if said else None


def _parse(msg: str) -> _Template | None:
    i, j = msg.find(_TENSOR), msg.find(_VERSIONS)
    if i < 0 or j < i:
        return None
    clause_text = msg[i + len(_TENSOR):j]
    full = "ExpBackward0" in clause_text
    k = clause_text.find(_OUTPUT + ("ExpBackward0" if full else "Exp"))
    clause = None
    if k >= 0:
        name_end = k + len(_OUTPUT) + len("ExpBackward0" if full else "Exp")
        clause = (clause_text[:k + len("output ")], clause_text[name_end:])
    return _Template(msg[:i], clause, full, msg[j + len(_VERSIONS):])


def _template(anomaly: bool) -> _Template:
    tpl = _TEMPLATES.get(anomaly)
    if tpl is None:
        with _LOCK:
            tpl = _TEMPLATES.get(anomaly)
            if tpl is None:
                msg = _probe()
                tpl = (_parse(msg) if msg is not None else None) or _parse(_FALLBACK)
                assert tpl is not None
                _TEMPLATES[anomaly] = tpl
    return tpl


def stale_message(t: torch.Tensor, now: int, saved: int, producer: str | None = None,
                  output_nr: int = 0) -> str:
    """PyTorch's error for ``t``, saved at version ``saved`` and now at ``now``.

    Args:
        t: the saved tensor (or an alias of it: only its type and shape are read).
        now: its version now.
        saved: its version when saved.
        producer: the node that made it, when PyTorch would name one: the node
            that saved its own output (``"SigmoidBackward0"``).
        output_nr: which of the producer's outputs it is.
    """
    import torch

    tpl = _template(torch.is_anomaly_enabled())
    clause = ""
    if producer is not None and tpl.clause is not None:
        name = producer if tpl.full_names else BACKWARD_SUFFIX.sub("", producer)
        clause = f"{tpl.clause[0]}{output_nr} of {name}{tpl.clause[1]}"
    return (f"{tpl.head}[{type_name(t)} {_sizes(t)}]{clause} is at version {now}; "
            f"expected version {saved} instead.{tpl.hint}")


# (dtype, device type) -> the type's name in PyTorch's message, as learnt.
_TYPE_NAMES: dict[tuple[torch.dtype, str], str] = {}


def type_name(t: torch.Tensor) -> str:
    """``t``'s type as PyTorch's message prints it (C++'s ``Tensor::toString()``).

    That is ``t.type()`` for the oldest dtypes (``torch.FloatTensor``) and
    ``CPUComplexFloatType``, ``CPUBFloat16Type``, ``CPUBoolType`` for others:
    learnt from the running torch once per dtype and device type, as the
    sentence's template is. A layout other than strided keeps ``t.type()``.
    """
    import torch

    if t.layout is not torch.strided or getattr(t, "is_nested", False):
        return t.type()
    key = (t.dtype, t.device.type)
    name = _TYPE_NAMES.get(key)
    if name is None:
        said = _probe(t.dtype, t.device)
        m = SAVED_RE.search(said) if said is not None else None
        name = _TYPE_NAMES[key] = m.group(1) if m is not None else t.type()
    return name


def _sizes(t: torch.Tensor) -> str:
    """``t``'s sizes as PyTorch's message prints them: ``[8, 1]``.

    A nested tensor has no single shape: PyTorch prints its size tensor the way
    C++ prints a tensor (`` 2\n 3\n[ torch.LongTensor{2,1} ]``), mirrored here.
    """
    if not getattr(t, "is_nested", False):
        return "[" + ", ".join(map(str, t.shape)) + "]"
    sizes = t._nested_tensor_size()
    rows = sizes.tolist()
    width = max((len(str(v)) for row in rows for v in row), default=1)
    body = "".join(" " + "  ".join(str(v).rjust(width) for v in row) + "\n" for row in rows)
    dims = ",".join(map(str, sizes.shape))
    return f"{body}[ torch.LongTensor{{{dims}}} ]"


def output_slot(node: Node, packed: object) -> int | None:
    """Which output of ``node`` the saved tensor that packed to ``packed`` is, if it is one.

    A node that saved its own output (``result``, ``result1``) is the producer
    PyTorch names; behind hooks only the packed value tells which slot is being
    unpacked: the raw saved tensor shows it, or (old torch) strict mode's own
    unpack hook hands it to :func:`~versionwatch._compat.peek` instead of checking it.
    """
    from versionwatch._compat import SAVED_INTROSPECTION, HookedSaved, peek

    for attr in dir(node):
        if not attr.startswith("_raw_saved_result"):
            continue
        slot = attr[len("_raw_saved_"):]
        try:
            if SAVED_INTROSPECTION:
                found = getattr(getattr(node, attr), "data", None) is packed
            else:
                found = packed in peek(node, "_saved_" + slot)[1]
        except (RuntimeError, HookedSaved):
            continue
        if found:
            return result_nr(slot)
    return None


def result_nr(slot: str) -> int | None:
    """Which of its node's outputs a slot holds (``result``: 0, ``result1``: 1), if any."""
    if not slot.startswith("result"):
        return None
    suffix = slot[len("result"):]
    return 0 if not suffix else int(suffix) if suffix.isdigit() else None
