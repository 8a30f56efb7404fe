"""Child processes: started in a process group of their own, ended with everything they started.

The package runs children in four places (``versionwatch run --replay``, the
fix's check runs and its fork server, the native build); all of them start,
wait for and end a child here. A child leads a process group of its own (a new
session), so that

- a terminal's Ctrl-C or a job control signal reaches the parent alone, which
  decides what the child gets (:func:`terminate` forwards a termination);
- one ``killpg`` ends the child with whatever it started (a training script's
  data loader workers, ninja and its compilers), which a kill of its pid alone
  would leave running.

A leaf: the standard library and :mod:`versionwatch._package` only, so that a
child started from anywhere in the package costs no import of torch.

Example::

    proc = start([sys.executable, "-c", "import time; time.sleep(60)"],
                 env=environment(), stdin=subprocess.DEVNULL)
    try:
        finished = wait(proc, timeout=5.0)  # False: it is still running
    finally:
        end(proc)  # SIGKILL to its whole group, then reaped: nothing is left
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from versionwatch._package import PACKAGE_DIR

# Where this very versionwatch is imported from: the folder that holds the package.
SOURCES = os.path.dirname(os.path.dirname(PACKAGE_DIR))
_POSIX = os.name == "posix"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def environment() -> dict[str, str]:
    """The parent's environment, with this very versionwatch importable first.

    The child's ``import versionwatch`` must find the copy that runs here,
    wherever the program's folder, a relative ``PYTHONPATH`` or another
    installed copy would put another one first.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCES, env.get("PYTHONPATH")) if p)
    return env


# ``python -m MODULE`` without the working directory on ``sys.path``: ``-m`` puts it
# first, so a ``json.py`` or ``torch.py`` there would shadow the real module in our
# own imports, which ``python sub/train.py`` never does. ``-P`` (Python 3.11+) is
# not everywhere; a script of the package is: see versionwatch._cli.boot.
def python_module(module: str) -> list[str]:
    """The command line that runs ``module`` as ``python -m`` does, the working directory
    not on its ``sys.path`` (see :mod:`versionwatch._cli.boot`); the child's arguments
    follow it."""
    return [sys.executable, os.path.join(PACKAGE_DIR, "_cli", "boot.py"), module]


def start(argv: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
          stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
          stderr: int | IO[Any] | None = None,
          pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a process group of its own (see the module's doc).

    ``env=None`` inherits this process's environment as it is (a child that
    needs no versionwatch); :func:`environment` gives one that imports ours.
    Raises what :class:`subprocess.Popen` raises (``OSError``: no such program).
    """
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
        # POSIX: a new session, so the child's pid is its group's id. Windows has
        # no sessions: a new process group keeps a console's Ctrl-C from it.
        start_new_session=_POSIX,
        creationflags=0 if _POSIX else subprocess.CREATE_NEW_PROCESS_GROUP,  # type: ignore[attr-defined]
    )


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited, without reaping it where the platform can.

    An exited but unreaped child keeps its pid, so its group's id cannot name
    anyone else's group yet: :func:`kill_group` may still end what it left.
    """
    if proc.returncode is not None:
        return True
    if hasattr(os, "waitid"):
        try:
            return os.waitid(os.P_PID, proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already, on another thread
            return True
    return proc.poll() is not None  # no waitid (macOS, Windows): this reaps it


def wait(proc: subprocess.Popen[bytes], timeout: float | None = None) -> bool:
    """Wait until the child exits, at most ``timeout`` seconds (``None``: for ever).

    True if it exited. Like :func:`exited`, it does not reap the child where
    the platform can wait without reaping.
    """
    if not hasattr(os, "waitid"):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    if timeout is None:
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already, on another thread
            pass
        return True
    # waitid has no timeout: look, as Popen.wait(timeout) does, ever less often
    # up to every 50 ms.
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not exited(proc):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        delay = min(delay * 2, left, 0.05)
        time.sleep(delay)
    return True


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone already is no error.

    PermissionError too: macOS answers it for a group left with zombies only.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the child's whole group; nothing once the child is reaped.

    A reaped child's pid is free, and may name another process's group by now.
    On Windows, where there are no groups to signal, the child alone is killed
    (whatever ``sig``).
    """
    if proc.returncode is not None:
        return
    if _POSIX:
        signal_group(proc.pid, sig)  # the child leads its group: its pid is the group's id
    else:
        proc.kill()


def end(proc: subprocess.Popen[bytes], *, leftovers: bool = True) -> int:
    """Kill the child's whole group and reap the child: its exit status.

    No zombie, and nothing of its group left running. ``leftovers=False``
    kills the group only while the child runs: what a child that has ended by
    itself left running (a compiler's server) is then not ours to end.
    """
    if leftovers or not exited(proc):
        kill_group(proc, signal.SIGKILL)
    return proc.wait()


def terminate(proc: subprocess.Popen[bytes], grace: float = 2.0) -> bool:
    """Forward a termination to the child's group: SIGTERM, then SIGKILL after ``grace`` s.

    The program's own SIGTERM handler gets its say, briefly. The child is not
    reaped (the thread that waits for it does that, with :func:`end`), so this
    may run on any thread. True if the child was still running.
    """
    running = not exited(proc)
    if running:
        kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not exited(proc) and time.monotonic() < deadline:
            time.sleep(0.02)
    kill_group(proc, signal.SIGKILL)
    return running


def tie_to_parent(parent: int, death_fd: int, pdeathsig: bool = True) -> None:
    """The child's side: die with ``parent``, however it dies, with this whole group.

    ``death_fd`` is the read end of a pipe whose only write end the parent
    holds (passed with ``start(..., pass_fds=...)``). On Linux the kernel kills
    this process when its parent dies (``PR_SET_PDEATHSIG``); everywhere, a
    daemon thread kills this group when the pipe closes (the fallback on
    macOS, where there is no ``PR_SET_PDEATHSIG``). ``pdeathsig=False`` leaves
    the pipe alone to do it, as on macOS.
    """
    os.set_inheritable(death_fd, False)  # not the program's to pass on to its children
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the pipe below still ties us
    thread = threading.Thread(target=_await_parent, args=(death_fd,), daemon=True,
                              name="versionwatch-parent")
    thread.start()
    if os.getppid() != parent:  # it died before the tie was made: nothing would tell us
        signal_group(os.getpgrp())


def _await_parent(fd: int) -> None:
    # The parent never writes: the read returns b"" when its end closes, as it
    # does when the parent dies, however it dies.
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    signal_group(os.getpgrp())
