"""Cost of ``watch(..., on_hazard="repair")``, where it repairs and where it has nothing to do.

Two parts, each timed with interleaved, rotating blocks as in ``overhead.py``
(the same ``measure`` for part 1), so that drift in the machine hits every
configuration alike; ratios are paired per round.

1. Nothing to repair: the benchmark models of ``overhead.py`` (a tiny MLP, a
   transformer), plain ``zero_grad, forward, loss, backward, step``:
   ``unwatched``, ``watch`` (default mode, ``on_hazard="raise"``) and
   ``watch_repair``. The split: repair's only work here is remembering each
   watched forward's outputs (weakly) and, before each step, one read of a
   saved slot that finds the graph freed; both are timed alone, in
   microseconds per step.
2. A GAN-style loop with ``retain_graph``: the discriminator's loss runs
   backward with ``retain_graph=True``, its optimizer steps, and the
   generator's loss then runs backward through the discriminator's graph,
   which saved the old weights. ``hand_clone`` is the unwatched loop whose
   discriminator clones its weights in forward (the usual fix);
   ``watch_hand_clone`` that loop watched in default mode (what watching
   costs before any repair); ``watch_repair`` the same program unchanged
   under repair;
   ``allow_mutation`` the unchanged program inside
   ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` around each step.

Usage:
  python benchmarks/repair.py            # both parts
  python benchmarks/repair.py --quick    # smoke run (seconds; numbers meaningless)
  python benchmarks/repair.py --models '' --clock cpu   # part 2 only, in CPU time
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch

import overhead  # (the benchmark models and the interleaved measure)

# --- part 1: nothing to repair -------------------------------------------------------------


def part1(keys: list[str], quick: bool) -> None:
    def repair(s: overhead.Setup) -> contextlib.AbstractContextManager[object]:
        return versionwatch.watch(s.model, s.opt, on_hazard="repair")

    configs: list[overhead.Config] = [
        ("unwatched", lambda s: overhead._null(), overhead._null),
        ("watch", overhead._watch(), overhead._null),
        ("watch_repair", repair, overhead._null),
    ]
    for key in keys:
        s = overhead.MODELS[key]()
        steps = 2 if quick else s.steps
        repeats = 2 if quick else s.repeats
        warmup = 1 if quick else s.warmup
        t0 = time.perf_counter()
        results = overhead.measure(s, configs, steps, repeats, warmup, s.block_warm)
        print(f"\n### nothing to repair: {s.label}\n")
        print(f"{repeats} rounds x {steps} timed steps per configuration; "
              f"{time.perf_counter() - t0:.0f} s\n")
        print(overhead.table(results))
        by = {r.name: r for r in results}
        print(f"\nrepair vs default mode: {by['watch_repair'].median / by['watch'].median:.3f}x "
              "(medians)")
        _split(s, by["watch"].median)


def _split(s: overhead.Setup, step_s: float) -> None:
    """Repair's own work per step, timed alone: at forward, and before the step."""
    with versionwatch.watch(s.model, s.opt, on_hazard="repair") as w:
        repairer = w.repairer
        assert repairer is not None
        out = s.model(s.x)
        F.mse_loss(out, s.target).backward()
        params = [p for g in s.opt.param_groups for p in g["params"]]
        names = w.names
        n = 2000

        def at_forward() -> None:
            repairer.roots = []
            repairer.outputs(out, "forward #1")

        def before_step() -> None:
            repairer.roots = []
            repairer.outputs(out, "forward #1")
            repairer.before_step(params, names, "SGD.step() #1", None)

        fwd = min(timeit.repeat(at_forward, number=n, repeat=5)) / n
        both = min(timeit.repeat(before_step, number=n, repeat=5)) / n
    print(f"split: at forward {fwd * 1e6:.1f} us/step, before step (graph found freed) "
          f"{(both - fwd) * 1e6:.1f} us/step; together {both / step_s * 100:.2f}% of the "
          "default-mode step")


# --- part 2: a GAN with retain_graph ----------------------------------------------------


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...], clone: bool = False) -> None:
        super().__init__()
        self.clone = clone
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            w, b = layer.weight, layer.bias
            if self.clone:  # the hand-written fix: the graph saves clones, not the weights
                w, b = w.clone(), b.clone()
            x = F.linear(x, w, b)
            if i < len(self.layers) - 1:
                x = F.leaky_relu(x, 0.2)
        return x


class Gan:
    def __init__(self, clone: bool) -> None:
        torch.manual_seed(0)
        self.G = MLP((64, 256, 256, 64))
        self.D = MLP((64, 256, 256, 1), clone=clone)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=1e-4, betas=(0.5, 0.999))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=1e-4, betas=(0.5, 0.999))
        self.z, self.real = torch.randn(64, 64), torch.randn(64, 64)
        self.ones, self.zeros = torch.ones(64, 1), torch.zeros(64, 1)

    def step(self) -> None:
        fake = self.G(self.z)
        d_real, d_fake = self.D(self.real), self.D(fake)
        d_loss = (F.binary_cross_entropy_with_logits(d_real, self.ones)
                  + F.binary_cross_entropy_with_logits(d_fake, self.zeros))
        g_loss = F.binary_cross_entropy_with_logits(d_fake, self.ones)
        self.opt_d.zero_grad()
        d_loss.backward(retain_graph=True)
        self.opt_d.step()
        self.opt_g.zero_grad()
        g_loss.backward()  # through D's graph, which saved D's weights before the step
        self.opt_g.step()


GanConfig = tuple[str, Gan, Callable[[Gan], Any], Callable[[], Any]]


def part2(quick: bool, cpu: bool = False) -> dict[str, float]:
    configs: list[GanConfig] = [
        ("hand_clone", Gan(clone=True), lambda g: contextlib.nullcontext(),
         contextlib.nullcontext),
        ("watch_hand_clone", Gan(clone=True),
         lambda g: versionwatch.watch({"G": g.G, "D": g.D}, g.opt_g, g.opt_d),
         contextlib.nullcontext),
        ("watch_repair", Gan(clone=False),
         lambda g: versionwatch.watch({"G": g.G, "D": g.D}, g.opt_g, g.opt_d,
                                      on_hazard="repair"), contextlib.nullcontext),
        ("allow_mutation", Gan(clone=False), lambda g: contextlib.nullcontext(),
         torch.autograd.graph.allow_mutation_on_saved_tensors),
    ]
    steps, repeats, warmup = (2, 2, 1) if quick else (10, 30, 10)
    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    rounds: dict[str, list[float]] = {c[0]: [] for c in configs}
    # Process CPU time leaves out the waits of a machine shared with other jobs.
    clock = time.process_time if cpu else time.perf_counter

    def block(config: GanConfig, n: int) -> list[float]:
        _, gan, outer, per_step = config
        out = []
        with outer(gan):
            for k in range(n + 1):  # one untimed step per block
                t0 = clock()
                with per_step():
                    gan.step()
                if k:
                    out.append(clock() - t0)
        return out

    for config in configs:
        block(config, warmup)
    for r in range(repeats):
        k = r % len(configs)
        for config in configs[k:] + configs[:k]:
            t = block(config, steps)
            times[config[0]] += t
            rounds[config[0]].append(statistics.median(t))
    base = statistics.median(times["hand_clone"])
    print("\n### GAN-style loop with retain_graph: G 64-256-256-64, D 64-256-256-1, batch 64, "
          "Adam x2\n")
    print(f"{repeats} rounds x {steps} timed steps per configuration; "
          f"clock: {'process CPU time' if cpu else 'wall (perf_counter)'}\n")
    print("| configuration | median step (ms) | ratio to hand_clone | paired ratio (IQR) |")
    print("|---|---:|---:|---:|")
    ratios: dict[str, float] = {}
    for name, ts in times.items():
        paired = [m / b for m, b in zip(rounds[name], rounds["hand_clone"])]
        q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
        med = statistics.median(ts)
        ratios[name] = statistics.median(paired)
        print(f"| {name} | {med * 1e3:.3f} | {med / base:.3f}x | "
              f"{statistics.median(paired):.3f}x ({q[0]:.3f} - {q[2]:.3f}) |")
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: numbers meaningless")
    p.add_argument("--models", default="a,b", help="part 1's models (a, b); '' skips part 1")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="part 2's clock: wall (default) or process CPU time, steadier on a "
                        "machine shared with other jobs")
    p.add_argument("--no-gan", action="store_true", help="skip part 2")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, versionwatch {versionwatch.__version__}, "
          f"Python {platform.python_version()}, {platform.machine()}, "
          f"threads={torch.get_num_threads()}")
    keys = [k for k in args.models.split(",") if k]
    part1(keys, args.quick)
    if not args.no_gan:
        part2(args.quick, cpu=args.clock == "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
