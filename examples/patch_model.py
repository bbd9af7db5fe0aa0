"""Patch a PyTorch model to run on teeny's kernels, in place, and train it as before.

    PYTHONPATH=src python examples/patch_model.py

With Hugging Face transformers installed (pip install 'teeny-triton[hf]') this patches a tiny
GPT-2 built from its config (random weights, no download); otherwise a small torch.nn MLP.
The report says what was swapped, what was left to PyTorch and why.
"""

import torch

import teeny.torch


def build():
    try:
        import transformers
    except ImportError:
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
        )
        return model, lambda m, gen: torch.nn.functional.cross_entropy(
            m(torch.randn(4, 16, generator=gen)), torch.randint(0, 8, (4,), generator=gen)
        )
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)

    def loss(m, gen):
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        return m(ids, labels=ids).loss

    return model, loss


if __name__ == "__main__":
    torch.manual_seed(0)
    model, loss_of = build()
    report = teeny.torch.patch(model)  # in place: same parameters, same state_dict keys
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        optimizer.zero_grad()
        loss = loss_of(model, torch.Generator().manual_seed(0))  # one batch, learnt step by step
        loss.backward()  # teeny's backward kernels
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(report)
