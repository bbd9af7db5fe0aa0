"""``teeny.torch.patch`` in the Hugging Face training stack (issue 49): a patched model deep-copies,
pickles and reloads as itself, recomputes under activation checkpointing as it computed, keeps
PEFT's LoRA adapters in the computation whichever comes first, and names its ops in the profiler.
Each case against the same model unpatched: the loss and every gradient, float32 on the CPU."""

import copy
import io
import warnings

import pytest
import torch

import teeny.torch as tt
from helpers import assert_same_step, run_script, shift_weights

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 48


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _ids():
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def _step(model, ids):
    """The loss of one training call, and the gradient of each trainable parameter, by name."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _assert_trains_like(model, ref, ids, what=""):
    assert_same_step(_step(model, ids), _step(ref, ids), what)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_deep_copy_of_a_patched_model_computes_with_its_own_weights(family):
    """``copy.deepcopy`` (TRL's reference model, an EMA copy): the copy is patched as the
    original is, and changing its weights changes its results, not the original's."""
    ref, ids = _model(family), _ids()
    model = copy.deepcopy(ref)
    tt.patch(model)
    twin = copy.deepcopy(model)
    twin_ref = copy.deepcopy(ref)
    shift_weights(twin, twin_ref)
    assert type(twin) is type(model) and twin._teeny_report is not model._teeny_report
    _assert_trains_like(twin, twin_ref, ids, "the copy")
    _assert_trains_like(model, ref, ids, "the original")
    assert "one chunked teeny op" in twin._teeny_report.fused_loss
    assert all(m._teeny_report is twin._teeny_report for m in twin.modules() if hasattr(m, "_teeny_report"))
    assert tt.patch(twin) is twin._teeny_report  # patching the copy again changes nothing


def test_a_patched_model_pickles_and_its_state_dict_loads_either_way():
    """``torch.save(model)`` and ``torch.load``: the same classes (made again where the process
    has not made them yet), the same results; patching the loaded model again keeps its report;
    a patched model's ``state_dict`` loads into an unpatched one and back."""
    from teeny.torch import patching

    ref, ids = _model("llama"), _ids()
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    patching.classes._CLASSES.clear()  # as in a fresh process: unpickling makes the classes again
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded).__name__ == "LlamaForCausalLM" and type(loaded).__module__ == "teeny.torch.patching"
    assert type(loaded.model.layers[0]).__name__ == "TeenyLlamaDecoderLayer"
    assert loaded._teeny_report.swapped == report.swapped
    _assert_trains_like(loaded, ref, ids, "unpickled")
    assert tt.patch(loaded) is loaded._teeny_report
    plain = _model("llama")
    shift_weights(plain)
    model.load_state_dict(plain.state_dict())
    _assert_trains_like(model, plain, ids, "state_dict loaded")
    again = _model("llama")
    again.load_state_dict(model.state_dict())
    _assert_trains_like(again, plain, ids, "state_dict of the patched model")


def test_a_patched_model_unpickles_in_a_fresh_process(tmp_path):
    """A patched Llama's config names teeny's attention (``attn_implementation="teeny"``): a fresh
    process that only ``torch.load``s it finds the name registered (unpickling imports teeny's
    classes, which register it) and computes the same loss."""
    ref, ids = _model("llama"), _ids()
    model = copy.deepcopy(ref)
    tt.patch(model)
    torch.save(model, tmp_path / "model.pt")
    done = run_script(
        "unpickle_patched", tmp_path / "model.pt", ",".join(map(str, ids.flatten().tolist())), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    implementation, loss = done.stdout.split()[-2:]
    assert implementation == "teeny"
    assert abs(float(loss) - float(ref(input_ids=ids, labels=ids).loss)) < 1e-5


def test_attention_is_teenys_through_transformers_interface_and_blocks_skip_the_router(tmp_path):
    """``patch`` switches a Llama's SDPA attention to ``attn_implementation="teeny"``: transformers'
    own SDPA function with its call on teeny's kernels, so a decoder layer runs without the
    router (the attention layer's views of its heads never reach the router's handler); the
    config saved by ``save_pretrained`` still says nothing of teeny."""
    import json

    from teeny.torch.patching.router import Router

    ref, ids = _model("llama"), _ids()
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    assert model.config._attn_implementation == "teeny" and ref.config._attn_implementation == "sdpa"
    assert report.coverage()["attention"] == "teeny: attn_implementation teeny"
    seen = []
    handler = Router.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return handler(self, func, types, args, kwargs)

    Router.__torch_function__ = spy
    try:
        _assert_trains_like(model, ref, ids)
    finally:
        Router.__torch_function__ = handler
    assert torch.nn.functional.scaled_dot_product_attention in seen
    assert torch.Tensor.view not in seen, "the attention layer's head views went through the router"
    assert report.routed["scaled_dot_product_attention"] == 2 and not report.fallbacks
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "teeny" not in json.dumps(saved)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5.2x renamed it "activation_checkpointing"
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_recomputes_the_blocks_on_teenys_kernels(reentrant):
    """``activation_checkpointing_enable`` (the Trainer's ``gradient_checkpointing=True``) on a
    patched Llama: each decoder layer runs again in the backward, outside the model's forward;
    it routes its attention to teeny again (a recomputation on PyTorch's attention saves other
    tensors: non-reentrant checkpointing's ``CheckpointError``). Loss and gradients as unpatched."""
    ref, ids = _model("llama"), _ids()
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})  # the Trainer's
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    _assert_trains_like(model, ref, ids, "checkpointed")
    assert report.routed["scaled_dot_product_attention"] == 2 * 2  # both layers, forward and recomputation
    assert not report.fallbacks


def _lora(model, targets):
    """``model`` with LoRA adapters on ``targets`` (initialised non-zero: each one changes the loss)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fan_in_fan_out set for GPT-2's Conv1D; tied lm_head
        return peft.get_peft_model(model, config)


_LORA_TARGETS = {"gpt2": ["c_attn", "c_fc", "lm_head"], "llama": ["q_proj", "v_proj", "gate_proj", "lm_head"]}


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch", "patch_lora_patch"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_adapters_are_never_bypassed(family, order):
    """LoRA on the attention, the MLP and the head, added after ``patch``, patched with the model,
    or added after ``patch`` and patched again: the loss and every adapter's gradient of the
    unpatched PEFT model. A one-call forward that reads a wrapped layer's weight (GPT-2's attention
    and MLP) runs the layers' own calls instead, and the report says so: left at patch time,
    counted at run time. The head's adapters, once patched, are merged into the fused head + loss
    (no logits); added after the patch, the head computes its logits (counted)."""
    targets = _LORA_TARGETS[family]
    ref, ids = _lora(_model(family), targets), _ids()
    model = _model(family)
    if order == "lora_then_patch":
        model = _lora(model, targets)
        report = tt.patch(model)
    else:
        report = tt.patch(model)
        model = _lora(model, targets)
        if order == "patch_lora_patch":
            assert tt.patch(model) is report
    _assert_trains_like(model, ref, ids, order)
    if order == "patch_then_lora":
        fallbacks = {name for name, why in report.fallbacks if "peft.tuners.lora" in why}
        assert fallbacks == (
            {"gpt2_attention", "gelu_mlp", "causal_lm_loss"} if family == "gpt2" else {"causal_lm_loss"}
        )
        return
    assert "the LoRA adapters merged into the head's weight" in report.fused_loss
    assert model(input_ids=ids, labels=ids).logits is None
    assert not {name for name, _ in report.fallbacks} & {"causal_lm_loss"}
    if family == "gpt2" and order == "lora_then_patch":
        left = {path.split(".")[-1] for path, _, why in report.left if "peft.tuners.lora" in why}
        assert left == {"attn", "mlp"}


def test_lora_on_the_head_with_dropout_in_training_computes_the_logits():
    """A head adapter with dropout does not merge into one weight: in training the head computes
    its logits through PEFT's layer (counted in the fallbacks), with PEFT's numbers (eval mode)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.5, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(_model("llama"), config)
    report = tt.patch(model)
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None
    assert [why for name, why in report.fallbacks if name == "causal_lm_loss"] == [
        "lm_head's LoRA adapters do not merge (dropout, a variant): the logits are computed"
    ]


def test_a_patched_peft_model_without_an_adapter_on_the_head_keeps_the_fused_loss():
    """``patch`` of a ``PeftModel`` finds the causal LM inside it: head and loss stay one call."""
    ref, ids = _lora(_model("llama"), ["q_proj", "v_proj"]), _ids()
    model = _lora(_model("llama"), ["q_proj", "v_proj"])
    report = tt.patch(model)
    assert "one chunked teeny op" in report.fused_loss
    assert model(input_ids=ids, labels=ids).logits is None
    _assert_trains_like(model, ref, ids)


def test_the_profiler_names_teenys_ops_forward_and_backward():
    """Under ``torch.profiler`` each teeny call is a range named after its op, and so is its
    backward (not ``_EagerRun`` / ``_EagerRunBackward`` alone)."""
    model, ids = _model("gpt2"), _ids()
    tt.patch(model)
    _step(model, ids)  # traced and compiled outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _step(model, ids)
    names = {event.name for event in profile.events()}
    for op in ("gpt2_attention", "gelu_mlp", "causal_lm_loss"):
        assert f"teeny op {op}" in names and f"teeny op {op} backward" in names, sorted(names)


def test_the_rotary_embedding_goes_to_teeny_only_while_a_patched_model_runs():
    """``patch`` puts a dispatcher in place of the Llama modeling module's ``apply_rotary_pos_emb``:
    in the patched model q and k are rotated by one teeny call (counted), while an unpatched Llama
    in the same process keeps transformers' own function, bit for bit."""
    from transformers.models.llama import modeling_llama

    from teeny.torch.patching.rotary import RotaryDispatch

    plain, ids = _model("llama"), _ids()
    before = plain(input_ids=ids, labels=ids).loss
    model = _model("llama")
    report = tt.patch(model)
    assert isinstance(modeling_llama.apply_rotary_pos_emb, RotaryDispatch)
    assert torch.equal(plain(input_ids=ids, labels=ids).loss, before)
    _assert_trains_like(model, _model("llama"), ids)
    assert report.routed["apply_rotary_pos_emb"] == 2  # one call per layer
    assert report.coverage()["rotary"] == "teeny: rotary_embedding"


def test_rms_norms_are_told_apart_by_what_they_compute():
    """RMS norms are recognised by running them once: Llama's x̂ w and Gemma's x̂ (1 + w) (its
    weight starts at zero) both become teeny's norm, with the right offset; a ``*RMSNorm`` that
    computes something else is left to PyTorch and reported."""
    from transformers.models.llama import modeling_llama

    gemma = transformers.GemmaForCausalLM(
        transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    )  # fmt: skip
    ref, ids = copy.deepcopy(gemma), _ids()
    tt.patch(gemma)
    assert {m.weight_offset for m in gemma.modules() if "offset_rms_norm" in getattr(type(m), "_teeny_labels", ())}
    _assert_trains_like(gemma, ref, ids, "gemma")

    class DoubledRMSNorm(modeling_llama.LlamaRMSNorm):
        __module__ = modeling_llama.__name__  # one of transformers' classes, as patch sees it

        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    model = _model("llama")
    model.model.norm.__class__ = DoubledRMSNorm
    ref = copy.deepcopy(model)
    report = tt.patch(model)
    assert ("model.norm", "DoubledRMSNorm", "an RMS norm that computes neither x̂ w nor x̂ (1 + w)") in report.left
    assert type(model.model.layers[0].input_layernorm).weight_offset == 0.0
    _assert_trains_like(model, ref, ids, "llama")
