"""One tensor in several argument slots: ``torch.ops.teeny.*`` and ``teeny.torch.apply`` against
eager PyTorch, outputs and gradients, as hypothesis draws the aliasing.

What ``test_ops.py``'s harness cannot see: every sample there passes distinct tensors. A call's
replay (``teeny.program.tape``) numbered its inputs by identity, so a first call ``mul(x, x)`` made
every later ``mul(a, b)`` read ``b`` twice. Here each example calls an op with a drawn pattern
(which slots get one tensor; the backward's gradient may be an input's memory too), then with
distinct tensors, then both again, in both orders, from an empty cache, with new values at every
call: a replay that reads the wrong slot gives a wrong number. Slots of one shape and dtype may
alias. Small shapes and a few examples per op keep the file well under a minute on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from teeny import ops
from teeny.checks.samples import OPS
from teeny.torch import apply, bridge

Spec = tuple[tuple[int, ...], torch.dtype]
F64, BOOL = torch.float64, torch.bool
ROWS = ((3, 4), F64)
VECTOR = ((4,), F64)
SQUARE = ((4, 4), F64)
HEADS = ((1, 2, 3, 4), F64)
CONDITION = ((3, 4), BOOL)


@dataclass(frozen=True)
class Case:
    """``name(*tensors, *extra)`` (``name(list(tensors), *extra)`` when ``listed``) as
    ``torch.ops.teeny.<name>`` and as ``apply`` of ``teeny.ops.<name>``, against the registry's
    PyTorch reference. ``positive``: values in [0.5, 1.5) (log, sqrt, div, pow)."""

    name: str
    slots: tuple[Spec, ...] = (ROWS,)
    extra: tuple = ()
    positive: bool = False
    listed: bool = False

    def __str__(self) -> str:
        return self.name


def _unary_cases() -> list[Case]:
    special = {
        "swiglu": Case("swiglu", (ROWS, ROWS)),
        "geglu": Case("geglu", (ROWS, ROWS)),
        "softcap": Case("softcap", extra=(1.5,)),
        "prelu": Case("prelu", (ROWS, VECTOR)),
        "threshold": Case("threshold", extra=(0.1, 20.0)),
    }
    positive = {"log", "sqrt", "rsqrt", "reciprocal"}
    names = sorted(n for n, info in OPS.items() if info.family in ("unary", "activation") and n != "gelu_tanh")
    return [special.get(n, Case(n, positive=n in positive)) for n in names]


CASES = [
    *(Case(n, (ROWS, ROWS), positive=n in ("div", "pow")) for n in ("add", "sub", "mul", "div", "pow")),
    Case("maximum", (ROWS, ROWS)),
    Case("minimum", (ROWS, ROWS)),
    Case("where", (CONDITION, ROWS, ROWS)),
    *_unary_cases(),
    Case("matmul", (SQUARE, SQUARE)),
    Case("linear", (SQUARE, SQUARE)),
    Case("scaled_dot_product_attention", (HEADS, HEADS, HEADS)),
    Case("layer_norm", (ROWS, VECTOR, VECTOR)),
    Case("rms_norm", (ROWS, VECTOR)),
    Case("softmax", extra=(-1,)),
    Case("log_softmax", extra=(0,)),
    Case("sum", extra=(1,)),
    Case("concat", (ROWS, ROWS, ROWS), extra=(1,), listed=True),
    Case("stack", (ROWS, ROWS, ROWS), extra=(0,), listed=True),
]
_NORMALISED = {"layer_norm": [4], "rms_norm": [4]}  # the normalized shape, after x


def _arguments(case: Case, tensors: list) -> tuple:
    if case.listed:
        return (list(tensors), *case.extra)
    if case.name in _NORMALISED:
        return (tensors[0], _NORMALISED[case.name], *tensors[1:], *case.extra)
    return (*tensors, *case.extra)


def _runs(case: Case) -> dict[str, Callable]:
    return {
        "op": lambda *args: getattr(torch.ops.teeny, case.name)(*args),
        "apply": lambda *args: apply(getattr(ops, case.name), *args),
    }


@st.composite
def _pattern(draw, case: Case) -> tuple[tuple[int, ...], int | None]:
    """Which earlier slot of the same shape and dtype each slot shares its tensor with (itself:
    a tensor of its own), and which slot's memory the output's gradient is (None: its own)."""
    shares: list[int] = []
    for i, spec in enumerate(case.slots):  # the most aliased first: hypothesis starts from there
        alike = [j for j in range(i) if case.slots[j] == spec and shares[j] == j]
        shares.append(draw(st.sampled_from([*alike, i])))
    floats = [i for i, (_, dtype) in enumerate(case.slots) if dtype.is_floating_point and shares[i] == i]
    return tuple(shares), draw(st.sampled_from([*floats, None]))


def _tensors(case: Case, shares: tuple[int, ...], gen: torch.Generator) -> list[torch.Tensor]:
    made: list[torch.Tensor] = []
    for i, (shape, dtype) in enumerate(case.slots):
        if shares[i] != i:
            made.append(made[shares[i]])
        elif dtype == BOOL:
            made.append(torch.rand(shape, generator=gen, dtype=F64) > 0.5)
        else:
            t = torch.rand(shape, generator=gen, dtype=dtype)
            made.append((t + 0.5 if case.positive else 4 * t - 2).requires_grad_())
    return made


def _one_call(case: Case, run: Callable, shares: tuple[int, ...], grad_from: int | None, gen: torch.Generator):
    """(teeny's output and gradients, torch's) for one call with aliasing ``shares``."""
    tensors = _tensors(case, shares, gen)
    leaves = [t for i, t in enumerate(tensors) if shares[i] == i and t.requires_grad]
    twins = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    twins = [twins[s] for s in shares]  # the same aliasing among the reference's tensors
    twin_leaves = [t for i, t in enumerate(twins) if shares[i] == i and t.requires_grad]
    got = run(*_arguments(case, tensors))
    want = OPS[case.name].ref(*_arguments(case, twins))
    if grad_from is not None and tensors[grad_from].shape == got.shape:
        seed = tensors[grad_from].detach()  # the gradient is an input's memory
    else:
        seed = torch.rand(got.shape, generator=gen, dtype=got.dtype)
    grads = torch.autograd.grad(got, leaves, seed.expand(got.shape), allow_unused=True)
    want_grads = torch.autograd.grad(want, twin_leaves, seed.clone().expand(want.shape), allow_unused=True)
    return [got.detach(), *grads], [want.detach(), *want_grads]


def _forget_tapes() -> None:
    """Every entry's recorded runs dropped, its trace kept: the next call of each records again."""
    for entry in bridge._ENTRIES.values():
        entry._forward_replay.tapes.clear()
        entry._backward_replay.tapes.clear()


# apply of a one-tensor op adds nothing to the op's own aliasing (its gradient's) but time
WAYS = [(case, way) for case in CASES for way in ("op", "apply") if way == "op" or len(case.slots) > 1]


@pytest.mark.parametrize(("case", "way"), WAYS, ids=lambda v: str(v))
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure is one a rerun shows
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_aliased_then_distinct_arguments_match_torch(case, way, data):
    shares, grad_from = data.draw(_pattern(case), label="aliasing")
    aliased, apart = (shares, grad_from), (tuple(range(len(case.slots))), None)
    gen = torch.Generator().manual_seed(len(case.slots))
    run = _runs(case)[way]
    for sequence in ([aliased, apart, aliased], [apart, aliased]):  # each order from no recorded run
        _forget_tapes()
        for call, (pattern, gradient) in enumerate(sequence):
            got, want = _one_call(case, run, pattern, gradient, gen)
            for k, (g, w) in enumerate(zip(got, want)):
                what = "output" if k == 0 else f"gradient {k - 1}"
                assert (g is None) == (w is None), f"{case} call {call} {pattern}: {what}"
                if g is not None:
                    torch.testing.assert_close(g, w, msg=lambda m: f"{case} call {call} {pattern} {what}: {m}")
