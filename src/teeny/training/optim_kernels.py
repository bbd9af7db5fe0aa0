"""Optimizer update kernels over flat parameter arenas: one launch updates a whole range of one.

SGD (PyTorch's rule), for gradient g of parameter p at its step t:
    g <- g + wd * p;  b <- g at t = 1 else momentum * b + (1 - dampening) * g
    g <- g + momentum * b (Nesterov) or b (momentum > 0);  p <- p - lr * g
Adam / AdamW (PyTorch's rule), at the parameter's step t:
    AdamW: p <- p * (1 - lr * wd)      Adam: g <- g + wd * p
    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
Global-norm clipping: per-program partial sums of g^2 (float32 sums, float64 for float64
gradients) land in a float64 buffer, ``common.sum_partials`` adds them to the squared norm,
and a one-program kernel writes the norm and the factor min(1, max_norm / (norm + 1e-6)) to
device memory, which a scaling pass multiplies every gradient by: no step waits on the host.
Updates compute in float32 (float64 for float64 arenas, hyperparameters included).
Dynamic loss scaling (``optim.GradScaler``, PyTorch's rule): the backward is seeded with the
scale S; g <- g / S with a per-program count of non-finite g (summed by ``common.sum_partials``);
a step with any updates nothing (the update kernels read that flag through ``skip_ptr``) and
S <- S * backoff, else after ``growth_interval`` clean steps in a row S <- S * growth.
"""

import triton
import triton.language as tl

from ..core.common import ELEMENTWISE_BLOCK, upcast
from ..core.kernel import kernel

BLOCK = ELEMENTWISE_BLOCK

# Slots of the float64 hyperparameter buffer every update kernel reads. Kept in device memory,
# not passed as scalars: a captured CUDA graph then uses the values of the step being replayed,
# and float64 arenas get float64 hyperparameters. The step count of each parameter follows the
# N_HYPER slots (a launch reads the count its range shares through ``step_ptr``).
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, MOMENTUM, DAMPENING = (tl.constexpr(i) for i in range(7))
N_HYPER = 7
# Slots of a GradScaler's float64 state buffer: the loss scale, the clean steps since it last
# changed, and whether the last step's gradients held an inf or NaN (the update kernels' skip flag).
SCALE, GROWTH_TRACKER, FOUND_INF = (tl.constexpr(i) for i in range(3))


@kernel(half=True, optional=("buf_ptr", "skip_ptr"))
def sgd_step_kernel(
    p_ptr, g_ptr, buf_ptr, hyper_ptr, step_ptr, skip_ptr, n, NESTEROV: tl.constexpr, BLOCK: tl.constexpr
):
    """``buf_ptr`` is the momentum buffer (``None`` without momentum); where ``skip_ptr`` (a loss
    scaler's overflow flag) holds a non-zero value the step changes nothing."""
    if skip_ptr is not None:
        n = tl.where(tl.load(skip_ptr) == 0.0, n, 0)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = upcast(tl.load(p_ptr + offsets, mask=mask))
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    lr = tl.load(hyper_ptr + LR).to(p.dtype)
    g = g + tl.load(hyper_ptr + WEIGHT_DECAY).to(p.dtype) * p
    if buf_ptr is not None:
        first = tl.load(step_ptr) == 1.0
        momentum = tl.load(hyper_ptr + MOMENTUM).to(p.dtype)
        dampening = tl.load(hyper_ptr + DAMPENING).to(p.dtype)
        old = upcast(tl.load(buf_ptr + offsets, mask=mask))
        buf = tl.where(first, g, momentum * old + (1.0 - dampening) * g)
        tl.store(buf_ptr + offsets, buf.to(buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    tl.store(p_ptr + offsets, (p - lr * g).to(p_ptr.dtype.element_ty), mask=mask)


@kernel(half=True, optional=("skip_ptr",))
def adam_step_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, hyper_ptr, step_ptr, skip_ptr, n, DECOUPLED: tl.constexpr, BLOCK: tl.constexpr
):
    """``skip_ptr`` as in ``sgd_step_kernel``."""
    if skip_ptr is not None:
        n = tl.where(tl.load(skip_ptr) == 0.0, n, 0)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = upcast(tl.load(p_ptr + offsets, mask=mask))
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    lr64 = tl.load(hyper_ptr + LR)
    t = tl.load(step_ptr)
    beta1 = tl.load(hyper_ptr + BETA1)
    beta2 = tl.load(hyper_ptr + BETA2)
    step_size = (lr64 / (1.0 - tl.exp(t * tl.log(beta1)))).to(p.dtype)
    correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2))).to(p.dtype)
    weight_decay = tl.load(hyper_ptr + WEIGHT_DECAY).to(p.dtype)
    if DECOUPLED:
        p = p * (1.0 - lr64.to(p.dtype) * weight_decay)
    else:
        g = g + weight_decay * p
    b1 = beta1.to(p.dtype)
    b2 = beta2.to(p.dtype)
    m = b1 * upcast(tl.load(m_ptr + offsets, mask=mask)) + (1.0 - b1) * g
    v = b2 * upcast(tl.load(v_ptr + offsets, mask=mask)) + (1.0 - b2) * g * g
    denom = tl.sqrt(v) / correction2_sqrt + tl.load(hyper_ptr + EPS).to(p.dtype)
    p = p - step_size * (m / denom)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def sum_squares_partial_kernel(g_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """partial[program] = sum of g^2 over the program's block, into a float64 buffer."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = upcast(tl.load(g_ptr + offsets, mask=offsets < n, other=0.0))
    tl.store(partial_ptr + tl.program_id(0), tl.sum(g * g, axis=0).to(partial_ptr.dtype.element_ty))


@kernel
def clip_factor_kernel(sum_squares_ptr, norm_ptr, factor_ptr, max_norm):
    """norm = sqrt(sum of squares); factor = min(1, max_norm / (norm + 1e-6)), launched as the
    float64 instance (so ``max_norm`` arrives as float64)."""
    norm = tl.sqrt(tl.load(sum_squares_ptr))
    tl.store(norm_ptr, norm)
    tl.store(factor_ptr, tl.minimum(max_norm / (norm + 1e-6), 1.0))


@kernel(half=True)
def scale_by_factor_kernel(g_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    factor = tl.load(factor_ptr).to(g.dtype)
    tl.store(g_ptr + offsets, (g * factor).to(g_ptr.dtype.element_ty), mask=mask)


@kernel(half=True, optional=("base_ptr",))
def loss_seed_kernel(scaler_ptr, base_ptr, seed_ptr, n, BLOCK: tl.constexpr):
    """seed = scale * base (``base_ptr`` None: 1), the gradient a scaled backward starts from."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = tl.load(scaler_ptr + SCALE)
    if base_ptr is not None:
        seed = upcast(tl.load(base_ptr + offsets, mask=mask, other=0.0)) * scale.to(tl.float32)
    else:
        seed = tl.zeros([BLOCK], dtype=tl.float32) + scale.to(tl.float32)
    tl.store(seed_ptr + offsets, seed.to(seed_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def unscale_partial_kernel(g_ptr, scaler_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """g <- g / scale (by its inverse: exact, the scale is a power of two); partial[program] =
    how many of the program's gradients are inf or NaN, into a float64 buffer."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = upcast(tl.load(g_ptr + offsets, mask=mask, other=0.0))
    g = g * (1.0 / tl.load(scaler_ptr + SCALE)).to(g.dtype)
    tl.store(g_ptr + offsets, g.to(g_ptr.dtype.element_ty), mask=mask)
    bad = ((g != g) | (tl.abs(g) == float("inf"))) & mask
    tl.store(partial_ptr + tl.program_id(0), tl.sum(bad.to(tl.int32), axis=0).to(partial_ptr.dtype.element_ty))


@kernel
def loss_scale_update_kernel(scaler_ptr, nonfinite_ptr, growth_factor, backoff_factor, growth_interval):
    """After the gradients were counted: raise the skip flag and back the scale off if any was
    not finite, else count a clean step and grow the scale after ``growth_interval`` of them.
    Launched as the float64 instance."""
    nonfinite = tl.load(nonfinite_ptr)
    found = nonfinite > 0.0
    scale = tl.load(scaler_ptr + SCALE)
    clean = tl.load(scaler_ptr + GROWTH_TRACKER) + 1.0
    grow = (clean >= growth_interval) & (nonfinite == 0.0)
    scale = tl.where(found, scale * backoff_factor, tl.where(grow, scale * growth_factor, scale))
    tl.store(scaler_ptr + SCALE, scale)
    tl.store(scaler_ptr + GROWTH_TRACKER, tl.where(found | grow, 0.0, clean))
    tl.store(scaler_ptr + FOUND_INF, tl.where(found, 1.0, 0.0))


def blocks(n: int) -> int:
    return triton.cdiv(n, BLOCK)
