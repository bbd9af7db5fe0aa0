"""Normalisation: layer_norm, rms_norm, group_norm, batch_norm.

Every op normalises "statistics rows" of x: y = (x - mean) * rstd * w + b with
rstd = 1 / sqrt(var + eps) (biased variance; rms_norm: mean = 0, var = mean(x^2)). Where the
rows lie is the op's layout (``Rows``):

* rows of x (layer_norm, rms_norm, group_norm): row r is contiguous, x[r * row_len + j]; the
  affine channel of element j is (r % groups) * (channels / groups) + j // spatial
  (layer/rms: groups = spatial = 1, so the channel is j).
* channels (batch_norm over x viewed as (N, C, S)): row c gathers x[n, c, s] for all n, s
  (j = n * S + s); its affine channel is c.

Backward, with xhat = (x - mean) * rstd and g = dy * w, per row of length L:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (rms_norm: without mean(g))
    dx = rstd * g                                          (batch_norm on running statistics)
    dw[c] = sum over the elements of channel c of dy * xhat,   db[c] = sum of dy

A constant row has var = 0: rstd = 1 / sqrt(eps) is large but finite and xhat = 0, so every
formula stays finite, as in PyTorch (no 0/0 anywhere).

The kernels work on 2-D tiles of ROWS statistics rows x BLOCK columns (``_tile``): under the
interpreter, which pays per program and per tl operation, a tile holds thousands of elements
so that a small problem is a handful of programs; on the GPU a tile is about ``GPU_TILE``
elements (one long row, or several short ones). A row that fits one block is loaded once and
kept in registers; a longer row loops over column blocks (forward: per-block means and M2
merged with Chan's formula; backward: a pass for the row sums, a pass for dx). The forward
saves mean/rstd per row, from which the backward recomputes xhat. The backward reads dy in
place when it is row-strided (``strided_grad_output``: e.g. a slice of a wider gradient).

dw/db: for batch_norm a row is a whole channel, so ``norm_backward`` writes its sums directly
(``PER_ROW``). When the channel of column j is j (layer_norm, rms_norm) and a row fits one
block, ``norm_backward`` also reduces dw/db (``PER_PROGRAM``, as in Liger-Kernel and the Triton
layer-norm tutorial): each program loops over its ``tiles_per_program`` tiles, accumulates
dy * xhat and dy in fp32 registers and writes ONE partial row; ``common.sum_partials`` adds the
partial rows (dw's and db's, halves of one buffer, in one launch). Then backward reads x and dy
once. Otherwise (group_norm, rows longer than one block) ``norm_weight_backward`` writes partial
rows over a (outer, channels, spatial) view of x.
No locks, no atomics: bit-reproducible. Half-precision inputs compute in float32, float64 in
float64 (eps and momentum included). Column loop bounds (ROW_LEN, SPATIAL, ...) are
compile-time constants (one compile per row length on the GPU).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import init
from ..device import DEVICE, INTERPRETER
from ..graph import graph_of
from ..kernel import Kernel, dtype_name, kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, Block, Launch, OpContext, RuntimeOp
from .common import acc_dtype, cdiv, pow2, sum_partials, sum_to_shape_kernel, tl_acc_dtype

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm"]
NN_LAYERS = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d"]

MAX_BLOCK = 4096 if INTERPRETER else 16384  # longest column block of one row; longer rows loop (tests lower it)
INTERPRETER_TILE = 1 << 15  # elements of one tile under the interpreter (few, wide programs)
GPU_TILE = 4096  # elements of one tile on the GPU (short rows: several rows per program)
PROGRAMS_PER_SM = 2  # programs (= dw/db partial rows) of the fused backward on the GPU
INTERPRETER_PROGRAMS = 4  # the same under the interpreter
ROWS_PER_WEIGHT_PROGRAM = 32  # rows reduced by one program of norm_weight_backward

# STATS: where the statistics come from (SAVED_STATS: those the forward saved, as the backward
# reads them, when it writes y again: ``NormOp.recompute_launches``)
BATCH_STATS, RUNNING_STATS, SAVED_STATS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# CHANNEL: the affine channel of column j of statistics row r
COLUMN_CHANNEL = tl.constexpr(0)  # j (layer_norm, rms_norm)
ROW_CHANNEL = tl.constexpr(1)  # r (batch_norm)
GROUP_CHANNEL = tl.constexpr(2)  # (r % groups) * channels_per_group + j // SPATIAL (group_norm)
# AFFINE_GRAD: what norm_backward writes to dw_ptr / db_ptr (when given)
PER_ROW = tl.constexpr(1)  # the sum over each statistics row (one row = one channel)
PER_PROGRAM = tl.constexpr(2)  # one partial row per program, summed by common.sum_partials
# DY_ROW_LEN when dy is laid out like x (contiguous); otherwise it is the length of dy's rows
DY_LIKE_X = tl.constexpr(0)

# Index maths is written inline in the kernels (a @triton.jit helper call costs about 0.3 ms per
# call and program under the interpreter; dy's offsets take one, _dy_offsets). Column j of statistics row r lies at
#     r * row_stride + (j // INNER) * outer_stride + j % INNER
# (rows of x: row_stride = INNER = ROW_LEN, so it is r * ROW_LEN + j; channels: row_stride =
# INNER = SPATIAL, outer_stride = C * SPATIAL). dy lies where x does unless it is row-strided:
# then x's flat index i lies at (i // DY_ROW_LEN) * dy_row_stride + i % DY_ROW_LEN.


@triton.jit
def _dy_offsets(offs, rows, c, dy_row_stride, ROW_LEN: tl.constexpr, DY_ROW_LEN: tl.constexpr):
    """Offsets of dy at x's offsets ``offs`` (rows x columns c of statistics rows of x)."""
    if DY_ROW_LEN == DY_LIKE_X:
        return offs
    elif DY_ROW_LEN == ROW_LEN:  # a statistics row is one row of dy (layer_norm over the last dim)
        return rows.to(tl.int64)[:, None] * dy_row_stride + c[None, :]
    else:
        flat = rows.to(tl.int64)[:, None] * ROW_LEN + c[None, :]
        return (flat // DY_ROW_LEN) * dy_row_stride + flat % DY_ROW_LEN


@kernel(half=True, optional=("w_ptr", "dx_ptr", "dx_add_ptr", "mean_ptr", "dw_ptr", "db_ptr"))
def norm_backward(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    dx_add_ptr,
    mean_ptr,
    rstd_ptr,
    dw_ptr,
    db_ptr,
    n_rows,
    tiles_per_program,
    row_stride,
    outer_stride,
    channels_per_group,
    groups,
    dy_row_stride,
    ROW_LEN: tl.constexpr,
    INNER: tl.constexpr,
    SPATIAL: tl.constexpr,
    CHANNEL: tl.constexpr,
    STATS: tl.constexpr,
    AFFINE_GRAD: tl.constexpr,
    DY_ROW_LEN: tl.constexpr,
    COMPUTE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program p takes tiles p * tiles_per_program ... of ROWS rows: dx (when dx_ptr is given;
    plus dx_add, the gradient of x's other readers, when given: dx itself or another tensor),
    and dw/db (when given) PER_ROW (dw[r] = sum_j dy * xhat) or PER_PROGRAM (dw[p, j] = sum over
    its rows of dy * xhat; needs ROW_LEN <= BLOCK and COLUMN_CHANNEL). Centred (mean_ptr given)
    or not (rms_norm)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < ROW_LEN
    if INNER == ROW_LEN:
        col_offs = cols.to(tl.int64)
    else:
        col_offs = (cols // INNER).to(tl.int64) * outer_stride + cols % INNER
    w_cols = tl.zeros([BLOCK], dtype=COMPUTE)
    if w_ptr is not None and CHANNEL == COLUMN_CHANNEL and ROW_LEN <= BLOCK:  # the same for every row: load once
        w_cols = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(COMPUTE)
    dw_acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE)  # PER_PROGRAM sums, reduced over rows at the end
    db_acc = tl.zeros([ROWS, BLOCK], dtype=COMPUTE)
    for tile in range(0, tiles_per_program):
        rows = (pid * tiles_per_program + tile) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        base = rows.to(tl.int64) * row_stride
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)[:, None]
        if mean_ptr is not None:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)[:, None]
        else:
            mean = rstd * 0
        if ROW_LEN <= BLOCK:  # one block: x and dy stay in registers
            mask = row_mask[:, None] & col_mask[None, :]
            offs = base[:, None] + col_offs[None, :]
            dy_offs = _dy_offsets(offs, rows, cols, dy_row_stride, ROW_LEN, DY_ROW_LEN)
            dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(COMPUTE)
            g = dy
            if w_ptr is not None:
                if CHANNEL == COLUMN_CHANNEL:
                    g = dy * w_cols[None, :]
                elif CHANNEL == ROW_CHANNEL:
                    g = dy * tl.load(w_ptr + rows[:, None], mask=row_mask[:, None], other=0.0).to(COMPUTE)
                else:
                    channel = ((rows % groups) * channels_per_group)[:, None] + (cols // SPATIAL)[None, :]
                    g = dy * tl.load(w_ptr + channel, mask=mask, other=0.0).to(COMPUTE)
            xhat = dy * 0
            if STATS == BATCH_STATS or dw_ptr is not None:
                xhat = tl.where(mask, (tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE) - mean) * rstd, 0.0)
            if dx_ptr is not None:
                if STATS == BATCH_STATS:
                    mean_g_xhat = tl.sum(g * xhat, 1)[:, None] / ROW_LEN
                    if mean_ptr is not None:
                        dx = rstd * (g - tl.sum(g, 1)[:, None] / ROW_LEN - xhat * mean_g_xhat)
                    else:
                        dx = rstd * (g - xhat * mean_g_xhat)
                else:
                    dx = rstd * g
                if dx_add_ptr is not None:
                    dx += tl.load(dx_add_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if dw_ptr is not None and AFFINE_GRAD == PER_ROW:
                tl.store(dw_ptr + rows, tl.sum(dy * xhat, 1).to(dw_ptr.dtype.element_ty), mask=row_mask)
            if db_ptr is not None and AFFINE_GRAD == PER_ROW:
                tl.store(db_ptr + rows, tl.sum(dy, 1).to(db_ptr.dtype.element_ty), mask=row_mask)
            if dw_ptr is not None and AFFINE_GRAD == PER_PROGRAM:
                dw_acc += dy * xhat
            if db_ptr is not None and AFFINE_GRAD == PER_PROGRAM:
                db_acc += dy
        else:  # a pass for the row sums (and PER_ROW dw/db), a pass for dx
            zero = tl.zeros([ROWS], dtype=COMPUTE)
            sum_g, sum_g_xhat, sum_dy, sum_dy_xhat = zero, zero, zero, zero
            if STATS == BATCH_STATS or dw_ptr is not None or db_ptr is not None:
                for start in range(0, ROW_LEN, BLOCK):
                    c = start + cols
                    mask = row_mask[:, None] & (c < ROW_LEN)[None, :]
                    if INNER == ROW_LEN:
                        offs = base[:, None] + c[None, :]
                    else:
                        offs = base[:, None] + ((c // INNER).to(tl.int64) * outer_stride + c % INNER)[None, :]
                    dy_offs = _dy_offsets(offs, rows, c, dy_row_stride, ROW_LEN, DY_ROW_LEN)
                    dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(COMPUTE)
                    xhat = tl.where(mask, (tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE) - mean) * rstd, 0.0)
                    g = dy
                    if w_ptr is not None:
                        if CHANNEL == COLUMN_CHANNEL:
                            channel, channel_mask = c[None, :], (c < ROW_LEN)[None, :]
                        elif CHANNEL == ROW_CHANNEL:
                            channel, channel_mask = rows[:, None], row_mask[:, None]
                        else:
                            channel = ((rows % groups) * channels_per_group)[:, None] + (c // SPATIAL)[None, :]
                            channel_mask = mask
                        g = dy * tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE)
                    sum_g += tl.sum(g, 1)
                    sum_g_xhat += tl.sum(g * xhat, 1)
                    sum_dy += tl.sum(dy, 1)
                    sum_dy_xhat += tl.sum(dy * xhat, 1)
            if dw_ptr is not None and AFFINE_GRAD == PER_ROW:
                tl.store(dw_ptr + rows, sum_dy_xhat.to(dw_ptr.dtype.element_ty), mask=row_mask)
            if db_ptr is not None and AFFINE_GRAD == PER_ROW:
                tl.store(db_ptr + rows, sum_dy.to(db_ptr.dtype.element_ty), mask=row_mask)
            if dx_ptr is not None:
                mean_g = (sum_g / ROW_LEN)[:, None]
                mean_g_xhat = (sum_g_xhat / ROW_LEN)[:, None]
                for start in range(0, ROW_LEN, BLOCK):
                    c = start + cols
                    mask = row_mask[:, None] & (c < ROW_LEN)[None, :]
                    if INNER == ROW_LEN:
                        offs = base[:, None] + c[None, :]
                    else:
                        offs = base[:, None] + ((c // INNER).to(tl.int64) * outer_stride + c % INNER)[None, :]
                    dy_offs = _dy_offsets(offs, rows, c, dy_row_stride, ROW_LEN, DY_ROW_LEN)
                    g = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(COMPUTE)
                    if w_ptr is not None:
                        if CHANNEL == COLUMN_CHANNEL:
                            channel, channel_mask = c[None, :], (c < ROW_LEN)[None, :]
                        elif CHANNEL == ROW_CHANNEL:
                            channel, channel_mask = rows[:, None], row_mask[:, None]
                        else:
                            channel = ((rows % groups) * channels_per_group)[:, None] + (c // SPATIAL)[None, :]
                            channel_mask = mask
                        g = g * tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE)
                    if STATS == BATCH_STATS:
                        xhat = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE) - mean) * rstd
                        if mean_ptr is not None:
                            dx = rstd * (g - mean_g - xhat * mean_g_xhat)
                        else:
                            dx = rstd * (g - xhat * mean_g_xhat)
                    else:
                        dx = rstd * g
                    if dx_add_ptr is not None:
                        dx += tl.load(dx_add_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if dw_ptr is not None and AFFINE_GRAD == PER_PROGRAM:
        tl.store(dw_ptr + pid.to(tl.int64) * ROW_LEN + cols, tl.sum(dw_acc, 0), mask=col_mask)
    if db_ptr is not None and AFFINE_GRAD == PER_PROGRAM:
        tl.store(db_ptr + pid.to(tl.int64) * ROW_LEN + cols, tl.sum(db_acc, 0), mask=col_mask)


@kernel(half=True, optional=("mean_ptr", "dw_partial_ptr", "db_partial_ptr"))
def norm_weight_backward(
    x_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    outer,
    channels,
    groups,
    dy_row_stride,
    SPATIAL: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    DY_ROW_LEN: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
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
        if mean_ptr is not None:
            mean = tl.load(mean_ptr + stats_row, mask=row_mask, other=0.0).to(COMPUTE)
        else:
            mean = rstd * 0
        for s_start in range(0, SPATIAL, BLOCK_S):
            s_cur = s_start + s
            mask = row_mask[:, None] & (s_cur < SPATIAL)[None, :]
            offs = (a * channels + c[:, None]) * SPATIAL + s_cur[None, :]
            if DY_ROW_LEN == DY_LIKE_X:
                dy_offs = offs
            else:  # offs is x's flat index
                dy_offs = (offs // DY_ROW_LEN) * dy_row_stride + offs % DY_ROW_LEN
            dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(COMPUTE)
            if dw_partial_ptr is not None:
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
                dw += dy * (x - mean[:, None]) * rstd[:, None]
            if db_partial_ptr is not None:
                db += dy
    partial = pid.to(tl.int64) * channels + c
    if dw_partial_ptr is not None:
        tl.store(dw_partial_ptr + partial, tl.sum(dw, 1), mask=c_mask)
    if db_partial_ptr is not None:
        tl.store(db_partial_ptr + partial, tl.sum(db, 1), mask=c_mask)


@triton.jit
def _load_x(
    x_ptr, residual_ptr, sum_ptr, offs, mask, residual_numel, RESIDUAL_REPEATS: tl.constexpr, COMPUTE: tl.constexpr
):
    """x at ``offs`` in COMPUTE precision; with residual_ptr, x + residual rounded to x's dtype
    (as the add it replaces rounds its sum; residual repeats every residual_numel elements when
    RESIDUAL_REPEATS), also stored at sum_ptr when given."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if residual_ptr is not None:
        if RESIDUAL_REPEATS:
            r = tl.load(residual_ptr + offs % residual_numel, mask=mask, other=0.0)
        else:
            r = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        x = (x.to(COMPUTE) + r.to(COMPUTE)).to(x_ptr.dtype.element_ty)
        if sum_ptr is not None:
            tl.store(sum_ptr + offs, x, mask=mask)
    return x.to(COMPUTE)


@kernel(
    backward=(norm_backward, norm_weight_backward, sum_to_shape_kernel),
    half=True,
    optional=("residual_ptr", "w_ptr", "b_ptr", "sum_ptr", "mean_ptr", "running_mean_ptr", "running_var_ptr"),
)
def norm_forward(
    x_ptr,
    residual_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    sum_ptr,
    mean_ptr,
    rstd_ptr,
    running_mean_ptr,
    running_var_ptr,
    n_rows,
    row_stride,
    outer_stride,
    channels_per_group,
    groups,
    eps,
    momentum,
    residual_numel,
    ROW_LEN: tl.constexpr,
    INNER: tl.constexpr,
    SPATIAL: tl.constexpr,
    CHANNEL: tl.constexpr,
    STATS: tl.constexpr,
    RESIDUAL_REPEATS: tl.constexpr,
    COMPUTE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One tile of ROWS rows per program: mean (centred: mean_ptr given), rstd (saved), y, and the
    running statistics (batch statistics with running_mean_ptr given). With residual_ptr (rows of
    x only) the rows normalised are x + residual, written to sum_ptr (``AddNormOp``). SAVED_STATS:
    y only, from the mean and rstd at mean_ptr / rstd_ptr."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    base = rows.to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK)
    if STATS == RUNNING_STATS:  # batch_norm in inference
        mean = tl.load(running_mean_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)
        rstd = 1.0 / tl.sqrt(tl.load(running_var_ptr + rows, mask=row_mask, other=1.0).to(COMPUTE) + eps)
    elif STATS == SAVED_STATS:
        mean = tl.zeros([ROWS], dtype=COMPUTE)
        if mean_ptr is not None:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=1.0).to(COMPUTE)
    else:
        if ROW_LEN <= BLOCK:  # one block: x stays in registers for y
            mask = row_mask[:, None] & (cols < ROW_LEN)[None, :]
            if INNER == ROW_LEN:
                offs = base[:, None] + cols[None, :]
            else:
                offs = base[:, None] + ((cols // INNER).to(tl.int64) * outer_stride + cols % INNER)[None, :]
            x = _load_x(x_ptr, residual_ptr, sum_ptr, offs, mask, residual_numel, RESIDUAL_REPEATS, COMPUTE)
            if mean_ptr is not None:
                mean = tl.sum(x, 1) / ROW_LEN
                d = tl.where(mask, x - mean[:, None], 0.0)
                m2 = tl.sum(d * d, 1)
            else:
                m2 = tl.sum(x * x, 1)
        else:
            count = tl.zeros([], dtype=COMPUTE)
            mean = tl.zeros([ROWS], dtype=COMPUTE)
            m2 = tl.zeros([ROWS], dtype=COMPUTE)
            for start in range(0, ROW_LEN, BLOCK):
                c = start + cols
                mask = row_mask[:, None] & (c < ROW_LEN)[None, :]
                if INNER == ROW_LEN:
                    offs = base[:, None] + c[None, :]
                else:
                    offs = base[:, None] + ((c // INNER).to(tl.int64) * outer_stride + c % INNER)[None, :]
                x = _load_x(x_ptr, residual_ptr, sum_ptr, offs, mask, residual_numel, RESIDUAL_REPEATS, COMPUTE)
                if mean_ptr is not None:  # Chan et al.: merge this block's (count, mean, M2) into the running ones
                    n_block = tl.minimum(ROW_LEN - start, BLOCK).to(COMPUTE)
                    mean_block = tl.sum(x, 1) / n_block
                    d = tl.where(mask, x - mean_block[:, None], 0.0)
                    delta = mean_block - mean
                    total = count + n_block
                    mean += delta * (n_block / total)
                    m2 += tl.sum(d * d, 1) + delta * delta * (count * n_block / total)
                    count = total
                else:
                    m2 += tl.sum(x * x, 1)
        rstd = 1.0 / tl.sqrt(m2 / ROW_LEN + eps)
        if running_mean_ptr is not None:  # running_var takes the unbiased variance, as in PyTorch
            running_mean = tl.load(running_mean_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)
            running_var = tl.load(running_var_ptr + rows, mask=row_mask, other=0.0).to(COMPUTE)
            new_mean = (1.0 - momentum) * running_mean + momentum * mean
            new_var = (1.0 - momentum) * running_var + momentum * (m2 / (ROW_LEN - 1))
            tl.store(running_mean_ptr + rows, new_mean.to(running_mean_ptr.dtype.element_ty), mask=row_mask)
            tl.store(running_var_ptr + rows, new_var.to(running_var_ptr.dtype.element_ty), mask=row_mask)
    if STATS != SAVED_STATS:
        if mean_ptr is not None:
            tl.store(mean_ptr + rows, mean.to(mean_ptr.dtype.element_ty), mask=row_mask)
        tl.store(rstd_ptr + rows, rstd.to(rstd_ptr.dtype.element_ty), mask=row_mask)
    for start in range(0, ROW_LEN, BLOCK):
        c = start + cols
        mask = row_mask[:, None] & (c < ROW_LEN)[None, :]
        if INNER == ROW_LEN:
            offs = base[:, None] + c[None, :]
        else:
            offs = base[:, None] + ((c // INNER).to(tl.int64) * outer_stride + c % INNER)[None, :]
        if STATS != BATCH_STATS or ROW_LEN > BLOCK:  # else x of the statistics pass is still in registers
            x = _load_x(x_ptr, residual_ptr, None, offs, mask, residual_numel, RESIDUAL_REPEATS, COMPUTE)
        if mean_ptr is not None:
            y = (x - mean[:, None]) * rstd[:, None]
        else:
            y = x * rstd[:, None]
        if w_ptr is not None or b_ptr is not None:
            if CHANNEL == COLUMN_CHANNEL:  # the affine channels as a row, a column or a tile (broadcast against y)
                channel, channel_mask = c[None, :], (c < ROW_LEN)[None, :]
            elif CHANNEL == ROW_CHANNEL:
                channel, channel_mask = rows[:, None], row_mask[:, None]
            else:
                channel, channel_mask = ((rows % groups) * channels_per_group)[:, None] + (c // SPATIAL)[None, :], mask
            if w_ptr is not None:
                y = y * tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE)
            if b_ptr is not None:
                y = y + tl.load(b_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ RuntimeOp


def _block(n: int) -> int:
    return max(16, min(pow2(n), MAX_BLOCK))


def _tile(rows: int, row_len: int, dtype: torch.dtype) -> tuple[int, int]:
    """(ROWS, BLOCK) of a tile: a block of the row, and as many rows as fill the tile budget
    (on the GPU, half as many float64 elements: they take two registers each)."""
    block = _block(row_len)
    budget = INTERPRETER_TILE if INTERPRETER else GPU_TILE // (2 if dtype == torch.float64 else 1)
    return max(1, min(budget // block, pow2(rows))), block


def _launch_block(kernel: Kernel, block: int, tile: int, elements_per_warp: int) -> Block:
    """The ``BLOCK`` size, num_warps for the tile (about ``elements_per_warp`` each, 4 to 16) and
    two pipeline stages for the row loop (bench/NOTES.md: on the H200 stages=2 beat 1 and the
    default 3 for bf16 16384x4096), unless the kernel was tuned (Kernel.tune, bench/tune_launch.py)."""
    if INTERPRETER or kernel.launch_options:
        return Block(block)
    return Block(block, num_warps=max(4, min(16, tile // elements_per_warp)), num_stages=2)


@functools.cache
def _sm_count() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _max_programs() -> int:
    """Programs (and dw/db partial rows) of the fused backward: a few per SM on the GPU, so
    that every SM streams rows while the partial rows stay few."""
    return INTERPRETER_PROGRAMS if INTERPRETER else PROGRAMS_PER_SM * _sm_count()


def _dims(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _dy_layout(ctx: OpContext) -> dict:
    """DY_ROW_LEN and dy_row_stride of the backward kernels: DY_LIKE_X for a contiguous dy, else
    the length of dy's last dim and the distance between its rows."""
    dy = ctx.grad_output
    if dy.is_contiguous():
        return dict(DY_ROW_LEN=DY_LIKE_X, dy_row_stride=0)
    return dict(DY_ROW_LEN=dy.shape[-1], dy_row_stride=ctx.grad_output_row_stride)


@dataclass(frozen=True)
class Rows:
    """Where the statistics rows of x lie (see the index maths above the kernels)."""

    rows: int
    row_len: int
    inner: int
    row_stride: int
    outer_stride: int
    spatial: int  # elements per channel in a row (rows of x)
    channels: int
    groups: int
    channel_is_row: bool = False

    @property
    def channel(self) -> tl.constexpr:
        """The CHANNEL constant of the kernels."""
        if self.channel_is_row:
            return ROW_CHANNEL
        return COLUMN_CHANNEL if self.groups == 1 and self.spatial == 1 else GROUP_CHANNEL

    def index_args(self) -> dict:
        """The kernels' index arguments, by name."""
        return dict(
            n_rows=self.rows,
            row_stride=self.row_stride,
            outer_stride=self.outer_stride,
            channels_per_group=self.channels // max(self.groups, 1),
            groups=self.groups,
            ROW_LEN=self.row_len,
            INNER=max(self.inner, 1),
            SPATIAL=self.spatial,
            CHANNEL=self.channel,
        )


class NormOp(RuntimeOp):
    """One normalisation node. Inputs: x, then (batch_norm) running_mean, running_var, then
    weight and bias when given. Subclasses say where the statistics rows lie (``stats_rows``)."""

    n_activation_inputs = 1
    kernel = norm_forward
    centred = True
    out_dtype: torch.dtype | None = None  # y's dtype when not x's (LayerNormOp's out_dtype)
    strided_grad_output = True  # the backward reads dy in place from a row-strided gradient
    grad_accumulates = True  # dx added to the gradient of x's other readers (a residual stream's)

    def __init__(self, name: str, eps: float, has_weight: bool, has_bias: bool, n_running: int = 0):
        self.name, self.eps = name, float(eps)
        self.has_weight, self.has_bias = has_weight, has_bias
        self.weight_index = 1 + n_running if has_weight else None
        self.bias_index = 1 + n_running + has_weight if has_bias else None
        affine = tuple(i for i in (self.weight_index, self.bias_index) if i is not None)
        self.differentiable_inputs = (0,) + affine  # running statistics never get a gradient
        self.saves_inputs = (0,) + ((self.weight_index,) if has_weight else ())

    def stats_rows(self, shape) -> Rows:
        raise NotImplementedError

    def affine_shape(self, shape) -> tuple[int, ...]:
        raise NotImplementedError

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (len(input_shapes) - 1)

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(
                f"{self.name} expects a floating-point input, got {str(input_dtypes[0]).replace('torch.', '')}"
            )

    def output_dtype(self, input_dtypes):
        return self.out_dtype or input_dtypes[0]

    def extra_outputs(self, input_shapes, dtype):
        rows = self.stats_rows(input_shapes[0]).rows
        stats = {"rstd": ((rows,), acc_dtype(dtype))}
        if self.centred:
            stats["mean"] = ((rows,), acc_dtype(dtype))
        return stats

    def stats_source(self) -> tl.constexpr:
        return BATCH_STATS

    def running_stats(self, ctx: OpContext):
        """(running_mean, running_var) the forward reads or updates, or (None, None)."""
        return None, None

    def momentum(self) -> float:
        return 0.0

    def sources(self, ctx: OpContext) -> dict:
        """What the forward normalises: x (``AddNormOp``: the sum of two tensors it also writes)."""
        return dict(x_ptr=ctx.inputs[0], residual_numel=1, RESIDUAL_REPEATS=False)

    def _affine(self, tensors: list):
        """weight and bias (or None) out of a list laid out like the node's inputs."""
        w = tensors[self.weight_index] if self.has_weight else None
        b = tensors[self.bias_index] if self.has_bias else None
        return w, b

    def forward_launches(self, ctx: OpContext) -> list[Launch]:
        return self._normalise(ctx, self.sources(ctx), self.stats_source(), self.running_stats(ctx))

    @property
    def recomputable(self) -> tuple[int, ...]:
        """y again from x, the affine parameters and the saved mean and rstd."""
        return tuple(i for i in (0, self.weight_index, self.bias_index) if i is not None)

    def recompute_launches(self, ctx: OpContext) -> list[Launch]:
        plain = dict(x_ptr=ctx.inputs[0], residual_numel=1, RESIDUAL_REPEATS=False)  # AddNormOp: x is the sum
        return self._normalise(ctx, plain, SAVED_STATS, (None, None))

    def _normalise(self, ctx: OpContext, sources: dict, stats, running) -> list[Launch]:
        (x,) = ctx.inputs
        w, b = self._affine([x, *ctx.params])
        rows = self.stats_rows(x.shape)
        rows_per_tile, block = _tile(rows.rows, rows.row_len, ctx.dtype)
        running_mean, running_var = running
        args = ArgVisitor().visit(
            **sources,
            w_ptr=w,
            b_ptr=b,
            y_ptr=ctx.output,
            mean_ptr=ctx.saved.get("mean"),
            rstd_ptr=ctx.saved["rstd"],
            running_mean_ptr=running_mean,
            running_var_ptr=running_var,
            eps=self.eps,
            momentum=self.momentum(),
            STATS=stats,
            COMPUTE=tl_acc_dtype(ctx.dtype),
            ROWS=rows_per_tile,
            **rows.index_args(),
        )
        grid = (cdiv(rows.rows, rows_per_tile),)
        return [Launch(norm_forward, grid, args, _launch_block(norm_forward, block, rows_per_tile * block, 1024))]

    def backward_launches(self, ctx: OpContext) -> list[Launch]:
        x = ctx.inputs[0]
        w, _ = self._affine([x, *ctx.params])
        (dx,) = ctx.grad_inputs
        dw, db = self._affine([dx, *ctx.grad_params])
        rows = self.stats_rows(x.shape)
        rows_per_tile, block = _tile(rows.rows, rows.row_len, ctx.dtype)
        if rows.channel_is_row:  # a row is a whole channel: its sums are dw, db
            target = PER_ROW
        elif rows.channel == COLUMN_CHANNEL and rows.row_len <= block:  # fused: partial rows per program
            target = PER_PROGRAM
        else:
            target = None  # norm_weight_backward
        fused = target is not None and (dw is not None or db is not None)
        n_tiles = cdiv(rows.rows, rows_per_tile)
        tiles_per_program = max(1, cdiv(n_tiles, _max_programs())) if fused and target == PER_PROGRAM else 1
        n_programs = cdiv(n_tiles, tiles_per_program)

        if target == PER_PROGRAM:
            dw_out, db_out, both = _partial_rows(ctx, dw, db, n_programs, rows.row_len)
        else:
            dw_out, db_out = (None if target is None else dw), (None if target is None else db)
        launches = []
        if dx is not None or fused:
            args = ArgVisitor().visit(
                x_ptr=x,
                w_ptr=w,
                dy_ptr=ctx.grad_output,
                dx_ptr=dx,
                dx_add_ptr=ctx.grad_input_addend if dx is not None else None,
                mean_ptr=ctx.saved.get("mean"),
                rstd_ptr=ctx.saved["rstd"],
                dw_ptr=dw_out,
                db_ptr=db_out,
                tiles_per_program=tiles_per_program,
                STATS=self.stats_source(),
                AFFINE_GRAD=target if target is not None else PER_ROW,  # unused without dw_ptr / db_ptr
                COMPUTE=tl_acc_dtype(ctx.dtype),
                ROWS=rows_per_tile,
                **rows.index_args(),
                **_dy_layout(ctx),
            )
            launch_block = _launch_block(norm_backward, block, rows_per_tile * block, 512)
            launches.append(Launch(norm_backward, (n_programs,), args, launch_block))
        if fused and target == PER_PROGRAM:
            launches += _sum_partial_rows(dw, db, dw_out, db_out, both)
        if target is None and (dw is not None or db is not None):
            launches += self._weight_backward(ctx, rows, dw, db)
        return launches

    def _weight_backward(self, ctx: OpContext, rows: Rows, dw, db) -> list[Launch]:
        """dw/db through norm_weight_backward's partial rows and ``sum_partials``."""
        x, channels, spatial = ctx.inputs[0], rows.channels, rows.spatial
        outer = x.numel() // max(channels * spatial, 1)
        n_partials = cdiv(outer, ROWS_PER_WEIGHT_PROGRAM)
        block_s = min(pow2(spatial), 256)
        block_c = max(1, min(pow2(channels), 2048 // block_s, 1024))
        dw_partial, db_partial, both = _partial_rows(ctx, dw, db, n_partials, channels)
        args = ArgVisitor().visit(
            x_ptr=x,
            dy_ptr=ctx.grad_output,
            mean_ptr=ctx.saved.get("mean"),
            rstd_ptr=ctx.saved["rstd"],
            dw_partial_ptr=dw_partial,
            db_partial_ptr=db_partial,
            outer=outer,
            channels=channels,
            groups=rows.groups,
            SPATIAL=spatial,
            ROWS_PER_PROGRAM=ROWS_PER_WEIGHT_PROGRAM,
            COMPUTE=tl_acc_dtype(ctx.dtype),
            BLOCK_C=block_c,
            BLOCK_S=block_s,
            **_dy_layout(ctx),
        )
        launches = [Launch(norm_weight_backward, (n_partials, cdiv(channels, block_c)), args)]
        return launches + _sum_partial_rows(dw, db, dw_partial, db_partial, both)


def _partial_rows(ctx: OpContext, dw, db, n: int, channels: int) -> tuple:
    """Float32 (float64) buffers of n partial rows for dw and for db (None where that gradient
    is not wanted), and, when both are, the one (2, n, channels) buffer they are halves of."""
    dtype = acc_dtype(ctx.dtype)
    if dw is not None and db is not None:
        both = ctx.empty((2, n, channels), dtype)
        return both[0], both[1], both
    return *(ctx.empty((n, channels), dtype) if g is not None else None for g in (dw, db)), None


def _sum_partial_rows(dw, db, dw_partial, db_partial, both) -> list[Launch]:
    """dw and db from their partial rows (``_partial_rows``): both in one launch when both are wanted."""
    if both is not None:
        return sum_partials(both, dw, db)
    return [launch for grad, rows in ((dw, dw_partial), (db, db_partial)) if grad is not None
            for launch in sum_partials(rows, grad)]  # fmt: skip


class LayerNormOp(NormOp):
    """layer_norm / rms_norm: each row of prod(normalized_shape) trailing elements. ``out_dtype``:
    y written in that dtype (computed as always in x's float32 or float64), dy read in it."""

    def __init__(self, normalized_shape, eps, has_weight, has_bias, centred=True, out_dtype=None):
        super().__init__("layer_norm" if centred else "rms_norm", eps, has_weight, has_bias)
        self.normalized_shape = tuple(normalized_shape)
        self.centred = centred
        if out_dtype is not None and not out_dtype.is_floating_point:
            raise TypeError(f"{self.name}: out_dtype must be a floating-point dtype, got {dtype_name(out_dtype)}")
        self.out_dtype = out_dtype

    def affine_shape(self, shape):
        return self.normalized_shape

    def stats_rows(self, shape):
        row_len = math.prod(self.normalized_shape)
        rows = math.prod(shape[: len(shape) - len(self.normalized_shape)])
        return Rows(
            rows, row_len, inner=row_len, row_stride=row_len, outer_stride=0, spatial=1, channels=row_len, groups=1
        )

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape, ns = tuple(input_shapes[0]), self.normalized_shape
        if len(ns) == 0 or len(shape) < len(ns) or shape[len(shape) - len(ns) :] != ns:
            raise ValueError(
                f"given normalized_shape={list(ns)}, expected input with shape [*, "
                f"{', '.join(str(s) for s in ns)}], but got input of size {_dims(shape)}"
            )


def repeats_over_rows(shape, full_shape) -> bool:
    """Whether a tensor of ``shape`` laid over ``full_shape`` repeats along its leading dims
    (element i of the full tensor reads element i % numel: (T, d) under (B, T, d))."""
    shape = list(shape)
    while shape and shape[0] == 1:
        shape.pop(0)
    return len(shape) <= len(full_shape) and tuple(shape) == tuple(full_shape[len(full_shape) - len(shape) :])


class AddNormOp(LayerNormOp):
    """layer_norm / rms_norm of s = x + residual where s is also read downstream (a residual
    stream; made by ``teeny.rewrites.fuse_residual_norm``). Inputs: s, weight and bias (when
    given), x, residual; s is the output of the add's ``TakenInOp``, which launches nothing:
    this forward reads x and residual once, writes their sum into s and normalises it (one read
    of s fewer than add + norm, and one launch). residual is x-shaped or repeats over x's leading
    dims; it may be of a narrower float dtype than s (an upcast the add read, taken in: the sum
    is the same). Backward: the norm's, on s (x and residual get their gradients through the add)."""

    mixed_float_inputs = True

    def __init__(self, norm: LayerNormOp):
        super().__init__(norm.normalized_shape, norm.eps, norm.has_weight, norm.has_bias, norm.centred, norm.out_dtype)
        self.name = f"add_{norm.name}"

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (self.has_weight + self.has_bias) + [None, None]

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        s, x, residual = (tuple(input_shapes[i]) for i in (0, -2, -1))
        if x != s or not repeats_over_rows(residual, s):
            raise ValueError(f"the sum {s} must have x's shape {x}, and the residual {residual} must repeat over it")

    def sources(self, ctx):
        s, (x, residual) = ctx.inputs[0], ctx.params[-2:]
        return dict(
            x_ptr=x,
            residual_ptr=residual,
            sum_ptr=s,
            residual_numel=max(residual.numel(), 1),
            RESIDUAL_REPEATS=residual.numel() != s.numel(),
        )


class TakenInOp(RuntimeOp):
    """A node whose forward ``AddNormOp`` takes in: the residual add s = a + b (the norm writes
    s), or the exact upcast of the residual that the norm reads in its own dtype (nothing reads
    the upcast value forwards). No launch forwards; backward, the op's own."""

    def __init__(self, op: RuntimeOp):
        self.op = op
        self.name, self.kernel = f"{op.name}_in_norm", op.kernel
        self.n_activation_inputs, self.differentiable_inputs = op.n_activation_inputs, op.differentiable_inputs
        self.saves_inputs, self.saves_output = op.saves_inputs, op.saves_output
        self.strided_grad_output = op.strided_grad_output

    def output_shape(self, input_shapes):
        return self.op.output_shape(input_shapes)

    def output_dtype(self, input_dtypes):
        return self.op.output_dtype(input_dtypes)

    def check_inputs(self, input_shapes, input_dtypes):
        self.op.check_inputs(input_shapes, input_dtypes)

    def has_backward(self):
        return self.op.has_backward()

    def forward_launches(self, ctx):
        return []  # AddNormOp writes the sum; the upcast is read in its source's dtype

    def backward_launches(self, ctx):
        return self.op.backward_launches(ctx)


class GroupNormOp(NormOp):
    """group_norm over x of shape (N, C, *): rows are (n, group), C / num_groups channels each."""

    def __init__(self, num_groups, eps, has_weight, has_bias):
        super().__init__("group_norm", eps, has_weight, has_bias)
        self.num_groups = int(num_groups)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def stats_rows(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        row_len = (c // self.num_groups) * spatial
        return Rows(
            n * self.num_groups,
            row_len,
            inner=row_len,
            row_stride=row_len,
            outer_stride=0,
            spatial=spatial,
            channels=c,
            groups=self.num_groups,
        )

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ValueError(f"group_norm expects an input of shape (N, C, *), got {_dims(shape)}")
        if self.num_groups <= 0 or shape[1] % self.num_groups:
            raise ValueError(
                f"expected the number of channels ({shape[1]}) to be divisible by num_groups "
                f"({self.num_groups}), but got input of shape {_dims(shape)}"
            )


class BatchNormOp(NormOp):
    """batch_norm over x of shape (N, C, *): one statistics row per channel. Inputs: x,
    running_mean, running_var (when given), weight, bias (when given)."""

    strided_grad_output = False  # its rows (channels) gather dy across rows of the gradient

    def __init__(self, has_running, training, momentum, eps, has_weight, has_bias):
        super().__init__("batch_norm", eps, has_weight, has_bias, n_running=2 if has_running else 0)
        self.has_running, self.training, self._momentum = has_running, bool(training), float(momentum)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def stats_rows(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        return Rows(
            c,
            n * spatial,
            inner=spatial,
            row_stride=spatial,
            outer_stride=c * spatial,
            spatial=spatial,
            channels=c,
            groups=c,
            channel_is_row=True,
        )

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

    def mutated_inputs(self):
        """In training the forward writes the running statistics (its params 0 and 1) in place."""
        return (1, 2) if self.training and self.has_running else ()

    def momentum(self):
        return self._momentum


# --------------------------------------------------------------------------- functional ops


def _apply(op: NormOp, x, *tensors):
    return graph_of(x).apply(op, [x, *(t for t in tensors if t is not None)])


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Normalise over the trailing ``normalized_shape`` dims: (x - mean) / sqrt(var + eps) * weight + bias.
    ``out_dtype``: the result's dtype, if not x's (rounded once from x's precision: a float32
    norm whose readers take it in bf16 writes bf16, with no cast after it)."""
    op = LayerNormOp(_normalized_shape(normalized_shape), eps, weight is not None, bias is not None,
                     out_dtype=_other_dtype(out_dtype, x))  # fmt: skip
    return _apply(op, x, weight, bias)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None, out_dtype: torch.dtype | None = None):
    """x / sqrt(mean(x^2) + eps) * weight over the trailing dims; eps=None: torch.finfo(x.dtype).eps.
    ``out_dtype`` as for layer_norm."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    op = LayerNormOp(_normalized_shape(normalized_shape), eps, weight is not None, False, centred=False,
                     out_dtype=_other_dtype(out_dtype, x))  # fmt: skip
    return _apply(op, x, weight)


def _other_dtype(out_dtype: torch.dtype | None, x) -> torch.dtype | None:
    """``out_dtype`` where it differs from x's (the same dtype: the plain op, one key)."""
    return None if out_dtype is None or out_dtype == x.dtype else out_dtype


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """Normalise x (N, C, *) over each group of C / num_groups channels; per-channel weight and bias."""
    return _apply(GroupNormOp(num_groups, eps, weight is not None, bias is not None), x, weight, bias)


def batch_norm(
    x,
    running_mean,
    running_var,
    weight=None,
    bias=None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
):
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
    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.normalized_shape, self.eps = _normalized_shape(normalized_shape), eps
        self.weight = Parameter(self.normalized_shape, init.ones(), dtype) if elementwise_affine else None
        self.bias = Parameter(self.normalized_shape, init.zeros(), dtype) if elementwise_affine and bias else None

    def forward(self, x):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.normalized_shape, self.eps = _normalized_shape(normalized_shape), eps
        self.weight = Parameter(self.normalized_shape, init.ones(), dtype) if elementwise_affine else None

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GroupNorm(Module):
    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
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

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
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
            raise ValueError(
                f"{type(self).__name__}: expected {wanted} input, got {x.ndim}D input of shape {_dims(x.shape)}"
            )
        training = self.training or not self.track_running_stats
        return batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training, self.momentum, self.eps
        )


class BatchNorm1d(_BatchNorm):
    """Over (N, C) or (N, C, L)."""

    input_dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Over (N, C, H, W)."""

    input_dims = (4,)


# -------------------------------------------------------------------------- registry/tests


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


def _rms_samples(
    dtype, gen, shapes=(((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((1, 5), (5,)), ((0, 5), (5,))), plain=(4, 9)
):
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
            out.append(
                Sample(
                    (x, rm, rv, w, b),
                    {"training": training, "momentum": 0.2},
                    grad=(0, 3, 4),
                    name=f"{shape} training={training}",
                    reduction=reduction,
                )
            )
            out.append(
                Sample(
                    (x.clone(), rm.clone(), rv.clone()),
                    {"training": training},
                    grad=(0,),
                    name=f"{shape} training={training} no affine",
                    reduction=reduction,
                )
            )
    return out


def _batch_gradcheck(gen):
    return _batch_samples(torch.float64, gen, shapes=((5, 3), (3, 2, 2)))


register(
    OpInfo("layer_norm", layer_norm, F.layer_norm, _layer_samples, family="norm", gradcheck_samples=_layer_gradcheck)
)
register(OpInfo("rms_norm", rms_norm, F.rms_norm, _rms_samples, family="norm", gradcheck_samples=_rms_gradcheck))
register(
    OpInfo("group_norm", group_norm, F.group_norm, _group_samples, family="norm", gradcheck_samples=_group_gradcheck)
)
register(
    OpInfo("batch_norm", batch_norm, F.batch_norm, _batch_samples, family="norm", gradcheck_samples=_batch_gradcheck)
)
