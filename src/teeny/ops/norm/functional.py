"""The functional normalisation ops: ``layer_norm``, ``rms_norm``, ``group_norm``,
``batch_norm``; argument checks, then one node each."""

from __future__ import annotations

import numbers

import torch

from ...core.graph import graph_of
from .ops import BatchNormOp, GroupNormOp, LayerNormOp, NormOp


def _apply(op: NormOp, x, *tensors):
    return graph_of(x).apply(op, [x, *(t for t in tensors if t is not None)])


def as_shape(normalized_shape) -> tuple[int, ...]:
    """``normalized_shape`` (an int or a sequence of ints) as a tuple."""
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Normalise over the trailing ``normalized_shape`` dims: (x - mean) / sqrt(var + eps) * weight + bias.
    ``out_dtype``: the result's dtype, if not x's (rounded once from x's precision: a float32
    norm whose readers take it in bf16 writes bf16, with no cast after it)."""
    op = LayerNormOp(
        as_shape(normalized_shape),
        eps=eps,
        has_weight=weight is not None,
        has_bias=bias is not None,
        out_dtype=_other_dtype(out_dtype, x),
    )
    return _apply(op, x, weight, bias)


def rms_norm(
    x,
    normalized_shape,
    weight=None,
    eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    weight_offset: float = 0.0,
):
    """x / sqrt(mean(x^2) + eps) * (weight + weight_offset) over the trailing dims; eps=None:
    torch.finfo(x.dtype).eps. ``weight_offset=1`` is Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps)
    * (1 + weight), computed in float32 (float64) and rounded once, as Gemma does; the weight's
    gradient is the same as without the offset. ``out_dtype`` as for layer_norm."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    op = LayerNormOp(
        as_shape(normalized_shape),
        eps=eps,
        has_weight=weight is not None,
        has_bias=False,
        centred=False,
        out_dtype=_other_dtype(out_dtype, x),
        weight_offset=weight_offset,
    )
    return _apply(op, x, weight)


def _other_dtype(out_dtype: torch.dtype | None, x) -> torch.dtype | None:
    """``out_dtype`` where it differs from x's (the same dtype: the plain op, one key)."""
    return None if out_dtype is None or out_dtype == x.dtype else out_dtype


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """Normalise x (N, C, *) over each group of C / num_groups channels; per-channel weight and bias."""
    op = GroupNormOp(num_groups, eps=eps, has_weight=weight is not None, has_bias=bias is not None)
    return _apply(op, x, weight, bias)


def batch_norm(
    x,
    running_mean,
    running_var,
    weight=None,
    bias=None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
):
    """Normalise x (N, C, *) per channel. Training: batch statistics, and running_mean /
    running_var (when given) are updated in place with ``momentum`` (unbiased variance).
    Inference: the running statistics."""
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm: give both running_mean and running_var, or neither")
    if not training and running_mean is None:
        raise ValueError("batch_norm: running_mean and running_var are required when training=False")
    if momentum is None:
        raise ValueError("batch_norm: momentum=None (cumulative moving average) is not supported; give a float")
    op = BatchNormOp(
        has_running=running_mean is not None,
        training=training,
        momentum=momentum,
        eps=eps,
        has_weight=weight is not None,
        has_bias=bias is not None,
    )
    return _apply(op, x, running_mean, running_var, weight, bias)
