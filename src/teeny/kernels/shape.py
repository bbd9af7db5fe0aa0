"""Shape ops: reshape, flatten, squeeze, transpose, permute, indexing, concat, split, expand.

Shape ops move data and never compute on it, so they serve every dtype (float, integer and
bool tensors). Where the result is a contiguous view of the input (reshape, flatten, squeeze,
unsqueeze, stop_gradient, a slice of leading rows, a permutation that only moves size-1 dims)
the op answers with a torch view (no launch, no copy) and its backward is a view of the
gradient too. Everything else is materialised by these kernels:

``strided_copy``   dst[dst_offset + sum_k c_k * dst_stride_k] = src[src_offset + sum_k c_k * src_stride_k]
                   for every coordinate c (rank <= 6 after merging dims contiguous in both
                   layouts), converted to dst's dtype. The layout of a permuted, sliced or
                   expanded tensor is the one torch computes for the view. Forward of permute,
                   basic indexing, expand and concat (one launch per input); backward of permute
                   (the inverse permutation) and concat (the parts copied back out); the dtype
                   conversions of cat's type promotion.
``slice_scatter``  backward of basic indexing: dx[c] = dy[(c - start) / step] where c lies on the
                   selected lattice (start <= c, (c - start) % step == 0, (c - start) / step <
                   length, per dim), else 0; one pass writes every element of dx (no zeroing).
``index_forward``  advanced indexing (index tensors and lists) and embedding lookups:
                   y[b, r] = x[x_offset + key(b) + rest_x(r)], key(b) = sum_k i_k(b) * stride_k,
                   where i_k is the k-th index broadcast to the index shape B (b runs over B;
                   negative indices wrap for getitem), stride_k the stride of the dim it
                   indexes, and r runs over the other dims.
``index_backward`` dx[x_offset + key(b) + rest_x(r)] += dy[b, r] with atomic adds, so repeated
                   indices sum; the order of the additions varies from run to run (not
                   bit-reproducible). Half-precision gradients add into a float32 buffer.
``index_backward_sorted``  the bit-reproducible path (``teeny.config.deterministic``): the
                   forward also writes key(b); the backward sorts the keys on the device
                   (``torch.sort``, stable: no host sync) and the first position of each run of
                   equal keys sums that run's dy rows in position order (float32, float64 for
                   float64), optionally divided by the run's length (embedding's
                   scale_grad_by_freq).

expand's backward is ``common.sum_to_shape``. An index tensor's values are known only on the
device: under ``teeny.config.check_indices`` the forward flags an out-of-range index and the op
raises an error naming it after the forward (``OpContext.check_after``); with the check off,
an out-of-range index reads zeros and gets no gradient. Index lists are checked when traced.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import config
from ..device import INTERPRETER
from ..graph import Tensor, graph_of
from ..kernel import ANY_DTYPES, kernel
from ..module import Module
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, Launch, OpContext, RuntimeOp
from .cast import to
from .common import (
    MAX_DIMS,
    acc_dtype,
    cdiv,
    pow2,
    strided_offsets,
    sum_to_shape,
    sum_to_shape_kernel,
    upcast,
    visit_layout,
)

__all__ = [
    "reshape",
    "view",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "transpose",
    "permute",
    "getitem",
    "slice",
    "narrow",
    "concat",
    "cat",
    "stack",
    "split",
    "chunk",
    "expand",
    "broadcast_to",
    "stop_gradient",
    "detach",
]
NN_LAYERS = ["Flatten", "Unflatten"]

COPY_BLOCK = 16384 if INTERPRETER else 1024  # the interpreter pays per program, not per element
# index_forward / index_backward tile (index positions x other elements), and the cap on the
# other elements per program
INDEX_TILE, INDEX_ROW = (16384, 1024) if INTERPRETER else (4096, 128)
MAX_INDEXED = 4  # index tensors one getitem may combine (the kernels take their strides as scalars)
_py_slice = builtins.slice  # `slice` is an op of this module


# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _lattice(idx, size, start, step, length, dy_stride, dy_off, inside):
    """One dim of slice_scatter: peel this dim's coordinate off ``idx``, test it against the
    selected lattice and add its position in dy."""
    r = idx % size - start
    k = r // step
    inside = inside & (r >= 0) & (r - k * step == 0) & (k < length)
    return idx // size, dy_off + k * dy_stride, inside


@kernel(dtypes=ANY_DTYPES)
def slice_scatter(
    dy_ptr,
    dx_ptr,
    n,
    size0,
    size1,
    size2,
    size3,
    size4,
    size5,
    start0,
    start1,
    start2,
    start3,
    start4,
    start5,
    step0,
    step1,
    step2,
    step3,
    step4,
    step5,
    length0,
    length1,
    length2,
    length3,
    length4,
    length5,
    dy_stride0,
    dy_stride1,
    dy_stride2,
    dy_stride3,
    dy_stride4,
    dy_stride5,
    BLOCK: tl.constexpr,
):
    """Dims numbered innermost first (size 1, length 1 for dims the layout does not use)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    rest, off, inside = _lattice(idx, size0, start0, step0, length0, dy_stride0, tl.zeros_like(idx), mask)
    rest, off, inside = _lattice(rest, size1, start1, step1, length1, dy_stride1, off, inside)
    rest, off, inside = _lattice(rest, size2, start2, step2, length2, dy_stride2, off, inside)
    rest, off, inside = _lattice(rest, size3, start3, step3, length3, dy_stride3, off, inside)
    rest, off, inside = _lattice(rest, size4, start4, step4, length4, dy_stride4, off, inside)
    rest, off, inside = _lattice(rest, size5, start5, step5, length5, dy_stride5, off, inside)
    dy = tl.load(dy_ptr + off, mask=inside, other=0)
    tl.store(dx_ptr + idx, dy.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(backward=(slice_scatter, sum_to_shape_kernel), dtypes=ANY_DTYPES)
def strided_copy(
    src_ptr,
    dst_ptr,
    n,
    src_offset,
    dst_offset,
    sd0,
    sd1,
    sd2,
    sd3,
    sd4,
    st0,
    st1,
    st2,
    st3,
    st4,
    st5,
    dd0,
    dd1,
    dd2,
    dd3,
    dd4,
    dt0,
    dt1,
    dt2,
    dt3,
    dt4,
    dt5,
    NDIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Element i of the copy: source layout s*, destination layout d* (same sizes)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    src = src_offset + strided_offsets(idx, sd0, sd1, sd2, sd3, sd4, st0, st1, st2, st3, st4, st5, NDIM)
    dst = dst_offset + strided_offsets(idx, dd0, dd1, dd2, dd3, dd4, dt0, dt1, dt2, dt3, dt4, dt5, NDIM)
    value = tl.load(src_ptr + src, mask=mask)
    if dst_ptr.dtype.element_ty.is_floating() and dst_ptr.dtype.element_ty.primitive_bitwidth == 16:
        # through float32: exact for half-precision sources; integers are rounded twice, as in
        # PyTorch; and the 3.6 interpreter's direct int -> bfloat16 cast is a bit cast
        value = value.to(tl.float32)
    tl.store(dst_ptr + dst, value.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _index_term(idx_ptr, b, mask, n_b, flag_ptr, key, bad, size, stride, k: tl.constexpr, K: tl.constexpr, WRAP):
    """Add index k's share i_k(b) * stride to ``key`` (index k of the stacked (K, n_b) indices).
    An index outside [-size, size) (WRAP) or [0, size) is ``bad``; with ``flag_ptr`` it is
    recorded in flag[k] as i + (i >= 0), never 0, which the host decodes."""
    if k < K:
        i = tl.load(idx_ptr + k * n_b + b, mask=mask, other=0).to(tl.int64)
        if WRAP:
            low = -size
        else:
            low = size * 0
        out = mask & ((i < low) | (i >= size))
        if flag_ptr is not None:
            tl.store(flag_ptr + k + b * 0, i + (i >= 0).to(tl.int64), mask=out)
        key += tl.where(i < 0, i + size, i) * stride
        bad = bad | out
    return key, bad


@triton.jit
def _index_key(idx_ptr, b, mask, n_b, flag_ptr, z0, z1, z2, z3, a0, a1, a2, a3, K: tl.constexpr, WRAP):
    """key(b) = sum_k i_k(b) * a_k over the K indexed dims (sizes z_k), and which b are bad."""
    key = tl.zeros_like(b)
    bad = b < 0
    key, bad = _index_term(idx_ptr, b, mask, n_b, flag_ptr, key, bad, z0, a0, 0, K, WRAP)
    key, bad = _index_term(idx_ptr, b, mask, n_b, flag_ptr, key, bad, z1, a1, 1, K, WRAP)
    key, bad = _index_term(idx_ptr, b, mask, n_b, flag_ptr, key, bad, z2, a2, 2, K, WRAP)
    key, bad = _index_term(idx_ptr, b, mask, n_b, flag_ptr, key, bad, z3, a3, 3, K, WRAP)
    return key, bad


@kernel(half=True)
def index_backward(
    idx_ptr,
    dy_ptr,
    acc_ptr,
    n_b,
    n_r,
    x_offset,
    b_stride,
    skip_key,
    z0,
    z1,
    z2,
    z3,
    a0,
    a1,
    a2,
    a3,
    yd0,
    yd1,
    yd2,
    yd3,
    yd4,
    yt0,
    yt1,
    yt2,
    yt3,
    yt4,
    yt5,
    xd0,
    xd1,
    xd2,
    xd3,
    xd4,
    xt0,
    xt1,
    xt2,
    xt3,
    xt4,
    xt5,
    K: tl.constexpr,
    REST_NDIM: tl.constexpr,
    WRAP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """acc[x_offset + key(b) + rest_x(r)] += dy[b * b_stride + rest_y(r)] (atomics; acc zeroed
    first); positions with an out-of-range index or key == skip_key add nothing."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_b = b < n_b
    key, bad = _index_key(idx_ptr, b, mask_b, n_b, None, z0, z1, z2, z3, a0, a1, a2, a3, K, WRAP)
    rest_y = strided_offsets(r, yd0, yd1, yd2, yd3, yd4, yt0, yt1, yt2, yt3, yt4, yt5, REST_NDIM)
    rest_x = strided_offsets(r, xd0, xd1, xd2, xd3, xd4, xt0, xt1, xt2, xt3, xt4, xt5, REST_NDIM)
    tile = (mask_b & ~bad & (key != skip_key))[:, None] & (r < n_r)[None, :]
    dy = tl.load(dy_ptr + b[:, None] * b_stride + rest_y[None, :], mask=tile, other=0)
    targets = acc_ptr + x_offset + key[:, None] + rest_x[None, :]
    tl.atomic_add(targets, dy.to(acc_ptr.dtype.element_ty), mask=tile)


@kernel(half=True)
def index_backward_sorted(
    sorted_ptr,
    order_ptr,
    dy_ptr,
    dx_ptr,
    n_b,
    n_r,
    x_offset,
    b_stride,
    yd0,
    yd1,
    yd2,
    yd3,
    yd4,
    yt0,
    yt1,
    yt2,
    yt3,
    yt4,
    yt5,
    xd0,
    xd1,
    xd2,
    xd3,
    xd4,
    xt0,
    xt1,
    xt2,
    xt3,
    xt4,
    xt5,
    REST_NDIM: tl.constexpr,
    BY_COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (p, j): if sorted position p starts a run of equal keys (key >= 0), write
    dx[x_offset + key + rest_x(r)] = sum over the run's positions q of dy[order[q] * b_stride +
    rest_y(r)], in position order (divided by the run's length for BY_COUNT); dx zeroed first."""
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = r < n_r
    key = tl.load(sorted_ptr + p)
    previous = tl.load(sorted_ptr + p - 1, mask=p > 0, other=-1)
    if (key != previous) & (key >= 0):
        rest_y = strided_offsets(r, yd0, yd1, yd2, yd3, yd4, yt0, yt1, yt2, yt3, yt4, yt5, REST_NDIM)
        acc = upcast(tl.zeros([BLOCK_R], dtype=dy_ptr.dtype.element_ty))
        q = p
        next_key = key
        while next_key == key:
            position = tl.load(order_ptr + q)
            acc += upcast(tl.load(dy_ptr + position * b_stride + rest_y, mask=mask_r, other=0))
            q += 1
            next_key = tl.load(sorted_ptr + q, mask=q < n_b, other=-1)
        if BY_COUNT:
            acc = acc / (q - p)
        rest_x = strided_offsets(r, xd0, xd1, xd2, xd3, xd4, xt0, xt1, xt2, xt3, xt4, xt5, REST_NDIM)
        tl.store(dx_ptr + x_offset + key + rest_x, acc.to(dx_ptr.dtype.element_ty), mask=mask_r)


@kernel(
    backward=(index_backward, index_backward_sorted, strided_copy),
    dtypes=ANY_DTYPES,
    optional=("flag_ptr", "keys_ptr"),
)
def index_forward(
    x_ptr,
    idx_ptr,
    y_ptr,
    flag_ptr,
    keys_ptr,
    n_b,
    n_r,
    x_offset,
    b_stride,
    skip_key,
    z0,
    z1,
    z2,
    z3,
    a0,
    a1,
    a2,
    a3,
    yd0,
    yd1,
    yd2,
    yd3,
    yd4,
    yt0,
    yt1,
    yt2,
    yt3,
    yt4,
    yt5,
    xd0,
    xd1,
    xd2,
    xd3,
    xd4,
    xt0,
    xt1,
    xt2,
    xt3,
    xt4,
    xt5,
    K: tl.constexpr,
    REST_NDIM: tl.constexpr,
    WRAP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[b * b_stride + rest_y(r)] = x[x_offset + key(b) + rest_x(r)] over a (BLOCK_B, BLOCK_R)
    tile (0 for an out-of-range index). idx holds the K indices stacked, (K, n_b); sizes z_k and
    strides a_k of the dims they index. keys (optional) gets key(b), -1 where the index is out of
    range or key(b) == skip_key (no gradient), for the sorted backward."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_b = b < n_b
    mask_r = r < n_r
    key, bad = _index_key(idx_ptr, b, mask_b, n_b, flag_ptr, z0, z1, z2, z3, a0, a1, a2, a3, K, WRAP)
    if keys_ptr is not None:
        first = tl.program_id(1) == 0
        tl.store(keys_ptr + b, tl.where(bad | (key == skip_key), -1, key), mask=mask_b & first)
    rest_y = strided_offsets(r, yd0, yd1, yd2, yd3, yd4, yt0, yt1, yt2, yt3, yt4, yt5, REST_NDIM)
    rest_x = strided_offsets(r, xd0, xd1, xd2, xd3, xd4, xt0, xt1, xt2, xt3, xt4, xt5, REST_NDIM)
    tile = mask_b[:, None] & mask_r[None, :]
    values = tl.load(x_ptr + x_offset + key[:, None] + rest_x[None, :], mask=tile & ~bad[:, None], other=0)
    tl.store(y_ptr + b[:, None] * b_stride + rest_y[None, :], values, mask=tile)


# ---------------------------------------------------------------------------- layout helpers


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return strides[::-1]


def _merge_dims(sizes: Sequence[int], *stride_lists: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous with each other in every
    layout, so that the kernels index over as few dims as possible (outermost first)."""
    dims = [(int(n), [int(s[i]) for s in stride_lists]) for i, n in enumerate(sizes) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, strides in dims:
        if merged and all(ps == s * n for ps, s in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * n, strides)
        else:
            merged.append((n, strides))
    return [n for n, _ in merged], [[st[k] for _, st in merged] for k in range(len(stride_lists))]


def _visit_layouts(visitor: ArgVisitor, sizes: Sequence[int], ndim: str, **strides: Sequence[int]) -> None:
    """Visit one ``strided_offsets`` layout per keyword (its prefix) over the same ``sizes``
    (outermost first, as torch lists them; merged first), and their rank as ``ndim``."""
    sizes, merged = _merge_dims(sizes, *strides.values())
    if len(sizes) > MAX_DIMS:
        raise ValueError(
            f"the layout needs {len(sizes)} dims after merging contiguous ones; the shape kernels index at most "
            f"{MAX_DIMS}"
        )
    sizes = sizes[::-1] or [1]  # strided_offsets numbers dims innermost first
    for prefix, st in zip(strides, merged):
        visit_layout(visitor, prefix, sizes, st[::-1] or [0])
    visitor.visit(**{ndim: len(sizes)})


def _offset_in(view: torch.Tensor, base: torch.Tensor) -> int:
    return int(view.storage_offset()) - int(base.storage_offset())


def copy_launch(src: torch.Tensor, src_view: torch.Tensor, dst: torch.Tensor, dst_view: torch.Tensor) -> Launch:
    """The ``strided_copy`` launch copying the elements of ``src_view`` (a strided view of the
    buffer ``src``) to the places of ``dst_view`` (a view of ``dst`` with the same shape)."""
    n = src_view.numel()
    visitor = ArgVisitor().visit(
        src_ptr=src, dst_ptr=dst, n=n, src_offset=_offset_in(src_view, src), dst_offset=_offset_in(dst_view, dst)
    )
    _visit_layouts(visitor, src_view.shape, "NDIM", s=src_view.stride(), d=dst_view.stride())
    return Launch(strided_copy, (cdiv(n, COPY_BLOCK), 1, 1), visitor, COPY_BLOCK, work=n)


def contiguous_copy(src: torch.Tensor, src_view: torch.Tensor, dst: torch.Tensor) -> Launch:
    """Copy the strided view ``src_view`` of ``src`` into the contiguous ``dst``."""
    return copy_launch(src, src_view, dst, dst.view(src_view.shape))


@dataclass(frozen=True)
class IndexLayout:
    """The addressing of ``index_forward`` and its backward: y[b, r] = x[x_offset + key(b) +
    rest_x(r)] with key(b) = sum_k i_k(b) * strides[k] (the indexed dims' sizes and strides),
    b over ``n_b`` index positions (``b_stride`` apart in y) and r over the ``rest`` dims
    (outermost first) with strides ``rest_y`` in y and ``rest_x`` in x."""

    n_b: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    b_stride: int
    rest: tuple[int, ...]
    rest_y: tuple[int, ...]
    rest_x: tuple[int, ...]
    x_offset: int = 0
    wrap: bool = True  # negative indices count from the end (getitem); embedding refuses them

    @property
    def n_r(self) -> int:
        return math.prod(self.rest)

    def _visit(self, visitor: ArgVisitor) -> ArgVisitor:
        k = len(self.sizes)
        if k > MAX_INDEXED:
            raise ValueError(f"advanced indexing combines at most {MAX_INDEXED} index tensors, got {k}")
        sizes = list(self.sizes) + [1] * (MAX_INDEXED - k)
        strides = list(self.strides) + [0] * (MAX_INDEXED - k)
        visitor.visit(n_b=self.n_b, n_r=self.n_r, x_offset=self.x_offset, b_stride=self.b_stride)
        visitor.visit(**{f"z{j}": s for j, s in enumerate(sizes)}, **{f"a{j}": s for j, s in enumerate(strides)})
        visitor.visit(K=k, WRAP=self.wrap)
        _visit_layouts(visitor, self.rest, "REST_NDIM", y=self.rest_y, x=self.rest_x)
        return visitor

    def _blocks(self) -> tuple[int, int]:
        block_r = min(pow2(self.n_r), INDEX_ROW)
        return min(pow2(self.n_b), max(1, INDEX_TILE // block_r)), block_r

    def gather(self, x, idx, y, flag=None, keys=None, skip_key: int = -1) -> Launch:
        """The ``index_forward`` launch; ``flag`` (K int64, zeroed) records out-of-range indices,
        ``keys`` (n_b int64) receives the keys for ``scatter_add(..., keys=...)``."""
        block_b, block_r = self._blocks()
        args = self._visit(ArgVisitor().visit(x_ptr=x, idx_ptr=idx, y_ptr=y, flag_ptr=flag, keys_ptr=keys))
        args.visit(skip_key=skip_key, BLOCK_B=block_b, BLOCK_R=block_r)
        return Launch(index_forward, (cdiv(self.n_b, block_b), cdiv(self.n_r, block_r), 1), args, work=y.numel())

    def scatter_add(
        self, ctx: OpContext, idx, dy, dx, keys=None, skip_key: int = -1, by_count: bool = False
    ) -> list[Launch]:
        """Launches writing dx: the sorted path when ``keys`` (saved by the forward) is given,
        else atomic adds (into a float32 buffer, then cast, for half precision)."""
        if keys is not None:
            dx.zero_()  # elements no index selects keep a zero gradient
            sorted_keys, order = (keys, keys) if ctx.dry_run else torch.sort(keys, stable=True)
            block_r = min(pow2(self.n_r), INDEX_ROW)
            args = ArgVisitor().visit(sorted_ptr=sorted_keys, order_ptr=order, dy_ptr=dy, dx_ptr=dx)
            args.visit(n_b=self.n_b, n_r=self.n_r, x_offset=self.x_offset, b_stride=self.b_stride)
            _visit_layouts(args, self.rest, "REST_NDIM", y=self.rest_y, x=self.rest_x)
            args.visit(BY_COUNT=by_count, BLOCK_R=block_r)
            grid = (self.n_b, cdiv(self.n_r, block_r), 1)
            return [Launch(index_backward_sorted, grid, args, work=dy.numel())]
        if by_count:
            raise ValueError("dividing gradients by index counts needs the sorted backward (keys)")
        half = dx.dtype in (torch.float16, torch.bfloat16)
        acc = ctx.zeros(dx.shape, acc_dtype(dx.dtype)) if half else dx.zero_()
        block_b, block_r = self._blocks()
        args = self._visit(ArgVisitor().visit(idx_ptr=idx, dy_ptr=dy, acc_ptr=acc))
        args.visit(skip_key=skip_key, BLOCK_B=block_b, BLOCK_R=block_r)
        grid = (cdiv(self.n_b, block_b), cdiv(self.n_r, block_r), 1)
        launches = [Launch(index_backward, grid, args, work=dy.numel())]
        if half:
            launches.append(copy_launch(acc, acc, dx, dx))
        return launches


def decode_flag(value: int) -> int:
    """The index value ``index_forward`` recorded in a flag as i + (i >= 0)."""
    return value - 1 if value > 0 else value


# ------------------------------------------------------------------------------- runtime ops


class ViewOp(RuntimeOp):
    """A contiguous view with another shape (reshape, flatten, squeeze, unsqueeze, dropout in
    eval mode): no launch forwards or backwards; the gradient is a view of dy."""

    saves_inputs = False

    def __init__(self, name: str, shape: Sequence[int]):
        self.name, self.shape = name, tuple(int(s) for s in shape)

    def output_shape(self, input_shapes):
        return self.shape

    def view(self, inputs):
        return inputs[0].view(self.shape)

    def has_backward(self):
        return not self.stops_gradient  # no kernel to derive it from: the gradient is a view

    def backward_launches(self, ctx):
        if ctx.grad_inputs[0] is not None:
            ctx.grad_inputs[0] = ctx.grad_output.view(ctx.input_shapes[0])
        return []


class StopGradientOp(ViewOp):
    """Identity whose output carries no gradient."""

    stops_gradient = True


class StridedViewOp(RuntimeOp):
    """A view that torch describes by sizes, strides and an offset (permute, basic indexing,
    expand): answered with the view when that is contiguous, else gathered by ``strided_copy``."""

    kernel = strided_copy
    saves_inputs = False

    def torch_view(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output_shape(self, input_shapes):
        return tuple(self.torch_view(torch.empty(input_shapes[0], device="meta")).shape)

    def view(self, inputs):
        v = self.torch_view(inputs[0])
        return v if v.is_contiguous() else None

    def forward_launches(self, ctx):
        x = ctx.inputs[0]
        return [contiguous_copy(x, self.torch_view(x), ctx.output)]


class PermuteOp(StridedViewOp):
    """y = x.permute(dims); dx = dy.permute(inverse of dims)."""

    def __init__(self, name: str, dims: Sequence[int]):
        self.name, self.dims = name, tuple(dims)
        self.inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))

    def torch_view(self, x):
        return x.permute(self.dims)

    def backward_launches(self, ctx):
        back = ctx.grad_output.permute(self.inverse)
        if back.is_contiguous():
            ctx.grad_inputs[0] = back
            return []
        return [contiguous_copy(ctx.grad_output, back, ctx.grad_inputs[0])]


class GetItemOp(StridedViewOp):
    """y = x[index] (ints, slices with step > 0, None; ``index`` is normalised: one entry per
    input dim plus the Nones); dx = dy on the selected lattice, 0 elsewhere (slice_scatter)."""

    def __init__(self, name: str, index: tuple):
        self.name, self.index = name, index

    def torch_view(self, x):
        return x[self.index]

    def backward_launches(self, ctx):
        dy, shape = ctx.grad_output, ctx.input_shapes[0]
        if dy.numel() == math.prod(shape):  # everything selected: the gradient is a view
            ctx.grad_inputs[0] = dy.view(shape)
            return []
        dx = ctx.grad_inputs[0]
        dims = []  # per input dim: size, start, step, length, dy stride
        dy_strides, out_dim, in_dim = dy.stride(), 0, 0
        for item in self.index:
            if item is None:
                out_dim += 1
            elif isinstance(item, int):
                dims.append((shape[in_dim], item, 1, 1, 0))
                in_dim += 1
            else:
                dims.append((shape[in_dim], item.start, item.step, dy.shape[out_dim], dy_strides[out_dim]))
                in_dim += 1
                out_dim += 1
        dims = _merge_lattice(dims)[::-1]  # the kernel numbers dims innermost first
        if len(dims) > MAX_DIMS:
            raise ValueError(f"the selection spans {len(dims)} dims after merging; slice_scatter indexes at most 6")
        dims += [(1, 0, 1, 1, 0)] * (MAX_DIMS - len(dims))
        args = ArgVisitor().visit(dy_ptr=dy, dx_ptr=dx, n=dx.numel())
        for k, (size, start, step, length, stride) in enumerate(dims):
            args.visit(
                **{
                    f"size{k}": size,
                    f"start{k}": start,
                    f"step{k}": step,
                    f"length{k}": length,
                    f"dy_stride{k}": stride,
                }
            )
        return [Launch(slice_scatter, (cdiv(dx.numel(), COPY_BLOCK), 1, 1), args, COPY_BLOCK, work=dx.numel())]


def _merge_lattice(dims):
    """Drop fully selected size-1 dims and merge a dim with a fully selected inner neighbour
    (the pair is then one range of step 1)."""
    out = []
    for d in dims:
        size, start, step, length, stride = d
        if size == 1 and length == 1:
            continue
        if out:
            osize, ostart, ostep, olength, ostride = out[-1]
            full = start == 0 and step == 1 and length == size
            if full and (ostep == 1 or olength <= 1) and (olength <= 1 or ostride == stride * size):
                out[-1] = (osize * size, ostart * size, 1, olength * size, stride)
                continue
        out.append(d)
    return out


class ExpandOp(StridedViewOp):
    """y = x.expand(shape) (a stride-0 view); dx = dy summed over the broadcast dims."""

    def __init__(self, name: str, shape: Sequence[int]):
        self.name, self.shape = name, tuple(shape)

    def torch_view(self, x):
        return x.expand(self.shape)

    def backward_launches(self, ctx):
        dy, in_shape = ctx.grad_output, ctx.input_shapes[0]
        if dy.numel() == math.prod(in_shape):  # nothing broadcast to more than one element
            ctx.grad_inputs[0] = dy.view(in_shape)
            return []
        return sum_to_shape(ctx, dy, self.shape, ctx.grad_inputs[0])


class ConcatOp(RuntimeOp):
    """y = cat(xs, dim): each input copied into its place (one launch each); dx_i = the matching
    part of dy (a view where that part is contiguous, else a gather)."""

    kernel = strided_copy
    saves_inputs = False

    def __init__(self, name: str, dim: int, n: int):
        self.name, self.dim, self.n_activation_inputs = name, dim, n

    def output_shape(self, input_shapes):
        shape = list(input_shapes[0])
        shape[self.dim] = sum(s[self.dim] for s in input_shapes)
        return tuple(shape)

    def view(self, inputs):
        return inputs[0].view(inputs[0].shape) if len(inputs) == 1 else None

    def _parts(self, y: torch.Tensor, shapes):
        start = 0
        for shape in shapes:
            yield y.narrow(self.dim, start, shape[self.dim])
            start += shape[self.dim]

    def forward_launches(self, ctx):
        y = ctx.output
        return [copy_launch(x, x, y, part) for x, part in zip(ctx.inputs, self._parts(y, ctx.input_shapes))]

    def backward_launches(self, ctx):
        dy, launches = ctx.grad_output, []
        for i, part in enumerate(self._parts(dy, ctx.input_shapes)):
            if ctx.grad_inputs[i] is None:
                continue
            if part.is_contiguous():
                ctx.grad_inputs[i] = part
            else:
                launches.append(contiguous_copy(dy, part, ctx.grad_inputs[i]))
        return launches


class IndexOp(RuntimeOp):
    """y = x[basic][advanced] (PyTorch's advanced indexing): ``basic`` is a normalised basic
    index (a full slice where an index tensor goes); ``positions`` are the dims of x[basic]
    that the stacked indices (input 1, (K, n_b)) index, ``shaped`` says which of them have an
    index of rank >= 1 (the others are 0-d: they drop their dim like an int), and
    ``index_shape`` is the indices' broadcast shape B and ``dims`` the dims of x they index (for
    messages). B replaces the indexed dims where those are adjacent (ignoring 0-d ones), else it
    comes first."""

    name = "getitem"
    kernel = index_forward
    n_activation_inputs = 2
    differentiable_inputs = (0,)
    saves_inputs = (1,)

    def __init__(self, basic, positions, shaped, index_shape, dims, deterministic: bool, check: bool):
        self.basic, self.positions, self.shaped = basic, tuple(positions), tuple(shaped)
        self.index_shape, self.dims = tuple(index_shape), tuple(dims)
        self.deterministic, self.check = deterministic, check

    def _placed(self, view_shape) -> tuple[tuple[int, ...], list[int], int]:
        """(output shape, output dim of each rest dim of the view, first output dim of B)."""
        kept = [d for d in range(len(view_shape)) if not self._scalar(d)]
        shaped = [kept.index(p) for p, s in zip(self.positions, self.shaped) if s]
        rest = [d for d in range(len(view_shape)) if d not in self.positions]
        adjacent = bool(shaped) and shaped == list(range(shaped[0], shaped[0] + len(shaped)))
        start = shaped[0] if adjacent else 0
        before = [d for d in rest if kept.index(d) < start]
        after = [d for d in rest if d not in before]
        out = tuple(view_shape[d] for d in before) + self.index_shape + tuple(view_shape[d] for d in after)
        where = list(range(len(before))) + [len(before) + len(self.index_shape) + j for j in range(len(after))]
        return out, where, len(before)

    def _scalar(self, p: int) -> bool:
        return any(q == p and not s for q, s in zip(self.positions, self.shaped))

    def layout(self, x_shape) -> tuple[tuple[int, ...], IndexLayout]:
        view = torch.empty(x_shape, device="meta")[self.basic]
        out, where, b_start = self._placed(view.shape)
        rest = [d for d in range(view.dim()) if d not in self.positions]
        y_strides = _contiguous_strides(out)
        layout = IndexLayout(
            n_b=math.prod(self.index_shape),
            sizes=tuple(view.shape[p] for p in self.positions),
            strides=tuple(view.stride(p) for p in self.positions),
            b_stride=math.prod(out[b_start + len(self.index_shape) :]),
            rest=tuple(view.shape[d] for d in rest),
            rest_y=tuple(y_strides[w] for w in where),
            rest_x=tuple(view.stride(d) for d in rest),
            x_offset=view.storage_offset(),
        )
        return out, layout

    def output_shape(self, input_shapes):
        return self.layout(input_shapes[0])[0]

    def extra_outputs(self, input_shapes, dtype):
        return {"keys": ((math.prod(self.index_shape),), torch.int64)} if self.deterministic else {}

    def forward_launches(self, ctx):
        x, idx = ctx.inputs
        layout = self.layout(ctx.input_shapes[0])[1]
        flag = ctx.zeros((len(self.positions),), torch.int64) if self.check else None
        if flag is not None:
            for k, (dim, size) in enumerate(zip(self.dims, layout.sizes)):
                ctx.check_after(flag[k : k + 1], _out_of_bounds(dim, size))
        return [layout.gather(x, idx, ctx.output, flag, ctx.saved.get("keys"))]

    def backward_launches(self, ctx):
        layout = self.layout(ctx.input_shapes[0])[1]
        return layout.scatter_add(ctx, ctx.inputs[1], ctx.grad_output, ctx.grad_inputs[0], ctx.saved.get("keys"))


def _out_of_bounds(dim: int, size: int) -> Callable[[int], str]:
    return lambda value: f"index {decode_flag(value)} is out of bounds for dimension {dim} with size {size}"


# ------------------------------------------------------------------------- argument checking


def _wrap_dim(dim, ndim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what}: dim must be an int, got {dim!r}")
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise IndexError(
            f"{what}: dimension out of range (expected to be in range of [{-bound}, {bound - 1}], but got {dim})"
        )
    return dim % bound


def _int_list(values, what: str) -> tuple[int, ...]:
    if isinstance(values, int) and not isinstance(values, bool):
        return (values,)
    try:
        out = tuple(values)
    except TypeError:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {values!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise TypeError(f"{what} must be ints, got {values!r}")
    return out


def _sizes_arg(sizes, what: str) -> tuple[int, ...]:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    return _int_list(sizes, what)


def _apply(x, op: RuntimeOp, inputs=None):
    return graph_of(x).apply(op, [x] if inputs is None else inputs)


def _fail(x, name: str, message: str, kind=ValueError):
    """A trace-time error naming the op and its input (graph.apply names the node for
    errors found there; these are found in the argument checks before it)."""
    raise kind(f"{name} of {getattr(x, 'name', '?')!r} with shape {tuple(getattr(x, 'shape', ()))}: {message}")


def _infer_shape(x, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    numel = math.prod(x.shape)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1:
        _fail(x, name, f"only one dimension can be inferred, got shape {list(shape)}")
    if any(s < -1 for s in shape):
        _fail(x, name, f"invalid shape dimension in {list(shape)}")
    if unknown:
        known = math.prod(s for s in shape if s != -1)
        if known == 0:
            _fail(
                x,
                name,
                f"cannot reshape tensor of {numel} elements into shape {list(shape)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous",
            )
        if numel % known:
            _fail(x, name, f"shape {list(shape)} is invalid for input of size {numel}")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        _fail(x, name, f"shape {list(shape)} is invalid for input of size {numel}")
    return shape


# ------------------------------------------------------------------------------ functional ops


def reshape(x, shape):
    """x with another shape of the same number of elements; one size may be -1 (inferred).
    Always a view (teeny's values are contiguous)."""
    shape = _infer_shape(x, _int_list(shape, "reshape: shape"), "reshape")
    return _apply(x, ViewOp("reshape", shape))


def view(x, *shape):
    """Same as reshape (``view(x, 2, -1)`` or ``view(x, (2, -1))``)."""
    return reshape(x, _sizes_arg(shape, "view: shape"))


def flatten(x, start_dim: int = 0, end_dim: int = -1):
    """Merge dims start_dim..end_dim into one (a 0-d tensor becomes shape (1,))."""
    shape = tuple(x.shape)
    start, end = _wrap_dim(start_dim, len(shape), "flatten"), _wrap_dim(end_dim, len(shape), "flatten")
    if start > end:
        _fail(x, "flatten", f"start_dim cannot come after end_dim (start_dim={start_dim}, end_dim={end_dim})")
    if not shape:
        return _apply(x, ViewOp("flatten", (1,)))
    return _apply(x, ViewOp("flatten", shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :]))


def unflatten(x, dim: int, sizes):
    """Split dim into ``sizes`` (one may be -1)."""
    shape = tuple(x.shape)
    d = _wrap_dim(dim, len(shape), "unflatten")
    sizes = _int_list(sizes, "unflatten: sizes")
    if not sizes:
        _fail(x, "unflatten", "sizes must be non-empty")
    part = _infer_shape(_Shaped(shape[d], x), sizes, "unflatten")
    return _apply(x, ViewOp("unflatten", shape[:d] + part + shape[d + 1 :]))


class _Shaped:
    """A stand-in with only a name and a 1-d shape (for checking unflatten's sizes)."""

    def __init__(self, n: int, x):
        self.shape, self.name = (n,), getattr(x, "name", "?")


def squeeze(x, dim=None):
    """Remove size-1 dims: all of them (dim=None) or those listed in ``dim`` (an int or a
    tuple); a listed dim whose size is not 1 is left alone, as in PyTorch."""
    shape = tuple(x.shape)
    if dim is None:
        dims = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = {_wrap_dim(d, len(shape), "squeeze") for d in _int_list(dim, "squeeze: dim")}
        dims = {d for d in dims if d < len(shape) and shape[d] == 1}
    return _apply(x, ViewOp("squeeze", tuple(s for i, s in enumerate(shape) if i not in dims)))


def unsqueeze(x, dim: int):
    """Insert a size-1 dim at ``dim`` (in [-ndim-1, ndim])."""
    shape = tuple(x.shape)
    d = _wrap_dim(dim, len(shape) + 1, "unsqueeze")
    return _apply(x, ViewOp("unsqueeze", shape[:d] + (1,) + shape[d:]))


def permute(x, dims):
    """Reorder the dims of x: output dim i is input dim dims[i]."""
    ndim = len(x.shape)
    dims = _int_list(dims, "permute: dims")
    if len(dims) != ndim:
        _fail(
            x,
            "permute",
            f"number of dims don't match in permute: got {len(dims)} dims {list(dims)} for a {ndim}-d tensor",
        )
    wrapped = tuple(_wrap_dim(d, ndim, "permute") for d in dims)
    if len(set(wrapped)) != ndim:
        _fail(x, "permute", f"repeated dim in permute: {list(dims)}")
    return _apply(x, PermuteOp("permute", wrapped))


def transpose(x, dim0: int, dim1: int):
    """Swap two dims of x."""
    ndim = len(x.shape)
    d0, d1 = _wrap_dim(dim0, ndim, "transpose"), _wrap_dim(dim1, ndim, "transpose")
    dims = list(range(ndim))
    if ndim:
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return _apply(x, PermuteOp("transpose", tuple(dims)))


def _is_index(item) -> bool:
    """Whether ``item`` is an advanced index: a graph tensor, a torch tensor or a list of ints."""
    return isinstance(item, (Tensor, torch.Tensor, list)) or (isinstance(item, tuple) and bool(item))


def _normalise_index(x, index, allow_advanced: bool = False) -> tuple[tuple, list]:
    """``(basic, advanced)`` for ``x[index]``: ``basic`` has the Ellipsis expanded, ints wrapped
    and range-checked, slices made explicit (slice(start, stop, step), 0 <= start <= stop <=
    size) and a full slice where an advanced index goes; ``advanced`` lists (dim of x[basic],
    dim of x, the index) for each index tensor or list."""
    if not isinstance(index, tuple):
        index = (index,)
    shape = tuple(x.shape)
    for item in index:
        basic = item is None or item is Ellipsis or isinstance(item, (int, _py_slice))
        if isinstance(item, bool) or not (basic or (allow_advanced and _is_index(item))):
            kind = "tensor" if hasattr(item, "shape") else type(item).__name__
            supported = ", index tensors and lists of ints" if allow_advanced else ""
            _fail(
                x,
                "getitem",
                f"index {item!r} is not supported (a {kind}): teeny indexes with ints, slices, None, ...{supported}",
                TypeError,
            )
    if sum(item is Ellipsis for item in index) > 1:
        _fail(x, "getitem", "an index can only have a single ellipsis ('...')", IndexError)
    consumed = sum(1 for item in index if item is not None and item is not Ellipsis)
    if consumed > len(shape):
        _fail(x, "getitem", f"too many indices for tensor of dimension {len(shape)} (got {consumed})", IndexError)
    fill = [_py_slice(None)] * (len(shape) - consumed)
    expanded = []
    for item in index:
        expanded.extend(fill if item is Ellipsis else [item])
    if not any(item is Ellipsis for item in index):
        expanded.extend(fill)
    out, advanced, dim = [], [], 0
    for item in expanded:
        if item is None:
            out.append(None)
            continue
        size = shape[dim]
        if isinstance(item, int):
            if not -size <= item < size:
                _fail(x, "getitem", f"index {item} is out of bounds for dimension {dim} with size {size}", IndexError)
            out.append(item % size)
        elif isinstance(item, _py_slice):
            for v in (item.start, item.stop, item.step):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                    _fail(x, "getitem", f"slice bounds must be ints or None, got {item!r}", TypeError)
            if item.step is not None and item.step <= 0:
                _fail(x, "getitem", f"slice step must be positive, got {item.step} in dim {dim}")
            start, stop, step = item.indices(size)
            out.append(_py_slice(start, max(start, stop), step))
        else:
            advanced.append((sum(1 for o in out if not isinstance(o, int)), dim, item))
            out.append(_py_slice(0, size, 1))
        dim += 1
    return tuple(out), advanced


def _index_tensor(x, item, dim: int) -> Tensor:
    """The graph tensor of an advanced index: a graph tensor of integers as it is, a list of
    ints or an integer torch tensor as a constant (checked against the dim's size here)."""
    size = x.shape[dim]
    if isinstance(item, Tensor):
        if item.dtype not in (torch.int64, torch.int32):
            what = "a boolean mask (a data-dependent shape)" if item.dtype == torch.bool else f"a {item.dtype}"
            _fail(
                x, "getitem", f"index tensor {item.name!r} is {what}: index tensors must be int64 or int32", TypeError
            )
        return item
    try:
        values = torch.as_tensor(item)
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or not (
        values.dtype in (torch.int64, torch.int32) or (values.numel() == 0 and values.dim() == 1)
    ):
        _fail(x, "getitem", f"index {item!r} must be a list of ints (or an integer tensor)", TypeError)
    values = values.to(torch.int64)
    bad = values[(values < -size) | (values >= size)]
    if bad.numel():
        _fail(x, "getitem", f"index {int(bad[0])} is out of bounds for dimension {dim} with size {size}", IndexError)
    return graph_of(x).constant(values)


def getitem(x, index):
    """x[index] as PyTorch indexes: ints, slices (step > 0, negative and out-of-range bounds
    clamped), None and Ellipsis (basic indexing: a contiguous selection such as x[2:5] is a
    view, others copy), and advanced indexing with index tensors (int64 or int32 graph tensors)
    and lists of ints, in any position. Several indices broadcast together to a shape B; B
    replaces the indexed dims where they are adjacent, else it comes first (a 0-d index drops
    its dim like an int). Negative indices count from the end; an index out of range is an
    IndexError for lists (at trace time) and, under ``teeny.config.check_indices``, an error
    after the forward for tensors (with the check off it reads 0 and gets no gradient).
    The backward adds dy into the indexed places (repeated indices sum) with atomic adds, or,
    under ``teeny.config.deterministic``, bit-reproducibly by sorting."""
    basic, advanced = _normalise_index(x, index, allow_advanced=True)
    if not advanced:
        return _apply(x, GetItemOp("getitem", basic))
    if len(advanced) > MAX_INDEXED:
        _fail(x, "getitem", f"at most {MAX_INDEXED} index tensors or lists can be combined, got {len(advanced)}")
    tensors = [_index_tensor(x, item, dim) for _, dim, item in advanced]
    shaped = [bool(t.shape) for t in tensors]
    try:
        index_shape = tuple(torch.broadcast_shapes(*[t.shape for t in tensors]))
    except RuntimeError:
        listing = ", ".join(str(list(t.shape)) for t in tensors)
        message = f"shape mismatch: indexing tensors could not be broadcast together with shapes {listing}"
        _fail(x, "getitem", message, IndexError)
    n = math.prod(index_shape)
    flat = [reshape(t if tuple(t.shape) == index_shape else expand(t, *index_shape), (n,)) for t in tensors]
    stacked = flat[0] if len(flat) == 1 else concat(flat)
    op = IndexOp(
        basic,
        [p for p, _, _ in advanced],
        shaped,
        index_shape,
        [d for _, d, _ in advanced],
        deterministic=config.deterministic,
        check=config.check_indices,
    )
    return _apply(x, op, [x, stacked])


def slice(x, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    """x[..., start:end:step, ...] along ``dim`` (torch.ops.aten.slice)."""
    d = _wrap_dim(dim, len(x.shape), "slice")
    if not x.shape:
        _fail(x, "slice", "cannot slice a 0-d tensor", IndexError)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        _fail(x, "slice", f"slice step must be positive, got {step!r}")
    index = (_py_slice(None),) * d + (_py_slice(start, end, step),)
    return _apply(x, GetItemOp("slice", _normalise_index(x, index)[0]))


def narrow(x, dim: int, start: int, length: int):
    """x.narrow(dim, start, length): ``length`` elements of dim from ``start`` (negative
    start counts from the end)."""
    d = _wrap_dim(dim, len(x.shape), "narrow")
    size = x.shape[d] if x.shape else 1
    if not -size <= start <= size:
        _fail(x, "narrow", f"start ({start}) is out of range for dimension {d} of size {size}", IndexError)
    start = start % size if start < 0 else start
    if length < 0 or start + length > size:
        _fail(x, "narrow", f"start ({start}) + length ({length}) exceeds dimension size ({size})")
    return slice(x, d, start, start + length)


def _tensor_list(tensors, name: str) -> list:
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name}: expected a non-empty list of tensors")
    return list(tensors)


def _converted(t, dtype: torch.dtype):
    """``t`` in ``dtype`` (a copy converting each element, whose gradient converts back)."""
    return t if t.dtype == dtype else to(t, dtype)


def concat(tensors, dim: int = 0):
    """Join tensors along ``dim``; every other size must match. As in PyTorch, 1-d empty
    tensors (shape (0,)) are skipped, and tensors of different dtypes are promoted to a common
    one (bool < integers < floats, ``torch.promote_types``) by a converting copy."""
    tensors = _tensor_list(tensors, "concat")
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    kept = [t for t in tensors if tuple(t.shape) != (0,)] or tensors[:1]
    first = kept[0]
    ndim = len(first.shape)
    if ndim == 0:
        raise ValueError(f"concat: zero-dimensional tensor {first.name!r} cannot be concatenated")
    d = _wrap_dim(dim, ndim, "concat")
    for t in kept:
        if len(t.shape) != ndim:
            raise ValueError(
                f"concat: tensors must have the same number of dimensions: {first.name!r} has shape "
                f"{tuple(first.shape)} but {t.name!r} has shape {tuple(t.shape)}"
            )
        for k in range(ndim):
            if k != d and t.shape[k] != first.shape[k]:
                raise ValueError(
                    f"concat: sizes of tensors must match except in dimension {d}: expected size "
                    f"{first.shape[k]} but got size {t.shape[k]} in dimension {k} ({first.name!r} has "
                    f"shape {tuple(first.shape)}, {t.name!r} has shape {tuple(t.shape)})"
                )
    kept = [_converted(t, dtype) for t in kept]
    return graph_of(kept).apply(ConcatOp("concat", d, len(kept)), kept)


cat = concat


def stack(tensors, dim: int = 0):
    """Join same-shaped tensors along a new dim ``dim`` (dtypes promoted as in concat)."""
    tensors = _tensor_list(tensors, "stack")
    first = tensors[0]
    for t in tensors:
        if tuple(t.shape) != tuple(first.shape):
            raise ValueError(
                f"stack expects each tensor to be equal size, but got {tuple(first.shape)} for "
                f"{first.name!r} and {tuple(t.shape)} for {t.name!r}"
            )
    d = _wrap_dim(dim, len(first.shape) + 1, "stack")
    return concat([unsqueeze(t, d) for t in tensors], d)


def split(x, split_size_or_sections, dim: int = 0):
    """A list of consecutive parts of x along ``dim``: of size ``split_size_or_sections`` (the
    last one smaller) or of the listed sizes, which must add up to the dim's size."""
    if not x.shape:
        _fail(x, "split", "cannot split a 0-d tensor", ValueError)
    d = _wrap_dim(dim, len(x.shape), "split")
    size = x.shape[d]
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        step = split_size_or_sections
        if step < 0:
            _fail(x, "split", f"split expects split_size be non-negative, but got split_size={step}")
        if step == 0 and size > 0:
            _fail(x, "split", f"split_size can only be 0 if dimension size is 0, but got dimension {d} of size {size}")
        sizes = [min(step, size - s) for s in range(0, size, step)] if size else [0]
    else:
        sizes = list(_int_list(split_size_or_sections, "split: split_size_or_sections"))
        if any(s < 0 for s in sizes) or sum(sizes) != size:
            _fail(
                x,
                "split",
                f"split_with_sizes expects split_sizes to sum exactly to {size} (input tensor's size at "
                f"dimension {d}), but got split_sizes={sizes}",
            )
    parts, start = [], 0
    for s in sizes:
        parts.append(slice(x, d, start, start + s))
        start += s
    return parts


def chunk(x, chunks: int, dim: int = 0):
    """torch.chunk: split into ``chunks`` parts of ceil(size / chunks) (fewer if it divides so)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        _fail(x, "chunk", f"chunk expects `chunks` to be greater than 0, got: {chunks!r}")
    d = _wrap_dim(dim, len(x.shape), "chunk")
    size = x.shape[d] if x.shape else 1
    return split(x, max(cdiv(size, chunks), 1) if size else 0, d)


def expand(x, *sizes):
    """x broadcast to ``sizes`` (new dims in front; -1 keeps a size; only size-1 dims grow).
    Backward sums over the broadcast dims."""
    sizes = _sizes_arg(sizes, "expand: sizes")
    shape = tuple(x.shape)
    if len(sizes) < len(shape):
        _fail(
            x,
            "expand",
            f"the number of sizes provided ({len(sizes)}) must be greater or equal to the number of "
            f"dimensions in the tensor ({len(shape)})",
        )
    lead = len(sizes) - len(shape)
    target = []
    for i, s in enumerate(sizes):
        if i < lead:
            if s < 0:
                _fail(
                    x,
                    "expand",
                    f"the expanded size of the tensor ({s}) isn't allowed in a leading, non-existing dimension {i}",
                )
            target.append(s)
            continue
        have = shape[i - lead]
        if s == -1:
            s = have
        elif s < 0:
            _fail(x, "expand", f"invalid size {s} in {list(sizes)}")
        if have != s and have != 1:
            _fail(
                x,
                "expand",
                f"the expanded size of the tensor ({s}) must match the existing size ({have}) at "
                f"non-singleton dimension {i}. Target sizes: {list(sizes)}. Tensor sizes: {list(shape)}",
            )
        target.append(s)
    return _apply(x, ExpandOp("expand", tuple(target)))


def broadcast_to(x, shape):
    return expand(x, tuple(_int_list(shape, "broadcast_to: shape")))


def stop_gradient(x):
    """The value of x, through which no gradient flows (a view, no launch)."""
    return _apply(x, StopGradientOp("stop_gradient", tuple(x.shape)))


detach = stop_gradient


# ------------------------------------------------------------------------------------ layers


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return flatten(x, self.start_dim, self.end_dim)


class Unflatten(Module):
    def __init__(self, dim: int, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, x):
        return unflatten(x, self.dim, self.unflattened_size)


# -------------------------------------------------------------------------- registry/tests


def _samples(build):
    """Samples from ``build(t)``, where ``t(*shape)`` makes a random tensor of the dtype."""

    def samples(dtype, gen):
        return build(lambda *shape: make(gen, *shape, dtype=dtype))

    return samples


def _tiny(build):
    """Gradcheck samples (float64, tens of elements)."""
    return lambda gen: build(lambda *shape: make(gen, *shape, dtype=torch.float64))


def _both(build):
    return dict(samples=_samples(build), gradcheck_samples=_tiny(build))


def _register(name, op, ref, samples, gradcheck_samples=None, **kw):
    register(OpInfo(name, op, ref, samples, family="shape", gradcheck_samples=gradcheck_samples, **kw))


_register(
    "reshape",
    reshape,
    torch.reshape,
    _samples(
        lambda t: [
            Sample((t(3, 37), (37, -1)), name="3x37->37x-1"),
            Sample((t(5, 3, 11), (-1,)), name="flat"),
            Sample((t(1), ()), name="1->scalar"),
            Sample((t(0, 5), (5, 0, 1)), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 3, 5), (5, -1)), name="2x3x5")]),
)
_register(
    "view",
    lambda x, shape: view(x, *shape),
    lambda x, shape: x.view(*shape),
    **_both(lambda t: [Sample((t(2, 1, 7), (7, 2)), name="2x1x7")]),
)
_register(
    "flatten",
    flatten,
    torch.flatten,
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), 1), name="5x3x11 from 1"),
            Sample((t(2, 1, 7, 3), -3, -2), name="neg dims"),
            Sample((t(3, 37),), name="all"),
            Sample((t(0, 3, 2), 1), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 3, 5), 0, 1), name="2x3x5")]),
)
_register(
    "unflatten",
    unflatten,
    torch.unflatten,
    **_both(
        lambda t: [
            Sample((t(3, 14), -1, (2, -1)), name="3x14"),
            Sample(
                (
                    t(
                        15,
                    ),
                    0,
                    (3, 5),
                ),
                name="15",
            ),
        ]
    ),
)
_register(
    "squeeze",
    squeeze,
    torch.squeeze,
    _samples(
        lambda t: [
            Sample((t(2, 1, 7),), name="all"),
            Sample((t(2, 1, 7), -2), name="dim -2"),
            Sample((t(2, 1, 7), 0), name="no-op"),
            Sample((t(1, 3, 1), (0, 2)), name="tuple"),
            Sample((t(1),), name="1-element"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 1, 7),), name="2x1x7")]),
)
_register(
    "unsqueeze",
    unsqueeze,
    torch.unsqueeze,
    _samples(
        lambda t: [
            Sample((t(3, 37), 1), name="3x37 at 1"),
            Sample((t(5, 3, 11), -1), name="at -1"),
            Sample((t(0, 4), 0), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 7), -3), name="3x7")]),
)
_register(
    "transpose",
    transpose,
    torch.transpose,
    _samples(
        lambda t: [
            Sample((t(3, 37), 0, 1), name="3x37"),
            Sample((t(5, 3, 11), -1, 0), name="5x3x11 -1,0"),
            Sample((t(2, 1, 7), 0, 1), name="size-1 (view)"),
            Sample((t(4, 0, 3), 0, 2), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 2, 5), 0, 2), name="3x2x5")]),
)
_register(
    "permute",
    permute,
    torch.permute,
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), (2, 0, 1)), name="5x3x11"),
            Sample((t(2, 3, 1, 5, 3), (-1, 2, 0, 3, 1)), name="rank 5"),
            Sample((t(3, 37), (0, 1)), name="identity"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 2, 5), (1, 2, 0)), name="3x2x5")]),
)
_register(
    "getitem",
    getitem,
    lambda x, index: x[index],
    _samples(
        lambda t: [
            Sample((t(9, 5, 3), (_py_slice(1, 7, 2), _py_slice(None), -1)), name="x[1:7:2, :, -1]"),
            Sample((t(9, 5, 3), (Ellipsis, None, _py_slice(-4, None))), name="x[..., None, -4:]"),
            Sample((t(9, 5, 3), (_py_slice(2, 5),)), name="x[2:5] (view)"),
            Sample((t(9, 5, 3), (1, None, _py_slice(-100, 100, 3))), name="x[1, None, ::3] clamped"),
            Sample((t(3, 37), (_py_slice(5, 2),)), name="empty slice"),
            Sample((t(3, 37), (2, 36)), name="scalar"),
            Sample((t(129, 7), (_py_slice(None, None, 4), 3)), name="129x7"),
        ]
    ),
    _tiny(
        lambda t: [
            Sample((t(5, 3, 4), (_py_slice(1, 5, 2), None, Ellipsis, -1)), name="mixed"),
            Sample((t(6, 4), (_py_slice(1, 3),)), name="rows"),
        ]
    ),
)


def _advanced_samples(build):
    """Samples from ``build(t, i)``: ``t(*shape)`` a random tensor of the dtype, ``i(size,
    *shape)`` random int64 indices into a dim of ``size`` (negative ones too)."""

    def samples(dtype, gen):
        def i(size, *shape):
            return torch.randint(-size, size, shape, generator=gen)

        return build(lambda *shape: make(gen, *shape, dtype=dtype), i)

    return samples


_register(
    "getitem_advanced",
    getitem,
    lambda x, index: x[index],
    _advanced_samples(
        lambda t, i: [
            Sample((t(7, 5), (i(7, 13),)), name="x[idx], repeats", reduction=13),
            Sample((t(5, 6, 7), (_py_slice(None), i(6, 2, 3))), name="x[:, idx 2x3]", reduction=6),
            Sample((t(5, 6, 7), (i(5, 4), _py_slice(1, 5), i(7, 4))), name="x[i, 1:5, j] (apart: B first)"),
            Sample((t(5, 6, 7), (i(5, 2, 1), i(6, 3))), name="x[i, j] broadcast"),
            Sample((t(5, 6, 7), (_py_slice(1, 4), [0, -1, 2, 0], None)), name="x[1:4, list, None]", reduction=2),
            Sample((t(5, 6, 7), (Ellipsis, [[0], [6]])), name="x[..., [[0], [6]]]"),
            Sample((t(5, 6, 7), (i(5), _py_slice(None), i(7, 3))), name="x[0-d, :, j] (0-d drops its dim)"),
            Sample((t(4, 3), (i(4, 0),)), name="empty index"),
        ]
    ),
    lambda gen: _advanced_samples(
        lambda t, i: [
            Sample((t(5, 3), (i(5, 9),)), name="x[idx], repeats"),
            Sample((t(3, 2, 4), (i(3, 3), _py_slice(None), i(4, 3))), name="x[i, :, j]"),
            Sample((t(3, 4), ([0, -1, 0], _py_slice(1, 3))), name="x[list, 1:3]"),
        ]
    )(torch.float64, gen),
    notes="index tensors and lists (gather forwards, scatter-add backwards)",
)

_register(
    "slice",
    slice,
    lambda x, dim, start, end, step=1: torch.ops.aten.slice(x, dim, start, end, step),
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), -1, 2, -1, 3), name="5x3x11 last dim"),
            Sample((t(3, 37), 0, 1, None), name="rows"),
            Sample((t(3, 37), 1, 40, 50), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 8), 1, -7, 7, 2), name="3x8")]),
)
_register("narrow", narrow, torch.narrow, **_both(lambda t: [Sample((t(3, 9), 1, -5, 3), name="3x9")]))
_register(
    "concat",
    concat,
    torch.cat,
    _samples(
        lambda t: [
            Sample(([t(3, 37), t(3, 5), t(3, 1)], -1), name="last dim"),
            Sample(([t(2, 1, 7), t(5, 1, 7)],), name="dim 0"),
            Sample(([t(5, 3, 11), t(5, 0, 11), t(5, 2, 11)], 1), name="middle with empty"),
            Sample(([t(0), t(2, 3)], 0), name="skips 1-d empty"),
            Sample(([t(4, 3)], 1), name="one tensor"),
            Sample(([t(2, 3), torch.arange(6).reshape(2, 3), t(1, 3)], 0), name="with int64 (promoted)"),
        ]
    ),
    _tiny(lambda t: [Sample(([t(2, 3), t(2, 5)], 1), name="2x3+2x5"), Sample(([t(1, 4), t(3, 4)],), name="rows")]),
)
_register(
    "stack",
    stack,
    torch.stack,
    _samples(lambda t: [Sample(([t(3, 5), t(3, 5), t(3, 5)], -1), name="3x5")]),
    _tiny(lambda t: [Sample(([t(2, 3), t(2, 3)], 1), name="2x3")]),
)
_register(
    "split",
    lambda x, s, dim=0: concat(split(x, s, dim)[::-1], dim),
    lambda x, s, dim=0: torch.cat(torch.split(x, s, dim)[::-1], dim),
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), 4, -1), name="size 4 of 11"),
            Sample((t(7, 3), [2, 0, 5]), name="sections"),
            Sample((t(3, 37), 3, 0), name="one part"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 7), [2, 5], 1), name="3x7")]),
    notes="split(x, s, dim) checked through concat(parts reversed)",
)
_register(
    "chunk",
    lambda x, chunks, dim=0: concat(chunk(x, chunks, dim)[::-1], dim),
    lambda x, chunks, dim=0: torch.cat(torch.chunk(x, chunks, dim)[::-1], dim),
    **_both(lambda t: [Sample((t(2, 5), 3, 1), name="5 in 3")]),
)
_register(
    "expand",
    lambda x, sizes: expand(x, *sizes),
    lambda x, sizes: x.expand(*sizes),
    _samples(
        lambda t: [
            Sample((t(3, 1), (3, 37)), name="3x1->3x37", reduction=37),
            Sample(
                (
                    t(
                        11,
                    ),
                    (5, 3, 11),
                ),
                name="bias-like",
                reduction=15,
            ),
            Sample((t(2, 1, 7), (4, -1, 9, -1)), name="2x1x7->4x2x9x7", reduction=36),
            Sample((t(1), (300,)), name="scalar to 300", reduction=300),
            Sample((t(1, 5), (0, 5)), name="to empty"),
            Sample((t(3, 1), (3, 1)), name="no-op (view)"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 1), (2, 3, 5)), name="3x1->2x3x5", reduction=10)]),
)
_register(
    "stop_gradient",
    lambda x: concat([x, stop_gradient(x)]),
    lambda x: torch.cat([x, x.detach()]),
    _samples(lambda t: [Sample((t(3, 7),), name="3x7")]),
    # finite differences see through stop_gradient by design: nothing to gradcheck
    lambda gen: [Sample((make(gen, 3, 7, dtype=torch.float64),), grad=(), name="3x7")],
    notes="checked as concat([x, stop_gradient(x)]) against PyTorch autograd",
)
