"""Every ```python block of README.md and docs/*.md runs, and the site builds.

Each file's ```python blocks run in order in one namespace, in a temporary
working directory, with ``examples/`` importable. A block is compiled as
``example.py``, so the sites a watcher prints read ``example.py:LINE`` with the
block's own line numbers, as the docs show them. When the next fenced block is a
```text block (with no heading in between), it is the expected output: each of
its non-empty lines must appear in what the block printed (stdout and stderr),
runs of spaces collapsed; lines that hold a ``file:line`` site and lines that are
just ``...`` are skipped.

Blocks in ```py, ```console, ```bash, ```text (and any other language) are not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SITE = re.compile(r"\.py:\d+|<[^>\s]+>:\d+")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    after: str  # the text between the previous block's end and this block


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, with the prose before each."""
    out: list[Block] = []
    lines = text.splitlines()
    i, prose_start = 0, 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        lang = re.split(r"[\s{]", info, maxsplit=1)[0].lower() if info else ""
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close is not None and close.group("fence")[0] == fence[0]
                    and len(close.group("fence")) >= len(fence)
                    and not close.group("info").strip()):
                break
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        out.append(Block(lang, "\n".join(body) + "\n", start + 1,
                         "\n".join(lines[prose_start:start])))
        i += 1
        prose_start = i
    return out


def _normalize(text: str) -> str:
    return " ".join(text.split())


def expected_lines(text_block: str) -> list[str]:
    """The lines of an expected-output block that the check compares."""
    keep = []
    for line in text_block.splitlines():
        norm = _normalize(line)
        if not norm or norm == "..." or _SITE.search(line):
            continue
        keep.append(norm)
    return keep


def missing_lines(expected: str, output: str) -> list[str]:
    got = "\n".join(_normalize(line) for line in output.splitlines())
    return [line for line in expected_lines(expected) if line not in got]


def python_cases(path: Path) -> list[tuple[Block, Block | None]]:
    """The ```python blocks of a file, each with its expected-output block, if any."""
    bs = blocks(path.read_text(encoding="utf-8"))
    cases = []
    for k, b in enumerate(bs):
        if b.lang != "python":
            continue
        nxt = bs[k + 1] if k + 1 < len(bs) else None
        if nxt is not None and not (nxt.lang == "text" and not any(
                _HEADING.match(line) for line in nxt.after.splitlines())):
            nxt = None
        cases.append((b, nxt))
    return cases


@contextlib.contextmanager
def _isolated() -> Any:
    """Restore what a doc example may change: env, logging, warnings, torch's seed."""
    env = dict(os.environ)
    logger = logging.getLogger("versionwatch")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(env)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


def run_file(path: Path) -> list[tuple[Block, Block | None, str]]:
    """Run a file's ```python blocks in order; return each block's output.

    Raises AssertionError naming the block when one of them raises.
    """
    results = []
    namespace: dict[str, Any] = {"__name__": "__main__"}
    torch.manual_seed(0)
    with _isolated():
        for block, expected in python_cases(path):
            buf = io.StringIO()

            def show(message: Any, category: Any, filename: str, lineno: int,
                     file: Any = None, line: Any = None, _buf: io.StringIO = buf) -> None:
                _buf.write(warnings.formatwarning(message, category, filename, lineno, line))

            old_show = warnings.showwarning
            warnings.showwarning = show
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                    exec(compile(block.code, "example.py", "exec"), namespace)
            except BaseException as e:
                raise AssertionError(
                    f"{path.name}: the ```python block at line {block.line} raised "
                    f"{type(e).__name__}: {e}\n--- output so far:\n{buf.getvalue()}"
                    f"--- block:\n{block.code}"
                ) from e
            finally:
                warnings.showwarning = old_show
            results.append((block, expected, buf.getvalue()))
    return results


RUNNABLE = [p for p in DOC_FILES if python_cases(p)]


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for block, expected, output in run_file(path):
        if expected is None:
            continue
        missing = missing_lines(expected.code, output)
        assert not missing, (
            f"{path.name}: the ```text block at line {expected.line} does not match the output "
            f"of the ```python block at line {block.line}; missing lines:\n"
            + "\n".join(missing) + f"\n--- output:\n{output}"
        )


def test_readme_output_is_compared() -> None:
    """The README's main example has its printed output checked, not only run."""
    cases = python_cases(ROOT / "README.md")
    assert cases, "README.md has no ```python block"
    assert any(expected is not None for _, expected in cases)


def test_doc_pages_in_nav_exist() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE)
    assert "index.md" in pages
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names missing pages: {missing}"


# -- the harness itself --------------------------------------------------------------

def test_blocks_parse_fences_and_prose() -> None:
    text = "\n".join([
        "# T", "```python", "print('a')", "```", "prints", "```text", "a", "```",
        "## H", "```text", "b", "```", "    ```python", "    x = 1", "    ```",
        "````md", "```python", "inner", "```", "````",
    ])
    bs = blocks(text)
    assert [b.lang for b in bs] == ["python", "text", "text", "python", "md"]
    assert bs[0].code == "print('a')\n"
    assert bs[1].after == "prints"
    assert bs[3].code == "x = 1\n"
    assert "inner" in bs[4].code


def test_loose_comparison() -> None:
    expected = "a   b\n\n  at example.py:8\n...\nc"
    assert missing_lines(expected, "x\na b\nc\n") == []
    assert missing_lines(expected, "a b\n") == ["c"]


# -- the site --------------------------------------------------------------------------

def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.skipif(
    not _have("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"),
    reason="the docs extra (mkdocs, mkdocs-material, mkdocstrings[python]) is not installed",
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").is_file()
