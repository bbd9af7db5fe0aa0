"""Embedding: y[i, :] = W[idx[i], :]; dW[r, :] = sum of dy[i, :] over the i with idx[i] == r.

A row gather: the forward is ``index_forward`` (the advanced-indexing kernel of
``shape/kernels.py``, one index over W's rows, no wrap-around of negative indices) and the backward
its scatter-add pair:

- default (``index_backward``): atomic adds into a zeroed buffer (float32 for half weights,
  then cast to dW). Fast, but the order of the additions varies from run to run, so the result
  is **not bit-reproducible**.
- deterministic (``teeny.core.config.deterministic = True`` when the graph is traced, or
  ``embedding(..., deterministic=True)``): the forward also writes each position's row offset;
  the backward sorts them on the device (``torch.sort``, stable: no host sync) and
  ``index_backward_sorted`` has the first position of each run of equal rows sum that run's
  dy rows in position order, in fp32 (fp64 for float64). Bit-reproducible.

PyTorch's options:

- ``padding_idx``: that row is returned by the forward but gets a zero gradient.
- ``scale_grad_by_freq=True``: dW[r] is divided by the number of times r occurs in the batch
  (the sorted backward, where a run's length is that count).
- ``max_norm``: before the lookup, each row the batch references whose ``norm_type``-norm
  exceeds ``max_norm`` is scaled by max_norm / (norm + 1e-7) **in place**, as F.embedding
  does: the weight itself changes (the parameter in the executor's arena, or the tensor given
  to ``interop.torch.apply``). The renormalisation is not differentiated (as in PyTorch): dW is
  the gradient of a lookup of the renormalised rows. ``embedding_renorm`` does it over the
  sorted indices, so a row the batch names several times is scaled once. The norm is the true
  p-norm, (sum |w|^p)^(1/p) and max |w| for inf, as PyTorch computes it on the CPU; PyTorch's
  CUDA kernel sums w^p without the absolute value, so on a GPU it differs for ``norm_type=inf``
  and odd or fractional p (the tests compare with the CPU reference).

Indices outside [0, num_embeddings) (negative ones included, as in PyTorch): under
``teeny.core.config.check_indices`` (read at trace time; on by default on the CPU, off on the GPU)
the forward flags one and the op raises an error naming it after the forward. With the check
off nothing is checked: such an index reads a row of zeros and adds nothing to dW.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ..core import config
from ..core.common import pow2, upcast
from ..core.device import INTERPRETER
from ..core.graph import graph_of
from ..core.kernel import kernel
from ..core.module import Module, Parameter
from ..core.runtime import ArgVisitor, Launch, RuntimeOp
from .shape.kernels import index_forward
from .shape.launch import IndexLayout, decode_flag

__all__ = ["embedding"]
NN_LAYERS = ["Embedding"]

RENORM_BLOCK = 1024 if INTERPRETER else 256  # row elements per step of embedding_renorm

# embedding_renorm's norms
NORM_P = tl.constexpr(0)  # (sum |w|^p)^(1/p), any p > 0
NORM_L1 = tl.constexpr(1)
NORM_L2 = tl.constexpr(2)
NORM_INF = tl.constexpr(3)
_NORMS = {1.0: NORM_L1, 2.0: NORM_L2, math.inf: NORM_INF}


@kernel(half=True)
def embedding_renorm(sorted_ptr, w_ptr, num, dim, max_norm, norm_type, eps, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program p: if sorted index p starts a run of equal indices (and lies in [0, num)), scale
    row W[sorted[p]] by max_norm / (norm + eps) in place when its norm exceeds max_norm."""
    p = tl.program_id(0)
    row = tl.load(sorted_ptr + p).to(tl.int64)
    previous = tl.load(sorted_ptr + p - 1, mask=p > 0, other=-1).to(tl.int64)
    if (row != previous) & (row >= 0) & (row < num):
        base = w_ptr + row * dim
        acc = upcast(tl.zeros([BLOCK_D], dtype=w_ptr.dtype.element_ty))
        for start in range(0, dim, BLOCK_D):
            offsets = start + tl.arange(0, BLOCK_D)
            a = tl.abs(upcast(tl.load(base + offsets, mask=offsets < dim, other=0)))
            if NORM == NORM_INF:
                acc = tl.maximum(acc, a)
            elif NORM == NORM_L1:
                acc += a
            elif NORM == NORM_L2:
                acc += a * a
            else:
                acc += tl.exp(norm_type * tl.log(a))  # |w| = 0 gives exp(-inf) = 0
        if NORM == NORM_INF:
            norm = tl.max(acc, axis=0)
        elif NORM == NORM_L1:
            norm = tl.sum(acc, axis=0)
        elif NORM == NORM_L2:
            norm = tl.sqrt(tl.sum(acc, axis=0))
        else:
            norm = tl.exp(tl.log(tl.sum(acc, axis=0)) / norm_type)
        if norm > max_norm:
            scale = max_norm / (norm + eps)
            for start in range(0, dim, BLOCK_D):
                offsets = start + tl.arange(0, BLOCK_D)
                w = upcast(tl.load(base + offsets, mask=offsets < dim, other=0))
                tl.store(base + offsets, (w * scale).to(w_ptr.dtype.element_ty), mask=offsets < dim)


class EmbeddingOp(RuntimeOp):
    """The lookup of rows of the weight (the parameter input) by the indices (the activation
    input); see the module docstring for the options."""

    name = "embedding"
    kernel = index_forward
    n_activation_inputs = 1  # the indices; the weight is the parameter
    saves_inputs = (0,)  # the backward needs only the indices

    def __init__(
        self,
        padding_idx: int | None,
        deterministic: bool,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        check: bool = False,
    ):
        self.padding_idx, self.deterministic = padding_idx, deterministic
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, float(norm_type), scale_grad_by_freq
        self.check = check
        self.sorted_backward = deterministic or scale_grad_by_freq

    def mutated_inputs(self):
        """``max_norm`` renormalises the referenced rows of the weight in place, as PyTorch does."""
        return (1,) if self.max_norm is not None else ()

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

    def extra_outputs(self, input_shapes, dtype):
        return {"keys": ((math.prod(input_shapes[0]),), torch.int64)} if self.sorted_backward else {}

    @staticmethod
    def _layout(input_shapes) -> IndexLayout:
        num, dim = input_shapes[1]
        n = math.prod(input_shapes[0])
        return IndexLayout(n, (num,), (dim,), dim, (dim,), (1,), (1,), wrap=False)

    def _skip_key(self, dim: int) -> int:
        """The key (row offset) of the padding row, whose gradient stays zero (-1: none)."""
        return -1 if self.padding_idx is None else self.padding_idx * dim

    def forward_launches(self, ctx):
        (idx,), (w,) = ctx.inputs, ctx.params
        num, dim = ctx.input_shapes[1]
        launches = [] if self.max_norm is None else [self._renorm(ctx, idx, w)]
        flag = ctx.zeros((1,), torch.int64) if self.check else None
        if flag is not None:
            bounds = f"out of range for {num} embeddings (indices must lie in [0, {num}))"
            ctx.check_after(flag, lambda value: f"index {decode_flag(value)} is {bounds}")
        layout = self._layout(ctx.input_shapes)
        return launches + [layout.gather(w, idx, ctx.output, flag, ctx.saved.get("keys"), self._skip_key(dim))]

    def _renorm(self, ctx, idx, w) -> Launch:
        flat = idx.reshape(-1)
        sorted_idx = flat if ctx.dry_run else torch.sort(flat).values
        num, dim = ctx.input_shapes[1]
        args = ArgVisitor().visit(sorted_ptr=sorted_idx, w_ptr=w, num=num, dim=dim)
        args.visit(max_norm=self.max_norm, norm_type=self.norm_type, eps=1e-7)  # PyTorch's eps
        args.visit(NORM=_NORMS.get(self.norm_type, NORM_P), BLOCK_D=min(pow2(dim), RENORM_BLOCK))
        return Launch(embedding_renorm, (flat.numel(), 1, 1), args, work=flat.numel())

    def backward_launches(self, ctx):
        dw = ctx.grad_params[0]
        if dw is None:
            return []
        dim = ctx.input_shapes[1][1]
        layout = self._layout(ctx.input_shapes)
        keys = ctx.saved.get("keys")
        return layout.scatter_add(
            ctx, ctx.inputs[0], ctx.grad_output, dw, keys, self._skip_key(dim), self.scale_grad_by_freq
        )


def embedding(
    input,
    weight,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    *,
    deterministic: bool | None = None,
):
    """F.embedding: rows of ``weight`` picked by the integer ``input`` (any shape). The
    ``padding_idx`` row gets no gradient; ``max_norm`` renormalises the referenced rows of
    ``weight`` in place first; ``scale_grad_by_freq`` divides each row's gradient by its count
    in the batch. ``deterministic`` (default: ``teeny.core.config.deterministic`` when traced) makes
    the backward bit-reproducible. See the module docstring."""
    num = weight.shape[0] if len(weight.shape) >= 1 else 0
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
            raise TypeError(f"embedding: padding_idx must be an int or None, got {padding_idx!r}")
        if not -num <= padding_idx < num:
            raise ValueError(f"embedding: padding_idx {padding_idx} is out of range for {num} embeddings")
        padding_idx %= num
    if max_norm is not None:
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not max_norm >= 0:
            raise ValueError(f"embedding: max_norm must be non-negative, got {max_norm}")
        if not norm_type > 0:
            raise ValueError(f"embedding: norm_type must be positive (or inf), got {norm_type}")
    if sparse:
        raise ValueError("embedding: sparse gradients are not supported (teeny's gradients are dense)")
    op = EmbeddingOp(
        padding_idx,
        config.deterministic if deterministic is None else bool(deterministic),
        max_norm,
        norm_type,
        bool(scale_grad_by_freq),
        check=config.check_indices,
    )
    return graph_of(input, weight).apply(op, [input, weight])


def _embedding_init(padding_idx: int | None):
    def init(shape, gen, dtype):
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
        if padding_idx is not None:
            values[padding_idx] = 0.0
        return values.to(dtype)

    return init


class Embedding(Module):
    """nn.Embedding(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
    scale_grad_by_freq): weight N(0, 1) with the padding row zeroed, like PyTorch."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
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
        self.max_norm, self.norm_type, self.scale_grad_by_freq = max_norm, norm_type, scale_grad_by_freq
        self.weight = Parameter((num_embeddings, embedding_dim), _embedding_init(padding_idx), dtype=dtype)

    def forward(self, input):
        return embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            deterministic=self.deterministic,
        )

    def __repr__(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx})"
