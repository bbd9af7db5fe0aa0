"""Train a Hugging Face causal LM with the Hugging Face ``Trainer``, its steps run by teeny's kernels.

    .venv/bin/python examples/hf_trainer.py               # CPU: a tiny Llama, 3 steps
    .venv/bin/python examples/hf_trainer.py --eager       # the same run without teeny, to compare
    PYTHONPATH=src python3 examples/hf_trainer.py         # GPU: 8 layers, d 1024, bf16 autocast

(``.venv``: ``make install``, teeny with its ``[examples]`` extra, as ``make test`` makes it. On the
GPU machine, with torch, triton, transformers and accelerate installed, run from the source tree.)

Two arguments make the ``Trainer`` run on teeny: ``TrainingArguments(torch_compile=True,
torch_compile_backend="teeny")``. The ``Trainer`` hands the name to accelerate, which compiles the
model with ``torch.compile(model, backend="teeny")`` when it prepares it; ``trainer.model`` stays
the ``LlamaForCausalLM`` it was given (what it saves), so the optimizer, gradient accumulation,
clipping, logging and checkpoints work unchanged. The regions ``torch.compile`` captures run as
teeny programs (forward kernels, and backward kernels paired with them); what teeny has no op for
runs in PyTorch, and ``teeny.torch.backend.report()`` says which is which.

accelerate accepts only the backends of its own list (``DynamoBackend``): ``import teeny.torch``
(here: the first line, ``from teeny.torch import backend``) adds "teeny" to it, before the
``Trainer`` is built. Without that import accelerate refuses the name (``'TEENY' is not a valid
DynamoBackend``). ``model.compile(backend="teeny")`` before handing the model over does the same
without accelerate's list.

Gradient accumulation works as in eager mode: with ``gradient_accumulation_steps=2`` the logged
losses are the same as those of the same run without teeny (``--eager``; tests/test_examples.py
checks it on the CPU). The data is synthetic and learnable: each row counts up from a random token,
modulo the vocabulary, so the loss falls from ln(vocabulary) within a few steps. ``main`` returns
the logged losses, one per optimizer step.
"""

from teeny.torch import backend  # noqa: I001  (first: on a CPU, teeny picks the Triton interpreter; and accelerate learns "teeny")
import argparse
import tempfile

import torch
import transformers

# the Llama of the compile-backend issue (about 160M parameters) and a CPU-sized one
GPU = dict(layers=8, dim=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000, seq=1024, batch=8, steps=20)
TINY = dict(layers=1, dim=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq=16, batch=2, steps=3)


def counting_rows(count: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """``count`` training rows: token ids counting up from a random start (the labels: themselves,
    the model shifts them)."""
    starts = torch.randint(0, vocab, (count, 1), generator=torch.Generator().manual_seed(seed))
    ids = (starts + torch.arange(seq)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available())
    parser.add_argument("--eager", action="store_true", help="run without teeny (the reference)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 3 tiny, 20 on the GPU)")
    args = parser.parse_args(argv)
    size = TINY if args.tiny else GPU
    steps = args.steps or size["steps"]

    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["dim"], intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        max_position_embeddings=size["seq"], use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)  # random weights, nothing downloaded

    accumulation = 2
    rows = counting_rows(steps * accumulation * size["batch"], size["seq"], size["vocab"])
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=size["batch"],
            gradient_accumulation_steps=accumulation, learning_rate=1e-2 if args.tiny else 1e-3,
            bf16=not args.tiny, dataloader_pin_memory=not args.tiny, seed=0,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            torch_compile=not args.eager, torch_compile_backend=None if args.eager else "teeny",
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=training, train_dataset=rows)
        trainer.train()

    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print("losses:", ", ".join(f"{loss:.4f}" for loss in losses))
    if not args.eager:
        print(backend.report())
    return losses


if __name__ == "__main__":
    main()
