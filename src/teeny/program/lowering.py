"""``lower(graph, mode) -> Program``: gradients planned, every launch checked, kernels built.

Inference plans the forward only and frees each value after its last consumer. Training also

* works out which values need a gradient (trainable parameters, inputs marked
  ``requires_grad``, and whatever is computed from them, except through ``stop_gradient``),
* refuses an op without a backward on a path from such a value to the loss (naming the op,
  the node and the parameter; mark the parameter non-trainable or use ``stop_gradient`` to
  opt out), and
* plans the backward of every node on the path to the loss.

The loss is the first output; ``seeded=n`` makes the first n outputs the backward's starts
instead, each with a gradient its caller gives (``Executor.backward``): a function of several
outputs, each of its own shape and dtype, differentiated as one (``teeny.torch``'s operators).

Before planning, ``lower`` runs graph rewrites (``teeny.fusions``: fusions, mixed
precision) on a copy of the graph; ``rewrites=()`` runs none, and ``Program.summary()`` says
what each one changed.

Both modes then run every op once on meta tensors (no data, no launch): a packed argument
list that does not match its kernel's signature, or an empty grid where there is work, is
reported here, naming the op, node, kernel and argument, instead of inside a launch. The
kernel instances a program builds are the ones these launches use: inference builds no
backward kernel, and a backward launch may use only the kernels its op's forward kernel
declares with ``@kernel(backward=...)``. That run is also where products choose their tile
configuration (``teeny.core.tuning``): on a GPU, where a choice must be timed, the first run
only collects the choices, the candidates of all of them are compiled in one pool, and a
second run times them. Every kernel the program launches is then compiled at once
(``teeny.core.compiling``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import compiling, tuning
from ..core.errors import MissingBackwardError, NoGradientError, TeenyError
from ..core.graph import Graph, GraphError, Node, Value
from ..core.kernel import KernelInstance
from ..core.runtime import OpContext, RuntimeOp
from ..fusions import DEFAULT_REWRITES, RewriteFn, RewriteReport, apply_rewrites, precision_rewrites
from ..ops.products.launches import TMA_ALIGN, padded_length
from ..ops.shape.ops import ViewOp
from .accumulate import accumulate_kernel


class LoweringMode(enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"


@dataclass(eq=False)
class PlannedNode:
    node: Node
    needs_backward: bool = False
    grad_mask: list[bool] = field(default_factory=list)  # per input: does it want a gradient
    saved_inputs: list[bool] = field(default_factory=list)  # per input: kept for the backward
    # input index -> index (in Program.nodes) of its producer, whose recompute_launches write it
    # again for this node's backward instead of the forward keeping it (lower(..., recompute=True))
    recomputed: dict[int, int] = field(default_factory=dict)
    recompute_launches: list = field(default_factory=list)  # what the dry run launched for them
    forward_launches: list = field(default_factory=list)  # what the dry run launched (runtime.Launch)
    backward_launches: list = field(default_factory=list)
    is_view: bool = False  # the forward answers with a view of an input (no buffer of its own)

    @property
    def op(self) -> RuntimeOp:
        return self.node.op

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(eq=False, kw_only=True)
class Program:
    graph: Graph
    mode: LoweringMode
    nodes: list[PlannedNode]
    outputs: list[Value]
    instances: dict[tuple[int, torch.dtype], KernelInstance]
    requires_grad: dict[int, bool]  # value id -> needs a gradient
    last_use: dict[int, int]  # value id -> index of the last node reading it (forward)
    rewrites: list[RewriteReport] = field(default_factory=list)  # what each graph rewrite changed
    seeded: int = 1  # the first outputs, whose gradients the backward starts from
    # value id -> the row length (elements, 16-byte aligned) of its gradient's buffer, whose rows are
    # padded (``_plan_padded_grads``); the gradient is a row-strided view of it
    padded_grads: dict[int, int] = field(default_factory=dict)

    @property
    def loss(self) -> Value:
        return self.outputs[0]

    @property
    def seeded_outputs(self) -> list[Value]:
        return self.outputs[: self.seeded]

    @property
    def params(self) -> list[Value]:
        return self.graph.params

    @property
    def inputs(self) -> list[Value]:
        return self.graph.inputs

    def _saves(self, p: PlannedNode) -> tuple[list[Value], int]:
        """The intermediate values ``p`` keeps for its backward, and the bytes of its extra outputs
        (graph inputs and parameters are held anyway: keeping them costs nothing)."""
        if not p.needs_backward:
            return [], 0
        values = [v for v, keep in zip(p.node.inputs, p.saved_inputs) if keep and v.kind == "node"]
        if p.op.saves_output:
            values.append(p.node.output)
        extras = p.op.extra_outputs([v.shape for v in p.node.inputs], p.node.dtype)
        return values, sum(_nbytes(shape, dtype) for shape, dtype in extras.values())

    def saved_bytes(self, p: PlannedNode) -> int:
        """Bytes the forward keeps for ``p``'s backward (its declared saves)."""
        values, extra = self._saves(p)
        return extra + sum(_nbytes(v.shape, v.dtype) for v in values)

    def _buffers(self) -> Callable[[Value], Value]:
        """value -> the value whose buffer it is: a view's input, followed back to a value of its own."""
        views = {p.node.id for p in self.nodes if p.is_view}

        def buffer_of(v: Value) -> Value:
            while v.producer is not None and v.producer.id in views:
                v = v.producer.inputs[0]
            return v

        return buffer_of

    def flops(self) -> tuple[int, int]:
        """(forward, backward) floating-point operations of a run's products, counted as torch's
        ``FlopCounterMode`` counts them (``RuntimeOp.flops``); the backward's are 0 in inference."""
        forward = backward = 0
        for p in self.nodes:
            f, b = p.op.flops([v.shape for v in p.node.inputs], p.grad_mask or [False] * len(p.node.inputs))
            forward += f
            backward += b if p.needs_backward else 0
        return forward, backward

    def saved_total_bytes(self) -> int:
        """Bytes the forward keeps for the whole backward: each buffer once, however many nodes
        keep it or a view of it."""
        kept: dict[int, int] = {}
        extra, buffer_of = 0, self._buffers()
        for p in self.nodes:
            values, extra_bytes = self._saves(p)
            extra += extra_bytes
            for v in map(buffer_of, values):
                kept[v.id] = _nbytes(v.shape, v.dtype)
        return extra + sum(kept.values())

    def peak_activation_bytes(self) -> int:
        """The most bytes of activations alive at once during the forward: values not yet past
        their last reader, plus what training keeps for the backward (each buffer once; views
        are free)."""
        live: dict[int, int] = {}
        kept: dict[int, int] = {}
        extra = peak = 0
        buffer_of = self._buffers()
        outputs = {v.id for v in self.outputs}
        for index, p in enumerate(self.nodes):
            out = p.node.output
            if not p.is_view or out.id in outputs:
                live[out.id] = _nbytes(out.shape, out.dtype)
            values, extra_bytes = self._saves(p)
            kept.update((v.id, _nbytes(v.shape, v.dtype)) for v in map(buffer_of, values))
            extra += extra_bytes
            peak = max(peak, extra + sum({**live, **kept}.values()))
            for v in p.node.inputs:
                if self.last_use.get(v.id) == index and v.id not in outputs:
                    live.pop(v.id, None)
        return peak

    def summary(self) -> str:
        """What the program will do: per node its op, output, launches (forward / backward) and
        saved bytes; then the totals and the activation memory plan."""
        rows = [f"program {self.graph.name} ({self.mode.value}): {len(self.nodes)} nodes"]
        launches = [0, 0]
        for p in self.nodes:
            fwd, bwd = len(p.forward_launches), len(p.backward_launches) + len(p.recompute_launches)
            launches[0] += fwd
            launches[1] += bwd
            shape = "x".join(str(s) for s in p.node.output.shape) or "scalar"
            launched = p.forward_launches + p.backward_launches + p.recompute_launches
            kernels = ", ".join(sorted({launch.kernel.name for launch in launched}))
            rows.append(
                f"  {p.name:28} {p.op.name:22} {shape:>16} {fwd:2d}+{bwd:<2d} launches"
                f"  saves {_mib(self.saved_bytes(p)):>8}  {kernels or ('(view)' if p.is_view else '(no launch)')}"
            )
        param_bytes = sum(_nbytes(v.shape, v.dtype) for v in self.params)
        rows.append(
            f"  launches per step: {launches[0]} forward, {launches[1]} backward; kernels built: {len(self.instances)}"
        )
        forward_flops, backward_flops = self.flops()
        rows.append(f"  products: {forward_flops / 1e9:.3g} GFLOP forward, {backward_flops / 1e9:.3g} GFLOP backward")
        rows.append(
            f"  memory: parameters {_mib(param_bytes)}, saved for backward "
            f"{_mib(self.saved_total_bytes())}, peak activations "
            f"{_mib(self.peak_activation_bytes())}"
        )
        recomputed = {
            self.nodes[j].node.output.id: self.nodes[j].node.output for p in self.nodes for j in p.recomputed.values()
        }
        if recomputed:
            nbytes = sum(_nbytes(v.shape, v.dtype) for v in recomputed.values())
            rows.append(
                f"  recompute: {len(recomputed)} values ({_mib(nbytes)}) written again in the backward, not saved"
            )
        rows += [f"  rewrite {report}" for report in self.rewrites]
        return "\n".join(rows)

    def kernel_names(self) -> list[str]:
        return sorted(
            {f"{inst.kernel.name}[{str(inst.dtype).replace('torch.', '')}]" for inst in self.instances.values()}
        )


def lower(
    graph: Graph,
    mode: LoweringMode = LoweringMode.INFERENCE,
    *,
    outputs=None,
    rewrites: Sequence[RewriteFn] = DEFAULT_REWRITES,
    precision: str | None = None,
    recompute: bool = False,
    seeded: int = 1,
) -> Program:
    """Plan ``graph`` for ``mode`` and check every launch on meta tensors (see module docstring).
    ``rewrites``: the graph rewrites to run first (``teeny.fusions``; ``()``: none).
    ``precision``: ``None`` (the graph's dtypes), ``"bf16-mixed"`` or ``"fp16-mixed"``
    (``rewrites.mixed_precision``; float16 training wants a loss scaler: ``optim.GradScaler``).
    ``recompute``: training keeps no output of a ``recomputable`` op (norms, element-wise
    activations, casts of parameters) for a consumer's backward; the backward writes it again (``_plan_recompute``).
    ``seeded``: how many outputs, from the first, the backward starts from (1: the loss)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"lower(graph, mode): graph must be a teeny Graph, got {type(graph).__name__}")
    if not isinstance(mode, LoweringMode):
        raise TypeError(f"mode must be a LoweringMode, got {mode!r}")
    _check_structure(graph)
    outs = _resolve_outputs(graph, outputs)
    if not 1 <= seeded <= len(outs):
        raise ValueError(f"seeded={seeded}: the backward starts from 1 to {len(outs)} of the {len(outs)} outputs")
    rewrites = list(rewrites) + precision_rewrites(precision, recompute)
    graph, outs, reports = apply_rewrites(graph, outs, mode is LoweringMode.TRAINING, rewrites)
    needed = _ancestors(outs)
    planned = [
        PlannedNode(node, grad_mask=[False] * len(node.inputs), saved_inputs=[False] * len(node.inputs))
        for node in graph.nodes
        if node.output.id in needed
    ]
    requires_grad = {v.id: False for v in graph.values}
    if mode is LoweringMode.TRAINING:
        _plan_training(graph, planned, starts=outs[:seeded], requires_grad=requires_grad)
        if recompute:
            _plan_recompute(planned, outs)
    padded_grads = _plan_padded_grads(planned) if mode is LoweringMode.TRAINING else {}
    last_use = {}
    for index, p in enumerate(planned):
        for v in p.node.inputs:
            last_use[v.id] = index
    program = Program(
        graph=graph,
        mode=mode,
        nodes=planned,
        outputs=outs,
        instances={},
        requires_grad=requires_grad,
        last_use=last_use,
        rewrites=reports,
        seeded=seeded,
        padded_grads=padded_grads,
    )
    with compiling.gathered() as jobs, tuning.deferred() as preparations:
        _dry_run(program)  # builds exactly the kernel instances the launches use
    if preparations:  # choices to time: every candidate compiled in one pool, then a dry run that times them
        with compiling.batched():
            while preparations:
                preparations.popitem()[1]()  # (each let go at once: its bench holds operands on the GPU)
        for p in planned:  # (the launches the first dry run saw, with the default configurations)
            for launched in (p.forward_launches, p.backward_launches, p.recompute_launches):
                launched.clear()
        with compiling.gathered() as jobs:
            _dry_run(program)
    compiling.compile_all(jobs)  # every kernel the program launches, at once, before it first runs
    if mode is LoweringMode.TRAINING:
        for dtype in {p.node.dtype for p in planned if p.needs_backward} | {v.dtype for v in graph.params}:
            if dtype.is_floating_point:
                program.instances[(id(accumulate_kernel), dtype)] = accumulate_kernel.instance(dtype)
    return program


def _check_structure(graph: Graph) -> None:
    """Every node reads values of this graph made before it: a graph edited by hand into a cycle,
    or reading another graph's value, is refused here, naming the node, not deep in a run."""
    known = {id(v) for v in graph.values if v.kind != "node"}
    for node in graph.nodes:
        for v in node.inputs:
            if id(v) not in known:
                made_later = any(v is later.output for later in graph.nodes)
                why = "made by a later node (the graph has a cycle)" if made_later else "not a value of this graph"
                raise GraphError(f"graph {graph.name!r}: node '{node.name}' reads '{v.name}', which is {why}")
        known.add(id(node.output))


def _resolve_outputs(graph: Graph, outputs) -> list[Value]:
    if outputs is None:
        outs = list(graph.outputs)
        if not outs:
            if not graph.nodes:
                raise GraphError(f"graph {graph.name!r} has no nodes to lower")
            outs = [graph.nodes[-1].output]
    else:
        from ..core.graph import Tensor

        outs = [
            o.value if isinstance(o, Tensor) else o
            for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
        ]
    return outs


def _ancestors(outs: list[Value]) -> set[int]:
    seen: set[int] = set()
    stack = list(outs)
    while stack:
        v = stack.pop()
        if v.id in seen:
            continue
        seen.add(v.id)
        if v.producer is not None:
            stack.extend(v.producer.inputs)
    return seen


def _differentiable(op: RuntimeOp, index: int, value: Value) -> bool:
    if not value.dtype.is_floating_point:
        return False
    return op.differentiable_inputs is None or index in op.differentiable_inputs


def _plan_training(
    graph: Graph, planned: list[PlannedNode], *, starts: list[Value], requires_grad: dict[int, bool]
) -> None:
    """Mark what needs a gradient and which nodes run backwards, from ``starts`` (the loss, or
    the seeded outputs) back."""
    origin: dict[int, str] = {}  # value id -> a gradient source it depends on (for error messages)
    for v in graph.values:
        if v.kind in ("param", "input") and v.requires_grad:
            requires_grad[v.id] = True
            origin[v.id] = f"{'trainable parameter' if v.kind == 'param' else 'input'} '{v.name}'"
    for p in planned:
        node = p.node
        if node.op.stops_gradient:
            continue
        for i, v in enumerate(node.inputs):
            if requires_grad[v.id] and _differentiable(node.op, i, v):
                p.grad_mask[i] = True
        if any(p.grad_mask) and node.output.dtype.is_floating_point:
            requires_grad[node.output.id] = True
            origin[node.output.id] = next(origin[v.id] for i, v in enumerate(node.inputs) if p.grad_mask[i])
    names = ", ".join(repr(v.name) for v in starts)
    what = f"the loss {names}" if len(starts) == 1 else f"the outputs {names}"
    if not any(requires_grad[v.id] for v in starts):
        raise NoGradientError(
            f"{what} depend{'s' if len(starts) == 1 else ''} on no trainable parameter or input that requires a "
            "gradient: training it would compute nothing (lower it for INFERENCE instead)"
        )
    on_loss_path = {v.id for v in starts}  # values whose gradient reaches a start (not through stop_gradient)

    def reaches(p: PlannedNode) -> bool:  # an op copying input 0's gradient runs backwards when input 0 has one
        copies = p.op.grad_copies_input0 is not None and p.node.inputs[0].id in on_loss_path
        return p.node.output.id in on_loss_path or copies

    for p in reversed(planned):
        if reaches(p):
            on_loss_path.update(v.id for v, m in zip(p.node.inputs, p.grad_mask) if m)
    for p in planned:
        node = p.node
        p.needs_backward = requires_grad[node.output.id] and reaches(p)
        if not p.needs_backward:
            p.grad_mask = [False] * len(node.inputs)
            continue
        if not node.op.has_backward():
            raise MissingBackwardError(
                f"op {node.op.name} (node '{node.name}') has no backward, but it lies between "
                f"{origin[node.output.id]} and {what}. Give the op a backward kernel, "
                "mark the parameter non-trainable, or cut the path with teeny.ops.stop_gradient(...)"
            )
        saves = node.op.saves_inputs
        p.saved_inputs = [bool(saves) if isinstance(saves, bool) else (i in saves) for i in range(len(node.inputs))]


def _plan_recompute(planned: list[PlannedNode], outputs: list[Value]) -> None:
    """Mark the inputs the backward writes again rather than the forward keeping them: the
    output y of a node P whose op is ``recomputable`` and keeps y for nothing of its own, read
    for its backward by a later node. P then keeps what ``recompute_launches`` reads (its saved
    inputs, or graph inputs and parameters, which are held anyway), and P's cache entry, alive
    until P's own backward (after every consumer's), is where the backward recomputes y from.
    A value that is a program output, or a P with an input recomputed itself, keeps y saved."""
    index_of = {p.node.output.id: i for i, p in enumerate(planned)}
    keep = {v.id for v in outputs}
    recomputed_values: set[int] = set()

    def can_recompute(v: Value) -> bool:
        producer = planned[index_of[v.id]] if v.id in index_of else None
        if producer is None or v.id in keep or not producer.needs_backward:
            return False
        op, inputs = producer.op, producer.node.inputs
        if op.recomputable is None or op.saves_output:
            return False
        reads = [(k, inputs[k]) for k in op.recomputable]
        if any(u.id in recomputed_values for _, u in reads):
            return False
        return all(producer.saved_inputs[k] or u.kind != "node" for k, u in reads)

    for p in planned:
        if not p.needs_backward:
            continue
        for i, v in enumerate(p.node.inputs):
            if p.saved_inputs[i] and v.kind == "node" and (v.id in recomputed_values or can_recompute(v)):
                producer_index = index_of[v.id]
                producer = planned[producer_index]
                for k in producer.op.recomputable:
                    producer.saved_inputs[k] = True
                p.saved_inputs[i] = False
                p.recomputed[i] = producer_index
                recomputed_values.add(v.id)


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _plan_padded_grads(planned: list[PlannedNode]) -> dict[int, int]:
    """The values whose gradient gets rows padded to 16 bytes (value id -> the padded row length):
    the input of an op that may write its gradient so (``RuntimeOp.grad_rows_padded``: a loss of
    GPT-2's (8192, 50257) logits), rows not 16-byte aligned, up through the views that pass it on
    (a reshape keeping the last dim) to the op that made it, which must read its dY by rows
    (``strided_grad_output``: a linear, whose TMA products then read it with no padded copy).
    Every value on the way has one reader that wants its gradient (a seed, where a call gives one
    to an output, is added as it is, into a contiguous sum)."""
    readers: dict[int, int] = {}
    for p in planned:
        for v, wanted in zip(p.node.inputs, p.grad_mask):
            readers[v.id] = readers.get(v.id, 0) + wanted
    padded: dict[int, int] = {}
    for p in planned:
        for i in p.op.grad_rows_padded if p.needs_backward else ():
            v = p.node.inputs[i]
            if not p.grad_mask[i] or len(v.shape) != 2:
                continue
            size, row = v.dtype.itemsize, v.shape[-1]
            if (row * size) % TMA_ALIGN == 0:
                continue
            chain = [v]
            while chain[-1].producer is not None and isinstance(chain[-1].producer.op, ViewOp):
                source = chain[-1].producer.inputs[0]
                if chain[-1].producer.op.stops_gradient or not source.shape or source.shape[-1] != row:
                    break
                chain.append(source)
            maker = chain[-1].producer
            if maker is None or not maker.op.strided_grad_output or isinstance(maker.op, ViewOp):
                continue
            if any(readers.get(u.id, 0) != 1 for u in chain):
                continue
            padded.update((u.id, padded_length(row, size)) for u in chain)
    return padded


def grad_buffer(shape, dtype: torch.dtype, row: int | None, device) -> torch.Tensor:
    """A gradient's buffer of ``shape``: contiguous, or (``row``: ``Program.padded_grads``) a view
    of rows ``row`` elements apart."""
    if row is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    rows = math.prod(shape[:-1])
    return torch.empty((rows, row), dtype=dtype, device=device)[:, : shape[-1]].view(tuple(shape))


def node_context(program: Program, p: PlannedNode, *, dry_run: bool) -> dict[str, Any]:
    """What every ``OpContext`` of ``p``'s runs shares, the dry run's and the executor's: the
    node's op, name, dtype and shapes and the program's kernel instances, as arguments of
    ``OpContext.for_forward`` / ``for_recompute`` / ``for_backward``."""
    node = p.node
    return dict(
        op=node.op,
        node_name=node.name,
        dtype=node.dtype,
        instances=program.instances,
        input_shapes=[v.shape for v in node.inputs],
        output_shape=node.output.shape,
        dry_run=dry_run,
    )


def extra_buffers(p: PlannedNode, alloc) -> dict[str, torch.Tensor]:
    extras = p.op.extra_outputs([v.shape for v in p.node.inputs], p.node.dtype)
    return {name: alloc(shape, dtype) for name, (shape, dtype) in extras.items()}


def _addend_nodes(program: Program) -> dict[int, bool]:
    """The nodes whose backward the executor may hand a gradient to add to input 0's
    (``RuntimeOp.grad_accumulates``), by index: True where it does when every output's gradient
    is given (a later node also wants input 0's gradient: the backward runs in reverse, so that
    gradient is waiting), False where only input 0's own gradient as a program output would be
    waiting. Which it is in a call depends on the outputs whose gradients the call gives."""
    outputs = {v.id for v in program.outputs}
    wanted_later: set[int] = set()
    nodes = {}
    for index in range(len(program.nodes) - 1, -1, -1):
        p = program.nodes[index]
        if not p.needs_backward:
            continue
        x = p.node.inputs[0] if p.node.inputs else None
        if p.op.grad_accumulates and x is not None and p.grad_mask[0] and (x.id in wanted_later or x.id in outputs):
            nodes[index] = x.id in wanted_later
        wanted_later |= {v.id for v, wanted in zip(p.node.inputs, p.grad_mask) if wanted}
    return nodes


def _dry_run(program: Program) -> None:
    addends = _addend_nodes(program)
    padded = program.padded_grads
    for index, p in enumerate(program.nodes):
        node = p.node
        out = node.output
        inputs = [_meta(v.shape, v.dtype) for v in node.inputs]
        output = _meta(node.output.shape, node.output.dtype)
        saved = extra_buffers(p, _meta)
        node_args = node_context(program, p, dry_run=True)
        ctx = OpContext.for_forward(**node_args, inputs=inputs, output=output, saved=saved, launched=p.forward_launches)

        def forward(p=p, inputs=inputs, ctx=ctx):
            p.is_view = p.op.view(inputs) is not None
            if not p.is_view:
                ctx.run(p.op.forward_launches(ctx))

        _run_checked(node, "forward", forward)
        if p.needs_backward:
            kept = [t if keep else None for t, keep in zip(inputs, p.saved_inputs)]
            for i, producer_index in p.recomputed.items():
                producer = program.nodes[producer_index]
                kept[i] = _meta(node.inputs[i].shape, node.inputs[i].dtype)
                rctx = OpContext.for_recompute(
                    **node_context(program, producer, dry_run=True),
                    inputs=[_meta(v.shape, v.dtype) for v in producer.node.inputs],
                    output=kept[i],
                    saved=extra_buffers(producer, _meta),
                    launched=p.recompute_launches,
                )
                _run_checked(producer.node, "recompute", lambda c=rctx, op=producer.op: c.run(op.recompute_launches(c)))
            # the backward as the executor may run it: where input 0's gradient may be waiting, with it
            # to add and without (each product's configuration chosen here, none in a run), the
            # likelier way last (the launches the summary counts and the compile ahead sees)
            variants = ([False, True] if addends[index] else [True, False]) if index in addends else [False]
            for adds in variants:
                bctx = OpContext.for_backward(
                    **node_args,
                    inputs=kept,
                    output=output if node.op.saves_output else None,
                    saved=saved,
                    grad_output=grad_buffer(out.shape, out.dtype, padded.get(out.id), "meta"),
                    grads=[
                        grad_buffer(v.shape, v.dtype, padded.get(v.id), "meta") if m else None
                        for v, m in zip(node.inputs, p.grad_mask)
                    ],
                    grad_input_addend=_meta(node.inputs[0].shape, node.inputs[0].dtype) if adds else None,
                    launched=p.backward_launches if adds == variants[-1] else [],  # (the summary counts one)
                )
                _run_checked(node, "backward", lambda bctx=bctx: bctx.run(node.op.backward_launches(bctx)))


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return (
        n
        * (
            torch.finfo(dtype).bits
            if dtype.is_floating_point
            else torch.iinfo(dtype).bits
            if dtype != torch.bool
            else 8
        )
        // 8
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _run_checked(node: Node, phase: str, fn) -> None:
    try:
        fn()
    except TeenyError:
        raise
    except NotImplementedError as exc:
        raise TeenyError(f"op {node.op.name} (node '{node.name}', {phase}): {exc}") from None
    except Exception as exc:  # an op's Python launch code failed: say which op
        raise TeenyError(
            f"op {node.op.name} (node '{node.name}', {phase}) failed while packing its launch: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
