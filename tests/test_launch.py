"""The launch contract itself: packing by name, optional pointers, the BLOCK of a launch, the
default grids, float64 scalars, row-strided gradients, and failures that name op, node,
kernel and parameter (what tests/test_core.py's custom ops do not cover)."""

import math
import sys

import pytest
import torch
import triton  # noqa: I001  (after teeny: teeny chooses the interpreter first)
import triton.language as tl

import teeny
import teeny.ops  # noqa: F401  (every op family's kernels, for the registry)
from teeny import Graph, LoweringMode, RuntimeOp, lower, ops
from teeny.core.common import wait_for_previous
from teeny.core.errors import PackingError
from teeny.core.kernel import REGISTRY, Kernel, intercept_launches, kernel, record_launches
from teeny.core.runtime import ArgVisitor, Block, Launch, run_launch


@kernel
def _axpb_backward(x_ptr, dy_ptr, dx_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dx_ptr + offs, a * tl.load(dy_ptr + offs, mask=mask), mask=mask)


@kernel(backward=_axpb_backward, optional=("b_ptr",))
def _axpb_forward(x_ptr, b_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    """y = a * x (+ b)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = a * tl.load(x_ptr + offs, mask=mask)
    if b_ptr is not None:
        y += tl.load(b_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, y, mask=mask)


class Axpb(RuntimeOp):
    """y = a * x (+ b): one kernel each way, packed by name, BLOCK from block()."""

    name = "axpb"
    kernel = _axpb_forward
    saves_inputs = False

    def __init__(self, a: float, with_b: bool = False, block: int = 16):
        self.a, self.with_b, self.size = a, with_b, block
        self.n_activation_inputs = 2 if with_b else 1

    def block(self):
        return Block(size=self.size, num_warps=2)

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        b = inputs[1] if self.with_b else None
        visitor.visit(x_ptr=inputs[0], b_ptr=b, y_ptr=output, n=output.numel(), a=self.a)

    def pack_backward_args(self, inputs, params, output, output_shape, dy, dy_stride, dx, dparams, visitor, saved=None):
        visitor.visit(x_ptr=dy, dy_ptr=dy, dx_ptr=dx[0], n=dy.numel(), a=self.a)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)


def _run(op, *tensors, train=False):
    g = Graph()
    xs = [g.input(f"x{i}", t.shape, t.dtype, requires_grad=train and i == 0) for i, t in enumerate(tensors)]
    g.output(g.apply(op, xs, name="the_node"))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING if train else LoweringMode.INFERENCE))
    return ex, {f"x{i}": t for i, t in enumerate(tensors)}


def test_named_packing_with_an_optional_pointer_and_block_size():
    x, b = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    ex, feed = _run(Axpb(0.3, with_b=True), x, b)
    torch.testing.assert_close(ex.forward(feed).cpu(), 0.3 * x + b)
    ex, feed = _run(Axpb(0.3), x)  # b_ptr left out: None, declared optional
    with record_launches() as log:
        out = ex.forward(feed)
    torch.testing.assert_close(out.cpu(), 0.3 * x, rtol=0, atol=0)
    assert [r.grid for r in log] == [(math.ceil(37 / 16), 1, 1)]  # the default grid follows block().size


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, scale * tl.load(x_ptr + offs, mask=mask), mask=mask)


def _halve_arguments(src_ptr, dst_ptr, BLOCK: tl.constexpr) -> list:
    """What teeny packs (two tensors) -> what the Triton function takes."""
    return [src_ptr, dst_ptr, src_ptr.numel(), 0.5, BLOCK]


_halve = Kernel(_scaled_copy, arguments=_halve_arguments, name="_halve", register=False)


def test_a_kernel_with_arguments_packs_its_own_signature_and_launches_tritons():
    """``Kernel(arguments=...)`` (matmul_ws: TMA descriptors made on the host): teeny checks and
    packs the arguments function's signature, the launch passes what it returns to Triton."""
    assert [p.name for p in _halve.params] == ["src_ptr", "dst_ptr", "BLOCK"]
    x = torch.randn(37, dtype=torch.float64, device=teeny.DEVICE)
    y = torch.zeros_like(x)
    launch = Launch(_halve, (3,), ArgVisitor().visit(src_ptr=x, dst_ptr=y), Block(size=16))
    run_launch(launch, _halve.instance(torch.float64), "test", 37)
    torch.testing.assert_close(y.cpu(), 0.5 * x.cpu(), rtol=0, atol=0)
    with pytest.raises(PackingError, match="n"):  # the Triton function's own parameters are not teeny's
        run_launch(Launch(_halve, (3,), ArgVisitor().visit(x_ptr=x, y_ptr=y, n=37), Block(size=16)),
                   _halve.instance(torch.float64), "test", 37)  # fmt: skip


@triton.jit
def _waiting_copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    wait_for_previous()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def test_a_pdl_kernel_is_launched_to_overlap_the_one_before_it_only_where_the_gpu_can(monkeypatch):
    """``@kernel(pdl=True)``: Triton gets ``launch_pdl`` where the GPU has programmatic dependent
    launch (Hopper) and ``teeny.core.config.pdl`` is on, never otherwise; under the interpreter
    ``wait_for_previous`` is nothing and the kernel computes as any other."""
    waiting = Kernel(_waiting_copy, pdl=True, name="_waiting_copy", register=False)
    x = torch.randn(37, device=teeny.DEVICE)
    y = torch.zeros_like(x)
    run_launch(Launch(waiting, (3,), ArgVisitor().visit(src_ptr=x, dst_ptr=y, n=37), Block(size=16)),
               waiting.instance(torch.float32), "test", 37)  # fmt: skip
    torch.testing.assert_close(y, x, rtol=0, atol=0)

    def options(kernel, capable, pdl):  # what the launch would hand Triton
        monkeypatch.setattr(sys.modules["teeny.core.kernel"], "_pdl_capable", lambda: capable)
        monkeypatch.setattr(teeny.core.config, "pdl", pdl)
        seen = []
        with intercept_launches(lambda instance, jit, grid, args, options: seen.append(options)):
            kernel.instance(torch.float32).launch((1,), [x, y, 37, 16], num_warps=4)
        return seen[0]

    assert options(waiting, True, True) == {"num_warps": 4, "launch_pdl": True}
    assert options(waiting, False, True) == {"num_warps": 4}  # not Hopper
    assert options(waiting, True, False) == {"num_warps": 4}  # switched off
    plain = Kernel(_waiting_copy, name="_plain_copy", register=False)
    assert options(plain, True, True) == {"num_warps": 4}  # not declared: it may read before the wait


def test_every_kernel_declared_pdl_waits_for_the_previous_one():
    """A kernel launched to overlap the one before it must wait before it touches memory; the
    products and attention (the kernels the launch gaps sat before) are declared so."""
    declared = {name for name, k in REGISTRY.items() if k.pdl}
    assert {"matmul_ws", "matmul_tma", "matmul_sum_segments", "matmul_product", "attention_forward",
            "attention_backward_dq", "attention_backward_dkdv"} <= declared  # fmt: skip
    for name in declared:
        assert "wait_for_previous()" in REGISTRY[name].source, name


def test_float_scalars_reach_float64_kernels_as_float64_and_others_as_float32():
    for dtype, expected in ((torch.float64, "fp64"), (torch.float32, "fp32")):
        ex, feed = _run(Axpb(0.1), torch.randn(5, dtype=dtype), train=True)
        with record_launches() as log:
            out, cache = ex.forward_train(feed)
            ex.backward(cache, torch.ones(5, dtype=dtype))
        kernels = {r.kernel: r.scalar_types for r in log}
        assert kernels["_axpb_forward"] == {"n": "i32", "a": expected}
        assert kernels["_axpb_backward"]["a"] == expected


def test_float64_variant_is_typed_float64():
    jit = _axpb_forward.jit_with_float64(frozenset({"a"}))
    assert jit is _axpb_forward.jit_with_float64(frozenset({"a"}))  # built once
    assert jit.fn.__annotations__["a"] is tl.float64 if hasattr(jit, "fn") else True


class _Misnamed(Axpb):
    name = "misnamed"

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], y_ptr=output, n=output.numel(), alpha=self.a)


class _NoneForRequired(Axpb):
    name = "none_for_required"

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], y_ptr=None, n=output.numel(), a=self.a)


class _PositionalWrongName(Axpb):
    name = "positional_wrong_name"

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit_ptr(inputs[0]).visit_ptr(None, "b_ptr").visit_ptr(output, "y_ptr")  # partly named: positional
        visitor.visit_i32(output.numel(), "a").visit_float(self.a, "n").visit_constexpr(16, "BLOCK")


class _TwoBackwardLaunchesOfAnUndeclaredKernel(Axpb):
    name = "undeclared"

    def backward_launches(self, ctx):
        args = ArgVisitor().visit(
            x_ptr=ctx.grad_output, b_ptr=None, y_ptr=ctx.grad_inputs[0], n=ctx.grad_output.numel(), a=self.a
        )
        return [Launch(_axpb_forward, (1,), args, 16), Launch(_other_forward, (1,), args, 16)]


@kernel(optional=("b_ptr",))
def _other_forward(x_ptr, b_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize(
    "op, pattern",
    [
        (_Misnamed(0.5), r"misnamed \(node 'the_node', forward\): kernel _axpb_forward has no parameter 'alpha'"),
        (_NoneForRequired(0.5), r"argument 2 'y_ptr' got None, but the pointer is not declared optional"),
        (_PositionalWrongName(0.5), r"argument 3 is 'n', but the visit there names 'a'"),
    ],
)
def test_packing_mistakes_name_op_node_kernel_and_parameter(op, pattern):
    with pytest.raises(teeny.PackingError, match=pattern):
        _run(op, torch.randn(4))


def test_a_packing_plan_made_once_still_checks_each_launchs_values():
    from teeny.core.runtime import check_packing

    x, y = torch.randn(4), torch.empty(4)
    good = ArgVisitor().visit(x_ptr=x, y_ptr=y, n=4, a=0.5)
    assert check_packing(_axpb_forward, good, "here", 16) == [x, None, y, 4, 0.5, 16]
    # the same names and kinds: the plan is reused, and the values are checked again
    with pytest.raises(teeny.PackingError, match=r"there: kernel _axpb_forward argument 2 'y_ptr' got None"):
        check_packing(_axpb_forward, ArgVisitor().visit(x_ptr=x, y_ptr=None, n=4, a=0.5), "there", 16)
    with pytest.raises(teeny.PackingError, match=r"argument 0 'x_ptr' is a pointer, but a int was packed there"):
        check_packing(_axpb_forward, ArgVisitor().visit(x_ptr=3, y_ptr=y, n=4, a=0.5), "there", 16)
    with pytest.raises(teeny.PackingError, match=r"argument 3 'n' is a scalar scalar, but 'four' was packed there"):
        check_packing(_axpb_forward, ArgVisitor().visit(x_ptr=x, y_ptr=y, n="four", a=0.5), "there", 16)
    assert check_packing(_axpb_forward, ArgVisitor().visit(x_ptr=x, y_ptr=y, n=4.0, a=1), "here", 16)[3:5] == [4.0, 1]
    positional = ArgVisitor().visit_ptr(x).visit_ptr(None).visit_ptr(y).visit_i64(2**40).visit_float(2.0)
    assert check_packing(_axpb_forward, positional.visit_constexpr(16), "here") == [x, None, y, 2**40, 2.0, 16]
    positional = ArgVisitor().visit_ptr(x).visit_ptr(None).visit_ptr(None).visit_i64(2**40).visit_float(2.0)
    with pytest.raises(teeny.PackingError, match=r"argument 2 'y_ptr' got None"):
        check_packing(_axpb_forward, positional.visit_constexpr(16), "here")


def test_backward_may_only_launch_kernels_the_forward_kernel_declares():
    with pytest.raises(teeny.TeenyError, match=r"launches kernel _other_forward, which is not declared as a backward"):
        _run(_TwoBackwardLaunchesOfAnUndeclaredKernel(0.5), torch.randn(4), train=True)


class _NoBackwardGrid(Axpb):
    name = "no_backward_grid"
    backward_grid = RuntimeOp.backward_grid


def test_a_backward_kernel_without_backward_grid_is_refused_at_lowering():
    with pytest.raises(teeny.GridError, match=r"no_backward_grid has a backward kernel but no backward_grid"):
        _run(_NoBackwardGrid(0.5), torch.randn(4), train=True)
    _run(_NoBackwardGrid(0.5), torch.randn(4))  # inference needs no backward grid


BROKEN = """
@triton.jit
def broken_forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.no_such_function(tl.load(x_ptr + offs)))
"""


class Broken(teeny.CustomOp):
    name = "broken"

    def lower_source(self):
        return BROKEN

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], y_ptr=output, n=output.numel(), BLOCK=8)

    def grid(self, input_shapes, output_shape):
        return (1, 1, 1)


def test_a_kernel_that_fails_to_compile_names_op_node_dtype_and_shapes():
    ex, feed = _run(Broken(), torch.randn(2, 3, dtype=torch.float64))  # lowering cannot see it: no compile there
    with pytest.raises(
        teeny.core.errors.KernelLaunchError,
        match=r"op broken \(node 'the_node', forward\): kernel broken_forward for float64 failed "
        r"on inputs \(2, 3\):",
    ):
        ex.forward(feed)


class _RowGrad(RuntimeOp):
    """y = x; dx = dy read by rows through grad_output_row_stride (a 2-D copy kernel)."""

    name = "row_grad"
    kernel = None
    strided_grad_output = True
    seen_strides: list = []

    def view(self, inputs):
        return inputs[0]

    def has_backward(self):
        return True

    def backward_launches(self, ctx):
        type(self).seen_strides.append((ctx.grad_output_row_stride, ctx.grad_output.is_contiguous()))
        ctx.grad_inputs[0] = ctx.grad_output.contiguous()
        return []


def test_row_strided_grad_output_reaches_ops_that_read_rows_without_a_copy():
    g = Graph()
    x = g.input("x", (3, 4), torch.float64, requires_grad=True)
    g.output(g.apply(_RowGrad(), [x]))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    big = torch.arange(30, dtype=torch.float64, device=ex.device).view(3, 10)  # sliced where it lives
    _, cache = ex.forward_train({"x": torch.zeros(3, 4, dtype=torch.float64)})
    grads = ex.backward(cache, big[:, 2:6])
    assert _RowGrad.seen_strides[-1] == (10, False)
    torch.testing.assert_close(grads["x"].cpu(), big[:, 2:6].cpu())


def test_summary_counts_the_launches_a_step_makes_and_what_it_saves():
    from teeny import fusions
    from teeny.training.models import MLP

    g = Graph("mlp")
    x = g.input("x", (5, 8))
    y = g.input("y", (5,), torch.int64)
    g.output(teeny.ops.cross_entropy(MLP(8, 16, 3)(x), y))
    program = lower(g, LoweringMode.TRAINING, rewrites=())  # a node per op
    ex = teeny.Executor(program)
    with record_launches() as log:
        _, cache = ex.forward_train({"x": torch.randn(5, 8), "y": torch.tensor([0, 1, 2, 1, 0])})
        ex.backward(cache)
    planned = sum(len(p.forward_launches) + len(p.backward_launches) for p in program.nodes)
    assert len([r for r in log if r.kernel != "accumulate_kernel"]) == planned
    text = program.summary()
    assert f"{sum(len(p.forward_launches) for p in program.nodes)} forward" in text
    assert all(p.name in text for p in program.nodes)
    # saving a graph input or a parameter costs nothing extra; gelu keeps its input (5x16 float32)
    # and fc2 keeps gelu's output (5x16): the same sizes, counted per node
    fc1, gelu, fc2 = program.nodes[:3]
    assert program.saved_bytes(fc1) == 0
    assert program.saved_bytes(gelu) == program.saved_bytes(fc2) == 5 * 16 * 4
    assert program.peak_activation_bytes() >= 2 * 5 * 16 * 4
    # fused (fusions.fuse_mlp), one node keeps both: gelu's input and its output
    fused = lower(g, LoweringMode.TRAINING, rewrites=(fusions.fuse_mlp,))
    (mlp,) = [p for p in fused.nodes if p.op.name == "mlp"]
    assert fused.saved_bytes(mlp) == 2 * 5 * 16 * 4
    # the products' flops, 2 a multiply-add: fc1 5x8 @ 8x16, fc2 5x16 @ 16x3; backwards fc1's dW
    # (x wants no gradient), fc2's dX and dW; fused, the same
    fc1_flops, fc2_flops = 2 * 5 * 8 * 16, 2 * 5 * 16 * 3
    assert program.flops() == fused.flops() == (fc1_flops + fc2_flops, fc1_flops + 2 * fc2_flops)
    assert "products: 1.76e-06 GFLOP forward, 2.24e-06 GFLOP backward" in text


def test_saved_totals_count_each_buffer_once():
    """gelu keeps its input h and a linear keeps a reshape view of h (one buffer): the per-node
    saves count h twice, the program's total and its peak once."""
    g = Graph("views")
    x = g.input("x", (512, 64), requires_grad=True)
    h = ops.linear(x, g.parameter("w1", (512, 64), teeny.core.init.normal(0.5)))
    a = ops.gelu(h)
    b = ops.linear(ops.reshape(h, (256, 1024)), g.parameter("w2", (3, 1024), teeny.core.init.normal(0.5)))
    g.output(ops.add(ops.sum(a), ops.sum(b)))
    program = lower(g, LoweringMode.TRAINING)
    mib = 2**20  # h is 512 x 512 float32
    assert sum(program.saved_bytes(p) for p in program.nodes) == 2 * mib
    assert program.saved_total_bytes() == mib
    assert "saved for backward 1.00 MiB" in program.summary()
    assert 2 * mib <= program.peak_activation_bytes() < 2.1 * mib  # h and gelu's output, h once
