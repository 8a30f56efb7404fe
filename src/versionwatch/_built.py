"""Where the user built a module: its constructor call, found in the user's source.

A write inside a library module's ``forward`` (``nn.Dropout(0.5, inplace=True)``)
is fixed where that module was built. Nothing records constructions as they
happen (that would cost every ``nn.Module.__init__`` of the program, and a
module built before the watcher opened would still be unknown); instead, once
a report needs it, the module's qualified name is followed through the source
that built each level, with :mod:`ast`:

- the root (``clf``): the last assignment ``clf = ...`` in the files of the
  user's frames at the write (the script that calls the model, usually the one
  that builds it);
- a child of an ``nn.Sequential(a, b, c)``, ``nn.ModuleList([...])`` (a list
  comprehension's element counts for every index) or ``nn.ModuleDict({...})``:
  that argument of the parent's constructor call;
- a child of a user's class (``head.act``): ``self.act = ...`` in the class's
  own methods (its ``__init__``, or a helper it calls), in the file its
  methods' code comes from;
- a variable in any of these places (``act = nn.ReLU(inplace=True)`` then
  ``nn.Sequential(lin, act)``): its last assignment above the use, in the same file.

Limits: a module built by a function of the user's (``build_mlp()``), by a
library (a ``TransformerEncoderLayer``'s own dropout), from a config, or under
a name that is not a variable (``watch({"G": gen})``) has no constructor call
to follow: its site is ``None`` and the report says only which module it is.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable, Sequence

from torch import nn

from versionwatch._report import Site
from versionwatch._sites import is_library, site_at

# (filename, its source) -> the parsed source (None if it does not parse): by the
# text too, since a name (a notebook cell's, ``<string>``) may hold another source later.
_TREES: dict[tuple[str, str], ast.Module | None] = {}
_CONTAINERS = {"Sequential": nn.Sequential, "ModuleList": nn.ModuleList,
               "ModuleDict": nn.ModuleDict}


def _tree(filename: str) -> ast.Module | None:
    key = (filename, "".join(linecache.getlines(filename)))
    if key not in _TREES:
        if len(_TREES) > 64:
            _TREES.clear()
        try:
            _TREES[key] = ast.parse(key[1]) if key[1] else None
        except (SyntaxError, ValueError):
            _TREES[key] = None
    return _TREES[key]


def _called(node: ast.expr) -> str:
    """The last name of what a call calls: ``nn.Sequential(...)`` -> ``Sequential``."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
    return ""


def assignment(scope: ast.AST, target: str,
               before: int | None = None) -> tuple[ast.stmt, ast.expr] | None:
    """The last ``target = value`` in ``scope`` (above line ``before``): the statement
    and the value.

    ``target`` is a variable (``clf``) or an attribute of ``self`` (``self.act``);
    a tuple assignment (``self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)``)
    gives its element.
    """
    found: tuple[ast.stmt, ast.expr] | None = None
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if before is not None and node.lineno >= before:
            continue
        for t in targets:
            hit = _match(t, value, target)
            if hit is not None and (found is None or node.lineno >= found[0].lineno):
                found = (node, hit)
    return found


def _assigned(scope: ast.AST, target: str, before: int | None = None) -> ast.expr | None:
    found = assignment(scope, target, before)
    return found[1] if found is not None else None


def parsed(filename: str) -> ast.Module | None:
    """The parsed source of ``filename`` (cached; ``None`` if it cannot be read or parsed)."""
    return _tree(filename)


def _match(target: ast.expr, value: ast.expr, name: str) -> ast.expr | None:
    if ast.unparse(target) == name:
        return value
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            hit = _match(t, v, name)
            if hit is not None:
                return hit
    return None


def _follow(node: ast.expr | None, tree: ast.AST) -> ast.expr | None:
    """A constructor call: ``node`` itself, or the value of the variable it names."""
    for _ in range(8):  # a = b; b = nn.ReLU(): a few hops at most
        if not isinstance(node, ast.Name):
            return node
        node = _assigned(tree, node.id, before=node.lineno)
    return node


def _child(parent: nn.Module, call: ast.expr, attr: str, tree: ast.AST) -> ast.expr | None:
    """The argument of a container's constructor ``call`` that built its child ``attr``."""
    kind = _CONTAINERS.get(_called(call))
    if kind is None or type(parent) is not kind or not isinstance(call, ast.Call) \
            or call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    if kind is nn.Sequential:
        if attr.isdigit() and int(attr) < len(call.args):
            return _follow(call.args[int(attr)], tree)
        return None
    if len(call.args) != 1:
        return None
    arg = _follow(call.args[0], tree)
    if isinstance(arg, (ast.ListComp, ast.GeneratorExp)):
        return _follow(arg.elt, tree)  # every index is built by the one element
    if kind is nn.ModuleList and isinstance(arg, (ast.List, ast.Tuple)) and attr.isdigit() \
            and int(attr) < len(arg.elts) and not any(isinstance(e, ast.Starred)
                                                      for e in arg.elts):
        return _follow(arg.elts[int(attr)], tree)
    if kind is nn.ModuleDict and isinstance(arg, ast.Dict):
        for k, v in zip(arg.keys, arg.values):
            if isinstance(k, ast.Constant) and k.value == attr:
                return _follow(v, tree)
    return None


def _class_node(klass: type) -> tuple[str, ast.ClassDef] | None:
    """The ``class`` statement of a user's class, found through its methods' code.

    The methods' code objects name the file and lines for sure, where
    :func:`inspect.getsource` needs the class's module to have a file (not so
    for a class of ``__main__`` under ``runpy`` on older Pythons, or of a notebook).
    """
    codes = [c for v in vars(klass).values()
             if (c := getattr(getattr(v, "__func__", v), "__code__", None)) is not None]
    if not codes:
        return None
    filename = codes[0].co_filename
    if is_library(filename):
        return None
    tree = _tree(filename)
    first = min(c.co_firstlineno for c in codes if c.co_filename == filename)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == klass.__name__ \
                and node.lineno <= first <= (node.end_lineno or first):
            return filename, node
    return None


def _in_class(cls: type, attr: str) -> tuple[str, ast.expr] | None:
    """``self.attr = ...`` in the methods of a user's class (or a user's base of it)."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        found = _class_node(klass)
        if found is None:
            continue
        filename, node = found
        value = _follow(_assigned(node, f"self.{attr}"), node)
        if value is not None:
            return filename, value
    return None


def built_at(qualified: str, find: Callable[[str], nn.Module | None],
             files: Sequence[str]) -> Site | None:
    """The user's line that constructed the module named ``qualified`` (``"clf.2"``).

    Args:
        qualified: its name as reports give it: the root's name, then the path.
        find: the module of a qualified name (the root, each level below it).
        files: where to look for the root's assignment: the files of the
            user's frames, innermost first.
    """
    parts = qualified.split(".")
    # From the deepest user class on the path down: its own source built the rest.
    for start in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:start])
        owner = find(prefix) if prefix else None
        if start and (owner is None or type(owner) in _CONTAINERS.values()):
            continue  # a container's children come from its own constructor call
        if start:
            assert owner is not None
            found = _in_class(type(owner), parts[start])
            if found is None:
                continue
            filename, node = found
            tree = _tree(filename)
        else:
            root = parts[0]
            node, filename, tree = None, "", None
            for f in dict.fromkeys(files):
                tree = _tree(f)
                node = _follow(_assigned(tree, root), tree) if tree is not None else None
                if node is not None:
                    filename = f
                    break
            if node is None:
                return None
        assert tree is not None
        parent_name = ".".join(parts[:start + 1])
        for attr in parts[start + 1:]:
            parent = find(parent_name)
            if parent is None or node is None:
                return None
            node = _child(parent, node, attr, tree)
            parent_name += "." + attr
        if node is None or not isinstance(node, ast.Call):
            return None
        return site_at(filename, node.lineno)
    return None
