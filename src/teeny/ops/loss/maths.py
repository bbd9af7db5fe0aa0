"""The element-wise losses' maths, passed to ``pointwise_loss_forward`` / ``_backward`` as
constexprs: LOSS(x, t, pw, kink) -> l and GRAD(x, t, pw, kink) -> (dl/dx, dl/dt), in float32/64
(pw: the optional pos_weight; kink: where smooth L1 and Huber turn from quadratic to linear).
At the kinks the derivatives are PyTorch's (the package docstring, ``teeny.ops.loss``).

And the soft cap the class-loss kernels put on the logits they read (``soft_capped``,
``soft_cap_slope``): the ``softcap`` activation's maths (``teeny.ops.activation``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..activation.maths import _softcap


@triton.jit
def _sign(d):
    return tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))


@triton.jit
def mse(x, t, pw, kink):
    return (x - t) * (x - t)


@triton.jit
def mse_grad(x, t, pw, kink):
    return 2.0 * (x - t), 2.0 * (t - x)


@triton.jit
def l1(x, t, pw, kink):
    return tl.abs(x - t)


@triton.jit
def l1_grad(x, t, pw, kink):
    s = _sign(x - t)
    return s, -s


@triton.jit
def smooth_l1(x, t, pw, beta):
    d = tl.abs(x - t)
    return tl.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


@triton.jit
def smooth_l1_grad(x, t, pw, beta):
    d = x - t
    g = tl.where(tl.abs(d) < beta, d / beta, _sign(d))
    return g, -g


@triton.jit
def huber(x, t, pw, delta):
    d = tl.abs(x - t)
    return tl.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


@triton.jit
def huber_grad(x, t, pw, delta):
    # clamp(d, -delta, delta) with tl.where, not tl.minimum/maximum: those round a Python-float
    # scalar (the interpreter's delta, any literal) to float32 first, and they drop a NaN d
    d = x - t
    g = tl.where(d > delta, delta, tl.where(d < -delta, -delta, d))
    return g, -g


@triton.jit
def bce(x, t, pw, kink):
    log_x = tl.maximum(tl.log(x), -100.0)
    log_1mx = tl.maximum(tl.log(1.0 - x), -100.0)
    return (t - 1.0) * log_1mx - t * log_x


@triton.jit
def bce_grad(x, t, pw, kink):
    # PyTorch clamps at its float EPSILON 1e-12, float32 in every dtype: so does tl.maximum (it makes a
    # float32 tensor of a Python float), which keeps float64 results equal to PyTorch's
    dx = (x - t) / tl.maximum((1.0 - x) * x, 1e-12)
    return dx, tl.log(1.0 - x) - tl.log(x)


@triton.jit
def _softplus_neg(x):
    """log(1 + exp(-x)), stable."""
    return tl.maximum(-x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def bce_logits(x, t, pw, kink):
    return (1.0 - t) * x + ((pw - 1.0) * t + 1.0) * _softplus_neg(x)


@triton.jit
def bce_logits_grad(x, t, pw, kink):
    sigmoid_neg = 1.0 / (1.0 + tl.exp(x))
    return (1.0 - t) - ((pw - 1.0) * t + 1.0) * sigmoid_neg, (pw - 1.0) * _softplus_neg(x) - x


@triton.jit
def kl_div(x, t, pw, kink):
    return tl.where(t == 0.0, 0.0, t * tl.log(t)) - t * x


@triton.jit
def kl_div_grad(x, t, pw, kink):
    # t / t: NaN at t = 0, as PyTorch's xlogy gradient
    return -t, tl.log(t) + t / t - x


@triton.jit
def kl_div_log_target(x, t, pw, kink):
    return tl.exp(t) * (t - x)


@triton.jit
def kl_div_log_target_grad(x, t, pw, kink):
    e = tl.exp(t)
    return -e, e * (t - x + 1.0)


# ------------------------------------------------------- the class losses' soft cap on the logits


@triton.jit
def soft_capped(x, cap):
    """y = cap * tanh(x / cap): Gemma 2's soft cap on the logits, as the ``softcap`` activation."""
    return _softcap(x, cap, 0.0)


@triton.jit
def soft_cap_slope(y, cap):
    """dy/dx of ``soft_capped`` from its value y: 1 - tanh^2 = 1 - (y / cap)^2 (no second tanh)."""
    ratio = y / cap
    return 1.0 - ratio * ratio
