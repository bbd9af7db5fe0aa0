"""Casts between dtypes: ``to(x, dtype)`` (``x.to(dtype)``, ``x.float()``, ``x.bfloat16()``, ...).

    y = x.to(dtype)        dx = dy.to(x.dtype)

One kernel serves both directions: an element-wise copy that converts on the store, for every
float, integer and bool dtype (float to integer truncates towards zero and float to bool tests
for non-zero, as PyTorch does). The gradient flows between float dtypes only; a cast to an
integer or bool dtype ends the gradient like PyTorch's. A cast to the input's own dtype is a
view (no launch). Mixed precision uses this op: parameters kept in float32, cast to bfloat16
where they are read, gradients cast back; parameters that lie side by side in the arena (the
fused q/k/v weights) are cast as one stacked tensor, ``StackedCastOp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.common import ELEMENTWISE_BLOCK, elementwise_grid, side_by_side
from ..core.errors import TeenyError
from ..core.graph import graph_of
from ..core.kernel import ANY_DTYPES, dtype_name, kernel
from ..core.runtime import ArgVisitor, Launch, RuntimeOp

__all__ = ["to"]
NN_LAYERS: list[str] = []

BLOCK = ELEMENTWISE_BLOCK


@triton.jit
def _cast_copy(src_ptr, dst_ptr, n, TO_BOOL: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = src[i] converted to dst's dtype (to bool: src[i] != 0)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(src_ptr + offsets, mask=mask)
    if TO_BOOL:
        value = value != 0
    tl.store(dst_ptr + offsets, value.to(dst_ptr.dtype.element_ty), mask=mask)


# the backward of a cast is the cast back: the same kernel, declared as its own backward pair
cast_backward = kernel(_cast_copy, dtypes=ANY_DTYPES, name="cast_backward")
cast_forward = kernel(_cast_copy, dtypes=ANY_DTYPES, backward=cast_backward, name="cast_forward")


class CastOp(RuntimeOp):
    kernel = cast_forward
    saves_inputs = False
    recomputable = (0,)  # lower(recompute=True): a parameter's half-precision copy cast again in the backward

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = f"to_{dtype_name(dtype)}"

    def check_inputs(self, input_shapes, input_dtypes):
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"to: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype not in ANY_DTYPES:
            raise TypeError(f"to: teeny has no {dtype_name(self.dtype)} tensors")

    def output_dtype(self, input_dtypes):
        return self.dtype

    def view(self, inputs):
        return inputs[0] if inputs[0].dtype == self.dtype else None

    def has_backward(self):
        return self.dtype.is_floating_point

    def forward_launches(self, ctx):
        return [cast_launch(cast_forward, ctx.inputs[0], ctx.output, to_bool=self.dtype == torch.bool)]

    def backward_launches(self, ctx):
        return [cast_launch(cast_backward, ctx.grad_output, ctx.grad_inputs[0])]


def cast_launch(kernel, src: torch.Tensor, dst: torch.Tensor, to_bool: bool = False) -> Launch:
    """One launch of ``kernel`` (``cast_forward`` or ``cast_backward``) writing ``src`` into ``dst`` converted."""
    n = src.numel()
    visitor = ArgVisitor().visit(src_ptr=src, dst_ptr=dst, n=n, TO_BOOL=to_bool)
    return Launch(kernel, elementwise_grid(n, BLOCK), visitor, BLOCK, work=n)


class StackedCastOp(RuntimeOp):
    """to(cat([p_1, ..., p_n]), dtype) of parameters that lie side by side in the arena
    (``adjacent_params``), in one launch each way: mixed precision's cast of the fused q/k/v
    weights (and of their biases), read by the product as one stacked matrix.

        y = [p_1; ...; p_n].to(dtype)        dp_i = dy[rows of p_i].to(p_i.dtype)

    The backward casts dy into the parameters' gradient buffers, which the executor hands out
    side by side too."""

    kernel = cast_forward
    n_activation_inputs = 0  # every input is a parameter
    saves_inputs = False

    def __init__(self, dtype: torch.dtype, parts: int):
        self.dtype, self.parts = dtype, parts
        self.name = f"to_{dtype_name(dtype)}_stacked"
        self.adjacent_params = (tuple(range(parts)),)

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != self.parts:
            raise ValueError(f"{self.name}: expected {self.parts} parameters, got {len(input_shapes)}")
        if len(set(input_dtypes)) != 1 or not input_dtypes[0].is_floating_point or not self.dtype.is_floating_point:
            raise TypeError(f"{self.name}: one float dtype for all parts and a float target, got {set(input_dtypes)}")
        if len({tuple(s[1:]) for s in input_shapes}) != 1 or not input_shapes[0]:
            raise ValueError(f"{self.name}: the parts must agree in every dim but the first, got {input_shapes}")

    def output_shape(self, input_shapes):
        return (sum(s[0] for s in input_shapes), *input_shapes[0][1:])

    def output_dtype(self, input_dtypes):
        return self.dtype

    def has_backward(self):
        return True

    def forward_launches(self, ctx):
        return [cast_launch(cast_forward, side_by_side(ctx, ctx.params, "parameters"), ctx.output)]

    def backward_launches(self, ctx):
        if any(g is None for g in ctx.grad_params):  # adjacent_params keeps them trainable alike
            raise TeenyError(f"{ctx.where}: {self.name} needs the gradient of every part or of none")
        return [cast_launch(cast_backward, ctx.grad_output, side_by_side(ctx, ctx.grad_params, "parameter gradients"))]


def to(x, dtype: torch.dtype):
    """``x.to(dtype)``: the values converted to ``dtype``; the gradient is cast back to x's
    dtype (float dtypes only: a cast to an integer or bool dtype passes no gradient)."""
    return graph_of(x).apply(CastOp(dtype), [x])
