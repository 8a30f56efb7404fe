"""What the programs that ``versionwatch run --replay`` and ``versionwatch fix`` run see,
and what fix says of what it could not follow.

- ``sys.path``: the program's first entry is what plain ``python`` gives it (the
  script's folder), never the working directory, where a ``json.py`` would shadow
  the real module in versionwatch's own imports.
- Standard input: fix's runs read an empty one; a program that read it is said to.
- A process the program forks, and a thread: what fix did not follow is said.
- ``--facts`` and ``versionwatch merge`` (tests/test_cli.py): a malformed file is a
  usage error, one line, exit status 2.

Every program runs for real, in subprocesses, through the command as its console
script starts it (``python`` on a launcher file: not ``python -m``, which puts the
working directory on ``sys.path`` itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from versionwatch._fix.command import main as fix_main

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")

# tests/fix_programs/seed_story.py as a function: it fails at the second iteration.
_HEAD, _LOOP = (HERE / "fix_programs" / "seed_story.py").read_text(
    encoding="utf-8").split("torch.manual_seed(0)\n")
MODEL = ("import os\nimport sys\n" + _HEAD + "\ndef train(iterations=3):\n"
         + textwrap.indent("torch.manual_seed(0)\n" + _LOOP.replace(
             "range(3)", "range(iterations)"), "    "))
# What `versionwatch` (the console script) runs.
LAUNCHER = "import sys\nfrom versionwatch._cli.command import main\nsys.exit(main())\n"



def said_after_where(stderr: str) -> list[str]:
    """fix's stderr lines after its first, which says where the runs happen."""
    where, *lines = stderr.strip().splitlines()
    assert where.startswith("versionwatch fix: every run of the program happens in "), where
    return lines

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return env


def python(*args: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), input=stdin,
                          capture_output=True, text=True, timeout=300)


def versionwatch(tmp_path: Path, *args: str, cwd: Path,
                 stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``versionwatch ARGS`` as its console script runs it: ``sys.path[0]`` its own folder."""
    launcher = tmp_path / "bin" / "versionwatch_launcher.py"
    launcher.parent.mkdir(exist_ok=True)
    launcher.write_text(LAUNCHER)
    return python(str(launcher), *args, cwd=cwd, stdin=stdin)


def test_runs_see_the_sys_path_of_plain_python(tmp_path: Path) -> None:
    """A ``json.py`` in the working directory shadows nothing, in any run of the program
    (it did for ``--replay``, ``fix`` and ``fix --fresh``: their children ran as
    ``python -m``), and the program's ``sys.path[0]`` is its folder, as plainly."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "json.py").write_text('raise ImportError("the json.py of the working directory")\n')
    log = tmp_path / "path.log"
    (work / "sub" / "train.py").write_text(MODEL + textwrap.dedent("""\

        with open(sys.argv[1], "a") as f:  # the run's folder may be a copy: relative to it
            cwd_on_path = "" in sys.path or os.getcwd() in sys.path
            f.write(f"{os.path.relpath(sys.path[0])} {cwd_on_path}\\n")
        train()
    """))
    plain = python("sub/train.py", str(log), cwd=work)
    assert plain.returncode == 1 and "modified by an inplace operation" in plain.stderr
    assert log.read_text() == f"{os.path.join('sub')} False\n"
    seen = {"plain": log.read_text()}
    for mode in (["run"], ["run", "--replay"], ["fix"], ["fix", "--fresh"]):
        log.unlink()
        done = versionwatch(tmp_path, *mode, "sub/train.py", str(log), cwd=work)
        said = done.stdout + done.stderr
        assert "json.py of the working directory" not in said, (mode, said)
        assert done.returncode == 1, (mode, said)
        if mode == ["run", "--replay"]:
            assert "the strict replay met the same hazard" in said, said
        if mode[0] == "fix":
            assert "verified: one `optim.step()` after both backwards" in done.stdout, said
            assert "standard input" not in said and "forked" not in said
        lines = log.read_text().splitlines()
        assert len(lines) >= (2 if mode != ["run"] else 1), (mode, lines)
        seen[" ".join(mode)] = lines
        assert set(lines) == {seen["plain"].strip()}, (mode, lines)


def test_a_program_that_read_its_empty_stdin_is_said_to(tmp_path: Path) -> None:
    """The runs read an empty standard input: a program that trains on what it reads
    there ran no backward, which is no "no hazard" to claim."""
    (tmp_path / "train.py").write_text(MODEL + "\ntrain(int(sys.stdin.readline() or 0))\n")
    plain = python("train.py", cwd=tmp_path, stdin="3\n")
    assert "modified by an inplace operation" in plain.stderr
    done = versionwatch(tmp_path, "fix", "train.py", cwd=tmp_path, stdin="3\n")
    assert done.returncode == 0, done.stderr
    lines = said_after_where(done.stderr)
    assert lines[0] == ("versionwatch fix: no hazard seen (0 backward(s) ran), but "
                        "versionwatch fix did not follow all the program did:"), done.stderr
    assert "the program read its standard input, which versionwatch fix does not pass" \
        in lines[1], done.stderr


FORKS = {
    # multiprocessing's "fork": the parent does not look at how its child ended.
    "multiprocessing": textwrap.dedent("""\
        import multiprocessing

        if __name__ == "__main__":
            p = multiprocessing.get_context("fork").Process(target=train)
            p.start()
            p.join()
    """),
    # os.fork: the child trains, fails, and ends as the program does, at its end.
    "os.fork": textwrap.dedent("""\
        if os.fork() == 0:
            train()
        else:
            os.wait()
    """),
}


@pytest.mark.parametrize("how", list(FORKS))
def test_a_forked_training_is_said_not_followed(tmp_path: Path, how: str) -> None:
    """The training in a forked process is not followed: "no hazard seen in the main
    process", and why, never a bare "no hazard" (nor the fork's record for the run's)."""
    (tmp_path / "train.py").write_text(MODEL + "\n" + FORKS[how])
    plain = python("train.py", cwd=tmp_path)
    assert plain.returncode == 0 and "modified by an inplace operation" in plain.stderr
    done = versionwatch(tmp_path, "fix", "train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = said_after_where(done.stderr)
    assert lines[0] == ("versionwatch fix: no hazard seen (0 backward(s) ran in the main "
                        "process), but versionwatch fix did not follow all the program did:"
                        ), done.stderr
    assert lines[1].startswith("versionwatch fix: the program ran backwards in 1 forked "
                               "process(es), which versionwatch fix does not follow"), done.stderr


def test_a_fork_that_runs_no_backward_is_no_matter(tmp_path: Path) -> None:
    """A fork that trains nothing (a DataLoader's worker) leaves "no hazard" bare."""
    (tmp_path / "train.py").write_text(MODEL + textwrap.dedent("""\
        if os.fork() == 0:
            os._exit(0)
        os.wait()
        train(1)
    """))
    done = versionwatch(tmp_path, "fix", "train.py", cwd=tmp_path)
    assert (done.returncode, said_after_where(done.stderr)) == (
        0, ["versionwatch fix: no hazard (2 backward(s) ran); nothing to fix"])


def test_a_training_on_a_thread_says_what_the_check_could_not_run(tmp_path: Path) -> None:
    """The failure is found on the thread, but the program as meant runs on the main
    thread only: the patches that change the training are rejected against the
    failing run, and the result says why, and what to do."""
    (tmp_path / "train.py").write_text(MODEL + textwrap.dedent("""\
        import threading

        t = threading.Thread(target=train, name="trainer")
        t.start()
        t.join()
    """))
    done = versionwatch(tmp_path, "fix", "train.py", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("versionwatch fix: backward #4 at train.py:"), done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == (
        "versionwatch fix: backward #4 ran on thread 'trainer': the check runs the program "
        "as meant (each backward with what its forward saved) on the main thread only, so a "
        "patch that changes the training is compared with the failing run instead; run the "
        "training on the main thread to check such patches"), done.stdout


BAD_FACTS = {
    "nested": "[" * 100_000,
    "a list": "[1, 2]",
    "a line that is a number": json.dumps({"kind": "inplace", "failing_backward": 5}),
    "a line without its number": json.dumps({"kind": "inplace",
                                             "step": {"file": "train.py"}}),
    "a line numbered true": json.dumps({"kind": "inplace",
                                        "step": {"file": "train.py", "line": True}}),
    "updates that are no list": json.dumps({"kind": "inplace",
                                            "update": {"file": "train.py", "line": 3}}),
    "a name that is a number": json.dumps({"kind": "inplace", "tensor": 3}),
    "sources that are not text": json.dumps({"kind": "inplace", "sources": {"a.py": 1}}),
    "not UTF-8": b"\xff\xfe{".decode("latin-1"),
}


@pytest.mark.parametrize("name", list(BAD_FACTS))
def test_malformed_facts_are_a_usage_error(tmp_path: Path, name: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("x = 1\n")
    facts = tmp_path / "facts.json"
    facts.write_bytes(BAD_FACTS[name].encode("latin-1"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = fix_main(["--facts", str(facts), "train.py"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"versionwatch fix: error: --facts {facts}: "), err
