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
Half-precision inputs compute in float32, float64 in float64. Loop bounds (ROW_LEN, SPATIAL,
...) are compile-time constants: the Triton 3.6 interpreter with numpy 2.4 cannot run a
``range`` to a runtime scalar, and shapes are static per program anyway (one compile per
shape on the GPU).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

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
from .common import cdiv

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm"]
NN_LAYERS = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d"]

MAX_BLOCK = 4096  # longest column block of one row; longer rows loop (tests lower it)
ROWS_PER_WEIGHT_PROGRAM = 32  # rows reduced by one program of norm_weight_backward

# where the statistics come from (a compile-time constant of the kernels)
BATCH_STATS, RUNNING_STATS = 0, 1

# Index maths, written inline in every kernel (a @triton.jit helper call costs milliseconds
# per call under the interpreter). Column j of statistics row r lies at
#     r * row_stride + (j // INNER) * outer_stride + j % INNER
# (ROWS: row_stride = INNER = ROW_LEN; CHANNELS: row_stride = INNER = SPATIAL, outer_stride =
# C * SPATIAL), and its affine channel is r (CHANNEL_IS_ROW) or
# (r % groups) * channels_per_group + j // SPATIAL.


@kernel(half=True)
def norm_backward(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr,
                  row_stride, outer_stride, channels_per_group, groups,
                  ROW_LEN: tl.constexpr, INNER: tl.constexpr, SPATIAL: tl.constexpr, CHANNEL_IS_ROW: tl.constexpr,
                  CENTRED: tl.constexpr, HAS_WEIGHT: tl.constexpr, STATS: tl.constexpr, WRITE_DX: tl.constexpr,
                  ROW_DW: tl.constexpr, ROW_DB: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * row_stride
    cols = tl.arange(0, BLOCK)
    rstd = tl.load(rstd_ptr + row).to(COMPUTE)
    mean = tl.load(mean_ptr + row).to(COMPUTE) if CENTRED else rstd * 0
    zeros = tl.zeros([BLOCK], dtype=COMPUTE)
    sum_g, sum_g_xhat, sum_dy, sum_dy_xhat = zeros, zeros, zeros, zeros
    if STATS == 0 or ROW_DW or ROW_DB:
        for start in range(0, ROW_LEN, BLOCK):
            c = start + cols
            mask = c < ROW_LEN
            offs = base + (c // INNER).to(tl.int64) * outer_stride + c % INNER
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_WEIGHT:
                channel = row + c * 0 if CHANNEL_IS_ROW else (row % groups) * channels_per_group + c // SPATIAL
                g = dy * tl.load(w_ptr + channel, mask=mask, other=0.0).to(COMPUTE)
            sum_g += g
            sum_g_xhat += g * xhat
            sum_dy += dy
            sum_dy_xhat += dy * xhat
    if ROW_DW:
        tl.store(dw_ptr + row, tl.sum(sum_dy_xhat, 0).to(dw_ptr.dtype.element_ty))
    if ROW_DB:
        tl.store(db_ptr + row, tl.sum(sum_dy, 0).to(db_ptr.dtype.element_ty))
    if WRITE_DX:
        mean_g = tl.sum(sum_g, 0) / ROW_LEN
        mean_g_xhat = tl.sum(sum_g_xhat, 0) / ROW_LEN
        for start in range(0, ROW_LEN, BLOCK):
            c = start + cols
            mask = c < ROW_LEN
            offs = base + (c // INNER).to(tl.int64) * outer_stride + c % INNER
            g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            if HAS_WEIGHT:
                channel = row + c * 0 if CHANNEL_IS_ROW else (row % groups) * channels_per_group + c // SPATIAL
                g = g * tl.load(w_ptr + channel, mask=mask, other=0.0).to(COMPUTE)
            if STATS == 0:
                xhat = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE) - mean) * rstd
                if CENTRED:
                    dx = rstd * (g - mean_g - xhat * mean_g_xhat)
                else:
                    dx = rstd * (g - xhat * mean_g_xhat)
            else:
                dx = rstd * g
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def norm_weight_backward(x_ptr, dy_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr,
                         outer, channels, groups,
                         SPATIAL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, CENTRED: tl.constexpr,
                         HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, COMPUTE: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Over x viewed as (outer, channels, SPATIAL), statistics row of (a, c) =
    a * groups + c // (channels / groups): partial[pid, c] = sum over this program's
    ROWS_PER_PROGRAM values of a, and all s, of dy * xhat (dw) and dy (db)."""
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    c_mask = c < channels
    dw = tl.zeros([BLOCK_C, BLOCK_S], dtype=COMPUTE)  # reduced over s once, at the end
    db = tl.zeros([BLOCK_C, BLOCK_S], dtype=COMPUTE)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    for i in range(0, ROWS_PER_PROGRAM):
        a = first + i
        row_mask = c_mask & (a < outer)
        stats_row = a * groups + c // (channels // groups)
        rstd = tl.load(rstd_ptr + stats_row, mask=row_mask, other=0.0).to(COMPUTE)
        mean = tl.load(mean_ptr + stats_row, mask=row_mask, other=0.0).to(COMPUTE) if CENTRED else rstd * 0
        for s_start in range(0, SPATIAL, BLOCK_S):
            s_cur = s_start + s
            mask = row_mask[:, None] & (s_cur < SPATIAL)[None, :]
            offs = (a * channels + c[:, None]) * SPATIAL + s_cur[None, :]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            if HAS_DW:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                dw += dy * (x - mean[:, None]) * rstd[:, None]
            if HAS_DB:
                db += dy
    partial = pid.to(tl.int64) * channels + c
    if HAS_DW:
        tl.store(dw_partial_ptr + partial, tl.sum(dw, 1), mask=c_mask)
    if HAS_DB:
        tl.store(db_partial_ptr + partial, tl.sum(db, 1), mask=c_mask)


@kernel(half=True)
def sum_partials(partial_ptr, out_ptr, n, NUM_PARTIALS: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = sum over p of partial[p, j] (the second pass of a cross-program reduction)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.zeros([BLOCK], dtype=partial_ptr.dtype.element_ty)
    ptrs = partial_ptr + offs
    for _ in range(0, NUM_PARTIALS):
        total += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += n
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@kernel(backward=(norm_backward, norm_weight_backward, sum_partials), half=True)
def norm_forward(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, running_mean_ptr, running_var_ptr,
                 row_stride, outer_stride, channels_per_group, groups, eps, momentum,
                 ROW_LEN: tl.constexpr, INNER: tl.constexpr, SPATIAL: tl.constexpr, CHANNEL_IS_ROW: tl.constexpr,
                 CENTRED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
                 UPDATE_RUNNING: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * row_stride
    cols = tl.arange(0, BLOCK)
    if STATS == 1:  # RUNNING_STATS: batch_norm in inference
        mean = tl.load(running_mean_ptr + row).to(COMPUTE)
        rstd = 1.0 / tl.sqrt(tl.load(running_var_ptr + row).to(COMPUTE) + eps)
    else:
        zero = tl.zeros([], dtype=COMPUTE)
        count, mean, m2 = zero, zero, zero
        for start in range(0, ROW_LEN, BLOCK):
            c = start + cols
            mask = c < ROW_LEN
            offs = base + (c // INNER).to(tl.int64) * outer_stride + c % INNER
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
            if CENTRED:  # Chan et al.: merge this block's (count, mean, M2) into the running ones
                n_block = tl.minimum(ROW_LEN - start, BLOCK).to(COMPUTE)
                mean_block = tl.sum(x, 0) / n_block
                d = tl.where(mask, x - mean_block, 0.0)
                delta = mean_block - mean
                total = count + n_block
                mean += delta * (n_block / total)
                m2 += tl.sum(d * d, 0) + delta * delta * (count * n_block / total)
                count = total
            else:
                m2 += tl.sum(x * x, 0)
        var = m2 / ROW_LEN
        rstd = 1.0 / tl.sqrt(var + eps)
        if UPDATE_RUNNING:  # running_var takes the unbiased variance, as in PyTorch
            running_mean = tl.load(running_mean_ptr + row).to(COMPUTE)
            running_var = tl.load(running_var_ptr + row).to(COMPUTE)
            new_mean = (1.0 - momentum) * running_mean + momentum * mean
            new_var = (1.0 - momentum) * running_var + momentum * (m2 / (ROW_LEN - 1))
            tl.store(running_mean_ptr + row, new_mean.to(running_mean_ptr.dtype.element_ty))
            tl.store(running_var_ptr + row, new_var.to(running_var_ptr.dtype.element_ty))
    if CENTRED:
        tl.store(mean_ptr + row, mean.to(mean_ptr.dtype.element_ty))
    tl.store(rstd_ptr + row, rstd.to(rstd_ptr.dtype.element_ty))
    for start in range(0, ROW_LEN, BLOCK):
        c = start + cols
        mask = c < ROW_LEN
        offs = base + (c // INNER).to(tl.int64) * outer_stride + c % INNER
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
        y = (x - mean) * rstd if CENTRED else x * rstd
        if HAS_WEIGHT or HAS_BIAS:
            channel = row + c * 0 if CHANNEL_IS_ROW else (row % groups) * channels_per_group + c // SPATIAL
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + channel, mask=mask, other=0.0).to(COMPUTE)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + channel, mask=mask, other=0.0).to(COMPUTE)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ RuntimeOp


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block(n: int) -> int:
    return max(16, min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK))


def _dims(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@dataclass(frozen=True)
class Rows:
    """Where the statistics rows of x lie (see the index maths above the kernels)."""

    rows: int
    row_len: int
    inner: int
    row_stride: int
    outer_stride: int
    spatial: int  # elements per channel in a row (ROWS layouts)
    channels: int
    groups: int
    channel_is_row: bool = False

    def pack(self, v: ArgVisitor) -> None:
        """The runtime index arguments, then the compile-time ones (ROW_LEN ... CHANNEL_IS_ROW)."""
        v.visit_i64(self.row_stride).visit_i64(self.outer_stride)
        v.visit_i64(self.channels // max(self.groups, 1)).visit_i64(self.groups)

    def pack_constexprs(self, v: ArgVisitor) -> None:
        for value in (self.row_len, max(self.inner, 1), self.spatial, self.channel_is_row):
            v.visit_constexpr(value)


class NormOp(RuntimeOp):
    """One normalisation node. Inputs: x, then (batch_norm) running_mean, running_var, then
    weight and bias when given. Subclasses say where the statistics rows lie (``geometry``)."""

    n_activation_inputs = 1
    kernel = norm_forward
    centred = True

    def __init__(self, name: str, eps: float, has_weight: bool, has_bias: bool, n_running: int = 0):
        self.name, self.eps = name, float(eps)
        self.has_weight, self.has_bias = has_weight, has_bias
        self.weight_index = 1 + n_running if has_weight else None
        self.bias_index = 1 + n_running + has_weight if has_bias else None
        affine = tuple(i for i in (self.weight_index, self.bias_index) if i is not None)
        self.differentiable_inputs = (0,) + affine  # running statistics never get a gradient
        self.saves_inputs = (0,) + ((self.weight_index,) if has_weight else ())

    def geometry(self, shape) -> Rows:
        raise NotImplementedError

    def affine_shape(self, shape) -> tuple[int, ...]:
        raise NotImplementedError

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (len(input_shapes) - 1)

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"{self.name} expects a floating-point input, got {str(input_dtypes[0]).replace('torch.', '')}")

    def extra_outputs(self, input_shapes, dtype):
        rows = self.geometry(input_shapes[0]).rows
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

    def _affine(self, tensors: list):
        """weight and bias (or None) out of a list laid out like the node's inputs."""
        w = tensors[self.weight_index] if self.has_weight else None
        b = tensors[self.bias_index] if self.has_bias else None
        return w, b

    def forward(self, ctx: OpContext) -> None:
        (x,) = ctx.inputs
        w, b = self._affine([x, *ctx.params])
        geo = self.geometry(x.shape)
        running_mean, running_var = self.running_stats(ctx)
        mean = ctx.saved.get("mean", ctx.saved["rstd"])  # rms_norm keeps no mean: never read
        v = ArgVisitor()
        for ptr in (x, w, b, ctx.output, mean, ctx.saved["rstd"], running_mean, running_var):
            v.visit_ptr(x if ptr is None else ptr)  # x stands in for absent tensors (never read)
        geo.pack(v)
        v.visit_f32(self.eps).visit_f32(self.momentum())
        geo.pack_constexprs(v)
        for flag in (self.centred, self.has_weight, self.has_bias, self.stats_source(), self.update_running(),
                     _compute_dtype(ctx.dtype), _block(geo.row_len)):
            v.visit_constexpr(flag)
        ctx.launch(norm_forward, (geo.rows,), v, work=geo.rows * geo.row_len)

    def has_backward(self) -> bool:
        return True

    def backward_kernels(self):
        return (norm_backward, norm_weight_backward, sum_partials)

    def backward(self, ctx: OpContext) -> None:
        x = ctx.inputs[0]
        w, _ = self._affine([x, *ctx.params])
        (dx,) = ctx.grad_inputs
        dw, db = self._affine([dx, *ctx.grad_params])
        dy = ctx.grad_output
        geo = self.geometry(x.shape)
        mean, rstd = ctx.saved.get("mean", ctx.saved["rstd"]), ctx.saved["rstd"]
        row_grads = geo.channel_is_row  # a row is a whole channel: its sums are dw, db
        if dx is not None or (row_grads and (dw is not None or db is not None)):
            v = ArgVisitor()
            for ptr in (x, w, dy, dx, mean, rstd, dw if row_grads else None, db if row_grads else None):
                v.visit_ptr(x if ptr is None else ptr)
            geo.pack(v)
            geo.pack_constexprs(v)
            for flag in (self.centred, self.has_weight, self.stats_source(), dx is not None,
                         row_grads and dw is not None, row_grads and db is not None,
                         _compute_dtype(ctx.dtype), _block(geo.row_len)):
                v.visit_constexpr(flag)
            ctx.launch(norm_backward, (geo.rows,), v, work=geo.rows * geo.row_len)
        if not row_grads and (dw is not None or db is not None):
            self._weight_backward(ctx, x, dy, mean, rstd, dw, db, geo.channels, geo.spatial, geo.groups)

    def _weight_backward(self, ctx, x, dy, mean, rstd, dw, db, channels, spatial, groups) -> None:
        outer = x.numel() // max(channels * spatial, 1)
        n_partials = cdiv(outer, ROWS_PER_WEIGHT_PROGRAM)
        block_s = min(triton.next_power_of_2(max(spatial, 1)), 256)
        block_c = max(1, min(triton.next_power_of_2(max(channels, 1)), 2048 // block_s, 1024))
        partial_dtype = _stats_dtype(ctx.dtype)
        partials = {name: ctx.empty((n_partials, channels), partial_dtype) if g is not None else None
                    for name, g in (("dw", dw), ("db", db))}
        v = ArgVisitor()
        for ptr in (x, dy, mean, rstd, partials["dw"], partials["db"]):
            v.visit_ptr(x if ptr is None else ptr)
        v.visit_i64(outer).visit_i64(channels).visit_i64(groups)
        for flag in (spatial, ROWS_PER_WEIGHT_PROGRAM, self.centred, dw is not None, db is not None,
                     _compute_dtype(ctx.dtype), block_c, block_s):
            v.visit_constexpr(flag)
        ctx.launch(norm_weight_backward, (n_partials, cdiv(channels, block_c)), v, work=x.numel())
        for grad, partial in ((dw, partials["dw"]), (db, partials["db"])):
            if grad is None:
                continue
            v = ArgVisitor().visit_ptr(partial).visit_ptr(grad).visit_i64(channels)
            v.visit_constexpr(n_partials).visit_constexpr(1024)
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
        row_len = math.prod(self.normalized_shape)
        rows = math.prod(shape[:len(shape) - len(self.normalized_shape)])
        return Rows(rows, row_len, inner=row_len, row_stride=row_len, outer_stride=0, spatial=1, channels=row_len,
                    groups=1)

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
        row_len = (c // self.num_groups) * spatial
        return Rows(n * self.num_groups, row_len, inner=row_len, row_stride=row_len, outer_stride=0, spatial=spatial,
                    channels=c, groups=self.num_groups)

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

    def __init__(self, has_running, training, momentum, eps, has_weight, has_bias):
        super().__init__("batch_norm", eps, has_weight, has_bias, n_running=2 if has_running else 0)
        self.has_running, self.training, self._momentum = has_running, bool(training), float(momentum)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def geometry(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        return Rows(c, n * spatial, inner=spatial, row_stride=spatial, outer_stride=c * spatial, spatial=spatial,
                    channels=c, groups=c, channel_is_row=True)

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


_LAYER_SHAPES = (((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((129, 7), (7,)), ((1, 5), (5,)), ((0, 5), (5,)))


def _layer_samples(dtype, gen, shapes=_LAYER_SHAPES, plain=(4, 9)):
    out = []
    for shape, ns in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, ns)
        out.append(Sample((x, ns, w, b), name=f"{shape} {ns}", reduction=max(math.prod(ns), shape[0])))
    out.append(Sample((make(gen, *plain, dtype=dtype), plain[-1:]), name=f"{plain} no affine", reduction=plain[-1]))
    return out


def _layer_gradcheck(gen):
    return _layer_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))), plain=(2, 5))


def _rms_samples(dtype, gen, shapes=(((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((1, 5), (5,)), ((0, 5), (5,))),
                 plain=(4, 9)):
    out = [Sample(s.args[:3], name=s.name, reduction=s.reduction) for s in _layer_samples(dtype, gen, shapes, plain)]
    out.append(Sample(out[0].args, {"eps": 1e-3}, name=f"{out[0].name} eps=1e-3", reduction=out[0].reduction))
    return out


def _rms_gradcheck(gen):
    return _rms_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))), plain=(2, 5))[:-1]


def _group_samples(dtype, gen, shapes=(((2, 6, 5), 3), ((3, 4), 2), ((2, 4, 3, 2), 4)), plain=(2, 6, 5)):
    out = []
    for shape, groups in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, (shape[1],))
        reduction = max(shape[1] // groups * math.prod(shape[2:]), shape[0])
        out.append(Sample((x, groups, w, b), name=f"{shape} groups={groups}", reduction=reduction))
    out.append(Sample((make(gen, *plain, dtype=dtype), 2), name=f"{plain} groups=2 no affine", reduction=plain[1] // 2))
    return out


def _group_gradcheck(gen):
    return _group_samples(torch.float64, gen, shapes=(((2, 6, 2), 3), ((2, 4), 2)), plain=(2, 4))


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
