"""The hand-written functional ops of the activation family: ``apply_activation`` (any
element-wise maths pair as a node), ``glu``, ``swiglu``, ``geglu`` and ``prelu``. The declared activations'
functions are generated from ``declarations.ACTIVATIONS`` in the package, ``teeny.ops.activation``."""

from __future__ import annotations

from ...core.graph import graph_of
from .maths import _gelu_erf, _gelu_erf_grad, _gelu_tanh, _gelu_tanh_grad, _sigmoid_fn, _sigmoid_grad, _silu, _silu_grad
from .ops import ActivationOp, GatedOp, PReLUOp


def apply_activation(x, name: str, fn, grad, a: float = 0.0, b: float = 0.0):
    """A node applying the element-wise maths ``fn(x, a, b)`` (backward ``grad(x, dy, a, b)``),
    both ``@triton.jit`` functions, to the teeny tensor ``x``; ``a``, ``b`` are its scalars."""
    return graph_of(x).apply(ActivationOp(name, fn, grad, a, b), [x])


def glu(x, dim: int = -1):
    """a * sigmoid(b), where a and b are the first and second halves of x along ``dim``
    (whose size must be even)."""
    return graph_of(x).apply(GatedOp("glu", _sigmoid_fn, _sigmoid_grad, int(dim)), [x])


def swiglu(gate, up):
    """silu(gate) * up (two inputs of the same shape; both get gradients)."""
    return graph_of(gate, up).apply(GatedOp("swiglu", _silu, _silu_grad, None), [gate, up])


_GELU = {"tanh": (_gelu_tanh, _gelu_tanh_grad), "none": (_gelu_erf, _gelu_erf_grad)}


def geglu(gate, up, approximate: str = "tanh"):
    """gelu(gate) * up (two inputs of the same shape; both get gradients): Gemma's MLP, with
    gelu's tanh approximation by default (``approximate="none"``: the erf form)."""
    if approximate not in _GELU:
        raise ValueError(f"geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    act, act_grad = _GELU[approximate]
    return graph_of(gate, up).apply(GatedOp("geglu", act, act_grad, None), [gate, up])


def prelu(x, weight):
    """x if x > 0 else weight * x; ``weight`` has 1 element or one per channel (dim 1 of x)."""
    return graph_of(x, weight).apply(PReLUOp(), [x, weight])
