"""The attention kernels: ``attention_forward`` and its backward pair ``attention_backward_dq`` and
``attention_backward_dkdv`` (the maths: the package docstring; the tiles: ``tuning.py``; the strides
they index with: ``layout.py``).

Forward: one program per (head, block of BLOCK_M queries). It loads its query tile once and keeps
it in registers with the online-softmax state (row max, row sum and the O accumulator) while it
streams the key and value tiles of its head, BLOCK_N keys at a time, with the softmax in base 2
(exp2, with log2(e) folded into the scale: one multiply-add per score). It writes O and
lse2 = lse * log2(e), one value per query row, never the Lq x Lk matrix P: memory traffic is q,
O and lse2 once, and K and V once per query block. Key blocks every query of the block may see
in full (in range, not in any query's future) run a loop with no mask arithmetic; the blocks on
the causal diagonal and the last partial block run a checked loop; causal programs stop at the
diagonal, and the grid runs the longest query blocks first.

Backward, two launches and no atomics: ``attention_backward_dq`` (a program per query block:
delta for its rows, then dQ over the key blocks, streamed as in the forward) runs first, then
``attention_backward_dkdv`` (a program per key block of a key/value head: its K and V tiles and
the dK, dV accumulators stay in registers while it streams Q, dO, lse2 and delta over the query
blocks of every query head that reads it, split into unchecked and checked loops like the
forward). P is recomputed from lse2; the dropout mask is regenerated from the seed the forward
saved. Products use ``tl.dot`` with float32 accumulation (float64 for float64): bf16/fp16 tensor
cores for half inputs, float32 ones at the products' precision (tf32x3 on tensor cores: more
accurate than cuBLAS's SGEMM; tf32 with ``teeny.core.config.allow_tf32``), float64 ones exact.

Batch dims of q, k, v (and the mask) broadcast as in PyTorch; the kernels index them as two
levels (outer, head) with a stride per operand (0 along broadcast dims). Key/value heads
shared by several query heads (grouped-query attention, or one key/value head broadcast over
the query heads) are read in place, and their dK/dV summed inside the dkdv program; other
broadcast operands get their gradient summed by ``common.sum_to_shape``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.common import philox_keep, sum_to_shape_kernel, upcast, wait_for_previous
from ...core.device import INTERPRETER
from ...core.kernel import kernel

__all__ = ["LOG2E", "attention_backward_dkdv", "attention_backward_dq", "attention_forward"]

LOG2E = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------- device functions


def _device_fn(fn):
    """A device function called by the kernels: @triton.jit on the GPU. Under the interpreter
    a plain Python function (the kernel's tl calls work the same), since the interpreter
    re-patches triton.language on every call of a jit function (about 0.3-1 ms a call)."""
    return fn if INTERPRETER else triton.jit(fn)


@_device_fn
def _dot(a, b, acc, UPCAST_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b (acc may be None) in acc's dtype: float64 operands exact, float32 ones at
    PRECISION (the products' choice, ``linear.dot_precision``: tf32x3 on the GPU, on tensor cores
    and more accurate than cuBLAS's SGEMM; ieee under the interpreter), half ones on tensor cores
    (upcast to float32 under the interpreter, whose bf16 dot is wrong, then at PRECISION: ieee)."""
    if UPCAST_BF16 and (a.dtype == tl.bfloat16 or a.dtype == tl.float16):
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float64:
        if acc is None:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)
    elif a.dtype == tl.float32:
        if acc is None:
            return tl.dot(a, b, input_precision=PRECISION)
        else:
            return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)
    else:
        if acc is None:
            return tl.dot(a, b)
        else:
            return tl.dot(a, b, acc, out_dtype=acc.dtype)


@_device_fn
def _load_tile(base, rows, cols, n_rows, n_cols, ROW: tl.constexpr, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """base[rows, cols] of an (n_rows, n_cols) matrix whose rows lie ROW elements apart, 0
    outside it; unchecked loads (no mask: vectorised, pipelined) where the caller knows the
    tile is inside."""
    ptrs = base + rows[:, None] * ROW + cols[None, :]
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=(cols < n_cols)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@_device_fn
def _store_tile(base, value, rows, cols, n_rows, n_cols, ROW: tl.constexpr):
    ptrs = base + rows[:, None] * ROW + cols[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])


@_device_fn
def _apply_mask(s, mask_ptr, offsets, inside):
    """Scores s (base 2) with the user's mask applied: -inf where a boolean mask is False, plus
    bias * log2(e) for a float mask. ``offsets`` index the mask tile, ``inside`` guards it."""
    m = tl.load(mask_ptr + offsets, mask=inside, other=0)
    if mask_ptr.dtype.element_ty == tl.int1:
        if s.dtype == tl.float64:
            # Triton 3.6 gives a float64 dot operand the register layout of the narrowest load it
            # derives from, and float64 MMA has no such layout for a 1-byte load ("Currently fp64
            # don't support largeK MMA"); a reduction over a unit axis hides the load from it.
            m = tl.max(m.to(tl.int32)[:, :, None], axis=2)
        return tl.where(m != 0, s, float("-inf"))
    else:
        return s + upcast(m) * tl.full([], LOG2E, s.dtype)


@_device_fn
def _forward_keys(
    acc,
    row_sum,
    row_max,
    q,
    k_base,
    v_base,
    rows,
    start,
    end,
    q_len,
    k_len,
    qk_scale,
    mask_ptr,
    mask_base,
    mask_stride_q,
    mask_stride_k,
    seed,
    dropout_base,
    keep_threshold,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    DROPOUT: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The online softmax over key blocks start..end. CHECK: the blocks may hold keys out of
    range or (causal) later than some query; otherwise no score of them is masked but by the
    user's mask, and rows keep finite maxima (no -inf guard)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_base, cols, offs_d, k_len, D, K_ROW, CHECK, BLOCK_D != D)
        qk = _dot(q, tl.trans(k), None, UPCAST_BF16, PRECISION)
        if CHECK or mask_ptr is not None:
            s = qk * qk_scale
            if mask_ptr is not None:
                offsets = rows[:, None] * mask_stride_q + cols[None, :] * mask_stride_k
                inside = (rows < q_len)[:, None] & (cols < k_len)[None, :]
                s = _apply_mask(s, mask_ptr, mask_base + offsets, inside)
            if CHECK:
                seen = (cols < k_len)[None, :]
                if CAUSAL:
                    seen = seen & (cols[None, :] <= rows[:, None])
                s = tl.where(seen, s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: avoid inf - inf
            p = tl.math.exp2(s - shift[:, None])
            alpha = tl.math.exp2(row_max - shift)
        else:
            new_max = tl.maximum(row_max, tl.max(qk, 1) * qk_scale)  # qk_scale >= 0
            p = tl.math.exp2(qk * qk_scale - new_max[:, None])
            alpha = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = philox_keep(seed, dropout_base + rows[:, None] * k_len + cols[None, :], keep_threshold)
            p = tl.where(keep, p, 0.0)
        v = _load_tile(v_base, cols, offs_dv, k_len, DV, V_ROW, CHECK, BLOCK_DV != DV)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_BF16, PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@_device_fn
def _dq_keys(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    rows,
    start,
    end,
    q_len,
    k_len,
    qk_scale,
    dropout_scale,
    mask_ptr,
    mask_base,
    mask_stride_q,
    mask_stride_k,
    seed,
    dropout_base,
    keep_threshold,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    DROPOUT: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ (unscaled) += dS K over key blocks start..end (CHECK as in ``_forward_keys``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_base, cols, offs_d, k_len, D, K_ROW, CHECK, BLOCK_D != D)
        v = _load_tile(v_base, cols, offs_dv, k_len, DV, V_ROW, CHECK, BLOCK_DV != DV)
        s = _dot(q, tl.trans(k), None, UPCAST_BF16, PRECISION) * qk_scale
        if mask_ptr is not None:
            offsets = rows[:, None] * mask_stride_q + cols[None, :] * mask_stride_k
            inside = (rows < q_len)[:, None] & (cols < k_len)[None, :]
            s = _apply_mask(s, mask_ptr, mask_base + offsets, inside)
        if CHECK:
            seen = (cols < k_len)[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= rows[:, None])
            s = tl.where(seen, s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = _dot(do, tl.trans(v), None, UPCAST_BF16, PRECISION)
        if DROPOUT:
            keep = philox_keep(seed, dropout_base + rows[:, None] * k_len + cols[None, :], keep_threshold)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, UPCAST_BF16, PRECISION)
    return dq


@_device_fn
def _dkdv_queries(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    cols,
    start,
    end,
    q_len,
    k_len,
    qk_scale,
    dropout_scale,
    mask_ptr,
    mask_base,
    mask_stride_q,
    mask_stride_k,
    seed,
    dropout_base,
    keep_threshold,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    DROPOUT: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    Q_ROW: tl.constexpr,
    O_ROW: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK (unscaled) += dS^T Q and dV (without the dropout scale) += (P * keep)^T dO over the
    query blocks start..end of one query head; tiles are transposed (keys x queries). CHECK:
    the blocks may hold queries out of range or (causal) earlier than some key."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q = _load_tile(q_base, rows, offs_d, q_len, D, Q_ROW, CHECK, BLOCK_D != D)
        do = _load_tile(do_base, rows, offs_dv, q_len, DV, O_ROW, CHECK, BLOCK_DV != DV)
        if CHECK:
            lse = tl.load(lse_base + rows, mask=rows < q_len, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
        st = _dot(k, tl.trans(q), None, UPCAST_BF16, PRECISION) * qk_scale
        if mask_ptr is not None:
            lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows that see no key: P = 0 (all scores -inf)
            offsets = rows[None, :] * mask_stride_q + cols[:, None] * mask_stride_k
            inside = (rows < q_len)[None, :] & (cols < k_len)[:, None]
            st = _apply_mask(st, mask_ptr, mask_base + offsets, inside)
        if CHECK:
            seen = (rows < q_len)[None, :]
            if CAUSAL:
                seen = seen & (cols[:, None] <= rows[None, :])
            st = tl.where(seen, st, float("-inf"))
        pt = tl.math.exp2(st - lse[None, :])
        if DROPOUT:
            keep = philox_keep(seed, dropout_base + rows[None, :] * k_len + cols[:, None], keep_threshold)
        if WANT_DV:
            if DROPOUT:
                dv = _dot(tl.where(keep, pt, 0.0).to(do.dtype), do, dv, UPCAST_BF16, PRECISION)
            else:
                dv = _dot(pt.to(do.dtype), do, dv, UPCAST_BF16, PRECISION)
        if WANT_DK:
            if CHECK:
                delta = tl.load(delta_base + rows, mask=rows < q_len, other=0.0)
            else:
                delta = tl.load(delta_base + rows)
            dpt = _dot(v, tl.trans(do), None, UPCAST_BF16, PRECISION)
            if DROPOUT:
                dpt = tl.where(keep, dpt * dropout_scale, 0.0)
            dst = pt * (dpt - delta[None, :])
            dk = _dot(dst.to(q.dtype), q, dk, UPCAST_BF16, PRECISION)
    return dk, dv


# -------------------------------------------------------------------------------- kernels
# Layout: q, k, v, out/dout, dq and dk/dv are read and written through (outer, head) strides
# per operand (0 along broadcast dims of q, k, v) and their rows lie Q_ROW, K_ROW, V_ROW and
# O_ROW elements apart (dq like q, dk like k, dv like v, dout like out): D and DV for tensors
# laid out (..., heads, length, head dim), heads x D for (batch, length, heads, head dim), which
# the attention reads and writes in place of the transposes around it. lse/delta (BH, Lq) are
# contiguous, BH = n_outer * n_heads. Query head h reads key/value head h // kv_group. The
# mask is read through strides too. Program axis 0 is the head, axis 1 the block: CUDA runs
# axis 0 fastest, so the first wave holds the first block of every head (the longest ones,
# causal, once ordered so).


@kernel(half=True, optional=("mask_ptr", "seed_ptr", "dq_ptr"), pdl=True)
def attention_backward_dq(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    dout_ptr,
    lse_ptr,
    seed_ptr,
    delta_ptr,
    dq_ptr,
    q_len,
    k_len,
    n_heads,
    kv_group,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    o_stride_b,
    o_stride_h,
    dq_stride_b,
    dq_stride_h,
    scale,
    keep_threshold: tl.int64,
    dropout_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    Q_ROW: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    O_ROW: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """delta = rowsum(dO * O) of a block of query rows, and (if dq_ptr) dQ = c dS K for them."""
    wait_for_previous()
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # causal: longest blocks first
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_base = bh.to(tl.int64) * q_len
    b = bh // n_heads
    h = bh - b * n_heads
    o_base = b.to(tl.int64) * o_stride_b + h.to(tl.int64) * o_stride_h
    o = _load_tile(out_ptr + o_base, rows, offs_dv, q_len, DV, O_ROW, True, BLOCK_DV != DV)
    do = _load_tile(dout_ptr + o_base, rows, offs_dv, q_len, DV, O_ROW, True, BLOCK_DV != DV)
    delta = tl.sum(upcast(o) * upcast(do), 1)
    tl.store(delta_ptr + row_base + rows, delta, mask=rows < q_len)
    if dq_ptr is not None:
        q = _load_tile(
            q_ptr + b.to(tl.int64) * q_stride_b + h.to(tl.int64) * q_stride_h,
            rows,
            offs_d,
            q_len,
            D,
            Q_ROW,
            True,
            BLOCK_D != D,
        )
        q = tl.where(scale < 0, -q, q)  # the scores use |c|
        k_base = k_ptr + b.to(tl.int64) * k_stride_b + (h // kv_group).to(tl.int64) * k_stride_h
        v_base = v_ptr + b.to(tl.int64) * v_stride_b + (h // kv_group).to(tl.int64) * v_stride_h
        mask_base = b.to(tl.int64) * mask_stride_b + h.to(tl.int64) * mask_stride_h
        lse = tl.load(lse_ptr + row_base + rows, mask=rows < q_len, other=0.0)
        if mask_ptr is not None:
            lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows that see no key: P = 0
        qk_scale = tl.abs(
            tl.full([], LOG2E, ACC) * scale
        )  # a tensor op: the interpreter keeps float64 scalars exact there
        seed = 0
        if seed_ptr is not None:
            seed = tl.load(seed_ptr)
        if CAUSAL:
            end = tl.minimum(k_len, start_m + BLOCK_M)
            free_end = tl.minimum(start_m + 1, k_len) // BLOCK_N * BLOCK_N
        else:
            end = k_len
            free_end = k_len // BLOCK_N * BLOCK_N
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        for check in tl.static_range(2):
            dq = _dq_keys(
                dq,
                q,
                do,
                lse,
                delta,
                k_base,
                v_base,
                rows,
                free_end if check else 0,
                end if check else free_end,
                q_len,
                k_len,
                qk_scale,
                dropout_scale,
                mask_ptr,
                mask_base,
                mask_stride_q,
                mask_stride_k,
                seed,
                row_base * k_len,
                keep_threshold,
                CAUSAL,
                check == 1,
                seed_ptr is not None,
                D,
                DV,
                K_ROW,
                V_ROW,
                UPCAST_BF16,
                PRECISION,
                BLOCK_N,
                BLOCK_D,
                BLOCK_DV,
            )
        dq_base = dq_ptr + b.to(tl.int64) * dq_stride_b + h.to(tl.int64) * dq_stride_h
        _store_tile(dq_base, dq * scale, rows, offs_d, q_len, D, Q_ROW)


@kernel(half=True, optional=("mask_ptr", "seed_ptr", "dk_ptr", "dv_ptr"), pdl=True)
def attention_backward_dkdv(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    dout_ptr,
    lse_ptr,
    seed_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    q_len,
    k_len,
    n_heads,
    kv_group,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    o_stride_b,
    o_stride_h,
    dk_stride_b,
    dk_stride_h,
    dv_stride_b,
    dv_stride_h,
    scale,
    keep_threshold: tl.int64,
    dropout_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    Q_ROW: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    O_ROW: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK = c dS^T Q and dV = (P * Z)^T dO of a block of keys of one key/value head, summed over
    the query heads that read it (kv_group of them)."""
    wait_for_previous()
    kv_bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N  # causal: the first key blocks have the most queries
    n_kv_heads = n_heads // kv_group
    b = kv_bh // n_kv_heads
    kv_h = kv_bh - b * n_kv_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(
        k_ptr + b.to(tl.int64) * k_stride_b + kv_h.to(tl.int64) * k_stride_h,
        cols,
        offs_d,
        k_len,
        D,
        K_ROW,
        True,
        BLOCK_D != D,
    )
    v = _load_tile(
        v_ptr + b.to(tl.int64) * v_stride_b + kv_h.to(tl.int64) * v_stride_h,
        cols,
        offs_dv,
        k_len,
        DV,
        V_ROW,
        True,
        BLOCK_DV != DV,
    )
    k = tl.where(scale < 0, -k, k)  # the scores use |c|; dK's product reads q, not k
    qk_scale = tl.abs(tl.full([], LOG2E, ACC) * scale)  # a tensor op: the interpreter keeps float64 scalars exact there
    seed = 0
    if seed_ptr is not None:
        seed = tl.load(seed_ptr)
    if CAUSAL:  # query blocks before lo see none of these keys; from diag_end on, all of them
        lo = start_n // BLOCK_M * BLOCK_M
        diag_end = (start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        diag_end = 0
    full_end = q_len // BLOCK_M * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    for g in range(0, kv_group):
        h = kv_h * kv_group + g
        bh = b.to(tl.int64) * n_heads + h
        q_base = q_ptr + b.to(tl.int64) * q_stride_b + h.to(tl.int64) * q_stride_h
        mask_base = b.to(tl.int64) * mask_stride_b + h.to(tl.int64) * mask_stride_h
        for part in tl.static_range(3):  # diagonal (checked), the unchecked middle, the partial tail (checked)
            if part == 0:
                start = lo
                end = tl.minimum(diag_end, q_len)
            elif part == 1:
                start = diag_end
                end = full_end
            else:
                start = tl.maximum(diag_end, full_end)
                end = q_len
            dk, dv = _dkdv_queries(
                dk,
                dv,
                k,
                v,
                q_base,
                dout_ptr + b.to(tl.int64) * o_stride_b + h.to(tl.int64) * o_stride_h,
                lse_ptr + bh * q_len,
                delta_ptr + bh * q_len,
                cols,
                start,
                end,
                q_len,
                k_len,
                qk_scale,
                dropout_scale,
                mask_ptr,
                mask_base,
                mask_stride_q,
                mask_stride_k,
                seed,
                bh * q_len * k_len,
                keep_threshold,
                CAUSAL,
                part != 1,
                seed_ptr is not None,
                dk_ptr is not None,
                dv_ptr is not None,
                D,
                DV,
                Q_ROW,
                O_ROW,
                UPCAST_BF16,
                PRECISION,
                BLOCK_M,
                BLOCK_D,
                BLOCK_DV,
            )
    if dk_ptr is not None:
        dk_base = dk_ptr + b.to(tl.int64) * dk_stride_b + kv_h.to(tl.int64) * dk_stride_h
        _store_tile(dk_base, dk * scale, cols, offs_d, k_len, D, K_ROW)
    if dv_ptr is not None:
        dv_base = dv_ptr + b.to(tl.int64) * dv_stride_b + kv_h.to(tl.int64) * dv_stride_h
        _store_tile(dv_base, dv * dropout_scale, cols, offs_dv, k_len, DV, V_ROW)


@kernel(
    backward=(attention_backward_dq, attention_backward_dkdv, sum_to_shape_kernel),
    half=True,
    optional=("mask_ptr", "seed_out_ptr"),
    pdl=True,
)
@triton.jit(do_not_specialize=["seed"])
def attention_forward(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    lse_ptr,
    seed_out_ptr,
    q_len,
    k_len,
    n_heads,
    kv_group,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    o_stride_b,
    o_stride_h,
    scale,
    seed,
    keep_threshold: tl.int64,
    dropout_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    Q_ROW: tl.constexpr,
    K_ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    O_ROW: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """O and lse2 of a block of query rows of one head; with dropout (seed_out_ptr given) the
    mask of ``seed``, which program (0, 0) stores in seed_out for the backward."""
    wait_for_previous()
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # causal: longest blocks first
    b = bh // n_heads
    h = bh - b * n_heads
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(
        q_ptr + b.to(tl.int64) * q_stride_b + h.to(tl.int64) * q_stride_h,
        rows,
        offs_d,
        q_len,
        D,
        Q_ROW,
        True,
        BLOCK_D != D,
    )
    q = tl.where(scale < 0, -q, q)  # the scores use |c|, so that max(qk) * |c| is the largest score
    k_base = k_ptr + b.to(tl.int64) * k_stride_b + (h // kv_group).to(tl.int64) * k_stride_h
    v_base = v_ptr + b.to(tl.int64) * v_stride_b + (h // kv_group).to(tl.int64) * v_stride_h
    mask_base = b.to(tl.int64) * mask_stride_b + h.to(tl.int64) * mask_stride_h
    row_base = bh.to(tl.int64) * q_len
    qk_scale = tl.abs(tl.full([], LOG2E, ACC) * scale)  # a tensor op: the interpreter keeps float64 scalars exact there
    if seed_out_ptr is not None:
        if (bh == 0) & (tl.program_id(1) == 0):
            tl.store(seed_out_ptr, seed.to(tl.int64))
    if CAUSAL:
        end = tl.minimum(k_len, start_m + BLOCK_M)
        free_end = tl.minimum(start_m + 1, k_len) // BLOCK_N * BLOCK_N
    else:
        end = k_len
        free_end = k_len // BLOCK_N * BLOCK_N
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    row_sum = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    for check in tl.static_range(2):
        acc, row_sum, row_max = _forward_keys(
            acc,
            row_sum,
            row_max,
            q,
            k_base,
            v_base,
            rows,
            free_end if check else 0,
            end if check else free_end,
            q_len,
            k_len,
            qk_scale,
            mask_ptr,
            mask_base,
            mask_stride_q,
            mask_stride_k,
            seed,
            row_base * k_len,
            keep_threshold,
            CAUSAL,
            check == 1,
            seed_out_ptr is not None,
            D,
            DV,
            K_ROW,
            V_ROW,
            UPCAST_BF16,
            PRECISION,
            BLOCK_N,
            BLOCK_D,
            BLOCK_DV,
        )
    seen_any = row_sum > 0
    safe_sum = tl.where(seen_any, row_sum, 1.0)
    if seed_out_ptr is not None:
        out = acc * (dropout_scale / safe_sum)[:, None]
    else:
        out = acc / safe_sum[:, None]
    o_base = out_ptr + b.to(tl.int64) * o_stride_b + h.to(tl.int64) * o_stride_h
    _store_tile(o_base, out, rows, offs_dv, q_len, DV, O_ROW)
    lse = tl.where(seen_any, row_max + tl.log2(safe_sum), float("-inf"))
    tl.store(lse_ptr + row_base + rows, lse, mask=rows < q_len)
