"""The prediction's result: :class:`Hazard` and :class:`Report`, as plain data.

A report holds plain data only (names, shapes, versions, strings): never a
tensor or an autograd node, so keeping one (or the exception that carries it)
keeps no graph alive.

Rendering depends on the report, never the other way round: the renderers
(``_render`` for text, ``_dot`` for Graphviz) import this module and register
themselves in :data:`RENDERERS` when they load, and ``str(report)`` and
``report.to_dot()`` look them up there. Every path that hands out a report
(the predictor, the watcher, ``versionwatch.Report`` itself) loads them first.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from versionwatch._report.source_lines import made_variable, written_variable

HazardKind = Literal["inplace", "freed", "silent"]
SilentCause = Literal["checkpoint", "gradient", "fingerprint"]

# A node's name without its "Backward0" ending: the op, as reports name it.
BACKWARD_SUFFIX = re.compile(r"Backward\d*$")

# The JSON builders, by what each builds ("hazard", "repair", "report"): the
# document module registers them when it loads, as the renderers do, so that the
# report never imports what writes it (the folder's __init__ loads them together).
DOCUMENTS: dict[str, Callable[..., dict[str, Any]]] = {}

# "text" and "dot" -> the function that renders a report so; filled by the renderers.
RENDERERS: dict[str, Callable[[Report], str]] = {}


def register_renderer(kind: str, render: Callable[[Report], str]) -> None:
    """Make ``render`` the way reports render as ``kind`` (``"text"`` or ``"dot"``)."""
    RENDERERS[kind] = render


def _render(report: Report, kind: str) -> str:
    render = RENDERERS.get(kind)
    if render is None:
        raise RuntimeError(
            f"versionwatch: no {kind} renderer is loaded; import versionwatch._report.text first")
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
    return import_relative(filename)


def import_relative(filename: str) -> str:
    """``filename`` relative to the longest ``sys.path`` entry it lies under, else as given."""
    path = os.path.abspath(filename)
    for root in sorted((p for p in sys.path if p), key=len, reverse=True):
        root = os.path.join(os.path.abspath(root), "")
        if path.startswith(root):
            return path[len(root):]
    return filename


# Notebook cells: the file name a cell's code was compiled under -> the cell's number
# as IPython shows it (``In[5]``). Filled by whoever compiles cells: the IPython
# extension (from IPython's own compiler, through CELL_LOOKUPS, asked lazily) and
# ``versionwatch run nb.ipynb`` (register_cell). Reports then say ``Cell In[5], line 3``.
CELLS: dict[str, int] = {}
CELL_LOOKUPS: list[Callable[[str], int | None]] = []


def register_cell(filename: str, number: int) -> None:
    """Code compiled under ``filename`` is notebook cell ``In[number]``."""
    CELLS[filename] = number


def cell_of(filename: str) -> int | None:
    """The notebook cell whose code was compiled under ``filename``, if any."""
    number = CELLS.get(filename)
    if number is None:
        for lookup in CELL_LOOKUPS:
            number = lookup(filename)
            if number is not None:
                break
    return number


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

    ``via``: where the user's line called into a training library that then made
    the event (Hugging Face's ``Trainer`` calling the model, a write in
    transformers' own modeling code): that library's innermost line, shown after
    the user's (``train.py:30 (via transformers/trainer.py:2209)``).
    """

    if TYPE_CHECKING:
        file: str
    else:
        file: _ShownPath = _ShownPath()  # a required field that reads as a str
    line: int
    code: str = ""
    via: Site | None = field(default=None, repr=False)

    def __hash__(self) -> int:
        # Equal sites have equal lines and code, whatever the working directory.
        return hash((self.line, self.code))

    @property
    def cell(self) -> int | None:
        """The notebook cell this line is in (``5`` for ``In[5]``), else ``None``."""
        return cell_of(self.__dict__["_path"])

    def place(self) -> str:
        """``file:line``, or ``Cell In[5], line 3`` in a notebook; without ``via``."""
        cell = self.cell
        if cell is not None:
            return f"Cell In[{cell}], line {self.line}"
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        if self.via is not None:
            return f"{self.place()} (via {self.via.place()})"
        return self.place()


@dataclass(frozen=True)
class Writer:
    """The module whose ``forward`` made an in-place write (strict mode).

    A write inside a library module's forward (``nn.Dropout(inplace=True)``
    calls ``F.dropout(..., inplace=True)``) has no line of the user's own: the
    module is what the user wrote, and where they built it is where to fix it.

    Attributes:
        module: its qualified name, as the report names tensors (``"clf.2"``).
        text: its one-line ``repr()``, which shows how it was built
            (``"Dropout(p=0.5, inplace=True)"``).
        built_at: the user's line that constructed it, when it can be found.
        class_name: its class's name (``"Dropout"``).
    """

    module: str
    text: str = ""
    built_at: Site | None = None
    class_name: str = ""

    def __str__(self) -> str:
        return f"{self.module} ({self.text})" if self.text else self.module


@dataclass(frozen=True)
class Modification:
    """One event that moved a tensor's version between its save and the backward.

    ``kind`` is ``"optimizer.step"``, ``"inplace_op"`` (strict mode: the exact
    write), ``"between_events"``, ``"module_forward"`` or ``"backward"`` (a hook
    or custom Function that wrote during a backward). ``writer``: for an
    ``inplace_op`` made inside a module's ``forward``, that module (then
    ``site`` is the user's line that called it); ``None`` when the write is the
    user's own line, or unknown. ``stack``: for a write strict mode saw, the
    user's frames that led to it, outermost first, ``site`` last (a
    ``no_grad`` update in a helper: the loop's call of the helper, then the
    write); empty when ``site`` is all there is.
    """

    kind: str
    description: str
    site: Site | None = None
    versions: tuple[int, int] | None = None
    # For "between_events": the two events around the change, (label, site) each.
    bounds: tuple[tuple[str, Site | None], tuple[str, Site | None]] | None = None
    writer: Writer | None = None
    stack: tuple[Site, ...] = ()

    def __str__(self) -> str:
        text = self.description
        if self.writer is not None:
            text += f" in {self.writer}"
            if self.site is not None:
                text += f", called at {self.site}"
        elif self.site is not None:
            text += f" at {self.site}"
        if self.versions is not None:
            text += f" (version {self.versions[0]} -> {self.versions[1]})"
        return text


@dataclass(frozen=True)
class Forward:
    """A watched forward: its label (``"block.forward #1"``), the user's line that called it,
    and the watched module it ran (``"block"``), when known."""

    label: str
    site: Site | None = None
    module: str | None = None

    def __str__(self) -> str:
        return f"{self.label} at {self.site}" if self.site is not None else self.label


class ForwardRef:
    """The watched forward a tensor was saved in, in pieces: ``saved_during``'s source.

    ``label`` as its watcher named it (``"block.forward #1"``), ``site`` the user's
    line that called it, ``thread`` the name of the thread it ran on once several
    threads record events (else None). Made where the forward is recorded; its
    text (``"block.forward #1 on thread w at prog.py:24"``) only where it is shown.
    """

    __slots__ = ("label", "site", "thread")

    def __init__(self, label: str, site: Site | None, thread: str | None) -> None:
        self.label = label
        self.site = site
        self.thread = thread

    @property
    def named(self) -> str:
        """The label and, once threads record events, the thread: ``"forward #1 on thread w"``."""
        return self.label if self.thread is None else f"{self.label} on thread {self.thread}"

    def __str__(self) -> str:
        return f"{self.named} at {self.site}" if self.site is not None else self.named


def forward_of(ref: ForwardRef) -> Forward:
    """JSON's ``saved_forward``: the forward's label, the line that called it, and the root
    module when the label names one (``"G.forward #1"``; a watcher of one root writes
    ``"forward #1"``).

    >>> f = forward_of(ForwardRef("G.forward #2", Site("train.py", 12), None))
    >>> f.label, f.site.file, f.site.line, f.module
    ('G.forward #2', 'train.py', 12, 'G')
    >>> forward_of(ForwardRef("forward #1", None, "w")).label
    'forward #1 on thread w'
    """
    root, sep, _ = ref.label.rpartition(".forward #")
    return Forward(ref.named, ref.site, root if sep else None)


@dataclass(frozen=True)
class Carrier:
    """What carried a freed graph into this backward's graph (a ``freed`` hazard).

    The fix for "backward through the graph a second time" depends on what
    that tensor is to the program; each fact is ``None`` where unknown, and the
    fix is then worded as a choice.

    Attributes:
        name: the user's variable holding it (``"fake"``), ``""`` if none shows it.
        site: the user's line that made it (``fake = G(z)``), when known.
        module: the watched module whose forward made it (``"G"``), when known.
        role: ``"state"``: state carried from one iteration to the next and fed
            back into the forward that made it (``h = rnn(x, h)``): truncated
            backpropagation through time; ``"input"``: fed to another module's
            forward after the freeing backward (a GAN's ``D(fake)``), whose loss
            should still train what made it; ``"data"``: used as a constant
            (advantages, targets), through which no gradient is meant to flow.
        fed_to: for ``"input"``: the later forward it was fed to.
        entered: for ``"input"``: where it entered the graph that the freeing
            backward went through (the first loss's ``D(fake)``).
        trained: whether a watched optimizer steps the parameters of ``module``.
    """

    name: str = ""
    site: Site | None = None
    module: str | None = None
    role: Literal["state", "input", "data"] | None = None
    fed_to: Forward | None = None
    entered: Site | None = None
    trained: bool | None = None


@dataclass(frozen=True)
class Between:
    """What ran between the backward that freed a graph and this backward.

    Attributes:
        events: the steps, ``zero_grad`` calls and writes between them, in order
            (each as a :class:`Modification`); empty when nothing ran.
        changes_saved: a step or write changed a tensor the freed graph saved:
            ``retain_graph=True`` on the freeing backward would then end in
            "modified by an inplace operation" here. ``None``: unknown.
        discards_grad: a ``zero_grad`` discarded the gradients that the freeing
            backward left in the parameters of the freed graph (a GAN's D loss
            reaching into G). ``None``: unknown.
    """

    events: tuple[Modification, ...] = ()
    changes_saved: bool | None = None
    discards_grad: bool | None = None


@dataclass(frozen=True)
class Fix:
    """A patch of the user's own lines for a hazard, made by ``versionwatch fix``.

    Attributes:
        family: the kind of edit (``"out_of_place"``, ``"inplace_false"``,
            ``"move_step"``, ... : see docs/fix.md).
        summary: one line on what it changes.
        file: the file it edits (relative to the working directory when under it).
        line: the first line it changes there.
        old: the lines it replaces; ``new``: what replaces them.
        diff: a unified diff (``git apply`` takes it).
        checked: a run of the patched program checked it.
        verified: that run found the hazard gone and the program further on,
            with no other error and no gradient it trains with lost.
        keeps_values: the check found the losses and gradients bitwise the
            original run's (the values the program meant).
        why: the check's finding, or why it was rejected, in one line.
    """

    family: str
    summary: str
    file: str
    line: int
    old: str
    new: str
    diff: str
    checked: bool = False
    verified: bool = False
    keeps_values: bool = False
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def offered(self) -> bool:
        """Whether a report may offer it as the fix: verified by a run, or not checked
        and not one that only hides the failure (its ``why`` then says so)."""
        return self.verified or (not self.checked and HIDES not in self.why)


HIDES = "only hides"
"""The words of a candidate's ``why`` that only hides the failure (``zero_grad(set_to_none=True)``,
a detach in the failing loss): never offered as the fix."""


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
        saved_forward: the forward of ``saved_during`` as a structured
            location; when unset, read from ``saved_during``'s text.
        variable: the user's variable for an unnamed saved tensor (``"x"``);
            when unset, read from the write's line (``x += ...``) or, for a
            saved output, from the line that made it (``h = x.sigmoid()``).
        carrier: for ``freed`` with ``carried_by``: what that tensor is to the
            program (:class:`Carrier`), as far as a watcher knows.
        between: for ``freed``: what ran between the freeing backward and
            this one (:class:`Between`), as far as a watcher knows.
        compiled_forward: when ``node`` is a compiled region's
            (``CompiledFunctionBackward``): the ``def`` line of the compiled
            module's ``forward``, when known.
        fixes: patches of the user's lines for this hazard (:class:`Fix`),
            verified ones first; a watcher fills it with the candidates, not
            checked (their ``why`` says how to check them), and ``versionwatch
            fix`` with the checked ones. The text's ``fix`` line shows the first
            one it may offer (:attr:`Fix.offered`), else ``fix``.
        cause: for ``silent``, how the change escaped PyTorch's version check
            (:mod:`versionwatch._report.silent`): ``None`` (a write with no version
            bump), ``"checkpoint"``, ``"gradient"`` or ``"fingerprint"``.
        hidden_by: for ``silent``: what hid the write from PyTorch, in the user's
            words (``"checkpoint(use_reentrant=False)"``, ``"the hook at
            train.py:12"``), when known.
        saved_in: ``saved_during`` in pieces (:class:`ForwardRef`), where a
            watcher or strict mode set it; internal.
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
    saved_forward: Forward | None = None
    variable: str | None = None
    carrier: Carrier | None = None
    between: Between | None = None
    compiled_forward: Site | None = None
    fixes: list[Fix] = field(default_factory=list, compare=False)
    cause: SilentCause | None = None
    hidden_by: str | None = None
    saved_in: ForwardRef | None = field(default=None, repr=False, compare=False)
    key: int | None = field(default=None, repr=False, compare=False)
    seq: int | None = field(default=None, repr=False, compare=False)

    def saved_during_forward(self, forward: ForwardRef) -> None:
        """Set ``saved_during`` (its text) and ``saved_in`` (its pieces) to ``forward``."""
        self.saved_in = forward
        self.saved_during = str(forward)

    @property
    def where(self) -> str:
        """``Node.slot``, as in ``MulBackward0.other`` (the node alone if the slot is unknown)."""
        return f"{self.node}.{self.slot}" if self.slot else self.node

    @property
    def made_by(self) -> str | None:
        """The op that made an unnamed saved tensor: ``producer``, else PyTorch's sentence's.

        Strict mode knows the producer of a saved output only; PyTorch's sentence
        names it for a saved input too (``which is output 0 of Add,``).
        """
        if self.producer or self.tensor:
            return self.producer
        m = _PRODUCER.search(self.torch_message or "")
        return m["op"] if m else None

    def user_variable(self) -> str | None:
        """The user's variable for an unnamed saved tensor: ``variable``, else read from lines.

        The write's own line names what it wrote (``x += ...``, ``h.mul_(2)``,
        ``p[i] = v``); a saved output's line names what the op made
        (``h = torch.tanh(...)``). A line that only calls into a module
        (``loss = net(x)``) names nothing.
        """
        if self.variable or self.tensor:
            return self.variable
        for m in self.modified_by:
            if m.kind == "inplace_op" and m.writer is None and m.site is not None:
                name = written_variable(m.description, m.site.code)
                if name:
                    return name
        if self.saved_output and self.saved_at is not None and self.producer:
            return made_variable(self.producer, self.saved_at.code)
        return None

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
        producer = self.made_by
        what = f"the output of {producer}" if producer else "a tensor"
        if producer and self.saved_output:
            what = f"the output of {producer} (saved by its own backward)"
        variable = self.user_variable()
        if variable:
            # The user's name first, PyTorch's words for it after.
            what = f"`{variable}`"
            if producer:
                own = ", saved by its own backward" if self.saved_output else ""
                what += f" (the output of {producer}{own})"
        return f"{what}, {meta}" if meta else what

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as in the ``versionwatch.report/1`` schema."""
        forward = self.saved_forward or (forward_of(self.saved_in) if self.saved_in else None)
        return DOCUMENTS["hazard"](self, forward)


# PyTorch's sentence on a saved non-leaf: "[torch.FloatTensor [3, 4]], which is output 0 of Add,".
_PRODUCER = re.compile(r"\], which is output \d+ of (?P<op>\w+?)(?:Backward\d*)?(?:\.\.\.)?,")
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
        ('model.weight', 8, 'forward #1', 'opt.step() #1')
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
        return DOCUMENTS["repair"](self)


# Why a saved tensor (or a node) was not verified: the words of the report.
UNSURE_HOOKS = "behind saved_tensors_hooks"
"""Behind an unpack hook that is not ours: reading it would run user code."""
UNSURE_CHECKPOINT = "a reentrant checkpoint reruns its forward"
"""A reentrant checkpoint's backward runs a forward and a backward no walk can see."""
UNSURE_NONREENTRANT = "inside checkpoint(use_reentrant=False)"
"""Saved inside non-reentrant checkpointing, which recomputes it at backward:
strict mode checks it (its records of the saves and of the writes)."""
UNSURE_COPY_SLICES = "an in-place custom Function on a view (CopySlices), not run"
"""CopySlices wraps a custom Function, whose backward (user code) the check never runs."""
UNSURE_CLEARS = "cleared on first read (clear_saved_tensors_on_access)"
"""A custom Function whose saved tensors PyTorch drops at their first read."""
UNSURE_ERROR = "PyTorch's check raised an error that names no version"
"""Reading the slot raised something that is not PyTorch's version check."""
UNSURE_PROFILER = "a C profiler (cProfile) runs on this thread"
"""On a torch that hides which slots have hooks, no slot is read under a C profiler."""


@dataclass
class Report:
    """What a backward would do, predicted before it runs.

    ``str(report)`` gives the explanation: one headline, one fact a line, then a fix.

    Attributes:
        hazards: the failures, in the order the backward would meet them;
            ``hazards[0]`` is the one PyTorch would raise.
        unverifiable: ``(node, slot)`` of what the predictor did not verify:
            saved tensors behind user ``saved_tensors_hooks`` (``save_on_cpu``,
            non-reentrant checkpointing, ...), which it never unpacks since
            that could run user code, and the others of :attr:`unverifiable_why`.
        unverifiable_why: why, for each entry of :attr:`unverifiable` that is
            not behind hooks (:data:`UNSURE_HOOKS`): :data:`UNSURE_CHECKPOINT`,
            :data:`UNSURE_NONREENTRANT`, :data:`UNSURE_COPY_SLICES`, :data:`UNSURE_CLEARS`,
            :data:`UNSURE_ERROR`,
            :data:`UNSURE_PROFILER`.
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
    unverifiable_why: dict[tuple[str, str], str] = field(default_factory=dict)
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

    def why_unverifiable(self, node: str, slot: str) -> str:
        """Why ``(node, slot)`` of :attr:`unverifiable` was not verified, in a few words."""
        return self.unverifiable_why.get((node, slot), UNSURE_HOOKS)

    def __str__(self) -> str:
        return _render(self, "text")

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data, schema ``versionwatch.report/1``."""
        timeline = self.timeline.to_dict() if self.timeline is not None else {}
        return DOCUMENTS["report"]([self], timeline=timeline, rank=self.rank)

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
