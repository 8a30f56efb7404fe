"""The user's source as ``versionwatch fix`` edits it: statements, blocks and exact spans.

Edits are replacements of exact character spans of the original text, found
with the standard library's ``ast`` (structure) and ``tokenize`` (operators,
parentheses, commas), so everything outside them (formatting, comments, blank
lines) stays as the user wrote it. ``ast`` counts columns in UTF-8 bytes; this
module turns them into characters.
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from versionwatch._package import PACKAGE_DIR

Pos = tuple[int, int]  # (1-based line, 0-based character column)


@dataclass(frozen=True)
class Edit:
    """Replace the text from ``start`` to ``end`` (exclusive) with ``text``."""

    start: Pos
    end: Pos
    text: str


class Source:
    """One file's text, parsed: positions in characters, statements by line, blocks.

    Raises:
        SyntaxError: the text is not Python this interpreter parses.
    """

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.tree = ast.parse(text)
        self.tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        self._parent: dict[int, tuple[ast.AST, str]] = {}
        for node in ast.walk(self.tree):
            for name, value in ast.iter_fields(node):
                if isinstance(value, list):
                    for child in value:
                        if isinstance(child, ast.AST):
                            self._parent[id(child)] = (node, name)
                elif isinstance(value, ast.AST):
                    self._parent[id(value)] = (node, name)

    # -- positions ---------------------------------------------------------------------
    def line_text(self, n: int) -> str:
        return self.lines[n - 1] if 0 < n <= len(self.lines) else ""

    def _char(self, line: int, byte_col: int) -> int:
        return len(self.line_text(line).encode("utf-8")[:byte_col].decode("utf-8", "replace"))

    def start(self, node: ast.AST) -> Pos:
        return node.lineno, self._char(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> Pos:
        line = node.end_lineno  # type: ignore[attr-defined]
        return line, self._char(line, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, node: ast.AST) -> str:
        return self.span_text(self.start(node), self.end(node))

    def span_text(self, start: Pos, end: Pos) -> str:
        (l1, c1), (l2, c2) = start, end
        if l1 == l2:
            return self.line_text(l1)[c1:c2]
        parts = [self.line_text(l1)[c1:]]
        parts += [self.line_text(n) for n in range(l1 + 1, l2)]
        parts.append(self.line_text(l2)[:c2])
        return "".join(parts)

    def indent(self, line: int) -> str:
        text = self.line_text(line)
        return text[:len(text) - len(text.lstrip(" \t"))]

    def tokens_between(self, start: Pos, end: Pos) -> Iterator[tokenize.TokenInfo]:
        """The significant tokens that start at or after ``start`` and end by ``end``."""
        skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT,
                tokenize.DEDENT, tokenize.ENDMARKER)
        for tok in self.tokens:
            if tok.type in skip:
                continue
            if tok.start >= start and tok.end <= end:
                yield tok

    # -- structure ---------------------------------------------------------------------
    def parent(self, node: ast.AST) -> tuple[ast.AST, str] | None:
        return self._parent.get(id(node))

    def statements_at(self, line: int) -> list[ast.stmt]:
        """The innermost statements whose span holds ``line``, in source order.

        A simple statement on the line, or several joined with ``;``; a compound
        statement only if no statement of its body holds the line (its header).
        """
        found = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or 0):
                found.append(node)
        inner = [s for s in found if not any(o is not s and self.contains(s, o) for o in found)]
        return sorted(inner, key=lambda s: (s.lineno, s.col_offset))

    def contains(self, outer: ast.AST, inner: ast.AST) -> bool:
        node: ast.AST | None = inner
        while node is not None:
            up = self.parent(node)
            node = up[0] if up else None
            if node is outer:
                return True
        return False

    def block(self, stmt: ast.stmt) -> tuple[list[ast.stmt], int] | None:
        """The statement list that holds ``stmt``, and its index there."""
        up = self.parent(stmt)
        if up is None:
            return None
        body = getattr(up[0], up[1], None)
        if not isinstance(body, list):
            return None
        for i, s in enumerate(body):
            if s is stmt:
                return body, i
        return None

    def chain(self, stmt: ast.stmt) -> list[ast.stmt]:
        """``stmt`` and the statements that enclose it, innermost first."""
        out = [stmt]
        node: ast.AST = stmt
        while True:
            up = self.parent(node)
            if up is None:
                return out
            node = up[0]
            if isinstance(node, ast.stmt):
                out.append(node)

    def function(self, node: ast.AST) -> ast.AST:
        """The function (or module) whose code holds ``node``."""
        cur: ast.AST = node
        while True:
            up = self.parent(cur)
            if up is None:
                return self.tree
            cur = up[0]
            if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return cur

    def common_block(self, a: ast.stmt, b: ast.stmt,
                     ) -> tuple[list[ast.stmt], int, int] | None:
        """The innermost statement list that holds both, and the index of each one's part."""
        chain_a, chain_b = self.chain(a), self.chain(b)
        for sa in chain_a:
            place = self.block(sa)
            if place is None:
                continue
            body, ia = place
            for sb in chain_b:
                pb = self.block(sb)
                if pb is not None and pb[0] is body:
                    return body, ia, pb[1]
        return None

    def alone(self, stmt: ast.stmt) -> bool:
        """Whether ``stmt`` has its lines to itself (no ``;`` neighbour, no header before it)."""
        s, e = self.start(stmt), self.end(stmt)
        before = self.line_text(s[0])[:s[1]]
        after = self.line_text(e[0])[e[1]:].strip()
        return not before.strip() and (not after or after.startswith("#"))

    def whole_lines(self, stmt: ast.stmt) -> tuple[int, int]:
        """First and last line of ``stmt`` (with its decorators)."""
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
        return first, stmt.end_lineno or stmt.lineno


def apply(text: str, edits: Sequence[Edit]) -> str:
    """``text`` with ``edits`` made; they must not overlap."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))

    def offset(pos: Pos) -> int:
        line, col = pos
        if line > len(lines):
            return len(text)
        return starts[line - 1] + col

    out = text
    last = len(text) + 1
    for e in sorted(edits, key=lambda e: (offset(e.start), offset(e.end)), reverse=True):
        a, b = offset(e.start), offset(e.end)
        if b > last:
            raise ValueError("overlapping edits")
        out = out[:a] + e.text + out[b:]
        last = a
    return out


def unified_diff(rel: str, old: str, new: str) -> str:
    """A ``git apply``-able diff of one file, paths ``a/REL`` and ``b/REL``.

    A file outside the working directory keeps its absolute path (``patch -p0``).
    """
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    if os.path.isabs(rel):  # outside the working directory: for `patch -p0`
        out, names = [], (rel, rel)
    else:
        out, names = [f"diff --git a/{rel} b/{rel}\n"], (f"a/{rel}", f"b/{rel}")
    for line in difflib.unified_diff(a, b, *names, n=3):
        if not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def changed_lines(old: str, new: str) -> tuple[int, list[str], list[str]]:
    """The first changed line (1-based, of ``old``), and the old and new lines that differ."""
    a, b = old.splitlines(), new.splitlines()
    first = 0
    olds: list[str] = []
    news: list[str] = []
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if not first:
            first = i1 + 1
        olds += a[i1:i2]
        news += b[j1:j2]
    return first, olds, news


def line_map(old: str, new: str) -> dict[int, int]:
    """New line number -> old line number (an inserted line: the old line it stands at)."""
    a, b = old.splitlines(), new.splitlines()
    out: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for k in range(j2 - j1):
            if tag == "equal":
                out[j1 + k + 1] = i1 + k + 1
            else:
                out[j1 + k + 1] = min(i1 + k, max(i2 - 1, i1)) + 1
    return out


def library_file(path: str) -> bool:
    """Whether ``path`` is installed code (site-packages, the standard library, torch, ours)."""
    import sysconfig

    real = os.path.realpath(path)
    if os.sep + "site-packages" + os.sep in real or os.sep + "dist-packages" + os.sep in real:
        return True
    here = os.path.realpath(PACKAGE_DIR) + os.sep
    if real.startswith(here):
        return True
    for key in ("stdlib", "platstdlib"):
        root = sysconfig.get_paths().get(key)
        if root and real.startswith(os.path.realpath(root) + os.sep):
            return True
    return False
