"""Dtype casts: y = x.to(dtype), dx = dy.to(x.dtype).

A model imported from PyTorch changes dtype on purpose (Llama's RMSNorm computes in float32
and casts back; an integer mask becomes a float bias; labels are cast to int64): ``cast``
keeps those casts. The forward converts each element to the output pointer's dtype, the
backward converts the gradient back to the input's dtype; nothing is saved. A cast from an
integer or bool tensor has no gradient to give (the input is not floating point). Narrowing
rounds to nearest even on the GPU; the 3.6 interpreter truncates instead (one unit apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..graph import GraphError, graph_of
from ..kernel import ALL_FLOAT_DTYPES, ANY_DTYPES, dtype_name, kernel
from ..kernels.common import ELEMENTWISE_BLOCK, elementwise_grid
from ..runtime import RuntimeOp


@triton.jit
def _convert(x, target: tl.constexpr, DOWNCAST: tl.constexpr):
    """x in ``target``; to a narrower float rounded to nearest even, as PyTorch does. Between
    float64 and bfloat16 the value goes through float32 (the 3.6 interpreter converts that
    pair wrongly directly)."""
    if x.dtype == tl.float64 and target == tl.bfloat16:
        x = x.to(tl.float32)
    if x.dtype == tl.bfloat16 and target == tl.float64:
        x = x.to(tl.float32)
    if DOWNCAST:
        return x.to(target, fp_downcast_rounding="rtne")
    return x.to(target)


@kernel(dtypes=ALL_FLOAT_DTYPES)
def cast_backward(dy_ptr, dx_ptr, n, DOWNCAST: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    dy = tl.load(dy_ptr + offsets, mask=inside)
    tl.store(dx_ptr + offsets, _convert(dy, dx_ptr.dtype.element_ty, DOWNCAST), mask=inside)


@kernel(backward=cast_backward, dtypes=ANY_DTYPES)
def cast_forward(x_ptr, y_ptr, n, DOWNCAST: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    tl.store(y_ptr + offsets, _convert(x, y_ptr.dtype.element_ty, DOWNCAST), mask=inside)


class CastOp(RuntimeOp):
    """x.to(dtype)."""

    name = "cast"
    kernel = cast_forward
    saves_inputs = False

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def output_dtype(self, input_dtypes):
        return self.dtype

    def block(self):
        return ELEMENTWISE_BLOCK

    def grid(self, input_shapes, output_shape):
        return elementwise_grid(_numel(output_shape), ELEMENTWISE_BLOCK)

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        x = inputs[0]
        downcast = x.is_floating_point() and output.element_size() < x.element_size()
        visitor.visit(x_ptr=x, y_ptr=output, n=output.numel(), DOWNCAST=downcast)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)

    def pack_backward_args(
        self,
        inputs,
        params,
        output,
        output_shape,
        grad_output,
        row_stride,
        grad_inputs,
        grad_params,
        visitor,
        saved=None,
    ):
        dx = grad_inputs[0]
        downcast = dx.element_size() < grad_output.element_size()
        visitor.visit(dy_ptr=grad_output, dx_ptr=dx, n=grad_output.numel(), DOWNCAST=downcast)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cast(x, dtype: torch.dtype):
    """``x.to(dtype)``; the same dtype returns ``x`` itself (no node)."""
    if not isinstance(dtype, torch.dtype):
        raise GraphError(f"cast: dtype must be a torch.dtype, got {dtype!r}")
    if x.dtype == dtype:
        return x
    if dtype not in ANY_DTYPES:
        raise GraphError(f"cast: no kernel casts to {dtype_name(dtype)}")
    return graph_of(x).apply(CastOp(dtype), [x])
