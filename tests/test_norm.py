"""Normalisation ops beyond the generic harness (tests/test_ops.py): running statistics, layers,
long rows, multi-row tiles, a row-strided gradient read in place, constant rows (var = 0),
float64 scalars (eps, momentum) at tight tolerance, errors."""

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import assert_matches_torch
from teeny import nn
from teeny.core.graph import Graph, GraphError
from teeny.core.kernel import KernelInstance, record_launches
from teeny.core.module import Module
from teeny.fusions.residual_norm import AddNormOp
from teeny.ops import norm
from teeny.ops.norm import tiling
from teeny.ops.norm.ops import NormOp
from teeny.program.executor import Executor
from teeny.program.lowering import LoweringMode, lower
from teeny.torch import apply


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


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "rms_norm (1 + w)", "group_norm", "batch_norm"])
def test_rows_longer_than_one_block(case, monkeypatch, gen):
    """Rows are looped over in column blocks: force a 16-wide block on 37-93-long rows."""
    monkeypatch.setattr(tiling, "MAX_BLOCK", 16)
    monkeypatch.setattr(tiling, "ROWS_PER_WEIGHT_PROGRAM", 2)
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
    elif case == "rms_norm (1 + w)":
        w = torch.randn(6, 31, generator=gen).requires_grad_()
        fn = lambda x, w: norm.rms_norm(x, (6, 31), w, 1e-6, weight_offset=1.0)  # noqa: E731
        ref_fn, args = (lambda x, w: F.rms_norm(x, (6, 31), 1 + w, 1e-6)), (x, w)
    elif case == "group_norm":
        fn, ref_fn, args = (
            (lambda x, w, b: norm.group_norm(x, 2, w, b)),
            (lambda x, w, b: F.group_norm(x, 2, w, b)),
            (x, w, b),
        )
    else:
        fn = lambda x, w, b: norm.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
        ref_fn, args = (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)), (x, w, b)
    assert_matches_torch(fn, ref_fn, *args, tol=(1e-4, 1e-4), gen=gen)


def test_rms_norm_default_eps_is_dtype_eps():
    x = torch.full((2, 4), 1e-4, dtype=torch.float64)  # mean(x^2) = 1e-8, comparable with float32's eps
    ours = apply(lambda t: norm.rms_norm(t, (4,)), x.float())
    torch.testing.assert_close(ours, F.rms_norm(x.float(), (4,)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "add + layer_norm"])
def test_out_dtype_writes_the_rounded_result_and_reads_its_gradient_in_that_dtype(case, out_dtype, gen):
    """A float32 norm with ``out_dtype`` writes exactly torch's float32 result cast to it (one
    rounding, no cast launch after it) and takes its gradient in that dtype; x's and the affine
    gradients stay float32 and match torch autograd through the cast. Behind a residual add,
    ``fuse_residual_norm``'s fused op keeps the out_dtype."""
    x, r = torch.randn(37, 48, generator=gen), torch.randn(37, 48, generator=gen)
    w, b = torch.randn(48, generator=gen), torch.randn(48, generator=gen)
    dy = torch.randn(37, 48, generator=gen).to(out_dtype)
    if case == "rms_norm":
        ours = lambda x, r, w, b: norm.rms_norm(x, 48, w, 1e-6, out_dtype=out_dtype)  # noqa: E731
        reference = lambda x, r, w, b: F.rms_norm(x, (48,), w, 1e-6)  # noqa: E731
    elif case == "layer_norm":
        ours = lambda x, r, w, b: norm.layer_norm(x, 48, w, b, out_dtype=out_dtype)  # noqa: E731
        reference = lambda x, r, w, b: F.layer_norm(x, (48,), w, b)  # noqa: E731
    else:  # the sum is read again downstream, so the norm fuses with the add

        def ours(x, r, w, b):
            s = x + r
            return norm.layer_norm(s, 48, w, b, out_dtype=out_dtype) + s.to(out_dtype) * 0.0

        reference = lambda x, r, w, b: F.layer_norm(x + r, (48,), w, b)  # noqa: E731
    g = Graph()
    inputs = [g.input(n, t.shape, torch.float32, requires_grad=True) for n, t in zip("xrwb", (x, r, w, b))]
    y = ours(*inputs)
    assert y.dtype == out_dtype
    g.output(y)
    program = lower(g, LoweringMode.TRAINING)
    if case == "add + layer_norm":
        assert any(type(p.node.op) is AddNormOp and p.node.op.out_dtype == out_dtype for p in program.nodes)
    ex = Executor(program)
    out, cache = ex.forward_train(dict(zip("xrwb", (x, r, w, b))))
    grads = ex.backward(cache, dy)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    expected = reference(*leaves).to(out_dtype)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same rounding of the same float32 value
    expected.backward(dy)
    for name, leaf in zip("xrwb", leaves):
        if leaf.grad is not None:
            assert grads[name].dtype == torch.float32
            torch.testing.assert_close(grads[name], leaf.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_out_dtype_must_be_a_float_and_the_input_dtype_is_the_plain_op():
    with pytest.raises(TypeError, match="layer_norm: out_dtype must be a floating-point dtype, got int32"):
        _trace(lambda x: norm.layer_norm(x, (3,), out_dtype=torch.int32), (2, 3))
    y = _trace(lambda x: norm.rms_norm(x, (3,), out_dtype=torch.float32), (2, 3))
    assert y.value.producer.op.out_dtype is None


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
    monkeypatch.setattr(tiling, "INTERPRETER_TILE", 64)
    monkeypatch.setattr(tiling, "INTERPRETER_PROGRAMS", 3)

    def refuse(*args, **kwargs):
        raise AssertionError("layer/rms norm over one block must not need norm_weight_backward")

    monkeypatch.setattr(NormOp, "_weight_backward", refuse)
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
    assert_matches_torch(fn, ref_fn, *args, tol=(1e-5, 1e-5), gen=gen)


@pytest.mark.parametrize("case", ["layer_norm", "group_norm", "batch_norm"])
def test_multi_row_tiles_of_long_rows(case, monkeypatch, gen):
    """Several rows per tile AND several column blocks per row: 4 x 16 tiles over rows of 21 (group_norm),
    63 (layer_norm) and 259 (batch_norm) elements."""
    monkeypatch.setattr(tiling, "MAX_BLOCK", 16)
    monkeypatch.setattr(tiling, "INTERPRETER_TILE", 64)
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
    assert_matches_torch(fn, ref_fn, x, w, b, tol=(1e-4, 1e-4), gen=gen)


# ----------------------------------------------------------- a row-strided dy is read in place


@pytest.fixture
def dy_pointers(monkeypatch):
    """The dy tensor each launch of norm_backward / norm_weight_backward received."""
    seen = []
    launch = KernelInstance.launch

    def recording(self, grid, args, **options):
        if self.kernel.name in ("norm_backward", "norm_weight_backward"):
            dy = args[[p.name for p in self.kernel.params].index("dy_ptr")]
            if not dy.is_meta:  # (lowering's dry run on a GPU fires its launches to compile them ahead)
                seen.append((self.kernel.name, dy))
        return launch(self, grid, args, **options)

    monkeypatch.setattr(KernelInstance, "launch", recording)
    return seen


# case -> (input shape, normalized / affine shape, teeny fn, torch fn) for a last dim of n; fns take (x, w, b)
_STRIDED_CASES = {
    "layer_norm": lambda n: ((4, 3, n), (n,), norm.layer_norm, F.layer_norm),
    "rms_norm": lambda n: (
        (5, n),
        (n,),
        lambda x, s, w, b: norm.rms_norm(x, s, w),
        lambda x, s, w, b: F.rms_norm(x, s, w),
    ),
    "layer_norm 2-d": lambda n: ((4, 3, n), (3, n), norm.layer_norm, F.layer_norm),
    "group_norm": lambda n: (
        (3, 6, n),
        (6,),
        lambda x, s, w, b: norm.group_norm(x, 3, w, b),
        lambda x, s, w, b: F.group_norm(x, 3, w, b),
    ),
    "group_norm (N, C)": lambda n: (
        (5, 2 * n),
        (2 * n,),
        lambda x, s, w, b: norm.group_norm(x, 2, w, b),
        lambda x, s, w, b: F.group_norm(x, 2, w, b),
    ),
}


@pytest.mark.parametrize("n", [7, 19], ids=["one block", "column loop"])
@pytest.mark.parametrize("case", list(_STRIDED_CASES))
def test_row_strided_grad_output_is_read_without_a_copy(case, n, dy_pointers, monkeypatch, gen):
    """Executor.backward(cache, grad_output=wide[..., 2:2+n]): the backward kernels read the slice
    itself (its address and strides), and every gradient matches PyTorch. With 16-wide column
    blocks, rows of 19+ elements loop and dw/db come from norm_weight_backward."""
    monkeypatch.setattr(tiling, "MAX_BLOCK", 16)
    shape, affine, fn, ref_fn = _STRIDED_CASES[case](n)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    w = torch.rand(affine, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(affine, generator=gen, dtype=torch.float64)
    g = Graph()
    xs = g.input("x", shape, torch.float64, requires_grad=True)
    ws, bs = g.parameter("w", affine, dtype=torch.float64), g.parameter("b", affine, dtype=torch.float64)
    g.output(fn(xs, affine, ws, bs))
    ex = Executor(lower(g, LoweringMode.TRAINING), params={"w": w, "b": b})
    _, cache = ex.forward_train({"x": x})
    wide = torch.randn(*shape[:-1], shape[-1] + 5, generator=gen, dtype=torch.float64).to(teeny.DEVICE)
    dy = wide[..., 2 : 2 + shape[-1]]
    assert not dy.is_contiguous()
    grads = ex.backward(cache, grad_output=dy)
    assert dy_pointers and all(t.data_ptr() == dy.data_ptr() and t.stride() == dy.stride() for _, t in dy_pointers)
    if n > 16:
        assert "norm_weight_backward" in {name for name, _ in dy_pointers}
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    expected = torch.autograd.grad(ref_fn(xr, affine, wr, br), (xr, wr, br), dy.cpu(), allow_unused=True)
    torch.testing.assert_close(grads["x"].cpu(), expected[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ex.grads["w"].cpu(), expected[1], atol=1e-12, rtol=1e-12)
    if expected[2] is not None:  # rms_norm has no bias
        torch.testing.assert_close(ex.grads["b"].cpu(), expected[2], atol=1e-12, rtol=1e-12)


def test_torch_side_slice_of_the_gradient_reaches_the_kernel_as_is(dy_pointers, gen):
    """torch.cat(...)'s backward hands each piece a strided slice of its gradient: layer_norm
    through the interop reads that slice (no contiguous copy), batch_norm gets a copy."""
    x = torch.randn(6, 9, generator=gen).to(teeny.DEVICE).requires_grad_()
    w = (torch.rand(9, generator=gen) + 0.5).to(teeny.DEVICE).requires_grad_()
    y = apply(lambda x, w: norm.layer_norm(x, (9,), w), x, w)
    z = torch.randn(6, 4, generator=gen).to(teeny.DEVICE)
    dout = torch.randn(6, 13, generator=gen).to(teeny.DEVICE)
    got = torch.autograd.grad(torch.cat([y, z], 1), (x, w), dout)
    assert [not t.is_contiguous() for _, t in dy_pointers] == [True]
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = torch.autograd.grad(torch.cat([F.layer_norm(xr, (9,), wr), z], 1), (xr, wr), dout)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    dy_pointers.clear()
    y = apply(lambda x: norm.batch_norm(x, None, None, training=True), x)
    (gx,) = torch.autograd.grad(torch.cat([y, z], 1), x, dout)
    assert [t.is_contiguous() for _, t in dy_pointers] == [True]
    xr = x.detach().clone().requires_grad_()
    (ex,) = torch.autograd.grad(torch.cat([F.batch_norm(xr, None, None, training=True), z], 1), xr, dout)
    torch.testing.assert_close(gx, ex, atol=1e-5, rtol=1e-5)


# ------------------------------------------------- constant rows: var = 0, no 0/0 anywhere


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "case", ["layer_norm", "rms_norm of zeros", "group_norm", "batch_norm", "batch_norm eval", "layer_norm rows of 1"]
)
def test_constant_rows_give_finite_gradients_like_torch(case, dtype, gen):
    """A constant row has var = 0: rstd = 1/sqrt(eps) is large but finite and xhat = 0, so every
    gradient is a number, PyTorch's (rows of one element included: dx = 0)."""
    x = torch.randn(4, 6, 5, generator=gen, dtype=dtype)
    x[1] = 0.75  # a constant layer_norm row, group_norm group and (below) batch_norm channel
    x[:, 2] = -1.25
    w = torch.rand(6, 5, generator=gen, dtype=dtype) + 0.5
    b = torch.randn(6, 5, generator=gen, dtype=dtype)
    wc, bc = w[:, 0].contiguous(), b[:, 0].contiguous()
    running = (torch.full((6,), -1.25, dtype=dtype), torch.zeros(6, dtype=dtype))  # var 0 for eval
    fns = {
        "layer_norm": (
            lambda x, w, b: norm.layer_norm(x, (6, 5), w, b),
            lambda x, w, b: F.layer_norm(x, (6, 5), w, b),
            (x, w, b),
        ),
        "rms_norm of zeros": (
            lambda x, w: norm.rms_norm(x, (5,), w, eps=1e-6),
            lambda x, w: F.rms_norm(x, (5,), w, eps=1e-6),
            (x * 0, w[0].contiguous()),
        ),
        "group_norm": (
            lambda x, w, b: norm.group_norm(x, 3, w, b),
            lambda x, w, b: F.group_norm(x, 3, w, b),
            (x, wc, bc),
        ),
        "batch_norm": (
            lambda x, w, b: norm.batch_norm(x, None, None, w, b, training=True),
            lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
            (x, wc, bc),
        ),
        "batch_norm eval": (
            lambda x, w, b, rm, rv: norm.batch_norm(x, rm, rv, w, b),
            lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b),
            (x, wc, bc, *running),
        ),
        "layer_norm rows of 1": (lambda x: norm.layer_norm(x, (1,)), lambda x: F.layer_norm(x, (1,)), (x[..., :1],)),
    }
    fn, ref_fn, args = fns[case]
    args = [a.contiguous().to(teeny.DEVICE).requires_grad_(i < 3) for i, a in enumerate(args)]
    out = apply(fn, *args)
    dy = torch.randn(out.shape, generator=gen, dtype=dtype).to(teeny.DEVICE)
    wanted = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(out, wanted, dy)
    refs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    expected = torch.autograd.grad(ref_fn(*refs), [r for r in refs if r.requires_grad], dy)
    tol = 1e-10 if dtype == torch.float64 else 2e-3
    for g, e in zip(grads, expected):
        assert torch.isfinite(g).all() and torch.isfinite(e).all()
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)


# ------------------------------------------------------------------ float64 all the way


def test_layer_norm_float64_eps_is_float64():
    """The row [0.003, -0.002] with eps 1e-5: var = 6.25e-6 is comparable to eps, so eps as
    float32 would give 0.6201736777666285 (issue 17)."""
    x = torch.tensor([[0.003, -0.002]], dtype=torch.float64).to(teeny.DEVICE)
    y = apply(lambda t: norm.layer_norm(t, (2,)), x)
    assert y[0, 0].item() == pytest.approx(0.6201736729460423, rel=1e-15, abs=0)


def _float64_norm_cases(gen):
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 1e-3  # noqa: E731 (var ~ eps)
    affine = lambda n: (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5,) * 1  # noqa: E731
    return {
        "layer_norm": (
            (rand(3, 5), *affine(5)),
            lambda x, w: norm.layer_norm(x, (5,), w, eps=1.1e-6),
            lambda x, w: F.layer_norm(x, (5,), w, eps=1.1e-6),
        ),
        "rms_norm": (
            (rand(3, 5), *affine(5)),
            lambda x, w: norm.rms_norm(x, (5,), w, eps=3e-7),
            lambda x, w: F.rms_norm(x, (5,), w, eps=3e-7),
        ),
        "group_norm": (
            (rand(2, 6, 1), *affine(6)),
            lambda x, w: norm.group_norm(x, 3, w),
            lambda x, w: F.group_norm(x, 3, w),
        ),
        "batch_norm": (
            (rand(6, 3), *affine(3)),
            lambda x, w: norm.batch_norm(x, None, None, w, training=True, eps=1.3e-6),
            lambda x, w: F.batch_norm(x, None, None, w, training=True, eps=1.3e-6),
        ),
    }


@pytest.mark.parametrize("case", ["layer_norm", "rms_norm", "group_norm", "batch_norm"])
def test_float64_matches_torch_tightly_and_launches_take_float64_scalars(case, gen):
    """Small rows (var near eps) and non-dyadic eps: a float32 eps moves dx by ~1e-8."""
    args, fn, ref_fn = _float64_norm_cases(gen)[case]
    args = [a.to(teeny.DEVICE).requires_grad_() for a in args]
    with record_launches() as records:
        out = apply(fn, *args)
        dy = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(teeny.DEVICE)
        grads = torch.autograd.grad(out, args, dy)
    refs = [a.detach().clone().requires_grad_() for a in args]
    ref = ref_fn(*refs)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
    for g, e in zip(grads, torch.autograd.grad(ref, refs, dy)):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-12)
    floats = {(r.kernel, name): kind for r in records for name, kind in r.scalar_types.items() if kind[:2] == "fp"}
    assert floats.get(("norm_forward", "eps")) == "fp64" and set(floats.values()) == {"fp64"}, floats


def test_batch_norm_running_stats_float64_with_momentum_0_1():
    """Three training steps with momentum 0.1 (1 - momentum = 0.9 is not dyadic either): the
    running statistics stay float64-exact against PyTorch (issue 17: 8.4e-8 off in float32)."""
    gen = torch.Generator().manual_seed(3)
    g = Graph()
    layer = nn.BatchNorm1d(3, momentum=0.1, dtype=torch.float64)
    g.output(_Net(layer)(g.input("x", (6, 3), torch.float64, requires_grad=True)))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    ref = torch.nn.BatchNorm1d(3, momentum=0.1, dtype=torch.float64)
    with record_launches() as records:
        for _ in range(3):
            x = torch.randn(6, 3, generator=gen, dtype=torch.float64) * 3 + 1
            ex.forward_train({"x": x})
            ref(x)
    torch.testing.assert_close(ex.params["bn.running_mean"].cpu(), ref.running_mean.detach(), atol=0, rtol=1e-15)
    torch.testing.assert_close(ex.params["bn.running_var"].cpu(), ref.running_var.detach(), atol=0, rtol=1e-15)
    (forward,) = {r.kernel: r for r in records}.values()
    assert forward.scalar_types["momentum"] == "fp64" and forward.scalar_types["eps"] == "fp64"


# ------------------------------------------------------------- Gemma's RMSNorm: (1 + w)


def test_gemma_rms_norm_matches_transformers(gen):
    """rms_norm(weight_offset=1) against transformers' GemmaRMSNorm: in bfloat16 the same float32
    value rounded once (to one bf16 ulp: float32 sums may order differently), in float32 the
    output and both gradients; teeny.nn.RMSNorm(weight_offset=1) starts at Gemma's zero weight."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    x = torch.randn(3, 5, 24, generator=gen) * 3
    gemma = GemmaRMSNorm(24)
    with torch.no_grad():
        gemma.weight.normal_(generator=gen)
    ours = lambda x, w: norm.rms_norm(x, (24,), w, 1e-6, weight_offset=1.0)  # noqa: E731
    half = gemma.to(torch.bfloat16)(x.bfloat16()).detach()
    got = apply(ours, x.bfloat16().to(teeny.DEVICE), gemma.weight.detach().to(teeny.DEVICE))
    torch.testing.assert_close(got.float(), half.float(), atol=0, rtol=2**-8)
    gemma.float()
    xr = x.clone().requires_grad_()
    dy = torch.randn(x.shape, generator=gen)
    want = gemma(xr)
    want_grads = torch.autograd.grad(want, (xr, gemma.weight), dy)
    xt, wt = (t.detach().clone().to(teeny.DEVICE).requires_grad_() for t in (x, gemma.weight))
    out = apply(ours, xt, wt)
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(torch.autograd.grad(out, (xt, wt), dy.to(teeny.DEVICE)), want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)

    ex, out, _ = _run_layer(_Net(nn.RMSNorm(24, eps=1e-6, weight_offset=1.0)), x, LoweringMode.TRAINING)
    assert torch.equal(ex.params["bn.weight"].cpu(), torch.zeros(24))
    torch.testing.assert_close(out.cpu(), GemmaRMSNorm(24)(x).detach(), atol=1e-5, rtol=1e-5)


def test_the_residual_fusion_keeps_the_weight_offset(gen):
    """A residual add read downstream, then Gemma's norm: fused into one AddNormOp with the offset."""
    x, r, w = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen)
    g = Graph()
    xs, rs, ws = (g.input(n, t.shape, requires_grad=True) for n, t in zip("xrw", (x, r, w)))
    s = xs + rs
    g.output(norm.rms_norm(s, 16, ws, 1e-6, weight_offset=1.0) + s * 0.5)
    program = lower(g, LoweringMode.TRAINING)
    assert [p.op.weight_offset for p in program.nodes if type(p.op) is AddNormOp] == [1.0]
    out, _ = Executor(program).forward_train({"x": x, "r": r, "w": w})
    want = F.rms_norm(x + r, (16,), 1 + w, 1e-6) + (x + r) * 0.5
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


def test_a_weight_offset_needs_a_weight():
    with pytest.raises(ValueError, match="rms_norm: weight_offset=1.0 offsets a weight, but no weight was given"):
        _trace(lambda x: norm.rms_norm(x, (3,), weight_offset=1.0), (2, 3))
    with pytest.raises(ValueError, match="elementwise_affine=False"):
        nn.RMSNorm(3, elementwise_affine=False, weight_offset=1.0)
