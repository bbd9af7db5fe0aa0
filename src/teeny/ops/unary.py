"""Unary maths: y = f(x), dx = f'(x) dy, on the activation template (``ActivationOp``).

    neg:        -x                  dx = -dy
    abs:        |x|                 dx = sign(x) dy          (0 at 0, as PyTorch)
    exp:        e^x                 dx = e^x dy
    log:        ln x                dx = dy / x
    sqrt:       sqrt x              dx = dy / (2 sqrt x)
    rsqrt:      1 / sqrt x          dx = -dy / (2 x sqrt x)
    reciprocal: 1 / x               dx = -dy / x^2
    square:     x^2                 dx = 2 x dy
    sin, cos:   sin x, cos x        dx = cos x dy, -sin x dy
    erf:        erf x               dx = 2 / sqrt(pi) e^(-x^2) dy

Each op is one ``fn(x, a, b)`` / ``grad(x, dy, a, b)`` pair of ``@triton.jit`` maths for the
activation kernels (which compute halves in float32), declared once in ``UNARY`` (an
``activation.Activation``: the functional op and the registry's samples come from it).
Divisions and square roots are correctly rounded (``true_div``, ``sqrt_rn``): Triton's float32
'/' and sqrt are approximate on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.graph import Tensor, graph_of
from ..core.kernel import dtype_name
from .activation.declarations import Activation, define
from .activation.ops import ActivationOp

NN_LAYERS: list[str] = []


class UnaryOp(ActivationOp):
    """An activation-template op that takes floating-point tensors only."""

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"only floating-point tensors are supported, got {dtype_name(input_dtypes[0])}")


def unary(x: Tensor, name: str, fn, grad) -> Tensor:
    """The node applying the maths pair ``fn``/``grad`` to the teeny Tensor ``x``."""
    return _apply(x, UnaryOp(name, fn, grad))


def _apply(x: Tensor, op: UnaryOp) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op.name}: input must be a teeny Tensor, got {type(x).__name__}")
    return graph_of(x).apply(op, [x])


# ------------------------------------------------------------------------------ maths


@triton.jit
def true_div(a, b):
    """a / b correctly rounded (Triton's float32 '/' is approximate on the GPU)."""
    if b.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _root(x):
    """sqrt(x) correctly rounded (Triton's float32 sqrt is approximate on the GPU)."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _neg(x, a, b):
    return x * -1.0  # Triton's -x is 0 - x, which gives +0.0 for 0.0 (PyTorch: -0.0)


@triton.jit
def _neg_grad(x, dy, a, b):
    return dy * -1.0


@triton.jit
def _abs(x, a, b):
    return tl.abs(x)


@triton.jit
def _abs_grad(x, dy, a, b):
    return tl.where(x > 0, dy, tl.where(x < 0, -dy, 0.0))


@triton.jit
def _exp(x, a, b):
    return tl.exp(x)


@triton.jit
def _exp_grad(x, dy, a, b):
    return dy * tl.exp(x)


@triton.jit
def _log(x, a, b):
    return tl.log(x)


@triton.jit
def _log_grad(x, dy, a, b):
    return true_div(dy, x)


@triton.jit
def _sqrt(x, a, b):
    return _root(x)


@triton.jit
def _sqrt_grad(x, dy, a, b):
    return true_div(dy, 2.0 * _root(x))


@triton.jit
def _rsqrt(x, a, b):
    return true_div(1.0, _root(x))


@triton.jit
def _rsqrt_grad(x, dy, a, b):
    r = true_div(1.0, _root(x))
    return -0.5 * dy * r * r * r


@triton.jit
def _reciprocal(x, a, b):
    return true_div(1.0, x)


@triton.jit
def _reciprocal_grad(x, dy, a, b):
    r = true_div(1.0, x)
    return -dy * (r * r)


@triton.jit
def _square(x, a, b):
    return x * x


@triton.jit
def _square_grad(x, dy, a, b):
    return dy * 2.0 * x


@triton.jit
def _sin(x, a, b):
    return tl.sin(x)


@triton.jit
def _sin_grad(x, dy, a, b):
    return dy * tl.cos(x)


@triton.jit
def _cos(x, a, b):
    return tl.cos(x)


@triton.jit
def _cos_grad(x, dy, a, b):
    return -dy * tl.sin(x)


@triton.jit
def _erf(x, a, b):
    return tl.math.erf(x)


@triton.jit
def _erf_grad(x, dy, a, b):
    return dy * 1.1283791670955126 * tl.exp(-x * x)  # 2 / sqrt(pi)


# pow(x, e) with these Python-number exponents runs as the unary maths (exact, as PyTorch
# special-cases them too): exponent -> (fn, grad)
POW_AS_UNARY = {2.0: (_square, _square_grad), 0.5: (_sqrt, _sqrt_grad), -1.0: (_reciprocal, _reciprocal_grad)}


# ------------------------------------------------------------------------------ declarations


def _unary(name: str, fn, grad, ref, doc: str, **samples) -> Activation:
    """A unary op's declaration (see ``activation.Activation``): no arguments but the input, no
    layer; ``samples``: its sample ``domain`` and ``kinks``."""
    return Activation(name, None, fn, grad, ref, doc, routes=(), runtime_op=UnaryOp, input="input", **samples)


UNARY = [
    _unary("neg", _neg, _neg_grad, torch.neg, "-input."),
    _unary("abs", _abs, _abs_grad, torch.abs, "|input|; the gradient at 0 is 0, as in PyTorch.", kinks=(0.0,)),
    _unary("exp", _exp, _exp_grad, torch.exp, "e ** input."),
    _unary("log", _log, _log_grad, torch.log, "The natural logarithm (NaN below 0, -inf at 0).", domain=(0.2, 4.0)),
    _unary("sqrt", _sqrt, _sqrt_grad, torch.sqrt, "The square root, correctly rounded.", domain=(0.2, 4.0)),
    _unary("rsqrt", _rsqrt, _rsqrt_grad, torch.rsqrt, "1 / sqrt(input).", domain=(0.2, 4.0)),
    _unary(
        "reciprocal", _reciprocal, _reciprocal_grad, torch.reciprocal, "1 / input.", kinks=(0.0,), domain=(-2.0, 2.0)
    ),
    _unary("square", _square, _square_grad, torch.square, "input * input."),
    _unary("sin", _sin, _sin_grad, torch.sin, "The sine (radians)."),
    _unary("cos", _cos, _cos_grad, torch.cos, "The cosine (radians)."),
    _unary("erf", _erf, _erf_grad, torch.erf, "The error function."),
]
for _declaration in UNARY:
    globals()[_declaration.name] = define(_declaration, __name__, _apply)
del _declaration

__all__ = [d.name for d in UNARY]
