"""How an op is launched: ``RuntimeOp``, ``ArgVisitor``, ``Launch``, ``OpContext`` and ``CustomOp``.

A ``RuntimeOp`` describes one op of the graph: its shapes and dtypes, what its backward needs
saved from the forward (``saves_inputs``, ``saves_output``, ``extra_outputs``), and its launches.

**The launch-list contract** is what the executor calls and what the built-in ops implement:
``forward_launches(ctx)`` and, for training, ``backward_launches(ctx)`` return a list of
``Launch(kernel, grid, args, block, work)`` records whose arguments are packed through an
``ArgVisitor``; ``ctx`` is the node's ``OpContext`` (its tensors, shapes, dtype and, in backward,
``grad_output`` and the gradient buffers). ``recompute_launches(ctx)`` writes the output again in
the backward (default: the forward's launches).

**The one-kernel contract** is the shorter spelling of an op with one kernel each way, public
and what a ``CustomOp`` implements (``examples/kernel_pair.py`` is a worked example)::

    pack_args(inputs, params, output, output_shape, visitor, saved=None)
    block() -> Block | int                                   # default 1024
    grid(input_shapes, output_shape) -> (x, y, z)            # default: one program per block() of the output
    pack_backward_args(inputs, params, output, output_shape,
                       grad_output, grad_output_row_stride, grad_inputs, grad_params,
                       visitor, saved=None)
    backward_block() -> Block | int                          # default block()
    backward_grid(input_shapes, output_shape) -> (x, y, z)   # required with a backward kernel

``RuntimeOp``'s default ``forward_launches`` / ``backward_launches`` are the adapter: each makes
the one launch of the forward kernel (``kernel``) or of its one backward kernel from these methods
and ``ctx``'s fields of the same names (an input that needs no gradient gets a scratch buffer, so
that the kernel can write every one). An op overriding the launch lists needs none of them.

Every launch, also the optimizers' and the executor's gradient accumulation, is checked by
``check_launch`` (the packing against the kernel's signature, by parameter name where the visit
names one; no empty grid where there is work) and launched by ``fire``; ``run_launch`` does both.
A ``CheckedLaunch`` may be fired again with other argument values of the same kinds (the
executor's node replay, ``teeny.program.replay``; the gradient accumulation of one size).
Lowering runs each op once on meta tensors, so packing mistakes and zero grids are reported
before any real launch; the kernels a program builds are the kernels its launches use
(``@kernel(backward=...)`` says which kernels are the backward of which).
``OpContext.for_forward`` / ``for_recompute`` / ``for_backward`` make every context, the dry
run's and the executor's alike.

The inputs of a node are its activation inputs followed by its parameters: the first
``n_activation_inputs`` tensors are ``inputs``, the rest ``params`` (checked against
``param_shapes``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import compiling
from .device import INTERPRETER
from .errors import GridError, KernelLaunchError, PackingError, TeenyError
from .kernel import Kernel, KernelInstance, KernelParam, dtype_name, kernel_from_source, settle

Shape = tuple[int, ...]


# ----------------------------------------------------------------------------- ArgVisitor

AUTO = "auto"  # a named visit whose kind the kernel's signature decides
ARENA_ALIGN = 16  # bytes: every parameter in an executor's arena starts aligned (TMA loads need it)


class Visit(NamedTuple):
    name: str | None
    kind: str  # ptr, i32, i64, float, constexpr or AUTO
    value: Any


class ArgVisitor:
    """Collects a launch's arguments, each with its kind and, optionally, the name of the kernel
    parameter it fills.

    Named visits (``visitor.visit(x_ptr=x, n=n, BLOCK=1024)`` or ``visit_ptr(x, "x_ptr")``) are
    matched to the signature by name, so an order mistake cannot happen; positional visits fill
    the parameters in order. A float scalar (``visit_float``) reaches the kernel in its compute
    precision: float64 for float64 instances, float32 otherwise.
    """

    def __init__(self) -> None:
        self.visits: list[Visit] = []

    def _add(self, name: str | None, kind: str, value: Any) -> ArgVisitor:
        self.visits.append(Visit(name, kind, value))
        return self

    def visit_ptr(self, tensor: torch.Tensor | None, name: str | None = None) -> ArgVisitor:
        """A tensor's address; ``None`` only for a pointer the kernel declares ``optional``."""
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise PackingError(f"visit_ptr{_named(name)} expects a torch.Tensor, got {type(tensor).__name__}")
        return self._add(name, "ptr", tensor)

    def visit_i32(self, value: int, name: str | None = None) -> ArgVisitor:
        value = int(value)
        if not -(2**31) <= value < 2**31:
            raise PackingError(f"visit_i32{_named(name)}: {value} does not fit in int32 (use visit_i64)")
        return self._add(name, "i32", value)

    def visit_i64(self, value: int, name: str | None = None) -> ArgVisitor:
        return self._add(name, "i64", int(value))

    def visit_float(self, value: float, name: str | None = None) -> ArgVisitor:
        return self._add(name, "float", float(value))

    def visit_constexpr(self, value: Any, name: str | None = None) -> ArgVisitor:
        return self._add(name, "constexpr", value)

    def visit(self, **named: Any) -> ArgVisitor:
        """Named arguments; each one's kind comes from the kernel parameter of that name."""
        for name, value in named.items():
            self._add(name, AUTO, value)
        return self

    @property
    def kinds(self) -> list[str]:
        return [v.kind for v in self.visits]


def _named(name: str | None) -> str:
    return f" ({name!r})" if name else ""


_FITS = {
    "ptr": ("ptr",),
    "i32": ("i32",),
    "i64": ("i32", "i64"),
    "f32": ("float",),
    "scalar": ("i32", "i64", "float"),
    "constexpr": ("constexpr",),
}


def _what(where: str, kernel: Kernel, index: int, param: KernelParam) -> str:
    """The place a packing error names."""
    return f"{where}: kernel {kernel.name} argument {index} '{param.name}'"


Check = Callable[[Any, str], Any]  # (visited value, where) -> the value to pass; PackingError if it does not fit


def _constexpr(value: Any, where: str) -> Any:
    """A constexpr passes as it is; a ``@triton.jit`` function passed there (an activation) is
    settled first (``kernel.settle``): Triton specialises on its hash."""
    settle(value)
    return value


def _check(kernel: Kernel, index: int, param: KernelParam, *, kind: str, where: str) -> Check:
    """How a visit of ``kind`` fills ``param``: what does not depend on the value is checked here
    (once per packing plan, for the launch at ``where``), the returned function checks the rest."""

    def fail(message: str, where: str):
        raise PackingError(f"{_what(where, kernel, index, param)} {message}")

    if param.kind == "constexpr" and kind in (AUTO, "constexpr"):
        return _constexpr
    if param.kind == "ptr" and kind in (AUTO, "ptr"):

        def pointer(value, where):
            if isinstance(value, torch.Tensor):
                return value
            if value is not None:  # only a named visit (kind AUTO) gets here with another type
                fail(f"is a pointer, but a {type(value).__name__} was packed there", where)
            if not param.optional:
                fail("got None, but the pointer is not declared optional (@kernel(optional=...))", where)
            return value

        return pointer
    if kind == AUTO:

        def scalar(value, where):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(f"is a {param.kind} scalar, but {value!r} was packed there", where)
            if param.kind == "f32" or isinstance(value, float):
                return float(value)
            if param.kind == "i32" and not -(2**31) <= value < 2**31:
                fail(f"is int32, but {value} does not fit", where)
            return value

        return scalar
    if kind not in _FITS[param.kind]:
        raise PackingError(f"{_what(where, kernel, index, param)} is {param.kind}, but a {kind} was packed there")
    return lambda value, where: value


@dataclass(frozen=True)
class _Plan:
    """How one combination of visits (names, kinds) fills a kernel's parameters: per parameter,
    the position of its visit among the visits followed by ``defaults``, and its ``Check``."""

    defaults: tuple[Visit, ...]
    fills: tuple[tuple[int, Check], ...]


_PLANS: dict[tuple, _Plan] = {}


def _plan(kernel: Kernel, visits: list[Visit], *, where: str, block_size: int | None) -> _Plan:
    """``PackingError`` for a name the kernel does not have, a parameter packed twice or one
    left out, a count that does not match (positional visits) or a kind that cannot fill its
    parameter; otherwise the plan (see ``check_packing``)."""
    params = kernel.params
    if visits and all(v.name is not None for v in visits):  # every visit named: place them by name
        by_name: dict[str, int] = {}
        for index, v in enumerate(visits):
            if kernel.param(v.name) is None:
                raise PackingError(
                    f"{where}: kernel {kernel.name} has no parameter '{v.name}' "
                    f"(its parameters: {', '.join(p.name for p in params)})"
                )
            if v.name in by_name:
                raise PackingError(f"{where}: kernel {kernel.name} parameter '{v.name}' was packed twice")
            by_name[v.name] = index
        defaults: list[Visit] = []
        order: list[int] = []
        for p in params:
            if p.name in by_name:
                order.append(by_name[p.name])
                continue
            if p.name == "BLOCK" and p.kind == "constexpr" and block_size is not None:
                defaults.append(Visit(p.name, "constexpr", block_size))
            elif p.optional:
                defaults.append(Visit(p.name, "ptr", None))
            else:
                raise PackingError(f"{where}: kernel {kernel.name} parameter '{p.name}' ({p.kind}) was not packed")
            order.append(len(visits) + len(defaults) - 1)
    else:
        if len(visits) != len(params):
            expected = ", ".join(f"{p.name}:{p.kind}" for p in params)
            got = ", ".join(v.kind for v in visits)
            raise PackingError(
                f"{where}: kernel {kernel.name} takes {len(params)} arguments ({expected}) "
                f"but {len(visits)} were packed ({got})"
            )
        for index, (p, v) in enumerate(zip(params, visits)):
            if v.name is not None and v.name != p.name:
                raise PackingError(
                    f"{where}: kernel {kernel.name} argument {index} is '{p.name}', "
                    f"but the visit there names '{v.name}'"
                )
        defaults, order = [], list(range(len(params)))
    every = [*visits, *defaults]
    fills = tuple(
        (slot, _check(kernel, index, p, kind=every[slot].kind, where=where))
        for index, (p, slot) in enumerate(zip(params, order))
    )
    return _Plan(tuple(defaults), fills)


def check_packing(kernel: Kernel, visitor: ArgVisitor, where: str, block_size: int | None = None) -> list[Any]:
    """The argument values in signature order; ``PackingError`` unless the visits match
    ``kernel``'s signature. When every visit is named, a ``BLOCK`` constexpr nobody visited
    takes ``block_size`` and an optional pointer nobody visited is ``None``. What does not depend
    on the values is checked once per kernel and combination of visits (names and kinds)."""
    visits = visitor.visits
    key = (kernel, tuple([v[:2] for v in visits]), block_size)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(kernel, visits, where=where, block_size=block_size)
    every = visits + list(plan.defaults) if plan.defaults else visits
    return [check(every[slot].value, where) for slot, check in plan.fills]


# ----------------------------------------------------------------------------- Launch


@dataclass(frozen=True)
class Block:
    """A launch's block: the ``BLOCK`` constexpr (``size``) and Triton's ``num_warps`` /
    ``num_stages``; any left ``None`` keeps the kernel's default."""

    size: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


def as_block(block: Block | int | None) -> Block:
    if block is None:
        return Block()
    return block if isinstance(block, Block) else Block(size=int(block))


@dataclass
class Launch:
    """One kernel launch: ``kernel`` over ``grid`` with the arguments packed in ``args``.

    ``work`` is how many elements the launch computes (default: the output's size in forward,
    the gradient's in backward); with no work an empty grid is skipped, with work it is an error.
    """

    kernel: Kernel
    grid: Sequence[int]
    args: ArgVisitor
    block: Block | int | None = None
    work: int | None = None


@dataclass(frozen=True)
class CheckedLaunch:
    """A launch whose packing and grid were checked (``check_launch``): what ``fire`` needs
    besides its argument values, which are the same every run of a node but for the tensors."""

    instance: KernelInstance
    grid: tuple[int, ...]
    block: Block
    where: str
    input_shapes: tuple[Shape, ...] = ()


def check_launch(
    launch: Launch, instance: KernelInstance, where: str, work: int, *, input_shapes: Sequence[Shape] = ()
) -> tuple[CheckedLaunch, list[Any]] | None:
    """``launch`` checked (packing, grid): the ``CheckedLaunch`` and its argument values in
    signature order, or ``None`` for an empty grid with no work (nothing to launch)."""
    kernel = launch.kernel
    block = as_block(launch.block)
    values = check_packing(kernel, launch.args, where, block.size)
    grid = tuple(int(g) for g in launch.grid)
    if len(grid) == 0 or len(grid) > 3:
        raise GridError(f"{where}: kernel {kernel.name} grid {grid} must have 1 to 3 dimensions")
    if launch.work is not None:
        work = launch.work
    if any(g <= 0 for g in grid):
        if work == 0:
            return None
        raise GridError(
            f"{where}: kernel {kernel.name} has grid {grid} with no programs but {work} elements to compute"
        )
    return CheckedLaunch(instance, grid, block, where, tuple(input_shapes)), values


def fire(checked: CheckedLaunch, values: list[Any]) -> None:
    """Launch ``checked`` with ``values``: the one call every kernel launch in teeny ends in. A
    failing launch's error names the launch's place, dtype and input shapes."""
    instance, block = checked.instance, checked.block
    kernel = instance.kernel
    options: dict[str, Any] = {}
    if not INTERPRETER:
        options = kernel.options_for(instance.dtype) if kernel.launch_options else {}
        if block.num_warps is not None:
            options["num_warps"] = block.num_warps
        if block.num_stages is not None:
            options["num_stages"] = block.num_stages
    try:
        instance.launch(checked.grid, values, **options)
    except TeenyError:
        raise
    except Exception as exc:  # Triton's compile or launch failed: say where, in which dtype, on what
        raise launch_failed(checked.where, instance, checked.input_shapes, exc) from exc


def launch_failed(where: str, instance: KernelInstance, shapes: Sequence, exc: Exception) -> KernelLaunchError:
    """The error of a launch of ``instance`` that raised ``exc``: where it was, the kernel, its
    dtype and the shapes of its inputs (every path that launches names a failure so)."""
    on = f" on inputs {', '.join(str(tuple(s)) for s in shapes)}" if shapes else ""
    return KernelLaunchError(
        f"{where}: kernel {instance.kernel.name} for {dtype_name(instance.dtype)} failed{on}: "
        f"{type(exc).__name__}: {exc}"
    )


def run_launch(
    launch: Launch,
    instance: KernelInstance,
    where: str,
    work: int,
    *,
    dry_run: bool = False,
    input_shapes: Sequence[Shape] = (),
) -> tuple[CheckedLaunch, list[Any]] | None:
    """Check ``launch`` (packing, grid) and, unless ``dry_run``, launch it: the path every
    launch built from a ``Launch`` takes. Returns what ``check_launch`` returns. A dry run's
    launch is gathered for compiling ahead where lowering asks (``compiling.gathered``)."""
    checked = check_launch(launch, instance, where, work, input_shapes=input_shapes)
    if checked is not None and not dry_run:
        fire(*checked)
    elif checked is not None and compiling.gathering():
        compiling.gather(lambda: fire(*checked))
    return checked


def launch_kernel(launch: Launch, dtype: torch.dtype, where: str) -> CheckedLaunch | None:
    """Launch outside a graph node (optimizer steps, gradient accumulation), checked the same
    way. Returns the checked launch (``None``: nothing launched), which ``fire`` launches again
    with other argument values of the same kinds, sizes and alignment, unchecked."""
    try:
        instance = launch.kernel.instance(dtype)
    except TypeError as exc:
        raise TeenyError(f"{where}: {exc}") from None
    checked = run_launch(launch, instance, where, work=1)
    return None if checked is None else checked[0]


# ----------------------------------------------------------------------------- OpContext


def row_stride(t: torch.Tensor) -> int:
    """The distance between rows of ``t`` viewed as (rows, last dim)."""
    return t.stride(-2) if t.dim() >= 2 else max(t.numel(), 1)


@dataclass
class OpContext:
    """Everything one forward, recompute or backward run of one node sees; made by
    ``for_forward``, ``for_recompute`` or ``for_backward``, the dry run's and the executor's alike.

    ``inputs`` / ``params`` are the node's tensors (in backward: only those the op declared
    saved; the others are ``None``). ``saved`` holds the op's extra outputs (e.g. rstd).
    In backward, ``grad_inputs`` / ``grad_params`` hold a buffer for each input that needs a
    gradient and ``None`` for the others; the op writes (not adds) into them, or replaces one
    by a view of ``grad_output``; with ``grad_input_addend`` the op adds that gradient (which
    may be input 0's buffer itself) to input 0's. ``grad_output`` has unit stride along its last dim and rows
    ``grad_output_row_stride`` apart (contiguous unless the op sets ``strided_grad_output``).
    """

    op: RuntimeOp
    node_name: str
    dtype: torch.dtype
    inputs: list
    params: list
    output: torch.Tensor | None
    saved: dict[str, torch.Tensor]
    instances: dict[tuple[int, torch.dtype], KernelInstance]
    dry_run: bool = False
    grad_output: torch.Tensor | None = None
    grad_output_row_stride: int = 0
    grad_inputs: list = field(default_factory=list)
    grad_params: list = field(default_factory=list)
    input_shapes: list = field(default_factory=list)
    output_shape: Shape = ()
    phase: str = "forward"
    grad_input_addend: torch.Tensor | None = None  # backward: a gradient to add to input 0's (grad_accumulates)
    allowed_kernels: set[int] | None = None  # backward dry run: the kernels the op's pairs declare
    checks: list | None = None  # (flag, describe) pairs the executor reads after the forward
    launched: list | None = None  # dry run: the launches seen, as (kernel, grid, argument values)

    @classmethod
    def for_forward(
        cls,
        op: RuntimeOp,
        *,
        node_name: str,
        dtype: torch.dtype,
        instances: dict[tuple[int, torch.dtype], KernelInstance],
        inputs: Sequence[torch.Tensor | None],
        output: torch.Tensor | None,
        saved: dict[str, torch.Tensor] | None = None,
        input_shapes: Sequence[Shape] | None = None,
        output_shape: Shape | None = None,
        dry_run: bool = False,
        checks: list | None = None,
        launched: list | None = None,
    ) -> OpContext:
        """The context of a forward run of ``op`` at node ``node_name``. ``inputs``: the node's
        tensors, activation inputs then parameters (``None`` for one not kept), split at
        ``op.n_activation_inputs``; ``input_shapes`` / ``output_shape`` default to the tensors'
        shapes. ``dry_run``: lowering's run on meta tensors, which builds the kernel instances
        into ``instances`` (a real run finds them there). ``checks`` collects the flags
        ``check_after`` asks for, ``launched`` the launches run."""
        n_act = op.n_activation_inputs
        return cls(
            op=op,
            node_name=node_name,
            dtype=dtype,
            inputs=list(inputs[:n_act]),
            params=list(inputs[n_act:]),
            output=output,
            saved={} if saved is None else saved,
            instances=instances,
            dry_run=dry_run,
            input_shapes=[tuple(t.shape) for t in inputs] if input_shapes is None else list(input_shapes),
            output_shape=tuple(output.shape) if output_shape is None else output_shape,
            checks=checks,
            launched=launched,
        )

    @classmethod
    def for_recompute(cls, op: RuntimeOp, **forward: Any) -> OpContext:
        """The context in which ``op`` writes its output again in the backward
        (``recompute_launches``): ``forward`` are ``for_forward``'s arguments, ``output`` a fresh buffer."""
        ctx = cls.for_forward(op, **forward)
        ctx.phase = "recompute"
        return ctx

    @classmethod
    def for_backward(
        cls,
        op: RuntimeOp,
        *,
        grad_output: torch.Tensor,
        grads: Sequence[torch.Tensor | None],
        grad_input_addend: torch.Tensor | None = None,
        **forward: Any,
    ) -> OpContext:
        """The context of a backward run of ``op``: ``forward`` are ``for_forward``'s arguments
        (the tensors the forward kept), ``grads`` one gradient buffer per input, split like the
        inputs (``None``: no gradient wanted), ``grad_input_addend`` a gradient to add to input 0's
        (``grad_accumulates``). A dry run refuses launches of kernels that the op's forward kernel
        does not declare as its backward; a real run launches only what the dry run checked."""
        ctx = cls.for_forward(op, **forward)
        n_act = op.n_activation_inputs
        ctx.phase = "backward"
        ctx.grad_output = grad_output
        ctx.grad_output_row_stride = row_stride(grad_output)
        ctx.grad_inputs, ctx.grad_params = list(grads[:n_act]), list(grads[n_act:])
        ctx.grad_input_addend = grad_input_addend
        ctx.allowed_kernels = {id(k) for k in op.backward_kernels()} if ctx.dry_run else None
        return ctx

    def check_after(self, flag: torch.Tensor, describe) -> None:
        """After this run, raise an error naming the op if the one-element ``flag`` a kernel
        wrote is not 0; ``describe(value)`` says what was wrong (e.g. which index was out of
        range). The executor reads all flags of a forward with one synchronisation."""
        if self.checks is not None and not self.dry_run:
            self.checks.append((flag, self.where, describe))

    @property
    def where(self) -> str:
        return f"op {self.op.name} (node '{self.node_name}', {self.phase})"

    def empty(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A scratch buffer on the right device (a meta tensor during lowering's dry run)."""
        dev = "meta" if self.dry_run else _device_of(self)
        return torch.empty(tuple(shape), dtype=dtype or self.dtype, device=dev)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        dev = "meta" if self.dry_run else _device_of(self)
        return torch.zeros(tuple(shape), dtype=dtype or self.dtype, device=dev)

    def instance(self, kernel: Kernel) -> KernelInstance:
        """The built instance of ``kernel`` for this node's dtype. Lowering's dry run builds it
        (so a program builds exactly the kernels its launches use); a real run finds it. A
        backward's dry run refuses a kernel its op's pair does not declare, whether or not
        another node's forward built it."""
        if self.allowed_kernels is not None and id(kernel) not in self.allowed_kernels:
            raise TeenyError(
                f"{self.where}: launches kernel {kernel.name}, which is not declared as a backward of "
                f"the op's forward kernel (list it in @kernel(backward=...))"
            )
        key = (id(kernel), self.dtype)
        instance = self.instances.get(key)
        if instance is not None:
            return instance
        if not self.dry_run:
            raise TeenyError(
                f"{self.where}: kernel {kernel.name} for {dtype_name(self.dtype)} was not built for this "
                "program (a launch that lowering's dry run did not see)"
            )
        try:
            instance = kernel.instance(self.dtype)
        except TypeError as exc:
            raise TeenyError(f"{self.where}: {exc}") from None
        self.instances[key] = instance
        return instance

    def build_launches(self) -> list[Launch]:
        """The op's launches for this context's phase: ``forward_launches``,
        ``recompute_launches`` or ``backward_launches``."""
        if self.phase == "backward":
            return self.op.backward_launches(self)
        if self.phase == "recompute":
            return self.op.recompute_launches(self)
        return self.op.forward_launches(self)

    def run(self, launches: Sequence[Launch]) -> list[tuple[CheckedLaunch, list[Any]]]:
        """Check each of ``launches`` and, unless a dry run, launch it (``run_launch``), in
        order. Returns the checked launches with their argument values (empty ones left out)."""
        ref = self.grad_output if self.phase == "backward" else self.output
        work = 1 if ref is None else ref.numel()
        where = self.where
        checked = []
        for launch in launches:
            ran = run_launch(
                launch, self.instance(launch.kernel), where, work, dry_run=self.dry_run, input_shapes=self.input_shapes
            )
            if self.launched is not None:
                self.launched.append(launch)
            if ran is not None:
                checked.append(ran)
        return checked


_CHECK_SINKS: dict[int, list] = {}  # thread -> where its checks go while a run is recorded (teeny.program.tape)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def raise_not_capturable(op: RuntimeOp, node_name: str) -> None:
    """Refuse to launch a non-``capturable`` op into a CUDA graph being captured: every replay
    would repeat the host values of the capture's run (dropout's mask), a silently wrong result."""
    raise TeenyError(
        f"op {op.name} (node '{node_name}') runs while a CUDA graph is being captured, but its launches "
        "take a host value that changes per run (a dropout seed): every replay would repeat the captured "
        "run's mask. Run it outside the capture (torch.compile: mode='default' rather than "
        "'reduce-overhead'; teeny's TrainStep captures only capturable steps), or use p=0"
    )


def raise_failed_checks(checks: list) -> None:
    """Read the flags ops asked to have checked (``OpContext.check_after``) of one run: one
    host synchronisation for all of them. Skipped while a CUDA graph is being captured and for
    meta tensors (a run without data, as an ahead-of-time build makes); handed to the recorder
    instead while a run is recorded (``teeny.program.tape``, which reads them itself)."""
    sink = _CHECK_SINKS.get(threading.get_ident()) if _CHECK_SINKS else None
    if sink is not None:
        sink.extend(checks)
        return
    if not checks or checks[0][0].is_meta or capturing():
        return
    values = torch.stack([flag.reshape(()).to(torch.int64) for flag, _, _ in checks]).cpu().tolist()
    for value, (_, where, describe) in zip(values, checks):
        if value:
            raise TeenyError(f"{where}: {describe(value)}")


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
    kernel: Kernel | None = None  # the forward kernel; its @kernel(backward=...) are the backward kernels
    n_activation_inputs: int = 1
    saves_inputs: bool | tuple[int, ...] = True  # which inputs (indices over inputs+params) backward reads
    saves_output: bool = False
    stops_gradient: bool = False
    capturable: bool = (
        True  # False: its launches depend on host state that changes per run (a CUDA graph would freeze it)
    )
    differentiable_inputs: tuple[int, ...] | None = None  # None: every float input
    # inputs (indices over inputs+params) from which recompute_launches writes the output again
    # in the backward; None: it cannot (lower(..., recompute=True) saves the output instead)
    recomputable: tuple[int, ...] | None = None
    strided_grad_output: bool = False  # True: the backward reads dy by rows through grad_output_row_stride
    # True: the backward may write input 0's gradient over dy (each element of dx from the same element
    # of dy, read before it is written); the executor hands it dy's buffer when nothing else holds it
    grad_in_place: bool = False
    # True: the backward may write input 0's gradient over input 0 itself (same shape and dtype; the
    # launch writing it comes after every launch reading input 0); the executor hands input 0's buffer
    # over when it owns it alone: a value recomputed for this node, at its last reader's backward
    grad_over_input: bool = False
    # True: the backward can add a contiguous gradient to input 0's as it writes it
    # (``OpContext.grad_input_addend``): the one input 0's other readers left, so that no launch adds
    # the two after; written over in place when nothing else holds it (else into a new buffer)
    grad_accumulates: bool = False
    # an input position (over inputs + params) whose gradient the backward writes as a copy of input
    # 0's whole gradient, in that input's dtype (the fused add + norm's half-precision branch:
    # ``fusions.residual_norm``): the executor must hand the op input 0's waiting gradient as its addend
    grad_copies_input0: int | None = None
    # input positions whose gradient the backward may write into rows padded to 16 bytes (a
    # row-strided view of a wider buffer): the executor gives it one where the value's rows are not
    # 16-byte aligned and the product that made it reads dY by rows (``Program.padded_grads``: TMA
    # reads GPT-2's logits' gradient, 50,257 classes, with no padded copy)
    grad_rows_padded: tuple[int, ...] = ()
    # True: inputs after the first may be of other float dtypes (the kernels convert as they load);
    # the node computes in input 0's dtype. False: one float dtype for all inputs (the graph checks)
    mixed_float_inputs: bool = False
    # True (set on one node's op): the model computes this op in its own dtypes, as in a
    # ``torch.autocast(enabled=False)`` block (rotary tables from positions): mixed precision
    # (``fusions.mixed_precision``) leaves its inputs as they are, float32 stays float32
    in_float32: bool = False
    # groups of parameter positions (indices over inputs + params) the executor lays out side by side
    # in its arena, in this order, and whose gradient buffers it hands out side by side: the op may
    # read them as one tensor (a view). The rewrite that sets it checks that the executor can: one
    # dtype, sizes in multiples of 16 bytes (no padding between), trainable alike, read by this node only
    adjacent_params: tuple[tuple[int, ...], ...] = ()

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

    def mutated_inputs(self) -> tuple[int, ...]:
        """Indices (over inputs + params) of the tensors the forward writes in place, as PyTorch's
        op does (batch norm's running statistics, embedding's ``max_norm`` renormalisation)."""
        return ()

    def extra_outputs(self, input_shapes: list[Shape], dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        """Tensors the forward writes besides its output for the backward (e.g. rstd)."""
        return {}

    def flops(self, input_shapes: list[Shape], grad_mask: Sequence[bool]) -> tuple[int, int]:
        """(forward, backward) floating-point operations of the products the op computes, two
        per multiply-add, as torch's ``FlopCounterMode`` counts matrix products, convolutions
        and attention (other work is not counted there); the backward's are those of the
        products it launches for the inputs ``grad_mask`` marks. (0, 0): no products."""
        return 0, 0

    # --- launches (the launch-list contract the executor calls) --------------------------
    def view(self, inputs: list) -> torch.Tensor | None:
        """Shape ops that can answer with a view of their input return it here (no launch,
        no copy); ``None`` means: launch the forward kernel."""
        return None

    def forward_launches(self, ctx: OpContext) -> list[Launch]:
        """The forward's launches. The default adapts the one-kernel contract: one launch of
        ``kernel``, from ``pack_args``, ``grid`` and ``block``."""
        if self.kernel is None:
            raise NotImplementedError(
                f"op {self.name} has no forward kernel: set `kernel` or implement forward_launches"
            )
        visitor = ArgVisitor()
        self.pack_args(ctx.inputs, ctx.params, ctx.output, ctx.output_shape, visitor, ctx.saved)
        return [Launch(self.kernel, self.grid(ctx.input_shapes, ctx.output_shape), visitor, self.block())]

    def recompute_launches(self, ctx: OpContext) -> list[Launch]:
        """The output written again, in the backward, from the inputs ``recomputable`` names
        and the extra outputs the forward saved (``ctx.output`` is a fresh buffer): what lets a
        consumer that reads the output for its own backward keep nothing. The default runs the
        forward again (element-wise ops: a cheap pass, no state)."""
        return self.forward_launches(ctx)

    def has_backward(self) -> bool:
        """Whether gradients flow through the op: by default, whether its forward kernel
        declares a backward (``@kernel(backward=...)``)."""
        return self.kernel is not None and self.kernel.has_backward

    def backward_kernels(self) -> tuple[Kernel, ...]:
        """The kernels a backward launch may use: those the forward kernel declares as its
        backward, and the forward kernel itself (a copy whose adjoint is the inverse copy)."""
        if self.kernel is None:
            return ()
        return (*self.kernel.backward, self.kernel)

    def backward_launches(self, ctx: OpContext) -> list[Launch]:
        """The backward's launches. The default adapts the one-kernel contract: one launch of
        the forward kernel's one backward kernel, from ``pack_backward_args``, ``backward_grid``
        and ``backward_block``. Inputs that need no gradient get a scratch buffer so that the
        kernel can write all of them."""
        kernels = self.kernel.backward if self.kernel is not None else ()
        if len(kernels) != 1:
            raise TeenyError(
                f"op {self.name} has {len(kernels)} backward kernels; it must implement backward_launches()"
            )
        if type(self).backward_grid is RuntimeOp.backward_grid:
            raise GridError(
                f"op {self.name} has a backward kernel but no backward_grid(): the default (0, 0, 0) "
                "would launch nothing and leave every gradient unwritten"
            )
        n_act = len(ctx.grad_inputs)
        shapes = ctx.input_shapes
        grad_inputs = [
            g if g is not None else (ctx.empty(shapes[i]) if self._float_input(ctx, i) else None)
            for i, g in enumerate(ctx.grad_inputs)
        ]
        grad_params = [g if g is not None else ctx.empty(shapes[n_act + i]) for i, g in enumerate(ctx.grad_params)]
        visitor = ArgVisitor()
        self.pack_backward_args(
            ctx.inputs,
            ctx.params,
            ctx.output,
            ctx.output_shape,
            ctx.grad_output,
            ctx.grad_output_row_stride,
            grad_inputs,
            grad_params,
            visitor,
            ctx.saved,
        )
        return [
            Launch(kernels[0], self.backward_grid(ctx.input_shapes, ctx.output_shape), visitor, self.backward_block())
        ]

    def _float_input(self, ctx: OpContext, index: int) -> bool:
        t = ctx.inputs[index] if index < len(ctx.inputs) else None
        return t is None or t.is_floating_point()

    # --- the one-kernel contract (public: what a CustomOp implements; see module docstring) ---
    def pack_args(self, inputs, params, output, output_shape, visitor: ArgVisitor, saved=None) -> None:
        """Visit the forward kernel's arguments: the node's activation ``inputs`` and ``params``,
        its ``output`` buffer (of ``output_shape``) and its ``saved`` extra outputs."""
        raise NotImplementedError(f"op {self.name} must implement pack_args or forward_launches")

    def block(self) -> Block | int:
        """The forward launch's block: its ``BLOCK`` size (given to the kernel's ``BLOCK``
        constexpr when the packing leaves it out) and, optionally, warps and stages."""
        return 1024

    def grid(self, input_shapes: list[Shape], output_shape: Shape) -> tuple[int, int, int]:
        """The forward launch's grid; the default: one program per ``block()`` of the output."""
        size = as_block(self.block()).size or 1024
        return (-(-_numel(output_shape) // size), 1, 1)

    def pack_backward_args(
        self,
        inputs,
        params,
        output,
        output_shape,
        grad_output,
        grad_output_row_stride,
        grad_inputs,
        grad_params,
        visitor: ArgVisitor,
        saved=None,
    ) -> None:
        """Visit the backward kernel's arguments: what ``pack_args`` gets (``inputs`` / ``params``
        / ``output``: ``None`` where the op did not declare them saved), ``grad_output`` (rows
        ``grad_output_row_stride`` apart) and one gradient buffer per input in ``grad_inputs`` /
        ``grad_params``, which the kernel writes (``None`` only for a non-float input)."""
        raise NotImplementedError(f"op {self.name} must implement pack_backward_args or backward_launches")

    def backward_block(self) -> Block | int:
        return self.block()

    def backward_grid(self, input_shapes: list[Shape], output_shape: Shape) -> tuple[int, int, int]:
        """The backward launch's grid: an op with a backward kernel must give one (the default
        (0, 0, 0) is refused at lowering)."""
        return (0, 0, 0)

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
    inference-only), plus the one-kernel contract of ``RuntimeOp`` (``pack_args``, ``grid``, and
    for training ``pack_backward_args``, ``backward_grid``; see the module docstring). The kernels are built once per
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

    def optional_pointers(self) -> tuple[str, ...]:
        """Pointer parameters (of either kernel) that may be packed as ``None``."""
        return ()

    def _kernels_built(self) -> tuple[Kernel, Kernel | None]:
        key = type(self)
        if key not in CustomOp._built:
            back_src = (self.lower_backward_source() or "").strip()
            options = {"dtypes": self.dtypes(), "register": False}
            backward = None
            if back_src:
                backward = kernel_from_source(back_src, optional=self._optional_in(back_src), **options)
            src = self.lower_source()
            forward = kernel_from_source(src, backward=backward, optional=self._optional_in(src), **options)
            CustomOp._built[key] = (forward, backward)
        return CustomOp._built[key]

    def _optional_in(self, source: str) -> tuple[str, ...]:
        return tuple(n for n in self.optional_pointers() if re.search(rf"\b{re.escape(n)}\b", source))

    @property
    def kernel(self) -> Kernel:  # type: ignore[override]
        return self._kernels_built()[0]
