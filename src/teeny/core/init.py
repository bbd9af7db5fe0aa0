"""Parameter initialisers with PyTorch's defaults. Each returns ``init(shape, generator, dtype)``."""

from __future__ import annotations

import math

import torch


def zeros():
    return lambda shape, gen, dtype: torch.zeros(shape, dtype=dtype)


def ones():
    return lambda shape, gen, dtype: torch.ones(shape, dtype=dtype)


def constant(value: float):
    return lambda shape, gen, dtype: torch.full(shape, float(value), dtype=dtype)


def uniform(bound: float):
    """U(-bound, bound)."""
    return lambda shape, gen, dtype: (
        (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(bound).to(dtype)
    )


def normal(std: float = 1.0, mean: float = 0.0):
    return lambda shape, gen, dtype: (torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean).to(dtype)


def kaiming_uniform(fan_in: int):
    """PyTorch's default for Linear/Conv weights: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (kaiming_uniform with a=sqrt(5)); also its default for their biases."""
    return uniform(1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0)


def from_tensor(tensor: torch.Tensor):
    """Initialise with a copy of ``tensor`` (e.g. weights taken from a PyTorch model)."""
    data = tensor.detach().cpu().clone()
    return lambda shape, gen, dtype: data.to(dtype).reshape(shape)
