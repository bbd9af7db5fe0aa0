"""Graph rewrites (teeny.fusions): each fused program against the same graph lowered with
``rewrites=()`` (outputs and every gradient), a float64 gradcheck of the fused graph, PyTorch
on the same maths, what ``Program.summary()`` reports, and when a rewrite must not fire."""

import math

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import compile_for_sm90, train_step
from teeny import Graph, LoweringMode, fusions, lower, ops
from teeny.core.graph import Tensor
from teeny.fusions import fuse_residual_norm
from teeny.fusions.chunked_loss import LinearCrossEntropyOp
from teeny.fusions.mlp_chain import MLPOp
from teeny.fusions.qkv_products import SharedInputLinearOp
from teeny.fusions.residual_norm import AddNormOp, TakenInOp
from teeny.fusions.transposed_weights import TransposedWeightLinearOp
from teeny.ops.cast import CastOp
from teeny.ops.norm import layer_norm, rms_norm
from teeny.ops.norm import tiling as norm_tiling
from teeny.program.executor import Executor
from teeny.training.models import GPT


def _run(graph, feed, rewrites=None, seed=0, **lower_options):
    """(outputs, input gradients, parameter gradients, program) of one training step."""
    options = {} if rewrites is None else {"rewrites": rewrites}
    program = lower(graph, LoweringMode.TRAINING, **options, **lower_options)
    step = train_step(program, feed, seed=seed)
    return step.out, step.grads, step.param_grads, program


def _ops(program):
    return [p.op for p in program.nodes]


def _forward_launches(program):
    return sum(len(p.forward_launches) for p in program.nodes)


def _assert_same_numbers(fused, plain, msg=None):
    """Bit for bit under the interpreter; on a GPU within float rounding: the compiler contracts
    a multiply and an add into one FMA differently in the fused kernel and in the unfused two."""
    if teeny.core.device.INTERPRETER:
        assert torch.equal(fused, plain), msg
    else:
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6, msg=msg)


def _residual_graph(dtype=torch.float32, shape=(4, 5, 8)):
    """x + p (p repeats over the batch) -> layer_norm, the sum read again downstream, then a
    full-shaped residual add -> rms_norm: both fusable."""
    g = Graph("residual")
    x = g.input("x", shape, dtype, requires_grad=True)
    d = shape[-1]
    p = g.parameter("p", shape[1:], init=teeny.core.init.normal(1.0), dtype=dtype)
    w = g.parameter("w", (d,), init=teeny.core.init.normal(1.0), dtype=dtype)
    b = g.parameter("b", (d,), init=teeny.core.init.normal(1.0), dtype=dtype)
    h = x + p
    y = layer_norm(h, (d,), w, b)
    z = h + y * y
    out = rms_norm(z, (d,), w)
    g.output(ops.sum(out * out))
    return g


def _torch_residual(x, p, w, b):
    h = x + p
    z = h + F.layer_norm(h, (x.shape[-1],), w, b) ** 2
    return (F.rms_norm(z, (x.shape[-1],), w, eps=torch.finfo(x.dtype).eps) ** 2).sum()


def test_residual_norm_fused_is_bit_identical_to_unfused(gen):
    g = _residual_graph()
    feed = {"x": torch.randn(4, 5, 8, generator=gen)}
    fused = _run(g, feed)
    plain = _run(g, feed, rewrites=())
    assert sum(isinstance(op, AddNormOp) for op in _ops(fused[3])) == 2
    assert sum(isinstance(op, TakenInOp) for op in _ops(fused[3])) == 2
    assert not any(isinstance(op, (AddNormOp, TakenInOp)) for op in _ops(plain[3]))
    assert _forward_launches(fused[3]) == _forward_launches(plain[3]) - 2  # the two adds launch nothing
    _assert_same_numbers(fused[0], plain[0])
    _assert_same_numbers(fused[1]["x"], plain[1]["x"])
    for name in plain[2]:
        _assert_same_numbers(fused[2][name], plain[2][name], name)
    summary = fused[3].summary()
    assert "residual add + layer_norm in one launch: 1" in summary
    assert "residual add + rms_norm in one launch: 1" in summary
    assert "(no launch)" in summary
    assert "rewrite" not in plain[3].summary()


@pytest.mark.parametrize("upcast_first", [False, True])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_an_upcast_sublayer_output_added_to_the_stream_is_read_in_place(gen, low, upcast_first):
    """A float32 stream plus a half-precision sublayer output upcast (autocast's residual add),
    then a norm, the sum read again: the norm reads the half-precision tensor as it is and
    writes the sum (one launch forwards, the upcast launches nothing; backwards the upcast's
    cast back stays). The same numbers as unfused, either operand order."""
    g = Graph("upcast")
    h = g.input("h", (3, 5, 8), requires_grad=True)
    a = g.input("a", (3, 5, 8), low, requires_grad=True)
    w = g.parameter("w", (8,), init=teeny.core.init.normal(1.0))
    a32 = ops.to(ops.mul(a, a), torch.float32)  # the sublayer: its output in half precision
    s = ops.add(a32, h) if upcast_first else ops.add(h, a32)
    y = layer_norm(s, (8,), w, None, out_dtype=low)
    g.output(ops.sum(ops.mul(s, ops.to(ops.exp(y), torch.float32))))
    feed = {"h": torch.randn(3, 5, 8, generator=gen), "a": torch.randn(3, 5, 8, generator=gen).to(low)}
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    fused_ops = [type(op).__name__ for op in _ops(fused[3])]
    assert fused_ops.count("TakenInOp") == 2 and "AddNormOp" in fused_ops and "CastOp" in fused_ops
    assert _forward_launches(fused[3]) == _forward_launches(plain[3]) - 2  # the add and the upcast
    assert "1 upcasts of the residual read in place" in fused[3].summary()
    _assert_same_numbers(fused[0], plain[0])
    for name in ("h", "a"):
        assert fused[1][name].dtype == plain[1][name].dtype
        _assert_same_numbers(fused[1][name], plain[1][name], name)
    _assert_same_numbers(fused[2]["w"], plain[2]["w"], "w")


# ----------------------------------------------------------------------------- transposed weights


def _conv1d_graph(dtype=torch.float32, rows=(3, 5), fin=7, fout=9, bias=True, w_read_again=False, form="linear"):
    """x (rows..., fin) @ W + b with W (fin, fout), written linear(x, W.t(), b) as transformers'
    Conv1D computes it (``form="matmul"``: matmul(x, W) + b, as ``addmm`` exports;
    ``"bias-first"``: b + matmul(x, W)); ``w_read_again``: the transpose (or the product
    before the bias) is also summed into the loss."""
    g = Graph("conv1d")
    x = g.input("x", (*rows, fin), dtype, requires_grad=True)
    w = g.parameter("w", (fin, fout), init=teeny.core.init.normal(0.3), dtype=dtype)
    b = g.parameter("b", (fout,), init=teeny.core.init.normal(1.0), dtype=dtype) if bias else None
    if form == "linear":
        again = wt = ops.transpose(w, 0, 1)
        y = ops.linear(x, wt, b)
    else:
        again = ops.matmul(x, w)
        y = ops.add(again, b) if form == "matmul" else ops.add(b, again)
    loss = ops.sum(ops.mul(y, y))
    if w_read_again:
        loss = ops.add(loss, ops.sum(again))
    g.output(loss)
    return g


@pytest.mark.parametrize("bias, form", [(True, "linear"), (False, "linear"), (True, "matmul"), (True, "bias-first")])
def test_transposed_weight_read_in_place_matches_unfused(bias, form, gen):
    g = _conv1d_graph(bias=bias, form=form)
    feed = {"x": torch.randn(3, 5, 7, generator=gen)}
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert [type(op).__name__ for op in _ops(fused[3])][:1] == ["TransposedWeightLinearOp"]
    assert _ops(fused[3])[0].has_bias == bias
    assert not any(type(op).__name__ in ("PermuteOp", "MatmulOp") for op in _ops(fused[3]))
    assert [op.name for op in _ops(fused[3])] == ["linear", "mul", "sum"]  # the bias in the product
    said = "linear of a transposed weight read in place: 1, 1 transposes" if form == "linear" else "x @ W + b as one"
    assert said in fused[3].summary()
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1]["x"], plain[1]["x"], rtol=1e-5, atol=1e-5)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("form", ["linear", "matmul"])
def test_transposed_weight_read_in_place_gradcheck_float64(form, gen):
    g = _conv1d_graph(torch.float64, rows=(2, 3), fin=4, fout=5, form=form)
    assert any(isinstance(op, TransposedWeightLinearOp) for op in _ops(lower(g, LoweringMode.TRAINING)))
    teeny.gradcheck_graph(g, {"x": torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)})


@pytest.mark.parametrize("form", ["linear", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_weight_read_in_place_matches_pytorch(dtype, form, gen):
    g = _conv1d_graph(dtype, rows=(3, 11), fin=24, fout=40, form=form)
    x = torch.randn(3, 11, 24, generator=gen).to(dtype)
    loss_value, grads, pgrads, program = _run(g, {"x": x})
    params = {k: v.detach().clone().requires_grad_() for k, v in Executor(program, seed=0).params.items()}
    xr = x.to(teeny.DEVICE).requires_grad_()
    y = torch.addmm(params["b"], xr.reshape(-1, 24), params["w"])  # transformers' Conv1D
    ref = (y.float() * y.float()).sum() if dtype != torch.float32 else (y * y).sum()
    ref.backward()
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=3e-2, atol=0.5)
    torch.testing.assert_close(loss_value.float(), ref.detach().float(), **tol)
    torch.testing.assert_close(grads["x"].float(), xr.grad.float(), **tol)
    for name, t in params.items():
        torch.testing.assert_close(pgrads[name].float(), t.grad.float(), **tol, msg=name)


@pytest.mark.parametrize("form", ["linear", "matmul"])
def test_transposed_weight_read_elsewhere_keeps_its_transpose(form, gen):
    """A transpose (or a product before its bias) that something else reads stays as it is."""
    program = lower(_conv1d_graph(w_read_again=True, form=form), LoweringMode.TRAINING)
    assert not any(isinstance(op, TransposedWeightLinearOp) for op in _ops(program))


def test_residual_norm_matches_pytorch(gen):
    g = _residual_graph()
    x = torch.randn(4, 5, 8, generator=gen)
    loss, grads, pgrads, program = _run(g, {"x": x})
    params = Executor(program, seed=0).params
    ref = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    xr = x.to(teeny.DEVICE).requires_grad_()
    ref_loss = _torch_residual(xr, ref["p"], ref["w"], ref["b"])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grads["x"], xr.grad, rtol=1e-4, atol=1e-4)
    for name, t in ref.items():
        torch.testing.assert_close(pgrads[name], t.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_residual_norm_gradcheck_float64(gen):
    g = _residual_graph(torch.float64, shape=(2, 3, 4))
    assert any(isinstance(op, AddNormOp) for op in _ops(lower(g, LoweringMode.TRAINING)))
    teeny.gradcheck_graph(g, {"x": torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)})


def _upcast_branch_junction(x, branch, weight, bias):
    """s = x + branch upcast to x's dtype (read by the fused norm as it is), layer_norm of s,
    and s read again (its gradient waits for the norm's backward): sum(y^2) + sum(s^2)."""
    s = teeny.ops.add(x, teeny.ops.to(branch, x.dtype))
    y = teeny.ops.layer_norm(s, (37,), weight, bias)
    return teeny.ops.add(teeny.ops.sum(teeny.ops.square(y)), teeny.ops.sum(teeny.ops.square(s)))


@pytest.mark.parametrize("wide, narrow", [(torch.float64, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
def test_the_fused_norm_writes_an_upcast_branchs_gradient_as_pytorch_does(wide, narrow, gen):
    """The branch's gradient, which the fused norm's backward writes in the branch's own dtype
    (``AddNormOp.writing_residual_grad``), on odd shapes: against PyTorch's autograd, and in
    float64 the stream's and the affine gradients against central finite differences through
    the same launches."""
    shape = (3, 5, 37)
    feed = [
        torch.randn(*shape, generator=gen).to(wide),
        torch.randn(*shape, generator=gen).to(narrow),
        (torch.rand(37, generator=gen) + 0.5).to(wide),
        torch.randn(37, generator=gen).to(wide),
    ]
    g = Graph("junction")
    names = ["x", "branch", "w", "b"]
    ins = [g.input(n, tuple(t.shape), t.dtype, requires_grad=True) for n, t in zip(names, feed)]
    g.output(_upcast_branch_junction(*ins))
    program = lower(g, LoweringMode.TRAINING)
    (norm,) = [p for p in program.nodes if isinstance(p.op, AddNormOp)]
    assert norm.op.grad_copies_input0 is not None and norm.backward_launches  # no cast launch for the branch
    assert not any(p.backward_launches for p in program.nodes if p.op.name.endswith("_in_norm"))
    ex = Executor(program)
    loss, cache = ex.forward_train(dict(zip(names, (t.to(teeny.DEVICE) for t in feed))))
    grads = ex.backward(cache)
    refs = [t.double().clone().requires_grad_() for t in feed]
    s = refs[0] + refs[1]
    y = torch.nn.functional.layer_norm(s, (37,), refs[2], refs[3])
    ((y * y).sum() + (s * s).sum()).backward()
    tol = dict(rtol=1e-6, atol=1e-6) if narrow == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, ref in zip(names, refs):
        got = grads[name]
        assert got.dtype == feed[names.index(name)].dtype, name
        scale = ref.grad.abs().max()
        torch.testing.assert_close(got.double() / scale, ref.grad / scale, **tol, msg=name)
    if wide == torch.float64:  # the float32 branch is held (finite differences in float32 say little)
        teeny.gradcheck(_upcast_branch_junction, *feed, requires_grad=lambda i, _: i != 1)


def test_residual_norm_half_precision_rounds_the_sum_like_the_add(gen):
    """The fused kernel rounds a + b to bfloat16 before normalising, as the add it replaces
    stores it: the fused program stays bit-identical to the unfused one (on the H200 as well)."""
    g = _residual_graph(torch.bfloat16)
    feed = {"x": torch.randn(4, 5, 8, generator=gen).bfloat16()}
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert torch.equal(fused[0], plain[0])
    assert torch.equal(fused[1]["x"], plain[1]["x"])
    for name in plain[2]:
        assert torch.equal(fused[2][name], plain[2][name]), name


def test_residual_norm_rows_longer_than_one_block(monkeypatch, gen):
    monkeypatch.setattr(norm_tiling, "MAX_BLOCK", 16)  # rows of 40: three column blocks, the sum re-read per block
    g = _residual_graph(shape=(3, 2, 40))
    feed = {"x": torch.randn(3, 2, 40, generator=gen)}
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert any(isinstance(op, AddNormOp) for op in _ops(fused[3]))
    _assert_same_numbers(fused[0], plain[0])
    _assert_same_numbers(fused[1]["x"], plain[1]["x"])


def test_rewrites_leave_the_traced_graph_as_it_was():
    g = _residual_graph()
    before = [(n.op, [v.id for v in n.inputs]) for n in g.nodes]
    program = lower(g, LoweringMode.TRAINING)
    assert program.graph is not g
    assert [(n.op, [v.id for v in n.inputs]) for n in g.nodes] == before
    assert lower(g, LoweringMode.TRAINING, rewrites=()).graph is g


def test_residual_norm_needs_the_norm_and_a_repeating_residual():
    g = Graph()
    x = g.input("x", (4, 8))
    r = g.input("r", (4, 1))  # broadcast along the row: not a residual the norm kernel can read
    w = g.parameter("w", (8,), init=teeny.core.init.ones())
    s = x + r
    y = layer_norm(s, (8,), w)
    g.output(y)
    assert not any(isinstance(op, AddNormOp) for op in _ops(lower(g)))
    g2 = Graph()
    a, b = g2.input("a", (4, 8)), g2.input("b", (4, 8))
    s2 = a + b
    layer_norm(s2, (8,))
    g2.output(s2)  # the norm is not needed for the output: nothing writes the sum if it is fused away
    program = lower(g2, outputs=[s2])
    assert not any(isinstance(op, (AddNormOp, TakenInOp)) for op in _ops(program))
    out = Executor(program)({"a": torch.ones(4, 8), "b": torch.ones(4, 8)})
    assert torch.equal(out, torch.full((4, 8), 2.0))


def _gpt_graph(model, batch, block, vocab):
    g = Graph("gpt")
    idx = g.input("x", (batch, block), torch.int64)
    y = g.input("y", (batch, block), torch.int64)
    logits = model(idx)
    g.output(ops.cross_entropy(ops.reshape(logits, (batch * block, vocab)), ops.reshape(y, (batch * block,))))
    return g


@pytest.fixture(scope="module")
def gpt_case():
    vocab, block, batch = 11, 6, 2
    gen = torch.Generator().manual_seed(0)
    model = GPT(vocab, block, d_model=8, n_heads=2, n_layers=2)
    feed = {
        "x": torch.randint(vocab, (batch, block), generator=gen),
        "y": torch.randint(vocab, (batch, block), generator=gen),
    }
    return _gpt_graph(model, batch, block, vocab), feed


def test_gpt_residual_stream_fuses_every_norm(gpt_case):
    """Token + position embeddings feed ln1 of block 1; each block's two residual adds feed the
    next norm: 2 * layers + 1 fused norms, and the same loss and gradients (bit for bit under
    the interpreter)."""
    g, feed = gpt_case
    fused, plain = _run(g, feed, rewrites=(fuse_residual_norm,)), _run(g, feed, rewrites=())
    assert sum(isinstance(op, AddNormOp) for op in _ops(fused[3])) == 5
    _assert_same_numbers(fused[0], plain[0])
    for name in plain[2]:
        _assert_same_numbers(fused[2][name], plain[2][name], name)


def test_gpt_with_every_default_rewrite(gpt_case):
    """The head and its loss chunked as well: the same step up to rounding (dW summed by chunks)."""
    g, feed = gpt_case
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _fused_ops(fused[3]) and sum(isinstance(op, AddNormOp) for op in _ops(fused[3])) == 5
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_rewrites_leave_the_counted_flops_as_they_were(gpt_case):
    """``Program.flops`` counts the products a step computes, whatever rewrites fused them (the
    q/k/v product, the MLP's chain, the chunked head, attention reading its heads in place); the
    chunked head computes its gradients' products in the forward, so only the total is the same."""
    g, _ = gpt_case
    plain = lower(g, LoweringMode.TRAINING, rewrites=()).flops()
    fused = lower(g, LoweringMode.TRAINING, rewrites=fusions.DEFAULT_REWRITES + (fusions.fuse_mlp,))
    assert {type(op).__name__ for op in _ops(fused)} >= {"SharedInputLinearOp", "MLPOp", "LinearCrossEntropyOp"}
    assert sum(fused.flops()) == sum(plain) and plain[0] > 0 and plain[1] > plain[0]
    assert lower(g, LoweringMode.INFERENCE).flops() == (plain[0], 0)


# ------------------------------------------------------------------ linear + cross-entropy


def _head_graph(
    rows=(3, 5), d=8, classes=11, dtype=torch.float32, bias=True, upcast=False, softcap_activation=None, **loss_options
):
    """x (rows..., d) -> linear -> (``upcast``: to float32 ->) (``softcap_activation``: ops.softcap
    at that cap ->) reshape to (N, classes) -> cross_entropy(target)."""
    g = Graph("head")
    x = g.input("x", (*rows, d), dtype, requires_grad=True)
    n = math.prod(rows)
    y = g.input("y", (n,), torch.int64)
    head = teeny.nn.Linear(d, classes, bias=bias, dtype=dtype)
    logits = head(x)
    if upcast:
        logits = ops.to(logits, torch.float32)
    if softcap_activation is not None:
        logits = ops.softcap(logits, softcap_activation)
    g.output(ops.cross_entropy(ops.reshape(logits, (n, classes)), y, **loss_options))
    return g


def _head_feed(gen, rows=(3, 5), d=8, classes=11, dtype=torch.float32):
    n = math.prod(rows)
    y = torch.randint(classes, (n,), generator=gen)
    y[1] = -100  # an ignored row
    return {"x": torch.randn(*rows, d, generator=gen).to(dtype), "y": y}


@pytest.fixture(autouse=True)
def small_logits_chunked(monkeypatch):
    """The samples' logits are tiny: chunk them anyway."""
    monkeypatch.setattr(fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 0)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 rows: the 15-row samples take four, the last one short."""
    monkeypatch.setattr(fusions.chunked_loss, "CHUNK_ROW_MULTIPLE", 4)
    monkeypatch.setattr(fusions.chunked_loss, "LOGITS_CHUNK_BYTES", 1)


def test_small_logits_are_not_chunked(monkeypatch):
    monkeypatch.setattr(fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 15 * 11 * 4 + 1)
    assert not _fused_ops(lower(_head_graph(), LoweringMode.TRAINING))
    monkeypatch.setattr(fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 15 * 11 * 4)
    assert _fused_ops(lower(_head_graph(), LoweringMode.TRAINING))


def _fused_ops(program):
    return [op for op in _ops(program) if isinstance(op, LinearCrossEntropyOp)]


CE_CASES = [
    dict(),
    dict(reduction="sum"),
    dict(label_smoothing=0.1),
    dict(weight=torch.linspace(0.5, 1.5, 11)),
    dict(weight=torch.linspace(0.5, 1.5, 11), label_smoothing=0.2),
    dict(bias=False),
    dict(softcap=0.8),
    dict(softcap=0.8, weight=torch.linspace(0.5, 1.5, 11), label_smoothing=0.1, reduction="sum"),
]


@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: ",".join(c) or "mean")
def test_linear_cross_entropy_chunked_matches_unfused(case, small_chunks, gen):
    options = dict(case)
    bias = options.pop("bias", True)
    g = _head_graph(bias=bias, **options)
    feed = _head_feed(gen)
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    (op,) = _fused_ops(fused[3])
    assert op.chunk_size(15, 11, torch.float32) == 4
    assert len(fused[3].nodes) == 1
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1]["x"], plain[1]["x"], rtol=1e-5, atol=1e-6)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-5, atol=1e-6, msg=name)


def _visits(launch) -> dict:
    return {v.name: v.value for v in launch.args.visits}


@pytest.mark.parametrize("classes, padded", [(11, 16), (16, 16), (33, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_linear_cross_entropy_pads_the_logits_rows_to_16_elements(dtype, classes, padded):
    """Each chunk's logits rows are a multiple of 16 elements long, padding included: the
    products read and write them in place (through TMA on the GPU, where a vocabulary of 50,257
    took padded copies each way), and the loss kernel reads and writes whole padded rows, a
    length Triton sees is divisible by 16, so it moves them in wide vectors (v16: scalar loads
    for 50,257 columns)."""
    (node,) = lower(_head_graph(dtype=dtype, classes=classes), LoweringMode.TRAINING).nodes
    (loss_launch,) = [launch for launch in node.forward_launches if launch.kernel.name == "class_loss_forward"]
    args = _visits(loss_launch)
    assert args["sample_stride"] == args["row_len"] == padded and args["n_classes"] == classes
    assert args["x_ptr"].stride() == (padded, 1) and args["grad_ptr"] is args["x_ptr"]


@pytest.mark.slow
def test_linear_cross_entropy_loss_kernel_moves_padded_rows_in_wide_vectors():
    """GPT-2's vocabulary of 50,257: the chunk's loss kernel, compiled for the H200, loads and
    stores the padded logits rows 16 bytes at a time, as it does GPT-2 small's 50,304 (v16: with
    masks at 50,257 it moved one bf16 a load, 436 against 87 us a chunk)."""
    widths = compile_for_sm90("loss_ptx_check", [50257, 50304, "50257:30.0"], timeout=600)
    for classes in ("50257", "50304", "50257:30.0"):  # soft-capped logits (Gemma 2's) too
        assert "ld.global.v4.b32" in widths[classes]["ld"] and "st.global.v4.b32" in widths[classes]["st"], widths
        assert "st.global.b16" not in widths[classes]["st"], widths  # no element-by-element stores of the rows


# the soft caps of Gemma 2's logits a head graph may have: none, the loss's own, an ops.softcap before it
SOFTCAPS = [{}, {"softcap": 0.7}, {"softcap_activation": 0.7}]


def _softcap_id(softcap: dict) -> str:
    return next(iter(softcap), "no softcap")


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=_softcap_id)
def test_linear_cross_entropy_gradcheck_float64(softcap, small_chunks, gen):
    shapes = dict(rows=(5,), d=2, classes=3)  # 5 rows: two chunks, the second short
    g = _head_graph(dtype=torch.float64, label_smoothing=0.2, **shapes, **softcap)
    (op,) = _fused_ops(lower(g, LoweringMode.TRAINING))
    assert op.loss.softcap == next(iter(softcap.values()), 0.0)
    feed = _head_feed(gen, dtype=torch.float64, **shapes)
    feed["x"] *= 4  # logits the cap bends
    teeny.gradcheck_graph(g, feed)


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=_softcap_id)
def test_linear_cross_entropy_matches_pytorch(softcap, small_chunks, gen):
    g = _head_graph(label_smoothing=0.1, **softcap)
    feed = _head_feed(gen)
    feed["x"] *= 4
    loss_value, grads, pgrads, program = _run(g, feed)
    params = {k: v.clone().requires_grad_() for k, v in Executor(program, seed=0).params.items()}
    x = feed["x"].to(teeny.DEVICE).requires_grad_()
    logits = F.linear(x, params["weight"], params["bias"]).reshape(15, 11)
    if softcap:
        cap = next(iter(softcap.values()))
        logits = cap * torch.tanh(logits / cap)
    ref = F.cross_entropy(logits, feed["y"].to(teeny.DEVICE), label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss_value, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["x"], x.grad, rtol=1e-4, atol=1e-6)
    for name, t in params.items():
        torch.testing.assert_close(pgrads[name], t.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_linear_cross_entropy_never_stores_the_logits(gen):
    """A wide head (logits 64 x 512 against a 16-wide input): the fused program keeps dX, dW and
    db for the backward instead of the logits, and says so."""
    g = _head_graph(rows=(4, 16), d=16, classes=512)
    fused = lower(g, LoweringMode.TRAINING)
    plain = lower(g, LoweringMode.TRAINING, rewrites=())
    logits = 64 * 512 * 4
    saved = sum(fused.saved_bytes(p) for p in fused.nodes)
    assert saved == 64 * 16 * 4 + 512 * 16 * 4 + 512 * 4 + 2 * 4  # dX, dW, db, the mean's two sums
    assert sum(plain.saved_bytes(p) for p in plain.nodes) >= logits
    assert plain.peak_activation_bytes() - fused.peak_activation_bytes() >= logits - saved
    assert "cross_entropy(linear) in chunks of rows: 1, logits (0.12 MiB) never stored" in fused.summary()
    out, _ = Executor(fused).forward_train(_head_feed(gen, rows=(4, 16), d=16, classes=512))
    assert torch.isfinite(out)


@pytest.mark.parametrize(
    "order", ["softcap reshape", "reshape softcap", "upcast softcap reshape", "softcap upcast reshape"]
)
def test_linear_cross_entropy_takes_in_a_softcap_activation(order, small_chunks, gen):
    """cross_entropy(softcap(linear(x))), as a graph of Gemma 2's head reads, the cap before or
    after the reshape and an upcast of bf16 logits: one fused node whose loss caps the logits as
    it reads them (never stored), the numbers of the unfused program; the summary says so."""
    dtype = torch.bfloat16 if "upcast" in order else torch.float32
    g = Graph("capped head")
    x, y = g.input("x", (3, 5, 8), dtype, requires_grad=True), g.input("y", (15,), torch.int64)
    logits = teeny.nn.Linear(8, 11, dtype=dtype)(x)
    for step in order.split():
        if step == "softcap":
            logits = ops.softcap(logits, 1.5)
        elif step == "upcast":
            logits = ops.to(logits, torch.float32)
        else:
            logits = ops.reshape(logits, (15, 11))
    g.output(ops.cross_entropy(logits, y, label_smoothing=0.1))
    feed = _head_feed(gen, dtype=dtype)
    feed["x"] *= 4
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    (op,) = _fused_ops(fused[3])
    assert len(fused[3].nodes) == 1 and op.loss.softcap == 1.5
    saved = sum(fused[3].saved_bytes(p) for p in fused[3].nodes)
    assert saved == 15 * 8 * dtype.itemsize + (11 * 8 + 11 + 2) * 4  # dX, float32 dW and db, the mean's sums
    assert "cross_entropy(linear) in chunks of rows: 1 (1 of soft-capped logits)" in fused[3].summary()
    # bf16 capped then upcast: the fused op caps in float32, the unfused one rounds the capped logits to bf16
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fused[0], plain[0], **tol)
    torch.testing.assert_close(fused[1]["x"].float(), plain[1]["x"].float(), **tol)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name].float(), plain[2][name].float(), **tol, msg=name)


def test_linear_cross_entropy_leaves_a_softcap_it_cannot_take_in():
    """A soft cap whose output another node reads (or the graph returns) stays, and so does the
    linear; a cap before a loss that caps again is not one cap: nothing fuses."""
    g = Graph()
    x, y = g.input("x", (6, 4), requires_grad=True), g.input("y", (6,), torch.int64)
    capped = ops.softcap(teeny.nn.Linear(4, 5)(x), 2.0)
    g.output(ops.cross_entropy(capped, y), capped)
    assert not _fused_ops(lower(g, LoweringMode.TRAINING))
    g2 = _head_graph(softcap_activation=2.0, softcap=3.0)
    assert not _fused_ops(lower(g2, LoweringMode.TRAINING))


def test_linear_cross_entropy_keeps_its_soft_cap_under_mixed_precision(small_chunks, gen):
    """bf16-mixed rebuilds the fused op in bf16: the loss it carries keeps the cap."""
    g = _head_graph(softcap_activation=0.9)
    feed = _head_feed(gen)
    feed["x"] *= 4
    mixed = _run(g, feed, precision="bf16-mixed")
    (op,) = _fused_ops(mixed[3])
    assert op.loss.softcap == 0.9
    plain = _run(g, feed, rewrites=())
    torch.testing.assert_close(mixed[0].float(), plain[0], rtol=2e-2, atol=2e-2)


def _given_head_graph(x_grad: bool, weight_grad: bool, rows=(3, 5), d=8, classes=11):
    """The head of ``_head_graph`` with W and b given as inputs, as ``teeny.torch`` passes a
    PyTorch layer's (frozen under LoRA: no gradient wanted)."""
    g = Graph("given head")
    n = math.prod(rows)
    x = g.input("x", (*rows, d), requires_grad=x_grad)
    y = g.input("y", (n,), torch.int64)
    w = g.input("w", (classes, d), requires_grad=weight_grad)
    b = g.input("b", (classes,), requires_grad=weight_grad)
    g.output(ops.cross_entropy(ops.reshape(ops.linear(x, w, b), (n, classes)), y))
    return g


@pytest.mark.parametrize("x_grad, weight_grad", [(True, False), (False, True)])
def test_linear_cross_entropy_computes_only_the_gradients_wanted(x_grad, weight_grad, small_chunks, gen):
    """A frozen head (LoRA) gets no dW or db in the forward, kept or computed (a (classes x d)
    float32 sum and a product per chunk), and frozen hidden states no dX; the gradients that
    are wanted match the unfused program's."""
    g = _given_head_graph(x_grad, weight_grad)
    feed = {**_head_feed(gen), "w": torch.randn(11, 8, generator=gen), "b": torch.randn(11, generator=gen)}
    fused, plain = lower(g, LoweringMode.TRAINING), lower(g, LoweringMode.TRAINING, rewrites=())
    (op,) = _fused_ops(fused)
    assert op.grads == (x_grad, weight_grad, weight_grad)
    every = lower(_given_head_graph(True, True), LoweringMode.TRAINING)  # every gradient wanted: dX, dW, db kept
    saved, kept_by_all = (sum(p.saved_bytes(n) for n in p.nodes) for p in (fused, every))
    assert kept_by_all - saved >= (11 * 8 * 4 + 11 * 4 if x_grad else 15 * 8 * 4)  # dW and db, or dX, not kept
    names = [launch.kernel.name for launch in fused.nodes[0].forward_launches]
    assert names.count("linear_cross_entropy_forward") == (4 * 2 if weight_grad else 0)  # dW and db summed per chunk
    assert ("grad_weight" in op.extra_outputs([(15, 8), (15,), (11, 8), (11,)], torch.float32)) == weight_grad
    feed = {k: v.to(teeny.DEVICE) for k, v in feed.items()}
    results = []
    for program in (fused, plain):
        ex = Executor(program)
        out, cache = ex.forward_train(feed)
        results.append((out, ex.backward(cache, torch.ones((), device=teeny.DEVICE))))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert set(results[0][1]) == set(results[1][1]) == ({"x"} if x_grad else {"w", "b"})
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_linear_cross_entropy_inference_computes_no_gradients(small_chunks, gen):
    g = _head_graph()
    feed = _head_feed(gen)
    program = lower(g)
    (op,) = _fused_ops(program)
    assert not op.with_grads and sum(program.saved_bytes(p) for p in program.nodes) == 0
    assert "linear_cross_entropy_backward" not in {k.kernel.name for k in program.instances.values()}
    torch.testing.assert_close(Executor(program)(feed), Executor(lower(g, rewrites=()))(feed))


def test_linear_cross_entropy_needs_logits_nobody_else_reads(gen):
    g = Graph()
    x, y = g.input("x", (6, 4)), g.input("y", (6,), torch.int64)
    logits = teeny.nn.Linear(4, 5)(x)
    g.output(ops.cross_entropy(logits, y), logits)  # the logits are an output: they must exist
    assert not _fused_ops(lower(g, LoweringMode.TRAINING))
    g2 = Graph()
    x2, y2 = g2.input("x", (6, 4)), g2.input("y", (6,), torch.int64)
    logits2 = teeny.nn.Linear(4, 5)(x2)
    g2.output(ops.cross_entropy(logits2, y2) + ops.sum(logits2))
    assert not _fused_ops(lower(g2, LoweringMode.TRAINING))


def test_linear_cross_entropy_reports_bad_class_indices(monkeypatch, gen):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)  # off by default on a GPU; read at tracing
    g = _head_graph()
    feed = _head_feed(gen)
    feed["y"][4] = 11
    ex = Executor(lower(g, LoweringMode.TRAINING))
    with pytest.raises(teeny.TeenyError, match="linear_cross_entropy.*class index 11 is out of range"):
        ex.forward_train(feed)


def test_linear_cross_entropy_half_precision_close_to_unfused(small_chunks, gen):
    g = _head_graph(dtype=torch.bfloat16)
    feed = _head_feed(gen, dtype=torch.bfloat16)
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _fused_ops(fused[3])
    torch.testing.assert_close(fused[0].float(), plain[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused[1]["x"].float(), plain[1]["x"].float(), rtol=2e-2, atol=2e-3)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name].float(), plain[2][name].float(), rtol=2e-2, atol=2e-3, msg=name)


def test_linear_cross_entropy_takes_in_an_upcast_of_the_logits(small_chunks, gen):
    """bf16 logits cast to float32 before the loss (Hugging Face's ``logits.float()``): the cast
    is exact, so the fused op computes the same and writes a float32 loss; a downcast is not."""
    g = _head_graph(dtype=torch.bfloat16, upcast=True)
    feed = _head_feed(gen, dtype=torch.bfloat16)
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert len(fused[3].nodes) == 1 and _fused_ops(fused[3])
    assert fused[0].dtype == plain[0].dtype == torch.float32
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused[1]["x"].float(), plain[1]["x"].float(), rtol=2e-2, atol=2e-3)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name].float(), plain[2][name].float(), rtol=2e-2, atol=2e-3, msg=name)
    down = Graph()
    x, y = down.input("x", (6, 4), requires_grad=True), down.input("y", (6,), torch.int64)
    down.output(ops.cross_entropy(ops.to(teeny.nn.Linear(4, 5)(x), torch.bfloat16), y))
    assert not _fused_ops(lower(down, LoweringMode.TRAINING))


# ------------------------------------------------------------------ a loss of upcast logits


def _upcast_loss_graph(dtype=torch.bfloat16, read_wide=False, **loss_options):
    """half-precision logits (2, 3, 37) -> .float() -> (6, 37) -> cross-entropy, as transformers'
    causal-LM loss reads them; ``read_wide``: the float32 copy is also an output."""
    g = Graph()
    x = g.input("x", (2, 3, 37), dtype, requires_grad=True)
    y = g.input("y", (6,), torch.int64)
    wide = ops.to(x, torch.float32)
    loss = ops.cross_entropy(ops.reshape(wide, (6, 37)), y, **loss_options)
    g.output(*([loss, wide] if read_wide else [loss]))
    return g


def _upcast_loss_feed(gen, dtype=torch.bfloat16):
    y = torch.randint(0, 37, (6,), generator=gen)
    y[2] = -100  # an ignored row
    return {"x": (3 * torch.randn(2, 3, 37, generator=gen)).to(dtype), "y": y}


def _casts_to_float32(program):
    return [p for p in program.nodes if isinstance(p.op, CastOp) and p.op.dtype == torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_of_upcast_logits_reads_them_as_they_are_bit_for_bit(dtype, smoothing, gen):
    """The loss reads the half-precision logits and writes a float32 loss: the same loss and
    the same half-precision gradient to the bit as the cast then the loss, and no cast left."""
    g, feed = _upcast_loss_graph(dtype, label_smoothing=smoothing), _upcast_loss_feed(gen, dtype)
    folded, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert not _casts_to_float32(folded[3]) and _casts_to_float32(plain[3])
    (loss,) = [op for op in _ops(folded[3]) if op.name == "cross_entropy"]
    assert loss.out_dtype == torch.float32
    assert "fold_loss_upcast: losses reading half-precision logits as they are: 1" in folded[3].summary()
    assert folded[0].dtype == torch.float32 and folded[1]["x"].dtype == dtype
    assert torch.equal(folded[0], plain[0]) and torch.equal(folded[1]["x"], plain[1]["x"])
    x = feed["x"].clone().requires_grad_()
    expected = F.cross_entropy(x.float().reshape(6, 37), feed["y"], label_smoothing=smoothing)
    expected.backward()
    torch.testing.assert_close(folded[0], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(folded[1]["x"].float(), x.grad.float(), rtol=1e-2, atol=1e-4)


def test_loss_of_upcast_logits_leaves_the_cast_another_reader_needs(gen):
    g, feed = _upcast_loss_graph(read_wide=True), _upcast_loss_feed(gen)
    folded, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert len(_casts_to_float32(folded[3])) == 1  # for the float32 output; the loss reads x
    assert [op.out_dtype for op in _ops(folded[3]) if op.name == "cross_entropy"] == [torch.float32]
    for a, b in zip(folded[0], plain[0]):
        assert torch.equal(a, b)
    assert torch.equal(folded[1]["x"], plain[1]["x"])


def test_loss_upcast_is_folded_only_where_it_is_exact():
    """float32 to float64 is not undone (the loss would compute in float32), nor a loss with
    class weights (float32, where the logits are bfloat16)."""
    g = Graph()
    x = g.input("x", (4, 5), torch.float32, requires_grad=True)
    y = g.input("y", (4,), torch.int64)
    g.output(ops.cross_entropy(ops.to(x, torch.float64), y))
    assert not fusions.fold_loss_upcast(g, g.outputs, True)[2]
    g = Graph()
    x = g.input("x", (4, 5), torch.bfloat16, requires_grad=True)
    y = g.input("y", (4,), torch.int64)
    g.output(ops.cross_entropy(ops.to(x, torch.float32), y, weight=torch.rand(5)))
    assert not fusions.fold_loss_upcast(g, g.outputs, True)[2]


def test_mixed_precision_head_and_loss_keep_no_float32_logits(gen):
    """A float32 head whose logits are upcast for the loss (a no-op cast in float32) and also
    returned in bfloat16, as the torch.compile backend asks for a model under autocast: in
    bf16-mixed the loss reads the bf16 logits and the returned logits are the product's own."""
    g = Graph()
    x = g.input("x", (2, 3, 8), requires_grad=True)
    y = g.input("y", (6,), torch.int64)
    logits = teeny.nn.Linear(8, 37)(x)
    wide = ops.to(logits, torch.float32)
    g.output(ops.cross_entropy(ops.reshape(wide, (6, 37)), y), ops.to(wide, torch.bfloat16))
    feed = {"x": torch.randn(2, 3, 8, generator=gen), "y": torch.randint(0, 37, (6,), generator=gen)}
    mixed = _run(g, feed, precision="bf16-mixed")
    program = mixed[3]
    assert not _casts_to_float32(program)
    assert not any(v.dtype == torch.float32 and v.numel == 6 * 37 for v in program.graph.values)
    assert mixed[0][0].dtype == torch.float32 and mixed[0][1].dtype == torch.bfloat16
    reference = _run(g, feed)
    torch.testing.assert_close(mixed[0][0], reference[0][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(mixed[0][1].float(), reference[0][1].float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------- attention in place


def _strided_copies(program):
    return sum(launch.kernel.name == "strided_copy" for p in program.nodes for launch in p.forward_launches)


def test_gpt_attention_reads_and_writes_its_heads_in_place(gpt_case):
    """Each layer's q, k, v head splits and the merge after the attention are gone (no
    strided_copy launch is left); the step is the same bit for bit."""
    g, feed = gpt_case
    in_place, plain = _run(g, feed, rewrites=(fusions.attention_in_place,)), _run(g, feed, rewrites=())
    layouts = [op.layout for op in _ops(in_place[3]) if op.name == "scaled_dot_product_attention"]
    assert layouts == ["blhd", "blhd"]
    assert _strided_copies(plain[3]) == 8 and _strided_copies(in_place[3]) == 0
    assert "attention on (batch, length, heads, dim) in place: 2, 8 transposes" in in_place[3].summary()
    assert torch.equal(in_place[0], plain[0])
    for name in plain[2]:
        assert torch.equal(in_place[2][name], plain[2][name]), name


def _heads_graph(b, lq, lk, h, hkv, d, dv, dtype=torch.float64, mask=None, read_output=False, **attn):
    """q, k, v (batch, length, heads, dim) inputs, transposed to (batch, heads, length, dim) for
    the attention and its output transposed back; ``read_output`` also reads the output itself."""
    g = Graph()
    q = g.input("q", (b, lq, h, d), dtype, requires_grad=True)
    k = g.input("k", (b, lk, hkv, d), dtype, requires_grad=True)
    v = g.input("v", (b, lk, hkv, dv), dtype, requires_grad=True)
    m = None if mask is None else g.input("mask", mask.shape, mask.dtype)
    t = lambda x: ops.transpose(x, 1, 2)  # noqa: E731
    y = ops.scaled_dot_product_attention(t(q), t(k), t(v), m, **attn)
    out = ops.sum(ops.mul(t(y), g.constant(torch.linspace(-1, 1, lq * h * dv, dtype=dtype).reshape(lq, h, dv))))
    if read_output:
        out = ops.add(out, ops.sum(ops.mul(y, y)))
    g.output(out)
    return g


CASES = {
    "causal": dict(b=2, lq=5, lk=7, h=3, hkv=3, d=4, dv=6, is_causal=True),
    "gqa": dict(b=1, lq=6, lk=6, h=4, hkv=2, d=8, dv=8, enable_gqa=True),  # dK/dV summed over the group
    "one-kv-head": dict(b=2, lq=3, lk=5, h=2, hkv=1, d=4, dv=3),
    "bool-mask": dict(b=2, lq=4, lk=5, h=3, hkv=3, d=5, dv=5, mask="bool"),
    "float-mask-output-read": dict(b=2, lq=4, lk=5, h=3, hkv=3, d=5, dv=5, mask="float", read_output=True),
}


def _heads_feed(case, gen):
    case = dict(case)
    mask_kind = case.pop("mask", None)
    b, lq, lk, h, hkv = case["b"], case["lq"], case["lk"], case["h"], case["hkv"]
    feed = {
        "q": torch.randn(b, lq, h, case["d"], generator=gen, dtype=torch.float64),
        "k": torch.randn(b, lk, hkv, case["d"], generator=gen, dtype=torch.float64),
        "v": torch.randn(b, lk, hkv, case["dv"], generator=gen, dtype=torch.float64),
    }
    if mask_kind == "bool":
        feed["mask"] = torch.rand(b, 1, lq, lk, generator=gen) > 0.3
        feed["mask"][..., 0] = True
    elif mask_kind == "float":
        feed["mask"] = torch.randn(h, lq, lk, generator=gen, dtype=torch.float64)
    return case, feed


@pytest.mark.parametrize("name", CASES)
def test_attention_in_place_matches_the_transposes(name, gen):
    """The same loss and q, k, v gradients as the graph with the transposes (float64, 1e-12);
    where the output is also read as (batch, heads, length, dim), one transpose back stays."""
    case, feed = _heads_feed(CASES[name], gen)
    g = _heads_graph(**case, mask=feed.get("mask"))
    in_place, plain = _run(g, feed, rewrites=(fusions.attention_in_place,)), _run(g, feed, rewrites=())
    assert [op.layout for op in _ops(in_place[3]) if op.name == "scaled_dot_product_attention"] == ["blhd"]
    left = 1 if case.get("read_output") else 0  # a one-head transpose is a view: it copies nothing
    assert _strided_copies(in_place[3]) == left < _strided_copies(plain[3])
    torch.testing.assert_close(in_place[0], plain[0], rtol=1e-12, atol=1e-12)
    for key in ("q", "k", "v"):
        torch.testing.assert_close(in_place[1][key], plain[1][key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_attention_on_length_heads_layout_gradcheck_float64(mask, gen):
    """The blhd op itself against central differences (one key/value head for two query heads;
    with a bool mask)."""
    from teeny.ops.attention.ops import AttentionOp

    _, feed = _heads_feed(dict(b=1, lq=3, lk=4, h=2, hkv=1, d=3, dv=2, mask=mask), gen)

    def attend(q, k, v, *m):
        op = AttentionOp(has_mask=bool(m), is_causal=False, scale=None, enable_gqa=False, layout="blhd")
        return q.graph.apply(op, [q, k, v, *m])

    args = [feed["q"], feed["k"], feed["v"]] + ([feed["mask"]] if mask else [])
    teeny.gradcheck(attend, *args, requires_grad=lambda i, t: i < 3)


def test_attention_in_place_needs_transposes_that_nothing_else_reads(gen):
    g = Graph()
    q = g.input("q", (1, 3, 2, 4), requires_grad=True)
    qt = ops.transpose(q, 1, 2)
    y = ops.scaled_dot_product_attention(qt, qt, qt)
    g.output(ops.add(ops.sum(y), ops.sum(qt)))  # the transposed q is read again: nothing to save
    program = lower(g, LoweringMode.TRAINING, rewrites=(fusions.attention_in_place,))
    assert [op.layout for op in _ops(program) if op.name == "scaled_dot_product_attention"] == ["bhld"]


def _packed_graph(b, length, heads, dim, dtype=torch.float64, reshape_out=False, read_block=False):
    """x (b, length, 3 * heads * dim) split into q, k, v column blocks, each (b, length, heads,
    dim) then transposed for a causal attention, as GPT-2 splits its c_attn output;
    ``reshape_out``: a reshape to the same shape between the attention and the merge of its heads
    (GPT-2's); ``read_block``: the k block also read by the loss."""
    g = Graph()
    width = heads * dim
    x = g.input("x", (b, length, 3 * width), dtype, requires_grad=True)
    blocks = [x[:, :, i * width : (i + 1) * width] for i in range(3)]
    q, k, v = (ops.transpose(ops.reshape(u, (b, length, heads, dim)), 1, 2) for u in blocks)
    y = ops.scaled_dot_product_attention(q, k, v, is_causal=True)
    if reshape_out:
        y = ops.reshape(y, (b, heads, length, dim))
    merged = ops.reshape(ops.transpose(y, 1, 2), (b, length, width))
    weights = g.constant(torch.linspace(-1, 1, length * width, dtype=dtype).reshape(length, width), name="weights")
    loss = ops.sum(merged * weights)
    g.output(ops.add(loss, ops.sum(blocks[1])) if read_block else loss)
    return g


def _packed(program):
    return [op.layout for op in _ops(program) if op.name == "scaled_dot_product_attention"]


@pytest.mark.parametrize("reshape_out", [False, True])
def test_attention_reads_packed_qkv_blocks_in_place(reshape_out, gen):
    """The blocks of one packed tensor: the attention reads it and writes its gradient whole, with
    no copy either way (also through a same-shape reshape before the heads' merge)."""
    g = _packed_graph(2, 5, 3, 4, reshape_out=reshape_out)
    feed = {"x": torch.randn(2, 5, 36, generator=gen, dtype=torch.float64)}
    packed, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _packed(packed[3]) == ["packed"] and _strided_copies(packed[3]) == 0 < _strided_copies(plain[3])
    assert not any(type(op).__name__ in ("GetItemOp", "PermuteOp") for op in _ops(packed[3]))
    assert "read_packed_qkv: attention reading packed q, k, v in place: 1, 3 block copies" in packed[3].summary()
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[1]["x"], plain[1]["x"], rtol=1e-12, atol=1e-12)


def test_attention_reads_packed_qkv_gradcheck_float64(gen):
    teeny.gradcheck_graph(_packed_graph(1, 3, 2, 2), {"x": torch.randn(1, 3, 12, generator=gen, dtype=torch.float64)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_packed_qkv_matches_pytorch(dtype, gen):
    b, length, heads, dim = 2, 19, 3, 16
    g = _packed_graph(b, length, heads, dim, dtype=dtype)
    x = torch.randn(b, length, 3 * heads * dim, generator=gen).to(dtype)
    out, grads, _, program = _run(g, {"x": x})
    assert _packed(program) == ["packed"]
    xr = x.to(teeny.DEVICE).requires_grad_()
    q, k, v = (u.reshape(b, length, heads, dim).transpose(1, 2) for u in xr.split(heads * dim, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, -1)
    weights = torch.linspace(-1, 1, length * heads * dim, device=teeny.DEVICE).reshape(length, -1)
    expected = (y.float() * weights).sum()
    expected.backward()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    torch.testing.assert_close(grads["x"].float(), xr.grad.float(), **tol)


def test_a_packed_block_read_elsewhere_stays_for_that_reader(gen):
    g = _packed_graph(1, 4, 2, 3, read_block=True)
    feed = {"x": torch.randn(1, 4, 18, generator=gen, dtype=torch.float64)}
    packed, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _packed(packed[3]) == ["packed"]
    assert [type(op).__name__ for op in _ops(packed[3])].count("GetItemOp") == 1  # the k block, for its sum
    torch.testing.assert_close(packed[1]["x"], plain[1]["x"], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ grouped keys and values


def _repeated_kv_graph(b, h, kvh, length, d, dtype=torch.float64, tile=False, read_repeat=False, causal=True):
    """k and v (b, kvh, length, d) repeated per group of h // kvh query heads before an
    attention, as transformers' repeat_kv writes it (``tile``: the groups side by side instead,
    head i reading key head i % kvh, which is not what grouping means)."""
    g = Graph()
    q = g.input("q", (b, h, length, d), dtype, requires_grad=True)
    k = g.input("k", (b, kvh, length, d), dtype, requires_grad=True)
    v = g.input("v", (b, kvh, length, d), dtype, requires_grad=True)
    group = h // kvh

    def repeat(t):
        if tile:
            return ops.reshape(ops.expand(ops.unsqueeze(t, 1), b, group, kvh, length, d), (b, h, length, d))
        return ops.reshape(ops.expand(ops.unsqueeze(t, 2), b, kvh, group, length, d), (b, h, length, d))

    kr = repeat(k)
    y = ops.scaled_dot_product_attention(q, kr, repeat(v), is_causal=causal)
    weights = g.constant(torch.linspace(-1, 1, length * d, dtype=dtype).reshape(length, d), name="weights")
    loss = ops.sum(y * weights)
    g.output(ops.add(loss, ops.sum(kr)) if read_repeat else loss)
    return g


def _repeated_kv_feed(gen, b, h, kvh, length, d, dtype=torch.float64):
    return {
        "q": torch.randn(b, h, length, d, generator=gen, dtype=dtype),
        "k": torch.randn(b, kvh, length, d, generator=gen, dtype=dtype),
        "v": torch.randn(b, kvh, length, d, generator=gen, dtype=dtype),
    }


def _grouped(program):
    return [op.enable_gqa for op in _ops(program) if op.name == "scaled_dot_product_attention"]


@pytest.mark.parametrize("shape", [(2, 6, 2, 5, 3), (1, 4, 1, 7, 8)])
def test_repeated_keys_and_values_are_read_grouped(shape, gen):
    """The same loss and q, k, v gradients as the repeats (float64, 1e-12), with no copy made."""
    g, feed = _repeated_kv_graph(*shape), _repeated_kv_feed(gen, *shape)
    grouped, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _grouped(grouped[3]) == [True] and _grouped(plain[3]) == [False]
    assert _strided_copies(grouped[3]) == 0 < _strided_copies(plain[3])
    assert "read_grouped_kv: attention reading grouped keys and values in place: 1" in grouped[3].summary()
    torch.testing.assert_close(grouped[0], plain[0], rtol=1e-12, atol=1e-12)
    for key in ("q", "k", "v"):
        torch.testing.assert_close(grouped[1][key], plain[1][key], rtol=1e-12, atol=1e-12, msg=key)


def test_repeated_keys_and_values_gradcheck_float64(gen):
    shape = (1, 4, 2, 3, 2)
    feed = _repeated_kv_feed(gen, *shape)
    teeny.gradcheck_graph(_repeated_kv_graph(*shape), feed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_keys_and_values_grouped_match_pytorch(dtype, gen):
    b, h, kvh, length, d = 2, 6, 3, 17, 16
    g = _repeated_kv_graph(b, h, kvh, length, d, dtype=dtype)
    feed = _repeated_kv_feed(gen, b, h, kvh, length, d, dtype=dtype)
    out, grads, _, program = _run(g, feed)
    assert _grouped(program) == [True]
    q, k, v = (feed[n].clone().requires_grad_() for n in ("q", "k", "v"))
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    expected = (y.float() * torch.linspace(-1, 1, length * d).reshape(length, d)).sum()
    expected.backward()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    for name, t in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(grads[name].float(), t.grad.float(), **tol, msg=name)


def test_keys_repeated_other_than_per_group_are_left_as_they_are(gen):
    """Tiled heads (head i reads key head i % kvh) are not a grouping: the repeats stay, and
    a repeat something else reads stays for that reader while the attention reads grouped."""
    shape = (1, 4, 2, 3, 2)
    tiled = _repeated_kv_graph(*shape, tile=True)
    assert not fusions.read_grouped_kv(tiled, tiled.outputs, True)[2]
    g, feed = _repeated_kv_graph(*shape, read_repeat=True), _repeated_kv_feed(gen, *shape)
    grouped, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert _grouped(grouped[3]) == [True] and _strided_copies(grouped[3]) == 1  # the repeated k, for its sum
    torch.testing.assert_close(grouped[1]["k"], plain[1]["k"], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------- q, k, v as one product


def _qkv_graph(b, length, heads, dim, dtype=torch.float64, bias=True, mask=None, **attn):
    """x (batch, length, width) -> q, k, v linears -> (batch, length, heads, dim) -> attention
    with the head transposes, as a multi-head layer writes it."""
    g = Graph()
    width = heads * dim
    x = g.input("x", (b, length, width), dtype, requires_grad=True)
    m = None if mask is None else g.input("mask", mask.shape, mask.dtype)
    t = lambda u: ops.transpose(u, 1, 2)  # noqa: E731
    layer = teeny.Module()
    layer.q, layer.k, layer.v = (teeny.nn.Linear(width, width, bias=bias, dtype=dtype) for _ in range(3))
    q, k, v = layer.q(x), layer.k(x), layer.v(x)
    split = [t(ops.reshape(u, (b, length, heads, dim))) for u in (q, k, v)]
    y = t(ops.scaled_dot_product_attention(*split, m, **attn))
    weights = torch.linspace(-1, 1, length * width, dtype=dtype).reshape(length, heads, dim)
    g.output(ops.sum(ops.mul(y, g.constant(weights))))
    return g


QKV_REWRITES = (fusions.attention_in_place, fusions.fuse_qkv_products)


def _assert_qkv_side_by_side(ex, kinds):
    """The q, k and v parameters of each kind lie one after the other in the executor's arena."""
    for kind in kinds:
        q, k, v = (ex.params[f"{n}.{kind}"] for n in "qkv")
        assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes


def _assert_second_backward_adds(ex, feed, tol):
    """Two backwards without zero_grad: every parameter gradient is twice the first one's."""
    ex.backward(ex.forward_train(feed)[1])
    once = {k: v.clone() for k, v in ex.grads.items()}
    ex.backward(ex.forward_train(feed)[1])
    for name in once:
        torch.testing.assert_close(ex.grads[name], 2 * once[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("case", ["causal", "no-bias", "bool-mask", "odd-width"])
def test_qkv_products_fused_match_the_three_products(case, gen):
    """One product for q, k and v and a packed attention: the same loss and every gradient (x,
    the three weights and biases) as the unfused graph, float64 to 1e-12. The weights (and
    biases) lie side by side in the executor's arena and are read in place, without a copy;
    at an odd width (9 float64 biases: 72 bytes, not a multiple of 16) they are copied."""
    shape = dict(b=2, length=5, heads=3, dim=3 if case == "odd-width" else 4)
    width = shape["heads"] * shape["dim"]
    mask = torch.rand(2, 1, 5, 5, generator=gen) > 0.3 if case == "bool-mask" else None
    if mask is not None:
        mask[..., 0] = True
    g = _qkv_graph(**shape, bias=case != "no-bias", mask=mask, is_causal=case == "causal")
    feed = {"x": torch.randn(2, 5, width, generator=gen, dtype=torch.float64)}
    if mask is not None:
        feed["mask"] = mask
    fused, plain = _run(g, feed, rewrites=QKV_REWRITES), _run(g, feed, rewrites=())
    names = [op.name for op in _ops(fused[3])]
    assert names.count("linear") == 1 and sum(isinstance(op, SharedInputLinearOp) for op in _ops(fused[3])) == 1
    assert [op.layout for op in _ops(fused[3]) if op.name == "scaled_dot_product_attention"] == ["packed"]
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused[1]["x"], plain[1]["x"], rtol=1e-12, atol=1e-12)
    assert set(fused[2]) == set(plain[2])
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-12, atol=1e-12, msg=name)
    summary = fused[3].summary()
    in_place = case != "odd-width"
    assert f"q, k, v projections as one product: 1 ({int(in_place)} reading their weights side by side" in summary
    assert ("0" if in_place else "6") + " small copies" in summary
    (product,) = [p for p in fused[3].nodes if isinstance(p.op, SharedInputLinearOp)]
    copies = [launch for launch in product.forward_launches + product.backward_launches if "copy" in launch.kernel.name]
    assert bool(copies) != in_place and product.op.adjacent == in_place
    if in_place:  # side by side in the arena, in q, k, v order
        _assert_qkv_side_by_side(Executor(fused[3], seed=0), ("weight",) if case == "no-bias" else ("weight", "bias"))


def test_qkv_weights_read_in_place_accumulate_gradients(gen):
    """Two backwards without zero_grad: the second one's q/k/v gradients go into one block of
    their own (side by side, as the fused product writes them) and are added into the arena."""
    g = _qkv_graph(b=2, length=5, heads=3, dim=4, is_causal=True)
    feed = {"x": torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)}
    ex = Executor(lower(g, LoweringMode.TRAINING, rewrites=QKV_REWRITES), seed=0)
    assert any(getattr(p.op, "adjacent", False) for p in ex.program.nodes)
    _assert_second_backward_adds(ex, feed, tol=1e-13)


def test_qkv_weights_cast_by_mixed_precision_as_one(gen):
    """bf16-mixed with the float32 q/k/v weights side by side in the arena: one stacked cast of
    the weights and one of the biases (``StackedCastOp``), read by one plain product; no cast
    or copy per part either way. The loss and every gradient agree with the unfused bf16-mixed
    graph (bf16 rounding), and a second backward without zero_grad adds the same gradients."""
    from teeny.ops.cast import CastOp, StackedCastOp
    from teeny.ops.products.ops import LinearOp

    g = _qkv_graph(b=2, length=5, heads=3, dim=4, dtype=torch.float32, is_causal=True)
    feed = {"x": torch.randn(2, 5, 12, generator=gen)}
    fused, plain = (
        _run(g, feed, rewrites=r, precision="bf16-mixed") for r in (QKV_REWRITES, (fusions.attention_in_place,))
    )
    nodes = fused[3].nodes
    stacked = [p for p in nodes if isinstance(p.op, StackedCastOp)]
    assert [p.node.output.shape for p in stacked] == [(36, 12), (36,)]
    assert "6 of the parameters side by side in 2 stacked casts" in fused[3].summary()
    assert not any(isinstance(p.op, SharedInputLinearOp) for p in nodes)
    assert not any(isinstance(p.op, CastOp) and p.node.inputs[0].kind == "param" for p in nodes)
    (product,) = [p for p in nodes if isinstance(p.op, LinearOp) and p.node.inputs[1] is stacked[0].node.output]
    assert len(product.forward_launches) == 1 and len(stacked[0].forward_launches) == 1
    assert all(len(p.backward_launches) == 1 for p in stacked)
    torch.testing.assert_close(fused[0], plain[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused[1]["x"], plain[1]["x"], rtol=2e-2, atol=2e-2)
    assert set(fused[2]) == set(plain[2])
    for name in plain[2]:
        assert fused[2][name].dtype == torch.float32
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=2e-2, atol=2e-2, msg=name)
    ex = Executor(fused[3], seed=0)
    _assert_qkv_side_by_side(ex, ("weight", "bias"))
    _assert_second_backward_adds(ex, feed, tol=1e-6)


def test_qkv_weights_frozen_apart_are_copied(gen):
    """q's weight frozen, k's and v's trained: they cannot share one run of the arena (an
    optimizer updates the trained prefix), so the fused product copies them; gradients as the
    unfused graph's, and none for the frozen weight."""
    g = _qkv_graph(b=2, length=5, heads=3, dim=4, is_causal=True)
    next(v for v in g.params if v.name == "q.weight").requires_grad = False
    feed = {"x": torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)}
    fused, plain = _run(g, feed, rewrites=QKV_REWRITES), _run(g, feed, rewrites=())
    (product,) = [p.op for p in fused[3].nodes if isinstance(p.op, SharedInputLinearOp)]
    assert not product.adjacent and not fused[2]["q.weight"].any()
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-12, atol=1e-12, msg=name)


def test_qkv_products_fused_gradcheck_float64(gen):
    g = _qkv_graph(b=1, length=3, heads=2, dim=2, is_causal=True)
    assert any(isinstance(op, SharedInputLinearOp) for op in _ops(lower(g, LoweringMode.TRAINING)))
    teeny.gradcheck_graph(g, {"x": torch.randn(1, 3, 4, dtype=torch.float64, generator=gen)})


def test_gpt_fuses_every_layers_qkv_products(gpt_case):
    """teeny.training.models.GPT under the default rewrites: one q/k/v product per layer, the same loss
    and gradients as without any rewrite (within float32 rounding)."""
    g, feed = gpt_case
    fused, plain = _run(g, feed), _run(g, feed, rewrites=())
    assert sum(isinstance(op, SharedInputLinearOp) for op in _ops(fused[3])) == 2
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_qkv_products_need_one_input_and_no_other_reader(gen):
    g = Graph()
    x = g.input("x", (1, 3, 4), torch.float64, requires_grad=True)
    z = g.input("z", (1, 3, 4), torch.float64, requires_grad=True)
    t = lambda u: ops.transpose(u, 1, 2)  # noqa: E731
    layer = teeny.Module()
    layer.q, layer.k, layer.v = (teeny.nn.Linear(4, 4, dtype=torch.float64) for _ in range(3))
    q, k, v = layer.q(x), layer.k(z), layer.v(x)  # k of another input: no shared product
    heads = [t(ops.reshape(u, (1, 3, 2, 2))) for u in (q, k, v)]
    g.output(ops.sum(ops.scaled_dot_product_attention(*heads)))
    assert not any(isinstance(op, SharedInputLinearOp) for op in _ops(lower(g, rewrites=QKV_REWRITES)))
    g2 = _qkv_graph(b=1, length=3, heads=2, dim=2)
    q_node = next(n for n in g2.nodes if n.op.name == "linear")
    g2.output(Tensor(g2, q_node.output))  # q is an output too: it must exist
    assert not any(isinstance(op, SharedInputLinearOp) for op in _ops(lower(g2, rewrites=QKV_REWRITES)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_products_fused_match_pytorch(dtype, gen):
    """The fused graph against torch (three F.linear, head split, causal SDPA) on odd shapes:
    loss, dx and every weight and bias gradient, within the registry's tolerance rule."""
    from teeny.checks.registry import tolerance

    b, length, heads, dim = 3, 7, 3, 5
    g = _qkv_graph(b, length, heads, dim, dtype=dtype, is_causal=True)
    x = torch.randn(b, length, heads * dim, generator=gen).to(dtype)
    loss, grads, pgrads, program = _run(g, {"x": x})
    assert any(isinstance(op, SharedInputLinearOp) for op in _ops(program))
    params = {k: v.detach().double().requires_grad_() for k, v in Executor(program, seed=0).params.items()}
    xr = x.double().to(teeny.DEVICE).requires_grad_()
    split = [
        F.linear(xr, params[f"{n}.weight"], params[f"{n}.bias"]).reshape(b, length, heads, dim).transpose(1, 2)
        for n in "qkv"
    ]
    y = F.scaled_dot_product_attention(*split, is_causal=True).transpose(1, 2)
    weights = torch.linspace(-1, 1, length * heads * dim, dtype=torch.float64).reshape(length, heads, dim)
    ref = (y * weights.to(y.device)).sum()
    ref.backward()
    atol, rtol = tolerance(dtype, heads * dim * length)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(grads["x"].double(), xr.grad, atol=atol, rtol=rtol)
    for name, t in params.items():
        torch.testing.assert_close(pgrads[name].double(), t.grad, atol=atol, rtol=rtol, msg=name)


# ------------------------------------------------------------------------- linear, activation, linear

MLP_LAYERS = {  # (out features, bias, activation after the layer) per layer; the last has none
    "gelu": [(9, True, ("gelu", {})), (6, True, None)],
    "three-layers": [(9, True, ("gelu", {"approximate": "tanh"})), (6, False, ("silu", {})), (5, True, None)],
    "relu-no-bias": [(8, False, ("relu", {})), (3, False, None)],
    "leaky-relu": [(8, True, ("leaky_relu", {"negative_slope": 0.3})), (4, True, None)],
}


def _mlp_graph(layers, shape=(2, 5, 7), dtype=torch.float64, frozen=()):
    """x -> linear -> activation -> linear ... -> a weighted sum, as a model writes an MLP."""
    g = Graph()
    x = g.input("x", shape, dtype, requires_grad=True)
    model = teeny.Module()
    h, width = x, shape[-1]
    for i, (out, bias, act) in enumerate(layers):
        layer = teeny.nn.Linear(width, out, bias=bias, dtype=dtype)
        setattr(model, f"fc{i}", layer)
        if i in frozen:
            layer.weight.trainable = False
        h, width = layer(h), out
        if act is not None:
            h = getattr(ops, act[0])(h, **act[1])
    weights = torch.linspace(-1, 1, math.prod(h.shape), dtype=dtype).reshape(h.shape)
    g.output(ops.sum(ops.mul(h, g.constant(weights))))
    return g


MLP_REWRITES = (fusions.fuse_mlp,)


def _mlp_ops(program):
    return [op for op in _ops(program) if isinstance(op, MLPOp)]


@pytest.mark.parametrize("case", list(MLP_LAYERS))
def test_mlp_fused_matches_the_unfused_layers(case, gen):
    """One node for the whole chain: the same loss and every gradient (x, weights, biases) as
    the unfused graph in float64 (to rounding: the activations are the same maths), with one
    launch per product and no activation launch either way."""
    g = _mlp_graph(MLP_LAYERS[case])
    feed = {"x": torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)}
    fused, plain = _run(g, feed, rewrites=MLP_REWRITES), _run(g, feed, rewrites=())
    (op,) = _mlp_ops(fused[3])
    assert len(op.activations) == len(MLP_LAYERS[case]) - 1 and len(_mlp_ops(fused[3])) == 1
    kernels = {launch.kernel.name for p in fused[3].nodes for launch in p.forward_launches}
    assert "activation_forward" not in kernels
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused[1]["x"], plain[1]["x"], rtol=1e-12, atol=1e-12)
    assert set(fused[2]) == set(plain[2])
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-12, atol=1e-12, msg=name)
    assert f"{len(op.activations)} in 1 chain," in fused[3].summary()


def test_mlp_fused_gradcheck_float64(gen):
    """The chain of "three-layers" (tanh GELU, SiLU, a middle layer without bias), narrower: the
    gradcheck perturbs every element of x and of each parameter twice."""
    layers = [(4, True, ("gelu", {"approximate": "tanh"})), (3, False, ("silu", {})), (2, True, None)]
    assert [(bias, act) for _, bias, act in layers] == [(bias, act) for _, bias, act in MLP_LAYERS["three-layers"]]
    g = _mlp_graph(layers, shape=(2, 3))
    (op,) = _mlp_ops(lower(g, LoweringMode.TRAINING, rewrites=MLP_REWRITES))
    assert len(op.activations) == 2
    teeny.gradcheck_graph(g, {"x": torch.randn(2, 3, dtype=torch.float64, generator=gen)}, rewrites=MLP_REWRITES)


def test_mlp_fused_with_a_frozen_weight_and_for_inference(gen):
    """A frozen first weight: no gradient for it, the others as unfused; lowered for inference
    the node keeps no pre-activations and gives the training forward's numbers."""
    layers = MLP_LAYERS["three-layers"]
    g = _mlp_graph(layers, frozen=(0,))
    feed = {"x": torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)}
    fused, plain = _run(g, feed, rewrites=MLP_REWRITES), _run(g, feed, rewrites=())
    assert not fused[2]["fc0.weight"].any() and set(fused[2]) == set(plain[2])  # the arena's slot stays zero
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-12, atol=1e-12, msg=name)
    program = lower(g, LoweringMode.INFERENCE, rewrites=MLP_REWRITES)
    (op,) = _mlp_ops(program)
    assert not op.keep_pre_activations
    assert set(op.extra_outputs([(2, 5, 7), (9, 7), (9,), (6, 9), (5, 6), (5,)], torch.float64)) == {"act0", "act1"}
    out = Executor(program, seed=0)(feed)
    torch.testing.assert_close(out, fused[0], rtol=1e-12, atol=1e-12)


def test_mlp_needs_activations_and_linears_nothing_else_reads(gen):
    """Not fused: an activation read twice, a hidden value that is an output, an activation
    whose reader is not a linear, and a linear whose weight (not input) is the activation."""
    dtype = torch.float64
    g = Graph()
    x = g.input("x", (3, 4), dtype, requires_grad=True)
    m = teeny.Module()
    m.a, m.b = teeny.nn.Linear(4, 4, dtype=dtype), teeny.nn.Linear(4, 4, dtype=dtype)
    h = ops.relu(m.a(x))
    g.output(ops.sum(ops.add(m.b(h), h)))  # h read by the linear and by the add
    assert not _mlp_ops(lower(g, rewrites=MLP_REWRITES))
    g2 = _mlp_graph(MLP_LAYERS["gelu"], shape=(3, 7))
    hidden = next(n for n in g2.nodes if n.op.name == "gelu")
    g2.output(Tensor(g2, hidden.output))
    assert not _mlp_ops(lower(g2, rewrites=MLP_REWRITES))
    g3 = Graph()
    x = g3.input("x", (3, 4), dtype, requires_grad=True)
    w = g3.input("w", (4, 4), dtype, requires_grad=True)
    g3.output(ops.sum(ops.linear(x, ops.tanh(ops.linear(x, w)))))  # the activation is a weight
    assert not _mlp_ops(lower(g3, rewrites=MLP_REWRITES))
    g4 = Graph()
    x = g4.input("x", (3, 4), dtype, requires_grad=True)
    g4.output(ops.sum(ops.exp(ops.tanh(m.a(x)))))  # no second linear
    assert not _mlp_ops(lower(g4, rewrites=MLP_REWRITES))


def test_gpt_fuses_every_layers_mlp_when_asked(gpt_case):
    """teeny.training.models.GPT with fuse_mlp added to the default rewrites (it is not one: on the H200
    the epilogue's GELU costs more than its own pass): each block's fc, gelu, proj is one node."""
    g, feed = gpt_case
    assert not _mlp_ops(lower(g, LoweringMode.TRAINING))
    fused, plain = _run(g, feed, rewrites=(*fusions.DEFAULT_REWRITES, fusions.fuse_mlp)), _run(g, feed, rewrites=())
    assert len(_mlp_ops(fused[3])) == 2
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mlp_fused_matches_pytorch(dtype, gen):
    """The fused chain against torch (F.linear, F.gelu tanh, F.silu, F.linear) on odd shapes:
    loss, dx and every weight and bias gradient, within the registry's tolerance rule."""
    from teeny.checks.registry import tolerance

    layers = MLP_LAYERS["three-layers"]
    g = _mlp_graph(layers, shape=(3, 7, 13), dtype=dtype)
    x = torch.randn(3, 7, 13, generator=gen).to(dtype)
    loss, grads, pgrads, program = _run(g, {"x": x}, rewrites=MLP_REWRITES)
    assert _mlp_ops(program)
    params = {k: v.detach().double().requires_grad_() for k, v in Executor(program, seed=0).params.items()}
    xr = x.double().to(teeny.DEVICE).requires_grad_()
    h = F.gelu(F.linear(xr, params["fc0.weight"], params["fc0.bias"]), approximate="tanh")
    h = F.silu(F.linear(h, params["fc1.weight"]))
    h = F.linear(h, params["fc2.weight"], params["fc2.bias"])
    weights = torch.linspace(-1, 1, h.numel(), dtype=torch.float64).reshape(h.shape).to(h.device)
    ref = (h * weights).sum()
    ref.backward()
    atol, rtol = tolerance(dtype, 13 * 9)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(grads["x"].double(), xr.grad, atol=atol, rtol=rtol)
    for name, t in params.items():
        torch.testing.assert_close(pgrads[name].double(), t.grad, atol=atol, rtol=rtol, msg=name)
