"""Activations: y = f(x) element-wise, dx = f'(x) * dy; plus the gated ones and PReLU.

Element-wise unary activations share one kernel pair: ``activation_forward`` applies the op's
``fn(x, a, b)`` and ``activation_backward`` its ``grad(x, dy, a, b)`` (the derivative times dy,
recomputed from the saved input x), both small ``@triton.jit`` functions passed as compile-time
constants, so each activation compiles to its own specialised kernel. ``a`` and ``b`` carry the
op's scalar arguments (negative_slope, alpha, beta, threshold, ...). Half-precision inputs are
computed in float32. Gradients at kinks follow PyTorch's backward formulas exactly (relu'(0) = 0,
leaky_relu'(0) = negative_slope, hardtanh' = 0 at both bounds, ...).

Gated activations (``glu``, ``swiglu``) share a second pair, ``gated_forward``/``gated_backward``:
y = u * act(g), where (u, g) are the two halves of x along ``dim`` (glu, act = sigmoid) or two
separate inputs (swiglu: g = gate, u = up, act = silu). ``prelu`` has its own pair, its weight
gradient reduced per channel with fp32 partials and a second pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import init as _init
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, away_from, make, register
from ..runtime import ArgVisitor, RuntimeOp
from .common import ELEMENTWISE_BLOCK, cdiv, elementwise_grid, upcast

__all__ = [
    "relu", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "sigmoid", "tanh", "softplus",
    "softsign", "hardtanh", "relu6", "hardsigmoid", "hardswish", "logsigmoid", "tanhshrink", "softshrink",
    "hardshrink", "threshold", "prelu", "glu", "swiglu",
]
NN_LAYERS = [
    "ReLU", "LeakyReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Softplus",
    "Softsign", "Hardtanh", "ReLU6", "Hardsigmoid", "Hardswish", "LogSigmoid", "Tanhshrink", "Softshrink",
    "Hardshrink", "Threshold", "PReLU", "GLU",
]

BLOCK = ELEMENTWISE_BLOCK


# ------------------------------------------------------------------ unary kernel template


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
# Helpers, then each activation: fn(x, a, b) -> y and grad(x, dy, a, b) -> dx, computed in
# float32/64. Comparisons are written like PyTorch's kernels, so kinks and NaNs behave alike.


@triton.jit
def _sigmoid(x):
    # 1 / (1 + exp(-x)) without overflow: exp of a non-positive number only
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _log1p(u):
    # accurate log(1 + u) for small u (Goldberg): log(w) * u / (w - 1) with w = 1 + u
    w = 1.0 + u
    d = w - 1.0
    return tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _expm1(x):
    # exp(x) - 1, accurate for small |x| (Kahan): (w - 1) * x / log(w) with w = exp(x)
    w = tl.exp(x)
    small = tl.abs(x) < 0.5
    ws = tl.where(small, w, 2.0)
    log_w = tl.log(ws)
    kahan = (ws - 1.0) * (x / tl.where(log_w == 0.0, 1.0, log_w))
    return tl.where(small, tl.where(ws == 1.0, x, kahan), w - 1.0)


@triton.jit
def _tanh(x):
    # tanh(|x|) = -expm1(-2|x|) / (2 + expm1(-2|x|)): no overflow, accurate near 0
    e = _expm1(-2.0 * tl.abs(x))
    t = -e / (2.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _softplus(x):
    # log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))
    return tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _relu(x, a, b):
    return tl.where(x < 0, 0.0, x)


@triton.jit
def _relu_grad(x, dy, a, b):
    return tl.where(x <= 0, 0.0, dy)


@triton.jit
def _leaky_relu(x, a, b):  # a = negative_slope
    return tl.where(x > 0, x, x * a)


@triton.jit
def _leaky_relu_grad(x, dy, a, b):
    return tl.where(x > 0, dy, dy * a)


@triton.jit
def _elu(x, a, b):  # a = alpha, b = scale (1 for elu; selu's constants for selu)
    return b * tl.where(x > 0, x, a * _expm1(x))


@triton.jit
def _elu_grad(x, dy, a, b):
    return tl.where(x <= 0, dy * (b * a) * tl.exp(x), dy * b)


@triton.jit
def _celu(x, a, b):  # a = alpha: x > 0 ? x : alpha * (exp(x / alpha) - 1)
    return tl.where(x > 0, x, a * _expm1(x / a))


@triton.jit
def _celu_grad(x, dy, a, b):
    return tl.where(x <= 0, dy * tl.exp(x / a), dy)


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


@triton.jit
def _silu(x, a, b):
    return x * _sigmoid(x)


@triton.jit
def _silu_grad(x, dy, a, b):
    s = _sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


@triton.jit
def _mish(x, a, b):
    return x * _tanh(_softplus(x))


@triton.jit
def _mish_grad(x, dy, a, b):
    t = _tanh(_softplus(x))
    return dy * (t + x * _sigmoid(x) * (1.0 - t * t))


@triton.jit
def _sigmoid_fn(x, a, b):
    return _sigmoid(x)


@triton.jit
def _sigmoid_grad(x, dy, a, b):
    s = _sigmoid(x)
    return dy * s * (1.0 - s)


@triton.jit
def _tanh_fn(x, a, b):
    return _tanh(x)


@triton.jit
def _tanh_grad(x, dy, a, b):
    t = _tanh(x)
    return dy * (1.0 - t * t)


@triton.jit
def _softplus_fn(x, a, b):  # a = beta, b = threshold: linear where x * beta > threshold
    xb = x * a
    return tl.where(xb > b, x, _softplus(xb) / a)


@triton.jit
def _softplus_grad(x, dy, a, b):
    xb = x * a
    return tl.where(xb > b, dy, dy * _sigmoid(xb))


@triton.jit
def _softsign(x, a, b):
    return x / (1.0 + tl.abs(x))


@triton.jit
def _softsign_grad(x, dy, a, b):
    d = 1.0 + tl.abs(x)
    return dy / (d * d)


@triton.jit
def _hardtanh(x, a, b):  # a = min_val, b = max_val
    return tl.where(x < a, a, tl.where(x > b, b, x))


@triton.jit
def _hardtanh_grad(x, dy, a, b):
    return tl.where((x <= a) | (x >= b), 0.0, dy)


@triton.jit
def _hardsigmoid(x, a, b):
    return tl.where(x <= -3.0, 0.0, tl.where(x >= 3.0, 1.0, x / 6.0 + 0.5))


@triton.jit
def _hardsigmoid_grad(x, dy, a, b):
    return tl.where((x > -3.0) & (x < 3.0), dy / 6.0, 0.0)


@triton.jit
def _hardswish(x, a, b):
    return x * tl.where(x <= -3.0, 0.0, tl.where(x >= 3.0, 6.0, x + 3.0)) / 6.0


@triton.jit
def _hardswish_grad(x, dy, a, b):
    return tl.where(x <= -3.0, 0.0, tl.where(x < 3.0, dy * (x / 3.0 + 0.5), dy))


@triton.jit
def _logsigmoid(x, a, b):  # -softplus(-x)
    return tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x)))


@triton.jit
def _logsigmoid_grad(x, dy, a, b):
    return dy * _sigmoid(-x)


@triton.jit
def _tanhshrink(x, a, b):
    return x - _tanh(x)


@triton.jit
def _tanhshrink_grad(x, dy, a, b):
    t = _tanh(x)
    return dy * t * t


@triton.jit
def _softshrink(x, a, b):  # a = lambd
    return tl.where(x > a, x - a, tl.where(x < -a, x + a, x * 0.0))


@triton.jit
def _softshrink_grad(x, dy, a, b):
    return tl.where((x >= -a) & (x <= a), 0.0, dy)


@triton.jit
def _hardshrink(x, a, b):  # a = lambd
    return tl.where((x >= -a) & (x <= a), 0.0, x)


@triton.jit
def _hardshrink_grad(x, dy, a, b):
    return tl.where((x >= -a) & (x <= a), 0.0, dy)


@triton.jit
def _threshold(x, a, b):  # a = threshold, b = value
    return tl.where(x <= a, b, x)


@triton.jit
def _threshold_grad(x, dy, a, b):
    return tl.where(x <= a, 0.0, dy)


# ------------------------------------------------------------------------- functional ops

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def relu(x, inplace: bool = False):
    """max(x, 0); the gradient at 0 is 0, as in PyTorch. (``inplace`` is accepted for
    PyTorch compatibility; a graph op always makes a new value.)"""
    return _activation(x, "relu", _relu, _relu_grad)


def leaky_relu(x, negative_slope: float = 0.01, inplace: bool = False):
    """x if x > 0 else negative_slope * x; the gradient at 0 is negative_slope."""
    return _activation(x, "leaky_relu", _leaky_relu, _leaky_relu_grad, negative_slope)


def elu(x, alpha: float = 1.0, inplace: bool = False):
    """x if x > 0 else alpha * (exp(x) - 1); the gradient at 0 is alpha."""
    return _activation(x, "elu", _elu, _elu_grad, alpha, 1.0)


def selu(x, inplace: bool = False):
    """scale * elu(x, alpha) with PyTorch's constants alpha = 1.6733, scale = 1.0507."""
    return _activation(x, "selu", _elu, _elu_grad, _SELU_ALPHA, _SELU_SCALE)


def celu(x, alpha: float = 1.0, inplace: bool = False):
    """x if x > 0 else alpha * (exp(x / alpha) - 1)."""
    if alpha == 0:
        raise ValueError("celu: alpha cannot be 0")
    return _activation(x, "celu", _celu, _celu_grad, alpha)


def gelu(x, approximate: str = "none"):
    """x * Phi(x) (``approximate="none"``, erf form) or its tanh approximation (``"tanh"``)."""
    if approximate == "tanh":
        return _activation(x, "gelu_tanh", _gelu_tanh, _gelu_tanh_grad)
    if approximate == "none":
        return _activation(x, "gelu", _gelu_erf, _gelu_erf_grad)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def silu(x, inplace: bool = False):
    """x * sigmoid(x)."""
    return _activation(x, "silu", _silu, _silu_grad)


def mish(x, inplace: bool = False):
    """x * tanh(softplus(x))."""
    return _activation(x, "mish", _mish, _mish_grad)


def sigmoid(x):
    """1 / (1 + exp(-x))."""
    return _activation(x, "sigmoid", _sigmoid_fn, _sigmoid_grad)


def tanh(x):
    """tanh(x)."""
    return _activation(x, "tanh", _tanh_fn, _tanh_grad)


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold."""
    if beta == 0:
        raise ValueError("softplus: beta cannot be 0")
    return _activation(x, "softplus", _softplus_fn, _softplus_grad, beta, threshold)


def softsign(x):
    """x / (1 + |x|)."""
    return _activation(x, "softsign", _softsign, _softsign_grad)


def hardtanh(x, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
    """clamp(x, min_val, max_val); the gradient is 0 at and beyond both bounds."""
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val cannot be greater than max_val (got {min_val} > {max_val})")
    return _activation(x, "hardtanh", _hardtanh, _hardtanh_grad, min_val, max_val)


def relu6(x, inplace: bool = False):
    """hardtanh(x, 0, 6) (so the gradient at 0 and at 6 is 0, as in PyTorch)."""
    return _activation(x, "relu6", _hardtanh, _hardtanh_grad, 0.0, 6.0)


def hardsigmoid(x, inplace: bool = False):
    """relu6(x + 3) / 6; the gradient is 1/6 strictly inside (-3, 3), else 0."""
    return _activation(x, "hardsigmoid", _hardsigmoid, _hardsigmoid_grad)


def hardswish(x, inplace: bool = False):
    """x * relu6(x + 3) / 6."""
    return _activation(x, "hardswish", _hardswish, _hardswish_grad)


def logsigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), computed without overflow."""
    return _activation(x, "logsigmoid", _logsigmoid, _logsigmoid_grad)


def tanhshrink(x):
    """x - tanh(x)."""
    return _activation(x, "tanhshrink", _tanhshrink, _tanhshrink_grad)


def softshrink(x, lambd: float = 0.5):
    """x - lambd if x > lambd, x + lambd if x < -lambd, else 0; lambd must be >= 0."""
    if not lambd >= 0:
        raise ValueError(f"softshrink: lambd must be greater or equal to 0, got {lambd}")
    return _activation(x, "softshrink", _softshrink, _softshrink_grad, lambd)


def hardshrink(x, lambd: float = 0.5):
    """0 where -lambd <= x <= lambd, else x."""
    return _activation(x, "hardshrink", _hardshrink, _hardshrink_grad, lambd)


def threshold(x, threshold: float, value: float, inplace: bool = False):
    """value where x <= threshold, else x; the gradient is 0 where x <= threshold."""
    return _activation(x, "threshold", _threshold, _threshold_grad, threshold, value)


# -------------------------------------------------------------- gated: glu and swiglu


@kernel(half=True)
def gated_backward(u_ptr, g_ptr, dy_ptr, du_ptr, dg_ptr, n, half_row, row_stride, g_offset, ACT: tl.constexpr,
                   ACT_GRAD: tl.constexpr, SPLIT: tl.constexpr, WRITE_DU: tl.constexpr, WRITE_DG: tl.constexpr,
                   BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SPLIT:
        src = (offsets // half_row) * row_stride + offsets % half_row
    else:
        src = offsets
    u = upcast(tl.load(u_ptr + src, mask=mask, other=0.0))
    g = upcast(tl.load(g_ptr + g_offset + src, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    if WRITE_DU:
        tl.store(du_ptr + src, (dy * ACT(g, 0.0, 0.0)).to(du_ptr.dtype.element_ty), mask=mask)
    if WRITE_DG:
        tl.store(dg_ptr + g_offset + src, ACT_GRAD(g, dy * u, 0.0, 0.0).to(dg_ptr.dtype.element_ty), mask=mask)


@kernel(backward=gated_backward, half=True)
def gated_forward(u_ptr, g_ptr, y_ptr, n, half_row, row_stride, g_offset, ACT: tl.constexpr, SPLIT: tl.constexpr,
                  BLOCK: tl.constexpr):
    """y = u * act(g); du = dy * act(g), dg = act'(g) * dy * u. Output element i reads u at
    src(i) = (i // half_row) * row_stride + i % half_row (SPLIT: the halves of a row) or
    src(i) = i, and g at src(i) + g_offset."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SPLIT:
        src = (offsets // half_row) * row_stride + offsets % half_row
    else:
        src = offsets
    u = upcast(tl.load(u_ptr + src, mask=mask, other=0.0))
    g = upcast(tl.load(g_ptr + g_offset + src, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, (u * ACT(g, 0.0, 0.0)).to(y_ptr.dtype.element_ty), mask=mask)


class GatedOp(RuntimeOp):
    """y = u * act(g): ``glu`` (u, g = the halves of one input along ``dim``) or ``swiglu``
    (g = gate, u = up: two inputs of one shape)."""

    kernel = gated_forward
    saves_inputs = True

    def __init__(self, name: str, act, act_grad, dim: int | None):
        self.name, self.act, self.act_grad, self.dim = name, act, act_grad, dim
        self.n_activation_inputs = 1 if dim is not None else 2

    def check_inputs(self, input_shapes, input_dtypes):
        if self.dim is None:
            gate, up = input_shapes
            if tuple(gate) != tuple(up):
                raise ValueError(f"gate and up must have the same shape, got {tuple(gate)} and {tuple(up)}")
            return
        (shape,) = input_shapes
        if len(shape) == 0:
            raise ValueError("glu does not support scalars because halving size must be even")
        if not -len(shape) <= self.dim < len(shape):
            raise ValueError(f"dim {self.dim} is out of range for a {len(shape)}-d input")
        if shape[self.dim % len(shape)] % 2:
            raise ValueError(f"halving dimension must be even, but dimension {self.dim % len(shape)} is size "
                             f"{shape[self.dim % len(shape)]}")

    def output_shape(self, input_shapes):
        shape = list(input_shapes[0])
        if self.dim is not None:
            shape[self.dim % len(shape)] //= 2
        return tuple(shape)

    def _layout(self, input_shapes, output_shape):
        """(half_row, row_stride, g_offset, split) of the launch."""
        n = math.prod(output_shape)
        if self.dim is None:
            return max(n, 1), max(n, 1), 0, False
        shape = input_shapes[0]
        dim = self.dim % len(shape)
        half_row = (shape[dim] // 2) * math.prod(shape[dim + 1:])
        return max(half_row, 1), 2 * half_row, half_row, True

    def _sources(self, inputs):
        return (inputs[0], inputs[0]) if self.dim is not None else (inputs[1], inputs[0])  # (u, g)

    def forward(self, ctx):
        half_row, row_stride, g_offset, split = self._layout(ctx.input_shapes, ctx.output_shape)
        u, g = self._sources(ctx.inputs)
        visitor = ArgVisitor().visit_ptr(u).visit_ptr(g).visit_ptr(ctx.output).visit_i64(ctx.output.numel())
        visitor.visit_i64(half_row).visit_i64(row_stride).visit_i64(g_offset)
        visitor.visit_constexpr(self.act).visit_constexpr(split).visit_constexpr(BLOCK)
        ctx.launch(gated_forward, elementwise_grid(ctx.output.numel(), BLOCK), visitor)

    def has_backward(self):
        return True

    def backward(self, ctx):
        half_row, row_stride, g_offset, split = self._layout(ctx.input_shapes, ctx.output_shape)
        u, g = self._sources(ctx.inputs)
        if self.dim is not None:
            du = dg = ctx.grad_inputs[0]
        else:
            dg, du = ctx.grad_inputs
        visitor = ArgVisitor().visit_ptr(u).visit_ptr(g).visit_ptr(ctx.grad_output)
        visitor.visit_ptr(du if du is not None else dg).visit_ptr(dg if dg is not None else du)
        visitor.visit_i64(ctx.grad_output.numel()).visit_i64(half_row).visit_i64(row_stride).visit_i64(g_offset)
        visitor.visit_constexpr(self.act).visit_constexpr(self.act_grad).visit_constexpr(split)
        visitor.visit_constexpr(du is not None).visit_constexpr(dg is not None).visit_constexpr(BLOCK)
        ctx.launch(gated_backward, elementwise_grid(ctx.grad_output.numel(), BLOCK), visitor)


def glu(x, dim: int = -1):
    """a * sigmoid(b), where a and b are the first and second halves of x along ``dim``
    (whose size must be even)."""
    return graph_of(x).apply(GatedOp("glu", _sigmoid_fn, _sigmoid_grad, int(dim)), [x])


def swiglu(gate, up):
    """silu(gate) * up (two inputs of the same shape; both get gradients)."""
    return graph_of(gate, up).apply(GatedOp("swiglu", _silu, _silu_grad, None), [gate, up])


# --------------------------------------------------------------------------------- prelu


@kernel(half=True)
def prelu_backward(x_ptr, w_ptr, dy_ptr, dx_ptr, partial_ptr, per_channel, channels, inner, splits,
                   WRITE_DX: tl.constexpr, WRITE_DW: tl.constexpr, BLOCK: tl.constexpr):
    """Program (c, s) walks the elements of channel c (x viewed as (outer, C, inner)) in
    BLOCK-wide steps s, s + splits, ...: writes dx = dy if x > 0 else w[c] * dy and the
    partial sum of dw[c] = sum(x * dy where x <= 0) (float32, float64 for float64) into
    partial[c, s]; ``prelu_weight_reduce`` sums the partials over s."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    w = upcast(tl.load(w_ptr + c))
    acc = tl.zeros([BLOCK], dtype=partial_ptr.dtype.element_ty)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(s.to(tl.int64) * BLOCK, per_channel, splits * BLOCK):
        j = start + lanes
        mask = j < per_channel
        offsets = (j // inner) * (channels * inner) + c * inner + j % inner
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        if WRITE_DX:
            tl.store(dx_ptr + offsets, tl.where(x > 0, dy, w * dy).to(dx_ptr.dtype.element_ty), mask=mask)
        if WRITE_DW:
            acc += tl.where(x > 0, 0.0, x * dy).to(acc.dtype)
    if WRITE_DW:
        tl.store(partial_ptr + c * splits + s, tl.sum(acc, axis=0))


@kernel(half=True)
def prelu_weight_reduce(partial_ptr, dw_ptr, splits, BLOCK: tl.constexpr):
    """dw[c] = sum over s of partial[c, s] (the second pass of prelu's weight gradient)."""
    c = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=partial_ptr.dtype.element_ty)
    for start in range(0, splits, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + c * splits + idx, mask=idx < splits, other=0.0)
    tl.store(dw_ptr + c, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty))


@kernel(backward=(prelu_backward, prelu_weight_reduce), half=True)
def prelu_forward(x_ptr, w_ptr, y_ptr, n, channels, inner, BLOCK: tl.constexpr):
    """y = x if x > 0 else w[c] * x, with c = (i // inner) % channels the channel (dim 1) of
    element i. Backward: see prelu_backward."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    w = upcast(tl.load(w_ptr + (offsets // inner) % channels, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, tl.where(x > 0, x, w * x).to(y_ptr.dtype.element_ty), mask=mask)


PRELU_TARGET_PROGRAMS = 1024  # backward: split channels until about this many programs run
REDUCE_BLOCK = 128


class PReLUOp(RuntimeOp):
    """prelu(x, weight): weight (1,) (or a scalar) shared by all elements, or (C,) along dim 1."""

    name = "prelu"
    kernel = prelu_forward
    saves_inputs = True

    def param_shapes(self, input_shapes):
        return [None]

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes
        if len(w) > 1:
            raise ValueError(f"weight must be a scalar or a 1-d tensor, got shape {tuple(w)}")
        channels = x[1] if len(x) >= 2 else 1
        numel = math.prod(w)
        if numel != 1 and numel != channels:
            raise ValueError(f"weight has {numel} parameters but the input has {channels} channels "
                             f"(dim 1 of shape {tuple(x)}); use 1 parameter or one per channel")

    @staticmethod
    def _layout(input_shapes):
        """(channels, inner, per_channel) with x viewed as (outer, channels, inner)."""
        x, w = input_shapes
        n = math.prod(x)
        if math.prod(w) == 1:
            return 1, 1, n
        channels, inner = x[1], math.prod(x[2:])
        return channels, inner, n // channels if channels else 0

    def forward(self, ctx):
        channels, inner, _ = self._layout(ctx.input_shapes)
        (x,), (w,) = ctx.inputs, ctx.params
        n = x.numel()
        visitor = ArgVisitor().visit_ptr(x).visit_ptr(w).visit_ptr(ctx.output).visit_i64(n)
        visitor.visit_i64(channels).visit_i64(inner).visit_constexpr(BLOCK)
        ctx.launch(prelu_forward, elementwise_grid(n, BLOCK), visitor)

    def has_backward(self):
        return True

    def backward_kernels(self):
        return (prelu_backward, prelu_weight_reduce)

    def backward(self, ctx):
        channels, inner, per_channel = self._layout(ctx.input_shapes)
        (x,), (w,) = ctx.inputs, ctx.params
        (dx,), (dw,) = ctx.grad_inputs, ctx.grad_params
        splits = max(1, min(cdiv(per_channel, BLOCK), cdiv(PRELU_TARGET_PROGRAMS, max(channels, 1))))
        acc_dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        partial = ctx.empty((channels * splits if dw is not None else 1,), acc_dtype)
        visitor = ArgVisitor().visit_ptr(x).visit_ptr(w).visit_ptr(ctx.grad_output)
        visitor.visit_ptr(dx if dx is not None else partial).visit_ptr(partial)
        visitor.visit_i64(per_channel).visit_i64(channels).visit_i64(inner).visit_i64(splits)
        visitor.visit_constexpr(dx is not None).visit_constexpr(dw is not None).visit_constexpr(BLOCK)
        # the weight gradient has work (zeros) even for an empty input
        ctx.launch(prelu_backward, (channels, splits, 1), visitor, work=channels if dw is not None else None)
        if dw is not None:
            reduce = ArgVisitor().visit_ptr(partial).visit_ptr(dw).visit_i64(splits).visit_constexpr(REDUCE_BLOCK)
            ctx.launch(prelu_weight_reduce, (channels, 1, 1), reduce, work=channels)


def prelu(x, weight):
    """x if x > 0 else weight * x; ``weight`` has 1 element or one per channel (dim 1 of x)."""
    return graph_of(x, weight).apply(PReLUOp(), [x, weight])


# ---------------------------------------------------------------------------------- layers


class _Activation(Module):
    """A layer applying ``FN`` with the keyword arguments given at construction."""

    FN = None

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return type(self).FN(x, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


class ReLU(_Activation):
    FN = relu

    def __init__(self, inplace: bool = False):
        super().__init__()


class LeakyReLU(_Activation):
    FN = leaky_relu

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__(negative_slope=negative_slope)


class ELU(_Activation):
    FN = elu

    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__(alpha=alpha)


class SELU(_Activation):
    FN = selu

    def __init__(self, inplace: bool = False):
        super().__init__()


class CELU(_Activation):
    FN = celu

    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__(alpha=alpha)


class GELU(_Activation):
    FN = gelu

    def __init__(self, approximate: str = "none"):
        super().__init__(approximate=approximate)


class SiLU(_Activation):
    FN = silu

    def __init__(self, inplace: bool = False):
        super().__init__()


class Mish(_Activation):
    FN = mish

    def __init__(self, inplace: bool = False):
        super().__init__()


class Sigmoid(_Activation):
    FN = sigmoid


class Tanh(_Activation):
    FN = tanh


class Softplus(_Activation):
    FN = softplus

    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__(beta=beta, threshold=threshold)


class Softsign(_Activation):
    FN = softsign


class Hardtanh(_Activation):
    FN = hardtanh

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        super().__init__(min_val=min_val, max_val=max_val)


class ReLU6(_Activation):
    FN = relu6

    def __init__(self, inplace: bool = False):
        super().__init__()


class Hardsigmoid(_Activation):
    FN = hardsigmoid

    def __init__(self, inplace: bool = False):
        super().__init__()


class Hardswish(_Activation):
    FN = hardswish

    def __init__(self, inplace: bool = False):
        super().__init__()


class LogSigmoid(_Activation):
    FN = logsigmoid


class Tanhshrink(_Activation):
    FN = tanhshrink


class Softshrink(_Activation):
    FN = softshrink

    def __init__(self, lambd: float = 0.5):
        super().__init__(lambd=lambd)


class Hardshrink(_Activation):
    FN = hardshrink

    def __init__(self, lambd: float = 0.5):
        super().__init__(lambd=lambd)


class Threshold(_Activation):
    FN = threshold

    def __init__(self, threshold: float, value: float, inplace: bool = False):
        super().__init__(threshold=threshold, value=value)


class GLU(_Activation):
    FN = glu

    def __init__(self, dim: int = -1):
        super().__init__(dim=dim)


class PReLU(Module):
    """prelu with a learnt ``weight`` of ``num_parameters`` elements, initialised to ``init``."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_parameters = num_parameters
        self.weight = Parameter((num_parameters,), _init.constant(init), dtype=dtype)

    def forward(self, x):
        return prelu(x, self.weight)


# -------------------------------------------------------------------------- registry/tests

_SHAPES = [(3, 37), (129, 7), (1,), (0, 5)]
_GRADCHECK_SHAPES = [(2, 9), (1,)]


def _unary_samples(kinks=(), low=-3.0, high=3.0, kwargs=({},), shapes=_SHAPES):
    """Samples on ``shapes``, values in [low, high) pushed away from ``kinks``; the i-th
    shape gets the i-th keyword set (cyclically)."""
    def samples(dtype, gen):
        return [Sample((away_from(make(gen, *s, low=low, high=high), kinks).to(dtype),), dict(kwargs[i % len(kwargs)]),
                       name=f"{s} {kwargs[i % len(kwargs)]}") for i, s in enumerate(shapes)]
    return samples


def _register_unary(name, fn, ref, kinks=(), low=-3.0, high=3.0, kwargs=({},)):
    register(OpInfo(name, fn, ref, _unary_samples(kinks, low, high, kwargs), family="activation",
                    kernels=(activation_forward, activation_backward),
                    gradcheck_samples=lambda gen: _unary_samples(kinks, low, high, kwargs, _GRADCHECK_SHAPES)(torch.float64, gen)))


_register_unary("relu", relu, F.relu, (0.0,))
_register_unary("leaky_relu", leaky_relu, F.leaky_relu, (0.0,), kwargs=({}, {"negative_slope": 0.2}))
_register_unary("elu", elu, F.elu, (0.0,), kwargs=({}, {"alpha": 0.5}))
_register_unary("selu", selu, F.selu, (0.0,))
_register_unary("celu", celu, F.celu, (0.0,), kwargs=({}, {"alpha": 2.0}))
_register_unary("gelu", gelu, F.gelu)
_register_unary("gelu_tanh", lambda x: gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"))
_register_unary("silu", silu, F.silu, low=-8.0, high=8.0)
_register_unary("mish", mish, F.mish, low=-8.0, high=8.0)
_register_unary("sigmoid", sigmoid, torch.sigmoid, low=-8.0, high=8.0)
_register_unary("tanh", tanh, torch.tanh)
_register_unary("softplus", softplus, F.softplus, (0.5,), low=-8.0, high=8.0,
                kwargs=({}, {"beta": 2.0, "threshold": 1.0}))
_register_unary("softsign", softsign, F.softsign)
_register_unary("hardtanh", hardtanh, F.hardtanh, (-1.0, 1.0, -0.5, 2.0),
                kwargs=({}, {"min_val": -0.5, "max_val": 2.0}))
_register_unary("relu6", relu6, F.relu6, (0.0, 6.0), low=-2.0, high=8.0)
_register_unary("hardsigmoid", hardsigmoid, F.hardsigmoid, (-3.0, 3.0), low=-5.0, high=5.0)
_register_unary("hardswish", hardswish, F.hardswish, (-3.0, 3.0), low=-5.0, high=5.0)
_register_unary("logsigmoid", logsigmoid, F.logsigmoid, low=-20.0, high=20.0)
_register_unary("tanhshrink", tanhshrink, F.tanhshrink)
_register_unary("softshrink", softshrink, F.softshrink, (-0.5, 0.5, -1.0, 1.0), kwargs=({}, {"lambd": 1.0}))
_register_unary("hardshrink", hardshrink, F.hardshrink, (-0.5, 0.5, -1.0, 1.0), kwargs=({}, {"lambd": 1.0}))
_register_unary("threshold", threshold, F.threshold, (0.5, -1.0),
                kwargs=({"threshold": 0.5, "value": -2.0}, {"threshold": -1.0, "value": 3.0}))


def _prelu_samples(shapes):
    def samples(dtype, gen):
        out = []
        for x_shape, w_shape in shapes:
            x = away_from(make(gen, *x_shape), (0.0,)).to(dtype)
            w = make(gen, *w_shape, low=-0.5, high=0.5).to(dtype)
            channels = w.numel() if w.numel() > 1 else 1
            out.append(Sample((x, w), name=f"x{x_shape} w{w_shape}",
                              reduction=max(1, x.numel() // max(channels, 1))))
        return out
    return samples


register(OpInfo("prelu", prelu, F.prelu,
                _prelu_samples([((3, 5, 7), (5,)), ((37, 3), (1,)), ((4, 3), (3,)), ((6,), (1,)), ((0, 3), (3,)),
                                ((), (1,)), ((2, 3), ())]),
                family="activation", kernels=(prelu_forward, prelu_backward, prelu_weight_reduce),
                gradcheck_samples=lambda gen: _prelu_samples([((2, 3, 3), (3,)), ((5,), (1,))])(torch.float64, gen)))


def _glu_samples(cases):
    def samples(dtype, gen):
        return [Sample((make(gen, *s).to(dtype),), {"dim": d}, name=f"{s} dim={d}") for s, d in cases]
    return samples


register(OpInfo("glu", glu, F.glu, _glu_samples([((3, 38), -1), ((4, 6, 5), 1), ((6,), 0), ((2, 0, 4), 2)]),
                family="activation", kernels=(gated_forward, gated_backward),
                gradcheck_samples=lambda gen: _glu_samples([((3, 4), -1), ((2, 4, 3), 1)])(torch.float64, gen)))


def _swiglu_samples(shapes):
    def samples(dtype, gen):
        return [Sample((make(gen, *s, low=-6, high=6).to(dtype), make(gen, *s).to(dtype)), name=str(s)) for s in shapes]
    return samples


register(OpInfo("swiglu", swiglu, lambda gate, up: F.silu(gate) * up, _swiglu_samples(_SHAPES),
                family="activation", kernels=(gated_forward, gated_backward),
                gradcheck_samples=lambda gen: _swiglu_samples(_GRADCHECK_SHAPES)(torch.float64, gen)))
