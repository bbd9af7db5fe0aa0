"""Casts: what the generic harness (float to float) does not see: integer and bool targets,
truncation, views for the same dtype, the gradient's dtype, and bad dtypes."""

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, lower, ops
from teeny.core.kernel import record_launches
from teeny.torch import apply


@pytest.mark.parametrize("target", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16, torch.float64])
def test_float_to_any_dtype_matches_torch(target):
    x = torch.tensor([[-2.7, -0.5, 0.0, 0.4, 1.5, 3.99]])
    out = apply(lambda t: ops.to(t, target), x)
    expected = x.abs().to(target) if target == torch.uint8 else x.to(target)  # uint8 of a negative is undefined
    if target == torch.uint8:
        out = apply(lambda t: ops.to(t, target), x.abs())
    assert out.dtype == target
    torch.testing.assert_close(out.cpu(), expected)


def test_int_and_bool_sources_and_tensor_methods():
    i = torch.tensor([3, -1, 0, 7])
    torch.testing.assert_close(apply(lambda t: t.float() * 0.5, i).cpu(), i.float() * 0.5)
    torch.testing.assert_close(apply(lambda t: t.bool(), i).cpu(), i.bool())
    torch.testing.assert_close(apply(lambda t: t.long(), i.bool()).cpu(), i.bool().long())


def test_same_dtype_is_a_view_and_launches_nothing():
    g = Graph()
    x = g.input("x", (4, 3))
    g.output(ops.to(x, torch.float32))
    program = lower(g, LoweringMode.INFERENCE)
    assert program.kernel_names() == []  # a view: the dry run launches nothing, so nothing is built
    ex = teeny.Executor(program)
    t = torch.randn(4, 3)
    with record_launches() as log:
        ex.forward({"x": t})
    assert log == []


def test_gradient_is_cast_back_to_the_input_dtype():
    x = torch.randn(5, 7, dtype=torch.float32, requires_grad=True)
    y = apply(lambda t: ops.to(t, torch.bfloat16), x)
    (g,) = torch.autograd.grad(y.float().pow(2).sum(), [x])
    x_ref = x.detach().clone().requires_grad_()
    (r,) = torch.autograd.grad(x_ref.to(torch.bfloat16).float().pow(2).sum(), [x_ref])
    assert g.dtype == torch.float32
    torch.testing.assert_close(g.cpu(), r)
    teeny.gradcheck(
        lambda t: ops.to(ops.to(t, torch.float32), torch.float64),
        torch.randn(3, 4, dtype=torch.float64),
        atol=1e-4,
        rtol=1e-3,
        eps=1e-3,
    )


def test_a_cast_to_an_integer_ends_the_gradient():
    g = Graph()
    w = g.parameter("w", (3,))
    g.output(ops.sum(ops.to(ops.to(w, torch.int64), torch.float32)))
    with pytest.raises(teeny.TeenyError, match="depends on no trainable parameter"):
        lower(g, LoweringMode.TRAINING)


def test_bad_dtype_is_a_clear_error():
    g = Graph()
    x = g.input("x", (2,))
    with pytest.raises(teeny.GraphError, match=r"to: dtype must be a torch.dtype, got 'float'"):
        ops.to(x, "float")
    with pytest.raises(teeny.GraphError, match=r"teeny has no complex64 tensors"):
        ops.to(x, torch.complex64)


FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PAIRS = [(s, t) for s in FLOATS for t in FLOATS if s != t]


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}-{t}".replace("torch.", "") for s, t in PAIRS])
def test_every_float_pair_matches_torch_forward_and_backward(source, target):
    """Exact both ways: narrowing rounds to nearest even (on the CPU too), widening is exact, and
    the gradient is the incoming gradient cast back."""
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0)).to(source).requires_grad_()
    y = apply(lambda t: ops.to(t, target), x)
    assert y.dtype == target
    torch.testing.assert_close(y.cpu(), x.detach().to(target), atol=0, rtol=0)
    seed = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)).to(target)
    (g,) = torch.autograd.grad(y, x, seed)
    assert g.dtype == source
    torch.testing.assert_close(g.cpu(), seed.to(source), atol=0, rtol=0)


# ----------------------------------------------------------- parameters side by side, cast as one


def _stacked_cast_graph(rows, cols, source, target):
    """Parameters of ``rows`` x ``cols`` (side by side in the arena) cast as one stacked tensor,
    then loss = sum(y.float() * c) with a fixed c."""
    from teeny.ops.cast import StackedCastOp

    g = Graph()
    parts = [g.parameter(f"p{i}", (r, cols), teeny.core.init.normal(1.0), dtype=source) for i, r in enumerate(rows)]
    y = g.apply(StackedCastOp(target, len(parts)), parts)
    c = torch.linspace(-2, 3, sum(rows) * cols, dtype=torch.float64).reshape(sum(rows), cols)
    g.output(ops.sum(ops.mul(ops.to(y, source), g.constant(c.to(source)))))
    return g, c


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
def test_stacked_cast_matches_torch_forward_and_backward(target):
    """float32 parameters of 3, 1 and 5 rows cast as one: one launch each way, the values and
    gradients exactly torch's cat-then-cast, the parts one after the other in the arena."""
    from teeny.ops.cast import StackedCastOp

    g, c = _stacked_cast_graph((3, 1, 5), 4, torch.float32, target)
    program = lower(g, LoweringMode.TRAINING)
    (node,) = [p for p in program.nodes if isinstance(p.op, StackedCastOp)]
    assert len(node.forward_launches) == len(node.backward_launches) == 1
    ex = teeny.Executor(program, seed=0)
    parts = [ex.params[f"p{i}"] for i in range(3)]
    for a, b in zip(parts, parts[1:]):
        assert b.data_ptr() == a.data_ptr() + a.nbytes
    loss, cache = ex.forward_train({})
    ex.backward(cache)
    ref = [t.detach().cpu().clone().requires_grad_() for t in parts]
    ref_loss = (torch.cat(ref).to(target).float() * c.float()).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-6, atol=1e-5)
    for i, r in enumerate(ref):
        torch.testing.assert_close(ex.grads[f"p{i}"].cpu(), r.grad, atol=0, rtol=0)


def test_stacked_cast_gradcheck_float64():
    """float64 parts cast to float64 (the narrowing casts round finite differences away): each
    part's gradient comes from its own rows of dy."""
    g, _ = _stacked_cast_graph((2, 1, 3), 2, torch.float64, torch.float64)
    teeny.gradcheck_graph(g, {})


def test_stacked_cast_of_non_parameters_is_a_clear_error():
    from teeny.ops.cast import StackedCastOp

    g = Graph()
    a, b = g.input("a", (2, 4), requires_grad=True), g.parameter("b", (2, 4))
    g.output(ops.sum(g.apply(StackedCastOp(torch.bfloat16, 2), [a, b])))
    with pytest.raises(teeny.TeenyError, match=r"side by side in the arena, but 'a' are not parameters"):
        teeny.Executor(lower(g, LoweringMode.TRAINING))
    with pytest.raises(teeny.GraphError, match=r"the parts must agree in every dim but the first"):
        g.apply(StackedCastOp(torch.bfloat16, 2), [b, g.parameter("c", (2, 3))])
