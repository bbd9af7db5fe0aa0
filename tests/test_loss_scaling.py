"""float16 mixed precision with dynamic loss scaling (``precision="fp16-mixed"``,
``optim.GradScaler``): the seed carries the scale, small gradients survive where the unscaled
float16 backward loses them, an overflowing step changes nothing and backs the scale off, the
scale grows after clean steps, Adam's step counts skip what was skipped, the state is
checkpointed, and ``train()`` follows the float32 loss curve."""

import pytest
import torch

from teeny import Graph, LoweringMode, lower, ops
from teeny.program.executor import Executor
from teeny.training.loop import TrainStep
from teeny.training.models import MLP
from teeny.training.optim import SGD, AdamW, GradScaler

F16 = torch.float16


def _graph(loss_factor=1.0):
    g = Graph("mlp")
    x = g.input("x", (8, 6))
    y = g.input("y", (8,), torch.int64)
    g.output(ops.mul(ops.cross_entropy(MLP(6, 16, 3)(x), y), loss_factor))
    return g


def _feed(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(8, 6, generator=gen), "y": torch.randint(3, (8,), generator=gen)}


def _setup(precision="fp16-mixed", optimizer=SGD, loss_factor=1.0, **scaler):
    ex = Executor(lower(_graph(loss_factor), LoweringMode.TRAINING, precision=precision), seed=0)
    opt = optimizer(ex, lr=1e-2) if optimizer is not SGD else SGD(ex, lr=1e-2, momentum=0.9)
    if precision == "fp16-mixed" and scaler.get("init_scale", 1) is not None:  # init_scale=None: no scaler
        GradScaler(opt, **scaler)
    return ex, opt


def test_fp16_mixed_computes_in_float16():
    program = lower(_graph(), LoweringMode.TRAINING, precision="fp16-mixed")
    by_op = {p.op.name: p.node for p in program.nodes}
    assert by_op["linear"].dtype == F16 and by_op["gelu"].dtype == F16
    assert program.loss.dtype == torch.float32
    assert set(Executor(program).param_arenas) == {torch.float32}


def _relative_error(grads, reference):
    return max(float((grads[k] - reference[k]).norm() / reference[k].norm()) for k in reference)


def test_scaling_keeps_gradients_that_float16_would_flush():
    """A loss of 1e-5 times the usual: its float16 gradients lie among the subnormals; scaled by
    2^14 they are ordinary float16 numbers, and after unscaling they match float32's."""
    feed = _feed()
    reference, _ = _setup(precision=None, loss_factor=1e-5)
    _, cache = reference.forward_train(feed)
    reference.backward(cache)
    expected = {k: v.clone() for k, v in reference.grads.items()}
    errors = {}
    for init_scale in (None, 2.0**14):  # (2^16 itself overflows float16, whose largest number is 65504)
        ex, opt = _setup(loss_factor=1e-5, init_scale=init_scale)
        opt.lr = 0.0  # look at the gradients, keep the weights
        TrainStep(ex, opt)(feed)
        errors[init_scale] = _relative_error(ex.grads, expected)
    assert errors[2.0**14] < 5e-3, errors
    assert errors[None] > 5 * errors[2.0**14], errors  # what float16 alone loses


def test_an_overflowing_step_changes_nothing_and_backs_the_scale_off():
    ex, opt = _setup(optimizer=AdamW, init_scale=2.0**40)
    before = {k: v.clone() for k, v in ex.params.items()}
    step = TrainStep(ex, opt)
    step(_feed())
    assert opt.scaler.skipped()
    assert all(torch.equal(ex.params[k], before[k]) for k in before)
    assert all(not t.any() for arenas in opt.state.values() for t in arenas.values())
    assert opt.scaler.scale == 2.0**39
    opt.settle()
    assert opt.param_steps == [0] * len(opt.slots) and opt.scaler.skipped_steps == 1


def test_the_scale_grows_after_growth_interval_clean_steps():
    ex, opt = _setup(init_scale=16.0, growth_interval=2)
    step = TrainStep(ex, opt)
    scales = []
    for i in range(5):
        step(_feed(i))
        scales.append(opt.scaler.scale)
    assert scales == [16.0, 32.0, 32.0, 64.0, 64.0]
    assert not opt.scaler.skipped() and opt.param_steps == [5] * len(opt.slots)


def test_adam_counts_only_the_steps_it_took():
    """A first step that overflows and backs the scale off to 2^10, then three steps: the same
    weights, bit for bit, as three steps at 2^10 from the start (Adam's bias correction counts
    three)."""
    skipping, opt_a = _setup(optimizer=AdamW, init_scale=2.0**30, backoff_factor=2.0**-20)
    straight, opt_b = _setup(optimizer=AdamW, init_scale=2.0**10)
    step_a, step_b = TrainStep(skipping, opt_a), TrainStep(straight, opt_b)
    step_a(_feed(0))
    assert opt_a.scaler.skipped() and opt_a.scaler.scale == 2.0**10
    for i in range(1, 4):
        step_a(_feed(i))
        step_b(_feed(i))
    assert opt_a.state_dict()["param_steps"].tolist() == opt_b.state_dict()["param_steps"].tolist()
    for name in straight.params:
        assert torch.equal(skipping.params[name], straight.params[name]), name


def test_the_scaler_state_is_part_of_the_optimizer_state():
    ex, opt = _setup(optimizer=AdamW, init_scale=2.0**40)
    TrainStep(ex, opt)(_feed())
    state = opt.state_dict()
    assert state["loss_scale"].tolist() == [2.0**39, 0.0, 1.0]
    other_ex, other = _setup(optimizer=AdamW, init_scale=4.0)
    other.load_state_dict(state)
    assert other.scaler.scale == 2.0**39
    plain_ex, plain = _setup(optimizer=AdamW, init_scale=None)
    plain.load_state_dict(state)  # an extra entry is ignored; a missing one is refused
    with pytest.raises(KeyError, match="loss_scale"):
        other.load_state_dict(plain.state_dict())


def test_sharded_counts_and_the_reduction():
    """What ZeRO-1 passes: every rank scales its ranges, counts those it owns alone, and the
    counts are summed across ranks (here: a reduce that adds another rank's count of 1)."""
    ex, opt = _setup(init_scale=4.0)
    n = ex.grad_numel[torch.float32]
    grads = ex.grad_arenas[torch.float32]
    grads.fill_(8.0)
    grads[n - 1] = float("inf")  # outside the counted range: another rank counts it
    reduced = []

    def reduce(count):
        reduced.append(float(count))
        count += 1.0

    half = n // 2
    opt.scaler.unscale(
        ex,
        count_ranges={torch.float32: [(0, half)]},
        scale_ranges={torch.float32: [(0, half), (half, n)]},
        reduce=reduce,
    )
    assert reduced == [0.0] and opt.scaler.skipped() and opt.scaler.scale == 2.0
    assert torch.equal(grads[: n - 1], torch.full((n - 1,), 2.0))


def test_bad_scaler_settings_are_refused():
    _, opt = _setup(precision=None, init_scale=None)
    for kwargs, match in (
        ({"init_scale": 0.0}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ):
        with pytest.raises(ValueError, match=match):
            GradScaler(opt, **kwargs)
    GradScaler(opt)
    with pytest.raises(Exception, match="already has a GradScaler"):
        GradScaler(opt)
