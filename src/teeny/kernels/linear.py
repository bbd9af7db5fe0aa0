"""Matrix products: ``matmul`` (torch.matmul semantics) and ``linear`` (y = x W^T + b).

Every product, forward and backward, is one of

    Z[g] = sum_r X[g, r] @ Y[g, r]   (+ bias[n] broadcast over rows)

with fp32 accumulation (fp64 for float64): ``g`` runs over the kept batch dims and ``r`` over
batch dims that the result is broadcast along (a gradient summed over broadcast dims, inside
the program: no atomics, no partials). X, Y and Z are read and written through strides, so a
transposed operand is the same buffer with its strides swapped, read in place:

    Y = A @ B        dA = sum_broadcast dY @ B^T        dB = sum_broadcast A^T @ dY
    linear: Y = X W^T + b,   dX = dY W,   dW = dY^T X,   db = column sums of dY

Three kernels compute them:

* ``matmul_tma`` (Hopper, 2-D products whose operands have one unit stride and 16-byte aligned
  rows; where rows are not aligned, a big product reads K-major copies with padded rows and
  writes padded rows copied into Z after, if timing says that beats the strided kernel):
  persistent programs (one or two per multiprocessor) walk the output tiles in grouped
  order (neighbouring programs share operand tiles in L2); operand tiles arrive by TMA
  descriptors made on the host at each launch, zero-filled past the edges, in either layout
  (a transposed operand is described as it lies and its tile transposed in shared memory; so
  is a transposed Z, Conv1D's dW^T written into W's (in, out)); the bias is added in the
  epilogue. Where
  whole tiles would leave the last wave of programs part idle (few output tiles and a long
  contraction: dW of a layer over many tokens), the last waves' tiles are shared out stream-K:
  their K tiles, laid end to end, are split evenly over the programs, and
  ``matmul_sum_segments`` adds up the fp32 segments of the tiles that several programs shared
  (in a fixed order: bit-reproducible, no atomics). linear's dW = dY^T X also sums the dY^T
  tiles it reads over the rows: the bias gradient without another pass over dY (the programs
  of the first column tile do it). float32 (tf32/tf32x3) tensor cores take operands K-major
  only, so an MN-major float32 operand may be copied K-major first (``matmul_copy``, one pass).
* ``matmul_ws`` (``linear_gluon``: Hopper, half precision, aligned 2-D products without an
  activation epilogue or a transposed Z): a Gluon kernel whose programs hold 128 x 192 tiles as
  two warpgroups side by side, fed by a TMA loader warp; a tuning candidate (an output 768 wide
  is 4 of its tiles across, where ``tl.dot``'s powers of two leave a wave part idle). A dW that
  also wants the bias gradient takes it from ``common.sum_to_shape`` there.
* ``matmul_product`` (everything else: batched and broadcast products, small products with
  unaligned rows, the interpreter): the same tiles in grouped order through strided pointer loads; the bias
  gradient is ``common.sum_to_shape`` of dY there (one pass reading dY once).

Both kernels can run an element-wise activation in the epilogue (``Epilogue``): Z = f(h) with h
the product plus bias also written out for the backward, or, backwards, Z = f'(h) * the product
with h read back. ``MLPOp`` (linear, activation, linear, ... as one node) uses both.

Tile sizes, warps, stages, the schedule and the copies are chosen per static shape when the
program is lowered: ``teeny.tuning`` times a few candidates on the GPU and caches the winner
on disk; under the interpreter, or with tuning off (``TEENY_TUNING=0``), ``default_config``
decides.

Precision: float64 is exact (``input_precision="ieee"``). float32 products use ``"tf32x3"``
on the GPU (three TF32 tensor-core products of split operands: more accurate than cuBLAS
SGEMM against float64, and faster than ``"ieee"`` FMA), or plain TF32 when
``teeny.config.allow_tf32`` was set before tracing (like ``torch.backends.cuda.matmul.allow_tf32``).
tf32x3 splits each operand into a high and a low part, so an infinite operand gives NaN where a
full-precision product gives inf. Under the Triton interpreter bfloat16 operands are upcast to
float32 before ``tl.dot`` (its bfloat16 dot is wrong).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import config as teeny_config
from .. import init, tuning
from ..device import DEVICE, INTERPRETER
from ..graph import graph_of
from ..kernel import Kernel, kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, Block, Launch, OpContext, RuntimeOp, TeenyError, run_launch
from . import linear_gluon
from .common import (
    DOT_UPCAST_BF16,
    acc_dtype,
    cdiv,
    pow2,
    side_by_side,
    sum_to_shape,
    sum_to_shape_kernel,
    tl_acc_dtype,
    wait_for_previous,
)
from .linear_gluon import matmul_ws
from .shape import copy_launch, strided_copy

__all__ = ["matmul", "linear"]
NN_LAYERS = ["Linear"]

IEEE, TF32, TF32X3 = "ieee", "tf32", "tf32x3"  # tl.dot input precisions


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``tl.dot``'s ``input_precision`` for ``dtype`` operands: exact for float64; tf32x3 for
    float32 on the GPU (tf32 if ``allow_tf32``); the flag does not apply to half operands."""
    if dtype == torch.float64:
        return IEEE
    if dtype == torch.float32:
        return TF32 if allow_tf32 else (IEEE if INTERPRETER else TF32X3)
    if dtype == torch.bfloat16 and DOT_UPCAST_BF16:
        return IEEE  # upcast to float32 under the interpreter
    return TF32


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the tile-th output tile in grouped order: GROUP_M row tiles
    walk the column tiles together, so the operand tiles they share stay in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


ROW_SUM_COLUMNS = tl.constexpr(16)  # the narrowest tl.dot: X @ [1 0 ... 0] (K x 16) sums X's rows


@triton.jit
def _tile_product(
    x_desc,
    y_desc,
    m0,
    n0,
    k_lo,
    k_hi,
    X_K_CONTIGUOUS: tl.constexpr,
    Y_K_CONTIGUOUS: tl.constexpr,
    ROW_SUMS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_SUM_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """sum over K tiles k_lo..k_hi-1 of X[m0 +, k] @ Y[k, n0 +] in ACC and (ROW_SUMS) the sums
    of those X tiles' rows. The row sums are a second, 16-wide product with the X tile already
    in shared memory (in every program: a reduction in registers would load the tile from
    shared memory and synchronise the warps every step), 1/16 more tensor-core work at
    BLOCK_N = 256."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    row_acc = tl.zeros((BLOCK_M, ROW_SUM_COLUMNS), dtype=ACC)
    for kt in range(k_lo, k_hi):
        k0 = kt * BLOCK_K
        if X_K_CONTIGUOUS:
            a = x_desc.load([m0, k0])
        else:
            a = x_desc.load([k0, m0]).T
        if Y_K_CONTIGUOUS:
            b = y_desc.load([n0, k0]).T
        else:
            b = y_desc.load([k0, n0])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # Triton 3.6 waits for the row sums' product as soon as it is issued (it keeps one product
        # per loop in flight): issued first, that wait does not hold back this step's big one
        if ROW_SUMS:
            first_column = tl.arange(0, ROW_SUM_COLUMNS)[None, :] == 0
            ones = tl.where(first_column, 1.0, 0.0).to(a.dtype) + tl.zeros((BLOCK_K, ROW_SUM_COLUMNS), dtype=a.dtype)
            row_acc = tl.dot(a, ones, row_acc, input_precision=ROW_SUM_PRECISION, out_dtype=ACC)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    return acc, tl.sum(row_acc, axis=1)  # the other columns are zeros: exact


@triton.jit
def _store_tile(desc, row, col, acc, SUBTILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc into the (BLOCK_M, BLOCK_N) box of ``desc`` at (row, col), in desc's dtype; SUBTILE
    stores each half of the columns on its own (half the shared memory for the epilogue)."""
    if SUBTILE:
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        desc.store([row, col], left.to(desc.dtype))
        desc.store([row, col + BLOCK_N // 2], right.to(desc.dtype))
    else:
        desc.store([row, col], acc.to(desc.dtype))


@triton.jit
def _activation_epilogue(
    acc, z_ptr, aux_ptr, offs_m, offs_n, M, N, stride_m, stride_n, act_a, act_b,
    ACTIVATION: tl.constexpr, DERIVATIVE: tl.constexpr,
):  # fmt: skip
    """An activation fused into the product (``MLPOp``), on the tile ``acc`` (bias added) of
    rows offs_m and columns offs_n, rounded first to Z's dtype as an unfused product stores it.
    ACTIVATION: returns f(h, a, b) of h = acc, h written to aux_ptr (when given) for the backward;
    DERIVATIVE: returns the gradient through the activation, f'(h, acc, a, b), h read from aux_ptr.
    aux_ptr's rows and columns are stride_m and stride_n apart."""
    if ACTIVATION is not None or DERIVATIVE is not None:
        acc = acc.to(z_ptr.dtype.element_ty).to(acc.dtype)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if ACTIVATION is not None:
            if aux_ptr is not None:
                aux = aux_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :] * stride_n
                tl.store(aux, acc.to(aux_ptr.dtype.element_ty), mask=mask)
            acc = ACTIVATION(acc, act_a, act_b)
        else:
            aux = aux_ptr + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :] * stride_n
            acc = DERIVATIVE(tl.load(aux, mask=mask, other=0.0).to(acc.dtype), acc, act_a, act_b)
    return acc


@triton.jit
def _load_tile(desc, row, col, SUBTILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) box of ``desc`` at (row, col), as ``_store_tile`` stores it."""
    if SUBTILE:
        left = desc.load([row, col])
        right = desc.load([row, col + BLOCK_N // 2])
        return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BLOCK_M, BLOCK_N))
    else:
        return desc.load([row, col])


@triton.jit
def _finish_tile(
    z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, sum_rows, act_a, act_b,
    ACC: tl.constexpr, SUBTILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, DERIVATIVE: tl.constexpr, Z_TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """The epilogue of a tile whose whole contraction one program summed: bias, activation,
    store, row sums. The activation's aux tile (h, as ``_activation_epilogue`` describes it)
    moves through ``aux_desc`` as Z does, in TMA boxes (a little faster than pointers from the
    accumulator's registers; what an activation here costs is its maths: ``rewrites.fuse_mlp``).
    Z_TRANSPOSED: ``z_desc`` describes Z^T, (N, M), and the tile is stored transposed."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC)[None, :]
    if ACTIVATION is not None or DERIVATIVE is not None:
        acc = acc.to(z_desc.dtype).to(acc.dtype)
        if ACTIVATION is not None:
            if aux_desc is not None:
                _store_tile(aux_desc, m0, n0, acc, SUBTILE, BLOCK_M, BLOCK_N)
            acc = ACTIVATION(acc, act_a, act_b)
        else:
            h = _load_tile(aux_desc, m0, n0, SUBTILE, BLOCK_M, BLOCK_N).to(acc.dtype)
            acc = DERIVATIVE(h, acc, act_a, act_b)
    if Z_TRANSPOSED:
        _store_tile(z_desc, n0, m0, acc.T, SUBTILE, BLOCK_N, BLOCK_M)
    else:
        _store_tile(z_desc, m0, n0, acc, SUBTILE, BLOCK_M, BLOCK_N)
    if row_sums_ptr is not None:
        if sum_rows:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            tl.store(row_sums_ptr + offs_m, row_sums.to(row_sums_ptr.dtype.element_ty), mask=offs_m < M)


@triton.jit
def _segment_owners(i, k_tiles, total, programs):
    """The first and last program of stream-K tile i: program p takes the K tiles
    p * total // programs ... (p + 1) * total // programs - 1 of the tiles laid end to end."""
    first = ((i * k_tiles + 1) * programs - 1) // total
    last = ((i + 1) * k_tiles * programs - 1) // total
    return first, last


@triton.jit(do_not_specialize=["programs", "dp_tiles"])
def _matmul_tma(
    x_desc,
    y_desc,
    z_desc,
    bias_ptr,
    row_sums_ptr,
    partial_ptr,
    partial_sums_ptr,
    aux_desc,
    M,
    N,
    K,
    programs,
    dp_tiles,
    act_a,
    act_b,
    X_K_CONTIGUOUS: tl.constexpr,
    Y_K_CONTIGUOUS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_SUM_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DERIVATIVE: tl.constexpr,
    Z_TRANSPOSED: tl.constexpr,
):
    """Z = X @ Y (+ bias) for a 2-D product, by ``programs`` persistent programs, through the TMA
    descriptors ``_matmul_tma_descriptors`` makes on the host: X (M, K) if X_K_CONTIGUOUS, else
    described as it lies, (K, M); Y (K, N), or (Y_K_CONTIGUOUS) (N, K); Z (M, N), or
    (Z_TRANSPOSED, no activation) (N, M); aux_desc laid out as Z.
    row_sums_ptr: also the sums of X's rows over K (linear's bias gradient, X = dY^T), written
    by the programs of the first column tile. ACTIVATION / DERIVATIVE (with aux_desc, act_a,
    act_b): an activation in the epilogue (``_activation_epilogue``).

    Tiles 0 .. dp_tiles - 1 (grouped order) go round the programs whole. The rest are stream-K
    (with partial_ptr): their K tiles, laid end to end, are shared out evenly, so the last wave
    leaves no multiprocessor idle; a tile that one program sums whole is stored as above, the
    segments of a shared one go to the fp32 (ACC) partials, rows of BLOCK_N, in boxes of
    BLOCK_M rows, (slot, tile) with slot = program - the tile's first, which
    ``matmul_sum_segments`` adds up."""
    wait_for_previous()
    if Z_TRANSPOSED:
        tl.static_assert(aux_desc is None, "an activation epilogue needs Z stored as (M, N)")
    row_sums_wanted: tl.constexpr = row_sums_ptr is not None
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    whole_tiles = (dp_tiles - pid + programs - 1) // programs  # tiles pid, pid + programs, ...
    items = whole_tiles
    if partial_ptr is not None:
        sk_tiles = tiles_m * tiles_n - dp_tiles
        total = sk_tiles.to(tl.int64) * k_tiles
        start = pid * total // programs  # this program's K tiles of the stream-K tiles laid end to end
        end = (pid + 1) * total // programs
        first_shared = start // k_tiles
        items += ((end + k_tiles - 1) // k_tiles - first_shared).to(tl.int32)
    # one loop over this program's whole tiles, then its stream-K segments (one loop nest: one
    # set of pipeline buffers in shared memory), flattened where Triton can (not with the row
    # sums' second product: Triton 3.6 fails to compile that)
    for item in tl.range(0, items, flatten=not row_sums_wanted):
        if partial_ptr is not None:
            whole = item < whole_tiles
            i = first_shared + (item - whole_tiles)  # the stream-K tile, where not whole
            tile = tl.where(whole, pid + item * programs, dp_tiles + i).to(tl.int32)
            k_lo = tl.where(whole, 0, tl.maximum(start - i * k_tiles, 0)).to(tl.int32)
            k_hi = tl.where(whole, k_tiles, tl.minimum(end - i * k_tiles, k_tiles)).to(tl.int32)
        else:
            tile = pid + item * programs
            k_lo = 0
            k_hi = k_tiles
        pid_m, pid_n = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc, row_sums = _tile_product(
            x_desc, y_desc, m0, n0, k_lo, k_hi, X_K_CONTIGUOUS, Y_K_CONTIGUOUS, row_sums_wanted,
            ACC, PRECISION, ROW_SUM_PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if partial_ptr is None:
            _finish_tile(
                z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, pid_n == 0,
                act_a, act_b, ACC, SUBTILE, BLOCK_M, BLOCK_N, ACTIVATION, DERIVATIVE, Z_TRANSPOSED,
            )  # fmt: skip
        else:
            first, last = _segment_owners(i, k_tiles, total, programs)
            if whole | (first == last):
                _finish_tile(
                    z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, pid_n == 0,
                    act_a, act_b, ACC, SUBTILE, BLOCK_M, BLOCK_N, ACTIVATION, DERIVATIVE, Z_TRANSPOSED,
                )  # fmt: skip
            else:
                # a segment of a shared tile: its box of fp32 partials, stored from registers
                # (no staging tile in shared memory, which the pipeline needs)
                row = ((pid - first) * sk_tiles + i) * BLOCK_M
                box = partial_ptr + (row + tl.arange(0, BLOCK_M))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                tl.store(box, acc)
                if row_sums_wanted:
                    if pid_n == 0:
                        tl.store(partial_sums_ptr + row + tl.arange(0, BLOCK_M), row_sums)


def _matmul_tma_descriptors(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    row_sums_ptr,
    partial_ptr,
    partial_sums_ptr,
    aux_ptr,
    M,
    N,
    K,
    x_stride,
    y_stride,
    z_stride,
    programs,
    dp_tiles,
    act_a,
    act_b,
    X_K_CONTIGUOUS: tl.constexpr,
    Y_K_CONTIGUOUS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_SUM_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DERIVATIVE: tl.constexpr,
    Z_TRANSPOSED: tl.constexpr,
) -> list:
    """matmul_tma as teeny packs it: X (M, K) with rows x_stride apart (X_K_CONTIGUOUS) or stored
    transposed, (K, M); Y (K, N) with rows y_stride apart or stored transposed, (N, K); Z (M, N)
    with rows z_stride apart or (Z_TRANSPOSED) stored (N, M); aux_ptr (an activation's h) laid out
    as Z. Returns ``_matmul_tma``'s arguments: X, Y, Z and aux as TMA descriptors, made here on
    the host, as ``matmul_ws``'s are (made on the device, its five cost 3.5-6.5 us a launch on
    the H200: bench/NOTES.md, versions 19-20)."""
    x_desc = _descriptor(x_ptr, (M, K) if X_K_CONTIGUOUS else (K, M), x_stride,
                         (BLOCK_M, BLOCK_K) if X_K_CONTIGUOUS else (BLOCK_K, BLOCK_M))  # fmt: skip
    y_desc = _descriptor(y_ptr, (N, K) if Y_K_CONTIGUOUS else (K, N), y_stride,
                         (BLOCK_N, BLOCK_K) if Y_K_CONTIGUOUS else (BLOCK_K, BLOCK_N))  # fmt: skip
    store_m, store_n = (BLOCK_M // 2, BLOCK_N // 2) if SUBTILE else (BLOCK_M, BLOCK_N)
    if Z_TRANSPOSED:
        z_desc = _descriptor(z_ptr, (N, M), z_stride, (BLOCK_N, store_m))
    else:
        z_desc = _descriptor(z_ptr, (M, N), z_stride, (BLOCK_M, store_n))
    aux_desc = None if aux_ptr is None else _descriptor(aux_ptr, (M, N), z_stride, (BLOCK_M, store_n))
    return [
        x_desc, y_desc, z_desc, bias_ptr, row_sums_ptr, partial_ptr, partial_sums_ptr, aux_desc, M, N, K, programs,
        dp_tiles, act_a, act_b, X_K_CONTIGUOUS, Y_K_CONTIGUOUS, ACC, PRECISION, ROW_SUM_PRECISION, UPCAST, BLOCK_M,
        BLOCK_N, BLOCK_K, GROUP_M, SUBTILE, ACTIVATION, DERIVATIVE, Z_TRANSPOSED,
    ]  # fmt: skip


def _descriptor(t: torch.Tensor, shape: tuple[int, int], row_stride: int, block: tuple[int, int]) -> TensorDescriptor:
    """The TMA descriptor of the 2-D ``shape`` at ``t``'s start, rows ``row_stride`` apart, in boxes of ``block``."""
    return TensorDescriptor(t, list(shape), [row_stride, 1], list(block))


matmul_tma = Kernel(
    _matmul_tma,
    half=True,
    optional=("bias_ptr", "row_sums_ptr", "partial_ptr", "partial_sums_ptr", "aux_ptr"),
    arguments=_matmul_tma_descriptors,
    pdl=True,
    name="matmul_tma",
)


@kernel(half=True, optional=("bias_ptr", "row_sums_ptr", "partial_sums_ptr", "aux_ptr"), pdl=True)
@triton.jit(do_not_specialize=["programs", "dp_tiles"])
def matmul_sum_segments(
    partial_ptr,
    partial_sums_ptr,
    z_ptr,
    bias_ptr,
    row_sums_ptr,
    aux_ptr,
    M,
    N,
    K,
    z_stride,
    programs,
    dp_tiles,
    act_a,
    act_b,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SLOTS: tl.constexpr,
    CHUNK_M: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DERIVATIVE: tl.constexpr,
    Z_TRANSPOSED: tl.constexpr,
):
    """The second pass of ``matmul_tma``'s stream-K tiles: program (i, c) adds up the segments
    of stream-K tile i that several programs shared (rows c * CHUNK_M ... of it), SLOTS boxes
    loaded at once (one memory latency, not one per segment) and summed in a fixed order
    (bit-reproducible), adds the bias, applies the epilogue's activation and stores Z; for the
    first column tile, the row sums too.
    Tiles summed whole by one program were stored by ``matmul_tma`` and are left alone."""
    wait_for_previous()
    i = tl.program_id(0).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    sk_tiles = tiles_m * tiles_n - dp_tiles
    total = sk_tiles.to(tl.int64) * k_tiles
    first, last = _segment_owners(i, k_tiles, total, programs)
    if first < last:
        pid_m, pid_n = _grouped_tile((dp_tiles + i).to(tl.int32), tiles_m, tiles_n, GROUP_M)
        rows = tl.program_id(1) * CHUNK_M + tl.arange(0, CHUNK_M)
        cols = tl.arange(0, BLOCK_N)
        acc = tl.zeros((CHUNK_M, BLOCK_N), dtype=ACC)
        sums = tl.zeros((CHUNK_M,), dtype=ACC)
        for slot0 in range(0, last - first + 1, SLOTS):
            slots = slot0 + tl.arange(0, SLOTS)
            used = slots <= last - first
            boxes = (slots * sk_tiles + i) * BLOCK_M
            offsets = (boxes[:, None, None] + rows[None, :, None]) * BLOCK_N + cols[None, None, :]
            acc += tl.sum(tl.load(partial_ptr + offsets, mask=used[:, None, None], other=0.0), axis=0)
            if row_sums_ptr is not None:
                if pid_n == 0:
                    box_sums = tl.load(partial_sums_ptr + boxes[:, None] + rows[None, :], mask=used[:, None], other=0.0)
                    sums += tl.sum(box_sums, axis=0)
        offs_m = pid_m * BLOCK_M + rows
        offs_n = pid_n * BLOCK_N + cols
        if bias_ptr is not None:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(ACC)[None, :]
        acc = _activation_epilogue(
            acc, z_ptr, aux_ptr, offs_m, offs_n, M, N, z_stride, 1, act_a, act_b, ACTIVATION, DERIVATIVE
        )
        if Z_TRANSPOSED:
            z = z_ptr + offs_m[:, None] + offs_n.to(tl.int64)[None, :] * z_stride
        else:
            z = z_ptr + offs_m.to(tl.int64)[:, None] * z_stride + offs_n[None, :]
        tl.store(z, acc.to(z_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
        if row_sums_ptr is not None:
            if pid_n == 0:
                tl.store(row_sums_ptr + offs_m, sums.to(row_sums_ptr.dtype.element_ty), mask=offs_m < M)


@kernel(half=True)
@triton.jit
def matmul_copy(src_ptr, dst_ptr, rows, cols, src_stride, dst_stride, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr):
    """A product's copy of an operand or result, src (rows, cols) with rows src_stride apart and
    contiguous columns: TRANSPOSE, dst[c, r] = src[r, c] (an MN-major operand copied K-major);
    else dst[r, c] = src[r, c] (rows padded to 16 bytes for TMA, or a padded result copied
    back). dst's rows are dst_stride apart."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    tile = tl.load(src_ptr + r[:, None] * src_stride + c[None, :], mask=mask)
    if TRANSPOSE:
        tl.store(dst_ptr + c[:, None] * dst_stride + r[None, :], tl.trans(tile), mask=tl.trans(mask))
    else:
        tl.store(dst_ptr + r[:, None] * dst_stride + c[None, :], tile, mask=mask)


# matmul_product computes every product (the backward ones are products with swapped strides);
# its backward= lists what a backward launches besides it: the Hopper kernels, matmul_tma's K-major
# and padded copies, the sums of the bias gradient and of split-contraction partials, and the
# copies of the fused q/k/v product's weight gradients out of one matrix (SharedInputLinearOp).
@kernel(
    backward=(matmul_tma, matmul_ws, matmul_sum_segments, matmul_copy, strided_copy, sum_to_shape_kernel),
    half=True,
    optional=("bias_ptr", "aux_ptr"),
    pdl=True,
)
def matmul_product(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    aux_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    syk,
    syn,
    szm,
    szn,
    G1,
    G2,
    sxg0,
    sxg1,
    sxg2,
    syg0,
    syg1,
    syg2,
    szg0,
    szg1,
    szg2,
    R1,
    n_red,
    sxr0,
    sxr1,
    syr0,
    syr1,
    act_a,
    act_b,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DERIVATIVE: tl.constexpr,
):
    """Z[g] = sum_r X[g, r] @ Y[g, r] (+ bias): one BLOCK_M x BLOCK_N tile of one batch entry
    per program; g = (g0, g1, g2) over sizes (., G1, G2), r = (r0, r1) over (n_red / R1, R1).
    ACTIVATION / DERIVATIVE: an activation in the epilogue of a 2-D product (aux_ptr lies like Z)."""
    wait_for_previous()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    g = (pid // tiles).to(tl.int64)
    pid_m, pid_n = _grouped_tile(pid % tiles, tiles_m, tiles_n, GROUP_M)
    g2 = g % G2
    g1 = (g // G2) % G1
    g0 = g // G2 // G1
    x_base = x_ptr + g0 * sxg0 + g1 * sxg1 + g2 * sxg2
    y_base = y_ptr + g0 * syg0 + g1 * syg1 + g2 * syg2
    z_base = z_ptr + g0 * szg0 + g1 * szg1 + g2 * szg2

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for r in range(0, n_red):
        r0 = tl.cast(r // R1, tl.int64)
        r1 = tl.cast(r % R1, tl.int64)
        x_tile = x_base + r0 * sxr0 + r1 * sxr1 + offs_m[:, None] * sxm + offs_k[None, :] * sxk
        y_tile = y_base + r0 * syr0 + r1 * syr1 + offs_k[:, None] * syk + offs_n[None, :] * syn
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            xt = tl.load(x_tile, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            yt = tl.load(y_tile, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                yt = yt.to(tl.float32)
            acc = tl.dot(xt, yt, acc, input_precision=PRECISION, out_dtype=ACC)
            x_tile += BLOCK_K * sxk
            y_tile += BLOCK_K * syk
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(ACC)[None, :]
    acc = _activation_epilogue(
        acc, z_ptr, aux_ptr, offs_m, offs_n, M, N, szm, szn, act_a, act_b, ACTIVATION, DERIVATIVE
    )
    z_tile = z_base + offs_m[:, None] * szm + offs_n[None, :] * szn
    tl.store(z_tile, acc.to(z_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ------------------------------------------------------------------- product description

MAX_KEPT_DIMS = 3  # batch dims of the result, after collapsing
MAX_REDUCED_DIMS = 2  # broadcast batch dims summed inside a program, after collapsing
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned bases and row strides


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return strides[::-1]


@dataclass(frozen=True)
class TmaLayout:
    """How ``matmul_tma`` reads a 2-D product: which operand dim is contiguous, and the other
    stride of each operand (in elements)."""

    x_k_contiguous: bool
    y_k_contiguous: bool
    x_stride: int
    y_stride: int
    z_stride: int
    z_transposed: bool = False  # Z stored (N, M), its rows z_stride apart


@dataclass
class Product:
    """One product: Z[g] = sum_r X[g, r] @ Y[g, r] with every access through strides.
    ``kept``: (size, x, y, z strides) per batch dim of Z; ``reduced``: (size, x, y strides)."""

    M: int
    N: int
    K: int
    x: tuple[int, int]  # strides of X over (m, k)
    y: tuple[int, int]  # (k, n)
    z: tuple[int, int]  # (m, n)
    kept: list[tuple[int, int, int, int]]
    reduced: list[tuple[int, int, int]]

    @property
    def batch(self) -> int:
        return math.prod(d[0] for d in self.kept)

    def work(self) -> int:
        return self.batch * self.M * self.N

    @property
    def z_transposed(self) -> bool:
        """Whether Z is stored transposed, (N, M) (Conv1D's dW written into W's (in, out))."""
        return self.z[1] != 1

    def tma_layout(self, dtype: torch.dtype) -> TmaLayout | None:
        """The layout for ``matmul_tma``, or None where the product is batched, empty, or an
        operand (Z too: it may be stored transposed) has no unit stride or rows that are not
        16-byte aligned."""
        if self.kept or self.reduced or min(self.M, self.N, self.K) == 0:
            return None
        if 1 not in self.x or 1 not in self.y or 1 not in self.z:
            return None
        size = torch.empty((), dtype=dtype).element_size()
        rows = (_row_stride(self.x), _row_stride(self.y), _row_stride(self.z))
        if any((stride * size) % TMA_ALIGN for stride in rows):
            return None
        return TmaLayout(self.x[1] == 1, self.y[1] != 1, *rows, self.z_transposed)  # X is (m, k), Y (k, n)

    def paddable(self) -> bool:
        """Whether ``matmul_tma`` can compute the product, on copies of the operands (and a
        result) whose rows are not 16-byte aligned, padded: 2-D, not empty, a unit stride in
        each operand and a unit column stride in Z (a vocabulary of 50,257: ``product_launches``)."""
        if self.kept or self.reduced or min(self.M, self.N, self.K) == 0 or self.z_transposed:
            return False
        return 1 in self.x and 1 in self.y

    def key(self) -> dict:
        """What a tuned configuration depends on."""
        return {"M": self.M, "N": self.N, "K": self.K, "x": self.x, "y": self.y, "z": self.z,
                "kept": self.kept, "reduced": self.reduced}  # fmt: skip


def _row_stride(strides: tuple[int, int]) -> int:
    """The stride of an operand's (or Z's) other dim than its contiguous one (the second dim
    where both strides are 1): the stride of its rows as TMA reads or writes them."""
    return strides[0] if strides[1] == 1 else strides[1]


def _collapse(dims: list[tuple]) -> list[tuple]:
    """Drop size-1 dims and merge neighbours whose strides (every operand) nest."""
    out: list[tuple] = []
    for d in dims:
        if d[0] == 1:
            continue
        if out and all(po == do * d[0] for po, do in zip(out[-1][1:], d[1:])):
            prev = out.pop()
            d = (prev[0] * d[0],) + d[1:]
        out.append(d)
    return out


def _plan_product(M, N, K, x, y, z, batch: list[tuple[int, int, int, int]], where: str) -> Product:
    """``batch``: per broadcast batch dim, (size, x, y, z strides); a zero z stride on a dim of
    size > 1 makes it a reduced dim."""
    kept = _collapse([d for d in batch if d[3] != 0 or d[0] == 1])
    reduced = _collapse([d[:3] for d in batch if d[3] == 0 and d[0] != 1])
    if len(kept) > MAX_KEPT_DIMS or len(reduced) > MAX_REDUCED_DIMS:
        raise ValueError(
            f"{where}: this pattern of broadcast batch dims needs {len(kept)} batch and {len(reduced)} "
            f"summed dims; the kernel supports {MAX_KEPT_DIMS} and {MAX_REDUCED_DIMS} "
            "(reshape the operands to fewer batch dims)"
        )
    return Product(M, N, K, x, y, z, kept, reduced)


# ------------------------------------------------------------------- configurations

# A configuration is a dict: the kernel ("tma" or "strided"), its tile constexprs and Triton's
# num_warps / num_stages. "tma" ones add SUBTILE (the epilogue stores half tiles), STREAM_K
# (how many of the last waves of tiles are shared out stream-K; 0: none), OCCUPANCY (programs
# per multiprocessor: 2 lets one program's epilogue overlap the other's products) and K_MAJOR
# (float32: copy MN-major operands K-major first, see candidates); products that also sum X's
# rows add FUSED_SUMS (in the kernel, or a separate column sum); a float32 one may name
# PRECISION "ieee" (the FMA units: exact, and for a small product faster than tf32x3's three
# tensor-core products). Candidates per operand precision (what the tuning pass times); the
# first of each list is the default where nothing is timed.


def _cfg(bm, bn, bk, warps, stages, subtile=False, stream_k=0, occupancy=1, kind="tma", fma=False) -> dict:
    config = {"kernel": kind, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
              "num_warps": warps, "num_stages": stages}  # fmt: skip
    if kind in ("tma", "ws"):
        config.update(SUBTILE=subtile, STREAM_K=stream_k, OCCUPANCY=occupancy, K_MAJOR=False)
    if fma:  # float32 on the FMA units, exact: a small product's latency without tf32x3's splits
        config["PRECISION"] = IEEE
    return config


# H200 (bench/matmul_sweep.py, run 3): 128x256x64 w8s3 wins at 4096^3 (0.98x cuBLAS) and on
# long rows; 128x128 tiles on 768-wide outputs; 128x64 tiles on small ones.
_TMA_CANDIDATES = {
    "half": [
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 256, 64, 8, 4, subtile=True),
        _cfg(256, 128, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 4, 4),
        _cfg(128, 128, 128, 8, 3),
        _cfg(64, 256, 64, 4, 4),
        _cfg(128, 64, 64, 4, 5),
        # two programs per multiprocessor (at most half the shared memory each)
        _cfg(128, 128, 64, 4, 2, occupancy=2),
        _cfg(128, 128, 32, 4, 4, occupancy=2),
        _cfg(128, 128, 64, 4, 3, subtile=True, occupancy=2),
    ],
    TF32X3: [
        _cfg(128, 128, 32, 8, 3),
        _cfg(128, 256, 32, 8, 2, subtile=True),
        _cfg(128, 128, 32, 4, 4),
        _cfg(64, 128, 32, 4, 4),
        _cfg(128, 64, 32, 4, 4),
        _cfg(128, 128, 16, 8, 5),
    ],
    TF32: [
        _cfg(128, 256, 32, 8, 3, subtile=True),
        _cfg(128, 128, 32, 8, 4),
        _cfg(256, 128, 32, 8, 3, subtile=True),
        _cfg(128, 128, 64, 8, 2),
    ],
    IEEE: [  # float32 on FMA units: smaller tiles, no tensor cores
        _cfg(64, 64, 32, 4, 3),
        _cfg(128, 64, 32, 8, 3),
        _cfg(128, 128, 16, 8, 3),
    ],
    "float64": [  # DMMA
        _cfg(64, 64, 16, 4, 3),
        _cfg(64, 128, 16, 4, 3),
        _cfg(128, 64, 16, 8, 3),
        _cfg(128, 128, 16, 8, 2),
    ],
}
# how many of each list (the first) also get stream-K and K_MAJOR variants
_VARIANTS_OF = {"half": 11, TF32X3: 4, TF32: 2, IEEE: 2, "float64": 2}
# matmul_ws (linear_gluon): 128 x 192 tiles of two warpgroups, half precision, no activation
# epilogue, no fused row sums, Z not transposed. H200, 4,096-row GPT-2 layers (v19): 0.97-1.08x
# cuBLAS on forwards and dX where matmul_tma's tuned best was 0.69-0.95x.
_WS_CONFIG = _cfg(linear_gluon.BLOCK_M, linear_gluon.BLOCK_N, linear_gluon.BLOCK_K, 4, linear_gluon.PIPELINE_STAGES,
                  kind="ws")  # fmt: skip

# Small products (under TUNE_MIN_MACS: the small MLP's 128-row layers) are latency-bound: a
# few programs of big tiles leave the GPU idle. These small tiles (all with stream-K variants)
# are what bench/matmul_sweep.py --only mlp times for them; _small_default picks from them.
_SMALL_FMA = [_cfg(64, 64, 32, 4, 3, fma=True), _cfg(32, 64, 32, 4, 3, fma=True), _cfg(64, 32, 32, 4, 3, fma=True),
              _cfg(32, 32, 64, 4, 3, fma=True)]  # fmt: skip
_SMALL_TMA_CANDIDATES = {
    "half": [_cfg(64, 64, 64, 4, 3), _cfg(64, 128, 64, 4, 3), _cfg(64, 64, 128, 4, 2), _cfg(128, 64, 64, 4, 3)],
    TF32X3: [_cfg(64, 64, 32, 4, 3), _cfg(64, 32, 32, 4, 4), _cfg(64, 128, 32, 4, 3)] + _SMALL_FMA,
    TF32: [_cfg(64, 64, 32, 4, 3), _cfg(64, 32, 32, 4, 4)] + _SMALL_FMA,
}
_SMALL_STRIDED_FMA = [
    _cfg(bm, bn, bk, w, 3, kind="strided", fma=True)
    for bm, bn, bk, w in ((32, 32, 32, 4), (16, 64, 32, 4), (64, 16, 32, 4), (16, 16, 64, 2))
]
_SMALL_STRIDED_CANDIDATES = {
    "half": [_cfg(32, 32, 64, 4, 3, kind="strided"), _cfg(16, 64, 64, 4, 3, kind="strided"),
             _cfg(64, 16, 64, 4, 3, kind="strided"), _cfg(64, 64, 64, 4, 3, kind="strided")],
    TF32X3: [_cfg(32, 32, 32, 4, 3, kind="strided")] + _SMALL_STRIDED_FMA,
    TF32: [_cfg(32, 32, 32, 4, 3, kind="strided")] + _SMALL_STRIDED_FMA,
}  # fmt: skip

# What a multiprocessor offers a program (227 KiB on Hopper), less a margin for the barriers;
# two programs per multiprocessor share 228 KiB less 1 KiB reserved for each. The estimate
# below is an upper bound: bench/compile_check.py prints what each candidate takes (128x256x64
# bf16, 3 stages: 196 KiB against 208 estimated).
SHARED_MEMORY_BUDGET = 226 * 1024
SHARED_MEMORY_PER_PAIR = 112 * 1024


def _shared_bytes(config: dict, dtype: torch.dtype, row_sums: bool = False, epilogue: str | None = None) -> int:
    """Shared memory a TMA configuration needs: num_stages operand tiles, the epilogue's staging
    tile and the row sums' (K x 16) tile of ones (stream-K partials are stored from registers);
    with a derivative epilogue (``Epilogue.kind``), the box h is loaded into. (An activation
    epilogue's store of h reuses Z's staging tile: sm_90 compiles of every candidate, with
    ``bench/compile_check.py --match gelu``, take exactly these sizes.)"""
    size = torch.empty((), dtype=dtype).element_size()
    operands = config["num_stages"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * size
    store_n = config["BLOCK_N"] // 2 if config["SUBTILE"] else config["BLOCK_N"]
    ones = config["BLOCK_K"] * ROW_SUM_COLUMNS.value * size if row_sums and config.get("FUSED_SUMS", True) else 0
    aux = config["BLOCK_M"] * store_n * size if epilogue == "derivative" else 0
    return operands + config["BLOCK_M"] * store_n * size + ones + aux


def _fits(config: dict, dtype: torch.dtype, row_sums: bool = False, epilogue: str | None = None) -> bool:
    budget = SHARED_MEMORY_BUDGET if config["OCCUPANCY"] == 1 else SHARED_MEMORY_PER_PAIR
    return _shared_bytes(config, dtype, row_sums, epilogue) <= budget


# H200, bf16 4096^3 forward+backward (bench/tune_launch.py, version 1): 8 warps and 4 stages for
# 128x128x32 half tiles, 0.93 ms against 1.12 ms for Triton's default 4 warps / 3 stages.
_STRIDED_CANDIDATES = {
    "half": [_cfg(128, 128, 32, 8, 4, kind="strided"), _cfg(128, 128, 64, 8, 3, kind="strided"),
             _cfg(64, 128, 32, 4, 4, kind="strided")],
    TF32X3: [_cfg(128, 128, 32, 8, 3, kind="strided"), _cfg(64, 64, 32, 4, 3, kind="strided")],
    TF32: [_cfg(128, 128, 32, 8, 3, kind="strided"), _cfg(64, 128, 32, 4, 4, kind="strided")],
    IEEE: [_cfg(64, 64, 32, 4, 3, kind="strided"), _cfg(128, 64, 32, 8, 3, kind="strided")],
    "float64": [_cfg(64, 64, 16, 4, 3, kind="strided"), _cfg(64, 128, 16, 4, 3, kind="strided")],
}  # fmt: skip

# the interpreter pays per program instance, not per element: few, wide ones
_INTERPRETER_CONFIG = _cfg(256, 256, 64, 4, 2, kind="strided")

STREAM_K_MIN_K_TILES = 4  # a stream-K program takes at least this many K tiles
STREAM_K_MAX_WAVES = 4  # beyond this many waves of tiles an idle last wave costs little: no stream-K
STREAM_K_FULL_WAVE = 0.8  # a last wave this full (of the multiprocessors) leaves little to share out
SEGMENT_SUM_ELEMENTS = 8192  # partial elements a program of matmul_sum_segments loads at once
SEGMENT_SUM_MAX_SLOTS = 16  # segments it loads at once
COPY_BLOCK = 64  # tile edge of matmul_copy
TUNE_MIN_MACS = 2**30  # smaller products (a few microseconds) take the heuristic without timing
PADDED_CANDIDATES = 4  # matmul_tma configurations timed on padded copies (each first compile takes seconds)


def _macs(p: Product) -> int:
    return p.work() * p.K * math.prod(d[0] for d in p.reduced)


def _small(p: Product) -> bool:
    """Whether ``p`` is small enough to take the heuristic without timing (see TUNE_MIN_MACS)."""
    return _macs(p) < TUNE_MIN_MACS


def _precision_class(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    if dtype == torch.float64:
        return "float64"
    return precision


@dataclass(frozen=True)
class Schedule:
    """How ``matmul_tma``'s ``programs`` share out a product: tiles 0 .. dp_tiles - 1 whole, the
    ``sk_tiles`` after them stream-K, a shared tile's segments in up to ``slots`` partial boxes
    (slots 1: no tile is shared, no second pass)."""

    programs: int
    dp_tiles: int
    sk_tiles: int
    slots: int


def schedule(p: Product, config: dict) -> Schedule:
    """The schedule of ``p`` under a TMA ``config``: STREAM_K = w shares out the tiles of the last
    w waves (a wave: one tile per program), where each program gets enough K tiles. A product of
    fewer tiles than multiprocessors is all stream-K, on as many programs as get that many K tiles
    each (a 128x784 by 784x256 product: 2 tiles of 25 K tiles on 12 programs, not 2)."""
    tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
    k_tiles = cdiv(p.K, config["BLOCK_K"])
    full = config["OCCUPANCY"] * tuning.multiprocessors()
    whole = Schedule(min(tiles, full), tiles, 0, 1)
    if not config["STREAM_K"]:
        return whole
    dp_tiles = max(0, cdiv(tiles, full) - config["STREAM_K"]) * full
    sk_tiles = tiles - dp_tiles
    total = sk_tiles * k_tiles
    programs = full
    if total < full * STREAM_K_MIN_K_TILES:  # too few K tiles for every program to get enough
        programs = 0 if dp_tiles else total // STREAM_K_MIN_K_TILES  # (whole tiles go round all)
        if programs <= sk_tiles:
            return whole
    # the owners of tile i, as _segment_owners computes them in the kernels
    slots = max(((i + 1) * k_tiles * programs - 1) // total - ((i * k_tiles + 1) * programs - 1) // total + 1
                for i in range(sk_tiles))  # fmt: skip
    return whole if slots == 1 else Schedule(programs, dp_tiles, sk_tiles, slots)


def _stream_k_useful(p: Product, config: dict, waves: int) -> bool:
    """Whether STREAM_K = waves changes ``config``'s schedule for ``p`` in a way worth timing:
    the whole tiles would leave a last wave under STREAM_K_FULL_WAVE full, within a few waves."""
    plain = schedule(p, config)
    tiles = plain.dp_tiles
    full = config["OCCUPANCY"] * tuning.multiprocessors()
    last_wave = tiles - (cdiv(tiles, full) - 1) * full
    if cdiv(tiles, full) > STREAM_K_MAX_WAVES or last_wave >= STREAM_K_FULL_WAVE * full:
        return False
    shared = schedule(p, {**config, "STREAM_K": waves})
    return shared != plain and (waves == 1 or shared != schedule(p, {**config, "STREAM_K": waves - 1}))


def _k_major_useful(p: Product) -> bool:
    """float32 tensor cores (tf32, tf32x3) read both operands K-major only: an MN-major operand
    tile is transposed through shared memory in every program that reads it (H200, 4096^3
    tf32x3: 0.81x cuBLAS with one such operand, 0.72x with two, 1.74x with none), so a K-major
    copy made once (one pass over the operand, its rows padded to 16 bytes) is worth timing."""
    return not (p.x[1] == 1 and p.y[1] != 1)


def candidates(
    p: Product, dtype: torch.dtype, precision: str, has_bias: bool, row_sums: bool = False, epilogue: str | None = None
) -> list[dict]:
    """The configurations the tuning pass times for ``p`` (the first is the heuristic's pick);
    ``row_sums``: the product also sums X's rows (linear's bias gradient); ``epilogue``: it
    applies an activation (``Epilogue.kind``). A configuration the epilogue's aux box leaves
    without room is tried with half-tile stores (SUBTILE), which halve that box."""
    if INTERPRETER:
        return [_INTERPRETER_CONFIG]
    cls = _precision_class(dtype, precision)
    small = _small(p)
    strided = list(_STRIDED_CANDIDATES[cls]) + (_SMALL_STRIDED_CANDIDATES.get(cls, []) if small else [])
    aligned = p.tma_layout(dtype) is not None
    # rows not 16-byte aligned (a vocabulary of 50,257): matmul_tma on padded copies, for a
    # product big enough to pay for them, timed against the strided kernel
    if not tuning.has_tma() or not (aligned or (p.paddable() and not small and epilogue is None)):
        return strided
    out = []
    options = _TMA_CANDIDATES[cls] + (_SMALL_TMA_CANDIDATES.get(cls, []) if small else [])
    for index, option in enumerate(options):
        variants = [option]
        if index < _VARIANTS_OF[cls] or index >= len(_TMA_CANDIDATES[cls]):
            variants += [{**option, "STREAM_K": w} for w in (1, 2) if _stream_k_useful(p, option, w)]
            if cls in (TF32X3, TF32) and "PRECISION" not in option and _k_major_useful(p):
                variants += [{**v, "K_MAJOR": True} for v in variants]
        for v in variants:
            if epilogue and not v["SUBTILE"] and not _fits(v, dtype, epilogue=epilogue):
                v = {**v, "SUBTILE": True}
            # half tiles stored transposed go through a layout conversion in shared memory
            # (sm_90, 128x256x64 in 4 stages: 288 KiB): a transposed Z takes whole-tile stores
            if v["SUBTILE"] and p.z_transposed:
                continue
            if _fits(v, dtype, epilogue=epilogue) and v not in out:
                out.append(v)
    if row_sums:  # fused into the kernel, or (a few) the separate column sum, to compare
        fused = [{**c, "FUSED_SUMS": True} for c in out if _fits(c, dtype, row_sums=True)]
        out = fused + [{**c, "FUSED_SUMS": False} for c in out[:3]]
    if cls == "half" and aligned and epilogue is None and not p.z_transposed:
        out.append({**_WS_CONFIG, "FUSED_SUMS": False} if row_sums else dict(_WS_CONFIG))
    return out if aligned else out[:PADDED_CANDIDATES] + strided


SMALL_STREAM_K_MIN_K_TILES = 16  # a small product's tiles are shared out stream-K from this many K tiles
# _small_default's reach: products of up to ~2.6x the MACs of the largest swept (128 x 784 x 256);
# bigger ones (a 4096-token layer of 256 features: 2^28) are not latency-bound the same way
SMALL_DEFAULT_MAX_MACS = 2**26


def _small_default(p: Product, dtype: torch.dtype, precision: str, epilogue: str | None) -> dict | None:
    """The pick for a small product, from the H200 sweep of the small MLP's layers (128 rows;
    bench/NOTES.md, version 9), where it is 2-4x faster than the big-tile default:

    * half: 64x64 tiles, K in one or two 128-wide steps (64 wide past K = 256);
    * float32 with both operands K-major (a forward): 64x32 tf32x3 tiles; with an MN-major operand
      (dX, dW), which float32 tensor cores would transpose through shared memory: 32x64 tiles on
      the FMA units (exact);
    * the strided kernel (rows not 16-byte aligned: a 10-wide output): 32x32x64 half tiles,
      16x16x64 float32 ones on the FMA units;
    * tiles shared out stream-K from SMALL_STREAM_K_MIN_K_TILES K tiles each (K = 784: yes; 256: no).

    None for float64 (the general rule)."""
    cls = _precision_class(dtype, precision)
    if cls == "float64":
        return None
    layout = p.tma_layout(dtype) if tuning.has_tma() else None
    if layout is None:
        if cls == "half":
            return _cfg(32, 32, 64, 4, 3, kind="strided")
        return _cfg(16, 16, 64, 2, 3, kind="strided", fma=True)
    if cls == "half":
        config = _cfg(64, 64, 128, 4, 2) if p.K <= 256 else _cfg(64, 64, 64, 4, 3)
    elif layout.x_k_contiguous and layout.y_k_contiguous:
        config = _cfg(64, 32, 32, 4, 4)
    else:
        config = _cfg(32, 64, 32, 4, 3, fma=True)
    if cdiv(p.K, config["BLOCK_K"]) >= SMALL_STREAM_K_MIN_K_TILES and _stream_k_useful(p, config, 1):
        config["STREAM_K"] = 1
    if epilogue and not _fits(config, dtype, epilogue=epilogue):
        config["SUBTILE"] = True
    return config


def default_config(
    p: Product, dtype: torch.dtype, precision: str, has_bias: bool, row_sums: bool = False, epilogue: str | None = None
) -> dict:
    """The heuristic: for a small product (under SMALL_DEFAULT_MAX_MACS) ``_small_default``; else
    the first candidate, unless the output has fewer of its tiles than the GPU has
    multiprocessors: then, for a product the tuning pass would time (TUNE_MIN_MACS), the first
    half-size whole-tile candidate (its tiles twice as many), or below that size the first
    stream-K variant. (H200, v17: at 4,096 rows of GPT-2's layers stream-K took 1.5-3.5x the
    best whole tiles; this pick, 128x128x64 w8s4, took 1.0-1.35x the tuned best.)"""
    if not INTERPRETER and _macs(p) < SMALL_DEFAULT_MAX_MACS:
        config = _small_default(p, dtype, precision, epilogue)
        if config is not None:
            return {**config, "FUSED_SUMS": True} if row_sums and config["kernel"] == "tma" else config
    options = candidates(p, dtype, precision, has_bias, row_sums, epilogue)
    config = options[0]
    if config["kernel"] == "tma" and schedule(p, config).dp_tiles < tuning.multiprocessors():
        area = config["BLOCK_M"] * config["BLOCK_N"] // 2
        tma = [c for c in options if c["kernel"] == "tma" and c["OCCUPANCY"] == 1 and c.get("FUSED_SUMS", True)]
        if _small(p):
            picks = [c for c in tma if c["STREAM_K"]]
        else:
            picks = [c for c in tma if c["BLOCK_M"] * c["BLOCK_N"] == area and not c["STREAM_K"]]
        if picks:
            config = picks[0]
    return config


# ------------------------------------------------------------------- launches


@dataclass(frozen=True)
class Epilogue:
    """An element-wise activation in a product's epilogue (``MLPOp``): ``activation`` is an
    ``activation.ActivationOp`` (its ``fn``, ``grad``, ``a``, ``b``). Forwards, Z = fn(h) of
    h = the product (+ bias), h also written to ``aux`` when given; with ``derivative``, Z =
    grad(h, the product), the gradient through the activation, h read from ``aux``. ``aux``
    lies like Z."""

    activation: Any
    aux: torch.Tensor | None
    derivative: bool = False

    @property
    def kind(self) -> str:
        """What the epilogue does with h: "activation" (stores it) or "derivative" (loads it)."""
        return "derivative" if self.derivative else "activation"

    def args(self) -> dict:
        op = self.activation
        return dict(
            aux_ptr=self.aux,
            act_a=op.a,
            act_b=op.b,
            ACTIVATION=None if self.derivative else op.fn,
            DERIVATIVE=op.grad if self.derivative else None,
        )


NO_EPILOGUE_ARGS = dict(aux_ptr=None, act_a=0.0, act_b=0.0, ACTIVATION=None, DERIVATIVE=None)


def _epilogue_args(epilogue: Epilogue | None, p: Product, z: torch.Tensor) -> dict:
    if epilogue is None:
        return NO_EPILOGUE_ARGS
    if p.kept or p.reduced or p.z_transposed or (epilogue.aux is not None and epilogue.aux.stride() != z.stride()):
        raise ValueError(
            f"an activation epilogue needs a 2-D product, Z's rows contiguous and an aux tensor laid out like Z ({p})"
        )
    return epilogue.args()


def _product_args(p: Product, x, y, z, bias, dtype: torch.dtype, precision: str, config: dict) -> ArgVisitor:
    kept = list(p.kept) + [(1, 0, 0, 0)] * (MAX_KEPT_DIMS - len(p.kept))
    reduced = list(p.reduced) + [(1, 0, 0)] * (MAX_REDUCED_DIMS - len(p.reduced))
    v = ArgVisitor().visit(x_ptr=x, y_ptr=y, z_ptr=z, bias_ptr=bias, M=p.M, N=p.N, K=p.K)
    v.visit(sxm=p.x[0], sxk=p.x[1], syk=p.y[0], syn=p.y[1], szm=p.z[0], szn=p.z[1])
    v.visit(G1=kept[1][0], G2=kept[2][0], R1=reduced[1][0], n_red=math.prod(d[0] for d in reduced))
    for operand, name in ((1, "x"), (2, "y"), (3, "z")):
        v.visit(**{f"s{name}g{i}": d[operand] for i, d in enumerate(kept)})
    for operand, name in ((1, "x"), (2, "y")):
        v.visit(**{f"s{name}r{i}": d[operand] for i, d in enumerate(reduced)})
    return v.visit(ACC=tl_acc_dtype(dtype), PRECISION=precision, UPCAST=dtype == torch.bfloat16 and DOT_UPCAST_BF16)


def _tiles(config: dict) -> dict:
    return {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}


class _ScratchContext:
    """What ``sum_to_shape`` uses of an OpContext: somewhere to put its partials."""

    def __init__(self, scratch: Callable[[tuple, torch.dtype], torch.Tensor]):
        self._scratch = scratch

    def empty(self, shape, dtype=None) -> torch.Tensor:
        return self._scratch(tuple(shape), dtype)


def _copy_launch(src, dst, rows: int, cols: int, src_stride: int, dst_stride: int, transpose: bool) -> Launch:
    """``matmul_copy`` of src (rows, cols), rows src_stride apart, into dst (see the kernel)."""
    args = ArgVisitor().visit(src_ptr=src, dst_ptr=dst, rows=rows, cols=cols, src_stride=src_stride,
                              dst_stride=dst_stride, TRANSPOSE=transpose, BLOCK=COPY_BLOCK)  # fmt: skip
    grid = (cdiv(rows, COPY_BLOCK), cdiv(cols, COPY_BLOCK))
    return Launch(matmul_copy, grid, args, Block(num_warps=4), work=rows * cols)


def _padded(n: int, size: int) -> int:
    """``n`` elements of ``size`` bytes rounded up to a multiple of 16 bytes (TMA's row alignment)."""
    per = TMA_ALIGN // math.gcd(TMA_ALIGN, size)
    return cdiv(n, per) * per


def _tma_operands(p: Product, x, y, z, size: int, k_major: bool, scratch, epilogue: bool):
    """What ``matmul_tma`` reads and writes for ``p``: each operand as it lies, or a K-major copy
    of it with 16-byte aligned rows, where its rows are not aligned or where ``k_major`` asks for
    one and it lies MN-major; Z, or a result with aligned rows that is copied into Z after.
    Returns (launches before, X, Y, Z to use, their TmaLayout, launches after)."""
    before: list[Launch] = []
    k_rows = _padded(p.K, size)

    def k_major_copy(t, sizes_strides, k_contiguous: bool, rows: int) -> torch.Tensor:
        """``t`` viewed as (rows, K) (``sizes_strides`` of X's (m, k) or Y's (n, k)) in a copy with
        rows k_rows apart."""
        (_, s_rows), (_, s_k) = sizes_strides
        dst = scratch((rows, k_rows), t.dtype)
        if k_contiguous:  # rows not aligned: the same layout, padded
            before.append(_copy_launch(t, dst, rows, p.K, s_rows, k_rows, transpose=False))
        else:
            before.append(_copy_launch(t, dst, p.K, rows, s_k, k_rows, transpose=True))
        return dst

    x_k, y_k = p.x[1] == 1, p.y[1] != 1  # X is (m, k), Y (k, n)
    x_row, y_row = _row_stride(p.x), _row_stride(p.y)
    if (x_row * size) % TMA_ALIGN or (k_major and not x_k):
        x, x_k, x_row = k_major_copy(x, [(p.M, p.x[0]), (p.K, p.x[1])], x_k, p.M), True, k_rows
    if (y_row * size) % TMA_ALIGN or (k_major and not y_k):
        y, y_k, y_row = k_major_copy(y, [(p.N, p.y[1]), (p.K, p.y[0])], y_k, p.N), True, k_rows
    after: list[Launch] = []
    z_row = _row_stride(p.z)
    if (z_row * size) % TMA_ALIGN:  # (a transposed Z is aligned: product_launches refuses it otherwise)
        if epilogue:
            raise ValueError(f"an activation epilogue needs Z's rows 16-byte aligned ({p})")
        z_row = _padded(p.N, size)
        padded = scratch((p.M, z_row), z.dtype)
        after.append(_copy_launch(padded, z, p.M, p.N, z_row, p.z[0], transpose=False))
        z = padded
    return before, x, y, z, TmaLayout(x_k, y_k, x_row, y_row, z_row, p.z_transposed), after


def _tma_launches(p: Product, x, y, z, bias, row_sums, layout: TmaLayout, dtype, precision, config, scratch, epilogue):
    """matmul_tma's launch for ``config`` (and matmul_sum_segments' where tiles are shared)."""
    sched = schedule(p, config)
    shared = sched.slots > 1
    box_rows = sched.slots * sched.sk_tiles * config["BLOCK_M"]
    partials = scratch((box_rows, config["BLOCK_N"]), acc_dtype(dtype)) if shared else None
    partial_sums = scratch((box_rows,), acc_dtype(dtype)) if shared and row_sums is not None else None
    args = ArgVisitor().visit(
        x_ptr=x,
        y_ptr=y,
        z_ptr=z,
        bias_ptr=bias,
        row_sums_ptr=row_sums,
        partial_ptr=partials,
        partial_sums_ptr=partial_sums,
        M=p.M,
        N=p.N,
        K=p.K,
        x_stride=layout.x_stride,
        y_stride=layout.y_stride,
        z_stride=layout.z_stride,
        programs=sched.programs,
        dp_tiles=sched.dp_tiles,
        X_K_CONTIGUOUS=layout.x_k_contiguous,
        Y_K_CONTIGUOUS=layout.y_k_contiguous,
        ACC=tl_acc_dtype(dtype),
        PRECISION=precision,
        # float32 row sums at float32 accuracy even where the product is plain tf32
        ROW_SUM_PRECISION=TF32X3 if precision == TF32 and dtype == torch.float32 else precision,
        UPCAST=dtype == torch.bfloat16 and DOT_UPCAST_BF16,
        SUBTILE=config["SUBTILE"],
        **_tiles(config),
        **epilogue,
        Z_TRANSPOSED=layout.z_transposed,
    )
    block = Block(num_warps=config["num_warps"], num_stages=config["num_stages"])
    launches = [Launch(matmul_tma, (sched.programs,), args, block, work=p.work())]
    if shared:
        slots = min(pow2(sched.slots), SEGMENT_SUM_MAX_SLOTS)
        chunk = min(config["BLOCK_M"], max(1, SEGMENT_SUM_ELEMENTS // (slots * config["BLOCK_N"])))
        sums = ArgVisitor().visit(
            partial_ptr=partials, partial_sums_ptr=partial_sums, z_ptr=z, bias_ptr=bias, row_sums_ptr=row_sums,
            M=p.M, N=p.N, K=p.K, z_stride=layout.z_stride, programs=sched.programs, dp_tiles=sched.dp_tiles,
            ACC=tl_acc_dtype(dtype), SLOTS=slots, CHUNK_M=chunk, **_tiles(config), **epilogue,
            Z_TRANSPOSED=layout.z_transposed,
        )  # fmt: skip
        grid = (sched.sk_tiles, config["BLOCK_M"] // chunk)
        launches.append(Launch(matmul_sum_segments, grid, sums, Block(num_warps=4), work=p.work()))
    return launches


def _ws_launch(p: Product, x, y, z, bias, dtype: torch.dtype, config: dict) -> Launch:
    """matmul_ws's launch: one persistent program per multiprocessor (or per tile, if fewer)."""
    layout = p.tma_layout(dtype)
    if dtype not in (torch.float16, torch.bfloat16) or z.dtype != dtype or layout is None or layout.z_transposed:
        raise ValueError(
            f"matmul_ws computes half-precision 2-D products into Z of their dtype with 16-byte aligned rows, "
            f"Z not transposed: not {dtype} into {z.dtype} ({p})"
        )
    args = ArgVisitor().visit(
        x_ptr=x, y_ptr=y, z_ptr=z, bias_ptr=bias, M=p.M, N=p.N, K=p.K, x_stride=layout.x_stride,
        y_stride=layout.y_stride, z_stride=layout.z_stride, X_K_CONTIGUOUS=layout.x_k_contiguous,
        Y_K_CONTIGUOUS=layout.y_k_contiguous, STAGES=config["num_stages"],
    )  # fmt: skip
    tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
    grid = (min(tiles, tuning.multiprocessors()),)
    return Launch(matmul_ws, grid, args, Block(num_warps=config["num_warps"]), work=p.work())


def product_launches(
    p: Product,
    x: torch.Tensor,
    y: torch.Tensor,
    z: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    precision: str,
    config: dict,
    scratch: Callable[[tuple, torch.dtype], torch.Tensor],
    row_sums: torch.Tensor | None = None,
    epilogue: Epilogue | None = None,
) -> list[Launch]:
    """The launches computing ``p`` into ``z`` with ``config`` (``scratch(shape, dtype)``
    allocates the partials of stream-K tiles and K-major copies); ``row_sums``: also the sums
    of X's rows over the contraction (X must then be stored transposed and contiguous, (K, M),
    as linear's dY is), in the kernel or by ``sum_to_shape``; ``epilogue``: an activation
    applied before the store (see ``Epilogue``)."""
    precision = config.get("PRECISION", precision)
    tma = config["kernel"] == "tma"
    if tma and not p.paddable() and p.tma_layout(dtype) is None:
        raise ValueError(f"matmul_tma cannot read this product ({p}): use a strided configuration")
    fused = row_sums is not None and tma and config.get("FUSED_SUMS", True)
    epilogue_args = _epilogue_args(epilogue, p, z)
    if config["kernel"] == "ws":
        if epilogue is not None:
            raise ValueError(f"matmul_ws has no activation epilogue ({p})")
        launches = [_ws_launch(p, x, y, z, bias, dtype, config)]
    elif not tma:
        args = _product_args(p, x, y, z, bias, dtype, precision, config).visit(**_tiles(config), **epilogue_args)
        grid = (p.batch * cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"]),)
        block = Block(num_warps=config["num_warps"], num_stages=config["num_stages"])
        launches = [Launch(matmul_product, grid, args, block, work=p.work())]
    else:
        launches, xk, yk, zk, layout, after = _tma_operands(
            p, x, y, z, z.element_size(), config["K_MAJOR"], scratch, epilogue is not None
        )
        launches += _tma_launches(p, xk, yk, zk, bias, row_sums if fused else None, layout, dtype, precision, config,
                                  scratch, epilogue_args)  # fmt: skip
        launches += after
    if row_sums is not None and not fused:
        if p.x[0] != 1:
            raise ValueError(f"the row sums of X need X stored transposed, (K, M) with unit column stride, not {p.x}")
        launches += sum_to_shape(_ScratchContext(scratch), x, (p.K, p.M), row_sums, strides=(p.x[1], 1))
    return launches


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % TMA_ALIGN == 0 for t in tensors)


def _extent(sizes_strides) -> int:
    """Elements a strided operand spans: 1 + sum (size - 1) * stride."""
    return 1 + sum((s - 1) * abs(st) for s, st in sizes_strides if s > 0)


def _bench_for(p: Product, dtype, precision: str, has_bias: bool, row_sums: bool, epilogue, where: str):
    """A timing function for tuning: runs ``p``'s launches with a configuration on random data
    (allocated at the first call, so that a cached choice allocates nothing), with ``epilogue``'s
    activation where it is not None."""
    buffers: list = []

    def operands():
        if not buffers:
            batch = p.kept + p.reduced
            x = torch.randn(_extent([(p.M, p.x[0]), (p.K, p.x[1])] + [(d[0], d[1]) for d in batch]), device=DEVICE)
            y = torch.randn(_extent([(p.K, p.y[0]), (p.N, p.y[1])] + [(d[0], d[2]) for d in batch]), device=DEVICE)
            z = torch.empty(_extent([(p.M, p.z[0]), (p.N, p.z[1])] + [(d[0], d[3]) for d in p.kept]), device=DEVICE)
            bias = torch.randn(p.N, device=DEVICE) if has_bias else None
            sums = torch.empty(p.M, device=DEVICE) if row_sums else None
            aux = torch.randn_like(z) if epilogue is not None else None
            buffers.extend(t if t is None else t.to(dtype) for t in (x, y, z, bias, sums, aux))
        return buffers

    def bench(config: dict) -> float:
        x, y, z, bias, sums, aux = operands()
        scratch = lambda shape, dt: torch.empty(shape, device=DEVICE, dtype=dt)  # noqa: E731
        timed = None if epilogue is None else Epilogue(epilogue.activation, aux, epilogue.derivative)
        launches = product_launches(p, x, y, z, bias, dtype, precision, config, scratch, sums, timed)

        def run():
            for launch in launches:
                run_launch(launch, launch.kernel.instance(dtype), where, p.work())

        return tuning.time_ms(run)

    return bench


def choose_config(
    p: Product,
    dtype: torch.dtype,
    precision: str,
    has_bias: bool,
    row_sums: bool = False,
    observe: Callable[[dict, float | None], None] | None = None,
    epilogue: Epilogue | None = None,
    time_small: bool = False,
) -> dict:
    """The configuration of product ``p``: tuned on the GPU (or cached), else the heuristic.
    ``row_sums``: the product also sums X's rows; ``epilogue``: it applies that activation.
    ``observe(config, ms)`` sees every timing (``None``: the candidate failed); ``time_small``:
    a small product is timed too (how bench/matmul_sweep.py finds SMALL_DEFAULTS)."""
    kind = None if epilogue is None else epilogue.kind
    options = candidates(p, dtype, precision, has_bias, row_sums, kind)
    default = default_config(p, dtype, precision, has_bias, row_sums, kind)
    key = {**p.key(), "dtype": str(dtype).replace("torch.", ""), "precision": precision, "bias": has_bias}
    if row_sums:
        key["row_sums"] = True
    if kind is not None:
        key["epilogue"] = kind
    kernel_name = matmul_tma.name if default["kernel"] == "tma" else matmul_product.name
    if _small(p) and not time_small:
        return default  # a few microseconds at most: not worth timing
    bench = _bench_for(p, dtype, precision, has_bias, row_sums, epilogue, f"tuning {kernel_name} {key}")
    if observe is not None:
        timed = bench

        def bench(config: dict) -> float:
            try:
                ms = timed(config)
            except Exception:
                observe(config, None)
                raise
            observe(config, ms)
            return ms

    return tuning.choose(kernel_name, key, options, default, bench)


class _ProductOp(RuntimeOp):
    """Shared launch code of matmul and linear: each product's configuration is chosen (tuned)
    during lowering's dry run and reused by every run of the program."""

    kernel = matmul_product

    def __init__(self):
        self.allow_tf32 = teeny_config.allow_tf32  # read at trace time
        self.configs: dict[str, dict] = {}

    def precision(self, dtype: torch.dtype) -> str:
        return dot_precision(dtype, self.allow_tf32)

    def product(
        self, ctx: OpContext, name: str, p: Product, x, y, z, bias=None, row_sums=None, epilogue=None
    ) -> list[Launch]:
        """The launches of one product (``name`` tells the op's products apart); ``row_sums``:
        also X's row sums, ``epilogue``: an activation (see ``product_launches``)."""
        precision = self.precision(ctx.dtype)
        config = self.configs.get(name)
        if config is None or ctx.dry_run:
            config = self.configs[name] = choose_config(
                p, ctx.dtype, precision, bias is not None, row_sums is not None, epilogue=epilogue
            )
        if config["kernel"] in ("tma", "ws") and not ctx.dry_run and not _aligned(x, y, z):
            # the executor keeps parameters and inputs 16-byte aligned, and fresh buffers are: the plan holds
            raise TeenyError(f"{ctx.where}: a TMA product's operand is not 16-byte aligned ({p})")
        return product_launches(
            p, x, y, z, bias, ctx.dtype, precision, config, lambda s, d: ctx.empty(s, d), row_sums, epilogue
        )


# ------------------------------------------------------------------------------- matmul


def _promote(a_shape, b_shape):
    """torch.matmul's 1-D promotion: (K,) @ ... -> (1, K); ... @ (K,) -> (K, 1)."""
    a = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    return a, b


def _product_flops(batch: int, m: int, n: int, k: int, backward_products: int) -> tuple[int, int]:
    """(forward, backward) flops of Z = X @ Y (batch of m x k by k x n) whose backward launches
    ``backward_products`` products of the same size (dX, dW: one each wanted)."""
    one = 2 * batch * m * n * k
    return one, one * backward_products


class MatmulOp(_ProductOp):
    """torch.matmul for any ranks >= 1, batch dims broadcast."""

    name = "matmul"
    n_activation_inputs = 2
    saves_inputs = True

    def check_inputs(self, input_shapes, input_dtypes):
        a_shape, b_shape = input_shapes
        for which, shape, dt in (("first", a_shape, input_dtypes[0]), ("second", b_shape, input_dtypes[1])):
            if len(shape) == 0:
                raise ValueError(f"matmul: both arguments need at least 1 dimension, but the {which} is 0-d")
            if not dt.is_floating_point:
                raise TypeError(f"matmul: expects floating point tensors, the {which} is {dt}")
        a, b = _promote(a_shape, b_shape)
        if a[-1] != b[-2]:
            raise ValueError(
                f"matmul: shapes {tuple(a_shape)} and {tuple(b_shape)} cannot be multiplied "
                f"(inner dims {a[-1]} and {b[-2]} differ)"
            )
        try:
            torch.broadcast_shapes(a[:-2], b[:-2])
        except RuntimeError:
            raise ValueError(
                f"matmul: batch dims of {tuple(a_shape)} and {tuple(b_shape)} do not broadcast ({a[:-2]} vs {b[:-2]})"
            ) from None
        for plan in self._plans(a_shape, b_shape).values():
            plan()  # raises for unsupported broadcasting patterns

    def flops(self, input_shapes, grad_mask):
        a, b = _promote(*input_shapes)
        batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
        return _product_flops(batch, a[-2], b[-1], a[-1], sum(map(bool, grad_mask[:2])))

    def output_shape(self, input_shapes):
        a_shape, b_shape = input_shapes
        a, b = _promote(a_shape, b_shape)
        out = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        if len(a_shape) > 1:
            out += (a[-2],)
        if len(b_shape) > 1:
            out += (b[-1],)
        return out

    def _plans(self, a_shape, b_shape):
        """The three products (forward, dA, dB) for these shapes, as lazy builders."""
        a, b = _promote(a_shape, b_shape)
        M, K, N = a[-2], a[-1], b[-1]
        if len(b) == 2 and len(a) > 2:  # (..., M, K) @ (K, N): fold the batch into the rows
            M, a = math.prod(a[:-1]), (math.prod(a[:-1]), K)
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        n = len(batch)
        sa, sb = _contiguous_strides(a), _contiguous_strides(b)
        sc = _contiguous_strides(batch + (M, N))

        def batch_strides(shape, strides):
            shape, strides = (1,) * (n + 2 - len(shape)) + tuple(shape), [0] * (n + 2 - len(shape)) + strides
            return [0 if shape[i] == 1 else strides[i] for i in range(n)]

        ab, bb, cb = batch_strides(a, sa), batch_strides(b, sb), sc[:n]
        where = f"matmul {tuple(a_shape)} @ {tuple(b_shape)}"
        return {
            # Y = A @ B
            "forward": lambda: _plan_product(
                M, N, K, (sa[-2], sa[-1]), (sb[-2], sb[-1]), (sc[-2], sc[-1]),
                [(batch[i], ab[i], bb[i], cb[i]) for i in range(n)], where,
            ),
            # dA = dY @ B^T, summed over the dims A is broadcast along
            "grad_a": lambda: _plan_product(
                M, K, N, (sc[-2], sc[-1]), (sb[-1], sb[-2]), (sa[-2], sa[-1]),
                [(batch[i], cb[i], bb[i], ab[i]) for i in range(n)], where,
            ),
            # dB = A^T @ dY, summed over the dims B is broadcast along
            "grad_b": lambda: _plan_product(
                K, N, M, (sa[-1], sa[-2]), (sc[-2], sc[-1]), (sb[-2], sb[-1]),
                [(batch[i], ab[i], cb[i], bb[i]) for i in range(n)], where,
            ),
        }  # fmt: skip

    def forward_launches(self, ctx):
        a, b = ctx.inputs
        p = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])["forward"]()
        return self.product(ctx, "forward", p, a, b, ctx.output)

    def backward_launches(self, ctx):
        a, b = ctx.inputs
        da, db = ctx.grad_inputs
        plans = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])
        launches = []
        if da is not None:
            launches += self.product(ctx, "grad_a", plans["grad_a"](), ctx.grad_output, b, da)
        if db is not None:
            launches += self.product(ctx, "grad_b", plans["grad_b"](), a, ctx.grad_output, db)
        return launches


def matmul(input, other):
    """torch.matmul(input, other): 1-D operands promoted and squeezed, batch dims broadcast;
    gradients summed over broadcast dims (in fp32, inside the kernel, no atomics)."""
    return graph_of(input, other).apply(MatmulOp(), [input, other])


# ------------------------------------------------------------------------------- linear


def _row_stride_of(y: torch.Tensor) -> int | None:
    """The row stride of a 2-D product result given as a view (None: contiguous rows)."""
    return y.stride(0) if y.dim() == 2 else None


class LinearOp(_ProductOp):
    """y = x W^T + b over the flattened leading dims of x."""

    name = "linear"
    n_activation_inputs = 1
    saves_inputs = (0, 1)  # x for dW, W for dX; the bias is not needed
    grad_over_input = True

    def __init__(self, has_bias: bool):
        super().__init__()
        self.has_bias = has_bias

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes[0], input_shapes[1]
        if not all(d.is_floating_point for d in input_dtypes):
            raise TypeError(f"linear: expects floating point tensors, got {[str(d) for d in input_dtypes]}")
        if len(x) == 0:
            raise ValueError("linear: input must have at least 1 dimension, got a 0-d tensor")
        if len(w) != 2:
            raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w)}")
        if x[-1] != w[1]:
            raise ValueError(
                f"linear: input shape {tuple(x)} and weight shape {tuple(w)} cannot be multiplied "
                f"(in_features {x[-1]} vs {w[1]})"
            )
        if self.has_bias and tuple(input_shapes[2]) != (w[0],):
            raise ValueError(
                f"linear: bias must have shape ({w[0]},) to match weight {tuple(w)}, got {tuple(input_shapes[2])}"
            )

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[1][0],)

    def flops(self, input_shapes, grad_mask):
        p = self.products(input_shapes)["forward"]
        return _product_flops(1, p.M, p.N, p.K, sum(map(bool, grad_mask[:2])))

    @staticmethod
    def products(input_shapes, y_row_stride: int | None = None) -> dict[str, Product]:
        """Y = X W^T, dX = dY W and dW = dY^T X over the rows of the flattened x; the rows of Y
        (and dY) ``y_row_stride`` apart (default: contiguous; a chunk of logits whose rows are
        padded to 16 bytes, ``loss.LinearCrossEntropyOp``)."""
        x, w = input_shapes[0], input_shapes[1]
        rows, fin, fout = math.prod(x[:-1]), w[1], w[0]
        ys = y_row_stride or fout
        return {
            "forward": Product(rows, fout, fin, (fin, 1), (1, fin), (ys, 1), [], []),
            "grad_input": Product(rows, fin, fout, (ys, 1), (fin, 1), (fin, 1), [], []),
            "grad_weight": Product(fout, fin, rows, (1, ys), (fin, 1), (fin, 1), [], []),
        }

    def forward_launches(self, ctx):
        (x,), w = ctx.inputs, ctx.params[0]
        bias = ctx.params[1] if self.has_bias else None
        p = self.products(ctx.input_shapes, _row_stride_of(ctx.output))["forward"]
        return self.product(ctx, "forward", p, x, w, ctx.output, bias)

    def backward_launches(self, ctx):
        go = ctx.grad_output
        products = self.products(ctx.input_shapes, _row_stride_of(go))
        (x,), w = ctx.inputs, ctx.params[0]
        (dx,) = ctx.grad_inputs
        dw = ctx.grad_params[0]
        dbias = ctx.grad_params[1] if self.has_bias else None
        launches = []
        if dw is not None:  # dW = dY^T X, and db (dY's column sums) fused: the product reads dY's columns
            launches += self.product(ctx, "grad_weight", products["grad_weight"], go, x, dw, row_sums=dbias)
        elif dbias is not None:
            launches += sum_to_shape(ctx, go, ctx.output_shape, dbias, strides=go.stride())
        if dx is not None:  # after dW, which reads x: dX may be written over x (grad_over_input)
            launches += self.product(ctx, "grad_input", products["grad_input"], go, w, dx)
        return launches


class TransposedWeightLinearOp(LinearOp):
    """y = x W + b with W stored (in_features, out_features), as transformers' Conv1D and
    torch.addmm keep it (made by ``rewrites.read_transposed_weights`` from linear(x, W.t())):
    the products read W through strides and write dW in W's layout, so no transpose is copied
    either way. dW is linear's product dY^T X, (out, in), written transposed: its fused row sums
    are db, as in linear. Shapes are checked as those of linear(x, W.t())."""

    def check_inputs(self, input_shapes, input_dtypes):
        w = tuple(input_shapes[1])
        super().check_inputs([input_shapes[0], w[::-1], *input_shapes[2:]], input_dtypes)

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[1][1],)

    @staticmethod
    def products(input_shapes, y_row_stride: int | None = None) -> dict[str, Product]:
        """Y = X W and dX = dY W^T over the rows of the flattened x (W is (in, out)), and dW^T =
        dY^T X, (out, in), stored transposed into dW's (in, out)."""
        x, w = input_shapes[0], input_shapes[1]
        rows, fin, fout = math.prod(x[:-1]), w[0], w[1]
        ys = y_row_stride or fout
        return {
            "forward": Product(rows, fout, fin, (fin, 1), (fout, 1), (ys, 1), [], []),
            "grad_input": Product(rows, fin, fout, (ys, 1), (1, fout), (fin, 1), [], []),
            "grad_weight": Product(fout, fin, rows, (1, ys), (fin, 1), (1, fout), [], []),
        }


class SharedInputLinearOp(_ProductOp):
    """linear(x, W_i, b_i) of one input by several weights as one product,
    y = x [W_1; W_2; ...]^T + [b_1, b_2, ...], the parts side by side in the last dim (the q, k
    and v projections of an attention: ``rewrites.fuse_qkv_products``). Inputs x, W_1[, b_1],
    W_2[, b_2], ... The backward computes dW and db of the stacked ones in one product (db in
    its epilogue).

    ``adjacent``: the weights are parameters the executor lays out side by side in its arena
    (and the biases), as ``adjacent_params`` asks, so the stacked weight and bias are views of
    them and the gradients are written straight into side-by-side gradient buffers: no copies.
    Otherwise the forward copies the weights into one matrix, which it keeps for dX, and the
    biases into one vector, and the backward copies each part's rows out to its gradient."""

    name = "linear"
    n_activation_inputs = 1
    saves_inputs = (0,)  # x for dW; the stacked weight is read in place or is an extra output
    grad_over_input = True

    def __init__(self, parts: int, has_bias: bool, adjacent: bool = False):
        super().__init__()
        self.parts, self.has_bias, self.adjacent = parts, has_bias, adjacent
        self.stride = 2 if has_bias else 1  # inputs per part
        if adjacent:  # input positions: the weights side by side, then the biases
            weights = tuple(range(1, 1 + parts * self.stride, self.stride))
            self.adjacent_params = (weights, tuple(i + 1 for i in weights)) if has_bias else (weights,)
            self.saves_inputs = (0, *weights)  # parameters: held anyway, kept for free

    def _split(self, params) -> tuple[list, list]:
        """(weights, biases) of the parts from the op's parameters (or their gradients)."""
        params = list(params)
        return params[:: self.stride], params[1 :: self.stride] if self.has_bias else [None] * self.parts

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != 1 + self.parts * self.stride:
            raise ValueError(f"linear of {self.parts} weights: expected {1 + self.parts * self.stride} inputs")
        x = input_shapes[0]
        weights, biases = self._split(input_shapes[1:])
        for w, b in zip(weights, biases):
            LinearOp(self.has_bias).check_inputs([x, w] + ([b] if self.has_bias else []), input_dtypes[:3])
        if len(set(input_dtypes)) != 1:
            raise TypeError(f"linear of {self.parts} weights: one dtype for all inputs, got {set(input_dtypes)}")

    def _rows(self, input_shapes) -> list[int]:
        return [w[0] for w in self._split(input_shapes[1:])[0]]

    def flops(self, input_shapes, grad_mask):
        rows, fin = math.prod(input_shapes[0][:-1]), input_shapes[0][-1]
        outs = self._rows(input_shapes)
        forward, grad_input = _product_flops(1, rows, sum(outs), fin, bool(grad_mask[0]))
        wants_weight = grad_mask[1 :: self.stride]
        grad_weights = sum(2 * rows * out * fin for out, g in zip(outs, wants_weight) if g)
        return forward, grad_input + grad_weights

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (sum(self._rows(input_shapes)),)

    def extra_outputs(self, input_shapes, dtype):
        if self.adjacent:
            return {}
        return {"weight": ((sum(self._rows(input_shapes)), input_shapes[0][-1]), dtype)}

    def _row_ranges(self, ctx) -> list[tuple[int, int]]:
        """Each part's rows in the stacked weight: (first, end)."""
        ends = list(itertools.accumulate(self._rows(ctx.input_shapes)))
        return list(zip([0] + ends[:-1], ends))

    def forward_launches(self, ctx):
        weights, biases = self._split(ctx.params)
        if self.adjacent:  # views of the parameters, side by side in the arena
            stacked = side_by_side(ctx, weights, "parts' weights")
            bias = side_by_side(ctx, biases, "parts' biases") if self.has_bias else None
            launches = []
        else:
            stacked = ctx.saved["weight"]
            rows = self._row_ranges(ctx)
            launches = [copy_launch(w, w, stacked, stacked[a:b]) for w, (a, b) in zip(weights, rows)]
            bias = None
            if self.has_bias:
                bias = ctx.empty((stacked.shape[0],), ctx.dtype)
                launches += [copy_launch(b_, b_, bias, bias[a:b]) for b_, (a, b) in zip(biases, rows)]
        shapes = [ctx.input_shapes[0], tuple(stacked.shape)]
        product = LinearOp.products(shapes)["forward"]
        return launches + self.product(ctx, "forward", product, ctx.inputs[0], stacked, ctx.output, bias)

    def backward_launches(self, ctx):
        x, go = ctx.inputs[0], ctx.grad_output
        if self.adjacent:
            stacked = side_by_side(ctx, self._split(ctx.params)[0], "parts' weights")
        else:
            stacked = ctx.saved["weight"]
        products = LinearOp.products([ctx.input_shapes[0], tuple(stacked.shape)])
        (dx,) = ctx.grad_inputs
        dws, dbs = self._split(ctx.grad_params)
        launches = []
        want_w, want_b = any(g is not None for g in dws), any(g is not None for g in dbs)
        # an adjacent op's gradient buffers lie side by side (the executor hands them out so): written in place
        in_place = self.adjacent and all(g is not None for g in ([*dws, *dbs] if self.has_bias else dws))
        if in_place:
            dw = side_by_side(ctx, dws, "parts' weight gradients")
            db = side_by_side(ctx, dbs, "parts' bias gradients") if self.has_bias else None
        else:
            dw = ctx.empty(tuple(stacked.shape), ctx.dtype) if want_w else None
            db = ctx.empty((stacked.shape[0],), ctx.dtype) if want_b else None
        if dw is not None:  # db (dY's column sums) in dW's epilogue
            launches += self.product(ctx, "grad_weight", products["grad_weight"], go, x, dw, row_sums=db)
        elif db is not None:
            launches += sum_to_shape(ctx, go, ctx.output_shape, db)
        if dx is not None:  # after dW, which reads x: dX may be written over x (grad_over_input)
            launches += self.product(ctx, "grad_input", products["grad_input"], go, stacked, dx)
        if not in_place:
            for (a, b), gw, gb in zip(self._row_ranges(ctx), dws, dbs):
                if gw is not None:
                    launches.append(copy_launch(dw, dw[a:b], gw, gw))
                if gb is not None:
                    launches.append(copy_launch(db, db[a:b], gb, gb))
        return launches


class MLPOp(_ProductOp):
    """linear, activation, linear (, activation, linear ...) as one node (``rewrites.fuse_mlp``):

        h_i = y_{i-1} W_i^T + b_i,   y_i = f_i(h_i)   (y_0 = x; the last layer has no f)

    Each activation runs in the epilogue of the product before it, which also writes h_i for the
    backward; backwards, f_i' runs in the epilogue of the product that computes the gradient of
    y_i, dh_i = f_i'(h_i) * (dh_{i+1} W_{i+1}): no activation takes a pass of its own either way.
    Inputs x, W_1[, b_1], W_2[, b_2], ...; the extra outputs h_i (training only) and y_i (the
    next layer's input, which its dW reads)."""

    name = "mlp"
    n_activation_inputs = 1
    grad_over_input = True  # x is read by dW_1 only, before dX

    def __init__(self, has_bias: Sequence[bool], activations: Sequence[Any], keep_pre_activations: bool = True):
        super().__init__()
        if len(activations) != len(has_bias) - 1 or not activations:
            raise ValueError(
                f"mlp: {len(has_bias)} layers need {len(has_bias) - 1} activations, got {len(activations)}"
            )
        self.has_bias, self.activations = tuple(has_bias), tuple(activations)
        self.keep_pre_activations = keep_pre_activations  # False when lowered for inference
        self.weight_index = list(itertools.accumulate([1] + [1 + b for b in self.has_bias[:-1]]))
        self.saves_inputs = (0, *self.weight_index)  # x for dW_1, the weights for dX

    def _layers(self, tensors) -> list[tuple[Any, Any]]:
        """(W_i, b_i or None) per layer from the node's inputs after x (or their gradients)."""
        tensors = list(tensors)
        return [(tensors[i - 1], tensors[i] if bias else None) for i, bias in zip(self.weight_index, self.has_bias)]

    def _shapes(self, input_shapes) -> list[tuple[tuple, tuple]]:
        """(input shape, weight shape) per layer."""
        shape, out = tuple(input_shapes[0]), []
        for w, _ in self._layers(input_shapes[1:]):
            out.append((shape, tuple(w)))
            shape = shape[:-1] + (w[0],)
        return out

    def flops(self, input_shapes, grad_mask):
        forward = backward = 0
        gradient_flows = bool(grad_mask[0])  # a dX of layer i is launched when something before it wants one
        for i, (shape, w) in enumerate(self._shapes(input_shapes)):
            one = _product_flops(1, math.prod(shape[:-1]), w[0], w[1], 1)[0]
            forward += one
            backward += one * (bool(grad_mask[self.weight_index[i]]) + gradient_flows)
            gradient_flows = gradient_flows or bool(grad_mask[self.weight_index[i]])
        return forward, backward

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != 1 + len(self.has_bias) + sum(self.has_bias):
            raise ValueError(
                f"mlp of {len(self.has_bias)} layers: expected {1 + len(self.has_bias) + sum(self.has_bias)} inputs"
            )
        if len(set(input_dtypes)) != 1:
            raise TypeError(f"mlp: one dtype for all inputs, got {sorted(map(str, set(input_dtypes)))}")
        for (shape, w), (_, b), has_bias in zip(
            self._shapes(input_shapes), self._layers(input_shapes[1:]), self.has_bias
        ):
            LinearOp(has_bias).check_inputs([shape, w] + ([b] if has_bias else []), input_dtypes[:3])

    def output_shape(self, input_shapes):
        shape, w = self._shapes(input_shapes)[-1]
        return shape[:-1] + (w[0],)

    def extra_outputs(self, input_shapes, dtype):
        extras = {}
        for i, (shape, _) in enumerate(self._shapes(input_shapes)[1:]):
            if self.keep_pre_activations:
                extras[f"pre{i}"] = (shape, dtype)
            extras[f"act{i}"] = (shape, dtype)
        return extras

    def forward_launches(self, ctx):
        launches, y = [], ctx.inputs[0]
        shapes = self._shapes(ctx.input_shapes)
        for i, ((w, b), shape) in enumerate(zip(self._layers(ctx.params), shapes)):
            product = LinearOp.products(list(shape))["forward"]
            if i < len(self.activations):
                out = ctx.saved[f"act{i}"]
                epilogue = Epilogue(self.activations[i], ctx.saved.get(f"pre{i}"))
            else:
                out, epilogue = ctx.output, None
            launches += self.product(ctx, f"forward{i}", product, y, w, out, b, epilogue=epilogue)
            y = out
        return launches

    def backward_launches(self, ctx):
        weights = [w for w, _ in self._layers(ctx.params)]
        grads = self._layers(ctx.grad_params)
        (dx,) = ctx.grad_inputs
        shapes = self._shapes(ctx.input_shapes)
        wanted = [dw is not None or db is not None for dw, db in grads]
        launches, g = [], ctx.grad_output  # g: the gradient of layer i's output h_i
        for i in reversed(range(len(weights))):
            products = LinearOp.products(list(shapes[i]))
            y = ctx.inputs[0] if i == 0 else ctx.saved[f"act{i - 1}"]
            dw, db = grads[i]
            if dw is not None:  # db (g's column sums) in dW's epilogue
                launches += self.product(ctx, f"grad_weight{i}", products["grad_weight"], g, y, dw, row_sums=db)
            elif db is not None:
                launches += sum_to_shape(ctx, g, tuple(g.shape), db)
            if i == 0:
                if dx is not None:
                    launches += self.product(ctx, "grad_input0", products["grad_input"], g, weights[0], dx)
            elif dx is not None or any(wanted[:i]):
                dh = ctx.empty(shapes[i][0], ctx.dtype)
                epilogue = Epilogue(self.activations[i - 1], ctx.saved[f"pre{i - 1}"], derivative=True)
                launches += self.product(
                    ctx, f"grad_input{i}", products["grad_input"], g, weights[i], dh, epilogue=epilogue
                )
                g = dh
            else:
                break
        return launches


def linear(input, weight, bias=None):
    """F.linear: y = input @ weight^T + bias for input of shape (..., in_features)."""
    inputs = [input, weight] + ([bias] if bias is not None else [])
    return graph_of(*inputs).apply(LinearOp(bias is not None), inputs)


class Linear(Module):
    """nn.Linear(in_features, out_features, bias=True): weight (out, in) and bias (out,),
    both U(-1/sqrt(in), 1/sqrt(in)) like PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), init.kaiming_uniform(in_features), dtype=dtype)
        self.bias = Parameter((out_features,), init.kaiming_uniform(in_features), dtype=dtype) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None})"


# ------------------------------------------------------------------------ registry/tests


def _matmul_samples(dtype, gen):
    pairs = [
        ((3, 37), (37, 5)),
        ((129, 7), (7, 11)),
        ((2, 3, 5), (5, 4)),
        ((3, 5, 7), (7, 2)),
        ((2, 1, 3, 5), (4, 5, 2)),
        ((5, 7), (3, 7, 2)),
        ((7,), (7, 3)),
        ((2, 3, 7), (7,)),
        ((7,), (7,)),
        ((0, 5), (5, 3)),
        ((3, 0), (0, 4)),
        ((67, 40), (40, 24)),  # 16-byte rows in every dtype: the Hopper kernel on a GPU
    ]
    return [
        Sample(
            (make(gen, *a, dtype=dtype), make(gen, *b, dtype=dtype)),
            name=f"{a}@{b}",
            reduction=_longest_contraction(a, b),
        )
        for a, b in pairs
    ]


def _longest_contraction(a_shape, b_shape) -> int:
    """The longest sum in the forward (K) or a gradient (M or N times the broadcast batch)."""
    a, b = _promote(a_shape, b_shape)
    batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
    return max(a[-1], a[-2] * batch, b[-1] * batch, 1)


def _matmul_gradcheck(gen):
    pairs = [((3, 4), (4, 2)), ((2, 1, 2, 2), (3, 2, 1)), ((3,), (2, 3, 1)), ((2, 3), (3,)), ((5, 8), (8, 6))]
    return [
        Sample((make(gen, *a, dtype=torch.float64), make(gen, *b, dtype=torch.float64)), name=f"{a}@{b}")
        for a, b in pairs
    ]


def _linear_samples(dtype, gen):
    cases = [
        ((3, 37), 5, True),
        ((129, 7), 11, False),
        ((2, 3, 5), 4, True),
        ((1, 1), 1, True),
        ((0, 5), 3, True),
        ((70, 3), 2, True),
        ((2, 37, 24), 40, True),  # 16-byte rows in every dtype: the Hopper kernel on a GPU
    ]
    out = []
    for x, fout, bias in cases:
        args = [make(gen, *x, dtype=dtype), make(gen, fout, x[-1], dtype=dtype)]
        if bias:
            args.append(make(gen, fout, dtype=dtype))
        out.append(
            Sample(tuple(args), name=f"{x}->{fout}{'+b' if bias else ''}", reduction=max(x[-1], math.prod(x[:-1])))
        )
    return out


def _linear_gradcheck(gen):
    f64 = torch.float64
    return [
        Sample((make(gen, 4, 3, dtype=f64), make(gen, 2, 3, dtype=f64), make(gen, 2, dtype=f64)), name="4x3->2+b"),
        Sample((make(gen, 2, 2, 3, dtype=f64), make(gen, 3, 3, dtype=f64)), name="2x2x3->3"),
        Sample((make(gen, 5, 4, dtype=f64), make(gen, 6, 4, dtype=f64), make(gen, 6, dtype=f64)), name="5x4->6+b"),
    ]


register(OpInfo("matmul", matmul, torch.matmul, _matmul_samples, family="linear", gradcheck_samples=_matmul_gradcheck))
register(OpInfo("linear", linear, F.linear, _linear_samples, family="linear", gradcheck_samples=_linear_gradcheck))
