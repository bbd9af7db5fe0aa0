"""The normalisation kernels: ``norm_forward`` and its backward pair ``norm_backward`` /
``norm_weight_backward`` (the maths is in the package docstring, ``teeny.ops.norm``).

The kernels work on 2-D tiles of ROWS statistics rows x BLOCK columns (``tiling.tile_shape``): under the
interpreter, which pays per program and per tl operation, a tile holds thousands of elements
so that a small problem is a handful of programs; on the GPU a tile is about ``tiling.GPU_TILE``
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

import triton
import triton.language as tl

from ...core.common import sum_to_shape_kernel
from ...core.kernel import kernel

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


@kernel(half=True, optional=("w_ptr", "dx_ptr", "dx_add_ptr", "dx_copy_ptr", "mean_ptr", "dw_ptr", "db_ptr"))
def norm_backward(
    x_ptr,
    w_ptr,
    dy_ptr,
    dx_ptr,
    dx_add_ptr,
    dx_copy_ptr,
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
    w_offset,
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
    plus dx_add, the gradient of x's other readers, when given: dx itself or another tensor; and
    the same values again into dx_copy, in its dtype, when given: a fused add's half-precision branch),
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
        w_cols = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(COMPUTE) + w_offset
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
                    g = dy * (tl.load(w_ptr + rows[:, None], mask=row_mask[:, None], other=0.0).to(COMPUTE) + w_offset)
                else:
                    channel = ((rows % groups) * channels_per_group)[:, None] + (cols // SPATIAL)[None, :]
                    g = dy * (tl.load(w_ptr + channel, mask=mask, other=0.0).to(COMPUTE) + w_offset)
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
                if dx_copy_ptr is not None:
                    tl.store(dx_copy_ptr + offs, dx.to(dx_copy_ptr.dtype.element_ty), mask=mask)
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
                        g = dy * (tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE) + w_offset)
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
                        g = g * (tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE) + w_offset)
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
                    if dx_copy_ptr is not None:
                        tl.store(dx_copy_ptr + offs, dx.to(dx_copy_ptr.dtype.element_ty), mask=mask)
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
    w_offset,
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
    """One tile of ROWS rows per program: mean (centred: mean_ptr given), rstd (saved), y (its scale
    is w + w_offset: w_offset is 1 for Gemma's rms_norm, else 0, as in norm_backward), and the
    running statistics (batch statistics with running_mean_ptr given). With residual_ptr (rows of
    x only) the rows normalised are x + residual, written to sum_ptr (``fusions.residual_norm.AddNormOp``).
    SAVED_STATS: y only, from the mean and rstd at mean_ptr / rstd_ptr."""
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
                y = y * (tl.load(w_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE) + w_offset)
            if b_ptr is not None:
                y = y + tl.load(b_ptr + channel, mask=channel_mask, other=0.0).to(COMPUTE)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
