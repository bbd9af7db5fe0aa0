"""Test samples of conv2d and the 2-d poolings (``teeny.ops.conv``): strides, padding
(numbers, pairs, "same", "valid"), dilation, groups, ceil_mode, unbatched and empty inputs."""

import math

import torch
import torch.nn.functional as F

from ...ops import avg_pool2d, conv2d, max_pool2d
from ...ops.conv import _pair
from ..registry import OpInfo, Sample, make, register


def _conv_reduction(x, w, kwargs) -> int:
    """The longest sum: a forward dot (C/groups*kH*kW), dX's (C_out/groups*kH*kW) or dW's
    (N*H_out*W_out, bounded by N*H*W)."""
    groups = kwargs.get("groups", 1)
    n = x[0] if len(x) == 4 else 1
    return max(1, w[1] * w[2] * w[3], w[0] // groups * w[2] * w[3], n * x[-2] * x[-1])


def _conv_samples(cases):
    def samples(dtype, gen):
        out = []
        for x, w, bias, kwargs in cases:
            args = (make(gen, *x, dtype=dtype), make(gen, *w, dtype=dtype, low=-1, high=1))
            if bias:
                args += (make(gen, w[0], dtype=dtype),)
            out.append(
                Sample(
                    args, dict(kwargs), name=f"x{x} w{w} bias={bias} {kwargs}", reduction=_conv_reduction(x, w, kwargs)
                )
            )
        return out

    return samples


_CONV_CASES = [
    ((2, 3, 7, 9), (5, 3, 3, 3), True, {}),
    ((2, 3, 7, 9), (5, 3, 3, 3), True, {"stride": 2, "padding": 1}),
    ((2, 3, 7, 9), (4, 3, 2, 3), False, {"dilation": 2, "padding": (2, 1), "stride": (1, 2)}),
    ((2, 6, 5, 7), (6, 2, 3, 3), True, {"groups": 3, "padding": 1}),
    ((1, 4, 5, 3), (7, 4, 1, 1), False, {}),
    ((1, 2, 5, 6), (3, 2, 2, 3), True, {"padding": "same", "dilation": (1, 2)}),
    ((4, 5, 6), (2, 2, 2, 2), True, {"stride": (1, 2), "padding": "valid", "groups": 2}),
    ((0, 3, 5, 5), (4, 3, 3, 3), True, {}),
]
_CONV_GRADCHECK = [
    ((1, 2, 4, 5), (3, 2, 2, 3), True, {"padding": 1}),
    ((1, 4, 4, 3), (2, 2, 2, 2), True, {"groups": 2, "stride": 2, "dilation": (1, 2)}),
]

register(
    OpInfo(
        "conv2d",
        conv2d,
        F.conv2d,
        _conv_samples(_CONV_CASES),
        family="conv",
        gradcheck_samples=lambda gen: _conv_samples(_CONV_GRADCHECK)(torch.float64, gen),
    )
)


def _distinct(gen, shape, dtype):
    """Distinct values in [-2, 2) (max pooling's finite differences need no near-ties)."""
    n = math.prod(shape)
    return (torch.randperm(n, generator=gen).double() * (4.0 / max(n, 1)) - 2.0).reshape(shape).to(dtype)


def _pool_samples(cases, max_pool: bool):
    def samples(dtype, gen):
        out = []
        for shape, kwargs in cases:
            x = _distinct(gen, shape, dtype) if max_pool else make(gen, *shape, dtype=dtype)
            k = _pair(kwargs["kernel_size"], "kernel_size", "")
            out.append(Sample((x,), dict(kwargs), name=f"{shape} {kwargs}", reduction=k[0] * k[1]))
        return out

    return samples


_MAX_POOL_CASES = [
    ((2, 3, 7, 9), {"kernel_size": 2}),
    ((2, 3, 7, 9), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ((2, 3, 7, 9), {"kernel_size": (3, 2), "stride": (2, 1), "dilation": (1, 2), "ceil_mode": True}),
    ((3, 5, 6), {"kernel_size": 3, "stride": 2, "ceil_mode": True, "padding": 1}),
    ((0, 2, 4, 4), {"kernel_size": 2}),
]
_AVG_POOL_CASES = [
    ((2, 3, 7, 9), {"kernel_size": 2}),
    ((2, 3, 7, 9), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ((2, 3, 7, 9), {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False, "ceil_mode": True}),
    ((2, 3, 7, 9), {"kernel_size": (2, 3), "stride": 1, "padding": (1, 0), "ceil_mode": True}),
    ((3, 5, 6), {"kernel_size": 3, "stride": 2, "divisor_override": 5}),
    ((0, 2, 4, 4), {"kernel_size": 2}),
]
_POOL_GRADCHECK = [
    ((1, 2, 4, 5), {"kernel_size": 2}),
    ((1, 2, 5, 4), {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
]

register(
    OpInfo(
        "max_pool2d",
        max_pool2d,
        F.max_pool2d,
        _pool_samples(_MAX_POOL_CASES, True),
        family="conv",
        gradcheck_samples=lambda gen: _pool_samples(_POOL_GRADCHECK, True)(torch.float64, gen),
    )
)
register(
    OpInfo(
        "avg_pool2d",
        avg_pool2d,
        F.avg_pool2d,
        _pool_samples(_AVG_POOL_CASES, False),
        family="conv",
        gradcheck_samples=lambda gen: _pool_samples(
            _POOL_GRADCHECK
            + [((1, 2, 5, 4), {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False})],
            False,
        )(torch.float64, gen),
    )
)
