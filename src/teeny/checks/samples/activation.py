"""Test samples of the activation family (``teeny.ops.activation``). The element-wise activations'
come from their declarations (``ACTIVATIONS``: domain, kinks, keyword sets; each variant, such as
``gelu_tanh``, registered under its kernel's name); PReLU, GLU, SwiGLU and GeGLU have their own."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import activation
from ...ops.activation import ACTIVATIONS, Activation, geglu, glu, prelu, swiglu
from ..registry import OpInfo, Sample, away_from, make, register

__all__ = ["SHAPES", "cases"]

SHAPES = [(3, 37), (129, 7), (1,), (0, 5)]
GRADCHECK_SHAPES = [(2, 9), (1,)]


def cases() -> list[tuple[Activation, dict]]:
    """Every (declaration, keyword arguments) the tests run: each declared keyword set, each variant."""
    return [(d, kwargs) for d in ACTIVATIONS for kwargs in (*d.samples, *d.variant_kwargs().values())]


def _samples(declaration: Activation, kwargs: tuple[dict, ...], shapes):
    """Samples on ``shapes``, values in the declared domain pushed away from its kinks; the i-th
    shape gets the i-th keyword set (cyclically)."""
    low, high = declaration.domain

    def samples(dtype, gen):
        return [
            Sample(
                (away_from(make(gen, *s, low=low, high=high), declaration.kinks).to(dtype),),
                dict(kwargs[i % len(kwargs)]),
                name=f"{s} {kwargs[i % len(kwargs)]}",
            )
            for i, s in enumerate(shapes)
        ]

    return samples


def _register(name: str, declaration: Activation, op, ref, kwargs: tuple[dict, ...]) -> None:
    register(
        OpInfo(
            name,
            op,
            ref,
            _samples(declaration, kwargs, SHAPES),
            family="activation",
            gradcheck_samples=lambda gen: _samples(declaration, kwargs, GRADCHECK_SHAPES)(torch.float64, gen),
        )
    )


def _variant(function, kwargs: dict):
    """``function`` with the keyword arguments that choose a variant fixed (and no others)."""
    return lambda x: function(x, **kwargs)


def register_activation(declaration: Activation, op) -> None:
    """Register ``op`` (``define(declaration, ...)``) and each of its variants with samples drawn
    from the declaration: from then on the generic tests check it like a built-in activation."""
    _register(declaration.name, declaration, op, declaration.ref, declaration.samples)
    for name, kwargs in declaration.variant_kwargs().items():
        _register(name, declaration, _variant(op, kwargs), _variant(declaration.ref, kwargs), ({},))


for _declaration in ACTIVATIONS:
    register_activation(_declaration, getattr(activation, _declaration.name))


def _prelu_samples(shapes):
    def samples(dtype, gen):
        out = []
        for x_shape, w_shape in shapes:
            x = away_from(make(gen, *x_shape), (0.0,)).to(dtype)
            w = make(gen, *w_shape, low=-0.5, high=0.5).to(dtype)
            channels = w.numel() if w.numel() > 1 else 1
            out.append(Sample((x, w), name=f"x{x_shape} w{w_shape}", reduction=max(1, x.numel() // max(channels, 1))))
        return out

    return samples


register(
    OpInfo(
        "prelu",
        prelu,
        F.prelu,
        _prelu_samples(
            [((3, 5, 7), (5,)), ((37, 3), (1,)), ((4, 3), (3,)), ((6,), (1,)), ((0, 3), (3,)), ((), (1,)), ((2, 3), ())]
        ),
        family="activation",
        gradcheck_samples=lambda gen: _prelu_samples([((2, 3, 3), (3,)), ((5,), (1,))])(torch.float64, gen),
    )
)


def _glu_samples(cases):
    def samples(dtype, gen):
        return [Sample((make(gen, *s).to(dtype),), {"dim": d}, name=f"{s} dim={d}") for s, d in cases]

    return samples


register(
    OpInfo(
        "glu",
        glu,
        F.glu,
        _glu_samples([((3, 38), -1), ((4, 6, 5), 1), ((6,), 0), ((2, 0, 4), 2)]),
        family="activation",
        gradcheck_samples=lambda gen: _glu_samples([((3, 4), -1), ((2, 4, 3), 1)])(torch.float64, gen),
    )
)


def _gated_samples(shapes, kwargs: tuple[dict, ...] = ({},)):
    """(gate, up) on ``shapes``, the i-th shape with the i-th keyword set (cyclically)."""

    def samples(dtype, gen):
        return [
            Sample(
                (make(gen, *s, low=-6, high=6).to(dtype), make(gen, *s).to(dtype)),
                dict(kwargs[i % len(kwargs)]),
                name=f"{s} {kwargs[i % len(kwargs)]}",
            )
            for i, s in enumerate(shapes)
        ]

    return samples


register(
    OpInfo(
        "swiglu",
        swiglu,
        lambda gate, up: F.silu(gate) * up,
        _gated_samples(SHAPES),
        family="activation",
        gradcheck_samples=lambda gen: _gated_samples(GRADCHECK_SHAPES)(torch.float64, gen),
    )
)


def _geglu(gate, up, approximate="tanh"):
    return F.gelu(gate, approximate=approximate) * up


_GEGLU_KWARGS = ({}, {"approximate": "none"})
register(
    OpInfo(
        "geglu",
        geglu,
        _geglu,
        _gated_samples(SHAPES, _GEGLU_KWARGS),
        family="activation",
        gradcheck_samples=lambda gen: _gated_samples(GRADCHECK_SHAPES, _GEGLU_KWARGS)(torch.float64, gen),
    )
)
