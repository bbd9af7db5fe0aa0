"""``fold_loss_upcast``: a cross-entropy of half-precision logits widened to float32 first
(``loss(logits.float())``, as transformers' causal-LM losses and autocast's policy do) reads the
half-precision logits as they are (``ClassLossOp(out_dtype=float32)``): the kernels compute in
float32 either way, so the loss is the same to the bit, and its gradient, rounded to the logits'
dtype once, is the one the cast's backward made. Per step the float32 copy of the logits is
neither written nor kept, and the float32 gradient of the logits neither written nor cast back:
for a (8192, 32000) bf16 head, 1 GiB fewer kept and about 4 GiB fewer read and written.
"""

from __future__ import annotations

import copy

import torch

from ..core.graph import Graph, Node, Value
from ..core.kernel import dtype_name
from ..ops.cast import CastOp
from ..ops.loss.ops import ClassLossOp
from ..ops.shape.ops import ViewOp
from .pipeline import Rebuild, left_out, matching, mib, nbytes, readers

_HALF = (torch.bfloat16, torch.float16)


def _widened_half(value: Value) -> tuple[Value, list[Node]] | None:
    """(the half-precision value ``h``, the nodes from the cast to ``value``: the cast, then the
    views) where ``value`` is views of ``cast(h, float32)``; else None."""
    chain: list[Node] = []
    while value.producer is not None and type(value.producer.op) is ViewOp:
        chain.append(value.producer)
        value = value.producer.inputs[0]
    cast = value.producer
    if cast is None or type(cast.op) is not CastOp or value.dtype != torch.float32:
        return None
    source = cast.inputs[0]
    return (source, [cast, *chain[::-1]]) if source.dtype in _HALF else None


def _upcast_loss_input(node: Node) -> tuple[Value, list[Node]] | None:
    """``_widened_half`` of the input of a cross-entropy or NLL of class indices without class
    weights, not yet folded; None for any other node."""
    op = node.op
    if type(op) is not ClassLossOp or op.has_weight or op.out_dtype is not None:
        return None
    if node.inputs[1].dtype.is_floating_point:  # class probabilities: of the input's dtype
        return None
    return _widened_half(node.inputs[0])


def fold_loss_upcast(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """Each cross-entropy or NLL of class indices (no class weights) whose input is, through
    views, a float32 cast of a half-precision value reads that value instead, the views made
    again on it, and writes its loss in float32 (``ClassLossOp.out_dtype``). The cast and the
    views are left out where nothing else reads them."""
    matches = matching(graph, _upcast_loss_input)  # loss node id -> (half value, cast and views)
    if not matches:
        return graph, outputs, ""
    skipped = left_out({node_id: chain for node_id, (_, chain) in matches.items()}, readers(graph), outputs)
    rebuild = Rebuild(graph)

    def fuse(node: Node, found: tuple[Value, list[Node]]) -> None:
        half, chain = found
        value = rebuild[half]
        for view in chain[1:]:
            value = rebuild.apply(view.op, [value], f"{view.name}.{dtype_name(half.dtype)}")
        folded = copy.copy(node.op)
        folded.out_dtype = node.output.dtype
        rebuild.new[node.output.id] = rebuild.apply(folded, [value, rebuild[node.inputs[1]]], node.name)

    rebuild.replace(skipped, matches, fuse)
    widened = {chain[0].output.id: nbytes(chain[0].output) for _, chain in matches.values()}
    graph, outputs = rebuild.finish(outputs)
    return (
        graph,
        outputs,
        f"losses reading half-precision logits as they are: {len(matches)}, "
        f"{mib(sum(widened.values()))} of float32 logits not made per forward",
    )
