"""Normalisation: layer_norm, rms_norm, group_norm, batch_norm.

Every op normalises "statistics rows" of x: y = (x - mean) * rstd * w + b with
rstd = 1 / sqrt(var + eps) (biased variance; rms_norm: mean = 0, var = mean(x^2); its
``weight_offset`` makes the scale w + offset, Gemma's (1 + w), and below w stands for that sum). Where the
rows lie is the op's layout (``tiling.Rows``):

* rows of x (layer_norm, rms_norm, group_norm): row r is contiguous, x[r * row_len + j]; the
  affine channel of element j is (r % groups) * (channels / groups) + j // spatial
  (layer/rms: groups = spatial = 1, so the channel is j).
* channels (batch_norm over x viewed as (N, C, S)): row c gathers x[n, c, s] for all n, s
  (j = n * S + s); its affine channel is c.

Backward, with xhat = (x - mean) * rstd and g = dy * w, per row of length L:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (rms_norm: without mean(g))
    dx = rstd * g                                          (batch_norm on running statistics)
    dw[c] = sum over the elements of channel c of dy * xhat,   db[c] = sum of dy   (an offset changes neither)

A constant row has var = 0: rstd = 1 / sqrt(eps) is large but finite and xhat = 0, so every
formula stays finite, as in PyTorch (no 0/0 anywhere).

Files, in the order the data moves:

``kernels.py``     ``norm_forward`` and its backward pair ``norm_backward`` / ``norm_weight_backward``:
                   their constants, index maths, tiles and dw/db partial rows
``tiling.py``      where the statistics rows lie (``Rows``), tile and launch sizes, programs
``ops.py``         the RuntimeOps (``NormOp``, ``LayerNormOp``, ``GroupNormOp``, ``BatchNormOp``)
``functional.py``  the functional ops: argument checks, then one node each
this file          the public surface and the layers

The residual add + norm (``AddNormOp``) lives with its rewrite in ``teeny.fusions.residual_norm``;
the test samples in ``teeny.checks.samples.norm``.
"""

from __future__ import annotations

import torch

from ...core import init
from ...core.module import Module, Parameter
from .functional import as_shape, batch_norm, group_norm, layer_norm, rms_norm
from .ops import shape_text

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm"]
NN_LAYERS = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d"]


class LayerNorm(Module):
    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.normalized_shape, self.eps = as_shape(normalized_shape), eps
        self.weight = Parameter(self.normalized_shape, init.ones(), dtype) if elementwise_affine else None
        self.bias = Parameter(self.normalized_shape, init.zeros(), dtype) if elementwise_affine and bias else None

    def forward(self, x):
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """``weight_offset``: the scale is weight + weight_offset (Gemma's RMSNorm: 1, with eps=1e-6);
    the weight starts at 1 - weight_offset, so the layer starts as a plain rms_norm."""

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        dtype: torch.dtype = torch.float32,
        weight_offset: float = 0.0,
    ):
        super().__init__()
        if weight_offset and not elementwise_affine:
            raise ValueError("RMSNorm: weight_offset offsets the weight, which elementwise_affine=False leaves out")
        self.normalized_shape, self.eps, self.weight_offset = as_shape(normalized_shape), eps, weight_offset
        initial = init.constant(1.0 - weight_offset)
        self.weight = Parameter(self.normalized_shape, initial, dtype) if elementwise_affine else None

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, weight_offset=self.weight_offset)


class GroupNorm(Module):
    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = Parameter((num_channels,), init.ones(), dtype) if affine else None
        self.bias = Parameter((num_channels,), init.zeros(), dtype) if affine else None

    def forward(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNorm(Module):
    input_dims: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter((num_features,), init.ones(), dtype) if affine else None
        self.bias = Parameter((num_features,), init.zeros(), dtype) if affine else None
        self.track_running_stats = track_running_stats
        if track_running_stats:
            self.running_mean = Parameter((num_features,), init.zeros(), dtype, trainable=False)
            self.running_var = Parameter((num_features,), init.ones(), dtype, trainable=False)
        else:
            self.running_mean = self.running_var = None

    def forward(self, x):
        if x.ndim not in self.input_dims:
            wanted = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(
                f"{type(self).__name__}: expected {wanted} input, got {x.ndim}D input of shape {shape_text(x.shape)}"
            )
        training = self.training or not self.track_running_stats
        return batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training, self.momentum, self.eps
        )


class BatchNorm1d(_BatchNorm):
    """Over (N, C) or (N, C, L)."""

    input_dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Over (N, C, H, W)."""

    input_dims = (4,)
