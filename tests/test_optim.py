"""Optimizer kernels against torch.optim: update rules, what they must never touch (frozen
parameters, BatchNorm statistics, parameters without a gradient), per-parameter step counts,
gradient clipping in float32 and float64, learning-rate schedules."""

import math

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, lower
from teeny.training.optim import SGD, Adam, AdamW, clip_grad_norm, cosine_schedule, step_schedule, warmup_schedule


def _executor_with_params(shapes, dtype=torch.float64, seed=0, frozen=(), unused=()):
    """loss = sum_i sum(p_i * c_i) over the parameters, except those named in ``unused`` (trainable,
    but the loss does not reach them); ``frozen`` are non-trainable parameters the loss reads."""
    g = Graph()
    terms = []
    for i, shape in enumerate(shapes):
        name = f"p{i}"
        p = g.parameter(name, shape, init=teeny.core.init.normal(), dtype=dtype, trainable=name not in frozen)
        if name not in unused:
            c = g.constant(torch.linspace(-1, 1, math.prod(shape), dtype=dtype).reshape(shape))
            terms.append(teeny.ops.sum(teeny.ops.mul(p, c)))
    loss = terms[0]
    for t in terms[1:]:
        loss = teeny.ops.add(loss, t)
    g.output(loss)
    return teeny.Executor(lower(g, LoweringMode.TRAINING), seed=seed)


def _backward(ex):
    (loss, cache) = ex.forward_train({})
    ex.backward(cache)


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
        ex.zero_grad()
        _backward(ex)  # the parameters have a gradient; replace it by a random one
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
    # one arena; each parameter starts 16-byte aligned (21, 11, 5 floats padded to 24, 12, 8)
    assert len(ex.param_arenas) == 1 and ex.param_arenas[torch.float32].numel() == 24 + 12 + 8
    assert all(p.data_ptr() % 16 == 0 for p in ex.params.values())
    _backward(ex)
    launches = []
    from teeny.core.kernel import KernelInstance

    original = KernelInstance.launch
    monkeypatch.setattr(
        KernelInstance,
        "launch",
        lambda self, grid, args: (launches.append(self.kernel.name), original(self, grid, args)),
    )
    AdamW(ex, lr=1e-3).step()
    assert launches == ["adam_step_kernel"]


OPTIMIZERS = [
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    (Adam, torch.optim.Adam, dict(lr=0.1, weight_decay=0.1)),
    (AdamW, torch.optim.AdamW, dict(lr=0.1)),  # AdamW's default weight decay 0.01
]


@pytest.mark.parametrize("ours,theirs,kwargs", OPTIMIZERS, ids=lambda c: getattr(c, "__name__", str(c)))
def test_frozen_and_unreached_parameters_are_never_touched(ours, theirs, kwargs):
    """A frozen all-ones (3, 3) parameter the loss reads, and a trainable one the loss does not
    reach, keep their values through 10 steps with weight decay (they used to drift: 0.80 under
    SGD, 0.51 under Adam), while the trained one follows torch.optim."""
    g = Graph()
    x = g.input("x", (2, 3), torch.float64)
    w = g.parameter("w", (3, 3), init=teeny.core.init.normal(), dtype=torch.float64)
    frozen = g.parameter("frozen", (3, 3), init=teeny.core.init.ones(), dtype=torch.float64, trainable=False)
    g.parameter("unreached", (4,), init=teeny.core.init.ones(), dtype=torch.float64)
    g.output(teeny.ops.sum(teeny.ops.mul(teeny.ops.matmul(x, w), teeny.ops.matmul(x, frozen))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    assert [v.name for v, _ in ex.arena_params[torch.float64]] == ["w", "unreached", "frozen"]
    ref_w = torch.nn.Parameter(ex.params["w"].detach().cpu().clone())
    ref_frozen = torch.ones(3, 3, dtype=torch.float64)  # requires_grad=False: torch.optim skips it
    ref_unreached = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))  # never gets a .grad
    opt = ours(ex, **kwargs)
    ref_opt = theirs([ref_w, torch.nn.Parameter(ref_frozen, requires_grad=False), ref_unreached], **kwargs)
    xs = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(10):
        opt.zero_grad()
        _, cache = ex.forward_train({"x": xs})
        ex.backward(cache)
        opt.step()
        ref_opt.zero_grad()
        (xs @ ref_w * (xs @ ref_frozen)).sum().backward()
        ref_opt.step()
    assert torch.equal(ex.params["frozen"].cpu(), torch.ones(3, 3, dtype=torch.float64))
    assert torch.equal(ex.params["unreached"].cpu(), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(ex.params["w"].cpu(), ref_w.detach(), atol=1e-12, rtol=1e-10)


def test_batch_norm_running_statistics_are_left_to_the_forward():
    """BatchNorm's running mean and variance are non-trainable parameters: the forward updates
    them, the optimizer's weight decay must not (PyTorch keeps them as buffers)."""
    bn = teeny.nn.BatchNorm1d(3, dtype=torch.float64)
    g = Graph()
    x = g.input("x", (4, 3), torch.float64)
    y = bn(x)
    g.output(teeny.ops.sum(teeny.ops.mul(y, y)))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    ref = torch.nn.BatchNorm1d(3, dtype=torch.float64)
    opt, ref_opt = AdamW(ex, lr=0.1, weight_decay=0.5), torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = torch.randn(4, 3, dtype=torch.float64, generator=gen)
        opt.zero_grad()
        _, cache = ex.forward_train({"x": xs})
        ex.backward(cache)
        opt.step()
        ref_opt.zero_grad()
        out = ref(xs)
        (out * out).sum().backward()
        ref_opt.step()
    for name in ("running_mean", "running_var"):
        full = [k for k in ex.params if k.endswith(name)][0]
        torch.testing.assert_close(ex.params[full].cpu(), getattr(ref, name), atol=1e-12, rtol=1e-10)


def test_step_without_a_gradient_changes_nothing():
    """After zero_grad and no backward every parameter is PyTorch's `.grad is None`: a step moves
    nothing and does not count (the next real step is Adam's step 1)."""
    ex = _executor_with_params([(4,)])
    before = ex.params["p0"].clone()
    opt = AdamW(ex, lr=0.1, weight_decay=0.5)
    opt.zero_grad()
    opt.step()
    assert torch.equal(ex.params["p0"], before) and opt.param_steps == [0]
    _backward(ex)
    opt.step()
    ref = torch.nn.Parameter(before.cpu().clone())
    ref.grad = ex.grads["p0"].cpu().clone()
    ref_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.5)
    ref_opt.step()
    torch.testing.assert_close(ex.params["p0"].cpu(), ref.detach(), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("ours,theirs,kwargs", OPTIMIZERS, ids=lambda c: getattr(c, "__name__", str(c)))
def test_each_parameter_keeps_its_own_step_count(ours, theirs, kwargs):
    """Gradients for p1 only from step 3 on (PyTorch: p1.grad is None before): p1's momentum
    starts, and its bias correction counts, from its first gradient; p0's and p2's do not wait."""
    shapes = [(5,), (3,), (4,)]
    ex = _executor_with_params(shapes)
    ref = [torch.nn.Parameter(ex.params[f"p{i}"].detach().cpu().clone()) for i in range(3)]
    opt, ref_opt = ours(ex, **kwargs), theirs(ref, **kwargs)
    gen = torch.Generator().manual_seed(2)
    launches = []
    for step in range(6):
        names = ["p0", "p2"] if step < 2 else ["p0", "p1", "p2"]
        _backward(ex)
        ref_opt.zero_grad()
        for i, shape in enumerate(shapes):
            grad = torch.randn(shape, generator=gen, dtype=torch.float64)
            ex.grads[f"p{i}"].copy_(grad)
            if f"p{i}" in names:
                ref[i].grad = grad.clone()
        opt.step(with_grad=names)
        launches.append(len(opt.segments))
        ref_opt.step()
    for i in range(3):
        torch.testing.assert_close(ex.params[f"p{i}"].cpu(), ref[i].detach(), atol=1e-12, rtol=1e-10)
    # the arena holds p2, p1, p0 (reverse order of first use): p1 splits the launches
    assert [v.name for v, _, _ in opt.slots] == ["p2", "p1", "p0"] and opt.param_steps == [6, 4, 6]
    assert launches == [2, 2, 3, 3, 3, 3]


def test_the_launch_plan_is_kept_while_names_and_step_counts_allow_it():
    ex = _executor_with_params([(5,), (3,), (4,)])
    opt = SGD(ex, lr=0.1)
    plans = []
    for names in (["p0", "p1", "p2"], ["p0", "p1", "p2"], ["p0", "p2"], ["p0", "p1", "p2"]):
        _backward(ex)
        opt.step(with_grad=names)
        plans.append(opt.segments)
    assert plans[1] is plans[0] and len(plans[0]) == 1  # the same names, equal counts: planned once
    assert len(plans[2]) == 2  # p1 has no gradient: two launches around it
    assert len(plans[3]) == 3 and opt.param_steps == [4, 3, 4]  # p1's count differs now: its own launch


def test_with_grad_naming_a_parameter_no_optimizer_updates_is_refused():
    ex = _executor_with_params([(3,), (2,)], frozen=("p1",))
    with pytest.raises(ValueError, match=r"\['p1'\].*never writes"):
        SGD(ex, lr=0.1).step(with_grad=["p1"])


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float64, 1e-14)], ids=["float32", "float64"])
def test_clip_grad_norm_matches_torch(dtype, rtol):
    """float64 gradients get a float64 norm and factor (the norm used to be summed in float32)."""
    shapes = [(3, 7), (13,)]
    ex = _executor_with_params(shapes, dtype=dtype)
    _backward(ex)
    ref = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    gen = torch.Generator().manual_seed(3)
    for i, s in enumerate(shapes):
        g = torch.randn(s, generator=gen, dtype=dtype) * 3 + 1e-9
        ex.grads[f"p{i}"].copy_(g)
        ref[i].grad = g.clone()
    max_norm = 1.5 + 1e-12  # not a float32 number: a float32 scalar would be off by 6e-8
    norm = clip_grad_norm(ex, max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert math.isclose(float(norm), float(ref_norm), rel_tol=rtol)
    for i in range(len(shapes)):
        torch.testing.assert_close(ex.grads[f"p{i}"].cpu(), ref[i].grad, atol=0, rtol=rtol * 4)
    before = ex.grads["p0"].clone()
    clip_grad_norm(ex, 1e6)  # below the limit: unchanged
    torch.testing.assert_close(ex.grads["p0"], before)


def test_bad_optimizer_arguments():
    ex = _executor_with_params([(3,)])
    with pytest.raises(ValueError, match="lr must be"):
        SGD(ex, lr=-1)
    with pytest.raises(ValueError, match="lr must be a finite"):
        SGD(ex, lr=math.inf)
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
