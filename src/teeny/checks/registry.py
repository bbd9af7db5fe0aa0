"""The op registry: every functional op with its PyTorch reference and test samples.

An ``OpInfo`` names an op, the ``teeny.ops`` function, the equivalent PyTorch function, and
small sample inputs on odd shapes. ``teeny ops`` lists the registry, ``teeny gradcheck``
checks every sample in float64, and the test suite compares each op with PyTorch autograd in
every dtype it supports, with the tolerance rule of ``tolerance()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """Arguments for one call: torch tensors (graph inputs) and plain values (passed as-is)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""
    grad: tuple[int, ...] | None = None  # indices of tensor args to differentiate (None: every float one)
    reduction: int = 1  # length of the longest reduction in the op, for the tolerance rule

    def tensors(self) -> list[torch.Tensor]:
        """The tensors among the arguments (nested lists too), in the order gradcheck numbers them."""
        return flat_tensors(list(self.args) + list(self.kwargs.values()))

    def wants_grad(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether tensor number ``index`` is differentiated in checks."""
        return tensor.is_floating_point() and (self.grad is None or index in self.grad)

    def has_gradient_to_check(self) -> bool:
        return any(self.wants_grad(i, t) and t.numel() for i, t in enumerate(self.tensors()))


def flat_tensors(args) -> list[torch.Tensor]:
    """The tensors among ``args``, in nested lists and tuples too, in order."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(flat_tensors(a))
    return out


@dataclass
class OpInfo:
    """An op's name, its ``teeny.ops`` function, the PyTorch function with the same arguments,
    and small odd-shaped samples. Its kernels, dtypes and whether it has a backward are not
    stated here: ``teeny.checks.facts.op_facts(info)`` computes them by lowering the samples."""

    name: str
    op: Callable  # the teeny.ops function (takes symbolic tensors)
    ref: Callable  # the PyTorch function with the same arguments
    samples: Callable[[torch.dtype, torch.Generator], list[Sample]]
    family: str = ""
    gradcheck_samples: Callable[[torch.Generator], list[Sample]] | None = None  # float64; default: samples
    atol: dict = field(default_factory=dict)  # dtype -> extra absolute tolerance factor
    output_dtype: Callable[[torch.dtype], torch.dtype] | None = None  # None: the output has the input's dtype
    notes: str = ""

    def gradcheck_inputs(self, gen: torch.Generator) -> list[Sample]:
        if self.gradcheck_samples is not None:
            return self.gradcheck_samples(gen)
        return self.samples(torch.float64, gen)


OPS: dict[str, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    if info.name in OPS:
        raise ValueError(f"op {info.name!r} is registered twice")
    OPS[info.name] = info
    return info


# The tolerance rule, stated once: elementwise error is a few units of the dtype's rounding,
# and a reduction over K terms adds error that grows like sqrt(K).
_BASE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tolerance(dtype: torch.dtype, reduction: int = 1, *more: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing an op in ``dtype`` (and the coarsest of ``more``, e.g. an
    output dtype) with a float32/float64 reference, where the op reduces over ``reduction`` terms."""
    base = max(_BASE.get(d, 0.0) for d in (dtype, *more))
    scale = base * max(1.0, math.sqrt(reduction))
    return scale, scale


def make(
    gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, low: float = -2.0, high: float = 2.0
) -> torch.Tensor:
    """A random sample tensor, uniform in [low, high)."""
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low).to(dtype)


def away_from(t: torch.Tensor, points: tuple[float, ...], gap: float = 1e-2) -> torch.Tensor:
    """Push values away from kinks (e.g. relu at 0) so finite differences stay meaningful."""
    for p in points:
        close = (t - p).abs() < gap
        t = torch.where(close, torch.where(t >= p, t + 2 * gap, t - 2 * gap), t)
    return t
