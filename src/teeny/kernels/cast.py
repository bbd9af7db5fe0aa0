"""Casts between dtypes: ``to(x, dtype)`` (``x.to(dtype)``, ``x.float()``, ``x.bfloat16()``, ...).

    y = x.to(dtype)        dx = dy.to(x.dtype)

One kernel serves both directions: an element-wise copy that converts on the store, for every
float, integer and bool dtype (float to integer truncates towards zero and float to bool tests
for non-zero, as PyTorch does). The gradient flows between float dtypes only; a cast to an
integer or bool dtype ends the gradient like PyTorch's. A cast to the input's own dtype is a
view (no launch). Mixed precision uses this op: parameters kept in float32, cast to bfloat16
where they are read, gradients cast back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..graph import graph_of
from ..kernel import ANY_DTYPES, dtype_name, kernel
from ..registry import OpInfo, Sample, make, register
from ..runtime import RuntimeOp
from .common import ELEMENTWISE_BLOCK

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

    def block(self):
        return BLOCK

    def has_backward(self):
        return self.dtype.is_floating_point

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit(src_ptr=inputs[0], dst_ptr=output, n=output.numel(), TO_BOOL=self.dtype == torch.bool)

    def pack_backward_args(
        self,
        inputs,
        params,
        output,
        output_shape,
        grad_output,
        grad_output_row_stride,
        grad_inputs,
        grad_params,
        visitor,
        saved=None,
    ):
        visitor.visit(src_ptr=grad_output, dst_ptr=grad_inputs[0], n=grad_output.numel(), TO_BOOL=False)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)


def to(x, dtype: torch.dtype):
    """``x.to(dtype)``: the values converted to ``dtype``; the gradient is cast back to x's
    dtype (float dtypes only: a cast to an integer or bool dtype passes no gradient)."""
    return graph_of(x).apply(CastOp(dtype), [x])


# -------------------------------------------------------------------------- registry/tests
# The sample's input has the dtype under test; the target dtype is the one the output has
# (``OpInfo.output_dtype``): every float input is cast to every other float dtype here.


_TARGETS = {
    torch.float32: torch.bfloat16,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float64: torch.float64,
}


def _cast_samples(dtype, gen):
    target = _TARGETS[dtype]
    return [
        Sample((make(gen, *shape).to(dtype), target), name=f"{shape} -> {dtype_name(target)}")
        for shape in ((3, 37), (129, 7), (1,), (0, 5))
    ]


register(
    OpInfo(
        "to",
        to,
        lambda x, dtype: x.to(dtype),
        _cast_samples,
        family="cast",
        output_dtype=lambda dtype: _TARGETS[dtype],
        gradcheck_samples=lambda gen: [Sample((make(gen, 4, 5, dtype=torch.float64), torch.float64))],
        notes="float64 gradcheck through a float64 target (a cast to a narrower dtype rounds the "
        "finite differences away); narrowing casts are checked against torch in test_cast.py",
    )
)
