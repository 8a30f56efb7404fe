"""versionwatch beside the other tools, on one buggy program: what each says, and what it costs.

The program is the seed story's loop (examples/seed_story.py) for two iterations, with
no versionwatch in it (PROGRAM below; it is written to a scratch folder as ``train.py``
and imported from there, so every tool reports the same file and lines). Iteration 2
fails at ``loss2.backward()``: ``zero_grad(set_to_none=False)`` left a zero ``.grad`` on
``w3``, so the ``optim.step()`` between the two backwards updated ``w3`` in place after
the forward had saved it (``d = s * self.w3``) for ``loss2``'s backward.

Each tool runs on that program in this one process: it wraps the loop (``around``,
the ``with`` line a user adds) or looks at ``loss2`` before its backward (``look``,
the line a user adds for torchviz). For each tool the script prints:

- what the run prints (warnings, what the user prints from the tool, the exception's
  message and notes), with the scratch folder's path removed;
- a facts table, read from that text by fixed rules (``facts()``): does it name the
  parameter (``w3`` outside quoted source lines), the op that saved it
  (``MulBackward0``/``Mul``/``aten::mul``), the line that saved it (``train.py:17``),
  the line that modified it (``train.py:32``), and a fix (a ``fix`` line). "among
  others" means the text names it together with what is not the culprit (the other
  parameters, the other ops, the other forward or step lines), so it does not single
  it out;
- a cost table: the median wall time (``time.perf_counter``) and CPU time
  (``time.process_time``) of one run of the program under each tool, as ratios to the
  plain run's medians. The runs are interleaved: every round runs each tool once, in a
  rotating order, so that drift of the machine hits every tool alike.

Tools absent from this environment are listed as "not in this torch" (DebugMode, torch
< 2.10) or "not installed" (torchviz).

Usage:
  python benchmarks/compared.py                 # outputs, facts, costs (40 rounds)
  python benchmarks/compared.py --repeats 100
  python benchmarks/compared.py --quick         # 3 rounds: facts exact, costs meaningless
  python benchmarks/compared.py --facts         # the facts table only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch

PROGRAM = '''\
import contextlib

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
        c = s * self.w2
        d = s * self.w3
        return c, d


def train(around=None, look=None, iterations=2):
    model = Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = nn.MSELoss()
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    with around(model, optim) if around else contextlib.nullcontext():
        for n in range(iterations):
            y1_pred, y2_pred = model(x)
            optim.zero_grad(set_to_none=False)
            loss1 = mse(y1_pred, y1)
            loss1.backward(retain_graph=True)
            optim.step()
            optim.zero_grad(set_to_none=False)
            loss2 = mse(y2_pred, y2)
            if look:
                look(loss2, model)
            loss2.backward()
            optim.step()
    return model


if __name__ == "__main__":
    train()
'''

FILE = "train.py"


def line_of(text: str, nth: int = 1) -> int:
    """The number of the ``nth`` line of PROGRAM that holds ``text``."""
    hits = [i for i, line in enumerate(PROGRAM.splitlines(), 1) if text in line]
    return hits[nth - 1]


SAVED_AT = line_of("d = s * self.w3")
OTHER_FORWARD_LINES = (line_of("s = a * self.w1"), line_of("c = s * self.w2"))
MODIFIED_AT = line_of("optim.step()", 1)
OTHER_STEP_LINES = (line_of("optim.step()", 2),)
SOURCE_LINES = sorted({ln.strip() for ln in PROGRAM.splitlines() if ln.strip()}, key=len,
                      reverse=True)


# --- the tools ------------------------------------------------------------------------

Around = Callable[[Any, Any], Any]
Look = Callable[[Any, Any], None]


@dataclass
class Tool:
    key: str
    label: str
    missing: str | None = None          # why it cannot run here, else None
    around: Around | None = None
    look: Look | None = None
    printed: Callable[[], str] | None = None   # what the user prints from it after the run
    reset: Callable[[], None] | None = None


def _debug_mode() -> Any:
    """``torch.utils._debug_mode.DebugMode`` where this torch has it (2.10+), else None."""
    if importlib.util.find_spec("torch.utils._debug_mode") is None:
        return None
    from torch.utils import _debug_mode

    return getattr(_debug_mode, "DebugMode", None)


def _make_dot() -> Any:
    try:
        from torchviz import make_dot  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return make_dot


def tools() -> list[Tool]:
    out = [Tool("plain", "torch alone")]
    out.append(Tool("anomaly", "detect_anomaly()",
                    around=lambda model, optim: torch.autograd.detect_anomaly()))
    debug_mode = _debug_mode()
    for key, label, kwargs in (("debugmode", "DebugMode()", {}),
                               ("debugmode_stack", "DebugMode(record_stack_trace=True)",
                                {"record_stack_trace": True})):
        if debug_mode is None:
            out.append(Tool(key, label, missing="not in this torch"))
            continue
        made: list[Any] = []

        def around(model: Any, optim: Any, kwargs: dict[str, Any] = kwargs,
                   made: list[Any] = made) -> Any:
            made[:] = [debug_mode(**kwargs)]
            return made[0]

        def printed(made: list[Any] = made) -> str:
            return str(made[0].debug_string())

        out.append(Tool(key, label, around=around, printed=printed))
    make_dot = _make_dot()
    for key, label, kwargs in (("torchviz", "torchviz make_dot(loss2, params)", {}),
                               ("torchviz_saved", "torchviz make_dot(..., show_saved=True)",
                                {"show_saved": True})):
        if make_dot is None:
            out.append(Tool(key, label, missing="not installed"))
            continue
        graphs: list[str] = []

        def look(loss: Any, model: Any, kwargs: dict[str, Any] = kwargs,
                 graphs: list[str] = graphs) -> None:
            dot = make_dot(loss, params=dict(model.named_parameters()), **kwargs)
            # the user renders the last one (Graphviz's `dot` program: not timed here)
            graphs.append(dot.source)

        def last(graphs: list[str] = graphs) -> str:
            return graphs[-1] if graphs else ""

        out.append(Tool(key, label, look=look, printed=last, reset=graphs.clear))
    out.append(Tool("allow_mutation", "allow_mutation_on_saved_tensors()",
                    around=lambda model, optim:
                    torch.autograd.graph.allow_mutation_on_saved_tensors()))
    out.append(Tool("watch", "versionwatch watch()",
                    around=lambda model, optim: versionwatch.watch(model, optim)))
    out.append(Tool("watch_strict", "versionwatch watch(strict=True)",
                    around=lambda model, optim: versionwatch.watch(model, optim, strict=True)))
    out.append(Tool("watch_repair", 'versionwatch watch(on_hazard="repair")',
                    around=lambda model, optim:
                    versionwatch.watch(model, optim, on_hazard="repair")))
    return out


# --- running ----------------------------------------------------------------------------


@dataclass
class Run:
    text: str                 # what the run printed, the scratch folder's path removed
    outcome: str
    weights: tuple[float, ...] | None   # final w1, w2, w3 when the program ran to its end


@contextlib.contextmanager
def program() -> Iterator[ModuleType]:
    """PROGRAM as module ``train`` from ``train.py`` in a scratch folder, the current one.

    ``sys.argv[0]`` is that file while it runs, as under ``python train.py``.
    """
    old_cwd, old_argv = os.getcwd(), sys.argv[:]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(os.path.realpath(tmp), FILE)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PROGRAM)
        spec = importlib.util.spec_from_file_location("train", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        os.chdir(os.path.dirname(path))
        sys.argv = [path]
        try:
            yield module
        finally:
            sys.argv = old_argv
            os.chdir(old_cwd)


def run_once(train: ModuleType, tool: Tool) -> Run:
    """One run of the program under ``tool``, printing what a user would see, captured."""
    if tool.reset:
        tool.reset()
    out = io.StringIO()
    weights = None
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        # as Python shows them by default: a library's DeprecationWarning is not shown
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            model = train.train(around=tool.around, look=tool.look)
            weights = tuple(p.item() for p in (model.w1, model.w2, model.w3))
        except RuntimeError as e:
            error = e
    parts = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
             for w in caught]
    if out.getvalue():
        parts.append(out.getvalue())
    if tool.printed:
        parts.append(tool.printed() + "\n")
    if error is None:
        outcome = "runs to the end"
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if os.path.basename(f.filename) == FILE]
        at = f" at {FILE}:{frames[-1].lineno}" if frames else ""
        outcome = f"{type(error).__name__}{at}"
        parts.append(f"{type(error).__name__}: {error}\n")
        parts.extend(f"{note}\n" for note in getattr(error, "__notes__", []))
    folder = os.path.dirname(str(train.__file__))
    text = "".join(parts).replace(folder + os.sep, "")
    return Run(text, outcome, weights)


def timed(train: ModuleType, tool: Tool) -> tuple[float, float]:
    """Wall and CPU seconds of one run of the program under ``tool``, its output dropped."""
    if tool.reset:
        tool.reset()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            train.train(around=tool.around, look=tool.look)
        except RuntimeError:
            pass
        w1, c1 = time.perf_counter(), time.process_time()
    return w1 - w0, c1 - c0


# --- the facts --------------------------------------------------------------------------

FACTS = ("outcome", "parameter", "op", "line that saved it", "line that modified it", "fix")


def _lines(numbers: tuple[int, ...]) -> str:
    alts = "|".join(str(n) for n in numbers)
    return rf"{re.escape(FILE)}(?::|\", line )(?:{alts})\b"


def _named(text: str, target: str, others: str) -> str:
    if not re.search(target, text):
        return "no"
    return "among others" if re.search(others, text) else "yes"


def facts(run: Run) -> dict[str, str]:
    """What the run's text names, by fixed rules (see the module's doc)."""
    text = run.text
    unquoted = text
    for line in SOURCE_LINES:   # a name in a quoted source line is the program's, not the tool's
        unquoted = unquoted.replace(line, "")
    return {
        "outcome": run.outcome,
        "parameter": _named(unquoted, r"\bw3\b", r"\bw[12]\b"),
        "op": _named(text, r"MulBackward0|\bof Mul\b|aten::mul\b", r"MseLossBackward0|aten::mse_loss"),
        "line that saved it": _named(text, _lines((SAVED_AT,)), _lines(OTHER_FORWARD_LINES)),
        "line that modified it": _named(text, _lines((MODIFIED_AT,)), _lines(OTHER_STEP_LINES)),
        "fix": "yes" if re.search(r"^\s*fix\s", text, re.M) else "no",
    }


def facts_table(rows: list[tuple[Tool, dict[str, str] | None]]) -> str:
    head = ["tool", *FACTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tool, f in rows:
        cells = [f[k] for k in FACTS] if f else [tool.missing or "", *[""] * (len(FACTS) - 1)]
        lines.append("| " + " | ".join([f"`{tool.label}`", *cells]) + " |")
    return "\n".join(lines)


def frames_trimmed(text: str) -> str:
    """Traceback frames outside ``train.py`` (this harness's, torch's) as one marked line each run."""
    out: list[str] = []
    skipped = 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r'\s+File "([^"]+)", line \d+, in ', lines[i])
        if m and m.group(1) != FILE:
            skipped += 1
            i += 2 if i + 1 < len(lines) and not lines[i + 1].lstrip().startswith("File ") else 1
            continue
        if skipped:
            out.append(f"  [... {skipped} frame(s) of the harness or of torch trimmed ...]")
            skipped = 0
        out.append(lines[i])
        i += 1
    text = "\n".join(out) + "\n"
    text = text.replace(str(Path(__file__).resolve().parents[1]) + os.sep, "")
    return re.sub(r"/\S*/site-packages/", "<site-packages>/", text)


def shorten(text: str, keep: int = 40) -> str:
    """At most ``keep`` lines: the first and last ones, the cut marked."""
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= keep:
        return "\n".join(lines)
    head, tail = keep // 2, keep - keep // 2
    return "\n".join([*lines[:head], f"[... {len(lines) - keep} lines trimmed ...]",
                      *lines[-tail:]])


# --- main -------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()}, "
            f"{cpu}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40, help="rounds of timed runs (default 40)")
    ap.add_argument("--quick", action="store_true", help="3 rounds: a smoke run")
    ap.add_argument("--facts", action="store_true", help="print the facts table only")
    ap.add_argument("--full", action="store_true", help="print each output untrimmed")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    if repeats < 1:
        ap.error("--repeats must be at least 1")

    all_tools = tools()
    present = [t for t in all_tools if t.missing is None]
    with program() as train:
        runs = {t.key: run_once(train, t) for t in present}
        rows = [(t, facts(runs[t.key]) if t.missing is None else None) for t in all_tools]
        if args.facts:
            print(facts_table(rows))
            return 0
        print(f"# {machine()}\n")
        for t in all_tools:
            print(f"## {t.label}\n")
            if t.missing:
                print(f"{t.missing}\n")
                continue
            text = frames_trimmed(runs[t.key].text) if runs[t.key].text else "(prints nothing)"
            print("```text\n" + (text.rstrip("\n") if args.full else shorten(text)) + "\n```\n")
        print("## facts\n")
        print(facts_table(rows) + "\n")
        finished = {t.label: ws for t in present if (ws := runs[t.key].weights)}
        for label, ws in finished.items():
            print(f"final weights under `{label}`: w1={ws[0]!r} w2={ws[1]!r} w3={ws[2]!r}")
        if len(set(finished.values())) == 1 and len(finished) > 1:
            print("(bitwise equal)")
        print()

        samples: dict[str, list[tuple[float, float]]] = {t.key: [] for t in present}
        gc.collect()
        for r in range(repeats):
            shift = r % len(present)
            for t in present[shift:] + present[:shift]:
                samples[t.key].append(timed(train, t))
    base_w = statistics.median(s[0] for s in samples["plain"])
    base_c = statistics.median(s[1] for s in samples["plain"])
    print(f"## cost: median of {repeats} runs each, interleaved\n")
    print("| tool | wall ms | wall ratio | CPU ms | CPU ratio |")
    print("|---|---|---|---|---|")
    for t in all_tools:
        if t.missing:
            print(f"| `{t.label}` | {t.missing} | | | |")
            continue
        w = statistics.median(s[0] for s in samples[t.key])
        c = statistics.median(s[1] for s in samples[t.key])
        print(f"| `{t.label}` | {w * 1e3:.2f} | {w / base_w:.2f}x | {c * 1e3:.2f} | "
              f"{c / base_c if base_c else float('nan'):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
