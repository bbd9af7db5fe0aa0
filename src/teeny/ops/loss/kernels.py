"""The loss kernels: one pair for every element-wise loss (``pointwise_loss_forward`` /
``_backward``, the loss's maths passed in as two @triton.jit functions, ``_mse`` / ``_mse_grad``
...), one fused row pair for cross-entropy and NLL (``class_loss_forward`` / ``_backward``), and
the sums of the chunked head + cross-entropy (``linear_cross_entropy_forward`` / ``_backward``,
for ``teeny.fusions.chunked_loss``). The maths is in the package docstring, ``teeny.ops.loss``.

Reductions to a scalar never use atomics: each program writes the fp32 (fp64 for float64)
sum of its block (for "mean", divided by the divisor) to a partials buffer that
``common.sum_partials`` adds into the loss. A mean weighted by the data (class losses: the sum
of the target classes' weights) sums the loss and the weights side by side, and ``loss_ratio``
divides them (bit-reproducible).

The class-loss forward saves only lse per row (and, for probability targets, the per-row target
mass sum_c w_c q'_c); the backward writes dx straight into the gradient buffer from the saved
logits and lse: no other logits-sized buffer exists. With SOFTCAP (Gemma 2's soft-capped logits)
every logit x they read becomes y = softcap * tanh(x / softcap) (``maths.soft_capped``): the loss
and lse are y's, and the gradient is y's times dy/dx = 1 - (y / softcap)^2; without it the
kernels compile as if the cap did not exist. A class index outside [0, C) that is not
ignore_index is never read out of bounds (the load is masked); the forward writes it to
``bad_index_ptr`` when given (``teeny.core.config.check_indices``), else its row's loss and
gradient are NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.common import upcast
from ...core.kernel import kernel
from .maths import soft_cap_slope, soft_capped

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


# ======================================================================= class-loss kernels


@triton.jit
def _row_offsets(rows, sample_stride, inner):
    """Offset of class 0 of each row (row r = n * inner + s of an (N, C, inner) input whose
    samples n are sample_stride apart: C * inner, or more for padded rows)."""
    return (rows // inner) * sample_stride + rows % inner


@triton.jit
def _class_target(
    target_ptr,
    weight_ptr,
    x_ptr,
    rows,
    row_mask,
    base,
    n_classes,
    inner,
    ignore_index,
    like,
    softcap,
    SOFTCAP: tl.constexpr,
):
    """For class-index targets: (t, active = not ignored, ok = active and in range, w_t, x_t);
    x_t soft-capped with SOFTCAP."""
    t = tl.load(target_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    active = row_mask & (t != ignore_index)
    ok = active & (t >= 0) & (t < n_classes)
    t_safe = tl.where(ok, t, 0)
    x_t = upcast(tl.load(x_ptr + base + t_safe * inner, mask=ok, other=0.0))
    if SOFTCAP:
        x_t = soft_capped(x_t, softcap)
    if weight_ptr is not None:
        w_t = upcast(tl.load(weight_ptr + t_safe, mask=ok, other=0.0))
    else:
        w_t = tl.where(ok, 1.0, 0.0).to(like.dtype)
    return t, active, ok, w_t, x_t


@triton.jit
def _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, other, softcap, SOFTCAP: tl.constexpr):
    """x at offsets (a block of columns cols of the rows), upcast and (SOFTCAP) soft-capped,
    ``other`` outside ``mask``. The load itself is masked by ``row_len`` (n_classes, or the
    padded length of rows whose padding may be read): a bound divisible by 16 lets Triton load
    the rows in wide vectors, which a vocabulary of 50,257 does not allow."""
    x = upcast(tl.load(x_ptr + offsets, mask=row_mask[:, None] & (cols < row_len)[None, :], other=other))
    if SOFTCAP:
        x = soft_capped(x, softcap)
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
    dx_sample_stride,
    row_len,
    ignore_index,
    label_smoothing,
    smoothing_per_class,
    divisor,
    softcap,
    SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dx (and, for probability targets, dtarget) of ROWS rows per program. lse_ptr: cross-entropy
    (None: NLL on log-probabilities); mass_ptr: probability targets (None: class indices);
    SOFTCAP: the logits soft-capped at ``softcap`` as they are read (module docstring). dx's
    samples lie dx_sample_stride apart (sample_stride, or rows padded to 16 bytes)."""
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
            target_ptr, weight_ptr, x_ptr, rows, row_mask, base, n_classes, inner, ignore_index, zero, softcap, SOFTCAP
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
        x = _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, 0.0, softcap, SOFTCAP)
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
        if SOFTCAP:
            dx = dx * soft_cap_slope(x, softcap)  # x is the capped y: dl/dx = dl/dy (1 - (y / cap)^2)
        if dx_ptr is not None:
            dx_offsets = _row_offsets(rows, dx_sample_stride, inner)[:, None] + cols[None, :].to(tl.int64) * inner
            tl.store(dx_ptr + dx_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


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
    softcap,
    SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The loss of ROWS rows per program (per row, or partial sums: see REDUCTION), lse (cross-
    entropy: lse_ptr given), the target mass (probability targets: mass_ptr given). With
    bad_index_ptr, a class index out of range (not ignore_index) is written there. With grad_ptr
    (cross-entropy on class indices), also the gradient of the rows' loss sum (dy = 1), in a
    second pass over the rows just read (from L2), which may write over x: one read of the
    logits from memory for the loss and its gradient (``LinearCrossEntropyOp``'s chunks). SOFTCAP:
    the logits soft-capped at ``softcap`` as they are read (module docstring)."""
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
            x = _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, float("-inf"), softcap, SOFTCAP)
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
            target_ptr, weight_ptr, x_ptr, rows, row_mask, base, n_classes, inner, ignore_index, zero, softcap, SOFTCAP
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
                y = _load_row_block(x_ptr, offsets, row_mask, cols, mask, row_len, 0.0, softcap, SOFTCAP)
                p = tl.exp(y - lse[:, None])
                w = _class_weights(weight_ptr, cols, col_mask, zero)[None, :]
                g = _class_index_grad(p, cols, t, w_t, w, w_total, label_smoothing, smoothing_per_class, SMOOTHING)
                if SOFTCAP:
                    g = g * soft_cap_slope(y, softcap)
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


# ============================================ linear + cross-entropy (teeny.fusions.chunked_loss)


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
