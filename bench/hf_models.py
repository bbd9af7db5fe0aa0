"""The Hugging Face models of the compile-backend issue, for ``teeny bench`` (random weights, no download).

    teeny bench bench/hf_models.py:gpt2_small --variants eager,compile,teeny-patch,teeny-backend
    teeny bench bench/hf_models.py:qwen2 --variants eager,compile-default,teeny-backend

``gpt2_small``: GPT-2 small (12 layers, d 768, 12 heads, vocabulary 50257, dropout 0), batch 8 x 1024,
its ``loss_type`` set (the README's advice: without it dynamo splits the model from its loss).
``qwen2``: a Qwen2 of the Llama's shape in ``examples/bench_llama.py`` (8 layers, d 1024, 16 / 4
heads, ffn 2816, vocabulary 32000; q/k/v biases), batch 8 x 1024.

Fine-tuning as users do it (issue 49: against Liger-Kernel), each of that shape, with non-reentrant
activation checkpointing and PEFT LoRA (r 16, alpha 32, on q, k, v, o and the MLP's projections;
the base weights frozen):

    teeny bench bench/hf_models.py:llama_lora --variants eager,compile-default,teeny-patch,liger

``llama_lora``, ``qwen2_lora``, ``gemma_lora`` (Gemma: GeGLU MLP, (1 + w) norms, head dim 64).
"""

import torch

BATCH, SEQ = 8, 1024


def _batch(vocab: int):
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def gpt2_small():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False
    )  # the library's defaults otherwise: 12 layers, d 768, 12 heads, 50257 tokens
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # as the README says: the model and its loss one region, for every backend
    return model, _batch(config.vocab_size)


def qwen2():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config), _batch(config.vocab_size)


def _llama_shape(family: str):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    shape = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    if family == "gemma":
        config, model_class = transformers.GemmaConfig(**shape, head_dim=64), transformers.GemmaForCausalLM
    elif family == "qwen2":
        config, model_class = transformers.Qwen2Config(**shape), transformers.Qwen2ForCausalLM
    else:
        config, model_class = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return model_class(config), _batch(config.vocab_size)


def _checkpointed_lora(family: str):
    import peft

    model, batch = _llama_shape(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    return peft.get_peft_model(model, config), batch


def llama_lora():
    return _checkpointed_lora("llama")


def qwen2_lora():
    return _checkpointed_lora("qwen2")


def gemma_lora():
    return _checkpointed_lora("gemma")
