"""How an op is launched: ``RuntimeOp``, ``ArgVisitor``, ``OpContext`` and ``CustomOp``.

A ``RuntimeOp`` describes one op of the graph. Its forward half says how to launch the
forward kernel (``pack_args``, ``block``, ``grid``); its training half says how to launch the
backward kernel (``has_backward``, ``pack_backward_args``, ``backward_block``,
``backward_grid``) and what the backward needs saved from the forward (``saves_inputs``,
``saves_output``, ``extra_outputs``). Simple ops only fill these in: the default
``forward(ctx)`` / ``backward(ctx)`` pack the arguments, check them and launch one kernel.
Ops that need several launches (a matmul's dA and dB, a two-pass reduction) override
``forward`` / ``backward`` and call ``ctx.launch`` once per kernel; every launch is checked
the same way, and lowering runs each op once on meta tensors so that packing mistakes and
zero grids are reported before any real launch.

The inputs of a node are its activation inputs followed by its parameters: the first
``n_activation_inputs`` tensors are ``inputs``, the rest ``params`` (checked against
``param_shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .device import INTERPRETER
from .kernel import Kernel, KernelInstance, kernel_from_source

Shape = tuple[int, ...]


class TeenyError(Exception):
    """Base of teeny's own errors."""


class PackingError(TeenyError):
    """Packed arguments do not match the kernel's signature."""


class GridError(TeenyError):
    """A launch grid is empty although there is work to do."""


class MissingBackwardError(TeenyError):
    """An op that gradients must flow through has no backward."""


# ----------------------------------------------------------------------------- ArgVisitor


class ArgVisitor:
    """Collects a launch's arguments in order, with the kind of each."""

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.kinds: list[str] = []

    def visit_ptr(self, tensor: torch.Tensor | None) -> "ArgVisitor":
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise PackingError(f"visit_ptr expects a torch.Tensor, got {type(tensor).__name__}")
        self.args.append(tensor)
        self.kinds.append("ptr")
        return self

    def visit_i32(self, value: int) -> "ArgVisitor":
        value = int(value)
        if not -(2**31) <= value < 2**31:
            raise PackingError(f"visit_i32: {value} does not fit in int32 (use visit_i64)")
        self.args.append(value)
        self.kinds.append("i32")
        return self

    def visit_i64(self, value: int) -> "ArgVisitor":
        self.args.append(int(value))
        self.kinds.append("i64")
        return self

    def visit_f32(self, value: float) -> "ArgVisitor":
        self.args.append(float(value))
        self.kinds.append("f32")
        return self

    def visit_constexpr(self, value: Any) -> "ArgVisitor":
        self.args.append(value)
        self.kinds.append("constexpr")
        return self


def _kind_fits(param_kind: str, visited: str) -> bool:
    if param_kind == visited:
        return True
    if param_kind == "scalar":
        return visited in ("i32", "i64", "f32")
    if param_kind == "i64":
        return visited == "i32"
    return False


def check_packing(kernel: Kernel, visitor: ArgVisitor, where: str) -> None:
    """Raise ``PackingError`` unless the visited arguments match ``kernel``'s signature."""
    params = kernel.params
    if len(visitor.kinds) != len(params):
        expected = ", ".join(f"{p.name}:{p.kind}" for p in params)
        got = ", ".join(visitor.kinds)
        raise PackingError(
            f"{where}: kernel {kernel.name} takes {len(params)} arguments ({expected}) "
            f"but {len(visitor.kinds)} were packed ({got})"
        )
    for index, (param, kind, value) in enumerate(zip(params, visitor.kinds, visitor.args)):
        if not _kind_fits(param.kind, kind):
            raise PackingError(
                f"{where}: kernel {kernel.name} argument {index} '{param.name}' is {param.kind}, "
                f"but a {kind} was packed there"
            )
        if kind == "ptr" and value is None:
            raise PackingError(f"{where}: kernel {kernel.name} argument {index} '{param.name}' got None for a pointer")


# ----------------------------------------------------------------------------- OpContext


@dataclass
class OpContext:
    """Everything one forward or backward run of one node sees.

    ``inputs`` / ``params`` are the node's tensors (in backward: only those the op declared
    saved; the others are ``None``). ``saved`` holds the op's extra outputs (e.g. rstd).
    In backward, ``grad_inputs`` / ``grad_params`` hold a buffer for each input that needs a
    gradient and ``None`` for the others; the op writes (not adds) into them.
    """

    op: "RuntimeOp"
    node_name: str
    dtype: torch.dtype
    inputs: list
    params: list
    output: torch.Tensor | None
    saved: dict[str, torch.Tensor]
    instances: dict[tuple[int, torch.dtype], KernelInstance]
    dry_run: bool = False
    grad_output: torch.Tensor | None = None
    grad_inputs: list = field(default_factory=list)
    grad_params: list = field(default_factory=list)
    input_shapes: list = field(default_factory=list)
    output_shape: Shape = ()
    phase: str = "forward"

    def empty(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A scratch buffer on the right device (a meta tensor during lowering's dry run)."""
        dev = "meta" if self.dry_run else _device_of(self)
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device=dev)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        dev = "meta" if self.dry_run else _device_of(self)
        return torch.zeros(tuple(shape), dtype=dtype or self.dtype, device=dev)

    def launch(self, kernel: Kernel, grid: Sequence[int], visitor: ArgVisitor, work: int | None = None,
               **options: Any) -> None:
        """Check and launch ``kernel`` over ``grid`` with the visited arguments.

        ``work`` is the number of elements the launch is for (default: the output's size in
        forward, the gradient's in backward); with no work an empty grid is skipped, with work
        it is an error. ``options`` go to Triton (``num_warps=8``, ``num_stages=3``; ignored by
        the interpreter).
        """
        where = f"op {self.op.name} (node '{self.node_name}', {self.phase})"
        instance = self.instances.get((id(kernel), self.dtype))
        if instance is None:
            mode = "training" if self.phase == "backward" else "this program"
            raise TeenyError(
                f"{where}: kernel {kernel.name} for {str(self.dtype).replace('torch.', '')} was not built "
                f"for {mode}; an op must declare every kernel it launches in kernels()/backward_kernels()"
            )
        check_packing(kernel, visitor, where)
        grid = tuple(int(g) for g in grid)
        if len(grid) == 0 or len(grid) > 3:
            raise GridError(f"{where}: kernel {kernel.name} grid {grid} must have 1 to 3 dimensions")
        if work is None:
            ref = self.grad_output if self.phase == "backward" else self.output
            work = 1 if ref is None else ref.numel()
        if any(g <= 0 for g in grid):
            if work == 0:
                return
            raise GridError(f"{where}: kernel {kernel.name} has grid {grid} with no programs but {work} elements to compute")
        if self.dry_run:
            return
        if INTERPRETER:
            options = {}
        elif kernel.launch_options:
            options = {**kernel.options_for(self.dtype), **options}
        instance.launch(grid, visitor.args, **options)


def _device_of(ctx: OpContext) -> torch.device:
    for t in [ctx.output, ctx.grad_output, *ctx.inputs, *ctx.params]:
        if isinstance(t, torch.Tensor):
            return t.device
    from .device import DEVICE

    return DEVICE


# ----------------------------------------------------------------------------- RuntimeOp


class RuntimeOp:
    """How one op is launched forwards and, for training, backwards (see module docstring)."""

    name: str = "op"
    kernel: Kernel | None = None  # the forward kernel of the default single-launch path
    n_activation_inputs: int = 1
    saves_inputs: bool | tuple[int, ...] = True  # which inputs (indices over inputs+params) backward reads
    saves_output: bool = False
    stops_gradient: bool = False
    capturable: bool = True  # False: its launches depend on host state that changes per run (a CUDA graph would freeze it)
    differentiable_inputs: tuple[int, ...] | None = None  # None: every float input

    # --- shapes and dtypes -------------------------------------------------------------
    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        return tuple(input_shapes[0])

    def output_dtype(self, input_dtypes: list[torch.dtype]) -> torch.dtype:
        return input_dtypes[0]

    def param_shapes(self, input_shapes: list[Shape]) -> list[Shape | None]:
        """Expected shapes of the parameter inputs (``None``: any shape)."""
        return []

    def check_inputs(self, input_shapes: list[Shape], input_dtypes: list[torch.dtype]) -> None:
        """Raise ``ValueError``/``TypeError`` naming what is wrong with the inputs."""

    def extra_outputs(self, input_shapes: list[Shape], dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        """Tensors the forward writes besides its output for the backward (e.g. rstd)."""
        return {}

    # --- forward -----------------------------------------------------------------------
    def view(self, inputs: list) -> torch.Tensor | None:
        """Shape ops that can answer with a view of their input return it here (no launch,
        no copy); ``None`` means: launch the forward kernel."""
        return None

    def kernels(self) -> tuple[Kernel, ...]:
        return (self.kernel,) if self.kernel is not None else ()

    def pack_args(self, inputs, params, output, output_shape, visitor: ArgVisitor, saved=None) -> None:
        raise NotImplementedError(f"op {self.name} must implement pack_args or forward")

    def block(self) -> int:
        return 1024

    def grid(self, input_shapes: list[Shape], output_shape: Shape) -> tuple[int, int, int]:
        n = _numel(output_shape)
        return (-(-n // self.block()), 1, 1)

    def forward(self, ctx: OpContext) -> None:
        visitor = ArgVisitor()
        self.pack_args(ctx.inputs, ctx.params, ctx.output, ctx.output_shape, visitor, ctx.saved)
        ctx.launch(self.kernel, self.grid(ctx.input_shapes, ctx.output_shape), visitor)

    # --- backward ----------------------------------------------------------------------
    def has_backward(self) -> bool:
        return False

    def backward_kernels(self) -> tuple[Kernel, ...]:
        return self.kernel.backward if self.kernel is not None else ()

    def pack_backward_args(self, inputs, params, output, output_shape, grad_output, grad_output_row_stride,
                           grad_inputs, grad_params, visitor: ArgVisitor, saved=None) -> None:
        raise NotImplementedError(f"op {self.name} must implement pack_backward_args or backward")

    def backward_block(self) -> int:
        return self.block()

    def backward_grid(self, input_shapes: list[Shape], output_shape: Shape) -> tuple[int, int, int]:
        return (0, 0, 0)

    def backward(self, ctx: OpContext) -> None:
        """Default: one launch of the single backward kernel. Inputs that need no gradient get
        a scratch buffer so that the kernel can write all of them."""
        kernels = self.backward_kernels()
        if len(kernels) != 1:
            raise TeenyError(f"op {self.name} has {len(kernels)} backward kernels; it must override backward()")
        n_act = len(ctx.grad_inputs)
        shapes = ctx.input_shapes
        grad_inputs = [g if g is not None else (ctx.empty(shapes[i]) if self._float_input(ctx, i) else None)
                       for i, g in enumerate(ctx.grad_inputs)]
        grad_params = [g if g is not None else ctx.empty(shapes[n_act + i]) for i, g in enumerate(ctx.grad_params)]
        go = ctx.grad_output
        row_stride = go.stride(-2) if go.dim() >= 2 else max(go.numel(), 1)
        visitor = ArgVisitor()
        self.pack_backward_args(ctx.inputs, ctx.params, ctx.output, ctx.output_shape, go, row_stride,
                                grad_inputs, grad_params, visitor, ctx.saved)
        ctx.launch(kernels[0], self.backward_grid(ctx.input_shapes, ctx.output_shape), visitor)

    def _float_input(self, ctx: OpContext, index: int) -> bool:
        t = ctx.inputs[index] if index < len(ctx.inputs) else None
        return t is None or t.is_floating_point()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ----------------------------------------------------------------------------- CustomOp


class CustomOp(RuntimeOp):
    """A user op whose kernels come as Triton source text.

    Subclass and give ``lower_source()`` (the forward kernel's source) and
    ``lower_backward_source()`` (the backward kernel's source; ``""`` makes the op
    inference-only), plus the launch contract of ``RuntimeOp`` (``pack_args``, ``grid``, and
    for training ``pack_backward_args``, ``backward_grid``). The kernels are built once per
    class from the text; everything else (lowering checks, gradcheck, the torch interop)
    treats the op like a built-in one.
    """

    _built: dict[type, tuple[Kernel, Kernel | None]] = {}

    def lower_source(self) -> str:
        raise NotImplementedError(f"custom op {self.name} must return its forward kernel source from lower_source()")

    def lower_backward_source(self) -> str:
        return ""

    def dtypes(self) -> tuple[torch.dtype, ...] | None:
        """Dtypes the kernels dispatch to (``None``: float32 and float64)."""
        return None

    def _kernels_built(self) -> tuple[Kernel, Kernel | None]:
        key = type(self)
        if key not in CustomOp._built:
            back_src = (self.lower_backward_source() or "").strip()
            options = {"dtypes": self.dtypes(), "register": False}
            backward = kernel_from_source(back_src, **options) if back_src else None
            forward = kernel_from_source(self.lower_source(), backward=backward, **options)
            CustomOp._built[key] = (forward, backward)
        return CustomOp._built[key]

    @property
    def kernel(self) -> Kernel:  # type: ignore[override]
        return self._kernels_built()[0]

    def has_backward(self) -> bool:
        return self._kernels_built()[1] is not None

