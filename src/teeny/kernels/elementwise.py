"""Element-wise maths with NumPy/PyTorch broadcasting: add, sub, mul, div, pow, minimum, maximum,
where, clamp, and the unary maths (neg, abs, exp, log, sqrt, rsqrt, reciprocal, square, sin, cos, erf).

One kernel pair serves every op of one to three operands (x, y, z):

    elementwise_forward:   out[i] = FN(x[bx(i)], y[by(i)], z[bz(i)], alpha)
    elementwise_backward:  (gx, gy, gz)[i] = GRAD(x, y, z, dout[i], alpha)   (per output element i)
    reduce_to_shape:       dX[t] = sum over the output elements i that read X[t] of gx[i]

``FN`` / ``GRAD`` are small ``@triton.jit`` maths functions passed as compile-time constants.
Each operand slot has a compile-time mode: FULL (same number of elements as the output: read at
the flat index), SCALAR (a one-element tensor), STRIDED (broadcast: the flat output index is
unravelled over the output's dimensions, merged where every operand is contiguous across them,
at most ``MAX_DIMS``), VALUE (a Python number, passed as the 64 bits of a double so that
float64 ops see it exactly; float32/half ops round it to float32 like PyTorch's opmath) or NONE.

Backward writes the gradient of a FULL operand straight into its buffer; the gradient of a
broadcast operand is written output-shaped in float32 (float64 for float64) and summed back to
the operand's shape by ``reduce_to_shape``: a tile of target elements per program, looping over
the broadcast elements, with the broadcast range split across programs when it is long and the
float32 partials summed by a second launch of the same kernel (no atomics). Where an operand's
gradient is ``dout`` itself (add, sub's first operand) no kernel runs for it: a view of
``dout``, or ``dout`` reduced to the operand's shape.

Unary maths reuse the activation template (``teeny.kernels.activation``): y = f(x), dx = f'(x) dy.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..device import INTERPRETER
from ..graph import Tensor, graph_of
from ..kernel import kernel
from ..registry import OpInfo, Sample, away_from, make, register
from ..runtime import ArgVisitor, RuntimeOp
from .activation import ActivationOp
from .common import ELEMENTWISE_BLOCK, cdiv, upcast

__all__ = [
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "minimum",
    "maximum",
    "where",
    "clamp",
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "square",
    "sin",
    "cos",
    "erf",
]
NN_LAYERS: list[str] = []

BLOCK = ELEMENTWISE_BLOCK  # 16K elements under the interpreter (few, wide programs), 1024 on the GPU
MAX_DIMS = 6
# reduce_to_shape: elements per tile and programs to aim for (the interpreter: few, wide programs)
_REDUCE_TILE, _REDUCE_TARGET_PROGRAMS = (16384, 4) if INTERPRETER else (2048, 512)
NONE, VALUE, SCALAR, FULL, STRIDED = 0, 1, 2, 3, 4
_POW_LIBDEVICE = tl.constexpr(not INTERPRETER)  # the interpreter has no libdevice

Shape = tuple[int, ...]


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _flat_index(pid, BLOCK: tl.constexpr, INT64: tl.constexpr):
    if INT64:
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _peel(off, rem, size, stride, K: tl.constexpr, NDIM: tl.constexpr):
    """Add dimension K's share (K = 0 innermost) of the flat index ``rem`` to ``off``."""
    if K < NDIM - 1:
        off += (rem % size) * stride
        rem = rem // size
    elif K == NDIM - 1:
        off += rem * stride
    return off, rem


@triton.jit
def _strided_offsets(index, d0, d1, d2, d3, d4, t0, t1, t2, t3, t4, t5, NDIM: tl.constexpr):
    """sum_k index_k * t_k, where index_k is the k-th digit (innermost first, sizes d_k) of index."""
    off = index * 0
    off, rem = _peel(off, index, d0, t0, 0, NDIM)
    off, rem = _peel(off, rem, d1, t1, 1, NDIM)
    off, rem = _peel(off, rem, d2, t2, 2, NDIM)
    off, rem = _peel(off, rem, d3, t3, 3, NDIM)
    off, rem = _peel(off, rem, d4, t4, 4, NDIM)
    off, rem = _peel(off, rem, 1, t5, 5, NDIM)
    return off


@triton.jit
def _operand(
    ptr, bits, index, mask, d0, d1, d2, d3, d4, t0, t1, t2, t3, t4, t5, like_ptr, MODE: tl.constexpr, NDIM: tl.constexpr
):
    """Operand values at the flat output indices, in the compute dtype (float64 or float32)."""
    if MODE == 1:  # VALUE: a Python number, as the bits of a double
        value = bits.to(tl.int64).to(tl.float64, bitcast=True)
        if like_ptr.dtype.element_ty != tl.float64:
            value = value.to(tl.float32)
        return value
    elif MODE == 2:  # SCALAR
        return upcast(tl.load(ptr))
    elif MODE == 3:  # FULL
        return upcast(tl.load(ptr + index, mask=mask, other=0))
    elif MODE == 4:  # STRIDED
        offsets = _strided_offsets(index, d0, d1, d2, d3, d4, t0, t1, t2, t3, t4, t5, NDIM)
        return upcast(tl.load(ptr + offsets, mask=mask, other=0))
    else:  # NONE
        return 0.0


@kernel(half=True)
def elementwise_backward(
    x_ptr,
    y_ptr,
    z_ptr,
    dout_ptr,
    gx_ptr,
    gy_ptr,
    gz_ptr,
    n,
    x_bits: tl.int64,
    y_bits: tl.int64,
    z_bits: tl.int64,
    alpha_bits: tl.int64,
    d0,
    d1,
    d2,
    d3,
    d4,
    xt0,
    xt1,
    xt2,
    xt3,
    xt4,
    xt5,
    yt0,
    yt1,
    yt2,
    yt3,
    yt4,
    yt5,
    zt0,
    zt1,
    zt2,
    zt3,
    zt4,
    zt5,
    GRAD: tl.constexpr,
    X_MODE: tl.constexpr,
    Y_MODE: tl.constexpr,
    Z_MODE: tl.constexpr,
    WRITE_X: tl.constexpr,
    WRITE_Y: tl.constexpr,
    WRITE_Z: tl.constexpr,
    NDIM: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = _flat_index(tl.program_id(0), BLOCK, INT64)
    mask = index < n
    x = _operand(x_ptr, x_bits, index, mask, d0, d1, d2, d3, d4, xt0, xt1, xt2, xt3, xt4, xt5, dout_ptr, X_MODE, NDIM)
    y = _operand(y_ptr, y_bits, index, mask, d0, d1, d2, d3, d4, yt0, yt1, yt2, yt3, yt4, yt5, dout_ptr, Y_MODE, NDIM)
    z = _operand(z_ptr, z_bits, index, mask, d0, d1, d2, d3, d4, zt0, zt1, zt2, zt3, zt4, zt5, dout_ptr, Z_MODE, NDIM)
    alpha = _operand(dout_ptr, alpha_bits, index, mask, d0, d1, d2, d3, d4, 0, 0, 0, 0, 0, 0, dout_ptr, 1, NDIM)
    dout = upcast(tl.load(dout_ptr + index, mask=mask, other=0))
    gx, gy, gz = GRAD(x, y, z, dout, alpha)
    if WRITE_X:
        tl.store(gx_ptr + index, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(gy_ptr + index, gy.to(gy_ptr.dtype.element_ty), mask=mask)
    if WRITE_Z:
        tl.store(gz_ptr + index, gz.to(gz_ptr.dtype.element_ty), mask=mask)


@kernel(backward=elementwise_backward, half=True)
def elementwise_forward(
    x_ptr,
    y_ptr,
    z_ptr,
    out_ptr,
    n,
    x_bits: tl.int64,
    y_bits: tl.int64,
    z_bits: tl.int64,
    alpha_bits: tl.int64,
    d0,
    d1,
    d2,
    d3,
    d4,
    xt0,
    xt1,
    xt2,
    xt3,
    xt4,
    xt5,
    yt0,
    yt1,
    yt2,
    yt3,
    yt4,
    yt5,
    zt0,
    zt1,
    zt2,
    zt3,
    zt4,
    zt5,
    FN: tl.constexpr,
    X_MODE: tl.constexpr,
    Y_MODE: tl.constexpr,
    Z_MODE: tl.constexpr,
    NDIM: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = _flat_index(tl.program_id(0), BLOCK, INT64)
    mask = index < n
    x = _operand(x_ptr, x_bits, index, mask, d0, d1, d2, d3, d4, xt0, xt1, xt2, xt3, xt4, xt5, out_ptr, X_MODE, NDIM)
    y = _operand(y_ptr, y_bits, index, mask, d0, d1, d2, d3, d4, yt0, yt1, yt2, yt3, yt4, yt5, out_ptr, Y_MODE, NDIM)
    z = _operand(z_ptr, z_bits, index, mask, d0, d1, d2, d3, d4, zt0, zt1, zt2, zt3, zt4, zt5, out_ptr, Z_MODE, NDIM)
    alpha = _operand(out_ptr, alpha_bits, index, mask, d0, d1, d2, d3, d4, 0, 0, 0, 0, 0, 0, out_ptr, 1, NDIM)
    tl.store(out_ptr + index, FN(x, y, z, alpha).to(out_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def reduce_to_shape_kernel(
    g_ptr,
    out_ptr,
    m,
    r,
    r_per_split,
    kd0,
    kd1,
    kd2,
    kd3,
    kd4,
    kt0,
    kt1,
    kt2,
    kt3,
    kt4,
    kt5,
    rd0,
    rd1,
    rd2,
    rd3,
    rd4,
    rt0,
    rt1,
    rt2,
    rt3,
    rt4,
    rt5,
    KEPT_NDIM: tl.constexpr,
    RED_NDIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[s, t] = sum_{j in split s} g[kept_offset(t) + reduced_offset(j)], summed in float32
    (float64 for float64). Program (i, s): targets i*BLOCK_M.., reduced range split s."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    targets = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    target_mask = targets < m
    base = _strided_offsets(targets, kd0, kd1, kd2, kd3, kd4, kt0, kt1, kt2, kt3, kt4, kt5, KEPT_NDIM)
    acc = upcast(tl.zeros([BLOCK_M, BLOCK_R], dtype=g_ptr.dtype.element_ty))
    start = pid_s.to(tl.int64) * r_per_split
    end = tl.minimum(start + r_per_split, r)
    for j0 in range(start, end, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        reduced = _strided_offsets(j, rd0, rd1, rd2, rd3, rd4, rt0, rt1, rt2, rt3, rt4, rt5, RED_NDIM)
        tile_mask = target_mask[:, None] & (j < end)[None, :]
        acc += upcast(tl.load(g_ptr + base[:, None] + reduced[None, :], mask=tile_mask, other=0))
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid_s.to(tl.int64) * m + targets, total.to(out_ptr.dtype.element_ty), mask=target_mask)


# ------------------------------------------------------------------------------ maths
# FN(x, y, z, alpha) -> out and GRAD(x, y, z, dout, alpha) -> (gx, gy, gz), in float32/64.


@triton.jit
def _true_div(a, b):
    """a / b correctly rounded (Triton's fp32 '/' is approximate on the GPU)."""
    if b.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _sqrt(x):
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _add(x, y, z, alpha):
    return x + alpha * y


@triton.jit
def _add_grad(x, y, z, dout, alpha):
    return dout, alpha * dout, dout


@triton.jit
def _mul(x, y, z, alpha):
    return x * y


@triton.jit
def _mul_grad(x, y, z, dout, alpha):
    return dout * y, dout * x, dout


@triton.jit
def _div(x, y, z, alpha):
    return _true_div(x, y)


@triton.jit
def _div_grad(x, y, z, dout, alpha):
    gx = _true_div(dout, y)
    return gx, -dout * _true_div(_true_div(x, y), y), dout


@triton.jit
def _pow_impl(a, b):
    """a ** b with C pow semantics: a negative base needs an integer exponent."""
    if _POW_LIBDEVICE:
        return libdevice.pow(a, b)
    else:
        magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
        odd = tl.abs(b - 2.0 * tl.floor(0.5 * b)) == 1.0
        signed = tl.where(odd, -magnitude, magnitude)
        result = tl.where(a < 0, tl.where(b == tl.floor(b), signed, float("nan")), magnitude)
        return tl.where(b == 0, 1.0, tl.where(a == 1, 1.0, result))


@triton.jit
def _pow(x, y, z, alpha):
    return _pow_impl(x, y)


@triton.jit
def _pow_grad(x, y, z, dout, alpha):
    # d/dx = y * x^(y-1) (0 where y == 0); d/dy = x^y * log(x) (0 where x == 0 and y >= 0), as torch
    gx = tl.where(y == 0, 0.0, dout * y * _pow_impl(x, y - 1.0))
    gy = dout * _pow_impl(x, y) * tl.log(x)
    gy = tl.where(x == 0, tl.where(y >= 0, 0.0, gy), gy)
    return gx, gy, dout


@triton.jit
def _maximum(x, y, z, alpha):
    return tl.where(x != x, x, tl.where(x > y, x, y))  # NaN propagates


@triton.jit
def _maximum_grad(x, y, z, dout, alpha):
    tie = dout * 0.5
    gx = tl.where(x == y, tie, tl.where(x < y, 0.0, dout))
    gy = tl.where(x == y, tie, tl.where(x > y, 0.0, dout))
    return gx, gy, dout


@triton.jit
def _minimum(x, y, z, alpha):
    return tl.where(x != x, x, tl.where(x < y, x, y))


@triton.jit
def _minimum_grad(x, y, z, dout, alpha):
    tie = dout * 0.5
    gx = tl.where(x == y, tie, tl.where(x > y, 0.0, dout))
    gy = tl.where(x == y, tie, tl.where(x < y, 0.0, dout))
    return gx, gy, dout


@triton.jit
def _where(x, y, z, alpha):  # x: condition (as 0/1)
    return tl.where(x != 0, y, z)


@triton.jit
def _where_grad(x, y, z, dout, alpha):
    return dout, tl.where(x != 0, dout, 0.0), tl.where(x != 0, 0.0, dout)


@triton.jit
def _clamp(x, y, z, alpha):  # y: min (-inf if None), z: max (+inf if None)
    low = tl.where(x < y, y, x)
    return tl.where(low > z, z, low)


@triton.jit
def _clamp_grad(x, y, z, dout, alpha):
    # as torch: x passes where min <= x <= max; min gets it where x < min < max; max where x > max or max < min
    gx = tl.where(x >= y, tl.where(x <= z, dout, 0.0), 0.0)
    gy = tl.where(x < y, tl.where(y < z, dout, 0.0), 0.0)
    gz = tl.where(x > z, dout, tl.where(z < y, dout, 0.0))
    return gx, gy, gz


# ------------------------------------------------------------------------------ layout


def _double_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def broadcast_shapes(shapes: list[Shape], what: str) -> Shape:
    """The NumPy/PyTorch broadcast of ``shapes``; a ValueError naming them all otherwise."""
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(ndim):
        sizes = {s[len(s) - ndim + k] for s in shapes if len(s) - ndim + k >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            listing = " and ".join(str(tuple(s)) for s in shapes)
            raise ValueError(
                f"{what}: shapes {listing} cannot be broadcast together "
                f"(dimension {k - ndim} has sizes {sorted(sizes)})"
            )
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _broadcast_strides(shape: Shape, out_shape: Shape) -> list[int]:
    """Element strides of a contiguous ``shape`` read as ``out_shape`` (0 along broadcast dims)."""
    strides, step = [0] * len(out_shape), 1
    for k in range(1, len(shape) + 1):
        size = shape[-k]
        strides[-k] = step if size != 1 else 0
        step *= size
    return strides


def _merged_layout(out_shape: Shape, strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 output dims and merge neighbours every operand walks contiguously.
    Returns (sizes, per-operand strides), innermost dimension first."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for k in reversed(range(len(out_shape))):
        size = out_shape[k]
        if size == 1:
            continue
        if sizes and all(st[k] == m[-1] * sizes[-1] for st, m in zip(strides, merged)):
            sizes[-1] *= size
            continue
        sizes.append(size)
        for st, m in zip(strides, merged):
            m.append(st[k])
    if not sizes:
        return [1], [[0] for _ in strides]
    return sizes, merged


def _pad(values: list[int], length: int, fill: int) -> list[int]:
    return list(values) + [fill] * (length - len(values))


def _visit_layout(visitor: ArgVisitor, sizes: list[int], strides: list[list[int]]) -> None:
    for d in _pad(sizes, MAX_DIMS, 1)[: MAX_DIMS - 1]:
        visitor.visit_i64(d)
    for st in strides:
        for t in _pad(st, MAX_DIMS, 0):
            visitor.visit_i64(t)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reduce_to_shape(ctx, grad: torch.Tensor, out_shape: Shape, target: torch.Tensor) -> None:
    """Write into ``target`` the sum of the output-shaped ``grad`` over the dimensions along
    which ``target``'s shape was broadcast to ``out_shape`` (two launches when the reduced
    range is long: float32 partials, then their sum)."""
    shape = tuple(target.shape)
    strides = _broadcast_strides(shape, out_shape)
    kept, kept_strides, red, red_strides = [], [], [], []
    step, last_kind = 1, None
    for k in reversed(range(len(out_shape))):  # innermost first, merging same-kind neighbours
        size = out_shape[k]
        if size != 1:
            kind = strides[k] != 0
            sizes, st = (kept, kept_strides) if kind else (red, red_strides)
            if kind == last_kind:
                sizes[-1] *= size
            else:
                sizes.append(size)
                st.append(step)
            last_kind = kind
        step *= size
    m, r = math.prod(shape), math.prod(out_shape)
    r = r // m if m else 0
    kept, kept_strides = kept or [1], kept_strides or [0]
    red, red_strides = red or [1], red_strides or [0]
    if len(kept) > MAX_DIMS or len(red) > MAX_DIMS:
        raise ValueError(f"reduce_to_shape: {shape} -> {out_shape} has too many dimensions")
    inner_kept = bool(out_shape) and out_shape[-1] != 1 and strides[-1] != 0
    if inner_kept:  # targets contiguous: wide along them
        block_m = min(_pow2(m), 64)
        block_r = min(_pow2(r), max(1, _REDUCE_TILE // block_m))
    else:
        block_r = min(_pow2(r), 256)
        block_m = min(_pow2(m), max(1, _REDUCE_TILE // block_r))
    programs_m = cdiv(m, block_m)
    split = max(1, min(cdiv(r, 4 * block_r), cdiv(_REDUCE_TARGET_PROGRAMS, programs_m)))
    r_per_split = cdiv(cdiv(r, split), block_r) * block_r if r else 1
    split = max(1, cdiv(r, r_per_split))
    partial_dtype = torch.float64 if target.dtype == torch.float64 else torch.float32
    first_out = target if split == 1 else ctx.empty((split, m), partial_dtype)
    _launch_reduce(
        ctx,
        grad,
        first_out,
        m,
        r,
        r_per_split,
        kept,
        kept_strides,
        red,
        red_strides,
        block_m,
        block_r,
        (programs_m, split, 1),
    )
    if split > 1:
        block_m = min(_pow2(m), 64)
        block_r = min(_pow2(split), max(1, _REDUCE_TILE // block_m))
        _launch_reduce(
            ctx, first_out, target, m, split, split, [m], [1], [split], [m], block_m, block_r, (cdiv(m, block_m), 1, 1)
        )


def _launch_reduce(
    ctx, grad, out, m, r, r_per_split, kept, kept_strides, red, red_strides, block_m, block_r, grid
) -> None:
    visitor = ArgVisitor().visit_ptr(grad).visit_ptr(out).visit_i64(m).visit_i64(r).visit_i64(r_per_split)
    _visit_layout(visitor, kept, [kept_strides])
    _visit_layout(visitor, red, [red_strides])
    visitor.visit_constexpr(len(kept)).visit_constexpr(len(red)).visit_constexpr(block_m).visit_constexpr(block_r)
    ctx.launch(reduce_to_shape_kernel, grid, visitor, work=m)


# ------------------------------------------------------------------------------ the op


class Maths:
    """One n-ary element-wise op's maths: FN, GRAD, which operand slots each slot's gradient
    reads (to save only those), and the slots whose gradient is ``dout`` itself."""

    def __init__(self, fn, grad, reads: tuple[tuple[int, ...], ...], passthrough: tuple[int, ...] = ()):
        self.fn, self.grad, self.reads, self.passthrough = fn, grad, reads, passthrough


class ElementwiseOp(RuntimeOp):
    """Up to three operand slots; each a tensor input (in order), a Python number or absent."""

    kernel = elementwise_forward

    def __init__(self, name: str, maths: Maths, slots: list, alpha: float = 0.0, bool_slots: tuple[int, ...] = ()):
        self.name, self.maths, self.alpha, self.bool_slots = name, maths, float(alpha), bool_slots
        self.slots = []  # per slot: ("tensor", input index) | ("value", float) | ("none", None)
        inputs = 0
        for s in slots:
            if s is None:
                self.slots.append(("none", None))
            elif isinstance(s, (int, float)):
                self.slots.append(("value", float(s)))
            else:
                self.slots.append(("tensor", inputs))
                inputs += 1
        self.slots += [("none", None)] * (3 - len(self.slots))
        self.n_activation_inputs = inputs
        needed = set()
        for slot, (kind, _) in enumerate(self.slots):
            if kind == "tensor" and slot not in maths.passthrough:
                needed.update(maths.reads[slot])
        self.saves_inputs = tuple(self.slots[s][1] for s in sorted(needed) if self.slots[s][0] == "tensor")

    # --- shapes ------------------------------------------------------------------------
    def check_inputs(self, input_shapes, input_dtypes):
        for slot, (kind, index) in enumerate(self.slots):
            if kind != "tensor":
                continue
            dtype = input_dtypes[index]
            if slot in self.bool_slots:
                if dtype != torch.bool:
                    raise TypeError(f"the condition must be a bool tensor, got {str(dtype).replace('torch.', '')}")
            elif not dtype.is_floating_point:
                raise TypeError(f"only floating-point tensors are supported, got {str(dtype).replace('torch.', '')}")
        shape = broadcast_shapes([tuple(s) for s in input_shapes], self.name)
        if len(self._layout(input_shapes, shape)[0]) > MAX_DIMS:
            raise ValueError(
                f"shapes {' and '.join(str(tuple(s)) for s in input_shapes)} broadcast over more than "
                f"{MAX_DIMS} non-mergeable dimensions"
            )

    def output_shape(self, input_shapes):
        return broadcast_shapes([tuple(s) for s in input_shapes], self.name)

    def output_dtype(self, input_dtypes):
        return next(d for d in input_dtypes if d.is_floating_point)

    def _layout(self, input_shapes, out_shape):
        strides = [
            _broadcast_strides(tuple(input_shapes[i]), out_shape) if kind == "tensor" else [0] * len(out_shape)
            for kind, i in self.slots
        ]
        return _merged_layout(tuple(out_shape), strides)

    def _modes(self, input_shapes, out_shape, present) -> list[int]:
        n = math.prod(out_shape)
        modes = []
        for slot, (kind, index) in enumerate(self.slots):
            if kind == "value":
                modes.append(VALUE)
            elif kind == "none" or not present[slot]:
                modes.append(NONE)
            else:
                numel = math.prod(input_shapes[index])
                modes.append(FULL if numel == n else SCALAR if numel == 1 else STRIDED)
        return modes

    def _pack_operands(self, visitor, tensors, dummy, input_shapes, out_shape, present):
        sizes, strides = self._layout(input_shapes, out_shape)
        modes = self._modes(input_shapes, out_shape, present)
        n = math.prod(out_shape)
        for slot, (_kind, index) in enumerate(self.slots):
            visitor.visit_ptr(tensors[index] if modes[slot] in (SCALAR, FULL, STRIDED) else dummy)
        return sizes, strides, modes, n

    def _visit_scalars(self, visitor, sizes, strides):
        for kind, value in self.slots:
            visitor.visit_i64(_double_bits(value) if kind == "value" else 0)
        visitor.visit_i64(_double_bits(self.alpha))
        _visit_layout(visitor, sizes, strides)

    # --- forward -----------------------------------------------------------------------
    def forward(self, ctx):
        visitor = ArgVisitor()
        present = [kind == "tensor" for kind, _ in self.slots]
        sizes, strides, modes, n = self._pack_operands(
            visitor, ctx.inputs, ctx.output, ctx.input_shapes, ctx.output_shape, present
        )
        visitor.visit_ptr(ctx.output).visit_i64(n)
        self._visit_scalars(visitor, sizes, strides)
        visitor.visit_constexpr(self.maths.fn)
        for mode in modes:
            visitor.visit_constexpr(mode)
        visitor.visit_constexpr(len(sizes)).visit_constexpr(n >= 2**31 - BLOCK).visit_constexpr(BLOCK)
        ctx.launch(elementwise_forward, (cdiv(n, BLOCK), 1, 1), visitor)

    # --- backward ----------------------------------------------------------------------
    def has_backward(self):
        return True

    def backward_kernels(self):
        return (elementwise_backward, reduce_to_shape_kernel)

    def backward(self, ctx):
        out_shape, n = tuple(ctx.output_shape), math.prod(ctx.output_shape)
        dout = ctx.grad_output
        grads = list(ctx.grad_inputs)
        targets = {}  # slot -> where the kernel writes its gradient (the buffer or a float32 scratch)
        reduce_later = []  # (slot, output-shaped gradient) to reduce into grads[index]
        for slot, (kind, index) in enumerate(self.slots):
            if kind != "tensor" or grads[index] is None:
                continue
            same_shape = math.prod(ctx.input_shapes[index]) == n
            if slot in self.maths.passthrough:
                if same_shape:
                    grads[index] = dout.view(ctx.input_shapes[index])
                else:
                    reduce_later.append((slot, dout))
            elif same_shape:
                targets[slot] = grads[index]
            else:
                scratch_dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
                targets[slot] = ctx.empty(out_shape, scratch_dtype)
                reduce_later.append((slot, targets[slot]))
        if targets:
            visitor = ArgVisitor()
            present = [kind == "tensor" and ctx.inputs[index] is not None for kind, index in self.slots]
            sizes, strides, modes, _ = self._pack_operands(
                visitor, ctx.inputs, dout, ctx.input_shapes, out_shape, present
            )
            visitor.visit_ptr(dout)
            for slot in range(3):
                visitor.visit_ptr(targets.get(slot, dout))
            visitor.visit_i64(n)
            self._visit_scalars(visitor, sizes, strides)
            visitor.visit_constexpr(self.maths.grad)
            for mode in modes:
                visitor.visit_constexpr(mode)
            for slot in range(3):
                visitor.visit_constexpr(slot in targets)
            visitor.visit_constexpr(len(sizes)).visit_constexpr(n >= 2**31 - BLOCK).visit_constexpr(BLOCK)
            ctx.launch(elementwise_backward, (cdiv(n, BLOCK), 1, 1), visitor)
        for slot, full_grad in reduce_later:
            index = self.slots[slot][1]
            reduce_to_shape(ctx, full_grad, out_shape, grads[index])
        ctx.grad_inputs[:] = grads


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _apply(name: str, maths: Maths, operands: list, alpha: float = 0.0, bool_slots: tuple[int, ...] = ()):
    for v in operands:
        if v is not None and not isinstance(v, Tensor) and not _is_number(v):
            raise TypeError(f"{name}: operands must be teeny Tensors or Python numbers, got {type(v).__name__}")
    tensors = [v for v in operands if isinstance(v, Tensor)]
    if not tensors:
        raise TypeError(f"{name}: at least one operand must be a teeny Tensor, got {operands!r}")
    return graph_of(*tensors).apply(ElementwiseOp(name, maths, operands, alpha, bool_slots), tensors)


# ------------------------------------------------------------------------------ functional ops

_ADD = Maths(_add, _add_grad, reads=((), (), ()), passthrough=(0,))
_ADD_ALPHA1 = Maths(_add, _add_grad, reads=((), (), ()), passthrough=(0, 1))
_MUL = Maths(_mul, _mul_grad, reads=((1,), (0,), ()))
_DIV = Maths(_div, _div_grad, reads=((1,), (0, 1), ()))
_POW = Maths(_pow, _pow_grad, reads=((0, 1), (0, 1), ()))
_MAXIMUM = Maths(_maximum, _maximum_grad, reads=((0, 1), (0, 1), ()))
_MINIMUM = Maths(_minimum, _minimum_grad, reads=((0, 1), (0, 1), ()))
_WHERE = Maths(_where, _where_grad, reads=((), (0,), (0,)))
_CLAMP = Maths(_clamp, _clamp_grad, reads=((0, 1, 2), (0, 1, 2), (0, 1, 2)))


def add(input, other, alpha=1):
    """input + alpha * other, broadcasting; either operand may be a Python number."""
    return _apply("add", _ADD_ALPHA1 if alpha == 1 else _ADD, [input, other], alpha)


def sub(input, other, alpha=1):
    """input - alpha * other, broadcasting; either operand may be a Python number."""
    return _apply("sub", _ADD, [input, other], -alpha)


def mul(input, other):
    """input * other, broadcasting; either operand may be a Python number."""
    return _apply("mul", _MUL, [input, other])


def div(input, other, rounding_mode=None):
    """input / other (true division), broadcasting; either operand may be a Python number."""
    if rounding_mode is not None:
        raise ValueError(f"div: only rounding_mode=None (true division) is supported, got {rounding_mode!r}")
    return _apply("div", _DIV, [input, other])


def pow(input, exponent):
    """input ** exponent, broadcasting; either may be a Python number. A negative base needs an
    integer exponent (NaN otherwise). Exponents 2, 0.5 and -1 given as numbers run as square,
    sqrt and reciprocal (exact)."""
    if isinstance(input, Tensor) and _is_number(exponent) and float(exponent) in _POW_SPECIAL:
        fn, grad = _POW_SPECIAL[float(exponent)]
        return _unary(input, "pow", fn, grad)
    return _apply("pow", _POW, [input, exponent])


def maximum(input, other):
    """Element-wise maximum (NaN propagates); at ties each operand gets half the gradient."""
    return _apply("maximum", _MAXIMUM, [input, other])


def minimum(input, other):
    """Element-wise minimum (NaN propagates); at ties each operand gets half the gradient."""
    return _apply("minimum", _MINIMUM, [input, other])


def where(condition, input, other):
    """input where condition else other (bool condition; all three broadcast together)."""
    if not isinstance(condition, Tensor):
        raise TypeError(f"where: condition must be a bool teeny Tensor, got {type(condition).__name__}")
    if not isinstance(input, Tensor) and not isinstance(other, Tensor):
        raise TypeError("where: at least one of input and other must be a float teeny Tensor")
    return _apply("where", _WHERE, [condition, input, other], bool_slots=(0,))


def clamp(input, min=None, max=None):
    """min(max(input, min), max); min and max are numbers or tensors (broadcast). The gradient
    passes where min <= input <= max, as in PyTorch (all elements are max when min > max)."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of 'min' or 'max' must not be None")
    if not isinstance(input, Tensor):
        raise TypeError(f"clamp: input must be a teeny Tensor, got {type(input).__name__}")
    low = -math.inf if min is None else min
    high = math.inf if max is None else max
    return _apply("clamp", _CLAMP, [input, low, high])


# ------------------------------------------------------------------------------ unary maths
# fn(x, a, b) -> y and grad(x, dy, a, b) -> dx for the activation template.


class UnaryOp(ActivationOp):
    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(
                f"only floating-point tensors are supported, got {str(input_dtypes[0]).replace('torch.', '')}"
            )


def _unary(x, name, fn, grad):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: input must be a teeny Tensor, got {type(x).__name__}")
    return graph_of(x).apply(UnaryOp(name, fn, grad), [x])


@triton.jit
def _neg(x, a, b):
    return -x


@triton.jit
def _neg_grad(x, dy, a, b):
    return -dy


@triton.jit
def _abs(x, a, b):
    return tl.abs(x)


@triton.jit
def _abs_grad(x, dy, a, b):
    return tl.where(x > 0, dy, tl.where(x < 0, -dy, 0.0))


@triton.jit
def _exp(x, a, b):
    return tl.exp(x)


@triton.jit
def _exp_grad(x, dy, a, b):
    return dy * tl.exp(x)


@triton.jit
def _log(x, a, b):
    return tl.log(x)


@triton.jit
def _log_grad(x, dy, a, b):
    return _true_div(dy, x)


@triton.jit
def _sqrt_fn(x, a, b):
    return _sqrt(x)


@triton.jit
def _sqrt_grad(x, dy, a, b):
    return _true_div(dy, 2.0 * _sqrt(x))


@triton.jit
def _rsqrt(x, a, b):
    return _true_div(1.0, _sqrt(x))


@triton.jit
def _rsqrt_grad(x, dy, a, b):
    r = _true_div(1.0, _sqrt(x))
    return -0.5 * dy * r * r * r


@triton.jit
def _reciprocal(x, a, b):
    return _true_div(1.0, x)


@triton.jit
def _reciprocal_grad(x, dy, a, b):
    r = _true_div(1.0, x)
    return -dy * (r * r)


@triton.jit
def _square(x, a, b):
    return x * x


@triton.jit
def _square_grad(x, dy, a, b):
    return dy * 2.0 * x


@triton.jit
def _sin(x, a, b):
    return tl.sin(x)


@triton.jit
def _sin_grad(x, dy, a, b):
    return dy * tl.cos(x)


@triton.jit
def _cos(x, a, b):
    return tl.cos(x)


@triton.jit
def _cos_grad(x, dy, a, b):
    return -dy * tl.sin(x)


@triton.jit
def _erf(x, a, b):
    return tl.math.erf(x)


@triton.jit
def _erf_grad(x, dy, a, b):
    return dy * 1.1283791670955126 * tl.exp(-x * x)  # 2 / sqrt(pi)


_POW_SPECIAL = {2.0: (_square, _square_grad), 0.5: (_sqrt_fn, _sqrt_grad), -1.0: (_reciprocal, _reciprocal_grad)}


def neg(input):
    """-input."""
    return _unary(input, "neg", _neg, _neg_grad)


def abs(input):
    """|input|; the gradient at 0 is 0, as in PyTorch."""
    return _unary(input, "abs", _abs, _abs_grad)


def exp(input):
    return _unary(input, "exp", _exp, _exp_grad)


def log(input):
    return _unary(input, "log", _log, _log_grad)


def sqrt(input):
    return _unary(input, "sqrt", _sqrt_fn, _sqrt_grad)


def rsqrt(input):
    """1 / sqrt(input)."""
    return _unary(input, "rsqrt", _rsqrt, _rsqrt_grad)


def reciprocal(input):
    """1 / input."""
    return _unary(input, "reciprocal", _reciprocal, _reciprocal_grad)


def square(input):
    return _unary(input, "square", _square, _square_grad)


def sin(input):
    return _unary(input, "sin", _sin, _sin_grad)


def cos(input):
    return _unary(input, "cos", _cos, _cos_grad)


def erf(input):
    return _unary(input, "erf", _erf, _erf_grad)


# ------------------------------------------------------------------------------ registry/tests

_BROADCASTS = [((3, 37), (37,)), ((5, 1, 7), (1, 4, 7)), ((1,), (129, 7)), ((0, 5), (5,)), ((13, 1), (13, 1))]
_TINY_BROADCASTS = [((3, 4), (4,)), ((2, 1, 3), (1, 2, 3)), ((1,), (2, 3))]


def _reduction(a: Shape, b: Shape) -> int:
    out = math.prod(broadcast_shapes([a, b], "samples"))
    return max(1, out // max(1, math.prod(a)), out // max(1, math.prod(b)))


def _binary_samples(
    shapes, x_range=(-2.0, 2.0), y_range=(-2.0, 2.0), y_sign=False, scalars=(2.5, -1.5), ties=False, scalar_shape=(3, 7)
):
    def samples(dtype, gen):
        out = []
        for sa, sb in shapes:
            x = make(gen, *sa, low=x_range[0], high=x_range[1])
            y = make(gen, *sb, low=y_range[0], high=y_range[1])
            if y_sign:
                y = y * (torch.randint(0, 2, sb, generator=gen) * 2 - 1)
            if ties:  # multiples of 0.5: many exact ties, other pairs far apart
                x, y = (x * 2).round() / 2, (y * 2).round() / 2
            out.append(Sample((x.to(dtype), y.to(dtype)), name=f"{sa}x{sb}", reduction=_reduction(sa, sb)))
        if scalars:
            t = make(gen, *scalar_shape, low=x_range[0], high=x_range[1]).to(dtype)
            s = make(gen, *scalar_shape, low=y_range[0], high=y_range[1]).to(dtype)
            if y_sign:
                s = s * (torch.randint(0, 2, scalar_shape, generator=gen) * 2 - 1).to(dtype)
            out.append(Sample((t, scalars[0]), name="tensor,number"))
            out.append(Sample((scalars[1], s), name="number,tensor"))
        return out

    return samples


def _gradcheck(sampler):
    return lambda gen: sampler(torch.float64, gen)


def _register_binary(name, fn, ref, notes="", **ranges):
    register(
        OpInfo(
            name,
            fn,
            ref,
            _binary_samples(_BROADCASTS, **ranges),
            family="elementwise",
            gradcheck_samples=_gradcheck(_binary_samples(_TINY_BROADCASTS, scalar_shape=(5,), **ranges)),
            notes=notes,
        )
    )


def _torch_binary(fn):
    def ref(a, b, *args, **kwargs):
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a, dtype=b.dtype)
        if not isinstance(b, torch.Tensor):
            b = torch.tensor(b, dtype=a.dtype)
        return fn(a, b, *args, **kwargs)

    return ref


_register_binary("add", add, lambda a, b: a + b)
_register_binary("sub", sub, lambda a, b: a - b)
register(
    OpInfo(
        "add_alpha",
        lambda a, b: add(a, b, alpha=-0.75),
        lambda a, b: torch.add(a, b, alpha=-0.75),
        _binary_samples(_BROADCASTS[:2], scalars=()),
        family="elementwise",
        gradcheck_samples=_gradcheck(_binary_samples(_TINY_BROADCASTS[:2], scalars=())),
    )
)
register(
    OpInfo(
        "sub_alpha",
        lambda a, b: sub(a, b, alpha=2),
        lambda a, b: torch.sub(a, b, alpha=2),
        _binary_samples(_BROADCASTS[:2], scalars=()),
        family="elementwise",
        gradcheck_samples=_gradcheck(_binary_samples(_TINY_BROADCASTS[:2], scalars=())),
    )
)
_register_binary("mul", mul, lambda a, b: a * b)
_register_binary("div", div, lambda a, b: a / b, y_range=(0.5, 2.0), y_sign=True, scalars=(2.5, -1.5))
_register_binary("pow", pow, lambda a, b: torch.pow(a, b), x_range=(0.5, 2.0), y_range=(-2.0, 2.0), scalars=(1.7, 1.5))
register(
    OpInfo(
        "pow_scalar_exponent",
        lambda x: pow(x, 3),
        lambda x: torch.pow(x, 3),
        lambda dtype, gen: [Sample((make(gen, *s).to(dtype),), name=str(s)) for s in ((3, 37), (0, 5))],
        family="elementwise",
        gradcheck_samples=lambda gen: [Sample((make(gen, 2, 5, dtype=torch.float64),))],
    )
)
register(
    OpInfo(
        "pow_square",
        lambda x: x**2,
        lambda x: x**2,
        lambda dtype, gen: [Sample((make(gen, 3, 37).to(dtype),))],
        family="elementwise",
        gradcheck_samples=lambda gen: [Sample((make(gen, 2, 5, dtype=torch.float64),))],
    )
)
_register_binary("maximum", maximum, _torch_binary(torch.maximum), ties=True, scalars=())
_register_binary("minimum", minimum, _torch_binary(torch.minimum), ties=True, scalars=())


def _where_samples(shapes, scalar_shape=(3, 7)):
    def samples(dtype, gen):
        out = []
        for sc, sa, sb in shapes:
            cond = torch.rand(sc, generator=gen) < 0.5
            out.append(Sample((cond, make(gen, *sa).to(dtype), make(gen, *sb).to(dtype)), name=f"{sc},{sa},{sb}"))
        cond = torch.rand(scalar_shape, generator=gen) < 0.5
        out.append(Sample((cond, make(gen, *scalar_shape).to(dtype), 0.5), name="tensor,number"))
        out.append(Sample((cond, -1.25, make(gen, scalar_shape[-1]).to(dtype)), name="number,tensor"))
        return out

    return samples


def _where_ref(cond, a, b):
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=b.dtype)
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype)
    return torch.where(cond, a, b)


register(
    OpInfo(
        "where",
        where,
        _where_ref,
        _where_samples([((3, 37), (3, 37), (37,)), ((5, 1, 7), (1, 4, 7), (5, 4, 1)), ((0, 5), (5,), (1,))]),
        family="elementwise",
        gradcheck_samples=_gradcheck(
            _where_samples([((2, 3), (2, 3), (3,)), ((2, 1, 3), (1, 2, 3), (2, 2, 1))], scalar_shape=(2, 3))
        ),
    )
)


def _clamp_samples(shapes, tensors):
    def samples(dtype, gen):
        out = []
        for s in shapes:
            x = away_from(make(gen, *s, low=-3, high=3), (-1.0, 0.5))
            out.append(Sample((x.to(dtype),), {"min": -1.0, "max": 0.5}, name=f"{s} both"))
            out.append(Sample((x.to(dtype),), {"min": -1.0}, name=f"{s} min"))
            out.append(Sample((x.to(dtype),), {"max": 0.5}, name=f"{s} max"))
        for sx, slo, shi in tensors:
            x = make(gen, *sx, low=-3, high=3)
            lo = make(gen, *slo, low=-2, high=0)
            hi = make(gen, *shi, low=-1, high=2)
            out.append(
                Sample(
                    (x.to(dtype), lo.to(dtype), hi.to(dtype)), name=f"tensors {sx},{slo},{shi}", reduction=math.prod(sx)
                )
            )
        return out

    return samples


def _clamp_fn(x, min=None, max=None):
    return clamp(x, min, max)


register(
    OpInfo(
        "clamp",
        _clamp_fn,
        lambda x, min=None, max=None: torch.clamp(x, min, max),
        _clamp_samples([(3, 37), (1,), (0, 5)], [((3, 37), (37,), (3, 1)), ((5, 4, 7), (1,), (4, 7))]),
        family="elementwise",
        gradcheck_samples=_gradcheck(_clamp_samples([(2, 4)], [((2, 4), (4,), (2, 1))])),
    )
)


def _unary_samples(low=-3.0, high=3.0, kinks=(), shapes=((3, 37), (129, 7), (1,), (0, 5))):
    def samples(dtype, gen):
        return [Sample((away_from(make(gen, *s, low=low, high=high), kinks).to(dtype),), name=str(s)) for s in shapes]

    return samples


def _register_unary(name, fn, ref, **domain):
    register(
        OpInfo(
            name,
            fn,
            ref,
            _unary_samples(**domain),
            family="elementwise",
            gradcheck_samples=_gradcheck(_unary_samples(shapes=((3, 7), (1,)), **domain)),
        )
    )


_register_unary("neg", neg, torch.neg)
_register_unary("abs", abs, torch.abs, kinks=(0.0,))
_register_unary("exp", exp, torch.exp)
_register_unary("log", log, torch.log, low=0.2, high=4.0)
_register_unary("sqrt", sqrt, torch.sqrt, low=0.2, high=4.0)
_register_unary("rsqrt", rsqrt, torch.rsqrt, low=0.2, high=4.0)
_register_unary("reciprocal", reciprocal, torch.reciprocal, kinks=(0.0,), low=-2.0, high=2.0)
_register_unary("square", square, torch.square)
_register_unary("sin", sin, torch.sin)
_register_unary("cos", cos, torch.cos)
_register_unary("erf", erf, torch.erf)
