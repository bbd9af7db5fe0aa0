"""The shape RuntimeOps: what each op launches forward and backward, and when it needs no
launch at all (a contiguous result is a torch view of its input, and its gradient a view of dy).

``ViewOp`` / ``StopGradientOp``  reshape, flatten, squeeze, unsqueeze, stop_gradient: views both ways.
``PermuteOp``, ``GetItemOp``, ``ExpandOp``  views torch describes by sizes, strides and an offset
    (``StridedViewOp``): gathered by ``strided_copy`` unless contiguous; backward the inverse
    permutation, ``slice_scatter``, ``sum_to_shape``.
``ConcatOp``  one copy per input; backward the parts of dy (views where contiguous).
``IndexOp``   advanced indexing: ``index_forward``, backward ``index_backward`` or, deterministic,
    ``index_backward_sorted``; an out-of-range index tensor is reported after the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ...core.common import sum_to_shape
from ...core.runtime import RuntimeOp
from .kernels import index_forward, strided_copy
from .launch import IndexLayout, contiguous_copy, contiguous_strides, copy_launch, decode_flag, slice_scatter_launch


class ViewOp(RuntimeOp):
    """A contiguous view with another shape (reshape, flatten, squeeze, unsqueeze, dropout in
    eval mode): no launch forwards or backwards; the gradient is a view of dy (of a row-strided
    dy too, where the view keeps the last dim: a gradient with padded rows passes through)."""

    saves_inputs = False
    strided_grad_output = True

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
            dy, shape = ctx.grad_output, tuple(ctx.input_shapes[0])
            keeps_rows = dy.is_contiguous() or (len(shape) > 0 and shape[-1] == dy.shape[-1])
            ctx.grad_inputs[0] = (dy if keeps_rows else dy.contiguous()).view(shape)
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
        return [slice_scatter_launch(dy, dx, dims)]


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
        y_strides = contiguous_strides(out)
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
