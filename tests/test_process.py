"""versionwatch._process: a child leads its own group, and ends with everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import versionwatch
from versionwatch._process import (
    SOURCES,
    end,
    environment,
    exited,
    signal_group,
    start,
    terminate,
    wait,
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

# A child that starts a grandchild (in its group), says the grandchild's pid, then sleeps.
_PARENT_OF_SLEEPER = (
    "import sys, time\n"
    "from subprocess import Popen\n"
    "p = Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def _with_grandchild(sleep: float) -> tuple[subprocess.Popen[bytes], int]:
    proc = start([sys.executable, "-c", _PARENT_OF_SLEEPER, str(sleep)],
                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    proc.stdout.close()
    return proc, grandchild


def test_the_child_leads_a_group_of_its_own(no_process_left: None) -> None:
    proc = start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # A terminal's Ctrl-C (sent to our group) does not reach it.
        assert os.getpgid(proc.pid) == proc.pid != os.getpgrp()
    finally:
        assert end(proc) == -signal.SIGKILL
    assert not _alive(proc.pid)


def test_end_kills_the_grandchild_with_the_child_and_reaps(no_process_left: None) -> None:
    proc, grandchild = _with_grandchild(60)
    assert _alive(grandchild) and os.getpgid(grandchild) == proc.pid
    assert end(proc) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL  # reaped: no zombie of ours
    assert _gone(grandchild), "the group kill left the grandchild running"


def test_a_timeout_returns_and_leaves_the_child_running(no_process_left: None) -> None:
    proc = start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        began = time.monotonic()
        assert wait(proc, 0.3) is False
        assert 0.3 <= time.monotonic() - began < 5
        assert not exited(proc) and _alive(proc.pid)
    finally:
        end(proc)


def test_wait_does_not_reap_so_the_group_kill_reaches_what_the_child_left(
        no_process_left: None) -> None:
    proc, grandchild = _with_grandchild(0)
    assert wait(proc, 30) is True
    # Exited, not reaped: its pid still names its group.
    assert exited(proc) and proc.returncode is None
    assert _alive(grandchild)
    assert end(proc) == 0  # its own exit status, though its group was killed
    assert _gone(grandchild), "the leftover grandchild survived end()"


def test_end_without_leftovers_spares_what_a_finished_child_left(
        no_process_left: None) -> None:
    proc, grandchild = _with_grandchild(0)
    try:
        assert wait(proc, 30) is True
        assert end(proc, leftovers=False) == 0
        time.sleep(0.2)
        assert _alive(grandchild)
    finally:
        signal_group(proc.pid)  # the group outlives its leader while the grandchild lives
    assert _gone(grandchild)


def test_terminate_lets_a_sigterm_handler_run_first(tmp_path: Path,
                                                   no_process_left: None) -> None:
    said = tmp_path / "said"
    code = ("import os, signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(said)!r}, 'w').write('bye')\n"
            "    os._exit(3)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = start([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    assert terminate(proc) is True
    assert end(proc) == 3
    assert said.read_text() == "bye"
    assert terminate(proc) is False  # ended already: nothing was running


def test_terminate_kills_a_child_that_ignores_sigterm(no_process_left: None) -> None:
    code = ("import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = start([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    began = time.monotonic()
    assert terminate(proc, grace=0.3) is True
    assert time.monotonic() - began < 5
    assert end(proc) == -signal.SIGKILL


def test_environment_puts_this_versionwatch_first(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(versionwatch.__file__)))
    assert os.path.samefile(SOURCES, here)
    # Another versionwatch, first on the inherited PYTHONPATH: ours still wins.
    (tmp_path / "versionwatch").mkdir()
    (tmp_path / "versionwatch" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    env = environment()
    assert env["PYTHONPATH"].split(os.pathsep) == [SOURCES, str(tmp_path)]
    code = "import importlib.util; print(importlib.util.find_spec('versionwatch').origin)"
    elsewhere = tmp_path / "elsewhere"  # `-c` puts its folder first: not the other copy's
    elsewhere.mkdir()
    found = subprocess.run([sys.executable, "-c", code], env=env, cwd=elsewhere,
                           capture_output=True, text=True, timeout=60, check=True)
    assert os.path.samefile(found.stdout.strip(), versionwatch.__file__)
    # The parent's own environment is left as it was.
    assert os.environ["PYTHONPATH"] == str(tmp_path)


def test_a_child_tied_by_its_pipe_ends_with_its_group_when_the_parent_is_killed(
        no_process_left: None) -> None:
    # P starts C tied to it by a pipe alone (as `versionwatch fix --fresh` ties a run);
    # C starts a sleep G in its group. P is killed: C's thread sees the pipe close and
    # kills C's group, G with it (PR_SET_PDEATHSIG would kill C alone, first).
    child = ("import os, subprocess, sys, time\n"
             "from versionwatch._process import tie_to_parent\n"
             "tie_to_parent(int(sys.argv[1]), int(sys.argv[2]), pdeathsig=False)\n"
             "p = subprocess.Popen(['sleep', '60'])\n"
             "print(os.getpid(), p.pid, flush=True)\n"
             "time.sleep(60)\n")
    parent = ("import os, sys, time\n"
              "from versionwatch._process import environment, start\n"
              "r, w = os.pipe()\n"
              f"start([sys.executable, '-c', {child!r}, str(os.getpid()), str(r)],\n"
              "      pass_fds=(r,), env=environment())\n"
              "os.close(r)\n"
              "time.sleep(60)\n")
    proc = start([sys.executable, "-c", parent], env=environment(), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    c, g = (int(x) for x in proc.stdout.readline().split())
    proc.stdout.close()
    assert _alive(c) and _alive(g) and os.getpgid(g) == c != proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    assert end(proc) == -signal.SIGKILL
    assert _gone(c), "the tied child outlived its parent"
    assert _gone(g), "what the tied child started outlived its parent"
