"""Models that ``teeny train`` knows: an MLP and a small CNN on the digits, a character GPT on
the standard library's source. Each is a ``Module`` plus a ``Task`` that builds its training
and evaluation graphs and feeds them data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import nn, ops
from ..core import init
from ..core.graph import Graph
from ..core.module import Module, ModuleList, Parameter
from .data import CharCorpus, digits


class CausalSelfAttention(Module):
    """Multi-head causal self-attention on x (batch, length, d_model), GPT style:
    q, k, v = x W_q^T + b_q, ...; heads of size d_model / n_heads; y = attn W_o^T + b_o.
    Parameters q_proj, k_proj, v_proj, out_proj (each a teeny.nn.Linear, PyTorch's init)."""

    def __init__(self, d_model: int, n_heads: int, bias: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        if n_heads <= 0 or d_model % n_heads != 0:
            raise ValueError(f"CausalSelfAttention: d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.d_model, self.n_heads = d_model, n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, dtype=dtype)

    def forward(self, x):
        if len(x.shape) != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"CausalSelfAttention expects (batch, length, {self.d_model}), got {tuple(x.shape)}")
        batch, length, _ = x.shape
        head_dim = self.d_model // self.n_heads

        def heads(t):  # (B, T, C) -> (B, nh, T, hd)
            return ops.transpose(ops.reshape(t, (batch, length, self.n_heads, head_dim)), 1, 2)

        y = ops.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True
        )
        y = ops.reshape(ops.transpose(y, 1, 2), (batch, length, self.d_model))
        return self.out_proj(y)


class MLP(Module):
    def __init__(self, in_features: int = 64, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(ops.gelu(self.fc1(x)))


class CNN(Module):
    """conv(1->16) relu pool, conv(16->32) relu pool, linear: for 8x8 digit images."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, classes)

    def forward(self, x):
        x = ops.max_pool2d(ops.relu(self.conv1(x)), 2)
        x = ops.max_pool2d(ops.relu(self.conv2(x)), 2)
        return self.fc(ops.flatten(x, 1))


class Block(Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(ops.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(Module):
    """A small GPT: token + learned position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, vocab_size: int, block_size: int = 64, d_model: int = 64, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = Parameter((block_size, d_model), init.normal(0.02))
        self.blocks = ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        x = self.tok(idx) + idx.graph.bind_parameter(self.pos)  # (B, T, d) + (T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------------------- tasks


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(-1).cpu() == labels.cpu()).float().mean())


@dataclass
class Task:
    """What the training loop needs to know about a model and its data."""

    name: str
    model: Module
    defaults: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)  # what else defines the model (e.g. gpt's size), kept in checkpoints

    def train_graph(self, batch_size: int, dtype: torch.dtype) -> Graph:
        """The training graph: inputs x, y; the loss is its first output."""
        raise NotImplementedError

    def batches(self, epoch: int, batch_size: int, seed: int):
        """The feeds of one epoch, in an order fixed by (seed, epoch) so that a resumed run
        sees the same batches as an uninterrupted one."""
        raise NotImplementedError

    def steps_per_epoch(self, batch_size: int) -> int:
        raise NotImplementedError

    def evaluate(self, params: dict[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError


class DigitsTask(Task):
    def __init__(self, name: str, model: Module, image: bool, defaults: dict):
        super().__init__(name, model, defaults)
        self.train_set, self.test_set = digits(image=image)
        self._eval = None

    def _graph(self, batch: int, with_loss: bool, dtype=torch.float32) -> Graph:
        g = Graph(self.name)
        x = g.input("x", (batch, *self.train_set.x.shape[1:]), dtype)
        logits = self.model(x)
        if with_loss:
            y = g.input("y", (batch,), torch.int64)
            g.output(ops.cross_entropy(logits, y), logits)
        else:
            g.output(logits)
        return g

    def train_graph(self, batch_size: int, dtype: torch.dtype = torch.float32) -> Graph:
        self.model.to(dtype)
        return self._graph(batch_size, True, dtype)

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.train_set) // batch_size

    def batches(self, epoch: int, batch_size: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        for x, y in self.train_set.batches(batch_size, gen):
            yield {"x": x, "y": y}

    def evaluate(self, params):
        from ..program.executor import Executor
        from ..program.lowering import lower

        if self._eval is None:
            self._eval = Executor(lower(self._graph(len(self.test_set), False)))
        self._eval.load_params(params)
        logits = self._eval.forward({"x": self.test_set.x})
        return {"test_accuracy": accuracy(logits, self.test_set.y)}


class CharTask(Task):
    def __init__(
        self,
        corpus: CharCorpus,
        block_size: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        defaults: dict,
        eval_batches: int = 8,
    ):
        model = GPT(corpus.vocab_size, block_size, d_model, n_heads, n_layers)
        super().__init__("gpt", model, defaults)
        self.corpus, self.block_size, self.eval_batches = corpus, block_size, eval_batches
        self._eval = None
        self._sampler = None
        self.epoch_tokens = defaults.get("epoch_tokens", 200_000)

    def _graph(self, batch: int, with_loss: bool) -> Graph:
        """With the loss: inputs x, y and the loss as the only output (so that lowering can run
        the head and the loss in chunks and never keep the logits); else the logits."""
        g = Graph("gpt")
        idx = g.input("x", (batch, self.block_size), torch.int64)
        logits = self.model(idx)
        if with_loss:
            y = g.input("y", (batch, self.block_size), torch.int64)
            v = self.corpus.vocab_size
            g.output(
                ops.cross_entropy(
                    ops.reshape(logits, (batch * self.block_size, v)), ops.reshape(y, (batch * self.block_size,))
                )
            )
        else:
            g.output(logits)
        return g

    def train_graph(self, batch_size: int, dtype: torch.dtype = torch.float32) -> Graph:
        self.batch_size = batch_size
        return self._graph(batch_size, True)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, self.epoch_tokens // (batch_size * self.block_size))

    def loss_count(self, feed: dict[str, torch.Tensor]) -> int:
        """The targets the mean cross-entropy averages over (those not equal to its ignore_index)."""
        return int((feed["y"] != -100).sum())

    def batches(self, epoch: int, batch_size: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        for _ in range(self.steps_per_epoch(batch_size)):
            x, y = self.corpus.batch("train", batch_size, self.block_size, gen)
            yield {"x": x, "y": y}

    def evaluate(self, params):
        from ..program.executor import Executor
        from ..program.lowering import LoweringMode, lower

        if self._eval is None:
            self._eval = Executor(lower(self._graph(self.batch_size, True), LoweringMode.INFERENCE))
        self._eval.load_params(params)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(self.eval_batches):
            x, y = self.corpus.batch("val", self.batch_size, self.block_size, gen)
            loss = self._eval.forward({"x": x, "y": y})
            losses.append(float(loss))
        return {"val_loss": sum(losses) / len(losses), "unigram_entropy": self.corpus.unigram_entropy()}

    def sample(
        self, params, prompt: str = "def ", length: int | None = None, temperature: float = 0.8, seed: int = 0
    ) -> str:
        """Generate text one character at a time (the context is the last block_size characters,
        left-aligned; causal attention makes the padding after it irrelevant)."""
        from ..program.executor import Executor
        from ..program.lowering import lower

        if self._sampler is None:
            self._sampler = Executor(lower(self._graph(1, False)))
        self._sampler.load_params(params)
        gen = torch.Generator().manual_seed(seed)
        if length is None:  # one forward pass per character: keep the interpreter's share short
            length = 60 if self._sampler.device.type == "cpu" else 300
        ids = self.corpus.encode(prompt).tolist() or [0]
        for _ in range(length):
            context = ids[-self.block_size :]
            window = torch.zeros(1, self.block_size, dtype=torch.int64)
            window[0, : len(context)] = torch.tensor(context)
            logits = self._sampler.forward({"x": window})[0, len(context) - 1].float().cpu()
            probs = torch.softmax(logits / max(temperature, 1e-4), dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
        return self.corpus.decode(ids)


# each model's training defaults, readable without loading its data (the `teeny train --nproc`
# launcher checks the batch size against the number of processes before starting them)
DEFAULTS: dict[tuple[str, str], dict] = {
    ("mlp", "small"): dict(epochs=15, batch_size=64, lr=3e-3, optimizer="adamw", weight_decay=0.0, schedule="cosine"),
    ("cnn", "small"): dict(epochs=15, batch_size=32, lr=2e-3, optimizer="adamw", weight_decay=0.0),
    ("gpt", "small"): dict(
        epochs=5,
        batch_size=32,
        lr=3e-3,
        optimizer="adamw",
        weight_decay=0.01,
        epoch_tokens=40_000,
        clip=1.0,
        schedule="cosine",
    ),
    ("gpt", "large"): dict(
        epochs=10, batch_size=64, lr=1e-3, optimizer="adamw", weight_decay=0.01, epoch_tokens=2_000_000, clip=1.0
    ),
    ("gpt", "gpt2"): dict(
        epochs=4,
        batch_size=8,
        lr=6e-4,
        optimizer="adamw",
        weight_decay=0.1,
        epoch_tokens=2_000_000,
        clip=1.0,
        schedule="cosine",
        warmup_steps=100,
        precision="bf16-mixed",
    ),
}


def model_defaults(name: str, size: str = "small") -> dict:
    """The training defaults of built-in model ``name`` (``size`` matters for gpt only)."""
    return dict(DEFAULTS[(name, size if name == "gpt" else "small")])


# the char GPT's shape per ``--size`` (gpt2: GPT-2 small's shape on the characters)
GPT_SIZES: dict[str, dict[str, int]] = {
    "small": dict(block_size=32, d_model=48, n_heads=4, n_layers=2),
    "large": dict(block_size=128, d_model=256, n_heads=8, n_layers=4),
    "gpt2": dict(block_size=1024, d_model=768, n_heads=12, n_layers=12),
}

NAMES = ("mlp", "cnn", "gpt")  # the models make_task builds (teeny.cli lists them too, to parse without kernels)


def make_task(name: str, size: str = "small") -> Task:
    if name not in NAMES:
        raise KeyError(name)
    defaults = model_defaults(name, size)
    if name == "mlp":
        return DigitsTask("mlp", MLP(), image=False, defaults=defaults)
    if name == "cnn":
        return DigitsTask("cnn", CNN(), image=True, defaults=defaults)
    extra = {"eval_batches": 4} if size == "small" else {}
    task = CharTask(CharCorpus(), **GPT_SIZES[size], defaults=defaults, **extra)
    task.spec = {"size": size}
    return task
