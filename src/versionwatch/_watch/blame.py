"""Blame: what moved a hazard's tensor, and what a late error (PyTorch's own) was about.

After a prediction found hazards, each one is handed to the watcher whose
ledger tracks its tensor, which names the events (or, in strict mode, the
lines) that changed it; a freed graph is traced to the backward that freed it
and to the variable that carried it into this one. When PyTorch raises an
error that no prediction saw coming, its sentence is read back and explained
from the ledger, as a note on the error.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from versionwatch import _distributed, _strict
from versionwatch._compat import SAVED_INTROSPECTION
from versionwatch._ledger import Tracked
from versionwatch._report import (
    Between,
    Carrier,
    Fix,
    Hazard,
    Modification,
    Report,
    Site,
    add_note,
    fix_for,
    render_report,
    strict_hint,
)
from versionwatch._sites import site_at, user_frame
from versionwatch._torch_messages import VERSION_RE as _VERSION_RE
from versionwatch._watch.carrier import freed_facts

if TYPE_CHECKING:
    from versionwatch._watch.protocols import Blamed

_W = TypeVar("_W", bound="Blamed")

logger = logging.getLogger("versionwatch")

# Default mode sees events, not ops: a write to an activation (or any tensor
# it does not track) between two events has no line it could name. The hint's
# command is the place's own (pytest, notebook, command line): _report.strict_hint.
_UNSEEN_WRITE = ("default mode sees forwards, backwards, steps and zero_grad, not the write "
                 "itself: {} names its line")
# The writes are events it saw (a step); the op that saved the tensor is not.
_UNSEEN_SAVE = ("default mode sees the forward, not the op in it that saved the tensor: "
                "{} names its line")


def explain(w: _W, report: Report, scope: Sequence[_W]) -> _W:
    """Blame each hazard in the ledger that tracks its tensor; return the owner.

    ``w`` is the watcher that predicted, ``scope`` it and the other open
    watchers of its thread, innermost first. The owner, the watcher of the
    first hazard's tensor, keeps the report.
    """

    def tracker(key: int | None) -> _W:
        return next((s for s in scope if key is not None and key in s.ledger.tracked), w)

    here = threading.current_thread().name
    elsewhere = next((s.strict_thread for s in scope
                      if s.strict_thread not in (None, here)), None)
    hint = strict_hint() if not w.strict else ""  # the place, decided once per report
    for h in report.hazards:
        if h.key is None and not SAVED_INTROSPECTION:
            _match_ledger(h, scope)
        exact = list(h.modified_by)  # strict mode's records name the writes
        if h.key is not None:
            tracker(h.key).ledger.blame(h, h.key)
            if exact:
                h.modified_by = exact
        if elsewhere is not None and not exact and h.kind == "inplace":
            h.notes.append(
                f"strict mode records saved tensors on thread {elsewhere} only (saved-tensor "
                f"hooks are per thread); this backward runs on thread {here}, and a forward "
                "there is checked as in the default mode, without write lines")
        if h.seq is not None and (h.module is None or h.saved_during is None):
            for s in scope:
                if s.ledger.place_forward(h):
                    break
        if h.node == "CompiledFunctionBackward" and h.compiled_forward is None:
            h.compiled_forward = compiled_forward(h, scope)
        if not w.strict and h.kind == "inplace":
            if all(m.kind == "between_events" for m in h.modified_by):
                h.notes.append(_UNSEEN_WRITE.format(hint))
            elif h.saved_at is None:
                h.notes.append(_UNSEEN_SAVE.format(hint))
        h.fix = fix_for(h)
    suggest(report)
    owner = tracker(report.hazards[0].key if report.hazards else None)
    report.timeline = owner.timeline(report=report)
    owner.reports.append(report)
    return owner


def explain_freed(report: Report, outputs: Any, scope: Sequence[Blamed]) -> None:
    """Name the backward that freed each graph, what carried it into this one, and
    what ran between the two (:mod:`versionwatch._watch.carrier`).

    The freer is the first freeing backward since the node was made. When
    this backward's own graph was built after that one (its root is newer),
    it is a new graph that reaches into the freed one: a tensor made before
    the freer carried it in. Called on the backward's own stack: the user's
    frame is the first one up outside the libraries.
    """
    roots = [t for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    root_seq = max((int(fn._sequence_nr()) for t in roots if (fn := t.grad_fn) is not None),
                   default=None)
    frame, _ = user_frame(1)
    facts: tuple[Carrier | None, Between] | None = None  # found once, for the first hazard
    for h in report.hazards:
        if h.kind != "freed" or h.seq is None:
            continue
        # Sequence numbers are per thread: with one thread, this one's are the node's.
        if h.saved_at is None and any(s.strict for s in scope) \
                and not any(s.ledger.threaded for s in scope):
            line = _strict.saved_line(h.seq)
            if line is not None:
                h.saved_at = line[0]
                if h.saved_during is None and line[1] is not None:
                    h.saved_during_forward(line[1])
        found = next(((s, ev) for s in scope if (ev := s.ledger.freer(h.seq)) is not None),
                     None)
        if found is None:
            continue
        owner, freer = found
        h.freed_by = Modification("backward", freer.label, freer.site)
        for s in scope:  # the forward that made the freed node: its module
            if s.ledger.place_forward(h):
                break
        same = root_seq is None or freer.seq is None or root_seq <= freer.seq
        if facts is None:
            optimizers = [(st.label, o) for s in scope for st in list(s._optimizers.values())
                          if (o := st.ref()) is not None]
            roots_by_name = {k: v for s in reversed(scope) for k, v in s.roots.items()}
            facts = freed_facts(h, owner.ledger, freer, outputs, roots_by_name, optimizers,
                                frame, same)
        carrier, h.between = facts
        if not same:  # the same graph run twice has no carrier
            h.carrier = carrier
            h.carried_by = carrier.name if carrier is not None else ""


def compiled_forward(h: Hazard, scope: Sequence[Blamed]) -> Site | None:
    """The ``def forward`` line of the compiled module a compiled region ran, if known.

    ``h.module`` names a watched module (``cnet``) or one inside it; the
    compiled one is an ``OptimizedModule`` (``torch.compile(net)``), which
    keeps the module it compiled as ``_orig_mod``.
    """
    name = h.module
    if not name:
        return None
    for s in scope:
        for root, ref in s.roots.items():
            if name != root and not name.startswith(root + "."):
                continue
            module = ref()
            path = name[len(root) + 1:].split(".") if name != root else []
            # The named module, then each one above it: the nearest compiled one.
            while module is not None:
                try:
                    here = module.get_submodule(".".join(path)) if path else module
                except AttributeError:
                    here = None
                orig = getattr(here, "_orig_mod", None)
                if isinstance(orig, torch.nn.Module):
                    return _def_line(type(orig).forward)
                if not path:
                    break
                path.pop()
    return None


def _def_line(fn: Any) -> Site | None:
    try:
        filename = inspect.getsourcefile(fn)
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    if filename is None:
        return None
    for k, text in enumerate(lines):  # past any decorator
        if text.lstrip().startswith(("def ", "async def ")):
            return site_at(filename, first + k)
    return site_at(filename, first)


def _match_ledger(h: Hazard, scope: Sequence[Blamed]) -> None:
    """Name a stale tensor that the predictor could not read (old torch), by its history.

    A buffer has no ``AccumulateGrad`` edge to be found by; a watched tensor now
    at the hazard's version that went through the saved one, of the same size,
    is it. Ties (``running_mean`` and ``running_var`` move together) go to the
    one named like the slot that saved it.
    """
    if h.kind != "inplace" or h.producer is not None or h.saved_version is None:
        return
    now, saved = h.current_version, h.saved_version
    found: list[tuple[int, Tracked, torch.Tensor]] = []
    for w in scope:
        for key, tr in list(w.ledger.tracked.items()):  # another thread may adopt
            t = tr.ref()
            if (t is None or t._version != now
                    or (h.shape is not None and tuple(t.shape) != h.shape)
                    or not any(tn.old <= saved < tn.new for tn in tr.history)):
                continue
            found.append((key, tr, t))
    if len(found) > 1:
        found = [f for f in found if f[1].name.rsplit(".", 1)[-1] == h.slot]
    if len(found) == 1:
        key, tr, t = found[0]
        h.tensor, h.key, h.requires_grad = tr.name, key, t.requires_grad


def after_error(w: Blamed, err: RuntimeError, report: Report | None, site: Site | None) -> None:
    """Explain PyTorch's error ``err`` from a backward at ``site``, as a note on it.

    With a report that predicted it, the prediction; else, for a "modified by
    an inplace operation" error, what the ledger (or strict mode's record)
    knows of the tensor. The late report joins ``w.reports``.
    """
    msg = str(err)
    if report is not None and not report.ok:
        # PyTorch's own error is right above the note: no need to repeat it.
        text = render_report(report, torch_message=False)
        add_note(err, f"versionwatch predicted this before backward ran:\n{text}")
        return
    m = _VERSION_RE.search(msg)
    if m is None:
        return
    now, saved = int(m.group(1)), int(m.group(2))
    strict = getattr(err, "versionwatch_saved", None)
    if strict is not None:
        # Strict mode's unpack hook raised it: its record names the writes.
        # The error may outlive the graph: it must not keep the saved tensor.
        del err.versionwatch_saved  # type: ignore[attr-defined]
        rec, node = strict
        h = rec.hazard(node, "", detected="after_error")
        name_record(w.names, h, rec)
    else:
        h = Hazard(kind="inplace", node="(unknown node)", slot="?", saved_version=saved,
                   current_version=now, detected="after_error")
    if h.tensor is None:
        candidates = [
            (k, tr) for k, tr in w.ledger.tracked.items()
            if tr.last == now and any(t.old <= saved < t.new for t in tr.history)
        ]
        if len(candidates) == 1:
            key, tr = candidates[0]
            h.tensor, h.key, h.requires_grad = tr.name, key, True
            if not h.modified_by:
                w.ledger.blame(h, key)
    h.fix = fix_for(h)
    h.torch_message = msg
    late = Report(hazards=[h], backward_site=site, rank=_distributed.rank())
    suggest(late)
    w.reports.append(late)
    text = render_report(late, torch_message=False)
    add_note(err, f"versionwatch explains (PyTorch raised, unpredicted):\n{text}")


def name_record(names: dict[int, str], h: Hazard, rec: _strict.SavedRecord) -> None:
    """Name a strict record's tensor if it is a watched one (in ``names``), or a view of one."""
    own, base = rec.ids
    name = names.get(own) or (names.get(base) if base is not None else None)
    if name is not None:
        h.tensor, h.key, h.requires_grad = name, own if own in names else base, True
        h.view = own not in names


# -- the fix: the candidates of versionwatch fix, unchecked ----------------------------------

# Candidates by what they were made from: a loop that meets the same hazard at
# every backward (on_hazard="log") reads and parses its files once.
_SUGGESTED: dict[tuple[str, str | None, str], list[Fix]] = {}
_SUGGESTED_MAX = 32


def _program() -> tuple[str | None, str]:
    """The main script (for in-place modules), and the command that checks a patch.

    Under pytest, the test that runs: ``versionwatch fix -m pytest NODEID``; else
    the script Python runs (``sys.argv[0]``), when it is the user's own file.
    """
    main = sys.argv[0] if sys.argv else ""
    if main.endswith(".py") and os.path.isfile(main) and not any(
            f"{os.sep}{d}{os.sep}" in os.path.realpath(main)
            for d in ("site-packages", "dist-packages")):
        from versionwatch._candidates import shown

        return os.path.abspath(main), shown(os.path.abspath(main))
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if test:
        return None, f"-m pytest {test.rsplit(' ', 1)[0]}"
    return None, "SCRIPT"


def suggest(report: Report) -> None:
    """Fill the first hazard's ``fixes`` with the patches ``versionwatch fix`` would check.

    The candidates are made from the report alone, here, and not checked: each
    one's ``why`` says how to check it (one that only hides the failure says so
    instead). The report's fix line shows the first one it may offer, so that the
    report and ``versionwatch fix`` say the same. It reads the user's files with
    ``ast``, which only a reported hazard pays for; whatever fails here leaves the
    fixes empty (the fix line is then the advice): a report never fails over it.
    """
    h = report.first
    if h is None or h.fixes:
        return
    try:
        from versionwatch._candidates import from_report, propose

        main, program = _program()
        facts = from_report(report)
        key = (repr(facts.to_dict()), main, os.getcwd())
        fixes = _SUGGESTED.get(key)
        if fixes is None:
            why = f"untested; `versionwatch fix {program}` checks it"
            fixes = []
            for c in propose(facts, main=main):
                fixes.append(dataclasses.replace(Fix(**c.to_dict()), why=c.hides or why))
            if len(_SUGGESTED) >= _SUGGESTED_MAX:
                _SUGGESTED.pop(next(iter(_SUGGESTED)))
            _SUGGESTED[key] = fixes
        h.fixes = list(fixes)  # frozen: shared with the cache as they are
    except Exception:  # the advice stands; the report must not fail over a patch
        logger.debug("versionwatch: no candidate fixes for the report", exc_info=True)
