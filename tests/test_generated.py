"""Random autograd programs (tests/programs.py) through the oracle.

Every backward of every program is predicted by versionwatch and then run by
PyTorch; the oracle asserts that the two agree (fails or not, kind, versions).
``VERSIONWATCH_PROGRAMS=20000`` runs more programs than the default.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from oracle import Oracle, Outcome
from programs import FORWARD_ERRORS, generate, mutation_lines, run_program

N_PROGRAMS = max(2000, int(os.environ.get("VERSIONWATCH_PROGRAMS", "0")))


@dataclass
class CallSite(Oracle):
    """The oracle, also recording each call's path and the program line it came from."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (path, file, line)

    def _record(self, path: str) -> None:
        caller = sys._getframe(2)
        self.calls.append((path, caller.f_code.co_filename, caller.f_lineno))

    def backward(self, outputs: Any, *, inputs: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        if inputs is not None:
            self._record("backward(inputs=)")
        elif isinstance(outputs, (list, tuple)):
            self._record("backward([...])")
        else:
            self._record("backward")
        super().backward(outputs, inputs=inputs, retain_graph=retain_graph,
                         create_graph=create_graph)

    def grad(self, outputs: Any, inputs: Any, *, retain_graph: bool | None = None,
             create_graph: bool = False, allow_unused: bool = False) -> Any:
        self._record("grad")
        return super().grad(outputs, inputs, retain_graph=retain_graph,
                            create_graph=create_graph, allow_unused=allow_unused)


@dataclass
class Result:
    seed: int
    src: str
    outcomes: list[Outcome]
    calls: list[tuple[str, str, int]]
    error: str | None = None  # a mismatch or an unexpected error, with the listing
    forward_error: str | None = None  # one of FORWARD_ERRORS: skipped, counted

    @property
    def failed(self) -> bool:
        return any(o.kind is not None for o in self.outcomes)


def listing(src: str) -> str:
    return "\n".join(f"{i:3}  {line}" for i, line in enumerate(src.splitlines(), start=1))


def _program_line(err: BaseException, filename: str) -> int | None:
    tb = err.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@functools.cache
def result(seed: int) -> Result:
    src = generate(seed)
    oracle = CallSite()
    r = Result(seed, src, oracle.outcomes, oracle.calls)
    try:
        run_program(src, oracle, seed=seed)
    except AssertionError as e:  # the prediction disagreed with PyTorch
        line = _program_line(e, f"<program {seed}>")
        r.error = (f"prediction mismatch in program {seed}, at line {line}:\n"
                   f"{listing(src)}\n\n{type(e).__name__}: {e}")
    except Exception as e:
        msg = str(e)
        if isinstance(e, RuntimeError) and any(f in msg for f in FORWARD_ERRORS):
            r.forward_error = msg
        else:
            line = _program_line(e, f"<program {seed}>")
            r.error = (f"program {seed} raised at line {line}:\n{listing(src)}\n\n"
                       f"{type(e).__name__}: {e}")
    return r


@pytest.mark.parametrize("seed", range(N_PROGRAMS))
def test_program(seed: int) -> None:
    r = result(seed)
    if r.forward_error is not None:
        pytest.skip(f"the forward raised a legitimate in-place error: {r.forward_error}")
    assert r.error is None, r.error


def test_the_mix() -> None:
    """Enough failures and passes, of both kinds, through every backward path."""
    results = [result(seed) for seed in range(N_PROGRAMS)]
    bad = [r.seed for r in results if r.error is not None]
    skipped = [r for r in results if r.forward_error is not None]
    ran = [r for r in results if r.error is None and r.forward_error is None]
    failed = [r for r in ran if r.failed]
    kinds = Counter(o.kind for r in ran for o in r.outcomes if o.kind is not None)
    paths = Counter(c[0] for r in ran for c in r.calls)
    failing_paths = Counter(
        c[0] for r in ran for c, o in zip(r.calls, r.outcomes) if o.kind is not None)
    several = sum(len(r.outcomes) >= 2 for r in ran)
    summary = (f"{len(results)} programs: {len(failed)} failed in PyTorch, "
               f"{len(ran) - len(failed)} passed, {len(skipped)} skipped (forward errors), "
               f"{len(bad)} bad {bad[:10]}; failures by kind {dict(kinds)}; "
               f"calls by path {dict(paths)}; failing calls by path {dict(failing_paths)}; "
               f"{several} programs ran two backwards or more")
    print(summary)
    assert len(results) >= 300, summary
    assert len(skipped) <= 0.02 * len(results), summary
    assert len(failed) >= 0.25 * len(ran), summary
    assert len(ran) - len(failed) >= 0.25 * len(ran), summary
    assert kinds["inplace"] >= 10 and kinds["freed"] >= 10, summary
    for path in ("backward", "backward(inputs=)", "grad", "backward([...])"):
        assert paths[path] >= 20, (path, summary)
    for path in ("backward(inputs=)", "grad"):
        assert failing_paths[path] >= 10, (path, summary)
    assert several >= 0.1 * len(ran), summary


def test_programs_are_deterministic_and_line_numbered() -> None:
    for seed in range(20):
        src = generate(seed)
        assert src == generate(seed)
        assert src.splitlines()[0] == f"# program {seed}"
        lines = src.splitlines()
        for n, name in mutation_lines(src).items():
            code = lines[n - 1].split("#")[0]
            assert name in code and re.search(r"_\(|\+=|\] =", code), (n, lines[n - 1])
        r = result(seed)
        assert r.calls, listing(src)
        for path, filename, n in r.calls:
            # Each backward ran from its own line of "<program SEED>", and
            # linecache can show it (as a future report will).
            assert filename == f"<program {seed}>"
            shown = linecache.getline(filename, n)
            assert shown == lines[n - 1] + "\n"
            assert ("oracle.grad(" if path == "grad" else "oracle.backward(") in shown
    assert any(mutation_lines(generate(seed)) for seed in range(20))


# -- prediction mismatches the generator found, now fixed -------------------------
# CopySlices (the node of an in-place op on a view) wraps that op's own node and
# exposes neither it nor its saved tensors to Python; check() now runs it once on
# zero gradients. Found by this generator at seeds beyond the default range (e.g.
# 1206, 4071, 7946 with VERSIONWATCH_PROGRAMS=20000); minimised here.


def test_inplace_on_view_hides_a_saved_tensor(oracle: Oracle) -> None:
    x = torch.ones(3, requires_grad=True)
    h = x.clone()
    h[:2].relu_()  # CopySlices wraps ReluBackward0, which saves the view's result
    h.add_(1.0)  # bumps that saved result's version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oracle.backward(h.sum())


def test_released_copyslices_fails_a_second_backward(oracle: Oracle) -> None:
    x = torch.ones(3, requires_grad=True)
    h = x.clone()
    h[:2].add_(1.0)  # h.grad_fn is CopySlices; nothing at all is saved
    oracle.backward(h.sum())  # releases CopySlices' wrapped node
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        oracle.backward(h.sum())
