"""Optimizer kernels against torch.optim, gradient clipping, learning-rate schedules."""

import math

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, lower
from teeny.optim import SGD, Adam, AdamW, clip_grad_norm, cosine_schedule, step_schedule, warmup_schedule


def _executor_with_params(shapes, dtype=torch.float64, seed=0):
    g = Graph()
    x = g.input("x", (1,), dtype=dtype, requires_grad=True)
    for i, shape in enumerate(shapes):
        g.parameter(f"p{i}", shape, init=teeny.init.normal(), dtype=dtype)
    g.output(teeny.ops.gelu(x))
    program = lower(g, LoweringMode.TRAINING)
    return teeny.Executor(program, seed=seed)


CASES = [
    (SGD, torch.optim.SGD, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (Adam, torch.optim.Adam, dict(lr=0.01)),
    (Adam, torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
]


@pytest.mark.parametrize("ours,theirs,kwargs", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_update_rule_matches_torch(ours, theirs, kwargs):
    shapes = [(3, 7), (11,), (2, 2, 5)]
    ex = _executor_with_params(shapes)
    ref = [torch.nn.Parameter(ex.params[f"p{i}"].detach().cpu().clone()) for i in range(len(shapes))]
    opt, ref_opt = ours(ex, **kwargs), theirs(ref, **kwargs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        for i, shape in enumerate(shapes):
            grad = torch.randn(shape, generator=gen, dtype=torch.float64)
            ex.grads[f"p{i}"].copy_(grad)
            ref[i].grad = grad.clone()
        opt.step()
        ref_opt.step()
    for i in range(len(shapes)):
        torch.testing.assert_close(ex.params[f"p{i}"].cpu(), ref[i].detach(), atol=1e-12, rtol=1e-10)


def test_step_is_one_launch_over_the_arena(monkeypatch):
    ex = _executor_with_params([(3, 7), (11,), (5,)], dtype=torch.float32)
    assert len(ex.param_arenas) == 1 and ex.param_arenas[torch.float32].numel() == 21 + 11 + 5
    launches = []
    from teeny.kernel import KernelInstance

    original = KernelInstance.launch
    monkeypatch.setattr(
        KernelInstance,
        "launch",
        lambda self, grid, args: (launches.append(self.kernel.name), original(self, grid, args)),
    )
    AdamW(ex, lr=1e-3).step()
    assert launches == ["adam_step_kernel"]


def test_clip_grad_norm_matches_torch():
    shapes = [(3, 7), (13,)]
    ex = _executor_with_params(shapes)
    ref = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    gen = torch.Generator().manual_seed(3)
    for i, s in enumerate(shapes):
        g = torch.randn(s, generator=gen, dtype=torch.float64) * 3
        ex.grads[f"p{i}"].copy_(g)
        ref[i].grad = g.clone()
    norm = clip_grad_norm(ex, 1.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.5)
    assert math.isclose(float(norm), float(ref_norm), rel_tol=1e-5)
    for i in range(len(shapes)):
        torch.testing.assert_close(ex.grads[f"p{i}"].cpu(), ref[i].grad, atol=1e-6, rtol=1e-5)
    before = ex.grads["p0"].clone()
    clip_grad_norm(ex, 1e6)  # below the limit: unchanged
    torch.testing.assert_close(ex.grads["p0"], before)


def test_bad_optimizer_arguments():
    ex = _executor_with_params([(3,)])
    with pytest.raises(ValueError, match="lr must be"):
        SGD(ex, lr=-1)
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(ex, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        Adam(ex, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(ex, 0)
    g = Graph()
    x = g.input("x", (2,))
    g.output(teeny.ops.gelu(x))
    with pytest.raises(ValueError, match="TRAINING"):
        SGD(teeny.Executor(lower(g)), lr=0.1)


def test_schedules():
    warm = warmup_schedule(4)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = cosine_schedule(10, warmup_steps=2)
    assert cos(0) == 0.5 and cos(1) == 1.0 and cos(2) == 1.0 and abs(cos(12)) < 1e-12
    assert abs(cos(6) - 0.5) < 1e-12  # halfway through the 8 decay steps
    st = step_schedule(3, 0.5)
    assert [st(s) for s in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
