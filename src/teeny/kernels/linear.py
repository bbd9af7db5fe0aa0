"""Matrix products: ``matmul`` (torch.matmul semantics) and ``linear`` (y = x W^T + b).

One tiled kernel computes every product, forward and backward:

    Z[g] = sum_r X[g, r] @ Y[g, r]   (+ bias[n] broadcast over rows)

with fp32 accumulation (fp64 for float64). X, Y and Z are read and written through strides,
so a transposed operand is the same buffer with its two strides swapped (dB = A^T dY reads A
as it is); ``g`` runs over the kept batch dims (up to 3 after collapsing, one per program)
and ``r`` over batch dims that the result is broadcast along, summed inside the program,
which reduces a gradient over broadcast batch dims without atomics or partials:

    Y = A @ B        dA = sum_broadcast dY @ B^T        dB = sum_broadcast A^T @ dY

``linear`` adds the bias in the forward kernel's epilogue, and its backward is
dX = dY @ W, dW = dY^T @ X (a product contracting over the rows), db = column sums of dY
(``column_sum``: fp32 partials over row chunks, then a second pass over the partials).

float32/float64 dots use ``input_precision="ieee"`` (PyTorch's full precision) unless
``set_allow_tf32(True)`` was called before tracing (like
``torch.backends.cuda.matmul.allow_tf32``; float64 is always exact). Under the Triton
interpreter bfloat16 operands are upcast to float32 before ``tl.dot``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import init
from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, OpContext, RuntimeOp
from .common import DOT_UPCAST_BF16, cdiv

__all__ = ["matmul", "linear", "set_allow_tf32", "get_allow_tf32"]
NN_LAYERS = ["Linear"]

_ALLOW_TF32 = False


def set_allow_tf32(flag: bool) -> None:
    """Let float32 products traced from now on use TF32 tensor cores (default False: full
    precision, like ``torch.backends.cuda.matmul.allow_tf32``). Read at trace time."""
    global _ALLOW_TF32
    _ALLOW_TF32 = bool(flag)


def get_allow_tf32() -> bool:
    return _ALLOW_TF32


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _product(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    syk,
    syn,
    szm,
    szn,
    G1,
    G2,
    sxg0,
    sxg1,
    sxg2,
    syg0,
    syg1,
    syg2,
    szg0,
    szg1,
    szg2,
    R1,
    n_red,
    sxr0,
    sxr1,
    syr0,
    syr1,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Z[g] = sum_r X[g, r] @ Y[g, r] (+ bias): one BLOCK_M x BLOCK_N tile of one batch entry."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    g = (pid // tiles).to(tl.int64)
    t = pid % tiles
    # grouped tile order: GROUP_M row tiles share the column tiles they read (L2 reuse)
    group = GROUP_M * tiles_n
    first_m = (t // group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % group) % group_m
    pid_n = (t % group) // group_m

    g2 = g % G2
    g1 = (g // G2) % G1
    g0 = g // G2 // G1
    x_base = x_ptr + g0 * sxg0 + g1 * sxg1 + g2 * sxg2
    y_base = y_ptr + g0 * syg0 + g1 * syg1 + g2 * syg2
    z_base = z_ptr + g0 * szg0 + g1 * szg1 + g2 * szg2

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for r in range(0, n_red):
        r0 = tl.cast(r // R1, tl.int64)
        r1 = tl.cast(r % R1, tl.int64)
        x_tile = x_base + r0 * sxr0 + r1 * sxr1 + offs_m[:, None] * sxm + offs_k[None, :] * sxk
        y_tile = y_base + r0 * syr0 + r1 * syr1 + offs_k[:, None] * syk + offs_n[None, :] * syn
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            xt = tl.load(x_tile, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            yt = tl.load(y_tile, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                yt = yt.to(tl.float32)
            acc = tl.dot(xt, yt, acc, input_precision=PRECISION, out_dtype=ACC)
            x_tile += BLOCK_K * sxk
            y_tile += BLOCK_K * syk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(ACC)[None, :]
    z_tile = z_base + offs_m[:, None] * szm + offs_n[None, :] * szn
    tl.store(z_tile, acc.to(z_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@kernel(half=True)
def column_sum(
    x_ptr, out_ptr, R, N, stride_r, ROWS: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr
):
    """out[p, n] = sum of x[r, n] over the p-th chunk of ROWS rows (in ACC precision).
    Applied twice for db: row chunks into fp32 partials, then the partials into db."""
    pid_r = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    start = pid_r.to(tl.int64) * ROWS
    acc = tl.zeros((BLOCK_N,), dtype=ACC)
    for r0 in range(0, ROWS, BLOCK_R):
        rows = start + r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        tile = tl.load(
            x_ptr + rows[:, None] * stride_r + offs_n[None, :], mask=(rows[:, None] < R) & mask_n[None, :], other=0.0
        )
        acc += tl.sum(tile.to(ACC), axis=0)
    tl.store(out_ptr + pid_r.to(tl.int64) * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@kernel(half=True)
def matmul_backward(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    syk,
    syn,
    szm,
    szn,
    G1,
    G2,
    sxg0,
    sxg1,
    sxg2,
    syg0,
    syg1,
    syg2,
    szg0,
    szg1,
    szg2,
    R1,
    n_red,
    sxr0,
    sxr1,
    syr0,
    syr1,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """dA = sum_broadcast dY @ B^T and dB = sum_broadcast A^T @ dY: the forward product with
    transposed strides, summing the broadcast batch dims inside each program."""
    _product(
        x_ptr,
        y_ptr,
        z_ptr,
        bias_ptr,
        M,
        N,
        K,
        sxm,
        sxk,
        syk,
        syn,
        szm,
        szn,
        G1,
        G2,
        sxg0,
        sxg1,
        sxg2,
        syg0,
        syg1,
        syg2,
        szg0,
        szg1,
        szg2,
        R1,
        n_red,
        sxr0,
        sxr1,
        syr0,
        syr1,
        HAS_BIAS,
        ACC,
        PRECISION,
        UPCAST,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        GROUP_M,
    )


@kernel(backward=(matmul_backward, column_sum), half=True)
def matmul_forward(
    x_ptr,
    y_ptr,
    z_ptr,
    bias_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    syk,
    syn,
    szm,
    szn,
    G1,
    G2,
    sxg0,
    sxg1,
    sxg2,
    syg0,
    syg1,
    syg2,
    szg0,
    szg1,
    szg2,
    R1,
    n_red,
    sxr0,
    sxr1,
    syr0,
    syr1,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Y[g] = A[g] @ B[g] (+ bias), batch dims broadcast through zero strides."""
    _product(
        x_ptr,
        y_ptr,
        z_ptr,
        bias_ptr,
        M,
        N,
        K,
        sxm,
        sxk,
        syk,
        syn,
        szm,
        szn,
        G1,
        G2,
        sxg0,
        sxg1,
        sxg2,
        syg0,
        syg1,
        syg2,
        szg0,
        szg1,
        szg2,
        R1,
        n_red,
        sxr0,
        sxr1,
        syr0,
        syr1,
        HAS_BIAS,
        ACC,
        PRECISION,
        UPCAST,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        GROUP_M,
    )


# H200, bf16 4096^3 forward+backward (bench/tune_launch.py): 8 warps and 4 stages for the 128x128
# half-precision tiles, 0.93 ms against 1.12 ms for Triton's default 4 warps / 3 stages.
for _k in (matmul_forward, matmul_backward):
    for _half in (torch.float16, torch.bfloat16):
        _k.tune(_half, num_warps=8, num_stages=4)


# ------------------------------------------------------------------- launch description

MAX_KEPT_DIMS = 3  # batch dims of the result, after collapsing
MAX_REDUCED_DIMS = 2  # broadcast batch dims summed inside a program, after collapsing


def _blocks(dtype: torch.dtype, tf32: bool) -> tuple[int, int, int]:
    if INTERPRETER:
        return 256, 256, 64  # the interpreter pays per program instance, not per element: few, wide ones
    if dtype in (torch.float16, torch.bfloat16) or (dtype == torch.float32 and tf32):
        return 128, 128, 32
    if dtype == torch.float64:
        return 64, 64, 16
    return 64, 64, 32


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return strides[::-1]


@dataclass
class Product:
    """One launch: Z[g] = sum_r X[g, r] @ Y[g, r] with every access through strides.
    ``kept``: (size, x, y, z strides) per batch dim of Z; ``reduced``: (size, x, y strides)."""

    M: int
    N: int
    K: int
    x: tuple[int, int]  # strides of X over (m, k)
    y: tuple[int, int]  # (k, n)
    z: tuple[int, int]  # (m, n)
    kept: list[tuple[int, int, int, int]]
    reduced: list[tuple[int, int, int]]

    @property
    def batch(self) -> int:
        return math.prod(d[0] for d in self.kept)

    def work(self) -> int:
        return self.batch * self.M * self.N


def _collapse(dims: list[tuple]) -> list[tuple]:
    """Drop size-1 dims and merge neighbours whose strides (every operand) nest."""
    out: list[tuple] = []
    for d in dims:
        if d[0] == 1:
            continue
        if out and all(po == do * d[0] for po, do in zip(out[-1][1:], d[1:])):
            prev = out.pop()
            d = (prev[0] * d[0],) + d[1:]
        out.append(d)
    return out


def _plan_product(M, N, K, x, y, z, batch: list[tuple[int, int, int, int]], where: str) -> Product:
    """``batch``: per broadcast batch dim, (size, x, y, z strides); a zero z stride on a dim of
    size > 1 makes it a reduced dim."""
    kept = _collapse([d for d in batch if d[3] != 0 or d[0] == 1])
    reduced = _collapse([d[:3] for d in batch if d[3] == 0 and d[0] != 1])
    if len(kept) > MAX_KEPT_DIMS or len(reduced) > MAX_REDUCED_DIMS:
        raise ValueError(
            f"{where}: this pattern of broadcast batch dims needs {len(kept)} batch and {len(reduced)} "
            f"summed dims; the kernel supports {MAX_KEPT_DIMS} and {MAX_REDUCED_DIMS} "
            "(reshape the operands to fewer batch dims)"
        )
    return Product(M, N, K, x, y, z, kept, reduced)


class _ProductOp(RuntimeOp):
    """Shared launch code of matmul and linear."""

    kernel = matmul_forward

    def __init__(self):
        self.allow_tf32 = _ALLOW_TF32  # read at trace time

    def precision(self, dtype: torch.dtype) -> str:
        if dtype == torch.float32 and self.allow_tf32:
            return "tf32"
        if dtype == torch.float32 or dtype == torch.float64:
            return "ieee"
        if dtype == torch.bfloat16 and DOT_UPCAST_BF16:
            return "ieee"
        return "tf32"  # half operands: the precision flag does not apply

    def has_backward(self) -> bool:
        return True

    def launch_product(self, ctx: OpContext, kernel, p: Product, x, y, z, bias=None) -> None:
        dtype = ctx.dtype
        bm, bn, bk = _blocks(dtype, self.allow_tf32)
        kept = list(p.kept) + [(1, 0, 0, 0)] * (MAX_KEPT_DIMS - len(p.kept))
        reduced = list(p.reduced) + [(1, 0, 0)] * (MAX_REDUCED_DIMS - len(p.reduced))
        v = ArgVisitor()
        v.visit_ptr(x).visit_ptr(y).visit_ptr(z).visit_ptr(bias if bias is not None else z)
        v.visit_i64(p.M).visit_i64(p.N).visit_i64(p.K)
        for s in (*p.x, *p.y, *p.z):
            v.visit_i64(s)
        v.visit_i64(kept[1][0]).visit_i64(kept[2][0])
        for operand in (1, 2, 3):
            for d in kept:
                v.visit_i64(d[operand])
        v.visit_i64(reduced[1][0]).visit_i32(math.prod(d[0] for d in reduced))
        for operand in (1, 2):
            for d in reduced:
                v.visit_i64(d[operand])
        v.visit_constexpr(bias is not None)
        v.visit_constexpr(tl.float64 if dtype == torch.float64 else tl.float32)
        v.visit_constexpr(self.precision(dtype))
        v.visit_constexpr(dtype == torch.bfloat16 and DOT_UPCAST_BF16)
        v.visit_constexpr(bm).visit_constexpr(bn).visit_constexpr(bk).visit_constexpr(8)
        grid = (p.batch * cdiv(p.M, bm) * cdiv(p.N, bn), 1, 1)
        ctx.launch(kernel, grid, v, work=p.work())

    def backward_kernels(self):
        return (matmul_backward,)


# ------------------------------------------------------------------------------- matmul


def _promote(a_shape, b_shape):
    """torch.matmul's 1-D promotion: (K,) @ ... -> (1, K); ... @ (K,) -> (K, 1)."""
    a = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    return a, b


class MatmulOp(_ProductOp):
    """torch.matmul for any ranks >= 1, batch dims broadcast."""

    name = "matmul"
    n_activation_inputs = 2
    saves_inputs = True

    def check_inputs(self, input_shapes, input_dtypes):
        a_shape, b_shape = input_shapes
        for which, shape, dt in (("first", a_shape, input_dtypes[0]), ("second", b_shape, input_dtypes[1])):
            if len(shape) == 0:
                raise ValueError(f"matmul: both arguments need at least 1 dimension, but the {which} is 0-d")
            if not dt.is_floating_point:
                raise TypeError(f"matmul: expects floating point tensors, the {which} is {dt}")
        a, b = _promote(a_shape, b_shape)
        if a[-1] != b[-2]:
            raise ValueError(
                f"matmul: shapes {tuple(a_shape)} and {tuple(b_shape)} cannot be multiplied "
                f"(inner dims {a[-1]} and {b[-2]} differ)"
            )
        try:
            torch.broadcast_shapes(a[:-2], b[:-2])
        except RuntimeError:
            raise ValueError(
                f"matmul: batch dims of {tuple(a_shape)} and {tuple(b_shape)} do not broadcast ({a[:-2]} vs {b[:-2]})"
            ) from None
        for plan in self._plans(a_shape, b_shape).values():
            plan()  # raises for unsupported broadcasting patterns

    def output_shape(self, input_shapes):
        a_shape, b_shape = input_shapes
        a, b = _promote(a_shape, b_shape)
        out = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        if len(a_shape) > 1:
            out += (a[-2],)
        if len(b_shape) > 1:
            out += (b[-1],)
        return out

    def _plans(self, a_shape, b_shape):
        """The three products (forward, dA, dB) for these shapes, as lazy builders."""
        a, b = _promote(a_shape, b_shape)
        M, K, N = a[-2], a[-1], b[-1]
        if len(b) == 2 and len(a) > 2:  # (..., M, K) @ (K, N): fold the batch into the rows
            M, a = math.prod(a[:-1]), (math.prod(a[:-1]), K)
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        n = len(batch)
        sa, sb = _contiguous_strides(a), _contiguous_strides(b)
        sc = _contiguous_strides(batch + (M, N))

        def batch_strides(shape, strides):
            shape, strides = (1,) * (n + 2 - len(shape)) + tuple(shape), [0] * (n + 2 - len(shape)) + strides
            return [0 if shape[i] == 1 else strides[i] for i in range(n)]

        ab, bb, cb = batch_strides(a, sa), batch_strides(b, sb), sc[:n]
        where = f"matmul {tuple(a_shape)} @ {tuple(b_shape)}"
        return {
            # Y = A @ B
            "forward": lambda: _plan_product(
                M,
                N,
                K,
                (sa[-2], sa[-1]),
                (sb[-2], sb[-1]),
                (sc[-2], sc[-1]),
                [(batch[i], ab[i], bb[i], cb[i]) for i in range(n)],
                where,
            ),
            # dA = dY @ B^T, summed over the dims A is broadcast along
            "grad_a": lambda: _plan_product(
                M,
                K,
                N,
                (sc[-2], sc[-1]),
                (sb[-1], sb[-2]),
                (sa[-2], sa[-1]),
                [(batch[i], cb[i], bb[i], ab[i]) for i in range(n)],
                where,
            ),
            # dB = A^T @ dY, summed over the dims B is broadcast along
            "grad_b": lambda: _plan_product(
                K,
                N,
                M,
                (sa[-1], sa[-2]),
                (sc[-2], sc[-1]),
                (sb[-2], sb[-1]),
                [(batch[i], ab[i], cb[i], bb[i]) for i in range(n)],
                where,
            ),
        }

    def forward(self, ctx):
        a, b = ctx.inputs
        p = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])["forward"]()
        self.launch_product(ctx, matmul_forward, p, a, b, ctx.output)

    def backward(self, ctx):
        a, b = ctx.inputs
        da, db = ctx.grad_inputs
        plans = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])
        if da is not None:
            self.launch_product(ctx, matmul_backward, plans["grad_a"](), ctx.grad_output, b, da)
        if db is not None:
            self.launch_product(ctx, matmul_backward, plans["grad_b"](), a, ctx.grad_output, db)


def matmul(input, other):
    """torch.matmul(input, other): 1-D operands promoted and squeezed, batch dims broadcast;
    gradients summed over broadcast dims (in fp32, inside the kernel, no atomics)."""
    return graph_of(input, other).apply(MatmulOp(), [input, other])


# ------------------------------------------------------------------------------- linear

if INTERPRETER:
    _SUM_ROWS, _SUM_BLOCK_R, _SUM_BLOCK_N = 1024, 64, 128
else:
    _SUM_ROWS, _SUM_BLOCK_R, _SUM_BLOCK_N = 2048, 32, 128


class LinearOp(_ProductOp):
    """y = x W^T + b over the flattened leading dims of x."""

    name = "linear"
    n_activation_inputs = 1
    saves_inputs = (0, 1)  # x for dW, W for dX; the bias is not needed

    def __init__(self, has_bias: bool):
        super().__init__()
        self.has_bias = has_bias

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes[0], input_shapes[1]
        if not all(d.is_floating_point for d in input_dtypes):
            raise TypeError(f"linear: expects floating point tensors, got {[str(d) for d in input_dtypes]}")
        if len(x) == 0:
            raise ValueError("linear: input must have at least 1 dimension, got a 0-d tensor")
        if len(w) != 2:
            raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w)}")
        if x[-1] != w[1]:
            raise ValueError(
                f"linear: input shape {tuple(x)} and weight shape {tuple(w)} cannot be multiplied "
                f"(in_features {x[-1]} vs {w[1]})"
            )
        if self.has_bias and tuple(input_shapes[2]) != (w[0],):
            raise ValueError(
                f"linear: bias must have shape ({w[0]},) to match weight {tuple(w)}, got {tuple(input_shapes[2])}"
            )

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[1][0],)

    def backward_kernels(self):
        return (matmul_backward, column_sum)

    @staticmethod
    def _sizes(input_shapes):
        x, w = input_shapes[0], input_shapes[1]
        return math.prod(x[:-1]), w[1], w[0]  # rows, in_features, out_features

    def forward(self, ctx):
        rows, fin, fout = self._sizes(ctx.input_shapes)
        (x,), w = ctx.inputs, ctx.params[0]
        bias = ctx.params[1] if self.has_bias else None
        # Y (rows x out) = X (rows x in) @ W^T (in x out)
        p = Product(rows, fout, fin, (fin, 1), (1, fin), (fout, 1), [], [])
        self.launch_product(ctx, matmul_forward, p, x, w, ctx.output, bias)

    def backward(self, ctx):
        rows, fin, fout = self._sizes(ctx.input_shapes)
        (x,), w = ctx.inputs, ctx.params[0]
        (dx,), go = ctx.grad_inputs, ctx.grad_output
        dw = ctx.grad_params[0]
        dbias = ctx.grad_params[1] if self.has_bias else None
        if dx is not None:  # dX (rows x in) = dY (rows x out) @ W (out x in)
            self.launch_product(
                ctx, matmul_backward, Product(rows, fin, fout, (fout, 1), (fin, 1), (fin, 1), [], []), go, w, dx
            )
        if dw is not None:  # dW (out x in) = dY^T (out x rows) @ X (rows x in)
            self.launch_product(
                ctx, matmul_backward, Product(fout, fin, rows, (1, fout), (fin, 1), (fin, 1), [], []), go, x, dw
            )
        if dbias is not None:
            self._column_sum(ctx, go, dbias, rows, fout)

    def _column_sum(self, ctx, go, out, rows, cols):
        """out = sum of go's rows: fp32 partials per chunk of rows, then one pass over them."""
        acc = tl.float64 if ctx.dtype == torch.float64 else tl.float32
        per_program = min(_SUM_ROWS, max(cdiv(rows, _SUM_BLOCK_R), 1) * _SUM_BLOCK_R)  # no empty loop trips
        chunks = max(cdiv(rows, per_program), 1)
        partial = (
            out
            if chunks == 1
            else ctx.empty((chunks, cols), torch.float64 if ctx.dtype == torch.float64 else torch.float32)
        )
        passes = [(go, partial, rows, per_program, chunks)]
        if chunks > 1:
            passes.append((partial, out, chunks, chunks, 1))
        for src, dst, n_rows, rows_per_program, programs in passes:
            v = ArgVisitor().visit_ptr(src).visit_ptr(dst).visit_i64(n_rows).visit_i32(cols).visit_i64(cols)
            v.visit_constexpr(rows_per_program).visit_constexpr(acc)
            v.visit_constexpr(_SUM_BLOCK_R).visit_constexpr(_SUM_BLOCK_N)
            ctx.launch(column_sum, (programs, cdiv(cols, _SUM_BLOCK_N), 1), v, work=cols)


def linear(input, weight, bias=None):
    """F.linear: y = input @ weight^T + bias for input of shape (..., in_features)."""
    inputs = [input, weight] + ([bias] if bias is not None else [])
    return graph_of(*inputs).apply(LinearOp(bias is not None), inputs)


class Linear(Module):
    """nn.Linear(in_features, out_features, bias=True): weight (out, in) and bias (out,),
    both U(-1/sqrt(in), 1/sqrt(in)) like PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), init.kaiming_uniform(in_features), dtype=dtype)
        self.bias = Parameter((out_features,), init.kaiming_uniform(in_features), dtype=dtype) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None})"


# ------------------------------------------------------------------------ registry/tests


def _matmul_samples(dtype, gen):
    pairs = [
        ((3, 37), (37, 5)),
        ((129, 7), (7, 11)),
        ((2, 3, 5), (5, 4)),
        ((3, 5, 7), (7, 2)),
        ((2, 1, 3, 5), (4, 5, 2)),
        ((5, 7), (3, 7, 2)),
        ((7,), (7, 3)),
        ((2, 3, 7), (7,)),
        ((7,), (7,)),
        ((0, 5), (5, 3)),
        ((3, 0), (0, 4)),
    ]
    return [
        Sample(
            (make(gen, *a, dtype=dtype), make(gen, *b, dtype=dtype)),
            name=f"{a}@{b}",
            reduction=_longest_contraction(a, b),
        )
        for a, b in pairs
    ]


def _longest_contraction(a_shape, b_shape) -> int:
    """The longest sum in the forward (K) or a gradient (M or N times the broadcast batch)."""
    a, b = _promote(a_shape, b_shape)
    batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
    return max(a[-1], a[-2] * batch, b[-1] * batch, 1)


def _matmul_gradcheck(gen):
    pairs = [((3, 4), (4, 2)), ((2, 1, 2, 2), (3, 2, 1)), ((3,), (2, 3, 1)), ((2, 3), (3,))]
    return [
        Sample((make(gen, *a, dtype=torch.float64), make(gen, *b, dtype=torch.float64)), name=f"{a}@{b}")
        for a, b in pairs
    ]


def _linear_samples(dtype, gen):
    cases = [
        ((3, 37), 5, True),
        ((129, 7), 11, False),
        ((2, 3, 5), 4, True),
        ((1, 1), 1, True),
        ((0, 5), 3, True),
        ((70, 3), 2, True),
    ]
    out = []
    for x, fout, bias in cases:
        args = [make(gen, *x, dtype=dtype), make(gen, fout, x[-1], dtype=dtype)]
        if bias:
            args.append(make(gen, fout, dtype=dtype))
        out.append(
            Sample(tuple(args), name=f"{x}->{fout}{'+b' if bias else ''}", reduction=max(x[-1], math.prod(x[:-1])))
        )
    return out


def _linear_gradcheck(gen):
    f64 = torch.float64
    return [
        Sample((make(gen, 4, 3, dtype=f64), make(gen, 2, 3, dtype=f64), make(gen, 2, dtype=f64)), name="4x3->2+b"),
        Sample((make(gen, 2, 2, 3, dtype=f64), make(gen, 3, 3, dtype=f64)), name="2x2x3->3"),
    ]


register(OpInfo("matmul", matmul, torch.matmul, _matmul_samples, family="linear", gradcheck_samples=_matmul_gradcheck))
register(OpInfo("linear", linear, F.linear, _linear_samples, family="linear", gradcheck_samples=_linear_gradcheck))
