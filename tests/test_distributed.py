"""DDP and FSDP2 on 2 CPU processes (gloo), and the per-rank reports of the CLI.

Each multi-process test starts its ranks with a deadline, kills them if it
passes, and leaves no process behind. The CUDA/NCCL path of DDP's buffer
broadcast is in tests/test_cuda.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import dist_workers
from versionwatch._cli.merge import MergeError, merge, rank_path, render_merged
from versionwatch._compat import fsdp2_runs_on_cpu, fully_shard_fn

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.usefixtures("no_process_left"),  # conftest.py: no rank outlives its test
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Callable[..., None], out: Path, timeout: float = 50) -> list[dict[str, Any]]:
    """Run ``fn(rank, port, out)`` on 2 spawned ranks; their results, by rank."""
    ctx = mp.start_processes(fn, args=(_free_port(), str(out)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks ran past {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_buffer_broadcast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two forwards before backward under DDP: no false alarm; a bump is blamed on DDP."""
    # As mp.spawn starts them: no RANK, so the reports' rank is get_rank()'s.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for rank, res in enumerate(_spawn(dist_workers.ddp_worker, tmp_path)):
        assert res["env_rank"] is None
        for mode in ("default", "strict"):
            r = res[f"broadcast_{mode}"]
            assert r["real"] == r["plain"], (rank, mode, r)
            assert r["predicted"] == (r["real"] is not None), (rank, mode, r)
            if r["real"] is None:
                # Recent torch: on CPU/gloo the broadcast bumps no version.
                assert len(set(r["plain_versions"])) == 1, r["plain_versions"]
            else:
                # Older torch (2.4): gloo's broadcast bumps them, as NCCL's does.
                assert "modified by an inplace operation" in r["real"]
                assert r["modified_by"][0].startswith(
                    "DistributedDataParallel's buffer broadcast in forward #2 of model"), r
            # Names: the module path as the user writes it, DDP's `module.` dropped.
            assert r["columns"] and all(c.startswith("model.") and ".module." not in c
                                        for c in r["columns"])
        b = res["bumped"]
        assert b["predicted"] and b["real"] is not None, (rank, b)
        assert "modified by an inplace operation" in b["real"]
        assert b["tensor"] == "model.1.running_mean"
        assert b["modified_by"][-1] == (
            "DistributedDataParallel's buffer broadcast in forward #2 of model"), b
        for fix in ("broadcast_buffers=False", "SyncBatchNorm", "torch.cat"):
            assert fix in b["fix"], b["fix"]
        assert b["rank"] == [rank, 2] and b["json_rank"] == rank
        assert f"rank         {rank} of 2" in b["text"]


@pytest.mark.skipif(fully_shard_fn() is None, reason="this torch has no FSDP2 fully_shard")
@pytest.mark.skipif(not fsdp2_runs_on_cpu(), reason="this torch's FSDP2 needs CUDA: its "
                    "FSDPCommContext makes torch.cuda streams whatever the device (torch 2.4)")
def test_fsdp2(tmp_path: Path) -> None:
    """FSDP2 on CPU: resharding makes no false alarm; a real hazard is named."""
    for rank, res in enumerate(_spawn(dist_workers.fsdp_worker, tmp_path)):
        for mode in ("default", "strict"):
            loop = res[f"loop_{mode}"]
            assert loop["real"] is None and not loop["predicted"], (rank, mode, loop["text"])
            step = res[f"step_between_{mode}"]
            # FSDP2 gathers the weights again for the second backward: PyTorch
            # raises nothing, and the prediction is PyTorch's outcome.
            assert step["real"] == step["plain"], step
            assert step["predicted"] == (step["real"] is not None), (rank, mode, step)
            clip = res[f"clip_{mode}"]
            assert clip["real"] is not None and clip["predicted"], (rank, mode, clip)
            assert clip["tensor"] == "model.2.weight", clip["text"]
            assert clip["rank"] == [rank, 2]


# -- the CLI under torchrun -------------------------------------------------------------

TRAIN = """\
import time
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                          nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward(retain_graph=True)
opt.step()
if rank == 1:
    loss.backward()
else:
    time.sleep(60)
dist.destroy_process_group()
"""


def _torchrun(args: list[str], cwd: Path, timeout: float = 55,
              launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERSIONWATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      os.environ.get("PYTHONPATH")]))
    cmd = [*(launcher or [sys.executable, "-m", "torch.distributed.run"]), "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun's ranks too
        except ProcessLookupError:
            pass
        p.wait()
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def test_torchrun_reports_per_rank_and_merge(tmp_path: Path) -> None:
    """Each rank writes its own report, rank 0 even when torchrun stops it by SIGTERM."""
    (tmp_path / "train.py").write_text(TRAIN)
    p = _torchrun(["-m", "versionwatch", "run", "--json", "report.json", "train.py"], tmp_path)
    assert p.returncode == 1, p.stdout
    assert "[rank1]:   rank         1 of 2" in p.stdout, p.stdout
    assert not (tmp_path / "report.json").exists()
    r0 = json.loads((tmp_path / "report.rank0.json").read_text())
    r1 = json.loads((tmp_path / "report.rank1.json").read_text())
    assert (r0["rank"], r0["world_size"], r1["rank"]) == (0, 2, 1)
    # rank 0 died of torchrun's SIGTERM after writing (its exit: the SIGTERM test below)
    assert (r0["exit_status"], r0["exception"], r0["ok"]) == (143, "terminated by SIGTERM", True)
    assert r1["exit_status"] == 1 and r1["hazards"][0]["tensor"] == "model.2.weight"

    summary = merge([str(tmp_path / "report.rank1.json"), str(tmp_path / "report.rank0.json")])
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["hazards"][0]["ranks"] == [1]
    text = render_merged(summary)
    assert "rank 1: inplace model.2.weight saved by AddmmBackward0.mat2" in text, text
    assert "only on rank 1" in text and "exit status: rank 0 143 (signal 15), rank 1 1" in text
    m = subprocess.run([sys.executable, "-m", "versionwatch", "merge", "report.rank0.json",
                        "report.rank1.json", "--json", "merged.json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert m.returncode == 1, m.stderr
    assert "ranks disagree:" in m.stdout
    assert json.loads((tmp_path / "merged.json").read_text())["schema"] == "versionwatch.ranks/1"


@pytest.mark.parametrize("form", [["-m", "versionwatch"], ["--no-python", "versionwatch"]],
                         ids=["torchrun-m", "torchrun-no-python"])
def test_torchrun_console_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 form: list[str]) -> None:
    """`torchrun -m versionwatch run ...`, and the documented `torchrun --no-python ...`."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "torchrun").is_file() or not (bin_dir / "versionwatch").is_file():
        pytest.skip("torchrun or the versionwatch console script is not installed here")
    (tmp_path / "ok.py").write_text(
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
        "m(torch.ones(3, 2)).sum().backward()\ndist.destroy_process_group()\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    p = _torchrun([*form, "run", "--json", "r.json", "ok.py"],
                  tmp_path, launcher=[str(bin_dir / "torchrun")])
    assert p.returncode == 0, p.stdout
    for r in range(2):
        doc = json.loads((tmp_path / f"r.rank{r}.json").read_text())
        assert (doc["rank"], doc["ok"], doc["exit_status"]) == (r, True, 0)


RANKED = """\
import sys
import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
model(torch.ones(3, 2)).sum().backward()
dist.destroy_process_group()
"""


def test_rank_from_the_process_group_without_torchrun(tmp_path: Path) -> None:
    """Ranks that set up their group themselves (no RANK) still write a file each.

    Neither rank has a hazard and both tear their group down before the report
    is written: the rank is the one the run saw.
    """
    (tmp_path / "ranked.py").write_text(RANKED)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("VERSIONWATCH_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "versionwatch", "run", "--json", "r.json",
                               "ranked.py", str(r), port], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=50)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not (tmp_path / "r.json").exists()
    for r in range(2):
        doc = json.loads((tmp_path / f"r.rank{r}.json").read_text())
        assert (doc["rank"], doc["world_size"], doc["ok"]) == (r, 2, True)


def _terminate_when_ready(tmp_path: Path, script: str) -> tuple[int, str]:
    """``versionwatch run --json r.json SCRIPT``, sent SIGTERM once it prints "ready".

    Returns its exit status and what it printed after "ready"; it is killed if
    it outlives the test.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen([sys.executable, "-m", "versionwatch", "run", "--json", "r.json",
                          script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out


def test_sigterm_writes_the_report_then_dies_of_it(tmp_path: Path) -> None:
    """Outside torchrun too: SIGTERM writes the report, and the exit is the plain one."""
    (tmp_path / "sleeper.py").write_text(
        "import time, torch\nm = torch.nn.Linear(2, 1)\nm(torch.ones(1, 2)).sum().backward()\n"
        "print('ready', flush=True)\ntime.sleep(60)\n")
    returncode, _ = _terminate_when_ready(tmp_path, "sleeper.py")
    assert returncode == -signal.SIGTERM
    doc = json.loads((tmp_path / "r.json").read_text())
    assert (doc["exit_status"], doc["exception"], "rank" in doc) == (
        143, "terminated by SIGTERM", False)
    assert doc["timeline"]["events"], doc


@pytest.mark.parametrize("chains", [False, True], ids=["replaces", "chains"])
def test_sigterm_handler_of_the_program_is_kept(tmp_path: Path, chains: bool) -> None:
    """A program that handles SIGTERM itself: its handler runs, as without versionwatch.

    One that chains to the handler it replaced calls SIG_DFL's stand-in
    unwatched (nothing callable), so it must not reach versionwatch's exit.
    """
    chain = ("    prev = PREV\n    if callable(prev):\n        prev(signum, frame)\n"
             if chains else "")
    (tmp_path / "handles.py").write_text(
        "import signal, sys, time, torch\n"
        "PREV = signal.getsignal(signal.SIGTERM)\n"
        f"def bye(signum, frame):\n{chain}    print('handled', flush=True)\n    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "m = torch.nn.Linear(2, 1)\nm(torch.ones(1, 2)).sum().backward()\n"
        "print('ready', flush=True)\ntime.sleep(60)\n")
    returncode, out = _terminate_when_ready(tmp_path, "handles.py")
    assert returncode == 3 and out == "handled\n", (returncode, out)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert (doc["exit_status"], doc["exception"]) == (3, None)


BLOCKED = """\
import sys
import time
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
print("ready", flush=True)
if rank == 0:
    dist.barrier()  # rank 1 never comes: blocked in gloo's C++, Python handlers wait
else:
    time.sleep(60)
"""


def test_sigterm_while_blocked_in_a_collective(tmp_path: Path) -> None:
    """A rank stuck in a collective never runs a Python signal handler; the report comes anyway.

    Rank 1 (plain, alive) never joins rank 0's barrier, so gloo does not fail it
    either: only the thread that reads the signal's wakeup byte can write rank 0's
    report. Without it, rank 0 would sit in the barrier until the test's deadline.
    """
    (tmp_path / "blocked.py").write_text(BLOCKED)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    port = str(_free_port())
    watched = subprocess.Popen([sys.executable, "-m", "versionwatch", "run", "--json", "r.json",
                                "blocked.py", "0", port], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    plain = subprocess.Popen([sys.executable, "blocked.py", "1", port], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        for p in (watched, plain):
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        time.sleep(1)  # into the barrier (were it not, the main thread's handler writes)
        watched.send_signal(signal.SIGTERM)
        watched.wait(timeout=30)
    finally:
        for p in (watched, plain):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert watched.returncode == -signal.SIGTERM, watched.stderr
    doc = json.loads((tmp_path / "r.rank0.json").read_text())
    assert (doc["exit_status"], doc["exception"], doc["rank"], doc["world_size"]) == (
        143, "terminated by SIGTERM", 0, 2)


def test_rank_path() -> None:
    assert rank_path("report.json", 1) == "report.rank1.json"
    assert rank_path(os.path.join("out", "r.v1.json"), 0) == os.path.join("out", "r.v1.rank0.json")
    assert rank_path("report", 3) == "report.rank3"
    assert rank_path(".report", 0) == ".report.rank0"


def _doc(rank: int, status: int, hazards: list[dict[str, Any]],
         versions: dict[str, int]) -> dict[str, Any]:
    return {"schema": "versionwatch.report/1", "ok": not hazards, "hazards": hazards,
            "rank": rank, "world_size": 2, "exit_status": status, "exception": None,
            "timeline": {"events": [{"event": "forward #1", "versions": versions}]}}


def test_merge_agreement_and_disagreement(tmp_path: Path) -> None:
    hazard = {"kind": "inplace", "tensor": "m.w", "saved_by": "MulBackward0", "slot": "other",
              "backward_site": {"file": "t.py", "line": 3},
              "modified_by": [{"description": "opt.step() #1"}]}
    paths = []
    for r in range(2):
        path = tmp_path / f"r{r}.json"
        path.write_text(json.dumps(_doc(r, 1, [hazard], {"m.w": 2})))
        paths.append(str(path))
    s = merge(paths)
    assert s["hazards"][0]["ranks"] == [0, 1] and s["disagree"] == [] and not s["ok"]
    assert "ranks agree" in render_merged(s)
    Path(paths[1]).write_text(json.dumps(_doc(1, 0, [], {"m.w": 3})))
    s = merge(paths)
    assert s["disagree"] == ["m.w (inplace, MulBackward0.other): only on rank 0",
                             "exit status: rank 0 1, rank 1 0",
                             "m.w ends at version 2 on rank 0, 3 on rank 1"]


def test_merge_names_a_missing_rank_and_refuses_a_rank_given_twice(tmp_path: Path) -> None:
    for r in (0, 2):
        doc = {**_doc(r, 0, [], {"m.w": 2}), "world_size": 3}
        (tmp_path / f"r{r}.json").write_text(json.dumps(doc))
    s = merge([str(tmp_path / "r0.json"), str(tmp_path / "r2.json")])
    assert s["disagree"] == ["no report from rank 1 of world size 3"]
    with pytest.raises(MergeError, match=r"r0.json and .*r0.json are both the report of rank 0: "
                                         r"give one report per rank"):
        merge([str(tmp_path / "r0.json"), str(tmp_path / "r0.json")])
    lone = {k: v for k, v in _doc(0, 0, [], {}).items() if k not in ("rank", "world_size")}
    (tmp_path / "lone.json").write_text(json.dumps(lone))
    with pytest.raises(MergeError, match=r"lone.json has no rank, unlike the others"):
        merge([str(tmp_path / "lone.json"), str(tmp_path / "r0.json")])
    (tmp_path / "r5.json").write_text(json.dumps({**_doc(5, 0, [], {}), "world_size": 3}))
    s = merge([str(tmp_path / "r0.json"), str(tmp_path / "r5.json")])
    assert s["disagree"] == ["rank 5 outside world size 3",
                             "no report from ranks 1, 2 of world size 3"]
    (tmp_path / "r1.json").write_text(json.dumps(_doc(1, 0, [], {})))
    s = merge([str(tmp_path / "r0.json"), str(tmp_path / "r1.json")])
    assert s["disagree"] == ["world size: 3 on rank 0, 2 on rank 1"]


def test_merge_bad_input(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("[1]")
    (tmp_path / "y.json").write_text("{")
    for name, said in (("x.json", "not a versionwatch report"), ("y.json", "is not JSON"),
                       ("missing.json", "cannot read")):
        with pytest.raises(MergeError, match=said):
            merge([str(tmp_path / name)])
    p = subprocess.run([sys.executable, "-m", "versionwatch", "merge", "y.json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 2 and p.stderr.startswith("versionwatch merge: error: "), p.stderr
    assert "Traceback" not in p.stderr


# Every field merge reads, with the JSON types it may hold (None: null).
_FIELDS: list[tuple[tuple[Any, ...], tuple[type | None, ...]]] = [
    (("ok",), (bool,)), (("hazards",), (list, None)), (("rank",), (int, None)),
    (("world_size",), (int, None)), (("exit_status",), (int, None)),
    (("exception",), (str, None)), (("timeline",), (dict, None)),
    (("timeline", "events"), (list, None)), (("timeline", "events", 0), (dict,)),
    (("timeline", "events", 0, "versions"), (dict, None)),
    (("timeline", "events", 0, "versions", "m.w"), (int, None)),
    (("hazards", 0), (dict,)), (("hazards", 0, "kind"), (str, None)),
    (("hazards", 0, "tensor"), (str, None)), (("hazards", 0, "saved_by"), (str, None)),
    (("hazards", 0, "slot"), (str, None)), (("hazards", 0, "backward_site"), (dict, None)),
    (("hazards", 0, "backward_site", "file"), (str, None)),
    (("hazards", 0, "backward_site", "line"), (int, None)),
    (("hazards", 0, "modified_by"), (list, None)), (("hazards", 0, "modified_by", 0), (dict,)),
    (("hazards", 0, "modified_by", 0, "description"), (str, None)),
]
# Wrong values of each JSON type: a string where a number goes, a list where an object goes...
_VALUES: list[Any] = ["2", "", 1, 0, 1.5, True, False, None, [], [1], {}, {"a": 1}]


def _json_type(value: Any) -> type | None:
    return None if value is None else type(value)


def _field_name(keys: tuple[Any, ...]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".")


def test_merge_wrong_typed_fields_name_the_file_and_the_field(tmp_path: Path) -> None:
    """Issue #23, item 8: a wrong-typed field is bad input (one line, exit 2), not a crash."""
    hazard = {"kind": "inplace", "tensor": "m.w", "saved_by": "MulBackward0", "slot": "other",
              "backward_site": {"file": "t.py", "line": 3},
              "modified_by": [{"description": "opt.step() #1"}]}
    good = _doc(1, 1, [hazard], {"m.w": 2})
    (tmp_path / "r0.json").write_text(json.dumps(_doc(0, 1, [hazard], {"m.w": 2})))
    path = tmp_path / "r1.json"
    path.write_text(json.dumps(good))
    assert merge([str(tmp_path / "r0.json"), str(path)])["ranks"][1]["rank"] == 1
    tried = 0
    for keys, allowed in _FIELDS:
        for value in _VALUES:
            if _json_type(value) in allowed:  # JSON's true is no integer: bool is not int here
                continue
            doc = json.loads(json.dumps(good))
            target = doc
            for k in keys[:-1]:
                target = target[k]
            target[keys[-1]] = value
            path.write_text(json.dumps(doc))
            field = _field_name(keys)
            with pytest.raises(MergeError) as caught:
                merge([str(tmp_path / "r0.json"), str(path)])
            said = str(caught.value)
            assert said.startswith(f"{path}: field {field} is "), (field, value, said)
            assert "\n" not in said
            tried += 1
    assert tried > 150
    # Through the command: one line naming the file and the field, exit 2 (not 1: a hazard).
    bad = json.loads(json.dumps(good))
    bad["hazards"][0]["backward_site"]["line"] = "3"
    path.write_text(json.dumps(bad))
    p = subprocess.run([sys.executable, "-m", "versionwatch", "merge", "r0.json", "r1.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert (p.returncode, p.stdout) == (2, ""), p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(
        "versionwatch merge: error: r1.json: field hazards[0].backward_site.line is a string, "
        "not an integer or null"), p.stderr
