"""Test samples of the losses (``teeny.ops.loss``): element-wise losses with inputs kept away
from their kinks, weights broadcast or full, and cross-entropy / NLL with class indices or
probabilities, ignored rows, class weights, label smoothing and soft-capped logits, registered
in ``teeny.checks.registry`` for ``tests/test_ops.py``'s harness."""

import math

import torch
import torch.nn.functional as F

from ...ops.loss import (
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)
from ..registry import OpInfo, Sample, away_from, make, register


def _named(shape, kwargs):
    extra = ",".join(f"{k}={v}" for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    weights = ",".join(f"{k}{tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return " ".join(p for p in (str(shape), extra, weights) if p)


def _reduction_length(shape, kwargs) -> int:
    return 1 if kwargs.get("reduction") == "none" else max(1, math.prod(shape))


# (shape, kwargs) of the element-wise samples; weights are filled in per loss
_POINTWISE_CASES = [
    ((3, 37), {}),
    ((129, 7), {"reduction": "sum"}),
    ((5, 3, 11), {"reduction": "none"}),
    ((1,), {}),
    ((0, 5), {"reduction": "sum"}),
]
_POINTWISE_GRADCHECK = [((2, 4), {}), ((3,), {"reduction": "none"}), ((2,), {"reduction": "sum"})]


def _pointwise_samples(make_pair, cases, extra=lambda shape, kwargs, dtype, gen: {}):
    """Samples of (input, target) from ``make_pair(shape, gen) -> float64 tensors`` per case;
    ``extra`` adds weight kwargs. Weights get no gradient (grad=(0, 1))."""

    def samples(dtype, gen):
        out = []
        for shape, kwargs in cases:
            x, t = make_pair(shape, gen)
            kwargs = {**kwargs, **extra(shape, kwargs, dtype, gen)}
            out.append(
                Sample(
                    (x.to(dtype), t.to(dtype)),
                    kwargs,
                    name=_named(shape, kwargs),
                    grad=(0, 1),
                    reduction=_reduction_length(shape, kwargs),
                )
            )
        return out

    return samples


def _regression_pair(kinks=()):
    """target in [-2, 2), input = target + a difference kept 0.1 away from the loss's kinks."""

    def pair(shape, gen):
        t = make(gen, *shape)
        return t + away_from(make(gen, *shape, low=-3, high=3), kinks, gap=0.1), t

    return pair


def _probability_pair(shape, gen):
    return make(gen, *shape, low=0.05, high=0.95), make(gen, *shape, low=0.0, high=1.0)


def _logit_pair(shape, gen):
    return make(gen, *shape, low=-3, high=3), make(gen, *shape, low=0.0, high=1.0)


def _kl_pair(log_target):
    def pair(shape, gen):
        target = make(gen, *shape, low=-3, high=0) if log_target else make(gen, *shape, low=0.05, high=1.0)
        return make(gen, *shape, low=-3, high=0), target

    return pair


def _bce_weights(pos_weight):
    def extra(shape, kwargs, dtype, gen):
        if len(shape) < 2 or shape[0] == 0:
            return {}
        out = {"weight": make(gen, *shape[-1:], low=0.1, high=2).to(dtype)}
        if shape == (129, 7):  # a full-shape weight
            out["weight"] = make(gen, *shape, low=0.1, high=2).to(dtype)
        if pos_weight:
            out["pos_weight"] = make(gen, *shape[-1:], low=0.2, high=3).to(dtype)
        return out

    return extra


def _with(cases, **kwargs):
    return [(shape, {**kw, **kwargs}) for shape, kw in cases]


def _register_pointwise(
    name,
    fn,
    ref,
    make_pair,
    cases=_POINTWISE_CASES,
    gradcheck_cases=_POINTWISE_GRADCHECK,
    extra=lambda shape, kwargs, dtype, gen: {},
):
    gradcheck = _pointwise_samples(make_pair, gradcheck_cases, extra)
    register(
        OpInfo(
            name,
            fn,
            ref,
            _pointwise_samples(make_pair, cases, extra),
            family="loss",
            gradcheck_samples=lambda gen: gradcheck(torch.float64, gen),
        )
    )


_register_pointwise("mse_loss", mse_loss, F.mse_loss, _regression_pair())
_register_pointwise("l1_loss", l1_loss, F.l1_loss, _regression_pair((0.0,)))
_register_pointwise("smooth_l1_loss", smooth_l1_loss, F.smooth_l1_loss, _regression_pair((0.0, 1.0, -1.0)))
_register_pointwise(
    "smooth_l1_loss_beta",
    lambda x, t, **kw: smooth_l1_loss(x, t, beta=0.3, **kw),  # not a power of two: float64 must stay float64
    lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.3, **kw),
    _regression_pair((0.0, 0.3, -0.3)),
)
_register_pointwise(
    "smooth_l1_loss_beta0",
    lambda x, t, **kw: smooth_l1_loss(x, t, beta=0.0, **kw),
    lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.0, **kw),
    _regression_pair((0.0,)),
)
_register_pointwise("huber_loss", huber_loss, F.huber_loss, _regression_pair((1.0, -1.0)))
_register_pointwise(
    "huber_loss_delta",
    lambda x, t, **kw: huber_loss(x, t, delta=0.7, **kw),
    lambda x, t, **kw: F.huber_loss(x, t, delta=0.7, **kw),
    _regression_pair((0.7, -0.7)),
)
_register_pointwise(
    "binary_cross_entropy", binary_cross_entropy, F.binary_cross_entropy, _probability_pair, extra=_bce_weights(False)
)
_register_pointwise(
    "binary_cross_entropy_with_logits",
    binary_cross_entropy_with_logits,
    F.binary_cross_entropy_with_logits,
    _logit_pair,
    extra=_bce_weights(True),
)
_KL_CASES = [
    ((3, 37), {"reduction": "batchmean"}),
    ((129, 7), {}),
    ((5, 3, 11), {"reduction": "none"}),
    ((1,), {"reduction": "sum"}),
    ((0, 5), {"reduction": "sum"}),
]
_KL_GRADCHECK = [((2, 4), {"reduction": "batchmean"}), ((3,), {"reduction": "none"}), ((2,), {})]
_register_pointwise("kl_div", kl_div, F.kl_div, _kl_pair(False), _KL_CASES, _KL_GRADCHECK)
_register_pointwise(
    "kl_div_log_target",
    kl_div,
    F.kl_div,
    _kl_pair(True),
    _with(_KL_CASES, log_target=True),
    _with(_KL_GRADCHECK, log_target=True),
)


# ---------------------------------------------------------------------------- class losses


def _class_targets(gen, shape, n_classes, ignore_every=0, ignore_index=-100):
    t = torch.randint(0, n_classes, shape, generator=gen, dtype=torch.int64)
    if ignore_every:
        t.view(-1)[::ignore_every] = ignore_index
    return t


# (input shape, target: "index" | "probs", ignore_every, kwargs); weights: kwargs "weight": True
_CE_CASES = [
    ((3, 37), "index", 0, {}),
    ((129, 7), "index", 5, {"weight": True}),
    ((129, 7), "index", 4, {"label_smoothing": 0.1, "reduction": "sum"}),
    ((5, 4, 3), "index", 0, {"weight": True, "label_smoothing": 0.2}),
    ((3, 37), "probs", 0, {"weight": True, "label_smoothing": 0.1}),
    ((4, 9), "probs", 0, {"reduction": "none"}),
    ((1, 37), "index", 0, {"reduction": "none"}),
    ((11, 5), "index", 3, {"ignore_index": 2, "reduction": "none", "weight": True}),
    ((6,), "index", 0, {}),
    ((0, 5), "index", 0, {"reduction": "sum"}),
    # soft-capped logits (Gemma 2's), caps the samples' logits in [-3, 3) reach: not a power of two
    ((15, 11), "index", 4, {"softcap": 1.7, "weight": True, "label_smoothing": 0.1}),
    ((5, 4, 3), "index", 0, {"softcap": 2.5, "reduction": "sum"}),
    ((11, 5), "index", 3, {"softcap": 0.9, "ignore_index": 2, "reduction": "none"}),
]
_CE_GRADCHECK = [
    ((3, 4), "index", 3, {"weight": True, "label_smoothing": 0.1}),
    ((2, 3), "probs", 0, {"label_smoothing": 0.1, "reduction": "none", "weight": True}),
    ((2, 2, 2), "index", 0, {"reduction": "sum"}),
    ((3, 5), "index", 3, {"softcap": 1.3, "weight": True, "label_smoothing": 0.2}),
]
_NLL_CASES = [
    ((3, 37), "index", 0, {}),
    ((129, 7), "index", 5, {"weight": True}),
    ((5, 4, 3), "index", 0, {"reduction": "sum"}),
    ((1, 37), "index", 0, {"reduction": "none"}),
    ((11, 5), "index", 3, {"ignore_index": 2, "reduction": "none", "weight": True}),
]
_NLL_GRADCHECK = [((3, 4), "index", 3, {"weight": True}), ((2, 2, 2), "index", 0, {"reduction": "none"})]


def _class_samples(cases, log_probs):
    def samples(dtype, gen):
        out = []
        for shape, kind, ignore_every, kwargs in cases:
            n_classes = shape[0] if len(shape) == 1 else shape[1]
            x = make(gen, *shape, low=-3, high=3)
            if log_probs:
                x = torch.log_softmax(x, dim=0 if len(shape) == 1 else 1)
            if kind == "probs":
                target = torch.softmax(make(gen, *shape, low=-2, high=2), dim=1).to(dtype)
            else:
                target_shape = () if len(shape) == 1 else shape[:1] + shape[2:]
                target = _class_targets(gen, target_shape, n_classes, ignore_every, kwargs.get("ignore_index", -100))
            kwargs = dict(kwargs)
            if kwargs.get("weight") is True:
                kwargs["weight"] = make(gen, n_classes, low=0.2, high=2).to(dtype)
            rows = max(1, math.prod(shape) // n_classes)
            length = n_classes if kwargs.get("reduction") == "none" else max(rows, n_classes)
            out.append(
                Sample(
                    (x.to(dtype), target),
                    kwargs,
                    name=f"{kind} " + _named(shape, kwargs),
                    grad=(0, 1),
                    reduction=length,
                )
            )
        return out

    return samples


def _cross_entropy_reference(input, target, *args, softcap=0.0, **kwargs):
    """F.cross_entropy, of the logits soft-capped at ``softcap`` > 0 first (as Gemma 2 caps them)."""
    if softcap:
        input = softcap * torch.tanh(input / softcap)
    return F.cross_entropy(input, target, *args, **kwargs)


register(
    OpInfo(
        "cross_entropy",
        cross_entropy,
        _cross_entropy_reference,
        _class_samples(_CE_CASES, False),
        family="loss",
        gradcheck_samples=lambda gen: _class_samples(_CE_GRADCHECK, False)(torch.float64, gen),
    )
)
register(
    OpInfo(
        "nll_loss",
        nll_loss,
        F.nll_loss,
        _class_samples(_NLL_CASES, True),
        family="loss",
        gradcheck_samples=lambda gen: _class_samples(_NLL_GRADCHECK, True)(torch.float64, gen),
    )
)
