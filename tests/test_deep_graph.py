"""Deep graphs: check() on a 100,000-node chain must not leave a crash behind.

On torch 2.13 an autograd node that Python has touched is freed through Python
deallocation, one nested call per node, so dropping a deep touched chain can
overflow the C stack (see docs/deep-graphs.md). A segfault would kill pytest
itself, so every case runs in a subprocess and the test reads its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

DEEP = 100_000

_PRELUDE = textwrap.dedent(
    """
    import gc, json, sys, time
    import torch
    import versionwatch

    def chain(n, x=None):
        if x is None:
            x = torch.ones(1, requires_grad=True)
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    def say(*args):
        print(*args, flush=True)  # flushed: a crash after this must not eat it
    """
)


def _no_core_dumps() -> None:  # pragma: no cover - runs in the child
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def run_script(body: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    code = _PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_no_core_dumps if os.name == "posix" else None,
    )


def explain(p: subprocess.CompletedProcess[str]) -> str:
    return f"rc={p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


def test_check_deep_chain_then_free() -> None:
    p = run_script(
        f"""
        y = chain({DEEP})
        r = versionwatch.check(y)
        say(json.dumps({{"ok": r.ok, "nodes": r.nodes}}))
        del y

        # The same chain with a stale tensor at its bottom: x * s saved s.
        s = torch.tensor([2.0])
        y = chain({DEEP}, torch.ones(1, requires_grad=True) * s)
        s.add_(1.0)
        r = versionwatch.check(y)
        h = r.hazards[0]
        say(json.dumps({{"ok": r.ok, "nodes": r.nodes, "n": len(r.hazards), "kind": h.kind,
                         "where": h.where, "versions": [h.saved_version, h.current_version],
                         "order": h.order}}))
        del y, r, h
        gc.collect()
        say("freed")
        """
    )
    assert p.returncode == 0, explain(p)
    assert "freed" in p.stdout, explain(p)
    clean, stale = (json.loads(line) for line in p.stdout.splitlines()[:2])
    assert clean == {"ok": True, "nodes": DEEP + 1}  # the muls and x's AccumulateGrad
    assert stale["ok"] is False
    assert stale["nodes"] == DEEP + 2
    assert stale["n"] == 1
    assert (stale["kind"], stale["where"], stale["versions"]) == (
        "inplace", "MulBackward0.other", [0, 1])
    assert stale["order"] == DEEP  # the bottom mul: the last node before AccumulateGrad


def test_two_leases_on_one_deep_chain() -> None:
    p = run_script(
        f"""
        y = chain({DEEP})
        r1 = versionwatch.check(y)
        r2 = versionwatch.check(y)
        r3 = versionwatch.check(y * 2.0)  # a third lease, on an output that dies at once
        say(r1.ok, r2.ok, r3.ok, r1.nodes, r3.nodes)
        del y
        gc.collect()
        say("freed")
        """
    )
    assert p.returncode == 0, explain(p)
    assert "freed" in p.stdout, explain(p)
    assert p.stdout.splitlines()[0] == f"True True True {DEEP + 1} {DEEP + 2}"


def test_keep_loss_then_drop_it_inside_a_function() -> None:
    p = run_script(
        f"""
        def forward():
            # The intermediates die with this frame; the caller keeps only the loss.
            return chain({DEEP}).sum()

        loss = forward()
        report = versionwatch.check(loss)
        say("checked", report.ok, report.nodes)

        def step(holder):
            loss = holder.pop()
            again = versionwatch.check(loss)  # a second lease, taken inside the function
            say("again", again.ok)
            del loss  # the last reference to the loss dies here, inside the function

        holder = [loss]
        del loss
        step(holder)
        gc.collect()
        say("freed")
        """
    )
    assert p.returncode == 0, explain(p)
    assert p.stdout.splitlines()[:2] == [f"checked True {DEEP + 2}", "again True"], explain(p)
    assert "freed" in p.stdout, explain(p)


def test_drop_the_loss_before_the_model_output() -> None:
    # The usual order in a training loop: the loss dies first, the output (and
    # an intermediate someone kept, e.g. for logging) later, each still deep.
    p = run_script(
        f"""
        y = chain({DEEP})
        loss = y.sum()
        say("checked", versionwatch.check(loss).ok)
        del loss
        say("loss freed")
        del y
        say("output freed")
        x = torch.ones(1, requires_grad=True)
        y = x
        for k in range({DEEP}):
            y = y * 1.0001
            if k == {DEEP // 2}:
                mid = y
        versionwatch.check(y.sum())
        del y
        say("top freed, middle kept")
        del mid
        gc.collect()
        say("freed")
        """
    )
    assert p.returncode == 0, explain(p)
    assert p.stdout.split() == ["checked", "True", "loss", "freed", "output", "freed", "top",
                                "freed,", "middle", "kept", "freed"], explain(p)


def test_check_scales_linearly() -> None:
    p = run_script(
        f"""
        def timed(y):
            t = time.perf_counter()
            versionwatch.check(y)
            return time.perf_counter() - t

        small = chain({DEEP // 2})
        big = chain({DEEP})
        gc.collect()
        # Interleaved, best of 4 each: a burst of load elsewhere hits both sizes.
        times = {{"small": [], "big": []}}
        for _ in range(4):
            times["small"].append(timed(small))
            times["big"].append(timed(big))
        say(json.dumps({{k: min(v) for k, v in times.items()}}))
        del small, big
        gc.collect()
        say("freed")
        """
    )
    assert p.stdout, explain(p)
    t = json.loads(p.stdout.splitlines()[0])
    ratio = t["big"] / t["small"]
    # Linear would be 2.0; generous bounds, not a benchmark.
    assert ratio < 3.5, (ratio, t)
    assert t["big"] < 30.0, t
    assert p.returncode == 0, explain(p)
    assert "freed" in p.stdout, explain(p)


def test_control_plain_walk_then_drop_crashes() -> None:
    """What the lease guards against: a plain walk, then the graph is dropped.

    Run on every torch: where the drop does not crash (the behaviour is probed,
    not assumed from the version), the test says so as an expected failure.
    """
    p = run_script(
        """
        y = chain(60_000)
        fn = y.grad_fn
        while fn is not None:  # touch every node from Python
            nf = fn.next_functions
            fn = nf[0][0] if nf else None
        say("walked")
        del y  # frees 60,000 touched nodes, one nested call each
        say("freed")
        """
    )
    assert "walked" in p.stdout, explain(p)
    if p.returncode == 0:
        pytest.xfail("dropping the walked chain did not crash here (a larger C stack?)")
    assert p.returncode < 0, explain(p)  # killed by a signal: SIGSEGV
    assert "freed" not in p.stdout
