"""``versionwatch fix``: nothing it started outlives it, however it ends.

Each test runs the real command on a program that starts a `sleep` (a Popen
child) and a multiprocessing worker waiting on a queue, marks its start, its
``finally`` and its ``atexit`` in a folder, and then does what the test wants
(a hazard to fix, its own error, forever). After ``fix`` ends (by itself, at a
time limit, by Ctrl-C, SIGTERM or SIGKILL), with the fork server and with
``--fresh``: no process carrying the test's tag in its environment is left,
nothing of ours is left in ``TMPDIR``, and where the run was ended rather than
killed, the program's ``finally`` and ``atexit`` ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import PROCESS_TAG, tagged_processes
from versionwatch._fix.check import STDERR_TAIL, run_child
from versionwatch._fix.command import main as fix_main

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "fork"),
                                reason="counts processes in /proc")

SRC = Path(__file__).resolve().parent.parent / "src"

PROGRAM = '''\
import atexit
import multiprocessing as mp
import os
import subprocess
import sys
import time

import torch

MARKS = os.environ["VW_LIFE_MARKS"]


def mark(what):
    with open(os.path.join(MARKS, f"{what}.{os.getpid()}"), "w"):
        pass


if __name__ == "__main__":
    context = mp.get_context("fork")
    queue = context.Queue()
    context.Process(target=queue.get, daemon=True).start()
    subprocess.Popen(["sleep", "1000"])
    atexit.register(mark, "atexit")
    mark("started")
    mode = sys.argv[1]
    try:
        if mode == "forever":
            while True:
                time.sleep(0.05)
        if mode == "error":
            raise ValueError("the program's own error")
        w = torch.ones(3, requires_grad=True)
        for _ in range(6):
            y = torch.sigmoid(w * 2)
            y.mul_(2)
            y.sum().backward()
    finally:
        mark("finally")
'''


class Fix:
    """``versionwatch fix`` on the program, in a session of its own (as a shell starts it)."""

    def __init__(self, folder: Path, args: list[str], fresh: bool) -> None:
        self.marks = folder / "marks"
        self.tmp = folder / "tmp"
        self.marks.mkdir()
        self.tmp.mkdir()
        (folder / "life.py").write_text(PROGRAM, encoding="utf-8")
        self.tag = f"life.{os.getpid()}.{time.monotonic_ns()}"
        env = dict(os.environ, PYTHONPATH=str(SRC), TMPDIR=str(self.tmp),
                   VW_LIFE_MARKS=str(self.marks), **{PROCESS_TAG: self.tag})
        argv = [sys.executable, "-m", "versionwatch", "fix", *(["--fresh"] if fresh else []),
                *args]
        self.proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def started(self, within: float = 120) -> None:
        """Wait until the program's first run has started (its mark)."""
        deadline = time.monotonic() + within
        while not self.of("started") and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.05)
        assert self.of("started"), "the program never started"
        time.sleep(0.3)  # its sleep and worker started too

    def of(self, what: str) -> set[str]:
        return {p.name.split(".", 1)[1] for p in self.marks.glob(f"{what}.*")}

    def end(self, within: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=within)
        return self.proc.returncode, out, err

    def left(self) -> tuple[list[str], list[str]]:
        """What is still there a moment after fix ended: its processes, its temp files."""
        deadline = time.monotonic() + 15
        while True:
            procs = tagged_processes(self.tag)
            files = [p.name for p in self.tmp.iterdir()
                     if not p.name.startswith("torchinductor_")]  # torch's own cache
            if (not procs and not files) or time.monotonic() > deadline:
                return procs, files
            time.sleep(0.1)


@pytest.fixture
def leftovers() -> Iterator[list[Fix]]:
    """Kill what a failing test left (its own processes, by its tag), so the next starts clean."""
    made: list[Fix] = []
    yield made
    for f in made:
        if f.proc.poll() is None:
            f.proc.kill()
            f.proc.communicate()
        for line in tagged_processes(f.tag):
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(tmp_path: Path, leftovers: list[Fix], args: list[str], fresh: bool) -> Fix:
    f = Fix(tmp_path, args, fresh)
    leftovers.append(f)
    return f


HOW = pytest.mark.parametrize("fresh", [False, True], ids=["fork_server", "fresh"])


def _every_run_cleaned_up(f: Fix) -> None:
    started = f.of("started")
    assert started, "the program never started"
    assert f.of("finally") == started, "a run was cut before the program's finally ran"
    assert f.of("atexit") == started, "a run was cut before the program's atexit ran"


@HOW
def test_a_fix_that_succeeds_leaves_nothing(tmp_path: Path, leftovers: list[Fix],
                                            fresh: bool) -> None:
    f = start(tmp_path, leftovers, ["--timeout", "60", "life.py", "hazard"], fresh)
    code, out, err = f.end()
    assert code == 1, err  # a patch found, not applied
    assert "1 candidate patch(es), 1 verified" in out
    assert f.left() == ([], [])
    # Every run (the first one, the program as meant, the check) was ended past its
    # record by unwinding the program, not cut: its finally and atexit ran.
    assert len(f.of("started")) >= 3
    _every_run_cleaned_up(f)


@HOW
def test_a_program_that_fails_otherwise_leaves_nothing(tmp_path: Path, leftovers: list[Fix],
                                                       fresh: bool) -> None:
    f = start(tmp_path, leftovers, ["--timeout", "60", "life.py", "error"], fresh)
    code, _, err = f.end()
    assert code == 1, err
    assert "ValueError: the program's own error" in err
    assert f.left() == ([], [])
    _every_run_cleaned_up(f)


@HOW
def test_a_run_past_its_time_limit_is_ended_with_all_it_started(
        tmp_path: Path, leftovers: list[Fix], fresh: bool) -> None:
    # The limit counts from the fork (server) or the start (a new interpreter, which
    # imports torch inside it): long enough for the program to start its children on
    # a loaded 2-core machine (2-3 s after a fork, 7 s in a new interpreter).
    f = start(tmp_path, leftovers, ["--timeout", "8" if not fresh else "20", "life.py",
                                    "forever"], fresh)
    code, _, err = f.end()
    assert code != 0, err
    assert "ended with a time-out, not a failure versionwatch fixes" in err
    assert f.left() == ([], [])
    _every_run_cleaned_up(f)  # SIGTERM, as Ctrl-C would: its finally ran


SIGNALS = [("sigint_to_the_group", signal.SIGINT, True, 130),
           ("sigint_to_fix", signal.SIGINT, False, 130),
           ("sigterm", signal.SIGTERM, False, 143)]


@HOW
@pytest.mark.parametrize("how,sig,group,status", SIGNALS, ids=[s[0] for s in SIGNALS])
def test_an_interrupted_fix_stops_its_runs_and_says_so_in_one_line(
        tmp_path: Path, leftovers: list[Fix], fresh: bool, how: str, sig: int, group: bool,
        status: int) -> None:
    f = start(tmp_path, leftovers, ["--timeout", "60", "life.py", "forever"], fresh)
    f.started()
    began = time.monotonic()
    if group:
        os.killpg(f.proc.pid, sig)  # what a terminal's Ctrl-C does
    else:
        os.kill(f.proc.pid, sig)
    code, out, err = f.end(within=60)
    assert code == status, err
    # After the lines on where the runs happen: one line, no traceback.
    *before, last = err.splitlines()
    assert last == "versionwatch fix: interrupted; 1 check run stopped, nothing written"
    assert all(line.startswith("versionwatch fix: every run") for line in before), err
    assert out == ""
    assert time.monotonic() - began < 15  # not the run's time limit, nor 30 s of waiting
    assert f.left() == ([], [])
    _every_run_cleaned_up(f)


@HOW
def test_a_killed_fix_leaves_nothing(tmp_path: Path, leftovers: list[Fix], fresh: bool) -> None:
    f = start(tmp_path, leftovers, ["--timeout", "60", "life.py", "forever"], fresh)
    f.started()
    f.proc.kill()  # SIGKILL: fix says nothing; what it started ends by itself
    f.end()
    procs, files = f.left()
    assert procs == [], procs
    assert files == [], files


@pytest.mark.parametrize("value", ["inf", "1e308", "nan", "0", "-1", "1e6"])
def test_a_timeout_that_is_no_limit_is_a_usage_error(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fix_main(["--timeout", value, "no_such_script.py"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("versionwatch fix: error: --timeout takes a positive number of seconds, "
                   f"at most 604800 (a week), not {value!r} (versionwatch fix --help)\n")


def test_a_runs_stderr_is_kept_as_its_tail(tmp_path: Path) -> None:
    # 8 MB on stderr, then the run dies: what the check keeps is its end, bounded.
    code = ("import os, sys\n"
            "line = b'x' * 1023 + b'\\n'\n"
            "for _ in range(8 * 1024):\n"
            "    os.write(2, line)\n"
            "os.write(2, b'the last line\\n')\n"
            "os._exit(3)\n")
    run = run_child(["-c", code], workdir=str(tmp_path), timeout=120)
    assert run.status == "died" and run.exit == 3
    assert len(run.stderr.encode()) <= STDERR_TAIL
    assert run.stderr.endswith("the last line\n")
    assert run.stderr.startswith("x")  # from a whole line on


def test_a_program_whose_cleanup_never_ends_is_cut_after_the_grace(
        tmp_path: Path, no_process_left: None) -> None:
    from versionwatch._fix.child import GRACE

    # Stopped after its first backward, the program's finally runs, and never ends.
    mark = tmp_path / "finally"
    code = ("import time, torch\n"
            "w = torch.ones(2, requires_grad=True)\n"
            "try:\n"
            "    (w * 2).sum().backward()\n"
            "    (w * 3).sum().backward()\n"
            "finally:\n"
            f"    open({str(mark)!r}, 'w').close()\n"
            "    while True:\n"
            "        time.sleep(0.05)\n")
    run = run_child(["-c", code], workdir=str(tmp_path), stop_after=1, timeout=120)
    assert run.status == "stopped" and run.backwards == 1  # the record, written first
    assert mark.exists(), "the program's finally did not run"
    assert run.seconds >= GRACE
