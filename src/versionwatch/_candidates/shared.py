"""What ``versionwatch fix``'s families share: :class:`Candidate`, :class:`Sources`, ast helpers.

The families (:mod:`versionwatch._candidates.edits` for edits in place,
:mod:`versionwatch._candidates.moves` for statements moved or merged,
:mod:`versionwatch._candidates.freed` for freed graphs) build their candidates from
these: the user's files parsed once, calls and statements found by ``ast``,
and statements removed or inserted with their formatting and comments kept.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

from versionwatch._candidates.facts import FixFacts, Line, shown
from versionwatch._candidates.source import (
    Edit,
    Source,
    apply,
    changed_lines,
    keep_endings,
    library_file,
    read_source,
    unified_diff,
)

# Callees that take tensors as data, not as a network's input (for carried_use).
DATA_CALLEES = ("loss", "criterion", "bce", "mse", "nll", "cross_entropy", "l1", "huber",
                 "kl_div", "print", "len", "float", "int", "isinstance", "type")
DATA_NAMESPACES = ("torch", "F", "functional", "math", "np", "numpy")
COMPOUND = (ast.With, ast.For, ast.If, ast.While, ast.Try, ast.AsyncWith, ast.AsyncFor)



def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working directory is gone
        return None


class CandidateDoc(TypedDict):
    """A candidate's JSON fields: a :class:`~versionwatch._report.model.Fix`'s."""

    family: str
    summary: str
    file: str
    line: int
    old: str
    new: str
    diff: str
    checked: bool
    verified: bool
    keeps_values: bool
    why: str


@dataclass
class Candidate:
    """One proposed patch, and what its check found.

    Attributes:
        family: which kind of edit (see the module's table).
        summary: one line on what it changes.
        files: absolute path -> (old text, new text) of each edited file.
        keeps_values: the family claims the values stay the same (an out-of-place
            form, ``inplace=False``, ``retain_graph=True``); the check compares
            them and clears it if they differ.
        same_backwards: the patched program runs the same backward calls in the
            same order (false for summed losses), so they compare one by one.
        cut_at: backwards whose reach may shrink on purpose (the discriminator's
            loss in ``D(fake.detach())``); ``cut_any``: every backward's may.
        hides: why this edit only hides the failure, by rule (never verified).
        checked: a run of the patched program checked it.
        verified: the check found the hazard gone and the program further on.
        why: the check's finding, one line.
        extra: what a family notes for later (``merged``, ``target``).
        base: the working directory when it was made: ``file`` and ``diff`` name
            the files relative to it.
    """

    family: str
    summary: str
    files: dict[str, tuple[str, str]]
    keeps_values: bool = False
    same_backwards: bool = True
    cut_at: tuple[Line, ...] = ()
    cut_any: bool = False
    hides: str | None = None
    checked: bool = False
    verified: bool = False
    why: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    base: str | None = field(default_factory=_cwd)

    @property
    def file(self) -> str:
        return next(iter(self.files))

    @property
    def line(self) -> int:
        old, new = self.files[self.file]
        return changed_lines(old, new)[0]

    @property
    def old(self) -> str:
        return "\n".join(ln for o, n in self.files.values() for ln in changed_lines(o, n)[1])

    @property
    def new(self) -> str:
        return "\n".join(ln for o, n in self.files.values() for ln in changed_lines(o, n)[2])

    @property
    def diff(self) -> str:
        return "".join(unified_diff(shown(path, self.base), old, new)
                       for path, (old, new) in self.files.items())

    def to_dict(self) -> CandidateDoc:
        return {
            "family": self.family, "summary": self.summary, "file": shown(self.file, self.base),
            "line": self.line, "old": self.old, "new": self.new, "diff": self.diff,
            "checked": self.checked, "verified": self.verified,
            "keeps_values": self.keeps_values, "why": self.why,
        }


# -- reading the user's files -------------------------------------------------------

class Sources:
    """The user's files, parsed once; ``None`` for one that cannot be read or parsed."""

    def __init__(self, texts: dict[str, str] | None = None) -> None:
        self._texts = dict(texts or {})
        self._parsed: dict[str, Source | None] = {}

    def get(self, path: str) -> Source | None:
        if path not in self._parsed:
            text = self._texts.get(path)
            if text is None and not path.startswith("<"):
                try:  # as the interpreter reads it: its coding cookie, a BOM
                    text = read_source(path)
                except (OSError, SyntaxError, UnicodeDecodeError):
                    text = None
            try:
                self._parsed[path] = None if text is None else Source(path, text)
            except (SyntaxError, ValueError):
                self._parsed[path] = None
        return self._parsed[path]

    def as_written(self, files: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
        """A candidate's files, each (old, new) with the line endings its file has.

        The families edit the text as Python reads it (``\\n`` endings); the diff
        shown, the check's copy and ``--apply`` need the file's own (``\\r\\n``).
        """
        out = {}
        for path, (old, new) in files.items():
            src = self.get(path)
            if src is not None and src.text == old and src.written != old:
                old, new = src.written, keep_endings(src.written, new)
            out[path] = (old, new)
        return out

    def at(self, line: Line | None) -> Source | None:
        """The source of ``line``'s file, if the line still reads as the watcher saw it."""
        if line is None or (not line.file.startswith("<") and library_file(line.file)):
            return None
        src = self.get(line.file)
        if src is None:
            return None
        if line.code and src.line_text(line.line).strip() != line.code.strip():
            return None  # edited since the run
        return src


# -- small ast helpers ---------------------------------------------------------------

def calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node``, in source order, not those in functions defined there."""
    found = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Call):
            found.append(n)
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                      ast.ClassDef)):
                stack.append(child)
    found.sort(key=lambda c: (c.lineno, c.col_offset))
    yield from found


def callee(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return ""


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def rebindable(node: ast.AST) -> bool:
    """A name or ``a.b.c``: assigning it rebinds what a later read of it finds."""
    return dotted(node) is not None


def atomic(node: ast.AST) -> bool:
    """Needs no parentheses as an operand of a binary operator or before ``.detach()``."""
    return isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant,
                             ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp,
                             ast.DictComp, ast.SetComp))


def is_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def backward_call(stmt: ast.AST) -> ast.Call | None:
    """The first backward ``stmt`` calls: ``loss.backward()``, ``torch.autograd.grad``,
    Lightning's ``self.manual_backward(loss)``."""
    for call in calls(stmt):
        name = dotted(call.func) or ""
        if callee(call) in ("backward", "manual_backward") \
                or name.endswith(("autograd.grad", "autograd.backward")):
            return call
    return None


def loss_of(stmt: ast.stmt) -> ast.expr | None:
    """The loss of a statement that is one backward call: ``loss`` of ``loss.backward()``
    or of ``self.manual_backward(loss)``."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call, func = stmt.value, stmt.value.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr == "backward":
        return func.value
    if func.attr == "manual_backward" and call.args:
        return call.args[0]
    return None


def method_stmt(stmt: ast.stmt, attr: str, receiver: str | None, src: Source) -> bool:
    """``stmt`` is ``RECEIVER.attr(...)`` alone."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    f = stmt.value.func
    return (isinstance(f, ast.Attribute) and f.attr == attr
            and (receiver is None or src.segment(f.value) == receiver))


def stmt_with(src: Source, line: int, pick: Callable[[ast.stmt], bool]) -> ast.stmt | None:
    return next((s for s in src.statements_at(line) if pick(s)), None)


def arg_uses(node: ast.AST, name: str) -> list[tuple[ast.Name, ast.Call]]:
    """Reads of ``name`` passed straight to a call (``D(fake)``), not as its receiver."""
    out = []
    for call in calls(node):
        values = [*call.args, *(k.value for k in call.keywords)]
        for v in values:
            if isinstance(v, ast.Name) and v.id == name:
                out.append((v, call))
    return out


def fed_to_forward(uses: list[tuple[ast.Name, ast.Call]]) -> bool:
    for _, call in uses:
        name = dotted(call.func) or ""
        word = callee(call).lower()
        if name.split(".")[0] in DATA_NAMESPACES and "." in name:
            continue
        if any(data in word for data in DATA_CALLEES):
            continue
        return True
    return False


# -- statement moves -----------------------------------------------------------------

def comment_start(src: Source, stmt: ast.stmt) -> int:
    """The first line of the comment lines directly above ``stmt`` at its indent (its own
    line when there are none): they say what the statement does, so they move with it."""
    return src.comments_above(src.whole_lines(stmt)[0])


def remove(src: Source, stmt: ast.stmt) -> Edit:
    if src.alone(stmt):
        first, last = comment_start(src, stmt), src.whole_lines(stmt)[1]
        return Edit((first, 0), (last + 1, 0), "")
    start, end = src.start(stmt), src.end(stmt)
    toks = list(src.tokens_between((start[0], 0), (end[0] + 1, 0)))
    after = [t for t in toks if t.start >= end]
    before = [t for t in toks if t.end <= start]
    if after and after[0].string == ";":
        rest = [t for t in after[1:] if t.start[0] == after[0].start[0]]
        return Edit(start, rest[0].start if rest else after[0].end, "")
    if before and before[-1].string == ";":
        return Edit(before[-1].start, end, "")
    raise ValueError("cannot remove")


def moved_text(src: Source, stmt: ast.stmt, indent: str) -> str:
    """``stmt`` as lines at ``indent`` (with its own trailing comment, and the comment
    lines directly above it)."""
    if src.alone(stmt):
        first, last = comment_start(src, stmt), src.whole_lines(stmt)[1]
        old = src.indent(first)
        out = []
        for n in range(first, last + 1):
            text = src.line_text(n)
            body = text[len(old):] if text.startswith(old) else text.lstrip(" \t")
            out.append(indent + body if body.strip() else body)
        text = "".join(out)
        return text if text.endswith("\n") else text + "\n"
    return indent + src.segment(stmt) + "\n"


def insert_after(src: Source, anchor: ast.stmt, moved: list[ast.stmt]) -> Edit:
    end = src.end(anchor)
    rest = src.line_text(end[0])[end[1]:].strip()
    if not rest or rest.startswith("#"):
        indent = src.indent(anchor.lineno)
        text = "".join(moved_text(src, s, indent) for s in moved)
        line = end[0] + 1
        if line > len(src.lines) and not src.text.endswith("\n"):
            return Edit(end, end, "\n" + text.rstrip("\n"))
        return Edit((line, 0), (line, 0), text)
    if any(s.lineno != s.end_lineno for s in moved):
        raise ValueError("cannot join a multi-line statement with ';'")
    return Edit(end, end, "".join("; " + src.segment(s) for s in moved))


# -- building candidates -------------------------------------------------------------

def candidate(family: str, summary: str, src: Source, edits: list[Edit],
               **kw: Any) -> Candidate | None:
    try:
        new = apply(src.text, edits)
        ast.parse(new)
    except (ValueError, SyntaxError):
        return None
    if new == src.text:
        return None
    return Candidate(family, summary, {src.path: (src.text, new)}, **kw)


def saver(facts: FixFacts) -> str:
    from versionwatch._report import op_name

    return f"`{op_name(facts.node)}`" if facts.node else "the op that saved it"



def function_stmts(src: Source, anchor: ast.stmt, lo: int, hi: int) -> list[ast.stmt]:
    """Simple statements of ``anchor``'s function whose first line is in ``(lo, hi]``."""
    func = src.function(anchor)
    out = []
    for node in ast.walk(func):
        if (isinstance(node, ast.stmt) and lo < node.lineno <= hi
                and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(node))
                and src.function(node) is func):
            out.append(node)
    return sorted(out, key=lambda s: (s.lineno, s.col_offset))




def backward_after(src: Source, line: int) -> ast.stmt | None:
    """The backward a ``check()``/``assert_backward_safe()`` at ``line`` asked about.

    The first statement after it, in its own block or an enclosing one (the
    check may sit in ``if predict:``), that calls a backward; one whose loss is
    the check's first argument wins over an earlier one that is not.
    """
    stmts = src.statements_at(line)
    if not stmts:
        return None
    asked = None
    for call in calls(stmts[0]):
        if callee(call) in ("check", "assert_backward_safe") and call.args:
            asked = src.segment(call.args[0])
            break
    for level in src.chain(stmts[0]):
        place = src.block(level)
        if place is None:
            continue
        body, i = place
        found = [s for s in body[i + 1:] if not isinstance(s, COMPOUND)
                 and backward_call(s) is not None]
        if not found:
            continue
        for s in found:
            back = backward_call(s)
            if (asked is not None and back is not None and isinstance(back.func, ast.Attribute)
                    and src.segment(back.func.value) == asked):
                return s
        return found[0]
    return None


def insert_before(src: Source, anchor: ast.stmt, text: str) -> Edit:
    """``text`` (whole lines, indented by the caller) above ``anchor`` and its comment lines."""
    if not src.alone(anchor):
        raise ValueError("cannot insert before a statement that shares its line")
    line = comment_start(src, anchor)
    return Edit((line, 0), (line, 0), text)


def enclosing_loop(src: Source, stmt: ast.stmt) -> ast.For | ast.While | None:
    """The innermost ``for``/``while`` of ``stmt``'s own function that holds it."""
    func = src.function(stmt)
    for outer in src.chain(stmt)[1:]:
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None
        if isinstance(outer, (ast.For, ast.While)) and src.function(outer) is func:
            return outer
    return None


def retain_edit(src: Source, call: ast.Call) -> Edit | None:
    """``retain_graph=True`` in backward ``call`` (``None``: it has it already)."""
    return keyword_edit(src, call, "retain_graph", "True")


def keyword_edit(src: Source, call: ast.Call, name: str, value: str) -> Edit | None:
    """``name=value`` in ``call`` (``None``: it has it already)."""
    for k in call.keywords:
        if k.arg == name:
            if src.segment(k.value) == value:
                return None
            return Edit(src.start(k.value), src.end(k.value), value)
    close = src.end(call)
    close = (close[0], close[1] - 1)  # the ")"
    toks = list(src.tokens_between(src.start(call), close))
    last_tok = toks[-1] if toks else None
    if last_tok is not None and last_tok.string == ",":  # keep the trailing comma
        return Edit(last_tok.end, last_tok.end, f" {name}={value},")
    sep = "" if last_tok is None or last_tok.string == "(" else ", "
    return Edit(close, close, f"{sep}{name}={value}")


def failing_in_loop(facts: FixFacts, sources: Sources,
                    ) -> tuple[Source, ast.stmt, ast.Name, ast.For | ast.While] | None:
    """The failing backward of a loop whose loss is a name (``total.backward()``): its
    source, its statement, the loss and the loop; ``None`` for any other shape."""
    fb = facts.failing_backward
    src = sources.at(fb)
    if src is None or fb is None:
        return None
    fail = stmt_with(src, fb.line, lambda s: backward_call(s) is not None)
    loss = loss_of(fail) if fail is not None else None
    loop = enclosing_loop(src, fail) if fail is not None else None
    if fail is None or loop is None or not isinstance(loss, ast.Name):
        return None
    return src, fail, loss, loop
