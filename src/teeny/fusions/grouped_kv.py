"""``read_grouped_kv``: an attention whose keys and values were repeated once per query head of
their group (transformers' ``repeat_kv``: ``x[:, :, None].expand(b, kv_heads, group, l, d)
.reshape(b, kv_heads * group, l, d)``) reads the key/value heads as they are, each for its
group (``AttentionOp(enable_gqa=True)``): per layer the two repeated copies (``group`` times the
keys' and values' size) are neither written nor kept, and their gradients are not summed back.
"""

from __future__ import annotations

from ..core.graph import Graph, Node, Value
from ..ops.attention.ops import AttentionOp
from ..ops.shape.ops import ExpandOp, ViewOp
from .pipeline import Rebuild, left_out, matching, mib, nbytes, readers


def _repeated_heads(value: Value) -> tuple[Value, int, list[Node]] | None:
    """(x, group, [unsqueeze, expand, reshape]) where ``value`` is x of shape (b, kv_heads, l, d)
    with each head repeated ``group`` times in place, as ``repeat_kv`` makes it; else None."""
    reshape = value.producer
    if reshape is None or type(reshape.op) is not ViewOp:
        return None
    expand = reshape.inputs[0].producer
    if expand is None or type(expand.op) is not ExpandOp:
        return None
    unsqueeze = expand.inputs[0].producer
    if unsqueeze is None or type(unsqueeze.op) is not ViewOp:
        return None
    x = unsqueeze.inputs[0]
    if len(x.shape) != 4:
        return None
    b, kv_heads, length, dim = x.shape
    group = expand.output.shape[2] if len(expand.output.shape) == 5 else 0
    if group < 1 or tuple(unsqueeze.output.shape) != (b, kv_heads, 1, length, dim):
        return None
    if tuple(expand.output.shape) != (b, kv_heads, group, length, dim):
        return None
    if tuple(value.shape) != (b, kv_heads * group, length, dim):
        return None
    return x, group, [unsqueeze, expand, reshape]


def _grouped_kv(node: Node) -> list[tuple[Value, int, list[Node]]] | None:
    """``_repeated_heads`` of k and v of an attention (heads second, no grouping of its own)
    whose keys and values are both repeated, by one group size above 1; None otherwise."""
    op = node.op
    if type(op) is not AttentionOp or op.layout != "bhld" or op.enable_gqa:
        return None
    found = [_repeated_heads(v) for v in node.inputs[1:3]]
    if any(f is None for f in found) or found[0][1] != found[1][1] or found[0][1] == 1:
        return None
    return found


def read_grouped_kv(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """An attention (heads second, no grouping of its own) whose keys and values are both
    repeated per group of query heads reads the unrepeated ones with ``enable_gqa``; the
    repeats are left out where nothing else reads them."""
    matches = matching(graph, _grouped_kv)  # attention id -> k's and v's
    if not matches:
        return graph, outputs, ""
    chains = {node_id: [link for _, _, chain in found for link in chain] for node_id, found in matches.items()}
    skipped = left_out(chains, readers(graph), outputs)
    rebuild = Rebuild(graph)

    def fuse(node: Node, found: list[tuple[Value, int, list[Node]]]) -> None:
        grouped = node.op.relaid("bhld", enable_gqa=True)
        inputs = [node.inputs[0], found[0][0], found[1][0], *node.inputs[3:]]
        rebuild.new[node.output.id] = rebuild.apply(grouped, [rebuild[v] for v in inputs], node.name)

    rebuild.replace(skipped, matches, fuse)
    repeated = sum(nbytes(graph.nodes[i].inputs[j]) for i in matches for j in (1, 2))
    graph, outputs = rebuild.finish(outputs)
    return (
        graph,
        outputs,
        f"attention reading grouped keys and values in place: {len(matches)}, "
        f"{mib(repeated)} of repeated keys and values not made per forward",
    )
