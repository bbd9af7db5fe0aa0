"""Test samples of the shape ops (``teeny.ops.shape``): odd shapes, empty tensors, views and
copies, advanced indexing with repeats, and split/chunk/stop_gradient checked through concat."""

import torch

from ...ops import (
    chunk,
    concat,
    expand,
    flatten,
    getitem,
    narrow,
    permute,
    reshape,
    split,
    squeeze,
    stack,
    stop_gradient,
    transpose,
    unflatten,
    unsqueeze,
    view,
)
from ...ops import slice as slice_op
from ..registry import OpInfo, Sample, make, register


def _samples(build):
    """Samples from ``build(t)``, where ``t(*shape)`` makes a random tensor of the dtype."""

    def samples(dtype, gen):
        return build(lambda *shape: make(gen, *shape, dtype=dtype))

    return samples


def _tiny(build):
    """Gradcheck samples (float64, tens of elements)."""
    return lambda gen: build(lambda *shape: make(gen, *shape, dtype=torch.float64))


def _both(build):
    return dict(samples=_samples(build), gradcheck_samples=_tiny(build))


def _register(name, op, ref, samples, gradcheck_samples=None, **kw):
    register(OpInfo(name, op, ref, samples, family="shape", gradcheck_samples=gradcheck_samples, **kw))


_register(
    "reshape",
    reshape,
    torch.reshape,
    _samples(
        lambda t: [
            Sample((t(3, 37), (37, -1)), name="3x37->37x-1"),
            Sample((t(5, 3, 11), (-1,)), name="flat"),
            Sample((t(1), ()), name="1->scalar"),
            Sample((t(0, 5), (5, 0, 1)), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 3, 5), (5, -1)), name="2x3x5")]),
)
_register(
    "view",
    lambda x, shape: view(x, *shape),
    lambda x, shape: x.view(*shape),
    **_both(lambda t: [Sample((t(2, 1, 7), (7, 2)), name="2x1x7")]),
)
_register(
    "flatten",
    flatten,
    torch.flatten,
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), 1), name="5x3x11 from 1"),
            Sample((t(2, 1, 7, 3), -3, -2), name="neg dims"),
            Sample((t(3, 37),), name="all"),
            Sample((t(0, 3, 2), 1), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 3, 5), 0, 1), name="2x3x5")]),
)
_register(
    "unflatten",
    unflatten,
    torch.unflatten,
    **_both(
        lambda t: [
            Sample((t(3, 14), -1, (2, -1)), name="3x14"),
            Sample((t(15), 0, (3, 5)), name="15"),
        ]
    ),
)
_register(
    "squeeze",
    squeeze,
    torch.squeeze,
    _samples(
        lambda t: [
            Sample((t(2, 1, 7),), name="all"),
            Sample((t(2, 1, 7), -2), name="dim -2"),
            Sample((t(2, 1, 7), 0), name="no-op"),
            Sample((t(1, 3, 1), (0, 2)), name="tuple"),
            Sample((t(1),), name="1-element"),
        ]
    ),
    _tiny(lambda t: [Sample((t(2, 1, 7),), name="2x1x7")]),
)
_register(
    "unsqueeze",
    unsqueeze,
    torch.unsqueeze,
    _samples(
        lambda t: [
            Sample((t(3, 37), 1), name="3x37 at 1"),
            Sample((t(5, 3, 11), -1), name="at -1"),
            Sample((t(0, 4), 0), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 7), -3), name="3x7")]),
)
_register(
    "transpose",
    transpose,
    torch.transpose,
    _samples(
        lambda t: [
            Sample((t(3, 37), 0, 1), name="3x37"),
            Sample((t(5, 3, 11), -1, 0), name="5x3x11 -1,0"),
            Sample((t(2, 1, 7), 0, 1), name="size-1 (view)"),
            Sample((t(4, 0, 3), 0, 2), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 2, 5), 0, 2), name="3x2x5")]),
)
_register(
    "permute",
    permute,
    torch.permute,
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), (2, 0, 1)), name="5x3x11"),
            Sample((t(2, 3, 1, 5, 3), (-1, 2, 0, 3, 1)), name="rank 5"),
            Sample((t(3, 37), (0, 1)), name="identity"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 2, 5), (1, 2, 0)), name="3x2x5")]),
)
_register(
    "getitem",
    getitem,
    lambda x, index: x[index],
    _samples(
        lambda t: [
            Sample((t(9, 5, 3), (slice(1, 7, 2), slice(None), -1)), name="x[1:7:2, :, -1]"),
            Sample((t(9, 5, 3), (Ellipsis, None, slice(-4, None))), name="x[..., None, -4:]"),
            Sample((t(9, 5, 3), (slice(2, 5),)), name="x[2:5] (view)"),
            Sample((t(9, 5, 3), (1, None, slice(-100, 100, 3))), name="x[1, None, ::3] clamped"),
            Sample((t(3, 37), (slice(5, 2),)), name="empty slice"),
            Sample((t(3, 37), (2, 36)), name="scalar"),
            Sample((t(129, 7), (slice(None, None, 4), 3)), name="129x7"),
        ]
    ),
    _tiny(
        lambda t: [
            Sample((t(5, 3, 4), (slice(1, 5, 2), None, Ellipsis, -1)), name="mixed"),
            Sample((t(6, 4), (slice(1, 3),)), name="rows"),
        ]
    ),
)


def _advanced_samples(build):
    """Samples from ``build(t, i)``: ``t(*shape)`` a random tensor of the dtype, ``i(size,
    *shape)`` random int64 indices into a dim of ``size`` (negative ones too)."""

    def samples(dtype, gen):
        def i(size, *shape):
            return torch.randint(-size, size, shape, generator=gen)

        return build(lambda *shape: make(gen, *shape, dtype=dtype), i)

    return samples


_register(
    "getitem_advanced",
    getitem,
    lambda x, index: x[index],
    _advanced_samples(
        lambda t, i: [
            Sample((t(7, 5), (i(7, 13),)), name="x[idx], repeats", reduction=13),
            Sample((t(5, 6, 7), (slice(None), i(6, 2, 3))), name="x[:, idx 2x3]", reduction=6),
            Sample((t(5, 6, 7), (i(5, 4), slice(1, 5), i(7, 4))), name="x[i, 1:5, j] (apart: B first)"),
            Sample((t(5, 6, 7), (i(5, 2, 1), i(6, 3))), name="x[i, j] broadcast"),
            Sample((t(5, 6, 7), (slice(1, 4), [0, -1, 2, 0], None)), name="x[1:4, list, None]", reduction=2),
            Sample((t(5, 6, 7), (Ellipsis, [[0], [6]])), name="x[..., [[0], [6]]]"),
            Sample((t(5, 6, 7), (i(5), slice(None), i(7, 3))), name="x[0-d, :, j] (0-d drops its dim)"),
            Sample((t(4, 3), (i(4, 0),)), name="empty index"),
        ]
    ),
    lambda gen: _advanced_samples(
        lambda t, i: [
            Sample((t(5, 3), (i(5, 9),)), name="x[idx], repeats"),
            Sample((t(3, 2, 4), (i(3, 3), slice(None), i(4, 3))), name="x[i, :, j]"),
            Sample((t(3, 4), ([0, -1, 0], slice(1, 3))), name="x[list, 1:3]"),
        ]
    )(torch.float64, gen),
    notes="index tensors and lists (gather forwards, scatter-add backwards)",
)

_register(
    "slice",
    slice_op,
    lambda x, dim, start, end, step=1: torch.ops.aten.slice(x, dim, start, end, step),
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), -1, 2, -1, 3), name="5x3x11 last dim"),
            Sample((t(3, 37), 0, 1, None), name="rows"),
            Sample((t(3, 37), 1, 40, 50), name="empty"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 8), 1, -7, 7, 2), name="3x8")]),
)
_register("narrow", narrow, torch.narrow, **_both(lambda t: [Sample((t(3, 9), 1, -5, 3), name="3x9")]))
_register(
    "concat",
    concat,
    torch.cat,
    _samples(
        lambda t: [
            Sample(([t(3, 37), t(3, 5), t(3, 1)], -1), name="last dim"),
            Sample(([t(2, 1, 7), t(5, 1, 7)],), name="dim 0"),
            Sample(([t(5, 3, 11), t(5, 0, 11), t(5, 2, 11)], 1), name="middle with empty"),
            Sample(([t(0), t(2, 3)], 0), name="skips 1-d empty"),
            Sample(([t(4, 3)], 1), name="one tensor"),
            Sample(([t(2, 3), torch.arange(6).reshape(2, 3), t(1, 3)], 0), name="with int64 (promoted)"),
        ]
    ),
    _tiny(lambda t: [Sample(([t(2, 3), t(2, 5)], 1), name="2x3+2x5"), Sample(([t(1, 4), t(3, 4)],), name="rows")]),
)
_register(
    "stack",
    stack,
    torch.stack,
    _samples(lambda t: [Sample(([t(3, 5), t(3, 5), t(3, 5)], -1), name="3x5")]),
    _tiny(lambda t: [Sample(([t(2, 3), t(2, 3)], 1), name="2x3")]),
)
_register(
    "split",
    lambda x, s, dim=0: concat(split(x, s, dim)[::-1], dim),
    lambda x, s, dim=0: torch.cat(torch.split(x, s, dim)[::-1], dim),
    _samples(
        lambda t: [
            Sample((t(5, 3, 11), 4, -1), name="size 4 of 11"),
            Sample((t(7, 3), [2, 0, 5]), name="sections"),
            Sample((t(3, 37), 3, 0), name="one part"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 7), [2, 5], 1), name="3x7")]),
    notes="split(x, s, dim) checked through concat(parts reversed)",
)
_register(
    "chunk",
    lambda x, chunks, dim=0: concat(chunk(x, chunks, dim)[::-1], dim),
    lambda x, chunks, dim=0: torch.cat(torch.chunk(x, chunks, dim)[::-1], dim),
    **_both(lambda t: [Sample((t(2, 5), 3, 1), name="5 in 3")]),
)
_register(
    "expand",
    lambda x, sizes: expand(x, *sizes),
    lambda x, sizes: x.expand(*sizes),
    _samples(
        lambda t: [
            Sample((t(3, 1), (3, 37)), name="3x1->3x37", reduction=37),
            Sample((t(11), (5, 3, 11)), name="bias-like", reduction=15),
            Sample((t(2, 1, 7), (4, -1, 9, -1)), name="2x1x7->4x2x9x7", reduction=36),
            Sample((t(1), (300,)), name="scalar to 300", reduction=300),
            Sample((t(1, 5), (0, 5)), name="to empty"),
            Sample((t(3, 1), (3, 1)), name="no-op (view)"),
        ]
    ),
    _tiny(lambda t: [Sample((t(3, 1), (2, 3, 5)), name="3x1->2x3x5", reduction=10)]),
)
_register(
    "stop_gradient",
    lambda x: concat([x, stop_gradient(x)]),
    lambda x: torch.cat([x, x.detach()]),
    _samples(lambda t: [Sample((t(3, 7),), name="3x7")]),
    # finite differences see through stop_gradient by design: nothing to gradcheck
    lambda gen: [Sample((make(gen, 3, 7, dtype=torch.float64),), grad=(), name="3x7")],
    notes="checked as concat([x, stop_gradient(x)]) against PyTorch autograd",
)
