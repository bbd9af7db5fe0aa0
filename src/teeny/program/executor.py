"""``Executor``: runs a ``Program`` forwards, keeps what the backward kernels need, runs the
chain rule backwards, and owns the parameters and their gradients.

Parameters live in one flat arena per dtype and their gradients in another, so zeroing the
gradients or an optimizer step is one launch whatever the number of parameters;
``executor.params[name]`` and ``executor.grads[name]`` are views into the arenas. An arena
holds first the parameters the backward writes, in the order it finishes their gradients, then
the other trainable ones, then the non-trainable ones (``arena_order``): an optimizer updates
the prefix ``grad_numel[dtype]`` and never touches the rest.

``forward_train`` returns the outputs and an ``ActivationCache`` holding, per node, only the
tensors its op declared it needs (``saves_inputs``, ``saves_output``, ``extra_outputs``).
``backward`` walks the nodes in reverse, hands each op its saved tensors and the gradient of
its output, sums the gradients of values used several times, adds parameter gradients into
the gradient arena (they accumulate until ``zero_grad``), and drops each node's cache entry
as soon as its backward has run.

What every run does the same is worked out once, when the executor is made: per node a
``NodeRun`` (where its inputs come from, its extra outputs, the fixed arguments of its
``OpContext``, what it frees). Each node's launches are built, checked and fired the full way on
its first run and recorded (``replay.NodeReplay``); later runs fire the recorded launches with
their own tensors (on a GPU straight through Triton's C launcher), and build an ``OpContext`` only
where a node cannot be replayed. Whole runs are recorded too (``tape.Replayed``): once every
node replays, a forward is its ATen calls and launches over numbered tensors, with none of the
per-node bookkeeping; a backward likewise, one tape per state of the parameters' gradients
(which are known to be zero). The cache of a taped forward is one list (``ActivationCache.flat``,
laid out by ``cached_nodes``) that the backward's tape takes whole (without checking its tensors
again where one forward tape made it and the seed is the executor's own). A CUDA graph's capture, a
hook on ``_node_backward``, a cache built elsewhere (``teeny.torch.bridge``), a program with an op
that is not capturable and a one-node program run node by node.

A tensor the backward reads (an input, a parameter, an output handed to the caller) that is
changed in place between ``forward_train`` and ``backward`` would silently give a wrong
gradient: the cache records the PyTorch version counter of each saved tensor the caller can
reach (inputs, parameters, constants, outputs, and views, which share their base's counter), and
``backward`` refuses to run when one moved, naming the input. (Kernels write through pointers and
move no counter: only PyTorch in-place operations are seen, which is what a user can do; the
intermediate buffers are the executor's own.)
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.device import DEVICE
from ..core.errors import TeenyError
from ..core.graph import Node, Value
from ..core.runtime import ARENA_ALIGN, OpContext, Shape, capturing, raise_failed_checks, raise_not_capturable
from .accumulate import accumulate
from .lowering import LoweringMode, PlannedNode, Program, grad_buffer, node_context
from .replay import NodeReplay, storage_id
from .tape import Replayed, Tape, not_capturable


def gradient_final_node(program: Program) -> dict[int, int]:
    """For each parameter the backward writes (value id), the index of the node whose backward
    writes its gradient last: the first node that uses it, since the backward runs in reverse."""
    final: dict[int, int] = {}
    for index, p in enumerate(program.nodes):
        for v, wanted in zip(p.node.inputs, p.grad_mask):
            if wanted and v.kind == "param":
                final.setdefault(v.id, index)
    return final


def arena_order(program: Program) -> list[Value]:
    """The parameters in arena order: first those the backward writes, in reverse order of first
    use (the order in which the backward finishes their gradients, so that the finished gradients
    grow as a prefix of the arena and data-parallel buckets are contiguous ranges), then trainable
    parameters the loss does not reach, then non-trainable ones (BatchNorm's running statistics,
    frozen weights). An optimizer updates the first group only, in one launch per arena."""
    final = gradient_final_node(program)
    params = program.params
    written = sorted((v for v in params if v.id in final), key=lambda v: -final[v.id])  # stable: ties keep graph order
    order = [
        *written,
        *(v for v in params if v.id not in final and v.requires_grad),
        *(v for v in params if not v.requires_grad),
    ]
    groups = {}  # value id -> the parameters an op wants side by side (RuntimeOp.adjacent_params), in order
    for p in program.nodes:
        for positions in p.op.adjacent_params:
            members = [p.node.inputs[i] for i in positions]
            if any(v.kind != "param" for v in members):
                raise TeenyError(
                    f"op {p.op.name} (node '{p.name}') asks for inputs {list(positions)} side by side in the arena, "
                    f"but {', '.join(repr(v.name) for v in members if v.kind != 'param')} are not parameters"
                )
            groups.update((v.id, members) for v in members)
    if not groups:
        return order
    category = {v.id: (v.id in final, v.requires_grad, v.dtype) for v in params}
    laid, placed = [], set()
    for v in order:  # a group at its first member's place
        for member in groups.get(v.id, [v]):
            if member.id not in placed:
                if category[member.id] != category[v.id]:
                    raise TeenyError(f"parameters {member.name!r} and {v.name!r} cannot lie side by side in the arena")
                laid.append(member)
                placed.add(member.id)
    return laid


@dataclass(eq=False)
class NodeRun:
    """What every run of one node does the same, worked out once (``Executor._plan_runs``): the
    value ids of its inputs, its extra outputs, the fixed arguments of its ``OpContext``, the
    intermediate values it frees, and the replays of its forward, recompute and backward
    launches (``replay.NodeReplay``)."""

    planned: PlannedNode
    inputs: tuple[int, ...]
    extras: tuple[tuple[str, Shape, torch.dtype], ...]  # (name, shape, dtype) of each extra output
    # the roles the executor allocated (NodeReplay.run): of the forward (inputs other nodes wrote,
    # output, extra outputs), and of its cache entry's tensors as roles of the recompute and backward
    # (entries forward_train made, marked "allocated": one rebuilt from elsewhere, as teeny.torch
    # does, holds tensors whose layout is checked)
    fresh_forward: int
    fresh_saved: int
    own_inputs: int  # the inputs that are parameters or constants: roles the same every run (NodeReplay.run)
    context: dict[str, Any]  # lowering.node_context
    frees: tuple[int, ...]  # intermediate values no later node reads
    single_use: frozenset[int]  # the positions of the inputs the node reads once
    # (position, value) of the tensors of its cache entry that the caller can change in place (an
    # input, parameter or constant, an output handed to the caller, or a view): the input at that
    # position, or the output at -1; the versions of the others are not recorded
    versioned: tuple[tuple[int, Value], ...]
    forward: NodeReplay
    recompute: NodeReplay
    backward: NodeReplay


class ActivationCache:
    """What the forward pass kept for the backward pass: per node, the saved inputs, output
    and extra tensors. Entries are dropped once their node's backward has run.

    ``forward_train`` keeps them as one list, ``flat`` (in ``Executor.cached_nodes`` order),
    which a replayed backward takes whole; ``entries`` (node id -> ``{"inputs", "output",
    "saved"}``) is made from it when asked for, or filled in by whoever builds a cache
    (``teeny.torch.bridge``)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = weakref.ref(executor)  # the executor whose backward may read it
        self.flat: list[torch.Tensor] | None = None
        self.made_by: Tape | None = None  # the forward tape that made flat (None: none, or not known)
        self._entries: dict[int, dict[str, Any]] | None = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.used = False
        self.inputs: dict[int, torch.Tensor] = {}  # value id -> the tensor bound to that graph input
        self.versions: list[tuple] = []  # (saved tensor, its version, node, value): Executor._saved_versions

    @property
    def entries(self) -> dict[int, dict[str, Any]]:
        """node id -> ``{"inputs", "output", "saved"}`` and, where forward_train made it, ``"allocated"``."""
        if self._entries is None:
            executor = self.executor()
            self._entries = {} if executor is None or self.flat is None else executor.entries_of(self.flat)
        return self._entries

    def tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for entry in self.entries.values():
            for t in [*entry["inputs"], entry["output"], *entry["saved"].values()]:
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t
        return list(seen.values())

    def num_tensors(self) -> int:
        return len(self.tensors())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class CachedNode:
    """Where one node's cache entry lies in ``ActivationCache.flat``: per input its index there,
    the executor's own tensor (a parameter or constant, the same every run) or None (not
    saved); the output's index or None; each extra output's name and index."""

    node_id: int
    inputs: tuple[int | torch.Tensor | None, ...]
    output: int | None
    saved: tuple[tuple[str, int], ...]


def inference_tensor_error(described: str) -> TeenyError:
    """The error for an inference tensor that a backward would keep: it has no version counter,
    so a change to it before the backward would go unseen."""
    return TeenyError(
        f"{described} is an inference tensor (made under torch.inference_mode()), which the backward cannot "
        "keep: make it under torch.no_grad() instead, or pass a clone made outside inference mode"
    )


class Executor:
    def __init__(
        self,
        program: Program,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ):
        if not isinstance(program, Program):
            raise TypeError(
                f"Executor takes a Program, got {type(program).__name__}: lower it first, "
                "Executor(lower(graph, LoweringMode.TRAINING))"
            )
        self.program = program
        self.device = DEVICE if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.training = program.mode is LoweringMode.TRAINING
        self._build_arenas(seed)
        if params is not None:
            self.load_params(params)
        self.live_values = 0  # after forward: how many intermediate buffers were still alive at the end
        self._consts = {v.id: v.data.to(self.device) for v in program.graph.values if v.kind == "const"}
        self._zeroed: set[int] = set(self._grad_by_id)  # the gradient arena starts at zero
        self._plan_runs()

    def _plan_runs(self) -> None:
        """What every run does the same, worked out once: the graph's inputs, and per node a
        ``NodeRun`` (where its tensors come from, what it frees, its launches' replays)."""
        program = self.program
        self._inputs = program.inputs
        self._input_names = {v.name for v in self._inputs}
        keep = {v.id for v in program.outputs}
        self._intermediates = {v.id for v in program.graph.values if v.kind == "node" and v.id not in keep}
        self._runs: dict[int, NodeRun] = {}  # node id -> its plan
        views = {p.node.output.id for p in program.nodes if p.is_view}  # values that are views of others
        for index, p in enumerate(program.nodes):
            node = p.node
            frees = (v.id for v in node.inputs if program.last_use.get(v.id) == index and v.id in self._intermediates)
            extras = node.op.extra_outputs([v.shape for v in node.inputs], node.dtype)
            self._runs[node.id] = NodeRun(
                planned=p,
                inputs=tuple(v.id for v in node.inputs),
                extras=tuple((name, tuple(shape), dtype) for name, (shape, dtype) in extras.items()),
                fresh_forward=_allocated_bits(node.inputs, views) | ((1 << (1 + len(extras))) - 1) << len(node.inputs),
                fresh_saved=_allocated_bits([*node.inputs, node.output], views)
                | (((1 << len(extras)) - 1) << (len(node.inputs) + 1)),
                own_inputs=sum(1 << i for i, v in enumerate(node.inputs) if v.kind in ("param", "const")),
                context=node_context(program, p, dry_run=False),
                frees=tuple(dict.fromkeys(frees)),
                single_use=frozenset(i for i, v in enumerate(node.inputs) if node.inputs.count(v) == 1),
                versioned=tuple(
                    (i, v)
                    for i, v in [*enumerate(node.inputs), (-1, node.output)]
                    if v.kind != "node" or v.id in keep or v.id in views
                ),
                forward=NodeReplay(node.op),
                recompute=NodeReplay(node.op),
                backward=NodeReplay(node.op),
            )
        self._first_recompute_reader: dict[int, int] = {}  # value id -> the first node recomputing it
        for index, p in enumerate(program.nodes):
            for i in p.recomputed:
                self._first_recompute_reader.setdefault(p.node.inputs[i].id, index)
        self._plan_cache()
        # whole runs recorded once and replayed (teeny.program.tape): the forward with and without
        # its cache, the backward per state of the gradients (see backward)
        self._blocked = not_capturable(program)
        if len(program.nodes) == 1:  # (measured: a tape's checks of its tensors cost more than one node's replay)
            self._blocked = self._blocked or "one node: its node replay is its whole run already"
        arenas = [*self.param_arenas.values(), *self.grad_arenas.values(), *self._consts.values()]
        self._own_memory = frozenset(t.untyped_storage().data_ptr() for t in arenas if t.numel())
        self._forward_tapes = {
            keep: Replayed(functools.partial(self._forward_flat, keep), self._blocked, self._own_memory)
            for keep in (False, True)
        }
        self._backward_tapes: dict[tuple, Replayed] = {}
        self._backward_known: dict[tuple, Tape] = {}  # (backward key, forward tape) -> the backward tape
        self._zeroed_after: dict[tuple, frozenset[int]] = {}  # backward key -> which gradients are still zero after it
        self._input_grads = [v for v in self._inputs if v.requires_grad]

    def _plan_cache(self) -> None:
        """Where each tensor of a cache entry lies in ``ActivationCache.flat`` (``cached_nodes``),
        and which of them the caller can change in place (``_versioned``: their versions are
        recorded and checked before the backward)."""
        own = {**self._consts, **self._param_by_id}
        self.cached_nodes: list[CachedNode] = []
        self._versioned: list[tuple[int | torch.Tensor, Node, Value]] = []
        seen: set[int] = set()
        index = 0
        for p in self.program.nodes:
            if not p.needs_backward:
                continue
            node, run = p.node, self._runs[p.node.id]
            inputs: list[int | torch.Tensor | None] = []
            for v, kept in zip(node.inputs, p.saved_inputs):
                if not kept:
                    inputs.append(None)
                elif v.id in own:
                    inputs.append(own[v.id])
                else:
                    inputs.append(index)
                    index += 1
            output = None
            if p.op.saves_output:
                output, index = index, index + 1
            saved = tuple((name, index + k) for k, (name, _, _) in enumerate(run.extras))
            index += len(saved)
            self.cached_nodes.append(CachedNode(node.id, tuple(inputs), output, saved))
            for i, value in run.versioned:
                source = inputs[i] if i >= 0 else output
                if source is not None and value.id not in seen:
                    seen.add(value.id)
                    self._versioned.append((source, node, value))

    # --- parameters ----------------------------------------------------------------------
    def _build_arenas(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        by_dtype: dict[torch.dtype, list[Value]] = {}
        for v in arena_order(self.program):
            by_dtype.setdefault(v.dtype, []).append(v)
        self.param_arenas: dict[torch.dtype, torch.Tensor] = {}
        self.grad_arenas: dict[torch.dtype, torch.Tensor] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self._param_by_id: dict[int, torch.Tensor] = {}
        self._grad_by_id: dict[int, torch.Tensor] = {}
        # the layout: each arena's parameters in order with their offsets, and how long the prefix of
        # parameters the backward writes is (all an optimizer updates; the rest it never touches)
        self.arena_params: dict[torch.dtype, list[tuple[Value, int]]] = {}
        self.grad_numel: dict[torch.dtype, int] = {}
        written = gradient_final_node(self.program)
        self.spans: dict[int, int] = {}  # value id -> elements it occupies in its arena (padded)
        for dtype, values in by_dtype.items():
            for v in values:
                self.spans[v.id] = _aligned_numel(v.numel, dtype)
            total = sum(self.spans[v.id] for v in values)
            arena = torch.zeros(total, dtype=dtype, device=self.device)
            grads = torch.zeros(total, dtype=dtype, device=self.device) if self.training else None
            offset = 0
            self.arena_params[dtype] = []
            for v in values:
                self.params[v.name] = arena[offset : offset + v.numel].view(v.shape)
                self._param_by_id[v.id] = self.params[v.name]
                if grads is not None:
                    gview = grads[offset : offset + v.numel].view(v.shape)
                    self.grads[v.name] = gview
                    self._grad_by_id[v.id] = gview
                self.arena_params[dtype].append((v, offset))
                offset += self.spans[v.id]
            self.grad_numel[dtype] = sum(self.spans[v.id] for v in values if v.id in written)
            self.param_arenas[dtype] = arena
            if grads is not None:
                self.grad_arenas[dtype] = grads
        for v in self.program.params:  # initialise in graph order: a value does not depend on the layout
            init = v.init(tuple(v.shape), generator, v.dtype)
            if tuple(init.shape) != tuple(v.shape):
                raise TeenyError(
                    f"initialiser of parameter '{v.name}' returned shape {tuple(init.shape)}, expected {v.shape}"
                )
            self._param_by_id[v.id].copy_(init)

    def span(self, v: Value) -> int:
        """Elements parameter ``v`` occupies in its arena: its size rounded up so that the next
        parameter starts 16-byte aligned (the padding stays zero, gradient and all)."""
        return self.spans[v.id]

    def load_params(self, params: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy values into the parameters (e.g. from a checkpoint or a PyTorch model)."""
        unknown = sorted(set(params) - set(self.params))
        missing = sorted(set(self.params) - set(params))
        if strict and (unknown or missing):
            raise KeyError(f"load_params: unknown parameters {unknown}, missing parameters {missing}")
        for name, value in params.items():
            if name not in self.params:
                continue
            target = self.params[name]
            value = torch.as_tensor(value).detach()
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_params: parameter '{name}' has shape {tuple(target.shape)}, got {tuple(value.shape)}"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.params.items()}

    def zero_grad(self) -> None:
        """Zero every parameter gradient (one fill per arena). Until the next backward writes
        them, teeny knows they are zero and lets that backward write them in place instead of
        adding into them; write into ``grads`` yourself only after a backward."""
        for arena in self.grad_arenas.values():
            arena.zero_()
        self._zeroed = set(self._grad_by_id)  # gradients known to be zero: a backward may write them directly

    # --- forward -------------------------------------------------------------------------
    def _bind_inputs(self, inputs: Any, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of the graph's inputs, in their order, checked and made contiguous and aligned."""
        graph_inputs = self._inputs
        if inputs is None:
            given: dict[str, Any] = {}
        elif isinstance(inputs, Mapping):
            given = dict(inputs)
        elif isinstance(inputs, torch.Tensor):
            given = {graph_inputs[0].name: inputs} if graph_inputs else {"?": inputs}
        elif isinstance(inputs, Sequence):
            if len(inputs) != len(graph_inputs):
                names = ", ".join(v.name for v in graph_inputs)
                raise TypeError(f"expected {len(graph_inputs)} inputs ({names}), got {len(inputs)}")
            given = {v.name: t for v, t in zip(graph_inputs, inputs)}
        else:
            raise TypeError(f"inputs must be a dict, a list or a tensor, got {type(inputs).__name__}")
        given.update(kwargs)
        names = self._input_names
        if not names.issuperset(given):
            unknown = sorted(set(given) - names)
            raise KeyError(f"unknown inputs {unknown}; the graph's inputs are {sorted(names)}")
        bound: list[torch.Tensor] = []
        for v in graph_inputs:
            if v.name not in given:
                raise KeyError(f"missing input '{v.name}' (shape {v.shape}, {str(v.dtype).replace('torch.', '')})")
            t = given[v.name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input '{v.name}' must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != v.shape:
                raise ValueError(
                    f"input '{v.name}' has shape {tuple(t.shape)}, but the program was lowered for {v.shape} "
                    "(shapes are static: lower again for another shape)"
                )
            if t.dtype != v.dtype:
                raise TypeError(
                    f"input '{v.name}' has dtype {str(t.dtype).replace('torch.', '')}, expected "
                    f"{str(v.dtype).replace('torch.', '')}"
                )
            if t.device != self.device:
                if t.device.type != "cpu":
                    raise ValueError(f"input '{v.name}' is on {t.device}, but this executor runs on {self.device}")
                t = t.to(self.device)
            if not t.is_contiguous():
                t = t.contiguous()
            if t.data_ptr() % ARENA_ALIGN and t.numel():  # the plan assumes aligned buffers (TMA loads)
                t = t.clone()
            bound.append(t)
        return bound

    def _alloc(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        if not shape:
            return torch.empty((), dtype=dtype, device=self.device)
        return torch.empty(*shape, dtype=dtype, device=self.device)  # sizes one by one: parsed faster than a tuple

    def _run_forward(self, inputs: Any, kwargs: dict, cache: ActivationCache | None):
        bound = self._bind_inputs(inputs, kwargs)
        keep = cache is not None
        entries = None  # the cache's entries as the run made them, where it ran node by node
        if self._blocked or capturing():  # (a CUDA graph's capture: TrainStep)
            entries = {} if keep else None
            flat = self._forward_flat(keep, list(bound), entries)
        else:
            flat = self._forward_tapes[keep](bound)
        outputs = self.program.outputs
        outs = flat[: len(outputs)]
        if cache is not None:
            cache.flat, cache._entries = flat[len(outputs) :], entries
            cache.made_by = None if entries is not None else self._forward_tapes[keep].answered
            cache.inputs = {v.id: t for v, t in zip(self._inputs, bound)}
            cache.outputs = {v.id: t for v, t in zip(outputs, outs)}
            cache.versions = self._saved_versions(cache)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _forward_flat(self, keep: bool, tensors: list[torch.Tensor], entries: dict | None = None) -> list[torch.Tensor]:
        """The forward on the graph's input tensors, node by node: its outputs, then (``keep``)
        the tensors of its cache in ``cached_nodes`` order, which are also put into ``entries``
        (``ActivationCache.entries``) when one is given. What a forward tape records."""
        program = self.program
        values = dict(zip((v.id for v in self._inputs), tensors))
        values.update(self._consts)
        values.update(self._param_by_id)
        entries = {} if entries is None else entries
        checks: list = []
        for run in self._runs.values():
            p = run.planned
            node, op = p.node, p.op
            args = [values[i] for i in run.inputs]
            saved = {name: self._alloc(shape, dtype) for name, shape, dtype in run.extras}
            out = op.view(args) if p.is_view else None
            if out is not None and not out.is_contiguous():
                raise TeenyError(
                    f"op {op.name} (node '{node.name}'): view() returned a non-contiguous tensor; "
                    "kernels read contiguous buffers, so return None and copy with a kernel instead"
                )
            if out is None:
                out = self._alloc(node.output.shape, node.output.dtype)
                if not op.capturable and capturing():
                    raise_not_capturable(op, node.name)

                def context(run=run, args=args, out=out, saved=saved) -> OpContext:
                    return OpContext.for_forward(**run.context, inputs=args, output=out, saved=saved, checks=checks)

                run.forward.run([*args, out, *saved.values()], context, checks, run.fresh_forward, run.own_inputs)
            values[node.output.id] = out
            if keep and p.needs_backward:
                entries[node.id] = {
                    "inputs": [a if s else None for a, s in zip(args, p.saved_inputs)],
                    "output": out if op.saves_output else None,
                    "saved": saved,
                    "allocated": True,  # the executor's own buffers (NodeRun.fresh_saved)
                }
            for value_id in run.frees:  # free what no later node reads
                values.pop(value_id, None)
        raise_failed_checks(checks)
        self.live_values = len(self._intermediates.intersection(values))
        flat = [values[v.id] for v in program.outputs]
        for cached in self.cached_nodes if keep else ():
            entry = entries[cached.node_id]
            flat.extend(t for t, k in zip(entry["inputs"], cached.inputs) if isinstance(k, int))
            if cached.output is not None:
                flat.append(entry["output"])
            flat.extend(entry["saved"][name] for name, _ in cached.saved)
        return flat

    def entries_of(self, flat: Sequence[torch.Tensor], start: int = 0) -> dict[int, dict[str, Any]]:
        """The cache entries (``ActivationCache.entries``) of the tensors ``flat[start:]``."""
        entries = {}
        for cached in self.cached_nodes:
            entries[cached.node_id] = {
                "inputs": [k if not isinstance(k, int) else flat[start + k] for k in cached.inputs],
                "output": None if cached.output is None else flat[start + cached.output],
                "saved": {name: flat[start + k] for name, k in cached.saved},
                "allocated": True,  # the executor's own buffers (NodeRun.fresh_saved)
            }
        return entries

    def forward(self, inputs: Any = None, **kwargs: torch.Tensor):
        """Run the program; returns its output (a tuple if it has several)."""
        return self._run_forward(inputs, kwargs, cache=None)

    __call__ = forward

    def forward_train(self, inputs: Any = None, **kwargs: torch.Tensor):
        """Run the program keeping what the backward needs: ``(outputs, ActivationCache)``."""
        if not self.training:
            raise TeenyError("this program was lowered for INFERENCE: lower it with LoweringMode.TRAINING to train")
        cache = ActivationCache(self)
        return self._run_forward(inputs, kwargs, cache), cache

    # --- backward ------------------------------------------------------------------------
    def backward(self, cache: ActivationCache, grad_output=None) -> dict[str, torch.Tensor]:
        """Backpropagate from the loss (the first output). ``grad_output`` defaults to 1 for a
        scalar loss. A program lowered with ``seeded=n`` (n > 1) takes a list of n gradients,
        one per seeded output (None: nothing flows back from that output). Parameter gradients
        are added into ``self.grads``; returns the gradients of the inputs that were marked
        ``requires_grad``. The seeds are the caller's: never written over."""
        if not isinstance(cache, ActivationCache):
            raise TypeError("backward(cache): pass the ActivationCache returned by forward_train")
        if cache.executor() is not self:
            raise TeenyError(
                "this ActivationCache was made by another Executor's forward_train: pass the cache of this "
                "executor's own forward_train"
            )
        if cache.used:
            raise TeenyError("this ActivationCache was already consumed by a backward pass; run forward_train again")
        program = self.program
        grads = self._seeds(program, grad_output)
        self._check_versions(cache)
        cache.versions = []  # its references would keep every saved tensor alive to the end of the backward
        cache.used = True
        hooked = "_node_backward" in self.__dict__  # a hook per node (training.distributed, tests) sees every node
        if cache._entries is not None or hooked or self._blocked or capturing():
            entries, cache.flat = cache.entries, None
            result = self._backward_entries(entries, grads)
        else:
            result = self._backward_taped(cache, grads, own_seed=grad_output is None)
        return {v.name: g for v, g in zip(self._input_grads, result)}

    def _backward_taped(self, cache: ActivationCache, grads: dict[int, torch.Tensor], own_seed: bool) -> list:
        """The backward of a cache ``forward_train`` made, through the tape of the gradients' state
        (``own_seed``: the seed is the executor's own ones, made by ``_seeds``)."""
        # one tape per state of the parameters' gradients (which are known to be zero: written in place
        # rather than added to) and per set of seeded outputs
        key = (frozenset(self._zeroed), tuple(grads))
        replayed = self._backward_tapes.get(key)
        if replayed is None:
            replayed = Replayed(functools.partial(self._backward_flat, key), self._blocked, self._own_memory)
            self._backward_tapes[key] = replayed
        tensors = [*grads.values(), *cache.flat]
        cache.flat, cache._entries = None, {}
        # a cache one forward tape made, with seeds of the executor's own (a scalar loss's ones, which
        # alias nothing), is laid out as every cache that tape makes: the backward tape that took the
        # last one takes it without checking its tensors again
        known = (key, cache.made_by) if own_seed and cache.made_by is not None else None
        if known in self._backward_known:
            result = replayed.call_laid_out_as(self._backward_known[known], tensors, consume=True)
        else:
            result = replayed(tensors, consume=True)  # each saved tensor freed after its node's backward
        if known is not None and replayed.answered is not None:
            self._backward_known[known] = replayed.answered
        self._zeroed = set(self._zeroed_after[key])
        return result

    def _backward_flat(self, key: tuple, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward from the seeds (one per value id of ``key[1]``) then the cache's tensors
        in ``tensors`` (emptied: the entries made of them hold them until their node's backward).
        What a backward tape records."""
        seeds = key[1]
        grads = dict(zip(seeds, tensors))
        entries = self.entries_of(tensors, start=len(seeds))
        tensors.clear()
        result = self._backward_entries(entries, grads)
        self._zeroed_after[key] = frozenset(self._zeroed)
        return result

    def _backward_entries(self, entries: dict[int, dict], grads: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The backward node by node over the cache ``entries`` from the seeds in ``grads``
        (value id -> gradient); the gradients of the inputs that require one."""
        program = self.program
        seeds = frozenset(storage_id(g) for g in grads.values())
        recomputed: dict[int, torch.Tensor] = {}  # value id -> written again, until its last reader's backward
        for index in range(len(program.nodes) - 1, -1, -1):
            p = program.nodes[index]
            if not p.needs_backward:
                continue
            node = p.node
            entry = entries.pop(node.id)
            grad_out = grads.pop(node.output.id, None)
            if grad_out is None:
                if p.op.grad_copies_input0 is None or node.inputs[0].id not in grads:
                    continue  # the output does not reach the loss through differentiable ops
                grad_out = self._alloc(node.output.shape, node.output.dtype).zero_()  # input 0's gradient to copy
            if p.recomputed:
                self._recompute(p, entry=entry, entries=entries, recomputed=recomputed, index=index)
            if not (p.op.strided_grad_output and _rows_with_one_stride(grad_out)):
                grad_out = grad_out.contiguous()
            buffer, addend = self._input_grad_buffer(
                p, index=index, entry=entry, grad_out=grad_out, seeds=seeds, grads=grads
            )
            if p.op.grad_copies_input0 is not None and addend is None and node.inputs[0].id in grads:
                raise TeenyError(  # its copy would miss the waiting part: a wrong gradient otherwise
                    f"op {node.op.name} (node '{node.name}') copies the whole gradient of '{node.inputs[0].name}' "
                    "into another input's, but the gradient waiting for it could not be handed over"
                )
            self._node_backward(p, entry, grad_out, grads, buffer, addend)  # positional: a hook (training.distributed)
        entries.clear()
        result = []
        for v in self._input_grads:
            g = grads.get(v.id)
            result.append(g if g is not None else torch.zeros(v.shape, dtype=v.dtype, device=self.device))
        return result

    def _saved_versions(self, cache: ActivationCache) -> list[tuple[torch.Tensor, int, Node, Value]]:
        """(tensor, version, node, value) for every tensor the backward will read that the caller
        can change in place (``NodeRun.versioned``): the node that saved it and the value it
        holds. Described only if it changes."""
        flat = cache.flat
        recorded = []
        for source, node, value in self._versioned:
            t = flat[source] if isinstance(source, int) else source
            try:
                version = t._version
            except RuntimeError:
                if not t.is_inference():
                    raise
                raise inference_tensor_error(self._describe_saved(cache, t, node, value)) from None
            recorded.append((t, version, node, value))
        return recorded

    def _describe_saved(self, cache: ActivationCache, t: torch.Tensor, node: Node, value: Value) -> str:
        """What a saved tensor is, for an error: the input or parameter whose memory it is (views
        of inputs name the input), else the node output it holds, else the node that saved it."""
        if t.numel():
            storage = storage_id(t)
            for v in self._inputs:
                source = cache.inputs[v.id]
                if source.numel() and storage_id(source) == storage:
                    return f"input '{v.name}'"
            for v in self.program.params:  # views of one arena: the parameter whose elements these are
                source = self._param_by_id[v.id]
                start = source.data_ptr()
                if source.numel() and start <= t.data_ptr() < start + source.numel() * source.element_size():
                    return f"parameter '{v.name}'"
        if value.kind == "node":
            return f"the output '{value.name}' of node '{value.producer.name}'"
        return f"a tensor saved by node '{node.name}'"

    def _check_versions(self, cache: ActivationCache) -> None:
        """Refuse a backward whose saved tensors were changed in place since the forward."""
        moved = [(t, node, value) for t, version, node, value in cache.versions if t._version != version]
        changed = sorted({self._describe_saved(cache, t, node, value) for t, node, value in moved})
        if changed:
            raise TeenyError(
                f"{', '.join(changed)} was modified in place between forward_train and backward: the backward "
                "kernels would read the new values and give a wrong gradient (clone before changing it, or run "
                "forward_train again)"
            )

    def _seeds(self, program, grad_output) -> dict[int, torch.Tensor]:
        """value id -> the gradient the backward starts from there (see ``backward``)."""
        starts = program.seeded_outputs
        if len(starts) == 1:
            given = [grad_output]
        elif isinstance(grad_output, (list, tuple)) and len(grad_output) == len(starts):
            given = list(grad_output)
        else:
            raise ValueError(
                f"this program starts its backward from {len(starts)} outputs "
                f"({', '.join(repr(v.name) for v in starts)}): give backward a list of {len(starts)} gradients"
            )
        grads: dict[int, torch.Tensor] = {}
        for v, g in zip(starts, given):
            if len(starts) > 1 and g is None:
                continue
            g = self._seed(v, g)
            if not program.requires_grad[v.id]:
                continue  # an output no gradient source reaches: nothing to start from
            if v.id in grads:  # one value returned twice: its gradients add
                total = self._alloc(v.shape, v.dtype)
                accumulate(grads[v.id].contiguous(), g.contiguous(), total)
                g = total
            grads[v.id] = g
        return grads

    def _seed(self, out: Value, grad_output: torch.Tensor | None) -> torch.Tensor:
        if grad_output is None:
            if out.numel != 1:
                raise ValueError(
                    f"backward() without grad_output needs a scalar loss, but '{out.name}' has shape {out.shape}"
                )
            return torch.ones(out.shape, dtype=out.dtype, device=self.device)
        if grad_output.shape != out.shape:
            raise ValueError(
                f"grad_output has shape {tuple(grad_output.shape)}, but the output '{out.name}' has shape {out.shape}"
            )
        if grad_output.dtype != out.dtype:
            raise TypeError(f"grad_output has dtype {grad_output.dtype}, but the output '{out.name}' is {out.dtype}")
        return grad_output if grad_output.device == self.device else grad_output.to(self.device)

    def _recompute(
        self, p: PlannedNode, *, entry: dict, entries: dict[int, dict], recomputed: dict[int, torch.Tensor], index: int
    ) -> None:
        """Put into ``entry`` the inputs of ``p`` the forward did not keep (``p.recomputed``):
        each written again by its producer's ``recompute_launches`` from the producer's cache
        entry, once, and kept in ``recomputed`` until the last node reading it (``index`` is
        ``p``'s) has had its backward."""
        for i, producer_index in p.recomputed.items():
            v = p.node.inputs[i]
            if v.id not in recomputed:
                producer = self._runs[self.program.nodes[producer_index].node.id]
                saved = entries[producer.planned.node.id]
                out = self._alloc(v.shape, v.dtype)

                def context(producer=producer, saved=saved, out=out) -> OpContext:
                    return OpContext.for_recompute(
                        **producer.context, inputs=saved["inputs"], output=out, saved=saved["saved"]
                    )

                roles = [*saved["inputs"], out, *saved["saved"].values()]
                allocated = saved.get("allocated")
                fresh = (producer.fresh_saved if allocated else 0) | 1 << len(saved["inputs"])
                producer.recompute.run(roles, context, fresh=fresh, fixed=producer.own_inputs if allocated else 0)
                recomputed[v.id] = out
            entry["inputs"][i] = recomputed[v.id]
            if self._first_recompute_reader[v.id] == index:
                del recomputed[v.id]

    def _input_grad_buffer(
        self,
        p: PlannedNode,
        *,
        index: int,
        entry: dict,
        grad_out: torch.Tensor,
        seeds: frozenset[int],
        grads: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(buffer, addend) for input 0's gradient. buffer: one nothing else needs that it may be
        written into, or None: ``grad_out`` for an op with ``grad_in_place``, when nothing else
        holds it; input 0 itself for an op with ``grad_over_input``, when it was recomputed for
        this node (``index``) and this is its last reader's backward; for an op with
        ``grad_accumulates``, the gradient input 0's other readers left, when nothing else holds
        it. addend (``grad_accumulates``): that waiting gradient (contiguous: an expanded one is
        copied), which the op adds to its own, in place (it is the buffer) or not (a seed, or a
        gradient something else still reads)."""
        node = p.node
        v = node.inputs[0] if node.inputs else None
        if v is None or v.kind == "param" or not p.grad_mask[0] or 0 not in self._runs[node.id].single_use:
            return None, None
        if p.op.grad_in_place and (v.shape, v.dtype) == (node.output.shape, grad_out.dtype):
            return (grad_out if _held_only_here(grad_out, seeds, grads) else None), None
        if p.op.grad_over_input and 0 in p.recomputed and self._first_recompute_reader[v.id] == index:
            return entry["inputs"][0], None
        waiting = grads.get(v.id)
        if p.op.grad_accumulates and waiting is not None and (waiting.shape, waiting.dtype) == (v.shape, v.dtype):
            if not waiting.is_contiguous():  # an expanded seed: the op reads a contiguous copy, its own
                waiting = grads[v.id] = waiting.contiguous()
            others = {k: g for k, g in grads.items() if k != v.id}
            others[node.output.id] = grad_out  # read by this backward: not to be written over
            if _held_only_here(waiting, seeds, others):
                return waiting, waiting
            return self._alloc(v.shape, v.dtype), waiting
        return None, None

    def _node_backward(
        self,
        p: PlannedNode,
        entry: dict,
        grad_out: torch.Tensor,
        grads: dict[int, torch.Tensor],
        input_grad_buffer: torch.Tensor | None = None,
        addend: torch.Tensor | None = None,
    ) -> None:
        """``p``'s backward launches; input 0's gradient is written into ``input_grad_buffer``
        when one is given, with the waiting gradient ``addend`` added (see ``_input_grad_buffer``)."""
        node = p.node
        run = self._runs[node.id]
        first_buffer = len(node.inputs) + 2 + len(run.extras)  # its position among the roles below
        buffers = []
        # the roles allocated here or by forward_train, and the executor's own (NodeReplay.run)
        fresh, fixed = (run.fresh_saved, run.own_inputs) if entry.get("allocated") else (0, 0)
        for i, (v, wanted) in enumerate(zip(node.inputs, p.grad_mask)):
            if not wanted:
                buffers.append(None)
            elif i == 0 and input_grad_buffer is not None:
                buffers.append(input_grad_buffer)  # one buffer of the input's size fewer
            elif v.kind == "param" and v.id in self._zeroed and i in run.single_use:
                buffers.append(self._grad_by_id[v.id])  # first gradient since zero_grad: write it in place
                fixed |= 1 << (first_buffer + i)
            elif v.id in self.program.padded_grads:  # rows padded for the product that made v: a view, not fresh
                buffers.append(grad_buffer(v.shape, v.dtype, self.program.padded_grads[v.id], self.device))
            else:
                buffers.append(self._alloc(v.shape, v.dtype))
                fresh |= 1 << (first_buffer + i)
        for positions in node.op.adjacent_params:  # side by side: the arena's views, or one block of their own
            group = [buffers[i] for i in positions]
            in_arena = all(g is self._grad_by_id[node.inputs[i].id] for i, g in zip(positions, group))
            if all(g is not None for g in group) and not in_arena:
                block = self._alloc((sum(g.numel() for g in group),), group[0].dtype)
                offsets = itertools.accumulate([0] + [g.numel() for g in group])
                for i, g, start in zip(positions, group, offsets):
                    buffers[i] = block[start : start + g.numel()].view(g.shape)
                    fresh &= ~(1 << (first_buffer + i))
                    fixed &= ~(1 << (first_buffer + i))
        roles = [*entry["inputs"], entry["output"], *entry["saved"].values(), grad_out, *buffers, addend]

        def context() -> OpContext:
            return OpContext.for_backward(
                **run.context,
                inputs=entry["inputs"],
                output=entry["output"],
                saved=entry["saved"],
                grad_output=grad_out,
                grads=buffers,
                grad_input_addend=addend,  # the op adds the gradient waiting to its own: no sum launch after
            )

        produced = run.backward.run(roles, context, fresh=fresh, fixed=fixed)  # an op may replace a buffer by a view
        for i, (v, wanted, g) in enumerate(zip(node.inputs, p.grad_mask, produced)):
            if not wanted:
                continue
            if g is None or g.shape != v.shape:
                raise TeenyError(
                    f"op {node.op.name} (node '{node.name}') backward left the gradient of '{v.name}' "
                    f"{'unset' if g is None else 'with shape ' + str(tuple(g.shape))}; expected {v.shape}"
                )
            if v.kind == "param":
                target = self._grad_by_id[v.id]
                if g is not target:
                    accumulate(target, g.contiguous(), target)
                self._zeroed.discard(v.id)
            elif v.id in grads:
                if i == 0 and addend is not None:  # the op added the gradient waiting to its own
                    grads[v.id] = g
                else:
                    total = self._alloc(v.shape, v.dtype)
                    accumulate(grads[v.id].contiguous(), g.contiguous(), total)  # a seed may be expanded
                    grads[v.id] = total
            else:
                grads[v.id] = g


def _aligned_numel(n: int, dtype: torch.dtype) -> int:
    step = max(1, ARENA_ALIGN // torch.empty((), dtype=dtype).element_size())
    return -(-n // step) * step


def _allocated_bits(values: Sequence[Value], views: set[int]) -> int:
    """Bit ``i`` set where ``values[i]`` is a node's output in a buffer of its own (not a view)."""
    return sum(1 << i for i, v in enumerate(values) if v.kind == "node" and v.id not in views)


def _rows_with_one_stride(t: torch.Tensor) -> bool:
    """Whether ``t`` is (rows, last dim) with unit stride along the last dim and one stride
    between rows (what a kernel reading dy by rows through ``grad_output_row_stride`` needs)."""
    if t.dim() < 2:
        return t.is_contiguous()
    if t.stride(-1) != 1 and t.size(-1) > 1:
        return False
    expected = t.stride(-2)
    for dim in range(t.dim() - 3, -1, -1):
        expected *= t.size(dim + 1)
        if t.size(dim) > 1 and t.stride(dim) != expected:
            return False
    return True


def _held_only_here(grad_out: torch.Tensor, seeds: frozenset[int], grads: dict[int, torch.Tensor]) -> bool:
    """Whether the backward may write over ``grad_out``: a contiguous buffer of its own, neither
    a seed (a caller's tensor; ``seeds`` are storage ids) nor sharing storage with a gradient
    still waiting in ``grads`` (a backward may hand one ``dy`` to several inputs as views)."""
    if (
        not grad_out.is_contiguous()
        or grad_out.untyped_storage().nbytes() != grad_out.numel() * grad_out.element_size()
    ):
        return False
    storage = storage_id(grad_out)
    return storage not in seeds and all(storage_id(g) != storage for g in grads.values())
