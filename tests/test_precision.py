"""Mixed precision (``lower(..., precision="bf16-mixed")``, ``TrainConfig(precision=...)``): what
the rewrite makes of a graph (bfloat16 compute, float32 parameters, optimizer state and loss),
gradients against the float32 program, the float32 master weights the optimizer updates, a
bf16-mixed char-GPT run whose loss curve follows the float32 run's, and the GPT-2-small preset
(built and lowered only: training it is for the GPU)."""

import json

import pytest
import torch

import teeny
from helpers import train_step
from teeny import Graph, LoweringMode, lower, ops
from teeny.core.module import Module, ModuleList
from teeny.fusions.master_weights import MasterWeightLinearOp
from teeny.fusions.residual_norm import AddNormOp
from teeny.fusions.transposed_weights import TransposedWeightLinearOp
from teeny.ops.cast import CastOp
from teeny.ops.products.ops import LinearOp
from teeny.program.executor import Executor
from teeny.training.loop import TrainConfig, train
from teeny.training.models import MLP, CharTask, make_task
from teeny.training.optim import SGD

BF16 = torch.bfloat16


def _mlp_graph(x_grad=False):
    g = Graph("mlp")
    x = g.input("x", (8, 6), requires_grad=x_grad)
    y = g.input("y", (8,), torch.int64)
    g.output(ops.cross_entropy(MLP(6, 16, 3)(x), y))
    return g


def _feed(gen):
    return {"x": torch.randn(8, 6, generator=gen), "y": torch.randint(3, (8,), generator=gen)}


def test_bf16_mixed_computes_in_bfloat16_on_float32_parameters():
    program = lower(_mlp_graph(x_grad=True), LoweringMode.TRAINING, precision="bf16-mixed")
    by_op = {p.op.name: p.node for p in program.nodes}
    assert by_op["linear"].dtype == BF16 and by_op["gelu"].dtype == BF16
    # the loss reads the bf16 logits and computes (and writes) in float32 (fusions.fold_loss_upcast)
    assert by_op["cross_entropy"].dtype == BF16 and by_op["cross_entropy"].output.dtype == torch.float32
    assert program.loss.dtype == torch.float32
    casts = [p.node for p in program.nodes if isinstance(p.op, CastOp)]
    assert [n.inputs[0].name for n in casts if n.inputs[0].kind != "node"] == ["x"]
    # the parameters' casts are the linears' own (fusions.master_weights): float32 read, dW written float32
    linears = [p.node for p in program.nodes if isinstance(p.op, MasterWeightLinearOp)]
    assert [[v.name for v in n.inputs[1:]] for n in linears] == [["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]]
    ex = Executor(program)
    assert set(ex.param_arenas) == set(ex.grad_arenas) == {torch.float32}
    assert all(t.dtype == torch.float32 for t in ex.params.values())
    assert "bfloat16 compute, float32 master weights, 1 input cast, 4 parameters cast" in program.summary()


def test_bf16_mixed_gradients_follow_float32(gen):
    g, feed = _mlp_graph(x_grad=True), _feed(gen)
    mixed = train_step(lower(g, LoweringMode.TRAINING, precision="bf16-mixed"), feed)
    ref = train_step(lower(g, LoweringMode.TRAINING), feed)
    assert mixed.out.dtype == torch.float32 and mixed.grads["x"].dtype == torch.float32
    torch.testing.assert_close(mixed.out, ref.out, rtol=2e-2, atol=2e-2)
    for name, grad in [("x", mixed.grads["x"]), *mixed.param_grads.items()]:
        expected = ref.grads["x"] if name == "x" else ref.param_grads[name]
        assert grad.dtype == torch.float32
        assert (grad - expected).norm() <= 2e-2 * expected.norm() + 1e-4, name


def test_optimizer_updates_float32_master_weights(gen):
    """Steps of 1e-5: a bfloat16 copy of the weights (8 bits of mantissa) would lose them; the
    float32 arena keeps them."""
    ex = Executor(lower(_mlp_graph(), LoweringMode.TRAINING, precision="bf16-mixed"))
    opt = SGD(ex, lr=1e-5)
    before = ex.params["fc1.weight"].clone()
    feed = _feed(gen)
    for _ in range(3):
        ex.zero_grad()
        _, cache = ex.forward_train(feed)
        ex.backward(cache)
        opt.step()
    after = ex.params["fc1.weight"]
    moved = after != before
    assert moved.float().mean() > 0.8  # (a few hidden units get no gradient from this batch)
    lost_in_bf16 = (after.bfloat16() == before.bfloat16()) & moved
    assert lost_in_bf16.float().mean() > 0.5  # most of what moved would not have moved in bfloat16


def test_a_models_own_upcast_of_its_logits_is_folded_into_the_loss(gen):
    """HF models write ``logits.float()`` before the loss, and view them: under mixed precision
    the view and the loss read the bf16 logits, with no cast of them at all (no cast back to
    bfloat16 for the view, none up for the loss: ``fold_loss_upcast`` follows mixed precision)."""
    g = Graph("head")
    x, y = g.input("x", (2, 4, 6)), g.input("y", (8,), torch.int64)
    head = teeny.nn.Linear(6, 5)
    logits = ops.to(head(x), torch.float32)  # the model's .float(), a no-op in the float32 graph
    g.output(ops.cross_entropy(ops.reshape(logits, (8, 5)), y))
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed", rewrites=())
    casts = [p.node for p in program.nodes if isinstance(p.op, CastOp)]
    assert [n.inputs[0].name for n in casts if n.inputs[0].kind != "node"] == ["x"]  # (W, b: the linear's own)
    assert not [n for n in casts if n.inputs[0].kind == "node"]  # the logits: none
    (loss,) = [p.node for p in program.nodes if p.op.name == "cross_entropy"]
    assert loss.inputs[0].dtype == BF16 and loss.output.dtype == torch.float32
    feed = {"x": torch.randn(2, 4, 6, generator=gen), "y": torch.randint(5, (8,), generator=gen)}
    mixed = train_step(program, feed)
    full = train_step(lower(g, LoweringMode.TRAINING, rewrites=()), feed)
    torch.testing.assert_close(mixed.out, full.out, rtol=2e-2, atol=2e-2)


def test_losses_and_in_place_updates_run_on_float32(gen):
    class Net(Module):
        def __init__(self):
            super().__init__()
            self.fc = teeny.nn.Linear(4, 3)
            self.bn = teeny.nn.BatchNorm1d(3)  # updates its float32 running statistics in place

        def forward(self, x):
            return self.bn(self.fc(x))

    g = Graph()
    x, t = g.input("x", (6, 4)), g.input("t", (6, 3))
    g.output(ops.mse_loss(Net()(x), t))
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    by_op = {p.op.name: p.node for p in program.nodes}
    assert by_op["linear"].dtype == BF16
    assert by_op["batch_norm"].dtype == torch.float32 and by_op["mse_loss"].dtype == torch.float32
    ex = Executor(program)
    _, cache = ex.forward_train({"x": torch.randn(6, 4, generator=gen), "t": torch.randn(6, 3, generator=gen)})
    ex.backward(cache)
    assert not torch.equal(ex.params["bn.running_mean"], torch.zeros(3))  # updated where it lives


def test_tables_computed_from_positions_keep_float32(gen):
    """Rotary angles: positions (integers past bfloat16's 256, cast to float, or a folded float
    constant) times frequencies, then cos: computed in float32 as eager autocast computes them;
    in bfloat16 position 1023 would be 1024 and the cos of it another number."""
    g = Graph()
    x = g.input("x", (2, 40, 8), requires_grad=True)
    freq = g.input("freq", (8,))
    ids = g.input("ids", (40,), torch.int64)
    folded = g.constant(torch.arange(984.0, 1024.0))
    angles = [ops.mul(ops.unsqueeze(ops.to(ids, torch.float32), -1), freq), ops.mul(ops.unsqueeze(folded, -1), freq)]
    g.output(ops.sum(ops.mul(x, ops.add(ops.cos(angles[0]), ops.sin(angles[1])))))
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    by_op = {p.node.name: p.node for p in program.nodes}
    assert all(n.dtype == torch.float32 for name, n in by_op.items() if name.startswith(("cos", "sin", "to_")))
    assert "ops kept in float32 (losses, in-place updates, tables from positions" in program.summary()
    feed = {"x": torch.randn(2, 40, 8, generator=gen), "freq": torch.rand(8, generator=gen) + 0.5}
    feed["ids"] = torch.arange(984, 1024)
    mixed = train_step(program, feed)
    table = torch.cos(feed["ids"][:, None] * feed["freq"]) + torch.sin(
        torch.arange(984.0, 1024.0)[:, None] * feed["freq"]
    )
    torch.testing.assert_close(mixed.grads["x"], table.expand(2, 40, 8), rtol=1e-2, atol=1e-2)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        lower(_mlp_graph(), precision="fp8")
    with pytest.raises(ValueError, match="unknown precision"):
        TrainConfig(precision="bf16").validate()


def _losses(out_dir) -> list[float]:
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r]


def test_char_gpt_mixed_precision_loss_curves_follow_float32(tmp_path):
    """bf16-mixed, and fp16-mixed with its loss scaler (which train() attaches)."""
    from teeny.training.data import CharCorpus

    corpus = CharCorpus(max_chars=50_000)
    curves = {}
    for precision in (None, "bf16-mixed", "fp16-mixed"):
        task = CharTask(corpus, 8, 16, 2, 1, defaults={"epoch_tokens": 4 * 8 * 8}, eval_batches=1)  # 4 steps
        out = tmp_path / str(precision)
        config = TrainConfig(epochs=1, batch_size=8, lr=3e-2, out=str(out), progress=False, precision=precision)
        result = train(task, config, log=lambda *_: None)
        assert set(result["executor"].param_arenas) == {torch.float32}
        scaler = result["optimizer"].scaler
        assert (scaler is not None) == (precision == "fp16-mixed")
        curves[precision] = _losses(out)
    f32 = curves[None]
    assert f32[-1] < f32[0] - 0.5  # it learns
    for precision in ("bf16-mixed", "fp16-mixed"):
        mixed = curves[precision]
        assert len(f32) == len(mixed) == 4
        assert max(abs(a - b) for a, b in zip(f32, mixed)) < 0.05, (precision, f32, mixed)


def test_gpt2_preset_builds_and_lowers():
    """GPT-2 small's shape: 12 blocks of d 768 and 12 heads, context 1024, the corpus's 96
    characters; lowered for bf16-mixed training (the dry run only: no data, no launch)."""
    task = make_task("gpt", "gpt2")
    graph = task.train_graph(task.defaults["batch_size"])
    assert task.defaults["precision"] == "bf16-mixed"
    program = lower(graph, LoweringMode.TRAINING, precision="bf16-mixed")
    n_params = sum(v.numel for v in program.params)
    assert n_params == 96 * 768 + 1024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768 + 96 * 769
    assert sum(isinstance(p.op, AddNormOp) for p in program.nodes) == 2 * 12 + 1
    attention = [
        (p.node.dtype, p.node.output.shape) for p in program.nodes if p.op.name == "scaled_dot_product_attention"
    ]
    assert attention == [(BF16, (8, 1024, 12, 64))] * 12  # (batch, length, heads, dim): the heads read in place
    assert all(v.dtype == torch.float32 for v in program.params)


def test_cli_trains_gpt2_in_bf16_mixed_by_default():
    from teeny.cli import build_parser

    args = build_parser().parse_args(["train", "gpt", "--size", "gpt2", "--precision", "bf16-mixed"])
    assert (args.size, args.precision) == ("gpt2", "bf16-mixed")
    settings = {k: v for k, v in make_task("gpt", "gpt2").defaults.items() if k != "epoch_tokens"}
    config = TrainConfig(**settings)
    config.validate()
    assert config.precision == "bf16-mixed" and config.batch_size == 8


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "cast_again"])
def test_linears_cast_their_master_weights_and_write_float32_gradients(recompute, gen):
    """bf16-mixed: each linear reads its float32 weight and bias (``MasterWeightLinearOp``): the
    bfloat16 copy of W is made by the linear's forward (kept for dX, or with ``recompute`` cast
    again in the backward), the bias read in float32, dW and db written in float32 by the
    products, rounded once: no cast node and no cast launch in the backward. The gradients are
    the float32 program's to bfloat16 accuracy, and the same bit for bit kept or cast again."""
    g, feed = _mlp_graph(x_grad=True), _feed(gen)
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed", recompute=recompute)
    assert "read_master_weights: linears casting their float32 weights themselves: 2 (2 biases" in program.summary()
    names = [launch.kernel.name for p in program.nodes for launch in p.backward_launches]
    assert names.count("cast_forward") == (2 if recompute else 0) and "cast_backward" in names  # (x's gradient)
    assert names.count("cast_backward") == 1
    mixed = train_step(program, feed)
    ref = train_step(lower(g, LoweringMode.TRAINING), feed)
    for name, grad in mixed.param_grads.items():
        expected = ref.param_grads[name]
        assert grad.dtype == torch.float32 and (grad - expected).norm() <= 2e-2 * expected.norm() + 1e-4, name
    other = train_step(lower(g, LoweringMode.TRAINING, precision="bf16-mixed", recompute=not recompute), feed)
    for name, grad in mixed.param_grads.items():
        assert torch.equal(grad, other.param_grads[name]), name
    assert torch.equal(mixed.grads["x"], other.grads["x"])


@pytest.mark.parametrize("linear", [LinearOp(True), TransposedWeightLinearOp(True)], ids=["linear", "conv1d"])
@pytest.mark.parametrize("recast", [False, True], ids=["kept", "cast_again"])
def test_master_weight_linear_float64_gradcheck_and_wider_weights_against_torch(linear, recast, gen):
    """``MasterWeightLinearOp`` in float64 all the way (its cast a copy): a finite-difference
    gradcheck of x, W and b, with x read by another op too (dX added in the epilogue); then a
    float32 x on float64 weights against PyTorch: y = x W.to(float32)^T + b, dW and db float64."""
    transposed = isinstance(linear, TransposedWeightLinearOp)
    w_shape = (5, 3) if transposed else (3, 5)

    def graph(x_dtype):
        g = Graph()
        x = g.input("x", (2, 2, 5), dtype=x_dtype, requires_grad=True)
        w = g.input("w", w_shape, dtype=torch.float64, requires_grad=True)
        b = g.input("b", (3,), dtype=torch.float64, requires_grad=True)
        y = g.apply(MasterWeightLinearOp(linear, recast), [x, w, b])
        g.output(ops.add(ops.sum(ops.mul(y, y)), ops.sum(ops.tanh(x))))
        return g

    feed = {"x": torch.randn(2, 2, 5, generator=gen, dtype=torch.float64)}
    feed |= {
        "w": torch.randn(*w_shape, generator=gen, dtype=torch.float64),
        "b": torch.randn(3, generator=gen).double(),
    }
    teeny.gradcheck_graph(graph(torch.float64), feed, rewrites=())
    ex = Executor(lower(graph(torch.float32), LoweringMode.TRAINING, rewrites=()))
    feed32 = {**feed, "x": feed["x"].float()}
    loss, cache = ex.forward_train(feed32)
    grads = ex.backward(cache)
    x, w, b = (feed32[n].clone().requires_grad_() for n in "xwb")
    y = x @ (w.float() if transposed else w.float().T) + b.float()
    expected = (y * y).sum() + torch.tanh(x).sum()
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for name, t in zip("xwb", (x, w, b)):
        assert grads[name].dtype == t.dtype
        torch.testing.assert_close(grads[name].cpu(), t.grad, rtol=1e-5, atol=1e-5, msg=name)


class _PreNormStack(Module):
    """Token and position embeddings, two pre-norm residual blocks (the second adds its output
    on the left, as GPT-2 writes it), a final norm and a head: a residual stream."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = teeny.nn.Embedding(16, 8), teeny.nn.Embedding(6, 8)
        self.norms = ModuleList([teeny.nn.RMSNorm(8) for _ in range(3)])
        self.blocks = ModuleList([teeny.nn.Linear(8, 8) for _ in range(2)])
        self.head = teeny.nn.Linear(8, 16)

    def forward(self, ids, positions):
        s = ops.add(self.tokens(ids), self.positions(positions))
        s = ops.add(s, self.blocks[0](self.norms[0](s)))
        s = ops.add(self.blocks[1](self.norms[1](s)), s)
        return s, self.head(self.norms[2](s))


def _stream_graph(stream_output: bool) -> Graph:
    """``_PreNormStack``'s loss (and its final stream, ``stream_output``) over 4 x 6 tokens."""
    g = Graph("stream")
    ids, positions, y = (
        g.input("ids", (4, 6), torch.int64),
        g.input("pos", (6,), torch.int64),
        g.input("y", (24,), torch.int64),
    )
    s, logits = _PreNormStack()(ids, positions)
    loss = ops.cross_entropy(ops.reshape(logits, (24, 16)), y)
    g.output(loss, s) if stream_output else g.output(loss)
    return g


def _stream_feed(gen) -> dict:
    return {
        "ids": torch.randint(16, (4, 6), generator=gen),
        "pos": torch.arange(6),
        "y": torch.randint(16, (24,), generator=gen),
    }


def test_the_residual_stream_stays_float32_and_keeps_small_updates(gen):
    """As under autocast, the stream (embeddings, each sum of it and a sublayer's output) is
    float32: the norms read it and their float32 weights as they are and write bfloat16 for the
    products; a sum reads the sublayer's bfloat16 output in place (no cast launch forwards).
    Updates of 1e-3 to a stream of ones survive, which bfloat16 (spacing 2^-7 there) rounds
    away; the gradients follow the float32 program's."""
    g = _stream_graph(stream_output=True)
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    assert (
        "the residual stream in float32 (3 norms read it, 2 half-precision sublayer outputs added" in program.summary()
    )
    norms = [p.node for p in program.nodes if p.op.name in ("rms_norm", "add_rms_norm")]
    assert [(n.dtype, n.output.dtype) for n in norms] == [(torch.float32, BF16)] * 3
    assert all(v.dtype == torch.float32 for n in norms for v in n.inputs[:2])  # the stream, the weight
    assert [n.inputs[-1].dtype for n in norms[1:]] == [BF16, BF16]  # each sublayer's output, read in place
    assert {p.node.dtype for p in program.nodes if p.op.name == "linear"} == {BF16}
    upcasts = [p for p in program.nodes if p.op.name == "to_float32_in_norm"]
    assert len(upcasts) == 2 and not any(p.forward_launches for p in upcasts)

    feed = _stream_feed(gen)
    steps = {}
    for precision in ("bf16-mixed", None):
        ex = Executor(lower(g, LoweringMode.TRAINING, precision=precision), seed=0)
        ex.params["tokens.weight"].copy_(1 + 0.1 * torch.rand(16, 8, generator=torch.Generator().manual_seed(1)))
        ex.params["positions.weight"].zero_()
        for name in ("blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"):
            ex.params[name].mul_(2e-3)
        (loss, stream), cache = ex.forward_train(feed)
        ex.backward(cache)
        steps[precision] = stream, {k: v.clone() for k, v in ex.grads.items()}
    (mixed, mixed_grads), (full, full_grads) = steps["bf16-mixed"], steps[None]
    assert mixed.dtype == torch.float32
    assert (full.bfloat16().float() - full).abs().max() > 1e-3  # what a bfloat16 stream would lose
    assert (mixed - full).abs().max() < 1e-4
    for name, grad in mixed_grads.items():
        expected = full_grads[name]
        assert grad.dtype == torch.float32 and (grad - expected).norm() <= 2e-2 * expected.norm() + 1e-5, name


def test_the_fused_norm_writes_the_half_branchs_gradient_itself(gen):
    """The sum's norm reads the sublayer's bfloat16 output in place, and its backward writes
    that output's gradient beside the stream's (rounded from the same float32 values): the
    upcast launches nothing backwards either, and every gradient is the one the program without
    the fused norm computes with a cast of the gradient (to the bit where the arithmetic is the
    same: ``_assert_same_gradients``)."""
    g = _stream_graph(stream_output=False)
    fused_program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    upcasts = [p for p in fused_program.nodes if p.op.name == "to_float32_in_norm"]
    assert len(upcasts) == 2 and not any(p.forward_launches or p.backward_launches for p in upcasts)
    norms = [p for p in fused_program.nodes if isinstance(p.op, AddNormOp) and p.node.inputs[-1].dtype == BF16]
    assert len(norms) == 2 and all(p.grad_mask[-1] and p.op.grad_copies_input0 is not None for p in norms)
    feed = _stream_feed(gen)
    grads = _gradients_with_and_without_the_fused_norm(g, fused_program, feed)
    _assert_same_gradients(*grads)


def _gradients_with_and_without_the_fused_norm(g: Graph, fused_program, feed: dict) -> list[dict]:
    """The parameters' gradients of one step of ``fused_program`` (``g`` in bf16-mixed) and of
    ``g`` lowered the same way without ``fuse_residual_norm``."""
    unfused = tuple(r for r in teeny.fusions.DEFAULT_REWRITES if r is not teeny.fusions.fuse_residual_norm)
    grads = []
    for program in (fused_program, lower(g, LoweringMode.TRAINING, precision="bf16-mixed", rewrites=unfused)):
        ex = Executor(program, seed=0)
        _, cache = ex.forward_train(feed)
        ex.backward(cache)
        grads.append({k: v.clone() for k, v in ex.grads.items()})
    return grads


def _assert_same_gradients(fused: dict, expected: dict) -> None:
    """The same to the bit under the interpreter; on the GPU the two programs' kernels may
    contract a multiply and an add into one (FMA) where the other rounds between them, and a
    bf16 gradient then differs in its last bit here and there."""
    assert fused.keys() == expected.keys()
    for name, grad in fused.items():
        if teeny.core.device.INTERPRETER:
            assert torch.equal(grad, expected[name]), name
        else:
            torch.testing.assert_close(grad, expected[name], rtol=2e-2, atol=1e-5, msg=name)


def test_the_fused_norm_passes_the_branch_its_gradient_when_its_own_output_has_none(gen):
    """The sum s = e + linear(e) reaches the loss, the norm of s only an output no gradient
    starts from: the fused norm still runs backwards (with a zero dy) to write the branch's
    gradient, and the linear's weight gets the gradient the unfused program gives it."""

    class Side(Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.block = teeny.nn.Embedding(16, 8), teeny.nn.Linear(8, 8)
            self.norm, self.head = teeny.nn.RMSNorm(8), teeny.nn.Linear(8, 16)

        def forward(self, ids):
            e = self.tokens(ids)
            s = ops.add(e, self.block(e))
            return self.head(s), self.norm(s)

    g = Graph("side")
    ids, y = g.input("ids", (3, 5), torch.int64), g.input("y", (15,), torch.int64)
    logits, normed = Side()(ids)
    g.output(ops.cross_entropy(ops.reshape(logits, (15, 16)), y), normed)
    fused_program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    (fused_norm,) = [p for p in fused_program.nodes if isinstance(p.op, AddNormOp)]
    assert fused_norm.needs_backward and fused_norm.op.grad_copies_input0 is not None
    feed = {"ids": torch.randint(16, (3, 5), generator=gen), "y": torch.randint(16, (15,), generator=gen)}
    grads = _gradients_with_and_without_the_fused_norm(g, fused_program, feed)
    assert grads[0]["block.weight"].abs().max() > 0
    _assert_same_gradients(*grads)


def test_dropout_on_the_embeddings_keeps_the_stream_float32():
    """GPT-2's defaults drop out of the embeddings' sum: as under autocast, the dropout runs on
    the float32 stream, and the norm after it reads float32."""

    class Dropped(Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.norm, self.head = teeny.nn.Embedding(11, 8), teeny.nn.RMSNorm(8), teeny.nn.Linear(8, 11)

        def forward(self, ids):
            return self.head(self.norm(ops.dropout(self.tokens(ids), 0.1, seed=0)))

    g = Graph("dropped")
    ids, y = g.input("ids", (2, 5), torch.int64), g.input("y", (10,), torch.int64)
    g.output(ops.cross_entropy(ops.reshape(Dropped()(ids), (10, 11)), y))
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    dtypes = {p.op.name: (p.node.dtype, p.node.output.dtype) for p in program.nodes}
    assert dtypes["dropout"] == (torch.float32, torch.float32)
    assert dtypes["rms_norm"] == (torch.float32, BF16)


def test_a_float32_input_read_as_a_stream_stays_float32():
    """A region split around a call PyTorch runs gets its residual stream as an input: a
    float32 input that a residual sum and a norm read is the stream, as an embedding is."""

    class Block(Module):
        def __init__(self):
            super().__init__()
            self.norms = ModuleList([teeny.nn.RMSNorm(8) for _ in range(2)])
            self.mlp, self.head = teeny.nn.Linear(8, 8), teeny.nn.Linear(8, 11)

        def forward(self, s):
            s = ops.add(s, self.mlp(self.norms[0](s)))
            return self.head(self.norms[1](s))

    g = Graph("split")
    s, y = g.input("stream", (2, 5, 8), requires_grad=True), g.input("y", (10,), torch.int64)
    g.output(ops.cross_entropy(ops.reshape(Block()(s), (10, 11)), y))
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    norms = [p.node for p in program.nodes if p.op.name in ("rms_norm", "add_rms_norm")]
    assert [(n.inputs[0].dtype, n.output.dtype) for n in norms] == [(torch.float32, BF16)] * 2
    assert "the residual stream in float32 (2 norms read it, 1 half-precision sublayer" in program.summary()
