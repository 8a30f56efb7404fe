"""The words of a ``silent`` hazard, one function per cause.

A ``silent`` hazard is a saved tensor that backward would read changed, with no
error from PyTorch: the gradients would be wrong. :attr:`Hazard.cause` says how
the change escaped PyTorch's version check, and each cause has its own headline
and fix here, so that :mod:`versionwatch._report.text` and
:mod:`versionwatch._report.advice` stay one voice:

- ``None``: a write that bumped no version (``.data``, a fused optimizer step);
- ``"checkpoint"``: a tensor saved inside non-reentrant activation
  checkpointing (``checkpoint(fn, x, use_reentrant=False)``, selective
  checkpointing), where no version is checked and the recomputation during
  backward reads what the tensor holds then;
- ``"gradient"``: a hook that modified in place a gradient that another
  consumer of the backward also receives;
- ``"fingerprint"``: a saved tensor whose bytes changed with no version bump and
  no write that strict mode saw (``set_()``, a custom kernel, an extension, a
  buffer broadcast), found by its content fingerprint.
"""

from __future__ import annotations

from versionwatch._report.model import Hazard

__all__ = ["SILENT_TAIL", "gradient_consumer", "gradient_facts", "silent_fix", "silent_headline"]

SILENT_TAIL = "PyTorch will not raise, and the gradients would be wrong"
"""What every silent report says of the outcome (a fact line of its own)."""


def silent_headline(h: Hazard) -> str:
    """The headline of a predicted ``silent`` hazard."""
    if h.cause == "checkpoint":
        return _checkpoint_headline(h)
    if h.cause == "gradient":
        return _gradient_headline(h)
    if h.cause == "fingerprint":
        return _fingerprint_headline(h)
    return (
        f"versionwatch: backward will compute wrong gradients: {h.describe_tensor()} "
        f"saved by {h.node} was changed without a version bump"
    )


def silent_fix(h: Hazard) -> str:
    """The advice of a ``silent`` hazard (its ``fix`` line when no patch is offered)."""
    name = h.tensor or "the tensor"
    if h.cause == "checkpoint":
        return _checkpoint_fix(h)
    if h.cause == "gradient":
        return _gradient_fix(h)
    if h.cause == "fingerprint":
        return _fingerprint_fix(h)
    if any(m.description.startswith("a write under _unsafe_preserve_version_counter")
           for m in h.modified_by):
        return (
            "a write inside _unsafe_preserve_version_counter puts the version back "
            "(DistributedDataParallel's buffer broadcast does this): run one "
            "forward on the concatenated batch before backward, or pass "
            "broadcast_buffers=False to DistributedDataParallel, or convert BatchNorm with "
            "nn.SyncBatchNorm.convert_sync_batchnorm(model)"
        )
    return (
        f"{name} was changed without a version bump (fused optimizer, .data, or a "
        "no_grad write through .data); run every backward that needs it before the "
        "change, or re-run the forward after it"
    )


# --- checkpoint ---------------------------------------------------------------
# Two cases (versionwatch._strict.checkpoint): a write inside the checkpointed
# function that its recomputation repeats ("repeats this write" in the first
# fact line), a write after the forward to a saved tensor the recomputation
# reads again (a parameter), and a saved tensor made inside the function that
# the recomputation makes again from a parameter written since ("makes this
# tensor again").


def _checkpoint_repeated(h: Hazard) -> bool:
    return any("repeats this write" in n for n in h.notes)


def _checkpoint_remade(h: Hazard) -> bool:
    return any("makes this tensor again" in n for n in h.notes)


def _checkpoint_headline(h: Hazard) -> str:
    where = h.hidden_by or "checkpoint(use_reentrant=False)"
    if _checkpoint_repeated(h):
        what = ("was modified in place after it was saved, and the recomputation during "
                "backward repeats the write")
    elif _checkpoint_remade(h):
        what = ("is made again during backward from a tensor that was changed after the "
                "forward")
    else:
        what = ("was changed after the forward, and the recomputation during backward reads "
                "it as it is then")
    return (
        f"versionwatch: backward will compute wrong gradients: {h.describe_tensor()} "
        f"saved by {h.node} inside {where} {what}"
    )


def _checkpoint_fix(h: Hazard) -> str:
    if _checkpoint_repeated(h):
        return (
            "don't modify in place a tensor that an op inside the checkpointed function "
            "saved: use the out-of-place form (`x = x * s` instead of `x.mul_(s)`) or modify "
            "a `.clone()`"
        )
    name = h.tensor or "the tensor"
    for n in h.notes:  # "... makes this tensor again from NAMES as it is then, ..."
        if "makes this tensor again from " in n:
            name = n.split("makes this tensor again from ", 1)[1].split(" as it is then", 1)[0]
    return (
        f"{name} was changed between the checkpointed forward and its backward, which "
        "recomputes from it: make that change after this backward, or re-run the forward "
        "after it"
    )


# --- gradient -----------------------------------------------------------------


def _gradient_headline(h: Hazard) -> str:
    where = h.hidden_by or "a hook"
    by = f" that {h.node} passes on" if h.node else ""
    return (
        f"versionwatch: backward would compute wrong gradients: {where} modified in place "
        f"the gradient{by}, which another node also receives"
    )


def _gradient_fix(h: Hazard) -> str:
    return ("return a new gradient from the hook (`return g * scale`) instead of modifying "
            "it in place (`g.mul_(scale)`)")


def gradient_consumer(receiver: str, consumer: str) -> str:
    """The fact line: whose hook wrote, and which other node reads the write."""
    return f"the hook runs for {receiver}; {consumer} reads the same tensor after the write"


def gradient_facts(h: Hazard) -> list[tuple[str, str]]:
    """The facts of a ``gradient`` hazard: the gradient, the hook's write, who else sees it."""
    meta = f"{h.dtype}{list(h.shape)}" if h.dtype is not None and h.shape is not None else ""
    if h.device and h.device != "cpu":
        meta += f" on {h.device}"
    what = f"the gradient that {h.node} passes on" if h.node else "a gradient in flight"
    facts = [("gradient", f"{what}, {meta}" if meta else what)]
    for m in h.modified_by:
        code = f": {m.site.code}" if m.site and m.site.code else ""
        facts.append(("write", f"{m.description} at {m.site}{code}" if m.site else m.description))
    facts += [("note", note) for note in h.notes]
    return facts


# --- fingerprint --------------------------------------------------------------


FINGERPRINT_HIDDEN_BY = "a write no version counter sees"
FINGERPRINT_NO_LINE = (
    "its sampled bytes differ from those saved, and no write that strict mode sees made the "
    "change (a C++ kernel, NumPy, DLPack, an extension, a collective): no write line is known"
)


def fingerprint_hazard(h: Hazard) -> None:
    """Make ``h`` (strict mode's record of a saved tensor) a fingerprint hazard: cause and facts."""
    h.cause = "fingerprint"
    h.hidden_by = FINGERPRINT_HIDDEN_BY
    h.notes += [FINGERPRINT_NO_LINE, SILENT_TAIL]


def _fingerprint_headline(h: Hazard) -> str:
    return (
        f"versionwatch: backward will compute wrong gradients: {h.describe_tensor()} "
        f"saved by {h.node} was changed without a version bump (its content fingerprint changed)"
    )


def _fingerprint_fix(h: Hazard) -> str:
    name = h.tensor or "the tensor"
    return (
        f"{name} was changed by a write no version counter sees (a C++ kernel such as "
        "BatchNorm's running-statistics update, a NumPy or DLPack alias, an extension, a "
        "collective); run every backward that needs it before the change, or re-run the "
        "forward after it"
    )
