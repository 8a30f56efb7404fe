"""Every option of every command is explained in its ``--help`` and listed in docs/cli.md.

Each command's ``--help`` is compared with the option tables of its section of
docs/cli.md, both ways: an option added to a parser without a row there fails, and so
does a row for an option that no longer exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from versionwatch._cli.command import main
from versionwatch._fix import command as fix_command

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "cli.md"

# Each command, and the heading of docs/cli.md whose tables list its options.
COMMANDS = {
    (): "## `versionwatch --version` and `--help`",
    ("run",): "## Options",
    ("fix",): "## `versionwatch fix`",
    ("merge",): "## Under torchrun, and `versionwatch merge`",
    ("demo",): "## `versionwatch demo`",
    ("native",): "## `versionwatch native`",
    ("native", "build"): "### `versionwatch native build`",
    ("native", "status"): "## `versionwatch native`",
}
_HELP_ONLY = {"-h", "--help"}  # argparse's own, in every command
_OPTION = re.compile(r"(?<![\w-])(--?[a-z][\w-]*)")


def _help(argv: tuple[str, ...]) -> str:
    """``versionwatch ARGV --help``'s output, from the command's own entry point."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        status = main([*argv, "--help"])
        raise SystemExit(status)  # `fix` returns its status instead of exiting
    assert stop.value.code in (0, None), out.getvalue()
    return out.getvalue()


def _help_options(text: str) -> set[str]:
    """The options a help text explains: its lines that start with one, after two spaces."""
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("  -"):
            found.update(re.findall(r"(?:^  |, )(--?[a-z][\w-]*)", line))
    return found - _HELP_ONLY


def _section(heading: str) -> str:
    """The text of docs/cli.md under ``heading``, up to the next heading of its level or
    above."""
    text = CLI_MD.read_text(encoding="utf-8")
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line == heading]
    assert len(starts) == 1, f"docs/cli.md has {len(starts)} headings {heading!r}"
    level = len(heading.split(" ", 1)[0])
    body = []
    for line in lines[starts[0] + 1:]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body)


def _doc_options(heading: str) -> set[str]:
    """The options in the first column of the option tables of that section (not in its
    subsections: they are their own commands')."""
    level = len(heading.split(" ", 1)[0])
    found: set[str] = set()
    inside = True
    for line in _section(heading).splitlines():
        m = re.match(r"^(#+) ", line)
        if m:
            inside = len(m.group(1)) <= level
        if inside and line.startswith("| `-"):
            found.update(_OPTION.findall(line.split("|")[1]))
    return found


@pytest.mark.parametrize("argv", list(COMMANDS), ids=[" ".join(a) or "versionwatch"
                                                      for a in COMMANDS])
def test_help_options_are_the_documented_ones(argv: tuple[str, ...]) -> None:
    text = _help(argv)
    assert text.startswith("usage: versionwatch"), text[:200]
    helped, documented = _help_options(text), _doc_options(COMMANDS[argv])
    assert helped == documented, (
        f"`versionwatch {' '.join(argv)} --help` and docs/cli.md's "
        f"{COMMANDS[argv]!r} differ: only in --help: {sorted(helped - documented)}, "
        f"only in docs/cli.md: {sorted(documented - helped)}")


@pytest.mark.parametrize("argv", list(COMMANDS), ids=[" ".join(a) or "versionwatch"
                                                      for a in COMMANDS])
def test_every_option_is_explained(argv: tuple[str, ...]) -> None:
    """Each option in --help has a sentence of its own, and the command a description."""
    text = _help(argv)
    blocks = text.split("\n\n")
    assert len(blocks) >= 3, text  # usage, a description, the options
    for line in text.splitlines():
        m = re.match(r"^  (-[^\n]*?)(?:\s{2,}(\S.*))?$", line)
        if m:
            assert m.group(2) or text.split(line, 1)[1].split("\n", 1)[1].startswith(" " * 8), (
                f"{m.group(1)} has no explanation in:\n{text}")


def test_fix_help_is_its_parser_and_fix_reads_every_option_it_lists() -> None:
    """`versionwatch fix` reads its options itself: the help lists exactly those."""
    parser = fix_command.help_parser()
    listed = {o for a in parser._actions for o in a.option_strings} - _HELP_ONLY
    assert listed == (fix_command._VALUED | fix_command._FLAGS) - _HELP_ONLY
    assert {"--facts", "--jobs"} <= listed
    for option in sorted(listed):
        argv = [option, "2"] if option in fix_command._VALUED else [option]
        opts, program = fix_command._parse([*argv, "train.py", "--jobs", "x"])
        assert program == ["train.py", "--jobs", "x"], option  # the program's, not ours
        key = option[2:].replace("-", "_")
        assert opts[key] in (2, 2.0, "2", True), (option, opts)
    text = _help(("fix",))
    assert "--facts PATH" in text and "--jobs N" in text
    assert "check up to N patches at once" in text


def test_version() -> None:
    """`versionwatch --version`: the package's version and torch's, exit status 0."""
    import torch

    from versionwatch import __version__

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    p = subprocess.run([sys.executable, "-m", "versionwatch", "--version"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"versionwatch {__version__} (torch {torch.__version__})\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
