"""``read_transposed_weights``: linear(x, W.t(), b) of a 2-D W (transformers' Conv1D keeps W as
(in, out)) reads W through strides (``TransposedWeightLinearOp``) instead of copying
its transpose each way.
"""

from __future__ import annotations

import math

from ..core.graph import Graph, Node, Value
from ..ops.products.launches import Product
from ..ops.products.ops import LinearOp
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


def read_transposed_weights(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """linear(x, W.t(), b) of a 2-D W whose transpose nothing else reads becomes one product
    that reads W as it is stored, (in, out), through strides (``TransposedWeightLinearOp``;
    transformers' Conv1D, x @ W + b): per linear the transpose's copy fewer forwards, and the
    copy of dW^T back into W's layout fewer backwards (dW^T is written transposed, its bias
    gradient fused as in linear)."""
    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    matches: dict[int, Value] = {}  # linear node id -> the untransposed W
    for node in graph.nodes:
        if type(node.op) is not LinearOp or node.output.id not in needed:
            continue
        weight = node.inputs[1]
        transpose = weight.producer
        if transpose is None or type(transpose.op) is not PermuteOp or transpose.op.dims != (1, 0):
            continue
        if weight.id in kept or len(read_by[weight.id]) != 1:
            continue
        matches[node.id] = transpose.inputs[0]
    if not matches:
        return graph, outputs, ""
    skipped = {graph.nodes[node_id].inputs[1].producer.id for node_id in matches}
    rebuild = Rebuild(graph)

    def fuse(node: Node, weight: Value) -> None:
        inputs = [rebuild[node.inputs[0]], rebuild[weight], *(rebuild[v] for v in node.inputs[2:])]
        rebuild.new[node.output.id] = rebuild.apply(TransposedWeightLinearOp(node.op.has_bias), inputs, node.name)

    rebuild.replace(skipped, matches, fuse)
    copies = sum(nbytes(w) for w in matches.values())
    graph, outputs = rebuild.finish(outputs)
    more = ", as many backwards" if training else ""
    return (
        graph,
        outputs,
        f"linear of a transposed weight read in place: {len(matches)}, {len(matches)} transposes "
        f"({mib(copies)} of copies) fewer per forward{more}",
    )
