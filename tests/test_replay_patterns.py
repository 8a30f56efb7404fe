"""``versionwatch run --replay`` reproduces every failing program of ``docs/patterns.md``.

The page's programs are cut out of it as ``tests/test_docs.py`` reads the page
(:func:`test_docs.blocks`): the shared imports, then each ```python block whose
```text block shows a report. A page's program watches itself (``with
versionwatch.watch(...)``, ``versionwatch.check(loss)``, ``try ... except
versionwatch.InplaceModificationError``); here it is the program as a user
writes it, which ``versionwatch run`` watches: those lines are taken out (the
``with`` and ``try`` keep their bodies, ``print(versionwatch.check(loss))``
becomes ``loss.backward()``), with :mod:`ast`, so that the failure is the
program's own. Each one then runs under ``versionwatch run --replay``: default
mode's report, then the strict replay's, which must meet the same hazard at the
same backward. A freed graph is not replayed (default mode names the freeing
backward itself), and the report says why it failed.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os

import pytest

from test_docs import ROOT, blocks
from versionwatch._cli.command import main

PAGE = ROOT / "docs" / "patterns.md"
FAILS = ("versionwatch: backward will fail", "versionwatch: backward will compute wrong")


def _versionwatch(node: ast.expr) -> bool:
    """``versionwatch.X``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "versionwatch"


class _Plain(ast.NodeTransformer):
    """The program without its own watching: what ``versionwatch run`` is for."""

    def visit_With(self, node: ast.With) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        items = [i for i in node.items
                 if not (isinstance(i.context_expr, ast.Call) and _versionwatch(i.context_expr.func))]
        if items:
            node.items = items
            return node
        return node.body

    def visit_Try(self, node: ast.Try) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        if node.handlers and all(h.type is not None and _versionwatch(h.type)
                                 for h in node.handlers):
            return node.body
        return node

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                and call.func.id == "print" and call.args:
            arg = call.args[0]
            while isinstance(arg, ast.Attribute):  # print(versionwatch.check(x).ok)
                arg = arg.value
            if isinstance(arg, ast.Call) and _versionwatch(arg.func) and arg.func.attr == "check":
                backward = ast.Attribute(arg.args[0], "backward", ast.Load())
                return ast.Expr(ast.Call(backward, [], []))
        return node


def programs() -> list[tuple[str, str]]:
    """(the page's line of the block, the program) for each block that shows a failure."""
    found = blocks(PAGE.read_text())
    imports = found[0].code
    out = []
    for i, block in enumerate(found):
        after = found[i + 1] if i + 1 < len(found) else None
        if block.lang != "python" or after is None or after.lang != "text" \
                or not any(text.startswith(FAILS) for text in after.code.splitlines()):
            continue
        if "strict=True" in block.code:
            # Silent hazards that only strict mode sees (a write inside checkpointing,
            # a broadcast under _unsafe_preserve_version_counter): default mode, which
            # --replay starts from, has nothing to replay.
            continue
        tree = ast.fix_missing_locations(_Plain().visit(ast.parse(imports + block.code)))
        out.append((f"line{block.line}", ast.unparse(tree) + "\n"))
    return out


PROGRAMS = programs()


def test_the_page_has_the_programs_it_should():
    # GAN, actor-critic, ReLU after sigmoid, +=, index assignment, EMA, clipping, DDP's
    # broadcast, an optimizer in backward, recurrent state, a fused optimizer.
    assert len(PROGRAMS) == 11


@pytest.mark.parametrize("src", [p[1] for p in PROGRAMS], ids=[p[0] for p in PROGRAMS])
def test_replay_reproduces_each_pattern(src, tmp_path, monkeypatch):
    (tmp_path / "prog.py").write_text(src)
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["run", "--replay", "--json", "out.json", "prog.py"])
    said = err.getvalue()
    doc = json.loads((tmp_path / "out.json").read_text())
    assert status == 1 and doc["hazards"], said
    h = doc["hazards"][0]
    assert "not reproduced" not in said, said
    if h["kind"] == "freed":
        assert h["replay"] is None and h["freed_by"] is not None
        assert "running the same command again" not in said
        return
    assert h["replay"] == ("the lines above come from a strict replay of the same command, "
                           f"which met the same hazard at backward #{h['backward']}"), said
    # The replay's lines: the op that saved the tensor, in the program.
    assert h["saved_at"] is not None and h["saved_at"]["file"] == "prog.py"
    assert os.path.exists(h["saved_at"]["file"])
