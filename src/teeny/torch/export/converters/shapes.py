"""Converters of the ATen views, copies between shapes and reductions (softmax included)."""

from __future__ import annotations

import torch

from .... import ops
from .base import aten, converts, refuse

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


@converts(aten.repeat_interleave.self_int)
def _repeat_interleave(env, x, repeats, dim=None, output_size=None):
    """Each element ``repeats`` times in a row along ``dim`` (flattened first when None): a new
    axis after ``dim`` broadcast to ``repeats``, merged into ``dim``."""
    x = env.tensor(x)
    if dim is None:
        x, dim = ops.reshape(x, (x.numel(),)), 0
    d = dim % len(x.shape)
    shape = list(x.shape)
    shape.insert(d + 1, repeats)
    return ops.reshape(ops.expand(ops.unsqueeze(x, d + 1), tuple(shape)), tuple(env.val.shape))


@converts(aten.repeat.default)
def _repeat(env, x, repeats):
    """The tensor tiled ``repeats[i]`` times along each dim (leading dims of size 1 added): a
    new axis before each dim broadcast to its count, merged into it."""
    x = env.tensor(x)
    x = ops.reshape(x, (1,) * (len(repeats) - len(x.shape)) + tuple(x.shape))
    interleaved = tuple(s for pair in zip((1,) * len(repeats), x.shape) for s in pair)
    tiled = tuple(s for pair in zip(repeats, x.shape) for s in pair)
    return ops.reshape(ops.expand(ops.reshape(x, interleaved), tiled), tuple(env.val.shape))


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
    refuse(mode != "constant", f"pad with mode={mode!r}")
    x = env.tensor(x)
    fill = 0 if value is None else value
    for i in range(len(pad) // 2):
        dim = len(x.shape) - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        refuse(before < 0 or after < 0, "pad with negative sizes (cropping)")
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
    refuse(dtype is not None and dtype != env.tensor(x).dtype, "sum with another dtype=")
    return ops.sum(env.tensor(x), _dims(dim), keepdim)


@converts(aten.mean.dim, aten.mean.default)
def _mean(env, x, dim=None, keepdim=False, dtype=None):
    refuse(dtype is not None and dtype != env.tensor(x).dtype, "mean with another dtype=")
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
    refuse(isinstance(half_to_float, torch.dtype) and half_to_float != env.out_dtype(), "softmax with dtype=")
    return ops.softmax(env.tensor(x, env.out_dtype()), dim)


@converts(aten._log_softmax.default, aten.log_softmax.int)
def _log_softmax(env, x, dim, half_to_float=None):
    return ops.log_softmax(env.tensor(x, env.out_dtype()), dim)
