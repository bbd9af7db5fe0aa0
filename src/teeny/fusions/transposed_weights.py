"""``read_transposed_weights``: linear(x, W.t(), b) of a 2-D W (transformers' Conv1D keeps W as
(in, out)) reads W through strides (``TransposedWeightLinearOp``) instead of copying
its transpose each way; x @ W + b (Conv1D as ``addmm`` exports it: a product, then the bias
added in a launch of its own) becomes the same product with the bias in its epilogue.
"""

from __future__ import annotations

import math

from ..core.graph import Graph, Node, Value
from ..ops.elementwise import ElementwiseOp
from ..ops.products.launches import Product
from ..ops.products.ops import LinearOp, MatmulOp
from ..ops.shape.ops import PermuteOp
from .pipeline import Rebuild, ancestors, mib, nbytes, readers


class TransposedWeightLinearOp(LinearOp):
    """y = x W + b with W stored (in_features, out_features), as transformers' Conv1D and
    torch.addmm keep it (made by ``read_transposed_weights`` from linear(x, W.t())):
    the products read W through strides and write dW in W's layout, so no transpose is copied
    either way. dW is linear's product dY^T X, (out, in), written transposed: its fused row sums
    are db, as in linear. Shapes are checked as those of linear(x, W.t())."""

    def check_inputs(self, input_shapes, input_dtypes):
        w = tuple(input_shapes[1])
        super().check_inputs([input_shapes[0], w[::-1], *input_shapes[2:]], input_dtypes)

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[1][1],)

    @staticmethod
    def products(input_shapes, y_row_stride: int | None = None) -> dict[str, Product]:
        """Y = X W and dX = dY W^T over the rows of the flattened x (W is (in, out)), and dW^T =
        dY^T X, (out, in), stored transposed into dW's (in, out)."""
        x, w = input_shapes[0], input_shapes[1]
        rows, fin, fout = math.prod(x[:-1]), w[0], w[1]
        ys = y_row_stride or fout
        return {
            "forward": Product(rows, fout, fin, (fin, 1), (fout, 1), (ys, 1), [], []),
            "grad_input": Product(rows, fin, fout, (ys, 1), (1, fout), (fin, 1), [], []),
            "grad_weight": Product(fout, fin, rows, (1, ys), (fin, 1), (1, fout), [], []),
        }


def _matmul_plus_bias(node: Node, read_by, kept: set[int]) -> tuple[Node, Value] | None:
    """(the product, b) when ``node`` is x @ W + b (either order) of a 2-D W and a 1-D b of W's
    width and dtype, the product read by this sum alone and no output; else None."""
    op = node.op
    if not (isinstance(op, ElementwiseOp) and op.name == "add" and op.alpha == 1 and len(node.inputs) == 2):
        return None
    for product, bias in (node.inputs, node.inputs[::-1]):
        matmul = product.producer
        if matmul is None or type(matmul.op) is not MatmulOp or product.id in kept:
            continue
        x, weight = matmul.inputs
        if len(weight.shape) != 2 or len(x.shape) < 2 or len(read_by[product.id]) != 1:
            continue
        if tuple(bias.shape) == (weight.shape[1],) and bias.dtype == weight.dtype == x.dtype:
            return matmul, bias
    return None


def read_transposed_weights(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """linear(x, W.t(), b) of a 2-D W whose transpose nothing else reads becomes one product
    that reads W as it is stored, (in, out), through strides (``TransposedWeightLinearOp``;
    transformers' Conv1D, x @ W + b): per linear the transpose's copy fewer forwards, and the
    copy of dW^T back into W's layout fewer backwards (dW^T is written transposed, its bias
    gradient fused as in linear). x @ W + b of a 2-D W and a 1-D b (``addmm``, as Conv1D
    exports) becomes the same product with b added in its epilogue: per layer the bias's
    pass over the output fewer forwards, and its row sums fewer backwards."""
    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    matches: dict[int, list[Value]] = {}  # linear or sum node id -> the product's x, W (in, out)[, b]
    skipped: set[int] = set()
    for node in graph.nodes:
        if node.output.id not in needed:
            continue
        with_bias = _matmul_plus_bias(node, read_by, kept)
        if with_bias is not None:
            matmul, bias = with_bias
            matches[node.id] = [*matmul.inputs, bias]
            skipped.add(matmul.id)
            continue
        if type(node.op) is not LinearOp:
            continue
        weight = node.inputs[1]
        transpose = weight.producer
        if transpose is None or type(transpose.op) is not PermuteOp or transpose.op.dims != (1, 0):
            continue
        if weight.id in kept or len(read_by[weight.id]) != 1:
            continue
        matches[node.id] = [node.inputs[0], transpose.inputs[0], *node.inputs[2:]]
        skipped.add(transpose.id)
    if not matches:
        return graph, outputs, ""
    rebuild = Rebuild(graph)

    def fuse(node: Node, inputs: list[Value]) -> None:
        op = TransposedWeightLinearOp(has_bias=len(inputs) == 3)
        rebuild.new[node.output.id] = rebuild.apply(op, [rebuild[v] for v in inputs], node.name)

    rebuild.replace(skipped, matches, fuse)
    transposed = [graph.nodes[i] for i in matches if type(graph.nodes[i].op) is LinearOp]
    copies = sum(nbytes(node.inputs[1]) for node in transposed)
    sums = [graph.nodes[i] for i in matches if type(graph.nodes[i].op) is not LinearOp]
    passes = sum(nbytes(node.output) for node in sums)
    graph, outputs = rebuild.finish(outputs)
    more = ", as many backwards" if training else ""
    parts = []
    if transposed:
        parts.append(
            f"linear of a transposed weight read in place: {len(transposed)}, {len(transposed)} transposes "
            f"({mib(copies)} of copies) fewer per forward{more}"
        )
    if sums:
        parts.append(
            f"x @ W + b as one product: {len(sums)}, {len(sums)} bias passes ({mib(passes)} of outputs) "
            f"fewer per forward{more}"
        )
    return graph, outputs, "; ".join(parts)
