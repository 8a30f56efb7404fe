"""Run the console commands of the docs, for tests/test_docs.py.

``python docs_shell.py SPEC.json`` runs the pages that SPEC lists side by side, each in
its own forked process, and each page's commands in order, each in a forked child of
that process. A child runs its command as a fresh process would (``python SCRIPT``,
``python -m MODULE``, ``python -c CODE``; ``versionwatch`` as its console script does;
``pytest`` as ``python -m pytest -p no:cacheprovider``), with its own working directory,
environment, ``sys.argv``, ``sys.path[0]`` and ``__main__`` namespace, its stdout and
stderr both to ``OUT/<i>.out``; its exit status goes to ``OUT/<i>.rc`` (a negative one
for a signal). What it saves: this process imports torch (and what an optimizer's
first step imports) and pytest once, and every child inherits them, instead of paying
seconds for torch's import per command. (Not versionwatch: pytest warns when a
plugin's package was imported before it could rewrite its asserts.)

The shell syntax the docs use, and only that, is understood: ``VAR=value`` before a
command, ``# comments``, a trailing ``|| true``, and ``echo $?`` (the status of the
command before). Anything else is an error of the harness, status 127.

SPEC: ``{"env": {...}, "pages": [{"cwd": DIR, "out": DIR, "steps": [LINE, ...]}]}``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import shlex
import sys
import traceback
from typing import Any, NoReturn

HERE = os.path.abspath(__file__)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = {"|", "||", "&", "&&", ";", "<", ">", ">>", "(", ")"}


def _run(argv: list[str]) -> None:
    """Run a command in this (child) process as its own process would run it."""
    prog, args = argv[0], argv[1:]
    if prog == "versionwatch":  # the console script: versionwatch._cli.command:main
        from versionwatch._cli.command import main as console_script

        sys.argv = ["versionwatch", *args]
        sys.path[0] = os.path.dirname(sys.executable)  # the script's folder
        sys.exit(console_script())
    if prog == "pytest":
        prog, args = "python", ["-m", "pytest", "-p", "no:cacheprovider", *args]
    if prog != "python" or not args:
        raise SystemExit(f"docs_shell: cannot run {shlex.join(argv)!r}")
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(args[1], "<string>", "exec"), main)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _child(argv: list[str], env: dict[str, str], out: str) -> NoReturn:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # A fresh process's multiprocessing takes its start folder at import: spawned
    # children (mp.spawn) find the main script from it, here the page's folder.
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.ORIGINAL_DIR = os.getcwd()
    code = 0
    try:
        _run(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        # As Python prints it: from the command's own frames, without this file's and runpy's.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (HERE, runpy.__file__):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def run_line(line: str, env: dict[str, str], out: str, last: int) -> int:
    """Run one command line; return its exit status, as the shell would set ``$?``."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if words == ["echo", "$?"]:
        with open(out, "w") as f:
            f.write(f"{last}\n")
        return 0
    or_true = words[-2:] == ["||", "true"]
    if or_true:
        words = words[:-2]
    env = dict(env)
    while words and _ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words or _OPERATORS.intersection(words) or "$" in "".join(words):
        with open(out, "w") as f:
            f.write(f"docs_shell: shell syntax it does not understand: {line}\n")
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(words, env, out)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    return 0 if or_true else rc


def run_page(page: dict[str, Any], env: dict[str, str]) -> None:
    os.chdir(page["cwd"])
    last = 0
    for i, line in enumerate(page["steps"]):
        last = run_line(line, env, os.path.join(page["out"], f"{i}.out"), last)
        with open(os.path.join(page["out"], f"{i}.rc"), "w") as f:
            f.write(str(last))


def main() -> None:
    # Imported once here, for every command (not at import: pytest's --doctest-modules
    # imports this file too).
    import pytest  # noqa: F401
    import torch._dynamo  # noqa: F401  (what an optimizer's first step() imports: a second)

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    pids = []
    for page in spec["pages"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_page(page, spec["env"])
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
