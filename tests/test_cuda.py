"""On a GPU: the differential tests, the seed story, and DDP's buffer broadcast on NCCL.

Every test here is marked ``cuda`` and skips cleanly without a GPU
(``pytest -m cuda`` runs just these). On CPU, the same scenarios run in
test_generated.py, test_scenarios.py and test_distributed.py.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import versionwatch
from oracle import Oracle
from programs import FORWARD_ERRORS, generate, run_program

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture
def on_gpu() -> Any:
    previous = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(previous)


@pytest.mark.parametrize("seed", range(40))
def test_generated_programs_on_gpu(seed: int, on_gpu: None) -> None:
    """The generated programs of test_generated.py, every tensor on the GPU."""
    src = generate(seed)
    try:
        run_program(src, Oracle(), seed=seed)  # asserts each prediction against PyTorch
    except RuntimeError as e:
        if not any(f in str(e) for f in FORWARD_ERRORS):
            raise


class _Seed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([2.0]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))
        self.w3 = nn.Parameter(torch.tensor([4.0]))

    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a * self.w1
        return s * self.w2, s * self.w3


def _seed_loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    mse = nn.MSELoss()
    x, y1, y2 = (torch.tensor([v], device="cuda") for v in (1.0, 5.0, 7.0))
    for _ in range(3):
        y1_pred, y2_pred = model(x)
        opt.zero_grad(set_to_none=False)
        mse(y1_pred, y1).backward(retain_graph=True)
        opt.step()
        mse(y2_pred, y2).backward()
        opt.step()


def test_seed_story_on_gpu() -> None:
    model = _Seed().cuda()
    with pytest.raises(RuntimeError) as plain:
        _seed_loop(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model = _Seed().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with versionwatch.watch(model, opt), pytest.raises(
            versionwatch.InplaceModificationError) as ours:
        _seed_loop(model, opt)
    h = ours.value.report.hazards[0]
    assert h.tensor in ("model.w2", "model.w3") and h.device is not None
    assert h.device.startswith("cuda")
    assert h.torch_message is not None
    assert "torch.cuda.FloatTensor" in str(plain.value)
    assert h.torch_message.split("Hint")[0] == str(plain.value).split("Hint")[0]


# -- DDP on NCCL: the broadcast that bumps the buffers' versions ---------------------------

def _nccl_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).cuda()
    ddp = nn.parallel.DistributedDataParallel(disc, device_ids=[rank])
    seen: list[versionwatch.Report] = []
    real = None
    with versionwatch.watch(ddp, on_hazard=seen.append):
        fake = ddp(torch.randn(16, 4, device="cuda"))
        live = ddp(torch.randn(16, 4, device="cuda"))
        try:
            (live.mean() - fake.mean()).backward()
        except RuntimeError as e:
            real = str(e)
    dist.destroy_process_group()
    h = seen[0].hazards[0] if seen else None
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "real": real, "predicted": bool(seen),
        "modified_by": [m.description for m in h.modified_by] if h else []}))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
@pytest.mark.usefixtures("no_process_left")  # conftest.py: no rank outlives the test
def test_ddp_buffer_broadcast_nccl(tmp_path: Path) -> None:
    """Whatever this torch's NCCL broadcast does, the prediction is PyTorch's outcome."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_nccl_worker, args=(port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 55
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks ran past 55 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["predicted"] == (res["real"] is not None), res
        if res["real"] is not None:
            assert res["modified_by"][0].startswith(
                "DistributedDataParallel's buffer broadcast in forward #2"), res
