"""Events are data: a forward's pieces are kept apart and made into text only when shown."""

from __future__ import annotations

import pickle

import torch

from versionwatch._ledger import Ledger
from versionwatch._report.model import ForwardRef, Hazard, Site


def test_a_forward_ref_shows_todays_text_and_survives_a_pickle() -> None:
    ref = ForwardRef("m.forward #2", Site("train.py", 12), "worker-1")
    assert str(ref) == "m.forward #2 on thread worker-1 at train.py:12"
    assert str(ForwardRef("forward #1", None, None)) == "forward #1"
    h = Hazard(kind="inplace", node="MulBackward0", slot="other")
    h.saved_during_forward(ref)
    back = pickle.loads(pickle.dumps(h))
    assert back.saved_during == str(ref) and back.saved_in is not None
    assert (back.saved_in.label, back.saved_in.thread) == ("m.forward #2", "worker-1")
    assert "saved_in" not in h.to_dict()


def test_an_end_event_keeps_its_start_name_and_the_layout_says_what_moved() -> None:
    ledger = Ledger()
    w = torch.zeros(2)
    ledger.track("w", w)
    start = ledger.record("forward", "forward #1", Site("train.py", 3))
    end = ledger.end("forward_end", "forward #1", "module_forward", "during forward #1")
    assert (end.label, end.name, end.site) == ("end of forward #1", "forward #1", start.site)
    layout = ledger._layout
    assert layout is not None
    assert layout.unchanged_since() == [w._version]
    w.add_(1)
    assert layout.unchanged_since() is None
    assert layout.unchanged_since([w._version]) == [w._version]
