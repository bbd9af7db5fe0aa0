"""``chunk_linear_cross_entropy``: cross_entropy(linear(x, W, b)) with class-index targets
becomes one op that computes the logits chunk by chunk of rows, with the loss and the
gradients of x, W and b in the forward (``LinearCrossEntropyOp``, below): the (rows x classes)
logits are never stored for the backward. For logits of ``CHUNKED_LOGITS_MIN_BYTES`` and more;
a reshape and an upcast of the logits before the loss (``logits.float()``) are taken in, and so
is a ``softcap`` activation (Gemma 2's soft-capped logits), whose cap the loss applies.
"""

from __future__ import annotations

import math

import torch

from ..core.common import ELEMENTWISE_BLOCK, acc_dtype, cdiv, sum_partials
from ..core.device import INTERPRETER
from ..core.graph import Graph, Node, Value
from ..core.runtime import ArgVisitor, Launch, OpContext, RuntimeOp
from ..ops.activation.maths import _softcap
from ..ops.activation.ops import ActivationOp
from ..ops.cast import CastOp
from ..ops.loss.kernels import (
    REDUCE_WEIGHTED_MEAN,
    class_loss_forward,
    linear_cross_entropy_backward,
    linear_cross_entropy_forward,
    loss_ratio,
)
from ..ops.loss.ops import ClassLossOp
from ..ops.products.ops import LinearOp
from ..ops.shape.ops import ViewOp
from .pipeline import Rebuild, ancestors, mib, nbytes, readers, wants_gradient

# Smallest logits tensor worth chunking. Chunking saves memory, not time (it adds the float32
# sums of dW per chunk and the scaling of the saved gradients by dy, and a few launches): below
# this size the memory is small and the extra launches cost a launch-bound step more than it saves.
CHUNKED_LOGITS_MIN_BYTES = 16 << 20

BLOCK = ELEMENTWISE_BLOCK  # the element-wise launches: dW, db summed over the chunks; the backward's scaling
# logits bytes of one chunk of rows (an automatic chunk size aims below it), and the row multiple
# a chunk keeps (the matmul tiles' BLOCK_M on the GPU)
LOGITS_CHUNK_BYTES = 1 << 22 if INTERPRETER else 256 << 20
CHUNK_ROW_MULTIPLE = 16 if INTERPRETER else 128
ROW_ALIGN = 16  # elements: a chunk's logits rows are a multiple of this long, padding included


class LinearCrossEntropyOp(RuntimeOp):
    """cross_entropy(linear(x, W, b), target) with class-index targets, "mean" or "sum", chunked
    over rows (made by ``chunk_linear_cross_entropy``, below; as Liger-Kernel's fused
    linear cross-entropy). Inputs: x (..., d), target (rows,), class weights (C,) when given, then
    W (C, d) and b (C,) when given.

    Forward, per chunk of rows: logits = x_c W^T + b (the linear's launches, into one chunk-sized
    buffer), the chunk's loss partials, lse and the logits' gradient for dy = 1 written over
    them (``class_loss_forward``, one read of the logits; soft-capped as they are read where the
    loss has a ``softcap``), then dX_c = dlogits W (into the saved dX) and
    dW_c = dlogits^T x_c, db_c (the linear's backward), added into float32 sums. The (rows, C)
    logits are never stored: the forward keeps dX, dW, db (for training) instead, each only where
    that input wants a gradient (``grads``: a frozen head, as under LoRA, computes no dW and keeps
    none). Backward: the saved gradients times dy (/ the mean's denominator), one launch each."""

    kernel = linear_cross_entropy_forward
    saves_inputs = ()

    def __init__(
        self,
        linear: RuntimeOp,
        loss: ClassLossOp,
        *,
        out_dtype: torch.dtype,
        grads: tuple[bool, bool, bool] = (False, False, False),
        chunk_rows=None,
    ):
        """``grads``: whether x, W and b want a gradient (computed in the forward; all False: inference)."""
        if loss.target_probs or loss.reduction == "none" or not loss.from_logits:
            raise ValueError("linear + cross_entropy is chunked for class-index targets and mean or sum only")
        self.linear, self.loss, self.out_dtype = linear, loss, out_dtype
        self.grads, self.chunk_rows = tuple(grads), chunk_rows
        self.with_grads = any(self.grads)
        self.name = "linear_cross_entropy"
        self.has_bias, self.has_weight = bool(linear.has_bias), loss.has_weight
        self.n_activation_inputs = 2 + self.has_weight
        n = self.n_activation_inputs
        self.differentiable_inputs = (0, n) + ((n + 1,) if self.has_bias else ())

    # --- shapes --------------------------------------------------------------------------
    def _split(self, items: list):
        """(x, target, class weight, W, b) out of a list laid out like the inputs."""
        n = self.n_activation_inputs
        weight = items[2] if self.has_weight else None
        return items[0], items[1], weight, items[n], items[n + 1] if self.has_bias else None

    def _sizes(self, input_shapes) -> tuple[int, int, int]:
        x, _, _, w, _ = self._split(list(input_shapes))
        return math.prod(x[:-1]), w[1], w[0]  # rows, in_features, classes

    def check_inputs(self, input_shapes, input_dtypes):
        x, target, weight, w, b = self._split(list(input_shapes))
        dx, dt, dweight, dw, db = self._split(list(input_dtypes))
        self.linear.check_inputs([x, w] + ([b] if b is not None else []), [dx, dw] + ([db] if b is not None else []))
        rows, _, classes = self._sizes(input_shapes)
        logits = [(rows, classes), target] + ([weight] if weight is not None else [])
        self.loss.check_inputs(logits, [dx, dt] + ([dweight] if weight is not None else []))

    def output_shape(self, input_shapes):
        return ()

    def output_dtype(self, input_dtypes):
        return self.out_dtype

    def flops(self, input_shapes, grad_mask):
        """The head's products; with ``with_grads`` its backward's products run in the forward."""
        n = self.n_activation_inputs
        mask = [self.grads[0], self.grads[1]]
        forward, backward = self.linear.flops([input_shapes[0], input_shapes[n]], mask)
        return (forward + backward, 0) if self.with_grads else (forward, 0)

    def _mean(self) -> bool:
        return self.loss.reduction == "mean"

    def extra_outputs(self, input_shapes, dtype):
        rows, features, classes = self._sizes(input_shapes)
        acc = acc_dtype(dtype)
        extras = {"sums": ((2,), acc)} if self._mean() else {}  # the loss and the target weights, summed
        dx, dw, db = self.grads
        if dx:
            extras["grad_input"] = (tuple(input_shapes[0]), dtype)
        if dw:
            extras["grad_weight"] = ((classes, features), acc)
        if db and self.has_bias:
            extras["grad_bias"] = ((classes,), acc)
        return extras

    def chunk_size(self, rows: int, classes: int, dtype: torch.dtype) -> int:
        """Rows per chunk: ``chunk_rows``, or as many as keep a chunk's logits near
        ``LOGITS_CHUNK_BYTES`` (in equal chunks of a multiple of ``CHUNK_ROW_MULTIPLE`` rows)."""
        if self.chunk_rows:
            return max(1, min(self.chunk_rows, rows))
        chunks = max(1, cdiv(rows * classes * dtype.itemsize, LOGITS_CHUNK_BYTES))
        return max(1, min(rows, cdiv(cdiv(rows, chunks), CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE))

    # --- forward -------------------------------------------------------------------------
    def _linear(self, ctx, x, w, b, logits, dlogits=None, dx=None, dw=None, db=None) -> list[Launch]:
        """The linear's launches on a chunk: forward into ``logits``, or (``dlogits`` given) backward."""
        inputs = [x, w] + ([b] if b is not None else [])
        node = dict(node_name=ctx.node_name, dtype=ctx.dtype, instances=ctx.instances, dry_run=ctx.dry_run)
        if dlogits is None:
            sub = OpContext.for_forward(self.linear, **node, inputs=inputs, output=logits)
            return self.linear.forward_launches(sub)
        grads = [dx, dw] + ([db] if b is not None else [])
        sub = OpContext.for_backward(
            self.linear, **node, inputs=inputs, output=logits, grad_output=dlogits, grads=grads
        )
        return self.linear.backward_launches(sub)

    def forward_launches(self, ctx):
        x, target, weight, w, b = self._split([*ctx.inputs, *ctx.params])
        rows, features, classes = self._sizes(ctx.input_shapes)
        x = x.reshape(rows, features)
        chunk = self.chunk_size(rows, classes, ctx.dtype)
        acc = acc_dtype(ctx.dtype)
        mode = self.loss.reduction_mode()
        starts = list(range(0, rows, chunk)) or [0]  # no rows: one empty chunk (the mean of nothing is NaN)
        sizes = [min(chunk, rows - start) for start in starts]
        programs = [max(1, cdiv(n, self.loss.tile_shape(n, classes)[0])) for n in sizes]
        partials = ctx.empty((sum(programs), 2 if mode == REDUCE_WEIGHTED_MEAN else 1), acc)
        # rows padded to a multiple of 16 elements: the products read and write the logits in
        # place through TMA (16 bytes would do for it; a vocabulary of 50,257 took padded copies
        # each way), and the loss kernel reads and writes whole padded rows in wide vectors (its
        # row length and offsets divisible by 16, as Triton specialises integers)
        padded = cdiv(classes, ROW_ALIGN) * ROW_ALIGN
        logits, lse = ctx.empty((chunk, padded))[:, :classes], ctx.empty((chunk,), acc)
        bad_index = None
        if self.loss.check_indices:
            bad_index = ctx.zeros((1,), torch.int64)
            ctx.check_after(bad_index, lambda index: self.loss.describe_bad_index(index, classes))
        if self.with_grads:
            dx = ctx.saved["grad_input"].view(rows, features) if self.grads[0] else None
            dw_chunk = ctx.empty((classes, features)) if self.grads[1] else None
            db_chunk = ctx.empty((classes,)) if b is not None and self.grads[2] else None
        launches, first_program = [], 0
        for start, n, count in zip(starts, sizes, programs):
            x_c, target_c, logits_c, lse_c = x[start : start + n], target[start : start + n], logits[:n], lse[:n]
            launches += self._linear(ctx, x_c, w, b, logits_c)
            shape = (n, classes)
            args = self.loss.kernel_args(
                logits_c, target_c, weight=weight, lse=lse_c, mass=None, shape=shape, padded_rows=padded
            )
            out = partials[first_program : first_program + count]
            grad = logits_c if self.with_grads else None  # the loss sum's gradient, over the logits
            visitor = ArgVisitor().visit(out_ptr=out, bad_index_ptr=bad_index, grad_ptr=grad, **args)
            launches.append(Launch(class_loss_forward, (count,), visitor, work=n))
            first_program += count
            if not self.with_grads:
                continue
            dx_c = None if dx is None else dx[start : start + n]
            launches += self._linear(ctx, x_c, w, b, logits_c, logits_c, dx_c, dw_chunk, db_chunk)
            for part, name in ((dw_chunk, "grad_weight"), (db_chunk, "grad_bias")):
                if part is not None:
                    total = ctx.saved[name]
                    visitor = ArgVisitor().visit(chunk_ptr=part, total_ptr=total, n=part.numel(), FIRST=start == 0)
                    launches.append(Launch(linear_cross_entropy_forward, (cdiv(part.numel(), BLOCK),), visitor, BLOCK))
        if mode == REDUCE_WEIGHTED_MEAN:
            sums = ctx.saved["sums"]
            ratio = Launch(loss_ratio, (1,), ArgVisitor().visit(sums_ptr=sums, out_ptr=ctx.output), work=1)
            return [*launches, *sum_partials(partials, sums), ratio]
        return [*launches, *sum_partials(partials, ctx.output)]

    # --- backward ------------------------------------------------------------------------
    def backward_launches(self, ctx):
        dx, _, _, dw, db = self._split([*ctx.grad_inputs, *ctx.grad_params])
        sums = ctx.saved.get("sums")
        den = sums[1:] if sums is not None else None
        launches = []
        for grad, name in ((dx, "grad_input"), (dw, "grad_weight"), (db, "grad_bias")):
            if grad is not None:  # (a gradient the forward did not compute: a KeyError, never a silent zero)
                n = grad.numel()
                visitor = ArgVisitor().visit(
                    grad_ptr=ctx.saved[name], dy_ptr=ctx.grad_output, den_ptr=den, out_ptr=grad, n=n
                )
                launches.append(Launch(linear_cross_entropy_backward, (cdiv(n, BLOCK),), visitor, BLOCK))
        return launches


def _link(node: Node) -> str | None:
    """What ``node`` is as a step from a linear's logits to a loss that the fused op takes in:
    "reshape", "upcast" (an exact one: ``logits.float()`` before the loss, as Hugging Face's loss
    does) or "softcap" (the activation ``ops.softcap``, a finite cap); None for anything else."""
    op = node.op
    if type(op) is ViewOp:
        return "reshape"
    if type(op) is CastOp:
        source, target = node.inputs[0].dtype, op.dtype
        exact = source.is_floating_point and target.is_floating_point and target.itemsize >= source.itemsize
        return "upcast" if exact else None
    if type(op) is ActivationOp and op.fn is _softcap and math.isfinite(op.a):
        return "softcap"
    return None


def _logits_chain(node: Node | None) -> list[Node | None]:
    """The nodes from the linear that made a loss's logits to the loss: a reshape to (rows,
    classes), an exact upcast and a soft cap (``_link``) may come between, once each, in any
    order. First the candidate linear (or None)."""
    chain: list[Node | None] = []
    seen: set[str] = set()
    while node is not None and (link := _link(node)) is not None and link not in seen:
        seen.add(link)
        chain.insert(0, node)
        node = node.inputs[0].producer
    return [node, *chain]


def chunk_linear_cross_entropy(graph: Graph, outputs: list[Value], training: bool) -> tuple[Graph, list[Value], str]:
    """cross_entropy(linear(x, W, b)) (class indices, mean or sum; the logits possibly reshaped
    to (rows, classes), upcast and soft-capped in between) becomes one ``LinearCrossEntropyOp``
    that computes the logits chunk by chunk and never keeps them (see its docstring), when nothing
    else reads the logits, they are not an output and they take at least ``CHUNKED_LOGITS_MIN_BYTES``.
    A ``softcap`` activation's cap goes to the loss (``ClassLossOp.with_softcap``), unless the
    loss caps the logits itself (two caps one after the other are not one)."""
    needed, read_by = ancestors(outputs), readers(graph)
    kept = {v.id for v in outputs}
    # loss node id -> (linear node, the reshape, upcast and soft cap after it)
    matches: dict[int, tuple[Node, list[Node]]] = {}
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
        if nbytes(linear.output) < CHUNKED_LOGITS_MIN_BYTES:
            continue
        if any(n.output.id in kept or len(read_by[n.output.id]) != 1 for n in chain):
            continue
        if any(v.dtype.is_floating_point and v.dtype != linear.output.dtype for v in node.inputs[1:]):
            continue  # class weights in the upcast dtype: the fused op computes in the linear's
        if op.softcap and any(_link(n) == "softcap" for n in chain[1:]):
            continue  # capped logits capped again: not one soft cap
        matches[node.id] = (linear, chain[1:])
    if not matches:
        return graph, outputs, ""
    rebuild = Rebuild(graph)
    wants = wants_gradient()
    capped = 0  # fused losses of soft-capped logits

    def fuse(node: Node, match: tuple[Node, list[Node]]) -> None:
        nonlocal capped
        linear, links = match
        loss = node.op
        for link in links:
            if _link(link) == "softcap":
                loss = loss.with_softcap(link.op.a)
        capped += loss.softcap > 0
        x, params = linear.inputs[0], linear.inputs[1:]
        weight, bias = params[0], params[1] if len(params) > 1 else None
        grads = tuple(training and wants(v) for v in (x, weight, bias))  # the gradients the forward computes
        fused = LinearCrossEntropyOp(linear.op, loss, out_dtype=node.output.dtype, grads=grads)
        inputs = [x, *node.inputs[1:], *params]
        rebuild.new[node.output.id] = rebuild.apply(fused, [rebuild[v] for v in inputs], node.name)

    rebuild.replace({n.id for linear, rest in matches.values() for n in (linear, *rest)}, matches, fuse)
    logits_bytes = sum(nbytes(linear.output) for linear, _ in matches.values())
    graph, outputs = rebuild.finish(outputs)
    what = f" ({capped} of soft-capped logits)" if capped else ""
    return (
        graph,
        outputs,
        f"cross_entropy(linear) in chunks of rows: {len(matches)}{what}, logits ({mib(logits_bytes)}) never stored",
    )
