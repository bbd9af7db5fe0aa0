"""Activations: what the generic harness cannot see (kinks, NaN, extremes, errors, layers, PReLU's
weight gradient paths)."""

import pytest
import torch
import torch.nn.functional as F

import teeny
import teeny.nn as tnn
from teeny import ops
from teeny.checks.samples import activation as activation_samples
from teeny.core.graph import Graph, GraphError
from teeny.ops.activation import ACTIVATIONS
from teeny.ops.activation import ops as activation_ops
from teeny.program.executor import Executor
from teeny.program.lowering import LoweringMode, lower
from teeny.torch import apply

# (teeny op, torch op, kwargs): every declared keyword set and variant (checks.samples.activation.cases)
UNARY = [(getattr(ops, d.name), d.ref, kwargs) for d, kwargs in activation_samples.cases()]
# exact inputs: these points and every declared kink
KINKS = sorted({-6.0, -3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 6.0, *(k for d in ACTIVATIONS for k in d.kinks)}) + [-0.0]


def _ids(case):
    return f"{case[0].__name__}{case[2] or ''}"


def _compare(fn, ref, x, kwargs, atol=1e-6):
    xt = x.clone().to(teeny.DEVICE).requires_grad_()
    y = apply(lambda t: fn(t, **kwargs), xt)
    (g,) = torch.autograd.grad(y, xt, torch.ones_like(y))
    xr = x.clone().requires_grad_()
    yr = ref(xr, **kwargs)
    (gr,) = torch.autograd.grad(yr, xr, torch.ones_like(yr))
    torch.testing.assert_close(y.cpu(), yr, atol=atol, rtol=1e-5, equal_nan=True)
    # the gradient at NaN is not compared: PyTorch's own differs between its vectorised and scalar paths
    finite = ~x.isnan()
    torch.testing.assert_close(g.cpu()[finite], gr[finite], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("case", UNARY, ids=_ids)
def test_kinks_nan_and_extremes_match_torch(case):
    fn, ref, kwargs = case
    x = torch.tensor(KINKS + [float("nan"), -100.0, 100.0, -30.0, 30.0, 1e-6, -1e-6])
    _compare(fn, ref, x, kwargs)


def test_kink_gradients_explicitly():
    x = torch.tensor([0.0, -1.0, 1.0, 6.0, -3.0, 3.0])
    expect = {
        ops.relu: [0, 0, 1, 1, 0, 1],
        ops.relu6: [0, 0, 1, 0, 0, 1],
        ops.hardtanh: [1, 0, 0, 0, 0, 0],
        ops.hardsigmoid: [1 / 6, 1 / 6, 1 / 6, 0, 0, 0],
        ops.hardswish: [0.5, 1 / 6, 5 / 6, 1, 0, 1],
    }
    for fn, want in expect.items():
        xt = x.clone().to(teeny.DEVICE).requires_grad_()
        (g,) = torch.autograd.grad(apply(fn, xt).sum(), xt)
        torch.testing.assert_close(g.cpu(), torch.tensor(want, dtype=torch.float32), msg=fn.__name__)
    xt = x.clone().to(teeny.DEVICE).requires_grad_()
    (g,) = torch.autograd.grad(apply(lambda t: ops.leaky_relu(t, 0.1), xt).sum(), xt)
    assert g[0].item() == pytest.approx(0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_extremes_are_finite(dtype):
    x = torch.tensor([-60000.0, -100.0, -20.0, 20.0, 100.0, 60000.0]).to(dtype)
    for fn in (ops.sigmoid, ops.tanh, ops.softplus, ops.logsigmoid, ops.silu, ops.mish, ops.elu, ops.selu, ops.celu):
        y = apply(fn, x.to(teeny.DEVICE))
        ref = {ops.sigmoid: torch.sigmoid, ops.tanh: torch.tanh}.get(fn) or getattr(F, fn.__name__)
        torch.testing.assert_close(
            y.cpu().float(), ref(x.float()).to(dtype).float(), atol=1e-2, rtol=1e-2, msg=fn.__name__
        )


# the tanh family: libdevice's tanh on the GPU, the expm1 formula under the interpreter
TANH_FAMILY = [
    (ops.tanh, torch.tanh, {}),
    (ops.gelu, F.gelu, {"approximate": "tanh"}),
    (ops.mish, F.mish, {}),
    (ops.tanhshrink, F.tanhshrink, {}),
]


def _tanh_inputs():
    """A dense sweep, the branch points of libdevice's tanh (0.6, saturation near 9), the 2^-12
    cut-over to tanh(x) = x, tiny and denormal inputs and signed zeros."""
    special = [1e-40, 1e-30, 2.0**-12, 2.0**-12 * (1 - 2**-20), 0.6, 0.6 * (1 - 2**-20), 9.01, 0.0]
    special = torch.tensor(special, dtype=torch.float64)
    return torch.cat([torch.linspace(-12.0, 12.0, 40001, dtype=torch.float64), special, -special])


def _value_and_grad(fn, x, kwargs):
    xt = x.clone().to(teeny.DEVICE).requires_grad_()
    y = apply(lambda t: fn(t, **kwargs), xt)
    (g,) = torch.autograd.grad(y, xt, torch.ones_like(y))
    return y.detach().cpu().double(), g.cpu().double()


def _ulps(value, exact, scale):
    """max |value - exact| in float32 units in the last place of max(|exact|, scale): the
    scale of the terms a formula adds (|x| for x - tanh(x), 1 for 1 + tanh(...) and for the
    derivatives, which cross zero), so that cancellation counts against the formula, not the tanh."""
    return ((value - exact).abs() / (torch.maximum(exact.abs(), scale).clamp_min(2.0**-126) * 2.0**-23)).max().item()


@pytest.mark.parametrize("case", TANH_FAMILY, ids=_ids)
def test_tanh_family_is_float32_accurate_and_float64_exact(case):
    """fp32 within a few ulp of float64 (no worse than PyTorch's own fp32 kernels on the same
    device, whose cancellations, e.g. 1 + tanh near -1 in gelu, are the same); float64 exact."""
    fn, ref, kwargs = case
    x64 = _tanh_inputs().float().double()  # float32 inputs, exactly
    xr = x64.clone().requires_grad_()
    yr = ref(xr, **kwargs)
    (gr,) = torch.autograd.grad(yr, xr, torch.ones_like(yr))
    y32, g32 = _value_and_grad(fn, x64.float(), kwargs)
    xt = x64.float().to(teeny.DEVICE).requires_grad_()
    yt = ref(xt, **kwargs)
    (gt,) = torch.autograd.grad(yt, xt, torch.ones_like(yt))
    scales = {"value": x64.abs().clamp_max(1.0), "gradient": torch.ones_like(x64)}
    for mine, torchs, exact, what in ((y32, yt, yr, "value"), (g32, gt, gr, "gradient")):
        torch_ulps = _ulps(torchs.detach().cpu().double(), exact.detach(), scales[what])
        mine_ulps = _ulps(mine, exact.detach(), scales[what])
        print(f"{fn.__name__} {what}: {mine_ulps:.2f} ulp (PyTorch {torch_ulps:.2f})")
        assert mine_ulps <= max(4.0, 2.0 * torch_ulps), what
    tiny = x64.abs() < 2.0**-12
    if fn is ops.tanh:  # tanh(x) = x in float32 there: denormals kept, zeros keep their sign
        assert torch.equal(y32[tiny], x64[tiny])
        assert torch.equal(torch.signbit(y32[x64 == 0.0]), torch.signbit(x64[x64 == 0.0]))
    elif fn is not ops.tanhshrink:  # tanhshrink(x) = x - tanh(x) cancels to 0 there, as in PyTorch
        assert (y32[tiny & (x64 != 0.0)] != 0.0).all(), "tiny inputs flushed"
    y64, g64 = _value_and_grad(fn, x64, kwargs)
    # float64 to rounding: formulas that cancel (gelu's gradient near -7 is ~1e-14) agree to ~1e-14
    torch.testing.assert_close(y64, yr.detach(), atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(g64, gr, atol=1e-13, rtol=1e-13)


def _graph_input(shape, dtype=torch.float32):
    return Graph().input("x", shape, dtype)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.glu(_graph_input((3, 5))), "halving dimension must be even, but dimension 1 is size 5"),
        (lambda: ops.glu(_graph_input(())), "does not support scalars"),
        (lambda: ops.glu(_graph_input((4, 2)), dim=2), "dim 2 is out of range"),
        (lambda: ops.celu(_graph_input((3,)), alpha=0.0), "alpha cannot be 0"),
        (lambda: ops.softshrink(_graph_input((3,)), lambd=-1.0), "lambd must be greater or equal to 0"),
        (lambda: ops.hardtanh(_graph_input((3,)), 2.0, 1.0), "min_val cannot be greater than max_val"),
        (lambda: ops.gelu(_graph_input((3,)), approximate="fast"), "approximate must be 'none' or 'tanh'"),
        (lambda: ops.softplus(_graph_input((3,)), beta=0.0), "beta cannot be 0"),
        (lambda: ops.softcap(_graph_input((3,)), -30.0), "softcap: cap must be positive, got -30.0"),
        (lambda: ops.geglu(_graph_input((3,)), _graph_input((3,)), "fast"), "approximate must be 'tanh' or 'none'"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_shape_errors_name_the_node():
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (4, 3))
    with pytest.raises(GraphError, match=r"swiglu \(node .*gate and up must have the same shape"):
        ops.swiglu(a, b)
    x = g.input("x", (2, 3, 4))
    with pytest.raises(GraphError, match=r"prelu .*weight has 4 parameters but the input has 3 channels"):
        ops.prelu(x, g.input("w", (4,)))
    with pytest.raises(GraphError, match="weight must be a scalar or a 1-d tensor"):
        ops.prelu(x, g.input("w2", (1, 3)))
    with pytest.raises(GraphError, match="different float dtypes"):
        ops.swiglu(a, g.input("h", (3, 4), torch.float16))
    with pytest.raises(GraphError, match=r"geglu \(node .*gate and up must have the same shape"):
        ops.geglu(a, b)


def _prelu_executor(x_shape, w_shape, x_grad=True, w_init=None):
    g = Graph()
    x = g.input("x", x_shape, requires_grad=x_grad)
    w = g.parameter("weight", w_shape, init=w_init or teeny.core.init.uniform(0.5))
    g.output(ops.prelu(x, w))
    return Executor(lower(g, LoweringMode.TRAINING))


@pytest.mark.parametrize("x_grad", [True, False])
def test_prelu_weight_gradient(x_grad, monkeypatch):
    # few programs: each walks several BLOCK-wide steps of its channel, partials per split
    monkeypatch.setattr(activation_ops, "PRELU_TARGET_PROGRAMS", 4)
    x = torch.randn(3, 2, 700, generator=torch.Generator().manual_seed(0))
    ex = _prelu_executor(x.shape, (2,), x_grad)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y, cache = ex.forward_train(x.to(teeny.DEVICE))
    grads = ex.backward(cache, dy.to(teeny.DEVICE))
    w = ex.params["weight"].detach().cpu().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    yr = F.prelu(xr, w)
    gx, gw = torch.autograd.grad(yr, (xr, w), dy)
    torch.testing.assert_close(y.cpu(), yr.detach())
    torch.testing.assert_close(ex.grads["weight"].cpu(), gw, atol=1e-4, rtol=1e-5)
    if x_grad:
        torch.testing.assert_close(grads["x"].cpu(), gx)


def test_prelu_empty_batch_gives_zero_weight_gradient():
    ex = _prelu_executor((0, 3), (3,))
    ex.grads["weight"].fill_(7.0)
    ex.zero_grad()
    _, cache = ex.forward_train(torch.empty(0, 3).to(teeny.DEVICE))
    ex.backward(cache, torch.empty(0, 3).to(teeny.DEVICE))
    assert torch.equal(ex.grads["weight"].cpu(), torch.zeros(3))


def test_swiglu_gradient_of_one_input_only():
    gate, up = torch.randn(5, 7), torch.randn(5, 7)
    for which in (0, 1):
        args = [gate.clone().to(teeny.DEVICE), up.clone().to(teeny.DEVICE)]
        args[which].requires_grad_()
        (g,) = torch.autograd.grad(apply(ops.swiglu, *args).sum(), args[which])
        ref = [gate.clone(), up.clone()]
        ref[which].requires_grad_()
        (gr,) = torch.autograd.grad((F.silu(ref[0]) * ref[1]).sum(), ref[which])
        torch.testing.assert_close(g.cpu(), gr)


# every declared layer with each keyword set of its cases, then GLU and PReLU
LAYERS = [
    (getattr(tnn, d.layer)(**kwargs), getattr(torch.nn, d.layer)(**kwargs))
    for d, kwargs in activation_samples.cases()
    if d.layer is not None
] + [
    (tnn.GLU(1), torch.nn.GLU(1)),
    (tnn.PReLU(), torch.nn.PReLU()),
    (tnn.PReLU(4, init=0.1), torch.nn.PReLU(4, init=0.1)),
]


@pytest.mark.parametrize("layers", LAYERS, ids=lambda pair: repr(pair[1]))
def test_layers_match_torch_nn(layers):
    layer, ref = layers
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(3)) * 3
    g = Graph()
    g.output(layer(g.input("x", x.shape)))
    ex = Executor(lower(g, LoweringMode.INFERENCE))
    names = dict(ref.named_parameters())
    assert sorted(ex.params) == sorted(names)
    for name, p in names.items():
        torch.testing.assert_close(ex.params[name].cpu(), p.detach())  # PyTorch's initialisation
    torch.testing.assert_close(ex(x.to(teeny.DEVICE)).cpu(), ref(x).detach(), atol=1e-5, rtol=1e-5)


def test_prelu_parameter_names_in_a_model():
    model = teeny.nn.Sequential(teeny.nn.PReLU(3), teeny.nn.PReLU())
    ref = torch.nn.Sequential(torch.nn.PReLU(3), torch.nn.PReLU())
    names = [(n, p.shape) for n, p in model.named_parameters()]
    assert names == [(n, tuple(p.shape)) for n, p in ref.named_parameters()]
