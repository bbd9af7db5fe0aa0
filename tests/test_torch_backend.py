"""``torch.compile(model, backend="teeny")``: the captured regions run as teeny programs and
train exactly as the model does in eager mode (losses, every gradient, buffers), with the
user's optimizer, autocast, gradient accumulation and calls teeny has no op for."""

from __future__ import annotations

import copy
import enum
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch import nn

import teeny
from helpers import fresh_compile  # noqa: F401  (the fixture, used through pytestmark)
from teeny.torch import backend

transformers = pytest.importorskip("transformers")

DEVICE = teeny.DEVICE


pytestmark = pytest.mark.usefixtures("fresh_compile")


def _assert_same_training(model, reference, grad_rtol=1e-5):
    """Every parameter's gradient agrees to ``grad_rtol`` of the largest gradient entry of the
    model (a gradient that is zero in exact arithmetic, a bias before a batch norm, is noise),
    and every buffer agrees."""
    grads = [q.grad for q in reference.parameters() if q.grad is not None]
    scale = max(g.abs().max().item() for g in grads)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= grad_rtol * scale, name
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, msg=name)


def test_the_backend_is_registered_by_name():
    assert "teeny" in torch._dynamo.list_backends()


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(nn.functional.max_pool2d(h, 2), 1))


def test_a_cnn_with_batch_norm_trains_as_in_eager_mode_with_torchs_optimizer():
    torch.manual_seed(0)
    model = _ConvNet().to(DEVICE)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="teeny")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for _ in range(3):
        x = torch.randn(6, 3, 8, 8, device=DEVICE)
        y = torch.randint(0, 5, (6,), device=DEVICE)
        for net, opt in zip((compiled, reference), optimizers):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        _assert_same_training(model, reference, grad_rtol=1e-4)
        for opt in optimizers:
            opt.step()
    assert model.bn.num_batches_tracked.item() == 3  # the integer count ran through PyTorch, in place
    assert "aten.add_.Tensor: an integer result" in backend.report()


def _causal_lm(kind: str):
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=61, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        return transformers.GPT2LMHeadModel(config)
    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "cohere":  # rotary tables repeated element by element (repeat_interleave), a layer norm without bias
        return transformers.CohereForCausalLM(transformers.CohereConfig(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "cohere"])
def test_hugging_face_models_give_eagers_loss_and_gradients_accumulated(kind):
    torch.manual_seed(0)
    model = _causal_lm(kind).to(DEVICE)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="teeny")
    for _ in range(2):  # two micro-batches: the gradients accumulate in param.grad
        ids = torch.randint(0, 61, (2, 11), device=DEVICE)
        loss = compiled(input_ids=ids, labels=ids).loss
        expected = reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        loss.backward()
        expected.backward()
    _assert_same_training(model, reference)
    assert "left to PyTorch" not in backend.report().replace("0 kinds left to PyTorch", "")


def _assert_no_further_from_float32_than_autocast(model, reference, truth):
    """Each gradient of ``model`` (teeny under bf16 autocast) is no further from ``truth``'s
    (eager float32) than ``reference``'s (eager under the same autocast) is, give or take its
    own rounding: three times eager's distance, plus 1% of the largest gradient entry."""
    scale = max(t.grad.abs().max().item() for t in truth.parameters() if t.grad is not None)
    for (name, p), q, t in zip(model.named_parameters(), reference.parameters(), truth.parameters()):
        assert (p.grad is None) == (t.grad is None), name
        if t.grad is not None:
            ours, eagers = ((g - t.grad).abs().max().item() for g in (p.grad, q.grad))
            assert ours <= 3 * eagers + 1e-2 * scale, (name, ours, eagers, scale)


def test_gpt2s_loss_is_its_own_region_unless_its_loss_type_is_set():
    """transformers' ``loss_function`` logs a warning at each call for a class whose name names no
    loss (``GPT2LMHeadModel``): dynamo splits the graph there, for any backend. Setting
    ``model.loss_type`` (as the README says) makes the model and its loss one region."""
    torch.manual_seed(0)
    model = _causal_lm("gpt2").to(DEVICE)
    ids = torch.randint(0, 61, (2, 9), device=DEVICE)
    expected = copy.deepcopy(model)(input_ids=ids, labels=ids).loss
    for loss_type, regions in ((None, 2), ("ForCausalLM", 1)):
        torch._dynamo.reset()
        backend.reset()
        model.loss_type = loss_type
        loss = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        assert len(backend.reports()) == regions, backend.report()


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
def test_a_padding_mask_is_built_by_pytorch_and_read_by_teenys_attention(autocast):
    """The mask transformers builds from ``attention_mask`` is integer and boolean work, which
    PyTorch runs; the attention that reads it is teeny's, and so is the rest of the model. Under
    autocast, eager float32 is the truth both bf16 runs are measured against."""
    torch.manual_seed(0)
    model = _causal_lm("llama").to(DEVICE)
    reference, truth = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.autocast(DEVICE.type, torch.bfloat16, enabled=autocast):
        out = torch.compile(model, backend="teeny")(input_ids=ids, attention_mask=mask, labels=ids)
        eager = reference(input_ids=ids, attention_mask=mask, labels=ids)
    assert out.logits.dtype == eager.logits.dtype
    out.loss.backward()
    eager.loss.backward()
    if autocast:
        exact = truth(input_ids=ids, attention_mask=mask, labels=ids)
        exact.loss.backward()
        bound = 3 * (eager.loss - exact.loss).abs().item() + 1e-2 * exact.loss.item()
        assert (out.loss - exact.loss).abs().item() <= bound
        _assert_no_further_from_float32_than_autocast(model, reference, truth)
    else:
        torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-5)
        _assert_same_training(model, reference)
    text = backend.report()
    assert "PyTorch runs aten.le.Tensor: integer or boolean work" in text
    teeny_calls = Counter()
    for report in backend.reports():
        teeny_calls.update(report.teeny_calls)
        assert "aten.scaled_dot_product_attention.default" not in report.torch_calls
        assert report.name == "region0" or report.teeny_calls, report  # no program without the model's work
    assert teeny_calls["aten.scaled_dot_product_attention.default"] == 1
    assert teeny_calls["aten.linear.default"] == 8  # q, k, v, o, the MLP's three and the head


def test_autocast_around_the_model_lowers_as_mixed_precision():
    torch.manual_seed(0)
    model = _causal_lm("llama").to(DEVICE)
    model.config.use_cache = False  # without a cache, transformers repeats the key/value heads (repeat_kv)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 8), device=DEVICE)
    with torch.autocast(DEVICE.type, torch.bfloat16):
        out = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids)
        eager = reference(input_ids=ids, labels=ids)
    loss, expected = out.loss, eager.loss
    assert loss.dtype == expected.dtype
    assert out.logits.dtype == eager.logits.dtype == torch.bfloat16  # the head's product, as autocast makes it
    torch.testing.assert_close(out.logits, eager.logits, rtol=2e-2, atol=2e-2)
    (program,) = [entry.executor.program for report in backend.reports() for entry in report.live_entries()]
    rewrites = {report.rewrite for report in program.rewrites}
    assert {"fold_loss_upcast", "read_grouped_kv"} <= rewrites  # no float32 logits, no repeated k and v
    assert "attention_in_place" in rewrites  # no transposes around the attention, q and k rotated unsplit
    assert {p.op.layout for p in program.nodes if p.op.name == "rotary_embedding"} == {"blhd"}
    tables = [p.node for p in program.nodes if p.op.name in ("cos", "sin")]
    assert tables and all(n.dtype == torch.float32 for n in tables)  # rotary angles of exact positions
    norms = [p.node for p in program.nodes if p.op.name in ("rms_norm", "add_rms_norm")]  # the residual stream
    assert len(norms) == 3 and all((n.dtype, n.output.dtype) == (torch.float32, torch.bfloat16) for n in norms)
    assert not any(v.dtype == torch.float32 and v.numel == out.logits.numel() for v in program.graph.values)
    assert set(program.padded_grads.values()) == {64}  # dlogits' rows (61 classes) padded for the head's products
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    loss.backward()
    expected.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32  # float32 parameters, bf16 compute
    _assert_same_training(model, reference, grad_rtol=5e-2)
    assert ", 0 kinds left to PyTorch" in backend.report()


def test_the_recompute_option_keeps_fewer_activations_for_the_same_gradients():
    """``options={"recompute": True}``: norms' and activations' outputs are written again in the
    backward instead of kept, and the training is eager's."""
    torch.manual_seed(0)
    model = _causal_lm("llama").to(DEVICE)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 9), device=DEVICE)
    loss = torch.compile(model, backend="teeny", options={"recompute": True})(input_ids=ids, labels=ids).loss
    expected = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    _assert_same_training(model, reference)
    (program,) = [entry.executor.program for report in backend.reports() for entry in report.live_entries()]
    assert any(p.recomputed for p in program.nodes) and "recompute:" in program.summary()


def test_recompute_under_autocast_casts_the_weights_again_with_the_same_gradients():
    """Under bf16 autocast with ``recompute``: the bf16 copies of the float32 weights, which the
    products keep for dX, are cast again in the backward, and so are the norms' and the MLP's
    outputs; the loss and every gradient are those of the program that keeps them (bit for bit on
    the CPU)."""
    from teeny.ops.cast import CastOp
    from teeny.ops.products.ops import LinearOp

    torch.manual_seed(0)
    model = _causal_lm("llama").to(DEVICE)
    other = copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 9), device=DEVICE)
    losses = []
    for m, options in ((model, {"recompute": True}), (other, {})):
        with torch.autocast(DEVICE.type, torch.bfloat16):
            loss = torch.compile(m, backend="teeny", options=options)(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    exact = dict(rtol=0, atol=0) if DEVICE.type == "cpu" else dict(rtol=1e-3, atol=1e-6)  # (GPU: tuned kernels)
    torch.testing.assert_close(losses[0], losses[1], **exact)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **exact, msg=name)
    recomputing, keeping = (entry.executor.program for report in backend.reports() for entry in report.live_entries())
    again = {recomputing.nodes[j] for p in recomputing.nodes for j in p.recomputed.values()}
    weight_casts = [p for p in recomputing.nodes if isinstance(p.op, CastOp) and p.node.inputs[0].kind != "node"]
    linears = sum(1 for p in recomputing.nodes if type(p.op) is LinearOp)
    assert len([p for p in weight_casts if p in again]) >= linears  # every product's weight
    assert not any(p.recomputed for p in keeping.nodes)


def test_the_backends_options_are_checked_by_name():
    gm = torch.fx.symbolic_trace(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with pytest.raises(teeny.TeenyError, match="unknown option 'fast' \\(known: recompute: "):
        backend.teeny_backend(gm, [x], options={"fast": True})
    with pytest.raises(teeny.TeenyError, match="'recompute' must be True or False, got 'yes'"):
        backend.teeny_backend(gm, [x], options={"recompute": "yes"})
    with pytest.raises(teeny.TeenyError, match="unknown mode 'fastest' \\(known: default, reduce-overhead, "):
        backend.teeny_backend(gm, [x], mode="fastest")
    with pytest.raises(teeny.TeenyError, match="takes no fullgraph"):
        backend.teeny_backend(gm, [x], fullgraph=True)


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_torch_compiles_mode_says_whether_the_region_replays_as_cuda_graphs(mode):
    """``torch.compile(..., mode=)`` reaches the backend: "reduce-overhead" and "max-autotune"
    replay the region as CUDA graphs on a GPU (``tests/test_backend_graphs.py`` runs them there),
    the others launch by launch; the numbers are the same either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(DEVICE)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, device=DEVICE)
    loss = torch.compile(model, backend="teeny", mode=mode)(x).square().sum()
    expected = reference(x).square().sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    _assert_same_training(model, reference)
    (entry,) = [entry for report in backend.reports() for entry in report.live_entries()]
    assert entry._forward_replay.always == (mode in ("reduce-overhead", "max-autotune"))


def test_autocast_casts_a_model_writes_from_a_tensors_dtype_lower_as_mixed_precision():
    """OLMo-2 casts its q/k norms' float32 outputs back to the dtype it read off the projections
    (``x.to(input_dtype)``): dynamo writes autocast's bfloat16 into the graph there, which traced
    without autocast gave a float32 v and bfloat16 q, k (torch.export refused the region)."""
    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1)
    config = transformers.Olmo2Config(**common, num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.Olmo2ForCausalLM(config).to(DEVICE)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 8), device=DEVICE)
    with torch.autocast(DEVICE.type, torch.bfloat16):
        out = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids)
        eager = reference(input_ids=ids, labels=ids)
    assert out.logits.dtype == eager.logits.dtype
    torch.testing.assert_close(out.loss, eager.loss, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    eager.loss.backward()
    _assert_same_training(model, reference, grad_rtol=5e-2)
    assert ", 0 kinds left to PyTorch" in backend.report()


class _Cumulative(nn.Module):
    """A model with a call teeny has no op for (cumsum) between calls it has."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.cumsum(torch.tanh(self.a(x)), dim=1)).square().mean()


def test_a_call_teeny_lacks_runs_in_pytorch_between_teeny_programs():
    torch.manual_seed(0)
    model = _Cumulative().to(DEVICE)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 5, device=DEVICE)
    loss = torch.compile(model, backend="teeny")(x)
    expected = reference(x)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    _assert_same_training(model, reference)
    text = backend.report()
    assert "PyTorch runs aten.cumsum.default: teeny has no op for it" in text
    assert text.count("teeny program") >= 3  # the region, and a program on each side of the cumsum


class _Routed(nn.Module):
    """A router choosing two of four experts' weights with ``topk`` (which teeny has no op for)
    and normalising them in place (as Mixtral does), then a cumulative sum (no op for that
    either): an MoE layer's shape in small."""

    def __init__(self):
        super().__init__()
        self.gate, self.a, self.b = nn.Linear(6, 4, bias=False), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        top, _ = torch.topk(torch.softmax(self.gate(x), dim=-1, dtype=torch.float32), 2, dim=-1)
        top /= top.sum(-1, keepdim=True) + 1.0  # in place, on a tensor PyTorch made
        h = torch.tanh(self.a(x)) * top.sum(-1, keepdim=True).to(x.dtype)
        return self.b(torch.cumsum(h, dim=1))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
def test_a_split_region_trains_as_eager_and_under_autocast_as_autocast_does(autocast):
    """A split region: PyTorch's calls between teeny's programs, an in-place change of a tensor
    PyTorch made left to PyTorch (whose autograd follows it). Under autocast the split region
    runs in its own dtypes: teeny's programs in bf16 mixed precision, PyTorch's calls in
    float32 between them; the output comes back in autocast's dtype and the gradients are
    autocast's, within bf16's rounding."""
    torch.manual_seed(0)
    model = _Routed().to(DEVICE)
    reference, exact = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(5, 4, 6, device=DEVICE)
    with torch.autocast(DEVICE.type, torch.bfloat16, enabled=autocast):
        out = torch.compile(model, backend="teeny")(x)
        eager = reference(x)
    tol = 3e-2 if autocast else 1e-5
    assert out.dtype == eager.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(out, eager, rtol=tol, atol=tol)
    out.square().mean().backward()
    eager.square().mean().backward()
    exact(x).square().mean().backward()
    _assert_same_training(model, reference, grad_rtol=5e-2 if autocast else 1e-5)
    _assert_same_training(model, exact, grad_rtol=5e-2 if autocast else 1e-5)
    text = backend.report()
    assert "PyTorch runs aten.topk.default" in text and "PyTorch runs aten.cumsum.default" in text
    programs = [entry.executor.program for report in backend.reports() for entry in report.live_entries()]
    assert len(programs) >= 2
    assert all(("mixed_precision_bfloat16" in {r.rewrite for r in p.rewrites}) == autocast for p in programs)


def test_dynamic_shapes_build_a_program_per_shape_and_fullgraph_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8)).to(DEVICE)
    compiled = torch.compile(model, backend="teeny", fullgraph=True, dynamic=True)
    for rows in (3, 5, 3, 7):
        x = torch.randn(rows, 4, device=DEVICE)
        torch.testing.assert_close(compiled(x), model(x))
    assert backend.report().startswith("region0: 3 teeny programs")  # one region; the second call of 3 reuses


def test_repeat_interleave_and_repeat_run_in_teeny_with_a_float64_gradcheck():
    """Cohere's and GLM-4's rotary tables repeat each column (``repeat_interleave``); ``repeat``
    tiles: both as a broadcast new axis merged into a dim."""

    def f(x, w):
        y = x @ w
        return (
            torch.repeat_interleave(y, 2, dim=-1).sum(-1),
            (y.repeat(2, 1, 3).cos()).sum(0),
            y.sin().repeat_interleave(3),
        )

    x = torch.randn(3, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    compiled = torch.compile(f, backend="teeny")
    for out, expected in zip(compiled(x, w), f(x, w)):
        torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(compiled, (x, w), fast_mode=True)  # random projections of 93 output elements
    assert ", 0 kinds left to PyTorch" in backend.report()


def test_float64_gradcheck_through_the_backend():
    def f(x, w, b):
        return torch.tanh(nn.functional.layer_norm(x @ w, (5,)) + b).sum(dim=0)

    compiled = torch.compile(f, backend="teeny")
    args = [torch.randn(3, 4, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(1)]
    args += [
        torch.randn(4, 5, dtype=torch.float64, device=DEVICE, requires_grad=True),
        torch.randn(5, dtype=torch.float64, device=DEVICE, requires_grad=True),
    ]
    assert torch.autograd.gradcheck(compiled, args, eps=1e-6, atol=1e-7, fast_mode=True)  # random projections


def test_no_grad_runs_an_inference_program_and_dropout_follows_the_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 2)).to(DEVICE)
    compiled = torch.compile(model, backend="teeny")
    x = torch.randn(4, 6, device=DEVICE)
    model.eval()
    with torch.no_grad():
        out = compiled(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, model(x))
    model.train()
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second)  # a new mask each call
    first.sum().backward()
    assert model[0].weight.grad is not None


def test_llamas_rotary_embeddings_norms_and_mlp_run_as_one_teeny_op_each():
    torch.manual_seed(0)
    model = _causal_lm("llama").to(DEVICE)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 61, (2, 11), device=DEVICE)
    loss = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids).loss
    expected = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    _assert_same_training(model, reference)
    text = backend.report()
    assert "3 x LlamaRMSNorm (one op), 2 x rotary_embedding (one op), 1 x swiglu (one op)" in text, text


def test_accelerate_takes_the_name_as_one_more_member_of_its_list():
    """``import teeny.torch`` adds "teeny" to accelerate's fixed list of dynamo backends (the enum
    ``DynamoBackend``), which hands it to ``torch.compile`` lowered; accelerate's own names work as
    before, and registering again changes nothing."""
    pytest.importorskip("accelerate")
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    from teeny.torch import accelerate_name

    plugin = TorchDynamoPlugin(backend="teeny")
    assert plugin.backend is DynamoBackend.TEENY is DynamoBackend("TEENY") is DynamoBackend["TEENY"]
    assert isinstance(plugin.backend, DynamoBackend) and plugin.backend == "TEENY" == str(plugin.backend)
    assert (plugin.backend.name, plugin.backend.value.lower()) == ("TEENY", "teeny")
    assert plugin.to_kwargs()["backend"] == plugin.to_dict()["backend"] == "teeny"
    members = list(DynamoBackend)
    assert accelerate_name.register() and accelerate_name.register(DynamoBackend)  # again: nothing changes
    assert list(DynamoBackend) == members and members.count(DynamoBackend.TEENY) == 1
    assert DynamoBackend.list() == [str(m) for m in members] and "TEENY" in DynamoBackend
    assert TorchDynamoPlugin(backend="inductor").to_kwargs()["backend"] == "inductor"
    assert DynamoBackend("NO") is DynamoBackend.NO and DynamoBackend.NO in members
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        TorchDynamoPlugin(backend="teenie")
    assert not accelerate_name.register(enum.Enum("Other", "A B"))  # not a str enum: left alone


def test_the_name_is_registered_whether_accelerate_is_imported_before_or_after_teeny(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    from teeny.torch import accelerate_name

    accelerate_name._unregister(DynamoBackend)
    try:
        assert "TEENY" not in DynamoBackend
        accelerate_name.install()  # as ``import teeny.torch`` does with accelerate imported already
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "teeny")  # the name from the environment too
        assert TorchDynamoPlugin().to_kwargs()["backend"] == "teeny"
    finally:
        accelerate_name.register(DynamoBackend)
    # imported after teeny.torch (never by it): accelerate.utils registers it once imported
    code = (
        "import sys, teeny.torch; print('accelerate' in sys.modules); import accelerate.utils as u; "
        "print(u.TorchDynamoPlugin(backend='teeny').to_kwargs()['backend'], type(u.__loader__).__name__, "
        "any(getattr(f, 'teeny_accelerate_hook', False) for f in sys.meta_path))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "teeny", "SourceFileLoader", "False"], done.stdout


def test_a_region_dynamo_lets_go_frees_its_programs_and_keeps_its_report():
    """The reports (``backend.reports()``) keep what a region became, not its programs: after
    ``torch._dynamo.reset()`` and the model gone, the executors and their memory are freed
    (a bench running variants one after another, a user compiling a second model)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(DEVICE)
    compiled = torch.compile(model, backend="teeny")
    compiled(torch.randn(3, 4, device=DEVICE)).sum().backward()
    (report,) = backend.reports()
    (entry,) = report.live_entries()
    executor = weakref.ref(entry.executor)
    del entry, compiled, model
    torch._dynamo.reset()
    gc.collect()
    assert executor() is None
    assert report.live_entries() == [] and report.replayed() == "released"
    assert report.programs == 1 and "1 teeny program" in backend.report()
