"""Independent subprocesses of one test, run side by side.

A test that compares a plain run with a watched one (or runs several programs
that do not depend on each other) starts them together: pytest runs tests on
one core, and each child spends most of its time importing torch, so a second
core runs the other at no cost to what is asserted. Each child gets exactly the
arguments, input, folder and environment it would get alone.
"""

from __future__ import annotations

import subprocess
from typing import Any


def run_all(*runs: tuple[list[str], dict[str, Any]],
            timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """``subprocess.run(argv, capture_output=True, text=True, **kw)`` for each ``(argv, kw)``,
    all started at once; the results in the same order."""
    procs: list[tuple[subprocess.Popen[str], list[str], str | None]] = []
    try:
        for argv, kw in runs:
            kw = dict(kw)
            stdin = kw.pop("input", None)
            p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else None,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
            procs.append((p, argv, stdin))
        done = []
        for p, argv, stdin in procs:
            out, err = p.communicate(stdin, timeout=timeout)
            done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
        return done
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
