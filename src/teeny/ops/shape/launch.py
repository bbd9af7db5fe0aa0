"""The shape kernels' launches: layouts merged to as few dims as possible and visited as
``strided_offsets`` scalars, and the tile sizes (``copy_launch``, ``slice_scatter_launch``,
``IndexLayout.gather`` / ``scatter_add``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core.common import MAX_DIMS, acc_dtype, cdiv, pow2, visit_layout
from ...core.device import INTERPRETER
from ...core.runtime import ArgVisitor, Launch, OpContext
from .kernels import MAX_INDEXED, index_backward, index_backward_sorted, index_forward, slice_scatter, strided_copy

COPY_BLOCK = 16384 if INTERPRETER else 1024  # the interpreter pays per program, not per element
# index_forward / index_backward tile (index positions x other elements), and the cap on the
# other elements per program
INDEX_TILE, INDEX_ROW = (16384, 1024) if INTERPRETER else (4096, 128)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """The element strides of a contiguous tensor of ``shape``."""
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


def slice_scatter_launch(dy: torch.Tensor, dx: torch.Tensor, dims: list[tuple[int, int, int, int, int]]) -> Launch:
    """The ``slice_scatter`` launch writing all of dx: dy on the selected lattice, 0 elsewhere.
    ``dims`` lists, per dim of dx (outermost first), its size, the selection's start, step and
    length, and the dim's stride in dy."""
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
    return Launch(slice_scatter, (cdiv(dx.numel(), COPY_BLOCK), 1, 1), args, COPY_BLOCK, work=dx.numel())


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
