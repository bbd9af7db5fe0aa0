"""Dropout: what the generic harness cannot see (masks, seeds, steps, eval mode, errors)."""

import pytest
import torch

import teeny
from teeny.core.graph import Graph
from teeny.core.kernel import record_launches
from teeny.ops import dropout
from teeny.ops import masks as dropout_module
from teeny.program.executor import Executor
from teeny.program.lowering import LoweringMode, lower


def _executor(fn, shape, dtype=torch.float32, mode=LoweringMode.TRAINING):
    g = Graph()
    x = g.input("x", shape, dtype, requires_grad=mode is LoweringMode.TRAINING)
    g.output(fn(x))
    return Executor(lower(g, mode))


def _x(*shape, dtype=torch.float32):
    # no exact zeros, so a zero in the output means a dropped element
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    return x.to(dtype).to(teeny.DEVICE)


def test_same_seed_same_mask_and_different_seed_different_mask():
    x = _x(37, 29)
    a = _executor(lambda t: dropout(t, 0.5, seed=42), x.shape, mode=LoweringMode.INFERENCE)(x)
    b = _executor(lambda t: dropout(t, 0.5, seed=42), x.shape, mode=LoweringMode.INFERENCE)(x)
    c = _executor(lambda t: dropout(t, 0.5, seed=43), x.shape, mode=LoweringMode.INFERENCE)(x)
    assert torch.equal(a, b)
    assert not torch.equal(a == 0, c == 0)


def test_fraction_dropped_and_scaling():
    p = 0.3
    x = _x(257, 255)
    y = _executor(lambda t: dropout(t, p, seed=7), x.shape, mode=LoweringMode.INFERENCE)(x)
    dropped = y == 0
    assert abs(dropped.double().mean().item() - p) < 0.01
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p))


def test_backward_uses_the_forward_mask():
    p = 0.4
    x = _x(13, 101)
    ex = _executor(lambda t: dropout(t, p, seed=3), x.shape)
    y, cache = ex.forward_train(x)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(teeny.DEVICE)
    dx = ex.backward(cache, dy)["x"]
    keep = (y != 0).float()
    torch.testing.assert_close(dx, keep / (1 - p) * dy)
    assert 0 < keep.mean().item() < 1


def test_each_run_draws_a_new_mask_and_each_cache_keeps_its_own():
    x = _x(11, 97)
    ex = _executor(lambda t: dropout(t, 0.5, seed=5), x.shape)
    y1, cache1 = ex.forward_train(x)
    y2, cache2 = ex.forward_train(x)
    assert not torch.equal(y1 == 0, y2 == 0)
    dy = torch.ones_like(x)
    # backward of the first forward, after the second forward ran: still the first mask
    dx1 = ex.backward(cache1, dy)["x"]
    dx2 = ex.backward(cache2, dy)["x"]
    torch.testing.assert_close(dx1, (y1 != 0).float() * 2)
    torch.testing.assert_close(dx2, (y2 != 0).float() * 2)
    # the mask sequence is reproducible: a fresh program with the same seed replays it
    again = _executor(lambda t: dropout(t, 0.5, seed=5), x.shape)
    assert torch.equal(again.forward_train(x)[0], y1)
    assert torch.equal(again.forward_train(x)[0], y2)


def test_fixed_mask_is_deterministic_and_gradchecks():
    x = _x(9, 7)
    ex = _executor(lambda t: dropout(t, 0.5, seed=5, fixed_mask=True), x.shape, mode=LoweringMode.INFERENCE)
    assert torch.equal(ex(x), ex(x))
    x64 = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    teeny.gradcheck(lambda t: dropout(t, 0.3, seed=1, fixed_mask=True), x64)


def test_identity_in_eval_mode_and_for_p_zero():
    x = _x(5, 7)
    for fn in (lambda t: dropout(t, 0.5, training=False), lambda t: dropout(t, 0.0)):
        ex = _executor(fn, x.shape)
        assert not any("dropout" in k for k in ex.program.kernel_names())
        y, cache = ex.forward_train(x)
        assert torch.equal(y, x)
        assert y.data_ptr() == x.data_ptr()  # a view: no launch, no copy
        dy = torch.randn(x.shape).to(teeny.DEVICE)
        assert torch.equal(ex.backward(cache, dy)["x"], dy)


def test_p_one_gives_zeros_like_torch():
    x = _x(3, 5)
    x[0, 0] = float("inf")
    ex = _executor(lambda t: dropout(t, 1.0, seed=1), x.shape)
    y, cache = ex.forward_train(x)
    torch.testing.assert_close(y, torch.nn.functional.dropout(x, 1.0), equal_nan=True)  # inf * 0 = nan, as torch
    assert torch.equal(ex.backward(cache, torch.ones_like(x))["x"], torch.zeros_like(x))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_bad_p_is_an_error(p):
    g = Graph()
    x = g.input("x", (3,))
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
        dropout(x, p)
    with pytest.raises(ValueError, match="between 0 and 1"):
        teeny.nn.Dropout(p)


def test_unseeded_nodes_get_distinct_reproducible_seeds():
    x = _x(17, 31)
    dropout_module.manual_seed(123)
    g = Graph()
    xi = g.input("x", x.shape)
    a, b = dropout(xi, 0.5), dropout(xi, 0.5)
    assert a.value.producer.op.seed != b.value.producer.op.seed
    dropout_module.manual_seed(123)
    g2 = Graph()
    xi2 = g2.input("x", x.shape)
    assert dropout(xi2, 0.5).value.producer.op.seed == a.value.producer.op.seed


def test_half_precision_uses_the_same_mask():
    x = _x(7, 33)
    masks = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = _executor(lambda t: dropout(t, 0.5, seed=8), x.shape, dtype, LoweringMode.INFERENCE)(x.to(dtype))
        assert y.dtype == dtype
        masks.append(y == 0)
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])


def test_dropout_layer_follows_training_flag():
    layer = teeny.nn.Dropout(0.5)
    assert layer.p == 0.5
    x = _x(9, 13)
    y_train = _executor(layer, x.shape, mode=LoweringMode.INFERENCE)(x)
    assert (y_train == 0).any()
    layer.eval()
    y_eval = _executor(layer, x.shape, mode=LoweringMode.INFERENCE)(x)
    assert torch.equal(y_eval, x)


def test_float64_dropout_gets_float64_scale_and_p():
    """p = 0.3 is not dyadic: a float32 scale 1 / (1 - p) would be 1e-8 off (issue 17)."""
    p = 0.3
    x = _x(9, 31, dtype=torch.float64)
    ex = _executor(lambda t: dropout(t, p, seed=4), x.shape, torch.float64)
    with record_launches() as log:
        y, cache = ex.forward_train(x)
        dy = _x(9, 31, dtype=torch.float64)
        dx = ex.backward(cache, dy)["x"]
    scalars = {r.kernel: r.scalar_types for r in log if r.kernel.startswith("dropout")}
    assert scalars["dropout_forward"]["p"] == scalars["dropout_forward"]["scale"] == "fp64"
    assert scalars["dropout_backward"]["p"] == scalars["dropout_backward"]["scale"] == "fp64"
    keep = y != 0
    assert 0 < keep.double().mean().item() < 1
    scale = 1.0 / (1.0 - p)  # a Python float: float64
    torch.testing.assert_close(y, torch.where(keep, x * scale, 0.0), atol=1e-15, rtol=1e-15)
    torch.testing.assert_close(dx, torch.where(keep, dy * scale, 0.0), atol=1e-15, rtol=1e-15)


def test_dropout_under_cuda_graph_capture_is_a_loud_error(monkeypatch):
    """A captured dropout would replay its first mask on every replay: refused, naming the op.
    (Capture is simulated: the check reads ``capturing()``, as on the GPU.)"""
    import teeny.program.executor

    x = _x(9, 33)
    ex = _executor(lambda t: dropout(t, 0.5, seed=1), x.shape)
    plain = _executor(lambda t: t * 2.0, x.shape)
    monkeypatch.setattr(teeny.program.executor, "capturing", lambda: True)
    with pytest.raises(teeny.TeenyError, match=r"op dropout \(node .*CUDA graph is being captured.*mask"):
        ex.forward_train(x)
    torch.testing.assert_close(plain(x), x * 2.0)  # capturable ops run as before
    monkeypatch.setattr(teeny.program.executor, "capturing", lambda: False)
    assert ex.forward_train(x)[0].count_nonzero() < x.numel()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("way", ["op", "layer"])
def test_checkpoint_recomputes_the_forwards_mask(way, reentrant):
    """torch.utils.checkpoint restores torch's RNG state before recomputing the forward; a mask
    drawn from teeny's own counter came out new there (131 of 256 gradients off the forward's)."""
    import teeny.torch.nn as tnn

    layer = tnn.Dropout(0.5)
    drop = (lambda t: torch.ops.teeny.dropout(t, 0.5, True)) if way == "op" else layer
    x = _x(16, 16).requires_grad_()
    for _ in range(2):  # the second call: the op's entry known, the masks still new
        x.grad = None
        y = torch.utils.checkpoint.checkpoint(lambda t: drop(t) * 1.0, x, use_reentrant=reentrant)
        y.backward(torch.ones_like(y))  # (reentrant checkpointing refuses autograd.grad)
        keep = (y != 0).to(x.dtype)
        assert 0 < keep.mean().item() < 1
        torch.testing.assert_close(x.grad, keep * 2)


def test_on_the_pytorch_path_torch_manual_seed_decides_the_mask():
    x = _x(16, 16)
    torch.manual_seed(7)
    first, second = torch.ops.teeny.dropout(x, 0.5, True), torch.ops.teeny.dropout(x, 0.5, True)
    torch.manual_seed(7)
    assert torch.equal(torch.ops.teeny.dropout(x, 0.5, True), first)
    assert not torch.equal(first, second)
