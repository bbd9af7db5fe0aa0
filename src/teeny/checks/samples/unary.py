"""Test samples of the unary maths (``teeny.ops.unary``), from their declarations (``UNARY``):
values in each op's domain, pushed away from its kinks."""

from __future__ import annotations

import torch

from ...ops import unary
from ...ops.activation.declarations import Activation
from ...ops.unary import UNARY
from ..registry import OpInfo, Sample, away_from, make, register

SHAPES = ((3, 37), (129, 7), (1,), (0, 5))
GRADCHECK_SHAPES = ((3, 7), (1,))


def _samples(declaration: Activation, shapes):
    low, high = declaration.domain

    def samples(dtype, gen):
        return [
            Sample((away_from(make(gen, *s, low=low, high=high), declaration.kinks).to(dtype),), name=str(s))
            for s in shapes
        ]

    return samples


for _declaration in UNARY:
    register(
        OpInfo(
            _declaration.name,
            getattr(unary, _declaration.name),
            _declaration.ref,
            _samples(_declaration, SHAPES),
            family="unary",
            gradcheck_samples=lambda gen, d=_declaration: _samples(d, GRADCHECK_SHAPES)(torch.float64, gen),
        )
    )
