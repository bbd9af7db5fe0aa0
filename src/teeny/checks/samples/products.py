"""Test samples of the products (``teeny.ops.products``): matmul's 1-D promotion, broadcast and
summed batch dims, empty operands, and 16-byte rows that the Hopper kernel reads on a GPU; linear
with and without a bias over flattened leading dims."""

import math

import torch
import torch.nn.functional as F

from ...ops.products import linear, matmul
from ...ops.products.ops import promoted_shapes
from ..registry import OpInfo, Sample, make, register


def _matmul_samples(dtype, gen):
    pairs = [
        ((3, 37), (37, 5)),
        ((129, 7), (7, 11)),
        ((2, 3, 5), (5, 4)),
        ((3, 5, 7), (7, 2)),
        ((2, 1, 3, 5), (4, 5, 2)),
        ((5, 7), (3, 7, 2)),
        ((7,), (7, 3)),
        ((2, 3, 7), (7,)),
        ((7,), (7,)),
        ((0, 5), (5, 3)),
        ((3, 0), (0, 4)),
        ((67, 40), (40, 24)),  # 16-byte rows in every dtype: the Hopper kernel on a GPU
    ]
    return [
        Sample(
            (make(gen, *a, dtype=dtype), make(gen, *b, dtype=dtype)),
            name=f"{a}@{b}",
            reduction=_longest_contraction(a, b),
        )
        for a, b in pairs
    ]


def _longest_contraction(a_shape, b_shape) -> int:
    """The longest sum in the forward (K) or a gradient (M or N times the broadcast batch)."""
    a, b = promoted_shapes(a_shape, b_shape)
    batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
    return max(a[-1], a[-2] * batch, b[-1] * batch, 1)


def _matmul_gradcheck(gen):
    pairs = [((3, 4), (4, 2)), ((2, 1, 2, 2), (3, 2, 1)), ((3,), (2, 3, 1)), ((2, 3), (3,)), ((5, 8), (8, 6))]
    return [
        Sample((make(gen, *a, dtype=torch.float64), make(gen, *b, dtype=torch.float64)), name=f"{a}@{b}")
        for a, b in pairs
    ]


def _linear_samples(dtype, gen):
    cases = [
        ((3, 37), 5, True),
        ((129, 7), 11, False),
        ((2, 3, 5), 4, True),
        ((1, 1), 1, True),
        ((0, 5), 3, True),
        ((70, 3), 2, True),
        ((2, 37, 24), 40, True),  # 16-byte rows in every dtype: the Hopper kernel on a GPU
    ]
    out = []
    for x, fout, bias in cases:
        args = [make(gen, *x, dtype=dtype), make(gen, fout, x[-1], dtype=dtype)]
        if bias:
            args.append(make(gen, fout, dtype=dtype))
        out.append(
            Sample(tuple(args), name=f"{x}->{fout}{'+b' if bias else ''}", reduction=max(x[-1], math.prod(x[:-1])))
        )
    return out


def _linear_gradcheck(gen):
    f64 = torch.float64
    return [
        Sample((make(gen, 4, 3, dtype=f64), make(gen, 2, 3, dtype=f64), make(gen, 2, dtype=f64)), name="4x3->2+b"),
        Sample((make(gen, 2, 2, 3, dtype=f64), make(gen, 3, 3, dtype=f64)), name="2x2x3->3"),
        Sample((make(gen, 5, 4, dtype=f64), make(gen, 6, 4, dtype=f64), make(gen, 6, dtype=f64)), name="5x4->6+b"),
    ]


register(OpInfo("matmul", matmul, torch.matmul, _matmul_samples, family="linear", gradcheck_samples=_matmul_gradcheck))
register(OpInfo("linear", linear, F.linear, _linear_samples, family="linear", gradcheck_samples=_linear_gradcheck))
