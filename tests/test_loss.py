"""Loss family: what the generic harness (tests/test_ops.py) cannot see: ignore_index edge cases,
label smoothing and probability targets with weights, long rows that need the column loop,
out-of-range targets (checked and unchecked), soft-capped logits, gradients at kinks and zeros,
float64 scalars at tight tolerance, bad input errors, layers, and what the cross-entropy saves."""

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import assert_matches_torch
from teeny import Graph, GraphError, LoweringMode, TeenyError, lower
from teeny.checks.registry import make
from teeny.core.kernel import record_launches
from teeny.ops import loss as L
from teeny.ops.loss import ops as loss_ops
from teeny.program.executor import Executor
from teeny.torch import apply as _apply


def apply(fn, *args, **kwargs):
    """teeny.torch.apply on teeny's device, differentiably, with the result on the CPU."""
    move = lambda a: a.to(teeny.DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return _apply(fn, *map(move, args), **{k: move(v) for k, v in kwargs.items()}).cpu()


def _assert_matches(fn, ref, *args, atol=1e-5, rtol=1e-5, grad_out=None, **kwargs):
    """The loss ``fn`` against torch's ``ref`` (float64) at a fixed tolerance, NaN where torch
    has NaN; ``kwargs`` are the loss's own (``reduction=``, ``weight=``...)."""
    tol = (atol, rtol)
    return assert_matches_torch(fn, ref, *args, kwargs=kwargs, tol=tol, grad_out=grad_out, equal_nan=True)


# ------------------------------------------------------------------------------ ignore_index


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_all_ignored(reduction, smoothing):
    x = torch.randn(4, 6)
    target = torch.full((4,), -100)
    out, grads = _assert_matches(
        L.cross_entropy,
        F.cross_entropy,
        x,
        target,
        reduction=reduction,
        label_smoothing=smoothing,
        weight=torch.rand(6) + 0.5,
    )
    if reduction == "mean":
        assert torch.isnan(out)  # 0 / 0, like torch
    assert torch.equal(grads[0], torch.zeros_like(x))  # ignored rows get no gradient, not NaN


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_nll_all_ignored(reduction):
    x = torch.log_softmax(torch.randn(3, 5), 1)
    out, grads = _assert_matches(L.nll_loss, F.nll_loss, x, torch.full((3,), 1), ignore_index=1, reduction=reduction)
    assert torch.isnan(out) if reduction == "mean" else out == 0
    assert torch.equal(grads[0], torch.zeros_like(x))


def test_mean_divides_by_weights_of_kept_targets():
    x, target, weight = torch.randn(7, 5), torch.tensor([0, 4, -100, 2, 2, -100, 1]), torch.rand(5) + 0.1
    out, _ = _assert_matches(L.cross_entropy, F.cross_entropy, x, target, weight=weight)
    kept = target != -100
    manual = (F.cross_entropy(x, target, weight=weight, reduction="sum")) / weight[target[kept]].sum()
    torch.testing.assert_close(out, manual)


# ---------------------------------------------------- label smoothing, weights, probabilities


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_with_weights_and_ignore(reduction):
    x, target = torch.randn(9, 6), torch.tensor([0, 5, -100, 3, 3, 1, -100, 2, 4])
    _assert_matches(
        L.cross_entropy,
        F.cross_entropy,
        x,
        target,
        weight=torch.rand(6) + 0.2,
        label_smoothing=0.3,
        reduction=reduction,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_probability_targets(reduction):
    x = torch.randn(5, 7)
    target = torch.softmax(torch.randn(5, 7), 1)
    out, grads = _assert_matches(
        L.cross_entropy,
        F.cross_entropy,
        x,
        target,
        weight=torch.rand(7) + 0.2,
        label_smoothing=0.15,
        reduction=reduction,
    )
    assert len(grads) == 2  # gradient w.r.t. the target too


def test_unnormalised_probability_targets_and_spatial_dims():
    x = torch.randn(2, 4, 3, 2)
    target = torch.rand(2, 4, 3, 2) * 2  # need not sum to 1
    _assert_matches(L.cross_entropy, F.cross_entropy, x, target)
    _assert_matches(L.cross_entropy, F.cross_entropy, x, torch.randint(0, 4, (2, 3, 2)), label_smoothing=0.1)


def test_uint8_targets():
    x = torch.randn(3, 5)
    _assert_matches(L.cross_entropy, F.cross_entropy, x, torch.tensor([1, 4, 0], dtype=torch.uint8))


# -------------------------------------------------------------------------------- long rows


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_long_row_loops_over_column_blocks(monkeypatch, smoothing):
    monkeypatch.setattr(loss_ops, "MAX_BLOCK_C", 512)  # 5000 classes: 10 column blocks
    x = torch.randn(2, 5000) * 4
    x[0, 4321] = 60.0  # a large logit in a late block: the online max must rescale
    target = torch.tensor([4321, 17])
    _assert_matches(
        L.cross_entropy, F.cross_entropy, x, target, weight=torch.rand(5000) + 0.5, label_smoothing=smoothing
    )
    _assert_matches(L.cross_entropy, F.cross_entropy, x[:1], torch.softmax(torch.randn(1, 5000), 1), reduction="sum")


def test_large_logits_are_stable():
    x = torch.tensor([[1000.0, 0.0, -1000.0], [-1e4, -1e4, -1e4]])
    _assert_matches(L.cross_entropy, F.cross_entropy, x, torch.tensor([1, 2]), reduction="none")


# ------------------------------------------------------------------------ soft-capped logits


def _soft_capped_cross_entropy(input, target, softcap, **kwargs):
    """PyTorch's reference: cross-entropy of the logits capped as Gemma 2 caps them."""
    return F.cross_entropy(softcap * torch.tanh(input / softcap), target, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [1.7, 30.0])
def test_soft_capped_cross_entropy_matches_pytorch(reduction, softcap):
    """15 rows of 11 classes, logits up to 10 (a cap of 1.7 flattens them; 30, Gemma 2's, barely),
    with label smoothing, class weights and ignored rows: the loss and gradient of the capped logits."""
    gen = torch.Generator().manual_seed(3)
    x = make(gen, 15, 11, low=-10, high=10)
    target = torch.randint(0, 11, (15,), generator=gen)
    target[[2, 9]] = -100
    kwargs = dict(weight=make(gen, 11, low=0.2, high=2), label_smoothing=0.1, reduction=reduction)
    fn = lambda a, b, **kw: L.cross_entropy(a, b, softcap=softcap, **kw)
    ref = lambda a, b, **kw: _soft_capped_cross_entropy(a, b, softcap, **kw)
    out, _ = _assert_matches(fn, ref, x, target, **kwargs)
    assert not torch.allclose(out, F.cross_entropy(x, target, **kwargs), rtol=1e-3)  # the cap counts


def test_soft_capped_cross_entropy_over_column_blocks_and_spatial_dims(monkeypatch):
    """The cap on every column block of a long row (the online max sees capped logits) and on
    (N, C, d) inputs, whose classes are d apart."""
    monkeypatch.setattr(loss_ops, "MAX_BLOCK_C", 512)  # 2000 classes: 4 column blocks
    x = torch.randn(3, 2000) * 5
    x[0, 1500] = 80.0  # capped at 3: not the row's lse on its own
    target = torch.tensor([1500, 7, -100])
    fn = lambda a, b, **kw: L.cross_entropy(a, b, softcap=3.0, **kw)
    _assert_matches(fn, lambda a, b, **kw: _soft_capped_cross_entropy(a, b, 3.0, **kw), x, target)
    spatial, spatial_target = torch.randn(2, 5, 3) * 4, torch.tensor([[0, 4, 2], [1, -100, 3]])
    fn = lambda a, b, **kw: L.cross_entropy(a, b, softcap=2.0, **kw)
    ref = lambda a, b, **kw: _soft_capped_cross_entropy(a, b, 2.0, **kw)
    _assert_matches(fn, ref, spatial, spatial_target, label_smoothing=0.2, reduction="sum")


def test_soft_capped_cross_entropy_gradcheck_float64():
    gen = torch.Generator().manual_seed(5)
    x = make(gen, 4, 6, dtype=torch.float64, low=-4, high=4)
    target = torch.tensor([5, -100, 0, 3])
    weight = make(gen, 6, dtype=torch.float64, low=0.2, high=2)
    for reduction in ("mean", "sum", "none"):
        kwargs = dict(weight=weight, label_smoothing=0.1, reduction=reduction, softcap=1.3)
        teeny.gradcheck(L.cross_entropy, x, target, kwargs=kwargs, requires_grad=lambda i, _: i == 0)  # x only


def test_a_soft_cap_of_0_is_none_and_a_bad_one_is_refused():
    x, target = torch.randn(4, 5) * 3, torch.tensor([0, 4, -100, 2])
    out = apply(lambda a, b: L.cross_entropy(a, b, softcap=0.0), x, target)
    torch.testing.assert_close(out, F.cross_entropy(x, target))
    _, (gx, gt) = _graph(((4, 5), torch.float32), ((4,), torch.int64))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"cross_entropy: softcap must be a positive finite number.*got {bad}"):
            L.cross_entropy(gx, gt, softcap=bad)
    _, (px, probs) = _graph(((4, 5), torch.float32), ((4, 5), torch.float32))
    with pytest.raises(GraphError, match="softcap is for class-index targets"):
        L.cross_entropy(px, probs, softcap=2.0)
    with pytest.raises(ValueError, match="nll_loss: softcap caps logits"):
        loss_ops.ClassLossOp("nll_loss", from_logits=False, softcap=2.0)


# --------------------------------------------------------------------- out-of-range targets


def test_out_of_range_target_unchecked_gives_nan_without_reading_out_of_bounds(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", False)  # read when the op is traced
    x = torch.randn(3, 4, requires_grad=True)
    out = apply(L.cross_entropy, x, torch.tensor([0, 7, -3]), reduction="none")
    assert not torch.isnan(out[0]) and torch.isnan(out[1:]).all()
    out.sum().backward()
    assert torch.isnan(x.grad[1:]).all() and not torch.isnan(x.grad[0]).any()
    assert torch.isnan(apply(L.nll_loss, x.detach(), torch.tensor([0, 4, 1])))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", [L.cross_entropy, L.nll_loss])
def test_out_of_range_target_checked_raises_naming_op_and_index(fn, reduction, monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)
    x = torch.log_softmax(torch.randn(5, 4), 1)
    with pytest.raises(
        TeenyError, match=rf"op {fn.__name__} \(node .*target class index 9 is out of range.* 4 classes"
    ):
        apply(fn, x, torch.tensor([0, 9, 3, -100, 2]), reduction=reduction)
    with pytest.raises(TeenyError, match=r"target class index (-3|4) is out of range.*ignore_index is 1"):
        apply(fn, x, torch.tensor([-3, 1, 4, 0, 1]), ignore_index=1, reduction=reduction)
    # ignored rows and in-range targets pass the check; spatial dims (N, C, d) too
    _assert_matches(fn, getattr(F, fn.__name__), x, torch.tensor([0, 1, 3, -100, 2]), reduction=reduction)
    with pytest.raises(TeenyError, match="target class index 4 is out of range"):
        apply(fn, torch.randn(2, 4, 3), torch.tensor([[0, 1, 2], [3, 4, 0]]), reduction=reduction)


def test_checked_index_error_surfaces_through_the_executor(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)
    g = Graph()
    x, t = g.input("logits", (4, 3), requires_grad=True), g.input("target", (4,), torch.int64)
    g.output(L.cross_entropy(x, t))
    executor = Executor(lower(g, LoweringMode.TRAINING))
    with pytest.raises(TeenyError, match=r"cross_entropy \(node 'cross_entropy_0', forward\): target class index 3 "):
        executor.forward_train({"logits": torch.randn(4, 3), "target": torch.tensor([0, 3, 1, 2])})
    loss, cache = executor.forward_train({"logits": torch.randn(4, 3), "target": torch.tensor([0, 2, 1, 2])})
    assert torch.isfinite(loss) and executor.backward(cache)["logits"].isfinite().all()


# ------------------------------------------------------------------------- element-wise edges


def test_bce_log_clamp_and_extremes():
    x, t = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5]), torch.tensor([0.0, 1.0, 1.0, 0.0, 0.3])
    out = apply(L.binary_cross_entropy, x, t, reduction="none")
    torch.testing.assert_close(out, F.binary_cross_entropy(x, t, reduction="none"))  # -log(0) clamped to 100


def test_bce_with_logits_extreme_logits():
    x, t = torch.tensor([-200.0, 200.0, 30.0, -30.0]), torch.tensor([1.0, 0.0, 1.0, 0.5])
    pos = torch.tensor([2.0, 0.5, 1.0, 3.0])
    _assert_matches(
        L.binary_cross_entropy_with_logits,
        F.binary_cross_entropy_with_logits,
        x,
        t,
        pos_weight=pos,
        reduction="none",
        atol=1e-4,
    )


@pytest.mark.parametrize("shape", [(5,), (4, 3)])
def test_kl_div_batchmean_divides_by_first_dim(shape):
    x, t = torch.log_softmax(torch.randn(shape), -1), torch.softmax(torch.randn(shape), -1)
    _assert_matches(L.kl_div, F.kl_div, x, t, reduction="batchmean")


def test_weight_broadcast_over_trailing_dims():
    x, t = torch.rand(2, 3, 4) * 0.9 + 0.05, torch.rand(2, 3, 4)
    for w in (torch.rand(4), torch.rand(3, 4), torch.rand(1, 3, 4), torch.rand(1)):
        _assert_matches(L.binary_cross_entropy, F.binary_cross_entropy, x, t, weight=w)


@pytest.mark.parametrize("fn,ref", [(L.mse_loss, F.mse_loss), (L.l1_loss, F.l1_loss), (L.huber_loss, F.huber_loss)])
def test_empty_mean_is_nan_like_torch(fn, ref):
    x = torch.randn(0, 3)
    out = apply(fn, x, x.clone())
    assert torch.isnan(out) and torch.isnan(ref(x, x.clone()))


def test_long_mean_two_pass_reduction():
    x, t = torch.randn(3001), torch.randn(3001)  # 3 programs of partials
    _assert_matches(L.mse_loss, F.mse_loss, x, t)


# ------------------------------------------------------------- kinks and 0/0 in derivatives


@pytest.mark.parametrize(
    "fn,ref,x,t,kwargs",
    [
        # |d| == beta exactly (d / beta = sign(d) = +-1), d == 0, and beta = 0 (L1: sign(0) = 0)
        (L.smooth_l1_loss, F.smooth_l1_loss, [0.3, -0.3, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5], {"beta": 0.3}),
        (L.smooth_l1_loss, F.smooth_l1_loss, [0.0, 1.0, -2.0], [0.0, 0.0, 0.0], {"beta": 0.0}),
        (L.huber_loss, F.huber_loss, [0.7, -0.7, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], {"delta": 0.7}),
        (L.l1_loss, F.l1_loss, [1.0, 0.0, -1.0], [1.0, 0.5, -1.0], {}),
        (L.mse_loss, F.mse_loss, [1.0, 0.0], [1.0, 0.5], {}),
        # t = 0: the loss is 0, d/dx = -t = 0; d/dt is NaN, as PyTorch's xlogy gradient
        (L.kl_div, F.kl_div, [-1.0, -2.0, -0.5], [0.0, 0.3, 0.7], {"reduction": "sum"}),
        (L.binary_cross_entropy, F.binary_cross_entropy, [0.0, 1.0, 0.5, 0.0], [0.0, 1.0, 0.5, 1.0], {}),
    ],
)
def test_gradients_at_kinks_and_zeros_match_torch(fn, ref, x, t, kwargs):
    x, t = torch.tensor(x, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    for reduction in ("none", kwargs.pop("reduction", "mean")):
        _assert_matches(fn, ref, x, t, atol=1e-12, rtol=1e-12, reduction=reduction, **kwargs)


def test_kl_div_target_gradient_is_nan_only_where_torch_is():
    x, t = torch.tensor([-1.0, -2.0]), torch.tensor([0.0, 0.3])
    _, (dx, dt) = _assert_matches(L.kl_div, F.kl_div, x, t, reduction="sum", grad_out=torch.tensor(1.0))
    assert dx.tolist() == [0.0, pytest.approx(-0.3)] and torch.isnan(dt[0]) and dt[1].isfinite()


# ------------------------------------------------------------------ float64 all the way


def test_huber_linear_region_gradient_is_delta_exactly_in_float64():
    x = torch.tensor([2.0, -3.0, 0.25], dtype=torch.float64, requires_grad=True)
    loss = apply(L.huber_loss, x, torch.zeros(3, dtype=torch.float64), reduction="sum", delta=0.7)
    (dx,) = torch.autograd.grad(loss, x)
    assert dx.tolist() == [0.7, -0.7, 0.25]  # not 0.699999988 (delta through float32)
    assert loss.item() == 0.7 * (2.0 - 0.35) + 0.7 * (3.0 - 0.35) + 0.5 * 0.25 * 0.25


# (fn, torch reference, input, target, kwargs): non-dyadic scalars and weights in float64
def _float64_cases():
    gen = torch.Generator().manual_seed(7)
    rand = lambda *s, lo=-2.0, hi=2.0: make(gen, *s, dtype=torch.float64, low=lo, high=hi)  # noqa: E731
    x, t = rand(5, 7), rand(5, 7)
    p, q = rand(5, 7, lo=0.05, hi=0.95), rand(5, 7, lo=0.0, hi=1.0)
    w = rand(7, lo=0.1, hi=2.0)
    idx = torch.tensor([0, 6, -100, 3, 3])
    probs = torch.softmax(rand(5, 7), 1)
    capped = lambda a, b, **kw: F.cross_entropy(0.7 * torch.tanh(a / 0.7), b, **kw)  # noqa: E731
    return [
        (L.smooth_l1_loss, F.smooth_l1_loss, x, t, {"beta": 0.3}),
        (L.huber_loss, F.huber_loss, x, t, {"delta": 0.7, "reduction": "sum"}),
        (L.binary_cross_entropy, F.binary_cross_entropy, p, q, {"weight": w}),
        (L.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits, x, q, {"weight": w, "pos_weight": w}),
        (L.kl_div, F.kl_div, torch.log(p), q, {"reduction": "batchmean"}),
        (L.cross_entropy, F.cross_entropy, x, idx, {"weight": w, "label_smoothing": 0.1}),
        (L.cross_entropy, F.cross_entropy, x, probs, {"weight": w, "label_smoothing": 0.3, "reduction": "none"}),
        (L.nll_loss, F.nll_loss, torch.log_softmax(x, 1), idx, {"weight": w}),
        (lambda a, b, **kw: L.cross_entropy(a, b, softcap=0.7, **kw), capped, x, idx, {"weight": w}),
    ]


@pytest.mark.parametrize("case", range(len(_float64_cases())))
def test_float64_matches_torch_tightly_and_launches_take_float64_scalars(case):
    fn, ref, x, t, kwargs = _float64_cases()[case]
    with record_launches() as records:
        _assert_matches(fn, ref, x, t, atol=1e-13, rtol=1e-13, **kwargs)
    floats = {(r.kernel, name): kind for r in records for name, kind in r.scalar_types.items() if kind[:2] == "fp"}
    assert floats and all(kind == "fp64" for kind in floats.values()), floats
    assert all(r.dtype == torch.float64 for r in records)


# --------------------------------------------------------------------------------- errors


def _graph(*specs):
    g = Graph()
    return g, [g.input(f"a{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)]


@pytest.mark.parametrize(
    "target_spec,match",
    [
        (((3,), torch.int32), "int64"),
        (((3,), torch.float32), "class-probability target of shape"),
        (((4,), torch.int64), "does not match input"),
        (((3, 5), torch.float64), "different float dtypes"),
    ],
)
def test_cross_entropy_bad_target(target_spec, match):
    _, (x, t) = _graph(((3, 5), torch.float32), target_spec)
    with pytest.raises(GraphError, match=match):
        L.cross_entropy(x, t)


def test_class_loss_errors():
    _, (x, t, w) = _graph(((3, 5), torch.float32), ((3,), torch.int64), ((4,), torch.float32))
    with pytest.raises(GraphError, match=r"weight must have shape \(5,\)"):
        L.cross_entropy(x, t, weight=w)
    with pytest.raises(ValueError, match="reduction"):
        L.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        L.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(GraphError, match="class indices"):
        L.nll_loss(x, x)
    _, (x0, t0) = _graph(((3, 0), torch.float32), ((3,), torch.int64))
    with pytest.raises(GraphError, match="no classes"):
        L.cross_entropy(x0, t0)


def test_pointwise_errors():
    _, (x, t, t_int, w) = _graph(
        ((3, 4), torch.float32), ((4, 3), torch.float32), ((3, 4), torch.int64), ((3, 1), torch.float32)
    )
    with pytest.raises(GraphError, match="target shape"):
        L.mse_loss(x, t)
    with pytest.raises(GraphError, match="floating point"):
        L.l1_loss(x, t_int)
    with pytest.raises(GraphError, match="weight of shape"):
        L.binary_cross_entropy(x, x, weight=w)
    with pytest.raises(ValueError, match="reduction"):
        L.mse_loss(x, x, reduction="batchmean")
    with pytest.raises(ValueError, match="beta"):
        L.smooth_l1_loss(x, x, beta=-1.0)


def test_weight_gradient_is_refused_loudly():
    g, (x, t) = _graph(((3, 4), torch.float32), ((3,), torch.int64))
    x.value.requires_grad = True
    w = g.input("w", (4,), requires_grad=True)
    g.output(L.cross_entropy(x, t, weight=w))
    with pytest.raises(TeenyError, match="not differentiable with respect to its weight"):
        lower(g, LoweringMode.TRAINING)


# ------------------------------------------------------------------------ layers and graphs


def test_layers_match_torch_modules():
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    p, q = torch.rand(3, 4) * 0.9 + 0.05, torch.rand(3, 4)
    idx, w = torch.tensor([0, 3, -100]), torch.rand(4) + 0.5
    cases = [
        (teeny.nn.MSELoss(), torch.nn.MSELoss(), (x, t)),
        (teeny.nn.L1Loss(reduction="sum"), torch.nn.L1Loss(reduction="sum"), (x, t)),
        (teeny.nn.SmoothL1Loss(beta=0.5), torch.nn.SmoothL1Loss(beta=0.5), (x, t)),
        (teeny.nn.HuberLoss(delta=0.5), torch.nn.HuberLoss(delta=0.5), (x, t)),
        (teeny.nn.BCELoss(weight=w), torch.nn.BCELoss(weight=w), (p, q)),
        (teeny.nn.BCEWithLogitsLoss(pos_weight=w), torch.nn.BCEWithLogitsLoss(pos_weight=w), (x, q)),
        (teeny.nn.KLDivLoss(reduction="batchmean"), torch.nn.KLDivLoss(reduction="batchmean"), (x, q)),
        (teeny.nn.NLLLoss(weight=w), torch.nn.NLLLoss(weight=w), (x, idx)),
        (
            teeny.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1),
            torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1),
            (x, idx),
        ),
    ]
    for ours, theirs, args in cases:
        assert ours.parameters() == []  # weights are constants, not parameters
        assert ours.reduction == theirs.reduction
        out = apply(lambda a, b, m=ours: m(a, b), *args)
        torch.testing.assert_close(out, theirs(*args), msg=type(ours).__name__)


def test_training_graph_with_constant_weight_saves_only_lse():
    g = Graph()
    x = g.input("logits", (6, 11), requires_grad=True)
    t = g.input("target", (6,), torch.int64)
    weight = torch.rand(11) + 0.5
    g.output(teeny.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(x, t))
    executor = Executor(lower(g, LoweringMode.TRAINING))
    logits, target = torch.randn(6, 11), torch.tensor([1, 10, 0, -100, 5, 5])
    loss, cache = executor.forward_train({"logits": logits, "target": target})
    (entry,) = cache.entries.values()
    assert {k: tuple(v.shape) for k, v in entry["saved"].items()} == {"lse": (6,), "sums": (2,)}
    grads = executor.backward(cache)
    ref_x = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_x, target, weight=weight, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref.detach())
    torch.testing.assert_close(grads["logits"].cpu(), ref_x.grad)


def test_public_names():
    assert teeny.ops.mse is teeny.ops.mse_loss
    for name in L.__all__:
        assert hasattr(teeny.ops, name)
    for name in L.NN_LAYERS:
        assert hasattr(teeny.nn, name)
    import inspect

    for ours, theirs in [
        (L.cross_entropy, F.cross_entropy),
        (L.nll_loss, F.nll_loss),
        (L.kl_div, F.kl_div),
        (L.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits),
    ]:
        mine = inspect.signature(ours).parameters
        for name, p in inspect.signature(theirs).parameters.items():
            if name not in ("size_average", "reduce"):
                assert name in mine and mine[name].default == p.default, (ours.__name__, name)


@pytest.mark.parametrize("rows", [5, 20000], ids=["one program", "several programs"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_class_loss_of_one_program_writes_its_sums_in_place(rows, reduction):
    """One program's partial sums are the sums: no second pass (the small MLP's loss is one
    launch and the ratio, not three); several programs still add their partials."""
    gen = torch.Generator().manual_seed(4)
    x, t = torch.randn(rows, 7, generator=gen), torch.randint(0, 7, (rows,), generator=gen)
    t[::3] = -100  # ignored rows: the mean divides by the kept ones
    with record_launches() as launches:
        out = apply(lambda a, b: L.cross_entropy(a, b, reduction=reduction), x, t)
    kernels = [r.kernel for r in launches]
    torch.testing.assert_close(out, F.cross_entropy(x, t, reduction=reduction), rtol=1e-5, atol=1e-6)
    single = rows * 8 <= loss_ops.ROW_TILE
    assert ("sum_to_shape_kernel" in kernels) == (not single)
    assert ("loss_ratio" in kernels) == (reduction == "mean")
