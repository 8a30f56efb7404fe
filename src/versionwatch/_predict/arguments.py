"""A backward call's own arguments, judged the way PyTorch judges them.

``torch.autograd.backward`` and ``torch.autograd.grad`` reject some calls before
any node runs (a non-scalar output without a gradient, an output with no graph,
an input that does not require grad, an empty ``inputs``), and ``grad`` rejects
one more after the run: an input that no gradient reached, unless
``allow_unused``. A prediction that called such a call safe would be wrong, so
:func:`bind` raises what PyTorch raises, in PyTorch's order, with PyTorch's own
sentences.

These checks changed across torch releases, so none is rewritten here: the
Python half of each call is PyTorch's own function, run on a copy whose call
into the C++ engine stops and hands over what the engine would get
(:func:`_preamble`); the engine's checks of those are mirrored, in the
running torch's words, learnt once from the real engine on a throwaway leaf
(the probe section below).
"""

from __future__ import annotations

import functools
import logging
import operator
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Literal, NoReturn, SupportsIndex, TypeVar, Union, cast

import torch
from torch.autograd.graph import GradientEdge, Node

from versionwatch._report import add_note

Api = Literal["backward", "grad"]
Edge = Union[torch.Tensor, GradientEdge]
_T = TypeVar("_T")

# The public functions as torch defines them, taken before a watcher replaces them.
_TORCH_DEFINED: dict[str, Callable[..., object]] = {
    "backward": torch.autograd.backward, "grad": torch.autograd.grad}


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


def _typename(x: object) -> str:
    """``Py_TYPE(x)->tp_name``, which PyTorch's C++ messages print."""
    cls = type(x)
    heap = bool(cls.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE: tp_name is the bare name
    if heap or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


# -- probes: the running torch's own Python half and its engine's words --------------

class _Reached(Exception):
    """The copy of PyTorch's function got to the engine with these arguments."""

    def __init__(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        super().__init__()
        self.call = (args, kwargs)


def _stop(*args: object, **kwargs: object) -> NoReturn:
    raise _Reached(args, kwargs)


def _no_torch_function(*_: object) -> bool:
    # A subclass's __torch_function__ is user code: a prediction must not run it.
    return False


class _Quiet:
    """``warnings`` for the copy: the real call warns (deprecated arguments) once, itself."""

    @staticmethod
    def warn(*_: object, **__: object) -> None:
        return None


class _NoVmap:
    """``_vmap_internals`` for the copy: the batched gradients reach the engine unsplit."""

    @staticmethod
    def _vmap(fn: _T, *_: object, **__: object) -> _T:
        return fn


def _pass_grads(outputs: object, grads: _T, **_: object) -> _T:
    return grads


def _no_grads(_: object, length: int) -> tuple[None, ...]:
    return (None,) * length


def _genuine(api: Api) -> types.FunctionType:
    """PyTorch's own ``torch.autograd.<api>``, behind any wrappers that say what they wrap.

    A profiler, a test harness or another tool may have wrapped the function
    before versionwatch was imported. A copy of a wrapper's code would call
    what the wrapper closes over, the real function, and run the whole
    backward inside the prediction: only PyTorch's own code is ever copied.
    """
    fn: object = _TORCH_DEFINED[api]
    for _ in range(100):  # a __wrapped__ chain can loop
        code = getattr(fn, "__code__", None)
        if (code is not None and getattr(fn, "__module__", None) == "torch.autograd"
                and code.co_name == api):
            return cast(types.FunctionType, fn)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    msg = (f"torch.autograd.{api} was replaced before versionwatch was imported, by a wrapper "
           "that does not name the function it wraps (functools.wraps sets __wrapped__): "
           f"calls to torch.autograd.{api} are not predicted")
    if api not in _HIDDEN_SAID:
        _HIDDEN_SAID.add(api)
        logging.getLogger("versionwatch").warning("versionwatch: %s", msg)
    raise TypeError(msg)


_HIDDEN_SAID: set[str] = set()


@functools.cache
def _preamble(api: Api, grads: bool) -> Callable[..., object]:
    """``torch.autograd.<api>`` itself, up to the engine: it raises :class:`_Reached` there.

    The copy shares the original's code and all of its module but the names
    that would reach past the arguments (the engine, ``__torch_function__``,
    vmap, warnings). Without ``grads``, the gradients are not read either:
    what is left is how the call reads its outputs and inputs.
    """
    fn = _genuine(api)
    env = dict(fn.__globals__)
    env.update(_engine_run_backward=_stop, has_torch_function=_no_torch_function,
               warnings=_Quiet, _vmap_internals=_NoVmap)
    if not grads:
        env.update(_tensor_or_tensors_to_tuple=_no_grads, _make_grads=_pass_grads)
    copy = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _provoke(inputs: Callable[[torch.Tensor], tuple[object, ...]]) -> Exception | None:
    """What the engine raises for ``grad(x, inputs(x))``, ``x`` a fresh scalar leaf.

    Called straight, past every patch and mode of ours or the user's; the
    inputs are chosen so that the engine stops before any node, or runs
    none that is not the probe's own.
    """
    engine: Any = torch.autograd.Variable._execution_engine
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), \
            torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros((), requires_grad=True)
        try:
            engine.run_backward((x,), (torch.ones(()),), False, False, inputs(x), False, False)
        except Exception as e:  # any answer is the engine's answer
            return e
    return None


@functools.cache
def _empty_inputs() -> Exception | None:
    """The engine's own error for ``grad`` with no inputs (older torch leaves it to the engine)."""
    return _provoke(lambda x: ())


@functools.cache
def _edge_of_junk() -> tuple[type[Exception], list[str]] | None:
    """The error for an edge of a non-Node, split where the object's type name goes.

    Where the message does not end with the probe's type name, it is one part.
    """
    err = _provoke(lambda x: (GradientEdge(0, 0),))  # type: ignore[arg-type]
    if err is None:
        return None
    text = str(err)
    return type(err), [text[: -len("int")], ""] if text.endswith("int") else [text]


@functools.cache
def _unused() -> tuple[type[Exception], list[str]] | None:
    """The error for an input no gradient reached, split where its index goes.

    The probe's unused input is at index 1, its used one (the root) at 0;
    where the message names no index, it is one part.
    """
    err = _provoke(lambda x: (x, torch.zeros((), requires_grad=True)))
    if err is None:
        return None
    before, sep, after = str(err).partition(" 1 ")
    return type(err), [before + " ", " " + after] if sep else [str(err)]


def _bad(kind: type[Exception], text: str) -> BadCall:
    """A probed error, made anew for this call (its traceback is this call's)."""
    try:
        return BadCall(kind(text))
    except Exception:  # a type that takes more than a message
        return BadCall(RuntimeError(text))


# -- the checks ---------------------------------------------------------------------

def _outputs(value: object) -> tuple[Edge, ...]:
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


def _byte(value: object) -> None:
    """The engine parses each flag as a C ``unsigned char`` (the ``"b"`` format)."""
    n = operator.index(cast(SupportsIndex, value))  # raises TypeError for a non-integer
    if n < 0:
        raise OverflowError("unsigned byte integer is less than minimum")
    if n > 255:
        raise OverflowError("unsigned byte integer is greater than maximum")


def _check_edges(accumulate: bool, outs: tuple[Edge, ...], ins: tuple[object, ...]) -> None:
    """The engine's checks of the roots, then of the inputs (``run_backward``)."""
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad:
            raise BadCall(add_note(
                RuntimeError(f"element {i} of tensors does not require grad and does not "
                             "have a grad_fn"),
                f"versionwatch: outputs[{i}] was computed under torch.no_grad() or "
                "inference_mode(), detached, or only from tensors that don't require grad.",
            ))
    for x in ins:
        if isinstance(x, torch.Tensor):
            if not x.requires_grad:
                # backward() asks for the input's .grad first, which fails first.
                raise BadCall(RuntimeError(
                    "can't retain_grad on Tensor that has requires_grad=False" if accumulate
                    else "One of the differentiated Tensors does not require grad"
                ))
        elif isinstance(x, GradientEdge):
            if not isinstance(x.node, Node):
                junk = _edge_of_junk()
                if junk is not None:
                    raise _bad(junk[0], _typename(x.node).join(junk[1]))
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


def _check_root_grads(outs: tuple[Edge, ...], grads: tuple[object, ...]) -> None:
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


def _engine(tensors: object, grad_tensors: object, keep_graph: object, create_graph: object,
            inputs: object = None, allow_unreachable: object = False,
            accumulate_grad: object = False) -> dict[str, object]:
    """The engine's ``run_backward`` signature, to read what the copy handed it."""
    return locals()


def _run(api: Api, grads: bool, args: tuple[object, ...], kwargs: dict[str, object],
         outputs: object) -> Call:
    """``torch.autograd.<api>(*args, **kwargs)`` up to the first node, every check made.

    Raises:
        TypeError: ``outputs`` is not tensors at all (our sentence).
        BadCall: PyTorch rejects the call; ``.error`` is its exception.
    """
    copy = _preamble(api, grads)  # outside the try: it is not PyTorch rejecting the call
    try:
        copy(*args, **kwargs)
    except _Reached as reached:
        a = _engine(*reached.call[0], **reached.call[1])
    except Exception as e:  # whatever PyTorch's own code raised
        if not isinstance(outputs, Iterator):  # a one-shot iterator is the call's to read
            _outputs(outputs)
        raise BadCall(e) from None
    else:
        raise TypeError(f"torch.autograd.{api} returned before its engine ran")
    try:
        for flag in ("keep_graph", "create_graph", "allow_unreachable", "accumulate_grad"):
            _byte(a[flag])
    except (TypeError, OverflowError) as e:
        raise BadCall(e) from None
    outs = _outputs(a["tensors"])
    roots_grads = tuple(cast("Iterable[object]", a["grad_tensors"]))  # _make_grads's tuple
    if len(roots_grads) != len(outs):
        raise BadCall(RuntimeError(f"got {len(outs)} tensors and {len(roots_grads)} gradients"))
    accumulate = bool(a["accumulate_grad"])
    ins = tuple(cast("Iterable[object]", a["inputs"] or ()))
    _check_edges(accumulate, outs, ins)
    _check_root_grads(outs, roots_grads)
    if not accumulate and not ins:
        err = _empty_inputs()
        if err is not None:
            raise _bad(type(err), str(err))
    edges = cast("tuple[Edge, ...]", ins)  # _check_edges let only edges through
    return Call(api, outs, edges if edges or not accumulate else None,
                allow_unused=bool(a["allow_unreachable"]))


def parse(api: Api, outputs: object, inputs: object) -> Call:
    """The outputs and inputs of a call, with the engine's checks of both.

    Raises:
        TypeError: ``outputs`` is not tensors at all (our sentence), or
            ``api="grad"`` has no ``inputs``.
        BadCall: PyTorch rejects them; ``.error`` is its exception.
    """
    if (api == "backward" and inputs is None and type(outputs) is torch.Tensor
            and outputs.grad_fn is not None and outputs.numel() == 1
            and outputs.dtype.is_floating_point and outputs.layout is torch.strided
            and not outputs.is_nested):
        # loss.backward(), the call of nearly every training step: the checks
        # of the preamble (a real scalar with a node to start from) all hold,
        # and running a copy of it would cost as much as the rest of the
        # prediction of a small model.
        return Call(api, (outputs,), None, allow_unused=True)
    if api == "grad":
        if inputs is None:
            raise TypeError('api="grad" needs inputs, as torch.autograd.grad(outputs, inputs) does')
        return _run(api, False, (outputs, inputs), {}, outputs)
    return _run(api, False, (outputs,), {"inputs": inputs}, outputs)


def bind(
    api: Api,
    outputs: object,
    inputs: object,
    grad_outputs: object = None,
    retain_graph: object = None,
    create_graph: object = False,
    allow_unused: object = None,
    materialize_grads: object = False,
    is_grads_batched: object = False,
) -> Call:
    """Every check PyTorch makes of a call's arguments before a node runs, in its order.

    Raises:
        TypeError: ``outputs`` is not tensors at all (our sentence), or
            ``api="grad"`` has no ``inputs``.
        BadCall: PyTorch rejects the call; ``.error`` is its exception.
    """
    if api == "grad":
        if inputs is None:
            raise TypeError('api="grad" needs inputs, as torch.autograd.grad(outputs, inputs) does')
        call = _run(api, True, (outputs, inputs), {
            "grad_outputs": grad_outputs, "retain_graph": retain_graph,
            "create_graph": create_graph, "allow_unused": allow_unused,
            "is_grads_batched": is_grads_batched, "materialize_grads": materialize_grads,
        }, outputs)
        call.materialize_grads = bool(materialize_grads)
        return call
    return _run(api, True, (outputs,), {
        "grad_tensors": grad_outputs, "retain_graph": retain_graph,
        "create_graph": create_graph, "inputs": inputs}, outputs)


def after_run(call: Call, unreached: list[int]) -> None:
    """What ``grad`` raises after a run in which no gradient reached some inputs.

    Only inputs that no edge of the graph leads to are certain to get none; an
    input that is reached but gets an undefined gradient (a custom Function
    returning ``None``) is not foreseen.
    """
    if call.api != "grad" or not unreached or call.inputs is None:
        return
    if not call.allow_unused:
        unused = _unused()
        if unused is not None:
            raise _bad(unused[0], str(unreached[0]).join(unused[1]))
    if call.materialize_grads and any(isinstance(call.inputs[i], GradientEdge) for i in unreached):
        raise BadCall(RuntimeError(
            "materialize_grads cannot be used when the given input is a GradientEdge"
        ))


def rejected(api: str, args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether PyTorch rejects ``torch.autograd.<api>(*args, **kwargs)`` before a node runs."""
    name = "tensors" if api == "backward" else "outputs"
    try:
        _run("grad" if api == "grad" else "backward", True, args, kwargs,
             args[0] if args else kwargs.get(name))
    except (BadCall, TypeError):
        return True
    return False


class _Read(Exception):
    """PyTorch's own function began to read a one-shot iterator."""


class _Unread:
    """A one-shot iterator's stand-in while PyTorch's function is tried: reading it stops."""

    def __init__(self, original: Iterator[object]) -> None:
        self.original = original

    def __iter__(self) -> _Unread:
        return self

    def __next__(self) -> NoReturn:
        raise _Read


class _UnreadSized(_Unread):
    def __len__(self) -> int:
        return len(self.original)  # type: ignore[arg-type]


def _stand_in(value: object) -> object:
    if not isinstance(value, Iterator):
        return value
    return _UnreadSized(value) if hasattr(type(value), "__len__") else _Unread(value)


def read_once(args: tuple[object, ...], kwargs: dict[str, object], first: str,
              inputs_at: int) -> tuple[tuple[object, ...], dict[str, object]]:
    """The call's arguments with one-shot iterators (``model.parameters()``) made tuples.

    PyTorch reads outputs and inputs once, with ``tuple()``; the prediction
    reads them first, so it must leave PyTorch the same tensors to read. Where
    PyTorch rejects the call before it reads them (older torch asks
    ``backward``'s ``inputs`` for their ``len()``), they stay unread, for
    PyTorch to reject as it would.
    """
    at = (0, inputs_at)
    names = (first, "inputs")
    try:
        _preamble("backward" if first == "tensors" else "grad", False)(
            *(_stand_in(a) if k in at else a for k, a in enumerate(args)),
            **{k: _stand_in(v) if k in names else v for k, v in kwargs.items()})
    except (_Read, _Reached):
        pass
    except Exception:  # PyTorch fails before it reads them: so will the call
        return args, kwargs
    args = tuple(tuple(a) if k in at and isinstance(a, Iterator) else a
                 for k, a in enumerate(args))
    kwargs = {k: tuple(v) if k in names and isinstance(v, Iterator) else v
              for k, v in kwargs.items()}
    return args, kwargs
