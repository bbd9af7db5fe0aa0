"""What every ATen converter shares: the table ``CONVERTERS`` (ATen overload -> converter) and
the ``@converts`` decorator that fills it, the ``Env`` a converter is called with (the graph and
the FX node being converted), and ``refuse``, a converter's way of saying why a call cannot be
imported (``from_torch`` collects the reasons into one ``UnsupportedError``).

A converter is ``convert(env, *args, **kwargs)``: the ATen call's arguments, with teeny tensors
where the call reads a graph value; it returns the teeny value (or a tuple, for ATen ops with
several outputs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ....core.graph import Graph, Tensor
from ....ops.cast import to as cast

aten = torch.ops.aten


class Refused(Exception):
    """A converter's refusal; the message says why."""


def refuse(condition: bool, why: str) -> None:
    if condition:
        raise Refused(why)


@dataclass
class Env:
    """What a converter is called with: the graph being built and the FX node being converted."""

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


def is_teeny(v: Any) -> bool:
    """Whether ``v`` is (or holds) a teeny tensor: a value computed from the graph's inputs."""
    if isinstance(v, Tensor):
        return True
    if isinstance(v, (list, tuple)):
        return any(is_teeny(b) for b in v)
    return False


CONVERTERS: dict[Any, Callable] = {}


def converts(*targets):
    """Register the decorated function as the converter of each ATen overload in ``targets``."""

    def register(fn):
        for t in targets:
            CONVERTERS[t] = fn
        return fn

    return register
