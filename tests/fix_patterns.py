"""The error patterns of docs/patterns.md as plain programs, for ``versionwatch fix``'s tests.

The page's ```python blocks are read as tests/test_docs.py reads them (its
``blocks()``), grouped by their ``##`` section; the blocks before the first
section (the imports) open every program. A pattern's program is those blocks
and the section's blocks that :data:`PATTERNS` names, made plain: no
versionwatch in it at all. ``with versionwatch.watch(...) as w:`` runs its body
bare, ``try: ... except versionwatch.SomeError`` runs its body bare, a
``versionwatch.check(loss, ...)`` or ``assert_backward_safe(loss, ...)`` becomes
``loss.backward()`` (what it predicted), and any other statement that uses
versionwatch, the watcher or the caught error goes. The program then fails as
PyTorch fails it, which the tests check before they fix it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_docs import blocks

PAGE = Path(__file__).resolve().parent.parent / "docs" / "patterns.md"

# Section title -> the indices of its ```python blocks that make the program; the
# last one fails.
PATTERNS = {
    "GAN: alternating updates with `retain_graph=True`": (0,),
    "Actor-critic: the critic steps before the actor's backward": (0,),
    "`nn.ReLU(inplace=True)` after sigmoid or tanh": (0,),
    "`+=` on a saved output": (0,),
    "Index assignment": (0,),
    "EMA and weight clipping between forward and backward": (0,),
    "EMA and weight clipping between forward and backward / clipping": (1,),
    "DDP buffer broadcast": (0,),
    "Spectral norm": (0, 1),
    "Optimizer in backward: steps inside hooks": (0,),
    "Recurrent state carried across iterations": (0,),
}
# Sections with no error to fix, and why (every section is in one table or the other).
NO_ERROR = {
    "Fused optimizers: silent, no version bump": "PyTorch raises nothing: the gradients are "
    "silently wrong, which a watcher reports and no plain run can show (tests/test_fix.py's "
    "fused program checks its patch)",
    "A hook that edits a gradient in place": "PyTorch raises nothing: the gradients are "
    "silently wrong (tests/test_silent_gradients.py compares them with the out-of-place hook's)",
    "In-place writes inside activation checkpointing": "PyTorch raises nothing under "
    "checkpoint(use_reentrant=False): the gradients are silently wrong "
    "(tests/test_silent_checkpoint.py compares them with the out-of-place program's)",
}
_SUFFIX = re.compile(r" / \w+$")


def sections() -> tuple[list[str], dict[str, list[str]]]:
    """The preamble's code, and each section's ```python blocks' code, by title."""
    preamble: list[str] = []
    found: dict[str, list[str]] = {}
    title = None
    for b in blocks(PAGE.read_text(encoding="utf-8")):
        for line in b.after.splitlines():
            if line.startswith("## "):
                title = line[3:].strip()
                found.setdefault(title, [])
        if b.lang != "python" or b.title:
            continue
        (found[title] if title is not None else preamble).append(b.code)
    return preamble, found


def program(name: str) -> str:
    """The plain program of pattern ``name`` (a key of :data:`PATTERNS`)."""
    preamble, found = sections()
    codes = found[_SUFFIX.sub("", name)]
    return plain("\n".join([*preamble, *(codes[i] for i in PATTERNS[name])]))


def plain(code: str) -> str:
    """``code`` without versionwatch: see the module's docstring."""
    tree = _Plain().visit(ast.parse(code))
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


_PREDICTS = ("check", "assert_backward_safe")


class _Plain(ast.NodeTransformer):
    def __init__(self) -> None:
        self.names = {"versionwatch"}  # and the watchers' and caught errors' names

    def mentions(self, node: ast.AST | None) -> bool:
        return node is not None and any(
            isinstance(n, ast.Name) and n.id in self.names for n in ast.walk(node))

    def body(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for s in stmts:
            got = self.visit(s)
            if got is None:
                continue
            out.extend(got if isinstance(got, list) else [got])
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = self.body(stmts)
                setattr(node, field, kept or ([ast.Pass()] if field == "body" else []))
        return node

    def visit_Import(self, node: ast.Import) -> ast.AST | None:
        node.names = [a for a in node.names if not a.name.startswith("versionwatch")]
        return node if node.names else None

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | None:
        return None if (node.module or "").startswith("versionwatch") else node

    def visit_With(self, node: ast.With) -> ast.AST | list[ast.stmt]:
        kept = []
        for item in node.items:
            if self.mentions(item.context_expr):
                if isinstance(item.optional_vars, ast.Name):
                    self.names.add(item.optional_vars.id)
            else:
                kept.append(item)
        if not kept:
            return self.body(node.body)
        node.items = kept
        return self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> ast.AST | list[ast.stmt]:
        if node.handlers and all(self.mentions(h.type) for h in node.handlers):
            for h in node.handlers:
                if h.name:
                    self.names.add(h.name)
            return self.body(node.body) + self.body(node.finalbody)
        return self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return self.generic_visit(node)

    def visit_stmt(self, node: ast.stmt) -> ast.AST | None:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            f = call.func
            if (isinstance(f, ast.Attribute) and f.attr in _PREDICTS
                    and isinstance(f.value, ast.Name) and f.value.id == "versionwatch"
                    and call.args):
                loss = call.args[0]
                return ast.Expr(ast.Call(ast.Attribute(loss, "backward", ast.Load()), [], []))
        return None if self.mentions(node) else self.generic_visit(node)

    def visit(self, node: ast.AST) -> ast.AST | list[ast.stmt] | None:
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is not None:
            return method(node)  # type: ignore[no-any-return]
        if isinstance(node, ast.stmt):
            return self.visit_stmt(node)
        return self.generic_visit(node)
