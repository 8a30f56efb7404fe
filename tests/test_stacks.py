"""Other threads' stacks, read in one step (versionwatch._sites): what waiting predictions
and the gradient-hook check read instead of walking another thread's ``f_back``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from versionwatch import _sites
from versionwatch._watch import inflight as _inflight

JOIN_S = 60.0


@contextmanager
def _held_in(fn: Callable[[threading.Event, threading.Event], None]) -> Iterator[int]:
    inside, leave = threading.Event(), threading.Event()
    t = threading.Thread(target=fn, args=(inside, leave))
    t.start()
    try:
        assert inside.wait(JOIN_S)
        assert t.ident is not None
        yield t.ident
    finally:
        leave.set()
        t.join(JOIN_S)


def test_another_threads_stack_innermost_first_by_its_ident() -> None:
    def outer(inside: threading.Event, leave: threading.Event) -> None:
        inner(inside, leave)

    def inner(inside: threading.Event, leave: threading.Event) -> None:
        inside.set()
        leave.wait(JOIN_S)

    with _held_in(outer) as ident:
        stacks = _sites.thread_stacks()
        names = [f.name for f in stacks[ident].frames]
        # threading's wait frames on top, then ours, then threading's bootstrap.
        assert names.index("inner") < names.index("outer") < names.index("_bootstrap")
        assert stacks[ident].frames[names.index("inner")].file == __file__
        assert not stacks[ident].cut
        assert stacks[threading.get_ident()].frames[0].name == "thread_stacks"


def test_a_stack_over_a_hundred_frames_is_cut_and_counts_as_the_programs() -> None:
    def deep(n: int, inside: threading.Event, leave: threading.Event) -> None:
        if n:
            deep(n - 1, inside, leave)
            return
        inside.set()
        leave.wait(JOIN_S)

    with _held_in(lambda i, w: deep(150, i, w)) as ident:
        stack = _sites.thread_stacks()[ident]
        assert stack.cut
        assert len(stack.frames) == 100  # faulthandler's own limit
        # Not the engine's entry in what was read, the program's code in it: the
        # thread may be in a hook far above the engine, so no prediction waits for it.
        assert _inflight._runs_program_code(stack, stop_at_backward=True)


def test_non_ascii_paths_compare_as_faulthandler_writes_them(tmp_path: Path) -> None:
    name = str(tmp_path / "zoë-日本" / "train.py")
    space: dict[str, object] = {}
    exec(compile("def held(inside, leave):\n    inside.set()\n    leave.wait(60)\n",
                 name, "exec"), space)
    held = space["held"]
    with _held_in(held) as ident:  # type: ignore[arg-type]
        files = [f.file for f in _sites.thread_stacks()[ident].frames]
        assert _sites.as_dumped(name) in files
        assert name not in files  # written escaped, never as is
    assert _sites.as_dumped("zoë日\U0001f600") == "zo\\xeb\\u65e5\\U0001f600"


def test_parse_reads_each_thread_and_its_frames() -> None:
    text = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/a/b.py", line 3 in f\n'
        '  File "/a/"quoted".py", line ??? in <module>\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/c.py", line 1 in g\n'
        "  ...\n"
    )
    got = _sites.parse_stacks(text)
    assert got[0x7F0000000001] == _sites.Stack(
        (_sites.StackFrame("/a/b.py", "f"), _sites.StackFrame('/a/"quoted".py', "<module>")), False)
    assert got[0x7F0000000002] == _sites.Stack((_sites.StackFrame("/c.py", "g"),), True)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_one_descriptor_for_the_process_and_no_file_on_disk(tmp_path: Path) -> None:
    _sites.thread_stacks()
    before = _open_fds()
    for _ in range(50):
        _sites.thread_stacks()
    assert _open_fds() == before


FORKED = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
from versionwatch import _sites
me = threading.get_ident()
assert _sites.thread_stacks()[me].frames
pid = os.fork()
if pid == 0:
    # The child's dumps must not write at the parent's offset in a shared file.
    for _ in range(20):
        assert [f.name for f in _sites.thread_stacks()[threading.get_ident()].frames] == ["thread_stacks", "<module>"]
    os._exit(0)
for _ in range(20):
    assert [f.name for f in _sites.thread_stacks()[me].frames] == ["thread_stacks", "<module>"]
_, status = os.waitpid(pid, 0)
assert status == 0, status
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_reads_its_own_stacks_beside_its_parent() -> None:
    src = str(Path(_sites.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", FORKED, src], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
