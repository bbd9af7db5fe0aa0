"""Shape ops: reshape, flatten, squeeze, transpose, permute, indexing, concat, split, expand.

Shape ops move data and never compute on it, so they serve every dtype (float, integer and
bool tensors). Where the result is a contiguous view of the input (reshape, flatten, squeeze,
unsqueeze, stop_gradient, a slice of leading rows, a permutation that only moves size-1 dims)
the op answers with a torch view (no launch, no copy) and its backward is a view of the
gradient too. Everything else is a gather or a scatter over strided layouts:

    y[c] = x[offset_x + sum_k c_k * stride_x_k]              (permute, slicing, expand, concat)
    dx[c] = dy[(c - start) / step] on the selection, else 0  (slicing's backward)
    y[b, r] = x[key(b) + rest_x(r)],  key(b) = sum_k i_k(b) * stride_k      (advanced indexing)
    dx[key(b) + rest_x(r)] += dy[b, r]                        (its backward: repeated indices sum)

and expand's backward sums over the broadcast dims (``common.sum_to_shape``). An index tensor's
values are known only on the device: under ``teeny.core.config.check_indices`` the forward flags
an out-of-range index and the op raises an error naming it after the forward
(``OpContext.check_after``); with the check off, an out-of-range index reads zeros and gets no
gradient. Index lists are checked when traced.

Files, in the order the data moves:

``kernels.py``     the gather/scatter/copy kernels and their maths (``strided_copy``,
                   ``slice_scatter``, ``index_forward``, ``index_backward``, ``index_backward_sorted``)
``launch.py``      their launches: layouts merged and visited as scalars, tile sizes
                   (``copy_launch``, ``slice_scatter_launch``, ``IndexLayout``)
``ops.py``         the RuntimeOps (``ViewOp``, ``PermuteOp``, ``GetItemOp``, ``ExpandOp``,
                   ``ConcatOp``, ``IndexOp``)
``functional.py``  the functional ops: argument checks (PyTorch's messages), then one node each
this file          the public surface and the layers

Test samples live in ``teeny.checks.samples.shape``.
"""

from ...core.module import Module
from .functional import (
    broadcast_to,
    cat,
    chunk,
    concat,
    detach,
    expand,
    flatten,
    getitem,
    narrow,
    permute,
    reshape,
    slice,
    split,
    squeeze,
    stack,
    stop_gradient,
    transpose,
    unflatten,
    unsqueeze,
    view,
)

__all__ = [
    "reshape",
    "view",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "transpose",
    "permute",
    "getitem",
    "slice",
    "narrow",
    "concat",
    "cat",
    "stack",
    "split",
    "chunk",
    "expand",
    "broadcast_to",
    "stop_gradient",
    "detach",
]
NN_LAYERS = ["Flatten", "Unflatten"]


class Flatten(Module):
    """``flatten(x, start_dim, end_dim)`` as a layer (torch.nn.Flatten: from dim 1 by default)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return flatten(x, self.start_dim, self.end_dim)


class Unflatten(Module):
    """``unflatten(x, dim, unflattened_size)`` as a layer (torch.nn.Unflatten)."""

    def __init__(self, dim: int, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, x):
        return unflatten(x, self.dim, self.unflattened_size)
