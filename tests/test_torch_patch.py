"""``teeny.torch.patch``: the goal test of issue 12 (a patched tiny GPT-2 from ``transformers``
trains like the unpatched one: every loss and parameter gradient, float32 tolerance and
float64 tight), a patched Llama, a nanoGPT-style module of plain ``torch.nn`` code, and the
report: what was swapped, what was left to PyTorch and why, which calls fell back."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import teeny.torch as tt
import teeny.torch.nn as tnn
from teeny.checks.registry import tolerance

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 40


def _gpt2(dtype):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=4,  # head size 4: a scale of 0.5, which a float32 scalar holds exactly (issue 11 item 3)
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _llama(dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _batches(steps, batch=2, length=8):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (batch, length), generator=gen) for _ in range(steps)]


def _tolerance(dtype):
    return tolerance(dtype, 64) if dtype == torch.float32 else (1e-11, 1e-11)


def _lm_loss(model, ids, dtype):
    """float32: the model's own loss (labels=...). float64: the same shifted cross-entropy taken
    from the logits, since transformers computes its loss on float32 logits even for a float64 model."""
    if dtype == torch.float32:
        return model(ids, labels=ids).loss
    return _shifted_loss(model, ids)


def _shifted_loss(model, ids):
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_patched_gpt2_trains_like_the_unpatched_model(dtype):
    ref = _gpt2(dtype)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the patch
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    atol, rtol = _tolerance(dtype)
    for step, ids in enumerate(_batches(3)):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss, expected = _lm_loss(model, ids, dtype), _lm_loss(ref, ids, dtype)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol, msg=lambda m: f"step {step}: {m}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}")
        opt.step()
        opt_ref.step()
    swapped = {new for _, _, new in report.swapped}
    assert {"LayerNorm", "Embedding", "Linear", "TeenyConv1D", "TeenyGPT2MLP", "TeenyGPT2Attention"} <= swapped
    assert "one chunked teeny op" in report.fused_loss


def _causal_lm_entry():
    from teeny.torch import bridge

    (entry,) = [e for e in bridge._ENTRIES.values() if e.label == "teeny op causal_lm_loss"]
    return entry


@pytest.mark.parametrize("num_items", [None, 9])
def test_head_and_loss_are_one_chunked_op_in_training_and_the_logits_stay_in_eval(monkeypatch, num_items):
    """labels= in training: one teeny call whose program is the chunked head + loss, the loss
    and every gradient of the unpatched model, and no logits (as Liger's fused linear
    cross-entropy); ``num_items_in_batch`` (the Trainer's token count) divides the summed loss.
    In eval mode the logits are computed and the loss is transformers' own."""
    from teeny import fusions
    from teeny.fusions.chunked_loss import LinearCrossEntropyOp
    from teeny.torch import bridge

    monkeypatch.setattr(
        fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 0
    )  # the tiny model's logits: chunk them anyway
    bridge.clear_cache()
    ref = _gpt2(torch.float32)
    model = copy.deepcopy(ref)
    tt.patch(model)
    (ids,) = _batches(1)
    ids[0, 3] = -100  # an ignored label
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    out, expected = model(ids.clamp(min=0), labels=ids, **extra), ref(ids.clamp(min=0), labels=ids, **extra)
    assert out.logits is None and "logits" not in out
    atol, rtol = _same_loss_and_gradients(model, ref, out, expected)
    assert [type(n.op) for n in _causal_lm_entry().executor.program.nodes][-1] is LinearCrossEntropyOp
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = model(ids.clamp(min=0), labels=ids), ref(ids.clamp(min=0), labels=ids)
    torch.testing.assert_close(out.logits, expected.logits, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.loss, expected.loss, atol=atol, rtol=rtol)


def _same_loss_and_gradients(model, ref, out, expected) -> tuple[float, float]:
    """Backward through both outputs' losses; the patched ``model``'s loss and every gradient are
    the reference's, to float32's tolerance (returned)."""
    out.loss.backward()
    expected.loss.backward()
    atol, rtol = _tolerance(torch.float32)
    torch.testing.assert_close(out.loss, expected.loss, atol=atol, rtol=rtol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return atol, rtol


def _gemma2(softcap):
    """A tiny Gemma 2 (eager attention, its only kind), its head's weight (tied to the embedding)
    scaled so that its logits reach the cap ``softcap``."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, use_cache=False,
        final_logit_softcapping=softcap, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.mark.parametrize("num_items", [None, 11])
def test_gemma2s_soft_capped_head_and_loss_are_one_chunked_op(monkeypatch, num_items):
    """Gemma 2's ``final_logit_softcapping``: the chunked head + loss caps the logits as it reads
    them, and the model's forward, which caps what its head returns, sees no cap meanwhile (the
    loss is not capped again): the loss and every gradient of the unpatched model, no logits; the
    config keeps its cap, and in eval mode the model caps its logits itself."""
    from teeny import fusions
    from teeny.fusions.chunked_loss import LinearCrossEntropyOp
    from teeny.torch import bridge

    monkeypatch.setattr(fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 0)  # the tiny model's logits
    bridge.clear_cache()
    ref = _gemma2(2.0)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    assert "the soft cap final_logit_softcapping = 2.0 fused into the loss" in report.fused_loss
    assert report.coverage()["head + loss"].startswith("teeny: one chunked op")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, 3] = labels[1, 5] = -100
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    out, expected = model(ids, labels=labels, **extra), ref(ids, labels=labels, **extra)
    assert out.logits is None and model.config.final_logit_softcapping == 2.0
    (node,) = [n for n in _causal_lm_entry().executor.program.nodes if isinstance(n.op, LinearCrossEntropyOp)]
    assert node.op.loss.softcap == 2.0
    atol, rtol = _same_loss_and_gradients(model, ref, out, expected)
    uncapped = copy.deepcopy(ref)
    uncapped.config.final_logit_softcapping = None
    assert not torch.allclose(uncapped(ids, labels=labels, **extra).loss, expected.loss, rtol=0.05)  # the cap counts
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits.abs().max() <= 2.0
    torch.testing.assert_close(out.logits, expected.logits, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.loss, expected.loss, atol=atol, rtol=rtol)


def test_fused_loss_false_keeps_the_logits_and_a_model_without_a_plain_head_is_reported():
    model = _gpt2(torch.float32)
    report = tt.patch(model, fused_loss=False)
    (ids,) = _batches(1)
    assert model(ids, labels=ids).logits.shape == (*ids.shape, VOCAB) and report.fused_loss == ""
    gemma_like = _gpt2(torch.float32)
    gemma_like.config.final_logit_softcapping = 30.0
    report = tt.patch(gemma_like)
    assert "post-processes its logits: final_logit_softcapping" in report.fused_loss
    assert gemma_like(ids, labels=ids).logits is not None


def test_fused_loss_under_autocast_is_float32():
    ref = _gpt2(torch.float32)
    model = copy.deepcopy(ref)
    tt.patch(model)
    (ids,) = _batches(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, expected = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert loss.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=0.05, rtol=0.02)
    loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32


def test_patched_gpt2_compiles_in_one_graph_without_recompiling():
    """torch.compile(fullgraph=True) of the patched model, its own ``labels=`` loss included (the
    fused head + loss skips transformers' ``loss_function``, where the unpatched model breaks the
    graph): one graph, no recompile as the steps go on (a run-time count the patch mutated once
    made every call recompile), and the eager unpatched model's losses and gradients."""
    ref = _gpt2(torch.float32)
    model = copy.deepcopy(ref)
    tt.patch(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    atol, rtol = _tolerance(torch.float32)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, ids in enumerate(_batches(3)):
            opt.zero_grad()
            opt_ref.zero_grad()
            loss, expected = compiled(ids, labels=ids).loss, ref(ids, labels=ids).loss
            loss.backward()
            expected.backward()
            torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol, msg=lambda m: f"step {step}: {m}")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(
                    p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}"
                )
            opt.step()
            opt_ref.step()
    torch._dynamo.reset()


def _matches_under_autocast(ref, model, ids, compiled: bool):
    """The patched ``model``'s loss and gradients under bf16 autocast are ``ref``'s, eager and
    (``compiled``) under torch.compile with fullgraph."""
    runs = [model, torch.compile(model, fullgraph=True, backend="aot_eager")] if compiled else [model]
    for run in [ref, *runs]:
        run.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(ids, labels=ids).loss
        loss.backward()
        if run is ref:
            expected, expected_grads = loss, [p.grad for p in ref.parameters()]
            continue
        torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-3)
        for (name, p), g in zip(model.named_parameters(), expected_grads):
            torch.testing.assert_close(p.grad, g, atol=1e-2, rtol=5e-2, msg=lambda m: f"{name}: {m}")
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pre_norms_write_the_autocast_dtype_that_the_products_after_them_read(family):
    """Under autocast the norms a block hands straight to its products (GPT-2's ln_1 and ln_2,
    Llama's input and post-attention norms) write bf16 themselves, since those products cast
    their input to it first anyway: no cast launch after the norm, nor before its backward.
    Without autocast they stay float32; the final norm (whose output the model returns) is not
    marked. Losses and gradients match the unpatched model under autocast, eager and compiled
    (fullgraph, GPT-2)."""
    ref = _gpt2(torch.float32) if family == "gpt2" else _llama(torch.float32)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    if family == "gpt2":
        blocks, norms, final = model.transformer.h, ("ln_1", "ln_2"), model.transformer.ln_f
    else:
        blocks, norms, final = model.model.layers, ("input_layernorm", "post_attention_layernorm"), model.model.norm
    assert len(report.autocast_norms) == 2 * len(blocks) and not getattr(final, "autocast_output", False)
    seen = []
    for block in blocks:
        for name in norms:
            getattr(block, name).register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    ids = _batches(1)[0]
    model(ids, labels=ids)
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    _matches_under_autocast(ref, model, ids, compiled=family == "gpt2")
    assert set(seen) == {torch.bfloat16}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_attention_junction_of_each_block_is_one_teeny_call(family):
    """Each block's residual add after its attention and the norm after it (GPT-2's ln_2,
    Llama's post-attention norm) are one teeny call, ``residual_norm``: under bf16 autocast the
    attention's bf16 output is upcast as the norm reads it (one launch forwards, which also
    writes the float32 sum), and the norm writes bf16 for the MLP's products. Losses and
    gradients match the unpatched model, eager and compiled (GPT-2, fullgraph); a hook on the
    norm keeps the block's own two calls (the hook sees the norm run)."""
    from teeny.torch import bridge

    ref = _gpt2(torch.float32) if family == "gpt2" else _llama(torch.float32)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    block = "TeenyGPT2Block" if family == "gpt2" else "TeenyLlamaDecoderLayer"
    assert sum(new == block for _, _, new in report.swapped) == 2
    ids = _batches(1)[0]
    bridge.clear_cache()
    _matches_under_autocast(ref, model, ids, compiled=family == "gpt2")
    (junction,) = [e for e in bridge._ENTRIES.values() if e.label == "teeny op residual_norm"]
    nodes = junction.executor.program.nodes
    assert [type(p.op).__name__ for p in nodes] == ["TakenInOp", "TakenInOp", "AddNormOp"]
    assert sum(len(p.forward_launches) for p in nodes) == 1
    assert [dtype for _, dtype in junction.outputs] == [torch.float32, torch.bfloat16]
    norm = model.transformer.h[0].ln_2 if family == "gpt2" else model.model.layers[0].post_attention_layernorm
    seen = []
    norm.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, labels=ids).loss.backward()
    assert seen == [torch.bfloat16]
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # this transformers' own attention says so
@pytest.mark.parametrize("cache", ["past_key_values", "layer_cache"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_are_matched_by_structure_not_by_the_text_of_their_forward(family, cache, tmp_path, monkeypatch):
    """A block is recognised by its children, not by its forward's text: transformers before 5.2x
    named the blocks' cache argument ``past_key_values`` (the GPU machine has 5.17), where this one
    names it ``cache``, and a later release may rename it again (``layer_cache`` here). A block
    whose forward is written so is swapped the same way, hands its attention the cache by its own
    name, and gives the unpatched model's loss and gradients. A block with a child no layout has
    keeps its own forward (under the router), and the report says so."""
    import importlib
    import inspect
    import re
    import textwrap

    ref = _gpt2(torch.float32) if family == "gpt2" else _llama(torch.float32)
    blocks = ref.transformer.h if family == "gpt2" else ref.model.layers
    cls = type(blocks[0])
    forward = textwrap.dedent(inspect.getsource(cls.forward))
    current = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    forward = re.sub(rf"\b{current}\b", cache, forward[forward.index("def ") :])  # without decorators
    module = f"renamed_{family}_{cache}"
    (tmp_path / f"{module}.py").write_text(
        f"import {cls.__module__} as newer\n\n"
        "globals().update(vars(newer))  # the names transformers' forward reads\n"
        f"Newer = newer.{cls.__name__}\n\n\n"
        f"class {cls.__name__}(Newer):\n"
        f"    __module__ = '{cls.__module__}'  # patch swaps transformers' classes alone\n"
        + textwrap.indent(forward, "    ")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    renamed = getattr(importlib.import_module(module), cls.__name__)
    assert cache in inspect.signature(renamed.forward).parameters
    for block in blocks:
        block.__class__ = renamed
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    assert sum(new == f"Teeny{cls.__name__}" for _, _, new in report.swapped) == 2
    assert not [path for path, name, _ in report.left if name == cls.__name__]
    assert report.coverage()["block"] == "teeny: residual add + norm one call"
    _matches_under_autocast(ref, model, _batches(1)[0], compiled=False)

    other = copy.deepcopy(ref)
    for block in other.transformer.h if family == "gpt2" else other.model.layers:
        block.extra = nn.Identity()  # a child no layout has
    report = tt.patch(other)
    left = [path for path, name, why in report.left if name == cls.__name__ and "its own forward runs" in why]
    assert len(left) == 2 and f"{cls.__name__}): a block layout teeny does not know" in str(report)
    _matches_under_autocast(ref, other, _batches(1)[0], compiled=False)


class _PaddedLM(nn.Module):
    """A user's module around a GPT-2 that makes the padding mask itself."""

    def __init__(self, lm, padding):
        super().__init__()
        self.lm, self.padding = lm, padding

    def forward(self, ids, labels):
        logits = self.lm(ids, attention_mask=self.padding).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return transformers.modeling_outputs.CausalLMOutput(loss=loss)


def test_compiled_gpt2_takes_the_one_call_attention_when_its_mask_is_the_causal_one(monkeypatch):
    """Under torch.compile transformers builds the causal mask as a tensor (in eager mode it
    passes None): when GPT2Model's call gives nothing that changes the mask, each layer is
    still one ``gpt2_attention`` call; with a padding mask or positions given, to the model or
    by a user's module around it, transformers' attention runs. Every case gives the unpatched
    model's loss and gradients."""
    from teeny.torch.patching import gpt2 as patching

    decisions = []
    plain = patching._plain_causal_self_attention

    def recorded(module, args, kwargs):
        decisions.append((kwargs.get("attention_mask") is not None, plain(module, args, kwargs)))
        return decisions[-1][1]

    monkeypatch.setattr(patching, "_plain_causal_self_attention", recorded)
    (ids,) = _batches(1)
    padding = torch.ones_like(ids)
    padding[0, :2] = 0
    atol, rtol = _tolerance(torch.float32)
    for kwargs, wrapped, one_call in [
        ({}, False, True),
        ({"attention_mask": padding}, False, False),
        ({"position_ids": torch.arange(8).repeat(2, 1)}, False, False),
        ({}, True, False),
    ]:
        ref = _gpt2(torch.float32)
        if wrapped:
            ref = _PaddedLM(ref, padding)
        model = copy.deepcopy(ref)
        tt.patch(model)
        torch._dynamo.reset()
        decisions.clear()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        loss, expected = compiled(ids, labels=ids, **kwargs).loss, ref(ids, labels=ids, **kwargs).loss
        assert decisions == [(True, one_call)] * 2, (kwargs, wrapped)  # both layers, a mask tensor each
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"{kwargs} {name}: {m}")
        assert not any(getattr(m, "_teeny_mask_is_causal", False) for m in model.modules())  # reset after the call
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # transformers >= 5.24 (the GPU has 5.17)
def test_gpt2_attention_with_a_padding_mask_a_cache_or_dropout_runs_transformers_code(monkeypatch):
    """The one-call attention is taken only for plain causal self-attention; a padding mask, a
    generation cache and attention dropout in training run transformers' own attention (and
    give its numbers), and eval mode with dropout configured takes the fast path again."""
    from teeny.torch.patching import gpt2 as patching

    decisions = []
    plain = patching._plain_causal_self_attention

    def recorded(*args):
        decisions.append(plain(*args))
        return decisions[-1]

    monkeypatch.setattr(patching, "_plain_causal_self_attention", recorded)
    ref = _gpt2(torch.float32).eval()
    model = copy.deepcopy(ref)
    tt.patch(model)
    for layer in model.transformer.h:  # as a compiled call of another thread leaves them for a moment:
        layer.attn._teeny_mask_is_causal = True  # in eager mode the mark does not count
    (ids,) = _batches(1)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    atol, rtol = _tolerance(torch.float32)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}, {"use_cache": True}):
            decisions.clear()
            out, expected = model(ids, **kwargs), ref(ids, **kwargs)
            torch.testing.assert_close(
                out.logits, expected.logits, atol=atol, rtol=rtol, msg=lambda m: f"{kwargs}: {m}"
            )
            assert decisions == [not kwargs] * 2, kwargs  # both layers
        step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
        torch.testing.assert_close(step, ref(ids[:, -1:], past_key_values=expected.past_key_values).logits)
    for layer in model.transformer.h:
        layer.attn.attn_dropout.p = 0.5
    decisions.clear()
    model(ids)
    assert decisions == [True] * 2  # eval mode: no dropout
    model.train()
    decisions.clear()
    model(ids)
    assert decisions == [False] * 2


def test_patched_llama_matches_the_unpatched_model():
    from teeny.torch import bridge

    bridge.clear_cache()
    dtype = torch.float32  # LlamaRMSNorm computes in float32 whatever the model's dtype: compare in float32
    ref = _llama(dtype)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    swapped = {new for _, _, new in report.swapped}
    assert {"TeenyLlamaRMSNorm", "TeenyLlamaMLP", "Linear", "Embedding"} <= swapped
    assert [path for path, _, _ in report.left] == ["model.rotary_emb"]
    ids = _batches(1)[0]
    loss, expected = _lm_loss(model, ids, dtype), _lm_loss(ref, ids, dtype)
    loss.backward()
    expected.backward()
    atol, rtol = _tolerance(dtype)
    torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    assert "one chunked teeny op" in report.fused_loss and _causal_lm_entry()  # head and loss: one call
    assert report.routed["scaled_dot_product_attention"] == 2  # grouped-query attention, no repeat_kv copy


class NanoBlock(nn.Module):
    """nanoGPT's block, written against torch.nn and F as users write it."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.0))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab=VOCAB, d=16, heads=2, layers=2, length=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(NanoBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_patched_nanogpt_matches_and_reports_the_routed_calls():
    torch.manual_seed(0)
    ref = NanoGPT().double()
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    ids = _batches(1)[0]
    loss, expected = model(ids, ids), ref(ids, ids)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-11, rtol=1e-11)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-11, rtol=1e-11)
    assert report.routed == {"scaled_dot_product_attention": 2, "cross_entropy": 1}
    assert report.left == []


def test_a_call_teeny_cannot_run_falls_back_to_pytorch_and_is_reported():
    class Dropping(nn.Module):
        def forward(self, q):
            return (
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).sum() * 0 + F.softmax(q, -1, dtype=q.dtype).sum()
            )

    module = Dropping()
    report = tt.patch(module)
    q = torch.randn(1, 3, 4)
    module(q)
    assert report.fallbacks[("scaled_dot_product_attention", "scaled_dot_product_attention with dropout_p=0.5")] == 1
    assert report.fallbacks[("softmax", "softmax with dtype=")] == 1
    assert "run by PyTorch" in str(report)


def test_layers_with_options_teeny_lacks_are_left_and_reported():
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), nn.ReLU(), nn.BatchNorm2d(2))
    report = tt.patch(model)
    assert type(model[0]) is nn.Conv2d and type(model[1]) is tnn.ReLU and type(model[2]) is tnn.BatchNorm2d
    assert report.left == [("0", "Conv2d", "teeny has no kernel for padding_mode='reflect'")]
    assert tt.patch(model) is report  # patching again changes nothing and keeps one report
    assert len(report.swapped) == 2


def test_gpt2_layers_are_one_teeny_call_each_and_a_zero_dropout_none():
    """GPT-2's attention and MLP are one teeny call each (both layers: one signature), the
    attention's q, k, v and heads read in place (no copies); a lone Conv1D is one product with
    the bias in its epilogue; a zero dropout launches nothing."""
    from transformers.pytorch_utils import Conv1D

    from teeny.torch import bridge

    model = _gpt2(torch.float32)
    tt.patch(model)
    bridge.clear_cache()
    (ids,) = _batches(1)
    _lm_loss(model, ids, torch.float32).backward()
    labels = {entry.label for entry in bridge._ENTRIES.values()}
    assert {"teeny op gpt2_attention", "teeny op gelu_mlp"} <= labels
    assert not labels & {"teeny op add", "teeny op matmul", "teeny op dropout", "teeny op gelu", "teeny op linear",
                         "teeny op packed_attention", "teeny op scaled_dot_product_attention"}  # fmt: skip
    (attention,) = [e for e in bridge._ENTRIES.values() if e.label == "teeny op gpt2_attention"]
    names = [type(node.op).__name__ for node in attention.executor.program.nodes]
    assert names == ["TransposedWeightLinearOp", "AttentionOp", "ViewOp", "TransposedWeightLinearOp"]
    kernels = [launch.kernel.name for node in attention.executor.program.nodes for launch in node.forward_launches]
    assert len(kernels) == 3 and kernels[1] == "attention_forward"  # two products around it, no head copies
    (mlp,) = [e for e in bridge._ENTRIES.values() if e.label == "teeny op gelu_mlp"]
    names = [type(node.op).__name__ for node in mlp.executor.program.nodes]
    assert names == ["TransposedWeightLinearOp", "ActivationOp", "TransposedWeightLinearOp"]  # W read in place
    conv = nn.Sequential(Conv1D(5, 4))
    tt.patch(conv)
    bridge.clear_cache()
    conv(torch.randn(2, 3, 4, requires_grad=True)).sum().backward()
    (entry,) = bridge._ENTRIES.values()
    assert entry.label == "teeny op conv1d_linear"
    assert [type(node.op).__name__ for node in entry.executor.program.nodes] == ["TransposedWeightLinearOp"]


@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_under_autocast_runs_as_a_product_in_the_autocast_dtype(bias):
    """Conv1D's weight is (in, out): teeny's product reads it so, cast to the autocast dtype
    (no transposed copy); the gradients reach the float32 weight and bias."""
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(5, 8)
    if not bias:
        conv.bias = None
    model = nn.Sequential(conv)
    tt.patch(model)
    x = torch.randn(2, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16  # like torch's addmm under autocast, not float32 products
    ref = x @ conv.weight + (conv.bias if bias else 0)
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.02)
    y.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32
    torch.testing.assert_close(conv.weight.grad, x.sum(1).sum(0)[:, None].expand(8, 5), atol=0.1, rtol=0.02)
    if bias:
        torch.testing.assert_close(conv.bias.grad, torch.full((5,), 6.0))


def _patch_op_calls():
    """A small float64 call of each operator that patch and its routing register themselves."""
    g = torch.Generator().manual_seed(5)

    def randn(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)

    angles = torch.randn(2, 3, 2, generator=g, dtype=torch.float64).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()  # position tables: no gradient
    target = torch.randint(0, 7, (2, 4), generator=g)
    target[0, 2] = -100
    return [
        ("gelu_mlp", (randn(2, 3, 4), randn(4, 5), randn(5), randn(5, 4), randn(4))),  # Conv1D weights (in, out)
        ("conv1d_linear", (randn(2, 3, 4), randn(4, 5), randn(5))),
        ("conv1d_linear", (randn(3, 4), randn(4, 5), None)),
        ("causal_lm_loss", (randn(2, 4, 3), randn(7, 3), randn(7), target, -100, "mean")),
        ("causal_lm_loss", (randn(2, 4, 3), randn(7, 3), None, target, -100, "sum")),
        ("causal_lm_loss", (randn(2, 4, 3), randn(7, 3), randn(7), target, -100, "mean", 0.7)),  # Gemma 2's cap
        ("packed_attention", (randn(1, 5, 24), 2, True, 0.3)),  # batches > 1: test_torch_nn
        ("gpt2_attention", (randn(2, 3, 4), randn(4, 12), randn(12), randn(4, 4), randn(4), 2, 0.4)),
        ("gpt2_attention", (randn(1, 3, 4), randn(4, 12), None, randn(4, 4), None, 1, None)),
        ("residual_norm", (randn(2, 3, 5), randn(2, 3, 5), randn(5), randn(5), 1e-5, True, None)),
        ("residual_norm", (randn(3, 5), randn(3, 5), randn(5), None, 1e-6, False, None)),
        ("residual_norm", (randn(3, 5), randn(3, 5), randn(5), None, 1e-6, False, None, 1.0)),  # Gemma's (1 + w)
        ("rotary_pair", (randn(2, 2, 3, 4), randn(2, 1, 3, 4), cos, sin)),
        ("expert_mlp", (randn(3, 4), randn(6, 4), randn(4, 3))),
    ]


@pytest.mark.parametrize("name, args", _patch_op_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_patch_operators_pass_opcheck_and_float64_gradcheck(name, args):
    import teeny.torch.nn.functional  # noqa: F401  (registers packed_attention)
    import teeny.torch.patching  # noqa: F401  (registers gelu_mlp, causal_lm_loss, rotary_pair, ...)

    op = getattr(torch.ops.teeny, name)
    torch.library.opcheck(op, args)
    leaves = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def fn(*xs):
        full = list(args)
        for i, x in zip(leaves, xs):
            full[i] = x
        out = op(*full)
        return tuple(out) if isinstance(out, list) else out

    # fast mode: the analytical Jacobian against central differences along random directions
    # (u^T J v), a few calls instead of one per input element; each kernel pair underneath has its
    # element-by-element gradcheck in test_ops
    assert torch.autograd.gradcheck(fn, [args[i] for i in leaves], eps=1e-6, atol=1e-8, fast_mode=True)
