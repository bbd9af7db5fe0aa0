"""``read_packed_qkv``: an attention on (batch, length, heads, dim) whose q, k and v are the three
column blocks of one (batch, length, 3 * heads * dim) tensor (GPT-2's ``c_attn(x).split(width,
dim=2)``, then each block's heads split by a reshape) reads that tensor as it is
(``AttentionOp(layout="packed")``), and its backward writes the packed gradient whole: per
layer the three strided copies of the blocks fewer forwards, and backwards the three gradients
scattered into zeros of the packed size and their sum.
"""

from __future__ import annotations

import torch

from ..core.graph import Graph, Node, Value
from ..ops.attention.ops import AttentionOp
from ..ops.shape.ops import GetItemOp, ViewOp
from .pipeline import Rebuild, left_out, matching, mib, nbytes, readers


def _column_block(value: Value) -> tuple[Value, int] | None:
    """(the packed tensor, where the block starts) when ``value`` is a block of whole rows'
    consecutive columns of a 3-D tensor (a slice of its last dim, step 1); else None."""
    node = value.producer
    if node is None or type(node.op) is not GetItemOp:
        return None
    packed = node.inputs[0]
    if len(packed.shape) != 3:
        return None
    view = node.op.torch_view(torch.empty(packed.shape, device="meta"))
    whole = torch.empty(packed.shape, device="meta").stride()
    if tuple(view.shape[:-1]) != tuple(packed.shape[:-1]) or view.stride() != whole:
        return None
    return packed, view.storage_offset()


def _packed_source(node: Node) -> tuple[Value, list[Node]] | None:
    """(the packed tensor, the slices and reshapes between it and the attention) when q, k and v
    of the attention ``node`` (on (batch, length, heads, dim), ungrouped) are, in order, the three
    equal column blocks of one tensor with their heads split; else None."""
    op = node.op
    if type(op) is not AttentionOp or op.layout != "blhd" or op.enable_gqa:
        return None
    b, length, heads, dim = node.inputs[0].shape
    width = heads * dim
    chain, sources = [], {}
    for index, value in enumerate(node.inputs[:3]):
        reshape = value.producer
        if reshape is None or type(reshape.op) is not ViewOp or tuple(value.shape) != (b, length, heads, dim):
            return None
        block = _column_block(reshape.inputs[0])
        if block is None or block[1] != index * width or tuple(block[0].shape) != (b, length, 3 * width):
            return None
        sources[block[0].id] = block[0]
        chain += [reshape.inputs[0].producer, reshape]
    return (next(iter(sources.values())), chain) if len(sources) == 1 else None


def read_packed_qkv(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """An attention on (batch, length, heads, dim) (``attention_in_place``'s layout) of the three
    column blocks of one packed tensor reads the packed tensor; the slices and reshapes are
    left out where nothing else reads them."""
    matches = matching(graph, _packed_source)
    if not matches:
        return graph, outputs, ""
    skipped = left_out({node_id: chain for node_id, (_, chain) in matches.items()}, readers(graph), outputs)
    rebuild = Rebuild(graph)

    def fuse(node: Node, found: tuple[Value, list[Node]]) -> None:
        op, packed = node.op, found[0]
        attention = op.relaid("packed", heads=node.inputs[0].shape[2])
        inputs = [rebuild[packed]] + [rebuild[v] for v in node.inputs[3:]]
        rebuild.new[node.output.id] = rebuild.apply(attention, inputs, node.name)

    rebuild.replace(skipped, matches, fuse)
    copies = sum(nbytes(graph.nodes[i].inputs[j]) for i in matches for j in range(3))
    graph, outputs = rebuild.finish(outputs)
    return (
        graph,
        outputs,
        f"attention reading packed q, k, v in place: {len(matches)}, {3 * len(matches)} block copies "
        f"({mib(copies)}) fewer per forward",
    )
