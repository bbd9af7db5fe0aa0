"""Pieces every op family shares, each stated once.

* The accumulation dtype: float64 stays float64, everything else sums in float32
  (``acc_dtype`` on the host, ``tl_acc_dtype`` for a ``tl.constexpr``, ``upcast`` in a kernel).
* ``sum_to_shape``: the sum of an ``out_shape``-shaped gradient over the dims along which a
  smaller shape was broadcast (bias and broadcast-operand gradients, ``expand``'s backward,
  column sums). One kernel, ``sum_to_shape_kernel``: a tile of target elements per program,
  looping over the broadcast elements; a long broadcast range is split across programs into
  float32 partials [splits, targets] that a second launch of the same kernel sums
  (``sum_partials``; many partials for few targets in two steps, so that no lone program
  loops over them all; a few hundred in one pass of narrower column blocks; two sums' partials
  of one shape, a norm's dw and db, in one launch). No atomics, so every result is
  bit-reproducible.
* ``side_by_side``: tensors that lie one after the other in one buffer (the parameters an op
  asks for with ``RuntimeOp.adjacent_params``, and their gradients) read as one, a view.
* Launch sizes for the interpreter and the GPU, and ``strided_offsets`` (a flat index
  unravelled over up to ``MAX_DIMS`` dims, innermost first, into an element offset).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .device import INTERPRETER
from .errors import TeenyError
from .kernel import kernel
from .runtime import ArgVisitor, Launch

if TYPE_CHECKING:
    from .runtime import OpContext

Shape = tuple[int, ...]


@triton.jit
def upcast(x):
    """The dtype to compute in: float64 stays float64, everything else becomes float32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


ON_GPU = tl.constexpr(not INTERPRETER)


@tl.core.extern
def _gdc_wait_from_hopper(_semantic=None):
    # the compile target's architecture ("sm90"), not the GPU at hand: an ahead-of-time bundle
    # compiles for several; the instruction is sm_90's
    if int(_semantic.builder.options.arch.removeprefix("sm")) >= 90:
        gdc_wait(_semantic=_semantic)


@triton.jit
def wait_for_previous():
    """Programmatic dependent launch: wait here until the kernel launched before this one has
    finished and its writes are visible (``griddepcontrol.wait``; returns at once for a kernel
    not launched so). A kernel calls it before its first load or store and declares
    ``@kernel(pdl=True)``; what comes before it (index arithmetic) overlaps the previous kernel.
    Compiled for a GPU before Hopper (an sm_80 bundle) it is nothing."""
    if ON_GPU:
        _gdc_wait_from_hopper()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and partials are kept in for ``dtype`` data (the host side of ``upcast``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """``acc_dtype`` as a Triton dtype, for a ``tl.constexpr`` argument."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def elementwise_grid(n: int, block: int) -> tuple[int, int, int]:
    return (cdiv(n, block), 1, 1)


def side_by_side(ctx: OpContext, parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``parts`` stacked along dim 0, as a view of the buffer they lie one after the other in
    (an op's ``adjacent_params`` and their gradient buffers, which the executor lays out so; a
    meta tensor in lowering's dry run). A TeenyError naming ``what`` if they do not."""
    shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
    if ctx.dry_run:
        return ctx.empty(shape, parts[0].dtype)
    if not all(t.is_contiguous() for t in parts) or any(
        b.data_ptr() != a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])
    ):
        raise TeenyError(
            f"{ctx.where}: the {what} are not side by side in one buffer, as the op's adjacent_params "
            "asks the executor to lay them out"
        )
    first = parts[0]
    return first.as_strided((math.prod(shape),), (1,), first.storage_offset()).view(shape)


# tl.dot on bfloat16 operands gives garbage under the 3.6 interpreter: upcast there only.
DOT_UPCAST_BF16 = INTERPRETER


# Under the interpreter each program instance costs about a millisecond whatever its size, while
# numpy handles a wide block almost as fast as a narrow one: use few, wide programs there.
ELEMENTWISE_BLOCK = 16384 if INTERPRETER else 1024

MAX_DIMS = 6  # dims of a strided layout after merging (see strided_offsets)


@triton.jit
def _peel(off, rem, size, stride, K: tl.constexpr, NDIM: tl.constexpr):
    """Add dimension K's share (K = 0 innermost) of the flat index ``rem`` to ``off``."""
    if K < NDIM - 1:
        off += (rem % size) * stride
        rem = rem // size
    elif K == NDIM - 1:
        off += rem * stride
    return off, rem


@triton.jit
def strided_offsets(index, d0, d1, d2, d3, d4, t0, t1, t2, t3, t4, t5, NDIM: tl.constexpr):
    """sum_k index_k * t_k, where index_k is the k-th digit (innermost first, sizes d_k) of index."""
    off = index * 0
    off, rem = _peel(off, index, d0, t0, 0, NDIM)
    off, rem = _peel(off, rem, d1, t1, 1, NDIM)
    off, rem = _peel(off, rem, d2, t2, 2, NDIM)
    off, rem = _peel(off, rem, d3, t3, 3, NDIM)
    off, rem = _peel(off, rem, d4, t4, 4, NDIM)
    off, rem = _peel(off, rem, 1, t5, 5, NDIM)
    return off


def visit_layout(visitor: ArgVisitor, prefix: str, sizes: Sequence[int], strides: Sequence[int]) -> None:
    """Visit a layout for ``strided_offsets`` as ``{prefix}d0..d4`` and ``{prefix}t0..t5``."""
    sizes = list(sizes) + [1] * (MAX_DIMS - len(sizes))
    strides = list(strides) + [0] * (MAX_DIMS - len(strides))
    visitor.visit(**{f"{prefix}d{k}": sizes[k] for k in range(MAX_DIMS - 1)})
    visitor.visit(**{f"{prefix}t{k}": strides[k] for k in range(MAX_DIMS)})


# ----------------------------------------------------------------------- sum_to_shape

# elements per tile and programs to aim for (the interpreter: few, wide programs), the widest
# tile along contiguous targets, and the most steps one program of the partials' pass loops
# before that pass splits in two (docs/archive/bench-journal.md v15: a lone program reducing 32,768 partials
# took 36 us; 4096 x 128 was the fastest tile for a bias gradient's column sums)
_SUM_TILE, _SUM_TARGET_PROGRAMS = (16384, 4) if INTERPRETER else (4096, 512)
_SUM_WIDTH = 64 if INTERPRETER else 128
_SUM_MIN_WIDTH = 64 if INTERPRETER else 32  # the narrowest column block sum_partials takes to stay one pass
_PARTIAL_STEPS = 4


@kernel(half=True, optional=("out2_ptr",))
def sum_to_shape_kernel(
    g_ptr, out_ptr, out2_ptr,
    m, m_first, r, r_per_split, out_split_stride,
    kd0, kd1, kd2, kd3, kd4,  # the kept dims' sizes, innermost first
    kt0, kt1, kt2, kt3, kt4, kt5,  # g's strides along them
    rd0, rd1, rd2, rd3, rd4,  # the reduced dims' sizes, innermost first
    rt0, rt1, rt2, rt3, rt4, rt5,  # g's strides along them
    KEPT_NDIM: tl.constexpr, RED_NDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """out[s * out_split_stride + t] = sum over j in split s of g[kept(t) + reduced(j)], summed
    in float32 (float64 for float64). Program (i, s): targets i*BLOCK_M ..., reduced range
    split s. With out2_ptr the targets from m_first on go to out2 (at t - m_first) instead."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    targets = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    target_mask = targets < m
    base = strided_offsets(targets, kd0, kd1, kd2, kd3, kd4, kt0, kt1, kt2, kt3, kt4, kt5, KEPT_NDIM)
    acc = upcast(tl.zeros([BLOCK_M, BLOCK_R], dtype=g_ptr.dtype.element_ty))
    start = pid_s.to(tl.int64) * r_per_split
    end = tl.minimum(start + r_per_split, r)
    for j0 in range(start, end, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        reduced = strided_offsets(j, rd0, rd1, rd2, rd3, rd4, rt0, rt1, rt2, rt3, rt4, rt5, RED_NDIM)
        tile_mask = target_mask[:, None] & (j < end)[None, :]
        acc += upcast(tl.load(g_ptr + base[:, None] + reduced[None, :], mask=tile_mask, other=0))
    total = tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty)
    split_offset = pid_s.to(tl.int64) * out_split_stride
    if out2_ptr is None:
        tl.store(out_ptr + split_offset + targets, total, mask=target_mask)
    else:
        first = targets < m_first
        tl.store(out_ptr + split_offset + targets, total, mask=target_mask & first)
        second = tl.where(first, 0, targets - m_first)  # in range where masked off too
        tl.store(out2_ptr + split_offset + second, total, mask=target_mask & ~first)


def _split_dims(out_shape: Shape, kept_mask: Sequence[int], strides: Sequence[int]) -> tuple[list, list, list, list]:
    """Kept and reduced dims of ``out_shape`` (sizes and the gradient's element ``strides``,
    innermost first; a dim merged into its inner neighbour where both are of one kind and their
    strides nest); ``kept_mask`` is 0 along the dims summed over."""
    kept, kept_strides, red, red_strides = [], [], [], []
    last_kind = None
    for k in reversed(range(len(out_shape))):
        size = out_shape[k]
        if size != 1:
            kind = kept_mask[k] != 0
            sizes, st = (kept, kept_strides) if kind else (red, red_strides)
            if kind == last_kind and strides[k] == st[-1] * sizes[-1]:
                sizes[-1] *= size
            else:
                sizes.append(size)
                st.append(strides[k])
            last_kind = kind
    return kept or [1], kept_strides or [0], red or [1], red_strides or [0]


def broadcast_strides(shape: Shape, out_shape: Shape) -> list[int]:
    """Element strides of a contiguous ``shape`` read as ``out_shape`` (0 along broadcast dims)."""
    strides, step = [0] * len(out_shape), 1
    for k in range(1, len(shape) + 1):
        size = shape[-k]
        strides[-k] = step if size != 1 else 0
        step *= size
    return strides


def sum_to_shape(
    ctx: OpContext, grad: torch.Tensor, out_shape: Shape, target: torch.Tensor, strides: Sequence[int] | None = None
) -> list[Launch]:
    """Launches writing into ``target`` the sum of the ``out_shape``-shaped ``grad`` over the dims
    along which ``target``'s shape broadcasts to ``out_shape``; ``grad`` is contiguous, or its
    elements are ``strides`` apart (a view of padded rows)."""
    shape = tuple(target.shape)
    if strides is None:
        strides = broadcast_strides(out_shape, out_shape)
    kept, kept_strides, red, red_strides = _split_dims(out_shape, broadcast_strides(shape, out_shape), strides)
    m, r = math.prod(shape), math.prod(out_shape)
    r = r // m if m else 0
    if len(kept) > MAX_DIMS or len(red) > MAX_DIMS:
        raise ValueError(f"sum_to_shape: {shape} -> {out_shape} has too many dimensions")
    inner_kept = bool(out_shape) and out_shape[-1] != 1 and broadcast_strides(shape, out_shape)[-1] != 0
    if inner_kept:  # targets contiguous: wide along them
        block_m = min(pow2(m), _SUM_WIDTH)
        block_r = min(pow2(r), max(1, _SUM_TILE // block_m))
    else:
        block_r = min(pow2(r), 256)
        block_m = min(pow2(m), max(1, _SUM_TILE // block_r))
    programs_m = cdiv(m, block_m)
    split = max(1, min(cdiv(r, 4 * block_r), cdiv(_SUM_TARGET_PROGRAMS, programs_m)))
    r_per_split = cdiv(cdiv(r, split), block_r) * block_r if r else 1
    split = max(1, cdiv(r, r_per_split))
    first_out = target if split == 1 else ctx.empty((split, m), acc_dtype(target.dtype))
    launches = [_sum_launch(
        grad, first_out, m=m, r=r, r_per_split=r_per_split, kept=(kept, kept_strides), red=(red, red_strides),
        block_m=block_m, block_r=block_r, grid=(programs_m, split, 1),
    )]  # fmt: skip
    if split > 1:
        launches += sum_partials(first_out, target)
    return launches


def sum_partials(partials: torch.Tensor, out: torch.Tensor, second: torch.Tensor | None = None) -> list[Launch]:
    """The second pass of a split sum: ``out[t] = sum_s partials[s, t]`` for a contiguous
    (splits, targets) buffer of float32 (float64) partials, which it may overwrite. Many
    partials for few targets are summed in two steps, so that no lone program loops over all of
    them: each program of the first sums a range of rows into that range's first row, and
    the second sums those rows. Fewer partials (a norm's 264 weight-gradient rows of 768) are
    summed in one pass of narrower column blocks (down to _SUM_MIN_WIDTH), if that leaves no
    program more than _PARTIAL_STEPS tiles to loop over: one launch instead of two.
    With ``second``, ``partials`` is (2, splits, targets), two sums of one shape (a norm's dw
    and db): the first into ``out``, the second into ``second``, in one launch where each
    would take one pass."""
    if second is not None:
        _, splits, m = partials.shape
        if second.dtype != out.dtype or second.numel() != m or out.numel() != m:
            raise ValueError(
                f"sum_partials: two sums of {m} targets go into two tensors of {m} elements and one dtype, "
                f"not {tuple(out.shape)} {out.dtype} and {tuple(second.shape)} {second.dtype}"
            )
        block_m, block_r, ranges = _partials_tiles(splits, 2 * m)
        if ranges >= 2:
            return sum_partials(partials[0], out) + sum_partials(partials[1], second)
        grid = (cdiv(2 * m, block_m), 1, 1)
        launch = _sum_launch(
            partials, out, m=2 * m, r=splits, r_per_split=splits, kept=([m, 2], [1, splits * m]), red=([splits], [m]),
            block_m=block_m, block_r=block_r, grid=grid, second=second, m_first=m,
        )  # fmt: skip
        return [launch]
    splits, m = partials.shape
    block_m, block_r, ranges = _partials_tiles(splits, m)
    programs_m = cdiv(m, block_m)
    if ranges < 2:
        return [_sum_launch(
            partials, out, m=m, r=splits, r_per_split=splits, kept=([m], [1]), red=([splits], [m]),
            block_m=block_m, block_r=block_r, grid=(programs_m, 1, 1),
        )]  # fmt: skip
    rows = cdiv(cdiv(splits, ranges), block_r) * block_r  # rows per range
    ranges = cdiv(splits, rows)
    first = _sum_launch(
        partials, partials, m=m, r=splits, r_per_split=rows, kept=([m], [1]), red=([splits], [m]),
        block_m=block_m, block_r=block_r, grid=(programs_m, ranges, 1), out_split_stride=rows * m,
    )  # fmt: skip
    block_r = min(pow2(ranges), max(1, _SUM_TILE // block_m))
    second_step = _sum_launch(
        partials, out, m=m, r=ranges, r_per_split=ranges, kept=([m], [1]), red=([ranges], [rows * m]),
        block_m=block_m, block_r=block_r, grid=(programs_m, 1, 1),
    )  # fmt: skip
    return [first, second_step]


def _partials_tiles(splits: int, m: int) -> tuple[int, int, int]:
    """``sum_partials``' column block, row block and number of row ranges (< 2: one pass) for
    ``splits`` partial rows of ``m`` targets."""
    block_m = min(pow2(m), _SUM_WIDTH)
    narrow = block_m
    while narrow > _SUM_MIN_WIDTH and splits > _PARTIAL_STEPS * (_SUM_TILE // narrow):
        narrow //= 2
    if splits <= _PARTIAL_STEPS * (_SUM_TILE // narrow):
        block_m = narrow
    block_r = min(pow2(splits), max(1, _SUM_TILE // block_m))
    programs_m = cdiv(m, block_m)
    ranges = min(cdiv(splits, _PARTIAL_STEPS * block_r), max(1, _SUM_TARGET_PROGRAMS // programs_m))
    return block_m, block_r, ranges


_Layout = tuple[Sequence[int], Sequence[int]]  # (sizes, element strides), innermost first


def _sum_launch(
    grad: torch.Tensor, out: torch.Tensor, *,
    m: int, r: int, r_per_split: int,  # targets, reduced elements per target, and per program
    kept: _Layout, red: _Layout,  # the targets' dims in grad, and the summed dims
    block_m: int, block_r: int, grid: tuple[int, int, int],
    out_split_stride: int | None = None, second: torch.Tensor | None = None, m_first: int = 0,
) -> Launch:  # fmt: skip
    """One ``sum_to_shape_kernel`` launch (see its docstring for the arguments' meaning)."""
    visitor = ArgVisitor().visit(g_ptr=grad, out_ptr=out, out2_ptr=second, m=m, m_first=m_first, r=r)
    visitor.visit(r_per_split=r_per_split)
    visitor.visit(out_split_stride=m if out_split_stride is None else out_split_stride)
    visit_layout(visitor, "k", *kept)
    visit_layout(visitor, "r", *red)
    visitor.visit(KEPT_NDIM=len(kept[0]), RED_NDIM=len(red[0]), BLOCK_M=block_m, BLOCK_R=block_r)
    return Launch(sum_to_shape_kernel, grid, visitor, work=m)


# ----------------------------------------------------------------------- counter-based dropout masks

_MASK64 = (1 << 64) - 1


@triton.jit
def philox_keep(seed, offsets, keep_threshold):
    """True where the Philox draw of element ``offsets`` (int64 counters) under ``seed`` is
    >= ``keep_threshold`` (an int64 in [0, 2^32]): each element is kept with probability
    1 - keep_threshold / 2^32, and the same (seed, offset) always gives the same answer, so a
    backward regenerates its forward's mask. The draw is the first 32-bit word of Philox-4x32-10
    with counter (offset mod 2^32, offset >> 32, 0, 0) and key (seed mod 2^32, seed >> 32)."""
    lo = (offsets & 0xFFFFFFFF).to(tl.uint32)
    hi = (offsets >> 32).to(tl.uint32)
    zero = tl.zeros_like(lo)
    draw, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    return draw.to(tl.int64) >= keep_threshold


def keep_threshold(p: float) -> int:
    """The ``philox_keep`` threshold that drops an element with probability ``p``."""
    return min(1 << 32, max(0, round(float(p) * (1 << 32))))


def mix_seed(base: int, step: int) -> int:
    """A 31-bit seed (always an int32 argument) from (base, step) through splitmix64: the seed of
    the ``step``-th mask drawn by a node whose base seed is ``base``."""
    z = (base * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 33
