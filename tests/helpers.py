"""What the test files share: teeny against PyTorch autograd (``assert_matches_torch``, the rule
of ``tests/test_ops.py``), a function traced and run by the executor (``run_teeny``), one
training step of a lowered program (``train_step``), and the programs under ``tests/scripts``
run in a fresh Python (``run_script``, ``compile_for_sm90``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

import teeny
from teeny.checks.registry import tolerance
from teeny.program.executor import Executor
from teeny.program.lowering import LoweringMode, lower
from teeny.torch import apply

SCRIPTS = Path(__file__).resolve().parent / "scripts"


# ------------------------------------------------------------------------- teeny against torch


def _map_tensors(args, fn: Callable[[int, torch.Tensor], torch.Tensor]):
    """``args`` with every tensor (in nested lists and tuples too) replaced by fn(index, tensor),
    numbered in the order ``teeny.checks.registry.Sample.tensors`` numbers them."""
    counter = [0]

    def go(a):
        if isinstance(a, torch.Tensor):
            counter[0] += 1
            return fn(counter[0] - 1, a)
        if isinstance(a, (list, tuple)):
            return type(a)(go(b) for b in a)
        return a

    return go(args)


def _tensors(args) -> list[torch.Tensor]:
    found = []
    _map_tensors(args, lambda i, t: found.append(t) or t)
    return found


def float64_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` on teeny's device, float64 if ``t`` is floating point, that
    requires a gradient where ``t`` does: PyTorch's side of a comparison."""
    copy = t.detach().to(teeny.DEVICE)
    return (copy.double() if copy.is_floating_point() else copy).requires_grad_(t.requires_grad)


class Compared(NamedTuple):
    """teeny's output and the gradients of the differentiated tensors, on the CPU."""

    out: torch.Tensor
    grads: list[torch.Tensor]


def assert_matches_torch(
    teeny_fn: Callable,
    torch_fn: Callable,
    *args,
    kwargs: dict | None = None,
    dtype: torch.dtype | None = None,
    reduction: int = 1,
    out_dtype: torch.dtype | None = None,
    tol: tuple[float, float] | None = None,
    grad: Sequence[int] | None = None,
    grad_out: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
    backward: bool = True,
    equal_nan: bool = False,
    name: str = "teeny",
) -> Compared:
    """``teeny_fn`` (through ``teeny.torch.apply``, on teeny's device) against ``torch_fn`` on
    float64 copies of the same arguments: the output, then the gradient of every differentiated
    tensor for one output gradient (``grad_out``, else float64 normal noise from ``gen``).

    ``args`` are tensors (in nested lists too) and plain values, used as they are: a float tensor
    is differentiated unless ``grad`` lists the indices of those that are. ``kwargs`` (the op's
    keyword arguments; tensors among them are moved, not differentiated) go to both functions.
    The tolerance is ``tol`` = (atol, rtol), else the registry's rule for ``dtype`` (by default
    the first float argument's), ``reduction`` terms and ``out_dtype``; when ``dtype`` is given,
    a float output must come out in ``out_dtype`` or ``dtype``. ``backward=False`` (an
    inference-only op) compares the output alone."""
    kwargs = kwargs or {}
    ours = _map_tensors(
        args,
        lambda i, t: (
            t.detach().clone().to(teeny.DEVICE).requires_grad_(t.is_floating_point() and (grad is None or i in grad))
        ),
    )
    theirs = _map_tensors(ours, lambda i, t: float64_copy(t))
    our_kwargs = {k: v.to(teeny.DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    their_kwargs = {k: float64_copy(v) if isinstance(v, torch.Tensor) else v for k, v in our_kwargs.items()}
    floats = [t for t in _tensors(args) if t.is_floating_point()]
    if tol is None:
        tol = tolerance(dtype or (floats[0].dtype if floats else torch.float32), reduction, *filter(None, [out_dtype]))
    atol, rtol = tol

    out = apply(teeny_fn, *ours, **our_kwargs)
    expected = torch_fn(*theirs, **their_kwargs)
    if dtype is not None and expected.is_floating_point():
        assert out.dtype == (out_dtype or dtype), f"{name}: output in {out.dtype}, not {out_dtype or dtype}"
    torch.testing.assert_close(
        out.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=equal_nan, msg=lambda m: f"{name} forward: {m}"
    )
    inputs = [t for t in _tensors(ours) if t.requires_grad]
    if not backward or not inputs or out.numel() == 0 or not expected.requires_grad:
        return Compared(out.detach().cpu(), [])
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=gen or torch.Generator().manual_seed(0), dtype=torch.float64)
    grad_out = grad_out.to(teeny.DEVICE)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)
    ref_inputs = [t for t in _tensors(theirs) if t.requires_grad]
    ref_grads = torch.autograd.grad(expected, ref_inputs, grad_out.to(expected.dtype), allow_unused=True)
    for index, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g is not None, f"{name}: no gradient for input {index}"
        r = torch.zeros_like(ref_inputs[index]) if r is None else r
        torch.testing.assert_close(
            g.double(),
            r.double(),
            atol=atol,
            rtol=rtol,
            equal_nan=equal_nan,
            msg=lambda m, i=index: f"{name} grad of input {i}: {m}",
        )
    return Compared(out.detach().cpu(), [g.cpu() for g in grads])


# ------------------------------------------------------------------------- the executor


def run_teeny(fn: Callable, *tensors: torch.Tensor, mode: LoweringMode = LoweringMode.INFERENCE):
    """``fn`` traced on graph inputs ``x0, x1, ...`` shaped like ``tensors``, lowered in ``mode``
    and run forwards on them: (output, executor, program)."""
    g = teeny.Graph()
    xs = [g.input(f"x{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    g.output(fn(*xs))
    program = lower(g, mode)
    ex = Executor(program)
    return ex.forward({f"x{i}": t.to(teeny.DEVICE) for i, t in enumerate(tensors)}), ex, program


class Step(NamedTuple):
    """One training step: the output, the input gradients, copies of the parameter gradients,
    the executor, and the bytes the forward kept for the backward."""

    out: torch.Tensor
    grads: dict
    param_grads: dict
    executor: Executor
    saved_bytes: int


def train_step(program, feed: dict, seed: int = 0, grad_out: torch.Tensor | None = None, **executor_options) -> Step:
    """A fresh executor of ``program`` (parameters initialised from ``seed``) run forwards and
    backwards once on ``feed``."""
    ex = Executor(program, seed=seed, **executor_options)
    out, cache = ex.forward_train(feed)
    saved = cache.nbytes()
    grads = ex.backward(cache) if grad_out is None else ex.backward(cache, grad_out)
    return Step(out, grads, {k: v.clone() for k, v in ex.grads.items()}, ex, saved)


# ------------------------------------------------------------------------- tests/scripts


def script(name: str) -> Path:
    """The path of ``tests/scripts/<name>.py``."""
    path = SCRIPTS / f"{name}.py"
    assert path.is_file(), path
    return path


def run_script(name: str, *args: str, env: dict | None = None, timeout: float = 600, **options):
    """``python tests/scripts/<name>.py args...`` in a fresh process, its output captured as text
    (``env`` replaces the environment)."""
    command = [sys.executable, str(script(name)), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, **options)


def load_script(name: str) -> ModuleType:
    """``tests/scripts/<name>.py`` imported as a module (for what a test shares with its script)."""
    spec = importlib.util.spec_from_file_location(f"teeny_test_script_{name}", script(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_launches(launches, dtype: torch.dtype) -> None:
    """Run teeny Launches (a product's, say) one after another with each kernel's ``dtype`` instance."""
    from teeny.core.runtime import run_launch

    for launch in launches:
        run_launch(launch, launch.kernel.instance(dtype), "test", 1)


def compile_for_sm90(name: str, cases, timeout: float):
    """Run ``tests/scripts/<name>.py`` (a compile check: it imports ``sm90`` first, compiles
    kernels for the H200 without the interpreter, and prints ``RESULTS <json>`` or ``SKIP <json
    reason>``) on ``cases`` (JSON in its first argument): the parsed results, or a skip."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = run_script(name, json.dumps(cases), env=env, timeout=timeout)
    lines = done.stdout.splitlines()
    skip = [line for line in lines if line.startswith("SKIP ")]
    if skip:
        pytest.skip(json.loads(skip[0][5:]))
    results = [line for line in lines if line.startswith("RESULTS ")]
    assert results, f"{name} crashed:\n{done.stderr[-3000:]}"
    return json.loads(results[0][8:])


def regression_task(name: str = "regression", rows: int = 96, steps: int | None = None, evaluate=None):
    """A user's own graph and data for the training loop: linear regression (mse loss) on ``rows``
    rows of 7 features. ``steps``: what ``steps_per_epoch`` claims (default: the truth);
    ``evaluate``: the task's evaluation. Returns the task and the true weight."""
    from teeny import Graph, nn, ops
    from teeny.training.loop import CallableTask

    gen = torch.Generator().manual_seed(0)
    true_w = torch.randn(1, 7, generator=gen)
    xs = torch.randn(rows, 7, generator=gen)
    ys = xs @ true_w.T + 0.5

    def build(batch):
        g = Graph(name)
        x, y = g.input("x", (batch, 7)), g.input("y", (batch, 1))
        g.output(ops.mse_loss(nn.Linear(7, 1)(x), y))
        return g

    def batches(epoch, batch, seed):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for i in range(0, rows - batch + 1, batch):
            yield {"x": xs[order[i : i + batch]], "y": ys[order[i : i + batch]]}

    declared = (lambda batch: rows // batch) if steps is None else (lambda batch: steps)
    task = CallableTask(name, build, batches, declared, **({"evaluate": evaluate} if evaluate else {}))
    return task, true_w


@pytest.fixture
def fresh_compile():
    """A test of ``torch.compile(backend="teeny")`` starts and ends with dynamo's caches and the
    backend's reports empty (``pytestmark = pytest.mark.usefixtures("fresh_compile")``)."""
    from teeny.torch import backend

    torch._dynamo.reset()
    backend.reset()
    yield
    torch._dynamo.reset()


def assert_same_step(actual, expected, what: str) -> None:
    """Two training steps' (loss, {name: gradient}) agree: the loss and every gradient, to float32's
    tolerance for sums of 64 terms (``teeny.torch.patch`` against the model unpatched)."""
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    atol, rtol = tolerance(torch.float32, 64)
    torch.testing.assert_close(loss, expected_loss, atol=atol, rtol=rtol, msg=lambda m: f"{what}: loss: {m}")
    assert grads.keys() == expected_grads.keys(), what
    for name, g in expected_grads.items():
        assert grads[name] is not None, f"{what}: {name}: no gradient"
        torch.testing.assert_close(grads[name], g, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {name}: {m}")


def shift_weights(*models) -> None:
    """The same change to every parameter of each model (a training step's, as an EMA copy sees)."""
    for model in models:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@contextlib.contextmanager
def float32_precision_kept():
    """On a GPU, ``TrainingArguments(torch_compile=True)`` turns TF32 on for the whole process
    whatever the backend (transformers' ``enable_tf32``, accelerate's ``AcceleratorState``): torch's
    float32 precision flags are put back, for the eager reference and the tests after."""

    def owner(name):
        found = torch.backends
        for part in filter(None, name.split(".")):
            found = getattr(found, part, None)
        return found

    names = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv")
    flags = [(o, "fp32_precision", o.fp32_precision) for o in map(owner, names) if hasattr(o, "fp32_precision")]
    if not flags:  # torch before 2.9
        flags = [(o, "allow_tf32", o.allow_tf32) for o in (torch.backends.cuda.matmul, torch.backends.cudnn)]
    matmul = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        for o, name, value in flags:
            setattr(o, name, value)
        torch.set_float32_matmul_precision(matmul)  # torch >= 2.9: the legacy flags agree again
        for o, name, value in flags:
            setattr(o, name, value)
        try:  # torch 2.11 on a GPU can be left with the two APIs disagreeing (Lightning's check then raises)
            torch.get_float32_matmul_precision()
        except RuntimeError:
            torch.set_float32_matmul_precision(matmul)  # the legacy setter sets every backend's alike


# ----------------------------------------------------------------------------- the executor's replay tests
# (test_replay.py, test_run_tapes.py): a graph of tokens (idx), a float input x and class targets


def token_model(fan_out: bool = False) -> teeny.Graph:
    """Tokens through an embedding, a product with a (..., d) input, layer norm and a loss; with
    ``fan_out`` a residual block reads the norm's output twice (its gradients add)."""
    from teeny import Graph, ops
    from teeny.core.init import normal

    g = Graph("replayed")
    idx = g.input("idx", (4, 6), torch.int64)
    x = g.input("x", (4, 6, 8), requires_grad=True)
    target = g.input("target", (24,), torch.int64)
    table, w, b, ln_w, ln_b = (
        g.parameter(name, shape, init=normal(0.5))
        for name, shape in [("table", (10, 8)), ("w", (5, 8)), ("b", (5,)), ("ln_w", (8,)), ("ln_b", (8,))]
    )
    h = ops.layer_norm(ops.embedding(idx, table) + x * 2.0, (8,), ln_w, ln_b)
    logits = ops.linear(h + ops.gelu(h) if fan_out else ops.gelu(h), w, b)
    g.output(ops.cross_entropy(ops.reshape(logits, (24, 5)), target))
    return g


def token_feed(seed: int) -> dict:
    """On the executor's device: a CPU tensor given to a GPU program is copied over, and the
    copy (not the caller's tensor) is what the backward reads."""
    gen = torch.Generator().manual_seed(seed)
    feed = {
        "idx": torch.randint(0, 10, (4, 6), generator=gen),
        "x": torch.randn(4, 6, 8, generator=gen),
        "target": torch.randint(0, 5, (24,), generator=gen),
    }
    return {name: t.to(teeny.DEVICE) for name, t in feed.items()}


def token_step(ex: Executor, feed: dict, zero_grad: bool = True):
    if zero_grad:
        ex.zero_grad()
    loss, cache = ex.forward_train(feed)
    grads = ex.backward(cache)
    return loss.clone(), grads["x"].clone(), {name: g.clone() for name, g in ex.grads.items()}


def assert_same_token_steps(a, b) -> None:
    """The same numbers; to the last bit but for the embedding table's gradient on a GPU, whose
    backward adds rows with atomics (in whatever order they land)."""
    loss_a, dx_a, grads_a = a
    loss_b, dx_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(dx_a, dx_b, rtol=0, atol=0)
    for name in grads_a:
        atomic = name == "table" and teeny.DEVICE.type == "cuda"
        tol = dict(rtol=1e-6, atol=1e-7) if atomic else dict(rtol=0, atol=0)
        torch.testing.assert_close(grads_a[name], grads_b[name], **tol, msg=name)
