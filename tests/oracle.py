"""PyTorch as the oracle: predict a backward, run it, and compare the outcomes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import versionwatch
from versionwatch import Report

_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+) instead")


@dataclass
class Outcome:
    kind: str | None  # None (success), "inplace" or "freed"
    versions: tuple[int, int] | None = None  # (saved, current)


def outcome_of(err: BaseException | None) -> Outcome:
    if err is None:
        return Outcome(None)
    msg = str(err)
    if "modified by an inplace operation" in msg:
        m = _VERSIONS.search(msg)
        assert m is not None, msg
        return Outcome("inplace", (int(m.group(2)), int(m.group(1))))
    if "backward through the graph a second time" in msg:
        return Outcome("freed")
    raise AssertionError(f"unexpected error from backward: {msg}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN included (a program may produce NaN gradients)."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _snapshot(tensors: Sequence[torch.Tensor]) -> list[tuple[int, Any]]:
    out = []
    for t in tensors:
        g = t.grad
        out.append((t._version, None if g is None else (g._version, g.clone())))
    return out


def assert_matches(report: Report, real: Outcome) -> None:
    """The prediction agrees with what PyTorch did: fails or not, kind, versions."""
    if real.kind is None:
        assert report.ok, f"false alarm: PyTorch ran this backward fine, but:\n{report}"
        return
    assert not report.ok, f"missed: PyTorch raised {real.kind} {real.versions}:\n{report}"
    first = report.hazards[0]
    assert first.kind == real.kind, (first.kind, real.kind, str(report))
    if real.versions is not None:
        # Several stale tensors in the first failing node: PyTorch names the one
        # its generated code unpacks first, which any of them may be.
        same_node = [h for h in report.hazards if h.order == first.order]
        got = {(h.saved_version, h.current_version) for h in same_node}
        assert real.versions in got, (real.versions, got, str(report))


@dataclass
class Oracle:
    """Drop-in for backward/grad that checks each prediction against PyTorch."""

    watched: Sequence[torch.Tensor] = ()
    names: Any = None
    reports: list[Report] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def _run(self, outputs: Any, inputs: Any, api: str, call: Any, **args: Any) -> Any:
        before = _snapshot(self.watched)
        # The call's own arguments too: check() mirrors the call it is given.
        report = versionwatch.check(outputs, inputs=inputs, names=self.names, api=api, **args)  # type: ignore[arg-type]
        after = _snapshot(self.watched)
        assert len(before) == len(after)
        for (v0, g0), (v1, g1) in zip(before, after):
            assert v0 == v1, "check() changed a version"
            assert (g0 is None) == (g1 is None), "check() changed a .grad"
            if g0 is not None and g1 is not None:
                assert g0[0] == g1[0] and _same(g0[1], g1[1]), "check() changed a .grad"
        self.reports.append(report)
        err: BaseException | None = None
        result = None
        try:
            result = call()
        except RuntimeError as e:
            err = e
        real = outcome_of(err)
        self.outcomes.append(real)
        assert_matches(report, real)
        if err is not None:
            raise err
        return result

    def backward(self, outputs: Any, *, inputs: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        self._run(outputs, inputs, "backward", lambda: torch.autograd.backward(
            outputs, inputs=inputs, retain_graph=retain_graph, create_graph=create_graph),
            retain_graph=retain_graph, create_graph=create_graph)

    def grad(self, outputs: Any, inputs: Any, *, retain_graph: bool | None = None,
             create_graph: bool = False, allow_unused: bool = False) -> Any:
        return self._run(outputs, inputs, "grad", lambda: torch.autograd.grad(
            outputs, inputs, retain_graph=retain_graph, create_graph=create_graph,
            allow_unused=allow_unused), retain_graph=retain_graph, create_graph=create_graph,
            allow_unused=allow_unused)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind is not None]
