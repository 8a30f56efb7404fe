"""Rank bodies for tests/test_distributed.py, run by ``torch.multiprocessing`` on gloo.

Each worker runs its scenarios watched and plain, and writes what it saw to
``OUT/rank<N>.json``; the test asserts on those files. Every prediction is
compared with the real backward's outcome (PyTorch is the oracle).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import versionwatch
from versionwatch._compat import fully_shard_fn


def _init(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)


def _outcome(fn: Callable[[], Any]) -> str | None:
    """None if ``fn`` ran, else PyTorch's error sentence."""
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[0] if not isinstance(
            e, (versionwatch.InplaceModificationError, versionwatch.FreedGraphError)) else "ours"
    return None


def _watched(model: nn.Module, body: Callable[[], Any], strict: bool,
             opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Run ``body`` watched with a collecting policy, then its real backward."""
    seen: list[versionwatch.Report] = []
    watched = [model] + ([opt] if opt is not None else [])
    with versionwatch.watch(*watched, on_hazard=seen.append, strict=strict) as w:
        real = _outcome(body)
        columns = w.timeline().columns
    first = seen[0].hazards[0] if seen and seen[0].hazards else None
    return {
        "real": real,
        "predicted": bool(seen),
        "tensor": first.tensor if first else None,
        "modified_by": [m.description for m in first.modified_by] if first else [],
        "fix": first.fix if first else None,
        "rank": list(seen[0].rank) if seen and seen[0].rank else None,
        "json_rank": seen[0].to_dict().get("rank") if seen else None,
        "text": str(seen[0]) if seen else "",
        "columns": columns,
    }


def _disc() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


def ddp_worker(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    results: dict[str, Any] = {"env_rank": os.environ.get("RANK")}
    try:
        for strict in (False, True):
            # Two forwards (fake, then real) before one backward, buffers broadcast;
            # a fresh DDP for each run (a failed backward leaves its reducer waiting).
            runs: dict[str, Any] = {}
            for watched in (False, True):
                torch.manual_seed(0)
                ddp = nn.parallel.DistributedDataParallel(_disc())
                mean = ddp.module[1].running_mean
                versions: list[int] = []

                def two_forwards(ddp: nn.Module = ddp, mean: torch.Tensor = mean,
                                 versions: list[int] = versions) -> None:
                    versions.append(mean._version)
                    fake = ddp(torch.randn(16, 4))
                    versions.append(mean._version)
                    real = ddp(torch.randn(16, 4))
                    versions.append(mean._version)
                    (real.mean() - fake.mean()).backward()

                if watched:
                    runs.update(_watched(ddp, two_forwards, strict))
                else:
                    runs["plain"] = _outcome(two_forwards)
                    runs["plain_versions"] = versions
            results[f"broadcast_{'strict' if strict else 'default'}"] = runs

        # What NCCL does on GPUs: the broadcast bumps the buffers' versions.
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_disc())
        pre = ddp._pre_forward

        def bumping_pre_forward(*args: Any, **kwargs: Any) -> Any:
            got = pre(*args, **kwargs)
            for b in ddp.module.buffers():
                torch.autograd.graph.increment_version(b)
            return got

        ddp._pre_forward = bumping_pre_forward  # type: ignore[method-assign]

        def gan_step() -> None:
            fake = ddp(torch.randn(16, 4))
            real = ddp(torch.randn(16, 4))
            (real.mean() - fake.mean()).backward()

        results["bumped"] = _watched(ddp, gan_step, strict=False)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def fsdp_worker(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    fully_shard = fully_shard_fn()
    assert fully_shard is not None
    results: dict[str, Any] = {}
    try:
        for strict in (False, True):
            mode = "strict" if strict else "default"
            # Resharded after forward (the default) and unsharded again for
            # backward: a training loop, then a step between two backwards.
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            for layer in (model[0], model[2]):
                fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def loop(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
                for _ in range(2):
                    model(torch.randn(8, 4)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()

            results[f"loop_{mode}"] = _watched(model, loop, strict, opt)

            def step_between(model: nn.Module = model,
                             opt: torch.optim.Optimizer = opt) -> None:
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward(retain_graph=True)
                opt.step()
                loss.backward()

            plain = _outcome(step_between)
            results[f"step_between_{mode}"] = {**_watched(model, step_between, strict, opt),
                                               "plain": plain}

            # Kept unsharded after forward: an in-place update of a weight
            # (a clip, an EMA swap) before backward is PyTorch's error.
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            fully_shard(model, reshard_after_forward=False)

            def clip_before_backward(model: nn.Module = model) -> None:
                loss = model(torch.randn(8, 4)).pow(2).mean()
                with torch.no_grad():
                    model[2].weight.clamp_(-0.1, 0.1)
                loss.backward()

            results[f"clip_{mode}"] = _watched(model, clip_before_backward, strict)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
