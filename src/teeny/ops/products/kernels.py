"""The products' device code. Every matrix product, forward and backward, is one launch (or a
few) of these kernels on a ``launches.Product``: Z[g] = sum_r X[g, r] @ Y[g, r] (+ bias[n]),
every access through strides (the package docstring has the maths). Three kernels compute them:

* ``matmul_tma`` (Hopper, 2-D products whose operands have one unit stride and 16-byte aligned
  rows; where rows are not aligned, a big product reads K-major copies with padded rows and
  stores Z from its registers, if timing says that beats the strided kernel):
  persistent programs (one or two per multiprocessor) walk the output tiles in grouped
  order (neighbouring programs share operand tiles in L2); operand tiles arrive by TMA
  descriptors made on the host at each launch, zero-filled past the edges, in either layout
  (a transposed operand is described as it lies and its tile transposed in shared memory; so
  is a transposed Z, Conv1D's dW^T written into W's (in, out)); the bias is added in the
  epilogue. Where whole tiles would leave the last wave of programs part idle (few output tiles
  and a long contraction: dW of a layer over many tokens), the last waves' tiles are shared out stream-K:
  their K tiles, laid end to end, are split evenly over the programs, and
  ``matmul_sum_segments`` adds up the fp32 segments of the tiles that several programs shared
  (in a fixed order: bit-reproducible, no atomics). linear's dW = dY^T X also sums the dY^T
  tiles it reads over the rows: the bias gradient without another pass over dY (the programs
  of the first column tile do it). float32 (tf32/tf32x3) tensor cores take operands K-major
  only, so an MN-major float32 operand may be copied K-major first (``matmul_copy``, one pass).
* ``matmul_ws`` (``gluon.py``: Hopper, half precision, aligned 2-D products without an
  activation epilogue or a transposed Z; an addend into half Z, or a float32 Z): a Gluon kernel
  whose programs hold 128 x 192 tiles as
  two warpgroups side by side, fed by a TMA loader warp; a tuning candidate (an output 768 wide
  is 4 of its tiles across, where ``tl.dot``'s powers of two leave a wave part idle). A dW that
  also wants the bias gradient takes it from ``common.sum_to_shape`` there.
* ``matmul_product`` (everything else: batched and broadcast products, small products with
  unaligned rows, the interpreter): the same tiles in grouped order through strided pointer loads; the bias
  gradient is ``common.sum_to_shape`` of dY there (one pass reading dY once).

Both kernels can run an element-wise activation in the epilogue: Z = f(h) with h
the product plus bias also written out for the backward, or, backwards, Z = f'(h) * the product
with h read back (``launches.Epilogue``). ``MLPOp`` (linear, activation, linear, ... as one node,
``teeny.fusions.mlp_chain``) uses both.

Which kernel and which tiles a product gets is ``tuning.py``'s choice; ``launches.py`` turns a
product and its configuration into these kernels' launches.

Precision: float64 is exact (``input_precision="ieee"``). float32 products use ``"tf32x3"``
on the GPU (three TF32 tensor-core products of split operands: more accurate than cuBLAS
SGEMM against float64, and faster than ``"ieee"`` FMA), or plain TF32 when
``teeny.core.config.allow_tf32`` was set before tracing (like ``torch.backends.cuda.matmul.allow_tf32``).
tf32x3 splits each operand into a high and a low part, so an infinite operand gives NaN where a
full-precision product gives inf. Under the Triton interpreter bfloat16 operands are upcast to
float32 before ``tl.dot`` (its bfloat16 dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...core.common import DOT_UPCAST_BF16, sum_to_shape_kernel, wait_for_previous
from ...core.device import INTERPRETER
from ...core.kernel import Kernel, kernel
from ..shape.kernels import strided_copy
from .gluon import matmul_ws

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
def plus_addend(addend, product, a, b):
    """The "derivative" of an addend epilogue (``launches.addend_epilogue``): Z = addend + the
    product, the product rounded to Z's dtype first, as it is when stored alone and summed after."""
    return addend + product


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
    z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, z_stride, sum_rows, act_a, act_b,
    ACC: tl.constexpr, SUBTILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACTIVATION: tl.constexpr, DERIVATIVE: tl.constexpr, Z_TRANSPOSED: tl.constexpr, Z_POINTERS: tl.constexpr,
):  # fmt: skip
    """The epilogue of a tile whose whole contraction one program summed: bias, activation,
    store, row sums. The activation's aux tile (h, as ``_activation_epilogue`` describes it)
    moves through ``aux_desc`` as Z does, in TMA boxes (a little faster than pointers from the
    accumulator's registers; what an activation here costs is its maths: ``fusions.mlp_chain``).
    Z_TRANSPOSED: ``z_desc`` describes Z^T, (N, M), and the tile is stored transposed.
    Z_POINTERS: ``z_desc`` is Z's pointer, rows z_stride apart (not 16-byte aligned: a vocabulary
    of 50,257), and the tile is stored from registers (no activation)."""
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
    if Z_POINTERS:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        z = z_desc + offs_m.to(tl.int64)[:, None] * z_stride + offs_n[None, :]
        tl.store(z, acc.to(z_desc.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    elif Z_TRANSPOSED:
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
    Z_POINTERS: tl.constexpr,
):
    """Z = X @ Y (+ bias) for a 2-D product, by ``programs`` persistent programs, through the TMA
    descriptors ``_matmul_tma_descriptors`` makes on the host: X (M, K) if X_K_CONTIGUOUS, else
    described as it lies, (K, M); Y (K, N), or (Y_K_CONTIGUOUS) (N, K); Z (M, N), or
    (Z_TRANSPOSED, no activation) (N, M), or (Z_POINTERS, no activation) Z's pointer, its rows
    z_stride apart and stored from registers; aux_desc laid out as Z.
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
                z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, z_stride, pid_n == 0,
                act_a, act_b, ACC, SUBTILE, BLOCK_M, BLOCK_N, ACTIVATION, DERIVATIVE, Z_TRANSPOSED, Z_POINTERS,
            )  # fmt: skip
        else:
            first, last = _segment_owners(i, k_tiles, total, programs)
            if whole | (first == last):
                _finish_tile(
                    z_desc, bias_ptr, row_sums_ptr, aux_desc, acc, row_sums, m0, n0, M, N, z_stride, pid_n == 0,
                    act_a, act_b, ACC, SUBTILE, BLOCK_M, BLOCK_N, ACTIVATION, DERIVATIVE, Z_TRANSPOSED, Z_POINTERS,
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
    Z_POINTERS: tl.constexpr,
) -> list:
    """matmul_tma as teeny packs it: X (M, K) with rows x_stride apart (X_K_CONTIGUOUS) or stored
    transposed, (K, M); Y (K, N) with rows y_stride apart or stored transposed, (N, K); Z (M, N)
    with rows z_stride apart or (Z_TRANSPOSED) stored (N, M) (Z_POINTERS: passed as the pointer, its
    rows not 16-byte aligned); aux_ptr (an activation's h) laid out as Z. Returns ``_matmul_tma``'s
    arguments: X, Y, Z and aux as TMA descriptors, made here on the host, as ``matmul_ws``'s are
    (made on the device, its five cost 3.5-6.5 us a launch on the H200:
    docs/archive/bench-journal.md, versions 19-20)."""
    x_desc = _descriptor(x_ptr, (M, K) if X_K_CONTIGUOUS else (K, M), x_stride,
                         (BLOCK_M, BLOCK_K) if X_K_CONTIGUOUS else (BLOCK_K, BLOCK_M))  # fmt: skip
    y_desc = _descriptor(y_ptr, (N, K) if Y_K_CONTIGUOUS else (K, N), y_stride,
                         (BLOCK_N, BLOCK_K) if Y_K_CONTIGUOUS else (BLOCK_K, BLOCK_N))  # fmt: skip
    store_m, store_n = (BLOCK_M // 2, BLOCK_N // 2) if SUBTILE else (BLOCK_M, BLOCK_N)
    if Z_POINTERS:
        z_desc = z_ptr
    elif Z_TRANSPOSED:
        z_desc = _descriptor(z_ptr, (N, M), z_stride, (BLOCK_N, store_m))
    else:
        z_desc = _descriptor(z_ptr, (M, N), z_stride, (BLOCK_M, store_n))
    aux_desc = None if aux_ptr is None else _descriptor(aux_ptr, (M, N), z_stride, (BLOCK_M, store_n))
    return [
        x_desc, y_desc, z_desc, bias_ptr, row_sums_ptr, partial_ptr, partial_sums_ptr, aux_desc, M, N, K, z_stride,
        programs, dp_tiles, act_a, act_b, X_K_CONTIGUOUS, Y_K_CONTIGUOUS, ACC, PRECISION, ROW_SUM_PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SUBTILE, ACTIVATION, DERIVATIVE, Z_TRANSPOSED, Z_POINTERS,
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
