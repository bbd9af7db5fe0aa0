"""Losses: element-wise losses (MSE, L1, smooth L1, Huber, BCE, BCE with logits, KL divergence)
and row losses over classes (cross-entropy, NLL), with reduction "none" | "mean" | "sum".

Element-wise losses share one kernel pair. ``pointwise_loss_forward`` computes
l_i = w_i * LOSS(x_i, t_i) (w: an optional weight broadcast over the input, pos_weight an
optional argument of the maths, ``kink`` where smooth L1 and Huber turn from quadratic to
linear: beta, delta); ``pointwise_loss_backward`` computes dx_i = dy_i * w_i * dLOSS/dx and
dt_i = dy_i * w_i * dLOSS/dt (dy_i = dy / divisor when reduced: divisor = n for "mean", batch
size for "batchmean", 1 for "sum"). At the kinks the derivatives are PyTorch's: sign(0) = 0 for
L1 (and smooth L1 with beta = 0), d / beta = sign(d) at |d| = beta, clamp(d, -delta, delta) for
Huber; KL divergence's target gradient log(t) + 1 - x is NaN at t = 0, as PyTorch's.

Reductions to a scalar never use atomics: each program writes the fp32 (fp64 for float64)
sum of its block (for "mean", divided by the divisor) to a partials buffer that
``common.sum_partials`` adds into the loss. A mean weighted by the data (class losses: the sum
of the target classes' weights) sums the loss and the weights side by side, and ``loss_ratio``
divides them (bit-reproducible).

Cross-entropy and NLL are one fused row kernel pair (``class_loss_forward``/``_backward``)
over rows of C classes (input (N, C) or (N, C, d1, ...), class stride d1*...):

    lse = log sum_c exp(x_c)                      online over column blocks (any C)
    class index t:  loss = (1-eps) w_t (lse - x_t) + eps/C sum_c w_c (lse - x_c)
                    dx_c = s [(1-eps) w_t (p_c - [c=t]) + eps/C (W p_c - w_c)],  p = exp(x - lse), W = sum w
    probabilities q (q' = (1-eps) q + eps/C):
                    loss = sum_c w_c q'_c (lse - x_c)
                    dx_c = s (p_c sum_j w_j q'_j - w_c q'_c),  dq_c = s (1-eps) w_c (lse - x_c)

with s = dy (per row) or dy / denominator ("mean": sum of w_t over non-ignored rows for class
indices, number of rows for probabilities). NLL is the same kernel on log-probabilities
(no lse: lse = 0, p = 0, eps = 0). The forward saves only lse per row (and, for probability
targets, the per-row target mass sum_c w_c q'_c); the backward writes dx straight into the
gradient buffer from the saved logits and lse: no other logits-sized buffer exists.

Rows whose target is ignore_index give loss 0 and gradient 0. A class index outside [0, C)
that is not ignore_index is never read out of bounds (the load is masked). With
``teeny.config.check_indices`` (on by default on the CPU) the forward writes it to a flag and
the run raises an error naming the op and the index; without the check its row's loss and
gradient are NaN, which makes a reduced loss NaN. BCE inputs outside [0, 1] give NaN instead
of PyTorch's error.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import config
from ..device import INTERPRETER
from ..graph import Tensor, graph_of
from ..kernel import dtype_name, kernel
from ..module import Module
from ..registry import OpInfo, Sample, away_from, make, register
from ..runtime import ArgVisitor, Launch, OpContext, RuntimeOp, TeenyError
from .common import ELEMENTWISE_BLOCK, acc_dtype, cdiv, pow2, sum_partials, upcast

__all__ = [
    "mse_loss",
    "mse",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "nll_loss",
    "cross_entropy",
]
NN_LAYERS = [
    "MSELoss",
    "L1Loss",
    "SmoothL1Loss",
    "HuberLoss",
    "BCELoss",
    "BCEWithLogitsLoss",
    "KLDivLoss",
    "NLLLoss",
    "CrossEntropyLoss",
]

BLOCK = ELEMENTWISE_BLOCK  # element-wise losses
MAX_BLOCK_C = 4096  # widest column block of the row kernels (longer rows loop)
# rows x columns handled by one program of the row kernels (the interpreter pays per program, not per element)
ROW_TILE = 65536 if INTERPRETER else 4096

_REDUCTIONS = ("none", "mean", "sum")

# REDUCTION: what the kernels do with the per-element (per-row) losses
REDUCE_NONE = tl.constexpr(0)  # store each one
REDUCE_SUM = tl.constexpr(1)  # a partial sum per program
REDUCE_MEAN = tl.constexpr(2)  # a partial sum per program, divided by ``divisor``
REDUCE_WEIGHTED_MEAN = tl.constexpr(3)  # partial sums of the loss and of the target weights (class losses)


# ======================================================================= element-wise kernels


@triton.jit
def _broadcast_load(ptr, offsets, numel, mask, like):
    """ptr[offsets % numel] (a tensor broadcast over the input's trailing dims); 1 without ptr."""
    if ptr is not None:
        return upcast(tl.load(ptr + offsets % numel, mask=mask, other=0.0))
    else:
        return tl.full(like.shape, 1.0, like.dtype)


@kernel(half=True, optional=("w_ptr", "pw_ptr", "dx_ptr", "dt_ptr"))
def pointwise_loss_backward(
    x_ptr,
    t_ptr,
    w_ptr,
    pw_ptr,
    dy_ptr,
    dx_ptr,
    dt_ptr,
    n,
    w_numel,
    pw_numel,
    kink,
    divisor,
    GRAD: tl.constexpr,
    REDUCTION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.5))  # 0.5: a harmless value for every loss
    t = upcast(tl.load(t_ptr + offsets, mask=mask, other=0.5))
    pw = _broadcast_load(pw_ptr, offsets, pw_numel, mask, x)
    if REDUCTION == REDUCE_NONE:
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    elif REDUCTION == REDUCE_MEAN:
        dy = upcast(tl.load(dy_ptr)) / divisor
    else:
        dy = upcast(tl.load(dy_ptr))
    scale = dy * _broadcast_load(w_ptr, offsets, w_numel, mask, x)
    dx, dt = GRAD(x, t, pw, kink)
    if dx_ptr is not None:
        tl.store(dx_ptr + offsets, (dx * scale).to(dx_ptr.dtype.element_ty), mask=mask)
    if dt_ptr is not None:
        tl.store(dt_ptr + offsets, (dt * scale).to(dt_ptr.dtype.element_ty), mask=mask)


@kernel(backward=pointwise_loss_backward, half=True, optional=("w_ptr", "pw_ptr"))
def pointwise_loss_forward(
    x_ptr,
    t_ptr,
    w_ptr,
    pw_ptr,
    out_ptr,
    n,
    w_numel,
    pw_numel,
    kink,
    divisor,
    LOSS: tl.constexpr,
    REDUCTION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out: the loss per element (REDUCE_NONE), or one fp32/fp64 partial sum per program."""
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.5))  # 0.5: a harmless value for every loss
    t = upcast(tl.load(t_ptr + offsets, mask=mask, other=0.5))
    pw = _broadcast_load(pw_ptr, offsets, pw_numel, mask, x)
    loss = LOSS(x, t, pw, kink) * _broadcast_load(w_ptr, offsets, w_numel, mask, x)
    if REDUCTION == REDUCE_NONE:
        tl.store(out_ptr + offsets, loss.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        partial = tl.sum(tl.where(mask, loss, 0.0), axis=0)
        if REDUCTION == REDUCE_MEAN:
            partial = partial / divisor
        tl.store(out_ptr + pid, partial)


@kernel(half=True)
def loss_ratio(sums_ptr, out_ptr):
    """out = sums[0] / sums[1]: a weighted mean from the sums of the loss and of the weights."""
    tl.store(out_ptr, (tl.load(sums_ptr) / tl.load(sums_ptr + 1)).to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------ element-wise loss maths
# LOSS(x, t, pw, kink) -> l and GRAD(x, t, pw, kink) -> (dl/dx, dl/dt), in float32/64.


@triton.jit
def _sign(d):
    return tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))


@triton.jit
def _mse(x, t, pw, kink):
    return (x - t) * (x - t)


@triton.jit
def _mse_grad(x, t, pw, kink):
    return 2.0 * (x - t), 2.0 * (t - x)


@triton.jit
def _l1(x, t, pw, kink):
    return tl.abs(x - t)


@triton.jit
def _l1_grad(x, t, pw, kink):
    s = _sign(x - t)
    return s, -s


@triton.jit
def _smooth_l1(x, t, pw, beta):
    d = tl.abs(x - t)
    return tl.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


@triton.jit
def _smooth_l1_grad(x, t, pw, beta):
    d = x - t
    g = tl.where(tl.abs(d) < beta, d / beta, _sign(d))
    return g, -g


@triton.jit
def _huber(x, t, pw, delta):
    d = tl.abs(x - t)
    return tl.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


@triton.jit
def _huber_grad(x, t, pw, delta):
    # clamp(d, -delta, delta) with tl.where, not tl.minimum/maximum: those round a Python-float
    # scalar (the interpreter's delta, any literal) to float32 first, and they drop a NaN d
    d = x - t
    g = tl.where(d > delta, delta, tl.where(d < -delta, -delta, d))
    return g, -g


@triton.jit
def _bce(x, t, pw, kink):
    log_x = tl.maximum(tl.log(x), -100.0)
    log_1mx = tl.maximum(tl.log(1.0 - x), -100.0)
    return (t - 1.0) * log_1mx - t * log_x


@triton.jit
def _bce_grad(x, t, pw, kink):
    # PyTorch clamps at its float EPSILON 1e-12, float32 in every dtype: so does tl.maximum (it makes a
    # float32 tensor of a Python float), which keeps float64 results equal to PyTorch's
    dx = (x - t) / tl.maximum((1.0 - x) * x, 1e-12)
    return dx, tl.log(1.0 - x) - tl.log(x)


@triton.jit
def _softplus_neg(x):
    """log(1 + exp(-x)), stable."""
    return tl.maximum(-x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _bce_logits(x, t, pw, kink):
    return (1.0 - t) * x + ((pw - 1.0) * t + 1.0) * _softplus_neg(x)


@triton.jit
def _bce_logits_grad(x, t, pw, kink):
    sigmoid_neg = 1.0 / (1.0 + tl.exp(x))
    return (1.0 - t) - ((pw - 1.0) * t + 1.0) * sigmoid_neg, (pw - 1.0) * _softplus_neg(x) - x


@triton.jit
def _kl_div(x, t, pw, kink):
    return tl.where(t == 0.0, 0.0, t * tl.log(t)) - t * x


@triton.jit
def _kl_div_grad(x, t, pw, kink):
    # t / t: NaN at t = 0, as PyTorch's xlogy gradient
    return -t, tl.log(t) + t / t - x


@triton.jit
def _kl_div_log_target(x, t, pw, kink):
    return tl.exp(t) * (t - x)


@triton.jit
def _kl_div_log_target_grad(x, t, pw, kink):
    e = tl.exp(t)
    return -e, e * (t - x + 1.0)


# ================================================================ element-wise RuntimeOp


def _check_reduction(reduction, allowed=_REDUCTIONS) -> str:
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
        self, name, loss, grad, reduction="mean", kink=0.0, has_weight=False, has_pos_weight=False, divisor=None
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


# ======================================================================= class-loss kernels


@triton.jit
def _row_offsets(rows, sample_stride, inner):
    """Offset of class 0 of each row (row r = n * inner + s of an (N, C, inner) input whose
    samples n are sample_stride apart: C * inner, or more for padded rows)."""
    return (rows // inner) * sample_stride + rows % inner


@triton.jit
def _class_target(target_ptr, weight_ptr, x_ptr, rows, row_mask, base, n_classes, inner, ignore_index, like):
    """For class-index targets: (t, active = not ignored, ok = active and in range, w_t, x_t)."""
    t = tl.load(target_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    active = row_mask & (t != ignore_index)
    ok = active & (t >= 0) & (t < n_classes)
    t_safe = tl.where(ok, t, 0)
    x_t = upcast(tl.load(x_ptr + base + t_safe * inner, mask=ok, other=0.0))
    if weight_ptr is not None:
        w_t = upcast(tl.load(weight_ptr + t_safe, mask=ok, other=0.0))
    else:
        w_t = tl.where(ok, 1.0, 0.0).to(like.dtype)
    return t, active, ok, w_t, x_t


@triton.jit
def _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, other):
    """x at offsets (a block of columns cols of the rows), upcast, ``other`` outside ``mask``.
    The load itself is masked by ``row_len`` (n_classes, or the padded length of rows whose
    padding may be read): a bound divisible by 16 lets Triton load the rows in wide vectors,
    which a vocabulary of 50,257 does not allow."""
    x = upcast(tl.load(x_ptr + offsets, mask=row_mask[:, None] & (cols < row_len)[None, :], other=other))
    return tl.where(mask, x, other)


@triton.jit
def _class_weights(weight_ptr, cols, col_mask, like):
    if weight_ptr is not None:
        return upcast(tl.load(weight_ptr + cols, mask=col_mask, other=0.0))
    else:
        return tl.where(col_mask, 1.0, 0.0).to(like.dtype)


@triton.jit
def _class_index_grad(p, cols, t, w_t, w, w_total, label_smoothing, smoothing_per_class, SMOOTHING: tl.constexpr):
    """d loss / d x of rows with class-index targets t (weights w_t) for dy = 1, from the
    softmax p of a block of columns cols (class weights w, summing to w_total)."""
    g = (1.0 - label_smoothing) * w_t[:, None] * (p - tl.where(cols[None, :] == t[:, None], 1.0, 0.0))
    if SMOOTHING:
        g += smoothing_per_class * (w_total[:, None] * p - w)
    return g


@kernel(half=True, optional=("weight_ptr", "lse_ptr", "mass_ptr", "den_ptr", "dx_ptr", "dtarget_ptr"))
def class_loss_backward(
    x_ptr,
    target_ptr,
    weight_ptr,
    lse_ptr,
    mass_ptr,
    dy_ptr,
    den_ptr,
    dx_ptr,
    dtarget_ptr,
    n_rows,
    n_classes,
    inner,
    sample_stride,
    row_len,
    ignore_index,
    label_smoothing,
    smoothing_per_class,
    divisor,
    SMOOTHING: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dx (and, for probability targets, dtarget) of ROWS rows per program. lse_ptr: cross-entropy
    (None: NLL on log-probabilities); mass_ptr: probability targets (None: class indices)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    base = _row_offsets(rows, sample_stride, inner)
    zero = upcast(tl.zeros([ROWS], dtype=x_ptr.dtype.element_ty))
    if REDUCTION == REDUCE_NONE:
        scale = upcast(tl.load(dy_ptr + rows, mask=row_mask, other=0.0))
    elif REDUCTION == REDUCE_MEAN:
        scale = zero + upcast(tl.load(dy_ptr)) / divisor
    elif REDUCTION == REDUCE_WEIGHTED_MEAN:
        scale = zero + upcast(tl.load(dy_ptr)) / tl.load(den_ptr)
    else:
        scale = zero + upcast(tl.load(dy_ptr))
    if lse_ptr is not None:
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    else:
        lse = zero
    if mass_ptr is not None:
        mass = tl.load(mass_ptr + rows, mask=row_mask, other=0.0)
    else:
        t, active, ok, w_t, x_t = _class_target(
            target_ptr, weight_ptr, x_ptr, rows, row_mask, base, n_classes, inner, ignore_index, zero
        )
        # ignored rows: 0; class index out of range: NaN (see module docstring)
        row_value = tl.where(active, float("nan"), 0.0)
        w_total = zero + n_classes
        if SMOOTHING and weight_ptr is not None:
            w_sum = tl.zeros([BLOCK_C], dtype=zero.dtype)
            for c0 in range(0, n_classes, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                w_sum += upcast(tl.load(weight_ptr + cols, mask=cols < n_classes, other=0.0))
            w_total = zero + tl.sum(w_sum, axis=0)
    for c0 in range(0, n_classes, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < n_classes
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = base[:, None] + cols[None, :].to(tl.int64) * inner
        x = _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, 0.0)
        if lse_ptr is not None:
            p = tl.exp(x - lse[:, None])
        else:
            p = x * 0.0
        w = _class_weights(weight_ptr, cols, col_mask, zero)[None, :]
        if mass_ptr is not None:
            q = upcast(tl.load(target_ptr + offsets, mask=mask, other=0.0))
            if SMOOTHING:
                q = q * (1.0 - label_smoothing) + smoothing_per_class
            dx = scale[:, None] * (p * mass[:, None] - w * q)
            if dtarget_ptr is not None:
                dq = scale[:, None] * (1.0 - label_smoothing) * w * (lse[:, None] - x)
                tl.store(dtarget_ptr + offsets, dq.to(dtarget_ptr.dtype.element_ty), mask=mask)
        else:
            g = _class_index_grad(p, cols, t, w_t, w, w_total, label_smoothing, smoothing_per_class, SMOOTHING)
            dx = tl.where(ok[:, None], scale[:, None] * g, row_value[:, None])
        if dx_ptr is not None:
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(
    backward=class_loss_backward, half=True, optional=("weight_ptr", "lse_ptr", "mass_ptr", "bad_index_ptr", "grad_ptr")
)
def class_loss_forward(
    x_ptr,
    target_ptr,
    weight_ptr,
    out_ptr,
    lse_ptr,
    mass_ptr,
    bad_index_ptr,
    grad_ptr,
    n_rows,
    n_classes,
    inner,
    sample_stride,
    row_len,
    ignore_index,
    label_smoothing,
    smoothing_per_class,
    divisor,
    SMOOTHING: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The loss of ROWS rows per program (per row, or partial sums: see REDUCTION), lse (cross-
    entropy: lse_ptr given), the target mass (probability targets: mass_ptr given). With
    bad_index_ptr, a class index out of range (not ignore_index) is written there. With grad_ptr
    (cross-entropy on class indices), also the gradient of the rows' loss sum (dy = 1), in a
    second pass over the rows just read (from L2), which may write over x: one read of the
    logits from memory for the loss and its gradient (``LinearCrossEntropyOp``'s chunks)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    base = _row_offsets(rows, sample_stride, inner)
    zero = upcast(tl.zeros([ROWS], dtype=x_ptr.dtype.element_ty))
    m = zero - float("inf")  # running max and sum of exp(x - max): the online log-sum-exp
    s = zero
    sum_wx = zero  # sum_c w_c x_c (label smoothing) or sum_c w_c q'_c x_c (probabilities)
    w_total = zero  # sum_c w_c (label smoothing) or sum_c w_c q'_c (probabilities)
    if lse_ptr is not None or SMOOTHING or mass_ptr is not None:
        for c0 in range(0, n_classes, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < n_classes
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = base[:, None] + cols[None, :].to(tl.int64) * inner
            x = _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, float("-inf"))
            if lse_ptr is not None:
                m_new = tl.maximum(m, tl.max(x, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
                m = m_new
            w = _class_weights(weight_ptr, cols, col_mask, zero)[None, :]
            if mass_ptr is not None:
                q = upcast(tl.load(target_ptr + offsets, mask=mask, other=0.0))
                if SMOOTHING:
                    q = tl.where(mask, q * (1.0 - label_smoothing) + smoothing_per_class, 0.0)
                w = w * q
            w = tl.where(mask, w, 0.0)
            sum_wx += tl.sum(w * tl.where(mask, x, 0.0), axis=1)
            w_total += tl.sum(w, axis=1)
    if lse_ptr is not None:
        lse = tl.where(m == float("-inf"), m, m + tl.log(s))
        tl.store(lse_ptr + rows, lse, mask=row_mask)
    else:
        lse = zero
    if mass_ptr is not None:
        loss = w_total * lse - sum_wx
        tl.store(mass_ptr + rows, w_total, mask=row_mask)
        w_t = zero
    else:
        t, active, ok, w_t, x_t = _class_target(
            target_ptr, weight_ptr, x_ptr, rows, row_mask, base, n_classes, inner, ignore_index, zero
        )
        if bad_index_ptr is not None:  # any of the bad indices (programs and lanes race: one of them lands)
            tl.store(bad_index_ptr + rows * 0, t, mask=active & ~ok)
        loss = (1.0 - label_smoothing) * w_t * (lse - x_t)
        if SMOOTHING:
            loss += smoothing_per_class * (w_total * lse - sum_wx)
        row_value = tl.where(active, float("nan"), 0.0)  # ignored rows: 0; class index out of range: NaN
        loss = tl.where(ok, loss, row_value)
        if grad_ptr is not None:
            for c0 in range(0, n_classes, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                col_mask = cols < n_classes
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = base[:, None] + cols[None, :].to(tl.int64) * inner
                p = tl.exp(_load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, 0.0) - lse[:, None])
                w = _class_weights(weight_ptr, cols, col_mask, zero)[None, :]
                g = _class_index_grad(p, cols, t, w_t, w, w_total, label_smoothing, smoothing_per_class, SMOOTHING)
                g = tl.where(mask, tl.where(ok[:, None], g, row_value[:, None]), 0.0)  # padding: 0
                tl.store(grad_ptr + offsets, g.to(grad_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < row_len))
    if REDUCTION == REDUCE_NONE:
        tl.store(out_ptr + rows, loss.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:  # out_ptr: per-program partial sums [programs, 1] or, with the target weights, [programs, 2]
        partial = tl.sum(tl.where(row_mask, loss, 0.0), axis=0)
        if REDUCTION == REDUCE_MEAN:
            partial = partial / divisor
        if REDUCTION == REDUCE_WEIGHTED_MEAN:
            tl.store(out_ptr + 2 * pid, partial)
            tl.store(out_ptr + 2 * pid + 1, tl.sum(w_t, axis=0))
        else:
            tl.store(out_ptr + pid, partial)


class ClassLossOp(RuntimeOp):
    """Cross-entropy (``from_logits``) or NLL over the class dim 1: inputs (input, target[, weight])."""

    kernel = class_loss_forward
    n_activation_inputs = 2
    saves_inputs = True

    def __init__(self, name, from_logits, reduction="mean", ignore_index=-100, label_smoothing=0.0, has_weight=False):
        self.name, self.from_logits, self.reduction = name, from_logits, reduction
        self.ignore_index, self.label_smoothing = int(ignore_index), float(label_smoothing)
        self.has_weight = has_weight
        self.n_activation_inputs = 2 + has_weight
        self.target_probs = False  # decided from the target's dtype in check_inputs
        self.check_indices = config.check_indices  # read at trace time (see teeny.config)

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

    def output_shape(self, input_shapes):
        x = tuple(input_shapes[0])
        if self.reduction != "none":
            return ()
        return () if len(x) == 1 else x[:1] + x[2:]

    def _dims(self, shape):
        n_classes = shape[0] if len(shape) == 1 else shape[1]
        inner = math.prod(shape[2:])
        return math.prod(shape) // n_classes, n_classes, inner

    def _blocks(self, n_rows, n_classes):
        block_c = min(pow2(n_classes), MAX_BLOCK_C)
        rows = max(1, min(ROW_TILE // block_c, pow2(n_rows)))
        return rows, block_c

    def _reduction_mode(self) -> tl.constexpr:
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
        if self._reduction_mode() == REDUCE_WEIGHTED_MEAN:
            extras["sums"] = ((2,), acc)  # the loss and the target weights, summed
        return extras

    def _args(self, ctx) -> dict:
        """The arguments both kernels take."""
        weight = ctx.inputs[2] if self.has_weight else None
        return self.kernel_args(
            ctx.inputs[0],
            ctx.inputs[1],
            weight,
            ctx.saved.get("lse"),
            ctx.saved.get("target_mass"),
            ctx.input_shapes[0],
        )

    def kernel_args(self, x, target, weight, lse, mass, shape, padded_rows=None) -> dict:
        """The arguments both kernels take, for input ``x`` of ``shape`` (also a chunk of rows of
        the logits ``padded_rows`` elements apart, padding included: ``LinearCrossEntropyOp``)."""
        n_rows, n_classes, inner = self._dims(shape)
        rows, block_c = self._blocks(n_rows, n_classes)
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
            SMOOTHING=self.label_smoothing > 0,
            REDUCTION=self._reduction_mode(),
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
            ctx.check_after(bad_index, lambda index: self._describe_bad_index(index, n_classes))
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

    def _describe_bad_index(self, index: int, n_classes: int) -> str:
        return (
            f"target class index {index} is out of range: the input has {n_classes} classes (0 to "
            f"{n_classes - 1}) and ignore_index is {self.ignore_index} (teeny.config.check_indices)"
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
            **fields,
        )
        grid = (cdiv(fields["n_rows"], fields["ROWS"]),)
        return [Launch(class_loss_backward, grid, args, work=ctx.inputs[0].numel())]


# ===================================================================== linear + cross-entropy


@kernel(half=True, optional=("den_ptr",))
def linear_cross_entropy_backward(grad_ptr, dy_ptr, den_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = grad * dy (/ den, the mean's denominator): a gradient the forward computed for the
    sum of the losses."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = upcast(tl.load(dy_ptr))
    if den_ptr is not None:
        scale = scale / upcast(tl.load(den_ptr))
    grad = upcast(tl.load(grad_ptr + offsets, mask=mask, other=0.0))
    tl.store(out_ptr + offsets, (grad * scale).to(out_ptr.dtype.element_ty), mask=mask)


@kernel(backward=linear_cross_entropy_backward, half=True)
def linear_cross_entropy_forward(chunk_ptr, total_ptr, n, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """total (float32; float64 for float64) = chunk (FIRST) or total + chunk: dW and db summed
    over the chunks of rows."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    chunk = upcast(tl.load(chunk_ptr + offsets, mask=mask, other=0.0))
    if not FIRST:
        chunk += tl.load(total_ptr + offsets, mask=mask, other=0.0)
    tl.store(total_ptr + offsets, chunk.to(total_ptr.dtype.element_ty), mask=mask)


# logits bytes of one chunk of rows (an automatic chunk size aims below it), and the row multiple
# a chunk keeps (the matmul tiles' BLOCK_M on the GPU)
LOGITS_CHUNK_BYTES = 1 << 22 if INTERPRETER else 256 << 20
CHUNK_ROW_MULTIPLE = 16 if INTERPRETER else 128
ROW_ALIGN = 16  # elements: a chunk's logits rows are a multiple of this long, padding included


class LinearCrossEntropyOp(RuntimeOp):
    """cross_entropy(linear(x, W, b), target) with class-index targets, "mean" or "sum", chunked
    over rows (made by ``teeny.rewrites.chunk_linear_cross_entropy``; as Liger-Kernel's fused
    linear cross-entropy). Inputs: x (..., d), target (rows,), class weights (C,) when given, then
    W (C, d) and b (C,) when given.

    Forward, per chunk of rows: logits = x_c W^T + b (the linear's launches, into one chunk-sized
    buffer), the chunk's loss partials, lse and the logits' gradient for dy = 1 written over
    them (``class_loss_forward``, one read of the logits), then dX_c = dlogits W (into the saved dX) and
    dW_c = dlogits^T x_c, db_c (the linear's backward), added into float32 sums. The (rows, C)
    logits are never stored: the forward keeps dX, dW, db (for training) instead. Backward: the
    saved gradients times dy (/ the mean's denominator), one launch each."""

    kernel = linear_cross_entropy_forward
    saves_inputs = ()

    def __init__(self, linear: RuntimeOp, loss: ClassLossOp, out_dtype: torch.dtype, with_grads: bool, chunk_rows=None):
        if loss.target_probs or loss.reduction == "none" or not loss.from_logits:
            raise ValueError("linear + cross_entropy is chunked for class-index targets and mean or sum only")
        self.linear, self.loss, self.out_dtype = linear, loss, out_dtype
        self.with_grads, self.chunk_rows = with_grads, chunk_rows
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
        forward, backward = self.linear.flops([input_shapes[0], input_shapes[n]], [grad_mask[0], grad_mask[n]])
        return (forward + backward, 0) if self.with_grads else (forward, 0)

    def _mean(self) -> bool:
        return self.loss.reduction == "mean"

    def extra_outputs(self, input_shapes, dtype):
        rows, features, classes = self._sizes(input_shapes)
        acc = acc_dtype(dtype)
        extras = {"sums": ((2,), acc)} if self._mean() else {}  # the loss and the target weights, summed
        if self.with_grads:
            extras["grad_input"] = (tuple(input_shapes[0]), dtype)
            extras["grad_weight"] = ((classes, features), acc)
            if self.has_bias:
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
        params = [w] + ([b] if b is not None else [])
        sub = OpContext(
            op=self.linear,
            node_name=ctx.node_name,
            dtype=ctx.dtype,
            inputs=[x],
            params=params,
            output=logits,
            saved={},
            instances=ctx.instances,
            dry_run=ctx.dry_run,
            input_shapes=[tuple(x.shape)] + [tuple(p.shape) for p in params],
            output_shape=tuple(logits.shape),
        )
        if dlogits is None:
            return self.linear.forward_launches(sub)
        sub.phase, sub.grad_output, sub.grad_output_row_stride = "backward", dlogits, dlogits.shape[-1]
        sub.grad_inputs, sub.grad_params = [dx], [dw] + ([db] if b is not None else [])
        return self.linear.backward_launches(sub)

    def forward_launches(self, ctx):
        x, target, weight, w, b = self._split([*ctx.inputs, *ctx.params])
        rows, features, classes = self._sizes(ctx.input_shapes)
        x = x.reshape(rows, features)
        chunk = self.chunk_size(rows, classes, ctx.dtype)
        acc = acc_dtype(ctx.dtype)
        mode = self.loss._reduction_mode()
        starts = list(range(0, rows, chunk)) or [0]  # no rows: one empty chunk (the mean of nothing is NaN)
        sizes = [min(chunk, rows - start) for start in starts]
        programs = [max(1, cdiv(n, self.loss._blocks(n, classes)[0])) for n in sizes]
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
            ctx.check_after(bad_index, lambda index: self.loss._describe_bad_index(index, classes))
        if self.with_grads:
            dx = ctx.saved["grad_input"].view(rows, features)
            dw_chunk = ctx.empty((classes, features))
            db_chunk = ctx.empty((classes,)) if b is not None else None
        launches, first_program = [], 0
        for start, n, count in zip(starts, sizes, programs):
            x_c, target_c, logits_c, lse_c = x[start : start + n], target[start : start + n], logits[:n], lse[:n]
            launches += self._linear(ctx, x_c, w, b, logits_c)
            args = self.loss.kernel_args(logits_c, target_c, weight, lse_c, None, (n, classes), padded)
            out = partials[first_program : first_program + count]
            grad = logits_c if self.with_grads else None  # the loss sum's gradient, over the logits
            visitor = ArgVisitor().visit(out_ptr=out, bad_index_ptr=bad_index, grad_ptr=grad, **args)
            launches.append(Launch(class_loss_forward, (count,), visitor, work=n))
            first_program += count
            if not self.with_grads:
                continue
            launches += self._linear(ctx, x_c, w, b, logits_c, logits_c, dx[start : start + n], dw_chunk, db_chunk)
            for part, total in ((dw_chunk, ctx.saved["grad_weight"]), (db_chunk, ctx.saved.get("grad_bias"))):
                if part is not None:
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
            if grad is not None:
                n = grad.numel()
                visitor = ArgVisitor().visit(
                    grad_ptr=ctx.saved[name], dy_ptr=ctx.grad_output, den_ptr=den, out_ptr=grad, n=n
                )
                launches.append(Launch(linear_cross_entropy_backward, (cdiv(n, BLOCK),), visitor, BLOCK))
        return launches


# ============================================================================ functional ops


def _tensor_arg(graph, value, like, name):
    """A weight given as a teeny Tensor stays one; a torch tensor becomes a graph constant in
    the input's dtype."""
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, torch.Tensor):
        return graph.constant(value.detach().to(like.dtype), name=None)
    raise TypeError(f"{name} must be a teeny Tensor, a torch.Tensor or None, got {type(value).__name__}")


def _pointwise(name, input, target, loss, grad, reduction, kink=0.0, weight=None, pos_weight=None, divisor=None):
    graph = graph_of(input, target)
    weight = _tensor_arg(graph, weight, input, "weight")
    pos_weight = _tensor_arg(graph, pos_weight, input, "pos_weight")
    op = PointwiseLossOp(name, loss, grad, reduction, kink, weight is not None, pos_weight is not None, divisor)
    return graph.apply(op, [t for t in (input, target, weight, pos_weight) if t is not None])


def mse_loss(input, target, reduction: str = "mean"):
    """(input - target)^2, reduced."""
    return _pointwise("mse_loss", input, target, _mse, _mse_grad, _check_reduction(reduction))


mse = mse_loss


def l1_loss(input, target, reduction: str = "mean"):
    """|input - target|, reduced (gradient sign(input - target), 0 at 0)."""
    return _pointwise("l1_loss", input, target, _l1, _l1_grad, _check_reduction(reduction))


def smooth_l1_loss(input, target, reduction: str = "mean", beta: float = 1.0):
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (d = input - target; beta = 0: L1)."""
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be non-negative, got {beta}")
    return _pointwise(
        "smooth_l1_loss", input, target, _smooth_l1, _smooth_l1_grad, _check_reduction(reduction), kink=beta
    )


def huber_loss(input, target, reduction: str = "mean", delta: float = 1.0):
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta)."""
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be positive, got {delta}")
    return _pointwise("huber_loss", input, target, _huber, _huber_grad, _check_reduction(reduction), kink=delta)


def binary_cross_entropy(input, target, weight=None, reduction: str = "mean"):
    """-w (t log x + (1 - t) log(1 - x)) on probabilities x, logs clamped at -100 as in PyTorch.
    Inputs outside [0, 1] give NaN (PyTorch raises)."""
    return _pointwise(
        "binary_cross_entropy", input, target, _bce, _bce_grad, _check_reduction(reduction), weight=weight
    )


def binary_cross_entropy_with_logits(input, target, weight=None, reduction: str = "mean", pos_weight=None):
    """w ((1 - t) x + (1 + (pos_weight - 1) t) log(1 + exp(-x))), computed stably."""
    return _pointwise(
        "binary_cross_entropy_with_logits",
        input,
        target,
        _bce_logits,
        _bce_logits_grad,
        _check_reduction(reduction),
        weight=weight,
        pos_weight=pos_weight,
    )


def kl_div(input, target, reduction: str = "mean", log_target: bool = False):
    """target (log target - input) (input: log-probabilities; target: probabilities, or
    log-probabilities with ``log_target``); "batchmean" divides the sum by input.size(0)."""
    reduction = _check_reduction(reduction, _REDUCTIONS + ("batchmean",))
    loss, grad = (_kl_div_log_target, _kl_div_log_target_grad) if log_target else (_kl_div, _kl_div_grad)
    divisor = None
    if reduction == "batchmean":
        reduction, divisor = "mean", (lambda shape: shape[0] if len(shape) else 1)
    return _pointwise("kl_div", input, target, loss, grad, reduction, divisor=divisor)


def _class_loss(name, from_logits, input, target, weight, ignore_index, reduction, label_smoothing):
    graph = graph_of(input, target)
    weight = _tensor_arg(graph, weight, input, "weight")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    op = ClassLossOp(name, from_logits, _check_reduction(reduction), ignore_index, label_smoothing, weight is not None)
    return graph.apply(op, [t for t in (input, target, weight) if t is not None])


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean"):
    """-w_t input[n, t_n] on log-probabilities (N, C) or (N, C, d1, ...), class-index targets
    (int64); "mean" divides by the sum of w_t over non-ignored targets (NaN if all are ignored)."""
    return _class_loss("nll_loss", False, input, target, weight, ignore_index, reduction, 0.0)


def cross_entropy(
    input, target, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0
):
    """log_softmax + NLL over the class dim 1, fused: targets are class indices (int64) or class
    probabilities (the input's shape and dtype). Long rows are processed in column blocks."""
    return _class_loss("cross_entropy", True, input, target, weight, ignore_index, reduction, label_smoothing)


# ================================================================================== layers


class _Loss(Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction


class MSELoss(_Loss):
    def forward(self, input, target):
        return mse_loss(input, target, self.reduction)


class L1Loss(_Loss):
    def forward(self, input, target):
        return l1_loss(input, target, self.reduction)


class SmoothL1Loss(_Loss):
    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):
        return smooth_l1_loss(input, target, self.reduction, self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):
        return huber_loss(input, target, self.reduction, self.delta)


class BCELoss(_Loss):
    """``weight``: a torch tensor (a constant of the graph) or a teeny Tensor."""

    def __init__(self, weight=None, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight = weight

    def forward(self, input, target):
        return binary_cross_entropy(input, target, self.weight, self.reduction)


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input, target):
        return binary_cross_entropy_with_logits(input, target, self.weight, self.reduction, self.pos_weight)


class KLDivLoss(_Loss):
    def __init__(self, reduction: str = "mean", log_target: bool = False):
        super().__init__(reduction)
        self.log_target = log_target

    def forward(self, input, target):
        return kl_div(input, target, self.reduction, self.log_target)


class NLLLoss(_Loss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight, self.ignore_index = weight, ignore_index

    def forward(self, input, target):
        return nll_loss(input, target, self.weight, self.ignore_index, self.reduction)


class CrossEntropyLoss(_Loss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(reduction)
        self.weight, self.ignore_index, self.label_smoothing = weight, ignore_index, label_smoothing

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing)


# ========================================================================= registry/tests


def _named(shape, kwargs):
    extra = ",".join(f"{k}={v}" for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    weights = ",".join(f"{k}{tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return " ".join(p for p in (str(shape), extra, weights) if p)


def _reduction_length(shape, kwargs) -> int:
    return 1 if kwargs.get("reduction") == "none" else max(1, math.prod(shape))


# (shape, kwargs) of the element-wise samples; weights are filled in per loss
_POINTWISE_CASES = [
    ((3, 37), {}),
    ((129, 7), {"reduction": "sum"}),
    ((5, 3, 11), {"reduction": "none"}),
    ((1,), {}),
    ((0, 5), {"reduction": "sum"}),
]
_POINTWISE_GRADCHECK = [((2, 4), {}), ((3,), {"reduction": "none"}), ((2,), {"reduction": "sum"})]


def _pointwise_samples(make_pair, cases, extra=lambda shape, kwargs, dtype, gen: {}):
    """Samples of (input, target) from ``make_pair(shape, gen) -> float64 tensors`` per case;
    ``extra`` adds weight kwargs. Weights get no gradient (grad=(0, 1))."""

    def samples(dtype, gen):
        out = []
        for shape, kwargs in cases:
            x, t = make_pair(shape, gen)
            kwargs = {**kwargs, **extra(shape, kwargs, dtype, gen)}
            out.append(
                Sample(
                    (x.to(dtype), t.to(dtype)),
                    kwargs,
                    name=_named(shape, kwargs),
                    grad=(0, 1),
                    reduction=_reduction_length(shape, kwargs),
                )
            )
        return out

    return samples


def _regression_pair(kinks=()):
    """target in [-2, 2), input = target + a difference kept 0.1 away from the loss's kinks."""

    def pair(shape, gen):
        t = make(gen, *shape)
        return t + away_from(make(gen, *shape, low=-3, high=3), kinks, gap=0.1), t

    return pair


def _probability_pair(shape, gen):
    return make(gen, *shape, low=0.05, high=0.95), make(gen, *shape, low=0.0, high=1.0)


def _logit_pair(shape, gen):
    return make(gen, *shape, low=-3, high=3), make(gen, *shape, low=0.0, high=1.0)


def _kl_pair(log_target):
    def pair(shape, gen):
        target = make(gen, *shape, low=-3, high=0) if log_target else make(gen, *shape, low=0.05, high=1.0)
        return make(gen, *shape, low=-3, high=0), target

    return pair


def _bce_weights(pos_weight):
    def extra(shape, kwargs, dtype, gen):
        if len(shape) < 2 or shape[0] == 0:
            return {}
        out = {"weight": make(gen, *shape[-1:], low=0.1, high=2).to(dtype)}
        if shape == (129, 7):  # a full-shape weight
            out["weight"] = make(gen, *shape, low=0.1, high=2).to(dtype)
        if pos_weight:
            out["pos_weight"] = make(gen, *shape[-1:], low=0.2, high=3).to(dtype)
        return out

    return extra


def _with(cases, **kwargs):
    return [(shape, {**kw, **kwargs}) for shape, kw in cases]


def _register_pointwise(
    name,
    fn,
    ref,
    make_pair,
    cases=_POINTWISE_CASES,
    gradcheck_cases=_POINTWISE_GRADCHECK,
    extra=lambda shape, kwargs, dtype, gen: {},
):
    gradcheck = _pointwise_samples(make_pair, gradcheck_cases, extra)
    register(
        OpInfo(
            name,
            fn,
            ref,
            _pointwise_samples(make_pair, cases, extra),
            family="loss",
            gradcheck_samples=lambda gen: gradcheck(torch.float64, gen),
        )
    )


_register_pointwise("mse_loss", mse_loss, F.mse_loss, _regression_pair())
_register_pointwise("l1_loss", l1_loss, F.l1_loss, _regression_pair((0.0,)))
_register_pointwise("smooth_l1_loss", smooth_l1_loss, F.smooth_l1_loss, _regression_pair((0.0, 1.0, -1.0)))
_register_pointwise(
    "smooth_l1_loss_beta",
    lambda x, t, **kw: smooth_l1_loss(x, t, beta=0.3, **kw),  # not a power of two: float64 must stay float64
    lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.3, **kw),
    _regression_pair((0.0, 0.3, -0.3)),
)
_register_pointwise(
    "smooth_l1_loss_beta0",
    lambda x, t, **kw: smooth_l1_loss(x, t, beta=0.0, **kw),
    lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.0, **kw),
    _regression_pair((0.0,)),
)
_register_pointwise("huber_loss", huber_loss, F.huber_loss, _regression_pair((1.0, -1.0)))
_register_pointwise(
    "huber_loss_delta",
    lambda x, t, **kw: huber_loss(x, t, delta=0.7, **kw),
    lambda x, t, **kw: F.huber_loss(x, t, delta=0.7, **kw),
    _regression_pair((0.7, -0.7)),
)
_register_pointwise(
    "binary_cross_entropy", binary_cross_entropy, F.binary_cross_entropy, _probability_pair, extra=_bce_weights(False)
)
_register_pointwise(
    "binary_cross_entropy_with_logits",
    binary_cross_entropy_with_logits,
    F.binary_cross_entropy_with_logits,
    _logit_pair,
    extra=_bce_weights(True),
)
_KL_CASES = [
    ((3, 37), {"reduction": "batchmean"}),
    ((129, 7), {}),
    ((5, 3, 11), {"reduction": "none"}),
    ((1,), {"reduction": "sum"}),
    ((0, 5), {"reduction": "sum"}),
]
_KL_GRADCHECK = [((2, 4), {"reduction": "batchmean"}), ((3,), {"reduction": "none"}), ((2,), {})]
_register_pointwise("kl_div", kl_div, F.kl_div, _kl_pair(False), _KL_CASES, _KL_GRADCHECK)
_register_pointwise(
    "kl_div_log_target",
    kl_div,
    F.kl_div,
    _kl_pair(True),
    _with(_KL_CASES, log_target=True),
    _with(_KL_GRADCHECK, log_target=True),
)


# ---------------------------------------------------------------------------- class losses


def _class_targets(gen, shape, n_classes, ignore_every=0, ignore_index=-100):
    t = torch.randint(0, n_classes, shape, generator=gen, dtype=torch.int64)
    if ignore_every:
        t.view(-1)[::ignore_every] = ignore_index
    return t


# (input shape, target: "index" | "probs", ignore_every, kwargs); weights: kwargs "weight": True
_CE_CASES = [
    ((3, 37), "index", 0, {}),
    ((129, 7), "index", 5, {"weight": True}),
    ((129, 7), "index", 4, {"label_smoothing": 0.1, "reduction": "sum"}),
    ((5, 4, 3), "index", 0, {"weight": True, "label_smoothing": 0.2}),
    ((3, 37), "probs", 0, {"weight": True, "label_smoothing": 0.1}),
    ((4, 9), "probs", 0, {"reduction": "none"}),
    ((1, 37), "index", 0, {"reduction": "none"}),
    ((11, 5), "index", 3, {"ignore_index": 2, "reduction": "none", "weight": True}),
    ((6,), "index", 0, {}),
    ((0, 5), "index", 0, {"reduction": "sum"}),
]
_CE_GRADCHECK = [
    ((3, 4), "index", 3, {"weight": True, "label_smoothing": 0.1}),
    ((2, 3), "probs", 0, {"label_smoothing": 0.1, "reduction": "none", "weight": True}),
    ((2, 2, 2), "index", 0, {"reduction": "sum"}),
]
_NLL_CASES = [
    ((3, 37), "index", 0, {}),
    ((129, 7), "index", 5, {"weight": True}),
    ((5, 4, 3), "index", 0, {"reduction": "sum"}),
    ((1, 37), "index", 0, {"reduction": "none"}),
    ((11, 5), "index", 3, {"ignore_index": 2, "reduction": "none", "weight": True}),
]
_NLL_GRADCHECK = [((3, 4), "index", 3, {"weight": True}), ((2, 2, 2), "index", 0, {"reduction": "none"})]


def _class_samples(cases, log_probs):
    def samples(dtype, gen):
        out = []
        for shape, kind, ignore_every, kwargs in cases:
            n_classes = shape[0] if len(shape) == 1 else shape[1]
            x = make(gen, *shape, low=-3, high=3)
            if log_probs:
                x = torch.log_softmax(x, dim=0 if len(shape) == 1 else 1)
            if kind == "probs":
                target = torch.softmax(make(gen, *shape, low=-2, high=2), dim=1).to(dtype)
            else:
                target_shape = () if len(shape) == 1 else shape[:1] + shape[2:]
                target = _class_targets(gen, target_shape, n_classes, ignore_every, kwargs.get("ignore_index", -100))
            kwargs = dict(kwargs)
            if kwargs.get("weight") is True:
                kwargs["weight"] = make(gen, n_classes, low=0.2, high=2).to(dtype)
            rows = max(1, math.prod(shape) // n_classes)
            length = n_classes if kwargs.get("reduction") == "none" else max(rows, n_classes)
            out.append(
                Sample(
                    (x.to(dtype), target),
                    kwargs,
                    name=f"{kind} " + _named(shape, kwargs),
                    grad=(0, 1),
                    reduction=length,
                )
            )
        return out

    return samples


register(
    OpInfo(
        "cross_entropy",
        cross_entropy,
        F.cross_entropy,
        _class_samples(_CE_CASES, False),
        family="loss",
        gradcheck_samples=lambda gen: _class_samples(_CE_GRADCHECK, False)(torch.float64, gen),
    )
)
register(
    OpInfo(
        "nll_loss",
        nll_loss,
        F.nll_loss,
        _class_samples(_NLL_CASES, True),
        family="loss",
        gradcheck_samples=lambda gen: _class_samples(_NLL_GRADCHECK, True)(torch.float64, gen),
    )
)
