"""Test samples of the normalisation ops (``teeny.ops.norm``): layer_norm, rms_norm, group_norm,
batch_norm, registered in ``teeny.checks.registry`` for ``tests/test_ops.py``'s harness."""

import math

import torch
import torch.nn.functional as F

from ...ops.norm import batch_norm, group_norm, layer_norm, rms_norm
from ..registry import OpInfo, Sample, make, register


def _affine(gen, dtype, shape):
    return make(gen, *shape, low=0.5, high=1.5).to(dtype), make(gen, *shape, low=-0.5, high=0.5).to(dtype)


_LAYER_SHAPES = (((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((129, 7), (7,)), ((1, 5), (5,)), ((0, 5), (5,)))


def _layer_samples(dtype, gen, shapes=_LAYER_SHAPES, plain=(4, 9)):
    out = []
    for shape, ns in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, ns)
        out.append(Sample((x, ns, w, b), name=f"{shape} {ns}", reduction=max(math.prod(ns), shape[0])))
    out.append(Sample((make(gen, *plain, dtype=dtype), plain[-1:]), name=f"{plain} no affine", reduction=plain[-1]))
    return out


def _layer_gradcheck(gen):
    return _layer_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))), plain=(2, 5))


def _rms_samples(
    dtype, gen, shapes=(((3, 37), (37,)), ((5, 3, 11), (3, 11)), ((1, 5), (5,)), ((0, 5), (5,))), plain=(4, 9)
):
    out = [Sample(s.args[:3], name=s.name, reduction=s.reduction) for s in _layer_samples(dtype, gen, shapes, plain)]
    out.append(Sample(out[0].args, {"eps": 1e-3}, name=f"{out[0].name} eps=1e-3", reduction=out[0].reduction))
    gemma = {"eps": 1e-6, "weight_offset": 1.0}
    out.append(Sample(out[1].args, gemma, name=f"{out[1].name} Gemma's (1 + w)", reduction=out[1].reduction))
    return out


def _rms_gradcheck(gen):
    samples = _rms_samples(torch.float64, gen, shapes=(((3, 7), (7,)), ((2, 2, 3), (2, 3))), plain=(2, 5))
    return [s for s in samples if s.kwargs.get("eps") != 1e-3]


def _rms_norm(x, normalized_shape, weight=None, eps=None, weight_offset=0.0):
    """PyTorch's rms_norm with the scale weight + weight_offset (Gemma's (1 + w))."""
    return F.rms_norm(x, normalized_shape, None if weight is None else weight + weight_offset, eps)


def _group_samples(dtype, gen, shapes=(((2, 6, 5), 3), ((3, 4), 2), ((2, 4, 3, 2), 4)), plain=(2, 6, 5)):
    out = []
    for shape, groups in shapes:
        x = make(gen, *shape, dtype=dtype)
        w, b = _affine(gen, dtype, (shape[1],))
        reduction = max(shape[1] // groups * math.prod(shape[2:]), shape[0])
        out.append(Sample((x, groups, w, b), name=f"{shape} groups={groups}", reduction=reduction))
    out.append(Sample((make(gen, *plain, dtype=dtype), 2), name=f"{plain} groups=2 no affine", reduction=plain[1] // 2))
    return out


def _group_gradcheck(gen):
    return _group_samples(torch.float64, gen, shapes=(((2, 6, 2), 3), ((2, 4), 2)), plain=(2, 4))


def _batch_samples(dtype, gen, shapes=((7, 3), (4, 3, 5, 2)), modes=(True, False)):
    out = []
    for shape in shapes:
        c = shape[1]
        for training in modes:
            x = make(gen, *shape, dtype=dtype)
            rm, rv = make(gen, c, low=-0.5, high=0.5).to(dtype), make(gen, c, low=0.5, high=2.0).to(dtype)
            w, b = _affine(gen, dtype, (c,))
            reduction = shape[0] * math.prod(shape[2:])
            out.append(
                Sample(
                    (x, rm, rv, w, b),
                    {"training": training, "momentum": 0.2},
                    grad=(0, 3, 4),
                    name=f"{shape} training={training}",
                    reduction=reduction,
                )
            )
            out.append(
                Sample(
                    (x.clone(), rm.clone(), rv.clone()),
                    {"training": training},
                    grad=(0,),
                    name=f"{shape} training={training} no affine",
                    reduction=reduction,
                )
            )
    return out


def _batch_gradcheck(gen):
    return _batch_samples(torch.float64, gen, shapes=((5, 3), (3, 2, 2)))


register(
    OpInfo("layer_norm", layer_norm, F.layer_norm, _layer_samples, family="norm", gradcheck_samples=_layer_gradcheck)
)
register(OpInfo("rms_norm", rms_norm, _rms_norm, _rms_samples, family="norm", gradcheck_samples=_rms_gradcheck))
register(
    OpInfo("group_norm", group_norm, F.group_norm, _group_samples, family="norm", gradcheck_samples=_group_gradcheck)
)
register(
    OpInfo("batch_norm", batch_norm, F.batch_norm, _batch_samples, family="norm", gradcheck_samples=_batch_gradcheck)
)
