"""Converters of the ATen losses (ATen's reduction is an integer: 0 none, 1 mean, 2 sum)."""

from __future__ import annotations

from .... import ops
from .base import aten, converts

# -------------------------------------------------------------------------- losses

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@converts(aten.cross_entropy_loss.default)
def _cross_entropy(env, x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    target = env.tensor(target, x.dtype if target.dtype.is_floating_point else None)
    return ops.cross_entropy(x, target, w, int(ignore_index), _REDUCTIONS[reduction], float(label_smoothing))


@converts(aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default)
def _nll_loss(env, x, target, weight=None, reduction=1, ignore_index=-100):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    return ops.nll_loss(x, env.tensor(target), w, int(ignore_index), _REDUCTIONS[reduction])


def _pointwise_loss(fn, *scalars):
    def convert(env, x, target, reduction=1, *rest):
        x = env.tensor(x)
        return fn(x, env.tensor(target, x.dtype), _REDUCTIONS[reduction], *[float(r) for r in rest])

    return convert


converts(aten.mse_loss.default)(_pointwise_loss(ops.mse_loss))
converts(aten.l1_loss.default)(_pointwise_loss(ops.l1_loss))
converts(aten.smooth_l1_loss.default)(_pointwise_loss(ops.smooth_l1_loss))
converts(aten.huber_loss.default)(_pointwise_loss(ops.huber_loss))


@converts(aten.binary_cross_entropy.default)
def _bce(env, x, target, weight=None, reduction=1):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    return ops.binary_cross_entropy(x, env.tensor(target, x.dtype), w, _REDUCTIONS[reduction])


@converts(aten.binary_cross_entropy_with_logits.default)
def _bce_logits(env, x, target, weight=None, pos_weight=None, reduction=1):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    pw = None if pos_weight is None else env.tensor(pos_weight, x.dtype)
    return ops.binary_cross_entropy_with_logits(x, env.tensor(target, x.dtype), w, _REDUCTIONS[reduction], pw)


@converts(aten.kl_div.default)
def _kl_div(env, x, target, reduction=1, log_target=False):
    x = env.tensor(x)
    return ops.kl_div(x, env.tensor(target, x.dtype), _REDUCTIONS[reduction], bool(log_target))
