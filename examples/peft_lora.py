"""Fine-tune a causal LM with PEFT LoRA adapters, the forward and backward run by teeny's kernels.

    .venv/bin/python examples/peft_lora.py                # CPU: a tiny Llama, torch.compile(backend="teeny")
    .venv/bin/python examples/peft_lora.py --teeny patch  # the same through teeny.torch.patch
    .venv/bin/python examples/peft_lora.py --teeny off    # plain PyTorch, to compare
    PYTHONPATH=src python3 examples/peft_lora.py --model HuggingFaceTB/SmolLM2-135M --steps 50  # GPU

(``.venv``: ``make install``, teeny with its ``[examples]`` extra, as ``make test`` makes it. On the
GPU machine, with torch, triton, transformers and peft installed, run from the source tree.)

``peft.get_peft_model`` freezes the model's weights and adds small trainable LoRA matrices
(``lora_A``, ``lora_B``) beside every linear layer but the LM head. Either of teeny's two paths
then runs the model, adapters included:

* ``model.compile(backend="teeny")`` (``torch.compile`` in place; the default here): the whole
  forward and loss, adapters and all, become one teeny program per input shape, with teeny's
  fusions (RMSNorm, rotary embedding, SwiGLU as single ops). Shapes are static: pad batches to a
  fixed length, or each new length builds a new program.
* ``teeny.torch.patch(model)``: swaps the layers for teeny's drop-ins in place, no compiler; any
  shape runs at once, and the LM head and its loss become one chunked op that never stores the
  logits. A LoRA adapter is never bypassed: a fused call that would read the weight of a layer
  with an adapter runs as that layer's calls instead, and the report printed at the end says so.

Pick ``compile`` when batches have one fixed length (a step is one program), ``patch`` when
lengths vary or the vocabulary is large (nothing to build per shape; no logits stored). Both give
the losses of plain PyTorch. Only the adapters train: ``main`` checks that every LoRA matrix has a
gradient and changed, that no base weight has a gradient or changed, and returns the losses.
Without ``--model`` the base model is a randomly initialised Llama (nothing is downloaded); the
data counts up from a random token, modulo the vocabulary, which any vocabulary can learn.
"""

import teeny.torch  # noqa: I001  (first: on a CPU, teeny picks the Triton interpreter)
import argparse
import warnings

import peft
import torch
import transformers
from teeny.torch import backend

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
GPU = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16)


def base_model(name: str | None, tiny: bool):
    """A pretrained causal LM by name, else a randomly initialised Llama (``TINY`` or ``GPU`` sized)."""
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name)
    sizes = TINY if tiny else GPU
    config = transformers.LlamaConfig(**sizes, num_key_value_heads=sizes["num_attention_heads"] // 2, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teeny", choices=["compile", "patch", "off"], default="compile")
    parser.add_argument("--model", help="a pretrained model to fine-tune (default: a random Llama)")
    parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available())
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, seq = (2, 16) if args.tiny else (8, 512)

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft's, not ours
    torch.manual_seed(0)
    model = base_model(args.model, args.tiny).to(device)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")  # not the head
    model = peft.get_peft_model(model, lora)
    model.print_trainable_parameters()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    if args.teeny == "compile":
        model.compile(backend="teeny")  # in place: still a PeftModel (save_pretrained writes the adapters)
    elif args.teeny == "patch":
        report = teeny.torch.patch(model)  # in place: still a PeftModel

    vocab = model.config.vocab_size
    starts = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(0))
    ids = ((starts + torch.arange(seq)) % vocab).to(device)
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2 if args.tiny else 1e-4)
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda" and not args.tiny):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}")

    # only the adapters trained: each LoRA matrix has a gradient and changed, no base tensor did
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        if name in trainable:
            assert "lora_" in name and changed and p.grad.abs().sum() > 0, f"{name} did not train"
        else:
            assert p.grad is None and not changed, f"{name} is frozen but changed"
    print(f"{len(trainable)} LoRA matrices trained, the {len(before) - len(trainable)} base tensors untouched")
    if args.teeny == "compile":
        print(backend.report())  # what ran in teeny, and what PyTorch ran
    elif args.teeny == "patch":
        print(report)  # what was swapped, what was left to PyTorch, and the calls PyTorch ran
    return losses


if __name__ == "__main__":
    main()
