"""Property-based: random small graphs (broadcasting, fan-out, reductions over random axes,
shape ops) give every input gradient PyTorch autograd gives, in float64 (issue 11).

Hypothesis draws a program step by step: each step applies an op to values already made
(any of them, so values fan out), sometimes with a new input whose shape broadcasts against
the operand; the loss sums every value made, each with its own weight, so every step's
gradient matters. The same program runs through teeny (``teeny.torch.apply``: traced,
lowered, teeny's kernels forwards and backwards) and through PyTorch in float64. Bounded to a
few dozen small programs so that it stays well under a minute on the CPU."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teeny import ops
from teeny.torch import apply

UNARY = {
    "tanh": (ops.tanh, torch.tanh),
    "sin": (ops.sin, torch.sin),
    "sigmoid": (ops.sigmoid, torch.sigmoid),
    "square": (ops.square, torch.square),
    "neg": (ops.neg, torch.neg),
    "half": (lambda x: x * 0.5, lambda x: x * 0.5),
}
BINARY = {
    "add": (ops.add, torch.add),
    "sub": (ops.sub, torch.sub),
    "mul": (ops.mul, torch.mul),
    "maximum": (ops.maximum, torch.maximum),
}
REDUCE = {
    "sum": (lambda x, d, k: ops.sum(x, d, k), lambda x, d, k: torch.sum(x, d, k)),
    "mean": (lambda x, d, k: ops.mean(x, d, k), lambda x, d, k: torch.mean(x, d, k)),
    "max": (lambda x, d, k: ops.max(x, d, k), lambda x, d, k: torch.amax(x, d, k)),
}


def _broadcast_partner(draw, shape):
    """A shape that broadcasts against ``shape``: some trailing dims kept, some set to 1."""
    keep = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep :]
    return tuple(1 if draw(st.booleans()) else s for s in tail)


@st.composite
def programs(draw):
    """(input shapes, steps): a step is (kind, name, operand indices, arguments)."""
    shapes = [tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))]
    values = list(shapes)  # the shape of every value so far: inputs first, then step results
    steps = []
    for _ in range(draw(st.integers(2, 6))):
        i = draw(st.integers(0, len(values) - 1))
        shape = values[i]
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "shape"]))
        if kind == "unary":
            steps.append(("unary", draw(st.sampled_from(sorted(UNARY))), (i,), ()))
            values.append(shape)
        elif kind == "binary":
            compatible = [j for j, s in enumerate(values) if _broadcasts(shape, s)]
            if draw(st.booleans()) or len(compatible) < 2:  # a new input that broadcasts against value i
                partner = _broadcast_partner(draw, shape)
                shapes.append(partner)
                values.insert(len(shapes) - 1, partner)  # inputs stay first: shift later values by one
                steps = [_shift(step, len(shapes) - 1) for step in steps]
                i = i + 1 if i >= len(shapes) - 1 else i
                j = len(shapes) - 1
            else:
                j = draw(st.sampled_from(compatible))
            first, second = (i, j) if draw(st.booleans()) else (j, i)
            steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), (first, second), ()))
            values.append(tuple(torch.broadcast_shapes(values[first], values[second])))
        elif kind == "reduce" and shape:
            dim = draw(st.integers(-len(shape), len(shape) - 1))
            keepdim = draw(st.booleans())
            steps.append(("reduce", draw(st.sampled_from(sorted(REDUCE))), (i,), (dim, keepdim)))
            out = list(shape)
            if keepdim:
                out[dim] = 1
            else:
                out.pop(dim)
            values.append(tuple(out))
        elif kind == "shape" and shape:
            step, out = _shape_step(draw, i, shape)
            steps.append(step)
            values.append(out)
    return shapes, steps


def _broadcasts(a, b) -> bool:
    try:
        torch.broadcast_shapes(a, b)
        return True
    except RuntimeError:
        return False


def _shift(step, new_input):
    """Renumber a step's operands after an input was inserted at index ``new_input``."""
    kind, name, operands, args = step
    return kind, name, tuple(o + 1 if o >= new_input else o for o in operands), args


def _shape_step(draw, i, shape):
    n = len(shape)
    choice = draw(st.sampled_from(["transpose", "flatten", "unsqueeze", "permute", "narrow", "expand"]))
    if choice == "transpose" and n >= 2:
        a, b = draw(st.permutations(range(n)))[:2]
        out = list(shape)
        out[a], out[b] = out[b], out[a]
        return ("shape", "transpose", (i,), (a, b)), tuple(out)
    if choice == "permute" and n >= 2:
        dims = tuple(draw(st.permutations(range(n))))
        return ("shape", "permute", (i,), (dims,)), tuple(shape[d] for d in dims)
    if choice == "narrow":
        dim = draw(st.integers(0, n - 1))
        start = draw(st.integers(0, shape[dim] - 1))
        length = draw(st.integers(1, shape[dim] - start))
        out = list(shape)
        out[dim] = length
        return ("shape", "narrow", (i,), (dim, start, length)), tuple(out)
    if choice == "expand" and 1 in shape:
        dim = shape.index(1)
        out = list(shape)
        out[dim] = draw(st.integers(2, 3))
        return ("shape", "expand", (i,), (tuple(out),)), tuple(out)
    if choice == "unsqueeze" and n < 3:
        dim = draw(st.integers(0, n))
        out = list(shape)
        out.insert(dim, 1)
        return ("shape", "unsqueeze", (i,), (dim,)), tuple(out)
    return ("shape", "flatten", (i,), ()), (math.prod(shape),)


def _shape(name, x, args, teeny):
    if name == "transpose":
        return (ops.transpose if teeny else torch.transpose)(x, *args)
    if name == "permute":
        return ops.permute(x, args[0]) if teeny else x.permute(*args[0])
    if name == "narrow":
        return (ops.narrow if teeny else torch.narrow)(x, *args)
    if name == "expand":
        return ops.expand(x, args[0]) if teeny else x.expand(*args[0])
    if name == "unsqueeze":
        return (ops.unsqueeze if teeny else torch.unsqueeze)(x, args[0])
    return ops.reshape(x, (-1,)) if teeny else x.reshape(-1)


def _run(steps, inputs, teeny: bool):
    """The program's loss: every value made, summed with weight 1 + k / 10 for value k."""
    values = list(inputs)
    for kind, name, operands, args in steps:
        xs = [values[o] for o in operands]
        side = 0 if teeny else 1
        if kind == "unary":
            values.append(UNARY[name][side](*xs))
        elif kind == "binary":
            values.append(BINARY[name][side](*xs))
        elif kind == "reduce":
            values.append(REDUCE[name][side](xs[0], *args))
        else:
            values.append(_shape(name, xs[0], args, teeny))
    total = None
    for k, v in enumerate(values[len(inputs) :]):
        term = (ops.sum(v) if teeny else v.sum()) * (1.0 + k / 10)
        total = term if total is None else total + term
    return total


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_graphs_match_pytorch_autograd_in_float64(program):
    shapes, steps = program
    gen = torch.Generator().manual_seed(len(steps) * 31 + len(shapes))
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]
    loss = apply(lambda *xs: _run(steps, xs, teeny=True), *inputs)
    expected = _run(steps, inputs, teeny=False)
    torch.testing.assert_close(loss, expected, atol=1e-10, rtol=1e-10)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    reference = torch.autograd.grad(expected, inputs, allow_unused=True)
    for index, (g, r) in enumerate(zip(grads, reference)):
        r = torch.zeros_like(inputs[index]) if r is None else r
        g = torch.zeros_like(inputs[index]) if g is None else g
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=lambda m: f"input {index} {steps}: {m}")
