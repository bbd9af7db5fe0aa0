"""Embedding: y[i, :] = W[idx[i], :]; dW[r, :] = sum of dy[i, :] over the i with idx[i] == r.

The forward gathers rows (indices of any shape, int64 or int32). The backward scatters the
rows of dy into dW, in one of two ways:

- default (``embedding_backward_atomic``): ``tl.atomic_add`` into a zeroed buffer (float32
  for half weights, then cast to dW). Fast, but the order of the additions varies from run to
  run, so the result is **not bit-reproducible**.
- deterministic (``embedding(..., deterministic=True)`` or ``set_deterministic(True)``): the
  flattened indices are sorted on the device (``torch.sort``, stable: no host sync), and
  ``embedding_backward_sorted`` has the first position of each run of equal indices sum that
  run's dy rows in position order, in fp32 (fp64 for float64). Bit-reproducible.

``padding_idx`` rows are returned by the forward but get a zero gradient. Indices outside
[0, num_embeddings) cannot be checked without a host sync: their loads and stores are masked,
so such an index reads a row of zeros and contributes no gradient (PyTorch would raise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.language as tl

from ..device import INTERPRETER
from ..graph import graph_of
from ..kernel import kernel
from ..module import Module, Parameter
from ..registry import OpInfo, Sample, make, register
from ..runtime import ArgVisitor, RuntimeOp
from .common import cdiv

__all__ = ["embedding", "set_deterministic", "get_deterministic"]
NN_LAYERS = ["Embedding"]

_DETERMINISTIC = False


def set_deterministic(flag: bool) -> None:
    """Make embedding backwards traced from now on bit-reproducible (sort-based instead of
    atomics). Read at trace time."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(flag)


def get_deterministic() -> bool:
    return _DETERMINISTIC


# the interpreter pays per program instance and per operation, not per element: wide tiles there
BLOCK_I = 256 if INTERPRETER else 32
BLOCK_D = 64 if INTERPRETER else 128
CAST_BLOCK = 16384 if INTERPRETER else 1024


# ----------------------------------------------------------------------------- kernels


@kernel(half=True)
def embedding_backward_atomic(
    idx_ptr, dy_ptr, acc_ptr, n, num, dim, padding_idx, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr
):
    """acc[idx[i], :] += dy[i, :] with atomics (not bit-reproducible); acc is zeroed first."""
    offs_i = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.load(idx_ptr + offs_i, mask=offs_i < n, other=-1).to(tl.int64)
    valid = (offs_i < n) & (rows >= 0) & (rows < num) & (rows != padding_idx)
    mask = valid[:, None] & (offs_d < dim)[None, :]
    dy = tl.load(dy_ptr + offs_i[:, None] * dim + offs_d[None, :], mask=mask, other=0.0)
    tl.atomic_add(acc_ptr + rows[:, None] * dim + offs_d[None, :], dy.to(acc_ptr.dtype.element_ty), mask=mask)


@kernel(half=True)
def embedding_backward_sorted(
    sorted_ptr, order_ptr, dy_ptr, dw_ptr, n, num, dim, padding_idx, ACC: tl.constexpr, BLOCK_D: tl.constexpr
):
    """dW[r, :] = sum over the run of sorted positions q with sorted[q] == r of dy[order[q], :],
    summed in position order by the run's first position (bit-reproducible); dW is zeroed first."""
    p = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    row = tl.load(sorted_ptr + p).to(tl.int64)
    prev = tl.load(sorted_ptr + p - 1, mask=p > 0, other=0).to(tl.int64)
    starts = (p == 0) | (row != prev)
    if starts & (row >= 0) & (row < num) & (row != padding_idx):
        acc = tl.zeros((BLOCK_D,), dtype=ACC)
        q = p
        key = row
        while key == row:
            src = tl.load(order_ptr + q).to(tl.int64)
            acc += tl.load(dy_ptr + src * dim + offs_d, mask=mask_d, other=0.0).to(ACC)
            q += 1
            key = tl.load(sorted_ptr + q, mask=q < n, other=-1).to(tl.int64)
        tl.store(dw_ptr + row * dim + offs_d, acc.to(dw_ptr.dtype.element_ty), mask=mask_d)


@kernel(half=True)
def embedding_cast(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = src in dst's dtype (the fp32 atomic buffer into a half-precision dW)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@kernel(backward=(embedding_backward_atomic, embedding_backward_sorted, embedding_cast), half=True)
def embedding_forward(idx_ptr, w_ptr, y_ptr, n, num, dim, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[i, :] = W[idx[i], :] (a row of zeros for an index outside [0, num))."""
    offs_i = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_range = offs_i < n
    rows = tl.load(idx_ptr + offs_i, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (rows >= 0) & (rows < num)
    mask_d = (offs_d < dim)[None, :]
    values = tl.load(w_ptr + rows[:, None] * dim + offs_d[None, :], mask=valid[:, None] & mask_d, other=0.0)
    tl.store(y_ptr + offs_i[:, None] * dim + offs_d[None, :], values, mask=in_range[:, None] & mask_d)


# ----------------------------------------------------------------------------- op


class EmbeddingOp(RuntimeOp):
    name = "embedding"
    kernel = embedding_forward
    n_activation_inputs = 1  # the indices; the weight is the parameter
    saves_inputs = (0,)  # the backward needs only the indices

    def __init__(self, padding_idx: int | None, deterministic: bool):
        self.padding_idx = padding_idx
        self.deterministic = deterministic

    def check_inputs(self, input_shapes, input_dtypes):
        if len(input_shapes) != 2:
            raise ValueError(f"embedding: expects indices and a weight, got {len(input_shapes)} tensors")
        if input_dtypes[0] not in (torch.int64, torch.int32):
            raise TypeError(f"embedding: indices must be int64 or int32, got {input_dtypes[0]}")
        if not input_dtypes[1].is_floating_point:
            raise TypeError(f"embedding: weight must be floating point, got {input_dtypes[1]}")
        if len(input_shapes[1]) != 2:
            raise ValueError(
                f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(input_shapes[1])}"
            )

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0]) + (input_shapes[1][1],)

    def output_dtype(self, input_dtypes):
        return input_dtypes[1]

    def _padding(self) -> int:
        return -1 if self.padding_idx is None else self.padding_idx

    def forward(self, ctx):
        (idx,), (w,) = ctx.inputs, ctx.params
        n, (num, dim) = idx.numel(), ctx.input_shapes[1]
        v = ArgVisitor().visit_ptr(idx).visit_ptr(w).visit_ptr(ctx.output).visit_i64(n).visit_i64(num).visit_i32(dim)
        v.visit_constexpr(BLOCK_I).visit_constexpr(BLOCK_D)
        ctx.launch(embedding_forward, (cdiv(n, BLOCK_I), cdiv(dim, BLOCK_D), 1), v)

    def has_backward(self):
        return True

    def backward_kernels(self):
        return (embedding_backward_sorted,) if self.deterministic else (embedding_backward_atomic, embedding_cast)

    def backward(self, ctx):
        (idx,), dw, go = ctx.inputs, ctx.grad_params[0], ctx.grad_output
        if dw is None:
            return
        n, (num, dim) = idx.numel(), ctx.input_shapes[1]
        pad = self._padding()
        if self.deterministic:
            dw.zero_()  # rows no index names keep a zero gradient
            flat = idx.reshape(-1)
            sorted_idx, order = (flat, flat) if ctx.dry_run else torch.sort(flat, stable=True)
            v = ArgVisitor().visit_ptr(sorted_idx).visit_ptr(order).visit_ptr(go).visit_ptr(dw)
            v.visit_i64(n).visit_i64(num).visit_i32(dim).visit_i64(pad)
            v.visit_constexpr(tl.float64 if ctx.dtype == torch.float64 else tl.float32).visit_constexpr(BLOCK_D)
            ctx.launch(embedding_backward_sorted, (n, cdiv(dim, BLOCK_D), 1), v, work=n * dim)
            return
        half = ctx.dtype in (torch.float16, torch.bfloat16)
        acc = ctx.zeros((num, dim), torch.float32) if half else dw.zero_()
        v = ArgVisitor().visit_ptr(idx).visit_ptr(go).visit_ptr(acc).visit_i64(n).visit_i64(num).visit_i32(dim)
        v.visit_i64(pad).visit_constexpr(BLOCK_I).visit_constexpr(BLOCK_D)
        ctx.launch(embedding_backward_atomic, (cdiv(n, BLOCK_I), cdiv(dim, BLOCK_D), 1), v, work=n * dim)
        if half:
            v = ArgVisitor().visit_ptr(acc).visit_ptr(dw).visit_i64(num * dim).visit_constexpr(CAST_BLOCK)
            ctx.launch(embedding_cast, (cdiv(num * dim, CAST_BLOCK), 1, 1), v, work=num * dim)


def embedding(input, weight, padding_idx: int | None = None, *, deterministic: bool | None = None):
    """F.embedding(input, weight, padding_idx): rows of ``weight`` picked by the integer
    ``input`` (any shape); the ``padding_idx`` row gets no gradient. ``deterministic``
    (default: ``set_deterministic``'s flag) makes the backward bit-reproducible."""
    num = weight.shape[0] if len(weight.shape) >= 1 else 0
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
            raise TypeError(f"embedding: padding_idx must be an int or None, got {padding_idx!r}")
        if not -num <= padding_idx < num:
            raise ValueError(f"embedding: padding_idx {padding_idx} is out of range for {num} embeddings")
        padding_idx %= num
    flag = _DETERMINISTIC if deterministic is None else bool(deterministic)
    return graph_of(input, weight).apply(EmbeddingOp(padding_idx, flag), [input, weight])


def _embedding_init(padding_idx: int | None):
    def init(shape, gen, dtype):
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
        if padding_idx is not None:
            values[padding_idx] = 0.0
        return values.to(dtype)

    return init


class Embedding(Module):
    """nn.Embedding(num_embeddings, embedding_dim, padding_idx=None): weight N(0, 1) with the
    padding row zeroed, like PyTorch."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        deterministic: bool | None = None,
    ):
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"Embedding: padding_idx {padding_idx} is out of range for {num_embeddings} embeddings"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.deterministic = padding_idx, deterministic
        self.weight = Parameter((num_embeddings, embedding_dim), _embedding_init(padding_idx), dtype=dtype)

    def forward(self, input):
        return embedding(input, self.weight, self.padding_idx, deterministic=self.deterministic)

    def __repr__(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx})"


# ------------------------------------------------------------------------ registry/tests


def _indices(gen, num, *shape):
    return torch.randint(0, num, shape, generator=gen, dtype=torch.int64)


def _samples(deterministic):
    def samples(dtype, gen):
        cases = [((5, 3), 7, 11, None), ((13,), 4, 37, None), ((2, 9), 6, 5, 2), ((0,), 3, 4, None), ((1,), 1, 1, None)]
        out = []
        for shape, num, dim, pad in cases:
            idx = _indices(gen, num, *shape)
            out.append(
                Sample(
                    (idx, make(gen, num, dim, dtype=dtype)),
                    {"padding_idx": pad},
                    name=f"{shape} of {num}x{dim} pad={pad}",
                    reduction=max(idx.numel(), 1),
                )
            )
        return out

    return samples


def _gradcheck(gen):
    f64 = torch.float64
    return [
        Sample((_indices(gen, 4, 7), make(gen, 4, 3, dtype=f64)), {"padding_idx": None}, name="7 of 4x3"),
        Sample((_indices(gen, 3, 2, 3), make(gen, 3, 2, dtype=f64)), {"padding_idx": None}, name="2x3 of 3x2"),
    ]
    # (padding_idx is left to the comparison with PyTorch: by definition its gradient is not
    # the finite difference)


register(
    OpInfo(
        "embedding",
        lambda idx, w, padding_idx=None: embedding(idx, w, padding_idx, deterministic=False),
        F.embedding,
        _samples(False),
        family="embedding",
        gradcheck_samples=_gradcheck,
    )
)
register(
    OpInfo(
        "embedding_deterministic",
        lambda idx, w, padding_idx=None: embedding(idx, w, padding_idx, deterministic=True),
        F.embedding,
        _samples(True),
        family="embedding",
        gradcheck_samples=_gradcheck,
    )
)
