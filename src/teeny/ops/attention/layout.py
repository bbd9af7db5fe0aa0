"""How the attention kernels index one call (``AttentionLayout``): the batch dims of q, k, v and
the mask merged into two levels (outer, head) with an element stride per operand (0 along
broadcast dims), the row strides, and the strides of the gradients. Three layouts of the
inputs: (..., heads, length, dim) tensors (``attention_layout``); (batch, length, heads, dim)
ones read and written in place of the transposes around them (``attention_layout_blhd``, which
``fusions.attention_layout.attention_in_place`` makes); q, k and v packed in one
(batch, length, 3 * heads * dim) tensor (``attention_layout_packed``, which
``fusions.qkv_products.fuse_qkv_products`` makes)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = [
    "AttentionLayout",
    "attention_layout",
    "attention_layout_blhd",
    "attention_layout_packed",
    "heads_second",
    "packed_parts",
]


@dataclass(frozen=True)
class AttentionLayout:
    """How the kernels index one call. ``batch``: the broadcast batch dims of the output;
    ``kv_batch``: those of the key/value gradients (the head dim divided by ``kv_group``). The
    kernels see them as ``n_outer`` x ``n_heads`` (query) heads; ``strides`` are the per-operand
    element strides of those two levels (q, k, v, mask, out and dout) with the mask's along
    queries and keys and the row strides (``Q_ROW``, ...), which every kernel takes;
    ``grad_strides`` those of dq, dk and dv, which one backward kernel each takes."""

    batch: tuple[int, ...]
    kv_batch: tuple[int, ...]
    n_outer: int
    n_heads: int
    kv_group: int
    q_len: int
    k_len: int
    d: int
    dv: int
    strides: dict[str, int]
    grad_strides: dict[str, int]

    @property
    def n_bh(self) -> int:
        return self.n_outer * self.n_heads


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise ValueError(
            f"the batch dims of query, key and value are not broadcastable: {', '.join(map(str, shapes))} "
            "(pass enable_gqa=True for fewer key/value heads)"
        ) from None


def _batch_strides(shape: tuple[int, ...], batch: tuple[int, ...], tail: int) -> list[int]:
    """Element strides, over the ``batch`` dims, of a contiguous tensor whose leading dims
    ``shape`` broadcast to ``batch`` and whose trailing dims hold ``tail`` elements (0 where
    broadcast)."""
    padded = (1,) * (len(batch) - len(shape)) + tuple(shape)
    strides, step = [0] * len(batch), tail
    for i in reversed(range(len(batch))):
        strides[i] = step if padded[i] != 1 else 0
        step *= padded[i]
    return strides


def attention_layout(shapes: list, mask_shape, *, enable_gqa: bool) -> AttentionLayout:
    """The layout of q, k, v (and mask) shapes; ValueError naming what does not fit."""
    q, k, v = (tuple(s) for s in shapes[:3])
    for what, shape in (("query", q), ("key", k), ("value", v)):
        if len(shape) < 2:
            raise ValueError(f"{what} must have at least 2 dimensions (length, head dim), got shape {shape}")
    if q[-1] != k[-1]:
        raise ValueError(f"query and key must have the same head dim (last dim), got query {q} and key {k}")
    if k[-2] != v[-2]:
        raise ValueError(f"key and value must have the same length (dim -2), got key {k} and value {v}")
    qb, kb, vb = q[:-2], k[:-2], v[:-2]
    kv_group = 1
    if qb and kb and vb and (kb[-1] != qb[-1] or vb[-1] != qb[-1]):
        heads, kv_heads = qb[-1], kb[-1]
        shared = kv_heads == vb[-1] and kv_heads > 0 and heads % kv_heads == 0
        if enable_gqa and not shared:
            raise ValueError(
                f"enable_gqa: key/value heads (dim -3) must be equal and divide the query heads, "
                f"got query {q}, key {k} and value {v}"
            )
        if shared and (enable_gqa or kv_heads == 1):  # read each key/value head in place for its group
            kv_group = heads // kv_heads
            kb, vb = kb[:-1] + (heads,), vb[:-1] + (heads,)
    batch = _broadcast([qb, kb, vb])
    lq, lk, d, dv = q[-2], k[-2], q[-1], v[-1]
    operands = [
        _batch_strides(qb, batch, lq * d),
        _batch_strides(k[:-2], batch, lk * d),
        _batch_strides(v[:-2], batch, lk * dv),
    ]
    if kv_group > 1:  # key/value head dim: one stride per key/value head, indexed by h // kv_group
        operands[1][-1], operands[2][-1] = lk * d, lk * dv
    mask_q = mask_k = 0
    if mask_shape is not None:
        mask = tuple(mask_shape)
        target = batch + (lq, lk)
        padded = (1,) * (len(target) - len(mask)) + mask
        if len(mask) > len(target) or any(m not in (1, t) for m, t in zip(padded, target)):
            raise ValueError(
                f"attn_mask of shape {mask} is not broadcastable to {target} (batch..., query length, key length)"
            )
        mask_k = 1 if padded[-1] != 1 else 0
        mask_q = padded[-1] if padded[-2] != 1 else 0
        operands.append(_batch_strides(padded[:-2], batch, padded[-2] * padded[-1]))
    levels = _index_levels(batch, operands, keep_heads=kv_group > 1)
    if len(levels) > 2:
        raise ValueError(
            f"the batch dims {batch} broadcast in a pattern the attention kernels cannot index "
            f"(more than two independent levels); shapes {', '.join(map(str, shapes))}"
        )
    (n_outer, outer), (n_heads, inner) = ([(1, [0] * len(operands))] * (2 - len(levels))) + levels
    names = ("q", "k", "v", "mask")
    strides = {f"{names[i]}_stride_b": outer[i] for i in range(len(operands))}
    strides.update({f"{names[i]}_stride_h": inner[i] for i in range(len(operands))})
    strides.setdefault("mask_stride_b", 0)
    strides.setdefault("mask_stride_h", 0)
    strides.update(mask_stride_q=mask_q, mask_stride_k=mask_k)
    kv_batch = batch[:-1] + (batch[-1] // kv_group,) if kv_group > 1 else batch
    # out, dout, dq, dk and dv are contiguous: (n_outer, n_heads or n_heads / kv_group, length, dim)
    strides.update(o_stride_b=n_heads * lq * dv, o_stride_h=lq * dv, Q_ROW=d, K_ROW=d, V_ROW=dv, O_ROW=dv)
    n_kv = n_heads // kv_group
    grad_strides = dict(
        dq_stride_b=n_heads * lq * d,
        dq_stride_h=lq * d,
        dk_stride_b=n_kv * lk * d,
        dk_stride_h=lk * d,
        dv_stride_b=n_kv * lk * dv,
        dv_stride_h=lk * dv,
    )
    return AttentionLayout(batch, kv_batch, n_outer, n_heads, kv_group, lq, lk, d, dv, strides, grad_strides)


def heads_second(shape) -> tuple[int, ...]:
    """(batch, length, heads, dim) -> (batch, heads, length, dim)."""
    b, length, h, d = shape
    return (b, h, length, d)


def attention_layout_blhd(shapes: list, mask_shape, *, enable_gqa: bool) -> AttentionLayout:
    """The layout of q (B, Lq, H, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, DV), each contiguous
    (what reshape(linear(x), (B, L, H, D)) makes, before the transpose to (B, H, L, D) that this
    layout saves), and the mask broadcastable to (B, H, Lq, Lk). The output is (B, Lq, H, DV)."""
    for what, shape in zip(("query", "key", "value"), shapes[:3]):
        if len(shape) != 4:
            raise ValueError(f"{what}: the (batch, length, heads, dim) layout takes 4-D tensors, got shape {shape}")
    q, k, v = (tuple(s) for s in shapes[:3])
    if not q[0] == k[0] == v[0]:
        raise ValueError(f"the (batch, length, heads, dim) layout needs one batch size, got {q}, {k} and {v}")
    logical = attention_layout([heads_second(s) for s in (q, k, v)], mask_shape, enable_gqa=enable_gqa)  # the checks
    (b, lq, h, d), (_, lk, hkv, _), dv = q, k, v[-1]
    strides = dict(
        q_stride_b=lq * h * d,
        q_stride_h=d,
        k_stride_b=lk * hkv * d,
        k_stride_h=d,  # query head h reads key/value head h // kv_group
        v_stride_b=lk * hkv * dv,
        v_stride_h=dv,
        o_stride_b=lq * h * dv,
        o_stride_h=dv,
        Q_ROW=h * d,
        K_ROW=hkv * d,
        V_ROW=hkv * dv,
        O_ROW=h * dv,
        mask_stride_q=logical.strides["mask_stride_q"],
        mask_stride_k=logical.strides["mask_stride_k"],
        mask_stride_b=0,
        mask_stride_h=0,
    )
    if mask_shape is not None:
        padded = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
        mask_b, mask_h = _batch_strides(padded[:2], (b, h), padded[2] * padded[3])
        strides.update(mask_stride_b=mask_b, mask_stride_h=mask_h)
    grad_strides = dict(
        dq_stride_b=strides["q_stride_b"],
        dq_stride_h=d,
        dk_stride_b=strides["k_stride_b"],
        dk_stride_h=d,
        dv_stride_b=strides["v_stride_b"],
        dv_stride_h=dv,
    )
    group = logical.kv_group
    return AttentionLayout((b, h), (b, h // group), b, h, group, lq, lk, d, dv, strides, grad_strides)


def attention_layout_packed(qkv_shape, *, heads: int, mask_shape) -> AttentionLayout:
    """The layout of q, k and v packed in one (B, L, 3 * H * D) tensor, as one product of the
    three projections writes them (``fusions.qkv_products.fuse_qkv_products``): q, k, v are its three
    column blocks, (B, L, H, D) each with rows 3 * H * D apart, and the (B, L, 3 * H * D)
    gradient holds dq, dk, dv the same way. The output is (B, L, H, D)."""
    if len(qkv_shape) != 3:
        raise ValueError(f"packed q, k, v: expected a (batch, length, 3 * heads * dim) tensor, got {tuple(qkv_shape)}")
    b, length, width = qkv_shape
    if heads <= 0 or width % (3 * heads):
        raise ValueError(f"packed q, k, v: the last dim {width} is not 3 x heads ({heads}) x head dim")
    d = width // (3 * heads)
    layout = attention_layout_blhd([(b, length, heads, d)] * 3, mask_shape, enable_gqa=False)
    rows = dict(Q_ROW=width, K_ROW=width, V_ROW=width)
    batch = {f"{x}_stride_b": length * width for x in ("q", "k", "v")}
    grads = {f"d{x}_stride_b": length * width for x in ("q", "k", "v")}
    return replace(layout, strides={**layout.strides, **rows, **batch}, grad_strides={**layout.grad_strides, **grads})


def packed_parts(qkv: torch.Tensor | None) -> tuple:
    """q, k and v (or dq, dk and dv): the three column blocks of a packed tensor, as views."""
    if qkv is None:
        return None, None, None
    third = qkv.shape[-1] // 3
    return qkv[..., :third], qkv[..., third : 2 * third], qkv[..., 2 * third :]


def _index_levels(batch, operands, *, keep_heads: bool) -> list[tuple[int, list[int]]]:
    """The batch dims merged into as few (size, per-operand stride) levels as the operands'
    strides allow (neighbours merge when, for every operand, outer stride = inner stride x
    inner size); ``keep_heads`` keeps the last dim (the query heads) a level of its own."""
    levels: list[tuple[int, list[int]]] = []
    last = len(batch) - 1
    for i, size in enumerate(batch):
        if size == 1 and not (keep_heads and i == last):
            continue
        strides = [op[i] for op in operands]
        mergeable = levels and not (keep_heads and i == last)
        if mergeable and all(outer == inner * size for outer, inner in zip(levels[-1][1], strides)):
            levels[-1] = (levels[-1][0] * size, strides)
        else:
            levels.append((size, strides))
    return levels
