"""Test samples of dropout (``teeny.ops.masks``)."""

import torch

from ...core.common import elementwise_grid
from ...core.runtime import Launch, launch_kernel
from ...ops import dropout
from ...ops.masks import BLOCK, DropoutOp, dropout_forward
from ..registry import OpInfo, Sample, make, register

# torch's random numbers cannot be reproduced, so the reference takes the mask from teeny
# itself: the scale-or-zero pattern of dropout(ones) with the same seed (float64), then
# computes x * pattern with torch. This checks the scaling, the dtypes, that the mask depends
# on the seed and offsets only (not on x), and that the backward reuses the forward's mask.


def _dropout_reference(x, p=0.5, training=True, inplace=False, seed=None, fixed_mask=False):
    if not training or p == 0:
        return x * 1
    op = DropoutOp(p, seed, fixed_mask=True)
    ones = torch.ones(x.shape, dtype=torch.float64, device=x.device)
    pattern, seed_out = torch.empty_like(ones), torch.empty(1, dtype=torch.int64, device=x.device)
    args = op.forward_args(ones, pattern, seed_out, op.step_seed(0))
    launch = Launch(dropout_forward, elementwise_grid(ones.numel(), BLOCK), args, BLOCK, work=ones.numel())
    launch_kernel(launch, torch.float64, "dropout reference")
    return x * pattern.to(x.dtype)


def _dropout_samples(cases):
    def samples(dtype, gen):
        return [Sample((make(gen, *shape).to(dtype),), kwargs, name=f"{shape} {kwargs}") for shape, kwargs in cases]

    return samples


register(
    OpInfo(
        "dropout",
        dropout,
        _dropout_reference,
        _dropout_samples(
            [
                ((3, 37), dict(p=0.3, seed=11, fixed_mask=True)),
                ((129, 9), dict(p=0.5, seed=5, fixed_mask=True)),
                ((1,), dict(p=0.5, seed=3, fixed_mask=True)),
                ((0, 5), dict(p=0.5, seed=2, fixed_mask=True)),
                ((4, 5), dict(p=1.0, seed=1, fixed_mask=True)),
                ((4, 5), dict(p=0.5, training=False)),
                ((5, 3), dict(p=0.0)),
            ]
        ),
        family="dropout",
        gradcheck_samples=lambda gen: _dropout_samples(
            [((3, 7), dict(p=0.4, seed=9, fixed_mask=True)), ((2, 3), dict(p=0.5, training=False))]
        )(torch.float64, gen),
        notes="mask from teeny's counter-based RNG; the reference reuses it (see teeny.checks.samples.masks)",
    )
)
