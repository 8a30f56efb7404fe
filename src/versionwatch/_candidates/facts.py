"""What ``versionwatch fix`` needs to know about a hazard: :class:`FixFacts`.

The fix engine never looks at a watcher: it reads a small, typed record of the
user's lines around one failure and edits those lines. A watcher (strict mode,
or a ``--replay``) fills the record from its report with :func:`from_report`;
tests write it by hand. Every field but ``kind`` is optional: a family of edits
is proposed only when the facts it needs are there, and the engine derives the
few it can from the source itself (:func:`versionwatch._candidates.edits.complete`).

All lines are :class:`Line`: an absolute file name as the interpreter saw it
(``frame.f_code.co_filename``), a 1-based line number, and the stripped source
line as the watcher saw it (compared with the file, so that an edit made since
the run is noticed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from versionwatch._report import Hazard, Modification, Report, Site, cell_of

Kind = Literal["inplace", "freed", "silent"]
Use = Literal["forward", "data"]
Between = Literal["step", "write", "nothing"]


@dataclass(frozen=True)
class Line:
    """One line of the user's source where a fact happened.

    Attributes:
        file: the file as the interpreter names it: an absolute path for a file,
            ``"<string>"`` for ``python -c``, ``"<stdin>"``, a notebook cell's name.
        line: the 1-based line number.
        code: the stripped source line as the watcher saw it, or ``""``.
    """

    file: str
    line: int
    code: str = ""

    def __str__(self) -> str:
        return shown_at(self.file, self.line)  # a notebook cell as IPython writes it

    def to_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "code": self.code}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Line:
        return cls(str(d["file"]), int(d["line"]), str(d.get("code") or ""))


def shown(file: str, base: str | None = None) -> str:
    """``file`` as the fix output shows it: relative to the working directory (or
    ``base``) when under it."""
    if file.startswith("<"):
        return file
    try:
        rel = os.path.relpath(file, base) if base else os.path.relpath(file)
    except (OSError, ValueError):
        return file
    return file if rel.startswith("..") else rel


def shown_at(file: str, line: int) -> str:
    """``file:line`` as the fix output shows it; a notebook cell as ``Cell In[3], line 9``."""
    cell = cell_of(file)
    return f"Cell In[{cell}], line {line}" if cell is not None else f"{shown(file)}:{line}"


@dataclass(frozen=True)
class FixFacts:
    """The facts about one failure that the fix engine edits from.

    Attributes:
        kind: the hazard's kind (``Hazard.kind``): ``"inplace"``, ``"freed"`` or
            ``"silent"`` (a write without a version bump: a fused optimizer, ``.data``).
        tensor: the display name of the stale tensor when it is a parameter or
            buffer (``"model.w3"``), ``None`` for an activation. It decides
            between rewriting an op out of place (activations only: rebinding a
            name never updates a parameter) and moving an update.
        node: the node that saved it (``"SigmoidBackward0"``); ``slot``: which of
            its saved values. For the words only.
        failing_backward: the user's call of the backward that fails
            (``Report.backward_site``).
        first_backward: the earlier backward of the same forward: for ``freed``,
            the backward that freed the graph (``Hazard.freed_by.site``); for a
            step between two backwards, the backward before the step (derived
            from the source when absent).
        saved_at: the user's line of the op that saved the tensor (strict mode:
            ``Hazard.saved_at``). Words only.
        write: the user's line of the in-place op that changed an activation
            (strict mode: a ``modified_by`` entry of kind ``"inplace_op"`` in user
            code, for a tensor without a name): ``y.mul_(2)``, ``x += f(x)``,
            ``t.relu_()``, ``x[idx] = v``, ``F.relu(x, inplace=True)``. For a
            write inside a library module's forward, the line that called the
            module (then ``module_built`` is the line to edit).
        write_op: that op as PyTorch names it (``"mul_"``, ``"add_"`` for ``+=``,
            ``"copy_"``/``"fill_"``/``"index_put_"`` for ``x[idx] = v``,
            ``"relu_"`` inside ``nn.ReLU(inplace=True)``), or ``None``. Picks among
            several in-place constructs on one line, and among modules.
        module_built: the line that constructs the in-place module whose forward
            wrote (``nn.ReLU(inplace=True)``, ``nn.Dropout(0.5, True)``).
            Absent, the engine looks for in-place constructions in the files of
            the other lines (and the main script) and checks each.
        module_class: that module's class name (``"Dropout"``).
        step: the ``optimizer.step()`` call that changed the tensor: between two
            backwards of one forward, or between a forward and its backward
            (``modified_by`` of kind ``"optimizer.step"``).
        zero_grad: that optimizer's ``zero_grad()`` between the step and the
            failing backward, if any (derived from the source when absent).
        update: a ``torch.no_grad()`` write to a parameter or buffer between the
            forward and the backward (EMA swap, ``clamp_``, max-norm, weight
            merge): the user frames of the write, outermost first (the call in
            the training loop, then the line in the helper it called). The
            engine moves the statement, in the failing backward's function,
            that holds the write.
        carried: for ``freed``, the variable that carried the freed graph into
            this backward's graph (``Hazard.carried_by``): ``"fake"``, ``"h"``, ``"adv"``.
        carried_made: the line that made it (``fake = G(z)``, ``h = rnn(x, h)``,
            ``adv = returns - values``); derived from the source when absent
            (the last assignment to ``carried`` before the first backward).
        carried_use: ``"forward"`` when the carried tensor is fed to a forward
            (``D(fake)``, ``rnn(x, h)``), ``"data"`` when it is used as a value
            (advantages, targets); derived from the source when absent.
        between: what sits between ``first_backward`` and the failing backward:
            ``"step"``, ``"write"`` or ``"nothing"``; orders the candidates only.
        sources: source text of programs that are not files (``"<string>"``,
            ``"<stdin>"``, notebook cells), by ``file``.
    """

    kind: Kind
    tensor: str | None = None
    node: str = ""
    slot: str = ""
    failing_backward: Line | None = None
    first_backward: Line | None = None
    saved_at: Line | None = None
    write: Line | None = None
    write_op: str | None = None
    module_built: Line | None = None
    module_class: str | None = None
    step: Line | None = None
    zero_grad: Line | None = None
    update: tuple[Line, ...] = ()
    carried: str | None = None
    carried_made: Line | None = None
    carried_use: Use | None = None
    between: Between | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def lines(self) -> list[Line]:
        """Every line the facts name."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Line):
                out.append(value)
            elif isinstance(value, tuple):
                out.extend(v for v in value if isinstance(v, Line))
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields (``sources`` left out)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sources":
                continue
            if isinstance(value, Line):
                out[f.name] = value.to_dict()
            elif isinstance(value, tuple):
                out[f.name] = [v.to_dict() for v in value]
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FixFacts:
        """The inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown fact(s): {', '.join(unknown)}")
        if d.get("kind") not in ("inplace", "freed", "silent"):
            raise ValueError(f"kind must be inplace, freed or silent, not {d.get('kind')!r}")
        kw: dict[str, Any] = {}
        for name, value in d.items():
            if value is None:
                kw[name] = None
            elif name == "update":
                kw[name] = tuple(Line.from_dict(v) for v in value)
            elif name == "sources":
                kw[name] = dict(value)
            elif isinstance(value, Mapping):
                kw[name] = Line.from_dict(value)
            else:
                kw[name] = value
        return cls(**kw)


_OP = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\(\)")
_STEP_CALL = re.compile(r"^[\w.\[\]]+\.step\(\s*\)")


def _line(site: Site | None) -> Line | None:
    if site is None:
        return None
    # A Site reads its file relative to the working directory: made absolute here,
    # while the working directory is the program's.
    file = site.file
    return Line(file if file.startswith("<") else os.path.abspath(file), site.line, site.code)


def _sites(m: Modification) -> list[Line]:
    """A modification's user lines, outermost first: its full stack where the report has
    one (a ``no_grad`` update in a helper: the call in the loop, then the write), else
    its own line."""
    lines = [_line(s) for s in getattr(m, "stack", None) or () if isinstance(s, Site)]
    own = _line(m.site)
    found = [ln for ln in lines if ln is not None]
    if own is not None and own not in found:
        found.append(own)
    return found


def from_report(report: Report, hazard: Hazard | None = None) -> FixFacts:
    """The facts a watcher's report gives about ``hazard`` (default: the first).

    Call it in the process that made the report, in the working directory the
    program had: a :class:`~versionwatch.Site` shows its file relative to it.
    Facts a report of this release may lack (the carrier, what ran between two
    backwards, where a module was built) are read when present; the engine
    derives what it can from the source otherwise.
    """
    h = hazard if hazard is not None else report.hazards[0]
    named = bool(h.tensor)
    write = op = step = built = cls = None
    update: list[Line] = []
    for m in h.modified_by:
        site = _line(m.site)
        writer = m.writer  # inside a library module's forward: that module
        if writer is not None and writer.built_at is not None and built is None:
            built = _line(writer.built_at)
            cls = writer.class_name or writer.text.split("(", 1)[0] or None
        if m.kind == "optimizer.step" and step is None:
            step = site
        elif m.kind == "inplace_op" and site is not None:
            match = _OP.match(m.description)
            if ("step()" in m.description or _STEP_CALL.search(site.code)) and step is None:
                # Strict mode records a step's writes as the step, or (an optimizer
                # it did not adopt, Lightning's) as the op, at the step's line.
                step = site
            elif named:
                update.extend(_sites(m))
            elif write is None:
                write = site
                op = match.group(1) if match else None
    freed_by = h.freed_by.site if h.freed_by is not None else None
    carried = h.carried_by or None
    made = use = between = None
    carrier = h.carrier
    if carrier is not None:
        carried = carried or carrier.name or None
        made = _line(carrier.site) if carrier.name else None
        use = {"data": "data", "state": "forward", "input": "forward"}.get(carrier.role or "")
    gap = h.between
    if gap is not None:
        events = list(gap.events)
        steps = [e for e in events if e.kind == "optimizer.step"
                 or (e.kind == "inplace_op" and "step()" in e.description)]
        between = "step" if steps else ("write" if events else "nothing")
        if step is None and steps:
            step = _line(steps[0].site)
    return FixFacts(
        kind=h.kind,
        tensor=h.tensor if named else None,
        node=h.node,
        slot=h.slot,
        failing_backward=_line(report.backward_site),
        first_backward=_line(freed_by),
        saved_at=_line(h.saved_at),
        write=write,
        write_op=op,
        module_built=built,
        module_class=cls,
        step=step,
        update=tuple(dict.fromkeys(update)),
        carried=carried,
        carried_made=made,
        carried_use=use,  # type: ignore[arg-type]
        between=between,  # type: ignore[arg-type]
    )
