"""Optimizer update kernels over flat parameter arenas: one launch updates every parameter.

SGD (PyTorch's rule), for gradient g of parameter p:
    g <- g + wd * p;  b <- g on the first step else momentum * b + (1 - dampening) * g
    g <- g + momentum * b (Nesterov) or b (momentum > 0);  p <- p - lr * g
Adam / AdamW (PyTorch's rule), step t:
    AdamW: p <- p * (1 - lr * wd)      Adam: g <- g + wd * p
    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
Global-norm clipping: partial sums of g^2 per program (fp32), a second pass sums them to the
norm and writes the factor min(1, max_norm / (norm + 1e-6)) to device memory, and a scaling
pass multiplies every gradient by it, so no step waits on the host.
Updates compute in float32 (float64 for float64 arenas). The learning rate and the step count
are read from a small float64 device buffer rather than passed as scalars, so a step captured
in a CUDA graph uses the values of the step being replayed.
"""

import triton
import triton.language as tl

from ..kernel import kernel
from .common import ELEMENTWISE_BLOCK, upcast

BLOCK = ELEMENTWISE_BLOCK


@kernel(half=True)
def sgd_step_kernel(p_ptr, g_ptr, buf_ptr, hyper_ptr, n, momentum, dampening, weight_decay,
                    NESTEROV: tl.constexpr, USE_MOMENTUM: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = upcast(tl.load(p_ptr + offsets, mask=mask))
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    lr = tl.load(hyper_ptr).to(p.dtype)
    first = tl.load(hyper_ptr + 1) == 1.0
    g = g + weight_decay * p
    if USE_MOMENTUM:
        old = upcast(tl.load(buf_ptr + offsets, mask=mask))
        buf = tl.where(first, g, momentum * old + (1.0 - dampening) * g)
        tl.store(buf_ptr + offsets, buf.to(buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    tl.store(p_ptr + offsets, (p - lr * g).to(p_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def adam_step_kernel(p_ptr, g_ptr, m_ptr, v_ptr, hyper_ptr, n, beta1, beta2, eps, weight_decay,
                     DECOUPLED: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = upcast(tl.load(p_ptr + offsets, mask=mask))
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    # hyper = [lr, step, log(beta1), log(beta2)] in float64 device memory: a captured CUDA graph
    # reads the values of the step being replayed
    lr64 = tl.load(hyper_ptr)
    t = tl.load(hyper_ptr + 1)
    step_size = (lr64 / (1.0 - tl.exp(t * tl.load(hyper_ptr + 2)))).to(p.dtype)
    correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.load(hyper_ptr + 3))).to(p.dtype)
    if DECOUPLED:
        p = p * (1.0 - lr64.to(p.dtype) * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * upcast(tl.load(m_ptr + offsets, mask=mask)) + (1.0 - beta1) * g
    v = beta2 * upcast(tl.load(v_ptr + offsets, mask=mask)) + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / correction2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def sum_squares_partial_kernel(g_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(g * g, axis=0))


@kernel(dtypes=None, half=True)
def clip_factor_kernel(partial_ptr, n_partials, norm_ptr, factor_ptr, max_norm, BLOCK: tl.constexpr):
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += tl.load(partial_ptr + offsets, mask=offsets < n_partials, other=0.0)
    norm = tl.sqrt(tl.sum(total, axis=0))
    tl.store(norm_ptr, norm)
    tl.store(factor_ptr, tl.minimum(max_norm / (norm + 1e-6), 1.0))


@kernel(half=True)
def scale_by_factor_kernel(g_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    factor = tl.load(factor_ptr)
    g = upcast(tl.load(g_ptr + offsets, mask=mask))
    tl.store(g_ptr + offsets, (g * factor).to(g_ptr.dtype.element_ty), mask=mask)


def blocks(n: int) -> int:
    return triton.cdiv(n, BLOCK)
