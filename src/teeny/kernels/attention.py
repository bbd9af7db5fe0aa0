"""Attention: fused (flash-style) scaled dot-product attention.

For one head, with queries q (Lq, D), keys k (Lk, D), values v (Lk, Dv), an optional mask and
scale c (default 1/sqrt(D)):

    S = c * q k^T + bias       (bias: the additive float mask, or 0 / -inf from a boolean mask
                               and from causal masking, top-left aligned: key j <= query i)
    P = softmax(S) row-wise,   O = P v,   lse = logsumexp(S) row-wise

The forward walks over key blocks with an online softmax and keeps only O and lse (float32,
float64 for float64), never the Lq x Lk matrix P. The backward recomputes P = exp(S - lse)
block by block:

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta)  with  delta = rowsum(dO * O),
    dQ = c dS K,   dK = c dS^T Q

in three launches and without atomics: ``attention_backward_delta`` (delta per query row),
``attention_backward_dkdv`` (one program per key block, looping over the query blocks of every
query head that reads it) and ``attention_backward_dq`` (one program per query block, looping
over key blocks). Products use ``tl.dot`` with float32 accumulation (float64 for float64;
full IEEE precision for float32/float64 operands, bf16/fp16 tensor cores for half inputs).

A query row that can see no key at all (every key masked) gets output 0 and gradient 0, as in
PyTorch's fused kernels (softmax over nothing is taken as all-zero weights, lse = -inf).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, OpContext, RuntimeOp
from .common import DOT_UPCAST_BF16, cdiv, upcast

__all__ = ["scaled_dot_product_attention"]
NN_LAYERS: list[str] = []


# ---------------------------------------------------------------------------------- maths


def _device_fn(fn):
    """A device function called by the kernels: @triton.jit on the GPU. Under the interpreter
    a plain Python function (the kernel's tl calls work the same), since the interpreter
    re-patches triton.language on every call of a jit function (about 0.3-1 ms a call)."""
    return fn if INTERPRETER else triton.jit(fn)


@_device_fn
def _dot(a, b, UPCAST_BF16: tl.constexpr):
    """a @ b accumulated in float32 (float64 for float64); full precision for float32/64."""
    if a.dtype == tl.float64:
        return tl.dot(a, b, input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    elif UPCAST_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_device_fn
def _query_rows(start, bh, Lq, n_bh, H, stride_mb, stride_mh, stride_mq, BLOCK_M: tl.constexpr, PACKED: tl.constexpr):
    """A block of query rows: (flat row index into (BH * Lq), in-range flag, (batch, head) index,
    position in the sequence, offset of the row in the mask). PACKED: rows start..start+BLOCK_M
    of the flat (BH * Lq) rows, spanning several heads; else positions start.. of head bh."""
    offs = start + tl.arange(0, BLOCK_M).to(tl.int64)
    if PACKED:
        rows = offs
        row_bh = rows // Lq
        pos = rows - row_bh * Lq
        ok = rows < n_bh * Lq
    else:
        rows = bh * Lq + offs
        row_bh = bh
        pos = offs
        ok = offs < Lq
    batch = row_bh // H
    mask_rows = batch * stride_mb + (row_bh - batch * H) * stride_mh + pos * stride_mq
    return rows, ok, row_bh, pos, mask_rows


@_device_fn
def _key_cols(start, kv_bh, Lk, col_end, BLOCK_N: tl.constexpr, PACKED: tl.constexpr):
    """A block of keys: (flat index into (BHkv * Lk), in-range flag, key/value head, position).
    PACKED: flat keys start.. below col_end, spanning several heads; else positions start.. of kv_bh."""
    offs = start + tl.arange(0, BLOCK_N).to(tl.int64)
    if PACKED:
        cols = offs
        col_kv = cols // Lk
        pos = cols - col_kv * Lk
        ok = cols < col_end
    else:
        cols = kv_bh * Lk + offs
        col_kv = kv_bh
        pos = offs
        ok = offs < Lk
    return cols, ok, col_kv, pos


@_device_fn
def _scores(
    q,
    k,
    row_ok,
    row_kv,
    pos_m,
    mask_rows,
    col_ok,
    col_kv,
    pos_n,
    scale,
    mask_ptr,
    stride_mk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    PACKED: tl.constexpr,
):
    """The masked, scaled scores S of a (BLOCK_M, BLOCK_N) tile; -inf where a key is not seen
    (out of range, masked, later than the query when causal, or another head's key when PACKED)."""
    s = _dot(q, tl.trans(k), UPCAST_BF16) * scale
    seen = row_ok[:, None] & col_ok[None, :]
    if PACKED:
        seen = seen & (row_kv[:, None] == col_kv[None, :])
    if IS_CAUSAL:
        seen = seen & (pos_n[None, :] <= pos_m[:, None])
    if HAS_MASK:
        mask_ptrs = mask_ptr + mask_rows[:, None] + pos_n[None, :] * stride_mk
        if MASK_BOOL:
            seen = seen & (tl.load(mask_ptrs, mask=seen, other=0) != 0)
        else:
            s = s + upcast(tl.load(mask_ptrs, mask=seen, other=0.0))
    return tl.where(seen, s, float("-inf"))


@_device_fn
def _load_rows(base, rows, row_ok, offs_cols, n_cols):
    """rows x cols tile of a row-major (*, n_cols) matrix, zero outside it (rows: int64)."""
    ptrs = base + rows[:, None] * n_cols + offs_cols[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & (offs_cols[None, :] < n_cols), other=0.0)


@_device_fn
def _store_rows(base, value, rows, row_ok, offs_cols, n_cols):
    ptrs = base + rows[:, None] * n_cols + offs_cols[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=row_ok[:, None] & (offs_cols[None, :] < n_cols))


# -------------------------------------------------------------------------------- kernels
# Layout: q (BH, Lq, D), k (BHkv, Lk, D), v (BHkv, Lk, DV), out (BH, Lq, DV), lse/delta (BH, Lq),
# contiguous; query head h reads key/value head h // KV_GROUP (grouped-query attention;
# KV_GROUP = 1 otherwise). The mask is read through broadcast strides (0 along broadcast dims).
# Two tilings (constexpr PACKED): per head (program axis 1 is the (batch, head) pair, axis 0
# a block of positions; the GPU's), or packed: the (BH * Lq) query rows and (BHkv * Lk) keys
# flattened, a tile spanning several heads and keys of another head masked out (few, wide
# programs for the interpreter, which pays per program and per operation, not per element).


@kernel(half=True)
def attention_backward_delta(out_ptr, dout_ptr, delta_ptr, n_rows, DV, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DV)
    o = upcast(_load_rows(out_ptr, rows, rows < n_rows, cols, DV))
    do = upcast(_load_rows(dout_ptr, rows, rows < n_rows, cols, DV))
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


@kernel(half=True)
def attention_backward_dkdv(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    Lq,
    Lk,
    D,
    DV,
    H,
    KV_GROUP,
    n_bh,
    scale,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WRITE_DK: tl.constexpr,
    WRITE_DV: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    ACC: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    start_n = tl.program_id(0).to(tl.int64) * BLOCK_N
    kv_bh = tl.program_id(1).to(tl.int64)
    n_kv = n_bh // KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols, col_ok, col_kv, pos_n = _key_cols(start_n, kv_bh, Lk, n_kv * Lk, BLOCK_N, PACKED)
    k = _load_rows(k_ptr, cols, col_ok, offs_d, D)
    v = _load_rows(v_ptr, cols, col_ok, offs_dv, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    if PACKED:  # the query rows of every head that reads these keys, as one flat range
        groups = 1
        lo = (start_n // Lk) * KV_GROUP * Lq
        hi = tl.minimum((start_n + BLOCK_N - 1) // Lk + 1, n_kv) * KV_GROUP * Lq
    else:
        groups = KV_GROUP
        lo = 0
        if IS_CAUSAL:
            lo = (start_n // BLOCK_M) * BLOCK_M  # earlier query blocks see none of these keys
        hi = Lq
    for g in range(0, groups):
        bh = kv_bh * KV_GROUP + g
        for start_m in range(lo, hi, BLOCK_M):
            rows, row_ok, row_bh, pos_m, mask_rows = _query_rows(
                start_m, bh, Lq, n_bh, H, stride_mb, stride_mh, stride_mq, BLOCK_M, PACKED
            )
            q = _load_rows(q_ptr, rows, row_ok, offs_d, D)
            do = _load_rows(dout_ptr, rows, row_ok, offs_dv, DV)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows that see no key: P = 0
            s = _scores(
                q,
                k,
                row_ok,
                row_bh // KV_GROUP,
                pos_m,
                mask_rows,
                col_ok,
                col_kv,
                pos_n,
                scale,
                mask_ptr,
                stride_mk,
                HAS_MASK,
                MASK_BOOL,
                IS_CAUSAL,
                UPCAST_BF16,
                PACKED,
            )
            p = tl.exp(s - lse[:, None])
            if WRITE_DV:
                dv += _dot(tl.trans(p).to(do.dtype), do, UPCAST_BF16)
            if WRITE_DK:
                delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
                dp = _dot(do, tl.trans(v), UPCAST_BF16)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds).to(q.dtype), q, UPCAST_BF16)
    if WRITE_DK:
        _store_rows(dk_ptr, dk * scale, cols, col_ok, offs_d, D)
    if WRITE_DV:
        _store_rows(dv_ptr, dv, cols, col_ok, offs_dv, DV)


@_device_fn
def _key_range(
    start_m, bh, Lq, Lk, KV_GROUP, n_bh, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PACKED: tl.constexpr
):
    """(first, end) of the keys a query block needs: flat keys of every head it spans when PACKED,
    else positions of its own head (up to the block's last query when causal)."""
    if PACKED:
        first = (start_m // Lq) // KV_GROUP * Lk
        end = (tl.minimum((start_m + BLOCK_M - 1) // Lq, n_bh - 1) // KV_GROUP + 1) * Lk
    else:
        first = start_m * 0
        end = first + Lk
        if IS_CAUSAL:
            end = tl.minimum(end, start_m + BLOCK_M)  # later keys are masked for every row of the block
    return first, end


@kernel(half=True)
def attention_backward_dq(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    Lq,
    Lk,
    D,
    DV,
    H,
    KV_GROUP,
    n_bh,
    scale,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    ACC: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    start_m = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = bh // KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows, row_ok, row_bh, pos_m, mask_rows = _query_rows(
        start_m, bh, Lq, n_bh, H, stride_mb, stride_mh, stride_mq, BLOCK_M, PACKED
    )
    row_kv = row_bh // KV_GROUP
    q = _load_rows(q_ptr, rows, row_ok, offs_d, D)
    do = _load_rows(dout_ptr, rows, row_ok, offs_dv, DV)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    first, end = _key_range(start_m, bh, Lq, Lk, KV_GROUP, n_bh, IS_CAUSAL, BLOCK_M, PACKED)
    for start_n in range(first, end, BLOCK_N):
        cols, col_ok, col_kv, pos_n = _key_cols(start_n, kv_bh, Lk, end, BLOCK_N, PACKED)
        k = _load_rows(k_ptr, cols, col_ok, offs_d, D)
        v = _load_rows(v_ptr, cols, col_ok, offs_dv, DV)
        s = _scores(
            q,
            k,
            row_ok,
            row_kv,
            pos_m,
            mask_rows,
            col_ok,
            col_kv,
            pos_n,
            scale,
            mask_ptr,
            stride_mk,
            HAS_MASK,
            MASK_BOOL,
            IS_CAUSAL,
            UPCAST_BF16,
            PACKED,
        )
        p = tl.exp(s - lse[:, None])
        ds = p * (_dot(do, tl.trans(v), UPCAST_BF16) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST_BF16)
    _store_rows(dq_ptr, dq * scale, rows, row_ok, offs_d, D)


@kernel(backward=(attention_backward_delta, attention_backward_dkdv, attention_backward_dq), half=True)
def attention_forward(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    lse_ptr,
    Lq,
    Lk,
    D,
    DV,
    H,
    KV_GROUP,
    n_bh,
    scale,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST_BF16: tl.constexpr,
    ACC: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    start_m = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = bh // KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows, row_ok, row_bh, pos_m, mask_rows = _query_rows(
        start_m, bh, Lq, n_bh, H, stride_mb, stride_mh, stride_mq, BLOCK_M, PACKED
    )
    row_kv = row_bh // KV_GROUP
    q = _load_rows(q_ptr, rows, row_ok, offs_d, D)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    row_sum = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    first, end = _key_range(start_m, bh, Lq, Lk, KV_GROUP, n_bh, IS_CAUSAL, BLOCK_M, PACKED)
    for start_n in range(first, end, BLOCK_N):
        cols, col_ok, col_kv, pos_n = _key_cols(start_n, kv_bh, Lk, end, BLOCK_N, PACKED)
        k = _load_rows(k_ptr, cols, col_ok, offs_d, D)
        s = _scores(
            q,
            k,
            row_ok,
            row_kv,
            pos_m,
            mask_rows,
            col_ok,
            col_kv,
            pos_n,
            scale,
            mask_ptr,
            stride_mk,
            HAS_MASK,
            MASK_BOOL,
            IS_CAUSAL,
            UPCAST_BF16,
            PACKED,
        )
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key seen yet: avoid inf - inf
        p = tl.exp(s - shift[:, None])
        rescale = tl.exp(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = _load_rows(v_ptr, cols, col_ok, offs_dv, DV)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, UPCAST_BF16)
        row_max = new_max
    seen_any = row_sum > 0
    safe_sum = tl.where(seen_any, row_sum, 1.0)
    _store_rows(out_ptr, acc / safe_sum[:, None], rows, row_ok, offs_dv, DV)
    lse = tl.where(seen_any, row_max + tl.log(safe_sum), float("-inf"))
    tl.store(lse_ptr + rows, lse, mask=row_ok)


# ------------------------------------------------------------------------------ RuntimeOp


# Under the interpreter the heads are packed into tiles of up to PACKED_TILE query rows and keys
# (tests set PACK_HEADS / PACKED_TILE to run the per-head tiling and many packed tiles on the CPU).
PACK_HEADS = INTERPRETER
PACKED_TILE = 512


def _blocks(g: dict, dtype: torch.dtype) -> tuple[bool, int, int, int, int]:
    """(PACKED, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV): head dims padded to a power of two (>= 16 for tl.dot).

    On the H200 (Triton 3.6), bf16 attention with head dims padded to 32/16 gave wrong results
    and an illegal memory access while 64/64 was right (cf. triton-lang/triton#11366, wgmma with
    BLOCK_D=32): half-precision head dims are padded to at least 64 there. float32/float64
    dots run on FMA units (IEEE precision) and use smaller tiles. Not tuned yet. The
    interpreter packs heads (few, wide programs: it pays per program and per operation).
    """
    block_d = max(16, triton.next_power_of_2(max(g["d"], 1)))
    block_dv = max(16, triton.next_power_of_2(max(g["dv"], 1)))
    if PACK_HEADS:
        bh = g["batch"] * g["heads"]
        block_m = min(PACKED_TILE, max(16, triton.next_power_of_2(max(bh * g["lq"], 1))))
        block_n = min(PACKED_TILE, max(16, triton.next_power_of_2(max(bh // g["group"] * g["lk"], 1))))
        return True, block_m, block_n, block_d, block_dv
    if INTERPRETER:
        return False, 16, 16, block_d, block_dv
    if dtype in (torch.float32, torch.float64):
        return False, 32, 32, block_d, block_dv
    block_d, block_dv = max(64, block_d), max(64, block_dv)
    if max(block_d, block_dv) > 64:
        return False, 64, 32, block_d, block_dv
    return False, 64, 64, block_d, block_dv


def _grid(g: dict, blocks, keys: bool) -> tuple[int, int, int]:
    """Programs over query blocks (keys=False) or key blocks (keys=True): per head, or packed."""
    packed, block_m, block_n = blocks[:3]
    heads = g["batch"] * g["heads"] // (g["group"] if keys else 1)
    length, block = (g["lk"], block_n) if keys else (g["lq"], block_m)
    return (cdiv(heads * length, block), 1, 1) if packed else (cdiv(length, block), heads, 1)


def _broadcast_strides(mask_shape, target) -> tuple[int, ...]:
    """Element strides that read a contiguous ``mask_shape`` tensor broadcast to ``target``."""
    shape = (1,) * (len(target) - len(mask_shape)) + tuple(mask_shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step if size != 1 else 0)
        step *= size
    return tuple(reversed(strides))


class AttentionOp(RuntimeOp):
    """Fused attention; inputs q, k, v[, mask]; saves the inputs, the output and lse."""

    name = "scaled_dot_product_attention"
    kernel = attention_forward
    saves_inputs = True
    saves_output = True
    differentiable_inputs = (0, 1, 2)  # no gradient for the mask

    def __init__(self, has_mask: bool, is_causal: bool, scale: float | None, enable_gqa: bool):
        self.has_mask, self.is_causal, self.user_scale, self.enable_gqa = has_mask, is_causal, scale, enable_gqa
        self.n_activation_inputs = 4 if has_mask else 3

    # --- shapes --------------------------------------------------------------------------
    def check_inputs(self, input_shapes, input_dtypes):
        q, k, v = (tuple(s) for s in input_shapes[:3])
        for what, shape in (("query", q), ("key", k), ("value", v)):
            if not 2 <= len(shape) <= 4:
                raise ValueError(
                    f"{what} must have 2 to 4 dimensions ((batch, heads,) length, head dim), got shape {shape}"
                )
        if not len(q) == len(k) == len(v):
            raise ValueError(f"query, key and value must have the same number of dimensions, got shapes {q}, {k}, {v}")
        for what, dtype in zip(("query", "key", "value"), input_dtypes[:3]):
            if not dtype.is_floating_point:
                raise TypeError(f"{what} must be a float tensor, got {str(dtype).replace('torch.', '')}")
        if q[-1] != k[-1]:
            raise ValueError(f"query and key must have the same head dim (last dim), got query {q} and key {k}")
        if k[:-1] != v[:-1]:
            raise ValueError(f"key and value must agree in every dim but the last, got key {k} and value {v}")
        if self.enable_gqa and len(q) >= 3:
            if q[:-3] != k[:-3] or k[-3] == 0 or q[-3] % k[-3] != 0:
                raise ValueError(
                    f"enable_gqa: key/value heads (dim -3) must divide query heads and the other batch "
                    f"dims must match, got query {q} and key {k}"
                )
        elif q[:-2] != k[:-2]:
            raise ValueError(
                f"query and key must have the same batch dims {q[:-2]}, got key {k} "
                f"(pass enable_gqa=True for fewer key/value heads)"
            )
        if self.has_mask:
            mask, target = tuple(input_shapes[3]), q[:-1] + (k[-2],)
            padded = (1,) * (len(target) - len(mask)) + mask
            if len(mask) > len(target) or any(m not in (1, t) for m, t in zip(padded, target)):
                raise ValueError(
                    f"attn_mask of shape {mask} is not broadcastable to {target} (batch..., query length, key length)"
                )
            dtype = input_dtypes[3]
            if dtype != torch.bool and dtype != input_dtypes[0]:
                raise TypeError(f"attn_mask must be bool or have the query's dtype, got {dtype}")

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[2][-1],)

    def extra_outputs(self, input_shapes, dtype):
        return {"lse": (tuple(input_shapes[0][:-1]), _acc_dtype(dtype))}

    # --- launch helpers ----------------------------------------------------------------------
    def _geometry(self, shapes):
        q, k, v = (tuple(s) for s in shapes[:3])
        q4, k4 = (1,) * (4 - len(q)) + q, (1,) * (4 - len(k)) + k
        batch, heads, lq, d = q4
        group = heads // k4[1] if k4[1] else 1
        strides = (0, 0, 0, 0)
        if self.has_mask:
            strides = _broadcast_strides(tuple(shapes[3]), (batch, heads, lq, k4[2]))
        scale = self.user_scale if self.user_scale is not None else 1.0 / math.sqrt(d) if d else 1.0
        return dict(batch=batch, heads=heads, lq=lq, lk=k4[2], d=d, dv=v[-1], group=group, scale=scale, strides=strides)

    def _common(self, visitor: ArgVisitor, g: dict) -> None:
        visitor.visit_i32(g["lq"]).visit_i32(g["lk"]).visit_i32(g["d"]).visit_i32(g["dv"])
        visitor.visit_i32(g["heads"]).visit_i32(g["group"]).visit_i64(g["batch"] * g["heads"]).visit_float(g["scale"])
        for s in g["strides"]:
            visitor.visit_i64(s)

    def _flags(self, visitor: ArgVisitor, mask) -> None:
        visitor.visit_constexpr(self.has_mask)
        visitor.visit_constexpr(mask is not None and mask.dtype == torch.bool)
        visitor.visit_constexpr(self.is_causal)

    def _tail(self, visitor: ArgVisitor, g: dict, dtype: torch.dtype) -> None:
        visitor.visit_constexpr(DOT_UPCAST_BF16).visit_constexpr(_tl_acc(dtype))
        for b in _blocks(g, dtype):
            visitor.visit_constexpr(b)

    # --- forward ---------------------------------------------------------------------------
    def forward(self, ctx: OpContext) -> None:
        q, k, v = ctx.inputs[:3]
        mask = ctx.inputs[3] if self.has_mask else None
        g = self._geometry(ctx.input_shapes)
        visitor = ArgVisitor()
        visitor.visit_ptr(q).visit_ptr(k).visit_ptr(v).visit_ptr(mask if mask is not None else q)
        visitor.visit_ptr(ctx.output).visit_ptr(ctx.saved["lse"])
        self._common(visitor, g)
        self._flags(visitor, mask)
        self._tail(visitor, g, ctx.dtype)
        ctx.launch(attention_forward, _grid(g, _blocks(g, ctx.dtype), keys=False), visitor)

    # --- backward --------------------------------------------------------------------------
    def has_backward(self):
        return True

    def backward_kernels(self):
        return (attention_backward_delta, attention_backward_dkdv, attention_backward_dq)

    def backward(self, ctx: OpContext) -> None:
        q, k, v = ctx.inputs[:3]
        mask = ctx.inputs[3] if self.has_mask else None
        dq, dk, dv = ctx.grad_inputs[:3]
        out, dout, lse = ctx.output, ctx.grad_output, ctx.saved["lse"]
        g = self._geometry(ctx.input_shapes)
        blocks = _blocks(g, ctx.dtype)
        packed, block_m, _, _, block_dv = blocks
        bh = g["batch"] * g["heads"]
        delta = ctx.empty(lse.shape, lse.dtype)
        if dq is not None or dk is not None:
            rows = bh * g["lq"]
            if packed:  # one wide program where the interpreter runs it
                block_m = min(max(16, triton.next_power_of_2(max(rows, 1))), max(16, 2 * PACKED_TILE**2 // block_dv))
            visitor = ArgVisitor().visit_ptr(out).visit_ptr(dout).visit_ptr(delta).visit_i64(rows).visit_i32(g["dv"])
            visitor.visit_constexpr(block_m).visit_constexpr(block_dv)
            ctx.launch(attention_backward_delta, (cdiv(rows, block_m), 1, 1), visitor, work=rows)

        def start(extra_ptrs):
            visitor = ArgVisitor()
            for t in (q, k, v, mask if mask is not None else q, dout, lse, delta, *extra_ptrs):
                visitor.visit_ptr(t)
            self._common(visitor, g)
            self._flags(visitor, mask)
            return visitor

        if dk is not None or dv is not None:
            visitor = start((dk if dk is not None else dv, dv if dv is not None else dk))
            visitor.visit_constexpr(dk is not None).visit_constexpr(dv is not None)
            self._tail(visitor, g, ctx.dtype)
            target = dk if dk is not None else dv
            ctx.launch(attention_backward_dkdv, _grid(g, blocks, keys=True), visitor, work=target.numel())
        if dq is not None:
            visitor = start((dq,))
            self._tail(visitor, g, ctx.dtype)
            ctx.launch(attention_backward_dq, _grid(g, blocks, keys=False), visitor, work=dq.numel())


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


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
):
    """softmax(query key^T * scale + attn_mask) value, as torch.nn.functional.scaled_dot_product_attention.

    query (..., Lq, D), key (..., Lk, D), value (..., Lk, Dv) with 0 to 2 batch dims; attn_mask
    a float mask added to the scores or a bool mask (True: may attend), broadcastable to
    (..., Lq, Lk), with no gradient; is_causal: query i sees keys j <= i (top-left aligned);
    scale defaults to 1/sqrt(D) (passed to the kernels as a float32 scalar); enable_gqa: key
    and value may have fewer heads (dim -3) than query. Rows that see no key give 0.
    dropout_p must be 0 (no attention dropout in teeny).
    """
    if dropout_p != 0.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p={dropout_p} is not supported (only 0.0)")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scaled_dot_product_attention: scale must be a float or None, got {type(scale).__name__}")
    op = AttentionOp(attn_mask is not None, bool(is_causal), None if scale is None else float(scale), bool(enable_gqa))
    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    return graph_of(query, key, value).apply(op, inputs)


# ---------------------------------------------------------------------------------- layers


# -------------------------------------------------------------------------- registry/tests


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
        sample("(1,1,1,1)", _qkv(gen, dtype, (1, 1), 1, 1, 1), 1),
        sample("empty batch (0,2,7,5)", _qkv(gen, dtype, (0, 2), 7, 7, 5), 7),
    ]


def _gradcheck_samples(gen):
    dt = torch.float64

    def sample(name, args, **kwargs):
        return Sample(args, kwargs, name=name, grad=(0, 1, 2))

    return [
        sample("(1,1,3,2)", _qkv(gen, dt, (1, 1), 3, 3, 2)),
        sample("(1,1,3,4) causal Lq<Lk", _qkv(gen, dt, (1, 1), 3, 4, 2), is_causal=True),
        sample("(1,1,4,3) causal Lq>Lk", _qkv(gen, dt, (1, 1), 4, 3, 2), is_causal=True),
        sample("(1,3,4) 3-D mask scale", _qkv(gen, dt, (1,), 3, 4, 2), attn_mask=make(gen, 3, 4, dtype=dt), scale=0.7),
        sample("gqa", _qkv(gen, dt, (1, 2), 2, 3, 2, kv_batch=(1, 1)), enable_gqa=True),
    ]


register(
    OpInfo(
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        _samples,
        family="attention",
        gradcheck_samples=_gradcheck_samples,
        notes="fused flash-style; saves output and logsumexp only",
    )
)
