"""The model as a graph: inputs, parameters, constants and op nodes, built by tracing.

    g = Graph()
    x = g.input("x", (64, 784))
    w = g.parameter("fc.weight", (10, 784), init=teeny.core.init.kaiming_uniform(784))
    y = teeny.ops.gelu(x @ w.T)        # every op adds a node, with its shape inferred
    g.output(y)

Symbolic ``Tensor``s carry a shape and dtype and nothing else; applying an op checks the
inputs (the op's ``check_inputs`` and ``param_shapes``) and infers the output's shape and
dtype, so a shape mistake is reported at the line that made it, naming the node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .runtime import RuntimeOp, Shape

Init = Callable[[tuple, torch.Generator, torch.dtype], torch.Tensor]


class GraphError(ValueError):
    """A graph was built wrongly: bad shape, dtype or argument."""


@dataclass(eq=False)
class Value:
    """One tensor-valued thing in a graph."""

    id: int
    name: str
    shape: Shape
    dtype: torch.dtype
    kind: str  # "input" | "param" | "const" | "node"
    requires_grad: bool = False  # inputs: whether gradients w.r.t. it are wanted; params: trainable
    init: Init | None = None  # params
    data: torch.Tensor | None = None  # consts
    producer: Node | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(eq=False)
class Node:
    id: int
    name: str
    op: RuntimeOp
    inputs: list[Value]
    output: Value
    dtype: torch.dtype  # the dtype the op's kernels are dispatched for


@dataclass(eq=False)
class Graph:
    name: str = "graph"
    values: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    _bound: dict[int, Tensor] = field(default_factory=dict)

    # --- sources -------------------------------------------------------------------------
    def _new_value(self, name: str, shape: Sequence[int], dtype: torch.dtype, kind: str, **kw) -> Value:
        shape = _as_shape(shape, f"{kind} '{name}'")
        if kind in ("input", "param") and any(v.name == name and v.kind == kind for v in self.values):
            raise GraphError(f"graph already has a {kind} named {name!r}")
        value = Value(len(self.values), name, shape, dtype, kind, **kw)
        self.values.append(value)
        return value

    def input(
        self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32, requires_grad: bool = False
    ) -> Tensor:
        if requires_grad and not dtype.is_floating_point:
            raise GraphError(f"input {name!r}: a {dtype} input cannot require a gradient")
        return Tensor(self, self._new_value(name, shape, dtype, "input", requires_grad=requires_grad))

    def parameter(
        self,
        name: str,
        shape: Sequence[int],
        init: Init | None = None,
        dtype: torch.dtype = torch.float32,
        trainable: bool = True,
    ) -> Tensor:
        if not dtype.is_floating_point:
            raise GraphError(f"parameter {name!r} must be floating point, got {dtype}")
        return Tensor(
            self, self._new_value(name, shape, dtype, "param", requires_grad=trainable, init=init or zeros_init)
        )

    def constant(self, data: Any, dtype: torch.dtype | None = None, name: str | None = None) -> Tensor:
        tensor = torch.as_tensor(data, dtype=dtype)
        return Tensor(
            self,
            self._new_value(
                name or f"const{len(self.values)}",
                tuple(tensor.shape),
                tensor.dtype,
                "const",
                data=tensor.detach().clone(),
            ),
        )

    @property
    def inputs(self) -> list[Value]:
        return [v for v in self.values if v.kind == "input"]

    @property
    def params(self) -> list[Value]:
        return [v for v in self.values if v.kind == "param"]

    # --- ops ---------------------------------------------------------------------------
    def apply(self, op: RuntimeOp, inputs: Sequence[Any], name: str | None = None) -> Tensor:
        """Add a node running ``op`` on ``inputs``; returns its symbolic output."""
        values = [self._as_value(t) for t in inputs]
        node_name = name or f"{op.name}_{len(self.nodes)}"
        shapes = [v.shape for v in values]
        dtypes = [v.dtype for v in values]
        where = f"{op.name} (node '{node_name}')"
        if len(values) < op.n_activation_inputs:
            raise GraphError(f"{where}: needs {op.n_activation_inputs} inputs, got {len(values)}")
        expected = op.param_shapes(shapes)
        params = shapes[op.n_activation_inputs :]
        if expected and len(params) != len(expected):
            raise GraphError(f"{where}: expects {len(expected)} parameters, got {len(params)}")
        for i, (want, got) in enumerate(zip(expected, params)):
            if want is not None and tuple(want) != tuple(got):
                pname = values[op.n_activation_inputs + i].name
                raise GraphError(f"{where}: parameter '{pname}' has shape {tuple(got)}, expected {tuple(want)}")
        float_dtypes = {d for d in dtypes if d.is_floating_point}
        if len(float_dtypes) > 1 and not op.mixed_float_inputs:
            listing = ", ".join(f"{v.name}:{str(v.dtype).replace('torch.', '')}" for v in values)
            raise GraphError(f"{where}: inputs have different float dtypes ({listing})")
        try:
            op.check_inputs(shapes, dtypes)
            out_shape = _as_shape(op.output_shape(shapes), where)
            out_dtype = op.output_dtype(dtypes)
        except (ValueError, TypeError, IndexError) as exc:
            raise GraphError(f"{where}: {exc}") from None
        compute_dtype = dtypes[0] if op.mixed_float_inputs and dtypes else next(iter(float_dtypes), out_dtype)
        out = self._new_value(node_name, out_shape, out_dtype, "node")
        node = Node(len(self.nodes), node_name, op, values, out, compute_dtype)
        out.producer = node
        self.nodes.append(node)
        return Tensor(self, out)

    def output(self, *tensors: Tensor) -> None:
        """Mark the graph's outputs (the first is the loss in training)."""
        for t in tensors:
            if not isinstance(t, Tensor) or t.graph is not self:
                raise GraphError(f"graph.output expects tensors of this graph, got {t!r}")
            self.outputs.append(t.value)

    def _as_value(self, t: Any) -> Value:
        if isinstance(t, Tensor):
            if t.graph is not self:
                raise GraphError(f"tensor {t.value.name!r} belongs to another graph")
            return t.value
        from .module import Parameter  # modules bind their parameters on first use

        if isinstance(t, Parameter):
            return self.bind_parameter(t).value
        if isinstance(t, (int, float, bool)):
            raise GraphError("python scalars must be turned into constants by the op (graph.constant)")
        raise GraphError(f"expected a teeny Tensor, got {type(t).__name__}")

    def bind_parameter(self, p: Any) -> Tensor:
        """The graph tensor of a ``teeny.nn.Parameter`` (registered on first use)."""
        tensor = self._bound.get(id(p))
        if tensor is None:
            tensor = self.parameter(p.full_name(), p.shape, p.init, p.dtype, p.trainable)
            self._bound[id(p)] = tensor
        return tensor

    def summary(self) -> str:
        lines = [
            f"graph {self.name}: {len(self.inputs)} inputs, {len(self.params)} parameters, {len(self.nodes)} nodes"
        ]
        for v in self.values:
            if v.kind in ("input", "param"):
                lines.append(f"  {v.kind:5} {v.name:30} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}")
        for n in self.nodes:
            ins = ", ".join(v.name for v in n.inputs)
            lines.append(f"  node  {n.name:30} {n.op.name}({ins}) -> {tuple(n.output.shape)}")
        return "\n".join(lines)


def zeros_init(shape: tuple, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _as_shape(shape: Any, where: str) -> Shape:
    try:
        # operator.index: a size is an int (or a numpy/torch integer), never a float or a bool
        if any(isinstance(s, bool) for s in shape):
            raise TypeError
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise GraphError(f"{where}: shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in out):
        raise GraphError(f"{where}: negative size in shape {out}")
    return out


class Tensor:
    """A symbolic tensor: a value of a graph being traced. Operators add op nodes."""

    __slots__ = ("graph", "value")

    def __init__(self, graph: Graph, value: Value):
        self.graph = graph
        self.value = value

    @property
    def shape(self) -> Shape:
        return self.value.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.value.numel

    @property
    def name(self) -> str:
        return self.value.name

    def __repr__(self) -> str:
        return f"Tensor({self.value.name!r}, shape={self.shape}, dtype={str(self.dtype).replace('torch.', '')})"

    # Operators call the functional ops that ``teeny.ops`` binds here (``bind_operators``):
    # the graph does not import the op families that build on it.
    def __add__(self, other):
        return _operator("add")(self, other)

    def __radd__(self, other):
        return _operator("add")(other, self)

    def __sub__(self, other):
        return _operator("sub")(self, other)

    def __rsub__(self, other):
        return _operator("sub")(other, self)

    def __mul__(self, other):
        return _operator("mul")(self, other)

    def __rmul__(self, other):
        return _operator("mul")(other, self)

    def __truediv__(self, other):
        return _operator("div")(self, other)

    def __rtruediv__(self, other):
        return _operator("div")(other, self)

    def __neg__(self):
        return _operator("neg")(self)

    def __pow__(self, other):
        return _operator("pow")(self, other)

    def __rpow__(self, other):
        return _operator("pow")(other, self)

    def __matmul__(self, other):
        return _operator("matmul")(self, other)

    def __getitem__(self, index):
        return _operator("getitem")(self, index)

    @property
    def T(self):
        return _operator("transpose")(self, -2, -1)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _operator("reshape")(self, shape)

    def view(self, *shape):
        return self.reshape(*shape)

    def transpose(self, dim0: int, dim1: int):
        return _operator("transpose")(self, dim0, dim1)

    def permute(self, *dims):
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return _operator("permute")(self, dims)

    def sum(self, dim=None, keepdim: bool = False):
        return _operator("sum")(self, dim, keepdim)

    def mean(self, dim=None, keepdim: bool = False):
        return _operator("mean")(self, dim, keepdim)

    def to(self, dtype: torch.dtype):
        return _operator("to")(self, dtype)

    def float(self):
        return self.to(torch.float32)

    def double(self):
        return self.to(torch.float64)

    def half(self):
        return self.to(torch.float16)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def long(self):
        return self.to(torch.int64)

    def int(self):
        return self.to(torch.int32)

    def bool(self):
        return self.to(torch.bool)


_OPERATORS: dict[str, Callable] = {}


def bind_operators(**functions: Callable) -> None:
    """Give symbolic tensors their operators (``x + y`` -> ``functions["add"](x, y)``, ...);
    ``teeny.ops`` calls this once with the functional ops."""
    _OPERATORS.update(functions)


def _operator(name: str) -> Callable:
    fn = _OPERATORS.get(name)
    if fn is None:
        raise GraphError(f"tensor operator {name!r} is not bound: import teeny.ops (the op families) first")
    return fn


def graph_of(*args: Any) -> Graph:
    """The graph that the symbolic tensors among ``args`` belong to."""
    for a in args:
        if isinstance(a, Tensor):
            return a.graph
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    return b.graph
    raise GraphError("no teeny Tensor among the arguments: trace with symbolic tensors from a Graph")


def trace_function(
    fn: Callable[..., Tensor],
    args: tuple,
    kwargs: dict | None = None,
    requires_grad: Callable[[int, torch.Tensor], bool] | None = None,
) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Trace ``fn`` with a graph input for every tensor in ``args`` (nested lists too);
    other arguments pass through. Float tensors require a gradient unless ``requires_grad``
    says otherwise. Returns the graph (with ``fn``'s result as output) and the input feed."""
    graph = Graph(getattr(fn, "__name__", "fn"))
    feed: dict[str, torch.Tensor] = {}
    counter = [0]

    def symbolic(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            index = counter[0]
            counter[0] += 1
            name = f"arg{index}"
            wants = a.is_floating_point() and (requires_grad(index, a) if requires_grad else True)
            feed[name] = a
            return graph.input(name, tuple(a.shape), a.dtype, requires_grad=wants)
        if isinstance(a, (list, tuple)):
            return type(a)(symbolic(b) for b in a)
        return a

    out = fn(*[symbolic(a) for a in args], **{k: symbolic(v) for k, v in (kwargs or {}).items()})
    outs = out if isinstance(out, (tuple, list)) else (out,)
    graph.output(*outs)
    return graph, feed
