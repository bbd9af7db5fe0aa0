"""``attention_in_place``: the transposes that split the heads of q, k and v before an attention,
and merge them after it, are left out: the attention reads and writes (batch, length, heads,
dim) tensors through strides (``ops.attention.ops.AttentionOp(layout="blhd")``, whose strides
``ops.attention.layout.attention_layout_blhd`` computes). A rotary embedding between a head
split and the attention (Llama's q and k) rotates the unsplit tensor instead
(``ops.rotary.RotaryOp(layout="blhd")``).
"""

from __future__ import annotations

from ..core.graph import Graph, Node, Value
from ..ops.attention.ops import AttentionOp
from ..ops.rotary import RotaryOp
from ..ops.shape.ops import PermuteOp, ViewOp
from .pipeline import Rebuild, ancestors, mib, nbytes, readers

_SWAP_LENGTH_AND_HEADS = (0, 2, 1, 3)


def _transposed_source(value: Value, read_by, kept: set[int]) -> Value | None:
    """x when ``value`` is x.transpose(1, 2) of a 4-D x, read by one node and not an output."""
    node = value.producer
    if node is None or type(node.op) is not PermuteOp or node.op.dims != _SWAP_LENGTH_AND_HEADS:
        return None
    if value.id in kept or len(read_by[value.id]) != 1:
        return None
    return node.inputs[0]


def _source(value: Value, read_by, kept: set[int]) -> Value | tuple[Node, Value] | None:
    """What an attention input is made of with its heads not split off: x for x.transpose(1, 2);
    (the rotation, x) for a rotary embedding (Llama's q and k) of x.transpose(1, 2), which then
    rotates x in its (batch, length, heads, dim) layout; None for anything else."""
    node = value.producer
    if node is not None and type(node.op) is RotaryOp and node.op.layout == "bhld":
        if value.id in kept or len(read_by[value.id]) != 1:
            return None
        x = _transposed_source(node.inputs[0], read_by, kept)
        return None if x is None else (node, x)
    return _transposed_source(value, read_by, kept)


def _batch(source: Value | tuple[Node, Value]) -> int:
    return (source[1] if isinstance(source, tuple) else source).shape[0]


def _merged_heads(reader: Node, read_by, kept: set[int]) -> list[Node] | None:
    """[reader] when it is the transpose that merges an attention's heads back; [reader, the
    transpose] when ``reader`` is a reshape to the same shape (GPT-2 writes one) read by that
    transpose alone and no output; else None."""
    if type(reader.op) is PermuteOp and reader.op.dims == _SWAP_LENGTH_AND_HEADS:
        return [reader]
    if type(reader.op) is not ViewOp or reader.output.shape != reader.inputs[0].shape or reader.output.id in kept:
        return None
    after = read_by[reader.output.id]
    if len(after) == 1 and type(after[0][0].op) is PermuteOp and after[0][0].op.dims == _SWAP_LENGTH_AND_HEADS:
        return [reader, after[0][0]]
    return None


def attention_in_place(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """scaled_dot_product_attention of q, k, v that are transposes (batch, length, heads, dim)
    -> (batch, heads, length, dim), as a multi-head layer splits its heads, becomes an attention
    that reads the untransposed tensors through strides (``AttentionOp(layout="blhd")``) and
    writes its output as (batch, length, heads, dim), which the transpose after it (the merge of
    the heads) made: per layer four copies fewer forwards and four backwards. Where something
    else reads the output, one transpose back stays for it."""
    needed = ancestors(outputs)
    read_by = readers(graph, needed)
    kept = {v.id for v in outputs}
    matches: dict[int, list[Value]] = {}  # attention node id -> its untransposed q, k, v
    for node in graph.nodes:
        if type(node.op) is not AttentionOp or node.op.layout != "bhld" or node.output.id not in needed:
            continue
        sources = [_source(v, read_by, kept) for v in node.inputs[:3]]
        if any(s is None for s in sources) or len({_batch(s) for s in sources}) != 1:
            continue
        matches[node.id] = sources
    if not matches:
        return graph, outputs, ""
    skipped = {v.producer.id for node in graph.nodes if node.id in matches for v in node.inputs[:3]}
    for sources in matches.values():  # a rotation's transpose too
        skipped.update(s[0].inputs[0].producer.id for s in sources if isinstance(s, tuple))
    skipped.update(node.id for node in graph.nodes if node.output.id not in needed)  # which may read them
    merges: dict[int, list[Node]] = {}  # per matched attention: the transposes of its output (head merges)
    others: set[int] = set()  # matched attentions whose output something else reads too
    for node in graph.nodes:
        if node.id in matches:
            for reader, _ in read_by[node.output.id]:
                merged = _merged_heads(reader, read_by, kept)
                if merged is not None:
                    merges.setdefault(node.id, []).append(merged[-1])
                    skipped.update(n.id for n in merged)
                else:
                    others.add(node.id)
            if node.output.id in kept:
                others.add(node.id)
    rebuild = Rebuild(graph)

    def unsplit(source: Value | tuple[Node, Value]) -> Value:
        if not isinstance(source, tuple):
            return rebuild[source]
        rotation, x = source
        tables = [rebuild[v] for v in rotation.inputs[1:]]
        return rebuild.apply(RotaryOp("blhd"), [rebuild[x], *tables], rotation.name)

    def fuse(node: Node, sources: list) -> None:
        op = node.op
        in_place = op.relaid("blhd")
        inputs = [unsplit(s) for s in sources] + [rebuild[v] for v in node.inputs[3:]]
        out = rebuild.apply(in_place, inputs, node.name)
        for merge in merges.get(node.id, []):
            rebuild.new[merge.output.id] = out
        if node.id in others:  # the (batch, heads, length, dim) output for its other readers
            rebuild.new[node.output.id] = rebuild.apply(
                PermuteOp("transpose", _SWAP_LENGTH_AND_HEADS), [out], node.name + "_heads_second"
            )

    rebuild.replace(skipped, matches, fuse)
    copies = 0
    for node in graph.nodes:
        if node.id in matches:  # the head splits, the merges, less the transpose back that stays
            copies += sum(nbytes(v) for v in node.inputs[:3])
            copies += (len(merges.get(node.id, [])) - (node.id in others)) * nbytes(node.output)
    graph, outputs = rebuild.finish(outputs)
    transposes = 3 * len(matches) + sum(len(m) for m in merges.values()) - len(others)
    return (
        graph,
        outputs,
        f"attention on (batch, length, heads, dim) in place: {len(matches)}, {transposes} transposes "
        f"({mib(copies)} of copies) fewer per forward, as many per backward",
    )
