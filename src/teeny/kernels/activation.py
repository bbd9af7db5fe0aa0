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

import inspect
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import init as _init
from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, away_from, make, register
from ..runtime import ArgVisitor, Launch, RuntimeOp
from .common import ELEMENTWISE_BLOCK, acc_dtype, cdiv, sum_partials, sum_to_shape_kernel, upcast

__all__ = [
    "relu",
    "leaky_relu",
    "elu",
    "selu",
    "celu",
    "gelu",
    "silu",
    "mish",
    "sigmoid",
    "tanh",
    "softplus",
    "softsign",
    "hardtanh",
    "relu6",
    "hardsigmoid",
    "hardswish",
    "logsigmoid",
    "tanhshrink",
    "softshrink",
    "hardshrink",
    "threshold",
    "prelu",
    "glu",
    "swiglu",
]
NN_LAYERS = [
    "ReLU",
    "LeakyReLU",
    "ELU",
    "SELU",
    "CELU",
    "GELU",
    "SiLU",
    "Mish",
    "Sigmoid",
    "Tanh",
    "Softplus",
    "Softsign",
    "Hardtanh",
    "ReLU6",
    "Hardsigmoid",
    "Hardswish",
    "LogSigmoid",
    "Tanhshrink",
    "Softshrink",
    "Hardshrink",
    "Threshold",
    "PReLU",
    "GLU",
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
    """An element-wise activation: ``fn``/``grad`` are its @triton.jit maths, ``a``/``b`` its
    scalar arguments (float64 in float64 kernels)."""

    kernel = activation_forward
    saves_inputs = True
    recomputable = (0,)
    grad_in_place = True

    def __init__(self, name: str, fn, grad, a: float = 0.0, b: float = 0.0):
        self.name, self.fn, self.grad, self.a, self.b = name, fn, grad, float(a), float(b)

    def block(self):
        return BLOCK

    def pack_args(self, inputs, params, output, output_shape, visitor: ArgVisitor, saved=None):
        (x,) = inputs
        visitor.visit(x_ptr=x, y_ptr=output, n=x.numel(), a=self.a, b=self.b, FN=self.fn)

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
        visitor: ArgVisitor,
        saved=None,
    ):
        (x,), (dx,) = inputs, grad_inputs
        visitor.visit(x_ptr=x, dy_ptr=grad_output, dx_ptr=dx, n=x.numel(), a=self.a, b=self.b, GRAD=self.grad)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)


def apply_activation(x, name: str, fn, grad, a: float = 0.0, b: float = 0.0):
    """A node applying the element-wise maths ``fn(x, a, b)`` (backward ``grad(x, dy, a, b)``),
    both ``@triton.jit`` functions, to the teeny tensor ``x``; ``a``, ``b`` are its scalars."""
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


# The GPU takes tanh from libdevice (H200, gelu tanh fp32 2^27 forward+backward: 0.627 ms, at the copy
# floor, against 0.722 ms through _expm1); the interpreter has no libdevice and uses the formula.
_TANH_LIBDEVICE = tl.constexpr(not INTERPRETER)
_TANH_IS_X = tl.constexpr(2.44140625e-4)  # 2^-12: below it tanh(x) = x to within x^2 / 3, under half an fp32 ulp


@triton.jit
def _tanh(x):
    if _TANH_LIBDEVICE:
        t = libdevice.tanh(x)
    else:
        # tanh(|x|) = -expm1(-2|x|) / (2 + expm1(-2|x|)): no overflow, accurate near 0
        e = _expm1(-2.0 * tl.abs(x))
        t = -e / (2.0 + e)
        t = tl.where(x >= 0, t, -t)
    if x.dtype == tl.float32:
        # x itself for tiny x: libdevice is linked with denormals flushed, and -0.0 keeps its sign
        t = tl.where(tl.abs(x) < _TANH_IS_X, x, t)
    return t


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
def _elu_grad(x, dy, a, b):  # NaN in, NaN out (exp(NaN)), as PyTorch
    return tl.where(x > 0, dy * b, dy * (b * a) * tl.exp(x))


@triton.jit
def _celu(x, a, b):  # a = alpha: x > 0 ? x : alpha * (exp(x / alpha) - 1)
    return tl.where(x > 0, x, a * _expm1(x / a))


@triton.jit
def _celu_grad(x, dy, a, b):
    return tl.where(x > 0, dy, dy * tl.exp(x / a))


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
def _hardtanh_grad(x, dy, a, b):  # 0 at and beyond both bounds, and at NaN, as PyTorch
    return tl.where((x > a) & (x < b), dy, 0.0)


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
def _softshrink_grad(x, dy, a, b):  # 0 inside [-lambd, lambd] and at NaN
    return tl.where((x > a) | (x < -a), dy, 0.0)


@triton.jit
def _hardshrink(x, a, b):  # a = lambd
    return tl.where((x >= -a) & (x <= a), 0.0, x)


@triton.jit
def _hardshrink_grad(x, dy, a, b):
    return tl.where((x > a) | (x < -a), dy, 0.0)


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
    return apply_activation(x, "relu", _relu, _relu_grad)


def leaky_relu(x, negative_slope: float = 0.01, inplace: bool = False):
    """x if x > 0 else negative_slope * x; the gradient at 0 is negative_slope."""
    return apply_activation(x, "leaky_relu", _leaky_relu, _leaky_relu_grad, negative_slope)


def elu(x, alpha: float = 1.0, inplace: bool = False):
    """x if x > 0 else alpha * (exp(x) - 1); the gradient at 0 is alpha."""
    return apply_activation(x, "elu", _elu, _elu_grad, alpha, 1.0)


def selu(x, inplace: bool = False):
    """scale * elu(x, alpha) with PyTorch's constants alpha = 1.6733, scale = 1.0507."""
    return apply_activation(x, "selu", _elu, _elu_grad, _SELU_ALPHA, _SELU_SCALE)


def celu(x, alpha: float = 1.0, inplace: bool = False):
    """x if x > 0 else alpha * (exp(x / alpha) - 1)."""
    if alpha == 0:
        raise ValueError("celu: alpha cannot be 0")
    return apply_activation(x, "celu", _celu, _celu_grad, alpha)


def gelu(x, approximate: str = "none"):
    """x * Phi(x) (``approximate="none"``, erf form) or its tanh approximation (``"tanh"``)."""
    if approximate == "tanh":
        return apply_activation(x, "gelu_tanh", _gelu_tanh, _gelu_tanh_grad)
    if approximate == "none":
        return apply_activation(x, "gelu", _gelu_erf, _gelu_erf_grad)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def silu(x, inplace: bool = False):
    """x * sigmoid(x)."""
    return apply_activation(x, "silu", _silu, _silu_grad)


def mish(x, inplace: bool = False):
    """x * tanh(softplus(x))."""
    return apply_activation(x, "mish", _mish, _mish_grad)


def sigmoid(x):
    """1 / (1 + exp(-x))."""
    return apply_activation(x, "sigmoid", _sigmoid_fn, _sigmoid_grad)


def tanh(x):
    """tanh(x)."""
    return apply_activation(x, "tanh", _tanh_fn, _tanh_grad)


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold."""
    if beta == 0:
        raise ValueError("softplus: beta cannot be 0")
    return apply_activation(x, "softplus", _softplus_fn, _softplus_grad, beta, threshold)


def softsign(x):
    """x / (1 + |x|)."""
    return apply_activation(x, "softsign", _softsign, _softsign_grad)


def hardtanh(x, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
    """clamp(x, min_val, max_val); the gradient is 0 at and beyond both bounds."""
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val cannot be greater than max_val (got {min_val} > {max_val})")
    return apply_activation(x, "hardtanh", _hardtanh, _hardtanh_grad, min_val, max_val)


def relu6(x, inplace: bool = False):
    """hardtanh(x, 0, 6) (so the gradient at 0 and at 6 is 0, as in PyTorch)."""
    return apply_activation(x, "relu6", _hardtanh, _hardtanh_grad, 0.0, 6.0)


def hardsigmoid(x, inplace: bool = False):
    """relu6(x + 3) / 6; the gradient is 1/6 strictly inside (-3, 3), else 0."""
    return apply_activation(x, "hardsigmoid", _hardsigmoid, _hardsigmoid_grad)


def hardswish(x, inplace: bool = False):
    """x * relu6(x + 3) / 6."""
    return apply_activation(x, "hardswish", _hardswish, _hardswish_grad)


def logsigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), computed without overflow."""
    return apply_activation(x, "logsigmoid", _logsigmoid, _logsigmoid_grad)


def tanhshrink(x):
    """x - tanh(x)."""
    return apply_activation(x, "tanhshrink", _tanhshrink, _tanhshrink_grad)


def softshrink(x, lambd: float = 0.5):
    """x - lambd if x > lambd, x + lambd if x < -lambd, else 0; lambd must be >= 0."""
    if not lambd >= 0:
        raise ValueError(f"softshrink: lambd must be greater or equal to 0, got {lambd}")
    return apply_activation(x, "softshrink", _softshrink, _softshrink_grad, lambd)


def hardshrink(x, lambd: float = 0.5):
    """0 where -lambd <= x <= lambd, else x."""
    return apply_activation(x, "hardshrink", _hardshrink, _hardshrink_grad, lambd)


def threshold(x, threshold: float, value: float, inplace: bool = False):
    """value where x <= threshold, else x; the gradient is 0 where x <= threshold."""
    return apply_activation(x, "threshold", _threshold, _threshold_grad, threshold, value)


# -------------------------------------------------------------- gated: glu and swiglu


@triton.jit
def _gated_sources(offsets, half_row, row_stride, SPLIT: tl.constexpr):
    """Where output element i reads u: the halves of a row (SPLIT) or the same index."""
    if SPLIT:
        return (offsets // half_row) * row_stride + offsets % half_row
    else:
        return offsets


@kernel(half=True, optional=("du_ptr", "dg_ptr"))
def gated_backward(
    u_ptr,
    g_ptr,
    dy_ptr,
    du_ptr,
    dg_ptr,
    n,
    half_row,
    row_stride,
    g_offset,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    src = _gated_sources(offsets, half_row, row_stride, SPLIT)
    u = upcast(tl.load(u_ptr + src, mask=mask, other=0.0))
    g = upcast(tl.load(g_ptr + g_offset + src, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    if du_ptr is not None:
        tl.store(du_ptr + src, (dy * ACT(g, 0.0, 0.0)).to(du_ptr.dtype.element_ty), mask=mask)
    if dg_ptr is not None:
        tl.store(dg_ptr + g_offset + src, ACT_GRAD(g, dy * u, 0.0, 0.0).to(dg_ptr.dtype.element_ty), mask=mask)


@kernel(backward=gated_backward, half=True)
def gated_forward(
    u_ptr, g_ptr, y_ptr, n, half_row, row_stride, g_offset, ACT: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    """y = u * act(g); du = dy * act(g), dg = act'(g) * dy * u. Output element i reads u at
    src(i) = (i // half_row) * row_stride + i % half_row (SPLIT: the halves of a row) or
    src(i) = i, and g at src(i) + g_offset."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    src = _gated_sources(offsets, half_row, row_stride, SPLIT)
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
        self.recomputable = tuple(range(self.n_activation_inputs))

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
            raise ValueError(
                f"halving dimension must be even, but dimension {self.dim % len(shape)} is size "
                f"{shape[self.dim % len(shape)]}"
            )

    def output_shape(self, input_shapes):
        shape = list(input_shapes[0])
        if self.dim is not None:
            shape[self.dim % len(shape)] //= 2
        return tuple(shape)

    def block(self):
        return BLOCK

    def _layout(self, ctx) -> dict:
        """The kernel's layout arguments: half_row, row_stride, g_offset and SPLIT."""
        n = math.prod(ctx.output_shape)
        if self.dim is None:
            return dict(half_row=max(n, 1), row_stride=max(n, 1), g_offset=0, SPLIT=False)
        shape = ctx.input_shapes[0]
        dim = self.dim % len(shape)
        half_row = (shape[dim] // 2) * math.prod(shape[dim + 1 :])
        return dict(half_row=max(half_row, 1), row_stride=2 * half_row, g_offset=half_row, SPLIT=True)

    def _sources(self, inputs) -> dict:
        u, g = (inputs[0], inputs[0]) if self.dim is not None else (inputs[1], inputs[0])
        return dict(u_ptr=u, g_ptr=g)

    def forward_launches(self, ctx):
        n = ctx.output.numel()
        args = ArgVisitor().visit(**self._sources(ctx.inputs), y_ptr=ctx.output, n=n, ACT=self.act, **self._layout(ctx))
        return [Launch(gated_forward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]

    def backward_launches(self, ctx):
        if self.dim is not None:
            du = dg = ctx.grad_inputs[0]
        else:
            dg, du = ctx.grad_inputs
        args = ArgVisitor().visit(
            **self._sources(ctx.inputs),
            dy_ptr=ctx.grad_output,
            du_ptr=du,
            dg_ptr=dg,
            n=ctx.grad_output.numel(),
            ACT=self.act,
            ACT_GRAD=self.act_grad,
            **self._layout(ctx),
        )
        return [Launch(gated_backward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]


def glu(x, dim: int = -1):
    """a * sigmoid(b), where a and b are the first and second halves of x along ``dim``
    (whose size must be even)."""
    return graph_of(x).apply(GatedOp("glu", _sigmoid_fn, _sigmoid_grad, int(dim)), [x])


def swiglu(gate, up):
    """silu(gate) * up (two inputs of the same shape; both get gradients)."""
    return graph_of(gate, up).apply(GatedOp("swiglu", _silu, _silu_grad, None), [gate, up])


# --------------------------------------------------------------------------------- prelu


@kernel(half=True, optional=("dx_ptr", "partial_ptr"))
def prelu_backward(
    x_ptr, w_ptr, dy_ptr, dx_ptr, partial_ptr, per_channel, channels, inner, splits, BLOCK: tl.constexpr
):
    """Program (c, s) walks the elements of channel c (x viewed as (outer, C, inner)) in
    BLOCK-wide steps s, s + splits, ...: writes dx = dy if x > 0 else w[c] * dy and the
    partial sum of dw[c] = sum(x * dy where x <= 0) into partial[s, c] (float32, float64 for
    float64); ``sum_partials`` adds the partials over s."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    w = upcast(tl.load(w_ptr + c))
    acc = upcast(tl.zeros([BLOCK], dtype=w_ptr.dtype.element_ty))
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(s.to(tl.int64) * BLOCK, per_channel, splits * BLOCK):
        j = start + lanes
        mask = j < per_channel
        offsets = (j // inner) * (channels * inner) + c * inner + j % inner
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        if dx_ptr is not None:
            tl.store(dx_ptr + offsets, tl.where(x > 0, dy, w * dy).to(dx_ptr.dtype.element_ty), mask=mask)
        if partial_ptr is not None:
            acc += tl.where(x > 0, 0.0, x * dy)
    if partial_ptr is not None:
        tl.store(partial_ptr + s * channels + c, tl.sum(acc, axis=0))


@kernel(backward=(prelu_backward, sum_to_shape_kernel), half=True)
def prelu_forward(x_ptr, w_ptr, y_ptr, n, channels, inner, BLOCK: tl.constexpr):
    """y = x if x > 0 else w[c] * x, with c = (i // inner) % channels the channel (dim 1) of
    element i. Backward: see prelu_backward."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    w = upcast(tl.load(w_ptr + (offsets // inner) % channels, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, tl.where(x > 0, x, w * x).to(y_ptr.dtype.element_ty), mask=mask)


PRELU_TARGET_PROGRAMS = 1024  # backward: split channels until about this many programs run


class PReLUOp(RuntimeOp):
    """prelu(x, weight): weight (1,) (or a scalar) shared by all elements, or (C,) along dim 1."""

    name = "prelu"
    kernel = prelu_forward
    saves_inputs = True
    recomputable = (0, 1)

    def param_shapes(self, input_shapes):
        return [None]

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes
        if len(w) > 1:
            raise ValueError(f"weight must be a scalar or a 1-d tensor, got shape {tuple(w)}")
        channels = x[1] if len(x) >= 2 else 1
        numel = math.prod(w)
        if numel != 1 and numel != channels:
            raise ValueError(
                f"weight has {numel} parameters but the input has {channels} channels "
                f"(dim 1 of shape {tuple(x)}); use 1 parameter or one per channel"
            )

    @staticmethod
    def _layout(input_shapes):
        """(channels, inner, per_channel) with x viewed as (outer, channels, inner)."""
        x, w = input_shapes
        n = math.prod(x)
        if math.prod(w) == 1:
            return 1, 1, n
        channels, inner = x[1], math.prod(x[2:])
        return channels, inner, n // channels if channels else 0

    def block(self):
        return BLOCK

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        channels, inner, _ = self._layout([tuple(inputs[0].shape), tuple(params[0].shape)])
        visitor.visit(x_ptr=inputs[0], w_ptr=params[0], y_ptr=output, n=output.numel(), channels=channels, inner=inner)

    def backward_launches(self, ctx):
        channels, inner, per_channel = self._layout(ctx.input_shapes)
        (x,), (w,) = ctx.inputs, ctx.params
        (dx,), (dw,) = ctx.grad_inputs, ctx.grad_params
        splits = max(1, min(cdiv(per_channel, BLOCK), cdiv(PRELU_TARGET_PROGRAMS, max(channels, 1))))
        partials = ctx.empty((splits, channels), acc_dtype(ctx.dtype)) if dw is not None else None
        args = ArgVisitor().visit(
            x_ptr=x,
            w_ptr=w,
            dy_ptr=ctx.grad_output,
            dx_ptr=dx,
            partial_ptr=partials,
            per_channel=per_channel,
            channels=channels,
            inner=inner,
            splits=splits,
        )
        # the weight gradient has work (zeros) even for an empty input
        launches = [
            Launch(prelu_backward, (channels, splits, 1), args, BLOCK, work=channels if dw is not None else None)
        ]
        if dw is not None:
            launches += sum_partials(partials, dw)
        return launches


def prelu(x, weight):
    """x if x > 0 else weight * x; ``weight`` has 1 element or one per channel (dim 1 of x)."""
    return graph_of(x, weight).apply(PReLUOp(), [x, weight])


# ---------------------------------------------------------------------------------- layers


def activation_layer(name: str, fn) -> type[Module]:
    """The ``nn`` layer of ``fn``: its constructor takes ``fn``'s arguments after the input (the
    names and defaults of PyTorch's layer, ``inplace`` accepted and ignored) and its forward
    applies ``fn``."""
    signature = inspect.signature(fn)
    options = inspect.Signature(list(signature.parameters.values())[1:])

    def __init__(self, *args, **kwargs):
        Module.__init__(self)
        try:
            bound = options.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        bound.apply_defaults()
        self.kwargs = {k: v for k, v in bound.arguments.items() if k != "inplace"}

    def forward(self, x):
        return fn(x, **self.kwargs)

    def __repr__(self):
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"

    doc = f"Layer applying ``{fn.__name__}``: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}"
    return type(
        name,
        (Module,),
        {"__init__": __init__, "forward": forward, "__repr__": __repr__, "__doc__": doc, "__module__": __name__},
    )


ReLU = activation_layer("ReLU", relu)
LeakyReLU = activation_layer("LeakyReLU", leaky_relu)
ELU = activation_layer("ELU", elu)
SELU = activation_layer("SELU", selu)
CELU = activation_layer("CELU", celu)
GELU = activation_layer("GELU", gelu)
SiLU = activation_layer("SiLU", silu)
Mish = activation_layer("Mish", mish)
Sigmoid = activation_layer("Sigmoid", sigmoid)
Tanh = activation_layer("Tanh", tanh)
Softplus = activation_layer("Softplus", softplus)
Softsign = activation_layer("Softsign", softsign)
Hardtanh = activation_layer("Hardtanh", hardtanh)
ReLU6 = activation_layer("ReLU6", relu6)
Hardsigmoid = activation_layer("Hardsigmoid", hardsigmoid)
Hardswish = activation_layer("Hardswish", hardswish)
LogSigmoid = activation_layer("LogSigmoid", logsigmoid)
Tanhshrink = activation_layer("Tanhshrink", tanhshrink)
Softshrink = activation_layer("Softshrink", softshrink)
Hardshrink = activation_layer("Hardshrink", hardshrink)
Threshold = activation_layer("Threshold", threshold)
GLU = activation_layer("GLU", glu)


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
        return [
            Sample(
                (away_from(make(gen, *s, low=low, high=high), kinks).to(dtype),),
                dict(kwargs[i % len(kwargs)]),
                name=f"{s} {kwargs[i % len(kwargs)]}",
            )
            for i, s in enumerate(shapes)
        ]

    return samples


def register_activation(name, fn, ref, kinks=(), low=-3.0, high=3.0, kwargs=({},)):
    """Register the activation ``fn`` with its PyTorch reference ``ref``: samples on odd shapes
    in [low, high], away from the ``kinks``, once per keyword-argument set in ``kwargs``."""
    register(
        OpInfo(
            name,
            fn,
            ref,
            _unary_samples(kinks, low, high, kwargs),
            family="activation",
            gradcheck_samples=lambda gen: _unary_samples(kinks, low, high, kwargs, _GRADCHECK_SHAPES)(
                torch.float64, gen
            ),
        )
    )


register_activation("relu", relu, F.relu, (0.0,))
register_activation("leaky_relu", leaky_relu, F.leaky_relu, (0.0,), kwargs=({}, {"negative_slope": 0.2}))
register_activation("elu", elu, F.elu, (0.0,), kwargs=({}, {"alpha": 0.5}))
register_activation("selu", selu, F.selu, (0.0,))
register_activation("celu", celu, F.celu, (0.0,), kwargs=({}, {"alpha": 2.0}))
register_activation("gelu", gelu, F.gelu)
register_activation("gelu_tanh", lambda x: gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"))
register_activation("silu", silu, F.silu, low=-8.0, high=8.0)
register_activation("mish", mish, F.mish, low=-8.0, high=8.0)
register_activation("sigmoid", sigmoid, torch.sigmoid, low=-8.0, high=8.0)
register_activation("tanh", tanh, torch.tanh)
register_activation(
    "softplus", softplus, F.softplus, (0.5,), low=-8.0, high=8.0, kwargs=({}, {"beta": 2.0, "threshold": 1.0})
)
register_activation("softsign", softsign, F.softsign)
register_activation(
    "hardtanh", hardtanh, F.hardtanh, (-1.0, 1.0, -0.5, 2.0), kwargs=({}, {"min_val": -0.5, "max_val": 2.0})
)
register_activation("relu6", relu6, F.relu6, (0.0, 6.0), low=-2.0, high=8.0)
register_activation("hardsigmoid", hardsigmoid, F.hardsigmoid, (-3.0, 3.0), low=-5.0, high=5.0)
register_activation("hardswish", hardswish, F.hardswish, (-3.0, 3.0), low=-5.0, high=5.0)
register_activation("logsigmoid", logsigmoid, F.logsigmoid, low=-20.0, high=20.0)
register_activation("tanhshrink", tanhshrink, F.tanhshrink)
register_activation("softshrink", softshrink, F.softshrink, (-0.5, 0.5, -1.0, 1.0), kwargs=({}, {"lambd": 1.0}))
register_activation("hardshrink", hardshrink, F.hardshrink, (-0.5, 0.5, -1.0, 1.0), kwargs=({}, {"lambd": 1.0}))
register_activation(
    "threshold",
    threshold,
    F.threshold,
    (0.5, -1.0),
    kwargs=({"threshold": 0.5, "value": -2.0}, {"threshold": -1.0, "value": 3.0}),
)


def _prelu_samples(shapes):
    def samples(dtype, gen):
        out = []
        for x_shape, w_shape in shapes:
            x = away_from(make(gen, *x_shape), (0.0,)).to(dtype)
            w = make(gen, *w_shape, low=-0.5, high=0.5).to(dtype)
            channels = w.numel() if w.numel() > 1 else 1
            out.append(Sample((x, w), name=f"x{x_shape} w{w_shape}", reduction=max(1, x.numel() // max(channels, 1))))
        return out

    return samples


register(
    OpInfo(
        "prelu",
        prelu,
        F.prelu,
        _prelu_samples(
            [((3, 5, 7), (5,)), ((37, 3), (1,)), ((4, 3), (3,)), ((6,), (1,)), ((0, 3), (3,)), ((), (1,)), ((2, 3), ())]
        ),
        family="activation",
        gradcheck_samples=lambda gen: _prelu_samples([((2, 3, 3), (3,)), ((5,), (1,))])(torch.float64, gen),
    )
)


def _glu_samples(cases):
    def samples(dtype, gen):
        return [Sample((make(gen, *s).to(dtype),), {"dim": d}, name=f"{s} dim={d}") for s, d in cases]

    return samples


register(
    OpInfo(
        "glu",
        glu,
        F.glu,
        _glu_samples([((3, 38), -1), ((4, 6, 5), 1), ((6,), 0), ((2, 0, 4), 2)]),
        family="activation",
        gradcheck_samples=lambda gen: _glu_samples([((3, 4), -1), ((2, 4, 3), 1)])(torch.float64, gen),
    )
)


def _swiglu_samples(shapes):
    def samples(dtype, gen):
        return [Sample((make(gen, *s, low=-6, high=6).to(dtype), make(gen, *s).to(dtype)), name=str(s)) for s in shapes]

    return samples


register(
    OpInfo(
        "swiglu",
        swiglu,
        lambda gate, up: F.silu(gate) * up,
        _swiglu_samples(_SHAPES),
        family="activation",
        gradcheck_samples=lambda gen: _swiglu_samples(_GRADCHECK_SHAPES)(torch.float64, gen),
    )
)
