"""A notebook file (``.ipynb``) as the program ``versionwatch run`` and ``fix`` run.

The notebook is JSON (nbformat 4): its code cells, in order, are one program,
each cell compiled under a name of its own (``/path/nb.ipynb#In[3]``) whose
lines ``linecache`` holds and whose reports read ``Cell In[3], line 2``
(:func:`versionwatch._report.register_cell`). ``n`` is the number a fresh
"Run all" gives the cell: 1, 2, 3... over the code cells that hold code.

IPython's own syntax has no meaning here: a ``%%`` cell magic's cell is
skipped, a ``%`` line magic or ``!`` shell line becomes ``pass`` (the line
numbers stay), each said in one line; ``%load_ext versionwatch`` and
``%%versionwatch`` mean "watched", which the run is already, and say nothing.

``fix --apply`` edits a cell's ``source`` strings in the file's own text
(:func:`patched_text`): each changed line's JSON string literal replaced,
escaped as the file escapes, every other byte kept. The positions of those
literals come from a small scanner over the text (:func:`_walk`), never from a
``json.load``/``json.dump`` round trip, which would re-indent and re-escape.
"""

from __future__ import annotations

import difflib
import io
import json
import linecache
import os
import re
import tokenize
from dataclasses import dataclass, field
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

SUFFIX = ".ipynb"
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# A line of IPython syntax (after its indentation): a magic or a shell escape.
_MAGIC = re.compile(r"^([ \t]*)([%!].*?)(\r\n|\n|\r)?$", re.DOTALL)
# A line as Python ends one: \r\n, \r or \n (not str.splitlines's \f, \x1c, U+2028...).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _split(text: str) -> list[str]:
    """``text``'s lines, each with its ending, as Python numbers them."""
    return _LINE.findall(text)


class NotebookError(Exception):
    """A notebook that cannot be run: the message is one line."""


def is_notebook(path: str) -> bool:
    """Whether ``path`` names a notebook file (by its suffix, as Jupyter does).

    Example:
        >>> is_notebook("train.ipynb"), is_notebook("train.py")
        (True, False)
    """
    return path.lower().endswith(SUFFIX)


@dataclass
class Cell:
    """One code cell that runs: its number, name, and text as Python runs it."""

    number: int
    index: int  # in the notebook's ``cells``
    filename: str
    text: str  # ``\n`` endings, IPython syntax made ``pass``
    raw: list[str]  # the source strings, as the JSON holds them
    spans: list[tuple[int, int]]  # each string literal's place in the file's text
    single: bool  # ``source`` is one string, not a list

    def lines(self) -> list[str]:
        return _split(self.text)


@dataclass
class Notebook:
    """A notebook read for running: its code cells, and what of them is skipped."""

    path: str
    text: str  # the file's text, as read
    cells: list[Cell]
    notes: list[str] = field(default_factory=list)

    def sources(self) -> dict[str, str]:
        """Each cell's name -> its text: the program's "files" that are not on disk."""
        return {c.filename: c.text for c in self.cells}

    def register(self) -> None:
        """Each cell's lines in ``linecache`` and its number for reports.

        Also by any spelling of a cell's name: a report read back from JSON (``--replay``'s
        strict run) names it relative to the working directory.
        """
        from versionwatch._report import CELL_LOOKUPS

        numbers = {c.filename: c.number for c in self.cells}
        for c in self.cells:
            register_lines(c.filename, c.text, c.number)

        def lookup(filename: str) -> int | None:
            return numbers.get(os.path.realpath(filename)) if "#In[" in filename else None

        CELL_LOOKUPS.append(lookup)


def register_lines(filename: str, text: str, number: int) -> None:
    """``filename``'s lines for ``linecache`` (no file to check: kept), and its cell number."""
    from versionwatch._report import register_cell

    # mtime None: linecache.checkcache keeps the entry, as for IPython's cells.
    linecache.cache[filename] = (len(text), None, _split(text), filename)
    register_cell(filename, number)


def cell_name(path: str, number: int) -> str:
    """The name cell ``number`` of the notebook at ``path`` is compiled under."""
    return f"{os.path.realpath(path)}#In[{number}]"


def read_notebook(path: str, name: str | None = None) -> Notebook:
    """The notebook at ``path``; ``name``: the path its cells are named by (default ``path``).

    Raises:
        NotebookError: not readable, not JSON, not nbformat 4, or no code cells.
    """
    shown = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise NotebookError(f"cannot read {shown}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig" if data.startswith(b"\xef\xbb\xbf") else "utf-8")
        nb = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise NotebookError(f"{shown} is not a notebook: not valid JSON "
                            f"({str(e).splitlines()[0]})") from None
    if not isinstance(nb, dict):
        raise NotebookError(f"{shown} is not a notebook: its JSON is not an object")
    version = nb.get("nbformat")
    if not isinstance(version, int) or version < 4:
        raise NotebookError(f"{shown}: nbformat {version} is not supported (nbformat 4 is); "
                            "open and save it in Jupyter to convert it")
    cells = nb.get("cells")
    if not isinstance(cells, list) or not cells:
        raise NotebookError(f"{shown} is not a notebook with cells: it has no 'cells'")
    try:
        located = _walk(text, _skip(text, 1 if text.startswith("\ufeff") else 0), 0)[0]
    except (ValueError, IndexError, KeyError):
        raise NotebookError(f"{shown} is not a notebook: its JSON could not be read") from None
    places = located.get("cells", (0, 0, []))[2]
    out = Notebook(path, text, [])
    number = 0
    base = name or path
    for index, cell in enumerate(cells):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        single = isinstance(source, str)
        raw = [source] if single else source
        if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
            raise NotebookError(f"{shown}: code cell {index + 1}'s source is not text")
        joined = "".join(raw)
        if not joined.strip():
            continue  # an empty cell gets no number on "Run all"
        number += 1
        spans: list[tuple[int, int]] = []
        cell_place = places[index][2] if index < len(places) else {}
        src_place = cell_place.get("source") if isinstance(cell_place, dict) else None
        if src_place is not None:
            spans = ([(src_place[0], src_place[1])] if single
                     else [(a, b) for a, b, _ in src_place[2]])
        code = _runnable(joined, number, out.notes)
        if code is None:
            continue
        out.cells.append(Cell(number, index, cell_name(base, number), code, list(raw), spans,
                              single))
    if number == 0:
        raise NotebookError(f"{shown} has no code cells to run")
    return out


def _runnable(source: str, number: int, notes: list[str]) -> str | None:
    """The cell's text as Python runs it, or ``None`` for a cell magic's cell."""
    lines = _split(source)
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    out: list[str] = []
    for k, line in enumerate(lines, 1):
        m = _MAGIC.match(line)
        # Only where a statement starts: `% b)` inside brackets is Python's modulo.
        if m is None or not _statement_starts("".join(out)):
            out.append(line.rstrip("\r\n") + "\n")
            continue
        magic = m.group(2).rstrip()
        if magic.startswith("%%") and line.strip() == first:
            if magic.split()[0] != "%%versionwatch":
                notes.append(f"versionwatch: skipped cell In[{number}]: {magic.split()[0]} is "
                             "an IPython cell magic")
                return None
        elif not (magic.split()[:2] == ["%load_ext", "versionwatch"]
                  or magic.split()[:2] == ["%reload_ext", "versionwatch"]):
            what = "a shell command" if magic.startswith("!") else "an IPython magic"
            notes.append(f"versionwatch: skipped In[{number}], line {k}: {magic} ({what})")
        out.append(f"{m.group(1)}pass\n")
    return "".join(out)


def _statement_starts(before: str) -> bool:
    """Whether a statement starts after ``before`` (no bracket, string or ``\\`` open)."""
    if not before:
        return True
    try:
        for _ in tokenize.generate_tokens(io.StringIO(before).readline):
            pass
    except (tokenize.TokenError, SyntaxError):
        return False
    return True


# -- the file's text ------------------------------------------------------------------

def _skip(s: str, i: int) -> int:
    m = _WS.match(s, i)
    return m.end() if m else i


def _walk(s: str, i: int, level: int) -> tuple[Any, int]:
    """The value at ``s[i]``, with the places of what ``fix`` edits.

    Levels: 0 the notebook (an object), 1 its ``cells`` (a list), 2 a cell (an
    object), 3 its ``source``. An object is ``{key: (start, end, value)}``, a
    list ``[(start, end, value)]``; any other value is decoded whole (outputs
    and all), by the C decoder.
    """
    c = s[i]
    descend = (level == 0 and c == "{") or (level == 1 and c == "[") or (
        level == 2 and c == "{") or (level == 3 and c == "[")
    if not descend:
        return _DECODER.raw_decode(s, i)
    if c == "{":
        obj: dict[str, tuple[int, int, Any]] = {}
        i = _skip(s, i + 1)
        if s[i] == "}":
            return obj, i + 1
        while True:
            if s[i] != '"':
                raise ValueError("a key")
            key, i = scanstring(s, i + 1)
            i = _skip(s, i)
            if s[i] != ":":
                raise ValueError("a colon")
            i = _skip(s, i + 1)
            want = (level == 0 and key == "cells") or (level == 2 and key == "source")
            start = i
            value, i = _walk(s, i, level + 1) if want else _DECODER.raw_decode(s, i)
            obj[key] = (start, i, value)
            i = _skip(s, i)
            if s[i] == ",":
                i = _skip(s, i + 1)
            elif s[i] == "}":
                return obj, i + 1
            else:
                raise ValueError("a comma")
    arr: list[tuple[int, int, Any]] = []
    i = _skip(s, i + 1)
    if s[i] == "]":
        return arr, i + 1
    while True:
        start = i
        value, i = _walk(s, i, level + 1) if level == 1 else _DECODER.raw_decode(s, i)
        arr.append((start, i, value))
        i = _skip(s, i)
        if s[i] == ",":
            i = _skip(s, i + 1)
        elif s[i] == "]":
            return arr, i + 1
        else:
            raise ValueError("a comma")


def _ascii_only(nb: Notebook) -> bool:
    """Whether the file escapes non-ASCII text (``\\u00e9``) rather than writing it."""
    for c in nb.cells:
        for (a, b), raw in zip(c.spans, c.raw):
            literal = nb.text[a:b]
            if any(ord(ch) > 127 for ch in raw):
                return literal.isascii()
    # No such line in the code: the rest of the file says (nbformat writes it as is).
    return nb.text.isascii() and re.search(r"\\u(?!00[0-7])[0-9a-fA-F]{4}", nb.text) is not None


def _literal(value: str, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


def patched_text(nb: Notebook, files: dict[str, tuple[str, str]]) -> str:
    """The file's text with each cell of ``files`` (cell name -> (old, new) text) edited.

    Only the string literals of changed lines change (one replaced by its new
    line; lines added or removed take or give up a literal and its separator);
    every other byte is the file's.

    Raises:
        NotebookError: a cell changed since the run, a file that is not one of
            its cells, or a cell whose strings are not one per line.
    """
    shown = os.path.basename(nb.path)
    by_name = {c.filename: c for c in nb.cells}
    ascii_only = _ascii_only(nb)
    edits: list[tuple[int, int, str]] = []
    for name, (old, new) in files.items():
        cell = by_name.get(name)
        if cell is None:
            raise NotebookError(f"the patch edits {os.path.basename(name)}, not a cell of "
                                f"{shown}; apply it by hand")
        if cell.text != old:
            raise NotebookError(f"cell In[{cell.number}] of {shown} changed since the run; "
                                "run versionwatch fix again")
        if not cell.spans:
            raise NotebookError(f"cell In[{cell.number}]'s source was not found in {shown}")
        edits.extend(_cell_edits(nb, cell, new, ascii_only))
    text = nb.text
    for a, b, replacement in sorted(edits, reverse=True):
        text = text[:a] + replacement + text[b:]
    return text


def _ending(raw: str) -> str:
    for end in ("\r\n", "\n", "\r"):
        if raw.endswith(end):
            return end
    return ""


def _cell_edits(nb: Notebook, cell: Cell, new: str, ascii_only: bool,
                ) -> list[tuple[int, int, str]]:
    """The (start, end, text) replacements of the file's text that make ``cell`` read ``new``."""
    old_lines = cell.lines()
    new_lines = _split(new)
    raw_lines = _split("".join(cell.raw))
    # The file's own line ending (a CRLF cell keeps CRLF); the last line keeps its none.
    eol = next((_ending(r) for r in raw_lines if _ending(r)), "\n")
    last_open = not _ending(raw_lines[-1]) if raw_lines else True

    def written(k: int, line: str) -> str:
        body = line.rstrip("\r\n")
        return body if (k == len(new_lines) - 1 and last_open) else body + eol

    if cell.single:
        out_lines = _merged(old_lines, raw_lines, new_lines, written)
        a, b = cell.spans[0]
        return [(a, b, _literal("".join(out_lines), ascii_only))]
    if len(cell.raw) != len(raw_lines) or any(
            r != ln for r, ln in zip(cell.raw, raw_lines)):
        raise NotebookError(f"cell In[{cell.number}] of {os.path.basename(nb.path)} does not "
                            "hold one string per line; apply the patch by hand")
    edits: list[tuple[int, int, str]] = []
    spans = cell.spans
    text = nb.text
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    # The separator between two literals, as the file writes it (",\n    "); with one
    # literal, a comma and the blank before it.
    if len(spans) > 1:
        sep = text[spans[0][1]:spans[1][0]]
    else:
        start = spans[0][0]
        while start > 0 and text[start - 1] in " \t\r\n":
            start -= 1
        sep = "," + text[start:spans[0][0]]
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        made = [_literal(written(j, new_lines[j]), ascii_only) for j in range(j1, j2)]
        shared = min(i2 - i1, j2 - j1)
        for k in range(shared):  # a line for a line: only its literal
            a, b = spans[i1 + k]
            edits.append((a, b, made[k]))
        if i2 - i1 > shared:  # lines removed: their literals and separators
            first, last = i1 + shared, i2 - 1
            if first > 0:
                edits.append((spans[first - 1][1], spans[last][1], ""))
            elif last + 1 < len(spans):
                edits.append((spans[first][0], spans[last + 1][0], ""))
            else:
                edits.append((spans[first][0], spans[last][1], ""))
        elif j2 - j1 > shared:  # lines added: after the literal before them
            extra = made[shared:]
            at = i1 + shared
            if at > 0:
                pos = spans[at - 1][1]
                edits.append((pos, pos, "".join(sep + m for m in extra)))
            else:
                pos = spans[0][0]
                edits.append((pos, pos, "".join(m + sep for m in extra)))
    return _fix_last(nb, cell, old_lines, new_lines, edits, ascii_only, eol, last_open)


def _fix_last(nb: Notebook, cell: Cell, old_lines: list[str], new_lines: list[str],
              edits: list[tuple[int, int, str]], ascii_only: bool, eol: str,
              last_open: bool) -> list[tuple[int, int, str]]:
    """The old last line, written without an ending, kept but no longer last: its
    literal gets the ending (unless an edit already rewrote or removed it)."""
    if not (last_open and cell.spans):
        return edits
    a, b = cell.spans[-1]
    if any(x <= a and b <= y for x, y, _ in edits):
        return edits
    old_last = cell.raw[-1]
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for op, i1, i2, j1, _j2 in matcher.get_opcodes():
        if op == "equal" and i1 <= len(old_lines) - 1 < i2:
            j = j1 + (len(old_lines) - 1 - i1)
            if j != len(new_lines) - 1:
                edits.append((a, b, _literal(old_last + eol, ascii_only)))
    return edits


def _merged(old_lines: list[str], raw_lines: list[str], new_lines: list[str],
            written: Any) -> list[str]:
    """The new lines as the file writes them: unchanged ones as they were."""
    out: list[str] = []
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    for op, i1, _i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            if op == "equal" and j != len(new_lines) - 1:
                raw = raw_lines[i1 + j - j1]
                out.append(raw if _ending(raw) else written(j, raw))
            elif op == "equal":
                out.append(written(j, raw_lines[i1 + j - j1]))
            else:
                out.append(written(j, new_lines[j]))
    return out
