"""Matrix products: ``matmul`` (torch.matmul semantics) and ``linear`` (y = x W^T + b).

Every product, forward and backward, is one of

    Z[g] = sum_r X[g, r] @ Y[g, r]   (+ bias[n] broadcast over rows)

with fp32 accumulation (fp64 for float64): ``g`` runs over the kept batch dims and ``r`` over
batch dims that the result is broadcast along (a gradient summed over broadcast dims, inside
the program: no atomics, no partials). X, Y and Z are read and written through strides, so a
transposed operand is the same buffer with its strides swapped, read in place:

    Y = A @ B        dA = sum_broadcast dY @ B^T        dB = sum_broadcast A^T @ dY
    linear: Y = X W^T + b,   dX = dY W,   dW = dY^T X,   db = column sums of dY

The files, in the order a product passes through them:

* ``ops.py``: ``MatmulOp`` and ``LinearOp`` (each describes its forward and backward as
  products), ``matmul``, ``linear`` and the ``Linear`` layer;
* ``tuning.py``: the candidate configurations (kernel, tiles, warps, stages, stream-K) with the
  measurements behind them, the heuristic default and ``choose_config``, which times them;
* ``launches.py``: ``Product`` (sizes and strides), the stream-K ``schedule`` and
  ``product_launches``, which turns a product and a configuration into launches;
* ``kernels.py``: the Triton kernels (``matmul_tma``, ``matmul_sum_segments``, ``matmul_copy``,
  ``matmul_product``) and the tile maths; ``gluon.py``: ``matmul_ws``, the Gluon kernel.

The products that only graph rewrites make live beside their patterns: Conv1D's transposed
weight (``teeny.fusions.transposed_weights``), the fused q/k/v projection
(``teeny.fusions.qkv_products``) and the MLP chain with activations in the epilogues
(``teeny.fusions.mlp_chain``). Test samples: ``teeny.checks.samples.products``.
"""

from .ops import Linear, linear, matmul  # noqa: F401  (Linear: the layer teeny.nn gathers)

__all__ = ["matmul", "linear"]
NN_LAYERS = ["Linear"]
