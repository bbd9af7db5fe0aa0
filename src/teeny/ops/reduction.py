"""Reductions (sum, mean, amax/amin, var, std, logsumexp) and softmax / log_softmax.

**Reductions.** Any set of axes is reduced by one strided kernel. The op first folds the
input's shape into *groups*: size-1 axes are dropped and neighbouring axes that are both kept
or both reduced merge, so ``(5, 3, 11)`` reduced over ``(0, 2)`` becomes kept ``[3]`` (stride
11) and reduced ``[5, 11]`` (strides 33, 1). Output element ``o`` (row-major over the kept
groups, which is the contiguous output) and reduced position ``r`` (row-major over the reduced
groups) address ``x[offset(o, kept) + offset(r, reduced)]`` (``common.strided_offsets``; up to
``MAX_DIMS`` groups of each kind). A program reduces a ``BLOCK_OUT x BLOCK_R`` tile at a time,
looping over its chunk of ``r``; when few outputs share a long reduction (a sum to a scalar),
the reduction is split over programs that write float32 (float64) partials, and a second pass
combines them (``common.sum_partials`` for a plain sum, ``reduce_finish`` where a max/min
combines or a finish remains). No atomics: results are reproducible. Half inputs accumulate in
float32.

    sum:        y = sum_r x                         dx = dy
    mean:       y = sum_r x / N                     dx = dy / N
    amax/amin:  y = max_r x (NaN propagates)        dx = dy / #[x == y] * [x == y]  (ties split evenly;
                                                         NaN for a row holding NaN, as PyTorch)
    var:        mu = mean x; y = sum (x - mu)^2 / max(0, N - correction)
                                                    dx = dy * 2 (x - mu) / (N - correction)
    std:        y = sqrt(var)                       dx = dy * (x - mu) / ((N - correction) y), 0 where y = 0
    logsumexp:  m = max x (0 where infinite); y = m + log sum exp(x - m)
                                                    dx = dy * exp(x - y)

var/std and logsumexp are two exact passes over x (the mean resp. the max first, as PyTorch).
The gradients follow PyTorch's formulas at the edges too: std of a constant row has gradient 0
(not 0/0), and the divisor of var/std's gradient is N - correction even where it is <= 0.

**Softmax** over any dim: rows are ``(outer, inner)`` pairs, row elements ``inner`` apart.
A row up to ``BLOCK_L`` long is held in registers (one read, one write); a longer row runs
an online max/sum-of-exponentials loop over column blocks, then a second loop that writes.
With ``dtype=`` the input is converted to that dtype first (as PyTorch) and the result and
the maths are in it; the gradient is converted back to the input's dtype.

    softmax:      y = exp(x - m) / s,  s = sum exp(x - m)      dx = y * (dy - sum(dy * y))
    log_softmax:  y = x - m - log s                            dx = dy - exp(y) * sum(dy)
"""

from __future__ import annotations

import builtins
import math
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core.common import (
    MAX_DIMS,
    acc_dtype,
    cdiv,
    pow2,
    strided_offsets,
    sum_partials,
    sum_to_shape_kernel,
    upcast,
    visit_layout,
)
from ..core.device import INTERPRETER
from ..core.graph import Tensor, graph_of
from ..core.kernel import dtype_name, kernel
from ..core.module import Module
from ..core.runtime import ArgVisitor, Launch, RuntimeOp

__all__ = ["sum", "mean", "max", "min", "var", "std", "logsumexp", "softmax", "log_softmax"]
NN_LAYERS = ["Softmax", "LogSoftmax"]

_bmax, _bmin = builtins.max, builtins.min  # this module defines ops named max/min/sum
Dims = int | list[int] | tuple[int, ...] | None  # the axes to reduce (None or []: all)

# what a reduction pass accumulates (OP of reduce_partial / reduce_finish)
SUM = tl.constexpr(0)  # x
MAX = tl.constexpr(1)
MIN = tl.constexpr(2)
SQDEV = tl.constexpr(3)  # (x - c)^2, c the row's mean
SUMEXP = tl.constexpr(4)  # exp(x - c), c the row's max (0 where infinite)
COUNT = tl.constexpr(5)  # [x == c], c the row's max/min
# how a pass finishes (FIN)
FIN_DIV = tl.constexpr(0)  # acc / divisor
FIN_SQRT = tl.constexpr(1)  # sqrt(acc / divisor)
FIN_LOG = tl.constexpr(2)  # log(acc) + c
# which gradient (GRAD of reduce_backward)
GRAD_SUM = tl.constexpr(0)  # dy / divisor
GRAD_EXTREMUM = tl.constexpr(1)  # dy / count * [x == y]
GRAD_VAR = tl.constexpr(2)  # 2 dy (x - mu) / divisor
GRAD_STD = tl.constexpr(3)  # dy (x - mu) / (divisor y), 0 where y = 0
GRAD_LSE = tl.constexpr(4)  # dy exp(x - y)

# The interpreter pays per program instance and per operation, not per element: few, wide programs.
TILE = 16384 if INTERPRETER else 2048  # elements per reduction tile
SPLIT_TARGET = 4 if INTERPRETER else 256  # programs to aim for when a reduction is split
MIN_CHUNKS = 4  # a split program reduces at least this many BLOCK_R blocks
MAX_SPLIT = 1024
SOFTMAX_MAX_BLOCK = 16384 if INTERPRETER else 4096  # longer rows take the looping path


# ------------------------------------------------------------------------ kernel helpers


@triton.jit
def _acc_full(shape, value, ptr):
    """A tensor of ``value`` in the accumulation dtype of ``ptr``'s elements (zeros plus the value:
    the 3.6 interpreter cannot fill a bfloat16 tensor with a constant other than 0)."""
    return upcast(tl.zeros(shape, ptr.dtype.element_ty)) + value


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _identity_value(OP: tl.constexpr):
    """The identity of OP's combine (masked-off lanes take it)."""
    if OP == MAX:
        return float("-inf")
    elif OP == MIN:
        return float("inf")
    else:
        return 0.0


@triton.jit
def _reduce_tile(v, axis: tl.constexpr, OP: tl.constexpr):
    if OP == MAX:
        r = tl.reduce(v, axis, _max_nan)
    elif OP == MIN:
        r = tl.reduce(v, axis, _min_nan)
    else:
        r = tl.sum(v, axis)
    return r


@triton.jit
def _combine(a, b, OP: tl.constexpr):
    if OP == MAX:
        r = _max_nan(a, b)
    elif OP == MIN:
        r = _min_nan(a, b)
    else:
        r = a + b
    return r


@triton.jit
def _safe_max(m):
    """PyTorch's logsumexp shift: the max, or 0 where it is infinite."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _finish(acc, c, divisor, FIN: tl.constexpr):
    if FIN == FIN_DIV:
        y = acc / divisor
    elif FIN == FIN_SQRT:
        y = tl.sqrt(acc / divisor)
    else:
        y = tl.log(acc) + _safe_max(c)
    return y


# ------------------------------------------------------------------------ reduction kernels


@kernel(half=True, optional=("x_ptr", "y_ptr", "aux_ptr"))
def reduce_backward(
    x_ptr,
    y_ptr,
    aux_ptr,
    dy_ptr,
    dx_ptr,
    n_out,
    R,
    chunk,
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
    divisor,
    GRAD: tl.constexpr,
    KEPT_NDIM: tl.constexpr,
    RED_NDIM: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """dx for every reduction (see the module docstring); aux is the row's mean (var/std) or
    tie count (amax/amin). Same tiling as reduce_partial; dx has x's contiguous layout."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    row_mask = rows < n_out
    row_offsets = strided_offsets(rows, kd0, kd1, kd2, kd3, kd4, kt0, kt1, kt2, kt3, kt4, kt5, KEPT_NDIM)
    dy = upcast(tl.load(dy_ptr + rows, mask=row_mask, other=0.0))
    if y_ptr is not None:
        y = upcast(tl.load(y_ptr + rows, mask=row_mask, other=1.0))
    if aux_ptr is not None:
        aux = upcast(tl.load(aux_ptr + rows, mask=row_mask, other=1.0))
    if GRAD == GRAD_SUM:
        g = dy / divisor
    elif GRAD == GRAD_EXTREMUM:
        g = dy / aux
    elif GRAD == GRAD_VAR:
        g = 2.0 * dy / divisor
    elif GRAD == GRAD_STD:
        g = tl.where(y == 0, 0.0, dy / (divisor * y))  # PyTorch: a constant row's std has gradient 0
    else:
        g = dy
    start = tl.program_id(1).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, R)
    for col0 in range(start, end, BLOCK_R):
        cols = col0 + tl.arange(0, BLOCK_R)
        mask = row_mask[:, None] & (cols < end)[None, :]
        offsets = (
            row_offsets[:, None]
            + strided_offsets(cols, rd0, rd1, rd2, rd3, rd4, rt0, rt1, rt2, rt3, rt4, rt5, RED_NDIM)[None, :]
        )
        if GRAD == GRAD_SUM:
            dx = g[:, None] + tl.zeros([BLOCK_OUT, BLOCK_R], g.dtype)
        else:
            x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
            if GRAD == GRAD_EXTREMUM:  # a product, not a select: a row whose max is NaN (no tie) gets NaN
                dx = g[:, None] * tl.where(x == y[:, None], 1.0, 0.0)
            elif GRAD == GRAD_LSE:
                dx = g[:, None] * tl.exp(x - y[:, None])
            else:
                dx = g[:, None] * (x - aux[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(backward=(reduce_backward, sum_to_shape_kernel), half=True, optional=("center_ptr", "partial_ptr", "out_ptr"))
def reduce_partial(
    x_ptr,
    center_ptr,
    partial_ptr,
    out_ptr,
    n_out,
    R,
    chunk,
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
    divisor,
    OP: tl.constexpr,
    FIN: tl.constexpr,
    KEPT_NDIM: tl.constexpr,
    RED_NDIM: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (i, s) reduces outputs [i*BLOCK_OUT, +BLOCK_OUT) over r in [s*chunk, +chunk):
    it writes acc to partial[s, o] when the reduction is split, else finish(acc) to out.
    ``center`` is the row's mean (SQDEV) or max (SUMEXP, COUNT)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    row_mask = rows < n_out
    row_offsets = strided_offsets(rows, kd0, kd1, kd2, kd3, kd4, kt0, kt1, kt2, kt3, kt4, kt5, KEPT_NDIM)
    if center_ptr is not None:
        center = upcast(tl.load(center_ptr + rows, mask=row_mask, other=0.0))
    else:
        center = _acc_full([BLOCK_OUT], 0.0, x_ptr)
    acc = _acc_full([BLOCK_OUT], _identity_value(OP), x_ptr)
    start = tl.program_id(1).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, R)
    for col0 in range(start, end, BLOCK_R):
        cols = col0 + tl.arange(0, BLOCK_R)
        mask = row_mask[:, None] & (cols < end)[None, :]
        offsets = (
            row_offsets[:, None]
            + strided_offsets(cols, rd0, rd1, rd2, rd3, rd4, rt0, rt1, rt2, rt3, rt4, rt5, RED_NDIM)[None, :]
        )
        x = upcast(tl.load(x_ptr + offsets, mask=mask, other=0.0))
        if OP == SQDEV:
            x = (x - center[:, None]) * (x - center[:, None])
        elif OP == SUMEXP:
            x = tl.exp(x - _safe_max(center)[:, None])
        elif OP == COUNT:
            x = tl.where(x == center[:, None], 1.0, 0.0).to(acc.dtype)
        acc = _combine(acc, _reduce_tile(tl.where(mask, x, _identity_value(OP)), 1, OP), OP)
    if partial_ptr is not None:
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * n_out + rows, acc, mask=row_mask)
    else:
        tl.store(out_ptr + rows, _finish(acc, center, divisor, FIN).to(out_ptr.dtype.element_ty), mask=row_mask)


@kernel(half=True, optional=("center_ptr",))
def reduce_finish(
    partial_ptr,
    center_ptr,
    out_ptr,
    n_out,
    n_split,
    divisor,
    OP: tl.constexpr,
    FIN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_SPLIT: tl.constexpr,
):
    """Second pass of a split reduction that combines by max/min or finishes (a plain sum takes
    ``common.sum_partials``): out[o] = finish(combine_s partial[s, o])."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    row_mask = rows < n_out
    acc = _acc_full([BLOCK_OUT], _identity_value(OP), partial_ptr)
    for s0 in range(0, n_split, BLOCK_SPLIT):
        splits = s0 + tl.arange(0, BLOCK_SPLIT)
        mask = (splits < n_split)[:, None] & row_mask[None, :]
        p = tl.load(partial_ptr + splits.to(tl.int64)[:, None] * n_out + rows[None, :], mask=mask, other=0.0)
        acc = _combine(acc, _reduce_tile(tl.where(mask, p, _identity_value(OP)), 0, OP), OP)
    if center_ptr is not None:
        center = upcast(tl.load(center_ptr + rows, mask=row_mask, other=0.0))
    else:
        center = acc
    tl.store(out_ptr + rows, _finish(acc, center, divisor, FIN).to(out_ptr.dtype.element_ty), mask=row_mask)


# ------------------------------------------------------------------------ reduction op


def _check_float(name: str, dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise TypeError(f"{name}: expects a floating-point tensor, got {dtype_name(dtype)}")


def _normalize_dims(name: str, dim, ndim: int) -> tuple[int, ...]:
    """``dim`` (None, int, or list/tuple of ints; negative allowed) as sorted axes; None and
    an empty list mean every axis, as in PyTorch."""
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else None
    if dims is None or not builtins.all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"{name}: dim must be None, an int or a list/tuple of ints, got {dim!r}")
    if not dims:
        return tuple(range(ndim))
    rank = _bmax(ndim, 1)  # a 0-d tensor accepts dim 0 and -1
    out = []
    for d in dims:
        if not -rank <= d < rank:
            raise ValueError(f"{name}: dim {d} is out of range for a {ndim}-d tensor (expected {-rank}..{rank - 1})")
        d = d % rank
        if d in out:
            raise ValueError(f"{name}: dim {d} appears more than once in {dim!r}")
        out.append(d)
    return tuple(sorted(d for d in out if d < ndim))


@dataclass(frozen=True)
class ReductionPlan:
    """How a reduction of one input shape is tiled (see the module docstring)."""

    kept: tuple[tuple[int, int], ...]  # (size, stride) groups, outermost first
    reduced: tuple[tuple[int, int], ...]
    n_out: int
    R: int
    block_out: int
    block_r: int
    n_split: int
    chunk: int

    @property
    def out_programs(self) -> int:
        return cdiv(self.n_out, self.block_out)

    def visit(self, args: ArgVisitor) -> ArgVisitor:
        """Visit the kernels' tiling: n_out, R, chunk, the kept (k*) and reduced (r*) layouts
        (innermost first) with their numbers of groups, BLOCK_OUT and BLOCK_R."""
        args.visit(n_out=self.n_out, R=self.R, chunk=self.chunk)
        for prefix, groups in (("k", self.kept), ("r", self.reduced)):
            visit_layout(args, prefix, [s for s, _ in reversed(groups)], [t for _, t in reversed(groups)])
        return args.visit(
            KEPT_NDIM=len(self.kept), RED_NDIM=len(self.reduced), BLOCK_OUT=self.block_out, BLOCK_R=self.block_r
        )


def plan_reduction(shape: tuple[int, ...], dims: tuple[int, ...], block: int | None = None) -> ReductionPlan:
    """The tiling of reducing ``dims`` of a contiguous ``shape``; ``block`` caps BLOCK_R."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    groups: list[list] = []  # [size, stride, reduced]
    for axis, (size, stride) in enumerate(zip(shape, strides)):
        if size == 1:
            continue
        reduced = axis in dims
        if groups and groups[-1][2] == reduced:
            groups[-1][0] *= size
            groups[-1][1] = stride
        else:
            groups.append([size, stride, reduced])
    kept = tuple((s, t) for s, t, r in groups if not r) or ((1, 0),)
    red = tuple((s, t) for s, t, r in groups if r) or ((1, 0),)
    if len(kept) > MAX_DIMS or len(red) > MAX_DIMS:
        raise ValueError(
            f"reducing dims {dims} of shape {shape} alternates kept and reduced axes more than "
            f"{MAX_DIMS} times; reduce in two steps"
        )
    n_out, R = math.prod(s for s, _ in kept), math.prod(s for s, _ in red)
    if red[-1][1] == 1:  # the innermost axis is reduced: long contiguous rows
        block_r = _bmin(pow2(R), block or 1024)
        block_out = _bmin(pow2(n_out), _bmax(1, TILE // block_r))
    else:  # outputs are contiguous: a wide tile of outputs, a few reduced positions
        block_out = _bmin(pow2(n_out), 64)
        block_r = _bmin(pow2(R), block or _bmax(1, TILE // block_out))
    chunks = _bmax(cdiv(R, block_r), 1)
    out_programs = cdiv(n_out, block_out)
    n_split = 1
    if out_programs < SPLIT_TARGET and chunks >= 2 * MIN_CHUNKS:
        n_split = _bmin(cdiv(SPLIT_TARGET, out_programs), cdiv(chunks, MIN_CHUNKS), MAX_SPLIT)
    chunk = block_r * cdiv(chunks, n_split)
    n_split = _bmax(cdiv(R, chunk), 1)
    return ReductionPlan(kept, red, n_out, R, block_out, block_r, n_split, chunk)


_FORWARD_OP = {"sum": SUM, "mean": SUM, "max": MAX, "min": MIN}
_GRAD = {
    "sum": GRAD_SUM,
    "mean": GRAD_SUM,
    "max": GRAD_EXTREMUM,
    "min": GRAD_EXTREMUM,
    "var": GRAD_VAR,
    "std": GRAD_STD,
    "logsumexp": GRAD_LSE,
}
_SAVES = {
    "sum": (False, False),
    "mean": (False, False),
    "max": (True, True),
    "min": (True, True),
    "var": (True, False),
    "std": (True, True),
    "logsumexp": (True, True),
}  # (input, output)


class ReduceOp(RuntimeOp):
    """One reduction of ``dim`` (see the module docstring); ``max_block`` caps BLOCK_R (tests use
    a small one to force the looping and split paths)."""

    kernel = reduce_partial

    def __init__(self, kind: str, dim=None, keepdim: bool = False, correction: float = 1, max_block: int | None = None):
        if kind not in _GRAD:
            raise ValueError(f"unknown reduction {kind!r}")
        if max_block is not None and (max_block < 1 or max_block & (max_block - 1)):
            raise ValueError(f"{kind}: max_block must be a power of two, got {max_block}")
        self.name, self.kind, self.dim, self.keepdim = kind, kind, dim, bool(keepdim)
        self.correction, self.max_block = correction, max_block
        self.saves_inputs, self.saves_output = _SAVES[kind]

    def _dims(self, shape) -> tuple[int, ...]:
        return _normalize_dims(self.kind, self.dim, len(shape))

    def check_inputs(self, input_shapes, input_dtypes):
        _check_float(self.kind, input_dtypes[0])
        if not isinstance(self.keepdim, bool):
            raise TypeError(f"{self.kind}: keepdim must be a bool")
        shape = tuple(input_shapes[0])
        dims = self._dims(shape)
        if self.kind in ("max", "min"):
            for d in dims:
                if shape[d] == 0:
                    raise ValueError(
                        f"{self.kind}: cannot reduce over dim {d} of size 0 (shape {shape}): "
                        "the maximum/minimum of nothing is undefined"
                    )
        plan_reduction(shape, dims)

    def output_shape(self, input_shapes):
        shape = tuple(input_shapes[0])
        dims = self._dims(shape)
        if self.keepdim:
            return tuple(1 if i in dims else s for i, s in enumerate(shape))
        return tuple(s for i, s in enumerate(shape) if i not in dims)

    def plan(self, shape) -> ReductionPlan:
        shape = tuple(shape)
        return plan_reduction(shape, self._dims(shape), self.max_block)

    def extra_outputs(self, input_shapes, dtype):
        if self.kind in ("var", "std"):
            return {"mean": ((self.plan(input_shapes[0]).n_out,), acc_dtype(dtype))}
        return {}

    def _divisor(self, plan: ReductionPlan, backward: bool = False) -> int | float:
        """mean's N; var/std's N - correction (not below 0 in the forward: PyTorch's derivative
        keeps the difference); 1 otherwise."""
        if self.kind == "mean":
            return plan.R
        if self.kind in ("var", "std"):
            d = plan.R - self.correction if backward else _bmax(0, plan.R - self.correction)
            return int(d) if float(d).is_integer() else float(d)
        return 1

    def _pass(self, ctx, plan, x, out, op, fin=FIN_DIV, divisor=1, center=None) -> list[Launch]:
        """One reduction of x into out: one launch, or float32 (float64) partials and a second
        pass (``sum_partials`` for a plain sum, ``reduce_finish`` otherwise)."""
        grid = (plan.out_programs, plan.n_split, 1)
        args = plan.visit(ArgVisitor().visit(x_ptr=x, center_ptr=center, divisor=divisor, OP=op.value, FIN=fin.value))
        if plan.n_split == 1:
            return [Launch(reduce_partial, grid, args.visit(out_ptr=out), work=plan.n_out)]
        partial = ctx.empty((plan.n_split, plan.n_out), acc_dtype(ctx.dtype))
        launches = [Launch(reduce_partial, grid, args.visit(partial_ptr=partial), work=plan.n_out)]
        if (op is SUM or op is COUNT) and fin is FIN_DIV and divisor == 1:
            return launches + sum_partials(partial, out)
        block_out = _bmin(pow2(plan.n_out), 64)
        finish = ArgVisitor().visit(
            partial_ptr=partial,
            center_ptr=center,
            out_ptr=out,
            n_out=plan.n_out,
            n_split=plan.n_split,
            divisor=divisor,
            OP=op.value,
            FIN=fin.value,
            BLOCK_OUT=block_out,
            BLOCK_SPLIT=_bmin(pow2(plan.n_split), _bmax(1, TILE // block_out)),
        )
        return launches + [Launch(reduce_finish, (cdiv(plan.n_out, block_out), 1, 1), finish, work=plan.n_out)]

    def forward_launches(self, ctx):
        (x,), out = ctx.inputs, ctx.output
        plan = self.plan(ctx.input_shapes[0])
        if self.kind in ("var", "std"):
            mean = ctx.saved["mean"]
            fin = FIN_SQRT if self.kind == "std" else FIN_DIV
            return self._pass(ctx, plan, x, mean, SUM, FIN_DIV, plan.R) + self._pass(
                ctx, plan, x, out, SQDEV, fin, self._divisor(plan), center=mean
            )
        if self.kind == "logsumexp":
            row_max = ctx.empty((plan.n_out,), acc_dtype(ctx.dtype))
            return self._pass(ctx, plan, x, row_max, MAX) + self._pass(
                ctx, plan, x, out, SUMEXP, FIN_LOG, center=row_max
            )
        return self._pass(ctx, plan, x, out, _FORWARD_OP[self.kind], FIN_DIV, self._divisor(plan))

    def backward_launches(self, ctx):
        dx = ctx.grad_inputs[0]
        if dx is None or dx.numel() == 0:
            return []
        plan = self.plan(ctx.input_shapes[0])
        x, y, aux = ctx.inputs[0], ctx.output, ctx.saved.get("mean")  # x, y: None where not saved
        launches = []
        if self.kind in ("max", "min"):  # aux: how many elements tie for the extremum
            aux = ctx.empty((plan.n_out,), acc_dtype(ctx.dtype))
            launches += self._pass(ctx, plan, x, aux, COUNT, center=y)
        args = ArgVisitor().visit(
            x_ptr=x,
            y_ptr=y,
            aux_ptr=aux,
            dy_ptr=ctx.grad_output,
            dx_ptr=dx,
            divisor=self._divisor(plan, backward=True),
            GRAD=_GRAD[self.kind].value,
        )
        return launches + [
            Launch(reduce_backward, (plan.out_programs, plan.n_split, 1), plan.visit(args), work=dx.numel())
        ]


def _reduce(x: Tensor, kind: str, dim: Dims, keepdim: bool, correction: float = 1) -> Tensor:
    return graph_of(x).apply(ReduceOp(kind, dim, keepdim, correction), [x])


# ------------------------------------------------------------------------ softmax kernels


@kernel(half=True)
def softmax_backward(
    y_ptr,
    dy_ptr,
    dx_ptr,
    n_rows,
    L,
    inner,
    LOG: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """softmax: dx = y (dy - sum(dy y)); log_softmax: dx = dy - exp(y) sum(dy), in y's dtype
    (float32 for halves), written in x's."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    base = (rows // inner) * L * inner + rows % inner
    if SINGLE:
        cols = tl.arange(0, BLOCK_L)
        mask = row_mask[:, None] & (cols < L)[None, :]
        offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
        y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
        dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
        if LOG:
            dx = dy - tl.exp(y) * tl.sum(dy, 1)[:, None]
        else:
            dx = y * (dy - tl.sum(dy * y, 1)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        total = _acc_full([BLOCK_ROWS], 0.0, y_ptr)
        for col0 in range(0, L, BLOCK_L):
            cols = col0 + tl.arange(0, BLOCK_L)
            mask = row_mask[:, None] & (cols < L)[None, :]
            offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
            dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
            if LOG:
                total += tl.sum(dy, 1)
            else:
                total += tl.sum(dy * upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0)), 1)
        for col0 in range(0, L, BLOCK_L):
            cols = col0 + tl.arange(0, BLOCK_L)
            mask = row_mask[:, None] & (cols < L)[None, :]
            offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
            y = upcast(tl.load(y_ptr + offsets, mask=mask, other=0.0))
            dy = upcast(tl.load(dy_ptr + offsets, mask=mask, other=0.0))
            if LOG:
                dx = dy - tl.exp(y) * total[:, None]
            else:
                dx = y * (dy - total[:, None])
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_row(x_ptr, offsets, mask, y_ptr):
    """x at offsets (-inf outside the row) converted to y's dtype first, as PyTorch's dtype=
    converts the input, then computed in float32 for halves."""
    return upcast(tl.load(x_ptr + offsets, mask=mask, other=float("-inf")).to(y_ptr.dtype.element_ty))


@kernel(backward=softmax_backward, half=True)
def softmax_forward(
    x_ptr,
    y_ptr,
    n_rows,
    L,
    inner,
    LOG: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """m = max x, s = sum exp(x - m); softmax y = exp(x - m) / s, log_softmax y = x - m - log s.
    Row r is x[(r // inner) * L * inner + r % inner + j * inner], j < L. Rows longer than
    BLOCK_L: online (m, s) over column blocks, s <- s exp(m_old - m_new) + sum exp(x - m_new)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    base = (rows // inner) * L * inner + rows % inner
    if SINGLE:
        cols = tl.arange(0, BLOCK_L)
        mask = row_mask[:, None] & (cols < L)[None, :]
        offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
        x = _load_row(x_ptr, offsets, mask, y_ptr)
        m = tl.max(x, 1)
        shifted = x - m[:, None]
        e = tl.exp(shifted)
        s = tl.sum(e, 1)
        if LOG:
            y = shifted - tl.log(s)[:, None]
        else:
            y = e / s[:, None]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        m = _acc_full([BLOCK_ROWS], float("-inf"), y_ptr)
        s = _acc_full([BLOCK_ROWS], 0.0, y_ptr)
        for col0 in range(0, L, BLOCK_L):
            cols = col0 + tl.arange(0, BLOCK_L)
            mask = row_mask[:, None] & (cols < L)[None, :]
            offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
            x = _load_row(x_ptr, offsets, mask, y_ptr)
            m_new = tl.maximum(m, tl.max(x, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while a row is all -inf
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)
            m = m_new
        log_s = tl.log(s)
        for col0 in range(0, L, BLOCK_L):
            cols = col0 + tl.arange(0, BLOCK_L)
            mask = row_mask[:, None] & (cols < L)[None, :]
            offsets = base[:, None] + cols.to(tl.int64)[None, :] * inner
            x = _load_row(x_ptr, offsets, mask, y_ptr)
            if LOG:
                y = x - m[:, None] - log_s[:, None]
            else:
                y = tl.exp(x - m[:, None]) / s[:, None]
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------ softmax op


class SoftmaxOp(RuntimeOp):
    """softmax / log_softmax over ``dim``, in ``dtype`` (None: the input's); ``max_block`` caps
    BLOCK_L (rows longer loop)."""

    kernel = softmax_forward
    saves_inputs = False
    saves_output = True

    def __init__(self, dim: int, log: bool = False, dtype: torch.dtype | None = None, max_block: int | None = None):
        if max_block is not None and (max_block < 1 or max_block & (max_block - 1)):
            raise ValueError(f"softmax: max_block must be a power of two, got {max_block}")
        self.name = "log_softmax" if log else "softmax"
        self.dim, self.log, self.dtype, self.max_block = dim, log, dtype, max_block

    def check_inputs(self, input_shapes, input_dtypes):
        _check_float(self.name, input_dtypes[0])
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"{self.name}: dtype must be a floating-point torch.dtype or None, got {self.dtype!r}")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"{self.name}: dim must be an int, got {self.dim!r}")
        ndim = len(input_shapes[0])
        rank = _bmax(ndim, 1)
        if not -rank <= self.dim < rank:
            raise ValueError(
                f"{self.name}: dim {self.dim} is out of range for a {ndim}-d tensor (expected {-rank}..{rank - 1})"
            )

    def output_dtype(self, input_dtypes):
        return self.dtype or input_dtypes[0]

    def _layout(self, shape) -> dict:
        """The kernels' row layout: n_rows, L, inner, SINGLE, BLOCK_ROWS, BLOCK_L."""
        shape = tuple(shape) or (1,)
        d = self.dim % len(shape)
        L, inner = shape[d], math.prod(shape[d + 1 :])
        n_rows = math.prod(shape[:d]) * inner
        if inner == 1:  # rows are contiguous: long row blocks, few rows
            block_l = _bmin(pow2(L), self.max_block or SOFTMAX_MAX_BLOCK)
            block_rows = _bmin(pow2(n_rows), _bmax(1, TILE // block_l))
        else:  # neighbouring rows are contiguous: a wide tile of rows, short row blocks
            block_rows = _bmin(pow2(n_rows), pow2(inner), 32)
            block_l = _bmin(pow2(L), self.max_block or _bmax(1, SOFTMAX_MAX_BLOCK // block_rows))
        return dict(n_rows=n_rows, L=L, inner=inner, SINGLE=L <= block_l, BLOCK_ROWS=block_rows, BLOCK_L=block_l)

    def grid(self, input_shapes, output_shape):
        layout = self._layout(output_shape)
        return (cdiv(layout["n_rows"], layout["BLOCK_ROWS"]), 1, 1)

    def forward_launches(self, ctx):
        args = ArgVisitor().visit(x_ptr=ctx.inputs[0], y_ptr=ctx.output, LOG=self.log, **self._layout(ctx.output_shape))
        return [Launch(softmax_forward, self.grid(ctx.input_shapes, ctx.output_shape), args)]

    def backward_launches(self, ctx):
        layout = self._layout(ctx.output_shape)
        args = ArgVisitor().visit(
            y_ptr=ctx.output, dy_ptr=ctx.grad_output, dx_ptr=ctx.grad_inputs[0], LOG=self.log, **layout
        )
        return [Launch(softmax_backward, self.grid(ctx.input_shapes, ctx.output_shape), args)]


# ------------------------------------------------------------------------ functional ops


def sum(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """torch.sum: the sum over ``dim`` (None or [] : every axis)."""
    return _reduce(x, "sum", dim, keepdim)


def mean(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """torch.mean over ``dim`` (None: every axis); the mean of nothing is NaN."""
    return _reduce(x, "mean", dim, keepdim)


def max(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """torch.amax: the largest value over ``dim`` (values only; NaN propagates); the gradient
    is split evenly among tied maxima."""
    return _reduce(x, "max", dim, keepdim)


def min(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """torch.amin: the smallest value over ``dim``; gradient split evenly among ties."""
    return _reduce(x, "min", dim, keepdim)


def var(x: Tensor, dim: Dims = None, correction: float = 1, keepdim: bool = False) -> Tensor:
    """torch.var: sum (x - mean)^2 / max(0, N - correction) over ``dim``."""
    return _reduce(x, "var", dim, keepdim, correction)


def std(x: Tensor, dim: Dims = None, correction: float = 1, keepdim: bool = False) -> Tensor:
    """torch.std: sqrt of ``var``."""
    return _reduce(x, "std", dim, keepdim, correction)


def logsumexp(x: Tensor, dim: Dims, keepdim: bool = False) -> Tensor:
    """torch.logsumexp: log sum exp(x) over ``dim``, computed stably."""
    return _reduce(x, "logsumexp", dim, keepdim)


def softmax(x: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """torch.softmax over ``dim`` (any dim, any row length), computed in float32 for halves;
    with ``dtype`` the input is converted to it first and the result is in it."""
    return graph_of(x).apply(SoftmaxOp(dim, dtype=dtype), [x])


def log_softmax(x: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """torch.log_softmax over ``dim`` (``dtype`` as for ``softmax``)."""
    return graph_of(x).apply(SoftmaxOp(dim, log=True, dtype=dtype), [x])


# ------------------------------------------------------------------------ layers


def _implicit_softmax_dim(name: str, ndim: int) -> int:
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X as an argument.",
        stacklevel=3,
    )
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(Module):
    """nn.Softmax(dim); dim=None picks PyTorch's legacy implicit dim (with its warning)."""

    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return softmax(x, self.dim if self.dim is not None else _implicit_softmax_dim("softmax", x.ndim))


class LogSoftmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return log_softmax(x, self.dim if self.dim is not None else _implicit_softmax_dim("log_softmax", x.ndim))
