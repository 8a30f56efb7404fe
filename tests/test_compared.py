"""docs/compared.md says what benchmarks/compared.py finds: its facts table is regenerated here.

The script runs each tool on the seed story's program (a quick run: 3 timed rounds, no
timing is asserted) and reads from each one's output what it names. The doc's facts
table was pasted from a run on torch 2.13 with torchviz installed; every row of a tool
present in this environment must match it cell for cell, and a tool absent here must be
reported as absent for the reason the probe gives (DebugMode: "not in this torch").
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compared.py"
DOC = ROOT / "docs" / "compared.md"
BEGIN, END = "<!-- facts: begin (benchmarks/compared.py) -->", "<!-- facts: end -->"
ABSENT = ("not in this torch", "not installed")


def table(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


def section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def quick() -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("PYTEST_CURRENT_TEST", None)
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def doc_facts() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "docs/compared.md lost its facts table markers"
    return table(text.split(BEGIN, 1)[1].split(END, 1)[0])


def test_facts_table_matches_the_doc_for_every_tool_present(quick: str) -> None:
    ours, doc = table(section(quick, "facts")), doc_facts()
    assert ours[0] == doc[0], (ours[0], doc[0])                  # the header
    assert [r[0] for r in ours] == [r[0] for r in doc]          # the same tools, in order
    compared = 0
    for row, want in zip(ours[1:], doc[1:]):
        if row[1] in ABSENT:
            assert all(not c for c in row[2:]), row
            continue
        assert row == want, f"\nscript: {row}\ndoc:    {want}"
        compared += 1
    assert compared >= 6, ours   # torch alone, anomaly, allow_mutation, three versionwatch rows


def test_debug_mode_is_probed_not_assumed(quick: str) -> None:
    rows = {r[0]: r for r in table(section(quick, "facts"))}
    has = importlib.util.find_spec("torch.utils._debug_mode") is not None
    if has:
        from torch.utils import _debug_mode
        has = hasattr(_debug_mode, "DebugMode")
    for label in ("`DebugMode()`", "`DebugMode(record_stack_trace=True)`"):
        assert (rows[label][1] == "not in this torch") is (not has), rows[label]
    torchviz = importlib.util.find_spec("torchviz") is not None
    assert (rows["`torchviz make_dot(loss2, params)`"][1] == "not installed") is (not torchviz)


def test_the_doc_states_what_the_run_shows(quick: str) -> None:
    doc = DOC.read_text(encoding="utf-8")
    # allow_mutation_on_saved_tensors and repair end with the same weights, as the doc says
    assert "(bitwise equal)" in quick, quick
    assert "bitwise-equal" in doc
    # torch's own message, the same in the script's run and the doc
    plain = section(quick, "torch alone").split("```text\n", 1)[1].split("\n```", 1)[0]
    assert plain in doc, plain
    # every present tool has a cost row with its ratios
    costs = {r[0]: r for r in table(section(quick, "cost: median of 3 runs each, interleaved"))}
    for label, row in costs.items():
        if label != "tool" and row[1] not in ABSENT:
            assert row[2].endswith("x") and row[4].endswith("x"), row
    assert costs["`torch alone`"][2] == "1.00x"
    # the command that reproduces the numbers
    assert "python benchmarks/compared.py" in doc


def test_bad_repeats_is_a_usage_error() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "0"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 2 and "--repeats must be at least 1" in p.stderr, p.stderr
