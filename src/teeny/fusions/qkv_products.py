"""``fuse_qkv_products``: the q, k and v projections of an
attention, three linears of one input, become one product (``SharedInputLinearOp``)
whose (batch, length, 3 * heads * dim) output the attention reads as it is
(``AttentionOp(layout="packed")``), and whose gradient the attention's backward writes whole:
per layer two products fewer forwards, two products and the two sums of dX's three parts
fewer backwards. Where the weights (and biases) are parameters read by these linears only,
of one dtype, trainable alike and each a multiple of 16 bytes, the executor lays them out side
by side in its arena (``RuntimeOp.adjacent_params``) and the product reads them and writes
their gradients in place; otherwise it takes six small copies each way (stacking the weights
and biases, and their gradients out). (A graph node has one output, so the attention must
read the stacked tensor itself: through views, each view's backward would write a
stacked-sized gradient to sum.)
"""

from __future__ import annotations

import itertools
import math

from ..core.common import side_by_side, sum_to_shape
from ..core.graph import Graph, Node, Value
from ..core.runtime import ARENA_ALIGN
from ..ops.attention.ops import AttentionOp
from ..ops.products.ops import LinearOp, ProductOp, product_flops
from ..ops.shape.launch import copy_launch
from ..ops.shape.ops import ViewOp
from .pipeline import Rebuild, ancestors, nbytes, readers


class SharedInputLinearOp(ProductOp):
    """linear(x, W_i, b_i) of one input by several weights as one product,
    y = x [W_1; W_2; ...]^T + [b_1, b_2, ...], the parts side by side in the last dim (the q, k
    and v projections of an attention: ``fuse_qkv_products``). Inputs x, W_1[, b_1],
    W_2[, b_2], ... The backward computes dW and db of the stacked ones in one product (db in
    its epilogue).

    ``adjacent``: the weights are parameters the executor lays out side by side in its arena
    (and the biases), as ``adjacent_params`` asks, so the stacked weight and bias are views of
    them and the gradients are written straight into side-by-side gradient buffers: no copies.
    Otherwise the forward copies the weights into one matrix, which it keeps for dX, and the
    biases into one vector, and the backward copies each part's rows out to its gradient."""

    name = "linear"
    n_activation_inputs = 1
    saves_inputs = (0,)  # x for dW; the stacked weight is read in place or is an extra output
    grad_over_input = True

    def __init__(self, parts: int, has_bias: bool, adjacent: bool = False):
        super().__init__()
        self.parts, self.has_bias, self.adjacent = parts, has_bias, adjacent
        self.stride = 2 if has_bias else 1  # inputs per part
        if adjacent:  # input positions: the weights side by side, then the biases
            weights = tuple(range(1, 1 + parts * self.stride, self.stride))
            self.adjacent_params = (weights, tuple(i + 1 for i in weights)) if has_bias else (weights,)
            self.saves_inputs = (0, *weights)  # parameters: held anyway, kept for free

    def _split(self, params) -> tuple[list, list]:
        """(weights, biases) of the parts from the op's parameters (or their gradients)."""
        params = list(params)
        return params[:: self.stride], params[1 :: self.stride] if self.has_bias else [None] * self.parts

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != 1 + self.parts * self.stride:
            raise ValueError(f"linear of {self.parts} weights: expected {1 + self.parts * self.stride} inputs")
        x = input_shapes[0]
        weights, biases = self._split(input_shapes[1:])
        for w, b in zip(weights, biases):
            LinearOp(self.has_bias).check_inputs([x, w] + ([b] if self.has_bias else []), input_dtypes[:3])
        if len(set(input_dtypes)) != 1:
            raise TypeError(f"linear of {self.parts} weights: one dtype for all inputs, got {set(input_dtypes)}")

    def _rows(self, input_shapes) -> list[int]:
        return [w[0] for w in self._split(input_shapes[1:])[0]]

    def flops(self, input_shapes, grad_mask):
        rows, fin = math.prod(input_shapes[0][:-1]), input_shapes[0][-1]
        outs = self._rows(input_shapes)
        forward, grad_input = product_flops(1, rows, sum(outs), fin, bool(grad_mask[0]))
        wants_weight = grad_mask[1 :: self.stride]
        grad_weights = sum(2 * rows * out * fin for out, g in zip(outs, wants_weight) if g)
        return forward, grad_input + grad_weights

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (sum(self._rows(input_shapes)),)

    def extra_outputs(self, input_shapes, dtype):
        if self.adjacent:
            return {}
        return {"weight": ((sum(self._rows(input_shapes)), input_shapes[0][-1]), dtype)}

    def _row_ranges(self, ctx) -> list[tuple[int, int]]:
        """Each part's rows in the stacked weight: (first, end)."""
        ends = list(itertools.accumulate(self._rows(ctx.input_shapes)))
        return list(zip([0] + ends[:-1], ends))

    def forward_launches(self, ctx):
        weights, biases = self._split(ctx.params)
        if self.adjacent:  # views of the parameters, side by side in the arena
            stacked = side_by_side(ctx, weights, "parts' weights")
            bias = side_by_side(ctx, biases, "parts' biases") if self.has_bias else None
            launches = []
        else:
            stacked = ctx.saved["weight"]
            rows = self._row_ranges(ctx)
            launches = [copy_launch(w, w, stacked, stacked[a:b]) for w, (a, b) in zip(weights, rows)]
            bias = None
            if self.has_bias:
                bias = ctx.empty((stacked.shape[0],), ctx.dtype)
                launches += [copy_launch(b_, b_, bias, bias[a:b]) for b_, (a, b) in zip(biases, rows)]
        shapes = [ctx.input_shapes[0], tuple(stacked.shape)]
        product = LinearOp.products(shapes)["forward"]
        return launches + self.product(ctx, "forward", product, x=ctx.inputs[0], y=stacked, z=ctx.output, bias=bias)

    def backward_launches(self, ctx):
        x, go = ctx.inputs[0], ctx.grad_output
        if self.adjacent:
            stacked = side_by_side(ctx, self._split(ctx.params)[0], "parts' weights")
        else:
            stacked = ctx.saved["weight"]
        products = LinearOp.products([ctx.input_shapes[0], tuple(stacked.shape)])
        (dx,) = ctx.grad_inputs
        dws, dbs = self._split(ctx.grad_params)
        launches = []
        want_w, want_b = any(g is not None for g in dws), any(g is not None for g in dbs)
        # an adjacent op's gradient buffers lie side by side (the executor hands them out so): written in place
        in_place = self.adjacent and all(g is not None for g in ([*dws, *dbs] if self.has_bias else dws))
        if in_place:
            dw = side_by_side(ctx, dws, "parts' weight gradients")
            db = side_by_side(ctx, dbs, "parts' bias gradients") if self.has_bias else None
        else:
            dw = ctx.empty(tuple(stacked.shape), ctx.dtype) if want_w else None
            db = ctx.empty((stacked.shape[0],), ctx.dtype) if want_b else None
        if dw is not None:  # db (dY's column sums) in dW's epilogue
            launches += self.product(ctx, "grad_weight", products["grad_weight"], x=go, y=x, z=dw, row_sums=db)
        elif db is not None:
            launches += sum_to_shape(ctx, go, ctx.output_shape, db)
        if dx is not None:  # after dW, which reads x: dX may be written over x (grad_over_input)
            launches += self.product(ctx, "grad_input", products["grad_input"], x=go, y=stacked, z=dx)
        if not in_place:
            for (a, b), gw, gb in zip(self._row_ranges(ctx), dws, dbs):
                if gw is not None:
                    launches.append(copy_launch(dw, dw[a:b], gw, gw))
                if gb is not None:
                    launches.append(copy_launch(db, db[a:b], gb, gb))
        return launches


def _projection(value: Value, read_by, kept: set[int]) -> Node | None:
    """The linear node when ``value`` is reshape(linear(x, W[, b])) splitting the last dim into
    (heads, dim), the linear and the reshape each read once and neither an output."""
    view = value.producer
    if view is None or type(view.op) is not ViewOp or value.id in kept or len(read_by[value.id]) != 1:
        return None
    projected = view.inputs[0]
    linear = projected.producer
    if linear is None or type(linear.op) is not LinearOp or projected.id in kept or len(read_by[projected.id]) != 1:
        return None
    rows = math.prod(projected.shape[:-1])
    if (
        len(value.shape) != 4
        or value.shape[2] * value.shape[3] != projected.shape[-1]
        or math.prod(value.shape[:2]) != rows
    ):
        return None
    return linear


def _params_side_by_side(linears: list[Node], read_by, kept: set[int]) -> bool:
    """Whether the executor can lay out the linears' weights side by side in its arena, and
    their biases (``RuntimeOp.adjacent_params``): parameters, each read by its own linear only
    and no output, of one dtype, trainable alike, each a multiple of 16 bytes (so that no padding
    comes between them)."""
    for position in range(1, len(linears[0].inputs)):
        values = [linear.inputs[position] for linear in linears]
        if len({v.id for v in values}) != len(values) or len({(v.dtype, v.requires_grad) for v in values}) != 1:
            return False
        for v in values:
            if v.kind != "param" or v.id in kept or len(read_by[v.id]) != 1 or nbytes(v) % ARENA_ALIGN:
                return False
    return True


def fuse_qkv_products(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """An attention in the (batch, length, heads, dim) layout whose q, k and v are reshaped
    linears of one input (same heads and head dim, all with a bias or none) reads them from one
    product instead (see the module docstring). The product runs just before the attention."""
    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    matches: dict[int, list[Node]] = {}  # attention node id -> its q, k and v linears
    for node in graph.nodes:
        if type(node.op) is not AttentionOp or node.op.layout != "blhd" or node.output.id not in needed:
            continue
        linears = [_projection(v, read_by, kept) for v in node.inputs[:3]]
        if any(linear is None for linear in linears) or len({v.shape for v in node.inputs[:3]}) != 1:
            continue
        if (
            len({linear.inputs[0].id for linear in linears}) != 1
            or len({linear.op.has_bias for linear in linears}) != 1
        ):
            continue
        matches[node.id] = linears
    if not matches:
        return graph, outputs, ""
    skipped = {v.producer.id for node in graph.nodes if node.id in matches for v in node.inputs[:3]}
    skipped |= {linear.id for linears in matches.values() for linear in linears}
    adjacent = {node_id: _params_side_by_side(linears, read_by, kept) for node_id, linears in matches.items()}
    rebuild = Rebuild(graph)

    def fuse(node: Node, linears: list[Node]) -> None:
        op = node.op
        b, length, heads, dim = node.inputs[0].shape
        inputs = [rebuild[linears[0].inputs[0]]] + [rebuild[v] for linear in linears for v in linear.inputs[1:]]
        product = SharedInputLinearOp(3, linears[0].op.has_bias, adjacent[node.id])
        stacked = rebuild.apply(product, inputs, node.name + "_qkv")
        packed = rebuild.apply(ViewOp("reshape", (b, length, 3 * heads * dim)), [stacked], node.name + "_qkv_rows")
        attention = op.relaid("packed", heads=heads, enable_gqa=False)
        rebuild.new[node.output.id] = rebuild.apply(
            attention, [packed] + [rebuild[v] for v in node.inputs[3:]], node.name
        )

    rebuild.replace(skipped, matches, fuse)
    graph, outputs = rebuild.finish(outputs)
    n, in_place = len(matches), sum(adjacent.values())
    copies = sum(  # the stacking, each way, where the weights are not read in place
        6 if linears[0].op.has_bias else 3 for node_id, linears in matches.items() if not adjacent[node_id]
    )
    more = f"; {2 * n} products and {2 * n} gradient sums fewer per backward, {copies} copies out" if training else ""
    return (
        graph,
        outputs,
        f"q, k, v projections as one product: {n} ({in_place} reading their weights side by side in place), "
        f"{2 * n} products fewer per forward, {copies} small copies to stack the weights{more}",
    )
