"""``fuse_mlp``: linear, element-wise activation, linear (and longer such chains, the MLP of a transformer
block) become one node (``MLPOp``): the activation runs in the
first product's epilogue, which writes h and f(h), and its derivative in the epilogue of the
product that computes the gradient of f(h), which writes dh = f'(h) * (dZ W) in place of
the gradient of f(h). Per activation: one launch and one read of h fewer forwards; one launch
and a write and read of the gradient of f(h) fewer backwards. (Only between two linears: an
activation whose gradient no product of the same node computes keeps its own launch.) The
persistent product kernel runs its epilogue between two tiles' products, not under them, so
the activation's maths adds to the product's time: on the H200 that cost more than the pass
it saves (GPT-2 small's c_fc with tanh-GELU: 73.6 us, against 30.8 + 17.1 us unfused; its step
17.9 ms unfused, 19.1 fused) or as much (a ReLU MLP; docs/archive/bench-journal.md, version 6).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from ..core.common import sum_to_shape
from ..core.graph import Graph, Node, Value
from ..ops.activation.ops import ActivationOp
from ..ops.products.launches import Epilogue
from ..ops.products.ops import LinearOp, ProductOp, product_flops
from .pipeline import Rebuild, ancestors, mib, nbytes, readers


class MLPOp(ProductOp):
    """linear, activation, linear (, activation, linear ...) as one node (``fuse_mlp``):

        h_i = y_{i-1} W_i^T + b_i,   y_i = f_i(h_i)   (y_0 = x; the last layer has no f)

    Each activation runs in the epilogue of the product before it, which also writes h_i for the
    backward; backwards, f_i' runs in the epilogue of the product that computes the gradient of
    y_i, dh_i = f_i'(h_i) * (dh_{i+1} W_{i+1}): no activation takes a pass of its own either way.
    Inputs x, W_1[, b_1], W_2[, b_2], ...; the extra outputs h_i (training only) and y_i (the
    next layer's input, which its dW reads)."""

    name = "mlp"
    n_activation_inputs = 1
    grad_over_input = True  # x is read by dW_1 only, before dX

    def __init__(self, has_bias: Sequence[bool], activations: Sequence[Any], keep_pre_activations: bool = True):
        super().__init__()
        if len(activations) != len(has_bias) - 1 or not activations:
            raise ValueError(
                f"mlp: {len(has_bias)} layers need {len(has_bias) - 1} activations, got {len(activations)}"
            )
        self.has_bias, self.activations = tuple(has_bias), tuple(activations)
        self.keep_pre_activations = keep_pre_activations  # False when lowered for inference
        self.weight_index = list(itertools.accumulate([1] + [1 + b for b in self.has_bias[:-1]]))
        self.saves_inputs = (0, *self.weight_index)  # x for dW_1, the weights for dX

    def _layers(self, tensors) -> list[tuple[Any, Any]]:
        """(W_i, b_i or None) per layer from the node's inputs after x (or their gradients)."""
        tensors = list(tensors)
        return [(tensors[i - 1], tensors[i] if bias else None) for i, bias in zip(self.weight_index, self.has_bias)]

    def _shapes(self, input_shapes) -> list[tuple[tuple, tuple]]:
        """(input shape, weight shape) per layer."""
        shape, out = tuple(input_shapes[0]), []
        for w, _ in self._layers(input_shapes[1:]):
            out.append((shape, tuple(w)))
            shape = shape[:-1] + (w[0],)
        return out

    def flops(self, input_shapes, grad_mask):
        forward = backward = 0
        gradient_flows = bool(grad_mask[0])  # a dX of layer i is launched when something before it wants one
        for i, (shape, w) in enumerate(self._shapes(input_shapes)):
            one = product_flops(1, math.prod(shape[:-1]), w[0], w[1], 1)[0]
            forward += one
            backward += one * (bool(grad_mask[self.weight_index[i]]) + gradient_flows)
            gradient_flows = gradient_flows or bool(grad_mask[self.weight_index[i]])
        return forward, backward

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != 1 + len(self.has_bias) + sum(self.has_bias):
            raise ValueError(
                f"mlp of {len(self.has_bias)} layers: expected {1 + len(self.has_bias) + sum(self.has_bias)} inputs"
            )
        if len(set(input_dtypes)) != 1:
            raise TypeError(f"mlp: one dtype for all inputs, got {sorted(map(str, set(input_dtypes)))}")
        for (shape, w), (_, b), has_bias in zip(
            self._shapes(input_shapes), self._layers(input_shapes[1:]), self.has_bias
        ):
            LinearOp(has_bias).check_inputs([shape, w] + ([b] if has_bias else []), input_dtypes[:3])

    def output_shape(self, input_shapes):
        shape, w = self._shapes(input_shapes)[-1]
        return shape[:-1] + (w[0],)

    def extra_outputs(self, input_shapes, dtype):
        extras = {}
        for i, (shape, _) in enumerate(self._shapes(input_shapes)[1:]):
            if self.keep_pre_activations:
                extras[f"pre{i}"] = (shape, dtype)
            extras[f"act{i}"] = (shape, dtype)
        return extras

    def forward_launches(self, ctx):
        launches, y = [], ctx.inputs[0]
        shapes = self._shapes(ctx.input_shapes)
        for i, ((w, b), shape) in enumerate(zip(self._layers(ctx.params), shapes)):
            product = LinearOp.products(list(shape))["forward"]
            if i < len(self.activations):
                out = ctx.saved[f"act{i}"]
                epilogue = Epilogue(self.activations[i], ctx.saved.get(f"pre{i}"))
            else:
                out, epilogue = ctx.output, None
            launches += self.product(ctx, f"forward{i}", product, x=y, y=w, z=out, bias=b, epilogue=epilogue)
            y = out
        return launches

    def backward_launches(self, ctx):
        weights = [w for w, _ in self._layers(ctx.params)]
        grads = self._layers(ctx.grad_params)
        (dx,) = ctx.grad_inputs
        shapes = self._shapes(ctx.input_shapes)
        wanted = [dw is not None or db is not None for dw, db in grads]
        launches, g = [], ctx.grad_output  # g: the gradient of layer i's output h_i
        for i in reversed(range(len(weights))):
            products = LinearOp.products(list(shapes[i]))
            y = ctx.inputs[0] if i == 0 else ctx.saved[f"act{i - 1}"]
            dw, db = grads[i]
            if dw is not None:  # db (g's column sums) in dW's epilogue
                launches += self.product(ctx, f"grad_weight{i}", products["grad_weight"], x=g, y=y, z=dw, row_sums=db)
            elif db is not None:
                launches += sum_to_shape(ctx, g, tuple(g.shape), db)
            if i == 0:
                if dx is not None:
                    launches += self.product(ctx, "grad_input0", products["grad_input"], x=g, y=weights[0], z=dx)
            elif dx is not None or any(wanted[:i]):
                dh = ctx.empty(shapes[i][0], ctx.dtype)
                epilogue = Epilogue(self.activations[i - 1], ctx.saved[f"pre{i - 1}"], derivative=True)
                launches += self.product(
                    ctx, f"grad_input{i}", products["grad_input"], x=g, y=weights[i], z=dh, epilogue=epilogue
                )
                g = dh
            else:
                break
        return launches


def _next_layer(linear: Node, read_by, kept: set[int]) -> tuple[Node, Node] | None:
    """(activation, next linear) when ``linear``'s output is read only by an element-wise
    activation whose output is read only by another linear, as its input, all of one dtype
    and neither value an output."""

    def only_reader(value: Value) -> tuple[Node, int] | None:
        return read_by[value.id][0] if value.id not in kept and len(read_by[value.id]) == 1 else None

    first = only_reader(linear.output)
    if first is None or type(first[0].op) is not ActivationOp:
        return None
    activation = first[0]
    second = only_reader(activation.output)
    if second is None or type(second[0].op) is not LinearOp or second[1] != 0:
        return None
    following = second[0]
    if following.output.dtype != linear.output.dtype:
        return None
    return activation, following


def fuse_mlp(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """Chains linear, activation, linear (, activation, linear ...) become one ``MLPOp`` at the
    place of their last linear: each activation in the epilogue of the product before it, its
    derivative in the epilogue of the product that computes its gradient (see the op)."""
    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    taken: set[int] = set()
    chains: dict[int, tuple[list[Node], list[Node]]] = {}  # last linear's id -> (linears, activations)
    for node in graph.nodes:
        if type(node.op) is not LinearOp or node.id in taken or node.output.id not in needed:
            continue
        linears, activations = [node], []
        while (step := _next_layer(linears[-1], read_by, kept)) is not None:
            activations.append(step[0])
            linears.append(step[1])
        if activations:
            chains[linears[-1].id] = (linears, activations)
            taken.update(n.id for n in linears)
    if not chains:
        return graph, outputs, ""
    rebuild = Rebuild(graph)

    def fuse(node: Node, chain: tuple[list[Node], list[Node]]) -> None:
        linears, activations = chain
        op = MLPOp([n.op.has_bias for n in linears], [n.op for n in activations], keep_pre_activations=training)
        inputs = [linears[0].inputs[0]] + [v for n in linears for v in n.inputs[1:]]
        rebuild.new[node.output.id] = rebuild.apply(op, [rebuild[v] for v in inputs], node.name)

    skipped = {n.id for linears, activations in chains.values() for n in [*linears[:-1], *activations]}
    rebuild.replace(skipped, chains, fuse)
    graph, outputs = rebuild.finish(outputs)
    activations = [a for _, chain in chains.values() for a in chain]
    hidden = sum(nbytes(a.output) for a in activations)
    if training:  # forwards h is not read back; backwards dy is neither written nor read
        saved = (
            f"{len(activations)} launches and {mib(hidden)} of reads fewer per forward, as many launches "
            f"and {mib(2 * hidden)} of memory traffic fewer per backward"
        )
    else:  # h is neither written nor read
        saved = f"{len(activations)} launches and {mib(2 * hidden)} of memory traffic fewer"
    return (
        graph,
        outputs,
        f"activations in the epilogues of the linears around them: {len(activations)} in {len(chains)} "
        f"chain{'s' if len(chains) != 1 else ''}, {saved}",
    )
