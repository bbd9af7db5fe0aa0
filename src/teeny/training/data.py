"""Data sets that ship offline: scikit-learn's handwritten digits and a character corpus made
from the Python standard library's own source files (present on every machine), and ``shard``,
which gives each process of a data-parallel run its rows of a global batch."""

from __future__ import annotations

import math
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.extras import require


def shard(feed: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of a global batch: the ``rank``-th of ``world_size`` equal slices along
    the first dimension of every tensor. The global batches come in an order fixed by (seed,
    epoch), so each process sees a disjoint shard of every epoch fixed by (seed, epoch, rank),
    and the processes together see exactly the batches a single process would."""
    sliced = {}
    for name, t in feed.items():
        rows = t.shape[0] if t.dim() else 0
        if rows % world_size:
            raise ValueError(f"input {name!r} has {rows} rows, which do not split evenly over {world_size} processes")
        part = rows // world_size
        sliced[name] = t[rank * part : (rank + 1) * part]
    return sliced


@dataclass
class ArrayDataset:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.x)

    def batches(self, batch_size: int, generator: torch.Generator | None = None, drop_last: bool = True):
        """(x, y) batches, shuffled when a generator is given; static shapes need drop_last."""
        order = torch.randperm(len(self), generator=generator) if generator is not None else torch.arange(len(self))
        stop = len(self) - (len(self) % batch_size if drop_last else 0)
        for start in range(0, stop, batch_size):
            idx = order[start : start + batch_size]
            yield self.x[idx], self.y[idx]


def digits(split_seed: int = 0, test_fraction: float = 0.2, image: bool = False) -> tuple[ArrayDataset, ArrayDataset]:
    """The 1,797 8x8 handwritten digits of scikit-learn, scaled to [0, 1], split train/test.
    ``image=True`` gives (N, 1, 8, 8) tensors, otherwise (N, 64)."""
    bunch = require("sklearn.datasets", "the digits data set").load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    if image:
        x = x.view(-1, 1, 8, 8)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return ArrayDataset(x[train], y[train]), ArrayDataset(x[test], y[test])


class CharCorpus:
    """Characters of the standard library's ``.py`` files (sorted by path, so the corpus is the
    same on every run of one Python version), encoded with a vocabulary of printable ASCII plus
    newline; anything else maps to '?'."""

    VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self, max_chars: int = 2_000_000, val_fraction: float = 0.1):
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py") if p.is_file())
        if not files:
            raise FileNotFoundError(f"no Python source files under {root}")
        chunks, total = [], 0
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            chunks.append(text)
            total += len(text)
            if total >= max_chars:
                break
        text = "".join(chunks)[:max_chars]
        self.stoi = {c: i for i, c in enumerate(self.VOCAB)}
        unknown = self.stoi["?"]
        ids = np.fromiter((self.stoi.get(c, unknown) for c in text), dtype=np.int64, count=len(text))
        self.data = torch.from_numpy(ids)
        split = int(len(self.data) * (1 - val_fraction))
        self.train, self.val = self.data[:split], self.data[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.VOCAB)

    def encode(self, text: str) -> torch.Tensor:
        unknown = self.stoi["?"]
        return torch.tensor([self.stoi.get(c, unknown) for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.VOCAB[int(i)] for i in ids)

    def unigram_entropy(self) -> float:
        """Entropy (nats per character) of the training text's character frequencies: the loss of
        the best model that ignores context."""
        counts = Counter(self.train.tolist())
        n = sum(counts.values())
        return -sum(c / n * math.log(c / n) for c in counts.values())

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        """Random windows: inputs (B, T) and next-character targets (B, T)."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x, y
