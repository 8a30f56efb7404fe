"""The user's source lines as reports read and quote them.

A line's one statement, the variable an in-place write or an op's output went
to, the line without its comment, the value an assignment gives: plain
``ast`` and ``tokenize`` on one line of text, with no import from the package,
so that the report (and anything above it) may use it.
"""

from __future__ import annotations

import ast
import io
import tokenize

__all__ = ["assigned", "made_variable", "statement", "without_comment", "written_variable"]

# A write's description: "+=", "x[...] = v", "mul_()", "torch.relu_()"; not a step's.
_AUGMENTED = {"+=": ast.Add, "-=": ast.Sub, "*=": ast.Mult, "/=": ast.Div, "//=": ast.FloorDiv,
              "%=": ast.Mod, "**=": ast.Pow, "&=": ast.BitAnd, "|=": ast.BitOr, "^=": ast.BitXor,
              "<<=": ast.LShift, ">>=": ast.RShift}


def statement(code: str) -> ast.stmt | None:
    """The one statement of a source line, if it parses alone (a comment may follow)."""
    try:
        body = ast.parse(code.strip()).body
    except (SyntaxError, ValueError):
        return None
    return body[0] if len(body) == 1 else None


def _dotted(node: ast.expr) -> str | None:
    """``x``, ``self.h``: a name the user can write again; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def written_variable(description: str, code: str) -> str | None:
    """The variable an in-place write's own line writes to, if the line shows the write.

    >>> written_variable("+=", "x += self.ff(self.n1(x))")
    'x'
    >>> written_variable("mul_()", "h.mul_(2)  # in place")
    'h'
    >>> written_variable("x[...] = v", "scores[mask] = 0.0")
    'scores'
    >>> written_variable("relu_()", "loss = net(x).sum()") is None
    True
    """
    stmt = statement(code)
    if stmt is None:
        return None
    op = _AUGMENTED.get(description)
    if op is not None:
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, op):
            return _dotted(stmt.target)
        return None
    if description == "x[...] = v":
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Subscript):
            return _dotted(stmt.targets[0].value)
        return None
    if not description.endswith("_()"):
        return None
    method = description[:-2].rpartition(".")[2]
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == method:
            target = _dotted(node.func.value)
            if target in ("torch", "F", "torch.nn.functional", "nn.functional"):
                return _dotted(node.args[0]) if node.args else None
            return target
    return None


def made_variable(producer: str, code: str) -> str | None:
    """The variable that a line assigns the output of ``producer``'s op to, if it ends in that op.

    >>> made_variable("Sigmoid", "h = self.fc(x).sigmoid()")
    'h'
    >>> made_variable("Tanh", "h = torch.tanh(self.fc(x))")
    'h'
    >>> made_variable("Sigmoid", "loss = net(x).sum()") is None
    True
    """
    stmt = statement(code)
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    call = stmt.value
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id \
        if isinstance(func, ast.Name) else ""
    if name.replace("_", "").lower() != producer.lower():
        return None
    return _dotted(stmt.targets[0])


def assigned(code: str, name: str) -> str | None:
    """``name = EXPR`` -> ``EXPR`` as written, if ``code`` is that assignment."""
    stmt = statement(code)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
            and _same_name(stmt.targets[0], name):
        return ast.get_source_segment(code.strip(), stmt.value)
    return None


def without_comment(code: str) -> str:
    """A source line without its comment: ``h = rnn(x, h)  # carries`` -> ``h = rnn(x, h)``.

    >>> without_comment("s = '#'  # a hash")
    "s = '#'"
    """
    text = code.strip()
    if "#" not in text:
        return text
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                return text[:tok.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):  # an unfinished line: as it is
        pass
    return text


def _same_name(node: ast.expr, name: str) -> bool:
    return ast.unparse(node) == name

