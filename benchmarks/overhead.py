"""Step-time overhead of versionwatch.watch() against an unwatched training loop.

Interleaved, side-by-side trials: every round runs a small block of steps under
each configuration in turn (the order rotates from round to round), so that
drift in the machine (frequency, other processes, allocator state) hits every
configuration alike. Each step is ``zero_grad, forward, loss, backward, step``,
timed alone with ``time.perf_counter``. The table shows the median step time
over all timed steps and its ratio to the unwatched median, and the *paired*
ratio: the median, over rounds, of each round's median against the same
round's unwatched median, with its interquartile range. On a busy machine the
paired ratio is the steadier of the two.

Models:
  a  tiny-op MLP: 50 x (Linear(32, 32) + Tanh), batch 4, SGD with momentum.
     Each op is microseconds, so this measures the per-node Python overhead.
  b  nn.TransformerEncoder: 6 layers, d_model 256, 8 heads, feed-forward 1024,
     batch_first, batch 8 x sequence 64, Adam. A realistic compute-bound step.

Configurations:
  unwatched       the plain loop
  watch           ``versionwatch.watch(model, opt)`` (default mode), open for the block
  detect_anomaly  ``torch.autograd.detect_anomaly(check_nan=False)`` around each step
  allow_mutation  ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` around each step
  watch_strict    ``versionwatch.watch(model, opt, strict=True)``: only with ``--strict``,
                  and only when watch() accepts ``strict`` (see STRICT below)

Usage:
  python benchmarks/overhead.py                   # full run, both models
  python benchmarks/overhead.py --models a --steps 40 --repeats 50
  python benchmarks/overhead.py --quick           # smoke run (seconds; numbers meaningless)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch

# --- models --------------------------------------------------------------------------


@dataclass
class Setup:
    """A model, its optimizer, a fixed batch, and the per-model defaults."""

    label: str
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    target: torch.Tensor
    steps: int  # timed steps per configuration per round
    repeats: int  # rounds
    warmup: int  # untimed steps per configuration before the first round
    block_warm: int  # untimed steps at the start of every block


def tiny_mlp() -> Setup:
    layers: list[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, target = torch.randn(4, 32), torch.randn(4, 32)
    return Setup("(a) tiny MLP: 50 x Linear(32,32)+Tanh, batch 4, SGD(momentum)",
                 model, opt, x, target, steps=20, repeats=40, warmup=30, block_warm=1)


def transformer() -> Setup:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, target = torch.randn(8, 64, 256), torch.randn(8, 64, 256)
    # One step per block: neighbouring steps of different configurations are then
    # a fraction of a second apart, and drift in the machine cancels in the pairs.
    return Setup("(b) TransformerEncoder: 6 layers, d_model 256, 8 heads, ff 1024, "
                 "batch 8 x seq 64, Adam", model, opt, x, target, steps=1, repeats=60,
                 warmup=3, block_warm=0)


MODELS: dict[str, Callable[[], Setup]] = {"a": tiny_mlp, "b": transformer}

# --- configurations --------------------------------------------------------------------
# A configuration is (name, block, per_step): ``block`` is a context manager factory
# entered once around a block of steps, ``per_step`` one entered around every step.


def _null() -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def _anomaly() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
        with torch.autograd.detect_anomaly(check_nan=False):
            yield


def _watch(**kwargs: object) -> Callable[[Setup], contextlib.AbstractContextManager[object]]:
    def make(s: Setup) -> contextlib.AbstractContextManager[object]:
        return versionwatch.watch(s.model, s.opt, **kwargs)  # type: ignore[arg-type]

    return make


def watch_accepts(param: str) -> bool:
    return param in inspect.signature(versionwatch.watch).parameters


Config = tuple[str, Callable[[Setup], contextlib.AbstractContextManager[object]],
               Callable[[], contextlib.AbstractContextManager[object]]]


def configurations(strict: bool) -> list[Config]:
    configs: list[Config] = [
        ("unwatched", lambda s: _null(), _null),
        ("watch", _watch(), _null),
        ("detect_anomaly", lambda s: _null(), _anomaly),
        ("allow_mutation", lambda s: _null(),
         torch.autograd.graph.allow_mutation_on_saved_tensors),
    ]
    # STRICT: the strict configuration. ``--strict`` adds watch(..., strict=True)
    # once watch() grows that parameter; until then it is skipped with a note.
    if strict:
        if watch_accepts("strict"):
            configs.insert(2, ("watch_strict", _watch(strict=True), _null))
        else:
            print("note: --strict ignored: versionwatch.watch() has no `strict` parameter yet",
                  file=sys.stderr)
    return configs


# --- the loop ----------------------------------------------------------------------------


def step(s: Setup) -> None:
    s.opt.zero_grad()
    out = s.model(s.x)
    loss = nn.functional.mse_loss(out, s.target)
    loss.backward()
    s.opt.step()


# What a step's time is read from: wall time by default; --clock cpu reads this
# thread's CPU time, which a machine shared with other jobs inflates far less
# (with torch.set_num_threads(1) every op of the step runs on this thread).
CLOCK = [time.perf_counter]


def run_block(s: Setup, config: Config, n: int, warm: int = 1) -> list[float]:
    """``warm`` untimed steps, then ``n`` timed ones, all inside the block context."""
    _, block, per_step = config
    times: list[float] = []
    clock = CLOCK[0]
    with block(s):
        for k in range(warm + n):
            t0 = clock()
            with per_step():
                step(s)
            t1 = clock()
            if k >= warm:
                times.append(t1 - t0)
    return times


@dataclass
class Result:
    name: str
    median: float  # median step time over all timed steps
    ratio: float  # median / the unwatched median
    paired: float  # median over rounds of (this round's median / its unwatched median)
    lo: float  # quartiles of those per-round ratios
    hi: float
    steps: int


def measure(s: Setup, configs: list[Config], steps: int, repeats: int, warmup: int,
            block_warm: int) -> list[Result]:
    for config in configs:  # warm-up: allocator, lazy init, optimizer state, caches
        run_block(s, config, 0, warm=warmup)
    per_config: dict[str, list[float]] = {c[0]: [] for c in configs}
    per_round: dict[str, list[float]] = {c[0]: [] for c in configs}
    for r in range(repeats):
        k = r % len(configs)
        for config in configs[k:] + configs[:k]:  # rotate who goes first
            times = run_block(s, config, steps, warm=block_warm)
            per_config[config[0]] += times
            per_round[config[0]].append(statistics.median(times))
    base = statistics.median(per_config["unwatched"])
    results = []
    for name, times in per_config.items():
        ratios = [m / b for m, b in zip(per_round[name], per_round["unwatched"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        med = statistics.median(times)
        results.append(Result(name, med, med / base, statistics.median(ratios), q[0], q[2],
                              len(times)))
    return results


def table(results: list[Result]) -> str:
    lines = [
        "| configuration | median step (ms) | ratio to unwatched | paired ratio (IQR) | steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.median * 1e3:.3f} | {r.ratio:.3f}x | "
                     f"{r.paired:.3f}x ({r.lo:.3f} - {r.hi:.3f}) | {r.steps} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="a,b", help="comma-separated: a (tiny MLP), b (transformer)")
    p.add_argument("--steps", type=int, help="timed steps per configuration per round")
    p.add_argument("--repeats", type=int, help="rounds of interleaved blocks")
    p.add_argument("--warmup", type=int, help="untimed steps per configuration before round 1")
    p.add_argument("--quick", action="store_true", help="smoke run: a few steps, numbers meaningless")
    p.add_argument("--configs", help="comma-separated subset of the configurations "
                   "(default: all; unwatched is always run, as the baseline)")
    p.add_argument("--strict", action="store_true",
                   help="also time watch(..., strict=True) (skipped if watch() lacks it)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall (time.perf_counter) or cpu (time.thread_time: this thread's "
                        "CPU time, for a loaded machine; needs --threads 1)")
    args = p.parse_args(argv)

    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODELS]
    if unknown or not keys:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            p.error("--clock cpu reads one thread's CPU time: use it with --threads 1")
        CLOCK[0] = time.thread_time
    torch.manual_seed(0)
    configs = configurations(args.strict)
    if args.configs:
        wanted = {c.strip() for c in args.configs.split(",")} | {"unwatched"}
        unknown = wanted - {c[0] for c in configs}
        if unknown:
            p.error(f"unknown configuration(s) {sorted(unknown)}; "
                    f"choose from {', '.join(c[0] for c in configs)}")
        configs = [c for c in configs if c[0] in wanted]

    print(f"torch {torch.__version__}, versionwatch {versionwatch.__version__}, "
          f"Python {platform.python_version()}, {platform.machine()}, "
          f"threads={torch.get_num_threads()}, clock={args.clock}")
    print(f"command: {' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}")
    for key in keys:
        s = MODELS[key]()
        steps = args.steps or (2 if args.quick else s.steps)
        repeats = args.repeats or (2 if args.quick else s.repeats)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else s.warmup)
        t0 = time.perf_counter()
        results = measure(s, configs, steps, repeats, warmup, s.block_warm)
        elapsed = time.perf_counter() - t0
        print(f"\n### {s.label}\n")
        print(f"{repeats} rounds x {steps} timed steps per configuration (+{s.block_warm} "
              f"untimed per block), {warmup} warm-up steps; {elapsed:.0f} s\n")
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
