"""Reductions and softmax: what the generic harness does not see (ties, long rows through the
looping and split paths, NaN/inf semantics and the gradients at 0/0 points, softmax's dtype=,
float64 corrections reaching the kernels as float64, bad input, layers)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import teeny
from teeny.checks.registry import tolerance
from teeny.checks.samples import OPS
from teeny.core.graph import Graph, GraphError, graph_of
from teeny.core.kernel import record_launches
from teeny.ops.reduction import ReduceOp, SoftmaxOp, plan_reduction
from teeny.torch import apply


def _grad(fn, x, *args, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out) if out.dim() else torch.ones(()))
    return out.detach(), g


def _teeny(op_fn):
    return lambda x, *a, **kw: apply(op_fn, x, *a, **kw)


def _with_op(op):
    """A function of a symbolic tensor applying a specific RuntimeOp (e.g. with a small block)."""
    return lambda x: graph_of(x).apply(op, [x])


# ----------------------------------------------------------------------------- max/min ties


@pytest.mark.parametrize("kind", ["max", "min"])
def test_ties_split_gradient_evenly(kind):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, -1.0, 0.0, 5.0]], dtype=torch.float64)
    if kind == "min":
        x = -x
    ref_fn = torch.amax if kind == "max" else torch.amin
    for dim in (1, 0, None):
        out, g = _grad(_teeny(getattr(teeny.ops, kind)), x, dim=dim)
        ref, rg = _grad(lambda t, dim: ref_fn(t, dim=() if dim is None else dim), x, dim=dim)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(g, rg)
    assert g[1].tolist() == [0.0, 0.0, 0.0, 0.0] and g[2, 0] == 0.5 and g[2, 3] == 0.5  # dim=None: the two 5s


def test_ties_over_non_adjacent_dims_half():
    x = torch.randint(0, 3, (4, 3, 5)).to(torch.bfloat16)  # many ties
    out, g = _grad(_teeny(teeny.ops.max), x, dim=(0, 2), keepdim=True)
    ref, rg = _grad(lambda t: torch.amax(t.double(), dim=(0, 2), keepdim=True), x)
    torch.testing.assert_close(out.double(), ref)
    torch.testing.assert_close(g.double(), rg.double(), atol=1e-2, rtol=1e-2)


def test_max_propagates_nan():
    x = torch.tensor([[1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]])
    out = apply(teeny.ops.max, x, dim=1)
    assert math.isnan(out[0]) and out[1] == 3.0
    assert math.isnan(apply(teeny.ops.min, x, dim=None))


# ----------------------------------------------------------------------------- long rows, split


@pytest.mark.parametrize("kind", ["sum", "mean", "max", "var", "std", "logsumexp"])
def test_split_reduction_of_long_row(kind):
    """1 x 5000 to a scalar with BLOCK_R = 64: several partials per output and a second pass."""
    plan = plan_reduction((1, 5000), (0, 1), block=64)
    assert plan.n_split > 1 and plan.chunk > plan.block_r  # split, and each split loops
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5000, generator=gen)
    op = ReduceOp(kind, None, False, max_block=64)
    out, g = _grad(_teeny(_with_op(op)), x)
    refs = {
        "sum": torch.sum,
        "mean": torch.mean,
        "max": torch.amax,
        "var": torch.var,
        "std": torch.std,
        "logsumexp": lambda t: torch.logsumexp(t, dim=(0, 1)),
    }
    ref, rg = _grad(lambda t: refs[kind](t.double()), x)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g.double(), rg.double(), atol=1e-6, rtol=1e-4)


def test_split_reduction_several_outputs_leading_axis():
    """Reduce dim 0 of (3000, 3) (outputs contiguous) through the split path, keepdim."""
    x = torch.randn(3000, 3, dtype=torch.float64)
    op = ReduceOp("var", 0, True, max_block=16)
    assert op.plan((3000, 3)).n_split > 1
    out, g = _grad(_teeny(_with_op(op)), x)
    ref, rg = _grad(lambda t: torch.var(t, dim=0, keepdim=True), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, rg)


def test_plan_large_scalar_reduction_uses_partials(monkeypatch):
    from teeny.ops import reduction

    monkeypatch.setattr(reduction, "TILE", 2048)  # the GPU's plan (the interpreter's aims at few programs)
    monkeypatch.setattr(reduction, "SPLIT_TARGET", 256)
    plan = plan_reduction((4096, 4096), (0, 1))
    assert plan.n_split > 100 and plan.n_out == 1
    plan = plan_reduction((100_000_000,), (0,))
    assert plan.n_split > 100 and plan.chunk * plan.n_split >= 100_000_000
    small = plan_reduction((3, 37), (1,))
    assert small.n_split == 1


@pytest.mark.parametrize("log", [False, True])
def test_softmax_long_row_loops(log):
    x = torch.randn(2, 5000, dtype=torch.float64) * 3
    op = SoftmaxOp(-1, log=log, max_block=256)
    assert not op._layout((2, 5000))["SINGLE"]  # not a single block: the online loop runs
    out, g = _grad(_teeny(_with_op(op)), x)
    ref_fn = F.log_softmax if log else F.softmax
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(2, 5000, generator=gen, dtype=torch.float64)
    xt = x.clone().requires_grad_(True)
    yt = apply(_with_op(op), xt)
    (gt,) = torch.autograd.grad(yt, xt, dy)
    xr = x.clone().requires_grad_(True)
    yr = ref_fn(xr, -1)
    (gr,) = torch.autograd.grad(yr, xr, dy)
    torch.testing.assert_close(yt, yr)
    torch.testing.assert_close(gt, gr)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_non_last_dim_loop_path(log):
    x = torch.randn(3, 300, 2, dtype=torch.float64)
    op = SoftmaxOp(1, log=log, max_block=32)
    dy = torch.randn(3, 300, 2, dtype=torch.float64)
    xt = x.clone().requires_grad_(True)
    yt = apply(_with_op(op), xt)
    (gt,) = torch.autograd.grad(yt, xt, dy)
    xr = x.clone().requires_grad_(True)
    yr = (F.log_softmax if log else F.softmax)(xr, 1)
    (gr,) = torch.autograd.grad(yr, xr, dy)
    torch.testing.assert_close(yt, yr)
    torch.testing.assert_close(gt, gr)


def test_softmax_half_long_row():
    x = torch.randn(1, 3000).to(torch.float16)
    out = apply(_with_op(SoftmaxOp(-1, max_block=128)), x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), F.softmax(x.double(), -1), atol=1e-3, rtol=1e-2)


# ----------------------------------------------------------------------------- special values


def test_softmax_infinities_match_torch():
    x = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3, [float("inf"), 0.0, 1.0]])
    for fn, ref in ((teeny.ops.softmax, F.softmax), (teeny.ops.log_softmax, F.log_softmax)):
        torch.testing.assert_close(apply(fn, x, dim=-1), ref(x, -1), equal_nan=True)
        torch.testing.assert_close(
            apply(_with_op(SoftmaxOp(-1, log=fn is teeny.ops.log_softmax, max_block=2)), x), ref(x, -1), equal_nan=True
        )


def test_nan_and_inf_results_match_torch():
    empty_rows = torch.randn(3, 0)
    torch.testing.assert_close(apply(teeny.ops.mean, empty_rows, dim=1), torch.mean(empty_rows, 1), equal_nan=True)
    torch.testing.assert_close(apply(teeny.ops.sum, empty_rows, dim=1), torch.sum(empty_rows, 1))
    torch.testing.assert_close(apply(teeny.ops.logsumexp, empty_rows, dim=1), torch.logsumexp(empty_rows, 1))
    one = torch.randn(4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(apply(teeny.ops.var, one, dim=1), torch.var(one, 1), equal_nan=True)
        torch.testing.assert_close(apply(teeny.ops.std, one, dim=1, correction=0), torch.std(one, 1, correction=0))
        two = torch.randn(3, 2)
        torch.testing.assert_close(apply(teeny.ops.var, two, dim=1, correction=2), torch.var(two, 1, correction=2))
    ninf = torch.full((2, 3), float("-inf"))
    ninf[1, 0] = 1.0
    torch.testing.assert_close(apply(teeny.ops.logsumexp, ninf, dim=1), torch.logsumexp(ninf, 1))
    pinf = torch.tensor([[1.0, float("inf")]])
    torch.testing.assert_close(apply(teeny.ops.logsumexp, pinf, dim=1), torch.logsumexp(pinf, 1))


def test_fractional_correction():
    x = torch.randn(4, 7, dtype=torch.float64)
    out, g = _grad(_teeny(teeny.ops.std), x, dim=1, correction=0.5)
    ref, rg = _grad(lambda t: torch.std(t, dim=1, correction=0.5), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, rg)


# ----------------------------------------------------------------------------- 0/0 in the derivative


NAN, INF = float("nan"), float("inf")


def _seeded_grad(fn, x, seed_gen=7):
    """fn(x) and its gradient for a fixed random dy (teeny's apply or torch alike)."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed_gen), dtype=out.dtype)
    (g,) = torch.autograd.grad(out, x, dy.to(out.device))
    return out.detach().cpu(), g.cpu()


@pytest.mark.parametrize("max_block", [None, 16])  # 16: the looping and split paths
@pytest.mark.parametrize("kind", ["std", "var"])
def test_constant_rows_have_zero_gradient(kind, max_block):
    """std of a row whose elements are all equal is 0 and its gradient 0, not 0/0 (as PyTorch);
    var's is 0 too. Rows of several lengths, with and without a correction."""
    x = torch.tensor([[2.5] * 300, [-1.0] * 300, list(range(300))], dtype=torch.float64)
    ref_fn = getattr(torch, kind)
    for correction in (1, 0.5):
        for dim, shape in ((1, (3, 300)), (0, (300, 3)), ((0, 1), (1, 900))):
            t = x.reshape(shape) if dim != 0 else x.T.contiguous()
            op = ReduceOp(kind, dim, False, correction, max_block=max_block)
            out, g = _seeded_grad(lambda u: apply(_with_op(op), u), t)
            ref, rg = _seeded_grad(lambda u: ref_fn(u, dim=dim, correction=correction), t)
            torch.testing.assert_close(out, ref)
            torch.testing.assert_close(g, rg)
            assert not g.isnan().any()


@pytest.mark.parametrize("kind", ["std", "var"])
def test_gradient_without_degrees_of_freedom_follows_pytorch(kind):
    """correction >= N: the forward divides by max(0, N - correction) (inf or NaN), while
    PyTorch's gradient keeps N - correction (finite when negative)."""
    x = torch.tensor([[2.0, 1.0, 3.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for correction in (3, 4, 5.5):
            out, g = _seeded_grad(lambda u: apply(getattr(teeny.ops, kind), u, dim=1, correction=correction), x)
            ref, rg = _seeded_grad(lambda u: getattr(torch, kind)(u, dim=1, correction=correction), x)
            torch.testing.assert_close(out, ref, equal_nan=True)
            torch.testing.assert_close(g, rg, equal_nan=True)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_extremum_gradient_of_a_row_holding_nan_is_nan(kind):
    """The max of a row holding NaN is NaN, no element equals it, and PyTorch's gradient
    dy / #ties * [x == y] is then NaN for the whole row; other rows split ties as usual."""
    x = torch.tensor([[1.0, NAN, 3.0, 3.0], [2.0, 2.0, -1.0, 0.0], [NAN, NAN, 0.0, 1.0]], dtype=torch.float64)
    ref_fn = torch.amax if kind == "max" else torch.amin
    for dim in (1, None):
        out, g = _seeded_grad(lambda u: apply(getattr(teeny.ops, kind), u, dim=dim), x)
        ref, rg = _seeded_grad(lambda u: ref_fn(u, dim=() if dim is None else dim), x)
        torch.testing.assert_close(out, ref, equal_nan=True)
        torch.testing.assert_close(g, rg, equal_nan=True)


def test_logsumexp_gradient_of_infinite_rows():
    """exp(x - y) where x and y are both infinite is NaN in PyTorch too; a finite x next to +inf
    gets 0."""
    x = torch.tensor([[-INF, -INF], [INF, 1.0], [INF, INF], [-INF, 0.0]], dtype=torch.float64)
    out, g = _seeded_grad(lambda u: apply(teeny.ops.logsumexp, u, dim=1), x)
    ref, rg = _seeded_grad(lambda u: torch.logsumexp(u, dim=1), x)
    torch.testing.assert_close(out, ref, equal_nan=True)
    torch.testing.assert_close(g, rg, equal_nan=True)


# ----------------------------------------------------------------------------- softmax dtype=


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize(
    "source,target",
    [
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
    ],
    ids=str,
)
def test_softmax_dtype_converts_first(source, target, log):
    """softmax(x, dim, dtype=): x converted to dtype first, the maths and the result in it, the
    gradient converted back to x's dtype, as PyTorch; one block and the looping path, last and
    inner dims. float64 results match PyTorch's to float64 rounding."""
    gen = torch.Generator().manual_seed(11)
    name = "log_softmax" if log else "softmax"
    for shape, dim, max_block in (((3, 37), -1, None), ((5, 3, 11), 1, None), ((2, 300), -1, 32), ((4, 9, 3), 1, 4)):
        x = (torch.randn(shape, generator=gen) * 3).to(source)
        op = SoftmaxOp(dim, log=log, dtype=target, max_block=max_block)
        out, g = _seeded_grad(lambda u: apply(_with_op(op), u.to(teeny.DEVICE)), x)
        ref, rg = _seeded_grad(lambda u: getattr(F, name)(u, dim, dtype=target), x)
        assert out.dtype == target and g.dtype == source
        tight = target == torch.float64
        atol, rtol = (1e-13, 1e-13) if tight else tolerance(_bmin_dtype(source, target), shape[dim])
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(g.double(), rg.double(), **({} if tight else dict(atol=2 * atol, rtol=2 * rtol)))
    assert apply(lambda u: teeny.ops.softmax(u, 0, dtype=target), x.to(teeny.DEVICE)).dtype == target


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_dtype_gradcheck(log):
    """Finite differences through the conversion both ways (float32 steps: one end is float32)."""
    fn = teeny.ops.log_softmax if log else teeny.ops.softmax
    gen = torch.Generator().manual_seed(2)
    for source, target in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        x = torch.randn(3, 5, generator=gen).to(source)
        teeny.gradcheck(lambda t, target=target: fn(t, 1, dtype=target), x, dtype=torch.float32)


def _bmin_dtype(a, b):
    """The less precise of two float dtypes."""
    order = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    return min(a, b, key=order.index)


# ----------------------------------------------------------------------------- float64 scalars


@pytest.mark.parametrize("name", ["var_correction0_3", "std_correction0_7"])
def test_float64_corrections_reach_the_kernels_as_float64(name, gen):
    """A non-dyadic correction (N - 0.3 is the divisor) is a float scalar: float64 launches
    receive it as float64 (LaunchRecord.scalar_types), and float64 results and gradients match
    PyTorch to the tight float64 tolerance."""
    info = OPS[name]
    for sample in info.samples(torch.float64, gen):
        (x,) = sample.args
        if not x.numel():
            continue
        with record_launches() as log:
            out, g = _seeded_grad(lambda u: apply(info.op, u, **sample.kwargs), x)
        ref, rg = _seeded_grad(lambda u: info.ref(u, **sample.kwargs), x)
        atol, rtol = tolerance(torch.float64, sample.reduction)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(g, rg, atol=atol, rtol=rtol)
        divisors = {(r.kernel, r.scalar_types.get("divisor")) for r in log if r.dtype == torch.float64}
        assert ("reduce_backward", "fp64") in divisors and ("reduce_partial", "fp64") in divisors, divisors


# ----------------------------------------------------------------------------- dims and shapes


@pytest.mark.parametrize("dim,keepdim", [([], False), ((), True), (None, True), ((0, -1), True), ((2, 0, 1), False)])
def test_dim_forms_and_keepdim(dim, keepdim):
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    out = apply(teeny.ops.sum, x, dim=dim, keepdim=keepdim)
    ref = torch.sum(x, dim=dim, keepdim=keepdim)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)


def test_zero_dim_tensor_and_many_groups():
    s = torch.tensor(2.5, dtype=torch.float64)
    for kind, ref in (("sum", torch.sum), ("mean", torch.mean), ("max", torch.amax)):
        out, g = _grad(_teeny(getattr(teeny.ops, kind)), s, dim=0)
        r, rg = _grad(lambda t: ref(t, 0), s)
        torch.testing.assert_close(out, r)
        torch.testing.assert_close(g, rg)
    x = torch.randn(2, 3, 2, 3, 2, 3, 2, 3, dtype=torch.float64)  # 4 kept and 4 reduced groups
    out = apply(teeny.ops.mean, x, dim=(1, 3, 5, 7))
    torch.testing.assert_close(out, x.mean((1, 3, 5, 7)))


def test_tensor_methods_sum_and_mean():
    x = torch.randn(5, 3, 11, dtype=torch.float64)
    torch.testing.assert_close(apply(lambda t: t.sum(1, True), x), x.sum(1, True))
    torch.testing.assert_close(apply(lambda t: t.mean((0, 2)), x), x.mean((0, 2)))


# ----------------------------------------------------------------------------- bad input


def _symbolic(shape, dtype=torch.float32):
    return Graph().input("x", shape, dtype)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: teeny.ops.sum(x, dim=2), "dim 2 is out of range for a 2-d tensor"),
        (lambda x: teeny.ops.mean(x, dim=(1, -1)), "appears more than once"),
        (lambda x: teeny.ops.var(x, dim=1.5), "dim must be None, an int or a list/tuple of ints"),
        (lambda x: teeny.ops.softmax(x, dim=-3), "dim -3 is out of range"),
        (lambda x: teeny.ops.log_softmax(x, dim=(0,)), "dim must be an int"),
    ],
)
def test_bad_dims(call, match):
    with pytest.raises(GraphError, match=match):
        call(_symbolic((3, 4)))


def test_bad_dtype_and_empty_extremum():
    with pytest.raises(GraphError, match="floating-point tensor, got int64"):
        teeny.ops.sum(_symbolic((3, 4), torch.int64))
    with pytest.raises(GraphError, match="softmax: expects a floating-point tensor"):
        teeny.ops.softmax(_symbolic((3, 4), torch.int32))
    with pytest.raises(GraphError, match="cannot reduce over dim 0 of size 0"):
        teeny.ops.max(_symbolic((0, 4)), dim=0)
    assert teeny.ops.min(_symbolic((0, 4)), dim=1).shape == (0,)  # torch allows this
    with pytest.raises(GraphError, match="alternates kept and reduced axes"):
        teeny.ops.sum(_symbolic((2,) * 13), dim=(1, 3, 5, 7, 9, 11))
    with pytest.raises(ValueError, match="power of two"):
        SoftmaxOp(-1, max_block=100)
    with pytest.raises(GraphError, match="dtype must be a floating-point torch.dtype or None, got torch.int64"):
        teeny.ops.softmax(_symbolic((3, 4)), -1, dtype=torch.int64)


# ----------------------------------------------------------------------------- layers


def test_layers():
    assert teeny.nn.Softmax is not None and teeny.nn.LogSoftmax is not None
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    layer, log_layer = teeny.nn.Softmax(dim=1), teeny.nn.LogSoftmax(dim=-1)
    assert list(layer.named_parameters()) == [] and list(log_layer.named_parameters()) == []
    torch.testing.assert_close(apply(layer, x), torch.nn.Softmax(dim=1)(x))
    torch.testing.assert_close(apply(log_layer, x), torch.nn.LogSoftmax(dim=-1)(x))
    with pytest.warns(UserWarning, match="Implicit dimension"):
        out = apply(teeny.nn.Softmax(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(out, torch.nn.Softmax()(x))


# ------------------------------------------------------------- sums of partials (kernels.common)


@pytest.mark.parametrize("splits,m", [(1, 1), (7, 3), (40, 1), (97, 5), (300, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_of_partials_in_one_or_two_steps(monkeypatch, splits, m, dtype):
    """``sum_partials``: out[t] = sum over s of partials[s, t]. With a small tile the many-row
    cases take two steps (ranges summed into their first rows, then those rows): the same sums
    as torch, and as the one-step pass at the default tile, to float rounding."""
    from teeny.core import common
    from teeny.core.runtime import launch_kernel

    gen = torch.Generator().manual_seed(splits * 31 + m)
    partials = torch.randn(splits, m, generator=gen, dtype=dtype).to(teeny.DEVICE)
    expected = partials.sum(0)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for tile, steps in ((common._SUM_TILE, 1), (8, 2 if splits > 4 * 8 // common.pow2(m) else 1)):
        monkeypatch.setattr(common, "_SUM_TILE", tile)
        work, out = partials.clone(), torch.full((m,), float("nan"), dtype=dtype, device=teeny.DEVICE)
        launches = common.sum_partials(work, out)
        assert len(launches) == steps, (tile, [launch.grid for launch in launches])
        for launch in launches:
            launch_kernel(launch, dtype, "test")
        torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("splits,m", [(1, 1), (7, 3), (97, 37), (300, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_sums_of_partials_in_one_launch(monkeypatch, splits, m, dtype):
    """``sum_partials(both, out, second)``: a (2, splits, m) buffer of two sums' partials (a
    norm's dw and db) summed into two tensors by one launch, tiles that straddle the halves
    included (37 targets a half); where either sum would take two steps (a small tile and
    many rows), each takes its own."""
    from teeny.core import common
    from teeny.core.runtime import launch_kernel

    gen = torch.Generator().manual_seed(splits * 7 + m)
    both = torch.randn(2, splits, m, generator=gen, dtype=dtype).to(teeny.DEVICE)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for tile in (common._SUM_TILE, 8):
        monkeypatch.setattr(common, "_SUM_TILE", tile)
        _, _, ranges = common._partials_tiles(splits, 2 * m)
        work = both.clone()
        out, second = (torch.full((m,), float("nan"), dtype=dtype, device=teeny.DEVICE) for _ in range(2))
        launches = common.sum_partials(work, out, second)
        if ranges < 2:
            assert len(launches) == 1
        else:
            assert len(launches) == len(common.sum_partials(both[0].clone(), out)) * 2
        for launch in launches:
            launch_kernel(launch, dtype, "test")
        torch.testing.assert_close(out, both[0].sum(0), **tol)
        torch.testing.assert_close(second, both[1].sum(0), **tol)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    with pytest.raises(ValueError, match="one dtype"):  # dw and db of one norm share a dtype
        common.sum_partials(both, out, torch.empty(m, dtype=other, device=teeny.DEVICE))


@pytest.mark.parametrize("splits,steps,width", [(40, 1, 16), (300, 2, 64)])
def test_few_partials_take_one_pass_of_narrower_columns(monkeypatch, splits, steps, width):
    """With a 256-element tile and 64-wide column blocks, 40 partial rows of 64 targets would take
    two steps (10 tiles for one program to loop over); 16-wide blocks take them in one pass of 4
    programs, 3 tiles each. 300 rows are too many even for 16 columns: two steps, 64 wide."""
    from teeny.core import common
    from teeny.core.runtime import launch_kernel

    for name, value in (("_SUM_TILE", 256), ("_SUM_WIDTH", 64), ("_SUM_MIN_WIDTH", 16)):
        monkeypatch.setattr(common, name, value)
    partials = torch.randn(splits, 64, generator=torch.Generator().manual_seed(splits)).to(teeny.DEVICE)
    out = torch.full((64,), float("nan"), device=teeny.DEVICE)
    launches = common.sum_partials(partials.clone(), out)
    assert len(launches) == steps and {launch.grid[0] for launch in launches} == {64 // width}
    for launch in launches:
        launch_kernel(launch, torch.float32, "test")
    torch.testing.assert_close(out, partials.sum(0), rtol=1e-5, atol=1e-5)
