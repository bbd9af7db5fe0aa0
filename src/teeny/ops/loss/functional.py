"""The functional losses: ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``,
``binary_cross_entropy``, ``binary_cross_entropy_with_logits``, ``kl_div`` (one ``PointwiseLossOp``
each, with its maths from ``maths.py``), ``nll_loss`` and ``cross_entropy`` (a ``ClassLossOp``);
argument checks (PyTorch's messages), then one node each."""

from __future__ import annotations

import torch

from ...core.graph import Tensor, graph_of
from . import maths
from .ops import REDUCTIONS, ClassLossOp, PointwiseLossOp, check_reduction


def _tensor_arg(graph, value, like, name):
    """A weight given as a teeny Tensor stays one; a torch tensor becomes a graph constant in
    the input's dtype."""
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, torch.Tensor):
        return graph.constant(value.detach().to(like.dtype), name=None)
    raise TypeError(f"{name} must be a teeny Tensor, a torch.Tensor or None, got {type(value).__name__}")


def _pointwise(name, input, target, *, loss, grad, reduction, kink=0.0, weight=None, pos_weight=None, divisor=None):
    graph = graph_of(input, target)
    weight = _tensor_arg(graph, weight, input, "weight")
    pos_weight = _tensor_arg(graph, pos_weight, input, "pos_weight")
    op = PointwiseLossOp(
        name,
        loss=loss,
        grad=grad,
        reduction=reduction,
        kink=kink,
        has_weight=weight is not None,
        has_pos_weight=pos_weight is not None,
        divisor=divisor,
    )
    return graph.apply(op, [t for t in (input, target, weight, pos_weight) if t is not None])


def mse_loss(input, target, reduction: str = "mean"):
    """(input - target)^2, reduced."""
    return _pointwise(
        "mse_loss", input, target, loss=maths.mse, grad=maths.mse_grad, reduction=check_reduction(reduction)
    )


mse = mse_loss


def l1_loss(input, target, reduction: str = "mean"):
    """|input - target|, reduced (gradient sign(input - target), 0 at 0)."""
    return _pointwise("l1_loss", input, target, loss=maths.l1, grad=maths.l1_grad, reduction=check_reduction(reduction))


def smooth_l1_loss(input, target, reduction: str = "mean", beta: float = 1.0):
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (d = input - target; beta = 0: L1)."""
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be non-negative, got {beta}")
    return _pointwise(
        "smooth_l1_loss",
        input,
        target,
        loss=maths.smooth_l1,
        grad=maths.smooth_l1_grad,
        reduction=check_reduction(reduction),
        kink=beta,
    )


def huber_loss(input, target, reduction: str = "mean", delta: float = 1.0):
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta)."""
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be positive, got {delta}")
    return _pointwise(
        "huber_loss",
        input,
        target,
        loss=maths.huber,
        grad=maths.huber_grad,
        reduction=check_reduction(reduction),
        kink=delta,
    )


def binary_cross_entropy(input, target, weight=None, reduction: str = "mean"):
    """-w (t log x + (1 - t) log(1 - x)) on probabilities x, logs clamped at -100 as in PyTorch.
    Inputs outside [0, 1] give NaN (PyTorch raises)."""
    return _pointwise(
        "binary_cross_entropy",
        input,
        target,
        loss=maths.bce,
        grad=maths.bce_grad,
        reduction=check_reduction(reduction),
        weight=weight,
    )


def binary_cross_entropy_with_logits(input, target, weight=None, reduction: str = "mean", pos_weight=None):
    """w ((1 - t) x + (1 + (pos_weight - 1) t) log(1 + exp(-x))), computed stably."""
    return _pointwise(
        "binary_cross_entropy_with_logits",
        input,
        target,
        loss=maths.bce_logits,
        grad=maths.bce_logits_grad,
        reduction=check_reduction(reduction),
        weight=weight,
        pos_weight=pos_weight,
    )


def kl_div(input, target, reduction: str = "mean", log_target: bool = False):
    """target (log target - input) (input: log-probabilities; target: probabilities, or
    log-probabilities with ``log_target``); "batchmean" divides the sum by input.size(0)."""
    reduction = check_reduction(reduction, REDUCTIONS + ("batchmean",))
    loss, grad = (
        (maths.kl_div_log_target, maths.kl_div_log_target_grad) if log_target else (maths.kl_div, maths.kl_div_grad)
    )
    divisor = None
    if reduction == "batchmean":
        reduction, divisor = "mean", (lambda shape: shape[0] if len(shape) else 1)
    return _pointwise("kl_div", input, target, loss=loss, grad=grad, reduction=reduction, divisor=divisor)


def _class_loss(name, input, target, *, from_logits, weight, ignore_index, reduction, label_smoothing, softcap=0.0):
    graph = graph_of(input, target)
    weight = _tensor_arg(graph, weight, input, "weight")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    op = ClassLossOp(
        name,
        from_logits=from_logits,
        reduction=check_reduction(reduction),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        has_weight=weight is not None,
        softcap=softcap,
    )
    return graph.apply(op, [t for t in (input, target, weight) if t is not None])


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean"):
    """-w_t input[n, t_n] on log-probabilities (N, C) or (N, C, d1, ...), class-index targets
    (int64); "mean" divides by the sum of w_t over non-ignored targets (NaN if all are ignored)."""
    return _class_loss(
        "nll_loss",
        input,
        target,
        from_logits=False,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=0.0,
    )


def cross_entropy(
    input,
    target,
    weight=None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float = 0.0,
):
    """log_softmax + NLL over the class dim 1, fused: targets are class indices (int64) or class
    probabilities (the input's shape and dtype). Long rows are processed in column blocks.
    ``softcap`` > 0 (class indices only): the loss of the soft-capped logits softcap * tanh(input /
    softcap), as Gemma 2 and 3 cap theirs (``final_logit_softcapping``), without storing them."""
    return _class_loss(
        "cross_entropy",
        input,
        target,
        from_logits=True,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
    )
