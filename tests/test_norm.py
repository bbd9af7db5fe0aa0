"""Normalisation ops beyond the generic harness: running statistics, layers, long rows, errors."""

import pytest
import torch
import torch.nn.functional as F

import teeny
from teeny import nn
from teeny.executor import Executor
from teeny.graph import Graph, GraphError
from teeny.interop.torch import apply
from teeny.kernels import norm
from teeny.lowering import LoweringMode, lower
from teeny.module import Module


class _Net(Module):
    def __init__(self, layer):
        super().__init__()
        self.bn = layer

    def forward(self, x):
        return self.bn(x)


def _run_layer(layer, x, mode, params=None):
    g = Graph()
    y = layer(g.input("x", tuple(x.shape), x.dtype))
    g.output(y)
    ex = Executor(lower(g, mode), params=params)
    if mode is LoweringMode.TRAINING:
        out, cache = ex.forward_train({"x": x})
        return ex, out, cache
    return ex, ex.forward({"x": x}), None


@pytest.mark.parametrize(
    "shape,cls,torch_cls",
    [((7, 3), nn.BatchNorm1d, torch.nn.BatchNorm1d), ((4, 3, 5, 2), nn.BatchNorm2d, torch.nn.BatchNorm2d)],
)
def test_batchnorm_running_stats_follow_torch(shape, cls, torch_cls, gen):
    x = torch.randn(shape, generator=gen)
    net = _Net(cls(3, momentum=0.3))
    ex, out, cache = _run_layer(net, x, LoweringMode.TRAINING)
    ref = torch_cls(3, momentum=0.3)
    ref_out = ref(x)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ex.params["bn.running_mean"], ref.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ex.params["bn.running_var"], ref.running_var, atol=1e-6, rtol=1e-5)
    # gradients reach weight/bias, never the running statistics
    ex.backward(cache, torch.randn(shape, generator=gen))
    assert ex.grads["bn.weight"].abs().sum() > 0
    assert ex.grads["bn.running_mean"].abs().sum() == 0 and ex.grads["bn.running_var"].abs().sum() == 0
    # a second step keeps following torch
    x2 = torch.randn(shape, generator=gen)
    ex.forward_train({"x": x2})
    ref(x2)
    torch.testing.assert_close(ex.params["bn.running_var"], ref.running_var, atol=1e-6, rtol=1e-5)


def test_batchnorm_eval_uses_running_stats(gen):
    x = torch.randn(5, 3, 4, generator=gen)
    ref = torch.nn.BatchNorm1d(3).eval()
    with torch.no_grad():
        ref.running_mean.uniform_(-1, 1, generator=gen)
        ref.running_var.uniform_(0.5, 2, generator=gen)
        ref.weight.uniform_(0.5, 1.5, generator=gen)
        ref.bias.uniform_(-1, 1, generator=gen)
    net = _Net(nn.BatchNorm1d(3)).eval()
    params = {f"bn.{k}": v for k, v in ref.state_dict().items() if k != "num_batches_tracked"}
    ex, out, _ = _run_layer(net, x, LoweringMode.INFERENCE, params)
    torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ex.params["bn.running_mean"], ref.running_mean)  # untouched


def test_functional_batch_norm_updates_in_place_and_without_running_stats(gen):
    x = torch.randn(6, 2, 3, generator=gen).to(teeny.DEVICE)
    # the running statistics are updated in place: they must live where the kernels run
    rm, rv = torch.zeros(2, device=teeny.DEVICE), torch.ones(2, device=teeny.DEVICE)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    out = apply(norm.batch_norm, x, rm, rv, training=True, momentum=0.5)
    ref = F.batch_norm(x, rm_ref, rv_ref, training=True, momentum=0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rm, rm_ref)
    torch.testing.assert_close(rv, rv_ref)
    out = apply(lambda t: norm.batch_norm(t, None, None, training=True), x)
    torch.testing.assert_close(out, F.batch_norm(x, None, None, training=True), atol=1e-5, rtol=1e-5)


def test_layer_parameters_match_torch():
    cases = [
        (nn.LayerNorm((3, 4)), torch.nn.LayerNorm((3, 4))),
        (nn.LayerNorm(5, bias=False), torch.nn.LayerNorm(5, bias=False)),
        (nn.LayerNorm(5, elementwise_affine=False), torch.nn.LayerNorm(5, elementwise_affine=False)),
        (nn.RMSNorm(6), torch.nn.RMSNorm(6)),
        (nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)),
        (nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)),
        (
            nn.BatchNorm1d(3, affine=False, track_running_stats=False),
            torch.nn.BatchNorm1d(3, affine=False, track_running_stats=False),
        ),
    ]
    gen = torch.Generator().manual_seed(0)
    for ours, ref in cases:
        expected = {k: v for k, v in ref.state_dict().items() if k != "num_batches_tracked"}
        got = dict(ours.named_parameters())
        assert set(got) == set(expected), type(ours).__name__
        for name, p in got.items():
            assert p.shape == tuple(expected[name].shape)
            assert torch.equal(p.init(p.shape, gen, torch.float32), expected[name]), name
            assert p.trainable == (name in dict(ref.named_parameters()))


@pytest.mark.parametrize(
    "layer,torch_layer,shape",
    [
        (nn.LayerNorm((3, 5)), torch.nn.LayerNorm((3, 5)), (4, 3, 5)),
        (nn.RMSNorm(7), torch.nn.RMSNorm(7), (5, 7)),
        (nn.GroupNorm(3, 6), torch.nn.GroupNorm(3, 6), (2, 6, 5)),
    ],
)
def test_layers_train_like_torch(layer, torch_layer, shape, gen):
    x = torch.randn(shape, generator=gen)
    ex, out, cache = _run_layer(_Net(layer), x, LoweringMode.TRAINING)
    ref = torch_layer(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(shape, generator=gen)
    ex.backward(cache, dy)
    ref.backward(dy)
    for name, p in torch_layer.named_parameters():
        torch.testing.assert_close(ex.grads[f"bn.{name}"], p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "group_norm", "batch_norm"])
def test_rows_longer_than_one_block(case, monkeypatch, gen):
    """Rows are looped over in column blocks: force a 16-wide block on 37-93-long rows."""
    monkeypatch.setattr(norm, "MAX_BLOCK", 16)
    monkeypatch.setattr(norm, "ROWS_PER_WEIGHT_PROGRAM", 2)
    x = (torch.randn(3, 6, 31, generator=gen) * 3 + 5).requires_grad_()
    w = torch.rand(6, generator=gen).add(0.5).requires_grad_()
    b = torch.randn(6, generator=gen).requires_grad_()
    if case == "layer_norm":
        w = torch.rand(31, generator=gen).add(0.5).requires_grad_()
        b = torch.randn(31, generator=gen).requires_grad_()
        fn, ref_fn, args = (
            (lambda x, w, b: norm.layer_norm(x, (31,), w, b)),
            (lambda x, w, b: F.layer_norm(x, (31,), w, b)),
            (x, w, b),
        )
    elif case == "rms_norm":
        w = torch.rand(6, 31, generator=gen).add(0.5).requires_grad_()
        fn, ref_fn, args = (lambda x, w: norm.rms_norm(x, (6, 31), w)), (lambda x, w: F.rms_norm(x, (6, 31), w)), (x, w)
    elif case == "group_norm":
        fn, ref_fn, args = (
            (lambda x, w, b: norm.group_norm(x, 2, w, b)),
            (lambda x, w, b: F.group_norm(x, 2, w, b)),
            (x, w, b),
        )
    else:
        fn = lambda x, w, b: norm.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
        ref_fn, args = (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)), (x, w, b)
    _forward_and_grads_match(fn, ref_fn, args, gen, tol=1e-4)


def test_rms_norm_default_eps_is_dtype_eps():
    x = torch.full((2, 4), 1e-4, dtype=torch.float64)  # mean(x^2) = 1e-8, comparable with float32's eps
    ours = apply(lambda t: norm.rms_norm(t, (4,)), x.float())
    torch.testing.assert_close(ours, F.rms_norm(x.float(), (4,)), atol=1e-5, rtol=1e-5)


def _trace(fn, *shapes, dtype=torch.float32):
    g = Graph()
    return fn(*[g.input(f"a{i}", s, dtype) for i, s in enumerate(shapes)])


def test_errors():
    with pytest.raises(GraphError, match="expected \\(37,\\)"):
        _trace(lambda x, w: norm.layer_norm(x, (37,), w), (3, 37), (36,))
    with pytest.raises(GraphError, match="normalized_shape=\\[3, 11\\]"):
        _trace(lambda x: norm.layer_norm(x, (3, 11)), (5, 11, 3))
    with pytest.raises(GraphError, match="divisible by num_groups"):
        _trace(lambda x: norm.group_norm(x, 4, None), (2, 6, 5))
    with pytest.raises(GraphError, match="expected \\(6,\\)"):
        _trace(lambda x, w: norm.group_norm(x, 3, w), (2, 6, 5), (5,))
    with pytest.raises(GraphError, match="more than 1 value per channel"):
        _trace(lambda x: norm.batch_norm(x, None, None, training=True), (1, 3))
    with pytest.raises(GraphError, match="expected \\(3,\\)"):
        _trace(lambda x, m, v: norm.batch_norm(x, m, v), (4, 3), (4,), (4,))
    with pytest.raises(ValueError, match="required when training=False"):
        _trace(lambda x: norm.batch_norm(x, None, None), (4, 3))
    with pytest.raises(GraphError, match="floating-point"):
        _trace(lambda x: norm.layer_norm(x, (3,)), (2, 3), dtype=torch.int64)
    with pytest.raises(ValueError, match="expected 4D input"):
        _trace(nn.BatchNorm2d(3), (4, 3))
    with pytest.raises(ValueError, match="divisible"):
        nn.GroupNorm(4, 6)


@pytest.mark.parametrize("rows", [37, 1, 0])
@pytest.mark.parametrize("case", ["layer_norm", "layer_norm no bias", "rms_norm", "group_norm 1 group"])
def test_multi_row_tiles_and_fused_weight_partials(case, rows, monkeypatch, gen):
    """Tiles of 4 rows x 16 columns and at most 3 programs: 37 rows are 10 tiles, 4 per program
    (the last program's tiles lie partly or wholly past the end). dw/db come from the fused
    per-program partial rows of norm_backward, never from norm_weight_backward."""
    monkeypatch.setattr(norm, "INTERPRETER_TILE", 64)
    monkeypatch.setattr(norm, "INTERPRETER_PROGRAMS", 3)

    def refuse(*args, **kwargs):
        raise AssertionError("layer/rms norm over one block must not need norm_weight_backward")

    monkeypatch.setattr(norm.NormOp, "_weight_backward", refuse)
    x = (torch.randn(rows, 11, generator=gen) * 2 + 3).requires_grad_()
    w = torch.rand(11, generator=gen).add(0.5).requires_grad_()
    b = torch.randn(11, generator=gen).requires_grad_()
    if case == "layer_norm":
        fn, ref_fn, args = (
            (lambda x, w, b: norm.layer_norm(x, (11,), w, b)),
            (lambda x, w, b: F.layer_norm(x, (11,), w, b)),
            (x, w, b),
        )
    elif case == "layer_norm no bias":
        fn, ref_fn, args = (lambda x, w: norm.layer_norm(x, (11,), w)), (lambda x, w: F.layer_norm(x, (11,), w)), (x, w)
    elif case == "rms_norm":
        fn, ref_fn, args = (lambda x, w: norm.rms_norm(x, (11,), w)), (lambda x, w: F.rms_norm(x, (11,), w)), (x, w)
    else:
        fn, ref_fn, args = (
            (lambda x, w, b: norm.group_norm(x, 1, w, b)),
            (lambda x, w, b: F.group_norm(x, 1, w, b)),
            (x, w, b),
        )
    _forward_and_grads_match(fn, ref_fn, args, gen, tol=1e-5)


@pytest.mark.parametrize("case", ["layer_norm", "group_norm", "batch_norm"])
def test_multi_row_tiles_of_long_rows(case, monkeypatch, gen):
    """Several rows per tile AND several column blocks per row: 4 x 16 tiles over rows of 21 (group_norm),
    63 (layer_norm) and 259 (batch_norm) elements."""
    monkeypatch.setattr(norm, "MAX_BLOCK", 16)
    monkeypatch.setattr(norm, "INTERPRETER_TILE", 64)
    x = (torch.randn(37, 9, 7, generator=gen) * 3 + 5).requires_grad_()
    w = torch.rand(9, generator=gen).add(0.5).requires_grad_()
    b = torch.randn(9, generator=gen).requires_grad_()
    if case == "layer_norm":
        w = torch.rand(9, 7, generator=gen).add(0.5).requires_grad_()
        b = torch.randn(9, 7, generator=gen).requires_grad_()
        fn, ref_fn = (lambda x, w, b: norm.layer_norm(x, (9, 7), w, b)), (lambda x, w, b: F.layer_norm(x, (9, 7), w, b))
    elif case == "group_norm":
        fn, ref_fn = (lambda x, w, b: norm.group_norm(x, 3, w, b)), (lambda x, w, b: F.group_norm(x, 3, w, b))
    else:
        fn = lambda x, w, b: norm.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
        ref_fn = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
    args = (x, w, b)
    out = apply(fn, *args)
    ref = ref_fn(*args)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    dy = torch.randn(out.shape, generator=gen)
    for g, r in zip(torch.autograd.grad(out, args, dy), torch.autograd.grad(ref, args, dy)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def _forward_and_grads_match(fn, ref_fn, args, gen, tol):
    """teeny's fn (through the torch interop) against PyTorch's ref_fn: output and every gradient."""
    out = apply(fn, *args)
    ref = ref_fn(*args)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    dy = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, args, dy)
    ref_grads = torch.autograd.grad(ref, args, dy)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=tol, rtol=tol)
