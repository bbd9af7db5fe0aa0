"""Runs of ATen calls that one teeny op computes, recognised by their shape in the exported graph
(whatever module makes them): ``silu(gate) * up`` (``swiglu``), ``gelu(gate) * up``
(``geglu``), and transformers' ``apply_rotary_pos_emb``, ``x * cos + rotate_half(x) * sin``
(``rotary_embedding``), with GPT-NeoX's and Phi's partial rotary,
``cat([rotary(x[..., :r]), x[..., r:]], -1)``.

``match(node)`` reads only the FX graph: it names the teeny op that computes ``node`` and the
nodes whose values it takes, or None. The importer applies the op to its values and keeps the
result only where it has the node's shape and dtype (else it converts the calls one by one). The
calls inside the run are converted as the walk meets them, since something else may read them;
lowering drops those nothing reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .... import ops

aten = torch.ops.aten


@dataclass
class Match:
    """``fn(*values of inputs, **kwargs)`` computes the matched node."""

    fn: Callable
    inputs: tuple[Node, ...]
    kwargs: dict = field(default_factory=dict)
    promote: bool = False  # the run's calls cast their inputs to its output's dtype exactly: the op may too
    no_gradient: tuple[int, ...] = ()  # inputs the op gives no gradient (refused where one may be wanted)

    @property
    def name(self) -> str:
        return self.fn.__name__


def match(node: Node) -> Match | None:
    """The teeny op that computes ``node`` from the start of the run of calls it ends, or None."""
    for pattern in (_gated, _rotary, _partial_rotary):
        found = pattern(node)
        if found is not None:
            return found
    return None


# ----------------------------------------------------------------------------- gated activations

# the gate's activation -> the gated op and its keyword arguments, from the activation's call
_GATED = {
    aten.silu.default: (ops.swiglu, lambda act: {}),
    aten.gelu.default: (ops.geglu, lambda act: {"approximate": act.kwargs.get("approximate", "none")}),
}


def _gated(node: Node) -> Match | None:
    """act(gate) * up (a Llama or Gemma MLP), the activation read by the product alone."""
    for act, up in _operands(node, aten.mul.Tensor):
        if isinstance(act, Node) and act.target in _GATED and len(act.users) == 1 and isinstance(up, Node):
            fn, kwargs = _GATED[act.target]
            return Match(fn, (act.args[0], up), kwargs(act))
    return None


# ----------------------------------------------------------------------------- rotary embedding


def _rotary(node: Node) -> Match | None:
    """x * unsqueeze(cos, 1) + rotate_half(x) * unsqueeze(sin, 1), each product either way round."""
    for plain, rotated in _operands(node, aten.add.Tensor):
        for half, sin in _operands(rotated, aten.mul.Tensor):
            x = _rotate_half_of(half)
            cos = next((c for y, c in _operands(plain, aten.mul.Tensor) if y is x), None)
            if x is not None and _unsqueezed(cos) and _unsqueezed(sin):
                return Match(ops.rotary_embedding, (x, cos.args[0], sin.args[0]), promote=True, no_gradient=(1, 2))
    return None


def _partial_rotary(node: Node) -> Match | None:
    """cat([rotary(x[..., :r]), x[..., r:]], -1): the columns past the rotary dim pass through."""
    if not _is_call(node, aten.cat.default) or len(node.args) != 2 or not _is_last_dim(node, node.args[1]):
        return None
    parts = node.args[0]
    if len(parts) != 2 or not isinstance(parts[0], Node):
        return None
    inner, rest = _rotary(parts[0]), _last_dim_slice(parts[1])
    head = None if inner is None else _last_dim_slice(inner.inputs[0])
    if head is None or rest is None:
        return None
    (x, start, stop), (y, rest_start, rest_stop) = head, rest
    if x is not y or start != 0 or rest_start != stop or rest_stop != _last_size(x):
        return None
    return Match(ops.rotary_embedding, (x, *inner.inputs[1:]), promote=True, no_gradient=(1, 2))


def _rotate_half_of(node) -> Node | None:
    """x where ``node`` is cat([-x[..., h:], x[..., :h]], -1) with h half x's last dim."""
    if not _is_call(node, aten.cat.default) or len(node.args) != 2 or not _is_last_dim(node, node.args[1]):
        return None
    parts = node.args[0]
    if len(parts) != 2 or not _is_call(parts[0], aten.neg.default):
        return None
    high, low = _last_dim_slice(parts[0].args[0]), _last_dim_slice(parts[1])
    if high is None or low is None or high[0] is not low[0]:
        return None
    x, size = high[0], _last_size(high[0])
    return x if size % 2 == 0 and high[1:] == (size // 2, size) and low[1:] == (0, size // 2) else None


def _unsqueezed(node) -> bool:
    """Whether ``node`` is t.unsqueeze(1) (cos and sin of shape (batch, seq, dim), made to broadcast
    over the heads)."""
    return _is_call(node, aten.unsqueeze.default) and _ndim(node) == 4 and node.args[1] % 4 == 1


def _last_dim_slice(node) -> tuple[Node, int, int] | None:
    """(x, start, stop) where ``node`` is x[..., start:stop], the bounds within x's size."""
    if not _is_call(node, aten.slice.Tensor) or node.kwargs:
        return None
    x, dim, start, stop, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1 :])
    if step != 1 or not _is_last_dim(x, dim):
        return None
    size = _last_size(x)
    start, stop = (0 if start is None else start), (size if stop is None else stop)
    start, stop = (b + size if b < 0 else b for b in (start, stop))
    return x, min(max(start, 0), size), min(max(stop, 0), size)


# ----------------------------------------------------------------------------- the graph


def _is_call(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _operands(node, target) -> list[tuple]:
    """(a, b) and (b, a) where ``node`` is target(a, b) with no other argument, else none."""
    if not _is_call(node, target) or len(node.args) != 2 or node.kwargs:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _ndim(node) -> int:
    val = _val(node)
    return -1 if val is None else val.dim()


def _last_size(node) -> int:
    return _val(node).shape[-1]


def _is_last_dim(node, dim) -> bool:
    """Whether ``dim`` is the last dim of ``node``'s value."""
    ndim = _ndim(node)
    return isinstance(dim, int) and ndim > 0 and dim in (-1, ndim - 1)
