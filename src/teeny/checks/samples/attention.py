"""Test samples of ``scaled_dot_product_attention`` and its PyTorch reference: PyTorch's own
attention, or, with dropout (which PyTorch cannot reproduce), PyTorch's softmax weights times the
mask of teeny's Philox counters, recomputed here in numpy (``philox_reference``)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...core.common import keep_threshold, mix_seed
from ...ops.attention import scaled_dot_product_attention
from ...ops.attention.layout import attention_layout
from ..registry import OpInfo, Sample, make, register

__all__ = ["dropout_keep_reference", "philox_reference", "reference"]


def philox_reference(seed: int, offsets: np.ndarray) -> np.ndarray:
    """``philox_keep``'s draw (uint32) for int64 ``offsets``, computed in numpy: the tests'
    independent account of the dropout mask."""
    low = np.uint64(0xFFFFFFFF)
    c0 = offsets.astype(np.uint64) & low
    c1 = offsets.astype(np.uint64) >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        prod_a, prod_b = round_a * c0, round_b * c2
        c0, c1, c2, c3 = (
            (prod_b >> np.uint64(32)) ^ c1 ^ k0,
            prod_b & low,
            (prod_a >> np.uint64(32)) ^ c3 ^ k1,
            prod_a & low,
        )
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0


def dropout_keep_reference(seed: int, n_bh: int, q_len: int, k_len: int, p: float) -> torch.Tensor:
    """The (n_bh, Lq, Lk) keep mask of a run whose step seed is ``seed``."""
    offsets = np.arange(n_bh * q_len * k_len, dtype=np.int64)
    keep = philox_reference(seed, offsets).astype(np.int64) >= keep_threshold(p)
    return torch.from_numpy(keep).reshape(n_bh, q_len, k_len)


def reference(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    seed=None,
    fixed_mask=False,
):
    """PyTorch's attention; with dropout (which PyTorch cannot reproduce) the softmax weights
    are computed by PyTorch and multiplied by the mask of teeny's counters (first run)."""
    if dropout_p == 0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    layout = attention_layout([query.shape, key.shape, value.shape], None, enable_gqa=enable_gqa)
    if layout.kv_group > 1:
        key = key.repeat_interleave(layout.kv_group, -3)
        value = value.repeat_interleave(layout.kv_group, -3)
    c = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-2, -1) * c
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if is_causal:
        causal = torch.ones(layout.q_len, layout.k_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    weights = torch.softmax(scores, dim=-1).expand(layout.batch + (layout.q_len, layout.k_len))
    keep = dropout_keep_reference(mix_seed(seed, 0), layout.n_bh, layout.q_len, layout.k_len, dropout_p)
    z = keep.reshape(weights.shape).to(weights) / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(weights)
    return (weights * z) @ value


def _qkv(gen, dtype, batch, lq, lk, d, dv=None, kv_batch=None):
    dv = d if dv is None else dv
    kv_batch = batch if kv_batch is None else kv_batch
    return (
        make(gen, *batch, lq, d, dtype=dtype),
        make(gen, *kv_batch, lk, d, dtype=dtype),
        make(gen, *kv_batch, lk, dv, dtype=dtype),
    )


def _samples(dtype, gen):
    def sample(name, args, reduction, **kwargs):
        return Sample(args, kwargs, name=name, grad=(0, 1, 2), reduction=reduction)

    return [
        sample("(1,2,7,5)", _qkv(gen, dtype, (1, 2), 7, 7, 5), 7),
        sample("(2,3,13,8) causal", _qkv(gen, dtype, (2, 3), 13, 13, 8), 13, is_causal=True),
        sample("(2,1,5,9) Lq<Lk causal", _qkv(gen, dtype, (2, 1), 5, 9, 6), 9, is_causal=True),
        sample("(1,2,9,5) Lq>Lk causal", _qkv(gen, dtype, (1, 2), 9, 5, 3), 9, is_causal=True),
        sample(
            "(2,2,7,13) mask (7,13) scale",
            _qkv(gen, dtype, (2, 2), 7, 13, 4),
            13,
            attn_mask=make(gen, 7, 13, dtype=dtype),
            scale=0.3,
        ),
        sample("(3,11,7) 3-D Dv!=D", _qkv(gen, dtype, (3,), 11, 11, 7, dv=5), 11),
        sample("gqa (1,4,5,6)/(1,2,7,6)", _qkv(gen, dtype, (1, 4), 5, 7, 6, kv_batch=(1, 2)), 14, enable_gqa=True),
        sample(
            "bool mask (2,1,5,1)",
            _qkv(gen, dtype, (2, 3), 5, 5, 4),
            5,
            attn_mask=torch.rand(2, 1, 5, 1, generator=gen) > 0.3,
        ),
        sample("k, v (6,3) broadcast over (2,3) heads", _qkv(gen, dtype, (2, 3), 5, 6, 3, kv_batch=()), 30),
        sample("q (5,4) broadcast over k, v (2,2)", _qkv(gen, dtype, (), 5, 6, 4, kv_batch=(2, 2)), 6),
        sample(
            "dropout 0.3 causal",
            _qkv(gen, dtype, (2, 2), 9, 9, 4),
            9,
            dropout_p=0.3,
            is_causal=True,
            seed=7,
            fixed_mask=True,
        ),
        sample("(1,1,1,1)", _qkv(gen, dtype, (1, 1), 1, 1, 1), 1),
        sample("empty batch (0,2,7,5)", _qkv(gen, dtype, (0, 2), 7, 7, 5), 7),
    ]


def _gradcheck_samples(gen):
    dt = torch.float64

    def sample(name, args, **kwargs):
        return Sample(args, kwargs, name=name, grad=(0, 1, 2))

    return [
        sample("(1,1,3,4) causal Lq<Lk", _qkv(gen, dt, (1, 1), 3, 4, 2), is_causal=True),
        sample(
            "k, v broadcast over batch, causal Lq>Lk", _qkv(gen, dt, (2, 1), 4, 3, 2, kv_batch=(1,)), is_causal=True
        ),
        sample("(1,3,4) 3-D mask scale", _qkv(gen, dt, (1,), 3, 4, 2), attn_mask=make(gen, 3, 4, dtype=dt), scale=0.7),
        sample("bool mask, negative scale", _qkv(gen, dt, (1,), 3, 4, 2), attn_mask=make(gen, 3, 4) > -1, scale=-0.6),
        sample("gqa", _qkv(gen, dt, (1, 2), 2, 3, 2, kv_batch=(1, 1)), enable_gqa=True),
        sample("dropout", _qkv(gen, dt, (1, 1), 3, 3, 2), dropout_p=0.4, seed=3, fixed_mask=True),
    ]


register(
    OpInfo(
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        reference,
        _samples,
        family="attention",
        gradcheck_samples=_gradcheck_samples,
        notes="fused flash-style; saves output and logsumexp only; dropout mask from Philox counters",
    )
)
