"""``lower(graph, mode, precision="bf16-mixed")`` adds this last rewrite: the program computes in half
precision while the parameters stay float32 (``mixed_precision``)."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from ..core.graph import Graph, Node, Value
from ..core.kernel import dtype_name
from ..core.runtime import RuntimeOp
from ..ops.cast import CastOp, StackedCastOp
from ..ops.elementwise import ElementwiseOp
from ..ops.lookup import EmbeddingOp
from ..ops.loss.ops import ClassLossOp, PointwiseLossOp
from ..ops.masks import DropoutOp
from ..ops.norm.ops import BatchNormOp, LayerNormOp
from ..ops.products.ops import LinearOp
from ..ops.shape.ops import ConcatOp, StopGradientOp, StridedViewOp, ViewOp
from ..ops.unary import UnaryOp
from .chunked_loss import LinearCrossEntropyOp
from .loss_upcast import fold_loss_upcast
from .master_weights import read_master_weights
from .pipeline import Rebuild, RewriteFn
from .qkv_products import SharedInputLinearOp
from .residual_norm import AddNormOp, TakenInOp

_SHAPE_OPS = (ViewOp, StridedViewOp)


def _keeps_float32(op: RuntimeOp) -> bool:
    """Ops a mixed-precision program runs on float32 inputs: losses (a float32 loss, as
    autocast computes them), ops that update a parameter in place (batch_norm's running
    statistics, embedding's max_norm renormalisation), which must see the float32 parameter,
    and ops the model computes in its own dtypes (``RuntimeOp.in_float32``: rotary tables,
    whose angles in bfloat16 would round positions past 256)."""
    if op.in_float32:
        return True
    if isinstance(op, EmbeddingOp):
        return op.max_norm is not None
    return isinstance(op, (ClassLossOp, PointwiseLossOp, BatchNormOp))


_TABLE_OPS = (ElementwiseOp, UnaryOp, ConcatOp, CastOp, *_SHAPE_OPS)


def _from_integers(graph: Graph) -> set[int]:
    """Ids of the float values computed from integers (positions, counts) that carry no
    gradient: an integer cast to float, a float constant of whole numbers (positions PyTorch
    folded), and what element-wise, concatenating and view ops make of one (a rotary table's
    angles, its cos and sin). They keep the graph's dtype, as autocast leaves them: bfloat16
    rounds the integers past 256 (the angles of later positions would be their neighbours')
    and every angle to 3 significant digits."""
    carries = {v.id for v in graph.values if v.requires_grad}
    exact: set[int] = set()
    for node in graph.nodes:
        if any(v.id in carries for v in node.inputs) and not isinstance(node.op, StopGradientOp):
            carries.add(node.output.id)
            continue
        if not node.output.dtype.is_floating_point or not isinstance(node.op, _TABLE_OPS):
            continue
        if isinstance(node.op, CastOp) and not node.inputs[0].dtype.is_floating_point:
            exact.add(node.output.id)
        elif any(v.id in exact or _whole_numbers(v) for v in node.inputs):
            exact.add(node.output.id)
    return exact


def _whole_numbers(v: Value) -> bool:
    """A float constant of whole numbers, more than one (positions; not a scalar factor)."""
    data = v.data
    if v.kind != "const" or data is None or not data.is_floating_point() or data.numel() < 2:
        return False
    return bool(torch.equal(data, data.round()))


def _widened_from(v: Value, to: torch.dtype) -> Value | None:
    """The ``to`` value that ``v`` is a widening cast of (bfloat16 -> float32: casting it back
    is exact), else None."""
    producer = v.producer
    if producer is None or not isinstance(producer.op, CastOp):
        return None
    source = producer.inputs[0]
    wider = source.dtype.is_floating_point and v.dtype.itemsize > source.dtype.itemsize
    return source if wider and source.dtype == to else None


def _widens_stream(node: Node, stream: set[int], norm_sums: set[int]) -> bool:
    """Whether ``node`` is an element-wise op or dropout (or the sum an ``AddNormOp`` writes) of
    a float output with an input from the residual stream: it computes in float32 and is the
    stream."""
    op = node.op.op if isinstance(node.op, TakenInOp) else node.op
    if not isinstance(op, (ElementwiseOp, DropoutOp)) or not node.output.dtype.is_floating_point:
        return False
    if isinstance(node.op, TakenInOp) and node.output.id not in norm_sums:
        return False
    return any(v.id in stream for v in node.inputs)


def _norm_reads_in_half(v: Value, add: Node, stream: set[int]) -> bool:
    """Whether the ``AddNormOp`` writing the sum ``add`` makes can read its half-precision
    operand ``v`` as it is: as its residual, beside a stream operand of the sum's shape."""
    (other,) = [u for u in add.inputs if u.id != v.id] or [v]
    return other.id in stream and other.shape == v.shape == add.output.shape


def _addends(reads: dict[int, Value], operands, s: Value) -> list[Value]:
    """An ``AddNormOp``'s (x, residual) on the stream: what the sum's add read, x the float32
    one (the sum is the same either way round)."""
    x, residual = (reads[v.id] for v in operands)
    return [x, residual] if x.dtype == s.dtype else [residual, x]


def _norm_sums(graph: Graph) -> set[int]:
    """Ids of the sums an ``AddNormOp`` writes (its input 0, the ``TakenInOp`` add's output)
    of the add's own two operands, which the norm reads as its x and residual."""
    sums = set()
    for node in graph.nodes:
        if isinstance(node.op, AddNormOp):
            s, x, residual = node.inputs[0], *node.inputs[-2:]
            if s.producer is not None and {x.id, residual.id} == {v.id for v in s.producer.inputs}:
                sums.add(s.id)
    return sums


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
    cast back at the end where one changed): the loss is float32, its seed too.

    The residual stream stays float32, as under autocast (where a float32 embedding's output,
    plus each half-precision sublayer's, promotes to float32): an embedding reads its float32
    table as it is, and a float32 input is the stream where such ops read it (a region split
    around a call PyTorch runs gets its stream as an input); element-wise ops, dropout and views
    with a stream input compute in float32 (a half operand cast up; the sum an ``AddNormOp``
    writes reads it in half precision and writes its gradient, the upcast launching nothing either
    way: ``TakenInOp``); layer / RMS
    norms of the stream read it, and their float32 weight and bias, as they are and write their
    output in ``dtype`` for the products that read it. In half precision the stream would round
    each sublayer's small update away (8 bits of mantissa): over 50 steps of a Llama the loss
    drifted from float32's two to three times as far as autocast's (docs/performance.md, v42)."""

    def rewrite(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:

        rebuild = Rebuild(graph)
        exact = _from_integers(graph)
        norm_sums = _norm_sums(graph)
        # (old) ids of the residual stream's values, kept float32: from float32 inputs (a split
        # region's stream comes in as one) and embeddings, below
        stream = {v.id for v in graph.values if v.kind == "input" and v.dtype == torch.float32}
        norm_reads: dict[int, dict[int, Value]] = {}  # a stream sum's id -> what its AddNormOp reads
        read_in_half: set[int] = set()  # (new) ids of the half sublayer outputs an AddNormOp reads as they are
        casts: dict[tuple[int, torch.dtype], Value] = {}
        counts: Counter = Counter()

        def cast(v: Value, to: torch.dtype) -> Value:
            if v.dtype == to or not v.dtype.is_floating_point:
                return v
            narrow = _widened_from(v, to)
            if narrow is not None:
                return narrow  # a widening cast undone (the model's logits.float()): exact, so none
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
            elif _keeps_float32(op) or node.output.id in exact:
                inputs = [cast(rebuild[v], v.dtype) for v in node.inputs]
                counts["float32 op"] += 1
            elif isinstance(op, EmbeddingOp) and node.output.dtype == torch.float32:
                inputs = [rebuild[v] for v in node.inputs]  # the float32 table, read as it is
                stream.add(node.output.id)
            elif isinstance(op, LayerNormOp) and node.inputs[0].id in stream:
                inputs = [rebuild[v] for v in node.inputs]  # the stream, weight and bias as they are
                if isinstance(op, AddNormOp):
                    inputs[-2:] = _addends(norm_reads[node.inputs[0].id], node.inputs[-2:], inputs[0])
                    if inputs[-1].id in read_in_half and op.grad_copies_input0 is None:
                        op = op.writing_residual_grad()  # its upcast passes no gradient
                if op.out_dtype is None:
                    op = copy.copy(op)
                    op.out_dtype = dtype  # for the products that read it
                counts["stream norm"] += 1
            elif _widens_stream(node, stream, norm_sums):
                inputs = []
                reads: dict[int, Value] = {}
                for v in node.inputs:
                    new = rebuild[v]
                    if v.id in stream or not new.dtype.is_floating_point or new.dtype == v.dtype:
                        inputs.append(new)
                    elif isinstance(op, TakenInOp) and _norm_reads_in_half(v, node, stream):
                        reads[v.id] = new  # the norm reads it in half precision and writes its gradient:
                        read_in_half.add(new.id)  # the upcast launches nothing either way
                        upcast = TakenInOp(CastOp(v.dtype), grad_by_norm=True)
                        inputs.append(rebuild.apply(upcast, [new], f"{v.name}.in_norm"))
                        counts["stream upcast"] += 1
                    else:
                        inputs.append(cast(new, v.dtype))
                    reads.setdefault(v.id, inputs[-1])
                if isinstance(op, TakenInOp):
                    norm_reads[node.output.id] = reads
                stream.add(node.output.id)
            elif isinstance(op, CastOp) and _widened_from(rebuild[node.inputs[0]], op.dtype) is not None:
                rebuild.new[node.output.id] = cast(rebuild[node.inputs[0]], op.dtype)  # the half value itself
                continue
            elif isinstance(op, (CastOp, *_SHAPE_OPS)):  # an explicit cast stays what it says; a view
                inputs = [rebuild[v] for v in node.inputs]  # moves values in the dtype they have
                if isinstance(op, _SHAPE_OPS) and node.inputs[0].id in stream:
                    stream.add(node.output.id)
            else:
                inputs = [cast(rebuild[v], dtype) if v.dtype == torch.float32 else rebuild[v] for v in node.inputs]
            if isinstance(op, LinearCrossEntropyOp):
                op = LinearCrossEntropyOp(
                    op.linear, op.loss, out_dtype=node.output.dtype, grads=op.grads, chunk_rows=op.chunk_rows
                )
            rebuild.new[node.output.id] = rebuild.apply(op, inputs, node.name)
        for v in outputs:
            rebuild.new[v.id] = cast(rebuild[v], v.dtype)
        if not casts and not counts["stacks"] and not counts["stream norm"]:
            return graph, outputs, ""
        graph, outputs = rebuild.finish(outputs)
        names = {"param": "parameter", "input": "input", "const": "constant", "node": "value"}
        parts = [f"{dtype_name(dtype)} compute, float32 master weights"]
        parts += [f"{n} {names[kind]}{'s' if n != 1 else ''} cast" for kind, n in counts.items() if kind in names]
        if counts["stacks"]:
            parts.append(f"{counts['stacked']} of the parameters side by side in {counts['stacks']} stacked casts")
        if counts["stream norm"]:
            added = counts["stream upcast"]
            into = f", {added} half-precision sublayer outputs added to it in the norm" if added else ""
            parts.append(f"the residual stream in float32 ({counts['stream norm']} norms read it{into})")
        if counts["float32 op"]:
            parts.append(
                f"{counts['float32 op']} ops kept in float32 (losses, in-place updates, tables from positions, "
                "the model's float32 blocks)"
            )
        return graph, outputs, ", ".join(parts)

    rewrite.__name__ = f"mixed_precision_{dtype_name(dtype)}"
    return rewrite


PRECISIONS: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def precision_rewrites(precision: str | None, recompute: bool = False) -> list[RewriteFn]:
    """The rewrites ``lower(..., precision=...)`` adds after the others (None: none): mixed
    precision, then the losses' reading of the half-precision logits it made (``fold_loss_upcast``)
    and the linears' casting their float32 weights themselves (``read_master_weights``; with
    ``recompute``, cast again in the backward)."""
    if precision is None:
        return []
    if precision not in PRECISIONS:
        choices = ", ".join(PRECISIONS)
        raise ValueError(f"unknown precision {precision!r}; choose None (the graph's dtypes) or {choices}")
    return [mixed_precision(PRECISIONS[precision]), fold_loss_upcast, read_master_weights(recast=recompute)]
