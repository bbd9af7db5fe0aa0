"""``read_master_weights``: under mixed precision (``fusions.mixed_precision``) each float32
weight (master weight) a linear reads is cast to half precision by a node of its own, whose backward casts dW
back: per weight a launch each way, and dW written in half precision, read and written again in
float32. This rewrite makes the cast part of the linear (``MasterWeightLinearOp``): its
forward casts W into the half copy that the product reads (and that dX reads, kept or cast
again), the bias is read in float32 as it is, and the backward's dW product writes the float32
gradient itself, db in its epilogue: per weight one launch fewer and a half-precision dW
neither written nor read, rounded once from the float32 sums.
"""

from __future__ import annotations

import torch

from ..core.common import sum_to_shape
from ..core.graph import Graph, Node, Value
from ..core.runtime import OpContext
from ..ops.cast import CastOp, cast_forward, cast_launch
from ..ops.products.ops import LinearOp, ProductOp, grad_input_launches, row_stride_of
from .pipeline import Rebuild, RewriteFn, readers
from .transposed_weights import TransposedWeightLinearOp

HALF = (torch.bfloat16, torch.float16)


class MasterWeightLinearOp(ProductOp):
    """``linear`` (``LinearOp``, or Conv1D's ``TransposedWeightLinearOp``) of x and a weight (and
    bias) kept in a wider float dtype (float32 master weights of a half-precision program),
    computed in x's dtype:

        W_h = W.to(x.dtype)        y = x W_h^T + b        dW = dY^T x (in W's dtype)        dX = dY W_h

    ``recast``: the backward casts W again for dX (``lower(recompute=True)``) instead of the
    forward keeping W_h. The bias may be of W's dtype or x's (the kernels convert as they load).
    A weight of x's own dtype is allowed, the cast then a copy (the float64 gradcheck)."""

    name = "linear"
    n_activation_inputs = 1
    mixed_float_inputs = True
    grad_over_input = True
    grad_accumulates = True
    strided_grad_output = True  # dY read through its row stride (as LinearOp)

    def __init__(self, linear: LinearOp, recast: bool):
        super().__init__()
        self.linear, self.recast, self.has_bias = linear, recast, linear.has_bias
        self.saves_inputs = (0, 1) if recast else (0,)  # x for dW; W to cast again (held anyway: a leaf)

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_dtypes[0], input_dtypes[1]
        wider = x.is_floating_point and w in (torch.float32, torch.float64) and w.itemsize >= x.itemsize
        if not wider or any(d not in (x, w) for d in input_dtypes[2:]):
            raise TypeError(
                f"linear of master weights: float32 or float64 weights as wide as x or wider, got {input_dtypes}"
            )
        self.linear.check_inputs(input_shapes, [x] * len(input_dtypes))

    def output_shape(self, input_shapes):
        return self.linear.output_shape(input_shapes)

    def flops(self, input_shapes, grad_mask):
        return self.linear.flops(input_shapes, grad_mask)

    def extra_outputs(self, input_shapes, dtype):
        return {} if self.recast else {"weight": (tuple(input_shapes[1]), dtype)}

    def backward_kernels(self):
        return (*super().backward_kernels(), cast_forward)  # the cast again, when ``recast``

    def _half_weight(self, ctx: OpContext) -> tuple[list, object]:
        """(launches, W_h): the forward's kept copy, or W cast again into a new buffer."""
        if not self.recast and ctx.phase == "backward":
            return [], ctx.saved["weight"]
        half = ctx.saved["weight"] if not self.recast else ctx.empty(ctx.input_shapes[1], ctx.dtype)
        return [cast_launch(cast_forward, ctx.params[0], half)], half

    def forward_launches(self, ctx):
        launches, w = self._half_weight(ctx)
        bias = ctx.params[1] if self.has_bias else None
        p = self.linear.products(ctx.input_shapes, row_stride_of(ctx.output))["forward"]
        return launches + self.product(ctx, "forward", p, x=ctx.inputs[0], y=w, z=ctx.output, bias=bias)

    def backward_launches(self, ctx):
        go, (x,) = ctx.grad_output, ctx.inputs
        products = self.linear.products(ctx.input_shapes, row_stride_of(go))
        (dx,) = ctx.grad_inputs
        dw = ctx.grad_params[0]
        db = ctx.grad_params[1] if self.has_bias else None
        launches = []
        if dw is not None:  # float32 dW (and db, dY's column sums, in its epilogue) from the product's sums
            launches += self.product(ctx, "grad_weight", products["grad_weight"], x=go, y=x, z=dw, row_sums=db)
        elif db is not None:
            launches += sum_to_shape(ctx, go, ctx.output_shape, db, strides=go.stride())
        if dx is not None:
            more, w = self._half_weight(ctx)
            launches += more + grad_input_launches(self, ctx, products["grad_input"], w, dx)
        return launches


def _float32_leaf_cast(value: Value, read_by, kept: set[int]) -> Node | None:
    """The cast when ``value`` is a half-precision cast of a float32 parameter or input read by
    one node only (and no output): the copy mixed precision made for that node."""
    cast = value.producer
    if cast is None or type(cast.op) is not CastOp or value.dtype not in HALF or value.id in kept:
        return None
    source = cast.inputs[0]
    if source.kind not in ("param", "input") or source.dtype != torch.float32 or len(read_by[value.id]) != 1:
        return None
    return cast


def read_master_weights(recast: bool) -> RewriteFn:
    """The rewrite (see the module docstring); ``recast``: the backward casts each weight again
    (``lower(recompute=True)``: no half copy kept)."""

    def rewrite(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
        if not training:  # no dW to write: the cast nodes launch what the op would
            return graph, outputs, ""
        read_by, kept = readers(graph), {v.id for v in outputs}
        matches: dict[int, tuple[Node, Node | None]] = {}  # linear node id -> (W's cast, b's cast or None)
        for node in graph.nodes:
            if type(node.op) not in (LinearOp, TransposedWeightLinearOp) or node.inputs[0].dtype not in HALF:
                continue
            weight = _float32_leaf_cast(node.inputs[1], read_by, kept)
            if weight is not None:
                bias = _float32_leaf_cast(node.inputs[2], read_by, kept) if node.op.has_bias else None
                matches[node.id] = (weight, bias)
        if not matches:
            return graph, outputs, ""
        skipped = {cast.id for casts in matches.values() for cast in casts if cast is not None}
        rebuild = Rebuild(graph)

        def fuse(node: Node, casts: tuple[Node, Node | None]) -> None:
            weight, bias = casts
            inputs = [rebuild[node.inputs[0]], rebuild[weight.inputs[0]]]
            if node.op.has_bias:
                inputs.append(rebuild[bias.inputs[0]] if bias is not None else rebuild[node.inputs[2]])
            op = MasterWeightLinearOp(node.op, recast)
            rebuild.new[node.output.id] = rebuild.apply(op, inputs, node.name)

        rebuild.replace(skipped, matches, fuse)
        graph, outputs = rebuild.finish(outputs)
        n, biases = len(matches), sum(bias is not None for _, bias in matches.values())
        return (
            graph,
            outputs,
            f"linears casting their float32 weights themselves: {n} ({biases} biases read in float32), "
            f"{n + biases} casts fewer per backward (dW and db written in float32 by the products)"
            + (f", {biases} fewer per forward" if biases else ""),
        )

    rewrite.__name__ = "read_master_weights"
    return rewrite
