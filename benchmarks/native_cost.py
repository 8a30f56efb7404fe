"""The native helper against the Python paths it can replace, per call, in a tight loop.

    python benchmarks/native_cost.py            # builds the helper first if needed
    python benchmarks/native_cost.py --quick    # a smoke run

1. The DQN loop's training graph (``benchmarks/loops.py``: Q-net 4-64-64-2,
   batch 32, ``gather``, smooth L1 loss; 17 nodes, 12 saved tensors): the
   Python predictor as a watcher calls it (``_predict.predict``), the public
   ``versionwatch.check``, and the native ``check`` on the same roots.
2. Version reads for 6 and 100 tensors: ``_ledger.read_versions`` against the
   native ``VersionSet.versions()`` and ``VersionSet.changed()``.

Each figure is the median over rounds of the mean per call in a round; the
configurations alternate within every round. One torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

import versionwatch
from versionwatch._ledger import read_versions
from versionwatch._native import build as _native_build
from versionwatch._native import loader as _native
from versionwatch._native.selftest import roots_of


def dqn_loss() -> tuple[torch.Tensor, nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    sizes = [4, 64, 64, 2]
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    qnet = nn.Sequential(*layers[:-1])
    states = torch.randn(32, 4)
    actions = torch.randint(0, 2, (32,))
    y = torch.randn(32)
    q = qnet(states).gather(1, actions.unsqueeze(1)).squeeze(1)
    return nn.functional.smooth_l1_loss(q, y), qnet


def per_call(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean time per call, in microseconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: type tables, caches
        for _ in range(min(calls, 200)):
            fn()
    for r in range(rounds):
        order = list(fns.items())
        order = order[r % len(order):] + order[:r % len(order)]
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few calls: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls, rounds = (200, 3) if args.quick else (5000, 15)

    start = time.monotonic()
    built = _native_build.build()
    if not built.ok:
        sys.exit(f"the native helper cannot be built here: {built.line}")
    ext = _native.native()
    if ext is None:
        sys.exit(_native.status())
    print(f"helper: {built.line}" if "already" not in built.line else
          f"helper: {built.line} (this run: {time.monotonic() - start:.1f} s to load)")
    print(_native.status())

    from versionwatch._predict.api import predict

    loss, _ = dqn_loss()
    roots = roots_of([loss])
    report = versionwatch.check(loss)
    nodes, checked, flagged = ext.check(roots)
    assert (nodes, checked, flagged) == (report.nodes, report.saved_checked, 0), (
        nodes, checked, report.nodes, report.saved_checked)
    print(f"\nDQN training graph: {nodes} nodes, {checked} saved tensors "
          f"({calls} calls x {rounds} rounds)")
    graph = per_call({
        "Python predictor (_predict.predict, the watcher's call)":
            lambda: predict(loss, None, "backward", {}),
        "versionwatch.check(loss)": lambda: versionwatch.check(loss),
        "native check(roots)": lambda: ext.check(roots),
        "native check, roots found in Python": lambda: ext.check(roots_of([loss])),
    }, calls, rounds)
    base = graph["Python predictor (_predict.predict, the watcher's call)"]
    print("| call | per call (us) | time / Python predictor's |\n|---|---:|---:|")
    for name, us in graph.items():
        print(f"| {name} | {us:.2f} | {us / base:.3f} |")

    print(f"\nVersion reads ({calls * 4} calls x {rounds} rounds)")
    print("| tensors | read_versions (ns) | VersionSet.versions() (ns) | "
          "VersionSet.changed() (ns) |\n|---:|---:|---:|---:|")
    for n in (6, 100):
        tensors = [nn.Parameter(torch.zeros(3)) for _ in range(n)]
        refs = [weakref.ref(t) for t in tensors]
        vs = ext.VersionSet(refs)
        assert vs.versions() == read_versions(refs) and vs.changed() is False
        got = per_call({
            "read": lambda refs=refs: read_versions(refs),  # type: ignore[misc]
            "versions": vs.versions,
            "changed": vs.changed,
        }, calls * 4, rounds)
        print(f"| {n} | {got['read'] * 1e3:.0f} | {got['versions'] * 1e3:.0f} | "
              f"{got['changed'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
