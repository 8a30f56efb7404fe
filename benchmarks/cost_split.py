"""Where watch()'s time goes: its own CPU time per training step, part by part.

overhead.py measures whole steps, which on a busy machine carry a few percent
of noise: more than watch() costs on a compute-bound model. This script instead
times versionwatch's own code from inside the step: it wraps the watcher's
entry points and the predictor's phases with ``time.perf_counter`` and reports
the mean microseconds per step of each, next to the unwatched step time.

It patches private functions (``versionwatch._watch.watcher``, ``_optimizers``,
``_predict``, ``_checker``, ``_graph``, ``_ledger``, ``_sites``), so it follows the code, not
the API: update it when they move (the tables below).
What it cannot see: the Python-level hook dispatch (nn.Module's hook path, the
patched ``autograd.backward`` and ``Optimizer.zero_grad`` wrappers), garbage
collection caused by our allocations, and cache effects on torch's own work.
Those are the gap between the "self time" total here and overhead.py's ratio.

With ``--ablate`` it instead runs overhead.py's interleaved step timing with
one part stubbed out at a time (the saved-tensor checks, all of predict(), the
ledger, the site capture, and all three), which counts what the timers miss.
Stubbing changes behaviour: only for measuring.

Usage:
  python benchmarks/cost_split.py                 # both models
  python benchmarks/cost_split.py --models a --steps 300
  python benchmarks/cost_split.py --ablate --models a
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # the models and the step
    MODELS,
    Config,
    Setup,
    measure,
    step,
    table,
    versionwatch,
)

from versionwatch import _ledger, _sites
from versionwatch._predict import api as _predict
from versionwatch._predict import checker as _checker
from versionwatch._predict import graph as _graph
from versionwatch._report import model as _report
from versionwatch._watch import intercept as _intercept
from versionwatch._watch import optimizers as _optimizers
from versionwatch._watch import watcher as _watch

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += clock() - t
            COUNTS[name] += 1

    return wrapper


def _run_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Time _run_backward without the backward itself (the ``call`` it is given)."""
    clock = time.perf_counter

    def wrapper(self: Any, api: str, outputs: Any, inputs: Any, call: Callable[[], Any],
                *rest: Any) -> Any:
        spent = [0.0]

        def timed_call() -> Any:
            t = clock()
            try:
                return call()
            finally:
                spent[0] += clock() - t

        t = clock()
        try:
            return original(self, api, outputs, inputs, timed_call, *rest)
        finally:
            TOTALS["backward: prediction and events"] += clock() - t - spent[0]
            COUNTS["backward: prediction and events"] += 1

    return wrapper


# Where each event's user's line is looked up (by name, as imported).
_SITE_OWNERS = (_sites, _intercept, _optimizers)
# (owner, attribute, label); the first group is disjoint and sums to the self time.
TOP = [
    (_watch.Watcher, "_on_forward", "forward hooks (2 events)"),
    (_watch.Watcher, "_on_zero_grad", "zero_grad event"),
    (_watch.Watcher, "_on_step_pre", "step pre-hook (sync)"),
    (_watch.Watcher, "_on_step_post", "step post-hook (event)"),
    (_graph._Lease, "dead", "lease release (deep graphs only)"),
]
INNER = [
    (_watch, "predict", "  predict() total"),
    (_graph.Graph, "walk", "    graph walk"),
    (_checker.CHECKER, "run", "    saved-tensor checks"),
    (_predict, "lease", "    lease (taking it)"),
    (_ledger.Ledger, "record", "  ledger.record (all events)"),
    (_ledger.Ledger, "sync", "  ledger.sync"),
    # The user's line: entry points call site_from, the rest user_site, which calls it.
    *((owner, "site_from", "  user's line (all events)") for owner in _SITE_OWNERS),
]


def install() -> Callable[[], None]:
    saved = []
    for owner, attr, label in TOP + INNER:
        original = owner.__dict__[attr]
        saved.append((owner, attr, original))
        setattr(owner, attr, _timed(label, original))
    original = _watch.Watcher.__dict__["_run_backward"]
    saved.append((_watch.Watcher, "_run_backward", original))
    _watch.Watcher._run_backward = _run_backward(original)  # type: ignore[method-assign]

    def uninstall() -> None:
        for owner, attr, original in saved:
            setattr(owner, attr, original)

    return uninstall


def unwatched_median(s: Setup, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def split(s: Setup, steps: int, warmup: int) -> None:
    for _ in range(warmup):
        step(s)
    base = unwatched_median(s, steps)
    uninstall = install()
    try:
        with versionwatch.watch(s.model, s.opt):
            for _ in range(warmup):
                step(s)
            TOTALS.clear()
            COUNTS.clear()
            for _ in range(steps):
                step(s)
    finally:
        uninstall()
    per_step = {k: v / steps * 1e6 for k, v in TOTALS.items()}
    top = ["backward: prediction and events"] + [label for _, _, label in TOP]
    total = sum(per_step.get(k, 0.0) for k in top)
    print(f"\n### {s.label}\n")
    print(f"unwatched median step: {base * 1e3:.3f} ms; {steps} watched steps timed\n")
    print("| part | us per step | share of self time | % of unwatched step |")
    print("|---|---:|---:|---:|")
    for label in dict.fromkeys(top + [label for _, _, label in INNER]):
        us = per_step.get(label, 0.0)
        name = label.replace("  ", "&nbsp;&nbsp;") if label.startswith(" ") else label
        print(f"| {name} | {us:.1f} | {us / total:.0%} | {us / (base * 1e6):.2%} |")
    print(f"| **self time total** | **{total:.1f}** | 100% | **{total / (base * 1e6):.2%}** |")


@contextlib.contextmanager
def _stubbed(s: Setup, checks: bool = False, predict: bool = False, ledger: bool = False,
             site: bool = False) -> Any:
    saved = [(_watch, "predict"), *((o, "site_from") for o in _SITE_OWNERS),
             (_ledger.Ledger, "record"),
             (_ledger.Ledger, "sync"), (_checker.CHECKER, "run")]
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr in saved]
    if predict:
        _watch.predict = lambda *a, **k: _report.Report()  # type: ignore[assignment]
    if site:
        for owner in _SITE_OWNERS:
            owner.site_from = lambda frame: None  # type: ignore[attr-defined]
    if ledger:
        _ledger.Ledger.record = lambda self, *a, **k: _ledger.Event(0, "x", "x")  # type: ignore[assignment]
        _ledger.Ledger.sync = lambda self, *a, **k: None  # type: ignore[assignment]
    if checks:
        _checker.CHECKER.run = lambda self, *a, **k: None  # type: ignore[assignment]
    try:
        with versionwatch.watch(s.model, s.opt):
            yield
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)


def ablate(s: Setup, steps: int, repeats: int) -> None:
    null = contextlib.nullcontext
    variants: list[tuple[str, dict[str, bool]]] = [
        ("watch", {}),
        ("watch without the saved-tensor checks", {"checks": True}),
        ("watch without predict()", {"predict": True}),
        ("watch without the ledger", {"ledger": True}),
        ("watch without user_site", {"site": True}),
        ("hooks only (all three stubbed)", {"predict": True, "ledger": True, "site": True}),
    ]
    configs: list[Config] = [("unwatched", lambda s: null(), null)]
    for name, kw in variants:
        configs.append((name, lambda s, kw=kw: _stubbed(s, **kw), null))
    results = measure(s, configs, steps, repeats, warmup=30, block_warm=1)
    print(f"\n### {s.label}: ablation, {repeats} rounds x {steps} steps\n")
    print(table(results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="a,b")
    p.add_argument("--steps", type=int, help="timed steps (default: 400 for a, 20 for b)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ablate", action="store_true", help="time steps with parts stubbed out")
    p.add_argument("--repeats", type=int, default=60, help="rounds for --ablate")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    for key in [k.strip() for k in args.models.split(",") if k.strip()]:
        s = MODELS[key]()
        if args.ablate:
            ablate(s, args.steps or (5 if key == "a" else 1), args.repeats)
            continue
        steps = args.steps or (400 if key == "a" else 20)
        split(s, steps, warmup=30 if key == "a" else 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
