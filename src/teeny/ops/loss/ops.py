"""The loss RuntimeOps: ``PointwiseLossOp`` (every element-wise loss, its maths a pair of
functions of ``maths.py``) and ``ClassLossOp`` (cross-entropy and NLL over a class dim), with
their launches, tile sizes and reduction modes."""

from __future__ import annotations

import copy
import math

import torch
import triton.language as tl

from ...core import config
from ...core.common import ELEMENTWISE_BLOCK, acc_dtype, cdiv, pow2, sum_partials
from ...core.device import INTERPRETER
from ...core.errors import TeenyError
from ...core.kernel import dtype_name
from ...core.runtime import ArgVisitor, Launch, RuntimeOp
from .kernels import (
    REDUCE_MEAN,
    REDUCE_NONE,
    REDUCE_SUM,
    REDUCE_WEIGHTED_MEAN,
    class_loss_backward,
    class_loss_forward,
    loss_ratio,
    pointwise_loss_backward,
    pointwise_loss_forward,
)

BLOCK = ELEMENTWISE_BLOCK  # element-wise losses
MAX_BLOCK_C = 4096  # widest column block of the row kernels (longer rows loop)
# rows x columns handled by one program of the row kernels (the interpreter pays per program, not per element)
ROW_TILE = 65536 if INTERPRETER else 4096

REDUCTIONS = ("none", "mean", "sum")  # kl_div adds "batchmean"


def check_reduction(reduction, allowed=REDUCTIONS) -> str:
    """``reduction``, or a ValueError naming the allowed ones."""
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, allowed))}, got {reduction!r}")
    return reduction


def _suffix_broadcasts(shape, target_shape) -> bool:
    """Whether ``shape`` broadcasts to ``target_shape`` by repetition over leading dims
    (weight index = flat index % weight numel)."""
    stripped = list(shape)
    while stripped and stripped[0] == 1:
        stripped.pop(0)
    if len(stripped) > len(target_shape):
        return False
    return tuple(stripped) == tuple(target_shape[len(target_shape) - len(stripped) :])


class PointwiseLossOp(RuntimeOp):
    """An element-wise loss: inputs (input, target[, weight][, pos_weight]).
    ``loss``/``grad`` are its @triton.jit maths; weights get no gradient (as in PyTorch)."""

    kernel = pointwise_loss_forward
    n_activation_inputs = 2
    saves_inputs = True

    def __init__(
        self, name, *, loss, grad, reduction="mean", kink=0.0, has_weight=False, has_pos_weight=False, divisor=None
    ):
        self.name, self.loss, self.grad = name, loss, grad
        self.reduction, self.kink = reduction, float(kink)
        self.has_weight, self.has_pos_weight = has_weight, has_pos_weight
        self.divisor = divisor  # fn(input_shape) -> the "mean" divisor (default numel)
        self.n_activation_inputs = 2 + has_weight + has_pos_weight

    def check_inputs(self, input_shapes, input_dtypes):
        x, t = input_shapes[0], input_shapes[1]
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"input must be floating point, got {dtype_name(input_dtypes[0])}")
        if not input_dtypes[1].is_floating_point:
            raise TypeError(f"target must be floating point like the input, got {dtype_name(input_dtypes[1])}")
        if tuple(x) != tuple(t):
            raise ValueError(f"target shape {tuple(t)} must equal the input shape {tuple(x)}")
        names = ["weight"] * self.has_weight + ["pos_weight"] * self.has_pos_weight
        for name, shape in zip(names, input_shapes[2:]):
            if not _suffix_broadcasts(shape, x):
                raise ValueError(
                    f"{name} of shape {tuple(shape)} must broadcast over the input {tuple(x)} along "
                    f"its trailing dims (e.g. {tuple(x[-1:])} or {tuple(x)})"
                )

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0]) if self.reduction == "none" else ()

    def _args(self, inputs) -> dict:
        """The arguments both kernels take: input, target, the weights and the scalars."""
        x, t = inputs[0], inputs[1]
        w = inputs[2] if self.has_weight else None
        pw = inputs[2 + self.has_weight] if self.has_pos_weight else None
        mode = {"none": REDUCE_NONE, "sum": REDUCE_SUM, "mean": REDUCE_MEAN}[self.reduction]
        divisor = self.divisor(x.shape) if self.divisor is not None else math.prod(x.shape)
        return dict(
            x_ptr=x,
            t_ptr=t,
            w_ptr=w,
            pw_ptr=pw,
            n=x.numel(),
            w_numel=w.numel() if w is not None else 1,
            pw_numel=pw.numel() if pw is not None else 1,
            kink=self.kink,
            divisor=divisor,
            REDUCTION=mode,
        )

    def forward_launches(self, ctx):
        n = ctx.inputs[0].numel()
        if self.reduction == "none":
            args = ArgVisitor().visit(out_ptr=ctx.output, LOSS=self.loss, **self._args(ctx.inputs))
            return [Launch(pointwise_loss_forward, (cdiv(n, BLOCK),), args, BLOCK, work=n)]
        programs = max(cdiv(n, BLOCK), 1)  # one program even for no elements: the mean of nothing is NaN
        partials = ctx.empty((programs, 1), acc_dtype(ctx.dtype))
        args = ArgVisitor().visit(out_ptr=partials, LOSS=self.loss, **self._args(ctx.inputs))
        return [Launch(pointwise_loss_forward, (programs,), args, BLOCK, work=n), *sum_partials(partials, ctx.output)]

    def backward_launches(self, ctx):
        _refuse_weight_grads(ctx, range(2, len(ctx.grad_inputs)))
        dx, dt = ctx.grad_inputs[0], ctx.grad_inputs[1]
        if dx is None and dt is None:
            return []
        n = ctx.inputs[0].numel()
        args = ArgVisitor().visit(
            dy_ptr=ctx.grad_output, dx_ptr=dx, dt_ptr=dt, GRAD=self.grad, **self._args(ctx.inputs)
        )
        return [Launch(pointwise_loss_backward, (cdiv(n, BLOCK),), args, BLOCK, work=n)]


def _refuse_weight_grads(ctx, indices) -> None:
    for i in indices:
        if i < len(ctx.grad_inputs) and ctx.grad_inputs[i] is not None:
            raise TeenyError(
                f"op {ctx.op.name} (node '{ctx.node_name}'): the loss is not differentiable with "
                "respect to its weight (as in PyTorch); pass the weight as a constant or an input "
                "that does not require a gradient"
            )


def check_softcap(softcap, name: str) -> float:
    """``softcap`` as a float: 0 (no cap) or a positive finite number, else a ValueError naming
    it and the op ``name``."""
    value = float(softcap)
    if value != 0.0 and not 0.0 < value < math.inf:
        raise ValueError(f"{name}: softcap must be a positive finite number (or 0: no cap), got {softcap}")
    return value


class ClassLossOp(RuntimeOp):
    """Cross-entropy (``from_logits``) or NLL over the class dim 1: inputs (input, target[, weight]).
    ``softcap`` > 0: cross-entropy of class indices on the soft-capped logits softcap * tanh(x / softcap)
    (Gemma 2's ``final_logit_softcapping``), the cap applied as the kernels read the logits.
    ``out_dtype``: the loss's dtype when it is not the input's: float32 for half-precision logits
    read as they are (``fusions.loss_upcast``), computed in float32 as always, their gradient
    written in their own dtype."""

    kernel = class_loss_forward
    n_activation_inputs = 2
    saves_inputs = True
    grad_rows_padded = (0,)  # dx written through its sample stride (rows padded for the head's products)

    def __init__(
        self,
        name,
        *,
        from_logits,
        reduction="mean",
        ignore_index=-100,
        label_smoothing=0.0,
        has_weight=False,
        softcap=0.0,
        out_dtype=None,
    ):
        self.name, self.from_logits, self.reduction = name, from_logits, reduction
        self.out_dtype = out_dtype
        self.ignore_index, self.label_smoothing = int(ignore_index), float(label_smoothing)
        self.has_weight = has_weight
        self.softcap = check_softcap(softcap, name)
        if self.softcap and not from_logits:
            raise ValueError(f"{name}: softcap caps logits: it is for cross-entropy, not for log-probabilities")
        self.n_activation_inputs = 2 + has_weight
        self.target_probs = False  # decided from the target's dtype in check_inputs
        self.check_indices = config.check_indices  # read at trace time (see teeny.core.config)

    def with_softcap(self, softcap: float) -> ClassLossOp:
        """This cross-entropy of the logits soft-capped at ``softcap`` first (a ``softcap``
        activation before the loss, folded into it by ``fusions.chunked_loss``)."""
        if self.softcap or not self.from_logits:
            raise ValueError(f"{self.name}: a soft cap goes on logits without one, got softcap={self.softcap}")
        capped = copy.copy(self)
        capped.softcap = check_softcap(softcap, self.name)
        return capped

    # --- shapes --------------------------------------------------------------------------
    def check_inputs(self, input_shapes, input_dtypes):
        x, t = tuple(input_shapes[0]), tuple(input_shapes[1])
        what = "logits" if self.from_logits else "log-probabilities"
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"input ({what}) must be floating point, got {dtype_name(input_dtypes[0])}")
        if len(x) == 0:
            raise ValueError(
                f"input ({what}) must have a class dimension: shape (C,), (N, C) or (N, C, d1, ...), got ()"
            )
        n_classes = x[0] if len(x) == 1 else x[1]
        if n_classes == 0:
            raise ValueError(f"input {x} has no classes (class dim 1 has size 0)")
        self.target_probs = input_dtypes[1].is_floating_point
        if self.target_probs:
            if not self.from_logits:
                raise TypeError(f"target must be class indices (int64), got {dtype_name(input_dtypes[1])}")
            if self.softcap:
                raise TypeError(
                    f"softcap is for class-index targets (int64), got class probabilities of dtype "
                    f"{dtype_name(input_dtypes[1])}"
                )
            if t != x:
                raise ValueError(
                    f"class-probability target of shape {t} must have the input's shape {x} "
                    "(or give class indices as an int64 tensor of shape (N, d1, ...))"
                )
        else:
            if input_dtypes[1] not in (torch.int64, torch.uint8):
                raise TypeError(
                    f"target must be class indices of dtype int64 (or class probabilities of the "
                    f"input's float dtype), got {dtype_name(input_dtypes[1])}"
                )
            expected = () if len(x) == 1 else x[:1] + x[2:]
            if t != expected:
                raise ValueError(f"class-index target of shape {t} does not match input {x}: expected {expected}")
        if self.has_weight and tuple(input_shapes[2]) != (n_classes,):
            raise ValueError(f"weight must have shape ({n_classes},) (one per class), got {tuple(input_shapes[2])}")

    def output_dtype(self, input_dtypes):
        return self.out_dtype or input_dtypes[0]

    def output_shape(self, input_shapes):
        x = tuple(input_shapes[0])
        if self.reduction != "none":
            return ()
        return () if len(x) == 1 else x[:1] + x[2:]

    def _dims(self, shape):
        n_classes = shape[0] if len(shape) == 1 else shape[1]
        inner = math.prod(shape[2:])
        return math.prod(shape) // n_classes, n_classes, inner

    def tile_shape(self, n_rows, n_classes):
        """(ROWS, BLOCK_C) of the row kernels: a column block of up to ``MAX_BLOCK_C``, rows to fill ``ROW_TILE``."""
        block_c = min(pow2(n_classes), MAX_BLOCK_C)
        rows = max(1, min(ROW_TILE // block_c, pow2(n_rows)))
        return rows, block_c

    def reduction_mode(self) -> tl.constexpr:
        """The kernels' REDUCTION: class-index means divide by the sum of the target weights."""
        if self.reduction == "none":
            return REDUCE_NONE
        if self.reduction == "sum":
            return REDUCE_SUM
        return REDUCE_MEAN if self.target_probs else REDUCE_WEIGHTED_MEAN  # class indices: by the target weights

    def extra_outputs(self, input_shapes, dtype):
        n_rows = self._dims(input_shapes[0])[0]
        acc = acc_dtype(dtype)
        extras = {}
        if self.from_logits:
            extras["lse"] = ((n_rows,), acc)
        if self.target_probs:
            extras["target_mass"] = ((n_rows,), acc)
        if self.reduction_mode() == REDUCE_WEIGHTED_MEAN:
            extras["sums"] = ((2,), acc)  # the loss and the target weights, summed
        return extras

    def _args(self, ctx) -> dict:
        """The arguments both kernels take."""
        weight = ctx.inputs[2] if self.has_weight else None
        return self.kernel_args(
            ctx.inputs[0],
            ctx.inputs[1],
            weight=weight,
            lse=ctx.saved.get("lse"),
            mass=ctx.saved.get("target_mass"),
            shape=ctx.input_shapes[0],
        )

    def kernel_args(self, x, target, *, weight, lse, mass, shape, padded_rows=None) -> dict:
        """The arguments both kernels take, for input ``x`` of ``shape`` (also a chunk of rows of
        the logits ``padded_rows`` elements apart, padding included: ``fusions.chunked_loss.LinearCrossEntropyOp``)."""
        n_rows, n_classes, inner = self._dims(shape)
        rows, block_c = self.tile_shape(n_rows, n_classes)
        return dict(
            x_ptr=x,
            target_ptr=target,
            weight_ptr=weight,
            lse_ptr=lse,
            mass_ptr=mass,
            n_rows=n_rows,
            n_classes=n_classes,
            inner=inner,
            sample_stride=padded_rows or n_classes * inner,
            row_len=padded_rows or n_classes,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            # eps / C on the host: under the interpreter a float argument divided by an int one is float32
            smoothing_per_class=self.label_smoothing / n_classes,
            divisor=n_rows,
            softcap=self.softcap,
            SMOOTHING=self.label_smoothing > 0,
            SOFTCAP=self.softcap > 0,
            REDUCTION=self.reduction_mode(),
            ROWS=rows,
            BLOCK_C=block_c,
        )

    # --- forward -------------------------------------------------------------------------
    def forward_launches(self, ctx):
        args = self._args(ctx)
        n_rows, n_classes, programs = args["n_rows"], args["n_classes"], cdiv(args["n_rows"], args["ROWS"])
        mode = args["REDUCTION"]
        bad_index = None
        if self.check_indices and not self.target_probs:
            bad_index = ctx.zeros((1,), torch.int64)
            ctx.check_after(bad_index, lambda index: self.describe_bad_index(index, n_classes))
        if mode == REDUCE_NONE:
            out, single = ctx.output, False
        else:
            programs = max(programs, 1)  # one program even for no rows: the mean of nothing is NaN
            single = programs == 1  # its sums are final: written in place, with no second pass
            if single and mode == REDUCE_WEIGHTED_MEAN:
                out = ctx.saved["sums"]
            elif single and ctx.output.dtype == acc_dtype(ctx.dtype):
                out = ctx.output
            else:
                single = False
                out = ctx.empty((programs, 2 if mode == REDUCE_WEIGHTED_MEAN else 1), acc_dtype(ctx.dtype))
        launch = Launch(
            class_loss_forward,
            (programs,),
            ArgVisitor().visit(out_ptr=out, bad_index_ptr=bad_index, **args),
            work=n_rows,
        )
        if mode == REDUCE_NONE:
            return [launch]
        if mode == REDUCE_SUM or mode == REDUCE_MEAN:
            return [launch] if single else [launch, *sum_partials(out, ctx.output)]
        sums = ctx.saved["sums"]
        ratio = Launch(loss_ratio, (1,), ArgVisitor().visit(sums_ptr=sums, out_ptr=ctx.output), work=1)
        return [launch, ratio] if single else [launch, *sum_partials(out, sums), ratio]

    def describe_bad_index(self, index: int, n_classes: int) -> str:
        """The error for an out-of-range class index (``check_indices``)."""
        return (
            f"target class index {index} is out of range: the input has {n_classes} classes (0 to "
            f"{n_classes - 1}) and ignore_index is {self.ignore_index} (teeny.core.config.check_indices)"
        )

    # --- backward ------------------------------------------------------------------------
    def backward_launches(self, ctx):
        _refuse_weight_grads(ctx, [2])
        dx = ctx.grad_inputs[0]
        dtarget = ctx.grad_inputs[1] if self.target_probs else None
        if dx is None and dtarget is None:
            return []
        fields = self._args(ctx)
        sums = ctx.saved.get("sums")
        args = ArgVisitor().visit(
            dy_ptr=ctx.grad_output,
            den_ptr=sums[1:] if sums is not None else None,  # the sum of the target weights
            dx_ptr=dx,
            dtarget_ptr=dtarget,
            dx_sample_stride=dx.stride(0) if dx is not None and dx.dim() == 2 else fields["sample_stride"],
            **fields,
        )
        grid = (cdiv(fields["n_rows"], fields["ROWS"]),)
        return [Launch(class_loss_backward, grid, args, work=ctx.inputs[0].numel())]
