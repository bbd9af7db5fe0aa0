"""Test samples of rotary_embedding (``teeny.ops.rotary``): odd head dims, partial rotary, one
table for every batch or one per batch, an empty batch. Only x is differentiated (cos and sin
get no gradient)."""

from __future__ import annotations

import torch

from ...ops.rotary import rotary_embedding
from ..registry import OpInfo, Sample, make, register

__all__ = ["ROTARY", "rotary_reference"]


def rotary_reference(x, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb`` on one tensor, with the columns past cos's last dim
    passed through as GPT-NeoX does."""
    rotary_dim = cos.shape[-1]
    rotated, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rotated.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((rotated * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def _samples(shapes):
    """Each shape is (batch, heads, seq, head_dim, rotary_dim, table_batch)."""

    def samples(dtype, gen):
        out = []
        for batch, heads, seq, head_dim, rotary_dim, tables in shapes:
            x = make(gen, batch, heads, seq, head_dim, dtype=dtype)
            cos, sin = (make(gen, tables, seq, rotary_dim, low=-1.0, high=1.0, dtype=dtype) for _ in range(2))
            name = f"x{(batch, heads, seq, head_dim)} cos{(tables, seq, rotary_dim)}"
            out.append(Sample((x, cos, sin), name=name, grad=(0,)))
        return out

    return samples


ROTARY = register(
    OpInfo(
        "rotary_embedding",
        rotary_embedding,
        rotary_reference,
        _samples(
            [(2, 3, 7, 10, 10, 2), (2, 3, 7, 10, 6, 1), (1, 2, 5, 6, 6, 1), (3, 1, 1, 7, 2, 3), (0, 2, 3, 4, 4, 1)]
        ),
        family="rotary",
        gradcheck_samples=lambda gen: _samples([(1, 2, 3, 6, 6, 1), (2, 1, 3, 5, 2, 2)])(torch.float64, gen),
    )
)
