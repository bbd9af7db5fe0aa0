"""teeny ops inside PyTorch: torch tensors in and out, gradients through torch.autograd.

    y = teeny.interop.torch.apply(teeny.ops.gelu, x)      # x: a torch tensor
    y.sum().backward()                                     # runs teeny's backward kernels

``apply`` traces the function once per combination of shapes, dtypes and ``requires_grad``
flags, lowers it (for training when any input needs a gradient), and caches the executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..executor import Executor
from ..graph import trace_function
from ..lowering import LoweringMode, lower

_CACHE: dict[Any, tuple[Executor, list[str]]] = {}


def _signature(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype, a.requires_grad and a.is_floating_point())
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_signature(b) for b in a))
    if isinstance(a, dict):
        return tuple(sorted((k, _signature(v)) for k, v in a.items()))
    return repr(a)


def _tensors(a: Any) -> list[torch.Tensor]:
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for b in a for t in _tensors(b)]
    return []


def _executor(fn: Callable, args: tuple, kwargs: dict) -> tuple[Executor, list[str]]:
    key = (fn, _signature(args), _signature(kwargs))
    hit = _CACHE.get(key)
    if hit is None:
        flat = _tensors(args) + _tensors(list(kwargs.values()))
        graph, feed = trace_function(fn, args, kwargs, requires_grad=lambda i, t: flat[i].requires_grad)
        training = any(v.requires_grad for v in graph.inputs)
        program = lower(graph, LoweringMode.TRAINING if training else LoweringMode.INFERENCE)
        hit = (Executor(program), list(feed))
        _CACHE[key] = hit
    return hit


class _TeenyFunction(torch.autograd.Function):
    """Tensors on another device than teeny's (CPU tensors with a GPU executor) are moved
    there and the results moved back, so the caller sees its own device."""

    @staticmethod
    def forward(ctx, executor: Executor, names: list[str], *tensors: torch.Tensor):
        feed = {name: t.detach() for name, t in zip(names, tensors)}
        out, cache = executor.forward_train(feed)
        ctx.executor, ctx.cache, ctx.names = executor, cache, names
        ctx.devices = [t.device for t in tensors]
        return out.to(tensors[0].device) if tensors else out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = ctx.executor.backward(ctx.cache, grad_output.to(ctx.executor.device))
        moved = [None if grads.get(n) is None else grads[n].to(d) for n, d in zip(ctx.names, ctx.devices)]
        return (None, None, *moved)


def apply(fn: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run ``fn`` (a function of teeny symbolic tensors) on torch tensors, differentiably."""
    executor, names = _executor(fn, args, kwargs)
    flat = _tensors(args) + _tensors(list(kwargs.values()))
    if not executor.training:
        out = executor.forward(dict(zip(names, flat)))
        return out.to(flat[0].device) if flat else out
    return _TeenyFunction.apply(executor, names, *flat)


def clear_cache() -> None:
    _CACHE.clear()
