"""Several threads running autograd under one watcher: predictions stay exact.

Each test compares every thread's prediction with what its real backward did.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import Report

# Generous: a test that would deadlock fails instead of hanging the suite.
JOIN_S = 60.0


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VERSIONWATCH_ON_HAZARD", raising=False)
    yield


def run_threads(targets: list[Callable[[], None]], names: list[str] | None = None) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reraised on the test's thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn), name=names[i] if names else None)
               for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a thread is stuck: deadlock"
    if errors:
        raise errors[0]


class Outcomes:
    """Per thread: what the watcher predicted, and what the real backward did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.predicted: dict[int, list[Report]] = {}
        self.raised: dict[int, list[str]] = {}
        self.backwards: dict[int, int] = {}
        self.names: dict[int, str] = {}

    def report(self, report: Report) -> None:
        with self.lock:
            self.predicted.setdefault(threading.get_ident(), []).append(report)

    def backward(self, loss: torch.Tensor) -> None:
        me = threading.get_ident()
        with self.lock:
            self.backwards[me] = self.backwards.get(me, 0) + 1
            self.names[me] = threading.current_thread().name
        try:
            loss.backward()
        except RuntimeError as e:
            with self.lock:
                self.raised.setdefault(me, []).append(str(e))

    def mismatches(self) -> tuple[int, int]:
        """(misses, false alarms), counted per backward call."""
        misses = false = 0
        for me in self.backwards:
            p, r = len(self.predicted.get(me, [])), len(self.raised.get(me, []))
            misses += max(r - p, 0)
            false += max(p - r, 0)
        return misses, false


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_shared_graph_race_is_predicted_exactly(strict: bool) -> None:
    # PyTorch's TestMultithreadAutograd.test_python_thread_in_middle: five
    # threads backward through one shared part; the first frees it.
    misses = false = failed = 0
    for _ in range(20):
        seen = Outcomes()
        start = threading.Barrier(5)
        with versionwatch.watch_all(on_hazard=seen.report, strict=strict):
            x = torch.ones(5, 5, requires_grad=True)
            y = x + x ** 2

            def worker(y: torch.Tensor = y, start: threading.Barrier = start,
                       seen: Outcomes = seen) -> None:
                z = y + y ** 2
                start.wait()  # all five in backward at once: the race
                seen.backward(z.sum())

            run_threads([worker] * 5)
        m, f = seen.mismatches()
        misses, false = misses + m, false + f
        failed += sum(len(v) for v in seen.raised.values())
        assert all("second time" in msg for v in seen.raised.values() for msg in v)
    assert (misses, false) == (0, 0)
    assert failed >= 20  # at least one of five fails each round: the race was there


def test_freed_report_names_the_other_threads_backward() -> None:
    seen = Outcomes()
    with versionwatch.watch_all(on_hazard=seen.report):
        x = torch.ones(3, requires_grad=True)
        y = x * x.exp()

        def worker(y: torch.Tensor = y) -> None:
            seen.backward((y + y.sin()).sum())

        run_threads([worker], ["first"])
        run_threads([worker], ["second"])
    reports = [r for rs in seen.predicted.values() for r in rs]
    assert len(reports) == 1
    h = reports[0].hazards[0]
    assert h.kind == "freed"
    assert any(n.startswith("freed by backward #1 on thread first at ") for n in h.notes), h.notes
    assert "thread first" in str(reports[0])
    assert "thread first" in reports[0].to_json()


def test_disjoint_graphs_do_not_wait_for_each_other() -> None:
    # Thread A's backward is held inside a hook until thread B's backward,
    # over another graph, has finished: B must not wait for A.
    b_done = threading.Event()
    seen = Outcomes()
    with versionwatch.watch_all(on_hazard=seen.report):
        def a() -> None:
            x = torch.ones(3, requires_grad=True)
            y = x.exp()
            y.register_hook(lambda g: b_done.wait(JOIN_S) and None)
            seen.backward(y.sum())

        def b() -> None:
            x = torch.ones(3, requires_grad=True)
            seen.backward(x.sin().sum())
            b_done.set()

        run_threads([a, b])
    assert b_done.is_set()
    assert seen.mismatches() == (0, 0) and not seen.raised


def test_backward_inside_a_backward_never_waits() -> None:
    # A hook runs a backward inside the outer one, over nodes the outer
    # flight holds; another thread is alive so flights record their nodes.
    idle = threading.Event()
    keeper = threading.Thread(target=idle.wait, args=(JOIN_S,))
    keeper.start()
    try:
        lin = nn.Linear(4, 4)
        inner: list[torch.Tensor] = []
        with versionwatch.watch(lin) as w:
            def outer() -> None:
                h = lin(torch.randn(2, 4))
                out, total = h.tanh(), h.sum()
                out.register_hook(lambda g: inner.append(
                    torch.autograd.grad(total, lin.weight, retain_graph=True)[0]))
                out.sum().backward()
            run_threads([outer])
        assert len(inner) == 1 and lin.weight.grad is not None and not w.reports
    finally:
        idle.set()
        keeper.join()


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_eight_threads_each_training_its_own_model(strict: bool) -> None:
    seen = Outcomes()
    planted_on = 5
    planted_at = 150
    models = [small_model() for _ in range(8)]
    with versionwatch.watch_all(on_hazard=seen.report, strict=strict) as w:
        def train(k: int) -> None:
            model = models[k]
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(200):
                opt.zero_grad()
                loss = model(torch.randn(4, 4)).pow(2).mean()
                if k == planted_on and step == planted_at:
                    loss.backward(retain_graph=True)
                    opt.step()  # the planted hazard: the graph saved the old weights
                seen.backward(loss)
                opt.step()

        run_threads([lambda k=k: train(k) for k in range(8)], [f"trainer-{k}" for k in range(8)])
    assert seen.mismatches() == (0, 0)
    assert sum(seen.backwards.values()) == 8 * 200
    ((thread, reports),) = seen.predicted.items()
    assert seen.names[thread] == f"trainer-{planted_on}" and len(reports) == 1
    h = reports[0].hazards[0]
    assert h.kind == "inplace" and h.tensor is not None
    stale = w.ledger.by_name[h.tensor].ref()
    assert any(stale is p for p in models[planted_on].parameters())
    # Blamed on its own thread's step, and every event names its thread.
    (m,) = h.modified_by
    assert re.fullmatch(rf"opt(\[\d\])?\.step\(\) #{planted_at + 1} on thread trainer-{planted_on}",
                        m.description), m.description
    assert reports[0].thread == f"trainer-{planted_on}"
    assert f"on thread trainer-{planted_on}" in str(reports[0])
    # Strict mode's hooks are the opening thread's: the report says what that leaves out.
    per_thread = [n for n in h.notes if "saved-tensor hooks are per thread" in n]
    if strict:
        assert per_thread == [
            f"strict mode records saved tensors on thread {threading.current_thread().name} "
            f"only (saved-tensor hooks are per thread); this backward runs on thread "
            f"trainer-{planted_on}, and a forward there is checked as in the default mode, "
            "without write lines"]
        assert per_thread[0] in str(reports[0])
    else:
        assert per_thread == []
    assert f'"thread": "trainer-{planted_on}"' in reports[0].to_json()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_hogwild_on_one_shared_model_stays_consistent(strict: bool) -> None:
    # Threads step one model's parameters while others run backward through
    # graphs that saved them. Whichever interleaving happens, no prediction is
    # a false alarm (versions only grow), and every failure is explained.
    model = small_model()
    seen = Outcomes()
    with versionwatch.watch_all(on_hazard=seen.report, strict=strict) as w:
        def train() -> None:
            opt = torch.optim.SGD(model.parameters(), lr=0.001)
            for _ in range(50):
                loss = model(torch.randn(4, 4)).pow(2).mean()
                seen.backward(loss)
                opt.step()

        run_threads([train] * 4)
    for me, reports in seen.predicted.items():
        assert len(reports) <= len(seen.raised.get(me, []))  # no false alarm
    for msgs in seen.raised.values():
        assert all("modified by an inplace operation" in m for m in msgs), msgs
    for p in model.parameters():
        assert torch.isfinite(p).all()
        # The ledger saw every version, in order, each move once.
        tr = w.ledger.tracked[id(p)]
        assert tr.last == p._version
        moves = list(tr.history)
        assert all(a.new == b.old for a, b in zip(moves, moves[1:]))
        assert all(m.modification.kind == "optimizer.step" for m in moves), [
            m.modification.description for m in moves if m.modification.kind != "optimizer.step"]


def test_a_fused_step_on_another_thread_is_no_false_alarm() -> None:
    # Sequence numbers count per thread: this thread has made many nodes, a
    # fresh thread few, so a forward there made after the fused step has
    # smaller numbers than the step's clock, and must not pass for stale.
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    x = torch.ones(1, requires_grad=True)
    for _ in range(100):
        x = x * 1.0
    seen = Outcomes()
    with versionwatch.watch(model, opt, on_hazard=seen.report):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()  # fused: updates the weights without a version bump

        def fresh() -> None:
            seen.backward(model(torch.randn(2, 4)).pow(2).mean())

        run_threads([fresh])
    assert seen.backwards and not seen.predicted and not seen.raised


def test_closing_while_other_threads_run_autograd_is_clean() -> None:
    started = threading.Barrier(3)
    stop = threading.Event()
    done: list[int] = []
    w = versionwatch.watch_all()

    def train() -> None:
        model = small_model()
        started.wait()
        n = 0
        while not stop.is_set() or n < 20:
            model(torch.randn(2, 4)).sum().backward()
            n += 1
        done.append(n)

    threads = [threading.Thread(target=train) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    w.close()  # while both threads are in their loops
    stop.set()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    assert len(done) == 2 and not w.reports
    assert torch.autograd.backward.__module__ == "torch.autograd"
    from versionwatch._watch import inflight as _inflight
    assert not _inflight._FLYING


def test_a_later_thread_with_a_reused_ident_is_named():
    """Threads one after another: a finished thread's ident often goes to the next.

    worker-0's backward frees the graph, the first events of the watcher; worker-1
    starts after it ended (in most tries with worker-0's ident) and fails: its
    report names worker-1. Eight tries, each with a fresh watcher.
    """
    for _ in range(8):
        reports: list[Report] = []
        raised: list[str] = []
        with versionwatch.watch_all(on_hazard=reports.append):
            x = torch.ones(5, 5, requires_grad=True)
            y = x + x ** 2

            def worker(y: torch.Tensor = y, raised: list[str] = raised) -> None:
                try:
                    (y + y ** 2).sum().backward()
                except RuntimeError:
                    raised.append(threading.current_thread().name)

            for k in range(2):
                run_threads([worker], [f"worker-{k}"])
        assert raised == ["worker-1"]
        (report,) = reports
        assert report.thread == "worker-1"
        assert "on thread worker-1" in str(report)


class _Act(nn.Module):
    """An activation written in place inside forward: default mode has no line for it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).sigmoid()
        s = h * 2
        h.mul_(2)
        return s.sum()


def test_default_mode_names_each_threads_forward():
    """Autograd's sequence numbers count per thread: each thread's forward ranges.

    Two threads run their forwards side by side (both count from 0); each
    activation is placed in its own thread's forward, even though the second
    thread's first event comes while the first one's forward runs (its start
    then lacks the thread's name that its end has). Ten tries.
    """
    for _ in range(10):
        models = {"first": _Act(4), "second": _Act(6)}
        got: dict[str, versionwatch.Hazard] = {}
        barrier = threading.Barrier(2)

        def train(name: str, got: dict[str, versionwatch.Hazard] = got,
                  barrier: threading.Barrier = barrier,
                  models: dict[str, nn.Module] = models) -> None:
            x = torch.randn(2, 4)
            barrier.wait()
            loss = models[name](x)
            barrier.wait()
            try:
                loss.backward()
            except versionwatch.InplaceModificationError as e:
                got[name] = e.report.hazards[0]

        with versionwatch.watch(models):
            run_threads([lambda n=n: train(n) for n in models], list(models))
        assert sorted(got) == ["first", "second"]
        for name, width in (("first", 4), ("second", 6)):
            h = got[name]
            assert h.shape == (2, width) and h.module == name
            assert re.fullmatch(rf"{name}\.forward #1( on thread {name})? at .*",
                                h.saved_during or ""), h.saved_during


def test_a_step_that_raised_is_closed_by_the_next_step() -> None:
    # With a second thread alive, a step opens a window in which versions that
    # move are blamed on it; a step vetoed by a pre-hook never reaches our
    # post-hook, and its window must not outlive it.
    release = threading.Event()
    idle = threading.Thread(target=release.wait)
    idle.start()
    try:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def veto(*_: object) -> None:
            raise RuntimeError("vetoed")

        with versionwatch.watch(model, opt) as w:
            handle = opt.register_step_pre_hook(veto)  # after ours: ours has run
            model(torch.ones(1, 2)).sum().backward()
            with pytest.raises(RuntimeError, match="vetoed"):
                opt.step()
            handle.remove()
            opt.step()
            assert not w.ledger._stepping and not w.ledger._steps
    finally:
        release.set()
        idle.join()


def test_a_strict_entry_left_on_a_thread_is_counted_until_the_thread_ends():
    """Closed from another thread, a strict watcher's hook entry waits for its own thread."""
    from versionwatch._runtime import installed

    opened, finish = threading.Event(), threading.Event()
    box: list[versionwatch.Watcher] = []

    def worker() -> None:
        box.append(versionwatch.watch_all(strict=True))
        opened.set()
        finish.wait(JOIN_S)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert opened.wait(JOIN_S)
        box[0].close()  # not its thread: PyTorch lets no thread pop another's hooks
        assert installed() == {"saved-tensor hook entries pending": 1,
                               "saved-tensor hook stack wrappers": 1}
    finally:
        finish.set()
        t.join(JOIN_S)
    assert installed() == {}  # its stack went with the thread


# A backward whose hook starts a thread that runs a backward, then joins it: the
# thread's backward must not wait for the outer one, which waits for it (issue #23,
# item 3). Each case prints what happened; the watched run must print the same.
HOOK_JOINS = """\
import sys, threading, time
import torch

case, watched = sys.argv[1], sys.argv[2] == "watched"
torch.manual_seed(0)
x = torch.randn(4, requires_grad=True)
said = []

def in_thread(fn):
    def run():
        try:
            fn()
            said.append("thread ok")
        except RuntimeError as e:
            said.append("thread " + str(e).split(".")[0])
    t = threading.Thread(target=run)
    t.start()
    return t

def main():
    if case == "unrelated":  # the repro: a graph of its own
        y = x * 2
        w = torch.ones(3, requires_grad=True)
        y.register_hook(lambda g: in_thread(lambda: (w * 3).sum().backward()).join())
        y.sum().backward()
    elif case == "shared":  # the thread runs (and frees) a part the outer one has yet to run
        h = x.exp()
        y, z = h * 2, h * 3
        y.register_hook(lambda g: in_thread(lambda: z.sum().backward()).join())
        y.sum().backward()
    elif case == "cuda":  # the hook of a CUDA node runs on autograd's device thread
        y = torch.randn(4, device="cuda", requires_grad=True) * 2
        w = torch.ones(3, requires_grad=True)
        y.register_hook(lambda g: in_thread(lambda: (w * 3).sum().backward()).join())
        y.sum().backward()
    elif case == "later":  # started by one hook, joined by a later one
        threads = []
        m = x * 1.0  # backward reaches it last: its hook joins the thread
        m.register_hook(lambda g: threads[0].join())
        a = torch.randn(800, 800, requires_grad=True) / 30
        h = m.sum() * a
        for _ in range(8):  # C work between the two hooks, while the thread departs
            h = (h @ a).tanh()
        h = h * 1.0  # backward reaches it first: its hook starts the thread
        w = torch.ones(3, requires_grad=True)
        h.register_hook(lambda g: threads.append(in_thread(lambda: (w * 3).sum().backward())))
        h.sum().backward()

start = time.perf_counter()
try:
    if watched:
        import versionwatch
        with versionwatch.watch_all():
            main()
    else:
        main()
    said.append("outer ok")
except RuntimeError as e:
    said.append("outer " + str(e).split(".")[0])
print(sorted(said), file=sys.stderr)
print(time.perf_counter() - start)
"""


@pytest.mark.parametrize("case", [
    "unrelated", "shared", "later",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU")]),
])
def test_a_hook_that_joins_a_thread_running_backward_never_stalls(case: str,
                                                                  tmp_path: Path) -> None:
    """Plain: milliseconds. Watched, the thread's backward waited 60 s for the outer one."""
    (tmp_path / "hook_joins.py").write_text(HOOK_JOINS)
    runs = []
    for mode in ("plain", "watched"):
        # Bounded: a stall of the watched run fails here, well before 60 s.
        p = subprocess.run([sys.executable, "hook_joins.py", case, mode], cwd=tmp_path,
                           capture_output=True, text=True, timeout=45)
        assert p.returncode == 0, p.stderr
        runs.append((float(p.stdout), p.stderr))
    (plain_s, plain), (watched_s, watched) = runs
    assert watched == plain
    # Not a benchmark: far below the 60 s that it took, far above any scheduling noise.
    assert watched_s < plain_s + 10, (plain_s, watched_s)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pthread_create via ctypes")
@pytest.mark.parametrize("dummy", [False, True], ids=["unnamed", "current_thread"])
def test_a_thread_python_did_not_start_running_program_code_is_not_waited_on(
        dummy: bool) -> None:
    """Autograd's device threads run the hooks of CUDA nodes: threads Python did not
    start. While one runs the program's code, which backward it serves is unknown, and
    a prediction waits for none (the hook may be waiting for it)."""
    import ctypes

    from versionwatch._watch import inflight as _inflight

    inside, leave = threading.Event(), threading.Event()

    def hook(_: object) -> None:  # the program's code, on a thread of C's
        if dummy:
            threading.current_thread()  # Python then lists it, as a dummy thread
        inside.set()
        leave.wait(JOIN_S)

    callback = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(hook)
    libc = ctypes.CDLL(None)
    tid = ctypes.c_ulong()
    assert _inflight._may_wait_for([])
    assert libc.pthread_create(ctypes.byref(tid), None, callback, None) == 0
    try:
        assert inside.wait(JOIN_S)
        assert not _inflight._may_wait_for([])
    finally:
        leave.set()
        libc.pthread_join(tid, None)
    assert _inflight._may_wait_for([])


# The engine's entry as PyTorch's own file names it: a stand-in compiled under that
# file name, so a thread can be held inside "the engine" and its stack classified.
_ENGINE_STANDIN = """
def _engine_run_backward(inside, *args):
    return inside(*args)
"""


@pytest.mark.parametrize("where", ["wrapper below the engine", "hook above the engine"])
def test_a_flight_is_waited_for_unless_the_engine_called_program_code(where: str):
    """A program's wrapper around the engine (a profiler, the peer harness) waits for
    the engine, which lands on its own: a prediction waits for that flight. A hook the
    engine called may wait for anything: a prediction does not wait for that one."""
    import os

    from versionwatch import _sites
    from versionwatch._watch import inflight as _inflight

    engine_file = os.path.join(os.path.dirname(torch.autograd.__file__), "graph.py")
    space: dict[str, object] = {}
    exec(compile(_ENGINE_STANDIN, engine_file, "exec"), space)
    engine = space["_engine_run_backward"]
    entered, held = threading.Event(), threading.Lock()
    held.acquire()

    def hook() -> None:  # the program's code, called by the engine
        held.acquire(True, JOIN_S)

    def wrapper() -> None:  # the program's code, on the way into the engine
        entered.set()
        if where.startswith("wrapper"):
            engine(held.acquire, True, JOIN_S)  # type: ignore[operator]  # C++ work: no frame
        else:
            engine(hook)  # type: ignore[operator]

    t = threading.Thread(target=wrapper)
    t.start()
    try:
        assert entered.wait(JOIN_S)
        stack = None
        for _ in range(1000):  # until the thread is inside the engine
            stack = _sites.thread_stacks()[t.ident]  # type: ignore[index]
            if stack.frames[0].name in ("_engine_run_backward", "hook"):
                break
            threading.Event().wait(0.001)
        assert stack is not None
        runs_program = _inflight._runs_program_code(stack, stop_at_backward=True)
        assert runs_program == where.startswith("hook")
    finally:
        held.release()
        t.join(JOIN_S)


CLOSED_ELSEWHERE = """\
import sys, threading
import torch
from torch import nn

model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
if sys.argv[1] == "watched":
    import versionwatch
    w = versionwatch.watch(model, strict=True)
    close = w.close
else:
    close = lambda: None
model(torch.ones(1, 2)).sum().backward()
t = threading.Thread(target=close)  # not the watcher's thread: its entry waits for this one
t.start()
t.join()
print("done")
"""


def test_a_strict_watcher_closed_from_another_thread_leaves_nothing_to_say_at_exit(
        tmp_path: Path) -> None:
    """The main thread's hook entry is still pending at exit: the interpreter's
    teardown must drop it silently, not print "Exception ignored in _forget_ended"."""
    (tmp_path / "closed_elsewhere.py").write_text(CLOSED_ELSEWHERE)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src}
    runs = []
    for mode in ("plain", "watched"):
        p = subprocess.run([sys.executable, "closed_elsewhere.py", mode], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        runs.append((p.returncode, p.stdout, p.stderr))
    assert runs[1] == runs[0] == (0, "done\n", "")
