"""Normalisation: layer_norm, rms_norm, group_norm, batch_norm.

Every op normalises "statistics rows" of x: y = (x - mean) * rstd * w + b with
rstd = 1 / sqrt(var + eps) (biased variance; rms_norm: mean = 0, var = mean(x^2)). Where the
rows lie is the op's *layout*:

* ``ROWS`` (layer_norm, rms_norm, group_norm): row r is contiguous, x[r * row_len + j]; the
  affine channel of element j is (r % groups) * (channels / groups) + j // spatial
  (layer/rms: groups = spatial = 1, so the channel is j).
* ``CHANNELS`` (batch_norm over x viewed as (N, C, S)): row c gathers x[n, c, s] for all n, s
  (j = n * S + s); its affine channel is c.

Backward, with xhat = (x - mean) * rstd and g = dy * w, per row of length L:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (rms_norm: without mean(g))
    dx = rstd * g                                          (batch_norm on running statistics)
    dw[c] = sum over the elements of channel c of dy * xhat,   db[c] = sum of dy

``norm_forward`` and ``norm_backward`` run one program per statistics row and loop over
column blocks, so rows of any length work; the forward merges per-block means and M2 with
Chan's formula (one read of x for the statistics) and saves mean/rstd per row, from which the
backward recomputes xhat. For ``CHANNELS`` a row is a whole channel, so ``norm_backward``
also writes dw/db directly. For ``ROWS`` dw/db reduce across rows: ``norm_weight_backward``
writes one fp32 partial row per program over a (outer, channels, spatial) view of x, and
``sum_partials`` adds the partial rows (no locks, no atomics: bit-reproducible).
Half-precision inputs compute in float32, float64 in float64.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import init
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, OpContext, RuntimeOp
from .common import cdiv, upcast

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm"]
NN_LAYERS = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d"]

MAX_BLOCK = 4096  # longest column block of one row; longer rows loop (tests lower it)
ROWS_PER_WEIGHT_PROGRAM = 32  # rows reduced by one program of norm_weight_backward

# layouts and statistics sources (compile-time constants of the kernels)
ROWS, CHANNELS = 0, 1
BATCH_STATS, RUNNING_STATS = 0, 1


@triton.jit
def _offsets(row, cols, row_len, channels, spatial, LAYOUT: tl.constexpr):
    """Element offsets of columns ``cols`` of statistics row ``row`` (int64)."""
    if LAYOUT == 1:  # CHANNELS: row = channel c, col = n * spatial + s
        cols = cols.to(tl.int64)
        return (cols // spatial) * channels * spatial + row * spatial + cols % spatial
    else:
        return row * row_len + cols


@triton.jit
def _channel(row, cols, channels, spatial, groups, LAYOUT: tl.constexpr):
    """Affine channel (index into weight/bias) of columns ``cols`` of row ``row``."""
    if LAYOUT == 1:
        return row + cols * 0
    else:
        return (row % groups) * (channels // groups) + cols // spatial


@kernel(half=True)
def norm_backward(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr,
                  row_len, channels, spatial, groups,
                  LAYOUT: tl.constexpr, CENTRED: tl.constexpr, HAS_WEIGHT: tl.constexpr, STATS: tl.constexpr,
                  WRITE_DX: tl.constexpr, ROW_DW: tl.constexpr, ROW_DB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    rstd = upcast(tl.load(rstd_ptr + row))
    mean = upcast(tl.load(mean_ptr + row)) if CENTRED else rstd * 0
    zeros = upcast(tl.zeros([BLOCK], dtype=dy_ptr.dtype.element_ty))
    sum_g, sum_g_xhat, sum_dy, sum_dy_xhat = zeros, zeros, zeros, zeros
    if STATS == 0 or ROW_DW or ROW_DB:
        for start in range(0, row_len, BLOCK):
            c = start + cols
            mask = c < row_len
            offs = _offsets(row, c, row_len, channels, spatial, LAYOUT)
            x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0))
            dy = upcast(tl.load(dy_ptr + offs, mask=mask, other=0.0))
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_WEIGHT:
                g = dy * upcast(tl.load(w_ptr + _channel(row, c, channels, spatial, groups, LAYOUT), mask=mask, other=0.0))
            sum_g += g
            sum_g_xhat += g * xhat
            sum_dy += dy
            sum_dy_xhat += dy * xhat
    if ROW_DW:
        tl.store(dw_ptr + row, tl.sum(sum_dy_xhat, 0).to(dw_ptr.dtype.element_ty))
    if ROW_DB:
        tl.store(db_ptr + row, tl.sum(sum_dy, 0).to(db_ptr.dtype.element_ty))
    if WRITE_DX:
        mean_g = tl.sum(sum_g, 0) / row_len
        mean_g_xhat = tl.sum(sum_g_xhat, 0) / row_len
        for start in range(0, row_len, BLOCK):
            c = start + cols
            mask = c < row_len
            offs = _offsets(row, c, row_len, channels, spatial, LAYOUT)
            x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0))
            g = upcast(tl.load(dy_ptr + offs, mask=mask, other=0.0))
            if HAS_WEIGHT:
                g = g * upcast(tl.load(w_ptr + _channel(row, c, channels, spatial, groups, LAYOUT), mask=mask, other=0.0))
            if STATS == 0:
                xhat = (x - mean) * rstd
                if CENTRED:
                    dx = rstd * (g - mean_g - xhat * mean_g_xhat)
                else:
                    dx = rstd * (g - xhat * mean_g_xhat)
            else:
                dx = rstd * g
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def norm_weight_backward(x_ptr, dy_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr,
                         outer, channels, spatial, groups, rows_per_program,
                         CENTRED: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    c_mask = c < channels
    zeros = upcast(tl.zeros([BLOCK_C], dtype=dy_ptr.dtype.element_ty))
    dw, db = zeros, zeros
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        a = first + i
        row_mask = c_mask & (a < outer)
        stats_row = a * groups + c // (channels // groups)
        rstd = upcast(tl.load(rstd_ptr + stats_row, mask=row_mask, other=0.0))
        if CENTRED:
            mean = upcast(tl.load(mean_ptr + stats_row, mask=row_mask, other=0.0))
        else:
            mean = rstd * 0
        for s_start in range(0, spatial, BLOCK_S):
            s_cur = s_start + s
            mask = row_mask[:, None] & (s_cur < spatial)[None, :]
            offs = (a * channels + c[:, None]) * spatial + s_cur[None, :]
            dy = upcast(tl.load(dy_ptr + offs, mask=mask, other=0.0))
            if HAS_DW:
                x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0))
                dw += tl.sum(dy * (x - mean[:, None]) * rstd[:, None], 1)
            if HAS_DB:
                db += tl.sum(dy, 1)
    partial = pid.to(tl.int64) * channels + c
    if HAS_DW:
        tl.store(dw_partial_ptr + partial, dw, mask=c_mask)
    if HAS_DB:
        tl.store(db_partial_ptr + partial, db, mask=c_mask)


@kernel(half=True)
def sum_partials(partial_ptr, out_ptr, num_partials, n, BLOCK: tl.constexpr):
    """out[j] = sum over p of partial[p, j] (the second pass of a cross-program reduction)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.zeros([BLOCK], dtype=partial_ptr.dtype.element_ty)
    ptrs = partial_ptr + offs
    for _ in range(0, num_partials):
        total += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += n
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@kernel(backward=(norm_backward, norm_weight_backward, sum_partials), half=True)
def norm_forward(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, running_mean_ptr, running_var_ptr,
                 row_len, channels, spatial, groups, eps, momentum,
                 LAYOUT: tl.constexpr, CENTRED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 STATS: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATS == 1:  # RUNNING_STATS: batch_norm in inference
        mean = upcast(tl.load(running_mean_ptr + row))
        rstd = 1.0 / tl.sqrt(upcast(tl.load(running_var_ptr + row)) + eps)
    else:
        zero = upcast(tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty))
        count, mean, m2 = tl.sum(zero, 0), tl.sum(zero, 0), tl.sum(zero, 0)
        for start in range(0, row_len, BLOCK):
            c = start + cols
            mask = c < row_len
            x = upcast(tl.load(x_ptr + _offsets(row, c, row_len, channels, spatial, LAYOUT), mask=mask, other=0.0))
            if CENTRED:  # Chan et al.: merge this block's (count, mean, M2) into the running ones
                n_block = tl.sum(tl.where(mask, 1.0, 0.0).to(x.dtype), 0)
                mean_block = tl.sum(x, 0) / n_block
                d = tl.where(mask, x - mean_block, 0.0)
                delta = mean_block - mean
                total = count + n_block
                mean += delta * (n_block / total)
                m2 += tl.sum(d * d, 0) + delta * delta * (count * n_block / total)
                count = total
            else:
                m2 += tl.sum(x * x, 0)
        var = m2 / row_len
        rstd = 1.0 / tl.sqrt(var + eps)
        if UPDATE_RUNNING:  # running_var takes the unbiased variance, as in PyTorch
            running_mean = upcast(tl.load(running_mean_ptr + row))
            running_var = upcast(tl.load(running_var_ptr + row))
            unbiased = m2 / (row_len - 1)
            tl.store(running_mean_ptr + row, ((1.0 - momentum) * running_mean + momentum * mean).to(running_mean_ptr.dtype.element_ty))
            tl.store(running_var_ptr + row, ((1.0 - momentum) * running_var + momentum * unbiased).to(running_var_ptr.dtype.element_ty))
    if CENTRED:
        tl.store(mean_ptr + row, mean.to(mean_ptr.dtype.element_ty))
    tl.store(rstd_ptr + row, rstd.to(rstd_ptr.dtype.element_ty))
    for start in range(0, row_len, BLOCK):
        c = start + cols
        mask = c < row_len
        offs = _offsets(row, c, row_len, channels, spatial, LAYOUT)
        x = upcast(tl.load(x_ptr + offs, mask=mask, other=0.0))
        y = (x - mean) * rstd if CENTRED else x * rstd
        if HAS_WEIGHT or HAS_BIAS:
            channel = _channel(row, c, channels, spatial, groups, LAYOUT)
            if HAS_WEIGHT:
                y = y * upcast(tl.load(w_ptr + channel, mask=mask, other=0.0))
            if HAS_BIAS:
                y = y + upcast(tl.load(b_ptr + channel, mask=mask, other=0.0))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ RuntimeOp


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block(n: int) -> int:
    return max(16, min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK))


def _dims(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class NormOp(RuntimeOp):
    """One normalisation node. Inputs: x, then (batch_norm) running_mean, running_var, then
    weight and bias when given. Subclasses say where the statistics rows lie (``geometry``)."""

    n_activation_inputs = 1
    kernel = norm_forward
    centred = True
    layout = ROWS

    def __init__(self, name: str, eps: float, has_weight: bool, has_bias: bool, n_running: int = 0):
        self.name, self.eps = name, float(eps)
        self.has_weight, self.has_bias = has_weight, has_bias
        self.weight_index = 1 + n_running if has_weight else None
        self.bias_index = 1 + n_running + has_weight if has_bias else None
        affine = tuple(i for i in (self.weight_index, self.bias_index) if i is not None)
        self.differentiable_inputs = (0,) + affine  # running statistics never get a gradient
        self.saves_inputs = (0,) + ((self.weight_index,) if has_weight else ())

    # --- geometry: (rows, row_len, channels, spatial, groups) of x's shape; outer for dw/db
    def geometry(self, shape) -> tuple[int, int, int, int, int]:
        raise NotImplementedError

    def affine_shape(self, shape) -> tuple[int, ...]:
        raise NotImplementedError

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (len(input_shapes) - 1)

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"{self.name} expects a floating-point input, got {str(input_dtypes[0]).replace('torch.', '')}")

    def extra_outputs(self, input_shapes, dtype):
        rows = self.geometry(input_shapes[0])[0]
        stats = {"rstd": ((rows,), _stats_dtype(dtype))}
        if self.centred:
            stats["mean"] = ((rows,), _stats_dtype(dtype))
        return stats

    def stats_source(self) -> int:
        return BATCH_STATS

    def running_stats(self, ctx: OpContext):
        return None, None

    def update_running(self) -> bool:
        return False

    def momentum(self) -> float:
        return 0.0

    def _affine(self, ctx: OpContext, tensors: list):
        """weight and bias (or None) out of a list laid out like the node's inputs."""
        w = tensors[self.weight_index] if self.has_weight else None
        b = tensors[self.bias_index] if self.has_bias else None
        return w, b

    def forward(self, ctx: OpContext) -> None:
        (x,) = ctx.inputs
        w, b = self._affine(ctx, [x, *ctx.params])
        rows, row_len, channels, spatial, groups = self.geometry(x.shape)
        running_mean, running_var = self.running_stats(ctx)
        mean = ctx.saved.get("mean", ctx.saved["rstd"])  # rms_norm keeps no mean: never read
        v = ArgVisitor()
        for ptr in (x, w, b, ctx.output, mean, ctx.saved["rstd"], running_mean, running_var):
            v.visit_ptr(x if ptr is None else ptr)  # x stands in for absent tensors (never read)
        v.visit_i64(row_len).visit_i64(channels).visit_i64(spatial).visit_i64(groups)
        v.visit_f32(self.eps).visit_f32(self.momentum())
        for flag in (self.layout, self.centred, self.has_weight, self.has_bias, self.stats_source(), self.update_running(),
                     _block(row_len)):
            v.visit_constexpr(flag)
        ctx.launch(norm_forward, (rows,), v, work=rows * row_len)

    def has_backward(self) -> bool:
        return True

    def backward_kernels(self):
        return (norm_backward, norm_weight_backward, sum_partials)

    def backward(self, ctx: OpContext) -> None:
        x = ctx.inputs[0]
        w, _ = self._affine(ctx, [x, *ctx.params])
        (dx,) = ctx.grad_inputs
        dw, db = self._affine(ctx, [dx, *ctx.grad_params])
        dy = ctx.grad_output
        rows, row_len, channels, spatial, groups = self.geometry(x.shape)
        mean, rstd = ctx.saved.get("mean", ctx.saved["rstd"]), ctx.saved["rstd"]
        row_grads = self.layout == CHANNELS
        if dx is not None or (row_grads and (dw is not None or db is not None)):
            v = ArgVisitor()
            for ptr in (x, w, dy, dx, mean, rstd, dw if row_grads else None, db if row_grads else None):
                v.visit_ptr(x if ptr is None else ptr)
            v.visit_i64(row_len).visit_i64(channels).visit_i64(spatial).visit_i64(groups)
            for flag in (self.layout, self.centred, self.has_weight, self.stats_source(), dx is not None,
                         row_grads and dw is not None, row_grads and db is not None, _block(row_len)):
                v.visit_constexpr(flag)
            ctx.launch(norm_backward, (rows,), v, work=rows * row_len)
        if not row_grads and (dw is not None or db is not None):
            self._weight_backward(ctx, x, dy, mean, rstd, dw, db, channels, spatial, groups)

    def _weight_backward(self, ctx, x, dy, mean, rstd, dw, db, channels, spatial, groups) -> None:
        outer = x.numel() // max(channels * spatial, 1)
        n_partials = cdiv(outer, ROWS_PER_WEIGHT_PROGRAM)
        block_s = min(triton.next_power_of_2(max(spatial, 1)), 256)
        block_c = max(1, min(triton.next_power_of_2(max(channels, 1)), 4096 // block_s, 1024))
        partial_dtype = _stats_dtype(ctx.dtype)
        partials = {name: ctx.empty((n_partials, channels), partial_dtype) if g is not None else None
                    for name, g in (("dw", dw), ("db", db))}
        v = ArgVisitor()
        for ptr in (x, dy, mean, rstd, partials["dw"], partials["db"]):
            v.visit_ptr(x if ptr is None else ptr)
        v.visit_i64(outer).visit_i64(channels).visit_i64(spatial).visit_i64(groups).visit_i64(ROWS_PER_WEIGHT_PROGRAM)
        for flag in (self.centred, dw is not None, db is not None, block_c, block_s):
            v.visit_constexpr(flag)
        ctx.launch(norm_weight_backward, (n_partials, cdiv(channels, block_c)), v, work=x.numel())
        for grad, partial in ((dw, partials["dw"]), (db, partials["db"])):
            if grad is None:
                continue
            v = ArgVisitor().visit_ptr(partial).visit_ptr(grad).visit_i64(n_partials).visit_i64(channels)
            v.visit_constexpr(1024)
            ctx.launch(sum_partials, (cdiv(channels, 1024),), v, work=channels)


class LayerNormOp(NormOp):
    """layer_norm / rms_norm: each row of prod(normalized_shape) trailing elements."""

    def __init__(self, normalized_shape, eps, has_weight, has_bias, centred=True):
        super().__init__("layer_norm" if centred else "rms_norm", eps, has_weight, has_bias)
        self.normalized_shape = tuple(normalized_shape)
        self.centred = centred

    def affine_shape(self, shape):
        return self.normalized_shape

    def geometry(self, shape):
        k = len(self.normalized_shape)
        row_len = math.prod(self.normalized_shape)
        return math.prod(shape[:len(shape) - k]), row_len, row_len, 1, 1

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape, ns = tuple(input_shapes[0]), self.normalized_shape
        if len(ns) == 0 or len(shape) < len(ns) or shape[len(shape) - len(ns):] != ns:
            raise ValueError(f"given normalized_shape={list(ns)}, expected input with shape [*, "
                             f"{', '.join(str(s) for s in ns)}], but got input of size {_dims(shape)}")


class GroupNormOp(NormOp):
    """group_norm over x of shape (N, C, *): rows are (n, group), C / num_groups channels each."""

    def __init__(self, num_groups, eps, has_weight, has_bias):
        super().__init__("group_norm", eps, has_weight, has_bias)
        self.num_groups = int(num_groups)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def geometry(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        return n * self.num_groups, (c // self.num_groups) * spatial, c, spatial, self.num_groups

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ValueError(f"group_norm expects an input of shape (N, C, *), got {_dims(shape)}")
        if self.num_groups <= 0 or shape[1] % self.num_groups:
            raise ValueError(f"expected the number of channels ({shape[1]}) to be divisible by num_groups "
                             f"({self.num_groups}), but got input of shape {_dims(shape)}")


class BatchNormOp(NormOp):
    """batch_norm over x of shape (N, C, *): one statistics row per channel. Inputs: x,
    running_mean, running_var (when given), weight, bias (when given)."""

    layout = CHANNELS

    def __init__(self, has_running, training, momentum, eps, has_weight, has_bias):
        super().__init__("batch_norm", eps, has_weight, has_bias, n_running=2 if has_running else 0)
        self.has_running, self.training, self._momentum = has_running, bool(training), float(momentum)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def geometry(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        return c, n * spatial, c, spatial, c

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ValueError(f"batch_norm expects an input of shape (N, C, *), got {_dims(shape)}")
        if self.training and shape[0] * math.prod(shape[2:]) <= 1:
            raise ValueError(f"expected more than 1 value per channel when training, got input of size {_dims(shape)}")

    def stats_source(self):
        return BATCH_STATS if self.training else RUNNING_STATS

    def running_stats(self, ctx):
        return (ctx.params[0], ctx.params[1]) if self.has_running else (None, None)

    def update_running(self):
        return self.training and self.has_running

    def momentum(self):
        return self._momentum


# --------------------------------------------------------------------------- functional ops


def _apply(op: NormOp, x, *tensors):
    return graph_of(x).apply(op, [x, *(t for t in tensors if t is not None)])


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """Normalise over the trailing ``normalized_shape`` dims: (x - mean) / sqrt(var + eps) * weight + bias."""
    op = LayerNormOp(_normalized_shape(normalized_shape), eps, weight is not None, bias is not None)
    return _apply(op, x, weight, bias)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the trailing dims; eps=None: torch.finfo(x.dtype).eps."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    op = LayerNormOp(_normalized_shape(normalized_shape), eps, weight is not None, False, centred=False)
    return _apply(op, x, weight)


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """Normalise x (N, C, *) over each group of C / num_groups channels; per-channel weight and bias."""
    return _apply(GroupNormOp(num_groups, eps, weight is not None, bias is not None), x, weight, bias)


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5):
    """Normalise x (N, C, *) per channel. Training: batch statistics, and running_mean /
    running_var (when given) are updated in place with ``momentum`` (unbiased variance).
    Inference: the running statistics."""
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm: give both running_mean and running_var, or neither")
    if not training and running_mean is None:
        raise ValueError("batch_norm: running_mean and running_var are required when training=False")
    if momentum is None:
        raise ValueError("batch_norm: momentum=None (cumulative moving average) is not supported; give a float")
    op = BatchNormOp(running_mean is not None, training, momentum, eps, weight is not None, bias is not None)
    return _apply(op, x, running_mean, running_var, weight, bias)


# ---------------------------------------------------------------------------------- layers


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.normalized_shape, self.eps = _normalized_shape(normalized_shape), eps
        self.weight = Parameter(self.normalized_shape, init.ones(), dtype) if elementwise_affine else None
        self.bias = Parameter(self.normalized_shape, init.zeros(), dtype) if elementwise_affine and bias else None

    def forward(self, x):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.normalized_shape, self.eps = _normalized_shape(normalized_shape), eps
        self.weight = Parameter(self.normalized_shape, init.ones(), dtype) if elementwise_affine else None

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = Parameter((num_channels,), init.ones(), dtype) if affine else None
        self.bias = Parameter((num_channels,), init.zeros(), dtype) if affine else None

    def forward(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNorm(Module):
    input_dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter((num_features,), init.ones(), dtype) if affine else None
        self.bias = Parameter((num_features,), init.zeros(), dtype) if affine else None
        self.track_running_stats = track_running_stats
        if track_running_stats:
            self.running_mean = Parameter((num_features,), init.zeros(), dtype, trainable=False)
            self.running_var = Parameter((num_features,), init.ones(), dtype, trainable=False)
        else:
            self.running_mean = self.running_var = None

    def forward(self, x):
        if x.ndim not in self.input_dims:
            wanted = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(f"{type(self).__name__}: expected {wanted} input, got {x.ndim}D input of shape {_dims(x.shape)}")
        training = self.training or not self.track_running_stats
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, training,
                          self.momentum, self.eps)


class BatchNorm1d(_BatchNorm):
    """Over (N, C) or (N, C, L)."""

    input_dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Over (N, C, H, W)."""

    input_dims = (4,)


# -------------------------------------------------------------------------- registry/tests

_KERNELS = (norm_forward, norm_backward, norm_weight_backward, sum_partials)


def _affine(gen, dtype, shape):
    return make(gen, *shape, low=0.5, high=1.5).to(dtype), make(gen, *shape, low=-0.5, high=0.5).to(dtype)


def _layer_samples(dtype, gen, shapes=(((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((129, 7), (7,)), ((1, 5), (5,)),
                                       ((0, 5), (5,)))):
    out = []
    for shape, ns in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, ns)
        out.append(Sample((x, ns, w, b), name=f"{shape} {ns}", reduction=math.prod(shape[len(shape) - len(ns):])))
    x = make(gen, 4, 9, dtype=dtype)
    out.append(Sample((x, (9,)), name="(4, 9) no affine", reduction=9))
    return out


def _layer_gradcheck(gen):
    return _layer_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))))


def _rms_samples(dtype, gen, shapes=None):
    base = _layer_samples(dtype, gen, shapes) if shapes else _layer_samples(dtype, gen)
    out = [Sample(s.args[:3], name=s.name, reduction=s.reduction) for s in base]
    out.append(Sample((base[0].args[0], base[0].args[1], base[0].args[2]), {"eps": 1e-3}, name="eps=1e-3",
                      reduction=base[0].reduction))
    return out


def _rms_gradcheck(gen):
    return _rms_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))))


def _group_samples(dtype, gen, shapes=(((2, 6, 5), 3), ((3, 4), 2), ((2, 4, 3, 2), 4))):
    out = []
    for shape, groups in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, (shape[1],))
        reduction = shape[1] // groups * math.prod(shape[2:])
        out.append(Sample((x, groups, w, b), name=f"{shape} groups={groups}", reduction=max(reduction, shape[0])))
    x = make(gen, 2, 6, 5, dtype=dtype)
    out.append(Sample((x, 2), name="(2, 6, 5) no affine", reduction=15))
    return out


def _group_gradcheck(gen):
    return _group_samples(torch.float64, gen, shapes=(((2, 6, 2), 3), ((2, 4), 2)))


def _batch_samples(dtype, gen, shapes=((7, 3), (4, 3, 5, 2)), modes=(True, False)):
    out = []
    for shape in shapes:
        c = shape[1]
        for training in modes:
            x = make(gen, *shape, dtype=dtype)
            rm, rv = make(gen, c, low=-0.5, high=0.5).to(dtype), make(gen, c, low=0.5, high=2.0).to(dtype)
            w, b = _affine(gen, dtype, (c,))
            reduction = shape[0] * math.prod(shape[2:])
            out.append(Sample((x, rm, rv, w, b), {"training": training, "momentum": 0.2}, grad=(0, 3, 4),
                              name=f"{shape} training={training}", reduction=reduction))
            out.append(Sample((x.clone(), rm.clone(), rv.clone()), {"training": training}, grad=(0,),
                              name=f"{shape} training={training} no affine", reduction=reduction))
    return out


def _batch_gradcheck(gen):
    return _batch_samples(torch.float64, gen, shapes=((5, 3), (3, 2, 2)))


register(OpInfo("layer_norm", layer_norm, F.layer_norm, _layer_samples, family="norm", kernels=_KERNELS,
                gradcheck_samples=_layer_gradcheck))
register(OpInfo("rms_norm", rms_norm, F.rms_norm, _rms_samples, family="norm", kernels=_KERNELS,
                gradcheck_samples=_rms_gradcheck))
register(OpInfo("group_norm", group_norm, F.group_norm, _group_samples, family="norm", kernels=_KERNELS,
                gradcheck_samples=_group_gradcheck))
register(OpInfo("batch_norm", batch_norm, F.batch_norm, _batch_samples, family="norm", kernels=_KERNELS,
                gradcheck_samples=_batch_gradcheck))
