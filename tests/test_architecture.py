"""The package's shape, read from the source with ``ast``.

Every import counts: at module level, inside a function, and under
``if TYPE_CHECKING:`` (a type-only import still ties two modules together).

The layers, lowest first (docs/architecture.md draws them):

- ``_report/``: the report as data and every rendering; imports nothing else of ours;
- the shared leaves at the top (``_runtime``, ``_compat``, ``_sites``, ``_ledger``, ...);
- ``_strict/``, then ``_predict/``, then ``_native/``, ``_repair/`` and ``_candidates/``;
- ``_watch/``, then ``_fix/``, then ``_cli/`` and ``integrations/``;
- the package itself (``versionwatch``, ``__main__``).

A module imports its own folder, the shared leaves and lower layers only; another
folder only through its ``__init__``, and no ``_name`` from there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "versionwatch"

LEAVES = "<leaves>"
# Each folder's layer; modules at the top of the package are the shared leaves.
LAYER = {
    "_report": 0, LEAVES: 1, "_strict": 2, "_predict": 3,
    "_native": 4, "_repair": 4, "_candidates": 4,
    "_watch": 5, "_fix": 6, "_cli": 7, "integrations": 7, "versionwatch": 8,
}
TOP_ONLY = {"versionwatch.__main__"}  # the package's own entry points sit with it
# The bundled demo plays the user's part (its lines are blamed as the user's), so it
# uses the public API as a user's script does: ``import versionwatch``.
USER_CODE = {"versionwatch._cli.demo"}


def _name(path: Path) -> str:
    parts = ["versionwatch", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PATHS = sorted(PACKAGE.rglob("*.py"))
MODULES = {_name(p): p for p in PATHS}
FOLDERS = {_name(p) for p in PATHS if p.name == "__init__.py"} - {"versionwatch"}


def _folder(module: str) -> str:
    """The folder that owns ``module``: a subpackage's name, the leaves, or the package."""
    if module == "versionwatch" or module in TOP_ONLY:
        return "versionwatch"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or module in FOLDERS else LEAVES


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for each import of ours."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names
                      if a.name.split(".")[0] == "versionwatch"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "versionwatch":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                # ``from versionwatch._x import mod`` imports the module ``mod``.
                found.append((sub, None, node.lineno) if sub in MODULES
                             else (node.module, a.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        # The module named, not the packages above it: Python imports a folder's
        # __init__ first, but a module of that folder importing a sibling while the
        # __init__ runs is no cycle.
        deps = {target for target, _, _ in _imports(p)}
        graph[m] = {d for d in deps if d in MODULES and d != m}
    return graph


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components, every kind of import counted: each
    module is its own."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
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

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, cycles


def _violations() -> list[str]:
    bad = []
    for m, p in MODULES.items():
        mine = _folder(m)
        for target, name, line in _imports(p):
            if target == "versionwatch" and mine != "versionwatch":
                if m not in USER_CODE:
                    bad.append(f"{m}:{line} imports the package itself")
                continue
            theirs = _folder(target)
            where = f"{m}:{line} ({mine}) -> {target}{'.' + name if name else ''} ({theirs})"
            if theirs == mine:
                continue
            if LAYER[theirs] > LAYER[mine] or (LAYER[theirs] == LAYER[mine] and theirs != LEAVES):
                bad.append(f"{where}: not a lower layer")
            elif theirs != LEAVES and target != f"versionwatch.{theirs}":
                bad.append(f"{where}: another folder, not through its __init__")
            elif theirs != LEAVES and name is not None and name.startswith("_"):
                bad.append(f"{where}: a private name crosses a folder")
    return bad


def test_layers_and_folders() -> None:
    """Each import goes to its own folder, a shared leaf or a lower layer; another
    folder only through its ``__init__``, with no ``_name``."""
    assert not _violations(), "\n".join(_violations())


def test_report_is_a_leaf() -> None:
    """Rendering depends on the report, never the other way round: ``_report/``
    imports nothing else of the package."""
    outside = {f"{m} -> {t}" for m, p in MODULES.items() if _folder(m) == "_report"
               for t, _, _ in _imports(p) if _folder(t) != "_report"}
    assert not outside, sorted(outside)


def test_few_modules_at_the_top_and_folders_say_what_they_own() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 15, top
    for folder in sorted(FOLDERS):
        doc = ast.get_docstring(ast.parse(MODULES[folder].read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 8, f"{folder}/__init__.py says nothing of what it owns"
    assert set(LAYER) - {LEAVES, "versionwatch"} == {f.split(".")[1] for f in FOLDERS}


def test_annotations_are_never_evaluated() -> None:
    """Python 3.9 is supported: ``X | None`` in an annotation runs only as a string, so
    every module that annotates anything says ``from __future__ import annotations``."""
    missing = []
    for p in PATHS:
        tree = ast.parse(p.read_text(encoding="utf-8"))
        annotated = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.AnnAssign))
                        for n in ast.walk(tree))
        future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                     and any(a.name == "annotations" for a in n.names) for n in tree.body)
        if annotated and not future:
            missing.append(str(p.relative_to(PACKAGE)))
    assert not missing, missing


def test_no_stubbed_host_methods() -> None:
    """Parts are objects a host holds, not mixins that stub its methods."""
    stubs = [f"{p.relative_to(PACKAGE)}:{node.lineno}" for p in PATHS
             for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
             if isinstance(node, ast.Raise) and node.exc is not None
             and "NotImplementedError" in ast.unparse(node.exc)]
    assert not stubs, stubs


def test_no_event_text_parsed_back() -> None:
    """Event identity travels as fields; text is only ever written, never split apart."""
    parse = re.compile(r"""\.(r?split|r?partition|removesuffix|removeprefix)\(\s*f?["'] (at|on thread)""")
    found = [f"{p.relative_to(PACKAGE)}:{k}" for p in PATHS
             for k, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if parse.search(line) or re.search(r"""\[len\(["']end of ["']\):\]""", line)]
    assert not found, found


def test_one_child_process_runner() -> None:
    """Children are started, tied to us and killed in one module."""
    for what in ("subprocess.Popen(", "os.killpg("):
        users = sorted(str(p.relative_to(PACKAGE)) for p in PATHS
                       if what in p.read_text(encoding="utf-8"))
        assert users == ["_process.py"], (what, users)


def _annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs,
              *(a for a in (args.vararg, args.kwarg) if a is not None)]
    return [a.annotation for a in params if a.annotation is not None] + (
        [fn.returns] if fn.returns is not None else [])


def test_any_is_rare() -> None:
    """At most 12% of functions take or return ``Any``."""
    functions = [n for p in PATHS for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    with_any = [f for f in functions
                if any(re.search(r"\bAny\b", ast.unparse(a)) for a in _annotations(f))]
    assert len(with_any) <= 0.12 * len(functions), (len(with_any), len(functions))


@pytest.mark.parametrize("rule", ["layers", "cycle"])
def test_the_rules_catch_what_they_forbid(tmp_path: Path, rule: str) -> None:
    """The checks above fail on a tree that breaks them (a check that cannot fail
    proves nothing)."""
    global PACKAGE, PATHS, MODULES, FOLDERS
    saved = PACKAGE, PATHS, MODULES, FOLDERS
    pkg = tmp_path / "versionwatch"
    for folder in ("_report", "_watch"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""owns things."""\n')
    (pkg / "__init__.py").write_text("")
    if rule == "layers":
        (pkg / "_report" / "model.py").write_text("from versionwatch._watch import w\n")
    else:
        (pkg / "_watch" / "a.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from versionwatch._watch.b import B\n")
        (pkg / "_watch" / "b.py").write_text("def f():\n    from versionwatch._watch import a\n")
    try:
        PACKAGE = pkg
        PATHS = sorted(pkg.rglob("*.py"))
        MODULES = {_name(p): p for p in PATHS}
        FOLDERS = {_name(p) for p in PATHS if p.name == "__init__.py"} - {"versionwatch"}
        if rule == "layers":
            assert any("not a lower layer" in v for v in _violations())
        else:
            with pytest.raises(AssertionError, match=r"_watch\.a"):
                test_no_import_cycle()
    finally:
        PACKAGE, PATHS, MODULES, FOLDERS = saved
