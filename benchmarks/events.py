"""What versionwatch adds to each event of a small-model training step, in microseconds.

A DQN-sized Q-net (4 -> 64 -> 64 -> 2, ReLU; batch 32 for training, 1 for
acting) with Adam. Every iteration times, each alone with
``time.perf_counter``: a forward under ``torch.no_grad()`` (acting), a
forward with grad and its loss, ``zero_grad()``, ``backward()`` and
``step()``; then ten forwards under ``no_grad`` in a row (an acting loop's
steady state, caches warm), timed together. Each round runs one block of
iterations per configuration, rotating which goes first; the extra cost of an event is the median, over rounds, of the
configuration's block median minus the same round's plain block median. Torch
runs on one thread.

Configurations: ``plain``; ``watch`` (``versionwatch.watch(qnet, opt)``);
``watch_all`` (``versionwatch.watch_all()``, what ``versionwatch run`` uses);
``strict`` (``watch(qnet, opt, strict=True)``).

Usage:
  python benchmarks/events.py                  # the table, as text
  python benchmarks/events.py --markdown       # the table for docs/performance.md
  python benchmarks/events.py --update-docs    # rewrite that table in docs/performance.md
  python benchmarks/events.py --quick          # smoke run: seconds, numbers meaningless
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN, END = "<!-- events.py: begin -->", "<!-- events.py: end -->"
EVENTS = ("forward, no_grad", "forward with grad", "zero_grad", "backward", "step",
          "forward, no_grad, 10 in a row (each)")
STEP_EVENTS = 5  # the events of one iteration; the last row is measured apart from it


def qnet() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))


def iteration(model: nn.Module, opt: torch.optim.Optimizer, act: torch.Tensor,
              x: torch.Tensor, y: torch.Tensor, out: list[list[float]]) -> None:
    clock = time.perf_counter
    t0 = clock()
    with torch.no_grad():
        model(act)
    t1 = clock()
    loss = nn.functional.mse_loss(model(x), y)
    t2 = clock()
    opt.zero_grad()
    t3 = clock()
    loss.backward()
    t4 = clock()
    opt.step()
    t5 = clock()
    with torch.no_grad():
        for _ in range(10):
            model(act)
    t6 = clock()
    for k, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
        out[k].append(b - a)
    out[5].append((t6 - t5) / 10)


Config = tuple[str, Callable[[nn.Module, torch.optim.Optimizer],
                             contextlib.AbstractContextManager[object]]]
CONFIGS: list[Config] = [
    ("plain", lambda m, o: contextlib.nullcontext()),
    ("watch", lambda m, o: versionwatch.watch({"qnet": m}, o)),
    ("watch_all", lambda m, o: versionwatch.watch_all()),
    ("strict", lambda m, o: versionwatch.watch({"qnet": m}, o, strict=True)),
]


def measure(rounds: int, block: int, warmup: int) -> tuple[dict[str, list[float]],
                                                           dict[str, list[float]]]:
    """Per configuration: the plain median per event (µs) and the extra µs per event."""
    torch.manual_seed(0)
    model = qnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    act, x, y = torch.randn(1, 4), torch.randn(32, 4), torch.randn(32, 2)
    for _, make in CONFIGS:
        with make(model, opt):
            for _ in range(warmup):
                iteration(model, opt, act, x, y, [[] for _ in EVENTS])
    medians: dict[str, list[list[float]]] = {name: [] for name, _ in CONFIGS}
    for r in range(rounds):
        k = r % len(CONFIGS)
        for name, make in CONFIGS[k:] + CONFIGS[:k]:
            out: list[list[float]] = [[] for _ in EVENTS]
            with make(model, opt):
                for _ in range(block):
                    iteration(model, opt, act, x, y, out)
            medians[name].append([statistics.median(ts) * 1e6 for ts in out])
    plain = {name: [statistics.median(m[e] for m in medians["plain"]) for e in range(len(EVENTS))]
             for name in medians}
    extra = {name: [statistics.median(m[e] - p[e] for m, p in zip(ms, medians["plain"]))
                    for e in range(len(EVENTS))] for name, ms in medians.items()}
    return plain, extra


def markdown(plain: list[float], extra: dict[str, list[float]], header: str) -> str:
    names = [n for n, _ in CONFIGS if n != "plain"]
    lines = [header, "",
             "| event | plain (µs) | " + " | ".join(f"{n} (extra µs)" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for e, event in enumerate(EVENTS[:STEP_EVENTS]):
        cells = " | ".join(f"{extra[n][e]:+.1f}" for n in names)
        lines.append(f"| {event} | {plain[e]:.1f} | {cells} |")
    total = sum(plain[:STEP_EVENTS])
    cells = " | ".join(f"{sum(extra[n][:STEP_EVENTS]):+.1f} "
                       f"({(total + sum(extra[n][:STEP_EVENTS])) / total:.2f}x)" for n in names)
    lines.append(f"| whole iteration | {total:.1f} | {cells} |")
    e = STEP_EVENTS
    cells = " | ".join(f"{extra[n][e]:+.1f}" for n in names)
    lines.append(f"| {EVENTS[e]} | {plain[e]:.1f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds of interleaved blocks")
    p.add_argument("--block", type=int, default=50, help="iterations per block")
    p.add_argument("--warmup", type=int, default=100, help="untimed iterations per configuration")
    p.add_argument("--quick", action="store_true", help="smoke run: numbers meaningless")
    p.add_argument("--markdown", action="store_true", help="print the table for the docs")
    p.add_argument("--update-docs", action="store_true",
                   help=f"rewrite the table between the markers in {DOCS.name}")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.block, args.warmup = 2, 3, 2
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    plain, extra = measure(args.rounds, args.block, args.warmup)
    header = (f"torch {torch.__version__}, Python {platform.python_version()}, one torch "
              f"thread, {args.rounds} rounds x {args.block} iterations per configuration, "
              f"load average {load:.1f} at the start; {time.perf_counter() - t0:.0f} s.")
    table = markdown(plain["plain"], extra, header)
    if args.update_docs:
        text = DOCS.read_text()
        pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
        if not pattern.search(text):
            p.error(f"{DOCS} has no {BEGIN} ... {END} markers")
        DOCS.write_text(pattern.sub(lambda m: f"{BEGIN}\n{table}\n{END}", text))
        print(f"updated {DOCS}")
    if args.markdown or not args.update_docs:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
