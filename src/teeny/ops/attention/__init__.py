"""Attention: fused (flash-style) scaled dot-product attention, forward and backward.

For one head, with queries q (Lq, D), keys k (Lk, D), values v (Lk, Dv), scale c (default
1/sqrt(D)), an optional mask and attention dropout with probability p:

    S = c q k^T + B        B: the additive float mask, or 0 / -inf from a boolean mask and from
                           causal masking (top-left aligned: query i sees keys j <= i)
    P = softmax(S) row-wise,   lse = logsumexp(S) row-wise
    Z = keep / (1 - p)     keep ~ Bernoulli(1 - p) per (head, query, key), from Philox counters
    O = (P * Z) V

and backward, with delta = rowsum(dO * O) (which equals rowsum(P * dP), dropout or not):

    dV = (P * Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - delta),   dQ = c dS K,   dK = c dS^T Q

A query row that can see no key at all (every key masked) gets output 0 and gradient 0, as in
PyTorch's fused kernels (softmax over nothing is taken as all-zero weights, lse = -inf).

The files, in the order a call goes through them:

    ops.py      ``scaled_dot_product_attention`` (the functional op) and ``AttentionOp``, which
                checks shapes, saves lse (and the dropout seed) and builds the launches
    layout.py   ``AttentionLayout``: the strides the kernels index q, k, v, the mask and the
                gradients with, for (..., heads, length, dim), (batch, length, heads, dim) and
                packed q, k, v inputs
    tuning.py   the tiles of each kernel (measured tables per dtype and head dim) and their choice
    kernels.py  the forward kernel and the two backward kernels (tiling and memory traffic first)

Test samples and the PyTorch reference: ``teeny.checks.samples.attention``. The rewrites that
change the layout: ``teeny.fusions.attention_layout`` and ``teeny.fusions.qkv_products``.
"""

from .ops import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention"]
NN_LAYERS: list[str] = []  # no layer: models call the functional op
