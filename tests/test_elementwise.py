"""Element-wise family: what the generic harness cannot see (broadcast layouts, Python-number
operands on both sides, error messages, tie gradients, clamp boundaries)."""

import pytest
import torch

import teeny
from teeny import ops
from teeny.graph import Graph, GraphError
from teeny.interop.torch import apply

DEV = teeny.DEVICE


def _leaf(t):
    return t.detach().clone().to(DEV).requires_grad_(True)


def _compare(fn, ref, *tensors, atol=1e-6, rtol=1e-6):
    """Forward and every gradient of fn (teeny) against ref (torch) on the same leaves."""
    ours = [_leaf(t) for t in tensors]
    theirs = [_leaf(t) for t in tensors]
    out, expected = apply(fn, *ours), ref(*theirs)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    if out.numel():
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype).to(DEV)
        for g, r in zip(torch.autograd.grad(out, ours, seed), torch.autograd.grad(expected, theirs, seed)):
            torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((2, 1, 3, 1), (1, 4, 1, 5)),  # alternating broadcast, 4 merged dimensions
        ((3, 1), (1, 3)),  # outer product
        ((), (4, 3)),  # 0-d tensor operand
        ((1, 1, 5), (3, 2, 1)),
        ((1,), (3000,)),  # long reduction: split over programs, second pass
        ((6, 1), (6, 700)),  # reduction along the inner dimension
    ],
)
def test_broadcasting_matches_torch(sa, sb, gen):
    a = torch.randn(sa, generator=gen)
    b = torch.randn(sb, generator=gen)
    _compare(ops.mul, torch.mul, a, b, atol=1e-4, rtol=1e-5)
    _compare(lambda x, y: ops.sub(x, y, alpha=3), lambda x, y: torch.sub(x, y, alpha=3), a, b, atol=1e-4, rtol=1e-5)


def test_where_broadcasts_three_ways(gen):
    cond = (torch.rand(4, 1, 3, generator=gen) < 0.5).to(DEV)
    a, b = torch.randn(1, 2, 3, generator=gen), torch.randn(4, 2, 1, generator=gen)
    ours = [_leaf(a), _leaf(b)]
    theirs = [_leaf(a), _leaf(b)]
    out = apply(ops.where, cond, *ours)
    expected = torch.where(cond, *theirs)
    torch.testing.assert_close(out, expected)
    seed = torch.randn(out.shape, generator=gen).to(DEV)
    for g, r in zip(torch.autograd.grad(out, ours, seed), torch.autograd.grad(expected, theirs, seed)):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize(
    "fn,ref",
    [
        (lambda x: x + 1.5, lambda x: x + 1.5),
        (lambda x: 1.5 + x, lambda x: 1.5 + x),
        (lambda x: x - 0.25, lambda x: x - 0.25),
        (lambda x: 1.0 - x, lambda x: 1.0 - x),
        (lambda x: x * 3, lambda x: x * 3),
        (lambda x: 2 * x, lambda x: 2 * x),
        (lambda x: x / 4.0, lambda x: x / 4.0),
        (lambda x: 3.0 / x, lambda x: 3.0 / x),
        (lambda x: -x, lambda x: -x),
        (lambda x: x**2, lambda x: x**2),
        (lambda x: x**3, lambda x: x**3),
        (lambda x: x**-1, lambda x: x**-1),
        (lambda x: 2**x, lambda x: 2**x),
        (lambda x: x * x, lambda x: x * x),  # one tensor feeding both operands
    ],
)
def test_python_number_operands(fn, ref, gen):
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    x = torch.where(x.abs() < 0.1, x + 0.3, x)
    _compare(fn, ref, x, atol=1e-12, rtol=1e-12)


def test_float64_scalar_is_exact():
    # 0.1 is not a float32: a float64 op must see the double, as PyTorch does
    x = torch.linspace(-1, 1, 7, dtype=torch.float64, device=DEV)
    assert torch.equal(apply(lambda t: t + 0.1, x), x + 0.1)
    assert torch.equal(apply(lambda t: t * 0.1, x), x * 0.1)


def test_pow_negative_base_and_zero():
    base = torch.tensor([-2.0, -1.5, 0.0, 0.0, 3.0], dtype=torch.float64, device=DEV)
    exponent = torch.tensor([3.0, 2.0, 2.0, 0.0, -1.0], dtype=torch.float64, device=DEV)
    torch.testing.assert_close(apply(ops.pow, base, exponent), torch.pow(base, exponent))
    assert torch.isnan(apply(ops.pow, torch.tensor([-2.0], device=DEV), torch.tensor([0.5], device=DEV))).all()
    # gradients where torch defines them specially: exponent 0, base 0
    b, e = (
        _leaf(torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)),
        _leaf(torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64)),
    )
    rb, re = _leaf(b), _leaf(e)
    gb, ge = torch.autograd.grad(apply(ops.pow, b, e).sum(), [b, e])
    rgb, rge = torch.autograd.grad(torch.pow(rb, re).sum(), [rb, re])
    torch.testing.assert_close(gb, rgb)
    torch.testing.assert_close(ge, rge)


def test_incompatible_shapes_name_both():
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (5,))
    with pytest.raises(GraphError, match=r"\(3, 4\) and \(5,\)"):
        a + b
    with pytest.raises(GraphError, match=r"\(3, 4\) and \(5,\)"):
        ops.maximum(a, b)
    with pytest.raises(GraphError, match=r"\(2, 3\).*\(3, 4\).*\(5,\)"):
        ops.where(g.input("c", (2, 3), torch.bool), a, b)


def test_bad_dtypes_and_arguments():
    g = Graph()
    x, i = g.input("x", (3,)), g.input("i", (3,), torch.int64)
    with pytest.raises(GraphError, match="floating-point"):
        ops.add(x, i)
    with pytest.raises(GraphError, match="bool"):
        ops.where(x, x, x)
    with pytest.raises(ValueError, match="min.*max"):
        ops.clamp(x)
    with pytest.raises(TypeError, match="teeny Tensor"):
        ops.add(1.0, 2.0)
    with pytest.raises(TypeError, match="str"):
        ops.mul(x, "2")
    with pytest.raises(ValueError, match="rounding_mode must be None, 'trunc' or 'floor', got 'round'"):
        ops.div(x, x, rounding_mode="round")
    with pytest.raises(GraphError, match="float dtypes"):
        ops.add(x, g.input("h", (3,), torch.float16))


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_tie_gradients_split_equally(name):
    a = _leaf(torch.tensor([1.0, 2.0, 3.0, -1.0]))
    b = _leaf(torch.tensor([1.0, 5.0, 0.0, -1.0]))
    out = apply(getattr(ops, name), a, b)
    ga, gb = torch.autograd.grad(out.sum(), [a, b])
    ra, rb = _leaf(a), _leaf(b)
    rga, rgb = torch.autograd.grad(getattr(torch, name)(ra, rb).sum(), [ra, rb])
    torch.testing.assert_close(ga, rga)
    torch.testing.assert_close(gb, rgb)
    assert ga[0] == 0.5 and gb[0] == 0.5 and ga[3] == 0.5


def test_maximum_propagates_nan():
    a = torch.tensor([float("nan"), 1.0, 2.0], device=DEV)
    b = torch.tensor([0.0, float("nan"), 1.0], device=DEV)
    torch.testing.assert_close(apply(ops.maximum, a, b), torch.maximum(a, b), equal_nan=True)
    torch.testing.assert_close(apply(ops.minimum, a, b), torch.minimum(a, b), equal_nan=True)


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (-1.0, None), (None, 1.0), (1.0, -1.0)])
def test_clamp_boundaries(lo, hi):
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 1.0, 2.0])  # hits both boundaries exactly
    ours, theirs = _leaf(x), _leaf(x)
    out = apply(lambda t: ops.clamp(t, lo, hi), ours)
    expected = torch.clamp(theirs, lo, hi)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), ours)[0], torch.autograd.grad(expected.sum(), theirs)[0])


def test_clamp_tensor_bounds_at_ties():
    x = torch.tensor([[-2.0, -1.0, 0.0, 1.0, 2.0], [0.0, -1.0, 0.5, 1.0, 3.0]])
    lo = torch.tensor([-1.0, -1.0, 0.5, 1.0, 3.0])
    hi = torch.tensor([[1.0], [0.0]])
    ours, theirs = [_leaf(t) for t in (x, lo, hi)], [_leaf(t) for t in (x, lo, hi)]
    out = apply(ops.clamp, *ours)
    expected = torch.clamp(*theirs)
    torch.testing.assert_close(out, expected)
    for g, r in zip(torch.autograd.grad(out.sum(), ours), torch.autograd.grad(expected.sum(), theirs)):
        torch.testing.assert_close(g, r)


def test_abs_gradient_at_zero():
    x = _leaf(torch.tensor([-1.0, 0.0, 2.0]))
    assert torch.autograd.grad(apply(ops.abs, x).sum(), x)[0].tolist() == [-1.0, 0.0, 1.0]


def test_empty_batch_gradient_of_broadcast_operand_is_zero():
    a, b = _leaf(torch.randn(0, 5)), _leaf(torch.randn(5))
    out = apply(ops.mul, a, b)
    assert out.shape == (0, 5)
    program = teeny.lower(_traced(ops.mul, (0, 5), (5,)), teeny.LoweringMode.TRAINING)
    ex = teeny.Executor(program)
    _, cache = ex.forward_train({"a": torch.randn(0, 5), "b": torch.randn(5)})
    grads = ex.backward(cache, torch.zeros(0, 5, device=DEV))
    assert torch.equal(grads["b"].cpu(), torch.zeros(5))


def _traced(fn, sa, sb):
    g = Graph()
    a = g.input("a", sa, requires_grad=True)
    b = g.input("b", sb, requires_grad=True)
    g.output(fn(a, b))
    return g


def test_add_saves_nothing_and_mul_by_number_saves_nothing():
    g = _traced(ops.add, (3, 4), (4,))
    assert g.nodes[0].op.saves_inputs == ()
    g2 = Graph()
    x = g2.input("x", (3,), requires_grad=True)
    y = x * 2.0
    assert g2.nodes[-1].op.saves_inputs == ()
    assert y.shape == (3,)
