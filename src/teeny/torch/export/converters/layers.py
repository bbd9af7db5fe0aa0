"""Converters of the ATen layers: products, embedding, the norms, dropout, attention (a folded
mask that is exactly causal becomes ``is_causal=True``), convolution and pooling."""

from __future__ import annotations

from typing import Any

import torch

from .... import ops
from .base import aten, converts, is_teeny, refuse

# -------------------------------------------------------------------------- layers


@converts(aten.linear.default)
def _linear(env, x, weight, bias=None):
    dtype = env.out_dtype()
    return ops.linear(
        env.tensor(x, dtype), env.tensor(weight, dtype), None if bias is None else env.tensor(bias, dtype)
    )


@converts(aten.addmm.default)
def _addmm(env, bias, a, b, beta=1, alpha=1):
    refuse(beta != 1 or alpha != 1, "addmm with beta/alpha")
    dtype = env.out_dtype()
    return ops.add(ops.matmul(env.tensor(a, dtype), env.tensor(b, dtype)), env.tensor(bias, dtype))


@converts(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(env, a, b):
    dtype = env.out_dtype()
    return ops.matmul(env.tensor(a, dtype), env.tensor(b, dtype))


@converts(aten.embedding.default)
def _embedding(env, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    refuse(scale_grad_by_freq or sparse, "embedding with scale_grad_by_freq or sparse")
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
        refuse(
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
    refuse(dropout_p != 0.0, f"attention dropout (dropout_p={dropout_p}): teeny's attention has none")
    refuse(
        is_teeny(attn_mask) and env.tensor(attn_mask).dtype != torch.bool,
        "a float attention mask computed from the inputs (teeny's masks carry no gradient)",
    )
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
    causal = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril()
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
    refuse(transposed, "transposed convolution")
    refuse(len(weight.shape) != 4, f"a {len(weight.shape) - 2}-d convolution (teeny has conv2d)")
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
    refuse(h % oh or w % ow, f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (not a whole number of windows)")
    return ops.avg_pool2d(x, (h // oh, w // ow), (h // oh, w // ow))
