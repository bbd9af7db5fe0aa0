"""Whole models built from teeny ops against the same models in PyTorch: identical weights and
inputs must give the same loss and the same gradient for every parameter."""

import math

import torch
import torch.nn.functional as F

from helpers import train_step
from teeny import Graph, LoweringMode, lower, ops
from teeny.training.data import CharCorpus, digits
from teeny.training.models import CNN, GPT


def _teeny_grads(model, feeds, build):
    g = Graph()
    g.output(build(g, model))
    step = train_step(lower(g, LoweringMode.TRAINING), feeds)
    return step.executor, step.out


def _load(ref: torch.nn.Module, params: dict):
    state = ref.state_dict()
    missing = set(state) - set(params)
    assert not missing, f"teeny has no parameters {missing}"
    ref.load_state_dict({k: params[k].detach().cpu().clone() for k in state})


def _compare(ex, ref, loss, ref_loss, atol=1e-5, rtol=1e-4):
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=atol, rtol=rtol)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            ex.grads[name].cpu(), p.grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


class TorchCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def test_cnn_gradients_match_pytorch():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(5, 1, 8, 8, generator=gen)
    y = torch.randint(10, (5,), generator=gen)

    def build(g, model):
        xs = g.input("x", (5, 1, 8, 8))
        ys = g.input("y", (5,), torch.int64)
        return ops.cross_entropy(model(xs), ys)

    ex, loss = _teeny_grads(CNN(), {"x": x, "y": y}, build)
    ref = TorchCNN()
    _load(ref, ex.params)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    _compare(ex, ref, loss, ref_loss)


class TorchBlock(torch.nn.Module):
    """The same pre-norm transformer block as teeny.training.models.Block, in PyTorch."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.attn, name, torch.nn.Linear(d, d))
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.proj = torch.nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, d = x.shape
        q, k, v = (getattr(self.attn, n)(x) for n in ("q_proj", "k_proj", "v_proj"))
        q, k, v = (t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn.out_proj(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    def __init__(self, vocab, block, d, heads, layers):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(block, d))
        self.blocks = torch.nn.ModuleList(TorchBlock(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def test_transformer_gradients_match_pytorch():
    vocab, block, d, heads = 13, 7, 12, 3
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(vocab, (2, block), generator=gen)
    tgt = torch.randint(vocab, (2, block), generator=gen)
    model = GPT(vocab, block, d, heads, n_layers=1)

    def build(g, model):
        xs = g.input("x", (2, block), torch.int64)
        ys = g.input("y", (2, block), torch.int64)
        logits = model(xs)
        return ops.cross_entropy(ops.reshape(logits, (2 * block, vocab)), ops.reshape(ys, (2 * block,)))

    ex, loss = _teeny_grads(model, {"x": idx, "y": tgt}, build)
    ref = TorchGPT(vocab, block, d, heads, 1)
    _load(ref, ex.params)
    ref_loss = F.cross_entropy(ref(idx).reshape(-1, vocab), tgt.reshape(-1))
    ref_loss.backward()
    _compare(ex, ref, loss, ref_loss)


def test_digits_data():
    train, test = digits()
    assert len(train) + len(test) == 1797 and train.x.shape[1] == 64
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    img_train, _ = digits(image=True)
    assert img_train.x.shape[1:] == (1, 8, 8)
    batches = list(train.batches(100, torch.Generator().manual_seed(0)))
    assert len(batches) == len(train) // 100 and batches[0][0].shape == (100, 64)


def test_char_corpus_is_offline_and_deterministic():
    a, b = CharCorpus(max_chars=50_000), CharCorpus(max_chars=50_000)
    assert torch.equal(a.data, b.data) and len(a.data) == 50_000
    assert a.decode(a.encode("def f(x):\n")) == "def f(x):\n"
    h = a.unigram_entropy()
    assert 2.0 < h < math.log(a.vocab_size)
    x, y = a.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
