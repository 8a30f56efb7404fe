"""What a watcher adds to ``optimizer.step()``, as a ratio to a plain step, in one run.

The step path is hot: an optimizer is named once (at ``watch()`` or its first
step), never at every step. This times ``opt.step()`` alone (gradients left in
place, so each step is the same work) on a small MLP with SGD and with Adam,
plain, under ``versionwatch.watch(model, opt)`` and under ``watch_all()``
(``versionwatch run``). Each round runs one block per configuration, rotating
which goes first; a configuration's ratio is the median over rounds of its
block median over the same round's plain block median (CPU clock, one thread).

Compare two checkouts back to back on the same machine:
  PYTHONPATH=src python benchmarks/step_names.py
  PYTHONPATH=/path/to/other/src python benchmarks/step_names.py

Usage:
  python benchmarks/step_names.py            # the ratios
  python benchmarks/step_names.py --quick    # smoke run: seconds, numbers meaningless
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn

try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch


def _block(opt_d: torch.optim.Optimizer, steps: int) -> float:
    """The median time of one ``opt_d.step()`` over ``steps`` steps, in microseconds."""
    clock = time.perf_counter
    times = []
    for _ in range(steps):
        t0 = clock()
        opt_d.step()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def measure(make: Callable[..., torch.optim.Optimizer], rounds: int,
            steps: int) -> dict[str, float]:
    """``{configuration: ratio to plain}`` and ``plain_us`` for one optimizer class."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt_d = make(D.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    D(x).sum().backward()  # gradients for every step

    configs: dict[str, Callable[[], ContextManager[object]]] = {
        "plain": contextlib.nullcontext,
        "watch": lambda: versionwatch.watch(D, opt_d),
        "watch_all": lambda: versionwatch.watch_all(),
    }
    per: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for name in order:
            with configs[name]():
                with torch.no_grad():
                    D(x)  # watch_all adopts D at its first forward
                opt_d.step()  # found and named here, outside the timed block
                got[name] = _block(opt_d, steps)
        for name in names:
            per[name].append(got[name] / got["plain"])
    out = {k: statistics.median(v) for k, v in per.items() if k != "plain"}
    out["plain_us"] = statistics.median(
        _block(opt_d, steps) for _ in range(3))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds, steps = (2, 20) if args.quick else (15, 400)
    print(f"versionwatch from {Path(versionwatch.__file__).parent}, torch {torch.__version__}")
    for cls in (torch.optim.SGD, torch.optim.Adam):
        r = measure(cls, rounds, steps)
        print(f"{cls.__name__:5} plain step {r['plain_us']:7.1f} us   "
              f"watch x{r['watch']:.3f}   watch_all x{r['watch_all']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
