"""Recompute (``lower(..., recompute=True)``): the outputs of norms and element-wise ops that a
later node reads for its backward are written again in the backward instead of kept. Each op
family that can recompute is checked against the same program keeping its outputs (float64,
bit for bit where the maths is the same) and by a float64 finite-difference gradcheck; then
what the plan keeps and recomputes, a value read by two nodes, products writing their input's
gradient over the recomputed input, batch norm's running statistics, half precision, and a
whole GPT step and training run."""

import json

import pytest
import torch

import teeny
from helpers import train_step
from teeny import Graph, LoweringMode, fusions, lower, ops
from teeny.checks.gradcheck import gradcheck_graph
from teeny.core import init
from teeny.ops import activation, conv, norm
from teeny.ops.norm.ops import NormOp
from teeny.program.executor import Executor
from teeny.training.data import CharCorpus
from teeny.training.loop import TrainConfig, train
from teeny.training.models import GPT, CharTask


def _recomputed(program):
    """Names of the nodes whose outputs the backward writes again."""
    return sorted({program.nodes[j].name for p in program.nodes for j in p.recomputed.values()})


def _then_linear(apply, shape, dtype=torch.float64, out_features=3):
    """x -> apply(x) -> linear -> mse against y: the linear keeps apply's output for dW."""
    g = Graph("recompute")
    x = g.input("x", shape, dtype, requires_grad=True)
    y = apply(g, x)
    w = g.parameter("w", (out_features, y.shape[-1]), teeny.core.init.normal(0.5), dtype)
    z = ops.linear(y, w)
    g.output(ops.mse_loss(z, g.input("target", z.shape, dtype)))
    return g


def _norm_params(g, x, channels, dtype):
    return (
        g.parameter("weight", (channels,), teeny.core.init.normal(0.3, 1.0), dtype),
        g.parameter("bias", (channels,), teeny.core.init.normal(0.3), dtype),
    )


def _layer_norm(g, x):
    return norm.layer_norm(x, (x.shape[-1],), *_norm_params(g, x, x.shape[-1], x.dtype))


def _rms_norm(g, x):
    return norm.rms_norm(x, (x.shape[-1],), _norm_params(g, x, x.shape[-1], x.dtype)[0])


def _group_norm(g, x):
    return norm.group_norm(x, 2, *_norm_params(g, x, x.shape[1], x.dtype))


def _batch_norm(g, x):
    c = x.shape[1]
    mean = g.input("running_mean", (c,), x.dtype)
    var = g.input("running_var", (c,), x.dtype)
    return norm.batch_norm(x, mean, var, *_norm_params(g, x, c, x.dtype), training=True)


def _swiglu(g, x):
    half = x.shape[-1] // 2
    return activation.swiglu(ops.slice(x, -1, 0, half), ops.slice(x, -1, half, 2 * half))


def _prelu(g, x):
    return activation.prelu(x, g.parameter("slope", (x.shape[1],), teeny.core.init.normal(0.1, 0.25), x.dtype))


FAMILIES = {  # small: the gradcheck perturbs every element of x and of each parameter twice
    "layer_norm": (_layer_norm, (2, 2, 5)),
    "rms_norm": (_rms_norm, (3, 5)),
    "group_norm": (_group_norm, (2, 4, 3)),
    "batch_norm": (_batch_norm, (3, 2, 3)),
    "gelu": (lambda g, x: activation.gelu(x), (2, 5)),
    "glu": (lambda g, x: activation.glu(x), (2, 6)),
    "swiglu": (_swiglu, (2, 6)),
    "prelu": (_prelu, (2, 2, 3)),
}


def _feed(graph, gen):
    feed = {v.name: torch.randn(v.shape, generator=gen, dtype=v.dtype) for v in graph.inputs}
    if "running_var" in feed:
        feed["running_mean"], feed["running_var"] = (
            torch.zeros_like(feed["running_mean"]),
            torch.ones_like(feed["running_var"]),
        )
    return feed


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_recomputes_its_output_with_the_same_gradients(family, gen):
    apply, shape = FAMILIES[family]
    g = _then_linear(apply, shape)
    feed = _feed(g, gen)
    kept = lower(g, LoweringMode.TRAINING)
    recomputing = lower(g, LoweringMode.TRAINING, recompute=True)
    assert len(_recomputed(recomputing)) == 1 and not _recomputed(kept)
    plain = train_step(kept, {k: v.clone() for k, v in feed.items()})
    again = train_step(recomputing, {k: v.clone() for k, v in feed.items()})
    assert again.saved_bytes < plain.saved_bytes  # the forward kept less
    torch.testing.assert_close(again.out, plain.out, rtol=0, atol=0)
    torch.testing.assert_close(again.grads["x"], plain.grads["x"], rtol=1e-12, atol=1e-14)
    for name in plain.param_grads:
        torch.testing.assert_close(again.param_grads[name], plain.param_grads[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_recomputing_passes_a_float64_gradcheck(family, gen):
    apply, shape = FAMILIES[family]
    g = _then_linear(apply, shape)
    assert len(_recomputed(lower(g, LoweringMode.TRAINING, recompute=True))) == 1
    assert gradcheck_graph(g, _feed(g, gen), recompute=True).ok


def _spy_input_grad_buffers(monkeypatch) -> list[tuple[str, bool]]:
    """(node name, whether its input 0's gradient went into input 0's own buffer) per backward."""
    seen = []
    original = Executor._node_backward

    def spy(self, p, entry, grad_out, grads, input_grad_buffer=None, addend=None):
        seen.append((p.name, input_grad_buffer is not None and input_grad_buffer is entry["inputs"][0]))
        original(self, p, entry, grad_out, grads, input_grad_buffer, addend)

    monkeypatch.setattr(Executor, "_node_backward", spy)
    return seen


def _norm_then_mlp(g, x):
    w1 = g.parameter("w1", (3, x.shape[-1]), teeny.core.init.normal(0.5), x.dtype)
    w2 = g.parameter("w2", (2, 3), teeny.core.init.normal(0.5), x.dtype)
    return ops.linear(activation.gelu(ops.linear(_layer_norm(g, x), w1)), w2)


def _relu_then_conv(g, x):
    return conv.conv2d(
        activation.relu(x), g.parameter("w", (2, x.shape[1], 3, 3), teeny.core.init.normal(0.4), x.dtype)
    )


PRODUCTS = {  # a product whose input 0 is recomputed: (build, input shape, rewrites, the product's op name)
    "linear": (lambda g, x: ops.linear(_layer_norm(g, x), g.parameter("w", (3, 5), init.normal(0.5), x.dtype)),
               (3, 5), fusions.DEFAULT_REWRITES, "linear"),
    "mlp": (_norm_then_mlp, (3, 5), fusions.DEFAULT_REWRITES + (fusions.fuse_mlp,), "mlp"),
    "conv2d": (_relu_then_conv, (1, 2, 4, 4), fusions.DEFAULT_REWRITES, "conv2d"),
}  # fmt: skip


@pytest.mark.parametrize("product", sorted(PRODUCTS))
def test_a_product_writes_its_input_gradient_over_its_recomputed_input(product, monkeypatch, gen):
    """dX has x's shape, and the product reads x only for dW, which it launches first: with x
    recomputed for it (nothing else holds it), dX goes into x's buffer. The same gradients as
    keeping x, and a float64 gradcheck."""
    build, shape, passes, op_name = PRODUCTS[product]
    g = Graph(product)
    x = g.input("x", shape, torch.float64, requires_grad=True)
    y = build(g, x)
    g.output(ops.mse_loss(y, g.input("target", y.shape, torch.float64)))
    feed = _feed(g, gen)
    plain = train_step(lower(g, LoweringMode.TRAINING, rewrites=passes), feed)
    recomputing = lower(g, LoweringMode.TRAINING, rewrites=passes, recompute=True)
    seen = _spy_input_grad_buffers(monkeypatch)
    again = train_step(recomputing, feed)
    product_nodes = [p.name for p in recomputing.nodes if p.op.name == op_name and p.recomputed]
    assert product_nodes and all((name, True) in seen for name in product_nodes)
    torch.testing.assert_close(again.grads["x"], plain.grads["x"], rtol=1e-12, atol=1e-14)
    for name in plain.param_grads:
        torch.testing.assert_close(again.param_grads[name], plain.param_grads[name], rtol=1e-12, atol=1e-14, msg=name)
    monkeypatch.undo()
    assert gradcheck_graph(g, feed, rewrites=passes, recompute=True).ok


def test_a_value_read_by_two_nodes_is_recomputed_once(monkeypatch, gen):
    g = Graph("fan_out")
    x = g.input("x", (4, 6), torch.float64, requires_grad=True)
    y = _layer_norm(g, x)
    a = ops.linear(y, g.parameter("wa", (3, 6), teeny.core.init.normal(0.5), torch.float64))
    b = ops.linear(y, g.parameter("wb", (3, 6), teeny.core.init.normal(0.5), torch.float64))
    g.output(ops.sum(ops.mul(a, b)))
    program = lower(g, LoweringMode.TRAINING, recompute=True)
    assert sum(bool(p.recomputed) for p in program.nodes) == 2
    calls = []
    original = NormOp.recompute_launches
    monkeypatch.setattr(NormOp, "recompute_launches", lambda op, ctx: calls.append(op) or original(op, ctx))
    feed = {"x": torch.randn(4, 6, generator=gen, dtype=torch.float64)}
    seen = _spy_input_grad_buffers(monkeypatch)
    again = train_step(program, feed)
    # b's backward runs first and must leave y alone; a's, the last to read y, writes its dy over it
    linears = [p.name for p in program.nodes if p.recomputed]
    assert [written for name, written in seen if name in linears] == [False, True]
    plain = train_step(lower(g, LoweringMode.TRAINING), feed)
    assert len(calls) == 1
    torch.testing.assert_close(again.grads["x"], plain.grads["x"], rtol=1e-12, atol=1e-14)
    for name in plain.param_grads:
        torch.testing.assert_close(again.param_grads[name], plain.param_grads[name], rtol=1e-12, atol=1e-14, msg=name)


def test_what_the_plan_keeps():
    """layer_norm -> gelu -> linear: gelu reads the norm's output y for its backward, so y is
    recomputed for it; the linear reads gelu's output, which is kept (its producer's own input
    is recomputed: no chains of recomputes). With y an output of the program, y is kept and
    gelu's output is recomputed instead. Inference plans nothing."""

    def chain(y_is_output):
        g = Graph("chain")
        x = g.input("x", (4, 6), torch.float32, requires_grad=True)
        y = _layer_norm(g, x)
        out = ops.sum(ops.linear(activation.gelu(y), g.parameter("w", (3, 6), teeny.core.init.normal(0.5))))
        g.output(out, y) if y_is_output else g.output(out)
        return g

    program = lower(chain(False), LoweringMode.TRAINING, recompute=True)
    assert [p.name for p in program.nodes if p.recomputed] == [program.nodes[1].name]  # gelu's backward
    assert _recomputed(program) == [program.nodes[0].name]
    assert "recompute: 1 values (0.00 MiB) written again in the backward, not saved" in program.summary()
    with_output = lower(chain(True), LoweringMode.TRAINING, recompute=True)
    assert [p.name for p in with_output.nodes if p.recomputed] == [with_output.nodes[2].name]  # the linear's
    assert not any(p.recomputed for p in lower(chain(False), LoweringMode.INFERENCE, recompute=True).nodes)


def test_batch_norm_updates_its_running_statistics_once(gen):
    g = _then_linear(_batch_norm, (4, 3, 5))
    feed = _feed(g, gen)
    stats = []
    for recompute in (False, True):
        run = {k: v.to(teeny.DEVICE, copy=True) for k, v in feed.items()}  # updated in place where they are
        train_step(lower(g, LoweringMode.TRAINING, recompute=recompute), run)
        stats.append((run["running_mean"], run["running_var"]))
    assert not torch.equal(stats[0][0].cpu(), feed["running_mean"])
    torch.testing.assert_close(stats[1], stats[0], rtol=0, atol=0)


def _gpt(dtype=torch.float32, vocab=11, block=6, batch=2):
    g = Graph("gpt")
    model = GPT(vocab, block, d_model=16, n_heads=2, n_layers=2).to(dtype)
    idx = g.input("x", (batch, block), torch.int64)
    y = g.input("y", (batch, block), torch.int64)
    logits = model(idx)
    g.output(ops.cross_entropy(ops.reshape(logits, (batch * block, vocab)), ops.reshape(y, (batch * block,))))
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_step_recomputes_every_norm_and_activation_output(dtype, gen):
    """Per block the two norms' outputs (read by the q/k/v product and the MLP's first linear)
    and GELU's (read by the second), and the final norm's (the head): 2 * 3 + 1 values. float32:
    the same step (bit for bit under the interpreter); bfloat16 within rounding (a fused
    residual norm recomputes from the rounded sum it wrote)."""
    g = _gpt(dtype)
    feed = {"x": torch.randint(11, (2, 6), generator=gen), "y": torch.randint(11, (2, 6), generator=gen)}
    kept, recomputing = lower(g, LoweringMode.TRAINING), lower(g, LoweringMode.TRAINING, recompute=True)
    assert len(_recomputed(recomputing)) == 7
    saved = sum(recomputing.saved_bytes(p) for p in recomputing.nodes)
    assert saved < sum(kept.saved_bytes(p) for p in kept.nodes)
    plain, again = train_step(kept, feed), train_step(recomputing, feed)
    assert again.saved_bytes < plain.saved_bytes
    exact = dtype == torch.float32 and teeny.core.device.INTERPRETER
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(again.out, plain.out, **tol)
    for name in plain.param_grads:
        torch.testing.assert_close(again.param_grads[name].float(), plain.param_grads[name].float(), **tol, msg=name)


def test_training_with_recompute_gives_the_same_losses(tmp_path):
    """``TrainConfig(recompute=True)`` (``teeny train --recompute``): the same run, step for step
    (bit for bit under the interpreter)."""
    corpus = CharCorpus(max_chars=20_000)
    losses = []
    for recompute in (False, True):
        task = CharTask(corpus, 8, 16, 2, 1, defaults={"epoch_tokens": 3 * 4 * 8}, eval_batches=1)
        out = tmp_path / str(recompute)
        config = TrainConfig(epochs=1, batch_size=4, lr=1e-2, out=str(out), progress=False, recompute=recompute)
        train(task, config, log=lambda *a, **k: None)
        with open(out / "metrics.jsonl") as f:
            losses.append([row["loss"] for row in map(json.loads, f) if "loss" in row])
    assert len(losses[0]) == 3
    if teeny.core.device.INTERPRETER:
        assert losses[0] == losses[1]
    else:  # the GPU's compiler contracts the norm's maths into FMAs differently in the two kernels
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)


def test_mixed_precision_casts_of_parameters_are_cast_again_not_kept(gen):
    """bf16-mixed with recompute: the half-precision copy of a float32 weight, which the product
    keeps for dX, is cast again in the backward from the parameter (which is kept anyway; the
    linear casts its master weight itself, ``fusions.master_weights``), so the forward keeps one
    bf16 weight fewer; loss and gradients are those of the program that keeps it, bit for bit.
    A cast of an activation is not recomputed (its input would have to be kept)."""
    from teeny.fusions.master_weights import MasterWeightLinearOp
    from teeny.ops.cast import CastOp

    g = Graph("cast")
    x = g.input("x", (6, 16), torch.float32, requires_grad=True)
    w = g.parameter("w", (24, 16), teeny.core.init.normal(0.3), torch.float32)
    h = activation.gelu(ops.linear(x, w))
    v = g.parameter("v", (5, 24), teeny.core.init.normal(0.3), torch.float32)
    z = ops.linear(h, v)
    g.output(ops.mse_loss(z, g.input("target", z.shape, torch.float32)))
    feed = _feed(g, gen)
    kept = lower(g, LoweringMode.TRAINING, precision="bf16-mixed")
    recomputing = lower(g, LoweringMode.TRAINING, precision="bf16-mixed", recompute=True)
    for program, recast in ((recomputing, True), (kept, False)):
        linears = [p.op for p in program.nodes if isinstance(p.op, MasterWeightLinearOp)]
        assert len(linears) == 2 and all(op.recast == recast for op in linears)
    assert not any(isinstance(recomputing.nodes[j].op, CastOp) and recomputing.nodes[j].node.inputs[0].kind == "node"
                   for p in recomputing.nodes for j in p.recomputed.values())  # fmt: skip
    plain = train_step(kept, {k: t.clone() for k, t in feed.items()})
    again = train_step(recomputing, {k: t.clone() for k, t in feed.items()})
    half_weights = {((24, 16), torch.bfloat16), ((5, 24), torch.bfloat16)}
    for step, held in ((plain, half_weights), (again, set())):
        _, cache = step.executor.forward_train({k: t.clone() for k, t in feed.items()})
        assert {(tuple(t.shape), t.dtype) for t in cache.tensors()} & half_weights == held
    torch.testing.assert_close(again.out, plain.out, rtol=0, atol=0)
    torch.testing.assert_close(again.grads["x"], plain.grads["x"], rtol=0, atol=0)
    for name in plain.param_grads:
        torch.testing.assert_close(again.param_grads[name], plain.param_grads[name], rtol=0, atol=0, msg=name)
