"""Rotary position embedding, in Hugging Face's convention (Llama, Qwen, Mistral, Gemma, GPT-NeoX, ...).

x is (batch, heads, seq, head_dim); cos and sin are (batch or 1, seq, R), the tables transformers'
rotary modules return (before ``apply_rotary_pos_emb`` unsqueezes their head dim), with an even
rotary dim R <= head_dim. The first R columns of each row of x are rotated, the rest pass through
(partial rotary: GPT-NeoX, Phi). With x1, x2 the two halves of those R columns and c1, c2, s1, s2
the matching halves of cos and sin at the row's (batch, position):

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x2, x1):
        y1 = x1 c1 - x2 s1,      y2 = x2 c2 + x1 s2
    backward, the transpose of that rotation:
        dx1 = dy1 c1 + dy2 s2,   dx2 = dy2 c2 - dy1 s1
    and y = x, dx = dy on the columns past R.

cos and sin get no gradient (they are tables computed from positions, not trained): a program
that asks for one is refused at lowering, naming the op. The backward reads cos, sin and dy only
(x is not kept) and may write dx over dy. Half-precision inputs are computed in float32 and
rounded once. cos and sin may be of a wider float dtype than x (float32 tables for a bf16 x, as
under autocast): the rotation is computed in float32 and written in x's dtype, the exact float32
rotation rounded once. Each program takes ROWS rows of x viewed as (batch * heads * seq, head_dim):
one read and one write of x, and of dy / dx backwards.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.common import ELEMENTWISE_BLOCK, cdiv, pow2, upcast
from ..core.graph import graph_of
from ..core.kernel import dtype_name, kernel
from ..core.runtime import ArgVisitor, Launch, RuntimeOp
from .norm.ops import shape_text

__all__ = ["rotary_embedding"]
NN_LAYERS: list[str] = []  # no parameters: models call the functional op


@triton.jit
def _rotate_rows(
    src_ptr,
    cos_ptr,
    sin_ptr,
    dst_ptr,
    n_rows,
    seq,
    heads_seq,
    pos_div,
    cos_batch,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """dst = the rotation (TRANSPOSE: its transpose) of ROWS rows of src, see the module docstring.
    Row r of src is in batch r // heads_seq at position s = (r // pos_div) % seq (pos_div 1 for
    (batch, heads, seq) rows, heads for (batch, seq, heads) ones); its cos/sin row is
    (r // heads_seq) * cos_batch + s (cos_batch = seq, or 0 when one table serves every batch)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (cols < HALF)[None, :]
    x_offs = rows[:, None] * HEAD_DIM + cols[None, :]
    t_offs = ((rows // heads_seq) * cos_batch + (rows // pos_div) % seq)[:, None] * (2 * HALF) + cols[None, :]
    a = upcast(tl.load(src_ptr + x_offs, mask=mask, other=0.0))
    b = upcast(tl.load(src_ptr + x_offs + HALF, mask=mask, other=0.0))
    c1 = upcast(tl.load(cos_ptr + t_offs, mask=mask, other=0.0))
    c2 = upcast(tl.load(cos_ptr + t_offs + HALF, mask=mask, other=0.0))
    s1 = upcast(tl.load(sin_ptr + t_offs, mask=mask, other=0.0))
    s2 = upcast(tl.load(sin_ptr + t_offs + HALF, mask=mask, other=0.0))
    if TRANSPOSE:
        out1 = a * c1 + b * s2
        out2 = b * c2 - a * s1
    else:
        out1 = a * c1 - b * s1
        out2 = b * c2 + a * s2
    tl.store(dst_ptr + x_offs, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + x_offs + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)
    if 2 * HALF < HEAD_DIM:  # partial rotary: the columns past the rotary dim pass through
        rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
        rest_mask = row_mask[:, None] & (rest < HEAD_DIM)[None, :]
        rest_offs = rows[:, None] * HEAD_DIM + rest[None, :]
        tl.store(dst_ptr + rest_offs, tl.load(src_ptr + rest_offs, mask=rest_mask), mask=rest_mask)


@kernel(half=True)
def rotary_backward(
    dy_ptr,
    cos_ptr,
    sin_ptr,
    dx_ptr,
    n_rows,
    seq,
    heads_seq,
    pos_div,
    cos_batch,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """dx = the transposed rotation of dy (each program reads its rows of dy before writing dx:
    dx may be dy's buffer)."""
    _rotate_rows(
        dy_ptr, cos_ptr, sin_ptr, dx_ptr, n_rows, seq, heads_seq, pos_div, cos_batch,
        HEAD_DIM, HALF, True, ROWS, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip


@kernel(backward=rotary_backward, half=True)
def rotary_forward(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    n_rows,
    seq,
    heads_seq,
    pos_div,
    cos_batch,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """y = x * cos + rotate_half(x) * sin on the first 2 * HALF columns, y = x past them."""
    _rotate_rows(
        x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, seq, heads_seq, pos_div, cos_batch,
        HEAD_DIM, HALF, False, ROWS, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip


class RotaryOp(RuntimeOp):
    """rotary_embedding(x, cos, sin): three activation inputs, x's shape and dtype out.
    ``layout="blhd"``: x (and the output) is (batch, seq, heads, head_dim), the heads not yet
    split off (``fusions.attention_layout.attention_in_place`` makes it of the transpose
    before a rotation whose output an attention reads)."""

    name = "rotary_embedding"
    kernel = rotary_forward
    n_activation_inputs = 3
    saves_inputs = (1, 2)  # cos and sin: the backward does not read x
    grad_in_place = True
    mixed_float_inputs = True  # wider tables than x: read as they are (see the module docstring)

    def __init__(self, layout: str = "bhld"):
        if layout not in ("bhld", "blhd"):
            raise ValueError(f"rotary_embedding layout must be 'bhld' or 'blhd', got {layout!r}")
        self.layout = layout

    def __repr__(self) -> str:
        return "RotaryOp()" if self.layout == "bhld" else f"RotaryOp(layout={self.layout!r})"

    def check_inputs(self, input_shapes, input_dtypes):
        for what, dtype in zip(("x", "cos", "sin"), input_dtypes):
            if not dtype.is_floating_point:
                raise TypeError(
                    f"rotary_embedding expects floating-point x, cos and sin, got {what} of {dtype_name(dtype)}"
                )
        x_dtype, table_dtypes = input_dtypes[0], set(input_dtypes[1:])
        wider = (x_dtype.itemsize, next(iter(table_dtypes)).itemsize) == (2, 4)
        if len(table_dtypes) > 1 or (x_dtype not in table_dtypes and not wider):
            got = ", ".join(f"{what} {dtype_name(d)}" for what, d in zip(("x", "cos", "sin"), input_dtypes))
            raise TypeError(
                f"rotary_embedding expects cos and sin of x's dtype, or float32 tables for a half-precision x; "
                f"got {got}"
            )
        x, cos, sin = (tuple(s) for s in input_shapes)
        if len(x) != 4:
            dims = "(batch, heads, seq, head_dim)" if self.layout == "bhld" else "(batch, seq, heads, head_dim)"
            raise ValueError(f"x must have shape {dims}, got {shape_text(x)}")
        if cos != sin:
            raise ValueError(f"cos and sin must have the same shape, got {shape_text(cos)} and {shape_text(sin)}")
        batch, seq, head_dim = x[0], x[2] if self.layout == "bhld" else x[1], x[3]
        if len(cos) != 3 or cos[0] not in (1, batch) or cos[1] != seq:
            raise ValueError(
                f"cos and sin must have shape (batch or 1, seq, rotary_dim) = ({batch} or 1, {seq}, rotary_dim) "
                f"for x of shape {shape_text(x)}, got {shape_text(cos)}"
            )
        rotary_dim = cos[2]
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"the rotary dim (the last dim of cos and sin, {rotary_dim}) must be even, positive and at most "
                f"head_dim ({head_dim}): rotate_half splits it into two halves"
            )

    def _layout(self, input_shapes) -> dict:
        batch, a, b, head_dim = input_shapes[0]
        heads, seq = (a, b) if self.layout == "bhld" else (b, a)
        cos = input_shapes[1]
        half = cos[2] // 2
        block_half = pow2(half)
        return dict(
            n_rows=batch * heads * seq,
            seq=seq,
            heads_seq=heads * seq,
            pos_div=1 if self.layout == "bhld" else heads,
            cos_batch=seq if cos[0] > 1 else 0,
            HEAD_DIM=head_dim,
            HALF=half,
            ROWS=max(1, ELEMENTWISE_BLOCK // block_half),
            BLOCK_HALF=block_half,
            BLOCK_PASS=pow2(head_dim - 2 * half),
        )

    @staticmethod
    def _launch(kernel_, layout: dict, **tensors) -> Launch:
        args = ArgVisitor().visit(**tensors, **layout)
        return Launch(kernel_, (cdiv(layout["n_rows"], layout["ROWS"]),), args)

    def forward_launches(self, ctx):
        x, cos, sin = ctx.inputs
        layout = self._layout(ctx.input_shapes)
        return [self._launch(rotary_forward, layout, x_ptr=x, cos_ptr=cos, sin_ptr=sin, y_ptr=ctx.output)]

    def backward_launches(self, ctx):
        dx, dcos, dsin = ctx.grad_inputs
        if dcos is not None or dsin is not None:
            raise NotImplementedError(
                "no gradient for cos and sin (position tables, not trained), but one is needed here: "
                "detach them (in PyTorch) or cut their path with teeny.ops.stop_gradient"
            )
        _, cos, sin = ctx.inputs
        layout = self._layout(ctx.input_shapes)
        return [self._launch(rotary_backward, layout, dy_ptr=ctx.grad_output, cos_ptr=cos, sin_ptr=sin, dx_ptr=dx)]


def rotary_embedding(x, cos, sin):
    """Rotary position embedding in Hugging Face's convention, ``x * cos + rotate_half(x) * sin``:
    x (batch, heads, seq, head_dim); cos and sin (batch or 1, seq, rotary_dim) as transformers'
    rotary modules return them, rotary_dim even and at most head_dim (the columns past it pass
    through). x gets a gradient; cos and sin get none (see ``teeny.ops.rotary``)."""
    return graph_of(x, cos, sin).apply(RotaryOp(), [x, cos, sin])
