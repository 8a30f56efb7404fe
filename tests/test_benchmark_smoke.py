"""benchmarks/overhead.py runs end to end (a smoke run: no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"
CONFIGS = ("unwatched", "watch", "detect_anomaly", "allow_mutation")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def table_rows(out: str) -> list[list[str]]:
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def test_quick_run_prints_a_table_per_model_with_every_configuration() -> None:
    p = run("--quick")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("| configuration |") == 2, p.stdout  # models a and b
    names = [r[0] for r in table_rows(p.stdout) if r[0] != "configuration"]
    for config in CONFIGS:
        assert names.count(config) == 2, (config, p.stdout)
    for row in table_rows(p.stdout):
        if row[0] in CONFIGS:
            assert float(row[1]) > 0 and row[2].endswith("x"), row


def test_quick_run_of_one_model_with_strict_flag() -> None:
    p = run("--quick", "--models", "a", "--strict", "--steps", "1", "--repeats", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("| configuration |") == 1, p.stdout
    names = [r[0] for r in table_rows(p.stdout)]
    assert all(c in names for c in CONFIGS), p.stdout
    # watch(strict=True) is timed when watch() takes it, else skipped with a note.
    assert "watch_strict" in names or "--strict ignored" in p.stderr, (p.stdout, p.stderr)


def test_unknown_model_is_an_error() -> None:
    p = run("--quick", "--models", "z")
    assert p.returncode != 0
    assert "unknown model" in p.stderr


def test_predict_cost_quick_prints_both_models() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "predict_cost.py"
    r = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| chain of 2,000 sin nodes | 2,002 | 2,000 |" in r.stdout
    assert "6-layer TransformerEncoder" in r.stdout and "us per saved tensor" in r.stdout


def test_repair_benchmark_quick_prints_both_parts() -> None:
    script = ROOT / "benchmarks" / "repair.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, str(script), "--quick", "--models", "a"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    names = [row[0] for row in table_rows(r.stdout)]
    for config in ("unwatched", "watch", "watch_repair", "hand_clone", "watch_hand_clone",
                   "allow_mutation"):
        assert config in names, r.stdout
    assert "split: at forward" in r.stdout and "repair vs default mode" in r.stdout


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_loops_quick_times_both_loops_under_every_configuration() -> None:
    p = _script("loops.py", "--quick")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "### DQN" in p.stdout and "### A2C" in p.stdout, p.stdout
    names = [r[0] for r in table_rows(p.stdout) if r[0] != "configuration"]
    for config in ("unwatched", "watch", "watch_all", "strict"):
        assert names.count(config) == 2, (config, p.stdout)


def test_events_quick_prints_one_row_per_event(tmp_path: Path) -> None:
    p = _script("events.py", "--quick", "--markdown")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r[0]: r for r in table_rows(p.stdout)}
    for event in ("forward, no_grad", "forward with grad", "zero_grad", "backward", "step",
                  "whole iteration", "forward, no_grad, 10 in a row (each)"):
        assert len(rows[event]) == 5, p.stdout  # plain, then watch, watch_all, strict
    # The table in the docs page is the one this script writes between its markers.
    text = (ROOT / "docs" / "performance.md").read_text()
    assert "<!-- events.py: begin -->" in text and "<!-- events.py: end -->" in text
