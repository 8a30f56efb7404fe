"""The CLI end to end, in subprocesses: exit statuses, JSON, naming, __main__ semantics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from side_by_side import run_all

SEED = textwrap.dedent("""\
    import sys
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.tensor([2.0]))
            self.w2 = nn.Parameter(torch.tensor([3.0]))
            self.w3 = nn.Parameter(torch.tensor([4.0]))

        def forward(self, a):
            s = a * self.w1
            return s * self.w2, s * self.w3

    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = nn.MSELoss()
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    for n in range(3):
        y1_pred, y2_pred = model(x)
        optim.zero_grad(set_to_none=False)
        loss1 = mse(y1_pred, y1)
        loss1.backward(retain_graph=True)
        optim.step()
        optim.zero_grad(set_to_none=False)
        loss2 = mse(y2_pred, y2)
        loss2.backward()
        optim.step()
    print("done")
""")


def line_of(src: str, text: str, nth: int = 1) -> int:
    hits = [i for i, line in enumerate(src.splitlines(), 1) if text in line]
    return hits[nth - 1]


STEP1 = line_of(SEED, "optim.step()")
BACKWARD2 = line_of(SEED, "loss2.backward()")


def vw(*args: str, cwd: Path, env: dict[str, str] | None = None,
       ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "versionwatch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def side_by_side(cwd: Path, plain: list[str], watched: list[str],
                 ) -> list[subprocess.CompletedProcess[str]]:
    """``python(*plain)`` and ``vw(*watched)`` at once, for a program that reads no file
    the watched run writes (pytest runs on one core; the other runs the second child)."""
    return run_all(([sys.executable, *plain], {"cwd": cwd}),
                   ([sys.executable, "-m", "versionwatch", *watched], {"cwd": cwd}))


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The plain run that a watched one must match."""
    return subprocess.run([sys.executable, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def run_console(console: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``versionwatch ...`` through its console script, when it is installed."""
    if not console.exists():
        pytest.skip(f"no console script at {console}")
    return subprocess.run([str(console), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_hazard_exits_1_with_explanation_and_json(tmp_path: Path):
    (tmp_path / "train.py").write_text(SEED)
    r = vw("run", "--json", "out.json", "--dot", "out.dot", "train.py", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "done" not in r.stdout
    assert "model.w3 saved by MulBackward0 was modified by an inplace operation" in r.stderr
    assert f"optim.step() #3 at train.py:{STEP1}" in r.stderr
    assert "_watch/watcher.py" not in r.stderr and "Traceback" in r.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["schema"] == "versionwatch.report/1" and doc["exit_status"] == 1
    (h,) = doc["hazards"]
    assert (h["kind"], h["detected"], h["tensor"], h["saved_by"], h["slot"]) == (
        "inplace", "predicted", "model.w3", "MulBackward0", "other")
    assert (h["saved_version"], h["current_version"], h["shape"], h["dtype"]) == (1, 2, [1], "float32")
    assert h["modified_by"] == [{"kind": "optimizer.step", "description": "optim.step() #3",
                                 "file": "train.py", "line": STEP1, "versions": [1, 2]}]
    assert h["backward_site"] == {"file": "train.py", "line": BACKWARD2}
    assert "model.w3" in doc["timeline"]["columns"]
    dot = (tmp_path / "out.dot").read_text()
    assert dot.startswith("digraph") and "MulBackward0" in dot and "color=red" in dot


def test_clean_run_keeps_exit_status_and_argv(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "pkg" / "main.py").write_text(textwrap.dedent("""\
        import pickle, sys
        import torch
        import helper  # importable because sys.path[0] is the script's folder

        class Box:
            pass

        assert __name__ == "__main__"
        assert pickle.loads(pickle.dumps(Box())).__class__.__name__ == "Box"
        net = torch.nn.Linear(2, 1)
        net(torch.ones(1, 2)).sum().backward()
        print(sys.argv, helper.VALUE)
        sys.exit(3)
    """))
    r = vw("run", "pkg/main.py", "--flag", "x", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert r.stdout == python("pkg/main.py", "--flag", "x", cwd=tmp_path).stdout
    assert "['pkg/main.py', '--flag', 'x'] 7" in r.stdout
    assert "1 backward(s) watched, no hazard" in r.stderr


def test_module_mode_and_class_name(tmp_path: Path):
    (tmp_path / "mymod.py").write_text(textwrap.dedent("""\
        import sys
        import torch
        from torch import nn
        print("argv", sys.argv[1:])
        w = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))
        opt = torch.optim.SGD(w.parameters(), lr=0.1)
        def run():
            loss = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1))(torch.ones(1, 2)).sum()
            loss.backward()
            out = w(torch.ones(1, 2)).sum()
            out.backward(retain_graph=True)
            opt.step()
            out.backward()
        run()
    """))
    r = vw("run", "--quiet", "-m", "mymod", "a", cwd=tmp_path)
    assert r.returncode == 1
    assert "argv ['a']" in r.stdout
    assert "w.2.weight saved by AddmmBackward0" in r.stderr and "Sequential2" not in r.stderr


def test_inline_module_is_named_by_class(tmp_path: Path):
    (tmp_path / "s.py").write_text(textwrap.dedent("""\
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(2, 2)
                self.b = nn.Linear(2, 1)
            def forward(self, x):
                return self.b(self.a(x).tanh())
        def go(net):
            loss = net(torch.ones(1, 2)).sum()
            loss.backward(retain_graph=True)
            with torch.no_grad():
                net.b.weight.mul_(2)
            loss.backward()
        go(Net())
    """))
    r = vw("run", "s.py", cwd=tmp_path)
    assert r.returncode == 1
    assert "net.b.weight" in r.stderr or "Net.b.weight" in r.stderr
    assert "between end of backward #1 (s.py:12) and backward #2 (s.py:15)" in r.stderr


def test_warn_policy_lets_pytorch_raise_with_a_note(tmp_path: Path):
    (tmp_path / "train.py").write_text(SEED)
    r = vw("run", "--on-hazard", "warn", "train.py", cwd=tmp_path)
    assert r.returncode == 1
    assert "InplaceHazardWarning" in r.stderr
    assert "RuntimeError: one of the variables needed for gradient computation" in r.stderr
    assert "versionwatch predicted this before backward ran" in r.stderr


def test_json_written_when_the_script_dies(tmp_path: Path):
    # Python hands an uncaught exception to sys.excepthook, which a script may replace
    # (rich, a logger); the traceback it gets starts at the script's frames.
    (tmp_path / "err.py").write_text(textwrap.dedent("""\
        import sys, traceback
        import torch
        def hook(tp, value, tb):
            print("hooked", tp.__name__, [f.name for f in traceback.extract_tb(tb)])
        sys.excepthook = hook
        def load():
            raise ValueError("bad data")
        load()
    """))
    plain, r = side_by_side(tmp_path, ["err.py"], ["run", "--quiet", "--json", "o.json", "err.py"])
    assert plain.stdout == "hooked ValueError ['<module>', 'load']\n"
    assert (r.returncode, r.stdout, r.stderr) == (1, plain.stdout, plain.stderr)
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["exit_status"], doc["exception"]) == (1, "ValueError: bad data")
    assert doc["hazards"] == []


def test_keyboard_interrupt_exits_as_python_does(tmp_path: Path):
    # Python ends by SIGINT after an uncaught KeyboardInterrupt (a shell sees 130),
    # so a calling shell or loop knows it was interrupted.
    (tmp_path / "boom.py").write_text("def f():\n    raise KeyboardInterrupt\nf()\n")
    plain = python("boom.py", cwd=tmp_path)
    assert plain.returncode == -signal.SIGINT
    console = Path(sys.executable).with_name("versionwatch")
    for r in (vw("run", "--quiet", "--json", "o.json", "boom.py", cwd=tmp_path),
              run_console(console, "run", "--quiet", "boom.py", cwd=tmp_path)):
        assert (r.returncode, r.stdout, r.stderr) == (plain.returncode, "", plain.stderr)
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["exit_status"], doc["exception"]) == (130, "KeyboardInterrupt: ")


def test_missing_script(tmp_path: Path):
    r = vw("run", "nope.py", cwd=tmp_path)
    assert r.returncode == 2 and "can't open file 'nope.py'" in r.stderr


def test_svg_needs_dot(tmp_path: Path):
    import shutil

    (tmp_path / "train.py").write_text(SEED)
    r = vw("run", "--svg", "o.svg", "train.py", cwd=tmp_path)
    if shutil.which("dot"):
        assert (tmp_path / "o.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    else:
        assert "--svg needs Graphviz's `dot` program" in r.stderr


def test_spawned_workers_unpickle_main_objects(tmp_path: Path):
    (tmp_path / "dl.py").write_text(textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Data(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return torch.tensor([float(i)])

        if __name__ == "__main__":
            loader = DataLoader(Data(), batch_size=2, num_workers=1,
                                multiprocessing_context="spawn")
            print(sum(float(b.sum()) for b in loader))
    """))
    r = vw("run", "dl.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "6.0"


def test_demo_runs_in_four_steps(demo_plain: tuple[subprocess.CompletedProcess[str], Path]):
    r, folder = demo_plain  # run once for the session (tests/conftest.py)
    assert r.returncode == 0, r.stderr
    for n in range(1, 5):
        assert f"=== step {n}/4" in r.stdout
    assert "is at version 2; expected version 1 instead" in r.stdout
    assert "model.w3 saved by MulBackward0" in r.stdout
    assert "optim.step() #3 at versionwatch/_cli/demo.py" in r.stdout
    # It ends with the patch versionwatch fix verified, and the patched loop watched.
    step4 = r.stdout[r.stdout.index("=== step 4/4"):]
    assert "verified: one `optim.step()` after both backwards" in step4
    assert "checked: the program ran to its end (6 backward(s)), no hazard" in step4
    assert ("diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n" in step4)
    assert "-    optim.step()\n-    optim.zero_grad(set_to_none=False)\n" in step4
    assert "rejected: set_to_none: set_to_none=True only hides the failure" in step4
    assert "3 iterations, 0 hazards" in step4
    assert not [p for p in folder.iterdir()]  # the program it patched was a scratch copy


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help(argv, tmp_path: Path):
    r = vw(*argv, cwd=tmp_path)
    assert r.returncode == 0 and "versionwatch" in r.stdout


def test_torch_multiprocessing_spawn_and_systemexit_json(tmp_path: Path):
    (tmp_path / "mp.py").write_text(textwrap.dedent("""\
        import sys
        import torch
        import torch.multiprocessing as mp

        def work(rank, q):
            q.put(float(torch.ones(2).sum()) + rank)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.SimpleQueue()
            mp.spawn(work, args=(q,), nprocs=1, join=True)
            print("got", q.get())
            sys.exit(4)
    """))
    r = vw("run", "--json", "o.json", "mp.py", cwd=tmp_path)
    assert r.returncode == 4, r.stderr
    assert "got 2.0" in r.stdout
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["exit_status"] == 4 and doc["exception"] is None and doc["ok"] is True


ARGV = textwrap.dedent("""\
    import os, sys
    print(sys.argv, os.listdir("."))
    if "--exit" in sys.argv:
        code = sys.argv[sys.argv.index("--exit") + 1]
        sys.exit(int(code) if code.isdigit() else code)
""")


def test_options_after_module_belong_to_it(tmp_path: Path):
    # `-m pkg.train --json cfg.json` overwrote the program's cfg.json with the report.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(ARGV)
    (tmp_path / "cfg.json").write_text('{"lr": 1}')
    args = ("-m", "pkg.train", "--json", "cfg.json", "--lr", "0.1", "--exit", "bad config")
    plain = python(*args, cwd=tmp_path)
    assert plain.returncode == 1 and str(tmp_path / "pkg" / "train.py") in plain.stdout
    r = vw("run", "--quiet", "--json", "vw.json", *args, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (1, plain.stdout, plain.stderr)
    assert (tmp_path / "cfg.json").read_text() == '{"lr": 1}'
    doc = json.loads((tmp_path / "vw.json").read_text())
    assert (doc["target"], doc["exit_status"]) == ("pkg.train", 1)


def test_options_after_script_belong_to_it(tmp_path: Path):
    # `--` ends versionwatch's options, as it ends python's. One plain run, the
    # reference for both (it lists the folder: the runs go one after the other).
    (tmp_path / "s.py").write_text(ARGV)
    args = ("s.py", "--json", "x.json", "--quiet", "-h", "--", "-m", "y", "--exit", "3")
    plain = python(*args, cwd=tmp_path)
    assert plain.returncode == 3 and "'--json', 'x.json'" in plain.stdout
    for own in (["--"], ["--quiet"]):
        r = vw("run", *own, *args, cwd=tmp_path)
        assert (r.returncode, r.stdout) == (3, plain.stdout), (own, r.stderr)
        assert not (tmp_path / "x.json").exists()


def test_unwritable_outputs_keep_the_programs_exit_status(tmp_path: Path):
    (tmp_path / "s.py").write_text(textwrap.dedent("""\
        import torch
        def load():
            try:
                open("missing.csv")
            except OSError as e:
                raise RuntimeError("no data") from e
        print("started")
        load()
    """))
    # A `dot` that fails to write its output, as Graphviz's does for a missing folder.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dot").write_text('#!/bin/sh\ncat > "$3"\n')
    (bin_dir / "dot").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    plain = python("s.py", cwd=tmp_path)
    assert plain.returncode == 1 and "The above exception was the direct cause" in plain.stderr
    r = vw("run", "--quiet", "--json", "no/vw.json", "--dot", "no/vw.dot", "--svg", "no/vw.svg",
           "s.py", cwd=tmp_path, env=env)
    assert (r.returncode, r.stdout) == (1, plain.stdout)
    # The program's traceback as Python prints it, then one line per output.
    assert r.stderr.startswith(plain.stderr), r.stderr
    errors = r.stderr[len(plain.stderr):].splitlines()
    assert [e.split(": ")[:3] for e in errors] == [
        ["versionwatch", "error", f"cannot write {o} no/vw.{o[2:]}"]
        for o in ("--json", "--dot", "--svg")], errors



def test_bad_environment_variables_are_one_line_errors(tmp_path: Path):
    """Issue #23, item 9: every variable versionwatch reads, given garbage."""
    (tmp_path / "prog.py").write_text("print('ran')\n")
    base = {k: v for k, v in os.environ.items()
            if k not in ("VERSIONWATCH_ON_HAZARD", "RANK", "WORLD_SIZE")}
    # Ours: refused before the program runs, as --on-hazard garbage is.
    r = vw("run", "prog.py", cwd=tmp_path, env={**base, "VERSIONWATCH_ON_HAZARD": "garbage"})
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        "versionwatch run: error: VERSIONWATCH_ON_HAZARD='garbage' is not a valid policy; "
        "use one of: raise, warn, log, repair\n"))
    r = vw("run", "--on-hazard", "garbage", "prog.py", cwd=tmp_path, env=base)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = vw("run", "prog.py", cwd=tmp_path, env={**base, "VERSIONWATCH_NATIVE": "garbage"})
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr.startswith("versionwatch run: error: VERSIONWATCH_NATIVE='garbage' is not "
                               "valid; use auto"), r.stderr
    # torchrun's: they only label the report, and the program decides what they mean;
    # garbage there is no distributed run, and the run is the plain one.
    for env in ({"RANK": "zero", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "two"}):
        r = vw("run", "--json", "o.json", "prog.py", cwd=tmp_path, env={**base, **env})
        assert (r.returncode, r.stdout) == (0, "ran\n"), r.stderr
        assert "Traceback" not in r.stderr
        assert "rank" not in json.loads((tmp_path / "o.json").read_text())
    # --replay decides by WORLD_SIZE whether it may re-run the program: it says so.
    r = vw("run", "--replay", "prog.py", cwd=tmp_path, env={**base, "WORLD_SIZE": "two"})
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        "versionwatch run: error: --replay reads WORLD_SIZE to refuse distributed runs, and "
        "WORLD_SIZE='two' is not a whole number\n"))


CHDIR = SEED.replace("model = Model()", textwrap.dedent("""\
    import os
    print(sys.argv[0], __file__, flush=True)
    os.chdir(sys.argv[1])
    print(sys.argv[0], __file__, flush=True)
    model = Model()"""))


def test_outputs_and_replay_survive_a_chdir(tmp_path: Path):
    """Issue #23, item 5: the paths given are the command's, whatever the script's cwd."""
    (tmp_path / "train.py").write_text(CHDIR)
    (tmp_path / "elsewhere").mkdir()
    # A stand-in for Graphviz's dot, run from the script's new working directory.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dot").write_text("#!/bin/sh\ncat > \"$3\"\n")
    (bin_dir / "dot").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    plain = python("train.py", "elsewhere", cwd=tmp_path)
    r = vw("run", "--json", "o.json", "--dot", "o.dot", "--svg", "o.svg", "--replay",
           "train.py", "elsewhere", cwd=tmp_path, env=env)
    assert r.returncode == 1 and r.stdout == plain.stdout, r.stderr
    # sys.argv[0] as typed, __file__ absolute: as python gives them, before and after.
    assert r.stdout == f"train.py {tmp_path / 'train.py'}\n" * 2
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == []
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["hazards"][0]["tensor"] == "model.w3"
    assert "same hazard at backward #" in doc["hazards"][0]["replay"], doc["hazards"][0]
    assert (tmp_path / "o.dot").read_text().startswith("digraph")
    assert (tmp_path / "o.svg").read_text() == (tmp_path / "o.dot").read_text()


def test_script_from_standard_input(tmp_path: Path):
    """Issue #23, item 14: ``versionwatch run -`` reads the script from stdin, as ``python -``."""
    probe = textwrap.dedent("""\
        import sys, traceback
        import torch
        net = torch.nn.Linear(2, 1)
        net(torch.ones(1, 2)).sum().backward()
        print(sys.argv, repr(sys.path[0]), __name__, __file__, __cached__, __loader__,
              __spec__, __package__, sorted(k for k in globals() if k.startswith('__')))
        print(sys.stdin.read() == '')
        print(traceback.extract_stack()[-1].filename)
        raise SystemExit(4)
    """)

    def run(*argv: str, src: str) -> tuple[list[str], dict[str, Any]]:
        return [sys.executable, *argv], {"input": src, "cwd": tmp_path}

    # Four independent runs, side by side (each writes its own report).
    plain, r, plain2, r2 = run_all(
        run("-", "a", "--b", src=probe),
        run("-m", "versionwatch", "run", "--json", "o.json", "-", "a", "--b", src=probe),
        run("-", src=SEED),
        run("-m", "versionwatch", "run", "--replay", "--json", "o2.json", "-", src=SEED))
    assert plain.returncode == 4 and "['-', 'a', '--b'] '' __main__ <stdin> None" in plain.stdout
    assert (r.returncode, r.stdout) == (4, plain.stdout), r.stderr
    assert "1 backward(s) watched, no hazard" in r.stderr
    assert json.loads((tmp_path / "o.json").read_text())["target"] == "-"
    # A hazard: the traceback's file is <stdin>, and --replay feeds the source to its child.
    assert (r2.returncode, r2.stdout) == (1, plain2.stdout), r2.stderr
    assert f'File "<stdin>", line {BACKWARD2}, in <module>' in r2.stderr
    (h,) = json.loads((tmp_path / "o2.json").read_text())["hazards"]
    assert h["tensor"] == "model.w3" and "same hazard at backward #" in h["replay"], h
    assert h["modified_by"][0]["line"] == STEP1


STALE_LOGGED = textwrap.dedent("""\
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 2)).sum()
    loss.backward(retain_graph=True)
    opt.step()
    try:
        loss.backward()
    except RuntimeError:
        pass
""")


def test_os_exit_writes_the_report(tmp_path: Path):
    """Issue #23, item 12: ``os._exit(n)`` ends the run with the report written, called
    from a thread that is not the main one (docs/cli.md: "from any thread").

    A forked child's own os._exit (multiprocessing's) writes nothing of the parent's.
    """
    (tmp_path / "quits.py").write_text(STALE_LOGGED + textwrap.dedent("""\
        import inspect, multiprocessing, os, sys
        print(os._exit.__name__, inspect.signature(os._exit))
        child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
        child.start()
        child.join()
        print(child.exitcode, os.path.exists("o.json"), flush=True)
        sys.stdout.write("unflushed, if stdout is buffered")
        import threading  # os._exit from a thread other than the main one
        threading.Thread(target=os._exit, args=(5,)).start()
        threading.Event().wait(60)  # the thread ends the process first
    """))
    plain = python("quits.py", cwd=tmp_path)
    assert plain.returncode == 5, plain
    assert plain.stdout.startswith("_exit (status)\nchild\n0 False\n"), plain
    r = vw("run", "--on-hazard", "log", "--json", "o.json", "--dot", "o.dot", "quits.py",
           cwd=tmp_path)
    assert (r.returncode, r.stdout) == (plain.returncode, plain.stdout), r.stderr
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["exit_status"], doc["exception"], doc["ok"]) == (5, "os._exit(5)", False)
    assert doc["hazards"][0]["tensor"] == "model.2.weight"
    assert (tmp_path / "o.dot").read_text().startswith("digraph")


LATE_THREAD = textwrap.dedent("""\
    import threading
    import torch

    def train():
        threading.main_thread().join()  # returns once the main module has ended
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(),
                                    torch.nn.Linear(2, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.ones(1, 2)).sum()
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()

    threading.Thread(target=train, name="late").start()
    print("main done", flush=True)
""")


def test_non_daemon_thread_after_main_is_watched(tmp_path: Path):
    """Issue #23, item 13: Python waits for non-daemon threads after __main__ returns, and
    so does the watcher: a hazard there is in the report."""
    (tmp_path / "late.py").write_text(LATE_THREAD)
    plain, r = side_by_side(tmp_path, ["late.py"], ["run", "--json", "o.json", "late.py"])
    assert (plain.returncode, plain.stdout) == (0, "main done\n")
    assert "Exception in thread late" in plain.stderr and "is at version 2" in plain.stderr
    assert (r.returncode, r.stdout) == (0, plain.stdout), r.stderr
    assert "Exception in thread late" in r.stderr
    assert "InplaceModificationError: versionwatch: backward will fail" in r.stderr
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["ok"], doc["exit_status"]) == (False, 0), doc
    assert doc["hazards"][0]["tensor"] == "model.2.weight"
    # The summary comes once the thread is done, after what the thread printed.
    assert r.stderr.index("Exception in thread late") < r.stderr.index("had hazards")


NEVER_ENDS = textwrap.dedent("""\
    import threading, time
    import torch

    def spin():
        threading.main_thread().join()
        print("ready", flush=True)
        while True:
            time.sleep(0.05)

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    threading.Thread(target=spin).start()
""")


@pytest.mark.usefixtures("no_process_left")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signal_while_waiting_for_threads(tmp_path: Path, sig: signal.Signals):
    """A thread that never ends: the run waits as python does, and a signal then ends it as
    it ends python, with the report written."""
    (tmp_path / "spin.py").write_text(NEVER_ENDS)
    results = []
    procs = []  # plain and watched side by side, each in a process group of its own
    try:
        for argv in ([sys.executable, "spin.py"],
                     [sys.executable, "-m", "versionwatch", "run", "--json", "o.json",
                      "spin.py"]):
            procs.append(subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        # Into the wait: CPython loses a SIGINT that comes between threading's
        # last check for signals and its blocking lock.acquire(), plain or not.
        time.sleep(0.5)
        for p in procs:
            os.killpg(p.pid, sig)  # as a terminal sends Ctrl-C: to the whole group
        for p in procs:
            out, err = p.communicate(timeout=60)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    (plain_status, _, plain_err), (status, _, err) = results
    assert status == plain_status, (results, err)
    if sig == signal.SIGINT:
        # Python reports the interrupted wait and ends normally; so does the run.
        assert plain_err.startswith("Exception ignored in: <module 'threading'"), plain_err
        assert err.startswith(plain_err.split("Traceback")[0]), err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["timeline"]["events"], doc
    if sig == signal.SIGTERM:
        assert (doc["exit_status"], doc["exception"]) == (143, "terminated by SIGTERM")
    else:
        assert (doc["exit_status"], doc["exception"]) == (0, None)


# The seed story, which stops in its replay (the second run) before the failing backward.
REPLAY_HANGS = SEED.replace("model = Model()", textwrap.dedent("""\
    import os, time
    if os.path.exists("first.done"):  # the replay's run
        with open("child.pid", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    open("first.done", "w").close()
    model = Model()"""))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def _replay_interrupted(tmp_path: Path, how: str) -> tuple[int, str, int]:
    """``versionwatch run --replay`` of REPLAY_HANGS, hit by ``how`` while its replay runs.

    Returns its exit status, its stderr and the replay child's pid. Its temporary
    folder is tmp_path/tmp. Everything it started is killed if it outlives the test.
    """
    (tmp_path / "train.py").write_text(REPLAY_HANGS)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    p = subprocess.Popen([sys.executable, "-m", "versionwatch", "run", "--replay", "--json",
                          "o.json", "train.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = 0
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "child.pid").exists() or not (
                tmp_path / "child.pid").read_text():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)  # as a terminal: to the foreground group
        else:
            p.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    deadline = time.monotonic() + 10
    while child and _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = child and _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, f"the replay's child outlived its parent ({how})"
    return p.returncode, err, child


@pytest.fixture(scope="module")
def replays_interrupted(tmp_path_factory: pytest.TempPathFactory,
                        ) -> Iterator[dict[str, tuple[Path, int, str]]]:
    """:func:`_replay_interrupted` by SIGTERM, Ctrl-C and SIGKILL, the three side by side
    (each in its own folder and process group): ``how -> (folder, status, stderr)``.
    None of their processes may outlive them (conftest's processes_checked)."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import processes_checked

    hows = ["sigterm", "ctrl-c", "sigkill"]
    folders = {how: tmp_path_factory.mktemp(f"replay-{how}") for how in hows}
    with processes_checked("the interrupted replays"), ThreadPoolExecutor(len(hows)) as pool:
        done = {how: pool.submit(_replay_interrupted, folders[how], how) for how in hows}
        results = {how: (folders[how], *f.result()[:2]) for how, f in done.items()}
    yield results


@pytest.mark.usefixtures("no_process_left")
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_signal_during_replay_keeps_the_first_report(
        replays_interrupted: dict[str, tuple[Path, int, str]], how: str):
    """Issue #23, item 1: SIGTERM or Ctrl-C while the replay's second run goes: the first
    run's report is written, the child dies with its parent, nothing is left in the temp
    folder, and the run ends as the signal ends python, with no traceback of ours."""
    tmp_path, status, err = replays_interrupted[how]
    sig = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    assert status == -sig, err
    assert "_cli/replay.py" not in err and "_cli/command.py" not in err, err
    # The program's own traceback (its hazard) is there; nothing after the replay began.
    assert err.count("Traceback") == 1, err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["exit_status"], doc["ok"]) == (1, False)
    assert doc["exception"].startswith("InplaceModificationError: ")
    (h,) = doc["hazards"]
    said = "SIGTERM" if how == "sigterm" else "Ctrl-C"
    assert h["tensor"] == "model.w3" and h["replay"] == (
        f"not reproduced: the strict replay of the same command was interrupted ({said}); "
        "run it with --strict instead"), h
    assert list((tmp_path / "tmp").glob("versionwatch-replay-*")) == []


@pytest.mark.usefixtures("no_process_left")
def test_replay_child_dies_with_a_killed_parent(
        replays_interrupted: dict[str, tuple[Path, int, str]]):
    """SIGKILL leaves versionwatch no say: the kernel ends the child (PR_SET_PDEATHSIG on
    Linux; elsewhere the child sees the pipe from its parent close), and the first
    run's report was written before the replay began."""
    tmp_path, status, _ = replays_interrupted["sigkill"]
    assert status == -signal.SIGKILL
    doc = json.loads((tmp_path / "o.json").read_text())
    assert (doc["exit_status"], doc["hazards"][0]["replay"]) == (1, None)
    assert list((tmp_path / "tmp").glob("versionwatch-replay-*")) == []


# A parent that starts a child tied to it as the replay's child is, then sleeps.
TIED = textwrap.dedent("""\
    import os, subprocess, sys, time
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\\n"
         "from versionwatch._process import tie_to_parent\\n"
         "tie_to_parent(int(sys.argv[1]), int(sys.argv[2]), pdeathsig=sys.argv[3] == '1')\\n"
         "print('tied', flush=True)\\n"
         "time.sleep(120)\\n", str(os.getpid()), str(r), sys.argv[1]],
        pass_fds=(r,), start_new_session=True, stdout=subprocess.PIPE, text=True)
    os.close(r)
    assert child.stdout.readline() == "tied\\n"
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.usefixtures("no_process_left")
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "pipe"])
def test_tied_child_dies_with_a_killed_parent(tmp_path: Path, pdeathsig: bool):
    """Each of the two ties alone kills the replay's child when its parent is SIGKILLed:
    PR_SET_PDEATHSIG (Linux), and the pipe its daemon thread watches (everywhere)."""
    if pdeathsig and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    (tmp_path / "tied.py").write_text(TIED)
    p = subprocess.Popen([sys.executable, "tied.py", "1" if pdeathsig else "0"], cwd=tmp_path,
                         stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        assert _alive(child)
        p.kill()
        p.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_replay_after_the_programs_threads(tmp_path: Path):
    """A hazard in the main module, a thread still running: the outputs and the replay
    come once Python has joined the thread (at exit, where Python 3.12 lets no thread
    start: the replay starts none)."""
    (tmp_path / "train.py").write_text(SEED.replace("model = Model()", textwrap.dedent("""\
        import threading
        threading.Thread(target=threading.main_thread().join, name="late").start()
        model = Model()""")))
    r = vw("run", "--replay", "--json", "o.json", "train.py", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    (h,) = json.loads((tmp_path / "o.json").read_text())["hazards"]
    assert "same hazard at backward #" in h["replay"], h
    assert h["modified_by"][0]["line"] == line_of(SEED, "optim.step()") + 2


OWN_WATCHER = textwrap.dedent("""\
    import torch
    import versionwatch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()  # adopted here under `versionwatch run`
    opt.step()
    with versionwatch.watch(model, opt, on_hazard="log") as w:
        out = model(torch.ones(1, 2))
        out.sum().backward(retain_graph=True)
        opt.step()
        try:
            out.sum().backward()
        except RuntimeError as e:
            print("pytorch:", str(e).split(":")[0])
    print("own reports:", len(w.reports))
""")


def test_a_program_that_watches_its_own_model(tmp_path: Path):
    """Issue #23, item 2: the program's own watch() borrows the model; the run keeps the report.

    Plain, under ``run`` and under ``run --strict``: three runs side by side.
    """
    (tmp_path / "own.py").write_text(OWN_WATCHER)
    vw_argv = [sys.executable, "-m", "versionwatch", "run"]
    plain, *runs = run_all(
        ([sys.executable, "own.py"], {"cwd": tmp_path}),
        ([*vw_argv, "--json", "default.json", "own.py"], {"cwd": tmp_path}),
        ([*vw_argv, "--strict", "--json", "strict.json", "own.py"], {"cwd": tmp_path}))
    assert plain.returncode == 0, plain.stderr
    for mode, r in zip(("default", "strict"), runs):
        assert r.returncode == 0, (mode, r.stderr)
        assert r.stdout == plain.stdout, mode
        assert "own reports: 1" in r.stdout
        doc = json.loads((tmp_path / f"{mode}.json").read_text())
        (h,) = doc["hazards"]  # the program's watcher found it; the run's report has it once
        assert h["tensor"] == "model.2.weight", mode


def test_merge_of_deeply_nested_json_is_a_usage_error(tmp_path: Path):
    """json's parser recurses once per level: a RecursionError, not a traceback."""
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "deep_inside.json").write_text(
        '{"schema": "versionwatch.report/1", "ok": true, "hazards": '
        + "[" * 100_000 + "]" * 100_000 + "}")
    for name in ("deep.json", "deep_inside.json"):
        done = vw("merge", name, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (f"versionwatch merge: error: {name} is nested too deeply to be "
                               "a versionwatch report\n")
