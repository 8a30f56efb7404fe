from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from oracle import Oracle


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def oracle() -> Oracle:
    return Oracle()

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skips cleanly without one)")
    config.addinivalue_line("markers", "compile: compiles with inductor (tens of seconds)")


# Every process a multi-process test starts inherits this variable from os.environ
# (spawned ranks, torchrun and its ranks, CLI subprocesses), so /proc finds them all,
# reparented or not, whatever killed their parent.
PROCESS_TAG = "VW_TEST_PROCESS_TAG"


def tagged_processes(tag: str) -> list[str]:
    """Live processes (not zombies) whose environment has ``PROCESS_TAG=tag``."""
    mark = f"{PROCESS_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if state != b"Z" and mark in env:
            found.append(f"{entry}: {cmd}")
    return found


@contextlib.contextmanager
def processes_checked(name: str) -> Iterator[None]:
    """Fail if a process started inside the block is still alive after it."""
    if not os.path.isdir("/proc"):
        yield
        return
    # multiprocessing's resource tracker serves this pytest process until it
    # ends: started here, untagged, it is not the test's.
    resource_tracker.ensure_running()
    tag = f"{os.getpid()}.{time.monotonic_ns()}"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(PROCESS_TAG, tag)
        yield
    # A rank killed a moment ago may still be on its way out.
    deadline = time.monotonic() + 10
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"{name} left processes behind: {left}"


@pytest.fixture
def no_process_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if a process it started is still alive after it."""
    with processes_checked(request.node.name):
        yield


@pytest.fixture(scope="session")
def demo_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[
        subprocess.CompletedProcess[str], Path]:
    """``versionwatch demo`` with the native helper off, run once for the session in a
    folder of its own: tests/test_cli.py checks what it says, tests/test_native.py that
    the helper asked for and impossible says exactly the same (a demo is ~15 s)."""
    folder = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERSIONWATCH_NATIVE", "VERSIONWATCH_NATIVE_FAULT")}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VERSIONWATCH_NATIVE"] = "0"
    done = subprocess.run([sys.executable, "-m", "versionwatch", "demo"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    return done, folder
