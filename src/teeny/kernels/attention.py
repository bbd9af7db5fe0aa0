"""Attention: fused (flash-style) scaled dot-product attention, forward and backward.

For one head, with queries q (Lq, D), keys k (Lk, D), values v (Lk, Dv), scale c (default
1/sqrt(D)), an optional mask and attention dropout with probability p:

    S = c q k^T + B        B: the additive float mask, or 0 / -inf from a boolean mask and from
                           causal masking (top-left aligned: query i sees keys j <= i)
    P = softmax(S) row-wise,   lse = logsumexp(S) row-wise
    Z = keep / (1 - p)     keep ~ Bernoulli(1 - p) per (head, query, key), from Philox counters
    O = (P * Z) V

and backward, with delta = rowsum(dO * O) (which equals rowsum(P * dP), dropout or not):

    dV = (P * Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - delta),   dQ = c dS K,   dK = c dS^T Q

Forward: one program per (head, block of BLOCK_M queries) walks the key blocks with an online
softmax in base 2 (exp2, with log2(e) folded into the scale: one multiply-add per score) and
keeps only O and lse2 = lse * log2(e), never the Lq x Lk matrix P. Key blocks every query of
the block may see in full (in range, not in any query's future) run a loop with no mask
arithmetic; the blocks on the causal diagonal and the last partial block run a checked loop;
causal programs stop at the diagonal, and the grid runs the longest query blocks first.

Backward, two launches and no atomics: ``attention_backward_dq`` (a program per query block:
delta for its rows, then dQ over the key blocks) runs first, then ``attention_backward_dkdv``
(a program per key block of a key/value head: dK, dV over the query blocks of every query head
that reads it, split into unchecked and checked loops like the forward). P is recomputed from
lse2; the dropout mask is regenerated from the seed the forward saved. Products use ``tl.dot``
with float32 accumulation (float64 for float64): bf16/fp16 tensor cores for half inputs,
float32 ones at the products' precision (tf32x3 on tensor cores: more accurate than cuBLAS's
SGEMM; tf32 with ``teeny.config.allow_tf32``), float64 ones exact.

Batch dims of q, k, v (and the mask) broadcast as in PyTorch; the kernels index them as two
levels (outer, head) with a stride per operand (0 along broadcast dims). Key/value heads
shared by several query heads (grouped-query attention, or one key/value head broadcast over
the query heads) are read in place, and their dK/dV summed inside the dkdv program; other
broadcast operands get their gradient summed by ``common.sum_to_shape``.

A query row that can see no key at all (every key masked) gets output 0 and gradient 0, as in
PyTorch's fused kernels (softmax over nothing is taken as all-zero weights, lse = -inf).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import config as teeny_config
from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, Block, Launch, RuntimeOp
from .common import (
    DOT_UPCAST_BF16,
    acc_dtype,
    cdiv,
    keep_threshold,
    mix_seed,
    philox_keep,
    pow2,
    sum_to_shape,
    sum_to_shape_kernel,
    tl_acc_dtype,
    upcast,
    wait_for_previous,
)
from .linear import IEEE, dot_precision

__all__ = ["scaled_dot_product_attention"]
NN_LAYERS: list[str] = []

LOG2E = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------------------- maths


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


# ------------------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile: BLOCK_M query rows by BLOCK_N keys, and Triton's warps and pipeline
    stages (None: the kernel's default)."""

    block_m: int
    block_n: int
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class AttentionTiles:
    """The tiles of the three kernels of one call."""

    forward: Tiles
    dq: Tiles
    dkdv: Tiles


# bf16/fp16 on the GPU, by padded head dim: the fastest tiles of each kernel in the H200 sweep of
# bench/bench_attention.py (causal bf16 4x16x2048; bench/NOTES.md version 3): d64 fwd 64x64/w4/s3
# 0.106 ms, dq 64x64/w4/s3 0.113, dkdv 64x128/w4/s3 0.203; d128 fwd 64x64/w4/s3 0.190, dq
# 128x64/w8/s3 0.231, dkdv 64x128/w8/s3 0.374. The forward and dq keep BLOCK_M queries in
# registers and stream keys; dkdv keeps BLOCK_N keys and streams queries.
HALF_TILES = {
    64: AttentionTiles(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 128, 4, 3)),
    128: AttentionTiles(Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 128, 8, 3)),
    256: AttentionTiles(Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2)),
}
# float32 products at tf32x3 run on tensor cores (three tf32 MMAs a product; the hi/lo halves
# of each operand double its registers), for head dims up to 64. Swept on the H200 (fwd + bwd,
# causal, bench/NOTES.md v14): at 64x8x128x32 one warpgroup on 64 x 64 tiles, 0.131 ms (128-row
# tiles 0.162: half of each causal diagonal block is masked); at 4x16x2048x64 two warpgroups on
# 128-row tiles (64 x 128 for dK/dV), 3.08 ms (64 x 64: 4.59).
FLOAT32_TILES = AttentionTiles(Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2))
FLOAT32_LONG_TILES = AttentionTiles(Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2), Tiles(64, 128, 8, 2))
FLOAT32_LONG = 512  # queries and keys from which the long tiles are used
# float64 products run on FMA units / float64 MMA, and wider float32 heads: small tiles.
WIDE_TILES = AttentionTiles(Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2))

# Under the interpreter each program costs about a millisecond whatever its size: one wide
# tile per head where it fits. Tests set TILE_OVERRIDE to run several blocks per head.
INTERPRETER_TILE = 128
TILE_OVERRIDE: AttentionTiles | None = None


def head_blocks(dtype: torch.dtype, d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV): head dims padded to a power of two (>= 16 for tl.dot).

    On the H200 (Triton 3.6), bf16 attention with head dims padded to 32/16 gave wrong results
    and an illegal memory access while 64 was right (cf. triton-lang/triton#11366, wgmma with
    BLOCK_D=32): half-precision head dims are padded to at least 64 there."""
    least = 64 if dtype in (torch.float16, torch.bfloat16) and not INTERPRETER else 16
    return max(least, pow2(d)), max(least, pow2(dv))


def attention_tiles(dtype: torch.dtype, d: int, dv: int, q_len: int, k_len: int) -> AttentionTiles:
    """The tiles for one call (shapes are static per program)."""
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    if INTERPRETER:
        m = min(INTERPRETER_TILE, max(16, pow2(q_len)))
        n = min(INTERPRETER_TILE, max(16, pow2(k_len)))
        return AttentionTiles(Tiles(m, n), Tiles(m, n), Tiles(m, n))
    if dtype in (torch.float16, torch.bfloat16):
        head = max(64, pow2(max(d, dv)))
        return HALF_TILES[head] if head in HALF_TILES else HALF_TILES[256]
    if dtype == torch.float32 and max(d, dv) <= 64:
        return FLOAT32_LONG_TILES if min(q_len, k_len) >= FLOAT32_LONG else FLOAT32_TILES
    return WIDE_TILES


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class AttentionLayout:
    """How the kernels index one call. ``batch``: the broadcast batch dims of the output;
    ``kv_batch``: those of the key/value gradients (the head dim divided by ``kv_group``). The
    kernels see them as ``n_outer`` x ``n_heads`` (query) heads; ``strides`` are the per-operand
    element strides of those two levels (q, k, v, mask, out and dout) with the mask's along
    queries and keys and the row strides (``Q_ROW``, ...), which every kernel takes;
    ``grad_strides`` those of dq, dk and dv, which one backward kernel each takes."""

    batch: tuple[int, ...]
    kv_batch: tuple[int, ...]
    n_outer: int
    n_heads: int
    kv_group: int
    q_len: int
    k_len: int
    d: int
    dv: int
    strides: dict[str, int]
    grad_strides: dict[str, int]

    @property
    def n_bh(self) -> int:
        return self.n_outer * self.n_heads


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise ValueError(
            f"the batch dims of query, key and value are not broadcastable: {', '.join(map(str, shapes))} "
            "(pass enable_gqa=True for fewer key/value heads)"
        ) from None


def _batch_strides(shape: tuple[int, ...], batch: tuple[int, ...], tail: int) -> list[int]:
    """Element strides, over the ``batch`` dims, of a contiguous tensor whose leading dims
    ``shape`` broadcast to ``batch`` and whose trailing dims hold ``tail`` elements (0 where
    broadcast)."""
    padded = (1,) * (len(batch) - len(shape)) + tuple(shape)
    strides, step = [0] * len(batch), tail
    for i in reversed(range(len(batch))):
        strides[i] = step if padded[i] != 1 else 0
        step *= padded[i]
    return strides


def attention_layout(shapes: list, mask_shape, enable_gqa: bool) -> AttentionLayout:
    """The layout of q, k, v (and mask) shapes; ValueError naming what does not fit."""
    q, k, v = (tuple(s) for s in shapes[:3])
    for what, shape in (("query", q), ("key", k), ("value", v)):
        if len(shape) < 2:
            raise ValueError(f"{what} must have at least 2 dimensions (length, head dim), got shape {shape}")
    if q[-1] != k[-1]:
        raise ValueError(f"query and key must have the same head dim (last dim), got query {q} and key {k}")
    if k[-2] != v[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got key {k} and value {v}")
    qb, kb, vb = q[:-2], k[:-2], v[:-2]
    kv_group = 1
    if qb and kb and vb and (kb[-1] != qb[-1] or vb[-1] != qb[-1]):
        heads, kv_heads = qb[-1], kb[-1]
        shared = kv_heads == vb[-1] and kv_heads > 0 and heads % kv_heads == 0
        if enable_gqa and not shared:
            raise ValueError(
                f"enable_gqa: key/value heads (dim -3) must be equal and divide the query heads, "
                f"got query {q}, key {k} and value {v}"
            )
        if shared and (enable_gqa or kv_heads == 1):  # read each key/value head in place for its group
            kv_group = heads // kv_heads
            kb, vb = kb[:-1] + (heads,), vb[:-1] + (heads,)
    batch = _broadcast([qb, kb, vb])
    lq, lk, d, dv = q[-2], k[-2], q[-1], v[-1]
    operands = [
        _batch_strides(qb, batch, lq * d),
        _batch_strides(k[:-2], batch, lk * d),
        _batch_strides(v[:-2], batch, lk * dv),
    ]
    if kv_group > 1:  # key/value head dim: one stride per key/value head, indexed by h // kv_group
        operands[1][-1], operands[2][-1] = lk * d, lk * dv
    mask_q = mask_k = 0
    if mask_shape is not None:
        mask = tuple(mask_shape)
        target = batch + (lq, lk)
        padded = (1,) * (len(target) - len(mask)) + mask
        if len(mask) > len(target) or any(m not in (1, t) for m, t in zip(padded, target)):
            raise ValueError(
                f"attn_mask of shape {mask} is not broadcastable to {target} (batch..., query length, key length)"
            )
        mask_k = 1 if padded[-1] != 1 else 0
        mask_q = padded[-1] if padded[-2] != 1 else 0
        operands.append(_batch_strides(padded[:-2], batch, padded[-2] * padded[-1]))
    levels = _index_levels(batch, operands, keep_heads=kv_group > 1)
    if len(levels) > 2:
        raise ValueError(
            f"the batch dims {batch} broadcast in a pattern the attention kernels cannot index "
            f"(more than two independent levels); shapes {', '.join(map(str, shapes))}"
        )
    (n_outer, outer), (n_heads, inner) = ([(1, [0] * len(operands))] * (2 - len(levels))) + levels
    names = ("q", "k", "v", "mask")
    strides = {f"{names[i]}_stride_b": outer[i] for i in range(len(operands))}
    strides.update({f"{names[i]}_stride_h": inner[i] for i in range(len(operands))})
    strides.setdefault("mask_stride_b", 0)
    strides.setdefault("mask_stride_h", 0)
    strides.update(mask_stride_q=mask_q, mask_stride_k=mask_k)
    kv_batch = batch[:-1] + (batch[-1] // kv_group,) if kv_group > 1 else batch
    # out, dout, dq, dk and dv are contiguous: (n_outer, n_heads or n_heads / kv_group, length, dim)
    strides.update(o_stride_b=n_heads * lq * dv, o_stride_h=lq * dv, Q_ROW=d, K_ROW=d, V_ROW=dv, O_ROW=dv)
    n_kv = n_heads // kv_group
    grad_strides = dict(
        dq_stride_b=n_heads * lq * d,
        dq_stride_h=lq * d,
        dk_stride_b=n_kv * lk * d,
        dk_stride_h=lk * d,
        dv_stride_b=n_kv * lk * dv,
        dv_stride_h=lk * dv,
    )
    return AttentionLayout(batch, kv_batch, n_outer, n_heads, kv_group, lq, lk, d, dv, strides, grad_strides)


def heads_second(shape) -> tuple[int, ...]:
    """(batch, length, heads, dim) -> (batch, heads, length, dim)."""
    b, length, h, d = shape
    return (b, h, length, d)


def attention_layout_blhd(shapes: list, mask_shape, enable_gqa: bool) -> AttentionLayout:
    """The layout of q (B, Lq, H, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, DV), each contiguous
    (what reshape(linear(x), (B, L, H, D)) makes, before the transpose to (B, H, L, D) that this
    layout saves), and the mask broadcastable to (B, H, Lq, Lk). The output is (B, Lq, H, DV)."""
    for what, shape in zip(("query", "key", "value"), shapes[:3]):
        if len(shape) != 4:
            raise ValueError(f"{what}: the (batch, length, heads, dim) layout takes 4-D tensors, got shape {shape}")
    q, k, v = (tuple(s) for s in shapes[:3])
    if not q[0] == k[0] == v[0]:
        raise ValueError(f"the (batch, length, heads, dim) layout needs one batch size, got {q}, {k} and {v}")
    logical = attention_layout([heads_second(s) for s in (q, k, v)], mask_shape, enable_gqa)  # the checks
    (b, lq, h, d), (_, lk, hkv, _), dv = q, k, v[-1]
    strides = dict(
        q_stride_b=lq * h * d,
        q_stride_h=d,
        k_stride_b=lk * hkv * d,
        k_stride_h=d,  # query head h reads key/value head h // kv_group
        v_stride_b=lk * hkv * dv,
        v_stride_h=dv,
        o_stride_b=lq * h * dv,
        o_stride_h=dv,
        Q_ROW=h * d,
        K_ROW=hkv * d,
        V_ROW=hkv * dv,
        O_ROW=h * dv,
        mask_stride_q=logical.strides["mask_stride_q"],
        mask_stride_k=logical.strides["mask_stride_k"],
        mask_stride_b=0,
        mask_stride_h=0,
    )
    if mask_shape is not None:
        padded = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
        mask_b, mask_h = _batch_strides(padded[:2], (b, h), padded[2] * padded[3])
        strides.update(mask_stride_b=mask_b, mask_stride_h=mask_h)
    grad_strides = dict(
        dq_stride_b=strides["q_stride_b"],
        dq_stride_h=d,
        dk_stride_b=strides["k_stride_b"],
        dk_stride_h=d,
        dv_stride_b=strides["v_stride_b"],
        dv_stride_h=dv,
    )
    group = logical.kv_group
    return AttentionLayout((b, h), (b, h // group), b, h, group, lq, lk, d, dv, strides, grad_strides)


def attention_layout_packed(qkv_shape, heads: int, mask_shape) -> AttentionLayout:
    """The layout of q, k and v packed in one (B, L, 3 * H * D) tensor, as one product of the
    three projections writes them (``rewrites.fuse_qkv_products``): q, k, v are its three
    column blocks, (B, L, H, D) each with rows 3 * H * D apart, and the (B, L, 3 * H * D)
    gradient holds dq, dk, dv the same way. The output is (B, L, H, D)."""
    if len(qkv_shape) != 3:
        raise ValueError(f"packed q, k, v: expected a (batch, length, 3 * heads * dim) tensor, got {tuple(qkv_shape)}")
    b, length, width = qkv_shape
    if heads <= 0 or width % (3 * heads):
        raise ValueError(f"packed q, k, v: the last dim {width} is not 3 x heads ({heads}) x head dim")
    d = width // (3 * heads)
    layout = attention_layout_blhd([(b, length, heads, d)] * 3, mask_shape, False)
    rows = dict(Q_ROW=width, K_ROW=width, V_ROW=width)
    batch = {f"{x}_stride_b": length * width for x in ("q", "k", "v")}
    grads = {f"d{x}_stride_b": length * width for x in ("q", "k", "v")}
    return replace(layout, strides={**layout.strides, **rows, **batch}, grad_strides={**layout.grad_strides, **grads})


def _packed_parts(qkv: torch.Tensor | None) -> tuple:
    """q, k and v (or dq, dk and dv): the three column blocks of a packed tensor, as views."""
    if qkv is None:
        return None, None, None
    third = qkv.shape[-1] // 3
    return qkv[..., :third], qkv[..., third : 2 * third], qkv[..., 2 * third :]


def _index_levels(batch, operands, keep_heads: bool) -> list[tuple[int, list[int]]]:
    """The batch dims merged into as few (size, per-operand stride) levels as the operands'
    strides allow (neighbours merge when, for every operand, outer stride = inner stride x
    inner size); ``keep_heads`` keeps the last dim (the query heads) a level of its own."""
    levels: list[tuple[int, list[int]]] = []
    last = len(batch) - 1
    for i, size in enumerate(batch):
        if size == 1 and not (keep_heads and i == last):
            continue
        strides = [op[i] for op in operands]
        mergeable = levels and not (keep_heads and i == last)
        if mergeable and all(outer == inner * size for outer, inner in zip(levels[-1][1], strides)):
            levels[-1] = (levels[-1][0] * size, strides)
        else:
            levels.append((size, strides))
    return levels


# ------------------------------------------------------------------------------ RuntimeOp


_trace_seeds = itertools.count()


class AttentionOp(RuntimeOp):
    """Fused attention; inputs q, k, v[, mask]; saves the inputs, the output, lse2 and, with
    dropout, the seed of the run's mask (``extra_outputs``), as dropout does: every forward run
    draws a new mask (the k-th run of a node with base seed s always the same one), and a
    backward regenerates the mask of the forward that made its cache. ``layout="blhd"``: q, k, v
    and the output are (batch, length, heads, dim) (``attention_layout_blhd``; the rewrite
    ``rewrites.attention_in_place`` makes it of the transposes around an attention).
    ``layout="packed"``: one input holds q, k and v, (batch, length, 3 * heads * dim), and the
    output is (batch, length, heads, dim) (``attention_layout_packed``, ``heads`` given; the
    rewrite ``rewrites.fuse_qkv_products`` makes it of one product for the three)."""

    name = "scaled_dot_product_attention"
    kernel = attention_forward
    saves_inputs = True
    saves_output = True

    def __init__(
        self,
        has_mask: bool,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        dropout_p: float = 0.0,
        seed: int = 0,
        fixed_mask: bool = False,
        layout: str = "bhld",
        heads: int = 0,
    ):
        if layout not in ("bhld", "blhd", "packed"):
            raise ValueError(f"attention layout must be 'bhld', 'blhd' or 'packed', got {layout!r}")
        if (layout == "packed") != (heads > 0):
            raise ValueError("attention: the packed layout, and only it, takes heads=")
        self.layout, self.heads = layout, heads
        self.has_mask, self.is_causal, self.user_scale, self.enable_gqa = has_mask, is_causal, scale, enable_gqa
        self.n_qkv = 1 if layout == "packed" else 3  # inputs holding q, k and v; the mask follows
        self.n_activation_inputs = self.n_qkv + 1 if has_mask else self.n_qkv
        self.differentiable_inputs = tuple(range(self.n_qkv))
        self.dropout_p, self.seed, self.fixed_mask = float(dropout_p), int(seed), bool(fixed_mask)
        self.allow_tf32 = teeny_config.allow_tf32  # read at trace time
        self.capturable = self.dropout_p == 0.0  # the per-run seed comes from the host
        self.runs = 0  # forward runs so far: the step of the next dropout mask

    # --- shapes --------------------------------------------------------------------------
    def _layout(self, shapes) -> AttentionLayout:
        mask = shapes[self.n_qkv] if self.has_mask else None
        if self.layout == "packed":
            return attention_layout_packed(shapes[0], self.heads, mask)
        build = attention_layout_blhd if self.layout == "blhd" else attention_layout
        return build(shapes, mask, self.enable_gqa)

    def check_inputs(self, input_shapes, input_dtypes):
        names = ("packed q, k, v",) if self.layout == "packed" else ("query", "key", "value")
        for what, dtype in zip(names, input_dtypes):
            if not dtype.is_floating_point:
                raise TypeError(f"{what} must be a float tensor, got {str(dtype).replace('torch.', '')}")
        if self.has_mask:
            dtype = input_dtypes[self.n_qkv]
            if dtype != torch.bool and dtype != input_dtypes[0]:
                raise TypeError(f"attn_mask must be bool or have the query's dtype, got {dtype}")
        self._layout(input_shapes)

    def output_shape(self, input_shapes):
        layout = self._layout(input_shapes)
        if self.layout != "bhld":
            return (layout.n_outer, layout.q_len, layout.n_heads, layout.dv)
        return layout.batch + (layout.q_len, layout.dv)

    def flops(self, input_shapes, grad_mask):
        """S = Q K^T and O = P V forwards; backwards S again, dP, dV, dQ and dK (as torch counts
        its fused attention's; a causal mask's skipped blocks are counted too, as there)."""
        layout = self._layout(input_shapes)
        per_d = 2 * layout.n_bh * layout.q_len * layout.k_len
        backward = per_d * (3 * layout.d + 2 * layout.dv) if any(grad_mask[: self.n_qkv]) else 0
        return per_d * (layout.d + layout.dv), backward

    def extra_outputs(self, input_shapes, dtype):
        layout = self._layout(input_shapes)
        extras = {"lse": (layout.batch + (layout.q_len,), acc_dtype(dtype))}
        if self.dropout_p > 0:
            extras["seed"] = ((1,), torch.int64)
        return extras

    # --- launch helpers ----------------------------------------------------------------------
    @property
    def dropout_scale(self) -> float:
        return 0.0 if self.dropout_p == 1.0 else 1.0 / (1.0 - self.dropout_p)

    def step_seed(self, step: int) -> int:
        """The seed of the ``step``-th run's dropout mask."""
        return mix_seed(self.seed, 0 if self.fixed_mask else step)

    def _scale(self, layout: AttentionLayout) -> float:
        if self.user_scale is not None:
            return self.user_scale
        return 1.0 / math.sqrt(layout.d) if layout.d else 1.0

    def _common(self, ctx, layout: AttentionLayout) -> dict:
        """The arguments every kernel takes, by name."""
        q, k, v = _packed_parts(ctx.inputs[0]) if self.layout == "packed" else ctx.inputs[:3]
        block_d, block_dv = head_blocks(ctx.dtype, layout.d, layout.dv)
        return dict(
            q_ptr=q,
            k_ptr=k,
            v_ptr=v,
            mask_ptr=ctx.inputs[self.n_qkv] if self.has_mask else None,
            q_len=layout.q_len,
            k_len=layout.k_len,
            n_heads=layout.n_heads,
            kv_group=layout.kv_group,
            **layout.strides,
            scale=self._scale(layout),
            keep_threshold=keep_threshold(self.dropout_p),
            dropout_scale=self.dropout_scale,
            D=layout.d,
            DV=layout.dv,
            CAUSAL=self.is_causal,
            UPCAST_BF16=DOT_UPCAST_BF16,
            PRECISION=dot_precision(ctx.dtype, self.allow_tf32) if ctx.dtype == torch.float32 else IEEE,
            ACC=tl_acc_dtype(ctx.dtype),
            BLOCK_D=block_d,
            BLOCK_DV=block_dv,
        )

    # --- forward ---------------------------------------------------------------------------
    def forward_launches(self, ctx):
        layout = self._layout(ctx.input_shapes)
        tiles = attention_tiles(ctx.dtype, layout.d, layout.dv, layout.q_len, layout.k_len).forward
        seed = 0
        if self.dropout_p > 0:
            seed = self.step_seed(0 if ctx.dry_run else self.runs)
            if not ctx.dry_run:
                self.runs += 1
        args = ArgVisitor().visit(
            **self._common(ctx, layout),
            out_ptr=ctx.output,
            lse_ptr=ctx.saved["lse"],
            seed_out_ptr=ctx.saved.get("seed"),
            seed=seed,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
        )
        grid = (layout.n_bh, cdiv(layout.q_len, tiles.block_m), 1)
        return [Launch(attention_forward, grid, args, Block(None, tiles.num_warps, tiles.num_stages))]

    # --- backward --------------------------------------------------------------------------
    def backward_launches(self, ctx):
        layout = self._layout(ctx.input_shapes)
        tiles = attention_tiles(ctx.dtype, layout.d, layout.dv, layout.q_len, layout.k_len)
        dq, dk, dv = _packed_parts(ctx.grad_inputs[0]) if self.layout == "packed" else ctx.grad_inputs[:3]
        common = self._common(ctx, layout)
        saved = dict(lse_ptr=ctx.saved["lse"], seed_ptr=ctx.saved.get("seed"))
        delta = ctx.empty(ctx.saved["lse"].shape, ctx.saved["lse"].dtype)
        q_shape = layout.batch + (layout.q_len, layout.d)
        k_shape, v_shape = layout.kv_batch + (layout.k_len, layout.d), layout.kv_batch + (layout.k_len, layout.dv)
        # a broadcast operand's gradient is computed per head into float32 scratch, then summed
        # (the blhd and packed layouts have no broadcast operand: their gradients are written in place)
        dq_out, dk_out, dv_out = (
            g if g is None or tuple(g.shape) == full or self.layout != "bhld" else ctx.empty(full, acc_dtype(ctx.dtype))
            for g, full in ((dq, q_shape), (dk, k_shape), (dv, v_shape))
        )
        grad = layout.grad_strides
        launches = []
        if dq is not None or dk is not None:  # dq also writes delta, which dkdv reads
            t = tiles.dq
            args = ArgVisitor().visit(
                **common,
                **saved,
                out_ptr=ctx.output,
                dout_ptr=ctx.grad_output,
                delta_ptr=delta,
                dq_ptr=dq_out,
                dq_stride_b=grad["dq_stride_b"],
                dq_stride_h=grad["dq_stride_h"],
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
            )
            grid = (layout.n_bh, cdiv(layout.q_len, t.block_m), 1)
            launches.append(Launch(attention_backward_dq, grid, args, Block(None, t.num_warps, t.num_stages)))
        if dk is not None or dv is not None:
            t = tiles.dkdv
            args = ArgVisitor().visit(
                **common,
                **saved,
                dout_ptr=ctx.grad_output,
                delta_ptr=delta,
                dk_ptr=dk_out,
                dv_ptr=dv_out,
                **{k: v for k, v in grad.items() if not k.startswith("dq")},
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
            )
            grid = (layout.n_bh // layout.kv_group, cdiv(layout.k_len, t.block_n), 1)
            work = (dk if dk is not None else dv).numel()
            launches.append(Launch(attention_backward_dkdv, grid, args, Block(None, t.num_warps, t.num_stages), work))
        for scratch, target in ((dq_out, dq), (dk_out, dk), (dv_out, dv)):
            if target is not None and scratch is not target:
                launches += sum_to_shape(ctx, scratch, tuple(scratch.shape), target)
        return launches


# ------------------------------------------------------------------------- functional ops


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    seed: int | None = None,
    fixed_mask: bool = False,
):
    """softmax(query key^T * scale + attn_mask) value, as torch.nn.functional.scaled_dot_product_attention.

    query (..., Lq, D), key (..., Lk, D), value (..., Lk, Dv), whose batch dims broadcast;
    attn_mask a float mask added to the scores or a bool mask (True: may attend), broadcastable
    to (..., Lq, Lk), with no gradient; is_causal: query i sees keys j <= i (top-left aligned);
    scale defaults to 1/sqrt(D) (float64 for float64 inputs); enable_gqa: key and value may have
    fewer heads (dim -3) than query. Rows that see no key give 0. Any scale works, negative
    ones too (PyTorch's math path, its CPU float64 reference, gives NaN for a negative scale
    with is_causal=True: it multiplies q and k by sqrt(scale)).

    dropout_p > 0 drops attention weights with that probability (and scales the rest by
    1 / (1 - dropout_p)), with a new mask on every run, as ``teeny.ops.dropout``: ``seed`` is
    the node's base seed (None: a fresh one from a trace-time counter), ``fixed_mask=True``
    (teeny-only) keeps the base seed's mask on every run.
    """
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0 or math.isnan(dropout_p):
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1], got {dropout_p}")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scaled_dot_product_attention: scale must be a float or None, got {type(scale).__name__}")
    if seed is None:
        seed = mix_seed(0xA77E, next(_trace_seeds))
    op = AttentionOp(
        attn_mask is not None,
        bool(is_causal),
        None if scale is None else float(scale),
        bool(enable_gqa),
        dropout_p,
        int(seed),
        fixed_mask,
    )
    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    return graph_of(query, key, value).apply(op, inputs)


# -------------------------------------------------------------------------- registry/tests


def philox_reference(seed: int, offsets: np.ndarray) -> np.ndarray:
    """``philox_keep``'s draw (uint32) for int64 ``offsets``, computed in numpy: the tests'
    independent account of the dropout mask."""
    low = np.uint64(0xFFFFFFFF)
    c0 = offsets.astype(np.uint64) & low
    c1 = offsets.astype(np.uint64) >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        prod_a, prod_b = round_a * c0, round_b * c2
        c0, c1, c2, c3 = (
            (prod_b >> np.uint64(32)) ^ c1 ^ k0,
            prod_b & low,
            (prod_a >> np.uint64(32)) ^ c3 ^ k1,
            prod_a & low,
        )
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0


def dropout_keep_reference(seed: int, n_bh: int, q_len: int, k_len: int, p: float) -> torch.Tensor:
    """The (n_bh, Lq, Lk) keep mask of a run whose step seed is ``seed``."""
    offsets = np.arange(n_bh * q_len * k_len, dtype=np.int64)
    keep = philox_reference(seed, offsets).astype(np.int64) >= keep_threshold(p)
    return torch.from_numpy(keep).reshape(n_bh, q_len, k_len)


def _reference(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    seed=None,
    fixed_mask=False,
):
    """PyTorch's attention; with dropout (which PyTorch cannot reproduce) the softmax weights
    are computed by PyTorch and multiplied by the mask of teeny's counters (first run)."""
    if dropout_p == 0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    layout = attention_layout([query.shape, key.shape, value.shape], None, enable_gqa)
    if layout.kv_group > 1:
        key = key.repeat_interleave(layout.kv_group, -3)
        value = value.repeat_interleave(layout.kv_group, -3)
    c = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-2, -1) * c
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if is_causal:
        causal = torch.ones(layout.q_len, layout.k_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    weights = torch.softmax(scores, dim=-1).expand(layout.batch + (layout.q_len, layout.k_len))
    keep = dropout_keep_reference(mix_seed(seed, 0), layout.n_bh, layout.q_len, layout.k_len, dropout_p)
    z = keep.reshape(weights.shape).to(weights) / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(weights)
    return (weights * z) @ value


def _qkv(gen, dtype, batch, lq, lk, d, dv=None, kv_batch=None):
    dv = d if dv is None else dv
    kv_batch = batch if kv_batch is None else kv_batch
    return (
        make(gen, *batch, lq, d, dtype=dtype),
        make(gen, *kv_batch, lk, d, dtype=dtype),
        make(gen, *kv_batch, lk, dv, dtype=dtype),
    )


def _samples(dtype, gen):
    def sample(name, args, reduction, **kwargs):
        return Sample(args, kwargs, name=name, grad=(0, 1, 2), reduction=reduction)

    return [
        sample("(1,2,7,5)", _qkv(gen, dtype, (1, 2), 7, 7, 5), 7),
        sample("(2,3,13,8) causal", _qkv(gen, dtype, (2, 3), 13, 13, 8), 13, is_causal=True),
        sample("(2,1,5,9) Lq<Lk causal", _qkv(gen, dtype, (2, 1), 5, 9, 6), 9, is_causal=True),
        sample("(1,2,9,5) Lq>Lk causal", _qkv(gen, dtype, (1, 2), 9, 5, 3), 9, is_causal=True),
        sample(
            "(2,2,7,13) mask (7,13) scale",
            _qkv(gen, dtype, (2, 2), 7, 13, 4),
            13,
            attn_mask=make(gen, 7, 13, dtype=dtype),
            scale=0.3,
        ),
        sample("(3,11,7) 3-D Dv!=D", _qkv(gen, dtype, (3,), 11, 11, 7, dv=5), 11),
        sample("gqa (1,4,5,6)/(1,2,7,6)", _qkv(gen, dtype, (1, 4), 5, 7, 6, kv_batch=(1, 2)), 14, enable_gqa=True),
        sample(
            "bool mask (2,1,5,1)",
            _qkv(gen, dtype, (2, 3), 5, 5, 4),
            5,
            attn_mask=torch.rand(2, 1, 5, 1, generator=gen) > 0.3,
        ),
        sample("k, v (6,3) broadcast over (2,3) heads", _qkv(gen, dtype, (2, 3), 5, 6, 3, kv_batch=()), 30),
        sample("q (5,4) broadcast over k, v (2,2)", _qkv(gen, dtype, (), 5, 6, 4, kv_batch=(2, 2)), 6),
        sample(
            "dropout 0.3 causal",
            _qkv(gen, dtype, (2, 2), 9, 9, 4),
            9,
            dropout_p=0.3,
            is_causal=True,
            seed=7,
            fixed_mask=True,
        ),
        sample("(1,1,1,1)", _qkv(gen, dtype, (1, 1), 1, 1, 1), 1),
        sample("empty batch (0,2,7,5)", _qkv(gen, dtype, (0, 2), 7, 7, 5), 7),
    ]


def _gradcheck_samples(gen):
    dt = torch.float64

    def sample(name, args, **kwargs):
        return Sample(args, kwargs, name=name, grad=(0, 1, 2))

    return [
        sample("(1,1,3,4) causal Lq<Lk", _qkv(gen, dt, (1, 1), 3, 4, 2), is_causal=True),
        sample(
            "k, v broadcast over batch, causal Lq>Lk", _qkv(gen, dt, (2, 1), 4, 3, 2, kv_batch=(1,)), is_causal=True
        ),
        sample("(1,3,4) 3-D mask scale", _qkv(gen, dt, (1,), 3, 4, 2), attn_mask=make(gen, 3, 4, dtype=dt), scale=0.7),
        sample("bool mask, negative scale", _qkv(gen, dt, (1,), 3, 4, 2), attn_mask=make(gen, 3, 4) > -1, scale=-0.6),
        sample("gqa", _qkv(gen, dt, (1, 2), 2, 3, 2, kv_batch=(1, 1)), enable_gqa=True),
        sample("dropout", _qkv(gen, dt, (1, 1), 3, 3, 2), dropout_p=0.4, seed=3, fixed_mask=True),
    ]


register(
    OpInfo(
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        _reference,
        _samples,
        family="attention",
        gradcheck_samples=_gradcheck_samples,
        notes="fused flash-style; saves output and logsumexp only; dropout mask from Philox counters",
    )
)
