"""Element-wise family: what the generic harness cannot see (broadcast layouts, Python-number
operands on both sides and their rounding, float64 numbers reaching the kernels as float64, error
messages, tie gradients, clamp boundaries and NaN/infinite/integer bounds, pow and the rounded
divisions at special values)."""

import pytest
import torch

import teeny
from helpers import assert_matches_torch
from teeny import ops
from teeny.checks.registry import tolerance
from teeny.checks.samples import OPS
from teeny.core.graph import Graph, GraphError
from teeny.core.kernel import record_launches
from teeny.torch import apply

DEV = teeny.DEVICE


def _leaf(t):
    return t.detach().clone().to(DEV).requires_grad_(True)


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
    assert_matches_torch(ops.mul, torch.mul, a, b, tol=(1e-4, 1e-5))
    sub, torch_sub = (lambda x, y: ops.sub(x, y, alpha=3)), (lambda x, y: torch.sub(x, y, alpha=3))
    assert_matches_torch(sub, torch_sub, a, b, tol=(1e-4, 1e-5))


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
    assert_matches_torch(fn, ref, x, tol=(1e-12, 1e-12))


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


NAN, INF = float("nan"), float("inf")


def _grads(fn, *tensors, seed=None):
    """fn's value and the gradients of its float leaves (None for the others) for ``seed``."""
    leaves = [t.detach().clone().to(DEV).requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    seed = torch.ones_like(out) if seed is None else seed.to(DEV)
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, seed, allow_unused=True))
    return out.detach().cpu(), [next(grads).cpu() if t.requires_grad else None for t in leaves]


def _assert_same(fn, ref, *tensors, exact=False):
    """teeny's fn and torch's ref agree on the value and every float gradient (bit for bit if exact)."""
    out, grads = _grads(lambda *ts: apply(fn, *ts), *tensors)
    expected, ref_grads = _grads(ref, *tensors)
    tol = dict(atol=0, rtol=0) if exact else {}
    torch.testing.assert_close(out, expected, equal_nan=True, **tol)
    for g, r in zip(grads, ref_grads):
        if r is not None:
            torch.testing.assert_close(g, r, equal_nan=True, **tol)


@pytest.mark.parametrize("which", ["min", "max", "both"])
def test_clamp_nan_and_infinite_tensor_bounds(which):
    """A NaN bound gives NaN and no gradient; an infinite bound is a bound like any other (with
    min = +inf and no max the gradient goes to min), as in PyTorch."""
    x = torch.tensor([-2.0, 0.5, 3.0, NAN, INF, -INF], dtype=torch.float64)
    for bound in (NAN, INF, -INF):
        b = torch.full((6,), bound, dtype=torch.float64)
        other = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
        if which == "min":
            _assert_same(lambda t, lo: ops.clamp(t, lo), lambda t, lo: torch.clamp(t, lo), x, b, exact=True)
        elif which == "max":
            _assert_same(lambda t, hi: ops.clamp(t, None, hi), lambda t, hi: torch.clamp(t, None, hi), x, b, exact=True)
        else:
            _assert_same(ops.clamp, torch.clamp, x, b, other, exact=True)
            _assert_same(ops.clamp, torch.clamp, x, other, b, exact=True)


@pytest.mark.parametrize("kwargs", [{"min": NAN}, {"max": NAN}, {"min": NAN, "max": 1.0}])
def test_clamp_nan_number_bound_gives_nan_and_no_gradient(kwargs):
    """A NaN number bound gives NaN everywhere, as a NaN tensor bound does. The rule is written
    out here, not read from the installed torch: torch 2.11 returned the input unchanged for a
    NaN number bound, torch 2.13 returns NaN (as teeny, and as every torch for tensor bounds)."""
    x = torch.tensor([-2.0, 0.5, 3.0, NAN, INF, -INF], dtype=torch.float64, requires_grad=True)
    out, (grad,) = _grads(lambda t: apply(lambda u: ops.clamp(u, **kwargs), t), x)
    assert out.isnan().all(), out
    torch.testing.assert_close(grad, torch.zeros(6, dtype=torch.float64), atol=0, rtol=0)


@pytest.mark.parametrize("kwargs", [{"min": INF}, {"max": -INF}, {"min": -INF, "max": INF}])
def test_clamp_infinite_number_bounds(kwargs):
    x = torch.tensor([-2.0, 0.5, 3.0, NAN, INF, -INF], dtype=torch.float64)
    _assert_same(lambda t: ops.clamp(t, **kwargs), lambda t: torch.clamp(t, **kwargs), x, exact=True)


def test_clamp_integer_tensors():
    """Integer tensors clamp to integers (the promoted dtype of tensor and bounds), to the default
    float dtype with a float number bound; integer bounds of a float tensor are converted to it."""
    gen = torch.Generator().manual_seed(3)
    i64 = torch.randint(-20, 20, (3, 7), generator=gen)
    i32 = i64.to(torch.int32)
    lo, hi = torch.randint(-10, 0, (7,), generator=gen), torch.randint(0, 10, (3, 1), generator=gen).to(torch.int8)
    cases = [
        (lambda t: ops.clamp(t, -5, 7), lambda t: torch.clamp(t, -5, 7), (i64,)),
        (lambda t: ops.clamp(t, max=3), lambda t: torch.clamp(t, max=3), (i32,)),
        (ops.clamp, torch.clamp, (i32, lo, hi)),  # int32, int64 and int8: int64
        (lambda t, m: ops.clamp(t, m), lambda t, m: torch.clamp(t, m), (i32, hi)),
        (lambda t: ops.clamp(t, min=-2.5), lambda t: torch.clamp(t, min=-2.5), (i64,)),  # float32
        (ops.clamp, torch.clamp, (i64.to(torch.float16) / 4, lo, hi)),  # integer bounds of a half tensor
    ]
    for fn, ref, args in cases:
        out = apply(fn, *[a.to(DEV) for a in args])
        expected = ref(*args)
        assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
        assert torch.equal(out.cpu(), expected)


def test_clamp_refuses_bool_tensors():
    g = Graph()
    with pytest.raises(GraphError, match="only floating-point or integer tensors are supported, got bool"):
        ops.clamp(g.input("b", (3,), torch.bool), 0, 1)


def _assert_same_signs(out, expected):
    """The same sign bits (of zeros and infinities; a NaN's sign is not PyTorch's promise)."""
    numbers = ~expected.isnan()
    assert torch.equal(torch.signbit(out[numbers]), torch.signbit(expected[numbers]))


_POW_BASES = [-INF, -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, INF, NAN]
_POW_EXPONENTS = [-INF, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, INF, NAN]


def test_pow_special_values_match_torch():
    """C's pow at every special base and exponent (pow(-0.0, -3) = -inf, pow(-inf, 3) = -inf,
    pow(-1, inf) = 1, pow(nan, 0) = 1, ...), with both gradients: the exponent's keeps the sign
    of x^y log(x) at -0.0 (+inf for pow(-0.0, -1)). Then a Python-number exponent and base."""
    base = torch.tensor(_POW_BASES, dtype=torch.float64).repeat_interleave(len(_POW_EXPONENTS))
    exponent = torch.tensor(_POW_EXPONENTS, dtype=torch.float64).repeat(len(_POW_BASES))
    out, (gb, ge) = _grads(lambda *ts: apply(ops.pow, *ts), base, exponent)
    expected, (rgb, rge) = _grads(torch.pow, base, exponent)
    torch.testing.assert_close(out, expected, equal_nan=True)
    _assert_same_signs(out, expected)
    torch.testing.assert_close(gb, rgb, equal_nan=True)
    torch.testing.assert_close(ge, rge, equal_nan=True)
    x = torch.tensor(_POW_BASES, dtype=torch.float64)
    for e in (-3, -2.5, 3, 0.7):
        _assert_same(lambda t, e=e: ops.pow(t, e), lambda t, e=e: torch.pow(t, e), x)
    y = torch.tensor(_POW_EXPONENTS, dtype=torch.float64)
    for b in (0.0, -1.0, 0.3):  # (a Python -0.0 is +0.0 under the interpreter, which folds 0 constants)
        _assert_same(lambda t, b=b: ops.pow(b, t), lambda t, b=b: torch.pow(b, t), y)


_DIVIDENDS = [7.0, -7.0, 6.0, -6.0, 0.5, -0.5, 0.0, -0.0, 1e300, INF, -INF, NAN, 5.9999999, -1e-300]
_DIVISORS = [2.0, -2.0, 3.0, -0.5, 0.0, -0.0, INF, -INF, NAN, 1e-300]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["trunc", "floor"])
def test_rounded_division_matches_torch(mode, dtype):
    """div(rounding_mode=) at signs, exact multiples, zero and infinite divisors, NaN, -0.0
    results (PyTorch keeps the sign of the quotient), the same bits as PyTorch; the gradient of
    both operands is zero. Broadcast and Python-number operands too."""
    a = torch.tensor(_DIVIDENDS, dtype=torch.float64).repeat_interleave(len(_DIVISORS)).to(dtype)
    b = torch.tensor(_DIVISORS, dtype=torch.float64).repeat(len(_DIVIDENDS)).to(dtype)
    out, (ga, gb) = _grads(lambda *ts: apply(lambda x, y: ops.div(x, y, rounding_mode=mode), *ts), a, b)
    expected = torch.div(a, b, rounding_mode=mode)
    torch.testing.assert_close(out, expected, equal_nan=True, atol=0, rtol=0)
    _assert_same_signs(out, expected)
    assert torch.equal(ga, torch.zeros_like(a)) and torch.equal(gb, torch.zeros_like(b))
    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randn(4, 1, 3, generator=gen) * 5).to(dtype), (torch.randn(2, 1, generator=gen) + 0.1).to(dtype)
    _assert_same(lambda s, t: ops.div(s, t, rounding_mode=mode), lambda s, t: torch.div(s, t, rounding_mode=mode), x, y)
    for number in (2.5, -0.75):
        _assert_same(
            lambda s: ops.div(s, number, rounding_mode=mode), lambda s: torch.div(s, number, rounding_mode=mode), x
        )


def test_python_numbers_round_like_pytorch_below_float64():
    """In float32 and half kernels a Python number is a float32 scalar, as in PyTorch's opmath:
    the same bits as PyTorch for non-dyadic numbers. (Not bfloat16 here: the 3.6 interpreter
    rounds float32 to bfloat16 toward zero.)"""
    x = torch.linspace(-3, 3, 601, dtype=torch.float32, device=DEV)
    for fn in (lambda t: t + 0.1, lambda t: t * 0.1, lambda t: 0.7 - t, lambda t: t - 0.3):
        assert torch.equal(apply(fn, x), fn(x))
    h = x.to(torch.float16)
    assert torch.equal(apply(lambda t: t * 0.1, h), h * 0.1)
    assert torch.equal(apply(lambda t: ops.clamp(t, -0.3, 0.7), h), torch.clamp(h, -0.3, 0.7))


# every registered op of this family that takes a Python float (number operands, alpha, bounds)
_FLOAT_SCALAR_OPS = [
    "add",
    "sub",
    "add_alpha",
    "sub_alpha",
    "mul",
    "div",
    "div_trunc",
    "div_floor",
    "pow",
    "where",
    "clamp",
]


def _float_numbers(sample) -> bool:
    return any(isinstance(v, float) for v in list(sample.args) + list(sample.kwargs.values()))


@pytest.mark.parametrize("name", _FLOAT_SCALAR_OPS)
def test_float64_numbers_reach_the_kernels_as_float64(name, gen):
    """Every float64 launch receives its float scalars as float64 (LaunchRecord.scalar_types),
    and float64 results with non-dyadic numbers (0.3, -0.7, ...) match PyTorch's float64 to the
    tight float64 tolerance, gradients included (a float32 scalar would be 1e-8 off)."""
    info = OPS[name]
    samples = [
        s
        for s in info.samples(torch.float64, gen)
        if (_float_numbers(s) or name.endswith("alpha")) and all(t.numel() for t in s.tensors())
    ]
    assert samples, f"{name} has no float64 sample with a float number"
    for sample in samples:
        tensors = [a for a in sample.args if isinstance(a, torch.Tensor)]
        positions = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor)]

        def call(fn, *ts, sample=sample, positions=positions):
            args = list(sample.args)
            for i, t in zip(positions, ts):
                args[i] = t
            return fn(*args, **sample.kwargs)

        with record_launches() as log:
            out, grads = _grads(lambda *ts: apply(lambda *s: call(info.op, *s), *ts), *tensors)
        expected, ref_grads = _grads(lambda *ts: call(info.ref, *ts), *tensors)
        atol, rtol = tolerance(torch.float64, sample.reduction)
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=lambda m: f"{name} {sample.name}: {m}")
        for g, r in zip(grads, ref_grads):
            if r is not None:
                torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda m: f"{name} {sample.name} grad: {m}")
        floats = {k: t for rec in log if rec.dtype == torch.float64 for k, t in rec.scalar_types.items() if "fp" in t}
        assert floats and set(floats.values()) == {"fp64"}, f"{name} {sample.name}: {floats}"
