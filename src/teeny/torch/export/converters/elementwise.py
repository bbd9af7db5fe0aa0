"""Converters of the element-wise ATen ops: arithmetic (a Python number or a 0-d tensor operand
passes as a number), unary maths and activations, clamps and selections, the dtype casts, and
the copies and aliases (a teeny value itself)."""

from __future__ import annotations

from typing import Any

import torch

from .... import ops
from ....core.graph import Tensor
from ....ops.cast import to as cast
from .base import Env, aten, converts, refuse


def _operand(env: Env, v: Any, dtype: torch.dtype) -> Any:
    """A binary op's operand in the result dtype: Python numbers pass as they are."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, torch.Tensor) and v.dim() == 0 and dtype.is_floating_point:
        return v.item()
    return env.tensor(v, dtype)


def _binary(fn):
    def convert(env, a, b, *rest, **kw):
        dtype = env.out_dtype()
        refuse(not dtype.is_floating_point, f"an integer result ({dtype}); teeny's arithmetic is floating point")
        x, y = _operand(env, a, dtype), _operand(env, b, dtype)
        if not isinstance(x, Tensor) and not isinstance(y, Tensor):
            return fn(env.tensor(x, dtype), y, *rest, **kw)
        return fn(x, y, *rest, **kw)

    return convert


def _alpha(fn):
    def with_alpha(x, y, alpha=1):
        if alpha != 1:
            y = ops.mul(y, float(alpha)) if isinstance(y, Tensor) else y * alpha
        return fn(x, y)

    return with_alpha


converts(aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.add_.Scalar)(_binary(_alpha(ops.add)))
converts(aten.sub.Tensor, aten.sub.Scalar, aten.sub_.Tensor, aten.sub_.Scalar)(_binary(_alpha(ops.sub)))
converts(aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar)(_binary(ops.mul))
converts(aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar)(_binary(ops.div))
converts(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)(_binary(ops.pow))
converts(aten.maximum.default)(_binary(ops.maximum))
converts(aten.minimum.default)(_binary(ops.minimum))


@converts(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(env, a, b, alpha=1):
    return _binary(ops.sub)(env, b, ops.mul(a, float(alpha)) if alpha != 1 else a)


@converts(aten.div.Tensor_mode)
def _div_mode(env, a, b, rounding_mode=None):
    refuse(rounding_mode is not None, f"div with rounding_mode={rounding_mode!r}")
    return _binary(ops.div)(env, a, b)


def _unary(fn):
    def convert(env, x, *args):
        dtype = env.out_dtype()
        refuse(not dtype.is_floating_point, f"{fn.__name__} of an integer tensor")
        return fn(env.tensor(x, dtype), *args)

    return convert


for _targets, _fn in [
    ((aten.neg.default,), ops.neg),
    ((aten.abs.default,), ops.abs),
    ((aten.exp.default,), ops.exp),
    ((aten.log.default,), ops.log),
    ((aten.sqrt.default,), ops.sqrt),
    ((aten.rsqrt.default,), ops.rsqrt),
    ((aten.reciprocal.default,), ops.reciprocal),
    ((aten.square.default,), ops.square),
    ((aten.sin.default,), ops.sin),
    ((aten.cos.default,), ops.cos),
    ((aten.erf.default,), ops.erf),
    ((aten.tanh.default, aten.tanh_.default), ops.tanh),
    ((aten.sigmoid.default, aten.sigmoid_.default), ops.sigmoid),
    ((aten.relu.default, aten.relu_.default), ops.relu),
    ((aten.silu.default, aten.silu_.default), ops.silu),
    ((aten.mish.default, aten.mish_.default), ops.mish),
    ((aten.hardswish.default, aten.hardswish_.default), ops.hardswish),
    ((aten.hardsigmoid.default, aten.hardsigmoid_.default), ops.hardsigmoid),
    ((aten.log_sigmoid.default,), ops.logsigmoid),
    ((aten.selu.default, aten.selu_.default), ops.selu),
]:
    converts(*_targets)(_unary(_fn))


@converts(aten.gelu.default, aten.gelu_.default)
def _gelu(env, x, approximate="none"):
    return ops.gelu(env.tensor(x), approximate)


@converts(aten.leaky_relu.default, aten.leaky_relu_.default)
def _leaky_relu(env, x, negative_slope=0.01):
    return ops.leaky_relu(env.tensor(x), float(negative_slope))


@converts(aten.elu.default, aten.elu_.default)
def _elu(env, x, alpha=1.0, scale=1.0, input_scale=1.0):
    refuse(scale != 1.0 or input_scale != 1.0, "elu with scale/input_scale")
    return ops.elu(env.tensor(x), float(alpha))


@converts(aten.celu.default, aten.celu_.default)
def _celu(env, x, alpha=1.0):
    return ops.celu(env.tensor(x), float(alpha))


@converts(aten.hardtanh.default, aten.hardtanh_.default)
def _hardtanh(env, x, min_val=-1.0, max_val=1.0):
    return ops.hardtanh(env.tensor(x), float(min_val), float(max_val))


@converts(aten.relu6.default, aten.relu6_.default)
def _relu6(env, x):
    return ops.relu6(env.tensor(x))


@converts(aten.softplus.default)
def _softplus(env, x, beta=1.0, threshold=20.0):
    return ops.softplus(env.tensor(x), float(beta), float(threshold))


@converts(aten.softshrink.default)
def _softshrink(env, x, lambd=0.5):
    return ops.softshrink(env.tensor(x), float(lambd))


@converts(aten.hardshrink.default)
def _hardshrink(env, x, lambd=0.5):
    return ops.hardshrink(env.tensor(x), float(lambd))


@converts(aten.threshold.default, aten.threshold_.default)
def _threshold(env, x, threshold, value):
    return ops.threshold(env.tensor(x), float(threshold), float(value))


@converts(aten.glu.default)
def _glu(env, x, dim=-1):
    return ops.glu(env.tensor(x), dim)


@converts(aten.prelu.default, aten._prelu_kernel.default)
def _prelu(env, x, weight):
    return ops.prelu(env.tensor(x), env.tensor(weight))


@converts(aten.clamp.default, aten.clamp_.default)
def _clamp(env, x, min=None, max=None):
    lo = min.item() if isinstance(min, torch.Tensor) else min
    hi = max.item() if isinstance(max, torch.Tensor) else max
    return ops.clamp(env.tensor(x), lo, hi)


@converts(aten.clamp_min.default, aten.clamp_min_.default)
def _clamp_min(env, x, min):
    return ops.clamp(env.tensor(x), min=float(min))


@converts(aten.clamp_max.default, aten.clamp_max_.default)
def _clamp_max(env, x, max):
    return ops.clamp(env.tensor(x), max=float(max))


@converts(aten.where.self)
def _where(env, condition, a, b):
    dtype = env.out_dtype()
    refuse(not dtype.is_floating_point, "where with an integer result")
    return ops.where(env.tensor(condition), _operand(env, a, dtype), _operand(env, b, dtype))


@converts(aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor)
def _masked_fill(env, x, mask, value):
    value = value.item() if isinstance(value, torch.Tensor) else value
    return ops.where(env.tensor(mask), float(value), env.tensor(x))


# -------------------------------------------------------------------------- dtypes and copies


@converts(aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device, aten.type_as.default)
def _to(env, x, *args, **kwargs):
    return cast(env.tensor(x), env.out_dtype())


@converts(aten.contiguous.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default)
def _identity(env, x, *args, **kwargs):
    return x


@converts(aten.detach.default, aten.detach_.default)
def _detach(env, x):
    return ops.stop_gradient(env.tensor(x))


@converts(aten._assert_tensor_metadata.default)
def _assert_metadata(env, *args, **kwargs):
    return None
