"""Bring your PyTorch model: ``from_torch(module, example_inputs)`` -> a teeny ``Graph``, and
``to_torch(executor, module)`` hands the trained weights back.

    graph = teeny.torch.from_torch(model, (x, y))          # model(x, y) returns the loss
    executor = teeny.Executor(teeny.lower(graph, teeny.LoweringMode.TRAINING))
    ...                                                     # train with teeny's optimizers
    teeny.torch.to_torch(executor, model)                   # load_state_dict(strict=True) inside

Tracing is ``torch.export`` (its training IR, the ATen ops before decomposition), not
``torch.fx.symbolic_trace``: export runs the real Python code with fake tensors, so models
with shape arithmetic, ``if`` on shapes, ``**kwargs`` and output dataclasses (Hugging Face
GPT-2 and Llama, which ``symbolic_trace`` cannot trace without their own tracer) come out as
one flat graph of ATen calls; it lifts every parameter and buffer to an input named by its
``state_dict`` key (tied weights once), and records for every call the module path
(``nn_module_stack``) and the source line (``stack_trace``) that the error for an unsupported
call needs. The ATen level is also the smallest vocabulary to map: every ``F.*``, tensor
method and operator arrives as one of a few hundred ATen ops.

The graph: user inputs keep their argument names; parameters become teeny parameters under
their ``state_dict`` names, initialised with the module's values (``requires_grad=False``
parameters are non-trainable); floating-point buffers (BatchNorm's running statistics) are
non-trainable parameters, which teeny's ``batch_norm`` updates in place in training;
non-persistent buffers and tensor constants become graph constants. Computations that depend
on no input and no parameter (causal masks, position ids, rotary tables) are run once by
PyTorch at import and become constants. Train/eval behaviour is the module's mode at import:
import ``module.train()`` for a training graph (dropout draws a new mask per step, batch norm
uses batch statistics and updates the running ones), ``module.eval()`` for inference.
Integer buffers (``num_batches_tracked``) stay with the torch module (teeny does not count).

Rewrites keep an imported model as fast as one written in teeny: a module call whose
maths teeny has one kernel pair for (Hugging Face's tanh-GELU activations and ``*RMSNorm``s,
recognised by class name) becomes that op instead of its run of ATen calls (``nn_module_stack``
says which calls belong to it), ``silu(gate) * up`` becomes one ``swiglu`` pair, and a folded
attention mask that is exactly causal becomes
``is_causal=True``, so the attention kernel skips the masked blocks instead of reading a mask.

Every ATen call without a teeny op is collected, and ``UnsupportedError`` lists each one
with its module path and source line, not just the first.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import ops
from ..graph import Graph, Tensor
from ..kernels.cast import to as cast
from ..runtime import TeenyError

aten = torch.ops.aten
# `with torch.no_grad()` and `with torch.autocast(...)` blocks, as torch.export records them
_SET_GRAD_ENABLED = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


class UnsupportedError(TeenyError):
    """The module makes calls teeny cannot import; ``calls`` lists each (op, where, why)."""

    def __init__(self, calls: list[tuple[str, str, str]]):
        self.calls = calls
        lines = [f"{len(calls)} call{'s' if len(calls) != 1 else ''} cannot be imported into teeny:"]
        lines += [f"  {op} at {where}: {why}" for op, where, why in calls]
        super().__init__("\n".join(lines))


class _Unsupported(Exception):
    """A converter's refusal; the message says why."""


def _refuse(condition: bool, why: str) -> None:
    if condition:
        raise _Unsupported(why)


# ----------------------------------------------------------------------------- the converter


@dataclass
class _Env:
    graph: Graph
    node: Any = None  # the FX node being converted

    @property
    def val(self):
        """The node's fake output (shape and dtype torch computed for it)."""
        return self.node.meta.get("val")

    def tensor(self, value: Any, dtype: torch.dtype | None = None) -> Tensor:
        """A teeny tensor for ``value`` (a constant becomes a graph constant), cast to ``dtype``."""
        if isinstance(value, torch.Tensor):
            value = self.graph.constant(value.detach() if dtype is None else value.detach().to(dtype))
        elif isinstance(value, (int, float, bool)):
            value = self.graph.constant(torch.tensor(value, dtype=dtype or torch.get_default_dtype()))
        if dtype is not None and value.dtype != dtype:
            value = cast(value, dtype)
        return value

    def out_dtype(self) -> torch.dtype:
        return self.val.dtype


def _is_teeny(v: Any) -> bool:
    if isinstance(v, Tensor):
        return True
    if isinstance(v, (list, tuple)):
        return any(_is_teeny(b) for b in v)
    return False


# ---------------------------------------------------------------- converters: ATen op -> teeny

CONVERTERS: dict[Any, Callable] = {}


def converts(*targets):
    def register(fn):
        for t in targets:
            CONVERTERS[t] = fn
        return fn

    return register


def _operand(env: _Env, v: Any, dtype: torch.dtype) -> Any:
    """A binary op's operand in the result dtype: Python numbers pass as they are."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, torch.Tensor) and v.dim() == 0 and dtype.is_floating_point:
        return v.item()
    return env.tensor(v, dtype)


def _binary(fn):
    def convert(env, a, b, *rest, **kw):
        dtype = env.out_dtype()
        _refuse(not dtype.is_floating_point, f"an integer result ({dtype}); teeny's arithmetic is floating point")
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
    _refuse(rounding_mode is not None, f"div with rounding_mode={rounding_mode!r}")
    return _binary(ops.div)(env, a, b)


def _unary(fn):
    def convert(env, x, *args):
        dtype = env.out_dtype()
        _refuse(not dtype.is_floating_point, f"{fn.__name__} of an integer tensor")
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
    _refuse(scale != 1.0 or input_scale != 1.0, "elu with scale/input_scale")
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
    _refuse(not dtype.is_floating_point, "where with an integer result")
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


# -------------------------------------------------------------------------- shapes


@converts(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _reshape(env, x, shape):
    return ops.reshape(env.tensor(x), tuple(shape))


@converts(aten.flatten.using_ints)
def _flatten(env, x, start_dim=0, end_dim=-1):
    return ops.flatten(env.tensor(x), start_dim, end_dim)


@converts(aten.unflatten.int)
def _unflatten(env, x, dim, sizes):
    return ops.unflatten(env.tensor(x), dim, tuple(sizes))


@converts(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(env, x, dim=None):
    return ops.reshape(env.tensor(x), tuple(env.val.shape))


@converts(aten.unsqueeze.default)
def _unsqueeze(env, x, dim):
    return ops.unsqueeze(env.tensor(x), dim)


@converts(aten.transpose.int)
def _transpose(env, x, dim0, dim1):
    return ops.transpose(env.tensor(x), dim0, dim1)


@converts(aten.t.default, aten.numpy_T.default)
def _t(env, x):
    x = env.tensor(x)
    return x if len(x.shape) < 2 else ops.transpose(x, -2, -1)


@converts(aten.permute.default)
def _permute(env, x, dims):
    return ops.permute(env.tensor(x), tuple(dims))


@converts(aten.expand.default)
def _expand(env, x, sizes, implicit=False):
    return ops.expand(env.tensor(x), tuple(env.val.shape))


@converts(aten.slice.Tensor)
def _slice(env, x, dim=0, start=None, end=None, step=1):
    x = env.tensor(x)
    size = x.shape[dim]
    end = None if end is None or end >= size else end
    return ops.slice(x, dim, start, end, step)


@converts(aten.select.int)
def _select(env, x, dim, index):
    x = env.tensor(x)
    d = dim % len(x.shape)
    index = index % x.shape[d]
    return ops.squeeze(ops.narrow(x, d, index, 1), d)


@converts(aten.narrow.default)
def _narrow(env, x, dim, start, length):
    return ops.narrow(env.tensor(x), dim, start, length)


@converts(aten.split.Tensor, aten.split_with_sizes.default)
def _split(env, x, split_size, dim=0):
    return ops.split(env.tensor(x), split_size if isinstance(split_size, int) else list(split_size), dim)


@converts(aten.chunk.default)
def _chunk(env, x, chunks, dim=0):
    return ops.chunk(env.tensor(x), chunks, dim)


@converts(aten.unbind.int)
def _unbind(env, x, dim=0):
    x = env.tensor(x)
    d = dim % len(x.shape)
    return [ops.squeeze(ops.narrow(x, d, i, 1), d) for i in range(x.shape[d])]


@converts(aten.cat.default)
def _cat(env, tensors, dim=0):
    dtype = env.out_dtype()
    return ops.concat([env.tensor(t, dtype) for t in tensors], dim)


@converts(aten.stack.default)
def _stack(env, tensors, dim=0):
    dtype = env.out_dtype()
    return ops.stack([env.tensor(t, dtype) for t in tensors], dim)


@converts(aten.pad.default, aten.constant_pad_nd.default)
def _pad(env, x, pad, mode="constant", value=None):
    _refuse(mode != "constant", f"pad with mode={mode!r}")
    x = env.tensor(x)
    fill = 0 if value is None else value
    for i in range(len(pad) // 2):
        dim = len(x.shape) - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        _refuse(before < 0 or after < 0, "pad with negative sizes (cropping)")
        parts = []
        for width in (before, after):
            shape = list(x.shape)
            shape[dim] = width
            parts.append(env.graph.constant(torch.full(shape, fill, dtype=x.dtype)) if width else None)
        x = ops.concat([p for p in (parts[0], x, parts[1]) if p is not None], dim)
    return x


# -------------------------------------------------------------------------- reductions


def _dims(dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return tuple(dim) if isinstance(dim, (list, tuple)) else dim


@converts(aten.sum.dim_IntList, aten.sum.default)
def _sum(env, x, dim=None, keepdim=False, dtype=None):
    _refuse(dtype is not None and dtype != env.tensor(x).dtype, "sum with another dtype=")
    return ops.sum(env.tensor(x), _dims(dim), keepdim)


@converts(aten.mean.dim, aten.mean.default)
def _mean(env, x, dim=None, keepdim=False, dtype=None):
    _refuse(dtype is not None and dtype != env.tensor(x).dtype, "mean with another dtype=")
    return ops.mean(env.tensor(x), _dims(dim), keepdim)


@converts(aten.amax.default, aten.max.default)
def _amax(env, x, dim=(), keepdim=False):
    return ops.max(env.tensor(x), _dims(dim), keepdim)


@converts(aten.amin.default, aten.min.default)
def _amin(env, x, dim=(), keepdim=False):
    return ops.min(env.tensor(x), _dims(dim), keepdim)


@converts(aten.var.correction, aten.var.dim)
def _var(env, x, dim=None, correction=None, keepdim=False, **kw):
    correction = 1 if correction is None else correction
    if "unbiased" in kw:
        correction = 1 if kw["unbiased"] else 0
    return ops.var(env.tensor(x), _dims(dim), float(correction), keepdim)


@converts(aten.std.correction, aten.std.dim)
def _std(env, x, dim=None, correction=None, keepdim=False, **kw):
    correction = 1 if correction is None else correction
    return ops.std(env.tensor(x), _dims(dim), float(correction), keepdim)


@converts(aten.logsumexp.default)
def _logsumexp(env, x, dim, keepdim=False):
    return ops.logsumexp(env.tensor(x), _dims(dim), keepdim)


@converts(aten._softmax.default, aten.softmax.int)
def _softmax(env, x, dim, half_to_float=None):
    _refuse(isinstance(half_to_float, torch.dtype) and half_to_float != env.out_dtype(), "softmax with dtype=")
    return ops.softmax(env.tensor(x, env.out_dtype()), dim)


@converts(aten._log_softmax.default, aten.log_softmax.int)
def _log_softmax(env, x, dim, half_to_float=None):
    return ops.log_softmax(env.tensor(x, env.out_dtype()), dim)


# -------------------------------------------------------------------------- layers


@converts(aten.linear.default)
def _linear(env, x, weight, bias=None):
    dtype = env.out_dtype()
    return ops.linear(
        env.tensor(x, dtype), env.tensor(weight, dtype), None if bias is None else env.tensor(bias, dtype)
    )


@converts(aten.addmm.default)
def _addmm(env, bias, a, b, beta=1, alpha=1):
    _refuse(beta != 1 or alpha != 1, "addmm with beta/alpha")
    dtype = env.out_dtype()
    return ops.add(ops.matmul(env.tensor(a, dtype), env.tensor(b, dtype)), env.tensor(bias, dtype))


@converts(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(env, a, b):
    dtype = env.out_dtype()
    return ops.matmul(env.tensor(a, dtype), env.tensor(b, dtype))


@converts(aten.embedding.default)
def _embedding(env, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    _refuse(scale_grad_by_freq or sparse, "embedding with scale_grad_by_freq or sparse")
    return ops.embedding(env.tensor(indices), env.tensor(weight), None if padding_idx < 0 else padding_idx)


@converts(aten.layer_norm.default)
def _layer_norm(env, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    b = None if bias is None else env.tensor(bias, x.dtype)
    return ops.layer_norm(x, tuple(normalized_shape), w, b, float(eps))


@converts(aten.native_layer_norm.default)
def _native_layer_norm(env, x, normalized_shape, weight, bias, eps):
    return (_layer_norm(env, x, normalized_shape, weight, bias, eps), None, None)


@converts(aten.rms_norm.default)
def _rms_norm(env, x, normalized_shape, weight=None, eps=None):
    x = env.tensor(x)
    return ops.rms_norm(x, tuple(normalized_shape), None if weight is None else env.tensor(weight, x.dtype), eps)


@converts(aten.group_norm.default)
def _group_norm(env, x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    x = env.tensor(x)
    w = None if weight is None else env.tensor(weight, x.dtype)
    b = None if bias is None else env.tensor(bias, x.dtype)
    return ops.group_norm(x, num_groups, w, b, float(eps))


@converts(aten.batch_norm.default)
def _batch_norm(env, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True):
    for stat in (running_mean, running_var):
        _refuse(
            isinstance(stat, torch.Tensor) and training, "batch_norm updating a running statistic that is a constant"
        )
    x = env.tensor(x)
    stat = lambda v: None if v is None else env.tensor(v, x.dtype)
    return ops.batch_norm(
        x, stat(running_mean), stat(running_var), stat(weight), stat(bias), bool(training), float(momentum), float(eps)
    )


@converts(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(env, x, weight, bias, running_mean, running_var, momentum, eps):
    return (_batch_norm(env, x, weight, bias, running_mean, running_var, False, momentum, eps), None, None)


@converts(aten.dropout.default, aten.dropout_.default)
def _dropout(env, x, p, train):
    return ops.dropout(env.tensor(x), float(p), bool(train))


@converts(aten.native_dropout.default)
def _native_dropout(env, x, p, train):
    return (_dropout(env, x, p, train), None)


@converts(aten.scaled_dot_product_attention.default)
def _sdpa(env, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    _refuse(dropout_p != 0.0, f"attention dropout (dropout_p={dropout_p}): teeny's attention has none")
    _refuse(_is_teeny(attn_mask), "an attention mask computed from the inputs (teeny's masks carry no gradient)")
    dtype = env.out_dtype()
    if _is_causal_mask(attn_mask):  # a folded causal mask (Hugging Face builds one): the kernel skips those blocks
        attn_mask, is_causal = None, True
    mask = None if attn_mask is None else env.tensor(attn_mask, None if attn_mask.dtype == torch.bool else dtype)
    return ops.scaled_dot_product_attention(
        env.tensor(q, dtype),
        env.tensor(k, dtype),
        env.tensor(v, dtype),
        mask,
        0.0,
        bool(is_causal),
        None if scale is None else float(scale),
        bool(enable_gqa),
    )


def _is_causal_mask(mask: Any) -> bool:
    """Whether a constant mask lets query i see exactly keys j <= i (top-left aligned), in
    every batch and head: what ``is_causal=True`` computes."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return False
    lq, lk = mask.shape[-2:]
    causal = torch.ones(lq, lk, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, causal.expand_as(mask)))
    if mask.is_floating_point():  # additive: 0 where visible, -inf (or the dtype's min) where not
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        visible = mask == 0
        return bool(torch.equal(visible, causal.expand_as(mask)) and torch.equal(hidden, ~causal.expand_as(mask)))
    return False


@converts(aten.conv2d.default, aten.conv2d.padding)
def _conv2d(env, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    dtype = env.out_dtype()
    b = None if bias is None else env.tensor(bias, dtype)
    padding = padding if isinstance(padding, str) else tuple(padding) if not isinstance(padding, int) else padding
    return ops.conv2d(
        env.tensor(x, dtype), env.tensor(weight, dtype), b, _pair(stride), padding, _pair(dilation), groups
    )


@converts(aten.convolution.default)
def _convolution(env, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    _refuse(transposed, "transposed convolution")
    _refuse(len(weight.shape) != 4, f"a {len(weight.shape) - 2}-d convolution (teeny has conv2d)")
    return _conv2d(env, x, weight, bias, stride, padding, dilation, groups)


def _pair(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


@converts(aten.max_pool2d.default)
def _max_pool2d(env, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    stride = None if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _pair(stride)
    return ops.max_pool2d(env.tensor(x), _pair(kernel_size), stride, _pair(padding), _pair(dilation), ceil_mode)


@converts(aten.max_pool2d_with_indices.default)
def _max_pool2d_indices(env, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return (_max_pool2d(env, x, kernel_size, stride, padding, dilation, ceil_mode), None)


@converts(aten.avg_pool2d.default)
def _avg_pool2d(env, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None):
    stride = None if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _pair(stride)
    return ops.avg_pool2d(
        env.tensor(x), _pair(kernel_size), stride, _pair(padding), ceil_mode, count_include_pad, divisor
    )


@converts(aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(env, x, output_size):
    x = env.tensor(x)
    h, w = x.shape[-2:]
    oh, ow = (output_size, output_size) if isinstance(output_size, int) else output_size
    oh, ow = oh or h, ow or w
    if (oh, ow) == (1, 1):
        return ops.mean(x, (-2, -1), True)
    _refuse(h % oh or w % ow, f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (not a whole number of windows)")
    return ops.avg_pool2d(x, (h // oh, w // ow), (h // oh, w // ow))


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


# -------------------------------------------------------------------------- factories on inputs

_LIKE = {
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.scalar_tensor.default,
}


# ----------------------------------------------------------------------------- fused modules

# Modules whose maths teeny has one kernel pair for, recognised by class name (transformers
# stays optional): their run of ATen calls in the exported graph (one per module call, found
# through nn_module_stack) becomes that one op. fuse(env, activation input, parameters, module)
_GELU_TANH_MODULES = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}


def _fuse_gelu_tanh(env, x, params, module):
    _refuse(params, "parameters in an activation")
    return ops.gelu(env.tensor(x), "tanh")


def _fuse_rms_norm(env, x, params, module):
    _refuse(len(params) != 1 or not hasattr(module, "variance_epsilon"), "not a weight-and-epsilon RMSNorm")
    x = env.tensor(x)
    weight = env.tensor(params[0], x.dtype)
    return ops.rms_norm(x, tuple(weight.shape), weight, float(module.variance_epsilon))


def _fusion(class_name: str, module) -> Callable | None:
    if class_name in _GELU_TANH_MODULES:
        return _fuse_gelu_tanh
    if class_name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
        from .patching import _source

        if "1.0 + self.weight" not in _source(type(module).forward):  # Gemma-style norms scale by 1 + weight
            return _fuse_rms_norm
    return None


@dataclass
class _Region:
    """The consecutive ATen calls of one module call."""

    nodes: list
    fuse: Callable
    module: nn.Module


_PASS_THROUGH = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.alias.default,
    aten.contiguous.default,
}


def _passes_through(node, source) -> bool:
    """Whether ``node`` is ``source`` itself (a cast to its own dtype, an alias)."""
    val, src = node.meta.get("val"), source.meta.get("val")
    return (
        node.target in _PASS_THROUGH
        and node.args
        and node.args[0] is source
        and isinstance(val, torch.Tensor)
        and isinstance(src, torch.Tensor)
        and val.dtype == src.dtype
        and tuple(val.shape) == tuple(src.shape)
    )


def _regions(ep, root: nn.Module | None) -> dict[str, _Region]:
    """Fusable module calls, by the name of their first node."""
    if root is None:
        return {}
    runs: list[tuple[str, str, str, list]] = []
    for node in ep.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op != "call_function" or not stack:
            runs.append(("", "", "", [node]))
            continue
        key, (path, cls) = list(stack.items())[-1]
        if runs and runs[-1][0] == key and key:
            runs[-1][3].append(node)
        else:
            runs.append((key, path, cls, [node]))
    out = {}
    for key, path, cls, nodes in runs:
        if not key:
            continue
        path = re.sub(r"^L\['self'\]\.?", "", path)
        try:
            module = root.get_submodule(path)
        except AttributeError:
            continue
        fuse = _fusion(cls.rsplit(".", 1)[-1], module)
        if fuse is not None:
            out[nodes[0].name] = _Region(nodes, fuse, module)
    return out


# ----------------------------------------------------------------------------- the import


def _where(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"^L\['self'\]\.?", "", path)
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or "")
    line = ""
    if frames:
        file, number, code = frames[-1]
        line = f" ({os.path.basename(file)}:{number}: {code.strip()})"
    return f"{path or '<root>'}{line}"


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return str(target) if isinstance(target, torch._ops.OpOverload) else name


class _Import:
    """Walks one exported program, filling ``graph``."""

    def __init__(
        self,
        graph: Graph,
        ep,
        prefix: str = "",
        bound: Sequence[Any] = (),
        input_names=None,
        canonical=None,
        root: nn.Module | None = None,
    ):
        self.graph, self.ep, self.prefix = graph, ep, prefix
        self.regions = _regions(ep, root)
        self.fused: set[str] = set()  # nodes a fused module call already computed
        self.canonical = canonical or {}  # storage key -> the module's own name for a tensor (tied weights)
        self.by_storage: dict[tuple, Tensor] = {}
        self.env: dict[str, Any] = {}
        self.unsupported: list[tuple[str, str, str]] = []
        self.bound = list(bound)  # values for the first user inputs (a loss's model outputs)
        self.input_names = input_names
        self.int_buffers: list[str] = []

    def run(self) -> list[Any]:
        signature = self.ep.graph_signature
        specs = {spec.arg.name: spec for spec in signature.input_specs}
        state = self.ep.state_dict
        constants = self.ep.constants
        bound = iter(self.bound)
        user_index = 0
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                spec = specs[node.name]
                kind = spec.kind.name
                if kind == "USER_INPUT":
                    value = next(bound, None)
                    if value is None:
                        val = node.meta["val"]
                        name = self.input_names[user_index] if self.input_names else node.name
                        value = self.graph.input(name, tuple(val.shape), val.dtype)
                    user_index += 1
                    self.env[node.name] = value
                elif kind == "PARAMETER":
                    self.env[node.name] = self._parameter(spec.target, state[spec.target], True, node)
                elif kind == "BUFFER":
                    data = state[spec.target] if spec.persistent else constants[spec.target]
                    if spec.persistent and data.is_floating_point():
                        self.env[node.name] = self._parameter(spec.target, data, False, node)
                    else:
                        if spec.persistent:
                            self.int_buffers.append(self.prefix + spec.target)
                        self.env[node.name] = data.detach().clone()
                elif kind == "CONSTANT_TENSOR":
                    self.env[node.name] = constants[spec.target].detach().clone()
                else:
                    raise TeenyError(f"from_torch: exported input {node.name} of kind {kind} is not supported")
            elif node.op == "get_attr":  # the body of a higher-order call (a `with` block)
                self.env[node.name] = getattr(self.ep.graph_module, node.target)
            elif node.op == "call_function":
                if node.name in self.fused:
                    continue
                region = self.regions.get(node.name)
                if region is not None and self._fuse(region):
                    continue
                self.env[node.name] = self._call(node)
            elif node.op == "output":
                outputs = pytree.tree_map(self._value, node.args[0])
                return self._user_outputs(outputs)
        raise TeenyError("from_torch: the exported graph has no output")

    def _fuse(self, region: _Region) -> bool:
        """Compute a fusable module call as its one teeny op; False (convert call by call) when
        the run does not have one activation input and one output."""
        inside = {n.name for n in region.nodes}
        inputs: list = []
        for n in region.nodes:
            for a in pytree.tree_leaves((n.args, n.kwargs)):
                if isinstance(a, torch.fx.Node) and a.name not in inside and a not in inputs:
                    inputs.append(a)
        leaving = [n for n in region.nodes if any(u.name not in inside for u in n.users)]
        params = [a for a in inputs if a.op == "placeholder" and self._is_state(a)]
        activations = [a for a in inputs if a not in params]
        if len(activations) != 1 or not isinstance(self.env.get(activations[0].name), Tensor):
            return False
        # x.to(x.dtype) inside the module is x itself, and the code after the module may read it
        passing = [n for n in leaving if _passes_through(n, activations[0])]
        leaving = [n for n in leaving if n not in passing]
        if len(leaving) != 1:
            return False
        env = _Env(self.graph, leaving[0])
        try:
            result = region.fuse(env, self.env[activations[0].name], [self.env[p.name] for p in params], region.module)
        except _Unsupported:
            return False
        if result.dtype != env.out_dtype():
            result = cast(result, env.out_dtype())
        self._check(leaving[0], result)
        self.env[leaving[0].name] = result
        for n in passing:
            self.env[n.name] = self.env[activations[0].name]
        self.fused.update(inside)
        return True

    def _is_state(self, node) -> bool:
        spec = next((s for s in self.ep.graph_signature.input_specs if s.arg.name == node.name), None)
        return spec is not None and spec.kind.name in ("PARAMETER", "BUFFER")

    def _parameter(self, name: str, value: torch.Tensor, parameter: bool, node) -> Tensor:
        """One teeny parameter per tensor: tied weights (two state_dict names, one tensor) share
        it, under the name the module's ``named_parameters`` gives. A parameter the graph never
        reads is non-trainable (no gradient reaches it, so an optimizer must leave it alone)."""
        key = _storage_key(value)
        existing = self.by_storage.get(key)
        if existing is not None:
            return existing
        data = value.detach().clone()
        used = len(node.users) > 0 or any(
            len(n.users) > 0 for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self._aliases(key)
        )
        trainable = parameter and value.requires_grad and data.is_floating_point() and used
        name = self.canonical.get(key, name)
        tensor = self.graph.parameter(
            self.prefix + name, tuple(data.shape), init=_copy_init(data), dtype=data.dtype, trainable=trainable
        )
        self.by_storage[key] = tensor
        return tensor

    def _aliases(self, key: tuple) -> set[str]:
        """Placeholder names whose state tensor is the one with storage ``key``."""
        names = set()
        for spec in self.ep.graph_signature.input_specs:
            if spec.kind.name in ("PARAMETER", "BUFFER") and spec.target in self.ep.state_dict:
                if _storage_key(self.ep.state_dict[spec.target]) == key:
                    names.add(spec.arg.name)
        return names

    def _value(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        return a

    def _user_outputs(self, outputs) -> list[Any]:
        specs = self.ep.graph_signature.output_specs
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        user = []
        for spec, value in zip(specs, flat):
            kind = spec.kind.name
            if kind in ("USER_OUTPUT", "LOSS_OUTPUT"):
                user.append(value)
            elif kind == "BUFFER_MUTATION" and spec.target.endswith("num_batches_tracked"):
                continue
            else:
                self.unsupported.append((kind.lower(), spec.target or "<root>", "the module writes its own state"))
        return user

    def _call(self, node) -> Any:
        target = node.target
        args = pytree.tree_map(self._value, node.args)
        kwargs = pytree.tree_map(self._value, dict(node.kwargs))
        if target is _SET_GRAD_ENABLED:  # with torch.no_grad() / torch.enable_grad(): ...
            enabled, body, *operands = args
            outputs = self._inline(body, operands)
            return outputs if enabled else [ops.stop_gradient(v) if isinstance(v, Tensor) else v for v in outputs]
        if target is _AUTOCAST:  # with torch.autocast(..., enabled=False): ... (HF's rotary embeddings)
            _device, dtype, enabled, _cache, body, *operands = args
            if enabled:
                self.unsupported.append(
                    ("torch.autocast", _where(node), f"an autocast region ({dtype}) inside the model: run it without")
                )
                return self._stand_in(node)
            return self._inline(body, operands)
        if target is operator.getitem:
            container, index = args
            return None if container is None else container[index]
        if not _is_teeny(list(args) + list(kwargs.values())):  # depends on no input: PyTorch computes it now
            if target is aten.add_.Tensor and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
                return args[0]  # num_batches_tracked += 1: the count stays with the torch module
            return _fold(target, args, kwargs)
        if target in _LIKE:  # new_ones(x, ...), zeros_like(x): only x's shape matters
            dummy = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, Tensor) else a for a in args]
            return _fold(target, dummy, kwargs)
        env = _Env(self.graph, node)
        fused = self._swiglu(node)
        if fused is not None:
            return fused
        converter = CONVERTERS.get(target)
        try:
            if converter is None:
                raise _Unsupported("teeny has no op for it")
            result = converter(env, *args, **kwargs)
        except _Unsupported as exc:
            self.unsupported.append((_op_name(target), _where(node), str(exc)))
            return self._stand_in(node)
        except (ValueError, TypeError, TeenyError) as exc:
            self.unsupported.append((_op_name(target), _where(node), f"{type(exc).__name__}: {exc}"))
            return self._stand_in(node)
        self._check(node, result)
        if getattr(target, "_schema", None) is not None and target._schema.is_mutable and node.args:
            first = node.args[0]
            if isinstance(first, torch.fx.Node) and isinstance(self.env.get(first.name), Tensor):
                self.env[first.name] = result  # x.add_(y): later readers of x see the new value
        return result

    def _inline(self, body: torch.fx.GraphModule, operands: list[Any]) -> list[Any]:
        """The values of a higher-order call's body graph, converted call by call in a scope of its
        own (its node names are its own), with ``operands`` bound to its placeholders."""
        outer, self.env = self.env, {}
        try:
            operand = iter(operands)
            for node in body.graph.nodes:
                if node.op == "placeholder":
                    self.env[node.name] = next(operand)
                elif node.op == "get_attr":
                    self.env[node.name] = getattr(body, node.target)
                elif node.op == "call_function":
                    self.env[node.name] = self._call(node)
                elif node.op == "output":
                    return list(pytree.tree_map(self._value, node.args[0]))
        finally:
            self.env = outer
        raise TeenyError("from_torch: the body of a higher-order call has no output")

    def _swiglu(self, node) -> Tensor | None:
        """silu(gate) * up (a Llama MLP) as one swiglu pair; the silu node is left unread, and
        lowering drops it."""
        if node.target is not aten.mul.Tensor or len(node.args) != 2:
            return None
        for gate_node, up_node in (node.args, node.args[::-1]):
            if (
                isinstance(gate_node, torch.fx.Node)
                and gate_node.target is aten.silu.default
                and len(gate_node.users) == 1
                and isinstance(up_node, torch.fx.Node)
            ):
                gate, up = self.env.get(gate_node.args[0].name), self.env.get(up_node.name)
                if (
                    isinstance(gate, Tensor)
                    and isinstance(up, Tensor)
                    and gate.shape == up.shape == node.meta["val"].shape
                ):
                    if gate.dtype == up.dtype == node.meta["val"].dtype:
                        return ops.swiglu(gate, up)
        return None

    def _check(self, node, result) -> None:
        val = node.meta.get("val")
        if isinstance(result, Tensor) and isinstance(val, torch.Tensor):
            if tuple(result.shape) != tuple(val.shape) or result.dtype != val.dtype:
                raise TeenyError(
                    f"from_torch: {_op_name(node.target)} at {_where(node)} became a teeny tensor of shape "
                    f"{tuple(result.shape)} {result.dtype}, but PyTorch computes {tuple(val.shape)} {val.dtype}"
                )

    def _stand_in(self, node) -> Any:
        """A placeholder with the node's shape, so that the walk goes on and finds every unsupported call."""

        def make(val):
            if isinstance(val, torch.Tensor):
                name = f"__unsupported_{len(self.graph.values)}"
                return self.graph.input(name, tuple(val.shape), val.dtype)
            return val

        return pytree.tree_map(make, node.meta.get("val"))


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def _fold(target, args, kwargs):
    with torch.no_grad():
        return target(*args, **kwargs)


def _copy_init(data: torch.Tensor):
    def init(shape, generator, dtype):
        return data.to(dtype).clone()

    return init


class _Loss(nn.Module):
    """``loss(output, *targets)`` as a module, for export (its state is prefixed ``loss.``)."""

    def __init__(self, loss: Callable, out_spec):
        super().__init__()
        self.loss_fn = loss
        self.out_spec = out_spec

    def forward(self, *flat):
        n = self.out_spec.num_leaves
        output = pytree.tree_unflatten(list(flat[:n]), self.out_spec)
        return self.loss_fn(output, *flat[n:])


def _example(val: torch.Tensor) -> torch.Tensor:
    if val.is_floating_point():
        return torch.randn(tuple(val.shape), dtype=val.dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(tuple(val.shape), dtype=val.dtype)


def from_torch(
    module: nn.Module,
    example_inputs: Any,
    loss: Callable | None = None,
    targets: Sequence[torch.Tensor] = (),
    name: str | None = None,
) -> Graph:
    """A teeny ``Graph`` computing ``module`` (see the module docstring).

    ``example_inputs``: a tensor, a tuple of positional arguments, or a dict of keyword
    arguments, with the shapes the graph is built for (shapes are static). Without ``loss``
    the graph's outputs are the module's (flattened; the first is the loss in training, as
    for a Hugging Face model called with ``labels=``). With ``loss``, a callable
    ``loss(output, *targets)`` (``torch.nn.CrossEntropyLoss()``, a function of ``F`` calls),
    the graph's first output is that loss and ``targets`` gives example targets (graph
    inputs ``target``, ``target1``, ...); the module's outputs follow. Raises
    ``UnsupportedError`` listing every call teeny has no op for.
    """
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        args, kwargs = tuple(example_inputs), {}
    ep = torch.export.export(module, args, kwargs)
    graph = Graph(name or type(module).__name__)
    canonical = {}
    for key, t in [*module.named_parameters(), *module.named_buffers()]:  # first names of tied tensors win
        canonical.setdefault(_storage_key(t), key)
    main = _Import(graph, ep, canonical=canonical, root=module)
    outputs = main.run()
    unsupported = list(main.unsupported)
    if loss is not None:
        out_node = next(n for n in ep.graph.nodes if n.op == "output")
        user_vals = [
            a.meta["val"]
            for a, spec in zip(out_node.args[0], ep.graph_signature.output_specs)
            if spec.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT")
        ]
        wrapper = _Loss(loss, ep.call_spec.out_spec)
        loss_ep = torch.export.export(wrapper, (*[_example(v) for v in user_vals], *targets))
        names = [f"__output{i}" for i in range(len(user_vals))] + [
            "target" if i == 0 else f"target{i}" for i in range(len(targets))
        ]
        loss_import = _Import(graph, loss_ep, prefix="loss.", bound=outputs, input_names=names, root=wrapper)
        loss_outputs = loss_import.run()
        unsupported += loss_import.unsupported
        outputs = loss_outputs + outputs
    if unsupported:
        raise UnsupportedError(unsupported)
    tensors = [o for o in outputs if isinstance(o, Tensor)]
    if not tensors:
        raise TeenyError("from_torch: the module returns no tensor computed from its inputs or parameters")
    graph.output(*tensors)
    return graph


# ----------------------------------------------------------------------------- the way back


def to_torch(source: Any, module: nn.Module, strict: bool = True) -> nn.Module:
    """Load teeny's parameters into ``module`` with ``load_state_dict(strict=strict)``.

    ``source``: an ``Executor``, a dict of tensors (``executor.state_dict()``), or the path of
    a checkpoint written by ``teeny train``. Tied weights (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) are filled from the one teeny trained; integer buffers
    (``num_batches_tracked``) and anything else teeny does not hold keep the module's value.
    Returns ``module``."""
    if isinstance(source, (str, os.PathLike)):
        from ..train import load_checkpoint

        params, _, _ = load_checkpoint(source)
    elif hasattr(source, "params") and hasattr(source, "program"):
        params = source.params
    else:
        params = dict(source)
    own = module.state_dict(keep_vars=True)
    by_storage: dict[tuple, str] = {}
    for key, t in own.items():
        if key in params and isinstance(t, torch.Tensor) and t.numel():
            by_storage[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = key
    full = {}
    for key, t in own.items():
        if key in params:
            full[key] = params[key]
            continue
        tied = (
            by_storage.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))) if t.numel() else None
        )
        full[key] = params[tied] if tied is not None else t.detach()
    unknown = sorted(k for k in params if k not in own and not k.startswith("loss."))
    if strict and unknown:
        raise KeyError(f"to_torch: teeny parameters {unknown} are not in the module's state_dict")
    module.load_state_dict({k: v.detach().to(own[k].device) for k, v in full.items()}, strict=strict)
    return module


__all__ = ["from_torch", "to_torch", "UnsupportedError", "CONVERTERS"]
