"""``matmul_ws``: linear's Hopper product for half precision, written in Gluon with 128 x 192 tiles.

    Z (M, N) = X (M, K) @ Y (K, N) (+ bias[n]) (+ A)      bf16/fp16 in, fp32 accumulation

Z is of the operands' dtype, or float32 (a master weight's dW); A, a tensor laid out like Z (and
of its dtype, half), is a gradient waiting to be summed into (Z itself, in place, or another):
Z = round(round(X @ Y) + A), as the product stored alone and a separate sum would round it.

Triton's ``tl.dot`` tiles are powers of two, so an output 768 wide (GPT-2's) is 3 tiles of 256 or
6 of 128 across: at 4,096 rows that is 96 tiles (0.73 of a wave on the H200's 132
multiprocessors) or 192 (1.45 waves), and the products ran at 0.69-0.8x cuBLAS. Here a program
holds a 128 x 192 tile (128 tiles: 0.97 waves) as two warpgroups side by side, which Gluon
(Triton's explicit-layout dialect, ``triton.experimental.gluon``) can say:

* the default partition (4 warps) multiplies the tile's columns 0-127 into its accumulator,
  a worker partition (4 warps) columns 128-191 into its own, each issuing asynchronous wgmma
  and keeping one K step in flight;
* a one-warp worker loads, by TMA, each K step's X tile (128 x 64) and the two Y tiles
  (64 x 128, 64 x 64) into a ring of ``STAGES`` shared-memory stages; a stage is ready when its
  bytes have landed (one mbarrier) and free again once both consumers are done with it (another,
  counting two arrivals);
* each consumer adds the bias, casts, and stores its part of the tile by TMA from its own staging
  buffer while the loader already fills the stages of the program's next tile. With an addend,
  the consumer loads A's part of the tile by TMA into that staging buffer as the tile starts (its
  bytes land while the tile's K steps run) and adds it before the store. A float32 Z is stored
  from the accumulator's registers (each thread's two adjacent columns: whole 32-byte sectors),
  leaving the shared memory to the operand stages (a float32 staging tile would not fit beside 4).

Programs are persistent (one per multiprocessor) and walk the tiles in grouped order, like
``matmul_tma``. Operands are read as they lie, through descriptors made on the host (teeny packs
pointers and strides; ``Kernel(arguments=...)`` turns them into descriptors at each launch): X K-major
(rows of K) or M-major (X^T stored, a dW's dY^T), Y N-major or K-major (linear's W stored
(N, K)); an MN-major tile is transposed in shared memory by wgmma itself. Rows must be 16-byte
aligned (TMA). Gluon runs on the GPU only (sm_90): the interpreter has no Gluon, so CPU tests
compile it for sm_90 and GPU tests check its numbers (tests/test_linear_gluon.py).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...core.kernel import HALF_DTYPES, Kernel

BLOCK_M, BLOCK_N, BLOCK_K = 128, 192, 64  # a program's tile and K step
LEFT_N = 128  # columns of the default partition; the worker takes BLOCK_N - LEFT_N
GROUP_M = gl.constexpr(8)  # row tiles walking the column tiles together (operand tiles shared in L2)
# registers per thread of the worker partitions (the default one gets what is left): 152 / 40
# and 120 / 24 ran alike on the H200 (docs/archive/bench-journal.md, version 19)
RIGHT_REGISTERS = gl.constexpr(152)
LOADER_REGISTERS = gl.constexpr(40)
PIPELINE_STAGES = 4  # 4 x 40 KiB of operand stages and 48 KiB of staging for Z: 213 KiB (3: 5-15% slower)


@gluon.jit
def _tile_origin(tile, M, N):
    """(first row, first column) of the tile-th 128 x 192 output tile in grouped order."""
    tiles_n = gl.cdiv(N, 192)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows = gl.minimum(gl.cdiv(M, 128) - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows) * 128, ((tile % per_group) // rows) * 192


@gluon.jit
def _load(x_desc, y_left_desc, y_right_desc, z_left_desc, z_right_desc, a_left_desc, a_right_desc, bias_ptr, z_ptr,
          z_stride, x_bufs, y_left_bufs, y_right_bufs, ready, free, a_ready, M, N, K):  # fmt: skip
    """The loader warp: every K step of every tile of this program into the ring of stages."""
    STAGES: gl.constexpr = x_bufs.shape[0]
    X_K_MAJOR: gl.constexpr = x_bufs.shape[2] == 64  # (stage, 128 rows, 64 of K), else (stage, 64 of K, 128)
    Y_K_MAJOR: gl.constexpr = y_left_bufs.shape[2] == 64  # (stage, 128 columns, 64 of K), else (stage, 64, 128)
    nbytes: gl.constexpr = (x_desc.block_type.nbytes + y_left_desc.block_type.nbytes
                            + y_right_desc.block_type.nbytes)  # fmt: skip
    step = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, 128) * gl.cdiv(N, 192), gl.num_programs(0)):
        row, col = _tile_origin(tile, M, N)
        for k in range(0, K, 64):
            stage = step % STAGES
            mbarrier.wait(free.index(stage), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            if X_K_MAJOR:
                tma.async_copy_global_to_shared(x_desc, [row, k], bar, x_bufs.index(stage))
            else:
                tma.async_copy_global_to_shared(x_desc, [k, row], bar, x_bufs.index(stage))
            if Y_K_MAJOR:
                tma.async_copy_global_to_shared(y_left_desc, [col, k], bar, y_left_bufs.index(stage))
                tma.async_copy_global_to_shared(y_right_desc, [col + 128, k], bar, y_right_bufs.index(stage))
            else:
                tma.async_copy_global_to_shared(y_left_desc, [k, col], bar, y_left_bufs.index(stage))
                tma.async_copy_global_to_shared(y_right_desc, [k, col + 128], bar, y_right_bufs.index(stage))
            step += 1


@gluon.jit
def _multiply(z_desc, a_desc, bias_ptr, z_ptr, z_stride, x_bufs, y_bufs, ready, free, a_ready, M, N, K,
              COLUMN: gl.constexpr, WIDTH: gl.constexpr, X_K_MAJOR: gl.constexpr, Y_K_MAJOR: gl.constexpr):  # fmt: skip
    """One warpgroup: the (128, WIDTH) part of each tile from column COLUMN of the 192, stored
    through ``z_desc`` (half Z) or, where it is None, from the registers to ``z_ptr`` (float32
    Z); ``a_desc``: the addend's part, loaded into the staging buffer as the tile starts."""
    STAGES: gl.constexpr = x_bufs.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, WIDTH, 16])  # fmt: skip
    if z_desc is not None:
        z_buf = gl.allocate_shared_memory(z_desc.dtype, z_desc.block_type.shape, z_desc.layout)
    step = 0
    done = 0  # tiles this program finished: the addend barrier's phase
    for tile in range(gl.program_id(0), gl.cdiv(M, 128) * gl.cdiv(N, 192), gl.num_programs(0)):
        row, col = _tile_origin(tile, M, N)
        col += COLUMN
        if a_desc is not None:
            tma.store_wait(pendings=0)  # the previous tile's store has left the staging buffer
            mbarrier.expect(a_ready, a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, col], a_ready, z_buf)
        acc = gl.zeros((128, WIDTH), dtype=gl.float32, layout=layout)
        use_acc = False
        for k in range(0, K, 64):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            if X_K_MAJOR:
                a = x_bufs.index(stage)
            else:
                a = x_bufs.index(stage).permute((1, 0))
            if Y_K_MAJOR:
                acc = warpgroup_mma(a, y_bufs.index(stage).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
            else:
                acc = warpgroup_mma(a, y_bufs.index(stage), acc, use_acc=use_acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's product is done: its stage is free (the tile's first step: freed below)
            mbarrier.arrive(free.index((step + STAGES - 1) % STAGES), pred=k > 0)
            use_acc = True
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index((step + STAGES - 1) % STAGES))
        cols = col + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        if bias_ptr is not None:
            acc = acc + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        if z_desc is None:
            rows = row + gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
            offsets = rows.to(gl.int64)[:, None] * z_stride + cols[None, :]
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            gl.store(z_ptr + offsets, acc.to(z_ptr.dtype.element_ty), mask=mask)
        else:
            if a_desc is not None:
                mbarrier.wait(a_ready, done & 1)
                acc = acc.to(z_desc.dtype).to(gl.float32) + z_buf.load(layout).to(gl.float32)
            else:
                tma.store_wait(pendings=0)  # the previous tile's store has left the staging buffer
            z_buf.store(acc.to(z_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(z_desc, [row, col], z_buf)
        done += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _multiply_left(x_desc, y_left_desc, y_right_desc, z_left_desc, z_right_desc, a_left_desc, a_right_desc, bias_ptr,
                   z_ptr, z_stride, x_bufs, y_left_bufs, y_right_bufs, ready, free, a_ready, M, N, K):  # fmt: skip
    _multiply(z_left_desc, a_left_desc, bias_ptr, z_ptr, z_stride, x_bufs, y_left_bufs, ready, free, a_ready.index(0),
              M, N, K, 0, 128, x_bufs.shape[2] == 64, y_left_bufs.shape[2] == 64)  # fmt: skip


@gluon.jit
def _multiply_right(x_desc, y_left_desc, y_right_desc, z_left_desc, z_right_desc, a_left_desc, a_right_desc, bias_ptr,
                    z_ptr, z_stride, x_bufs, y_left_bufs, y_right_bufs, ready, free, a_ready, M, N, K):  # fmt: skip
    _multiply(z_right_desc, a_right_desc, bias_ptr, z_ptr, z_stride, x_bufs, y_right_bufs, ready, free,
              a_ready.index(1), M, N, K, 128, 64, x_bufs.shape[2] == 64, y_left_bufs.shape[2] == 64)  # fmt: skip


@gluon.jit
def _wait_for_previous():
    """``common.wait_for_previous`` in Gluon: griddepcontrol.wait (programmatic dependent launch)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _matmul_ws(x_desc, y_left_desc, y_right_desc, z_left_desc, z_right_desc, a_left_desc, a_right_desc, bias_ptr, z_ptr,
               M, N, K, z_stride, STAGES: gl.constexpr):  # fmt: skip
    """The kernel ``matmul_ws`` launches, given the TMA descriptors ``_arguments`` makes."""
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    y_left_bufs = gl.allocate_shared_memory(dtype, [STAGES] + y_left_desc.block_type.shape, y_left_desc.layout)
    y_right_bufs = gl.allocate_shared_memory(dtype, [STAGES] + y_right_desc.block_type.shape, y_right_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # each consumer's addend
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # both multiplying warpgroups
    for i in gl.static_range(2):
        mbarrier.init(a_ready.index(i), count=1)
    _wait_for_previous()  # the partitions below read and write global memory
    # (constexpr flags do not survive warp_specialize's argument tuples: the partitions read the
    # operands' layouts from the stage buffers' shapes)
    args = (x_desc, y_left_desc, y_right_desc, z_left_desc, z_right_desc, a_left_desc, a_right_desc, bias_ptr, z_ptr,
            z_stride, x_bufs, y_left_bufs, y_right_bufs, ready, free, a_ready, M, N, K)  # fmt: skip
    gl.warp_specialize([(_multiply_left, args), (_multiply_right, args), (_load, args)], [4, 1],
                       [RIGHT_REGISTERS, LOADER_REGISTERS])  # fmt: skip


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def _shared_layout(dtype: torch.dtype, block: tuple[int, int]):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int, cols: int, stride: int, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor(t, [rows, cols], [stride, 1], list(block), _shared_layout(t.dtype, block))


def _arguments(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    addend_ptr,
    M,
    N,
    K,
    x_stride,
    y_stride,
    z_stride,
    X_K_CONTIGUOUS: gl.constexpr,
    Y_K_CONTIGUOUS: gl.constexpr,
    STAGES: gl.constexpr,
) -> list:
    """matmul_ws as teeny packs it: Z = X @ Y (+ bias) (+ addend), X (M, K) with rows x_stride
    apart if X_K_CONTIGUOUS, else stored (K, M); Y (K, N) with rows y_stride apart unless
    Y_K_CONTIGUOUS: stored (N, K); Z (M, N) and the addend, rows z_stride apart. Returns
    ``_matmul_ws``'s arguments: the TMA descriptors, made here on the host (Z's and the addend's
    where Z is half; a float32 Z goes as its pointer). (Made on the device by each program, as
    ``matmul_tma`` does, they cost 3.5-6.5 us a launch on the H200: docs/archive/bench-journal.md,
    version 19.)"""
    if X_K_CONTIGUOUS:
        x_desc = _descriptor(x_ptr, M, K, x_stride, (BLOCK_M, BLOCK_K))
    else:
        x_desc = _descriptor(x_ptr, K, M, x_stride, (BLOCK_K, BLOCK_M))
    right = BLOCK_N - LEFT_N
    if Y_K_CONTIGUOUS:
        y_left = _descriptor(y_ptr, N, K, y_stride, (LEFT_N, BLOCK_K))
        y_right = _descriptor(y_ptr, N, K, y_stride, (right, BLOCK_K))
    else:
        y_left = _descriptor(y_ptr, K, N, y_stride, (BLOCK_K, LEFT_N))
        y_right = _descriptor(y_ptr, K, N, y_stride, (BLOCK_K, right))
    z_left = z_right = a_left = a_right = None
    if z_ptr.dtype in _GL_DTYPES:
        z_left = _descriptor(z_ptr, M, N, z_stride, (BLOCK_M, LEFT_N))
        z_right = _descriptor(z_ptr, M, N, z_stride, (BLOCK_M, right))
        z_ptr = None
    if addend_ptr is not None:
        a_left = _descriptor(addend_ptr, M, N, z_stride, (BLOCK_M, LEFT_N))
        a_right = _descriptor(addend_ptr, M, N, z_stride, (BLOCK_M, right))
    return [x_desc, y_left, y_right, z_left, z_right, a_left, a_right, bias_ptr, z_ptr, M, N, K, z_stride, STAGES]


matmul_ws = Kernel(
    _matmul_ws,
    dtypes=HALF_DTYPES,
    optional=("bias_ptr", "addend_ptr"),
    arguments=_arguments,
    pdl=True,
    name="matmul_ws",
)
