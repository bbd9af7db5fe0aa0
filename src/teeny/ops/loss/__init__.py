"""Losses: element-wise losses (MSE, L1, smooth L1, Huber, BCE, BCE with logits, KL divergence)
and row losses over classes (cross-entropy, NLL), with reduction "none" | "mean" | "sum".

Element-wise: l_i = w_i * LOSS(x_i, t_i) (w: an optional weight broadcast over the input,
pos_weight an optional argument of the maths, ``kink`` where smooth L1 and Huber turn from
quadratic to linear: beta, delta); dx_i = dy_i * w_i * dLOSS/dx and dt_i = dy_i * w_i * dLOSS/dt
(dy_i = dy / divisor when reduced: divisor = n for "mean", batch size for "batchmean", 1 for
"sum"). At the kinks the derivatives are PyTorch's: sign(0) = 0 for L1 (and smooth L1 with
beta = 0), d / beta = sign(d) at |d| = beta, clamp(d, -delta, delta) for Huber; KL divergence's
target gradient log(t) + 1 - x is NaN at t = 0, as PyTorch's.

Cross-entropy and NLL, over rows of C classes (input (N, C) or (N, C, d1, ...), class stride d1*...):

    lse = log sum_c exp(x_c)                      online over column blocks (any C)
    class index t:  loss = (1-eps) w_t (lse - x_t) + eps/C sum_c w_c (lse - x_c)
                    dx_c = s [(1-eps) w_t (p_c - [c=t]) + eps/C (W p_c - w_c)],  p = exp(x - lse), W = sum w
    probabilities q (q' = (1-eps) q + eps/C):
                    loss = sum_c w_c q'_c (lse - x_c)
                    dx_c = s (p_c sum_j w_j q'_j - w_c q'_c),  dq_c = s (1-eps) w_c (lse - x_c)

with s = dy (per row) or dy / denominator ("mean": sum of w_t over non-ignored rows for class
indices, number of rows for probabilities). NLL is the same on log-probabilities (no lse:
lse = 0, p = 0, eps = 0). Cross-entropy of class indices with ``softcap`` = c > 0 (Gemma 2's
soft-capped logits) is the above of y = c tanh(x / c), applied as the logits are read, with
dx_c = dy_c (1 - (y_c / c)^2).

Rows whose target is ignore_index give loss 0 and gradient 0. A class index outside [0, C)
that is not ignore_index: with ``teeny.core.config.check_indices`` (on by default on the CPU)
the run raises an error naming the op and the index; without the check its row's loss and
gradient are NaN, which makes a reduced loss NaN. BCE inputs outside [0, 1] give NaN instead
of PyTorch's error.

Files, in the order the data moves:

``maths.py``       the element-wise losses' LOSS and GRAD, two @triton.jit functions each
``kernels.py``     the kernel pairs (``pointwise_loss_forward``/``_backward``, ``class_loss_forward``/
                   ``_backward``, ``loss_ratio``, the chunked head's sums), reductions without atomics
``ops.py``         the RuntimeOps (``PointwiseLossOp``, ``ClassLossOp``): launches, tiles, reductions
``functional.py``  the functional ops: argument checks, then one node each
this file          the public surface and the layers

The chunked head + cross-entropy (``LinearCrossEntropyOp``) lives with its rewrite in
``teeny.fusions.chunked_loss``; the test samples in ``teeny.checks.samples.loss``.
"""

from __future__ import annotations

from ...core.module import Module
from .functional import (
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)

__all__ = [
    "mse_loss",
    "mse",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "nll_loss",
    "cross_entropy",
]
NN_LAYERS = [
    "MSELoss",
    "L1Loss",
    "SmoothL1Loss",
    "HuberLoss",
    "BCELoss",
    "BCEWithLogitsLoss",
    "KLDivLoss",
    "NLLLoss",
    "CrossEntropyLoss",
]


class _Loss(Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction


class MSELoss(_Loss):
    def forward(self, input, target):
        return mse_loss(input, target, self.reduction)


class L1Loss(_Loss):
    def forward(self, input, target):
        return l1_loss(input, target, self.reduction)


class SmoothL1Loss(_Loss):
    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):
        return smooth_l1_loss(input, target, self.reduction, self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):
        return huber_loss(input, target, self.reduction, self.delta)


class BCELoss(_Loss):
    """``weight``: a torch tensor (a constant of the graph) or a teeny Tensor."""

    def __init__(self, weight=None, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight = weight

    def forward(self, input, target):
        return binary_cross_entropy(input, target, self.weight, self.reduction)


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input, target):
        return binary_cross_entropy_with_logits(input, target, self.weight, self.reduction, self.pos_weight)


class KLDivLoss(_Loss):
    def __init__(self, reduction: str = "mean", log_target: bool = False):
        super().__init__(reduction)
        self.log_target = log_target

    def forward(self, input, target):
        return kl_div(input, target, self.reduction, self.log_target)


class NLLLoss(_Loss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(reduction)
        self.weight, self.ignore_index = weight, ignore_index

    def forward(self, input, target):
        return nll_loss(input, target, self.weight, self.ignore_index, self.reduction)


class CrossEntropyLoss(_Loss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(reduction)
        self.weight, self.ignore_index, self.label_smoothing = weight, ignore_index, label_smoothing

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing)
