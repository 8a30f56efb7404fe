"""Every code example of README.md and docs/*.md runs, and the site builds.

```python blocks: each file's ```python blocks run in order in one namespace, in a
temporary working directory, with ``examples/`` importable. A block is compiled as
``example.py``, so the sites a watcher prints read ``example.py:LINE`` with the
block's own line numbers, as the docs show them. When the next fenced block is a
```text block (with no heading in between), it is the expected output: each of
its non-empty lines must appear in what the block printed (stdout and stderr),
runs of spaces collapsed, ``file:line`` sites included (the source line a report
prints after a site may be missing: a block knows only its own lines as
``example.py``'s source); lines that are just ``...`` are skipped, a ``...`` inside a
line matches any text, and pytest's durations (``in 2.17s``) match any duration.

Files: a ```py (or ```python) block whose fence names a file, ```py title="train.py"
(mkdocs shows the name above the block), is that file. It is never run by itself: it
is written, at that path, into the working directory of its page's commands before
any of them runs.

```console blocks: a line ``$ COMMAND`` is a command, and the lines under it up to
the next ``$`` line are its expected output, compared as above. A page's commands run
in page order (``echo $?`` sees the command before it), in a temporary directory that
holds the page's files, each in a process of its own with this interpreter:
``python ...``, ``versionwatch ...`` (its console script's code) and ``pytest ...``
(``python -m pytest -p no:cacheprovider ...``). tests/docs_shell.py runs them: forked
from one process that has imported torch once, all pages side by side, in the
background from the start of this module; ``test_console_examples`` checks each page's
results. A command must exit 0 unless ``STATUS`` says otherwise. ``EXEMPT`` lists the
commands that are not run and why, ``MAPPED`` the ones run in another form (the
benchmarks in their quick form), ``ELSEWHERE`` the ones a dedicated test runs.

```py blocks without a title: cli.md's runs as ``python BLOCK``, in page order with
its commands (``SHELL_PY``); the fragments of lightning.md run with the surrounding
code that ``FRAGMENT_CODE`` gives them, and its callback signature is compared with the
real one (``FRAGMENTS`` names each one's test).

```bash blocks: README.md's fresh-machine set-ups, which CI runs itself (``EXEMPT_BLOCKS``).

``test_every_example_is_run_or_exempt`` fails on any block or command that none of
the above covers, and on entries of these tables that no longer match the docs.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import io
import json
import linecache
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from versionwatch import _sites

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
_TITLE = re.compile(r'\btitle="([^"]+)"')
_DURATION = re.compile(r"\bin \d+(?:\.\d+)?s\b")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    after: str  # the text between the previous block's end and this block
    info: str = ""  # the fence's whole info string: 'py title="train.py"'

    @property
    def title(self) -> str | None:
        """The file this block is, from ``title="NAME"`` in its fence, if any."""
        m = _TITLE.search(self.info)
        return m.group(1) if m else None


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
                         "\n".join(lines[prose_start:start]), info))
        i += 1
        prose_start = i
    return out


def _normalize(text: str) -> str:
    return _DURATION.sub("in <duration>", " ".join(text.split()))


def expected_lines(text_block: str) -> list[str]:
    """The lines of an expected-output block that the check compares."""
    keep = []
    for line in text_block.splitlines():
        norm = _normalize(line)
        if not norm or norm == "...":
            continue
        keep.append(norm)
    return keep


# A site and the source line after it: `example.py:10: h = f(x)`, up to ` (in ` or the end.
_SITE_CODE = re.compile(r"(\S+\.py:\d+): (.*?)(?= \(in |$)")


def _code_optional(line: str) -> re.Pattern[str]:
    """``line`` with each site's source line optional.

    A ```python block runs as ``example.py``, and only that block's lines are known
    as its source: a site in a class or function of an earlier block prints no source
    line, where the same program in one file would.
    """
    parts, pos = [], 0
    for m in _SITE_CODE.finditer(line):
        parts.append(re.escape(line[pos:m.start()]) + re.escape(m.group(1))
                     + "(?:: " + re.escape(m.group(2)) + ")?")
        pos = m.end()
    return re.compile("".join(parts) + re.escape(line[pos:]))


def _found(line: str, got: list[str]) -> bool:
    if "..." not in line:
        if any(line in g for g in got):
            return True
        pattern = _code_optional(line)
        return any(pattern.search(g) for g in got)
    pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
    return any(pattern.search(g) for g in got)


def missing_lines(expected: str, output: str) -> list[str]:
    got = [_normalize(line) for line in output.splitlines()]
    return [line for line in expected_lines(expected) if not _found(line, got)]


def python_cases(path: Path) -> list[tuple[Block, Block | None]]:
    """The ```python blocks of a file, each with its expected-output block, if any."""
    bs = blocks(path.read_text(encoding="utf-8"))
    cases = []
    for k, b in enumerate(bs):
        if b.lang != "python" or b.title:
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
                # As if example.py were a file: reports print a site's source line,
                # this block's (versionwatch caches sites by file and line).
                linecache.cache["example.py"] = (len(block.code), None,
                                                 block.code.splitlines(True), "example.py")
                _sites._SITES.clear()
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
    # Run as a reader runs them, not under pytest: hints name the place's own option.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
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


# Backticked names on the architecture page that look like modules and are none.
_ARCHITECTURE_NOT_MODULES = {"_on_forward", "_on_step_pre", "_name", "__version__"}


def test_architecture_page_names_every_folder_and_module() -> None:
    """docs/architecture.md names every folder and module, and every module it shows exists."""
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    package = ROOT / "src" / "versionwatch"
    modules = {".".join(p.relative_to(package).with_suffix("").parts)
               for p in package.rglob("*.py") if p.name != "__init__.py"} | {"__init__"}
    folders = {f"{p.parent.name}/" for p in package.rglob("__init__.py") if p.parent != package}
    unnamed = sorted(m for m in modules | folders if f"`{m}`" not in page)
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
    shown = set(re.findall(r"`(_{1,2}[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)?/?)`", page))
    dotted = {m.split(".")[0] for m in modules} | {m.rsplit(".", 1)[0] for m in modules}
    unknown = sorted(shown - modules - folders - dotted - _ARCHITECTURE_NOT_MODULES)
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"


# -- files, commands and fragments ---------------------------------------------------

@dataclass
class Command:
    text: str  # the command line after "$ ", as the page shows it
    output: str  # the lines shown under it: its expected output
    line: int  # its line in the page


def console_commands(block: Block) -> list[Command]:
    """The ``$ COMMAND`` lines of a ```console block, each with the output shown under it."""
    cmds: list[Command] = []
    for k, line in enumerate(block.code.splitlines()):
        if line.startswith("$ "):
            cmds.append(Command(line[2:].strip(), "", block.line + 1 + k))
        elif cmds:
            cmds[-1].output += line + "\n"
    return cmds


def _bare(command: str) -> str:
    """A command without its trailing ``# comment``: the key of the tables below."""
    return re.sub(r"\s+#.*$", "", command).strip()


# Console commands that are not run, and why: (pattern on the command, reason).
EXEMPT = [
    (r"^(\.venv/bin/)?pip install\b",
     "installs packages: the tests run in the environment it installs"),
    (r"^python3 -m venv\b",
     "creates the fresh environment that CI creates itself (.ci/run)"),
    (r"^torchrun\b",
     "needs torchrun on the PATH: the page runs the same as python -m torch.distributed.run"),
]

# Console commands run by a dedicated test instead of with their page's commands.
ELSEWHERE = [
    # cli.md's synopsis has placeholders (SCRIPT, [OPTIONS]): its options are checked
    # against `versionwatch run --help`.
    ("cli.md", r"\bSCRIPT\b|\bMODULE\b", "test_cli_synopsis_matches_help"),
    # It crashes the interpreter by design: the test asserts the crash (on torch 2.13).
    ("deep-graphs.md", r"^python repro\.py; echo \$\?$", "test_deep_graph_repro_crashes"),
]

# Console commands run in another form: (page, pattern, replacement, why).
_QUICK = ("a smoke-size run of the same script and options: a full run takes minutes "
          "(tests/test_benchmark_smoke.py smoke-tests the benchmarks too)")
MAPPED = [
    ("index.md", r"^\.venv/bin/", "",
     "the tests' environment stands in for the fresh .venv the page creates"),
    ("performance.md", r"^python benchmarks/overhead\.py\b.*",
     r"\g<0> --quick --models a --steps 1 --repeats 1 --warmup 0", _QUICK),
    ("performance.md", r"^python benchmarks/cost_split\.py\b.*",
     r"\g<0> --models a --steps 1 --repeats 1", _QUICK),
    ("performance.md", r"^python benchmarks/predict_cost\.py\b.*",
     r"\g<0> --quick --repeats 1", _QUICK),
    ("performance.md", r"^python benchmarks/loops\.py\b.*", r"\g<0> --quick", _QUICK),
    # --update-docs would rewrite the page under test: the same table, printed.
    ("performance.md", r"^python benchmarks/events\.py\b.*",
     "python benchmarks/events.py --quick --markdown", _QUICK),
]

# The exit status of each command that does not exit 0, and text its output must hold
# besides the lines the page shows: {(page, command): (status, texts)}.
STATUS: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {
    # the seed story: PyTorch's error, or versionwatch's before it, on iteration 2
    ("cli.md", "python train.py"): (1, ()),
    ("cli.md", "versionwatch run --json report.json train.py"): (1, ()),
    ("cli.md", "versionwatch run --quiet --dot hazard.dot --svg hazard.svg train.py"): (1, ()),
    ("cli.md", "versionwatch run --strict train_two_losses.py"): (1, ()),
    ("cli.md", "versionwatch run --stop-at-write train_two_losses.py"): (1, ()),
    ("cli.md", "versionwatch run act_inplace.py"): (1, ()),
    ("cli.md", "versionwatch run --replay act_inplace.py"): (1, ()),
    ("cli.md", "versionwatch run --strict clf.py"): (1, ()),
    # fix.md: the program has a hazard and nothing was applied.
    ("fix.md", "versionwatch fix train.py"): (1, ()),
    ("fix.md", "versionwatch fix gan.py"): (1, ()),
    ("fix.md", "versionwatch fix actor_critic.py"): (1, ()),
    ("fix.md", "versionwatch fix rnn.py"): (1, ()),
    ("fix.md", "versionwatch fix train_momentum.py"): (1, ()),
    ("fix.md", "versionwatch fix gan_one_dfake.py"): (1, ()),
    ("pytest.md", "pytest --versionwatch-fix -q tests/test_train.py"): (1, ()),
    ("lightning.md", "versionwatch fix train_lightning.py"): (1, ()),
    # pytest.md's tests: tests/test_train.py fails by design, in strict mode too.
    ("pytest.md", "pytest --versionwatch"): (1, ("1 failed, 5 passed",)),
    ("pytest.md", "pytest --versionwatch --versionwatch-on-hazard=warn"): (
        1, ("test_two_losses_one_step - RuntimeError", "1 failed, 5 passed, 1 warning")),
    ("pytest.md", "pytest --versionwatch -q tests/test_train.py"): (1, ()),
    ("pytest.md", "pytest --versionwatch-strict"): (1, ("1 failed, 5 passed",)),
    ("pytest.md", "pytest --versionwatch-strict --versionwatch-on-hazard=log"): (
        1, ("test_two_losses_one_step - RuntimeError", "1 failed, 5 passed")),
    ("pytest.md", "pytest --versionwatch-strict -q tests/test_train.py"): (1, ()),
    ("lightning.md", "python train_lightning.py"): (1, ()),
    ("quickstart.md", "VERSIONWATCH_ON_HAZARD=log python train.py"): (1, ()),
    # rank 1 fails by design; merge's status says a rank had a hazard
    ("distributed.md", "python -m torch.distributed.run --standalone --nproc-per-node 2 -m "
     "versionwatch run --json report.json train_ddp.py"): (1, ()),
    ("distributed.md", "versionwatch merge report.rank0.json report.rank1.json"): (1, ()),
    ("distributed.md", "versionwatch merge spawn.rank1.json"): (1, ()),
}

# Pages whose commands run in the repository: the benchmarks are its own scripts, and
# write nothing. Each of their commands must be MAPPED (to a quick form).
IN_REPO = {"performance.md"}

# Pages whose ```py blocks without a title run as `python BLOCK`, in page order with
# the page's commands.
SHELL_PY = {"cli.md"}

# Fenced blocks that are not run: {(page, lang): reason}. README.md's two ```bash blocks
# set up a fresh machine (a venv, pip install) and then run the demo or the tests: CI
# runs that itself, through .ci/run, and this suite is what they run.
EXEMPT_BLOCKS = {
    ("README.md", "bash"): "the fresh-machine set-up: CI runs it itself (.ci/run runs the "
                           "test command; the demo is cli.md's `versionwatch demo`)",
    ("versions.md", "bash"): "installs torch releases of several GB: .ci/run runs "
                             "tools/torch_matrix.py on the floor release",
}

# What a page's commands need beyond the core dependencies.
REQUIRES = {"lightning.md": ("lightning",)}

# ```py fragments, by page and a text that only that block holds: the test that runs them.
FRAGMENTS = {
    ("lightning.md", "trainer.fit(model, datamodule=dm)"): "test_lightning_fragment",
    ("lightning.md", "accelerator.backward(loss)"): "test_lightning_fragment",
    ("lightning.md", "VersionWatch(on_hazard="): "test_lightning_signature",
}

# The surrounding code each fragment needs, run before it in the same namespace.
FRAGMENT_CODE = {
    # `model` and `dm`: a LightningModule with automatic optimization and a data module.
    # The trainer's other settings come from PL_TRAINER_* (see test_lightning_fragment).
    "trainer.fit(model, datamodule=dm)": """
        import lightning as L
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class Regressor(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

            def training_step(self, batch, batch_idx):
                (x,) = batch
                return self.net(x).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        class Data(L.LightningDataModule):
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)

        model, dm = Regressor(), Data()
        """,
    # A plain loop. Accelerate is not a dependency: a stand-in whose backward(loss)
    # ends in loss.backward(), as Accelerate's does.
    "accelerator.backward(loss)": """
        import torch
        from torch import nn

        import versionwatch

        class Accelerator:
            def backward(self, loss):
                loss.backward()

        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = [torch.randn(8, 4) for _ in range(3)]
        accelerator = Accelerator()
        """,
}


def classify(page: str, command: str) -> tuple[str, str]:
    """("exempt", reason), ("elsewhere", test name) or ("run", the command to run)."""
    bare = _bare(command)
    for pattern, reason in EXEMPT:
        if re.search(pattern, bare):
            return "exempt", reason
    for name, pattern, test in ELSEWHERE:
        if name == page and re.search(pattern, bare):
            return "elsewhere", test
    for name, pattern, repl, _why in MAPPED:
        if name == page and re.search(pattern, bare):
            return "run", re.sub(pattern, repl, bare, count=1)
    return "run", command


def fragment(page: str, marker: str) -> Block:
    """The one ```py block of ``page`` without a title that holds ``marker``."""
    found = [b for b in blocks((DOCS / page).read_text(encoding="utf-8"))
             if b.lang == "py" and not b.title and marker in b.code]
    assert len(found) == 1, f"{page}: {len(found)} ```py blocks hold {marker!r}"
    return found[0]


def page_files(path: Path) -> dict[str, str]:
    """The files a page defines: its blocks with ``title="NAME"``."""
    files: dict[str, str] = {}
    for b in blocks(path.read_text(encoding="utf-8")):
        if b.title and b.lang in ("py", "python"):
            assert b.title not in files, f"{path.name}: two blocks are {b.title}"
            files[b.title] = b.code
    return files


_BLOCKS = "@BLOCKS@"  # in a step: the folder the page's ```py blocks are written to


@dataclass
class Step:
    shown: str  # what the page shows: the command, or "```py block"
    run: str  # what tests/docs_shell.py runs
    expected: str  # the output the page shows for it
    line: int
    status: int = 0
    texts: tuple[str, ...] = ()


def page_steps(path: Path) -> list[Step]:
    """What a page's console test runs, in page order."""
    steps: list[Step] = []
    bs = blocks(path.read_text(encoding="utf-8"))
    for k, b in enumerate(bs):
        if b.lang == "console":
            for c in console_commands(b):
                kind, run = classify(path.name, c.text)
                if kind == "run":
                    status, texts = STATUS.get((path.name, _bare(c.text)), (0, ()))
                    steps.append(Step(c.text, run, c.output, c.line, status, texts))
        elif b.lang == "py" and not b.title and path.name in SHELL_PY:
            nxt = bs[k + 1] if k + 1 < len(bs) else None
            expected = nxt.code if nxt is not None and nxt.lang == "text" else ""
            run = f"python {_BLOCKS}/block_{b.line}.py"
            steps.append(Step("```py block", run, expected, b.line))
    return steps


def _missing_requirements(path: Path) -> list[str]:
    return [m for m in REQUIRES.get(path.name, ()) if importlib.util.find_spec(m) is None]


CONSOLE_PAGES = [p for p in DOC_FILES if page_steps(p)]


# -- fragments and commands with a test of their own ---------------------------------

def _lightning_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's settings the fragment leaves out: fast and quiet, on the CPU.

    Lightning reads a Trainer argument's default from PL_TRAINER_<ARGUMENT>; the
    arguments a block passes still win.
    """
    for name, value in {"ACCELERATOR": "'cpu'", "DEVICES": "1", "MAX_STEPS": "2",
                        "LOGGER": "False", "ENABLE_CHECKPOINTING": "False",
                        "ENABLE_PROGRESS_BAR": "False", "ENABLE_MODEL_SUMMARY": "False"}.items():
        monkeypatch.setenv(f"PL_TRAINER_{name}", value)


@pytest.mark.parametrize("marker", [m for (page, m), test in FRAGMENTS.items()
                                    if test == "test_lightning_fragment"])
def test_lightning_fragment(marker: str, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    block = fragment("lightning.md", marker)
    monkeypatch.chdir(tmp_path)
    _lightning_env(monkeypatch)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with _isolated():
        exec(compile(textwrap.dedent(FRAGMENT_CODE[marker]), "surrounding.py", "exec"), namespace)
        exec(compile(block.code, "example.py", "exec"), namespace)
    if "trainer" in namespace:  # the callback watched the fit, which had no hazard
        from versionwatch.integrations.lightning import VersionWatch

        (callback,) = [c for c in namespace["trainer"].callbacks if isinstance(c, VersionWatch)]
        assert namespace["trainer"].global_step == 2
        assert callback.watcher is not None and not callback.watcher.reports


def test_lightning_signature() -> None:
    """The signature lightning.md shows is the callback's: names, kinds and defaults."""
    pytest.importorskip("lightning")
    from versionwatch.integrations.lightning import VersionWatch

    shown = fragment("lightning.md", "VersionWatch(on_hazard=").code.strip()
    m = re.fullmatch(r"VersionWatch(\(.*\))", shown)
    assert m, shown
    args = ast.parse(f"def f{m.group(1)}: pass").body[0].args  # type: ignore[attr-defined]
    doc = [(a.arg, "POSITIONAL_OR_KEYWORD", ast.literal_eval(d)) for a, d in zip(
        args.args, [None] * (len(args.args) - len(args.defaults)) + args.defaults)]
    doc += [(a.arg, "KEYWORD_ONLY", ast.literal_eval(d))
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    real = [(p.name, p.kind.name, p.default)
            for p in inspect.signature(VersionWatch).parameters.values()]
    assert doc == real


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    def no_core_dumps() -> None:  # pragma: no cover - runs in the child
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ImportError, ValueError, OSError):
            pass

    (cwd / "script.py").write_text(code, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "script.py"], cwd=cwd,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=no_core_dumps if os.name == "posix" else None,
    )


def _crash_line(stderr: str) -> int | None:
    """The line of script.py that faulthandler says the crash happened at."""
    m = re.search(r'File "[^"]*script\.py", line (\d+)', stderr)
    return int(m.group(1)) if m else None


def test_deep_graph_repro_crashes(tmp_path: Path) -> None:
    """`python repro.py; echo $?` of deep-graphs.md: the interpreter dies of SIGSEGV.

    The shell's "Segmentation fault" line and its status 139 (128 + SIGSEGV) depend on
    the shell; the test asserts the process was killed by a signal, at `del y`.
    """
    code = page_files(DOCS / "deep-graphs.md")["repro.py"]
    p = _run_python(code, tmp_path)
    report = f"rc={p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-3000:]}"
    if p.returncode == 0:
        pytest.xfail("freeing the walked chain did not crash here (a larger C stack?)")
    assert p.returncode < 0, report
    assert "never printed" not in p.stdout, report
    del_y = [i for i, line in enumerate(code.splitlines(), 1) if line.startswith("del y")]
    assert _crash_line(p.stderr) in del_y, report


def test_cli_synopsis_matches_help() -> None:
    """cli.md's synopsis names exactly the options of `versionwatch run --help`."""
    synopsis = [c.text for b in blocks((DOCS / "cli.md").read_text(encoding="utf-8"))
                if b.lang == "console" for c in console_commands(b)
                if classify("cli.md", c.text) == ("elsewhere", "test_cli_synopsis_matches_help")]
    assert synopsis
    assert all(s.startswith(("versionwatch run ", "python -m versionwatch run "))
               for s in synopsis), synopsis
    p = subprocess.run([sys.executable, "-m", "versionwatch", "run", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    option = re.compile(r"(?<![\w-])(--?[a-z][\w-]*)")
    shown = set(option.findall(" ".join(synopsis)))  # -m: python's, and -m MODULE
    usage = " ".join(p.stdout.split("\n\n")[0].split())
    assert shown == set(option.findall(usage)) - {"-h"}, (synopsis, usage)
    for name, choices in re.findall(r"(--[\w-]+) (\w+(?:\|\w+)+)", " ".join(synopsis)):
        assert f"{name} {{{choices.replace('|', ',')}}}" in usage, (name, usage)


# -- every example is run, or exempt -------------------------------------------------

def test_every_example_is_run_or_exempt() -> None:
    problems: list[str] = []
    commands: list[tuple[str, str]] = []  # (page, command without its comment)
    py_blocks: list[tuple[str, Block]] = []
    for path in DOC_FILES:
        page = path.name
        for b in blocks(path.read_text(encoding="utf-8")):
            where = f"{page}:{b.line} ```{b.lang}"
            if b.lang in ("python", "py") and b.title:
                if not (page_steps(path) or any(e[0] == page for e in ELSEWHERE)):
                    problems.append(f"{where}: the file {b.title} is used by no command")
                if page in IN_REPO:
                    problems.append(f"{where}: {page}'s commands run in the repository")
            elif b.lang == "py":
                py_blocks.append((page, b))
                hits = [m for (pg, m) in FRAGMENTS if pg == page and m in b.code]
                if page not in SHELL_PY and len(hits) != 1:
                    problems.append(f"{where}: neither a file, nor in SHELL_PY, "
                                    "nor one of FRAGMENTS")
            elif b.lang == "console":
                for c in console_commands(b):
                    commands.append((page, _bare(c.text)))
                    kind, how = classify(page, c.text)
                    if kind == "run" and page in IN_REPO and how == c.text:
                        problems.append(f"{page}:{c.line}: `{c.text}` runs in full: MAP it "
                                        "to a quick form, or exempt it")
                    program = [w for w in _bare(how).split() if "=" not in w][:1]
                    if kind == "run" and program not in (["python"], ["pytest"],
                                                         ["versionwatch"], ["echo"]):
                        problems.append(f"{page}:{c.line}: tests/docs_shell.py cannot run "
                                        f"`{c.text}`")
            elif b.lang in ("bash", "sh", "shell"):
                if (page, b.lang) not in EXEMPT_BLOCKS:
                    problems.append(f"{where}: not run: make it ```console, or exempt it")
            elif b.lang not in ("python", "text"):
                problems.append(f"{where}: decide how this language is run, or that it is data")

    def matched(page: str | None, pattern: str) -> bool:
        return any(re.search(pattern, c) for pg, c in commands if page in (None, pg))

    problems += [f"STATUS: no such command: {k}" for k in STATUS if k not in commands]
    problems += [f"EXEMPT: matches no command: {e}" for e in EXEMPT if not matched(None, e[0])]
    problems += [f"ELSEWHERE: matches no command: {e}" for e in ELSEWHERE
                 if not matched(e[0], e[1])]
    problems += [f"MAPPED: matches no command: {e}" for e in MAPPED if not matched(e[0], e[1])]
    problems += [f"FRAGMENTS: no such block: {k}" for k in FRAGMENTS
                 if not any(pg == k[0] and k[1] in b.code for pg, b in py_blocks)]
    problems += [f"FRAGMENT_CODE: not a fragment: {m}" for m in FRAGMENT_CODE
                 if m not in {k[1] for k in FRAGMENTS}]
    langs = {(p.name, b.lang) for p in DOC_FILES for b in blocks(p.read_text(encoding="utf-8"))}
    problems += [f"EXEMPT_BLOCKS: no such block: {k}" for k in EXEMPT_BLOCKS if k not in langs]
    assert not problems, "\n".join(problems)


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
    assert missing_lines(expected, "x\na b\n at example.py:8\nc\n") == []
    assert missing_lines(expected, "a b\nat example.py:8\n") == ["c"]
    # sites are compared; the source line after one may be missing (an earlier block's)
    assert missing_lines(expected, "a b\nat example.py:9\nc") == ["at example.py:8"]
    expected = "saved at example.py:10: h = f(x) (in net, at version 0)"
    assert missing_lines(expected, "saved at example.py:10 (in net, at version 0)") == []
    assert missing_lines(expected, "saved at example.py:10: h = g(x) (in net, at version 0)") \
        == [expected]
    # "..." inside a line matches any text, in one line; pytest's durations match any
    expected = "Error: ... Hint: ...\n1 failed in 2.1s"
    assert missing_lines(expected, "Error: it broke. Hint: look\n== 1 failed in 0.52s ==") == []
    assert missing_lines(expected, "Error: it broke.\nHint: look\n1 failed in 3s") == [
        "Error: ... Hint: ..."]


def test_files_and_commands_parse() -> None:
    text = "\n".join([
        '```py title="tests/test_a.py"', "def test_a(): pass", "```",
        "```console", "$ pytest -q   # all of them", "1 passed", "", "$ echo $?", "0", "```",
    ])
    file, console = blocks(text)
    assert (file.lang, file.title, console.title) == ("py", "tests/test_a.py", None)
    cmds = console_commands(console)
    assert [(c.text, c.output, c.line) for c in cmds] == [
        ("pytest -q   # all of them", "1 passed\n\n", 5), ("echo $?", "0\n", 8)]
    assert _bare(cmds[0].text) == "pytest -q"
    assert classify("x.md", "pip install -e .  # here")[0] == "exempt"
    assert classify("performance.md", "python benchmarks/overhead.py --strict  # slow") == (
        "run", "python benchmarks/overhead.py --strict --quick --models a --steps 1 "
               "--repeats 1 --warmup 0")
    assert classify("x.md", "pytest -q") == ("run", "pytest -q")


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


# -- the console pages ---------------------------------------------------------------

_SHELL = Path(__file__).with_name("docs_shell.py")
_RUN: dict[str, Any] = {}  # the background run: its process, its pages' steps and folders


def _start(pages: list[Path], tmp: Path) -> None:
    """Start tests/docs_shell.py on ``pages``: their commands, all pages side by side."""
    spec_pages = []
    for path in pages:
        out = tmp / path.stem / "out"
        out.mkdir(parents=True)
        if path.name in IN_REPO:
            cwd = ROOT
        else:
            cwd = tmp / path.stem / "cwd"
            cwd.mkdir()
            for name, code in page_files(path).items():
                (cwd / name).parent.mkdir(parents=True, exist_ok=True)
                (cwd / name).write_text(code, encoding="utf-8")
        for b in blocks(path.read_text(encoding="utf-8")):
            if b.lang == "py" and not b.title and path.name in SHELL_PY:
                (out / f"block_{b.line}.py").write_text(b.code, encoding="utf-8")
        steps = [s.run.replace(_BLOCKS, shlex.quote(str(out))) for s in page_steps(path)]
        spec_pages.append({"name": path.name, "cwd": str(cwd), "out": str(out), "steps": steps})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VERSIONWATCH_", "PYTEST_", "PL_"))}
    env.update(COLUMNS="80", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH")])))
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"env": env, "pages": spec_pages}), encoding="utf-8")
    _RUN["pages"] = {p["name"]: p for p in spec_pages}
    _RUN["proc"] = subprocess.Popen(
        [sys.executable, str(_SHELL), str(spec)], env=env, cwd=tmp, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(path: Path) -> tuple[str, list[tuple[Step, int | None, str]]]:
    """Wait for the background run; the results of ``path``'s steps."""
    if "log" not in _RUN:
        _RUN["log"], _ = _RUN["proc"].communicate(timeout=600)
    out = Path(_RUN["pages"][path.name]["out"])
    results = []
    for i, step in enumerate(page_steps(path)):
        rc_file, out_file = out / f"{i}.rc", out / f"{i}.out"
        rc = int(rc_file.read_text()) if rc_file.is_file() else None
        text = out_file.read_text(errors="replace") if out_file.is_file() else ""
        results.append((step, rc, text))
    return _RUN["log"], results


@pytest.fixture(scope="module", autouse=True)
def _start_console_pages(request: pytest.FixtureRequest,
                         tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start the console pages this session checks, at the start of this module.

    They run in the background, side by side and beside this module's other tests;
    test_console_examples, at the end of the module, collects their results.
    """
    names = {item.callspec.params["path"].name for item in request.session.items
             if getattr(item, "module", None) is request.module
             and getattr(item, "originalname", None) == "test_console_examples"}
    pages = [p for p in CONSOLE_PAGES if p.name in names and not _missing_requirements(p)]
    if pages and hasattr(os, "fork"):
        _start(pages, tmp_path_factory.mktemp("console"))
    yield
    proc = _RUN.get("proc")
    if proc is not None and proc.poll() is None:  # interrupted: stop it and its children
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    _RUN.clear()


@pytest.mark.parametrize("path", CONSOLE_PAGES, ids=[p.name for p in CONSOLE_PAGES])
def test_console_examples(path: Path) -> None:
    missing = _missing_requirements(path)
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}")
    if not hasattr(os, "fork"):
        pytest.skip("the console examples run in forked processes (POSIX)")
    log, results = _results(path)
    failures = []
    for step, rc, output in results:
        where = f"{path.name}:{step.line}: `{step.shown}`"
        if step.run != step.shown and step.shown != "```py block":
            where += f" (run as `{step.run}`)"
        wrong = []
        if rc != step.status:
            wrong.append(f"exit status {rc}, expected {step.status}")
        missing = missing_lines(step.expected, output)
        if missing:
            wrong.append("missing lines of the page's output:\n" + "\n".join(missing))
        absent = [t for t in step.texts if _normalize(t) not in _normalize(output)]
        if absent:
            wrong.append(f"output lacks {absent}")
        if wrong:
            failures.append(f"{where}: " + "\n".join(wrong) + f"\n--- output:\n{output[-6000:]}")
    assert not failures, "\n\n".join(failures) + (f"\n--- driver:\n{log[-3000:]}" if log else "")
