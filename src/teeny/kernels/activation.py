"""Activations: y = f(x) element-wise, dx = f'(x) * dy.

One kernel pair serves every activation: ``activation_forward`` applies the op's ``fn(x, a, b)``
and ``activation_backward`` its ``grad(x, dy, a, b)`` (the derivative times dy, recomputed from
the saved input x), both small ``@triton.jit`` functions passed as compile-time constants, so
each activation compiles to its own specialised kernel. ``a`` and ``b`` carry the op's scalar
arguments (negative_slope, alpha, beta, threshold, ...). Half-precision inputs are computed in
float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..graph import graph_of
from ..kernel import kernel
from ..module import Module
from ..registry import OpInfo, Sample, away_from, make, register
from ..runtime import ArgVisitor, RuntimeOp
from .common import elementwise_grid, upcast

__all__ = ["relu", "gelu"]
NN_LAYERS = ["ReLU", "GELU"]

BLOCK = 1024


@kernel(half=True)
def activation_backward(x_ptr, dy_ptr, dx_ptr, n, a, b, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    tl.store(dx_ptr + offsets, GRAD(x, dy, a, b).to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(backward=activation_backward, half=True)
def activation_forward(x_ptr, y_ptr, n, a, b, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, FN(x, a, b).to(y_ptr.dtype.element_ty), mask=mask)


class ActivationOp(RuntimeOp):
    """An element-wise activation: ``fn``/``grad`` are its @triton.jit maths."""

    saves_inputs = True

    def __init__(self, name: str, fn, grad, a: float = 0.0, b: float = 0.0):
        self.name, self.fn, self.grad, self.a, self.b = name, fn, grad, float(a), float(b)
        self.kernel = activation_forward

    def pack_args(self, inputs, params, output, output_shape, visitor: ArgVisitor, saved=None):
        (x,) = inputs
        visitor.visit_ptr(x).visit_ptr(output).visit_i64(x.numel()).visit_f32(self.a).visit_f32(self.b)
        visitor.visit_constexpr(self.fn).visit_constexpr(BLOCK)

    def grid(self, input_shapes, output_shape):
        return elementwise_grid(math.prod(output_shape), BLOCK)

    def has_backward(self):
        return True

    def pack_backward_args(self, inputs, params, output, output_shape, grad_output, grad_output_row_stride,
                           grad_inputs, grad_params, visitor: ArgVisitor, saved=None):
        (x,), (dx,) = inputs, grad_inputs
        visitor.visit_ptr(x).visit_ptr(grad_output).visit_ptr(dx).visit_i64(x.numel())
        visitor.visit_f32(self.a).visit_f32(self.b).visit_constexpr(self.grad).visit_constexpr(BLOCK)

    def backward_grid(self, input_shapes, output_shape):
        return elementwise_grid(math.prod(output_shape), BLOCK)


def _activation(x, name, fn, grad, a=0.0, b=0.0):
    return graph_of(x).apply(ActivationOp(name, fn, grad, a, b), [x])


# ---------------------------------------------------------------------------------- maths
# Each activation: fn(x, a, b) -> y and grad(x, dy, a, b) -> dx, computed in float32/64.


@triton.jit
def _relu(x, a, b):
    return tl.where(x > 0, x, 0.0)


@triton.jit
def _relu_grad(x, dy, a, b):
    return tl.where(x > 0, dy, 0.0)


@triton.jit
def _tanh(x):
    # tanh through exp, stable for large |x|
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@triton.jit
def _gelu_tanh(x, a, b):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def _gelu_tanh_grad(x, dy, a, b):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = _tanh(inner)
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


@triton.jit
def _gelu_erf(x, a, b):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_erf_grad(x, dy, a, b):
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    pdf = 0.3989422804014327 * tl.exp(-0.5 * x * x)
    return dy * (cdf + x * pdf)


# ------------------------------------------------------------------------- functional ops


def relu(x):
    """max(x, 0); the gradient at 0 is 0, as in PyTorch."""
    return _activation(x, "relu", _relu, _relu_grad)


def gelu(x, approximate: str = "none"):
    """x * Phi(x) (``approximate="none"``, erf form) or its tanh approximation (``"tanh"``)."""
    if approximate == "tanh":
        return _activation(x, "gelu_tanh", _gelu_tanh, _gelu_tanh_grad)
    if approximate == "none":
        return _activation(x, "gelu", _gelu_erf, _gelu_erf_grad)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# ---------------------------------------------------------------------------------- layers


class ReLU(Module):
    def forward(self, x):
        return relu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return gelu(x, self.approximate)


# -------------------------------------------------------------------------- registry/tests


def _unary_samples(kinks=()):
    def samples(dtype, gen):
        shapes = [(3, 37), (129, 7), (1,), (0, 5)]
        return [Sample((away_from(make(gen, *s, low=-3, high=3), kinks).to(dtype),), name=str(s)) for s in shapes]
    return samples


_KERNELS = (activation_forward, activation_backward)
register(OpInfo("relu", relu, F.relu, _unary_samples((0.0,)), family="activation", kernels=_KERNELS))
register(OpInfo("gelu", gelu, F.gelu, _unary_samples(), family="activation", kernels=_KERNELS))
register(OpInfo("gelu_tanh", lambda x: gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"),
                _unary_samples(), family="activation", kernels=_KERNELS))
