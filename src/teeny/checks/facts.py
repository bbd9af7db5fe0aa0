"""What each registered op is, computed from the op itself rather than stated.

``op_facts(info)`` lowers every float32 sample of an ``OpInfo`` (for training where a gradient
is wanted) and collects the kernels its launches use, the dtypes those kernels all dispatch to,
and whether gradients flow through it. ``teeny ops`` prints these facts and the test suite
reads the dtypes from them. The registry itself sits below the op families (they register
into it), so the lowering is called from here, one level above both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import MissingBackwardError, NoGradientError
from ..core.graph import trace_function
from ..core.kernel import ANY_DTYPES, Kernel
from ..program.accumulate import accumulate_kernel
from ..program.lowering import LoweringMode, lower
from .registry import OPS, OpInfo


@dataclass(frozen=True)
class OpFacts:
    """The kernels an op's samples launch (forward and backward), the dtypes those kernels all
    dispatch to, and whether gradients flow through the op."""

    kernels: tuple[Kernel, ...]
    dtypes: tuple[torch.dtype, ...]
    has_backward: bool


def op_facts(info: OpInfo | str) -> OpFacts:
    """The facts of a registered op, by ``OpInfo`` or by name (computed once per op)."""
    info = OPS[info] if isinstance(info, str) else info
    if info.name not in _FACTS:
        _FACTS[info.name] = _facts_of(info)
    return _FACTS[info.name]


_FACTS: dict[str, OpFacts] = {}


def _facts_of(info: OpInfo) -> OpFacts:
    kernels: dict[int, Kernel] = {}
    has_backward = False
    for sample in info.samples(torch.float32, torch.Generator().manual_seed(0)):
        graph, _ = trace_function(info.op, sample.args, sample.kwargs, requires_grad=sample.wants_grad)
        try:
            program = lower(graph, LoweringMode.TRAINING)
            has_backward = has_backward or any(p.needs_backward for p in program.nodes)
        except (NoGradientError, MissingBackwardError):  # nothing to differentiate, or an op without a backward
            program = lower(graph, LoweringMode.INFERENCE)
        kernels.update(
            (id(i.kernel), i.kernel) for i in program.instances.values() if i.kernel is not accumulate_kernel
        )
    found = tuple(kernels.values())
    dtypes = tuple(d for d in ANY_DTYPES if all(d in k.dtypes for k in found))
    return OpFacts(found, dtypes, has_backward)
