"""Test samples of the reductions and softmaxes (``teeny.ops.reduction``): odd shapes,
non-adjacent axes, keepdim, a 1-element and an empty-batch case, non-dyadic corrections."""

import math

import torch
import torch.nn.functional as F

from ... import ops
from ...ops.reduction import _normalize_dims
from ..registry import OpInfo, Sample, make, register

# (shape, dim, keepdim): odd shapes, non-adjacent axes, a 1-element and an empty-batch case
_REDUCE_CASES = [
    ((3, 37), 1, False),
    ((3, 37), None, False),
    ((129, 7), 0, True),
    ((5, 3, 11), (0, 2), False),
    ((5, 3, 11), [1], True),
    ((5, 3, 11), (-1, -2), False),
    ((1,), 0, False),
    ((0, 5), 1, False),
]
_GRADCHECK_CASES = [((3, 4), 1, False), ((2, 3, 3), (0, 2), True), ((4,), None, False), ((3, 1, 2), -1, False)]


def _reduction_samples(cases, kwargs=None):
    def samples(dtype, gen):
        out = []
        for shape, dim, keepdim in cases:
            dims = _normalize_dims("sample", dim, len(shape))
            n = math.prod(shape[d] for d in dims)
            kw = {"dim": dim, "keepdim": keepdim, **(kwargs or {})}
            out.append(Sample((make(gen, *shape).to(dtype),), kw, name=f"{shape} dim={dim}", reduction=max(n, 1)))
        return out

    return samples


def _gradcheck(cases, kwargs=None):
    return lambda gen: _reduction_samples(cases, kwargs)(torch.float64, gen)


_REFS = {
    "sum": lambda x, dim=None, keepdim=False: torch.sum(x, dim=dim, keepdim=keepdim),
    "mean": lambda x, dim=None, keepdim=False: torch.mean(x, dim=dim, keepdim=keepdim),
    "max": lambda x, dim=None, keepdim=False: torch.amax(x, dim=() if dim is None else dim, keepdim=keepdim),
    "min": lambda x, dim=None, keepdim=False: torch.amin(x, dim=() if dim is None else dim, keepdim=keepdim),
    "var": lambda x, dim=None, keepdim=False, correction=1: torch.var(
        x, dim=dim, correction=correction, keepdim=keepdim
    ),
    "std": lambda x, dim=None, keepdim=False, correction=1: torch.std(
        x, dim=dim, correction=correction, keepdim=keepdim
    ),
    "logsumexp": lambda x, dim=None, keepdim=False: torch.logsumexp(
        x, dim=tuple(range(x.dim())) if dim is None else dim, keepdim=keepdim
    ),
}
_OPS = {
    "sum": ops.sum,
    "mean": ops.mean,
    "max": ops.max,
    "min": ops.min,
    "var": ops.var,
    "std": ops.std,
    "logsumexp": ops.logsumexp,
}

for _kind, _fn in _OPS.items():
    # no NaN results here (mean of nothing, var of one element): test_reduction covers those
    _cases = [c for c in _REDUCE_CASES if _kind not in ("mean", "var", "std") or math.prod(c[0]) > 1]
    register(
        OpInfo(
            _kind,
            _fn,
            _REFS[_kind],
            _reduction_samples(_cases),
            family="reduction",
            gradcheck_samples=_gradcheck(_GRADCHECK_CASES),
        )
    )
for _kind, _correction in (("var", 0), ("var", 0.3), ("std", 0.7)):  # a non-dyadic correction is a float scalar
    register(
        OpInfo(
            f"{_kind}_correction{_correction}".replace(".", "_"),  # an identifier: var_correction0_3
            _OPS[_kind],
            _REFS[_kind],
            _reduction_samples(_REDUCE_CASES[:6], {"correction": _correction}),
            family="reduction",
            gradcheck_samples=_gradcheck(_GRADCHECK_CASES[:2], {"correction": _correction}),
        )
    )

_SOFTMAX_CASES = [
    ((3, 37), -1),
    ((129, 7), 0),
    ((5, 3, 11), 1),
    ((5, 3, 11), -1),
    ((5, 3, 11), 0),
    ((1,), 0),
    ((0, 5), -1),
]
_SOFTMAX_GRADCHECK = [((3, 7), -1), ((3, 4, 2), 1), ((1,), 0)]


def _softmax_samples(cases):
    def samples(dtype, gen):
        return [
            Sample(
                (make(gen, *shape, low=-4, high=4).to(dtype),),
                {"dim": dim},
                name=f"{shape} dim={dim}",
                reduction=max(shape[dim], 1),
            )
            for shape, dim in cases
        ]

    return samples


register(
    OpInfo(
        "softmax",
        ops.softmax,
        lambda x, dim=-1: F.softmax(x, dim),
        _softmax_samples(_SOFTMAX_CASES),
        family="reduction",
        gradcheck_samples=lambda gen: _softmax_samples(_SOFTMAX_GRADCHECK)(torch.float64, gen),
    )
)
register(
    OpInfo(
        "log_softmax",
        ops.log_softmax,
        lambda x, dim=-1: F.log_softmax(x, dim),
        _softmax_samples(_SOFTMAX_CASES),
        family="reduction",
        gradcheck_samples=lambda gen: _softmax_samples(_SOFTMAX_GRADCHECK)(torch.float64, gen),
    )
)
