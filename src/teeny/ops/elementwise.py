"""Element-wise maths with NumPy/PyTorch broadcasting: add, sub, mul, div (true, 'trunc', 'floor'),
pow, minimum, maximum, where and clamp. (The unary maths live in ``teeny.ops.unary``.)

One kernel pair serves every op of one to three operand slots (x, y, z):

    elementwise_forward:   out[i] = FN(x[bx(i)], y[by(i)], z[bz(i)], alpha)
    elementwise_backward:  (gx, gy, gz)[i] = GRAD(x, y, z, dout[i], alpha)   (per output element i)
    common.sum_to_shape:   dX[t] = sum over the output elements i that read X[t] of gx[i]

``FN`` / ``GRAD`` are small ``@triton.jit`` maths functions passed as compile-time constants.
Each slot has a compile-time mode: FULL (as many elements as the output: read at the flat index),
SCALAR (a one-element tensor), STRIDED (broadcast: the flat output index is unravelled over the
output's dimensions, merged where every operand is contiguous across them, at most ``MAX_DIMS``),
VALUE (a Python number, a scalar argument: float64 in float64 kernels, float32 otherwise, which
is how PyTorch's opmath rounds it) or NONE. Operands are converted to the output's dtype (as
PyTorch promotes: an integer bound of a float clamp becomes a float) and computed in float32 for
halves; clamp also runs on integer tensors.

Backward writes the gradient of a FULL operand straight into its buffer; the gradient of a
broadcast operand is written output-shaped in float32 (float64 for float64) and summed back to
the operand's shape by ``common.sum_to_shape``. Where an operand's gradient is ``dout`` itself
(add, sub's first operand) no kernel runs for it: a view of ``dout``, or ``dout`` summed to the
operand's shape. The rounded divisions are piecewise constant: their gradient is zero, as PyTorch's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..core.common import (
    ELEMENTWISE_BLOCK,
    MAX_DIMS,
    acc_dtype,
    broadcast_strides,
    cdiv,
    strided_offsets,
    sum_to_shape,
    sum_to_shape_kernel,
    upcast,
    visit_layout,
)
from ..core.device import INTERPRETER
from ..core.graph import Tensor, graph_of
from ..core.kernel import ALL_FLOAT_DTYPES, INT_DTYPES, dtype_name, kernel
from ..core.runtime import ArgVisitor, Launch, RuntimeOp
from .unary import POW_AS_UNARY, true_div, unary

__all__ = ["add", "sub", "mul", "div", "pow", "minimum", "maximum", "where", "clamp"]
NN_LAYERS: list[str] = []

BLOCK = ELEMENTWISE_BLOCK  # 16K elements under the interpreter (few, wide programs), 1024 on the GPU
# what an operand slot holds (its X_MODE / Y_MODE / Z_MODE)
NONE = tl.constexpr(0)  # nothing (or a tensor the backward did not save)
VALUE = tl.constexpr(1)  # a Python number, passed as a scalar argument
SCALAR = tl.constexpr(2)  # a one-element tensor
FULL = tl.constexpr(3)  # as many elements as the output
STRIDED = tl.constexpr(4)  # broadcast to the output through a strided layout
_POW_LIBDEVICE = tl.constexpr(not INTERPRETER)  # the interpreter has no libdevice

Shape = tuple[int, ...]
Operand = Tensor | int | float  # a tensor or a Python number


# ------------------------------------------------------------------------------ kernels


@triton.jit
def _flat_index(pid, BLOCK: tl.constexpr, INT64: tl.constexpr):
    if INT64:
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _computed(v, like_ptr):
    """``v`` in the dtype the kernel computes in: the output's (``like_ptr``'s), float32 for halves.
    An operand of another dtype (an integer bound of a float clamp) is converted to the output's
    dtype first, through float32 for halves, as PyTorch converts it."""
    ty = like_ptr.dtype.element_ty
    if ty == tl.float64 or not ty.is_floating():
        v = v.to(ty)
    else:
        if v.dtype != ty and v.dtype != tl.int1:  # a bool goes straight to float32: the 3.6
            v = v.to(tl.float32).to(ty)  # interpreter converts bool to bfloat16 wrongly
        v = v.to(tl.float32)
    return v


@triton.jit
def _operand(
    ptr, value, index, mask,
    d0, d1, d2, d3, d4,  # the output's sizes, innermost first (STRIDED)
    t0, t1, t2, t3, t4, t5,  # the operand's strides along them (STRIDED)
    like_ptr, MODE: tl.constexpr, NDIM: tl.constexpr,
):  # fmt: skip
    """One slot's operand at the flat output indices, in the compute dtype. Numbers and
    one-element tensors come as blocks too: the 3.6 interpreter broadcasts a 0-d bool (a
    comparison of them) to float64, which breaks '&' with a block of bools."""
    if MODE == VALUE:  # a scalar argument (under the interpreter: the Python number itself)
        ty = like_ptr.dtype.element_ty
        if ty.is_floating() and ty != tl.float64:
            ty = tl.float32
        return tl.full(index.shape, value, ty)
    elif MODE == SCALAR:
        return tl.broadcast_to(_computed(tl.load(ptr), like_ptr), index.shape)
    elif MODE == FULL:
        return _computed(tl.load(ptr + index, mask=mask, other=0), like_ptr)
    elif MODE == STRIDED:
        offsets = strided_offsets(index, d0, d1, d2, d3, d4, t0, t1, t2, t3, t4, t5, NDIM)
        return _computed(tl.load(ptr + offsets, mask=mask, other=0), like_ptr)
    else:
        return 0.0


@kernel(half=True, optional=("x_ptr", "y_ptr", "z_ptr", "gx_ptr", "gy_ptr", "gz_ptr"))
def elementwise_backward(
    x_ptr, y_ptr, z_ptr, dout_ptr, gx_ptr, gy_ptr, gz_ptr,
    n, x_value, y_value, z_value, alpha,
    xd0, xd1, xd2, xd3, xd4,  # the output's sizes, innermost first, for x's layout
    xt0, xt1, xt2, xt3, xt4, xt5,  # x's strides along them (0 where broadcast)
    yd0, yd1, yd2, yd3, yd4,  # the output's sizes, innermost first, for y's layout
    yt0, yt1, yt2, yt3, yt4, yt5,  # y's strides along them (0 where broadcast)
    zd0, zd1, zd2, zd3, zd4,  # the output's sizes, innermost first, for z's layout
    zt0, zt1, zt2, zt3, zt4, zt5,  # z's strides along them (0 where broadcast)
    GRAD: tl.constexpr,
    X_MODE: tl.constexpr, Y_MODE: tl.constexpr, Z_MODE: tl.constexpr,
    NDIM: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The gradient of each slot whose pointer is given, output-shaped (see the module docstring)."""
    index = _flat_index(tl.program_id(0), BLOCK, INT64)
    mask = index < n
    x = _operand(
        x_ptr, x_value, index, mask, xd0, xd1, xd2, xd3, xd4, xt0, xt1, xt2, xt3, xt4, xt5, dout_ptr, X_MODE, NDIM
    )
    y = _operand(
        y_ptr, y_value, index, mask, yd0, yd1, yd2, yd3, yd4, yt0, yt1, yt2, yt3, yt4, yt5, dout_ptr, Y_MODE, NDIM
    )
    z = _operand(
        z_ptr, z_value, index, mask, zd0, zd1, zd2, zd3, zd4, zt0, zt1, zt2, zt3, zt4, zt5, dout_ptr, Z_MODE, NDIM
    )
    dout = upcast(tl.load(dout_ptr + index, mask=mask, other=0))
    gx, gy, gz = GRAD(x, y, z, dout, alpha)
    if gx_ptr is not None:
        tl.store(gx_ptr + index, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    if gy_ptr is not None:
        tl.store(gy_ptr + index, gy.to(gy_ptr.dtype.element_ty), mask=mask)
    if gz_ptr is not None:
        tl.store(gz_ptr + index, gz.to(gz_ptr.dtype.element_ty), mask=mask)


@kernel(
    backward=(elementwise_backward, sum_to_shape_kernel),
    dtypes=ALL_FLOAT_DTYPES + INT_DTYPES,  # integer tensors for clamp
    optional=("x_ptr", "y_ptr", "z_ptr"),
)
def elementwise_forward(
    x_ptr, y_ptr, z_ptr, out_ptr,
    n, x_value, y_value, z_value, alpha,
    xd0, xd1, xd2, xd3, xd4,  # the output's sizes, innermost first, for x's layout
    xt0, xt1, xt2, xt3, xt4, xt5,  # x's strides along them (0 where broadcast)
    yd0, yd1, yd2, yd3, yd4,  # the output's sizes, innermost first, for y's layout
    yt0, yt1, yt2, yt3, yt4, yt5,  # y's strides along them (0 where broadcast)
    zd0, zd1, zd2, zd3, zd4,  # the output's sizes, innermost first, for z's layout
    zt0, zt1, zt2, zt3, zt4, zt5,  # z's strides along them (0 where broadcast)
    FN: tl.constexpr,
    X_MODE: tl.constexpr, Y_MODE: tl.constexpr, Z_MODE: tl.constexpr,
    NDIM: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    index = _flat_index(tl.program_id(0), BLOCK, INT64)
    mask = index < n
    x = _operand(
        x_ptr, x_value, index, mask, xd0, xd1, xd2, xd3, xd4, xt0, xt1, xt2, xt3, xt4, xt5, out_ptr, X_MODE, NDIM
    )
    y = _operand(
        y_ptr, y_value, index, mask, yd0, yd1, yd2, yd3, yd4, yt0, yt1, yt2, yt3, yt4, yt5, out_ptr, Y_MODE, NDIM
    )
    z = _operand(
        z_ptr, z_value, index, mask, zd0, zd1, zd2, zd3, zd4, zt0, zt1, zt2, zt3, zt4, zt5, out_ptr, Z_MODE, NDIM
    )
    tl.store(out_ptr + index, FN(x, y, z, alpha).to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ maths
# FN(x, y, z, alpha) -> out and GRAD(x, y, z, dout, alpha) -> (gx, gy, gz), in float32/64.


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
    return true_div(x, y)


@triton.jit
def _div_grad(x, y, z, dout, alpha):
    gx = true_div(dout, y)
    return gx, -dout * true_div(true_div(x, y), y), dout


@triton.jit
def _div_trunc(x, y, z, alpha):
    q = true_div(x, y)
    return tl.where(q < 0, tl.ceil(q), tl.floor(q))


@triton.jit
def _div_floor(x, y, z, alpha):
    """PyTorch's floor division: the quotient of x - fmod(x, y) (exact), corrected by one where
    the remainder's sign differs from y's, then rounded to the nearest integer; IEEE x / y for
    y = 0, and a zero quotient keeps the sign of x / y."""
    q = true_div(x, y)
    mod = x % y  # fmod: the sign of x
    div = true_div(x - mod, y)
    div = tl.where((mod != 0) & ((y < 0) != (mod < 0)), div - 1.0, div)
    floor = tl.floor(div)
    floor = tl.where(div - floor > 0.5, floor + 1.0, floor)
    return tl.where(y == 0, q, tl.where(div != 0, floor, q * 0.0))


@triton.jit
def _zero_grad(x, y, z, dout, alpha):  # the rounded divisions: zero almost everywhere, as PyTorch
    zero = tl.zeros_like(dout)
    return zero, zero, zero


@triton.jit
def _sign_bit(a):
    """Whether a is negative or -0.0."""
    return (a < 0) | ((a == 0) & (1.0 / a < 0))


@triton.jit
def _pow_impl(a, b):
    """a ** b with C's pow semantics (a negative finite base needs an integer exponent; the sign of
    -0.0 and -inf is kept for odd integer exponents; pow(-1, +-inf) = pow(1, y) = pow(x, 0) = 1)."""
    if _POW_LIBDEVICE:
        return libdevice.pow(a, b)
    else:
        magnitude = tl.exp2(b * tl.log2(tl.abs(a)))
        fractional = b != tl.floor(b)
        odd = tl.abs(b - 2.0 * tl.floor(0.5 * b)) == 1.0
        result = tl.where(odd & _sign_bit(a), magnitude * -1.0, magnitude)  # (-m is 0 - m: +0.0 for 0)
        result = tl.where((a < 0) & (a > float("-inf")) & fractional, float("nan"), result)
        one = (b == 0) | (a == 1) | ((a == -1) & (tl.abs(b) == float("inf")))
        return tl.where(one, 1.0, result)


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
def _clamp(x, y, z, alpha):  # y: min, z: max; a NaN bound gives NaN, as PyTorch
    low = tl.where(x < y, y, x)
    out = tl.where(low > z, z, low)
    return tl.where((y != y) | (z != z), y + z, out)


@triton.jit
def _clamp_grad(x, y, z, dout, alpha):
    # as torch: x passes where min <= x <= max; min gets it where x < min < max; max where x > max or max < min
    gx = tl.where((x >= y) & (x <= z), dout, 0.0)
    gy = tl.where((x < y) & (y < z), dout, 0.0)
    gz = tl.where((x > z) | (z < y), dout, 0.0)
    return gx, gy, gz


@triton.jit
def _clamp_min(x, y, z, alpha):  # y: min; the NaN test apart, as in _clamp (fused, it was lost on the GPU)
    low = tl.where(x < y, y, x)
    return tl.where(y != y, y, low)


@triton.jit
def _clamp_min_grad(x, y, z, dout, alpha):
    return tl.where(x >= y, dout, 0.0), tl.where(x < y, dout, 0.0), dout


@triton.jit
def _clamp_max(x, y, z, alpha):  # z: max; the NaN test apart, as in _clamp_min
    high = tl.where(x > z, z, x)
    return tl.where(z != z, z, high)


@triton.jit
def _clamp_max_grad(x, y, z, dout, alpha):
    return tl.where(x <= z, dout, 0.0), dout, tl.where(x > z, dout, 0.0)


# ------------------------------------------------------------------------------ layout


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


# ------------------------------------------------------------------------------ the op


@dataclass(frozen=True)
class Maths:
    """One element-wise op's maths: FN, GRAD, which operand slots each slot's gradient reads (to
    save only those), the slots whose gradient is ``dout`` itself, and whether integer tensors
    are operands too (clamp)."""

    fn: object
    grad: object
    reads: tuple[tuple[int, ...], ...]
    passthrough: tuple[int, ...] = ()
    integers: bool = False


@dataclass(frozen=True)
class Slot:
    """An operand slot: a tensor (``input``: its index among the node's inputs), a Python
    ``number``, or nothing."""

    input: int | None = None
    number: int | float | None = None


_SLOT_NAMES = ("x", "y", "z")


def _negative_zero(number) -> bool:
    return isinstance(number, float) and number == 0.0 and math.copysign(1.0, number) < 0


class ElementwiseOp(RuntimeOp):
    """Up to three operand slots, each a tensor input (in order), a Python number or nothing."""

    kernel = elementwise_forward

    def __init__(self, name: str, maths: Maths, operands: list, alpha: float = 0.0, bool_slots: tuple[int, ...] = ()):
        self.name, self.maths, self.alpha, self.bool_slots = name, maths, alpha, bool_slots
        self.slots: list[Slot] = []
        for operand in list(operands) + [None] * (3 - len(operands)):
            if isinstance(operand, Tensor):
                self.slots.append(Slot(input=sum(s.input is not None for s in self.slots)))
            else:
                self.slots.append(Slot(number=operand))
        self.n_activation_inputs = sum(s.input is not None for s in self.slots)
        needed = set()
        for index, slot in enumerate(self.slots):
            if slot.input is not None and index not in maths.passthrough:
                needed.update(maths.reads[index])
        self.saves_inputs = tuple(self.slots[s].input for s in sorted(needed) if self.slots[s].input is not None)

    # --- shapes and dtypes -------------------------------------------------------------
    def check_inputs(self, input_shapes, input_dtypes):
        for index, slot in enumerate(self.slots):
            if slot.input is None:
                continue
            dtype = input_dtypes[slot.input]
            if index in self.bool_slots:
                if dtype != torch.bool:
                    raise TypeError(f"the condition must be a bool tensor, got {dtype_name(dtype)}")
            elif not (dtype.is_floating_point or (self.maths.integers and dtype in INT_DTYPES)):
                kinds = "floating-point or integer" if self.maths.integers else "floating-point"
                raise TypeError(f"only {kinds} tensors are supported, got {dtype_name(dtype)}")
        shape = broadcast_shapes([tuple(s) for s in input_shapes], self.name)
        if len(self._layout(input_shapes, shape)[0]) > MAX_DIMS:
            raise ValueError(
                f"shapes {' and '.join(str(tuple(s)) for s in input_shapes)} broadcast over more than "
                f"{MAX_DIMS} non-mergeable dimensions"
            )

    def output_shape(self, input_shapes):
        return broadcast_shapes([tuple(s) for s in input_shapes], self.name)

    def output_dtype(self, input_dtypes):
        """The float operand's dtype; for integer tensors (clamp) the default float dtype when a
        bound is a float number, else their promoted integer dtype (as PyTorch)."""
        operands = [
            input_dtypes[s.input] for i, s in enumerate(self.slots) if s.input is not None and i not in self.bool_slots
        ]
        floats = [d for d in operands if d.is_floating_point]
        if floats:
            return floats[0]
        if any(isinstance(s.number, float) for s in self.slots):
            return torch.get_default_dtype()
        return functools.reduce(torch.promote_types, operands)

    def _layout(self, input_shapes, out_shape):
        strides = [
            broadcast_strides(tuple(input_shapes[s.input]), out_shape) if s.input is not None else [0] * len(out_shape)
            for s in self.slots
        ]
        return _merged_layout(tuple(out_shape), strides)

    def _visit_operands(self, args: ArgVisitor, tensors: list, input_shapes, out_shape, dtype: torch.dtype) -> None:
        """Visit each slot's pointer, number, mode and layout, and the launch's NDIM and INT64, for
        a kernel computing in ``dtype`` (the output's). ``tensors[i]`` is None for an input the
        backward did not save."""
        n = math.prod(out_shape)
        sizes, strides = self._layout(input_shapes, out_shape)
        as_number = float if dtype.is_floating_point else int
        for slot, name, slot_strides in zip(self.slots, _SLOT_NAMES, strides):
            tensor = tensors[slot.input] if slot.input is not None else None
            if slot.number is not None and INTERPRETER and _negative_zero(slot.number) and dtype.is_floating_point:
                # the interpreter makes a number equal to zero +0.0 (Triton's scalar_constant): -0.0
                # travels as a one-element tensor, whose load keeps its sign (the GPU's argument does)
                device = next((t.device for t in tensors if t is not None), None)
                tensor, mode = torch.full((1,), -0.0, dtype=dtype, device=device), SCALAR
            elif slot.number is not None:
                mode = VALUE
            elif tensor is None:
                mode = NONE
            else:
                numel = math.prod(input_shapes[slot.input])
                mode = FULL if numel == n else SCALAR if numel == 1 else STRIDED
            number = as_number(slot.number) if slot.number is not None and mode == VALUE else as_number(0)
            args.visit(**{f"{name}_ptr": tensor, f"{name}_value": number, f"{name.upper()}_MODE": mode.value})
            visit_layout(args, name, sizes, slot_strides)
        args.visit(alpha=as_number(self.alpha), NDIM=len(sizes), INT64=n >= 2**31 - BLOCK)

    # --- forward -----------------------------------------------------------------------
    def forward_launches(self, ctx):
        n = math.prod(ctx.output_shape)
        args = ArgVisitor().visit(out_ptr=ctx.output, n=n, FN=self.maths.fn)
        self._visit_operands(args, ctx.inputs, ctx.input_shapes, ctx.output_shape, ctx.output.dtype)
        return [Launch(elementwise_forward, (cdiv(n, BLOCK), 1, 1), args, BLOCK)]

    # --- backward ----------------------------------------------------------------------
    def backward_launches(self, ctx):
        out_shape, n = tuple(ctx.output_shape), math.prod(ctx.output_shape)
        dout = ctx.grad_output
        written = {}  # slot -> where the kernel writes its gradient (the buffer, or output-shaped scratch)
        sums = []  # (output-shaped gradient, the input's gradient buffer) to sum over broadcast dims
        for index, slot in enumerate(self.slots):
            grad = ctx.grad_inputs[slot.input] if slot.input is not None else None
            if grad is None:
                continue
            broadcast = math.prod(ctx.input_shapes[slot.input]) != n
            if index in self.maths.passthrough:
                if broadcast:
                    sums.append((dout, grad))
                else:
                    ctx.grad_inputs[slot.input] = dout.view(grad.shape)
            elif broadcast:
                written[index] = ctx.empty(out_shape, acc_dtype(ctx.dtype))
                sums.append((written[index], grad))
            else:
                written[index] = grad
        launches = []
        if written:
            args = ArgVisitor().visit(dout_ptr=dout, n=n, GRAD=self.maths.grad)
            args.visit(**{f"g{_SLOT_NAMES[index]}_ptr": buffer for index, buffer in written.items()})
            self._visit_operands(args, ctx.inputs, ctx.input_shapes, out_shape, dout.dtype)
            launches.append(Launch(elementwise_backward, (cdiv(n, BLOCK), 1, 1), args, BLOCK))
        for full, grad in sums:
            launches += sum_to_shape(ctx, full, out_shape, grad)
        return launches


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _apply(name: str, maths: Maths, operands: list, alpha: float = 0.0, bool_slots: tuple[int, ...] = ()) -> Tensor:
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
_DIV_ROUNDED = {
    "trunc": Maths(_div_trunc, _zero_grad, reads=((), (), ())),
    "floor": Maths(_div_floor, _zero_grad, reads=((), (), ())),
}
_POW = Maths(_pow, _pow_grad, reads=((0, 1), (0, 1), ()))
_MAXIMUM = Maths(_maximum, _maximum_grad, reads=((0, 1), (0, 1), ()))
_MINIMUM = Maths(_minimum, _minimum_grad, reads=((0, 1), (0, 1), ()))
_WHERE = Maths(_where, _where_grad, reads=((), (0,), (0,)))
_CLAMP = Maths(_clamp, _clamp_grad, reads=((0, 1, 2), (0, 1, 2), (0, 1, 2)), integers=True)
_CLAMP_MIN = Maths(_clamp_min, _clamp_min_grad, reads=((0, 1), (0, 1), ()), integers=True)
_CLAMP_MAX = Maths(_clamp_max, _clamp_max_grad, reads=((0, 2), (), (0, 2)), integers=True)


def add(input: Operand, other: Operand, alpha: float = 1) -> Tensor:
    """input + alpha * other, broadcasting; either operand may be a Python number."""
    return _apply("add", _ADD_ALPHA1 if alpha == 1 else _ADD, [input, other], alpha)


def sub(input: Operand, other: Operand, alpha: float = 1) -> Tensor:
    """input - alpha * other, broadcasting; either operand may be a Python number."""
    return _apply("sub", _ADD, [input, other], -alpha)


def mul(input: Operand, other: Operand) -> Tensor:
    """input * other, broadcasting; either operand may be a Python number."""
    return _apply("mul", _MUL, [input, other])


def div(input: Operand, other: Operand, rounding_mode: str | None = None) -> Tensor:
    """input / other, broadcasting; either operand may be a Python number. ``rounding_mode``
    "trunc" rounds the quotient toward zero, "floor" down (PyTorch's floor division, whose
    gradient is zero)."""
    if rounding_mode is None:
        return _apply("div", _DIV, [input, other])
    if rounding_mode not in _DIV_ROUNDED:
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    return _apply("div", _DIV_ROUNDED[rounding_mode], [input, other])


def pow(input: Operand, exponent: Operand) -> Tensor:
    """input ** exponent, broadcasting; either may be a Python number. A negative base needs an
    integer exponent (NaN otherwise). Exponents 2, 0.5 and -1 given as numbers run as square,
    sqrt and reciprocal (exact)."""
    if isinstance(input, Tensor) and _is_number(exponent) and float(exponent) in POW_AS_UNARY:
        fn, grad = POW_AS_UNARY[float(exponent)]
        return unary(input, "pow", fn, grad)
    return _apply("pow", _POW, [input, exponent])


def maximum(input: Operand, other: Operand) -> Tensor:
    """Element-wise maximum (NaN propagates); at ties each operand gets half the gradient."""
    return _apply("maximum", _MAXIMUM, [input, other])


def minimum(input: Operand, other: Operand) -> Tensor:
    """Element-wise minimum (NaN propagates); at ties each operand gets half the gradient."""
    return _apply("minimum", _MINIMUM, [input, other])


def where(condition: Tensor, input: Operand, other: Operand) -> Tensor:
    """input where condition else other (bool condition; all three broadcast together)."""
    if not isinstance(condition, Tensor):
        raise TypeError(f"where: condition must be a bool teeny Tensor, got {type(condition).__name__}")
    if not isinstance(input, Tensor) and not isinstance(other, Tensor):
        raise TypeError("where: at least one of input and other must be a float teeny Tensor")
    return _apply("where", _WHERE, [condition, input, other], bool_slots=(0,))


def clamp(input: Tensor, min: Operand | None = None, max: Operand | None = None) -> Tensor:
    """min(max(input, min), max), as PyTorch: min and max are numbers or tensors (broadcast,
    float or integer); a NaN bound gives NaN; integer tensors clamp to integers (to floats with a
    float bound). The gradient passes where min <= input <= max (all elements are max where
    min > max); a tensor bound gets it where it is the result."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of 'min' or 'max' must not be None")
    if not isinstance(input, Tensor):
        raise TypeError(f"clamp: input must be a teeny Tensor, got {type(input).__name__}")
    if max is None:
        return _apply("clamp", _CLAMP_MIN, [input, min])
    if min is None:
        return _apply("clamp", _CLAMP_MAX, [input, None, max])
    return _apply("clamp", _CLAMP, [input, min, max])
