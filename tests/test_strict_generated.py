"""Strict mode over the generated programs: each failure is traced to its exact line.

Every program runs under ``watch_all(strict=True)`` with a recording policy, so
writes proceed as in an unwatched run. The oracle still checks every prediction
against PyTorch (strict mode's saved-tensor hooks must not change any outcome).
Then, for each backward PyTorch rejected with an in-place error, the prediction
names the write: a ``inplace_op`` modification at a line the program marks
``# mutates:``. Backwards PyTorch accepted are never flagged (the generated
programs make no ``.data`` writes, so there is no silent case here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import versionwatch
from oracle import Oracle
from programs import generate, mutation_lines, run_program

N = max(2000, int(os.environ.get("VERSIONWATCH_STRICT_PROGRAMS", "0")))


@pytest.fixture(scope="module")
def strict_watcher() -> Iterator[versionwatch.Watcher]:
    with versionwatch.watch_all(strict=True, on_hazard=lambda report: None) as w:
        yield w


def test_strict_mode_names_the_exact_write(strict_watcher: versionwatch.Watcher) -> None:
    failed = traced = 0
    for seed in range(N):
        src = generate(seed)
        oracle = Oracle()
        outcomes = run_program(src, oracle, seed=seed)  # asserts prediction == PyTorch
        marked = mutation_lines(src)
        for outcome, report in zip(outcomes, oracle.reports):
            if outcome.kind is None:
                assert report.ok, f"program {seed}: flagged a backward PyTorch accepts\n{src}"
                continue
            if outcome.kind != "inplace":
                continue
            failed += 1
            first = report.hazards[0]
            writes = [m for h in report.hazards if h.order == first.order
                      for m in h.modified_by if m.kind == "inplace_op"]
            assert writes, f"program {seed}: no write recorded for\n{report}\n{src}"
            lines = {m.site.line for m in writes if m.site is not None}
            files = {m.site.file for m in writes if m.site is not None}
            assert files == {f"<program {seed}>"}, (files, src)
            assert lines <= set(marked), (
                f"program {seed}: writes at {sorted(lines)}, mutations at {sorted(marked)}\n"
                f"{report}\n{src}")
            traced += 1
    assert failed >= N // 5, failed
    assert traced == failed
