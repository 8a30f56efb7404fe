"""``versionwatch fix`` runs the program many times and changes nothing of the user's.

The program below has every side effect a training script has: it resumes from a
checkpoint and writes it back, appends to a log, deletes a file, writes into a
subfolder and talks to a server on 127.0.0.1. ``fix`` and ``fix --apply`` must
leave the user's folder byte-identical (names, bytes, modes), except for the
lines ``--apply`` patches, and the server must see the check runs: they ran,
in a scratch copy of the folder.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PROGRAMS = Path(__file__).parent / "fix_programs"

# Prepended to the seed story: the side effects happen before its failure.
SIDE_EFFECTS = '''\
import json, os, pathlib, socket
state = pathlib.Path("ckpt.json")
step = json.loads(state.read_text())["step"] if state.exists() else 0
state.write_text(json.dumps({"step": step + 1}))
with open("logs/train.log", "a") as log:
    log.write(f"resumed at {step}\\n")
if os.path.exists("stale.tmp"):
    os.remove("stale.tmp")
pathlib.Path("out").mkdir(exist_ok=True)
pathlib.Path("out/sample.txt").write_text("sample")
with socket.create_connection(("127.0.0.1", int(os.environ["VW_TEST_PORT"])), timeout=10) as s:
    s.sendall(b"hello")
'''


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under ``root``: its mode, and its bytes (a file) or target (a link)."""
    seen: dict[str, tuple[int, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            seen[str(path.relative_to(root))] = (st.st_mode, os.readlink(path))
        elif path.is_file():
            seen[str(path.relative_to(root))] = (st.st_mode, path.read_bytes())
        else:
            seen[str(path.relative_to(root))] = (st.st_mode, "")
    return seen


@pytest.fixture
def server() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on 127.0.0.1 that keeps what each connection sent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    got: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                got.append(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], got
    listener.close()
    thread.join(5)


@pytest.mark.parametrize("apply", [False, True], ids=["fix", "fix --apply"])
def test_check_runs_leave_the_users_folder_as_it_was(
        tmp_path: Path, server: tuple[int, list[bytes]], apply: bool) -> None:
    port, got = server
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    (work / "logs").mkdir(parents=True)
    tmp.mkdir()
    (work / "train.py").write_text(
        SIDE_EFFECTS + (PROGRAMS / "seed_story.py").read_text(encoding="utf-8"),
        encoding="utf-8")
    (work / "ckpt.json").write_text('{"step": 100}')
    (work / "logs" / "train.log").write_text("resumed at 99\n")
    (work / "stale.tmp").write_text("old")
    (work / "data.bin").write_bytes(bytes(range(256)))
    os.chmod(work / "data.bin", 0o640)
    os.symlink("data.bin", work / "latest")
    before = _snapshot(work)
    env = dict(os.environ, PYTHONPATH=str(SRC), TMPDIR=str(tmp), VW_TEST_PORT=str(port))
    report = tmp_path / "fix.json"
    done = subprocess.run(
        [sys.executable, "-m", "versionwatch", "fix", "--json", str(report),
         *(["--apply"] if apply else []), "train.py"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == (0 if apply else 1), done.stdout + done.stderr
    assert "verified: one `optim.step()` after both backwards" in done.stdout
    # Every check run talked to the server (the original, the reference, each candidate).
    assert len(got) >= 4 and set(got) == {b"hello"}
    after = _snapshot(work)
    patched, original = after.pop("train.py"), before.pop("train.py")
    assert after == before
    assert [p.name for p in tmp.iterdir() if p.name.startswith("versionwatch")] == []
    if not apply:
        assert patched == original
        return
    assert "applied the first verified patch to train.py" in done.stdout
    assert patched[0] == original[0] and patched[1] != original[1]
    # What changed is exactly the patch the report shows, as git applies it.
    diff = json.loads(report.read_text(encoding="utf-8"))["hazards"][0]["fixes"][0]["diff"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "train.py").write_bytes(bytes(original[1]))
    (fresh / "fix.patch").write_text(diff, encoding="utf-8")
    subprocess.run(["git", "apply", "fix.patch"], cwd=fresh, check=True)
    assert (fresh / "train.py").read_bytes() == patched[1]
