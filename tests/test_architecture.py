"""The package's shape: no import cycle, and no module below ``_watch`` imports it.

Read from the source with ``ast``, so that a lazy import inside a function counts
too; an import under ``if TYPE_CHECKING:`` does not (it never runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "versionwatch"

# The modules above the watcher: they make or drive watchers.
ABOVE_WATCH = {"versionwatch", "versionwatch._watch.auto", "versionwatch._cli.main",
               "versionwatch.integrations.pytest_plugin", "versionwatch.integrations.lightning"}


def _name(path: Path) -> str:
    parts = ["versionwatch", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports at run time."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
               for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from versionwatch import _strict`` imports the module, not the package's
            # own names; ``from versionwatch import watch`` imports the package.
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs if subs and node.module == "versionwatch" else {node.module, *subs}
    return {m for m in found if m in modules} - {_name(path)}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_name(p) for p in paths}
    return {_name(p): _imports(p, modules) for p in paths}


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components: each module is its own."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_no_lower_module_imports_watch() -> None:
    importers = {m for m, deps in _graph().items() if "versionwatch._watch.watcher" in deps}
    assert importers <= ABOVE_WATCH, sorted(importers - ABOVE_WATCH)
