"""conv family: what the generic harness cannot see (layers and init, split weight gradients,
pooling ties / NaN / overlapping windows, max_pool2d's returned indices, inference lowering, the
tf32 switch, error messages)."""

import math

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import assert_matches_torch
from teeny import Graph, LoweringMode, lower


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv2d_weight_gradient_split_over_positions(dtype, gen):
    # 3*11*11 = 363 output positions: several chunks of fp32 partials and the second pass
    x = torch.rand(3, 4, 13, 11, generator=gen) * 2 - 1
    w = torch.rand(6, 2, 3, 3, generator=gen) * 2 - 1
    b = torch.rand(6, generator=gen)
    x, w, b = (t.to(dtype) for t in (x, w, b))
    kwargs = dict(padding=(0, 1), groups=2)
    assert_matches_torch(teeny.ops.conv2d, F.conv2d, x, w, b, kwargs=kwargs, dtype=dtype, reduction=363, gen=gen)


def test_conv2d_layer_parameters_and_init():
    layer = teeny.nn.Conv2d(6, 4, (3, 2), groups=2)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    assert layer.weight.shape == (4, 3, 3, 2) and layer.bias.shape == (4,)
    bound = 1 / math.sqrt(3 * 3 * 2)  # fan_in = in_channels/groups * kH * kW, like torch
    gen = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        values = p.init(p.shape, gen, torch.float32)
        assert values.abs().max() <= bound and values.abs().max() > 0.6 * bound
    assert [n for n, _ in teeny.nn.Conv2d(2, 3, 1, bias=False).named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match="divisible by groups"):
        teeny.nn.Conv2d(5, 4, 3, groups=2)
    with pytest.raises(ValueError, match="divisible by groups"):
        teeny.nn.Conv2d(4, 3, 3, groups=2)


def test_small_cnn_matches_torch_and_trains():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 3, 2, stride=1, bias=False),
        torch.nn.AvgPool2d(2, ceil_mode=True),
    )
    model = teeny.nn.Sequential(
        teeny.nn.Conv2d(2, 4, 3, padding=1),
        teeny.nn.ReLU(),
        teeny.nn.MaxPool2d(2),
        teeny.nn.Conv2d(4, 3, 2, stride=1, bias=False),
        teeny.nn.AvgPool2d(2, ceil_mode=True),
    )
    g = Graph()
    x = g.input("x", (2, 2, 9, 7))
    g.output(model(x).sum())
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    ex.load_params({k: v.detach() for k, v in ref.state_dict().items()})
    xs = torch.randn(2, 2, 9, 7)
    out, cache = ex.forward_train({"x": xs.to(teeny.DEVICE)})
    ex.backward(cache)
    loss = ref(xs).sum()
    loss.backward()
    torch.testing.assert_close(out.cpu(), loss.detach(), atol=1e-4, rtol=1e-5)
    for name in ("0.weight", "0.bias", "3.weight"):
        layer, param = name.split(".")
        torch.testing.assert_close(ex.grads[name].cpu(), getattr(ref[int(layer)], param).grad, atol=1e-4, rtol=1e-4)


def test_pooling_in_inference_program():
    g = Graph()
    x = g.input("x", (1, 2, 5, 6))
    g.output(teeny.ops.max_pool2d(x, 2), teeny.ops.avg_pool2d(x, 3, stride=1, padding=1))
    ex = teeny.Executor(lower(g, LoweringMode.INFERENCE))
    xs = torch.randn(1, 2, 5, 6)
    outs = ex.forward({"x": xs.to(teeny.DEVICE)})
    torch.testing.assert_close(outs[0].cpu(), F.max_pool2d(xs, 2))
    torch.testing.assert_close(outs[1].cpu(), F.avg_pool2d(xs, 3, stride=1, padding=1))


@pytest.mark.parametrize(
    "kwargs",
    [{"kernel_size": 2}, {"kernel_size": 3, "stride": 1, "padding": 1}, {"kernel_size": 2, "stride": 1, "dilation": 2}],
    ids=str,
)
def test_max_pool2d_ties_go_to_the_first_in_scan_order(kwargs, gen):
    # a few integer levels: many ties inside each window, windows overlapping or not
    x = torch.randint(0, 3, (2, 3, 7, 8), generator=gen).float()
    assert_matches_torch(teeny.ops.max_pool2d, F.max_pool2d, x, kwargs=kwargs, reduction=9, gen=gen)
    zeros = torch.zeros(1, 2, 5, 5)
    assert_matches_torch(teeny.ops.max_pool2d, F.max_pool2d, zeros, kwargs=kwargs, reduction=9, gen=gen)


def test_max_pool2d_propagates_nan_like_torch(gen):
    x = torch.randn(1, 1, 4, 6, generator=gen)
    x[0, 0, 1, 1] = float("nan")
    x[0, 0, 2, 4] = float("nan")
    x[0, 0, 3, 5] = float("nan")
    kwargs = dict(kernel_size=2)
    assert_matches_torch(teeny.ops.max_pool2d, F.max_pool2d, x, kwargs=kwargs, equal_nan=True, gen=gen)


def test_avg_pool2d_count_include_pad_and_divisor(gen):
    x = torch.randn(2, 3, 6, 7, generator=gen)
    for kwargs in (
        {"kernel_size": 3, "padding": 1, "stride": 2, "count_include_pad": False},
        {"kernel_size": (3, 2), "padding": 1, "ceil_mode": True},
        {"kernel_size": 2, "divisor_override": 3},
    ):
        assert_matches_torch(teeny.ops.avg_pool2d, F.avg_pool2d, x, kwargs=kwargs, reduction=9, gen=gen)


def test_conv2d_errors_are_clear():
    g = Graph()
    x = g.input("x", (2, 6, 5, 7))
    with pytest.raises(ValueError, match="has 6 channels, but weight .* groups=4 expects 8"):
        teeny.ops.conv2d(x, g.input("w", (4, 2, 3, 3)), groups=4)
    with pytest.raises(ValueError, match="out_channels 5 .* not divisible by groups=3"):
        teeny.ops.conv2d(x, g.input("w2", (5, 2, 3, 3)), groups=3)
    with pytest.raises(ValueError, match=r"padded input size per channel \(5 x 7\) is smaller than .* \(6 x 6\)"):
        teeny.ops.conv2d(x, g.input("w3", (4, 6, 6, 6)))
    with pytest.raises(ValueError, match="weight must be 4-D"):
        teeny.ops.conv2d(x, g.input("w4", (4, 6, 3)))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        teeny.ops.conv2d(x, g.input("w5", (4, 6, 3, 3)), g.input("b", (3,)))
    with pytest.raises(ValueError, match="3-D .* or 4-D"):
        teeny.ops.conv2d(g.input("flat", (6, 5)), g.input("w6", (4, 6, 3, 3)))
    with pytest.raises(ValueError, match="'same' is not supported for strided"):
        teeny.ops.conv2d(x, g.input("w7", (4, 6, 3, 3)), padding="same", stride=2)
    with pytest.raises(ValueError, match="padding must be 'same', 'valid'"):
        teeny.ops.conv2d(x, g.input("w8", (4, 6, 3, 3)), padding="full")
    with pytest.raises(TypeError, match="stride must be an int or a pair"):
        teeny.ops.conv2d(x, g.input("w9", (4, 6, 3, 3)), stride=(1, 2, 3))
    # padding makes a kernel that is larger than the input fit, like torch
    assert teeny.ops.conv2d(x, g.input("w10", (4, 6, 6, 6)), padding=1).shape == (2, 4, 2, 4)
    assert teeny.ops.conv2d(x, g.input("w11", (4, 6, 2, 4)), padding="same").shape == (2, 4, 5, 7)


def test_pool_errors_are_clear():
    g = Graph()
    x = g.input("x", (1, 2, 3, 3))
    with pytest.raises(ValueError, match="pad should be at most half"):
        teeny.ops.max_pool2d(x, 2, padding=2)
    with pytest.raises(ValueError, match="pad should be at most half"):
        teeny.ops.avg_pool2d(x, 3, padding=2)
    with pytest.raises(ValueError, match="too small"):
        teeny.ops.max_pool2d(x, 4)
    with pytest.raises(ValueError, match="3-D .* or 4-D"):
        teeny.ops.avg_pool2d(g.input("flat", (3, 3)), 2)
    assert teeny.ops.max_pool2d(x, 2, ceil_mode=True).shape == (1, 2, 2, 2)
    assert teeny.ops.avg_pool2d(g.input("u", (2, 7, 9)), 3, stride=2, padding=1).shape == (2, 4, 5)


_INDEX_CASES = [
    {"kernel_size": 2},
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": (3, 2), "stride": (2, 1), "dilation": (1, 2), "ceil_mode": True},
    {"kernel_size": 3, "stride": 1, "padding": 1},  # overlapping windows
]


@pytest.mark.parametrize("kwargs", _INDEX_CASES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (3, 5, 6)], ids=str)
def test_max_pool2d_return_indices_like_torch(shape, kwargs, gen):
    # a few integer levels (ties) and two NaNs: the indices PyTorch returns, and the gradient of
    # the values when both are outputs of one training program
    x = torch.randint(0, 4, shape, generator=gen).double()
    x.view(-1)[[5, 17]] = float("nan")
    g = Graph()
    xs = g.input("x", shape, torch.float64, requires_grad=True)
    weights = g.input("w", F.max_pool2d(x, **kwargs).shape, torch.float64)
    values, indices = teeny.ops.max_pool2d(xs, return_indices=True, **kwargs)
    assert indices.dtype == torch.int64 and indices.shape == values.shape
    g.output((values * weights).sum(), values, indices)
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    w = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    (loss, out, idx), cache = ex.forward_train({"x": x.to(teeny.DEVICE), "w": w.to(teeny.DEVICE)})
    grads = ex.backward(cache)

    ref_x = x.clone().requires_grad_(True)
    ref, ref_idx = F.max_pool2d(ref_x, return_indices=True, **kwargs)
    (ref * w).sum().backward()
    assert idx.dtype == torch.int64
    torch.testing.assert_close(idx.cpu(), ref_idx, rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), ref.detach(), equal_nan=True)
    torch.testing.assert_close(grads["x"].cpu(), ref_x.grad)


def test_max_pool2d_indices_alone_in_inference_and_values_gradcheck(gen):
    x = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    g = Graph()
    xs = g.input("x", x.shape, torch.float64)
    g.output(teeny.ops.max_pool2d(xs, 3, stride=2, padding=1, return_indices=True)[1])
    idx = teeny.Executor(lower(g, LoweringMode.INFERENCE)).forward({"x": x.to(teeny.DEVICE)})
    torch.testing.assert_close(idx.cpu(), F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)[1])
    small = x[:1, :1, :4]  # finite differences cost two runs per element
    teeny.gradcheck(lambda t: teeny.ops.max_pool2d(t, 3, stride=2, padding=1, return_indices=True)[0], small)


def test_conv2d_tf32_switch_is_read_at_trace_time(monkeypatch):
    g = Graph()
    x, w = g.input("x", (1, 2, 5, 5)), g.input("w", (3, 2, 3, 3))
    monkeypatch.setattr(teeny.core.config, "allow_tf32", True)
    op = teeny.ops.conv2d(x, w).value.producer.op
    monkeypatch.setattr(teeny.core.config, "allow_tf32", False)
    full = teeny.ops.conv2d(x, w).value.producer.op
    assert op.allow_tf32 and not full.allow_tf32
