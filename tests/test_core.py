"""The core runtime: lowering modes, loud failures, executor bookkeeping, CustomOp from source."""

import math
import os
import weakref

import pytest
import torch

import teeny
from helpers import run_script
from teeny import CustomOp, Graph, LoweringMode, RuntimeOp, lower, ops
from teeny.core.kernel import built_instances
from teeny.ops.activation import activation_backward, activation_forward

# ------------------------------------------------------------------------------ custom op

SQUARE_FORWARD = """
@triton.jit
def scaled_square_forward(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, scale * x * x, mask=mask)
"""

SQUARE_BACKWARD = """
@triton.jit
def scaled_square_backward(x_ptr, dy_ptr, dx_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    dy = tl.load(dy_ptr + offs, mask=mask)
    tl.store(dx_ptr + offs, 2.0 * scale * x * dy, mask=mask)
"""


class ScaledSquare(CustomOp):
    """y = scale * x^2, dx = 2 * scale * x * dy; kernels given as source text."""

    name = "scaled_square"
    BLOCK = 64

    def __init__(self, scale=1.5):
        self.scale = scale

    def lower_source(self):
        return SQUARE_FORWARD

    def lower_backward_source(self):
        return SQUARE_BACKWARD

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit_ptr(inputs[0]).visit_ptr(output).visit_i32(output.numel()).visit_float(self.scale)
        visitor.visit_constexpr(self.BLOCK)

    def grid(self, input_shapes, output_shape):
        return (math.ceil(math.prod(output_shape) / self.BLOCK), 1, 1)

    def pack_backward_args(self, inputs, params, output, output_shape, dy, dy_stride, dx, dparams, visitor, saved=None):
        visitor.visit_ptr(inputs[0]).visit_ptr(dy).visit_ptr(dx[0]).visit_i32(dy.numel())
        self.pack_backward_scale(visitor)
        visitor.visit_constexpr(self.BLOCK)

    def pack_backward_scale(self, visitor):
        visitor.visit_float(self.scale)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)


class InferenceOnlySquare(ScaledSquare):
    name = "inference_only_square"

    def lower_backward_source(self):
        return ""


def scaled_square(x, scale=1.5):
    return x.graph.apply(ScaledSquare(scale), [x])


def test_custom_op_from_source_forward_and_gradcheck():
    x = torch.randn(3, 37, dtype=torch.float64)
    teeny.gradcheck(scaled_square, x)
    y = teeny.torch.apply(scaled_square, x.float())
    torch.testing.assert_close(y, 1.5 * x.float() ** 2)


def test_custom_op_trains():
    g = Graph()
    x = g.input("x", (4, 5))
    w = g.parameter("w", (4, 5), init=teeny.core.init.constant(2.0))
    g.output(ops.sum(scaled_square(x * w)))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    xs = torch.rand(4, 5) + 0.5
    first = None
    for _ in range(20):
        ex.zero_grad()
        out, cache = ex.forward_train({"x": xs})
        first = first if first is not None else float(out)
        ex.backward(cache)
        ex.params["w"].sub_(0.01 * ex.grads["w"])
    assert float(out) < first / 2


def test_custom_op_without_backward_is_inference_only():
    g = Graph()
    x = g.input("x", (3, 7), requires_grad=True)
    g.output(g.apply(InferenceOnlySquare(), [x]))
    program = lower(g, LoweringMode.INFERENCE)
    out = teeny.Executor(program).forward({"x": torch.ones(3, 7)})
    torch.testing.assert_close(out, torch.full((3, 7), 1.5))
    with pytest.raises(teeny.MissingBackwardError, match="inference_only_square.*has no backward.*input 'x'"):
        lower(g, LoweringMode.TRAINING)


# ------------------------------------------------------------------------------ lowering


def test_inference_builds_no_backward_kernel_and_keeps_no_activation():
    g = Graph()
    x = g.input("x", (6, 5))
    g.output(ops.gelu(ops.relu(ops.gelu(x))))
    before = len(built_instances())
    program = lower(g, LoweringMode.INFERENCE)
    new = built_instances()[before:]
    assert all(name != activation_backward.name for name, _ in new)
    assert not any(inst.kernel is activation_backward for inst in program.instances.values())
    ex = teeny.Executor(program)
    ex.forward({"x": torch.randn(6, 5)})
    assert ex.live_values == 0  # every intermediate freed after its last consumer
    with pytest.raises(teeny.TeenyError, match="lowered for INFERENCE"):
        ex.forward_train({"x": torch.randn(6, 5)})


def test_training_builds_backward_kernels_and_cache_holds_only_declared():
    g = Graph()
    x = g.input("x", (6, 5), requires_grad=True)
    a = ops.relu(x)
    b = ops.gelu(a)
    g.output(ops.gelu(b))
    program = lower(g, LoweringMode.TRAINING)
    assert any(inst.kernel is activation_backward for inst in program.instances.values())
    ex = teeny.Executor(program)
    out, cache = ex.forward_train({"x": torch.randn(6, 5)})
    # each activation saves its input only: x, a, b
    assert cache.num_tensors() == 3
    assert all(entry["output"] is None for entry in cache.entries.values())
    ex.backward(cache, torch.ones(6, 5))
    assert len(cache) == 0 and cache.num_tensors() == 0
    with pytest.raises(teeny.TeenyError, match="already consumed"):
        ex.backward(cache, torch.ones(6, 5))


def test_cache_entries_are_freed_as_backward_walks():
    g = Graph()
    x = g.input("x", (4, 3), requires_grad=True)
    g.output(ops.gelu(ops.gelu(ops.gelu(x))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    _, cache = ex.forward_train({"x": torch.randn(4, 3)})
    sizes = []
    original = ex._node_backward

    def spy(p, *args):
        sizes.append(len(cache))
        original(p, *args)

    ex._node_backward = spy
    ex.backward(cache, torch.ones(4, 3))
    assert sizes == [2, 1, 0]


def test_saved_tensors_are_freed_as_backward_walks():
    """A node's saved tensors are freed once its backward has run (as torch's autograd frees
    them), so a step's peak is not every saved tensor plus the backward's gradients."""
    g = Graph()
    x = g.input("x", (4, 3), requires_grad=True)
    g.output(ops.gelu(ops.gelu(ops.gelu(x))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    xs = torch.randn(4, 3, device=teeny.DEVICE)  # on the executor's device, the saved x is the caller's
    _, cache = ex.forward_train({"x": xs})
    input_storage = xs.untyped_storage().data_ptr()
    saved = [weakref.ref(t) for t in cache.tensors() if t.untyped_storage().data_ptr() != input_storage]
    assert len(saved) == 2  # gelu(x) and gelu(gelu(x)); x is the caller's
    alive = []
    original = ex._node_backward

    def spy(p, *args):
        alive.append(sum(ref() is not None for ref in saved))
        original(p, *args)

    ex._node_backward = spy
    ex.backward(cache, torch.ones(4, 3))
    assert alive == [2, 1, 0]


def test_an_activation_writes_its_gradient_over_the_gradient_it_reads():
    """gelu's backward reads dy and writes dx element by element: the executor hands it dy's
    buffer (when nothing else holds it) rather than a new one; never the caller's seed."""
    g = Graph()
    x = g.input("x", (4, 3), requires_grad=True)
    g.output(ops.gelu(ops.tanh(ops.gelu(x))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    xs = torch.randn(4, 3, device=teeny.DEVICE)
    reused = []
    original = ex._node_backward

    def spy(p, entry, grad_out, grads, buffer=None, addend=None):
        reused.append(buffer is grad_out)
        original(p, entry, grad_out, grads, buffer, addend)

    ex._node_backward = spy
    seed = torch.ones(4, 3, device=teeny.DEVICE)
    grads = ex.backward(ex.forward_train({"x": xs})[1], seed)
    assert reused == [False, True, True]  # not the first: its dy is the caller's seed
    assert torch.equal(seed, torch.ones_like(seed))
    xr = xs.clone().requires_grad_()
    torch.nn.functional.gelu(torch.tanh(torch.nn.functional.gelu(xr))).backward(seed)
    torch.testing.assert_close(grads["x"], xr.grad)


def test_a_gradient_shared_by_two_inputs_is_not_written_over():
    """add's backward hands one dy to both of its inputs; each feeds a gelu, whose backward
    must then not write over it (the other gelu still reads it)."""
    g = Graph()
    a = g.input("a", (3, 5), requires_grad=True)
    b = g.input("b", (3, 5), requires_grad=True)
    g.output(ops.mul(ops.add(ops.gelu(a), ops.gelu(b)), g.constant(torch.linspace(-2, 2, 15).reshape(3, 5))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    feed = {"a": torch.randn(3, 5), "b": torch.randn(3, 5)}
    grads = ex.backward(ex.forward_train(feed)[1], torch.ones(3, 5, device=teeny.DEVICE))
    ar, br = (feed[k].clone().requires_grad_() for k in "ab")
    (
        (torch.nn.functional.gelu(ar) + torch.nn.functional.gelu(br)) * torch.linspace(-2, 2, 15).reshape(3, 5)
    ).sum().backward()
    torch.testing.assert_close(grads["a"].cpu(), ar.grad)
    torch.testing.assert_close(grads["b"].cpu(), br.grad)


def _residual_graph(shared_with_another_input: bool) -> Graph:
    """s = x + r read by a layer_norm (fused with the add: input 0 of its AddNormOp) and by a later
    add; with ``shared_with_another_input`` s first feeds t = s + exp(a), whose backward hands one
    dy to s and to exp(a), whose own backward runs after the norm's."""
    g = Graph()
    x, r, a = (g.input(n, (6, 37), dtype=torch.float64, requires_grad=True) for n in "xra")
    w = g.input("w", (37,), dtype=torch.float64, requires_grad=True)
    u = ops.exp(a)
    s = ops.add(x, r)
    y = ops.layer_norm(s, [37], w, None)
    t = ops.add(s, u) if shared_with_another_input else s
    g.output(
        ops.mul(ops.add(t, ops.gelu(y)), g.constant(torch.linspace(-2, 2, 6 * 37, dtype=torch.float64).reshape(6, 37)))
    )
    return g


@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_a_norm_adds_its_input_gradient_to_the_one_waiting(monkeypatch, shared, looped, gen):
    """A residual stream read by a norm and by a later add: the norm's backward adds its dx to the
    gradient the add left (``grad_accumulates``), and no accumulate launch sums the two: in place,
    or into a new buffer when that gradient is shared with one still waiting (the add's dy handed
    to two inputs), which it must not write over. The gradients are torch's either way (float64), with rows in one block
    and (``looped``) in blocks of 16."""
    from teeny.ops.norm import tiling
    from teeny.ops.norm.ops import NormOp
    from teeny.program import executor as executor_module

    if looped:
        monkeypatch.setattr(tiling, "MAX_BLOCK", 16)

    sums = []
    original = executor_module.accumulate
    monkeypatch.setattr(executor_module, "accumulate", lambda *a: (sums.append(1), original(*a))[1])
    feed = {n: torch.randn(6, 37, generator=gen, dtype=torch.float64) for n in "xra"}
    feed["w"] = torch.randn(37, generator=gen, dtype=torch.float64)
    results = {}
    for adds in (True, False):
        monkeypatch.setattr(NormOp, "grad_accumulates", adds)
        sums.clear()
        ex = teeny.Executor(lower(_residual_graph(shared), LoweringMode.TRAINING))
        seed = torch.ones(6, 37, dtype=torch.float64, device=teeny.DEVICE)
        results[adds] = ex.backward(ex.forward_train(feed)[1], seed)
        assert len(sums) == (0 if adds else 1), (shared, adds)
        assert torch.equal(seed, torch.ones_like(seed))
    ref = {n: t.clone().requires_grad_() for n, t in feed.items()}
    s = ref["x"] + ref["r"]
    t = s + torch.exp(ref["a"]) if shared else s
    y = torch.nn.functional.layer_norm(s, [37], ref["w"])
    const = torch.linspace(-2, 2, 6 * 37, dtype=torch.float64).reshape(6, 37)
    ((t + torch.nn.functional.gelu(y)) * const).sum().backward()
    for n in "xraw" if shared else "xrw":
        for adds in (True, False):
            torch.testing.assert_close(results[adds][n].cpu(), ref[n].grad, rtol=1e-12, atol=1e-12, msg=n)


def test_fan_out_gradients_are_summed():
    g = Graph()
    x = g.input("x", (3, 37), requires_grad=True)
    y1 = ops.gelu(x)
    y2 = ops.relu(x)
    g.output(ops.add(y1, y2))
    xs = torch.randn(3, 37)
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    grads = ex.backward(ex.forward_train({"x": xs})[1], torch.ones(3, 37))
    xr = xs.clone().requires_grad_()
    (torch.nn.functional.gelu(xr) + torch.relu(xr)).sum().backward()
    torch.testing.assert_close(grads["x"], xr.grad)
    g64 = Graph()  # the float64 gradcheck on 3 x 7 of the same values: each element is perturbed twice
    x64 = g64.input("x", (3, 7), dtype=torch.float64, requires_grad=True)
    g64.output(ops.add(ops.gelu(x64), ops.relu(x64)))
    teeny.gradcheck_graph(g64, {"x": xs[:, :7].double()})
    # the same value consumed twice by one node: gelu(x) used twice
    g2 = Graph()
    x2 = g2.input("x", (5,), dtype=torch.float64, requires_grad=True)
    h = ops.gelu(x2)
    g2.output(ops.add(h, h))
    teeny.gradcheck_graph(g2, {"x": torch.randn(5, dtype=torch.float64)})


def test_training_needs_a_gradient_source():
    g = Graph()
    x = g.input("x", (3, 3))
    g.output(ops.gelu(x))
    with pytest.raises(teeny.TeenyError, match="depends on no trainable parameter"):
        lower(g, LoweringMode.TRAINING)


class NoBackwardGelu(RuntimeOp):
    name = "gelu_no_backward"
    kernel = activation_forward

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        from teeny.ops.activation import _gelu_erf

        visitor.visit_ptr(inputs[0]).visit_ptr(output).visit_i64(output.numel()).visit_float(0).visit_float(0)
        visitor.visit_constexpr(_gelu_erf).visit_constexpr(1024)

    def grid(self, input_shapes, output_shape):
        return (1, 1, 1)

    def has_backward(self):
        return False  # launches gelu's forward kernel without its backward half


def test_missing_backward_between_parameter_and_loss_is_an_error_naming_op_and_node():
    g = Graph()
    x = g.input("x", (2, 3))
    w = g.parameter("fc1.weight", (2, 3))
    h = g.apply(NoBackwardGelu(), [ops.add(x, w)], name="mystery")
    g.output(ops.gelu(h))
    with pytest.raises(teeny.MissingBackwardError, match=r"gelu_no_backward \(node 'mystery'\).*'fc1.weight'"):
        lower(g, LoweringMode.TRAINING)
    # inference is fine
    lower(g, LoweringMode.INFERENCE)


def test_stop_gradient_and_frozen_parameters_opt_out():
    g = Graph()
    x = g.input("x", (2, 3))
    w = g.parameter("frozen", (2, 3))
    v = g.parameter("live", (2, 3), init=teeny.core.init.ones())
    h = g.apply(NoBackwardGelu(), [ops.add(x, w)])
    g.output(ops.sum(ops.add(ops.gelu(ops.stop_gradient(h)), v)))
    program = lower(g, LoweringMode.TRAINING)  # no error: the path is cut
    ex = teeny.Executor(program)
    _, cache = ex.forward_train({"x": torch.randn(2, 3)})
    ex.backward(cache)
    torch.testing.assert_close(ex.grads["live"], torch.ones(2, 3))
    assert float(ex.grads["frozen"].abs().sum()) == 0.0
    g2 = Graph()
    x2 = g2.input("x", (2, 3))
    w2 = g2.parameter("frozen", (2, 3), trainable=False)
    v2 = g2.parameter("live", (2, 3))
    g2.output(ops.sum(ops.add(g2.apply(NoBackwardGelu(), [ops.add(x2, w2)]), v2)))
    lower(g2, LoweringMode.TRAINING)


class ZeroGridSquare(ScaledSquare):
    name = "zero_grid_square"

    def backward_grid(self, input_shapes, output_shape):
        return (0, 0, 0)


class MisPackedSquare(ScaledSquare):
    name = "mispacked_square"

    def pack_backward_scale(self, visitor):
        pass  # forgot the scale


class WrongKindSquare(ScaledSquare):
    name = "wrong_kind_square"

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit_ptr(inputs[0]).visit_ptr(output).visit_i32(output.numel()).visit_ptr(inputs[0])
        visitor.visit_constexpr(self.BLOCK)


def _train_graph(op):
    g = Graph()
    x = g.input("x", (3, 5), requires_grad=True)
    g.output(g.apply(op, [x], name="the_node"))
    return g


def test_zero_backward_grid_is_an_error():
    with pytest.raises(teeny.GridError, match=r"zero_grid_square \(node 'the_node', backward\).*grid \(0, 0, 0\)"):
        lower(_train_graph(ZeroGridSquare()), LoweringMode.TRAINING)


def test_wrong_argument_count_is_an_error():
    with pytest.raises(
        teeny.PackingError, match=r"mispacked_square \(node 'the_node', backward\).*takes 6 arguments.*5 were packed"
    ):
        lower(_train_graph(MisPackedSquare()), LoweringMode.TRAINING)


def test_wrong_argument_kind_is_an_error_even_for_inference():
    with pytest.raises(teeny.PackingError, match=r"argument 3 'scale' is scalar, but a ptr was packed"):
        lower(_train_graph(WrongKindSquare()), LoweringMode.INFERENCE)


# ------------------------------------------------------------------------------ bad input


def test_bad_inputs_give_clear_errors():
    g = Graph()
    x = g.input("x", (3, 4))
    g.output(ops.gelu(x))
    ex = teeny.Executor(lower(g))
    with pytest.raises(KeyError, match="missing input 'x'"):
        ex.forward({})
    with pytest.raises(ValueError, match=r"input 'x' has shape \(3, 5\).*lowered for \(3, 4\)"):
        ex.forward({"x": torch.zeros(3, 5)})
    with pytest.raises(TypeError, match="input 'x' has dtype float64, expected float32"):
        ex.forward({"x": torch.zeros(3, 4, dtype=torch.float64)})
    with pytest.raises(KeyError, match="unknown inputs"):
        ex.forward({"x": torch.zeros(3, 4), "y": torch.zeros(1)})


def test_dtype_without_kernel_is_refused_at_lowering():
    g = Graph()
    x = g.input("x", (3, 4), dtype=torch.float16)
    g.output(g.apply(ScaledSquare(), [x]))
    with pytest.raises(teeny.TeenyError, match="no float16 version"):
        lower(g)


def test_mixed_dtypes_are_refused_when_tracing():
    g = Graph()
    a = g.input("a", (3,))
    b = g.input("b", (3,), dtype=torch.float64)
    with pytest.raises(teeny.GraphError, match="different float dtypes"):
        ops.add(a, b)


class WrongGradSquare(ScaledSquare):
    name = "wrong_grad_square"

    def pack_backward_scale(self, visitor):
        visitor.visit_float(2 * self.scale)  # twice the scale: the gradient is twice too large


def test_gradcheck_reports_the_wrong_element():
    x = torch.randn(2, 3, dtype=torch.float64) + 3
    result = teeny.gradcheck(lambda t: t.graph.apply(WrongGradSquare(), [t]), x, raise_on_failure=False)
    assert not result.ok and len(result.mismatches) == 6
    assert "input 'arg0'[(0, 0)]" in result.report()
    with pytest.raises(teeny.GradcheckError, match="numerical .* analytical"):
        teeny.gradcheck(lambda t: t.graph.apply(WrongGradSquare(), [t]), x)
    big = torch.randn(40, 30, dtype=torch.float64) + 3
    result = teeny.gradcheck(
        lambda t: t.graph.apply(WrongGradSquare(), [t]), big, mode="directional", raise_on_failure=False
    )
    assert not result.ok and result.checked == {"input 'arg0'": 1}
    teeny.gradcheck(scaled_square, big, mode="directional")


def test_gradcheck_float32_mode():
    x = torch.randn(3, 7, dtype=torch.float32)
    teeny.gradcheck(ops.gelu, x)  # float32 defaults: h=1e-3 and looser tolerance


@pytest.mark.slow
def test_importing_triton_first_on_the_interpreter_is_a_clear_error():
    if teeny.DEVICE.type != "cpu":
        pytest.skip("only the interpreter cares about import order")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TEENY_DEVICE"] = "cpu"
    result = run_script("triton_before_teeny", env=env, timeout=120)
    assert result.returncode != 0 and "Import a teeny module first" in result.stderr
