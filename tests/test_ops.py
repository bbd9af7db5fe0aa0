"""Every registered op: float64 gradcheck, and forward + backward against PyTorch autograd in
every dtype it supports (float32 and half precision with ``teeny.registry.tolerance``)."""

import pytest
import torch

import teeny
from teeny.facts import op_facts
from teeny.interop.torch import apply
from teeny.ops import all_ops
from teeny.registry import Sample, tolerance

OPS = all_ops()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _flat(args):
    return Sample(tuple(args)).tensors()


def _rebuild(args, fn):
    """Copy ``args`` with every tensor replaced by fn(index, tensor)."""
    counter = [0]

    def go(a):
        if isinstance(a, torch.Tensor):
            i = counter[0]
            counter[0] += 1
            return fn(i, a)
        if isinstance(a, (list, tuple)):
            return type(a)(go(b) for b in a)
        return a

    return go(args)


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
        args = _rebuild(
            sample.args, lambda i, t: t.detach().clone().to(teeny.DEVICE).requires_grad_(sample.wants_grad(i, t))
        )
        kwargs = {k: (v.to(teeny.DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in sample.kwargs.items()}
        ref_args = _rebuild(
            args,
            lambda i, t: (t.detach().double() if t.is_floating_point() else t.detach()).requires_grad_(t.requires_grad),
        )
        ref_kwargs = {
            k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()
        }

        out = apply(info.op, *args, **kwargs)
        ref = info.ref(*ref_args, **ref_kwargs)
        out_dtype = info.output_dtype(dtype) if info.output_dtype else dtype
        atol, rtol = tolerance(dtype, sample.reduction, out_dtype)
        assert out.dtype == out_dtype if ref.is_floating_point() else True
        torch.testing.assert_close(
            out.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{info.name} {sample.name} forward: {m}"
        )
        inputs = [t for t in _flat(args) if t.requires_grad]
        if not op_facts(info).has_backward or not inputs or out.numel() == 0 or not ref.requires_grad:
            continue
        grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(teeny.DEVICE)
        grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)
        ref_inputs = [t for t in _flat(ref_args) if t.requires_grad]
        ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out, allow_unused=True)
        for index, (g, r) in enumerate(zip(grads, ref_grads)):
            if r is None:
                r = torch.zeros_like(ref_inputs[index])
            assert g is not None, f"{info.name} {sample.name}: no gradient for input {index}"
            torch.testing.assert_close(
                g.double(),
                r.double(),
                atol=atol,
                rtol=rtol,
                msg=lambda m, i=index: f"{info.name} {sample.name} grad of input {i}: {m}",
            )
