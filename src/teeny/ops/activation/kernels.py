"""The activation family's kernel pairs (the maths is in the package docstring, ``teeny.ops.activation``):

* ``activation_forward`` / ``activation_backward``: the template of every element-wise activation,
  its maths (``maths.py``) passed as the constexprs ``FN`` / ``GRAD``;
* ``gated_forward`` / ``gated_backward``: y = u * act(g), for glu, swiglu and geglu;
* ``prelu_forward`` / ``prelu_backward``: the weight gradient as per-split partial sums, added by
  ``common.sum_partials``.

Each program handles one BLOCK-wide slice (prelu's backward: one channel, in BLOCK-wide steps);
half-precision inputs are computed in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.common import sum_to_shape_kernel, upcast
from ...core.kernel import kernel

# ------------------------------------------------------------------ unary kernel template


@kernel(half=True)
def activation_backward(x_ptr, dy_ptr, dx_ptr, n, a, b, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    tl.store(dx_ptr + offsets, GRAD(x, dy, a, b).to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(backward=activation_backward, half=True)
def activation_forward(x_ptr, y_ptr, n, a, b, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, FN(x, a, b).to(y_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------- gated: glu and swiglu


@triton.jit
def _gated_sources(offsets, half_row, row_stride, SPLIT: tl.constexpr):
    """Where output element i reads u: the halves of a row (SPLIT) or the same index."""
    if SPLIT:
        return (offsets // half_row) * row_stride + offsets % half_row
    else:
        return offsets


@kernel(half=True, optional=("du_ptr", "dg_ptr"))
def gated_backward(
    u_ptr,
    g_ptr,
    dy_ptr,
    du_ptr,
    dg_ptr,
    n,
    half_row,
    row_stride,
    g_offset,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    src = _gated_sources(offsets, half_row, row_stride, SPLIT)
    u = upcast(tl.load(u_ptr + src, mask=mask, other=0.0))
    g = upcast(tl.load(g_ptr + g_offset + src, mask=mask, other=0.0))
    dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
    if du_ptr is not None:
        tl.store(du_ptr + src, (dy * ACT(g, 0.0, 0.0)).to(du_ptr.dtype.element_ty), mask=mask)
    if dg_ptr is not None:
        tl.store(dg_ptr + g_offset + src, ACT_GRAD(g, dy * u, 0.0, 0.0).to(dg_ptr.dtype.element_ty), mask=mask)


@kernel(backward=gated_backward, half=True)
def gated_forward(
    u_ptr, g_ptr, y_ptr, n, half_row, row_stride, g_offset, ACT: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    """y = u * act(g); du = dy * act(g), dg = act'(g) * dy * u. Output element i reads u at
    src(i) = (i // half_row) * row_stride + i % half_row (SPLIT: the halves of a row) or
    src(i) = i, and g at src(i) + g_offset."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    src = _gated_sources(offsets, half_row, row_stride, SPLIT)
    u = upcast(tl.load(u_ptr + src, mask=mask, other=0.0))
    g = upcast(tl.load(g_ptr + g_offset + src, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, (u * ACT(g, 0.0, 0.0)).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------- prelu


@kernel(half=True, optional=("dx_ptr", "partial_ptr"))
def prelu_backward(
    x_ptr, w_ptr, dy_ptr, dx_ptr, partial_ptr, per_channel, channels, inner, splits, BLOCK: tl.constexpr
):
    """Program (c, s) walks the elements of channel c (x viewed as (outer, C, inner)) in
    BLOCK-wide steps s, s + splits, ...: writes dx = dy if x > 0 else w[c] * dy and the
    partial sum of dw[c] = sum(x * dy where x <= 0) into partial[s, c] (float32, float64 for
    float64); ``sum_partials`` adds the partials over s."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    w = upcast(tl.load(w_ptr + c))
    acc = upcast(tl.zeros([BLOCK], dtype=w_ptr.dtype.element_ty))
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(s.to(tl.int64) * BLOCK, per_channel, splits * BLOCK):
        j = start + lanes
        mask = j < per_channel
        offsets = (j // inner) * (channels * inner) + c * inner + j % inner
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        if dx_ptr is not None:
            tl.store(dx_ptr + offsets, tl.where(x > 0, dy, w * dy).to(dx_ptr.dtype.element_ty), mask=mask)
        if partial_ptr is not None:
            acc += tl.where(x > 0, 0.0, x * dy)
    if partial_ptr is not None:
        tl.store(partial_ptr + s * channels + c, tl.sum(acc, axis=0))


@kernel(backward=(prelu_backward, sum_to_shape_kernel), half=True)
def prelu_forward(x_ptr, w_ptr, y_ptr, n, channels, inner, BLOCK: tl.constexpr):
    """y = x if x > 0 else w[c] * x, with c = (i // inner) % channels the channel (dim 1) of
    element i. Backward: see prelu_backward."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
    w = upcast(tl.load(w_ptr + (offsets // inner) % channels, mask=mask, other=0.0))
    tl.store(y_ptr + offsets, tl.where(x > 0, x, w * x).to(y_ptr.dtype.element_ty), mask=mask)
