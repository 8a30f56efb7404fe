"""PyTorch's own sentence for a stale saved tensor, worded as the running torch words it.

Strict mode raises (and predicts) where PyTorch's check never runs, since
PyTorch skips it for tensors behind saved-tensor hooks; its message must still
be the one PyTorch would give, so that code and tests that match on it keep
working. The wording differs between releases (the producer's name, the
anomaly hint), so it is learnt from the running torch: the first time a state
of anomaly mode needs it, a tiny stale tensor is read in a fresh thread, which
has no saved-tensor hooks and no dispatch modes of the caller's, and PyTorch's
message is cut into a template.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from versionwatch._compat import SAVED_INTROSPECTION, HookedSaved, peek
from versionwatch._explain import _BACKWARD_SUFFIX

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


def _probe() -> str | None:
    said: list[str] = []

    def run() -> None:
        try:
            a = torch.ones(1, requires_grad=True)
            b = a.exp()  # ExpBackward0 saves its output
            with torch.no_grad():
                b.add_(1)
            b.grad_fn._saved_result  # type: ignore[union-attr]  # noqa: B018
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
    tpl = _template(torch.is_anomaly_enabled())
    clause = ""
    if producer is not None and tpl.clause is not None:
        name = producer if tpl.full_names else _BACKWARD_SUFFIX.sub("", producer)
        clause = f"{tpl.clause[0]}{output_nr} of {name}{tpl.clause[1]}"
    return (f"{tpl.head}[{t.type()} {_sizes(t)}]{clause} is at version {now}; "
            f"expected version {saved} instead.{tpl.hint}")


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


def output_slot(node: object, packed: object) -> int | None:
    """Which output of ``node`` the saved tensor that packed to ``packed`` is, if it is one.

    A node that saved its own output (``result``, ``result1``) is the producer
    PyTorch names; behind hooks only the packed value tells which slot is being
    unpacked: the raw saved tensor shows it, or (old torch) strict mode's own
    unpack hook hands it to :func:`peek` instead of checking it.
    """
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
            return _result_nr(slot)
    return None


def _result_nr(slot: str) -> int | None:
    """Which of its node's outputs a slot holds (``result``: 0, ``result1``: 1), if any."""
    if not slot.startswith("result"):
        return None
    suffix = slot[len("result"):]
    return 0 if not suffix else int(suffix) if suffix.isdigit() else None


def strict_message(rec: Any, node: Any, slot: str | None = None) -> str:
    """PyTorch's error for strict mode's record ``rec`` of a tensor that ``node`` saved.

    PyTorch names a producer for a saved output (its own node) and for a view
    of a leaf that requires grad (the ``AsStrided`` node that a stale view's
    grad_fn is rebuilt as), and for a saved input the grad_fn that input has
    now; a leaf has none. Strict mode holds that input weakly: once the
    program has dropped it (a temporary that is not a view), its name is gone too.

    Args:
        rec: the :class:`~versionwatch._strict.SavedRecord`.
        node: the node that saved it (the one unpacking it), or None.
        slot: the node's slot that holds it, when known (else it is looked for).
    """
    t = rec.tensor
    producer, nr = None, 0
    if node is not None:
        found = _result_nr(slot) if slot is not None else output_slot(node, rec)
        if found is not None:
            producer, nr = node.name(), found
    if producer is None:
        # Unwatched, PyTorch keeps a saved input itself and names the grad_fn it
        # has when backward reads it (after `b.add_(1)`, AddBackward0).
        ref = getattr(rec, "original", None)
        original = ref() if ref is not None else None
        if original is not None:
            fn = original.grad_fn
            if fn is not None:
                producer, nr = fn.name(), original.output_nr
        elif rec.ids[1] is not None and (ref is not None or rec.requires_grad):
            # A stale view's grad_fn is rebuilt from its base as AsStrided.
            producer = "AsStridedBackward0"
    return stale_message(t, t._version, rec.version, producer, nr)
