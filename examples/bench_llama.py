"""A Llama from transformers' config (random weights, no download) for ``teeny bench``.

    teeny bench examples/bench_llama.py:make_model --steps 5            # tiny: seconds on a CPU
    teeny bench examples/bench_llama.py:make_gpu_model --steps 20       # 8 layers, d 1024: a GPU

``make_model()`` is tiny by default; each size can be changed by an environment variable
(``BENCH_LLAMA_LAYERS=4 BENCH_LLAMA_SEQ=256 teeny bench ...``): ``LAYERS``, ``DIM``, ``HEADS``,
``KV_HEADS``, ``FFN``, ``VOCAB``, ``BATCH``, ``SEQ``, each prefixed ``BENCH_LLAMA_``.
``make_gpu_model()`` is 8 layers, d 1024, 16 query / 4 key-value heads (GQA), ffn 2816, vocabulary
32000, batch 8 x 1024 (about 160M parameters), the same variables overriding it.

Copy this file for your own model: ``make_model()`` returns the model, one example batch
(``model(**batch)``'s keyword arguments) and, optionally, ``loss_fn(model, batch)``; without it the
loss is the output's ``.loss`` (a Hugging Face model called with ``labels=``) or its first item.
"""

import os

import torch

TINY = dict(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, vocab=128, batch=2, seq=32)
GPU = dict(layers=8, dim=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000, batch=8, seq=1024)


def llama(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, batch: int, seq: int):
    """A ``LlamaForCausalLM`` of these sizes and a batch of random token ids (its own labels)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _sizes(defaults: dict[str, int]) -> dict[str, int]:
    return {key: int(os.environ.get(f"BENCH_LLAMA_{key.upper()}", value)) for key, value in defaults.items()}


def make_model():
    """A tiny Llama (2 layers, d 64) and a 2 x 32 batch: the CPU size."""
    return llama(**_sizes(TINY))


def make_gpu_model():
    """An 8-layer, d-1024 Llama with GQA and a 8 x 1024 batch: the GPU size."""
    return llama(**_sizes(GPU))
