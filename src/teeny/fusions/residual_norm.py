"""``fuse_residual_norm``: y = layer_norm(a + b) or rms_norm(a + b) where the sum is also read
downstream (the residual stream of a pre-norm transformer) becomes one norm launch that reads
a and b, writes the sum and y (``AddNormOp``, below); the add keeps its node, and its backward,
but launches nothing (``TakenInOp``). An exact upcast of b read by the add alone (a bf16
sublayer's output added to a float32 stream under autocast) is taken in too: the norm reads b
in its own dtype, and its backward writes b's gradient beside the sum's (the sum's, rounded to b's
dtype: what the upcast's backward would cast), so the upcast launches nothing either way. Per
residual: one launch and one full read fewer forwards (and, with an upcast, one launch and a read
of the float32 gradient fewer backwards). The backward adds the norm's dx to the gradient the
residual path left (``RuntimeOp.grad_accumulates``): no accumulate launch sums the two.
"""

from __future__ import annotations

import copy
from collections import Counter

from ..core.graph import Graph, Node, Value
from ..core.runtime import RuntimeOp
from ..ops.cast import CastOp
from ..ops.elementwise import ElementwiseOp
from ..ops.norm.ops import LayerNormOp
from .pipeline import Rebuild, ancestors, mib, nbytes, readers


def repeats_over_rows(shape, full_shape) -> bool:
    """Whether a tensor of ``shape`` laid over ``full_shape`` repeats along its leading dims
    (element i of the full tensor reads element i % numel: (T, d) under (B, T, d))."""
    shape = list(shape)
    while shape and shape[0] == 1:
        shape.pop(0)
    return len(shape) <= len(full_shape) and tuple(shape) == tuple(full_shape[len(full_shape) - len(shape) :])


class AddNormOp(LayerNormOp):
    """layer_norm / rms_norm of s = x + residual where s is also read downstream (a residual
    stream; made by ``teeny.fusions.fuse_residual_norm``). Inputs: s, weight and bias (when
    given), x, residual; s is the output of the add's ``TakenInOp``, which launches nothing:
    this forward reads x and residual once, writes their sum into s and normalises it (one read
    of s fewer than add + norm, and one launch). residual is x-shaped or repeats over x's leading
    dims; it may be of a narrower float dtype than s (an upcast the add read, taken in: the sum
    is the same). Backward: the norm's, on s (x and residual get their gradients through the add);
    ``writing_residual_grad()``: the residual's too, a copy of s's whole gradient in its dtype (the
    add's upcast of it then passes none: ``TakenInOp(grad_by_norm=True)``)."""

    mixed_float_inputs = True

    def __init__(self, norm: LayerNormOp):
        super().__init__(
            norm.normalized_shape,
            eps=norm.eps,
            has_weight=norm.has_weight,
            has_bias=norm.has_bias,
            centred=norm.centred,
            out_dtype=norm.out_dtype,
            weight_offset=norm.weight_offset,
        )
        self.name = f"add_{norm.name}"

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (self.has_weight + self.has_bias) + [None, None]

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        s, x, residual = (tuple(input_shapes[i]) for i in (0, -2, -1))
        if x != s or not repeats_over_rows(residual, s):
            raise ValueError(f"the sum {s} must have x's shape {x}, and the residual {residual} must repeat over it")

    def writing_residual_grad(self) -> AddNormOp:
        """This op, its backward also writing the residual's gradient: ds (the norm's dx plus the
        gradient waiting for s, which the executor must hand over: ``grad_copies_input0``) in the
        residual's dtype. For a residual of s's shape whose upcast, read by the add alone, passes
        it no gradient of its own."""
        op = copy.copy(self)
        residual = 2 + self.has_weight + self.has_bias
        op.grad_copies_input0 = residual
        op.differentiable_inputs = (*self.differentiable_inputs, residual)
        return op

    def grad_copy(self, ctx):
        return ctx.grad_params[-1] if self.grad_copies_input0 is not None else None

    def sources(self, ctx):
        s, (x, residual) = ctx.inputs[0], ctx.params[-2:]
        return dict(
            x_ptr=x,
            residual_ptr=residual,
            sum_ptr=s,
            residual_numel=max(residual.numel(), 1),
            RESIDUAL_REPEATS=residual.numel() != s.numel(),
        )


class TakenInOp(RuntimeOp):
    """A node whose forward ``AddNormOp`` takes in: the residual add s = a + b (the norm writes
    s), or the exact upcast of the residual that the norm reads in its own dtype (nothing reads
    the upcast value forwards). No launch forwards; backward, the op's own, or with
    ``grad_by_norm`` (an upcast whose source's gradient the norm writes:
    ``AddNormOp.writing_residual_grad``) none: no gradient passes through it."""

    def __init__(self, op: RuntimeOp, grad_by_norm: bool = False):
        self.op = op
        self.stops_gradient = grad_by_norm
        self.name, self.kernel = f"{op.name}_in_norm", op.kernel
        self.n_activation_inputs, self.differentiable_inputs = op.n_activation_inputs, op.differentiable_inputs
        self.saves_inputs, self.saves_output = op.saves_inputs, op.saves_output
        self.strided_grad_output = op.strided_grad_output

    def output_shape(self, input_shapes):
        return self.op.output_shape(input_shapes)

    def output_dtype(self, input_dtypes):
        return self.op.output_dtype(input_dtypes)

    def check_inputs(self, input_shapes, input_dtypes):
        self.op.check_inputs(input_shapes, input_dtypes)

    def has_backward(self):
        return self.op.has_backward()

    def forward_launches(self, ctx):
        return []  # AddNormOp writes the sum; the upcast is read in its source's dtype

    def backward_launches(self, ctx):
        return self.op.backward_launches(ctx)


def _residual_add(node: Node) -> tuple[Value, Value] | None:
    """(x, residual) when ``node`` is a + b of two float tensors, one of the sum's shape and one
    that repeats over its leading dims; else None."""
    op, out = node.op, node.output
    if not (isinstance(op, ElementwiseOp) and op.name == "add" and op.alpha == 1 and len(node.inputs) == 2):
        return None
    if not out.dtype.is_floating_point:
        return None
    a, b = node.inputs
    for x, residual in ((a, b), (b, a)):
        if x.shape == out.shape and x.dtype == out.dtype and repeats_over_rows(residual.shape, out.shape):
            return x, residual
    return None


def _taken_in_upcast(residual: Value, add: Node, read_by, outputs: list[Value]) -> Node | None:
    """The exact float upcast that made ``residual`` when ``add`` alone reads it, it has the
    sum's shape and is no output: the fused norm reads its source in its own dtype instead."""
    cast = residual.producer
    if cast is None or type(cast.op) is not CastOp or any(v.id == residual.id for v in outputs):
        return None
    if residual.shape != add.output.shape:
        return None
    source, target = cast.inputs[0].dtype, cast.op.dtype
    if not (source.is_floating_point and target.is_floating_point and target.itemsize > source.itemsize):
        return None
    readers_of_residual = read_by[residual.id]
    return cast if len(readers_of_residual) == 1 and readers_of_residual[0][0] is add else None


def fuse_residual_norm(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """layer_norm / rms_norm of a residual sum a + b becomes one ``AddNormOp`` launch that also
    writes the sum (see the module docstring). The norm moves up to just after the add, so its
    weight and bias must exist there (they are parameters in a model)."""
    needed = ancestors(outputs)
    read_by = readers(graph)
    position = {node.id: i for i, node in enumerate(graph.nodes)}
    pairs: dict[int, Node | None] = {}  # add node id -> the norm node that writes its sum; upcast id -> None
    upcasts: dict[int, Node] = {}  # add node id -> the upcast of its residual, taken in
    operands: dict[int, tuple[Value, Value]] = {}  # add node id -> (x, residual)
    for node in graph.nodes:
        if node.output.id not in needed or _residual_add(node) is None:
            continue
        for reader, index in read_by[node.output.id]:
            if (
                index == 0
                and type(reader.op) is LayerNormOp
                and reader.output.id in needed
                and all(v.producer is None or position[v.producer.id] < position[node.id] for v in reader.inputs[1:])
            ):
                pairs[node.id] = reader
                x, residual = operands[node.id] = _residual_add(node)
                cast = _taken_in_upcast(residual, node, read_by, outputs)
                if cast is None and (residual.shape, residual.dtype) == (x.shape, x.dtype):  # the other way round
                    cast = _taken_in_upcast(x, node, read_by, outputs)
                    operands[node.id] = (residual, x) if cast is not None else (x, residual)
                if cast is not None:
                    upcasts[node.id] = cast
                    pairs[cast.id] = None
                break
    if not pairs:
        return graph, outputs, ""
    rebuild = Rebuild(graph)

    def fuse(node: Node, norm: Node | None) -> None:
        if norm is None:  # an upcast the fused norm reads through, and writes the gradient of
            upcast = TakenInOp(node.op, grad_by_norm=True)
            rebuild.new[node.output.id] = rebuild.apply(upcast, [rebuild[node.inputs[0]]], node.name)
            return
        x, residual = operands[node.id]
        s = rebuild.apply(TakenInOp(node.op), [rebuild[v] for v in node.inputs], node.name)
        rebuild.new[node.output.id] = s
        affine = [rebuild[v] for v in norm.inputs[1:]]
        fused = AddNormOp(norm.op)
        read = residual
        if node.id in upcasts:
            read, fused = upcasts[node.id].inputs[0], fused.writing_residual_grad()
        rebuild.new[norm.output.id] = rebuild.apply(fused, [s, *affine, rebuild[x], rebuild[read]], norm.name)

    norms = [norm for norm in pairs.values() if norm is not None]
    rebuild.replace({norm.id for norm in norms}, pairs, fuse)
    sums = sum(nbytes(norm.inputs[0]) for norm in norms)
    graph, outputs = rebuild.finish(outputs)
    kinds = Counter(norm.op.name for norm in norms)
    fused = ", ".join(f"residual add + {name} in one launch: {n}" for name, n in sorted(kinds.items()))
    taken = f"; {len(upcasts)} upcasts of the residual read in place" if upcasts else ""
    return graph, outputs, f"{fused} ({len(norms)} launches and {mib(sums)} of reads fewer per forward{taken})"
