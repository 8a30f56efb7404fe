"""The call's own arguments: check() mirrors the real call, error for error.

Bad input gets a precise TypeError or ValueError, never a crash inside
versionwatch; arguments that PyTorch rejects get PyTorch's own exception and
sentence, compared here with what the real call raises on the same arguments.
"""

from __future__ import annotations

import random
import types
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

import versionwatch

# -- our own TypeErrors, for arguments that are not tensors at all ------------------


def test_non_tensor_output():
    with pytest.raises(TypeError, match="^outputs must be a tensor or a sequence of tensors; got int$"):
        versionwatch.check(3)  # type: ignore[arg-type]


def test_non_tensor_in_sequence():
    x = torch.ones(1, requires_grad=True)
    with pytest.raises(TypeError, match=r"^outputs\[1\] must be a tensor; got str$"):
        versionwatch.check([x, "loss"])  # type: ignore[list-item]


def test_bad_names():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="^names must be an nn.Module"):
        versionwatch.check(x.sum(), names=[x])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^names must map str -> nn.Module or torch.Tensor -> str; got str -> int$"):
        versionwatch.check(x.sum(), names={"a": 1})  # type: ignore[dict-item]


def test_bad_api():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="api must be"):
        versionwatch.check(x.sum(), api="jvp")  # type: ignore[arg-type]


def test_grad_only_arguments_need_api_grad():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match='allow_unused and materialize_grads are arguments of torch.autograd.grad'):
        versionwatch.check(x.sum(), inputs=[x], allow_unused=True)
    with pytest.raises(TypeError, match='api="grad" needs inputs'):
        versionwatch.check(x.sum(), api="grad")


def test_edge_of_junk_as_output():
    with pytest.raises(TypeError, match=r"^outputs\[0\] is a GradientEdge of int, not of an autograd Node$"):
        versionwatch.check(GradientEdge(3, 0))  # type: ignore[arg-type]


def test_output_without_graph_keeps_pytorch_sentence_and_adds_a_note():
    with torch.no_grad():
        y = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError) as info:
        versionwatch.check(y)
    assert type(info.value) is RuntimeError
    assert str(info.value) == "element 0 of tensors does not require grad and does not have a grad_fn"
    assert "torch.no_grad()" in info.value.__notes__[0]


def test_names_from_dict_of_modules_and_tensors():
    gen = nn.Sequential(nn.Linear(2, 2))
    s = torch.ones(1, 2, requires_grad=True)
    out = gen(s).sum()
    with torch.no_grad():
        gen[0].weight.add_(1)
    r = versionwatch.check(out, names={"G": gen})
    assert (r.hazards[0].tensor, r.hazards[0].view) == ("G.0.weight", True)
    w = nn.Parameter(torch.ones(1))
    loss = (s.sum() * w).sum()
    with torch.no_grad():
        w.add_(1)
    assert versionwatch.check(loss, names={w: "my_w"}).hazards[0].tensor == "my_w"


# -- differential: assert_backward_safe against the real call -----------------------


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    """ok, a hazard, or an argument error as (type, message)."""
    try:
        fn()
    except versionwatch.InplaceModificationError:
        return ("inplace",)
    except versionwatch.FreedGraphError:
        return ("freed",)
    except Exception as e:
        if "modified by an inplace operation" in str(e):
            return ("inplace",)
        if "backward through the graph a second time" in str(e):
            return ("freed",)
        return (type(e), str(e))
    return ("ok",)


def _real(api: str, outputs: Any, kw: dict[str, Any]) -> None:
    kw = dict(kw)
    inputs = kw.pop("inputs", None)
    if api == "grad":
        torch.autograd.grad(outputs, inputs, **kw)
        return
    if "grad_outputs" in kw:
        kw["grad_tensors"] = kw.pop("grad_outputs")
    if inputs is not None:
        kw["inputs"] = inputs
    torch.autograd.backward(outputs, **kw)


def leaf(*shape: int, **kw: Any) -> torch.Tensor:
    return torch.randn(*shape, **kw).requires_grad_()


def _stale_sigmoid() -> tuple[torch.Tensor, torch.Tensor]:
    a = leaf(3)
    y = a.sigmoid()
    y.mul_(2)  # sigmoid saved its result
    return a, y


def _stale_root() -> torch.Tensor:
    """A root whose own node saved a tensor that is stale now."""
    s = (leaf(3) * 2).sigmoid()
    with torch.no_grad():
        s.mul_(2)  # no new node: SigmoidBackward0 stays the root, its result stale
    return s


def _leaf_and_stale() -> tuple[Any, dict[str, Any]]:
    """``a`` is an output and an input; its gradient also flows through a stale node."""
    a, y = _stale_sigmoid()
    return [a, y.sum()], {"inputs": [a], "grad_outputs": [torch.ones(3), None]}


def _split() -> tuple[Any, dict[str, Any]]:
    parts = (leaf(4) * 2).split(2)
    return parts[0].sum(), {"inputs": [parts[1]]}


def _stale_edge() -> tuple[Any, dict[str, Any]]:
    x = leaf(3)
    h = x * 2
    y = h.sigmoid()
    y.mul_(2)
    return y.sum(), {"inputs": get_gradient_edge(h)}


def _stale_unused() -> tuple[Any, dict[str, Any]]:
    _, y = _stale_sigmoid()
    return y.sum(), {"inputs": [leaf(3)]}


def _self_edge() -> tuple[Any, dict[str, Any]]:
    z = (leaf(3) * 2).sum()
    return z, {"inputs": get_gradient_edge(z)}


def _nested_stale() -> tuple[Any, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nt = torch.nested.nested_tensor([torch.rand(2), torch.rand(2)], requires_grad=True)
        x = nt.clone()
        res = x.sum(-1, keepdim=True)  # saves x
        x.add_(x)
        grad = torch.nested.nested_tensor([torch.rand(1), torch.rand(1)])
    return res, {"grad_outputs": grad}


def _two(kw: dict[str, Any]) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def build() -> tuple[Any, dict[str, Any]]:
        a = leaf(3)
        return [(a * a).sum(), (a * 3).sum()], kw
    return build


# id -> (api, build): build makes fresh tensors and returns (outputs, kwargs).
CASES: dict[str, tuple[str, Callable[[], tuple[Any, dict[str, Any]]]]] = {
    "non_scalar_without_gradient": ("backward", lambda: (leaf(3) * 2, {})),
    "non_scalar_with_gradient": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(3)})),
    "one_element_without_gradient": ("backward", lambda: (leaf(1, 1) * 2, {})),
    "integer_scalar": ("backward", lambda: ((leaf(3) * 2).sum().long(), {})),
    "no_grad_fn": ("backward", lambda: (torch.ones(2), {"grad_outputs": torch.ones(2)})),
    "gradient_shape": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(2)})),
    "gradient_broadcastable_shape": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(1)})),
    "gradient_complex": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(3, dtype=torch.cfloat)})),
    "gradient_other_dtype": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(3, dtype=torch.double)})),
    "gradient_on_another_device": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": torch.ones(3, device="meta")})),
    "gradient_edge_on_another_device": ("grad", lambda: ((lambda a: (get_gradient_edge(a * 2), {"inputs": [a], "grad_outputs": torch.ones(3, device="meta")}))(leaf(3)))),
    "gradient_sparse_csr_for_strided": ("backward", lambda: (leaf(1, 3) * 2, {"grad_outputs": torch.ones(1, 3).to_sparse_csr()})),
    "gradient_sparse_coo_for_strided": ("backward", lambda: (leaf(1, 3) * 2, {"grad_outputs": torch.ones(1, 3).to_sparse()})),
    "gradient_mkldnn_for_strided": ("backward", lambda: (leaf(1, 3) * 2, {"grad_outputs": torch.ones(1, 3).to_mkldnn()})),
    "gradient_strided_for_mkldnn": ("grad", lambda: ((lambda m: (m, {"inputs": m, "grad_outputs": torch.ones(2, 2)}))(torch.randn(2, 2).to_mkldnn().requires_grad_()))),
    "gradient_strided_for_sparse": ("grad", lambda: ((lambda x: (x * 2, {"inputs": x, "grad_outputs": torch.ones(3, 3, dtype=torch.double)}))(torch.randn(3, 3, dtype=torch.double).to_sparse().requires_grad_()))),
    "stale_and_gradient_device": ("backward", lambda: (_stale_sigmoid()[1], {"grad_outputs": torch.ones(3, device="meta")})),
    "gradient_not_a_tensor": ("backward", lambda: (leaf(3) * 2, {"grad_outputs": "ones"})),
    "gradient_an_int": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": leaf(1), "grad_outputs": 3})),
    "fewer_gradients": ("backward", _two({"grad_outputs": [torch.tensor(1.0)]})),
    "more_gradients": ("backward", _two({"grad_outputs": [torch.tensor(1.0)] * 3})),
    "none_gradients": ("backward", _two({"grad_outputs": [None, None]})),
    "retain_graph_a_str": ("backward", lambda: ((leaf(3) * 2).sum(), {"retain_graph": "yes"})),
    "retain_graph_negative": ("backward", lambda: ((leaf(3) * 2).sum(), {"retain_graph": -1})),
    "create_graph_a_float": ("backward", lambda: ((leaf(3) * 2).sum(), {"create_graph": 1.0})),
    "empty_outputs_backward": ("backward", lambda: ([], {})),
    "empty_outputs_grad": ("grad", lambda: ([], {"inputs": [leaf(2)]})),
    "empty_inputs_backward": ("backward", lambda: ((leaf(3) * 2).sum(), {"inputs": []})),
    "empty_inputs_grad": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": []})),
    "input_without_grad_backward": ("backward", lambda: ((leaf(3) * 2).sum(), {"inputs": [torch.ones(2)]})),
    "input_without_grad_grad": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [torch.ones(2)]})),
    "input_not_a_tensor": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [3]})),
    "input_a_tuple": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [(None, 0)]})),
    "input_edge_of_junk": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": GradientEdge(3, 0)})),  # type: ignore[arg-type]
    "inputs_a_str": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": "ab"})),
    "inputs_an_int": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": 3})),
    "inputs_a_mapping": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": types.MappingProxyType({"a": leaf(1)})})),
    "inputs_a_dict": ("grad", lambda: ((lambda a: ((a * 2).sum(), {"inputs": {"a": a}}))(leaf(3)))),
    "unused_grad": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [leaf(3)]})),
    "unused_second_grad": ("grad", lambda: ((lambda a: ((a * 2).sum(), {"inputs": [a, leaf(3)]}))(leaf(3)))),
    "unused_allowed": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [leaf(3)], "allow_unused": True})),
    "unused_materialized": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [leaf(3)], "materialize_grads": True})),
    "materialize_refuses_allow_unused_false": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [leaf(3)], "materialize_grads": True, "allow_unused": False})),
    "unused_edge_materialized": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": get_gradient_edge(leaf(3) * 1), "materialize_grads": True})),
    "unused_backward": ("backward", lambda: ((leaf(3) * 2).sum(), {"inputs": [leaf(3)]})),
    "unused_split_slot": ("grad", _split),
    "input_is_the_output": ("grad", lambda: ((lambda z: (z, {"inputs": [z]}))((leaf(3) * 2).sum()))),
    "input_is_the_output_edge": ("grad", _self_edge),
    "leaf_output_and_input": ("grad", lambda: ((lambda a: (a, {"inputs": [a], "grad_outputs": torch.ones(3)}))(leaf(3)))),
    "stale_root_its_own_input": ("grad", lambda: ((lambda s: (s, {"inputs": [s], "grad_outputs": torch.ones(3)}))(_stale_root()))),
    "stale_root_unreached_input": ("grad", lambda: (_stale_root(), {"inputs": [leaf(3)], "grad_outputs": torch.ones(3), "allow_unused": True})),
    "stale_root_unreached_input_backward": ("backward", lambda: (_stale_root(), {"inputs": [leaf(3)], "grad_outputs": torch.ones(3)})),
    "leaf_output_and_input_behind_a_stale_node": ("grad", _leaf_and_stale),
    "sparse_leaf_output_and_input": ("grad", lambda: ((lambda x: (x, {"inputs": [x], "grad_outputs": torch.ones(3, 3, dtype=torch.double).to_sparse()}))(torch.randn(3, 3, dtype=torch.double).to_sparse().requires_grad_()))),
    "stale_edge_input": ("grad", _stale_edge),
    "stale_and_unused": ("grad", _stale_unused),
    "stale_and_non_scalar": ("backward", lambda: (_stale_sigmoid()[1], {})),
    "stale_and_gradient_shape": ("backward", lambda: (_stale_sigmoid()[1], {"grad_outputs": torch.ones(2)})),
    "stale_with_gradient": ("backward", lambda: (_stale_sigmoid()[1], {"grad_outputs": torch.ones(3)})),
    "stale_nested": ("backward", _nested_stale),
    "sparse_coo_input": ("grad", lambda: ((lambda x: (x.to_dense().sum(), {"inputs": x}))(leaf(3, 3, dtype=torch.double).detach().to_sparse().requires_grad_()))),
    "sparse_csr_input": ("backward", lambda: ((lambda x: (x.to_dense().sum(), {"inputs": [x]}))(torch.randn(3, 3, dtype=torch.double).to_sparse_csr().requires_grad_()))),
    "mkldnn_input": ("grad", lambda: ((lambda x: (x.to_dense().sum(), {"inputs": [x]}))(torch.randn(3, 3).to_mkldnn().requires_grad_()))),
    "unused_sparse_input": ("grad", lambda: ((leaf(3) * 2).sum(), {"inputs": [torch.randn(3, 3).to_sparse().requires_grad_()]})),
    "edge_output": ("grad", lambda: ((lambda a: (get_gradient_edge((a * 2).sum()), {"inputs": [a]}))(leaf(3)))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mirrors_the_real_call(case: str) -> None:
    api, build = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors are beta
        outputs, kw = build()
        ours = _outcome(lambda: versionwatch.assert_backward_safe(outputs, api=api, **kw))  # type: ignore[arg-type]
        real = _outcome(lambda: _real(api, outputs, kw))
    assert ours == real


def test_the_cases_cover_each_outcome():
    """The table above exercises success, hazards and several PyTorch errors."""
    kinds = set()
    for api, build in CASES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs, kw = build()
            kinds.add(_outcome(lambda: _real(api, outputs, kw))[0])  # noqa: B023
    assert {"ok", "inplace", RuntimeError, TypeError, ValueError, OverflowError} <= kinds


def test_check_raises_the_argument_error_and_changes_nothing():
    a = leaf(3)
    y = a * a
    with pytest.raises(RuntimeError, match="^grad can be implicitly created only for scalar outputs$"):
        versionwatch.check(y)
    assert a.grad is None and a._version == 0
    assert versionwatch.check(y, grad_outputs=torch.ones(3)).ok
    y.backward(torch.ones(3))  # the graph was not freed by the checks
    assert torch.equal(a.grad, 2 * a.detach())


def test_unused_input_is_an_error_only_without_allow_unused():
    a, b = leaf(3), leaf(3)
    loss = (a * a).sum()
    with pytest.raises(RuntimeError) as ours:
        versionwatch.assert_backward_safe(loss, inputs=[b], api="grad")
    with pytest.raises(RuntimeError) as real:
        torch.autograd.grad(loss, [b], retain_graph=True)
    assert (type(ours.value), str(ours.value)) == (type(real.value), str(real.value))
    assert "appears to not have been used in the graph" in str(real.value)
    versionwatch.assert_backward_safe(loss, inputs=[b], api="grad", allow_unused=True)
    versionwatch.assert_backward_safe(loss, inputs=[b])  # backward(inputs=) allows it
    report = versionwatch.check(loss, inputs=[a, b], api="grad", allow_unused=True)
    assert report.ok and report.nodes == 2  # SumBackward0, MulBackward0: grad() only captures at a
    assert torch.autograd.grad(loss, [a, b], allow_unused=True)[1] is None


def test_gradient_edge_inputs_run_only_their_part_of_the_graph():
    x = leaf(3)
    h = x * 2
    y = h.sigmoid()
    y.mul_(2)
    other = (x * 3).sum()
    loss = y.sum() + other
    r = versionwatch.check(loss, inputs=get_gradient_edge(h), api="grad")
    assert r.hazards[0].where == "SigmoidBackward0.result"
    assert versionwatch.check(loss, inputs=[get_gradient_edge(x)], api="grad").hazards
    assert versionwatch.check(other, inputs=[get_gradient_edge(x)], api="grad").ok
    assert versionwatch.check(other, inputs=(t for t in [x]), api="grad").ok  # any iterable, as PyTorch


def test_sparse_and_mkldnn_leaf_inputs_are_found_in_the_graph():
    x = torch.randn(3, 3, dtype=torch.double).to_sparse().requires_grad_()
    d = x.to_dense()
    e = d.exp()  # exp saves its result
    loss = e.sum()
    e.add_(1)
    r = versionwatch.check(loss, inputs=[x], api="grad")
    assert not r.ok and r.hazards[0].where == "ExpBackward0.result"
    m = torch.randn(2, 2).to_mkldnn().requires_grad_()
    # Found: ToDenseBackward0 runs too (unfound, only the root would).
    assert versionwatch.check(m.to_dense().sum(), inputs=m, api="grad").nodes == 2


def test_nested_tensor_hazard_is_explained_without_a_shape():
    outputs, kw = _nested_stale()
    with pytest.raises(versionwatch.InplaceModificationError) as info:
        versionwatch.assert_backward_safe(outputs, **kw)
    h = info.value.report.hazards[0]
    assert (h.shape, h.saved_version, h.current_version) == (None, 0, 1)
    assert "modified by an inplace operation" in str(info.value)


def test_engine_probes_run_apart_from_the_callers_modes():
    """The engine's words are learnt on a throwaway leaf that no user mode sees,
    even when first needed under inference_mode and a TorchFunctionMode."""
    from torch.overrides import TorchFunctionMode

    from versionwatch._predict import arguments as _arguments

    seen: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    a, b = leaf(3), leaf(3)
    loss = (a * a).sum()
    real = _outcome(lambda: torch.autograd.grad(loss, [a, b], retain_graph=True))
    for probe in (_arguments._unused, _arguments._edge_of_junk, _arguments._empty_inputs):
        probe.cache_clear()
    with torch.inference_mode(), Record():
        ours = _outcome(lambda: versionwatch.assert_backward_safe(loss, inputs=[a, b], api="grad"))
        junk = _outcome(lambda: versionwatch.assert_backward_safe(
            loss, inputs=[GradientEdge(3, 0)], api="grad"))  # type: ignore[arg-type]
    assert ours == real and real[0] is RuntimeError
    assert junk == _outcome(lambda: torch.autograd.grad(loss, [GradientEdge(3, 0)]))  # type: ignore[arg-type]
    assert not {"zeros", "ones", "_set_grad_enabled"} & set(seen)


# -- the watcher: PyTorch's own argument errors, predictions for every input form ---

WATCHED_ARGUMENT_ERRORS: dict[str, Callable[[torch.Tensor], Any]] = {
    "no_gradient_for_non_scalar": lambda y: y.backward(),
    "gradient_shape": lambda y: y.backward(torch.ones(2)),
    "gradient_keyword": lambda y: torch.autograd.backward(y, grad_tensors=torch.ones(2, 2)),
    "gradient_device": lambda y: y.backward(torch.ones(3, device="meta")),
    "grad_empty_inputs": lambda y: torch.autograd.grad(y.sum(), []),
    "grad_unknown_keyword": lambda y: torch.autograd.grad(y.sum(), y, allow=True),
    "materialize_with_allow_unused_false": lambda y: torch.autograd.grad(
        y.sum(), [y], allow_unused=False, materialize_grads=True),
    "edge_of_junk_as_output": lambda y: torch.autograd.backward(GradientEdge(3, 0)),  # type: ignore[arg-type]
    "inputs_an_int": lambda y: torch.autograd.grad(y.sum(), 3),
    "both_gradient_names": lambda y: torch.autograd.backward(
        y, torch.ones(3), grad_variables=torch.ones(3)),
}


@pytest.mark.parametrize("case", list(WATCHED_ARGUMENT_ERRORS))
def test_watcher_leaves_argument_errors_to_pytorch(case: str) -> None:
    """A stale tensor, and arguments PyTorch rejects first: PyTorch's error, unchanged."""
    call = WATCHED_ARGUMENT_ERRORS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grad_variables is deprecated
        real = _outcome(lambda: call(_stale_sigmoid()[1]))
        with versionwatch.watch_all() as w:
            y = _stale_sigmoid()[1]
            watched = _outcome(lambda: call(y))
    # AssertionError: torch that reads an edge as a tuple asserts its items are tensors
    assert real[0] in (RuntimeError, TypeError, ValueError, AttributeError, AssertionError)
    assert watched == real
    assert not w.reports
    assert versionwatch.check(y, grad_outputs=torch.ones(3)).hazards  # the hazard was real


def test_watcher_predicts_edges_dicts_and_one_shot_iterators():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.ones(2, 3)
    # Older torch reads a dict of inputs as its keys, and rejects them.
    unwatched = _outcome(lambda: torch.autograd.grad(model(x).sum(), dict(model.named_parameters())))
    takes_dicts = unwatched == ("ok",)
    with versionwatch.watch(model):
        loss = model(x).pow(2).sum()
        plain = torch.autograd.grad(loss, model.parameters(), retain_graph=True)
        edges = torch.autograd.grad(loss, [get_gradient_edge(p) for p in model.parameters()],
                                    retain_graph=True)
        for g, e in zip(plain, edges):
            assert torch.equal(g, e)
        if takes_dicts:
            named = torch.autograd.grad(loss, dict(model.named_parameters()), retain_graph=True)
            assert isinstance(named, dict) and list(named) == ["0.weight", "0.bias", "2.weight", "2.bias"]
            for g, n in zip(plain, named.values()):
                assert torch.equal(g, n)
        with torch.no_grad():
            model[2].weight.add_(1)  # what a step does; the gradients of layer 0 need it
        for inputs in (model.parameters(), dict(model.named_parameters()),
                       get_gradient_edge(model[0].weight)):
            if isinstance(inputs, dict) and not takes_dicts:
                # PyTorch rejects the call before it reads a saved tensor: its own error.
                assert _outcome(lambda: torch.autograd.grad(loss, inputs, retain_graph=True)) \
                    == unwatched  # noqa: B023
                continue
            with pytest.raises(versionwatch.InplaceModificationError, match=r"model\.2\.weight"):
                torch.autograd.grad(loss, inputs, retain_graph=True)


def _iterator_call(api: str, m: nn.Module) -> tuple[Any, ...]:
    """A call on one-shot iterators: its outcome, what is left of them, whether it ran."""
    loss = m(torch.ones(1, 2)).sum()
    outputs, params = iter([loss]), m.parameters()
    if api == "backward":
        outcome = _outcome(lambda: torch.autograd.backward(outputs, inputs=params))
    else:
        outcome = _outcome(lambda: torch.autograd.grad(outputs, params))
    return outcome, len(list(outputs)), len(list(params)), m.weight.grad is not None


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_watcher_reads_one_shot_iterators_only_where_pytorch_does(api: str) -> None:
    """Older torch asks backward's inputs for len() first: that call fails, nothing read."""
    plain = _iterator_call(api, nn.Linear(2, 1))
    m = nn.Linear(2, 1)
    with versionwatch.watch(m) as w:
        watched = _iterator_call(api, m)
    assert watched == plain
    assert not w.reports


def test_watcher_unused_inputs():
    """With a stale tensor the run fails on it first; without one, PyTorch's own error."""
    a = leaf(3)
    plain = _outcome(lambda: torch.autograd.grad((a * a).sum(), [a, leaf(3)]))
    with versionwatch.watch_all():
        a, y = _stale_sigmoid()
        with pytest.raises(versionwatch.InplaceModificationError):
            torch.autograd.grad(y.sum(), [a, leaf(3)])
        a = leaf(3)
        with pytest.raises(RuntimeError) as info:
            torch.autograd.grad((a * a).sum(), [a, leaf(3)])
    assert (type(info.value), str(info.value)) == plain
    assert "appears to not have been used in the graph" in plain[1]


def test_watcher_sparse_and_mkldnn_inputs_give_pytorchs_gradients():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is beta
        leaves = [torch.randn(3, 3, dtype=torch.double).to_sparse().requires_grad_(),
                  torch.randn(3, 3, dtype=torch.double).to_sparse_csr().requires_grad_(),
                  torch.randn(3, 3).to_mkldnn().requires_grad_()]
        for x in leaves:
            (plain,) = torch.autograd.grad(x.to_dense().sum(), x)
            with versionwatch.watch_all():
                (watched,) = torch.autograd.grad(x.to_dense().sum(), x)
            assert torch.equal(plain.to_dense(), watched.to_dense())


def test_backward_inside_a_functorch_transform():
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        y = (x * x).sum()
        seen.append((_outcome(lambda: versionwatch.assert_backward_safe(y)),
                     _outcome(lambda: torch.autograd.backward(y))))
        return y

    torch.func.grad(f)(torch.ones(2))
    (ours, real), = seen
    assert ours == real and real[0] is RuntimeError and "functorch" in real[1]


def test_nested_tensor_hazard_under_strict_mode_is_explained():
    with versionwatch.watch_all(strict=True):
        outputs, kw = _nested_stale()
        with pytest.raises(versionwatch.InplaceModificationError) as info:
            outputs.backward(kw["grad_outputs"])
    assert info.value.report.hazards[0].shape is None


def _random_call(rng: random.Random) -> tuple[str, Any, dict[str, Any]]:
    """A call drawn from outputs, inputs, gradients and flags that mix every outcome."""
    a, b, c = leaf(3), leaf(3), torch.randn(3)
    h = a * 2
    s = h.sigmoid()
    parts = (b * 3).split(1)
    outs_pool: list[Callable[[], Any]] = [
        lambda: s, lambda: s.sum(), lambda: h, lambda: h.sum(), lambda: parts[0],
        lambda: parts[0].sum(), lambda: c, lambda: a, lambda: h.sum().long(),
        lambda: get_gradient_edge(h), lambda: get_gradient_edge(h.sum())]
    ins_pool: list[Callable[[], Any]] = [
        lambda: a, lambda: b, lambda: c, lambda: h, lambda: parts[1], lambda: parts[0],
        lambda: get_gradient_edge(h), lambda: get_gradient_edge(a), lambda: s,
        lambda: torch.ones(2, requires_grad=True)]
    n = rng.choice([1, 1, 2])
    outs = [rng.choice(outs_pool)() for _ in range(n)]
    outputs = outs[0] if n == 1 and rng.random() < 0.5 else outs
    api = rng.choice(["backward", "grad"])
    kw: dict[str, Any] = {}
    if api == "grad" or rng.random() < 0.4:
        ins = [rng.choice(ins_pool)() for _ in range(rng.choice([1, 2, 3]))]
        kw["inputs"] = ins[0] if len(ins) == 1 and rng.random() < 0.3 else ins
    if rng.random() < 0.5:
        grads = [rng.choice([None, torch.ones(3), torch.ones(()), torch.ones(1),
                             torch.ones(3, dtype=torch.double)])
                 for _ in range(rng.choice([n, n, max(n - 1, 1), n + 1]))]
        kw["grad_outputs"] = grads[0] if len(grads) == 1 and rng.random() < 0.5 else grads
    if api == "grad" and rng.random() < 0.3:
        kw["allow_unused"] = rng.choice([True, False, None])
    if api == "grad" and rng.random() < 0.2:
        kw["materialize_grads"] = True
    if rng.random() < 0.1:
        kw["retain_graph"] = rng.choice([True, False, 2, -1])
    with torch.no_grad():
        rng.choice([lambda: None, lambda: s.mul_(2), lambda: a.add_(1), lambda: b.add_(1)])()
    return api, outputs, kw


def test_random_calls_mirror_the_real_call():
    """Seeded random calls: each prediction agrees with the real call on the same tensors.

    Found that a single root with no input behind it does not run (a false alarm
    on its stale saved tensors before).
    """
    outcomes = set()
    for seed in range(1000):
        api, outputs, kw = _random_call(random.Random(seed))
        ours = _outcome(lambda: versionwatch.assert_backward_safe(outputs, api=api, **kw))  # noqa: B023
        real = _outcome(lambda: _real(api, outputs, kw))  # noqa: B023
        assert ours == real, (seed, api, kw)
        outcomes.add(real[0])
    assert {"ok", "inplace", RuntimeError} <= outcomes


def test_watcher_no_false_alarm_on_a_root_that_does_not_run():
    with versionwatch.watch_all() as w:
        s = _stale_root()
        (g,) = torch.autograd.grad(s, [s], torch.ones(3), retain_graph=True)
        (u,) = torch.autograd.grad(s, [leaf(3)], torch.ones(3), allow_unused=True)
    assert torch.equal(g, torch.ones(3)) and u is None and not w.reports


def _call_as_written(api: str, outputs: Any, kw: dict[str, Any]) -> None:
    """The real call, through ``Tensor.backward`` where a program would write that."""
    if api == "backward" and isinstance(outputs, torch.Tensor) and not isinstance(
            kw.get("grad_outputs"), list):
        rest = {k: v for k, v in kw.items() if k != "grad_outputs"}
        outputs.backward(kw.get("grad_outputs"), **rest)
        return
    _real(api, outputs, kw)


def test_random_calls_behave_the_same_under_a_watcher():
    """The same seeded calls, plain and watched: the same outcome (a predicted hazard
    is an InplaceModificationError where PyTorch raises its own)."""
    for seed in range(300):
        plain = _outcome(lambda: _call_as_written(*_random_call(random.Random(seed))))  # noqa: B023
        with versionwatch.watch_all():
            api, outputs, kw = _random_call(random.Random(seed))
            watched = _outcome(lambda: _call_as_written(api, outputs, kw))  # noqa: B023
        assert watched == plain, (seed, api, kw)


def test_check_observers_are_told_of_each_report_with_the_callers_frame(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The explicit seam that ``versionwatch fix``'s child uses instead of replacing check:
    told of every report of ``check`` and ``assert_backward_safe``, with the caller's
    frame, and of none made under ``unobserved()``."""
    import sys

    from versionwatch._predict import api

    told: list[tuple[bool, str]] = []
    monkeypatch.setattr(api, "CHECK_OBSERVERS",
                        [lambda report, frame: told.append((report.ok, frame.f_code.co_name))])
    x = torch.ones(3, requires_grad=True)
    y = x.sigmoid()
    y.mul_(2)
    here = sys._getframe().f_code.co_name
    assert not versionwatch.check(y.sum()).ok
    with pytest.raises(versionwatch.InplaceModificationError):
        versionwatch.assert_backward_safe(y.sum())
    with api.unobserved():
        versionwatch.check(y.sum())
    assert versionwatch.check(x.sum()).ok
    assert told == [(False, here), (False, "assert_backward_safe"), (True, here)]
