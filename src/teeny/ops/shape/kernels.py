"""The shape kernels: they move elements and never compute on them (every dtype).

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
``index_backward_sorted``  the bit-reproducible path (``teeny.core.config.deterministic``): the
                   forward also writes key(b); the backward sorts the keys on the device
                   (``torch.sort``, stable: no host sync) and the first position of each run of
                   equal keys sums that run's dy rows in position order (float32, float64 for
                   float64), optionally divided by the run's length (embedding's
                   scale_grad_by_freq).

expand's backward is ``common.sum_to_shape_kernel``. Layouts come as scalars (``strided_offsets``'
sizes and strides, innermost first); ``launch.py`` computes them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.common import strided_offsets, sum_to_shape_kernel, upcast
from ...core.kernel import ANY_DTYPES, kernel

MAX_INDEXED = 4  # index tensors one getitem may combine (the kernels take their strides as scalars)


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
    dy_ptr, dx_ptr, n,
    size0, size1, size2, size3, size4, size5,  # dx's size per dim
    start0, start1, start2, start3, start4, start5,  # first selected coordinate per dim
    step0, step1, step2, step3, step4, step5,  # the selection's step per dim
    length0, length1, length2, length3, length4, length5,  # coordinates selected per dim (dy's size)
    dy_stride0, dy_stride1, dy_stride2, dy_stride3, dy_stride4, dy_stride5,  # dy's stride per dim
    BLOCK: tl.constexpr,
):  # fmt: skip
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
    src_ptr, dst_ptr, n, src_offset, dst_offset,
    sd0, sd1, sd2, sd3, sd4,  # sizes, innermost first (the outermost: what remains)
    st0, st1, st2, st3, st4, st5,  # source strides
    dd0, dd1, dd2, dd3, dd4,  # the same sizes, for the destination's layout
    dt0, dt1, dt2, dt3, dt4, dt5,  # destination strides
    NDIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
    idx_ptr, dy_ptr, acc_ptr,
    n_b, n_r, x_offset, b_stride, skip_key,
    z0, z1, z2, z3,  # sizes of the indexed dims (1 past K)
    a0, a1, a2, a3,  # x strides of the indexed dims (0 past K)
    yd0, yd1, yd2, yd3, yd4,  # sizes of the other dims r, innermost first
    yt0, yt1, yt2, yt3, yt4, yt5,  # y strides of the other dims
    xd0, xd1, xd2, xd3, xd4,  # the same sizes, for x's layout
    xt0, xt1, xt2, xt3, xt4, xt5,  # x strides of the other dims
    K: tl.constexpr, REST_NDIM: tl.constexpr, WRAP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
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
    sorted_ptr, order_ptr, dy_ptr, dx_ptr,
    n_b, n_r, x_offset, b_stride,
    yd0, yd1, yd2, yd3, yd4,  # sizes of the other dims r, innermost first
    yt0, yt1, yt2, yt3, yt4, yt5,  # y strides of the other dims
    xd0, xd1, xd2, xd3, xd4,  # the same sizes, for x's layout
    xt0, xt1, xt2, xt3, xt4, xt5,  # x strides of the other dims
    REST_NDIM: tl.constexpr, BY_COUNT: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
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
    x_ptr, idx_ptr, y_ptr, flag_ptr, keys_ptr,
    n_b, n_r, x_offset, b_stride, skip_key,
    z0, z1, z2, z3,  # sizes of the indexed dims (1 past K)
    a0, a1, a2, a3,  # x strides of the indexed dims (0 past K)
    yd0, yd1, yd2, yd3, yd4,  # sizes of the other dims r, innermost first
    yt0, yt1, yt2, yt3, yt4, yt5,  # y strides of the other dims
    xd0, xd1, xd2, xd3, xd4,  # the same sizes, for x's layout
    xt0, xt1, xt2, xt3, xt4, xt5,  # x strides of the other dims
    K: tl.constexpr, REST_NDIM: tl.constexpr, WRAP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
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
