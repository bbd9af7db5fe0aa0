"""Test samples of embedding (``teeny.ops.lookup``): repeated rows, padding_idx, max_norm in
several norms, scale_grad_by_freq, an empty index; atomic and deterministic backwards."""

import math

import torch
import torch.nn.functional as F

from ...ops import embedding
from ..registry import OpInfo, Sample, make, register


def _indices(gen, num, *shape):
    return torch.randint(0, num, shape, generator=gen, dtype=torch.int64)


_CASES = [  # index shape, num_embeddings, embedding_dim, options
    ((5, 3), 7, 11, {}),
    ((13,), 4, 37, {}),
    ((2, 9), 6, 5, {"padding_idx": 2}),
    ((0,), 3, 4, {}),
    ((1,), 1, 1, {}),
    ((4, 5), 6, 9, {"scale_grad_by_freq": True, "padding_idx": 1}),
    ((6, 5), 7, 11, {"max_norm": 1.5}),
    ((9,), 5, 37, {"max_norm": 3.0, "norm_type": 1.0}),
    ((9,), 5, 6, {"max_norm": 0.5, "norm_type": math.inf, "scale_grad_by_freq": True}),
    ((3, 3), 4, 7, {"max_norm": 1.0, "norm_type": 3.0}),
]


def _samples(dtype, gen):
    out = []
    for shape, num, dim, options in _CASES:
        idx = _indices(gen, num, *shape)
        weight = make(gen, num, dim, dtype=dtype)
        out.append(Sample((idx, weight), options, name=f"{shape} of {num}x{dim} {options}", reduction=idx.numel() or 1))
    return out


def _gradcheck(gen):
    # padding_idx, max_norm and scale_grad_by_freq are left to the comparison with PyTorch: by
    # definition their gradients are not the finite differences
    f64 = torch.float64
    return [
        Sample((_indices(gen, 4, 7), make(gen, 4, 3, dtype=f64)), name="7 of 4x3"),
        Sample((_indices(gen, 3, 2, 3), make(gen, 3, 2, dtype=f64)), name="2x3 of 3x2"),
    ]


def _reference(idx, weight, max_norm=None, norm_type=2.0, **options):
    """F.embedding, renormalising on the CPU (see the module docstring: PyTorch's CUDA renorm
    is not the p-norm for inf and odd p); the weight changes in place, wherever it lives."""
    if max_norm is not None and weight.device.type != "cpu":
        with torch.no_grad():
            rows = weight.detach().cpu()
            torch.embedding_renorm_(rows, idx.detach().cpu().reshape(-1), max_norm, norm_type)
            weight.copy_(rows)
        max_norm = None
    return F.embedding(idx, weight, max_norm=max_norm, norm_type=norm_type, **options)


for _name, _deterministic in (("embedding", False), ("embedding_deterministic", True)):
    register(
        OpInfo(
            _name,
            lambda idx, w, _d=_deterministic, **options: embedding(idx, w, deterministic=_d, **options),
            _reference,
            _samples,
            family="embedding",
            gradcheck_samples=_gradcheck,
            notes="max_norm renormalises the referenced rows of the weight in place, as in PyTorch",
        )
    )
