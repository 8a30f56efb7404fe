"""A backward call's own arguments, judged the way PyTorch judges them.

``torch.autograd.backward`` and ``torch.autograd.grad`` reject some calls before
any node runs (a non-scalar output without a gradient, an output with no graph,
an input that does not require grad, an empty ``inputs``), and ``grad`` rejects
one more after the run: an input that no gradient reached, unless
``allow_unused``. A prediction that called such a call safe would be wrong, so
:func:`bind` raises what PyTorch raises, in PyTorch's order, with PyTorch's own
sentences (``torch/autograd/__init__.py`` and
``torch/csrc/autograd/python_engine.cpp``); the gradients are checked by
PyTorch's own helper, called as the call calls it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch.autograd.graph import GradientEdge, Node

Api = Literal["backward", "grad"]
Edge = Union[torch.Tensor, GradientEdge]

_FUNCTORCH = (
    "backward() called inside a functorch transform. This is not supported, please use "
    "functorch.grad or functorch.vjp instead or call backward() outside of functorch transforms."
)


class BadCall(Exception):
    """PyTorch rejects the call's arguments: it would raise ``error``, PyTorch's own."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Call:
    """A call's outputs and inputs as PyTorch reads them, and what ``grad`` does after."""

    api: Api
    outputs: tuple[Edge, ...]
    inputs: tuple[Edge, ...] | None
    allow_unused: bool = True
    materialize_grads: bool = False


def _note(err: Exception, text: str) -> Exception:
    if hasattr(err, "add_note"):
        err.add_note(text)
    else:  # Python < 3.11 has no add_note: set what it would set
        err.__notes__ = [*getattr(err, "__notes__", []), text]
    return err


def _typename(x: object) -> str:
    """``Py_TYPE(x)->tp_name``, which PyTorch's C++ messages print."""
    cls = type(x)
    heap = bool(cls.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE: tp_name is the bare name
    if heap or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def _outputs(value: Any) -> tuple[Edge, ...]:
    """The outputs as a tuple; anything else is our TypeError.

    PyTorch's own answer to a non-tensor output is an internal assertion, not a
    sentence worth mirroring.
    """
    if isinstance(value, GradientEdge):
        value = (value,)
    elif isinstance(value, torch.Tensor):
        return (value,)
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        raise TypeError(
            f"outputs must be a tensor or a sequence of tensors; got {type(value).__name__}"
        )
    outs = tuple(value)
    for i, t in enumerate(outs):
        if not isinstance(t, (torch.Tensor, GradientEdge)):
            raise TypeError(f"outputs[{i}] must be a tensor; got {type(t).__name__}")
        if isinstance(t, GradientEdge) and not isinstance(t.node, Node):
            raise TypeError(f"outputs[{i}] is a GradientEdge of {type(t.node).__name__}, "
                            "not of an autograd Node")
    return outs


def _inputs(api: Api, value: Any) -> tuple[Any, ...] | None:
    """The inputs as PyTorch reads them: a tensor or edge, a dict's values, any iterable.

    The watcher hands one-shot iterators over as tuples (:func:`read_once`).
    """
    if value is None:
        if api == "grad":
            raise TypeError('api="grad" needs inputs, as torch.autograd.grad(outputs, inputs) does')
        return None
    if isinstance(value, (torch.Tensor, GradientEdge)):
        return (value,)
    if type(value) is dict:
        ins = tuple(value.values())
    elif isinstance(value, Mapping):
        raise BadCall(TypeError(
            f"`inputs` argument to `{api}()` must be a dict, not {type(value).__name__}. "
            "Other Mapping types are not supported."
        ))
    else:
        try:
            ins = tuple(value)
        except TypeError as e:  # not iterable: PyTorch's tuple() says so
            raise BadCall(e) from None
    if not ins:
        raise BadCall(RuntimeError(f"`inputs` argument to `{api}()` cannot be empty."))
    return ins


def _byte(value: Any) -> None:
    """The engine parses each flag as a C ``unsigned char`` (the ``"b"`` format)."""
    n = operator.index(value)
    if n < 0:
        raise OverflowError("unsigned byte integer is less than minimum")
    if n > 255:
        raise OverflowError("unsigned byte integer is greater than maximum")


def _check_edges(api: Api, outs: tuple[Edge, ...], ins: tuple[Any, ...] | None) -> None:
    """The engine's checks of the roots, then of the inputs (``run_backward``)."""
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad:
            raise BadCall(_note(
                RuntimeError(f"element {i} of tensors does not require grad and does not "
                             "have a grad_fn"),
                f"versionwatch: outputs[{i}] was computed under torch.no_grad() or "
                "inference_mode(), detached, or only from tensors that don't require grad.",
            ))
    for x in ins or ():
        if isinstance(x, torch.Tensor):
            if not x.requires_grad:
                # backward() asks for the input's .grad first, which fails first.
                raise BadCall(RuntimeError(
                    "can't retain_grad on Tensor that has requires_grad=False" if api == "backward"
                    else "One of the differentiated Tensors does not require grad"
                ))
        elif isinstance(x, GradientEdge):
            if not isinstance(x.node, Node):
                raise BadCall(RuntimeError(
                    "GradientEdge's first object must be an autograd.graph.Node but got "
                    + _typename(x.node)
                ))
        else:
            raise BadCall(RuntimeError(
                f"all inputs have to be Tensors or GradientEdges, but got {_typename(x)}"
            ))


# Layouts by the names PyTorch's C++ messages print.
_LAYOUT = {torch.strided: "Strided", torch.sparse_coo: "Sparse", torch.sparse_csr: "SparseCsr",
           torch.sparse_csc: "SparseCsc", torch.sparse_bsr: "SparseBsr",
           torch.sparse_bsc: "SparseBsc", torch._mkldnn: "Mkldnn"}  # type: ignore[attr-defined]
_COMPRESSED = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
               torch.sparse_bsc)


def _check_root_grads(outs: tuple[Edge, ...], grads: tuple[Any, ...]) -> None:
    """The engine's checks of the roots' gradients before it runs a node.

    ``validate_outputs`` in ``engine.cpp``: shapes and dtypes were settled by
    ``_make_grads`` (a dtype is cast), so what is left is the layout (a sparse
    gradient fits anything, a strided one fits a sparse output) and the device
    (a 0-dim gradient is moved).
    """
    for i, (out, g) in enumerate(zip(outs, grads)):
        if not isinstance(g, torch.Tensor) or g.is_nested:
            continue
        if isinstance(out, GradientEdge):
            layout, device = None, out.node._input_metadata[out.output_nr].device
        elif out.is_nested:
            continue
        else:
            layout, device = out.layout, out.device
        if layout is not None and g.layout != layout and not g.is_sparse \
                and not (g.layout == torch.strided and layout in _COMPRESSED):
            raise BadCall(RuntimeError(
                f"invalid gradient at index {i} - expected layout "
                f"{_LAYOUT.get(layout, str(layout))} but got {_LAYOUT.get(g.layout, str(g.layout))}"
            ))
        if g.device != device and g.dim() != 0 and type(g) is torch.Tensor:
            raise BadCall(RuntimeError(
                f"invalid gradient at index {i} - expected device {device} but got {g.device}"
            ))


def parse(api: Api, outputs: Any, inputs: Any) -> Call:
    """The outputs and inputs of a call, with the engine's checks of both.

    Raises:
        TypeError: ``outputs`` or ``inputs`` is not tensors at all (our sentence).
        BadCall: PyTorch rejects them; ``.error`` is its exception.
    """
    outs = _outputs(outputs)
    ins = _inputs(api, inputs)
    _check_edges(api, outs, ins)
    return Call(api, outs, ins)


def bind(
    api: Api,
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    retain_graph: Any = None,
    create_graph: Any = False,
    allow_unused: Any = None,
    materialize_grads: Any = False,
    is_grads_batched: Any = False,
) -> Call:
    """Every check PyTorch makes of a call's arguments before a node runs, in its order.

    Raises:
        TypeError: ``outputs`` or ``inputs`` is not tensors at all (our sentence).
        BadCall: PyTorch rejects the call; ``.error`` is its exception.
    """
    if api == "grad":
        if materialize_grads and allow_unused is False:
            raise BadCall(ValueError(
                "Expected allow_unused to be True or not passed when materialize_grads=True, "
                "but got: allow_unused=False."
            ))
        if allow_unused is None:
            allow_unused = materialize_grads
        outs = _outputs(outputs)
        ins = _inputs(api, inputs)
    else:
        active = getattr(torch._C, "_are_functorch_transforms_active", None)
        if active is not None and active():
            raise BadCall(RuntimeError(_FUNCTORCH))
        ins = _inputs(api, inputs)
        outs = _outputs(outputs)
    try:
        # PyTorch's own checks of the gradients: shapes, dtypes, scalar outputs.
        grads = torch.autograd._tensor_or_tensors_to_tuple(grad_outputs, len(outs))
        grads = torch.autograd._make_grads(
            outs,  # type: ignore[arg-type]  # a mix of tensors and edges is PyTorch's too
            grads, is_grads_batched=bool(is_grads_batched))
        if retain_graph is None:
            retain_graph = create_graph
        _byte(retain_graph)
        _byte(create_graph)
        _byte(allow_unused if api == "grad" else True)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:
        raise BadCall(e) from None
    if len(grads) != len(outs):
        raise BadCall(RuntimeError(f"got {len(outs)} tensors and {len(grads)} gradients"))
    _check_edges(api, outs, ins)
    _check_root_grads(outs, grads)
    return Call(api, outs, ins, allow_unused=bool(allow_unused),
                materialize_grads=bool(materialize_grads))


def after_run(call: Call, unreached: list[int]) -> None:
    """What ``grad`` raises after a run in which no gradient reached some inputs.

    Only inputs that no edge of the graph leads to are certain to get none; an
    input that is reached but gets an undefined gradient (a custom Function
    returning ``None``) is not foreseen.
    """
    if call.api != "grad" or not unreached or call.inputs is None:
        return
    if not call.allow_unused:
        # torch 2.13's sentence; earlier releases say "One of the differentiated
        # Tensors" instead of naming the index.
        raise BadCall(RuntimeError(
            f"The differentiated Tensor at index {unreached[0]} appears to not have been used "
            "in the graph. Set allow_unused=True if this is the desired behavior."
        ))
    if call.materialize_grads and any(isinstance(call.inputs[i], GradientEdge) for i in unreached):
        raise BadCall(RuntimeError(
            "materialize_grads cannot be used when the given input is a GradientEdge"
        ))


# The signatures of the two calls the watcher replaces, to read their arguments
# by name exactly as Python binds them for PyTorch.
def _backward_args(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None,
                   create_graph: Any = False, grad_variables: Any = None,
                   inputs: Any = None) -> dict[str, Any]:
    return locals()


def _grad_args(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: Any = None,
               create_graph: Any = False, only_inputs: Any = True, allow_unused: Any = None,
               is_grads_batched: Any = False, materialize_grads: Any = False) -> dict[str, Any]:
    return locals()


def rejected(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether PyTorch rejects ``torch.autograd.<api>(*args, **kwargs)`` before a node runs."""
    try:
        if api == "backward":
            a = _backward_args(*args, **kwargs)
            grads = a["grad_tensors"]
            if a["grad_variables"] is not None:
                if grads is not None:
                    return True
                grads = a["grad_variables"]
            bind("backward", a["tensors"], a["inputs"], grads, a["retain_graph"],
                 a["create_graph"])
        else:
            a = _grad_args(*args, **kwargs)
            bind("grad", a["outputs"], a["inputs"], a["grad_outputs"], a["retain_graph"],
                 a["create_graph"], a["allow_unused"], a["materialize_grads"],
                 a["is_grads_batched"])
    except (BadCall, TypeError):
        return True
    return False


def read_once(args: tuple[Any, ...], kwargs: dict[str, Any], first: str,
              inputs_at: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with one-shot iterators (``model.parameters()``) made tuples.

    PyTorch reads outputs and inputs once, with ``tuple()``; the prediction
    reads them first, so it must leave PyTorch the same tensors to read.
    """
    args = tuple(tuple(a) if k in (0, inputs_at) and isinstance(a, Iterator) else a
                 for k, a in enumerate(args))
    kwargs = {k: tuple(v) if k in (first, "inputs") and isinstance(v, Iterator) else v
              for k, v in kwargs.items()}
    return args, kwargs

