"""``versionwatch run nb.ipynb`` and ``versionwatch fix [--apply] nb.ipynb``: a notebook file's
code cells run in order as one program, each named as IPython names it (``Cell In[3],
line 9``), and ``--apply`` edits the cell's ``source`` strings in the file's own text.

No kernel: the notebooks are nbformat 4 JSON written here by hand, in the layouts that
matter to the byte-for-byte edit (nbformat's ``indent=1, ensure_ascii=False``, another
indentation with ``ensure_ascii=True``, CRLF source lines, a single-string source).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from versionwatch._cli.command import main as cli_main
from versionwatch._fix.command import main as fix_main
from versionwatch._fix.notebook import NotebookError, patched_text, read_notebook
from versionwatch._fix.server import ForkServer

SRC = Path(__import__("versionwatch").__file__).resolve().parent.parent
SETUP = ["import torch\n", "from torch import nn\n", "%matplotlib inline\n",
         "%load_ext versionwatch\n", "torch.manual_seed(0)"]
MODEL = ["# the seed story: two losses from shared weights\n",
         "class Model(nn.Module):\n",
         "    def __init__(self):\n",
         "        super().__init__()\n",
         "        self.w1 = nn.Parameter(torch.tensor([2.0]))\n",
         "        self.w2 = nn.Parameter(torch.tensor([3.0]))\n",
         "        self.w3 = nn.Parameter(torch.tensor([4.0]))\n",
         "    def forward(self, a):\n",
         "        s = a * self.w1\n",
         "        return s * self.w2, s * self.w3\n",
         "model = Model()\n",
         "optim = torch.optim.SGD(model.parameters(), lr=0.1)\n",
         "mse = nn.MSELoss()\n",
         "x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])"]
LOOP = ["for _ in range(3):  # entraîne, δ\n",
        "    y1_pred, y2_pred = model(x)\n",
        "    optim.zero_grad(set_to_none=False)\n",
        "    loss1 = mse(y1_pred, y1)\n",
        "    loss1.backward(retain_graph=True)\n",
        "    optim.step()\n",
        "    optim.zero_grad(set_to_none=False)\n",
        "    loss2 = mse(y2_pred, y2)\n",
        "    loss2.backward()\n",
        "    optim.step()"]


def notebook(cells: list[list[str] | str], *, kinds: list[str] | None = None,
             indent: int = 1, ensure_ascii: bool = False, eol: str = "\n") -> str:
    """An nbformat 4 notebook's text: a markdown cell, then ``cells`` (code unless
    ``kinds`` says), each source line ended by ``eol``."""
    def source(lines: list[str] | str) -> list[str] | str:
        if isinstance(lines, str):
            return lines
        return [ln[:-1] + eol if ln.endswith("\n") else ln for ln in lines]

    kinds = kinds or ["code"] * len(cells)
    body = [{"cell_type": "markdown", "metadata": {}, "source": ["# The seed story"]}]
    for kind, lines in zip(kinds, cells):
        cell = {"cell_type": kind, "metadata": {}, "source": source(lines)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        body.append(cell)
    nb = {"cells": body, "metadata": {"kernelspec": {"name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=indent, ensure_ascii=ensure_ascii) + "\n"


def vw(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # This checkout's package, whatever the working directory (PYTHONPATH=src is relative).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    return subprocess.run([sys.executable, "-m", "versionwatch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


# -- run ------------------------------------------------------------------------------

def test_run_names_the_cells_and_json_has_them(tmp_path: Path) -> None:
    (tmp_path / "seed.ipynb").write_text(notebook([SETUP, MODEL, LOOP]), encoding="utf-8")
    done = vw("run", "--strict", "--json", "r.json", "seed.ipynb", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    err = done.stderr
    # The step of cell 3's line 6 changed what cell 2's line 10 saved; backward at line 9.
    assert "modified by  optim.step() #3 at Cell In[3], line 6: optim.step()" in err
    assert "backward at  Cell In[3], line 9" in err
    assert ("saved by     MulBackward0.other at Cell In[2], line 10: "
            "return s * self.w2, s * self.w3") in err
    assert 'File "' in err and "seed.ipynb#In[3]\", line 9" in err  # Python's own traceback
    assert "NameError" not in err
    # One line for the magic, none for %load_ext versionwatch (the run is watched).
    assert "versionwatch: skipped In[1], line 3: %matplotlib inline (an IPython magic)" in err
    assert "load_ext" not in err
    doc = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    saved = doc["hazards"][0]["saved_at"]
    assert (saved["cell"], saved["line"], saved["file"]) == (2, 10, "seed.ipynb#In[2]")


def test_cell_magic_cell_is_skipped_with_one_line(tmp_path: Path) -> None:
    """A ``%%`` cell is skipped (its code never runs); ``%%versionwatch`` runs its body;
    markdown, raw and empty code cells are no cells; numbers are a fresh "Run all"'s."""
    cells: list[list[str] | str] = [
        ["x = 1\n", "!pip list\n", "if x:\n", "    %time y = 2\n", "    z = 3"],
        ["%%bash\n", "echo hi\n", "raise SystemExit(7)"],
        "   \n",
        ["print('raw')"],
        ["%%versionwatch --strict\n", "print('watched', x, z)"],
        ["w = 1\n", "def (:"],
    ]
    text = notebook(cells, kinds=["code", "code", "code", "raw", "code", "code"])
    (tmp_path / "nb.ipynb").write_text(text, encoding="utf-8")
    done = vw("run", "nb.ipynb", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == "watched 1 3\n"
    lines = done.stderr.splitlines()
    assert lines[:3] == [
        "versionwatch: skipped In[1], line 2: !pip list (a shell command)",
        "versionwatch: skipped In[1], line 4: %time y = 2 (an IPython magic)",
        "versionwatch: skipped cell In[2]: %%bash is an IPython cell magic",
    ]
    # The empty cell has no number: the %%versionwatch cell is In[3]. Each cell is
    # compiled as it comes, as "Run all" runs it: In[4]'s syntax error after In[3] ran.
    assert "nb.ipynb#In[4]\", line 2" in done.stderr
    assert "SyntaxError" in done.stderr


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "nb.ipynb is not a notebook: not valid JSON"),
    ('{"nbformat": 4, "cells": []}', "nb.ipynb is not a notebook with cells"),
    ('{"nbformat": 3, "worksheets": []}', "nb.ipynb: nbformat 3 is not supported"),
    ('[1, 2]', "nb.ipynb is not a notebook: its JSON is not an object"),
    (notebook([["# text"]], kinds=["markdown"]), "nb.ipynb has no code cells to run"),
])
@pytest.mark.parametrize("command", ["run", "fix"])
def test_bad_notebook_is_one_line_and_status_2(tmp_path: Path, text: str, why: str,
                                               command: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "nb.ipynb").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    # In this process: refused before anything runs.
    code = cli_main([command, "nb.ipynb"])
    out = capsys.readouterr().err
    assert code == 2
    assert len(out.splitlines()) == 1, out
    assert out.startswith(f"versionwatch {command}: error: {why}"), out
    assert "Traceback" not in out


# -- fix --apply ------------------------------------------------------------------------

def test_fix_apply_edits_only_the_cells_strings(tmp_path: Path, server: ForkServer,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """CRLF source lines and non-ASCII text written as is (nbformat's ensure_ascii=False):
    the patch removes two lines' literals, every other byte of the file is kept, and
    the patched notebook runs clean."""
    text = notebook([SETUP, MODEL, LOOP], eol="\r\n")
    path = tmp_path / "seed.ipynb"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.chdir(tmp_path)
    code = fix_main(["--apply", "--check-steps", "1", "seed.ipynb"], server=server)
    out = capsys.readouterr()
    assert code == 0, out.err + out.out
    assert "--- a/seed.ipynb#In[3]" in out.out
    assert "applied the first verified patch to seed.ipynb#In[3]" in out.out
    after = path.read_bytes().decode("utf-8")
    assert _changed(text, after) == ['-"    optim.step()\\r\\n",',
                                     '-"    optim.zero_grad(set_to_none=False)\\r\\n",']
    assert "entraîne, δ" in after  # not escaped
    done = vw("run", "seed.ipynb", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "backward(s) watched, no hazard" in done.stderr


# -- the edit alone ---------------------------------------------------------------------

def _edit(tmp_path: Path, text: str, cell: int, new: str) -> tuple[str, str]:
    path = tmp_path / "nb.ipynb"
    path.write_bytes(text.encode("utf-8"))
    nb = read_notebook(str(path))
    (c,) = [c for c in nb.cells if c.number == cell]
    return text, patched_text(nb, {c.filename: (c.text, new)})


def _changed(before: str, after: str) -> list[str]:
    """The lines of the file the edit changed, ``-`` or ``+`` and the line unindented."""
    return [ln[0] + ln[2:].strip() for ln in difflib.ndiff(before.splitlines(True),
                                                           after.splitlines(True))
            if ln[:1] in "+-"]


def test_a_replaced_line_is_escaped_as_the_file_escapes(tmp_path: Path) -> None:
    """ensure_ascii=True, indent=2: the new literal escapes non-ASCII as the file does."""
    text = notebook([["a = 1\n", "s = 'é'\n", "b = 2"]], indent=2, ensure_ascii=True)
    before, after = _edit(tmp_path, text, 1, "a = 1\ns = 'δé'\nb = 2\n")
    assert _changed(before, after) == ['-"s = \'\\u00e9\'\\n",',
                                       '+"s = \'\\u03b4\\u00e9\'\\n",']
    assert json.loads(after)["cells"][1]["source"] == ["a = 1\n", "s = 'δé'\n", "b = 2"]


def test_lines_added_and_removed_keep_the_layout(tmp_path: Path) -> None:
    text = notebook([["a = 1\n", "%time b = 2\n", "c = 3"]])
    # The magic (run as `pass`) is kept as written; a line after the last gets its end.
    before, after = _edit(tmp_path, text, 1, "a = 1\npass\nc = 3\nd = 4\n")
    assert json.loads(after)["cells"][1]["source"] == ["a = 1\n", "%time b = 2\n",
                                                        "c = 3\n", "d = 4"]
    assert _changed(before, after) == ['-"c = 3"', '+"c = 3\\n",', '+"d = 4"']
    # As json.dumps writes the new source, byte for byte, in both layouts.
    assert after == notebook([["a = 1\n", "%time b = 2\n", "c = 3\n", "d = 4"]])
    for indent in (1, 2):
        _, grown = _edit(tmp_path, notebook([["a = 1"]], indent=indent), 1, "b = 0\na = 1\nc = 2\n")
        assert grown == notebook([["b = 0\n", "a = 1\n", "c = 2"]], indent=indent)
    before, after = _edit(tmp_path, text, 1, "pass\nc = 3\n")
    assert json.loads(after)["cells"][1]["source"] == ["%time b = 2\n", "c = 3"]
    assert _changed(before, after) == ['-"a = 1\\n",']


def test_a_single_string_source_is_one_literal(tmp_path: Path) -> None:
    text = notebook(["x = 1\r\ny = 2\r\n"])
    before, after = _edit(tmp_path, text, 1, "x = 1\ny = x + 1\n")
    assert json.loads(after)["cells"][1]["source"] == "x = 1\r\ny = x + 1\r\n"
    assert _changed(before, after) == ['-"source": "x = 1\\r\\ny = 2\\r\\n",',
                                       '+"source": "x = 1\\r\\ny = x + 1\\r\\n",']


def test_magics_only_where_a_statement_starts(tmp_path: Path) -> None:
    """A line that starts with `%` inside brackets or a string is Python's, kept."""
    path = tmp_path / "nb.ipynb"
    code = ['x = (7\n', '     % 4)\n', 's = """\n', '%not a magic\n', '"""\n', '%time y = 1']
    path.write_text(notebook([code]), encoding="utf-8")
    nb = read_notebook(str(path))
    assert nb.cells[0].text == 'x = (7\n     % 4)\ns = """\n%not a magic\n"""\npass\n'
    assert nb.notes == ["versionwatch: skipped In[1], line 6: %time y = 1 (an IPython magic)"]


def test_a_cell_is_found_by_any_spelling_of_its_name(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A report read back from JSON (``--replay``'s strict run) names a cell relative to
    the working directory: it still reads ``Cell In[2], line 1``."""
    from versionwatch._report import CELL_LOOKUPS, Site
    from versionwatch._report.model import CELLS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "nb.ipynb").write_text(notebook([["a = 1"], ["b = 2"]]), encoding="utf-8")
    nb = read_notebook("nb.ipynb")
    lookups, cells = list(CELL_LOOKUPS), dict(CELLS)
    try:
        nb.register()
        assert str(Site("nb.ipynb#In[2]", 1)).startswith("Cell In[2], line 1")
        assert str(Site(str(tmp_path / "nb.ipynb#In[1]"), 1)).startswith("Cell In[1], line 1")
        assert str(Site("other.py", 1)).startswith("other.py:1")
    finally:
        CELL_LOOKUPS[:] = lookups
        CELLS.clear()
        CELLS.update(cells)


def test_a_cell_changed_since_the_run_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nb.ipynb"
    path.write_text(notebook([["a = 1\n", "b = 2"]]), encoding="utf-8")
    nb = read_notebook(str(path))
    with pytest.raises(NotebookError, match=r"cell In\[1\] of nb.ipynb changed since the run"):
        patched_text(nb, {nb.cells[0].filename: ("a = 0\nb = 2\n", "a = 1\n")})


def test_apply_keeps_the_guarantees_of_a_script(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``--apply`` writes a notebook as it writes a script: a read-only one refused
    without --force (and still read-only after it), every hard link of it patched."""
    import stat

    from versionwatch._candidates.shared import Candidate
    from versionwatch._fix.command import apply_to_notebook

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "nb.ipynb"
    path.write_text(notebook([["a = 1\n", "b = 2"]]), encoding="utf-8")
    os.link(path, tmp_path / "other.ipynb")
    before = path.read_bytes()
    nb = read_notebook("nb.ipynb")
    cell = nb.cells[0]
    patch = Candidate("out_of_place", "", {cell.filename: (cell.text, "a = 1\nb = 3\n")})
    path.chmod(stat.S_IRUSR)
    notes: list[str] = []
    assert apply_to_notebook(nb, patch, False, notes) == \
        "nb.ipynb is read-only; --force writes it anyway"
    assert path.read_bytes() == before
    assert apply_to_notebook(nb, patch, True, notes) is None
    want = before.replace(b'"b = 2"', b'"b = 3"')
    assert path.read_bytes() == want == (tmp_path / "other.ipynb").read_bytes()
    assert not path.stat().st_mode & stat.S_IWUSR
    assert any("hard links" in n for n in notes)
    # Now that the file holds the patch, the same patch is refused: the cell changed.
    assert "changed since the run" in (apply_to_notebook(nb, patch, True, []) or "")
