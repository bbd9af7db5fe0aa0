"""Every registered op: float64 gradcheck, and forward + backward against PyTorch autograd in
every dtype it supports (float32 and half precision with ``teeny.checks.registry.tolerance``)."""

import pytest
import torch

import teeny
from helpers import assert_matches_torch
from teeny.checks.facts import op_facts
from teeny.checks.samples import all_ops

OPS = all_ops()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("info", OPS, ids=lambda i: i.name)
def test_gradcheck_float64(info, gen):
    if not op_facts(info).has_backward:
        pytest.skip("inference-only op")
    for sample in info.gradcheck_inputs(gen):
        if sample.has_gradient_to_check():
            teeny.gradcheck(info.op, *sample.args, kwargs=sample.kwargs, requires_grad=sample.wants_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("info", OPS, ids=lambda i: i.name)
def test_matches_torch(info, dtype, gen):
    if dtype not in op_facts(info).dtypes:
        pytest.skip(f"{info.name} has no {dtype} version")
    for sample in info.samples(dtype, gen):
        assert_matches_torch(
            info.op,
            info.ref,
            *sample.args,
            kwargs=sample.kwargs,
            dtype=dtype,
            reduction=sample.reduction,
            out_dtype=info.output_dtype(dtype) if info.output_dtype else None,
            grad=sample.grad,
            gen=gen,
            backward=op_facts(info).has_backward,
            name=f"{info.name} {sample.name}",
        )
