"""The prediction's result: :class:`Hazard` and :class:`Report`, as plain data.

A report holds plain data only (names, shapes, versions, strings): never a
tensor or an autograd node, so keeping one (or the exception that carries it)
keeps no graph alive.

Rendering depends on the report, never the other way round: the renderers
(``_explain`` for text, ``_dot`` for Graphviz) import this module and register
themselves in :data:`RENDERERS` when they load, and ``str(report)`` and
``report.to_dot()`` look them up there. Every path that hands out a report
(the predictor, the watcher, ``versionwatch.Report`` itself) loads them first.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

HazardKind = Literal["inplace", "freed", "silent"]
SCHEMA = "versionwatch.report/1"

# "text" and "dot" -> the function that renders a report so; filled by the renderers.
RENDERERS: dict[str, Callable[[Report], str]] = {}


def register_renderer(kind: str, render: Callable[[Report], str]) -> None:
    """Make ``render`` the way reports render as ``kind`` (``"text"`` or ``"dot"``)."""
    RENDERERS[kind] = render


def _render(report: Report, kind: str) -> str:
    render = RENDERERS.get(kind)
    if render is None:
        raise RuntimeError(
            f"versionwatch: no {kind} renderer is loaded; import versionwatch._explain first")
    return render(report)


def relative_path(filename: str) -> str:
    """``filename`` as reports show it: relative to the working directory, else to sys.path."""
    try:
        rel = os.path.relpath(filename)
    except (OSError, ValueError):  # no working directory, or another drive
        return filename
    if not rel.startswith(".."):
        return rel
    # Outside the working directory: relative to the import root (site-packages).
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        root = os.path.join(os.path.abspath(root), "")
        if filename.startswith(root):
            return filename[len(root):]
    return filename


class _ShownPath:
    """``Site.file``: stores the path as given, reads it relative to the working directory.

    A data descriptor as a dataclass field: ``Site`` stays a frozen dataclass
    (``asdict``, ``replace``, ``fields``, pattern matching), while a watcher
    records the interpreter's own path at every event without asking the
    working directory (a system call) each time.
    """

    def __get__(self, site: Site | None, owner: type | None = None) -> str:
        if site is None:
            raise AttributeError("file")  # a required field: no class-level default
        path: str = site.__dict__["_path"]
        try:
            cwd = os.getcwd()
        except OSError:  # the working directory was deleted: show what was shown last
            shown = site.__dict__.get("_shown")
            return shown[1] if shown is not None else path
        shown = site.__dict__.get("_shown")
        if shown is None or shown[0] != cwd:
            shown = (cwd, relative_path(path))
            site.__dict__["_shown"] = shown
        return shown[1]

    def __set__(self, site: Site, path: str) -> None:
        # Only the dataclass's __init__ gets here (through object.__setattr__): frozen.
        site.__dict__["_path"] = path
        site.__dict__.pop("_shown", None)


@dataclass(frozen=True)
class Site:
    """A place in the user's code: ``file:line`` and, when readable, the source line.

    ``file`` is shown relative to the working directory at the time it is
    read (else relative to the import root it lies under, else as given).
    Equal sites have the same line and code and show the same file.
    """

    if TYPE_CHECKING:
        file: str
    else:
        file: _ShownPath = _ShownPath()  # a required field that reads as a str
    line: int
    code: str = ""

    def __hash__(self) -> int:
        # Equal sites have equal lines and code, whatever the working directory.
        return hash((self.line, self.code))

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Modification:
    """One event that moved a tensor's version between its save and the backward.

    ``kind`` is ``"optimizer.step"``, ``"inplace_op"`` (strict mode: the exact
    write), ``"between_events"``, ``"module_forward"`` or ``"backward"`` (a hook
    or custom Function that wrote during a backward).
    """

    kind: str
    description: str
    site: Site | None = None
    versions: tuple[int, int] | None = None
    # For "between_events": the two events around the change, (label, site) each.
    bounds: tuple[tuple[str, Site | None], tuple[str, Site | None]] | None = None

    def __str__(self) -> str:
        text = self.description
        if self.site is not None:
            text += f" at {self.site}"
        if self.versions is not None:
            text += f" (version {self.versions[0]} -> {self.versions[1]})"
        return text


def _site(site: Site | None) -> dict[str, Any] | None:
    return None if site is None else {"file": site.file, "line": site.line, "code": site.code}


def _event(bound: tuple[str, Site | None]) -> dict[str, Any]:
    label, site = bound
    return {"event": label, "file": site.file if site else None,
            "line": site.line if site else None}


@dataclass
class Hazard:
    """One saved tensor that backward would fail on (or, for ``silent``, compute wrongly from).

    Attributes:
        kind: ``"inplace"`` (version mismatch), ``"freed"`` (saved tensors already
            released by an earlier backward) or ``"silent"`` (modified without a
            version bump: PyTorch raises nothing and the gradients are wrong).
        node: the autograd node that saved the tensor, e.g. ``"MulBackward0"``.
        slot: which of the node's saved values: ``"other"``, ``"indices[1]"``,
            ``"saved_tensors[0]"`` for a custom ``autograd.Function``.
        saved_version: the version recorded when the forward saved the tensor.
        current_version: the tensor's version now.
        tensor: the tensor's display name (``"model.w3"``) if known.
        shape, dtype, device: what the tensor is, when it is still readable.
        producer: the op that produced the tensor when it is not a leaf
            (``"Sigmoid"``), else ``None``.
        saved_output: the node saved its own op's output (e.g. ``sigmoid``'s result).
        view: the node saved a view of the named tensor (``weight.t()`` in ``F.linear``).
        requires_grad: whether the saved tensor itself requires grad (a parameter).
        order: position of ``node`` in the backward's execution order (0 first).
        module: qualified name of the module whose forward saved it, when a
            watcher knows it.
        saved_during: the forward that saved it and where it was called, when
            a watcher knows it (``"m.forward #1 at train.py:12"``).
        saved_at: the user's line of the op that saved it (strict mode).
        freed_by: for ``freed``, the earlier backward that freed the graph, when
            a watcher saw it.
        carried_by: for ``freed``, when this backward's graph was built after
            that backward and reaches into the freed one: the variable that
            carried the old graph in (``"h"``), or ``""`` when no variable
            shows it.
        modified_by: the events that moved the version, when a watcher knows them.
        notes: further facts a watcher knows (e.g. why a step updated the tensor).
        path: node names from the backward's root down to ``node``.
        fix: a concrete fix for this case.
        detected: ``"predicted"`` (before backward ran) or ``"after_error"``.
        torch_message: PyTorch's own error for this tensor, verbatim, as the
            running torch words it (``None`` where PyTorch raises nothing: a
            ``silent`` hazard, or a write stopped before it happened).
        key: ``id()`` of the named tensor (the base, for a view); internal.
        seq: the saving node's autograd sequence number; internal.
    """

    kind: HazardKind
    node: str
    slot: str
    saved_version: int | None = None
    current_version: int | None = None
    tensor: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    producer: str | None = None
    saved_output: bool = False
    view: bool = False
    requires_grad: bool | None = None
    order: int = 0
    module: str | None = None
    saved_during: str | None = None
    saved_at: Site | None = None
    freed_by: Modification | None = None
    carried_by: str | None = None
    modified_by: list[Modification] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    path: list[str] = field(default_factory=list)
    fix: str = ""
    detected: str = "predicted"
    torch_message: str | None = None
    key: int | None = field(default=None, repr=False, compare=False)
    seq: int | None = field(default=None, repr=False, compare=False)

    @property
    def where(self) -> str:
        """``Node.slot``, as in ``MulBackward0.other`` (the node alone if the slot is unknown)."""
        return f"{self.node}.{self.slot}" if self.slot else self.node

    def describe_tensor(self) -> str:
        """The tensor's name if known, else its type, in the words the report uses."""
        meta = ""
        if self.dtype is not None and self.shape is not None:
            meta = f"{self.dtype}{list(self.shape)}"
            if self.device and self.device != "cpu":
                meta += f" on {self.device}"
        if self.tensor:
            if self.view:
                return f"{self.tensor} (saved as a view of it, {meta})"
            return f"{self.tensor} ({meta})" if meta else self.tensor
        what = f"the output of {self.producer}" if self.producer else "a tensor"
        if self.producer and self.saved_output:
            what = f"the output of {self.producer} (saved by its own backward)"
        return f"{what}, {meta}" if meta else what

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as in the ``versionwatch.report/1`` schema."""
        d = asdict(self)
        d["tensor"] = self.tensor or self.describe_tensor()
        d["shape"] = list(self.shape) if self.shape is not None else None
        d["saved_by"] = self.node
        d["saved_at"] = _site(self.saved_at)
        f = self.freed_by
        d["freed_by"] = None if f is None else {
            "description": f.description, "file": f.site.file if f.site else None,
            "line": f.site.line if f.site else None}
        del d["node"], d["key"], d["seq"]
        d["modified_by"] = [
            {
                "kind": m.kind,
                "description": m.description,
                "file": m.site.file if m.site else None,
                "line": m.site.line if m.site else None,
                **({"versions": list(m.versions)} if m.versions else {}),
                **({"after": _event(m.bounds[0]), "before": _event(m.bounds[1])}
                   if m.bounds else {}),
            }
            for m in self.modified_by
        ]
        return d


def size(n: int) -> str:
    """Bytes in the units the reports use: ``1.0 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Repair:
    """A copy that ``on_hazard="repair"`` kept for a live graph before a write.

    Attributes:
        tensor: the watched tensor (``"D.fc.weight"``), or what it was.
        nbytes: bytes copied for it (views of one tensor share one copy).
        graph: the graph that saved it (``"forward #7"``).
        before: the write it was copied before (``"Adam.step() #12"``).
        site: where that write was called, when known.

    Example:
        >>> import torch, versionwatch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with versionwatch.watch(model, opt, on_hazard="repair") as w:
        ...     loss = (model(torch.ones(1, 2)) * model.weight).sum()  # saves the weight
        ...     loss.backward(retain_graph=True)
        ...     opt.step()
        ...     loss.backward()  # the weight as the forward saw it
        >>> r = w.repairs[0]
        >>> r.tensor, r.nbytes, r.graph, r.before
        ('model.weight', 8, 'forward #1', 'SGD.step() #1')
    """

    tensor: str
    nbytes: int
    graph: str
    before: str
    site: Site | None = None

    def __str__(self) -> str:
        at = f" at {self.site}" if self.site else ""
        return (f"kept a copy of {self.tensor} ({size(self.nbytes)}) for the graph of "
                f"{self.graph} before {self.before}{at}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"tensor": self.tensor, "bytes": self.nbytes, "graph": self.graph,
                "before": self.before, "file": self.site.file if self.site else None,
                "line": self.site.line if self.site else None}


@dataclass
class Report:
    """What a backward would do, predicted before it runs.

    ``str(report)`` gives the explanation: one headline, one fact a line, then a fix.

    Attributes:
        hazards: the failures, in the order the backward would meet them;
            ``hazards[0]`` is the one PyTorch would raise.
        unverifiable: ``(node, slot)`` of saved tensors behind user
            ``saved_tensors_hooks`` (``save_on_cpu``, checkpointing, ...), which
            the predictor never unpacks since that could run user code.
        nodes: how many autograd nodes the backward would execute.
        saved_checked: how many saved tensors were verified.
        backward_site: the user's backward call, when a watcher knows it.
        thread: the name of the thread that called it, once several threads
            have run watched events.
        backward: the backward's number in its watcher (``backward #2``), when
            a watcher ran it.
        replay: what ``versionwatch run --replay`` found when it re-ran the
            program in strict mode to fill in the lines, if it did.
        rank: ``(rank, world_size)`` of the process that made a report with
            hazards, under ``torch.distributed`` (a process group, or torchrun's
            ``RANK``), else None.

    Example:
        >>> import torch, versionwatch
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x.sigmoid()
        >>> _ = y.mul_(2)
        >>> report = versionwatch.check(y.sum())
        >>> report.ok, report.hazards[0].where
        (False, 'SigmoidBackward0.result')
    """

    hazards: list[Hazard] = field(default_factory=list)
    unverifiable: list[tuple[str, str]] = field(default_factory=list)
    nodes: int = 0
    saved_checked: int = 0
    backward_site: Site | None = None
    timeline: Any = None
    thread: str | None = None
    backward: int | None = None
    replay: str | None = None
    rank: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        """True when backward is predicted to succeed (no hazard of any kind)."""
        return not self.hazards

    @property
    def first(self) -> Hazard | None:
        """The hazard backward meets first, or ``None``."""
        return self.hazards[0] if self.hazards else None

    def __str__(self) -> str:
        return _render(self, "text")

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data, schema ``versionwatch.report/1``."""
        site = self.backward_site
        hazards = []
        for h in self.hazards:
            d = h.to_dict()
            d["backward"] = self.backward
            d["replay"] = self.replay
            d["backward_site"] = {"file": site.file, "line": site.line} if site else None
            if site and self.thread:
                d["backward_site"]["thread"] = self.thread
            hazards.append(d)
        timeline = self.timeline.to_dict() if self.timeline is not None else {}
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "ok": self.ok,
            "hazards": hazards,
            "unverifiable": [{"saved_by": n, "slot": s} for n, s in self.unverifiable],
            "nodes": self.nodes,
            "saved_checked": self.saved_checked,
            "timeline": timeline,
        }
        if self.rank is not None:
            out["rank"], out["world_size"] = self.rank
        return out

    def to_dot(self) -> str:
        """Graphviz DOT: the path from the backward's root to each stale saved tensor.

        The saving node is red; the tensor box shows its name and both versions;
        the events that modified it point at it.
        """
        return _render(self, "dot")

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(str(self))}</pre>"

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict())``; keyword arguments go to :func:`json.dumps`."""
        return json.dumps(self.to_dict(), **kwargs)
