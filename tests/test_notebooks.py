"""Notebooks, executed headless (nbclient + ipykernel): ``%load_ext versionwatch``,
``%%versionwatch``, cells named ``Cell In[n], line k``, a re-run backward cell.

Two kernels for the module: the watched notebook and the same notebook without
versionwatch, which must train bitwise alike up to the failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import versionwatch

SRC = str(Path(versionwatch.__file__).resolve().parents[1])

SETUP = """\
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt_g = torch.optim.SGD(G.parameters(), lr=0.1)
opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
"""

# The right order: D's step after G's backward.
GOOD = """\
for _ in range(3):
    fake = G(torch.randn(16, 4))
    d_loss = D(fake.detach()).mean() - D(torch.randn(16, 4)).mean()
    g_loss = -D(fake).mean()
    opt_d.zero_grad()
    opt_g.zero_grad()
    g_loss.backward()
    d_loss.backward()
    opt_d.step()
    opt_g.step()
"""

# The bug: D steps before G's backward, which needs D's old weights.
BAD = """\
fake = G(torch.randn(16, 4))
d_loss = D(fake.detach()).mean() - D(torch.randn(16, 4)).mean()
g_loss = -D(fake).mean()
opt_d.zero_grad()
d_loss.backward()
opt_d.step()
opt_g.zero_grad()
g_loss.backward()
"""

DUMP = """\
import hashlib
print("PARAMS", hashlib.sha256(b"".join(
    p.detach().numpy().tobytes() for m in (G, D) for p in m.parameters())).hexdigest())
"""

FORWARD = "net = nn.Sequential(nn.Linear(3, 3), nn.Tanh())\nloss = net(torch.ones(2, 3)).sum()\n"
BACKWARD = "loss.backward()\n"

HOOKS = """\
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn
def patched():
    return (torch.Tensor.backward, torch.autograd.backward, nn.Module.__call__,
            torch.optim.Optimizer.zero_grad, torch.autograd.grad,
            dict(optimizer_module._global_optimizer_pre_hooks),
            dict(optimizer_module._global_optimizer_post_hooks),
            dict(torch.nn.modules.module._global_forward_pre_hooks),
            dict(torch.nn.modules.module._global_forward_hooks))
"""


def _run(notebooks: dict[str, list[str]], tmp: Path) -> dict[str, list[list[dict[str, Any]]]]:
    """Execute each list of cells as a notebook, each in a fresh kernel, side by side;
    each notebook's outputs, cell by cell."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # The kernel runs this interpreter ("python" in the kernel spec is ours) on this
    # checkout's sources, whatever is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [SRC, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "VERSIONWATCH_ON_HAZARD": ""}
    books = {}
    for name, cells in notebooks.items():
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
        books[name] = nb

    async def run_all() -> None:
        await asyncio.gather(*(nbclient.NotebookClient(
            nb, kernel_name="python3", timeout=120, allow_errors=True,
            resources={"metadata": {"path": str(tmp)}}).async_execute(env=env)
            for nb in books.values()))

    asyncio.run(run_all())
    for name, nb in books.items():
        nbformat.write(nb, str(tmp / f"{name}.ipynb"))  # to read when a test fails
    return {name: [c.get("outputs", []) for c in nb.cells] for name, nb in books.items()}


def _text(outputs: list[dict[str, Any]]) -> str:
    parts = []
    for o in outputs:
        if o.get("output_type") == "stream":
            parts.append(o["text"])
        elif o.get("output_type") == "error":
            parts.append(f"{o['ename']}: {o['evalue']}")
        elif "data" in o:
            parts.append(o["data"].get("text/plain", ""))
    return "".join(parts)


WATCHED = [
    "import sys, versionwatch\nprint(sys.executable, versionwatch.__file__)\n" + HOOKS +
    "before = patched()\n%load_ext versionwatch\n%load_ext versionwatch\n",  # In[1]
    SETUP,  # In[2]
    GOOD,  # In[3]
    BAD,  # In[4]
    DUMP,  # In[5]
    FORWARD,  # In[6]
    BACKWARD,  # In[7]
    BACKWARD,  # In[8]: run again on the freed graph
    "%%versionwatch --on-hazard nope\nprint('ran')\n",  # In[9]: never runs
    "%%versionwatch --strict --on-hazard warn\nx = torch.ones(3, requires_grad=True)\n"
    "y = x.exp()\ny.add_(1)\ny.sum().backward()\n",  # In[10]
    "import json\nfrom versionwatch.integrations import ipython as vw_ipython\n"
    "reports = vw_ipython._LOADED['watcher'].reports\n"
    "print('JSON', json.dumps([r.to_dict() for r in reports]))\n"
    "print('HTML', reports[0]._repr_html_().replace(chr(10), ' '))\n",  # In[11]
    "%unload_ext versionwatch\nprint('RESTORED', patched() == before)\n",  # In[12]
    "%%versionwatch --on-hazard raise\nx = torch.ones(3, requires_grad=True)\n"
    "y = x.sigmoid()\ny.mul_(2)\ny.sum().backward()\n",  # In[13]: the magic alone
    "%env VERSIONWATCH_ON_HAZARD=nope\n%load_ext versionwatch\n",  # In[14]
]

PLAIN = [
    "import sys\nprint(sys.executable)\n",
    SETUP,
    GOOD,
    BAD,
    DUMP,
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("IPython")
    pytest.importorskip("ipykernel")
    tmp = tmp_path_factory.mktemp("nb")
    return _run({"watched": WATCHED, "plain": PLAIN}, tmp)


def test_kernel_runs_this_checkout(runs: dict[str, list[dict[str, Any]]]) -> None:
    first = _text(runs["watched"][0])
    assert first.split()[0] == sys.executable, first
    assert first.split()[1] == versionwatch.__file__, first


def test_gan_bug_reported_in_its_cell_with_cell_lines(runs: dict[str, list[dict[str, Any]]]) -> None:
    out = _text(runs["watched"][3])
    assert out.count("versionwatch: backward will fail") == 1, out
    assert "modified by an inplace operation" in out
    # The forward, the step and the backward, as IPython names them, with their code.
    assert "Cell In[4], line 3" in out, out  # g_loss = -D(fake).mean()
    assert "Cell In[4], line 6" in out, out  # opt_d.step()
    assert "backward at  Cell In[4], line 8" in out or \
        re.search(r"backward at\s+Cell In\[4\], line 8", out), out
    assert "ipykernel_" not in out, out
    # PyTorch's own error follows (warn policy): the notebook fails as the plain one does.
    assert "RuntimeError: one of the variables needed" in out
    assert "RuntimeError: one of the variables needed" in _text(runs["plain"][3])
    # Nothing was printed in the cells without a hazard.
    assert "versionwatch" not in _text(runs["watched"][2])


def test_training_bitwise_as_the_plain_notebook(runs: dict[str, list[dict[str, Any]]]) -> None:
    watched, plain = _text(runs["watched"][4]), _text(runs["plain"][4])
    assert watched.startswith("PARAMS ") and watched == plain


def test_rerun_backward_cell_named(runs: dict[str, list[dict[str, Any]]]) -> None:
    assert "versionwatch" not in _text(runs["watched"][6])
    out = _text(runs["watched"][7])
    assert "this cell ran again on the graph of In[6]" in out, out
    assert "re-run the forward cell In[6] first, or build the forward in the same cell " \
           "as the backward" in out, out
    assert "Trying to backward through the graph a second time" in out


def test_cell_magic(runs: dict[str, list[dict[str, Any]]]) -> None:
    bad = runs["watched"][8]
    # IPython prints a UsageError as one line, no traceback; the body never ran.
    assert [o["output_type"] for o in bad] == ["stream"], bad
    assert _text(bad).strip() == ("UsageError: %%versionwatch: --on-hazard 'nope' is not a "
                                  "policy; use one of: raise, warn, log, repair"), bad
    # Watched only there, strict: the write's own line, in this cell (its body's lines).
    out = _text(runs["watched"][9])
    assert out.count("versionwatch: backward will fail") == 1, out
    assert "modified by  add_() at Cell In[10], line 3: y.add_(1)" in out, out
    assert "ipykernel_" not in out, out


def test_cell_magic_after_unload(runs: dict[str, list[dict[str, Any]]]) -> None:
    # Only that cell is watched, raise: our error, stopped before PyTorch's backward ran.
    out = _text(runs["watched"][12])
    assert out.startswith("InplaceModificationError: versionwatch: backward will fail: "), out
    assert "backward at  Cell In[13], line 4" in out, out


def test_json_and_html_name_cells(runs: dict[str, list[dict[str, Any]]]) -> None:
    out = _text(runs["watched"][10])
    line = next(x for x in out.splitlines() if x.startswith("JSON "))
    gan, freed = json.loads(line[5:])  # the strict cell's watcher kept its own
    h = gan["hazards"][0]
    assert h["backward_site"]["cell"] == 4 and h["backward_site"]["line"] == 8
    assert h["backward_site"]["file"].endswith(".py")  # the path stays beside it
    assert (h["modified_by"][0]["cell"], h["modified_by"][0]["line"]) == (4, 6)
    assert (h["saved_forward"]["cell"], h["saved_forward"]["line"]) == (4, 3)
    f = freed["hazards"][0]
    assert f["freed_by"]["cell"] == 8 and f["saved_forward"]["cell"] == 6
    assert f["fix"].startswith("re-run the forward cell In[6] first")
    html = next(x for x in out.splitlines() if x.startswith("HTML "))
    assert "Cell In[4], line 8" in html


def test_unload_restores_every_hook(runs: dict[str, list[dict[str, Any]]]) -> None:
    assert "RESTORED True" in _text(runs["watched"][11])


def test_docs_show_what_the_notebook_prints(runs: dict[str, list[dict[str, Any]]]) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "notebooks.md").read_text()
    blocks = re.findall(r"```text\n(.*?)```", page, flags=re.DOTALL)
    assert BAD in blocks
    gan = blocks[blocks.index(BAD) + 1]
    rerun = next(b for b in blocks if "this cell ran again" in b)

    def shown(block: str, out: str) -> None:
        out = re.sub(r" +", " ", out)
        for line in block.splitlines():
            if line.strip() and line.strip() != "...":
                assert re.sub(r" +", " ", line) in out, line

    shown(gan, _text(runs["watched"][3]))
    shown(rerun, _text(runs["watched"][7]))


def test_bad_environment_is_one_line_at_load(runs: dict[str, list[dict[str, Any]]]) -> None:
    out = runs["watched"][13]
    # %env's echo (stdout) and the error (stderr) are two streams: either may come first.
    assert sorted((o["output_type"], o["name"]) for o in out) == [
        ("stream", "stderr"), ("stream", "stdout")], out
    err = next(o["text"] for o in out if o["name"] == "stderr")
    assert err.splitlines() == [
        "UsageError: versionwatch: VERSIONWATCH_ON_HAZARD='nope' is not a valid policy; "
        "use one of: raise, warn, log, repair"], out


def test_import_versionwatch_imports_no_ipython() -> None:
    code = ("import sys, versionwatch; versionwatch.load_ipython_extension; "
            "bad = [m for m in ('IPython', 'ipykernel', 'lightning', 'transformers') "
            "if m in sys.modules]; assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_rerun_cell_wording_without_a_kernel(tmp_path: Path) -> None:
    """The same wording from cells that ``versionwatch run nb.ipynb`` registers (no IPython):
    and a backward run again in a plain file keeps the usual words."""
    import linecache
    import warnings

    import torch

    from versionwatch._report import register_cell
    from versionwatch._report.model import CELLS

    ns: dict[str, Any] = {"torch": torch, "nn": torch.nn}
    cells = {6: FORWARD, 8: BACKWARD}
    names = {n: str(tmp_path / f"cell{n}.py") for n in cells}
    try:
        for n, code in cells.items():
            register_cell(names[n], n)
            linecache.cache[names[n]] = (len(code), None, code.splitlines(True), names[n])
        with versionwatch.watch_all(on_hazard="warn") as w, \
                warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            exec(compile(FORWARD, names[6], "exec"), ns)
            exec(compile(BACKWARD, names[8], "exec"), ns)
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                exec(compile(BACKWARD, names[8], "exec"), ns)
        text = str(seen[-1].message)
        assert text.splitlines()[0] == ("versionwatch: backward will fail: this cell ran again on "
                                        "the graph of In[6], which its earlier run's backward "
                                        "already freed"), text
        assert "fix          re-run the forward cell In[6] first" in text, text
        assert "freed by     backward #1 at Cell In[8], line 1 (this cell's earlier run)" in text
        # The same lines outside cells: the usual freed-graph words.
        for n in cells:
            del CELLS[names[n]]
        again = str(w.reports[-1])
        assert again.splitlines()[0].endswith("it would backward through the graph a second "
                                              "time; the tensors saved by TanhBackward0 were "
                                              "already freed"), again
        assert "(this same line, in an earlier iteration)" in again, again
    finally:
        for n in cells:
            CELLS.pop(names[n], None)
            linecache.cache.pop(names[n], None)


def test_kernel_warn_policy_shows_the_same_report_each_time() -> None:
    """``warnings.warn`` would show one text once per cell namespace; a kernel's report
    shows again when the cell runs again (filters still apply)."""
    import warnings

    from versionwatch.integrations import ipython

    report = versionwatch.Report(hazards=[versionwatch.Hazard(
        kind="freed", node="MulBackward0", slot="other")])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        ipython._warn(report)
        ipython._warn(report)
    assert [type(w.message) for w in seen] == [versionwatch.InplaceHazardWarning] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", versionwatch.InplaceHazardWarning)
        with pytest.raises(versionwatch.InplaceHazardWarning, match="already freed"):
            ipython._warn(report)
