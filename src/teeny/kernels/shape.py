"""Shape ops: reshape, flatten, squeeze, transpose, permute, indexing, concat, split, expand.

Shape ops move data and never compute on it, so they are dtype-agnostic (float and integer
tensors, and bool). Where the result is a contiguous view of the input (reshape, flatten,
squeeze, unsqueeze, stop_gradient, a slice of leading rows, a permutation that only moves
size-1 dims) the op answers with a torch view (no launch, no copy) and its backward is a view
of the gradient too. Everything else is materialised by three kernels:

``strided_copy``      dst[off_d + sum_i c_i * dst_stride_i] = src[off_s + sum_i c_i * src_stride_i]
                      for every coordinate c of ``sizes`` (rank <= 6 after merging dims that are
                      contiguous in both layouts). The layout of a permuted, sliced, indexed or
                      expanded tensor is the one torch computes for the view; the backward of
                      permute/transpose is the inverse permutation, concat copies each input into
                      its place and its backward copies the parts back out.
``slice_scatter``     backward of indexing: dx[c] = dy[(c - start) / step] where c lies on the
                      selected lattice (start <= c, (c - start) % step == 0, (c - start) / step <
                      length, per dim), else 0; one pass over dx writes every element (no zeroing).
``sum_broadcast``     backward of expand: dx[m] = sum over the broadcast coordinates r of
                      dy[m, r], in float32 (float64 for float64). Long sums are split over
                      programs into fp32 partials [splits, M] that a second launch of the same
                      kernel sums; no atomics, so the result is bit-reproducible.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, OpContext, RuntimeOp, TeenyError
from .common import cdiv

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

MAX_RANK = 6
COPY_BLOCK = 16384 if INTERPRETER else 1024  # the interpreter pays per program, not per element
SHAPE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_py_slice = builtins.slice  # `slice` is an op of this module


# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _strided_offset(idx, n1, n2, n3, n4, n5, s0, s1, s2, s3, s4, s5):
    """Offset of row-major linear index ``idx`` over sizes (n0..n5) with strides s0..s5."""
    off = (idx % n5) * s5
    idx = idx // n5
    off += (idx % n4) * s4
    idx = idx // n4
    off += (idx % n3) * s3
    idx = idx // n3
    off += (idx % n2) * s2
    idx = idx // n2
    off += (idx % n1) * s1
    idx = idx // n1
    return off + idx * s0


@kernel(dtypes=SHAPE_DTYPES)
def strided_copy(
    src_ptr,
    dst_ptr,
    n,
    src_offset,
    dst_offset,
    n1,
    n2,
    n3,
    n4,
    n5,
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    src = src_offset + _strided_offset(idx, n1, n2, n3, n4, n5, s0, s1, s2, s3, s4, s5)
    dst = dst_offset + _strided_offset(idx, n1, n2, n3, n4, n5, d0, d1, d2, d3, d4, d5)
    tl.store(dst_ptr + dst, tl.load(src_ptr + src, mask=mask), mask=mask)


@triton.jit
def _lattice(idx, size, start, step, length, dy_stride, dy_off, inside):
    """One dim of slice_scatter: peel this dim's coordinate off ``idx``, test it against the
    selected lattice and add its position in dy."""
    r = idx % size - start
    k = r // step
    inside = inside & (r >= 0) & (r - k * step == 0) & (k < length)
    return idx // size, dy_off + k * dy_stride, inside


@kernel(dtypes=SHAPE_DTYPES)
def slice_scatter(
    dy_ptr,
    dx_ptr,
    n,
    n0,
    n1,
    n2,
    n3,
    n4,
    n5,
    b0,
    b1,
    b2,
    b3,
    b4,
    b5,
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    l0,
    l1,
    l2,
    l3,
    l4,
    l5,
    g0,
    g1,
    g2,
    g3,
    g4,
    g5,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    rest, off, inside = _lattice(idx, n5, b5, p5, l5, g5, tl.zeros_like(idx), mask)
    rest, off, inside = _lattice(rest, n4, b4, p4, l4, g4, off, inside)
    rest, off, inside = _lattice(rest, n3, b3, p3, l3, g3, off, inside)
    rest, off, inside = _lattice(rest, n2, b2, p2, l2, g2, off, inside)
    rest, off, inside = _lattice(rest, n1, b1, p1, l1, g1, off, inside)
    rest, off, inside = _lattice(rest, n0, b0, p0, l0, g0, off, inside)
    dy = tl.load(dy_ptr + off, mask=inside, other=0)
    tl.store(dx_ptr + idx, dy.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def sum_broadcast(
    dy_ptr,
    out_ptr,
    M,
    R,
    chunk,
    k1,
    k2,
    k3,
    k4,
    k5,
    ks0,
    ks1,
    ks2,
    ks3,
    ks4,
    ks5,
    r1,
    r2,
    r3,
    r4,
    r5,
    rs0,
    rs1,
    rs2,
    rs3,
    rs4,
    rs5,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1).to(tl.int64)
    row_off = _strided_offset(rows, k1, k2, k3, k4, k5, ks0, ks1, ks2, ks3, ks4, ks5)
    if dy_ptr.dtype.element_ty == tl.float64:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    begin = split * chunk
    end = tl.minimum(begin + chunk, R)
    for r0 in range(0, chunk, BLOCK_R):
        r = begin + r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        r_off = _strided_offset(r, r1, r2, r3, r4, r5, rs0, rs1, rs2, rs3, rs4, rs5)
        mask = (rows[:, None] < M) & (r[None, :] < end)
        acc += tl.load(dy_ptr + row_off[:, None] + r_off[None, :], mask=mask, other=0.0).to(acc.dtype)
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + split * M + rows, total.to(out_ptr.dtype.element_ty), mask=rows < M)


COPY_KERNELS = (strided_copy,)
ALL_KERNELS = (strided_copy, slice_scatter, sum_broadcast)


# ---------------------------------------------------------------------------- layout helpers


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return strides[::-1]


def _merge_dims(sizes: Sequence[int], *stride_lists: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous with each other in every
    layout, so that the kernels index over as few dims as possible."""
    dims = [(int(n), [int(s[i]) for s in stride_lists]) for i, n in enumerate(sizes) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, strides in dims:
        if merged and all(ps == s * n for ps, s in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * n, strides)
        else:
            merged.append((n, strides))
    return [n for n, _ in merged], [[st[k] for _, st in merged] for k in range(len(stride_lists))]


def _pad(values: Sequence[int], fill: int) -> list[int]:
    if len(values) > MAX_RANK:
        raise ValueError(
            f"the layout needs {len(values)} dims after merging contiguous ones; the shape kernels "
            f"index at most {MAX_RANK}"
        )
    return [fill] * (MAX_RANK - len(values)) + [int(v) for v in values]


def _offset_in(view: torch.Tensor, base: torch.Tensor) -> int:
    return int(view.storage_offset()) - int(base.storage_offset())


def launch_copy(
    ctx: OpContext, src: torch.Tensor, src_view: torch.Tensor, dst: torch.Tensor, dst_view: torch.Tensor
) -> None:
    """Copy the elements of ``src_view`` (a strided view of the buffer ``src``) to the places
    of ``dst_view`` (a view of ``dst`` with the same shape), with one ``strided_copy`` launch."""
    sizes, (src_strides, dst_strides) = _merge_dims(src_view.shape, src_view.stride(), dst_view.stride())
    n = src_view.numel()
    visitor = ArgVisitor().visit_ptr(src).visit_ptr(dst).visit_i64(n)
    visitor.visit_i64(_offset_in(src_view, src)).visit_i64(_offset_in(dst_view, dst))
    for v in _pad(sizes, 1)[1:] + _pad(src_strides, 0) + _pad(dst_strides, 0):
        visitor.visit_i64(v)
    visitor.visit_constexpr(COPY_BLOCK)
    ctx.launch(strided_copy, (cdiv(n, COPY_BLOCK), 1, 1), visitor, work=n)


def _gather(ctx: OpContext, src: torch.Tensor, src_view: torch.Tensor, dst: torch.Tensor) -> None:
    launch_copy(ctx, src, src_view, dst, dst.view(src_view.shape))


# ------------------------------------------------------------------------------- runtime ops


class ViewOp(RuntimeOp):
    """A contiguous view with another shape (reshape, flatten, squeeze, unsqueeze): no launch
    forwards or backwards."""

    saves_inputs = False

    def __init__(self, name: str, shape: Sequence[int]):
        self.name, self.shape = name, tuple(int(s) for s in shape)

    def kernels(self):
        return ()

    def backward_kernels(self):
        return ()

    def output_shape(self, input_shapes):
        return self.shape

    def view(self, inputs):
        return inputs[0].view(self.shape)

    def forward(self, ctx):
        raise TeenyError(f"op {self.name} is a view and never launches")

    def has_backward(self):
        return True

    def backward(self, ctx):
        if ctx.grad_inputs[0] is not None:
            ctx.grad_inputs[0] = ctx.grad_output.view(ctx.input_shapes[0])


class StopGradientOp(ViewOp):
    """Identity whose output carries no gradient."""

    stops_gradient = True

    def has_backward(self):
        return False


class StridedViewOp(RuntimeOp):
    """A view that torch describes by sizes, strides and an offset (permute, indexing, expand):
    answered with the view when that is contiguous, else gathered by ``strided_copy``."""

    saves_inputs = False

    def torch_view(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output_shape(self, input_shapes):
        return tuple(self.torch_view(torch.empty(input_shapes[0], device="meta")).shape)

    def kernels(self):
        return COPY_KERNELS

    def view(self, inputs):
        v = self.torch_view(inputs[0])
        return v if v.is_contiguous() else None

    def forward(self, ctx):
        x = ctx.inputs[0]
        _gather(ctx, x, self.torch_view(x), ctx.output)

    def has_backward(self):
        return True


class PermuteOp(StridedViewOp):
    """y = x.permute(dims); dx = dy.permute(inverse of dims)."""

    def __init__(self, name: str, dims: Sequence[int]):
        self.name, self.dims = name, tuple(dims)
        self.inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))

    def torch_view(self, x):
        return x.permute(self.dims)

    def backward_kernels(self):
        return COPY_KERNELS

    def backward(self, ctx):
        if ctx.grad_inputs[0] is None:
            return
        dy = ctx.grad_output
        back = dy.permute(self.inverse)
        if back.is_contiguous():
            ctx.grad_inputs[0] = back
        else:
            _gather(ctx, dy, back, ctx.grad_inputs[0])


class GetItemOp(StridedViewOp):
    """y = x[index] (ints, slices with step > 0, None; ``index`` is normalised: one entry per
    input dim plus the Nones); dx = dy on the selected lattice, 0 elsewhere (slice_scatter)."""

    def __init__(self, name: str, index: tuple):
        self.name, self.index = name, index

    def torch_view(self, x):
        return x[self.index]

    def backward_kernels(self):
        return (slice_scatter,)

    def backward(self, ctx):
        if ctx.grad_inputs[0] is None:
            return
        dy, shape = ctx.grad_output, ctx.input_shapes[0]
        if dy.numel() == math.prod(shape):  # everything selected: the gradient is a view
            ctx.grad_inputs[0] = dy.view(shape)
            return
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
        dims = _merge_lattice(dims)
        n = dx.numel()
        visitor = ArgVisitor().visit_ptr(dy).visit_ptr(dx).visit_i64(n)
        for k, fill in enumerate((1, 0, 1, 1, 0)):
            for v in _pad([d[k] for d in dims], fill):
                visitor.visit_i64(v)
        visitor.visit_constexpr(COPY_BLOCK)
        ctx.launch(slice_scatter, (cdiv(n, COPY_BLOCK), 1, 1), visitor, work=n)


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

    if INTERPRETER:  # few, wide programs
        BLOCK_LONG, BLOCK_SHORT, MAX_SPLITS, TARGET_PROGRAMS = 1024, 16, 4, 4
    else:
        BLOCK_LONG, BLOCK_SHORT, MAX_SPLITS, TARGET_PROGRAMS = 128, 8, 128, 256

    def __init__(self, name: str, shape: Sequence[int]):
        self.name, self.shape = name, tuple(shape)

    def torch_view(self, x):
        return x.expand(self.shape)

    def backward_kernels(self):
        return (sum_broadcast,)

    def backward(self, ctx):
        if ctx.grad_inputs[0] is None:
            return
        dy, in_shape = ctx.grad_output, ctx.input_shapes[0]
        if dy.numel() == math.prod(in_shape):  # nothing broadcast to more than one element
            ctx.grad_inputs[0] = dy.view(in_shape)
            return
        dx = ctx.grad_inputs[0]
        lead = len(self.shape) - len(in_shape)
        dy_strides = dy.stride()
        kept, kept_strides, red, red_strides = [], [], [], []
        for i, n in enumerate(self.shape):
            if i >= lead and in_shape[i - lead] == n:
                kept.append(n)
                kept_strides.append(dy_strides[i])
            else:
                red.append(n)
                red_strides.append(dy_strides[i])
        kept, (kept_strides, _) = _merge_dims(kept, kept_strides, _contiguous_strides(kept))
        red, (red_strides,) = _merge_dims(red, red_strides)
        M, R = dx.numel(), math.prod(red)
        if R == 0:  # dy is empty: dx = 0 (no size-0 dim reaches the kernel's index maths)
            red, red_strides = [], []
        rows_contiguous = bool(kept_strides) and kept_strides[-1] == 1
        bm, br = (self.BLOCK_LONG, self.BLOCK_SHORT) if rows_contiguous else (self.BLOCK_SHORT, self.BLOCK_LONG)
        m_blocks = cdiv(M, bm)
        splits = max(1, min(self.MAX_SPLITS, cdiv(R, br * 8), cdiv(self.TARGET_PROGRAMS, max(m_blocks, 1))))
        chunk = cdiv(cdiv(R, splits), br) * br
        splits = max(1, cdiv(R, chunk)) if chunk else 1
        chunk = max(chunk, br)
        acc_dtype = torch.float64 if dx.dtype == torch.float64 else torch.float32
        first_out = dx if splits == 1 else ctx.empty((splits, M), acc_dtype)
        self._launch_sum(
            ctx, dy, first_out, M, R, chunk, kept, kept_strides, red, red_strides, bm, br, (m_blocks, splits, 1)
        )
        if splits > 1:  # second pass: sum the partials [splits, M] over splits
            self._launch_sum(
                ctx,
                first_out,
                dx,
                M,
                splits,
                cdiv(splits, br) * br,
                [M],
                [1],
                [splits],
                [M],
                self.BLOCK_LONG,
                self.BLOCK_SHORT,
                (cdiv(M, self.BLOCK_LONG), 1, 1),
            )

    @staticmethod
    def _launch_sum(ctx, src, out, M, R, chunk, kept, kept_strides, red, red_strides, bm, br, grid):
        visitor = ArgVisitor().visit_ptr(src).visit_ptr(out).visit_i64(M).visit_i64(R).visit_i64(chunk)
        for v in _pad(kept, 1)[1:] + _pad(kept_strides, 0) + _pad(red, 1)[1:] + _pad(red_strides, 0):
            visitor.visit_i64(v)
        visitor.visit_constexpr(bm).visit_constexpr(br)
        ctx.launch(sum_broadcast, grid, visitor, work=M)


class ConcatOp(RuntimeOp):
    """y = cat(xs, dim): each input copied into its place (one launch each); dx_i = the matching
    part of dy (a view where that part is contiguous, else a gather)."""

    saves_inputs = False

    def __init__(self, name: str, dim: int, n: int):
        self.name, self.dim, self.n_activation_inputs = name, dim, n

    def output_shape(self, input_shapes):
        shape = list(input_shapes[0])
        shape[self.dim] = sum(s[self.dim] for s in input_shapes)
        return tuple(shape)

    def kernels(self):
        return COPY_KERNELS

    def backward_kernels(self):
        return COPY_KERNELS

    def view(self, inputs):
        return inputs[0].view(inputs[0].shape) if len(inputs) == 1 else None

    def _parts(self, y: torch.Tensor, shapes):
        start = 0
        for shape in shapes:
            yield y.narrow(self.dim, start, shape[self.dim])
            start += shape[self.dim]

    def forward(self, ctx):
        y = ctx.output
        for x, part in zip(ctx.inputs, self._parts(y, ctx.input_shapes)):
            launch_copy(ctx, x, x, y, part)

    def has_backward(self):
        return True

    def backward(self, ctx):
        dy = ctx.grad_output
        for i, part in enumerate(self._parts(dy, ctx.input_shapes)):
            if ctx.grad_inputs[i] is None:
                continue
            if part.is_contiguous():
                ctx.grad_inputs[i] = part
            else:
                _gather(ctx, dy, part, ctx.grad_inputs[i])


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


def _normalise_index(x, index) -> tuple:
    """Index of ``x[index]`` with the Ellipsis expanded, ints wrapped and range-checked, and
    slices made explicit: slice(start, stop, step) with 0 <= start <= stop <= size."""
    if not isinstance(index, tuple):
        index = (index,)
    shape = tuple(x.shape)
    for item in index:
        if isinstance(item, bool) or not (item is None or item is Ellipsis or isinstance(item, (int, _py_slice))):
            kind = "tensor" if hasattr(item, "shape") else type(item).__name__
            _fail(
                x,
                "getitem",
                f"index {item!r} is not supported (a {kind}): teeny indexes with ints, slices, None "
                "and ..., not with tensors, lists or bools",
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
    out, dim = [], 0
    for item in expanded:
        if item is None:
            out.append(None)
            continue
        size = shape[dim]
        if isinstance(item, int):
            if not -size <= item < size:
                _fail(x, "getitem", f"index {item} is out of bounds for dimension {dim} with size {size}", IndexError)
            out.append(item % size)
        else:
            for v in (item.start, item.stop, item.step):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                    _fail(x, "getitem", f"slice bounds must be ints or None, got {item!r}", TypeError)
            if item.step is not None and item.step <= 0:
                _fail(x, "getitem", f"slice step must be positive, got {item.step} in dim {dim}")
            start, stop, step = item.indices(size)
            out.append(_py_slice(start, max(start, stop), step))
        dim += 1
    return tuple(out)


def getitem(x, index):
    """x[index] for ints, slices (step > 0, negative and out-of-range bounds clamped as in
    PyTorch), None and Ellipsis. A contiguous selection (e.g. x[2:5]) is a view; others copy."""
    normalised = _normalise_index(x, index)
    return _apply(x, GetItemOp("getitem", normalised))


def slice(x, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    """x[..., start:end:step, ...] along ``dim`` (torch.ops.aten.slice)."""
    d = _wrap_dim(dim, len(x.shape), "slice")
    if not x.shape:
        _fail(x, "slice", "cannot slice a 0-d tensor", IndexError)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        _fail(x, "slice", f"slice step must be positive, got {step!r}")
    index = (_py_slice(None),) * d + (_py_slice(start, end, step),)
    return _apply(x, GetItemOp("slice", _normalise_index(x, index)))


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


def _same_ranked(tensors, name: str):
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name}: expected a non-empty list of tensors")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listing = ", ".join(f"{t.name}:{str(t.dtype).replace('torch.', '')}" for t in tensors)
        raise TypeError(f"{name}: tensors must have one dtype, got {listing}")
    return list(tensors)


def concat(tensors, dim: int = 0):
    """Join tensors along ``dim``; every other size must match. As in PyTorch, 1-d empty
    tensors (shape (0,)) are skipped."""
    tensors = _same_ranked(tensors, "concat")
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
    return graph_of(kept).apply(ConcatOp("concat", d, len(kept)), kept)


cat = concat


def stack(tensors, dim: int = 0):
    """Join same-shaped tensors along a new dim ``dim``."""
    tensors = _same_ranked(tensors, "stack")
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
