"""``AttentionOp``, the ``RuntimeOp`` that plans the launches of the attention kernels (forward;
dq then dk/dv backward; sums of broadcast operands' gradients), and the functional op
``scaled_dot_product_attention``. Attention adds no layer of its own (``NN_LAYERS`` is empty): a
model's attention block (``teeny.training.models.CausalSelfAttention``) calls the functional op."""

from __future__ import annotations

import itertools
import math

import torch

from ...core import config as teeny_config
from ...core.common import (
    DOT_UPCAST_BF16,
    acc_dtype,
    cdiv,
    keep_threshold,
    mix_seed,
    sum_to_shape,
    tl_acc_dtype,
)
from ...core.graph import graph_of
from ...core.runtime import ArgVisitor, Block, Launch, RuntimeOp
from ..products.kernels import IEEE, dot_precision
from .kernels import attention_backward_dkdv, attention_backward_dq, attention_forward
from .layout import AttentionLayout, attention_layout, attention_layout_blhd, attention_layout_packed, packed_parts
from .tuning import AttentionTiles, attention_tiles, head_blocks

__all__ = ["AttentionOp", "scaled_dot_product_attention"]

_trace_seeds = itertools.count()


class AttentionOp(RuntimeOp):
    """Fused attention; inputs q, k, v[, mask]; saves the inputs, the output, lse2 and, with
    dropout, the seed of the run's mask (``extra_outputs``), as dropout does: every forward run
    draws a new mask (the k-th run of a node with base seed s always the same one), and a
    backward regenerates the mask of the forward that made its cache. ``layout="blhd"``: q, k, v
    and the output are (batch, length, heads, dim) (``attention_layout_blhd``; the rewrite
    ``fusions.attention_layout.attention_in_place`` makes it of the transposes around an
    attention). ``layout="packed"``: one input holds q, k and v, (batch, length, 3 * heads * dim),
    and the output is (batch, length, heads, dim) (``attention_layout_packed``, ``heads`` given;
    the rewrite ``fusions.qkv_products.fuse_qkv_products`` makes it of one product for the three).
    Every argument is keyword-only: the rewrites rebuild an op from another's fields."""

    name = "scaled_dot_product_attention"
    kernel = attention_forward
    saves_inputs = True
    saves_output = True

    def __init__(
        self,
        *,
        has_mask: bool,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        dropout_p: float = 0.0,
        seed: int = 0,
        fixed_mask: bool = False,
        layout: str = "bhld",
        heads: int = 0,
    ):
        if layout not in ("bhld", "blhd", "packed"):
            raise ValueError(f"attention layout must be 'bhld', 'blhd' or 'packed', got {layout!r}")
        if (layout == "packed") != (heads > 0):
            raise ValueError("attention: the packed layout, and only it, takes heads=")
        self.layout, self.heads = layout, heads
        self.has_mask, self.is_causal, self.user_scale, self.enable_gqa = has_mask, is_causal, scale, enable_gqa
        self.n_qkv = 1 if layout == "packed" else 3  # inputs holding q, k and v; the mask follows
        self.n_activation_inputs = self.n_qkv + 1 if has_mask else self.n_qkv
        self.differentiable_inputs = tuple(range(self.n_qkv))
        self.dropout_p, self.seed, self.fixed_mask = float(dropout_p), int(seed), bool(fixed_mask)
        self.allow_tf32 = teeny_config.allow_tf32  # read at trace time
        self.capturable = self.dropout_p == 0.0  # the per-run seed comes from the host
        self.runs = 0  # forward runs so far: the step of the next dropout mask
        self.seed_chosen = True  # False: ``seed`` came from the trace-time counter
        self.torch_rng = False  # True: each run's seed comes from torch's RNG (the PyTorch path, as dropout's)

    def relaid(self, layout: str, heads: int = 0, enable_gqa: bool | None = None) -> AttentionOp:
        """The same attention (mask, causality, scale, dropout and its seed) on inputs in another
        ``layout`` (``heads`` for "packed"), or grouped (``enable_gqa``): what the graph rewrites
        that change how an attention reads its inputs make."""
        op = AttentionOp(
            has_mask=self.has_mask,
            is_causal=self.is_causal,
            scale=self.user_scale,
            enable_gqa=self.enable_gqa if enable_gqa is None else enable_gqa,
            dropout_p=self.dropout_p,
            seed=self.seed,
            fixed_mask=self.fixed_mask,
            layout=layout,
            heads=heads,
        )
        op.allow_tf32, op.seed_chosen, op.torch_rng = self.allow_tf32, self.seed_chosen, self.torch_rng
        return op

    # --- shapes --------------------------------------------------------------------------
    def _layout(self, shapes) -> AttentionLayout:
        mask = shapes[self.n_qkv] if self.has_mask else None
        if self.layout == "packed":
            return attention_layout_packed(shapes[0], heads=self.heads, mask_shape=mask)
        build = attention_layout_blhd if self.layout == "blhd" else attention_layout
        return build(shapes, mask, enable_gqa=self.enable_gqa)

    def check_inputs(self, input_shapes, input_dtypes):
        names = ("packed q, k, v",) if self.layout == "packed" else ("query", "key", "value")
        for what, dtype in zip(names, input_dtypes):
            if not dtype.is_floating_point:
                raise TypeError(f"{what} must be a float tensor, got {str(dtype).replace('torch.', '')}")
        if self.has_mask:
            dtype = input_dtypes[self.n_qkv]
            if dtype != torch.bool and dtype != input_dtypes[0]:
                raise TypeError(f"attn_mask must be bool or have the query's dtype, got {dtype}")
        self._layout(input_shapes)

    def output_shape(self, input_shapes):
        layout = self._layout(input_shapes)
        if self.layout != "bhld":
            return (layout.n_outer, layout.q_len, layout.n_heads, layout.dv)
        return layout.batch + (layout.q_len, layout.dv)

    def flops(self, input_shapes, grad_mask):
        """S = Q K^T and O = P V forwards; backwards S again, dP, dV, dQ and dK (as torch counts
        its fused attention's; a causal mask's skipped blocks are counted too, as there)."""
        layout = self._layout(input_shapes)
        per_d = 2 * layout.n_bh * layout.q_len * layout.k_len
        backward = per_d * (3 * layout.d + 2 * layout.dv) if any(grad_mask[: self.n_qkv]) else 0
        return per_d * (layout.d + layout.dv), backward

    def extra_outputs(self, input_shapes, dtype):
        layout = self._layout(input_shapes)
        extras = {"lse": (layout.batch + (layout.q_len,), acc_dtype(dtype))}
        if self.dropout_p > 0:
            extras["seed"] = ((1,), torch.int64)
        return extras

    # --- launch helpers ----------------------------------------------------------------------
    @property
    def dropout_scale(self) -> float:
        return 0.0 if self.dropout_p == 1.0 else 1.0 / (1.0 - self.dropout_p)

    def step_seed(self, step: int) -> int:
        """The seed of the ``step``-th run's dropout mask."""
        return mix_seed(self.seed, 0 if self.fixed_mask else step)

    def _scale(self, layout: AttentionLayout) -> float:
        if self.user_scale is not None:
            return self.user_scale
        return 1.0 / math.sqrt(layout.d) if layout.d else 1.0

    @staticmethod
    def _tiles(ctx, layout: AttentionLayout) -> AttentionTiles:
        return attention_tiles(
            ctx.dtype,
            d=layout.d,
            dv=layout.dv,
            q_len=layout.q_len,
            k_len=layout.k_len,
            kv_heads=layout.n_bh // layout.kv_group,
        )

    def _common(self, ctx, layout: AttentionLayout) -> dict:
        """The arguments every kernel takes, by name."""
        q, k, v = packed_parts(ctx.inputs[0]) if self.layout == "packed" else ctx.inputs[:3]
        block_d, block_dv = head_blocks(ctx.dtype, d=layout.d, dv=layout.dv)
        return dict(
            q_ptr=q,
            k_ptr=k,
            v_ptr=v,
            mask_ptr=ctx.inputs[self.n_qkv] if self.has_mask else None,
            q_len=layout.q_len,
            k_len=layout.k_len,
            n_heads=layout.n_heads,
            kv_group=layout.kv_group,
            **layout.strides,
            scale=self._scale(layout),
            keep_threshold=keep_threshold(self.dropout_p),
            dropout_scale=self.dropout_scale,
            D=layout.d,
            DV=layout.dv,
            CAUSAL=self.is_causal,
            UPCAST_BF16=DOT_UPCAST_BF16,
            PRECISION=dot_precision(ctx.dtype, self.allow_tf32) if ctx.dtype == torch.float32 else IEEE,
            ACC=tl_acc_dtype(ctx.dtype),
            BLOCK_D=block_d,
            BLOCK_DV=block_dv,
        )

    # --- forward ---------------------------------------------------------------------------
    def forward_launches(self, ctx):
        layout = self._layout(ctx.input_shapes)
        tiles = self._tiles(ctx, layout).forward
        seed = 0
        if self.dropout_p > 0:
            seed = self.step_seed(0 if ctx.dry_run else self.runs)
            if not ctx.dry_run:
                self.runs += 1
                if self.torch_rng and not self.fixed_mask:  # checkpointing restores torch's RNG: the same mask
                    drawn = int(torch.randint(1 << 62, (), dtype=torch.int64))
                    seed = mix_seed(self.seed if self.seed_chosen else -1, drawn)
        args = ArgVisitor().visit(
            **self._common(ctx, layout),
            out_ptr=ctx.output,
            lse_ptr=ctx.saved["lse"],
            seed_out_ptr=ctx.saved.get("seed"),
            seed=seed,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
        )
        grid = (layout.n_bh, cdiv(layout.q_len, tiles.block_m), 1)
        return [Launch(attention_forward, grid, args, Block(None, tiles.num_warps, tiles.num_stages))]

    # --- backward --------------------------------------------------------------------------
    def backward_launches(self, ctx):
        layout = self._layout(ctx.input_shapes)
        tiles = self._tiles(ctx, layout)
        dq, dk, dv = packed_parts(ctx.grad_inputs[0]) if self.layout == "packed" else ctx.grad_inputs[:3]
        common = self._common(ctx, layout)
        saved = dict(lse_ptr=ctx.saved["lse"], seed_ptr=ctx.saved.get("seed"))
        delta = ctx.empty(ctx.saved["lse"].shape, ctx.saved["lse"].dtype)
        q_shape = layout.batch + (layout.q_len, layout.d)
        k_shape, v_shape = layout.kv_batch + (layout.k_len, layout.d), layout.kv_batch + (layout.k_len, layout.dv)
        # a broadcast operand's gradient is computed per head into float32 scratch, then summed
        # (the blhd and packed layouts have no broadcast operand: their gradients are written in place)
        dq_out, dk_out, dv_out = (
            g if g is None or tuple(g.shape) == full or self.layout != "bhld" else ctx.empty(full, acc_dtype(ctx.dtype))
            for g, full in ((dq, q_shape), (dk, k_shape), (dv, v_shape))
        )
        grad = layout.grad_strides
        launches = []
        if dq is not None or dk is not None:  # dq also writes delta, which dkdv reads
            t = tiles.dq
            args = ArgVisitor().visit(
                **common,
                **saved,
                out_ptr=ctx.output,
                dout_ptr=ctx.grad_output,
                delta_ptr=delta,
                dq_ptr=dq_out,
                dq_stride_b=grad["dq_stride_b"],
                dq_stride_h=grad["dq_stride_h"],
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
            )
            grid = (layout.n_bh, cdiv(layout.q_len, t.block_m), 1)
            launches.append(Launch(attention_backward_dq, grid, args, Block(None, t.num_warps, t.num_stages)))
        if dk is not None or dv is not None:
            t = tiles.dkdv
            args = ArgVisitor().visit(
                **common,
                **saved,
                dout_ptr=ctx.grad_output,
                delta_ptr=delta,
                dk_ptr=dk_out,
                dv_ptr=dv_out,
                **{k: v for k, v in grad.items() if not k.startswith("dq")},
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
            )
            grid = (layout.n_bh // layout.kv_group, cdiv(layout.k_len, t.block_n), 1)
            work = (dk if dk is not None else dv).numel()
            launches.append(Launch(attention_backward_dkdv, grid, args, Block(None, t.num_warps, t.num_stages), work))
        for scratch, target in ((dq_out, dq), (dk_out, dk), (dv_out, dv)):
            if target is not None and scratch is not target:
                launches += sum_to_shape(ctx, scratch, tuple(scratch.shape), target)
        return launches


# ------------------------------------------------------------------------- functional ops


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    seed: int | None = None,
    fixed_mask: bool = False,
):
    """softmax(query key^T * scale + attn_mask) value, as torch.nn.functional.scaled_dot_product_attention.

    query (..., Lq, D), key (..., Lk, D), value (..., Lk, Dv), whose batch dims broadcast;
    attn_mask a float mask added to the scores or a bool mask (True: may attend), broadcastable
    to (..., Lq, Lk), with no gradient; is_causal: query i sees keys j <= i (top-left aligned);
    scale defaults to 1/sqrt(D) (float64 for float64 inputs); enable_gqa: key and value may have
    fewer heads (dim -3) than query. Rows that see no key give 0. Any scale works, negative
    ones too (PyTorch's math path, its CPU float64 reference, gives NaN for a negative scale
    with is_causal=True: it multiplies q and k by sqrt(scale)).

    dropout_p > 0 drops attention weights with that probability (and scales the rest by
    1 / (1 - dropout_p)), with a new mask on every run, as ``teeny.ops.dropout``: ``seed`` is
    the node's base seed (None: a fresh one from a trace-time counter), ``fixed_mask=True``
    (teeny-only) keeps the base seed's mask on every run.
    """
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0 or math.isnan(dropout_p):
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1], got {dropout_p}")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scaled_dot_product_attention: scale must be a float or None, got {type(scale).__name__}")
    seed_chosen = seed is not None
    if seed is None:
        seed = mix_seed(0xA77E, next(_trace_seeds))
    op = AttentionOp(
        has_mask=attn_mask is not None,
        is_causal=bool(is_causal),
        scale=None if scale is None else float(scale),
        enable_gqa=bool(enable_gqa),
        dropout_p=dropout_p,
        seed=int(seed),
        fixed_mask=fixed_mask,
    )
    op.seed_chosen = seed_chosen
    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    return graph_of(query, key, value).apply(op, inputs)
