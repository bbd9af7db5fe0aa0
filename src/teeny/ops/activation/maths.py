"""The ``@triton.jit`` maths of the element-wise activations: for each, ``fn(x, a, b) -> y`` and
``grad(x, dy, a, b) -> dx`` (the derivative times dy, recomputed from the saved input x), passed
to ``kernels.activation_forward`` / ``activation_backward`` as compile-time constants; and the
helpers they share (an overflow-free sigmoid, accurate log1p, expm1 and tanh, softplus). ``a``
and ``b`` carry an op's scalar arguments (the comment beside a function names them);
``declarations.ACTIVATIONS`` pairs each function with PyTorch's names and defaults.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...core.device import INTERPRETER

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
def _softcap(x, a, b):  # a = cap
    return a * _tanh(x / a)


@triton.jit
def _softcap_grad(x, dy, a, b):
    t = _tanh(x / a)
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
