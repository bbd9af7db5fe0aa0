"""Test samples of the element-wise ops (``teeny.ops.elementwise``): broadcast pairs of odd
shapes, a Python number on either side, ties for maximum/minimum, jumps for the rounded
divisions, and tensor bounds (float and integer) for clamp."""

import functools
import math

import torch

from ...ops import add, clamp, div, maximum, minimum, mul, pow, sub, where
from ...ops.elementwise import broadcast_shapes
from ..registry import OpInfo, Sample, away_from, make, register

Shape = tuple[int, ...]


# Python-number operands are non-dyadic (0.3, -0.7, ...): a float64 kernel that received them
# as float32 would be off by 1e-8, which only such numbers show.

_BROADCASTS = [((3, 37), (37,)), ((5, 1, 7), (1, 4, 7)), ((1,), (129, 7)), ((0, 5), (5,)), ((13, 1), (13, 1))]
_TINY_BROADCASTS = [((3, 4), (4,)), ((2, 1, 3), (1, 2, 3)), ((1,), (2, 3))]


def _reduction(a: Shape, b: Shape) -> int:
    out = math.prod(broadcast_shapes([a, b], "samples"))
    return max(1, out // max(1, math.prod(a)), out // max(1, math.prod(b)))


def _binary_samples(
    shapes,
    x_range=(-2.0, 2.0),
    y_range=(-2.0, 2.0),
    y_sign=False,
    scalars=(0.3, -0.7),
    ties=False,
    scalar_shape=(3, 7),
    jumps=False,
):
    """Broadcast pairs, then a tensor with a number on either side. ``jumps``: the op jumps (a
    rounded quotient), so below float64 the numbers are exact in the dtype (2.5, -1.5): the
    rounding of 0.3 to float32 moves a jump, which a float64 reference cannot follow."""

    def samples(dtype, gen):
        numbers = (2.5, -1.5) if jumps and dtype != torch.float64 else scalars
        out = []
        for sa, sb in shapes:
            x = make(gen, *sa, low=x_range[0], high=x_range[1])
            y = make(gen, *sb, low=y_range[0], high=y_range[1])
            if y_sign:
                y = y * (torch.randint(0, 2, sb, generator=gen) * 2 - 1)
            if ties:  # multiples of 0.5: many exact ties, other pairs far apart
                x, y = (x * 2).round() / 2, (y * 2).round() / 2
            out.append(Sample((x.to(dtype), y.to(dtype)), name=f"{sa}x{sb}", reduction=_reduction(sa, sb)))
        if scalars:
            t = make(gen, *scalar_shape, low=x_range[0], high=x_range[1]).to(dtype)
            s = make(gen, *scalar_shape, low=y_range[0], high=y_range[1]).to(dtype)
            if y_sign:
                s = s * (torch.randint(0, 2, scalar_shape, generator=gen) * 2 - 1).to(dtype)
            out.append(Sample((t, numbers[0]), name="tensor,number"))
            out.append(Sample((numbers[1], s), name="number,tensor"))
        return out

    return samples


def _gradcheck(sampler):
    return lambda gen: sampler(torch.float64, gen)


def _torch_binary(fn):
    """``fn`` of two operands either of which may be a Python number (as teeny's ops take them)."""

    def ref(a, b, *args, **kwargs):
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a, dtype=b.dtype)
        if not isinstance(b, torch.Tensor):
            b = torch.tensor(b, dtype=a.dtype)
        return fn(a, b, *args, **kwargs)

    return ref


def _register_binary(name, fn, ref, **ranges):
    register(
        OpInfo(
            name,
            fn,
            ref,
            _binary_samples(_BROADCASTS, **ranges),
            family="elementwise",
            gradcheck_samples=_gradcheck(_binary_samples(_TINY_BROADCASTS, scalar_shape=(5,), **ranges)),
        )
    )


_register_binary("add", add, lambda a, b: a + b)
_register_binary("sub", sub, lambda a, b: a - b)
_register_binary("add_alpha", lambda a, b: add(a, b, alpha=-0.3), lambda a, b: torch.add(a, b, alpha=-0.3))
_register_binary("sub_alpha", lambda a, b: sub(a, b, alpha=0.7), lambda a, b: torch.sub(a, b, alpha=0.7))
_register_binary("mul", mul, lambda a, b: a * b)
_register_binary("div", div, lambda a, b: a / b, y_range=(0.5, 2.0), y_sign=True)
for _mode in ("trunc", "floor"):
    _register_binary(
        f"div_{_mode}",
        functools.partial(div, rounding_mode=_mode),
        _torch_binary(functools.partial(torch.div, rounding_mode=_mode)),
        x_range=(-6.0, 6.0),
        y_range=(0.5, 2.0),
        y_sign=True,
        jumps=True,
    )
_register_binary("pow", pow, lambda a, b: torch.pow(a, b), x_range=(0.5, 2.0), y_range=(-2.0, 2.0), scalars=(1.7, 0.7))
register(
    OpInfo(
        "pow_scalar_exponent",
        lambda x: pow(x, 3),
        lambda x: torch.pow(x, 3),
        lambda dtype, gen: [Sample((make(gen, *s).to(dtype),), name=str(s)) for s in ((3, 37), (0, 5))],
        family="elementwise",
        gradcheck_samples=lambda gen: [Sample((make(gen, 2, 5, dtype=torch.float64),))],
    )
)
register(
    OpInfo(
        "pow_square",
        lambda x: x**2,
        lambda x: x**2,
        lambda dtype, gen: [Sample((make(gen, 3, 37).to(dtype),))],
        family="elementwise",
        gradcheck_samples=lambda gen: [Sample((make(gen, 2, 5, dtype=torch.float64),))],
    )
)
_register_binary("maximum", maximum, _torch_binary(torch.maximum), ties=True, scalars=())
_register_binary("minimum", minimum, _torch_binary(torch.minimum), ties=True, scalars=())


def _where_samples(shapes, scalar_shape=(3, 7)):
    def samples(dtype, gen):
        out = []
        for sc, sa, sb in shapes:
            cond = torch.rand(sc, generator=gen) < 0.5
            out.append(Sample((cond, make(gen, *sa).to(dtype), make(gen, *sb).to(dtype)), name=f"{sc},{sa},{sb}"))
        cond = torch.rand(scalar_shape, generator=gen) < 0.5
        out.append(Sample((cond, make(gen, *scalar_shape).to(dtype), 0.3), name="tensor,number"))
        out.append(Sample((cond, -1.7, make(gen, scalar_shape[-1]).to(dtype)), name="number,tensor"))
        return out

    return samples


def _where_ref(cond, a, b):
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=b.dtype)
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype)
    return torch.where(cond, a, b)


register(
    OpInfo(
        "where",
        where,
        _where_ref,
        _where_samples([((3, 37), (3, 37), (37,)), ((5, 1, 7), (1, 4, 7), (5, 4, 1)), ((0, 5), (5,), (1,))]),
        family="elementwise",
        gradcheck_samples=_gradcheck(
            _where_samples([((2, 3), (2, 3), (3,)), ((2, 1, 3), (1, 2, 3), (2, 2, 1))], scalar_shape=(2, 3))
        ),
    )
)


def _clamp_samples(shapes, tensors):
    """Number bounds (both, min only, max only), then tensor bounds: float, and integer for the
    last case (integer bounds of a float tensor, which get no gradient)."""

    def samples(dtype, gen):
        out = []
        for s in shapes:
            x = away_from(make(gen, *s, low=-3, high=3), (-0.7, 0.3)).to(dtype)
            out.append(Sample((x,), {"min": -0.7, "max": 0.3}, name=f"{s} both"))
            out.append(Sample((x,), {"min": -0.7}, name=f"{s} min"))
            out.append(Sample((x,), {"max": 0.3}, name=f"{s} max"))
            out.append(Sample((x,), {"min": -1, "max": 2}, name=f"{s} integer numbers"))
        for i, (sx, slo, shi) in enumerate(tensors):
            x = make(gen, *sx, low=-3, high=3)
            lo, hi = make(gen, *slo, low=-2, high=0), make(gen, *shi, low=-1, high=2)
            if i == len(tensors) - 1:
                x, lo, hi = away_from(x, (-2.0, -1.0, 0.0, 1.0, 2.0)), lo.round().long(), hi.round().int()
            else:
                lo, hi = lo.to(dtype), hi.to(dtype)
            name = f"tensors {sx},{slo},{shi}{' integer' if i == len(tensors) - 1 else ''}"
            out.append(Sample((x.to(dtype), lo, hi), name=name, reduction=math.prod(sx)))
            out.append(Sample((x.to(dtype), lo), name=f"tensor min {sx},{slo}", reduction=math.prod(sx)))
            out.append(Sample((x.to(dtype), None, hi), name=f"tensor max {sx},{shi}", reduction=math.prod(sx)))
        return out

    return samples


def _clamp_op(x, min=None, max=None):
    return clamp(x, min, max)


register(
    OpInfo(
        "clamp",
        _clamp_op,
        lambda x, min=None, max=None: torch.clamp(x, min, max),
        _clamp_samples(
            [(3, 37), (1,), (0, 5)], [((3, 37), (37,), (3, 1)), ((5, 4, 7), (1,), (4, 7)), ((3, 5), (5,), (3, 1))]
        ),
        family="elementwise",
        gradcheck_samples=_gradcheck(_clamp_samples([(2, 4)], [((2, 4), (4,), (2, 1)), ((2, 3), (3,), (2, 1))])),
    )
)
