r"""The user's source as ``versionwatch fix`` edits it: statements, blocks and exact spans.

Edits are replacements of exact character spans of the original text, found
with the standard library's ``ast`` (structure) and ``tokenize`` (operators,
parentheses, commas), so everything outside them (formatting, comments, blank
lines) stays as the user wrote it. ``ast`` counts columns in UTF-8 bytes; this
module turns them into characters.

A file is read as Python reads it (:func:`read_source`): its bytes decoded in the
encoding its coding cookie or UTF-8 BOM names, and split into lines only where
Python ends one (:func:`split_lines`). The edits are made on Python's view of the
text (every line ended by ``\n``); :func:`keep_endings` gives the patched text the
file's own line endings back (``\r\n``, ``\r``, mixed).
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import re
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from versionwatch._package import PACKAGE_DIR

Pos = tuple[int, int]  # (1-based line, 0-based character column)

# A line as Python counts them: ended by \r\n, \r or \n, or the last one, unended.
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def split_lines(text: str, keepends: bool = False) -> list[str]:
    r"""``text``'s lines as Python numbers them: a line ends at ``\n``, ``\r\n`` or ``\r``.

    Not ``str.splitlines``, which also ends one at a form feed, ``\x1c``-``\x1e``,
    ``\x85``, U+2028 and U+2029: characters a comment or a string may hold, after
    which every line number would be off from the interpreter's.

    >>> split_lines("a\fb\r\nc\rd\n\u2028e")
    ['a\x0cb', 'c', 'd', '\u2028e']
    """
    lines = _LINE.findall(text)
    return lines if keepends else [_body(ln) for ln in lines]


def _body(line: str) -> str:
    """``line`` without its ending."""
    return line[:-2] if line.endswith("\r\n") else line.rstrip("\r\n")


def decode_source(data: bytes) -> tuple[str, str]:
    """A source file's bytes as text, and the encoding that decoded them.

    The encoding is the one Python uses: the coding cookie of the first two
    lines, ``utf-8-sig`` with a UTF-8 BOM (which the text leaves out), else
    UTF-8. The line endings stay as they are in the file.

    Raises:
        SyntaxError: a coding cookie Python does not know.
        UnicodeDecodeError: bytes that are not in that encoding.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding


def read_source(path: str) -> str:
    """The text of the file at ``path`` as the interpreter decodes it, endings as written.

    Raises:
        OSError, SyntaxError, UnicodeDecodeError: as :func:`decode_source`.
    """
    with open(path, "rb") as f:
        return decode_source(f.read())[0]


def python_text(text: str) -> str:
    r"""``text`` with every line ended by ``\n``, as the interpreter reads a file."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def keep_endings(written: str, new: str) -> str:
    """``new``, an edit of ``python_text(written)``, with ``written``'s line endings.

    A line the edit kept keeps its own ending; a line it changed or added gets the
    ending of the line it replaces, or where it adds one, of the line before it
    (the line after, at the top): a CRLF file stays CRLF, a mixed file keeps each
    line's own, and the diff of the two applies to the file as it is.
    """
    if "\r" not in written:
        return new
    old = split_lines(written, keepends=True)
    lines = split_lines(new, keepends=True)
    endings = [ln[len(_body(ln)):] for ln in old]
    # For a line whose neighbour has none (the last line, unended): the file's usual one.
    usual = max(("\r\n", "\r", "\n"), key=endings.count)

    def ending(i: int) -> str:
        return endings[min(max(i, 0), len(old) - 1)] or usual

    out: list[str] = []
    matcher = difflib.SequenceMatcher(a=[_body(ln) for ln in old],
                                      b=[_body(ln) for ln in lines], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for k in range(j2 - j1):
            line = lines[j1 + k]
            body = _body(line)
            if len(body) == len(line):  # the last line, unended: so it stays
                out.append(line)
            elif tag == "equal":
                out.append(body + ending(i1 + k))
            else:
                out.append(body + ending(min(i1 + k, i2 - 1) if i2 > i1 else i1 - 1))
    return "".join(out)


@dataclass(frozen=True)
class Edit:
    """Replace the text from ``start`` to ``end`` (exclusive) with ``text``."""

    start: Pos
    end: Pos
    text: str


class Source:
    r"""One file's text, parsed: positions in characters, statements by line, blocks.

    ``text`` is the file's text as Python reads it, every line ended by ``\n``;
    ``written`` is the text as given, with the file's own line endings.

    Raises:
        SyntaxError: the text is not Python this interpreter parses.
    """

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.written = text  # as in the file: its own line endings
        self.text = python_text(text)  # as Python reads it: what the edits are made on
        self.lines = split_lines(self.text, keepends=True)
        self.tree = ast.parse(self.text)
        self.tokens = list(tokenize.generate_tokens(io.StringIO(self.text).readline))
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

    def values_of(self, name: str, node: ast.AST) -> list[ast.expr] | None:
        """Every value the function (or module) that holds ``node`` binds to ``name``.

        ``None`` when some binding is no plain ``name = value`` (a parameter, a loop
        variable, ``with ... as``, a tuple target, ``global``): what it holds is unknown.
        """
        scope = self.function(node)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = scope.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            if any(p is not None and p.arg == name for p in params):
                return None
        out: list[ast.expr] = []
        for n in ast.walk(scope):
            if isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
                return None
            if not (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)) \
                    or self.function(n) is not scope:
                continue
            up = self.parent(n)
            owner = up[0] if up else None
            if isinstance(owner, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) \
                    and owner.value is not None and up is not None \
                    and up[1] in ("targets", "target"):
                out.append(owner.value)
            else:
                return None
        return out

    def comments_above(self, line: int) -> int:
        """The first of the comment lines directly above ``line`` (``line`` if none)."""
        first = line
        indent = self.indent(line)
        while first > 1:
            text = self.line_text(first - 1)
            if not text.lstrip().startswith("#") or self.indent(first - 1) != indent:
                break
            first -= 1
        return first

    def whole_lines(self, stmt: ast.stmt) -> tuple[int, int]:
        """First and last line of ``stmt`` (with its decorators)."""
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
        return first, stmt.end_lineno or stmt.lineno


def apply(text: str, edits: Sequence[Edit]) -> str:
    """``text`` with ``edits`` made; they must not overlap."""
    lines = split_lines(text, keepends=True)
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
    return _comments_kept(text, out, edits)


def _trailing_comments(text: str) -> dict[int, tuple[int, str]]:
    """Line -> (column, text) of each comment that follows code on its line."""
    found: dict[int, tuple[int, str]] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT and tok.line[:tok.start[1]].strip():
                found[tok.start[0]] = (tok.start[1], tok.string)
    except (tokenize.TokenError, SyntaxError):
        pass
    return found


def _comments_kept(old: str, new: str, edits: Sequence[Edit]) -> str:
    """``new`` with the trailing comment of each line an edit lengthened within the line
    back at its column in ``old``, or where that no longer fits, after the code by the
    gap it had (two spaces at most): not pushed right by the longer code. A comment
    that the shorter code moved left stays there, with its gap."""
    comments = _trailing_comments(old)
    inline = {e.start[0] for e in edits if e.start[0] == e.end[0] and "\n" not in e.text}
    inline -= {n for e in edits if e.start[0] != e.end[0] or "\n" in e.text
               for n in range(e.start[0], e.end[0] + 1)}
    if not inline & comments.keys():
        return new
    lines = split_lines(new, keepends=True)
    for n in sorted(inline & comments.keys()):
        # Lines an earlier edit added or removed move this one.
        moved = n + sum(e.text.count("\n") - (e.end[0] - e.start[0]) for e in edits
                        if e.end[0] < n)
        if not 0 < moved <= len(lines):
            continue
        column, comment = comments[n]
        line = lines[moved - 1]
        body = line.rstrip("\r\n")
        if not body.endswith(comment):
            continue
        code = body[:len(body) - len(comment)].rstrip()
        if not code.strip() or len(body) - len(comment) <= column:
            continue
        before = split_lines(old)[n - 1][:column]
        gap = min(len(before) - len(before.rstrip()), 2) or 1
        at = max(column, len(code) + gap)
        lines[moved - 1] = code + " " * (at - len(code)) + comment + line[len(body):]
    return "".join(lines)


def unified_diff(rel: str, old: str, new: str) -> str:
    r"""A ``git apply``-able diff of one file, paths ``a/REL`` and ``b/REL``.

    A file outside the working directory keeps its absolute path (``patch -p0``).
    Each line keeps its ending, so that the diff of a CRLF file applies to it; a
    line ended by a lone ``\r`` (which no line-based tool reads as a line end) is
    shown ended by ``\n``.
    """
    a, b = split_lines(old, keepends=True), split_lines(new, keepends=True)
    if os.path.isabs(rel):  # outside the working directory: for `patch -p0`
        out, names = [], (rel, rel)
    else:
        out, names = [f"diff --git a/{rel} b/{rel}\n"], (f"a/{rel}", f"b/{rel}")
    for line in difflib.unified_diff(a, b, *names, n=3):
        if line.endswith("\r"):
            line = line[:-1] + "\n"
        if not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def changed_lines(old: str, new: str) -> tuple[int, list[str], list[str]]:
    """The first changed line (1-based, of ``old``), and the old and new lines that differ."""
    a, b = split_lines(old), split_lines(new)
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
    a, b = split_lines(old), split_lines(new)
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
