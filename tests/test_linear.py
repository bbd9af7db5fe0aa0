"""linear family: what the generic harness cannot see (layer, init, the tf32 switch, errors, reductions,
the Hopper kernel's layouts and split contraction, tuned configurations)."""

import math

import pytest
import torch

import teeny
from helpers import compile_for_sm90, run_launches
from teeny import Graph, LoweringMode, lower
from teeny.checks.registry import tolerance
from teeny.core.kernel import record_launches
from teeny.fusions.transposed_weights import TransposedWeightLinearOp
from teeny.ops.products import kernels as products_kernels
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning
from teeny.ops.products.ops import LinearOp
from teeny.torch import apply


def test_linear_layer_parameters_and_init():
    layer = teeny.nn.Linear(20, 7)
    names = [name for name, _ in layer.named_parameters()]
    assert names == ["weight", "bias"]
    assert layer.weight.shape == (7, 20) and layer.bias.shape == (7,)
    gen = torch.Generator().manual_seed(0)
    bound = 1 / math.sqrt(20)
    for p in layer.parameters():
        values = p.init(p.shape, gen, torch.float32)
        assert values.abs().max() <= bound
        assert values.abs().max() > 0.7 * bound  # spread over the whole interval
    assert [n for n, _ in teeny.nn.Linear(3, 2, bias=False).named_parameters()] == ["weight"]


def test_linear_layer_matches_torch_and_trains():
    torch.manual_seed(0)
    g = Graph()
    x = g.input("x", (4, 3, 5))
    layer = teeny.nn.Sequential(teeny.nn.Linear(5, 6), teeny.nn.Linear(6, 2, bias=False))
    g.output(layer(x).sum())
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Linear(6, 2, bias=False)).double()
    ex.load_params({k: v.detach() for k, v in ref.state_dict().items()})
    xs = torch.randn(4, 3, 5)
    out, cache = ex.forward_train({"x": xs})
    ex.backward(cache)
    loss = ref(xs.double()).sum()
    loss.backward()
    torch.testing.assert_close(out.double(), loss.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ex.grads["0.weight"].double(), ref[0].weight.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ex.grads["0.bias"].double(), ref[0].bias.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ex.grads["1.weight"].double(), ref[1].weight.grad, atol=1e-4, rtol=1e-5)


def test_matmul_operator_and_shapes():
    g = Graph()
    a, b = g.input("a", (2, 1, 3, 5)), g.input("b", (4, 5, 2))
    assert (a @ b).shape == (2, 4, 3, 2)
    assert teeny.ops.matmul(g.input("v", (5,)), g.input("w", (5,))).shape == ()
    assert teeny.ops.matmul(g.input("m", (3, 5)), g.input("u", (5,))).shape == (3,)
    assert teeny.ops.matmul(g.input("t", (5,)), g.input("bb", (2, 5, 4))).shape == (2, 4)


def test_matmul_inner_dim_mismatch_names_both_shapes():
    g = Graph()
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(5, 2\)"):
        teeny.ops.matmul(g.input("a", (3, 4)), g.input("b", (5, 2)))
    with pytest.raises(ValueError, match="do not broadcast"):
        teeny.ops.matmul(g.input("c", (2, 3, 4)), g.input("d", (3, 4, 2)))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        teeny.ops.matmul(g.input("e", ()), g.input("f", (3,)))


def test_linear_bad_shapes():
    g = Graph()
    x = g.input("x", (3, 4))
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(2, 5\)"):
        teeny.ops.linear(x, g.input("w", (2, 5)))
    with pytest.raises(ValueError, match="bias must have shape"):
        teeny.ops.linear(x, g.input("w2", (2, 4)), g.input("b", (3,)))
    with pytest.raises(ValueError, match="2-D"):
        teeny.ops.linear(x, g.input("w3", (4,)))


def test_mixed_dtypes_refused():
    g = Graph()
    with pytest.raises(ValueError, match="different float dtypes"):
        teeny.ops.matmul(g.input("a", (3, 4)), g.input("b", (4, 2), dtype=torch.float64))


def test_tf32_switch_is_read_at_trace_time(monkeypatch):
    g = Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (4, 2))
    full = teeny.ops.matmul(a, b).value.producer.op
    monkeypatch.setattr(teeny.core.config, "allow_tf32", True)
    op = teeny.ops.matmul(a, b).value.producer.op
    lin_op = teeny.ops.linear(a, g.input("w", (5, 4))).value.producer.op
    monkeypatch.setattr(teeny.core.config, "allow_tf32", False)
    assert op.precision(torch.float32) == "tf32" and lin_op.precision(torch.float32) == "tf32"
    assert op.precision(torch.float64) == "ieee"  # float64 is never tf32
    # ops traced before the switch, or after it was turned off, keep full precision
    assert full.precision(torch.float32) == teeny.ops.matmul(a, b).value.producer.op.precision(torch.float32)
    assert full.precision(torch.float32) in ("ieee", "tf32x3")


def test_matmul_gradient_sums_broadcast_dims(gen):
    a = torch.randn(2, 1, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    out = apply(teeny.ops.matmul, a, b)
    ref = torch.matmul(a.detach(), b.detach())
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ga, gb = torch.autograd.grad(out, (a, b), grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.autograd.backward(torch.matmul(a2, b2), grad)
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ga, a2.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gb, b2.grad, atol=1e-12, rtol=1e-12)


def test_linear_bias_gradient_two_pass(gen):
    rows = 200  # more than one chunk of rows: partials, then a second pass
    x = torch.randn(rows, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    out = apply(teeny.ops.linear, x, w, b)
    grad = torch.randn(rows, 2, generator=gen, dtype=torch.float64)
    gx, gw, gb = torch.autograd.grad(out, (x, w, b), grad)
    torch.testing.assert_close(gb, grad.sum(0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gw, grad.T @ x.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gx, grad @ w.detach(), atol=1e-12, rtol=1e-12)


def test_linear_zero_in_features_gives_bias():
    x, w, b = torch.randn(3, 0), torch.randn(2, 0), torch.randn(2)
    torch.testing.assert_close(apply(teeny.ops.linear, x, w, b), b.expand(3, 2))


def test_too_many_broadcast_patterns_is_a_clear_error():
    g = Graph()
    a, b = g.input("a", (2, 1, 3, 1, 4, 5)), g.input("b", (1, 2, 1, 3, 5, 4))
    with pytest.raises(ValueError, match="batch dims"):
        teeny.ops.matmul(a, b)


def _linear_cases(rows, fin, fout, gen) -> dict:
    """linear's three products on float64 data: (A, B, expected Z, bias, expected row sums)."""
    x, w, dy = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((rows, fin), (fout, fin), (rows, fout)))
    bias = torch.randn(fout, generator=gen, dtype=torch.float64)
    return {
        "forward": (x, w, x @ w.T + bias, bias, None),
        "grad_input": (dy, w, dy @ w, None, None),
        "grad_weight": (dy, x, dy.T @ x, None, dy.sum(0)),
    }


def _product_launches(p, case, dtype, config):
    """``p``'s launches on ``case``'s operands in ``dtype`` (scratch memory starts as NaN, so a
    box read before it is written shows), with the Z and row sums they write."""
    a, b, expected, bias, sums_expected = case
    z = torch.empty(expected.shape, dtype=dtype, device=teeny.DEVICE)
    sums = None if sums_expected is None else torch.empty(len(sums_expected), dtype=dtype, device=teeny.DEVICE)
    args = [t.to(dtype).to(teeny.DEVICE) if t is not None else None for t in (a, b, bias)]
    scratch = lambda s, d: torch.full(s, float("nan"), dtype=d, device=teeny.DEVICE)  # noqa: E731
    precision = products_kernels.dot_precision(dtype, False)
    launches = products_launches.product_launches(
        p,
        config,
        x=args[0],
        y=args[1],
        z=z,
        bias=args[2],
        dtype=dtype,
        precision=precision,
        scratch=scratch,
        row_sums=sums,
    )
    return launches, z, sums


def _check_product(launches, z, sums, case, dtype, name):
    run_launches(launches, dtype)
    atol, rtol = tolerance(dtype, max(case[2].shape + case[0].shape))
    torch.testing.assert_close(z.cpu().double(), case[2], atol=atol, rtol=rtol, msg=name)
    if sums is not None:
        torch.testing.assert_close(sums.cpu().double(), case[4], atol=atol, rtol=rtol, msg=name)


SCHEDULES = {  # matmul_tma configurations (16x32x16 tiles), the multiprocessors they run on
    "whole": (dict(), 4),
    "subtile": (dict(subtile=True), 4),
    "stream_k": (dict(stream_k=1), 2),  # dW's 3 tiles shared by 2 programs
    "stream_k_2_waves": (dict(stream_k=2, subtile=True), 3),  # dX's last 4 tiles shared by 3
    "pairs_stream_k": (dict(stream_k=1, occupancy=2), 2),  # dW's 3 tiles shared by 4 programs
    "k_major": (dict(stream_k=1), 2),  # float32 only: MN-major operands copied K-major first
    "few_tiles_stream_k": (dict(stream_k=1), 64),  # dW's 3 tiles on 7 of the 64 (4+ K tiles each)
    "fma_stream_k": (dict(stream_k=1, fma=True), 2),  # float32 only: exact FMA products (small ones)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tma_kernel_reads_every_layout_in_place(dtype, schedule, gen, monkeypatch):
    """The Hopper kernel (it runs under the interpreter too) on linear's three products, whose
    operands lie in all four layouts, with the bias (forward) and the bias gradient (the row
    sums of dY^T in dW); sizes that are not multiples of the tiles; scratch memory starts as
    NaN, so a partial box read before it is written shows."""
    if schedule in ("k_major", "fma_stream_k") and dtype != torch.float32:
        pytest.skip("K-major copies and FMA products are float32 configurations")
    options, sms = SCHEDULES[schedule]
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: sms)
    if schedule == "pairs_stream_k":  # the segment sums take one box at a time: a round per segment
        monkeypatch.setattr(products_launches, "SEGMENT_SUM_MAX_SLOTS", 1)
    rows, fin, fout = 148, 24, 40  # 148 float32 rows: 16-byte aligned K-major copies
    cases = _linear_cases(rows, fin, fout, gen)
    precision = products_kernels.dot_precision(dtype, False)
    shared = []
    for name, p in LinearOp.products([(rows, fin), (fout, fin)]).items():
        assert p.tma_layout(dtype) is not None, name
        config = dict(products_tuning._cfg(16, 32, 16, 4, 2, **options), K_MAJOR=schedule == "k_major")
        shared.append(products_launches.schedule(p, config).slots > 1)
        launches, z, sums = _product_launches(p, cases[name], dtype, config)
        kernels = [launch.kernel for launch in launches]
        assert (
            products_kernels.matmul_tma in kernels and (products_kernels.matmul_sum_segments in kernels) == shared[-1]
        )
        products = [launch for launch in launches if launch.kernel is products_kernels.matmul_tma]
        launched = {v.name: v.value for v in products[0].args.visits}
        assert launched["PRECISION"] == ("ieee" if schedule == "fma_stream_k" else precision)
        if schedule == "k_major":  # forward: both operands K-major already; dX: W is not; dW: neither
            copies = {"forward": 0, "grad_input": 1, "grad_weight": 2}[name]
            assert kernels.count(products_kernels.matmul_copy) == copies
        _check_product(launches, z, sums, cases[name], dtype, name)
    assert any(shared) == (options.get("stream_k", 0) > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tma_kernel_writes_a_transposed_weight_gradient(dtype, schedule, gen, monkeypatch):
    """Conv1D's dW (W stored (in, out)): linear's dY^T X, (out, in), written transposed into dW's
    (in, out) by the Hopper kernel (whole tiles, half-tile stores, stream-K segment sums), and
    db, the row sums of dY^T, fused into it."""
    if schedule in ("k_major", "fma_stream_k") and dtype != torch.float32:
        pytest.skip("K-major copies and FMA products are float32 configurations")
    options, sms = SCHEDULES[schedule]
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: sms)
    rows, fin, fout = 148, 24, 40
    x, dy = (torch.randn(rows, n, generator=gen, dtype=torch.float64) for n in (fin, fout))
    p = TransposedWeightLinearOp.products([(rows, fin), (fin, fout)])["grad_weight"]
    assert p.tma_layout(dtype).z_transposed
    config = dict(products_tuning._cfg(16, 32, 16, 4, 2, **options), K_MAJOR=schedule == "k_major")
    case = (dy, x, x.T @ dy, None, dy.sum(0))  # Z is dW as it lies, (in, out); the row sums are db
    launches, z, sums = _product_launches(p, case, dtype, config)
    assert products_kernels.matmul_tma in [launch.kernel for launch in launches]
    _check_product(launches, z, sums, case, dtype, schedule)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k_major", [False, True], ids=["as_they_lie", "k_major"])
def test_tma_kernel_reads_unaligned_rows_through_padded_copies(dtype, k_major, gen, monkeypatch):
    """Rows that are not 16-byte aligned (a vocabulary of 50,257): each such operand is copied
    K-major into rows padded to 16 bytes (transposed where it lay MN-major), and Z is stored in
    place from the registers (no padded result, no copy after), so matmul_tma computes every one
    of linear's products; with ``K_MAJOR`` the aligned MN-major operands are copied too."""
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 4)
    rows, fin, fout = 37, 21, 45  # every row length odd: none of the operands' rows is aligned
    cases = _linear_cases(rows, fin, fout, gen)
    for name, p in LinearOp.products([(rows, fin), (fout, fin)]).items():
        assert p.tma_layout(dtype) is None and p.paddable(), name
        config = dict(products_tuning._cfg(16, 32, 16, 4, 2, stream_k=1), K_MAJOR=k_major)
        launches, z, sums = _product_launches(p, cases[name], dtype, config)
        kernels = [launch.kernel for launch in launches]
        assert products_kernels.matmul_tma in kernels, name
        assert kernels.count(products_kernels.matmul_copy) == 2, name  # X and Y into padded rows; Z as it lies
        assert products_kernels.matmul_copy not in kernels[kernels.index(products_kernels.matmul_tma) :], name
        _check_product(launches, z, sums, cases[name], dtype, name)


def _lower_and_train_linear(args, dtype, gen):
    """linear(x, w, b) of ``args`` lowered for training and run forwards and backwards by the
    executor: (program, output, gradients, the output's gradient, the kernels launched)."""
    g = Graph()
    xs, ws, bs = (g.input(n, t.shape, dtype, requires_grad=True) for n, t in zip("xwb", args))
    g.output(teeny.ops.linear(xs, ws, bs))
    program = lower(g, LoweringMode.TRAINING)
    ex = teeny.Executor(program)
    with record_launches() as log:
        out, cache = ex.forward_train(dict(zip("xwb", args)))
        grad = torch.randn(*out.shape, generator=gen).to(dtype).to(teeny.DEVICE)
        grads = ex.backward(cache, grad)
    return program, out, grads, grad, [r.kernel for r in log]


def _check_linear_against_torch(args, out, grads, grad, dtype):
    refs = [t.detach().double().requires_grad_(True) for t in args]
    ref = torch.nn.functional.linear(*refs)
    ref.backward(grad.double())
    atol, rtol = tolerance(dtype, args[0].shape[0])
    torch.testing.assert_close(out.double(), ref.detach(), atol=atol, rtol=rtol)
    for name, r in zip("xwb", refs):
        torch.testing.assert_close(grads[name].double(), r.grad, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_linear_with_unaligned_rows_trains_through_padded_backward_products(dtype, monkeypatch, gen):
    """The op as lowered and run: the forward on the strided kernel (as tuning picks for the
    head of a 50,257-token vocabulary), dX and dW on matmul_tma with padded K-major copies. The
    backward's copy kernel is declared a backward kernel of the op, so lowering builds it even
    when the forward launched none (on the H200 a copy kernel that was not declared was refused:
    "strided_copy, which is not declared as a backward")."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(teeny.core.tuning, "has_tma", lambda: True)
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 4)
    rows, fin, fout = 37, 21, 45

    def configs(p, *args, **kwargs):
        if (p.M, p.N) == (rows, fout):  # the forward
            return products_tuning._cfg(16, 32, 16, 4, 2, kind="strided")
        return dict(products_tuning._cfg(16, 32, 16, 4, 2, stream_k=1), K_MAJOR=True)

    monkeypatch.setattr(products_tuning, "default_config", configs)
    args = [torch.randn(*s, generator=gen).to(dtype).to(teeny.DEVICE) for s in ((rows, fin), (fout, fin), (fout,))]
    _, out, grads, grad, kernels = _lower_and_train_linear(args, dtype, gen)
    assert kernels[0] == "matmul_product" and kernels.count("matmul_tma") == 2 and "matmul_copy" in kernels
    _check_linear_against_torch(args, out, grads, grad, dtype)
    if dtype == torch.float64:  # and against central finite differences, through the same launches
        teeny.gradcheck(teeny.ops.linear, *args)  # the bias element by element, x and W along directions


def _launch_args(launch) -> dict:
    return {v.name: v.value for v in launch.args.visits}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_a_loss_writes_the_heads_gradient_in_rows_padded_for_its_products(dtype, gen):
    """logits = linear(x, W) with rows that are not 16-byte aligned (11 classes here, GPT-2's
    50,257), reshaped and read by a cross-entropy: the loss writes dlogits into rows padded to 16
    bytes, the reshape passes the row-strided view on, and the head's dX and dW read it through
    its row stride (so on the GPU TMA reads it with no padded copy). Loss and gradients are
    PyTorch's; in float64, central finite differences through the same launches."""
    g = Graph("head")
    x = g.input("x", (2, 3, 8), dtype, requires_grad=True)
    w = g.input("w", (11, 8), dtype, requires_grad=True)
    y = g.input("y", (6,), torch.int64)
    logits = teeny.ops.linear(x, w)
    g.output(teeny.ops.cross_entropy(teeny.ops.reshape(logits, (6, 11)), y))
    program = lower(g, LoweringMode.TRAINING)
    per_16_bytes = 16 // dtype.itemsize
    padded = math.ceil(11 / per_16_bytes) * per_16_bytes
    assert sorted(program.padded_grads.values()) == [padded, padded]  # the logits and their reshape
    (loss_node,) = [p for p in program.nodes if p.op.name == "cross_entropy"]
    assert _launch_args(loss_node.backward_launches[-1])["dx_sample_stride"] == padded
    (head,) = [p for p in program.nodes if p.op.name == "linear"]
    for launch in head.backward_launches:  # dX and dW read dY's rows `padded` apart
        assert padded in [v for v in _launch_args(launch).values() if isinstance(v, int)]
    feed = {
        "x": torch.randn(2, 3, 8, generator=gen).to(dtype),
        "w": torch.randn(11, 8, generator=gen).to(dtype),
        "y": torch.randint(11, (6,), generator=gen),
    }
    ex = teeny.Executor(program)
    loss, cache = ex.forward_train(feed)
    grads = ex.backward(cache)
    refs = {k: feed[k].double().clone().requires_grad_() for k in ("x", "w")}
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(refs["x"], refs["w"]).reshape(6, 11), feed["y"])
    ref.backward()
    atol, rtol = tolerance(dtype, 11)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=atol, rtol=rtol)
    for name in ("x", "w"):
        torch.testing.assert_close(grads[name].double(), refs[name].grad, atol=atol, rtol=rtol, msg=name)
    if dtype == torch.float64:

        def head_loss(x, w, y):
            return teeny.ops.cross_entropy(teeny.ops.reshape(teeny.ops.linear(x, w), (6, 11)), y)

        teeny.gradcheck(head_loss, feed["x"], feed["w"], feed["y"], requires_grad=lambda i, _: i < 2)


@pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="matmul_tma and TMA: the GPU")
def test_a_gpt2_sized_head_and_loss_train_through_tma_on_the_gpu(gen):
    """GPT-2's head at its real width, 50,257 classes, bf16 (1,024 rows): the logits' product
    stores its unaligned Z from registers and dX and dW read the loss's padded dlogits by TMA.
    Loss and gradients against PyTorch in float32 of the same bf16 inputs."""
    rows, width, classes = 1024, 768, 50257
    g = Graph("head")
    x = g.input("x", (rows, width), torch.bfloat16, requires_grad=True)
    w = g.input("w", (classes, width), torch.bfloat16, requires_grad=True)
    y = g.input("y", (rows,), torch.int64)
    logits = teeny.ops.linear(x, w)
    g.output(teeny.ops.cross_entropy(logits, y), logits)  # the logits an output, as a model returns them (not chunked)
    program = lower(g, LoweringMode.TRAINING)
    assert len(program.padded_grads) == 1  # dlogits, rows of 50,264
    feed = {
        "x": torch.randn(rows, width, generator=gen).bfloat16().cuda(),
        "w": (torch.randn(classes, width, generator=gen) / 30).bfloat16().cuda(),
        "y": torch.randint(classes, (rows,), generator=gen).cuda(),
    }
    ex = teeny.Executor(program)
    with record_launches() as log:
        (loss, _), cache = ex.forward_train(feed)
        grads = ex.backward(cache)
    kernels = [r.kernel for r in log]
    assert "matmul_copy" not in kernels, kernels  # no padded copy of dlogits (nor of a padded Z)
    refs = {k: feed[k].float().requires_grad_() for k in ("x", "w")}
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(refs["x"], refs["w"]), feed["y"])
    ref.backward()
    torch.testing.assert_close(loss.float(), ref.detach(), rtol=1e-2, atol=1e-2)
    for name in ("x", "w"):
        got, want = grads[name].float(), refs[name].grad
        assert (got - want).norm() <= 2e-2 * want.norm(), name


def test_unaligned_products_time_padded_copies_when_big_enough(monkeypatch):
    """A big product with unaligned rows is timed on matmul_tma with padded copies and on the
    strided kernel; a small one, or one with an activation epilogue (its aux lies like Z), and a
    batched one take the strided kernel only."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(teeny.core.tuning, "has_tma", lambda: True)
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 132)
    head = LinearOp.products([(4096, 768), (50257, 768)])  # GPT-2's LM head, transformers' vocabulary
    for name, p in head.items():
        kinds = {
            c["kernel"]
            for c in products_tuning.candidates(
                p, dtype=torch.bfloat16, precision="tf32", has_bias=False, row_sums=name == "grad_weight"
            )
        }
        assert kinds == {"tma", "strided"}, name
        for dtype, precision in ((torch.bfloat16, "tf32"), (torch.float32, "tf32x3")):  # the untimed pick
            assert (
                products_tuning.default_config(
                    p, dtype=dtype, precision=precision, has_bias=False, row_sums=name == "grad_weight"
                )["kernel"]
                == "tma"
            )
    forward = head["forward"]
    assert {
        c["kernel"]
        for c in products_tuning.candidates(
            forward, dtype=torch.bfloat16, precision="tf32", has_bias=False, epilogue="activation"
        )
    } == {"strided"}
    small = LinearOp.products([(64, 24), (45, 24)])["forward"]
    assert {
        c["kernel"] for c in products_tuning.candidates(small, dtype=torch.bfloat16, precision="tf32", has_bias=False)
    } == {"strided"}
    batched = products_launches.Product(64, 45, 24, (24, 1), (45, 1), (45, 1), [(2, 64 * 24, 0, 64 * 45)], [])
    assert not batched.paddable()


EPILOGUE_KERNELS = {  # (kernel, options, multiprocessors)
    "strided": ("strided", {}, 4),
    "tma": ("tma", {}, 4),
    "tma_subtile": ("tma", dict(subtile=True), 4),  # h stored and loaded in half tiles
    "tma_stream_k": ("tma", dict(stream_k=2), 4),  # the epilogue in matmul_sum_segments too
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("where", list(EPILOGUE_KERNELS))
def test_activation_epilogue_in_every_product_kernel(dtype, where, gen, monkeypatch):
    """An activation in the epilogue (``MLPOp``): forwards y = gelu(x W^T + b), with h = x W^T + b
    written for the backward; backwards dh = gelu'(h) * (dY W), h read back. In the strided
    kernel, in matmul_tma and in the segment sums of its stream-K tiles."""
    from teeny.ops.activation import ActivationOp, _gelu_tanh, _gelu_tanh_grad

    kind, options, sms = EPILOGUE_KERNELS[where]
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: sms)
    gelu = ActivationOp("gelu_tanh", _gelu_tanh, _gelu_tanh_grad)
    rows, fin, fout = 45, 72, 80
    shapes = ((rows, fin), (fout, fin), (fout,), (rows, fout), (rows, fin))
    x, w, bias, dy, h_in = (torch.randn(*s, generator=gen).to(dtype).to(teeny.DEVICE) for s in shapes)
    h_ref = (x.double() @ w.double().T + bias.double()).to(dtype).double()  # rounded as an unfused product
    g_ref = (dy.double() @ w.double()).to(dtype).double()
    h_in64 = h_in.double().requires_grad_()
    torch.nn.functional.gelu(h_in64, approximate="tanh").backward(g_ref)
    products = LinearOp.products([(rows, fin), (fout, fin)])
    precision = products_kernels.dot_precision(dtype, False)
    config = dict(products_tuning._cfg(16, 32, 16, 4, 2, kind=kind, **options), K_MAJOR=False)
    if "stream_k" in options:
        assert all(products_launches.schedule(p, config).slots > 1 for p in products.values())

    def run(product, a, b, out, bias, epilogue):
        scratch = lambda s, d: torch.full(s, float("nan"), dtype=d, device=teeny.DEVICE)  # noqa: E731
        launches = products_launches.product_launches(
            product,
            config,
            x=a,
            y=b,
            z=out,
            bias=bias,
            dtype=dtype,
            precision=precision,
            scratch=scratch,
            epilogue=epilogue,
        )
        run_launches(launches, dtype)

    y, h, dh = (torch.empty(s, dtype=dtype, device=teeny.DEVICE) for s in ((rows, fout), (rows, fout), (rows, fin)))
    run(products["forward"], x, w, y, bias, products_launches.Epilogue(gelu, h))
    run(products["grad_input"], dy, w, dh, None, products_launches.Epilogue(gelu, h_in, derivative=True))
    atol, rtol = tolerance(dtype, fin)
    torch.testing.assert_close(h.cpu().double(), h_ref.cpu(), atol=atol, rtol=rtol)
    y_ref = torch.nn.functional.gelu(h.double(), approximate="tanh")  # of h as written
    torch.testing.assert_close(y.cpu().double(), y_ref.cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(dh.cpu().double(), h_in64.grad.cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("where", list(EPILOGUE_KERNELS))
@pytest.mark.parametrize("in_place", [False, True], ids=["new_buffer", "in_place"])
def test_addend_epilogue_in_every_product_kernel(dtype, where, in_place, gen, monkeypatch):
    """dX = dY W + the gradient waiting (``launches.addend_epilogue``: linear's ``grad_accumulates``),
    into a new buffer or over the waiting one, rounded as the product stored alone and summed after:
    in the strided kernel, in matmul_tma and in the segment sums of its stream-K tiles."""
    kind, options, sms = EPILOGUE_KERNELS[where]
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: sms)
    rows, fin, fout = 45, 72, 80
    dy, w, waiting = (
        torch.randn(*s, generator=gen).to(dtype).to(teeny.DEVICE) for s in ((rows, fout), (fout, fin), (rows, fin))
    )
    expected = (dy.double() @ w.double()).to(dtype).double() + waiting.double()
    product = LinearOp.products([(rows, fin), (fout, fin)])["grad_input"]
    config = dict(products_tuning._cfg(16, 32, 16, 4, 2, kind=kind, **options), K_MAJOR=False)
    dx = waiting if in_place else torch.full_like(waiting, float("nan"))
    addend = waiting.clone() if not in_place else waiting
    launches = products_launches.product_launches(
        product, config, x=dy, y=w, z=dx, dtype=dtype, precision=products_kernels.dot_precision(dtype, False),
        scratch=lambda s, d: torch.full(s, float("nan"), dtype=d, device=teeny.DEVICE),
        epilogue=products_launches.addend_epilogue(addend),
    )  # fmt: skip
    run_launches(launches, dtype)
    atol, rtol = tolerance(dtype, fout)
    torch.testing.assert_close(dx.cpu().double(), expected.cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("where", list(EPILOGUE_KERNELS))
def test_float32_weight_gradient_of_half_operands_in_every_product_kernel(dtype, where, gen, monkeypatch):
    """dW = dY^T X of half-precision operands written in float32, with db (dY's column sums) in
    float32 too (``fusions.master_weights``): the float32 sums stored as they are, not rounded to
    the operands' dtype first, in the strided kernel, matmul_tma and the stream-K segment sums."""
    kind, options, sms = EPILOGUE_KERNELS[where]
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: sms)
    rows, fin, fout = 72, 48, 80
    dy, x = (torch.randn(*s, generator=gen).to(dtype).to(teeny.DEVICE) for s in ((rows, fout), (rows, fin)))
    product = LinearOp.products([(rows, fin), (fout, fin)])["grad_weight"]
    config = dict(products_tuning._cfg(16, 32, 16, 4, 2, kind=kind, **options), K_MAJOR=False)
    dw = torch.full((fout, fin), float("nan"), device=teeny.DEVICE)
    db = torch.full((fout,), float("nan"), device=teeny.DEVICE)
    launches = products_launches.product_launches(
        product, config, x=dy, y=x, z=dw, dtype=dtype, precision=products_kernels.dot_precision(dtype, False),
        scratch=lambda s, d: torch.full(s, float("nan"), dtype=d, device=teeny.DEVICE), row_sums=db,
    )  # fmt: skip
    run_launches(launches, dtype)
    expected = dy.double().T @ x.double()
    assert dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dw.cpu().double(), expected.cpu(), atol=1e-4 * rows, rtol=1e-5)
    torch.testing.assert_close(db.cpu().double(), dy.double().sum(0).cpu(), atol=1e-4 * rows, rtol=1e-5)
    rounding = (expected - expected.to(dtype).double()).abs().max().item()
    assert (dw.double() - expected).abs().max().item() < rounding / 4  # not rounded to the operands' dtype


@pytest.mark.parametrize("adds", [True, False], ids=["in_the_epilogue", "by_an_accumulate_launch"])
def test_linears_of_one_input_sum_its_gradient_in_their_products(adds, monkeypatch, gen):
    """x read by three linears (an attention's q, k and v projections) and then a gelu: the
    linears' backwards add dX to the gradient waiting in their product's epilogue
    (``grad_accumulates``), so no accumulate launch sums x's gradient; float64 gradients are
    torch's either way, and a float64 gradcheck holds through the epilogue."""
    from teeny.program import executor as executor_module

    monkeypatch.setattr(LinearOp, "grad_accumulates", adds)
    sums = []
    original = executor_module.accumulate
    monkeypatch.setattr(executor_module, "accumulate", lambda *a: (sums.append(1), original(*a))[1])

    def graph():
        g = Graph()
        x = g.input("x", (2, 2, 4), dtype=torch.float64, requires_grad=True)
        ws = [g.input(f"w{i}", (n, 4), dtype=torch.float64, requires_grad=True) for i, n in enumerate((3, 2, 2))]
        b = g.input("b", (2,), dtype=torch.float64, requires_grad=True)
        q, k, v = teeny.ops.linear(x, ws[0]), teeny.ops.linear(x, ws[1], b), teeny.ops.linear(x, ws[2])
        g.output(
            teeny.ops.add(
                teeny.ops.sum(teeny.ops.exp(q)),
                teeny.ops.add(teeny.ops.sum(teeny.ops.mul(k, v)), teeny.ops.sum(teeny.ops.gelu(x))),
            )
        )
        return g

    feed = {"x": torch.randn(2, 2, 4, generator=gen, dtype=torch.float64), "b": torch.randn(2, generator=gen).double()}
    feed |= {f"w{i}": torch.randn(n, 4, generator=gen, dtype=torch.float64) / 2 for i, n in enumerate((3, 2, 2))}
    program = lower(graph(), LoweringMode.TRAINING)

    def configs():  # the products' configurations: the dry run chose each one the run uses
        return {(p.name, key[0]) for p in program.nodes if isinstance(p.op, LinearOp) for key in p.op.configs}

    chosen = configs()
    ex = teeny.Executor(program)
    grads = ex.backward(ex.forward_train(feed)[1])
    assert len(sums) == (0 if adds else 3)
    assert configs() == chosen and sum(name == "grad_input+addend" for _, name in chosen) == (3 if adds else 0)
    ref = {n: t.clone().requires_grad_() for n, t in feed.items()}
    x = ref["x"]
    q, k, v = x @ ref["w0"].T, x @ ref["w1"].T + ref["b"], x @ ref["w2"].T
    (q.exp().sum() + (k * v).sum() + torch.nn.functional.gelu(x).sum()).backward()
    for name, t in ref.items():
        torch.testing.assert_close(grads[name].cpu(), t.grad, rtol=1e-12, atol=1e-12, msg=name)
    if adds:
        teeny.gradcheck_graph(graph(), feed)


def test_the_dry_run_chooses_each_product_a_run_may_launch_with_or_without_the_addend(gen):
    """h = linear(x, W1) is a program output and read by linear(h, W2): whether h's gradient is
    waiting when the second linear's backward (which runs first) is done depends on whether the
    call gives h's gradient. The dry run chose the dX product both ways (a product's
    configuration is chosen, and timed on a GPU, in lowering: a run, which may be recording a
    tape or a CUDA graph, times nothing); the gradients are torch's either way."""
    g = Graph()
    x = g.input("x", (4, 8), dtype=torch.float64, requires_grad=True)
    w1, w2 = (g.input(n, s, dtype=torch.float64, requires_grad=True) for n, s in (("w1", (8, 8)), ("w2", (5, 8))))
    h = teeny.ops.linear(teeny.ops.linear(x, w1), w1)
    y = teeny.ops.linear(h, w2)
    g.output(teeny.ops.sum(teeny.ops.mul(y, y)), h)
    program = lower(g, LoweringMode.TRAINING, seeded=2)

    def configs():
        return {(p.name, key[0]) for p in program.nodes if isinstance(p.op, LinearOp) for key in p.op.configs}

    chosen = configs()
    assert {name for _, name in chosen} >= {"grad_input", "grad_input+addend"}
    feed = {
        n: torch.randn(*s, generator=gen, dtype=torch.float64)
        for n, s in (("x", (4, 8)), ("w1", (8, 8)), ("w2", (5, 8)))
    }
    ex = teeny.Executor(program)
    for h_grad in (None, torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8)):
        outs, cache = ex.forward_train(feed)
        grads = ex.backward(cache, [torch.ones((), dtype=torch.float64), h_grad])
        ref = {n: t.clone().requires_grad_() for n, t in feed.items()}
        h_ref = ref["x"] @ ref["w1"].T @ ref["w1"].T
        y_ref = h_ref @ ref["w2"].T
        ((y_ref * y_ref).sum() + (0 if h_grad is None else (h_ref * h_grad).sum())).backward()
        for name, t in ref.items():
            torch.testing.assert_close(grads[name].cpu(), t.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert configs() == chosen


@pytest.mark.slow
def test_tma_kernel_compiles_for_the_h200_with_descriptors_made_on_the_host():
    """matmul_tma's launches (forward with bias, dX, dW with the bias gradient shared out
    stream-K, Conv1D's transposed dW, an activation epilogue; bf16 and float32) compile for sm_90
    as an ahead-of-time bundle would, with X, Y, Z (and the epilogue's h) as TMA descriptors made
    on the host: the kernel loads and stores by TMA and writes no descriptor of its own (its PTX
    had 64 ``tensormap`` instructions when each program made them: docs/archive/bench-journal.md, version 20)."""
    rows, fin, fout = 328, 136, 200
    products = dict(LinearOp.products([(rows, fin), (fout, fin)]))
    products["transposed_grad_weight"] = TransposedWeightLinearOp.products([(rows, fin), (fin, fout)])["grad_weight"]
    cases = []
    for dtype in ("bfloat16", "float32"):
        for name, p in products.items():
            dw = "grad_weight" in name
            config = (128, 128, 64, 8, 3, name == "forward", 1 if dw else 0)  # subtile forwards, stream-K dW
            fields = (p.M, p.N, p.K, list(p.x), list(p.y), list(p.z), [], [])
            cases.append(dict(name=f"{dtype} {name}", dtype=dtype, product=fields, bias=name == "forward",
                              row_sums=dw, epilogue=False, config=config))  # fmt: skip
        p = products["forward"]
        fields = (p.M, p.N, p.K, list(p.x), list(p.y), list(p.z), [], [])
        cases.append(dict(name=f"{dtype} gelu epilogue", dtype=dtype, product=fields, bias=True, row_sums=False,
                          epilogue=True, config=(128, 128, 64, 8, 3)))  # fmt: skip
    results = compile_for_sm90("linear_tma_compile", cases, timeout=900)
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['case']}: {r['error']}" for r in failed)
    assert len(results) == len(cases) == 10
    for r in results:
        descriptors = [v for v in r["signature"].values() if str(v).startswith("tensordesc")]
        assert len(descriptors) == (4 if "epilogue" in r["case"] else 3), r
        assert r["tensormap_writes"] == 0 and r["tma_loads"] >= 2 and r["tma_stores"] >= 1, r
        assert r["waits"] == 1, r  # programmatic dependent launch: waits for the kernel before it


def test_tma_layout_refuses_what_tma_cannot_read():
    P = products_launches.Product
    assert P(8, 8, 8, (8, 1), (8, 1), (8, 1), [], []).tma_layout(torch.float32) is not None
    assert P(8, 8, 8, (8, 1), (1, 8), (8, 1), [], []).tma_layout(torch.float32).y_k_contiguous
    assert P(8, 8, 8, (1, 8), (8, 1), (8, 1), [], []).tma_layout(torch.float32).x_k_contiguous is False
    assert P(8, 6, 8, (8, 1), (6, 1), (6, 1), [], []).tma_layout(torch.float32) is None  # 24-byte rows
    assert P(8, 6, 8, (8, 1), (6, 1), (6, 1), [], []).tma_layout(torch.float64) is not None  # 48-byte rows
    assert P(8, 8, 8, (8, 2), (8, 1), (8, 1), [], []).tma_layout(torch.float32) is None  # no unit stride
    assert P(8, 8, 8, (8, 1), (8, 1), (8, 1), [(2, 64, 0, 64)], []).tma_layout(torch.float32) is None  # batched
    assert P(8, 8, 0, (0, 1), (8, 1), (8, 1), [], []).tma_layout(torch.float32) is None  # empty contraction


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_through_the_hopper_path_matches_torch(dtype, monkeypatch, gen):
    """The GPU's path (TMA kernel, heuristic configurations, dW stream-K with its segment sums
    and the bias gradient fused into it) run by the interpreter, as the op lowers and runs it
    on a Hopper GPU (of 4 multiprocessors, so that dW's one tile is shared out)."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(teeny.core.tuning, "has_tma", lambda: True)
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 4)
    rows, fin, fout = 1030, 24, 40  # dW contracts over 1030 rows: stream-K
    products = LinearOp.products([(rows, fin), (fout, fin)])
    precision = products_kernels.dot_precision(dtype, False)
    config = products_tuning.default_config(
        products["grad_weight"], dtype=dtype, precision=precision, has_bias=False, row_sums=True
    )
    assert config["kernel"] == "tma" and products_launches.schedule(products["grad_weight"], config).slots > 1
    x = torch.randn(rows, fin, generator=gen)
    w = torch.randn(fout, fin, generator=gen) / fin**0.5
    b = torch.randn(fout, generator=gen)
    args = [t.to(dtype).to(teeny.DEVICE).requires_grad_(True) for t in (x, w, b)]
    program, out, grads, grad, kernels = _lower_and_train_linear(args, dtype, gen)
    op = program.nodes[0].op
    assert all(c["kernel"] == "tma" for c in op.configs.values()), op.configs
    assert kernels.count("matmul_tma") == 3 and "matmul_sum_segments" in kernels
    assert "sum_to_shape_kernel" not in kernels  # the bias gradient came with dW
    _check_linear_against_torch(args, out, grads, grad, dtype)


def test_a_product_of_few_tiles_is_shared_out_over_programs_with_enough_k_tiles(monkeypatch):
    """An MLP layer's product (128 x 784 by 784 x 256: two 128x128 tiles of 25 K tiles) on a
    132-multiprocessor GPU runs on 12 programs of 4+ K tiles each, not on 2 programs of 25;
    with whole tiles to go round, or too few K tiles to share, the schedule is the plain one."""
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 132)
    P = products_launches.Product
    config = products_tuning._cfg(128, 128, 32, 8, 3, stream_k=1)
    mlp = P(128, 256, 784, (784, 1), (1, 784), (256, 1), [], [])
    sched = products_launches.schedule(mlp, config)
    assert (sched.programs, sched.dp_tiles, sched.sk_tiles) == (12, 0, 2) and sched.slots > 1
    owners = [products_kernels._segment_owners.fn(i, 25, 50, 12) for i in range(2)]  # the maths, off the GPU
    assert owners[0][0] == 0 and owners[-1][1] == 11  # every program takes part
    tiny = P(128, 256, 64, (64, 1), (1, 64), (256, 1), [], [])  # 2 K tiles per tile: nothing to share
    assert products_launches.schedule(tiny, config) == products_launches.schedule(tiny, {**config, "STREAM_K": 0})
    wide = P(8192, 768, 768, (768, 1), (1, 768), (768, 1), [], [])  # 384 tiles: 2 waves whole, 1 shared
    assert products_launches.schedule(wide, config).programs == 132


def test_small_products_get_small_tiles_to_time_and_big_ones_do_not(monkeypatch):
    """A product under TUNE_MIN_MACS (the small MLP's layers) also lists small tiles, float32
    ones on the FMA units among them, each with its stream-K variants; a big product does not.
    Nothing is timed for the small one when it lowers: the heuristic picks the sweep's winners
    (time_small is the sweep's way in)."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(teeny.core.tuning, "has_tma", lambda: True)
    monkeypatch.setattr(teeny.core.tuning, "multiprocessors", lambda: 132)
    P = products_launches.Product
    small = P(128, 256, 784, (784, 1), (1, 784), (256, 1), [], [])
    big = P(8192, 768, 768, (768, 1), (1, 768), (768, 1), [], [])
    for dtype, precision in ((torch.float32, "tf32x3"), (torch.bfloat16, "tf32")):
        few = products_tuning.candidates(small, dtype=dtype, precision=precision, has_bias=True)
        many = products_tuning.candidates(big, dtype=dtype, precision=precision, has_bias=True)
        assert any(c["BLOCK_M"] == 64 and c["BLOCK_N"] == 64 for c in few)
        assert not any(c["BLOCK_M"] == 64 and c["BLOCK_N"] == 64 for c in many)
        fma = [c for c in few if c.get("PRECISION") == "ieee"]
        assert bool(fma) == (dtype == torch.float32) and not any("PRECISION" in c for c in many)
        if fma:
            assert any(c["STREAM_K"] for c in fma) and not any(c["K_MAJOR"] for c in fma)
    narrow = P(128, 10, 256, (256, 1), (1, 256), (10, 1), [], [])  # 40-byte rows: the strided kernel
    assert narrow.tma_layout(torch.float32) is None
    assert any(
        c["BLOCK_N"] == 16
        for c in products_tuning.candidates(narrow, dtype=torch.float32, precision="tf32x3", has_bias=True)
    )

    # the picks of the H200 sweep (docs/archive/bench-journal.md, version 9) for the small MLP's layers
    products = {(fin, fout): LinearOp.products([(128, fin), (fout, fin)]) for fin, fout in
                ((784, 256), (256, 256), (256, 10))}  # fmt: skip

    def pick(fin, fout, name, dtype=torch.float32):
        precision = "tf32x3" if dtype == torch.float32 else "tf32"
        c = products_tuning.default_config(
            products[fin, fout][name], dtype=dtype, precision=precision, has_bias=True, row_sums=name == "grad_weight"
        )
        tile = (c["kernel"], c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c.get("PRECISION", precision))
        return tile + ((c["STREAM_K"], c.get("FUSED_SUMS", False)) if c["kernel"] == "tma" else ())

    assert pick(784, 256, "forward") == ("tma", 64, 32, 32, "tf32x3", 1, False)  # 25 K tiles: stream-K
    assert pick(256, 256, "forward") == ("tma", 64, 32, 32, "tf32x3", 0, False)
    assert pick(256, 256, "grad_input") == ("tma", 32, 64, 32, "ieee", 0, False)  # W is MN-major
    assert pick(784, 256, "grad_weight") == ("tma", 32, 64, 32, "ieee", 0, True)  # the bias gradient fused
    assert pick(256, 10, "forward") == ("strided", 16, 16, 64, "ieee")
    assert pick(784, 256, "forward", torch.bfloat16) == ("tma", 64, 64, 64, "tf32", 0, False)
    assert pick(256, 256, "grad_weight", torch.bfloat16) == ("tma", 64, 64, 128, "tf32", 0, True)
    assert pick(256, 10, "grad_input", torch.bfloat16) == ("strided", 32, 32, 64, "tf32")
    assert (
        products_tuning.default_config(big, dtype=torch.float32, precision="tf32x3", has_bias=True)["BLOCK_M"] == 128
    )  # the general rule

    def timed(*args, **kwargs):
        raise AssertionError("a small product was timed")

    monkeypatch.setattr(teeny.core.tuning, "choose", timed)
    assert products_tuning.choose_config(
        small, dtype=torch.float32, precision="tf32x3", has_bias=True
    ) == products_tuning.default_config(small, dtype=torch.float32, precision="tf32x3", has_bias=True)
