"""Graph rewrites that ``lower`` runs before it plans a program.

A rewrite is a function ``(graph, outputs, training) -> (graph, outputs, report)``: it returns a
graph that computes the same ``outputs`` (the values the program returns, first the loss) with
fewer launches or less memory, and a line saying what it changed (empty: nothing, and the graph
it was given). The rewritten graph is a copy made node by node (``Rebuild``); the caller's graph
stays as traced. ``lower(graph, mode, rewrites=DEFAULT_REWRITES)`` runs them in order,
``rewrites=()`` runs none, and ``Program.summary()`` lists what each one did.

* ``read_transposed_weights``: linear(x, W.t(), b) of a 2-D W (transformers' Conv1D keeps W as
  (in, out)) reads W through strides (``linear.TransposedWeightLinearOp``) instead of copying
  its transpose each way.
* ``fuse_residual_norm``: y = layer_norm(a + b) or rms_norm(a + b) where the sum is also read
  downstream (the residual stream of a pre-norm transformer) becomes one norm launch that reads
  a and b, writes the sum and y (``norm.AddNormOp``); the add keeps its node, and its backward,
  but launches nothing (``norm.TakenInOp``). An exact upcast of b read by the add alone (a bf16
  sublayer's output added to a float32 stream under autocast) is taken in too: the norm reads b
  in its own dtype, and the upcast keeps only its backward. Per residual: one launch and one full read
  fewer. The backward adds the norm's dx to the gradient the residual path left
  (``RuntimeOp.grad_accumulates``): no accumulate launch sums the two.
* ``attention_in_place``: the transposes that split the heads of q, k and v before an attention,
  and merge them after it, are left out: the attention reads and writes (batch, length, heads,
  dim) tensors through strides (``attention.AttentionOp(layout="blhd")``).
* ``chunk_linear_cross_entropy``: cross_entropy(linear(x, W, b)) with class-index targets
  becomes one op that computes the logits chunk by chunk of rows, with the loss and the
  gradients of x, W and b in the forward (``loss.LinearCrossEntropyOp``): the (rows x classes)
  logits are never stored for the backward. For logits of ``CHUNKED_LOGITS_MIN_BYTES`` and more;
  a reshape and an upcast of the logits before the loss (``logits.float()``) are taken in.

``precision=`` of ``lower`` adds a last rewrite, ``mixed_precision``: see its docstring.

* ``fuse_qkv_products`` (after ``attention_in_place``): the q, k and v projections of an
  attention, three linears of one input, become one product (``linear.SharedInputLinearOp``)
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
* ``fuse_mlp`` (not a default: ask for it, ``rewrites=DEFAULT_REWRITES + (fuse_mlp,)``):
  linear, element-wise activation, linear (and longer such chains, the MLP of a transformer
  block) become one node (``linear.MLPOp``): the activation runs in the
  first product's epilogue, which writes h and f(h), and its derivative in the epilogue of the
  product that computes the gradient of f(h), which writes dh = f'(h) * (dZ W) in place of
  the gradient of f(h). Per activation: one launch and one read of h fewer forwards; one launch
  and a write and read of the gradient of f(h) fewer backwards. (Only between two linears: an
  activation whose gradient no product of the same node computes keeps its own launch.) The
  persistent product kernel runs its epilogue between two tiles' products, not under them, so
  the activation's maths adds to the product's time: on the H200 that cost more than the pass
  it saves (GPT-2 small's c_fc with tanh-GELU: 73.6 us, against 30.8 + 17.1 us unfused; its step
  17.9 ms unfused, 19.1 fused) or as much (a ReLU MLP; bench/NOTES.md, version 6).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .graph import Graph, Node, Tensor, Value
from .runtime import ARENA_ALIGN, RuntimeOp

# The rewrites import the op families they know inside their functions: the families import
# the registry, which imports lowering, which imports this module.

RewriteFn = Callable[[Graph, list[Value], bool], tuple[Graph, list[Value], str]]


@dataclass(frozen=True)
class RewriteReport:
    """What one rewrite changed in a program, as ``Program.summary()`` prints it."""

    rewrite: str
    changed: str

    def __str__(self) -> str:
        return f"{self.rewrite}: {self.changed}"


class Rebuild:
    """A copy of ``graph`` made node by node: ``copy(node)`` re-applies a node as it is,
    ``apply(op, inputs, name)`` adds a new one, ``self[old]`` is the new value of an old one.
    Inputs, parameters and constants are copied first, in their order (so the parameter arena
    is laid out as before)."""

    def __init__(self, graph: Graph):
        self.source, self.graph = graph, Graph(graph.name)
        self.new: dict[int, Value] = {}
        for v in graph.values:
            if v.kind == "input":
                copy = self.graph.input(v.name, v.shape, v.dtype, v.requires_grad)
            elif v.kind == "param":
                copy = self.graph.parameter(v.name, v.shape, v.init, v.dtype, v.requires_grad)
            elif v.kind == "const":
                copy = self.graph.constant(v.data, v.dtype, v.name)
            else:
                continue
            self.new[v.id] = copy.value

    def __getitem__(self, old: Value) -> Value:
        return self.new[old.id]

    def apply(self, op: RuntimeOp, inputs: Sequence[Value], name: str) -> Value:
        """A new node ``op(inputs)`` (new values), its shape and dtype inferred and checked."""
        return self.graph.apply(op, [Tensor(self.graph, v) for v in inputs], name=name).value

    def copy(self, node: Node) -> Value:
        """``node`` re-applied to the new values of its inputs."""
        out = self.apply(node.op, [self[v] for v in node.inputs], node.name)
        self.new[node.output.id] = out
        return out

    def replace(self, skipped: set[int], fused: Mapping[int, Any], fuse: Callable[[Node, Any], None]) -> None:
        """Every node of the source graph in order: those in ``skipped`` left out, each one in
        ``fused`` handed to ``fuse(node, fused[node.id])`` (which applies what replaces it and
        sets ``self.new`` for the values it stands for), the others copied."""
        for node in self.source.nodes:
            if node.id in skipped:
                continue
            if node.id in fused:
                fuse(node, fused[node.id])
            else:
                self.copy(node)

    def finish(self, outputs: Sequence[Value]) -> tuple[Graph, list[Value]]:
        """The new graph, with the new values of ``outputs`` as its outputs."""
        outs = [self[v] for v in outputs]
        self.graph.output(*[Tensor(self.graph, v) for v in outs])
        return self.graph, outs


def ancestors(outputs: Sequence[Value]) -> set[int]:
    """Ids of the values ``outputs`` are computed from (themselves included)."""
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v.id not in seen:
            seen.add(v.id)
            if v.producer is not None:
                stack.extend(v.producer.inputs)
    return seen


def readers(graph: Graph) -> dict[int, list[tuple[Node, int]]]:
    """Per value id, the nodes that read it and at which input position."""
    out: dict[int, list[tuple[Node, int]]] = {v.id: [] for v in graph.values}
    for node in graph.nodes:
        for index, v in enumerate(node.inputs):
            out[v.id].append((node, index))
    return out


def _nbytes(value: Value) -> int:
    return value.numel * value.dtype.itemsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def apply_rewrites(
    graph: Graph, outputs: list[Value], training: bool, rewrites: Sequence[RewriteFn]
) -> tuple[Graph, list[Value], list[RewriteReport]]:
    """Run ``rewrites`` in order; the final graph, its outputs and what each rewrite changed."""
    reports = []
    for rewrite in rewrites:
        graph, outputs, changed = rewrite(graph, outputs, training)
        if changed:
            reports.append(RewriteReport(getattr(rewrite, "__name__", str(rewrite)), changed))
    return graph, outputs, reports


# ------------------------------------------------------------------------- residual + norm


def _residual_add(node: Node) -> tuple[Value, Value] | None:
    """(x, residual) when ``node`` is a + b of two float tensors, one of the sum's shape and one
    that repeats over its leading dims; else None."""
    from .kernels.elementwise import ElementwiseOp
    from .kernels.norm import repeats_over_rows

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
    from .kernels.cast import CastOp

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
    from .kernels.norm import AddNormOp, LayerNormOp, TakenInOp

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
        if norm is None:  # an upcast the fused norm reads through: its backward only
            rebuild.new[node.output.id] = rebuild.apply(TakenInOp(node.op), [rebuild[node.inputs[0]]], node.name)
            return
        x, residual = operands[node.id]
        s = rebuild.apply(TakenInOp(node.op), [rebuild[v] for v in node.inputs], node.name)
        rebuild.new[node.output.id] = s
        affine = [rebuild[v] for v in norm.inputs[1:]]
        read = upcasts[node.id].inputs[0] if node.id in upcasts else residual
        rebuild.new[norm.output.id] = rebuild.apply(
            AddNormOp(norm.op), [s, *affine, rebuild[x], rebuild[read]], norm.name
        )

    norms = [norm for norm in pairs.values() if norm is not None]
    rebuild.replace({norm.id for norm in norms}, pairs, fuse)
    sums = sum(_nbytes(norm.inputs[0]) for norm in norms)
    graph, outputs = rebuild.finish(outputs)
    kinds = Counter(norm.op.name for norm in norms)
    fused = ", ".join(f"residual add + {name} in one launch: {n}" for name, n in sorted(kinds.items()))
    taken = f"; {len(upcasts)} upcasts of the residual read in place" if upcasts else ""
    return graph, outputs, f"{fused} ({len(norms)} launches and {_mib(sums)} of reads fewer per forward{taken})"


# ------------------------------------------------------------------ linear + cross-entropy


# Smallest logits tensor worth chunking. Chunking saves memory, not time (it adds the float32
# sums of dW per chunk and the scaling of the saved gradients by dy, and a few launches): below
# this size the memory is small and the extra launches cost a launch-bound step more than it saves.
CHUNKED_LOGITS_MIN_BYTES = 16 << 20


def _logits_chain(node: Node | None) -> list[Node | None]:
    """The nodes from the linear that made a loss's logits to the loss: a reshape to (rows,
    classes) and an exact upcast (``logits.float()`` before the loss, as Hugging Face's loss
    does) may come between, once each, in either order. First the candidate linear (or None)."""
    from .kernels.cast import CastOp
    from .kernels.shape import ViewOp

    chain: list[Node | None] = []
    seen: set[type] = set()
    while node is not None and type(node.op) in (ViewOp, CastOp) and type(node.op) not in seen:
        if type(node.op) is CastOp:
            source, target = node.inputs[0].dtype, node.op.dtype
            if not (source.is_floating_point and target.is_floating_point and target.itemsize >= source.itemsize):
                break
        seen.add(type(node.op))
        chain.insert(0, node)
        node = node.inputs[0].producer
    return [node, *chain]


def chunk_linear_cross_entropy(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """cross_entropy(linear(x, W, b)) (class indices, mean or sum; the logits possibly reshaped
    to (rows, classes) and upcast in between) becomes one ``LinearCrossEntropyOp`` that computes the
    logits chunk by chunk and never keeps them (see its docstring), when nothing else reads the
    logits, they are not an output and they take at least ``CHUNKED_LOGITS_MIN_BYTES``."""
    from .kernels.linear import LinearOp
    from .kernels.loss import ClassLossOp, LinearCrossEntropyOp

    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    matches: dict[int, tuple[Node, list[Node]]] = {}  # loss node id -> (linear node, the reshape and upcast after it)
    for node in graph.nodes:
        op = node.op
        if not (type(op) is ClassLossOp and op.from_logits and not op.target_probs and op.reduction != "none"):
            continue
        logits = node.inputs[0]
        if node.output.id not in needed or len(logits.shape) != 2:
            continue
        chain = _logits_chain(logits.producer)
        linear = chain[0]
        if linear is None or type(linear.op) is not LinearOp or linear.output.shape[-1] != logits.shape[-1]:
            continue
        if _nbytes(linear.output) < CHUNKED_LOGITS_MIN_BYTES:
            continue
        if any(n.output.id in kept or len(read_by[n.output.id]) != 1 for n in chain):
            continue
        if any(v.dtype.is_floating_point and v.dtype != linear.output.dtype for v in node.inputs[1:]):
            continue  # class weights in the upcast dtype: the fused op computes in the linear's
        matches[node.id] = (linear, chain[1:])
    if not matches:
        return graph, outputs, ""
    rebuild = Rebuild(graph)

    def fuse(node: Node, match: tuple[Node, list[Node]]) -> None:
        linear = match[0]
        x, params = linear.inputs[0], linear.inputs[1:]
        fused = LinearCrossEntropyOp(linear.op, node.op, node.output.dtype, with_grads=training)
        inputs = [x, *node.inputs[1:], *params]
        rebuild.new[node.output.id] = rebuild.apply(fused, [rebuild[v] for v in inputs], node.name)

    rebuild.replace({n.id for linear, rest in matches.values() for n in (linear, *rest)}, matches, fuse)
    logits_bytes = sum(_nbytes(linear.output) for linear, _ in matches.values())
    graph, outputs = rebuild.finish(outputs)
    return (
        graph,
        outputs,
        f"cross_entropy(linear) in chunks of rows: {len(matches)}, logits ({_mib(logits_bytes)}) never stored",
    )


# ------------------------------------------------------------------- attention in place

_SWAP_LENGTH_AND_HEADS = (0, 2, 1, 3)


def _transposed_source(value: Value, read_by, kept: set[int]) -> Value | None:
    """x when ``value`` is x.transpose(1, 2) of a 4-D x, read by one node and not an output."""
    from .kernels.shape import PermuteOp

    node = value.producer
    if node is None or type(node.op) is not PermuteOp or node.op.dims != _SWAP_LENGTH_AND_HEADS:
        return None
    if value.id in kept or len(read_by[value.id]) != 1:
        return None
    return node.inputs[0]


def attention_in_place(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """scaled_dot_product_attention of q, k, v that are transposes (batch, length, heads, dim)
    -> (batch, heads, length, dim), as a multi-head layer splits its heads, becomes an attention
    that reads the untransposed tensors through strides (``AttentionOp(layout="blhd")``) and
    writes its output as (batch, length, heads, dim), which the transpose after it (the merge of
    the heads) made: per layer four copies fewer forwards and four backwards. Where something
    else reads the output, one transpose back stays for it."""
    from .kernels.attention import AttentionOp
    from .kernels.shape import PermuteOp

    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    matches: dict[int, list[Value]] = {}  # attention node id -> its untransposed q, k, v
    for node in graph.nodes:
        if type(node.op) is not AttentionOp or node.op.layout != "bhld" or node.output.id not in needed:
            continue
        sources = [_transposed_source(v, read_by, kept) for v in node.inputs[:3]]
        if any(s is None for s in sources) or len({s.shape[0] for s in sources}) != 1:
            continue
        matches[node.id] = sources
    if not matches:
        return graph, outputs, ""
    skipped = {v.producer.id for node in graph.nodes if node.id in matches for v in node.inputs[:3]}
    merges: dict[int, list[Node]] = {}  # per matched attention: the transposes of its output (head merges)
    others: set[int] = set()  # matched attentions whose output something else reads too
    for node in graph.nodes:
        if node.id in matches:
            for reader, _ in read_by[node.output.id]:
                if type(reader.op) is PermuteOp and reader.op.dims == _SWAP_LENGTH_AND_HEADS:
                    merges.setdefault(node.id, []).append(reader)
                    skipped.add(reader.id)
                else:
                    others.add(node.id)
            if node.output.id in kept:
                others.add(node.id)
    rebuild = Rebuild(graph)

    def fuse(node: Node, sources: list[Value]) -> None:
        op = node.op
        in_place = AttentionOp(
            op.has_mask, op.is_causal, op.user_scale, op.enable_gqa, op.dropout_p, op.seed, op.fixed_mask, "blhd"
        )
        out = rebuild.apply(in_place, [rebuild[v] for v in sources + node.inputs[3:]], node.name)
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
            copies += sum(_nbytes(v) for v in node.inputs[:3])
            copies += (len(merges.get(node.id, [])) - (node.id in others)) * _nbytes(node.output)
    graph, outputs = rebuild.finish(outputs)
    transposes = 3 * len(matches) + sum(len(m) for m in merges.values()) - len(others)
    return (
        graph,
        outputs,
        f"attention on (batch, length, heads, dim) in place: {len(matches)}, {transposes} transposes "
        f"({_mib(copies)} of copies) fewer per forward, as many per backward",
    )


# ------------------------------------------------------------------------- transposed weights


def read_transposed_weights(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """linear(x, W.t(), b) of a 2-D W whose transpose nothing else reads becomes one product
    that reads W as it is stored, (in, out), through strides (``linear.TransposedWeightLinearOp``;
    transformers' Conv1D, x @ W + b): per linear the transpose's copy fewer forwards, and the
    copy of dW^T back into W's layout fewer backwards (dW^T is written transposed, its bias
    gradient fused as in linear)."""
    from .kernels.linear import LinearOp, TransposedWeightLinearOp
    from .kernels.shape import PermuteOp

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
    copies = sum(_nbytes(w) for w in matches.values())
    graph, outputs = rebuild.finish(outputs)
    more = ", as many backwards" if training else ""
    return (
        graph,
        outputs,
        f"linear of a transposed weight read in place: {len(matches)}, {len(matches)} transposes "
        f"({_mib(copies)} of copies) fewer per forward{more}",
    )


# ------------------------------------------------------------------------- q, k, v as one product


def _projection(value: Value, read_by, kept: set[int]) -> Node | None:
    """The linear node when ``value`` is reshape(linear(x, W[, b])) splitting the last dim into
    (heads, dim), the linear and the reshape each read once and neither an output."""
    from .kernels.linear import LinearOp
    from .kernels.shape import ViewOp

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
            if v.kind != "param" or v.id in kept or len(read_by[v.id]) != 1 or _nbytes(v) % ARENA_ALIGN:
                return False
    return True


def fuse_qkv_products(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """An attention in the (batch, length, heads, dim) layout whose q, k and v are reshaped
    linears of one input (same heads and head dim, all with a bias or none) reads them from one
    product instead (see the module docstring). The product runs just before the attention."""
    from .kernels.attention import AttentionOp
    from .kernels.linear import SharedInputLinearOp
    from .kernels.shape import ViewOp

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
        attention = AttentionOp(
            op.has_mask, op.is_causal, op.user_scale, False, op.dropout_p, op.seed, op.fixed_mask, "packed", heads
        )
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


# ------------------------------------------------------------------------- linear, activation, linear


def _next_layer(linear: Node, read_by, kept: set[int]) -> tuple[Node, Node] | None:
    """(activation, next linear) when ``linear``'s output is read only by an element-wise
    activation whose output is read only by another linear, as its input, all of one dtype
    and neither value an output."""
    from .kernels.activation import ActivationOp
    from .kernels.linear import LinearOp

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
    from .kernels.linear import LinearOp, MLPOp

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
    hidden = sum(_nbytes(a.output) for a in activations)
    if training:  # forwards h is not read back; backwards dy is neither written nor read
        saved = (
            f"{len(activations)} launches and {_mib(hidden)} of reads fewer per forward, as many launches "
            f"and {_mib(2 * hidden)} of memory traffic fewer per backward"
        )
    else:  # h is neither written nor read
        saved = f"{len(activations)} launches and {_mib(2 * hidden)} of memory traffic fewer"
    return (
        graph,
        outputs,
        f"activations in the epilogues of the linears around them: {len(activations)} in {len(chains)} "
        f"chain{'s' if len(chains) != 1 else ''}, {saved}",
    )


DEFAULT_REWRITES: tuple[RewriteFn, ...] = (
    read_transposed_weights,
    fuse_residual_norm,
    chunk_linear_cross_entropy,
    attention_in_place,
    fuse_qkv_products,
)

# ------------------------------------------------------------------------- mixed precision


def _keeps_float32(op: RuntimeOp) -> bool:
    """Ops a mixed-precision program runs on float32 inputs: losses (a float32 loss, as
    autocast computes them), and ops that update a parameter in place (batch_norm's running
    statistics, embedding's max_norm renormalisation), which must see the float32 parameter."""
    from .kernels.embedding import EmbeddingOp
    from .kernels.loss import ClassLossOp, PointwiseLossOp
    from .kernels.norm import BatchNormOp

    if isinstance(op, EmbeddingOp):
        return op.max_norm is not None
    return isinstance(op, (ClassLossOp, PointwiseLossOp, BatchNormOp))


def mixed_precision(dtype: torch.dtype) -> RewriteFn:
    """The rewrite of ``lower(..., precision="bf16-mixed")`` (``dtype`` bfloat16; float16 for
    ``"fp16-mixed"``, whose training also scales the loss: ``optim.GradScaler``): the program
    computes in ``dtype`` while the parameters stay float32 in the arena (master weights: the
    optimizer and its state update float32, one launch per arena as before).

    Each float32 parameter is cast to ``dtype`` once, just before its first reader (the cast's
    backward brings its gradient back to the float32 gradient arena); the fused q/k/v product's
    parameters, side by side in the arena, are cast as one stacked weight and one stacked bias
    (``StackedCastOp``) that a plain linear reads. float32 inputs are cast the same way and
    float32 constants converted. Every op is re-applied to the cast values,
    so its output dtype follows. Losses and in-place updaters (``_keeps_float32``) get float32
    inputs instead; the chunked head + loss (``LinearCrossEntropyOp``) computes its products in
    ``dtype`` and writes the loss in float32. Outputs keep the dtypes the graph gave them (a
    cast back at the end where one changed): the loss is float32, its seed too."""
    from .kernel import dtype_name

    def rewrite(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
        from .kernels.cast import CastOp, StackedCastOp
        from .kernels.linear import LinearOp, SharedInputLinearOp
        from .kernels.loss import LinearCrossEntropyOp

        rebuild = Rebuild(graph)
        casts: dict[tuple[int, torch.dtype], Value] = {}
        counts: Counter = Counter()

        def cast(v: Value, to: torch.dtype) -> Value:
            if v.dtype == to or not v.dtype.is_floating_point:
                return v
            key = (v.id, to)
            if key not in casts:
                counts[v.kind] += 1
                if v.kind == "const":
                    casts[key] = rebuild.graph.constant(v.data.to(to), to, f"{v.name}.{dtype_name(to)}").value
                else:
                    casts[key] = rebuild.apply(CastOp(to), [v], f"{v.name}.{dtype_name(to)}")
            return casts[key]

        for node in graph.nodes:
            op = node.op
            if isinstance(op, SharedInputLinearOp) and op.adjacent and node.inputs[1].dtype == torch.float32:
                # float32 parameters side by side in the arena: each group cast as one stacked tensor,
                # then one product of the stacked casts (no cast or copy per part)
                stacked = [
                    rebuild.apply(
                        StackedCastOp(dtype, op.parts), [rebuild[node.inputs[i]] for i in group], f"{node.name}.{what}"
                    )
                    for group, what in zip(op.adjacent_params, ("weight", "bias"))
                ]
                n_stacked = sum(len(group) for group in op.adjacent_params)
                counts["param"] += n_stacked
                counts["stacked"] += n_stacked
                counts["stacks"] += len(stacked)
                inputs, op = [cast(rebuild[node.inputs[0]], dtype), *stacked], LinearOp(op.has_bias)
            elif _keeps_float32(op):
                inputs = [cast(rebuild[v], v.dtype) for v in node.inputs]
                counts["float32 op"] += 1
            elif isinstance(op, CastOp):  # an explicit cast in the model stays what it says
                inputs = [rebuild[v] for v in node.inputs]
            else:
                inputs = [cast(rebuild[v], dtype) if v.dtype == torch.float32 else rebuild[v] for v in node.inputs]
            if isinstance(op, LinearCrossEntropyOp):
                op = LinearCrossEntropyOp(op.linear, op.loss, node.output.dtype, op.with_grads, op.chunk_rows)
            rebuild.new[node.output.id] = rebuild.apply(op, inputs, node.name)
        for v in outputs:
            rebuild.new[v.id] = cast(rebuild[v], v.dtype)
        if not casts and not counts["stacks"]:
            return graph, outputs, ""
        graph, outputs = rebuild.finish(outputs)
        names = {"param": "parameter", "input": "input", "const": "constant", "node": "value"}
        parts = [f"{dtype_name(dtype)} compute, float32 master weights"]
        parts += [f"{n} {names[kind]}{'s' if n != 1 else ''} cast" for kind, n in counts.items() if kind in names]
        if counts["stacks"]:
            parts.append(f"{counts['stacked']} of the parameters side by side in {counts['stacks']} stacked casts")
        if counts["float32 op"]:
            parts.append(f"{counts['float32 op']} loss or in-place ops on float32")
        return graph, outputs, ", ".join(parts)

    rewrite.__name__ = f"mixed_precision_{dtype_name(dtype)}"
    return rewrite


PRECISIONS: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def precision_rewrites(precision: str | None) -> list[RewriteFn]:
    """The rewrites ``lower(..., precision=...)`` adds after the others (None: none)."""
    if precision is None:
        return []
    if precision not in PRECISIONS:
        choices = ", ".join(PRECISIONS)
        raise ValueError(f"unknown precision {precision!r}; choose None (the graph's dtypes) or {choices}")
    return [mixed_precision(PRECISIONS[precision])]
