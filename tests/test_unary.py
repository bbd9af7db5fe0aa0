"""Unary maths: what the generic harness cannot see (special values and their gradients, the
gradient of abs at 0, pow's number exponents taking the unary kernels, bad input)."""

import pytest
import torch

import teeny
from teeny import ops
from teeny.core.graph import Graph, GraphError
from teeny.core.kernel import record_launches
from teeny.ops.unary import UNARY
from teeny.torch import apply

DEV = teeny.DEVICE
NAN, INF = float("nan"), float("inf")
SPECIAL = [0.0, -0.0, INF, -INF, NAN, 1e-30, -2.0, 0.5, 3.0, 1e30]
NAMES = [d.name for d in UNARY]  # every declared unary op


def _value_and_grad(fn, x):
    x = x.detach().clone().to(DEV).requires_grad_(True)
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return y.detach().cpu(), g.cpu()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_special_values_and_their_gradients_match_torch(name, dtype):
    """0, -0.0, infinities, NaN, tiny and huge inputs: the value and the gradient as PyTorch's
    formulas give them (signed infinities at 0, NaN where PyTorch has NaN)."""
    x = torch.tensor(SPECIAL, dtype=dtype)
    y, g = _value_and_grad(lambda t: apply(getattr(ops, name), t), x)
    ry, rg = _value_and_grad(getattr(torch, name), x)
    tol = dict(atol=0, rtol=0) if dtype == torch.float64 and name in ("neg", "abs", "square") else {}
    torch.testing.assert_close(y, ry, equal_nan=True, **tol)
    torch.testing.assert_close(g, rg, equal_nan=True, **tol)
    assert torch.equal(torch.signbit(y[:2]), torch.signbit(ry[:2])), f"{name}: the sign of the result at +-0"


def test_abs_gradient_at_zero():
    x = torch.tensor([-1.0, 0.0, 2.0], device=DEV, requires_grad=True)
    assert torch.autograd.grad(apply(ops.abs, x).sum(), x)[0].tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "exponent,unary",
    [(2, "activation_forward"), (0.5, "activation_forward"), (-1, "activation_forward"), (3, "elementwise_forward")],
)
def test_pow_number_exponents_take_the_unary_kernels(exponent, unary):
    """pow(x, 2 / 0.5 / -1) runs square, sqrt and reciprocal (correctly rounded, as PyTorch
    special-cases them); other exponents run the element-wise pow."""
    x = torch.tensor([0.25, 1.5, 3.0, 7.0], dtype=torch.float64, device=DEV)
    with record_launches() as log:
        out = apply(lambda t: ops.pow(t, exponent), x)
    assert [r.kernel for r in log] == [unary]
    torch.testing.assert_close(out, torch.pow(x, exponent), atol=0, rtol=0 if exponent != 3 else 1e-15)


def test_bad_input_is_refused_with_a_clear_message():
    g = Graph()
    with pytest.raises(GraphError, match="only floating-point tensors are supported, got int64"):
        ops.exp(g.input("i", (3,), torch.int64))
    with pytest.raises(TypeError, match="sqrt: input must be a teeny Tensor, got float"):
        ops.sqrt(2.0)
