"""A watcher's events pass through its methods by name, whatever part records them.

A peer harness wraps these methods on the class (``setattr``) and expects
every event to reach them: forwards, steps, zero_grad, a backward's
explanation and dispatch, an error after all, and the watcher's opening and
closing; for an automatic watcher, its opening and each adopted root.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch import nn

import versionwatch
from versionwatch import AutoWatcher, Report, Watcher

WATCHER_EVENTS = ("__init__", "close", "_explain", "_after_error", "_dispatch", "_on_forward",
                  "_on_step_pre", "_on_step_post", "_on_zero_grad")


def wrap(monkeypatch: pytest.MonkeyPatch, cls: type, names: tuple[str, ...]) -> Counter[str]:
    """Count each call of ``cls.<name>`` for ``names``, wrapped on the class by name."""
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in names:
        monkeypatch.setattr(cls, name, counted(name, getattr(cls, name)))
    return calls


@pytest.mark.parametrize("when", ["before_opening", "while_open"])
def test_every_event_reaches_the_watchers_methods(monkeypatch: pytest.MonkeyPatch,
                                                   when: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Report] = []
    calls: Counter[str] = Counter()
    if when == "before_opening":
        calls = wrap(monkeypatch, Watcher, WATCHER_EVENTS)
    w = versionwatch.watch(model, opt, on_hazard=seen.append)
    if when == "while_open":
        calls = wrap(monkeypatch, Watcher, WATCHER_EVENTS)
    with w:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError):
            loss.backward()  # predicted, dispatched to the policy, then PyTorch's error
    assert len(seen) == 1
    expected = {"close": 1, "_explain": 1, "_after_error": 1, "_dispatch": 1, "_on_forward": 2,
                "_on_step_pre": 1, "_on_step_post": 1, "_on_zero_grad": 1}
    if when == "before_opening":
        expected["__init__"] = 1
    assert dict(calls) == expected


def test_an_automatic_watchers_roots_reach_its_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = wrap(monkeypatch, AutoWatcher, ("__init__", "_adopt_root"))
    with versionwatch.watch_all() as w:
        model = nn.Linear(2, 1)
        model(torch.ones(1, 2)).sum().backward()
        model(torch.ones(1, 2))
    assert dict(calls) == {"__init__": 1, "_adopt_root": 1}
    assert [e.label for e in w.ledger.events if e.kind == "forward"] == [
        "model.forward #1", "model.forward #2"]


def test_the_peer_harness_old_module_names_still_work() -> None:
    """The peer harness imports ``versionwatch._auto`` and sets ``versionwatch._watch.predict``
    as it did when both were modules: the same classes, and the watcher's own seam."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "import versionwatch._auto as A\n"
        "import versionwatch._watch as W\n"
        "from versionwatch._watch import auto, watcher\n"
        "assert A is auto and A.AutoWatcher is auto.AutoWatcher and W.Watcher is watcher.Watcher\n"
        "assert auto.__spec__.name == 'versionwatch._watch.auto'  # its own spec, kept\n"
        "assert W._ACTIVE is not None and not hasattr(W, '_LOCAL')\n"
        "seen = []\n"
        "real = W.predict\n"
        "def observe(*args):\n"
        "    seen.append(args[2])\n"
        "    return real(*args)\n"
        "W.predict = observe\n"
        "assert watcher.predict is observe and W.predict is observe\n"
        "m = torch.nn.Linear(2, 1)\n"
        "with W.watch(m):\n"
        "    m(torch.ones(1, 2)).sum().backward()\n"
        "print(seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['backward']"
