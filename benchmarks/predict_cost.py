"""The predictor's cost per saved tensor, and against the model's own backward.

    python benchmarks/predict_cost.py            # both models
    python benchmarks/predict_cost.py --quick    # a smoke run (small sizes)

For each model, on fresh graphs (each check walks nodes that Python has not
touched yet, as in training): the time of ``versionwatch.check(loss)``, divided
by the number of saved tensors it verified, and as a ratio to the time of the
same model's ``loss.backward()``. Medians over the repeats; one torch thread.
Goals: at most 2 us per saved tensor, and under 5% of the transformer's backward.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import versionwatch


def chain(n: int) -> Callable[[], torch.Tensor]:
    """A chain of n ``sin`` nodes; each saves its input."""

    def build() -> torch.Tensor:
        y = torch.full((1,), 0.5, requires_grad=True)
        for _ in range(n):
            y = y.sin()
        return y.sum()

    return build


def transformer(layers: int, d: int, batch: int, seq: int) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(batch, seq, d)
    return lambda: model(x).pow(2).mean()


def measure(build: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float, int, int]:
    checks, backwards = [], []
    saved = nodes = 0
    for _ in range(repeats):
        loss = build()
        t0 = time.perf_counter()
        report = versionwatch.check(loss)
        checks.append(time.perf_counter() - t0)
        saved, nodes = report.saved_checked, report.nodes
        t0 = time.perf_counter()
        loss.backward()
        backwards.append(time.perf_counter() - t0)
        del loss, report
        gc.collect()
    return statistics.median(checks), statistics.median(backwards), saved, nodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, numbers meaningless")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    n = 2_000 if args.quick else 100_000
    repeats = 2 if args.quick else args.repeats
    models = {
        f"chain of {n:,} sin nodes": chain(n),
        "6-layer TransformerEncoder (d=256), batch 8x64":
            transformer(2 if args.quick else 6, 256, 8 if not args.quick else 2, 64),
    }
    print(f"torch {torch.__version__}, one thread, median of {repeats}\n")
    print("| model | nodes | saved tensors | check (ms) | us per saved tensor "
          "| backward (ms) | check / backward |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, build in models.items():
        build()  # warm-up: allocator, kernels
        check, backward, saved, nodes = measure(build, repeats)
        print(f"| {name} | {nodes:,} | {saved:,} | {check * 1e3:.2f} | "
              f"{check / max(saved, 1) * 1e6:.2f} | {backward * 1e3:.2f} | "
              f"{check / backward * 100:.1f}% |")


if __name__ == "__main__":
    main()
