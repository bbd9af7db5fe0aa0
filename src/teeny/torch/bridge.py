"""The bridge from PyTorch to teeny: a teeny function compiled once per signature and run as
two generic PyTorch operators, so that torch autograd, ``torch.compile`` and
``torch.library.opcheck`` see teeny like any other library of kernels.

    teeny::run_forward(str key, Tensor[] tensors) -> Tensor[]
    teeny::run_backward(str key, Tensor?[] grads, Tensor[] saved) -> Tensor[]

``key`` names a ``Compiled`` entry: a teeny function traced for one combination of shapes,
dtypes, arguments and ``requires_grad`` flags, lowered (for training when a gradient is
wanted) and given an ``Executor``. The forward operator returns the function's output and
the *extras*: the tensors the backward kernels need that are neither an input nor the output
(rstd, log-sum-exp, a dropout seed, intermediate values of a function of several ops). Saved
for the backward are exactly the tensors the ops' pairs declare (``saves_inputs``,
``saves_output``, ``extra_outputs``): the inputs and outputs among them through
``save_for_backward`` (so PyTorch's version counters catch an in-place change between forward
and backward), the rest as extras, except a view of a tensor the backward has anyway (the
attention's output with its heads merged for the projection after it), which the backward
makes again (``Slot("view")``) rather than the forward returning it twice, as a copy. The
backward operator rebuilds the ``ActivationCache`` from them and runs teeny's backward
kernels; a backward may run any number of times
(``retain_graph=True``). The backward operator has no backward: ``create_graph=True`` through a
teeny op raises an error naming the op. In plain eager mode (real tensors, nothing tracing)
``call`` skips the two operators' dispatch and runs the same entry through ``_EagerRun``, an
``autograd.Function`` with the same saved tensors, checks and errors.

A function with several float outputs is lowered with each of them seeded (``lower(seeded=)``):
its float outputs come first, each of its own shape and dtype, and the backward operator takes
the gradient of each (None where none flows back). Keys of registered ops
(``teeny.torch.library``) describe the call completely, so an entry evicted from the bounded
cache (``CACHE_SIZE``) is rebuilt from its key; keys of ``apply`` name an entry that the
autograd graph keeps alive.

``apply(fn, *args)`` runs any teeny function on torch tensors. It keys its cache on what ``fn``
computes (its code, the values its closure, defaults and the globals it reads hold, and the
arguments' shapes, dtypes and values), so an inline lambda is traced once, not per call, and
the cache is bounded (least recently used entries go first). Dicts are keyed by their contents;
other objects by identity and the plain values they hold as attributes (a bound method's
``self.training``), one level deep. The trace gives each tensor argument its own input, so one
tensor passed twice shares the entry of two; the entry's replay (``teeny.program.tape``) tells
the two apart. Dropout here draws each mask from torch's RNG (``teeny.ops.masks``), so
``torch.utils.checkpoint`` recomputes the forward's mask.
"""

from __future__ import annotations

import ast
import functools
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import profiler
from torch.utils.flop_counter import register_flop_formula

from ..core.errors import NoGradientError, TeenyError
from ..core.graph import Graph, Tensor, Value
from ..program.executor import ActivationCache, Executor, inference_tensor_error
from ..program.lowering import LoweringMode, lower
from ..program.tape import Replayed, check_replayable
from .graphed import GraphedReplayed, GraphPool

CACHE_SIZE = 512  # compiled entries kept (least recently used go first); evicted op entries are rebuilt from their key


@dataclass(frozen=True)
class Slot:
    """Where a tensor of the rebuilt ``ActivationCache`` comes from: a flat ``input``, a
    program ``output``, an ``extra`` returned by the forward, a ``const`` / ``param`` the
    executor holds (``index`` is then the value id), or a ``view`` (``index`` into
    ``Compiled.views``) rebuilt in the backward from another slot by the view ops that made it."""

    kind: str
    index: int


@dataclass
class Compiled:
    """One teeny function, traced, lowered and ready to run for one call signature."""

    key: str
    label: str  # what it is, for messages: "teeny op gelu", "apply(<lambda>)"
    executor: Executor
    input_names: list[str]  # graph input names, in the order of the flat tensors
    input_labels: list[str]  # how messages name each flat tensor ("x", "argument 1")
    grad_inputs: tuple[int, ...]  # flat tensors that get a gradient, in order
    mutated: tuple[int, ...]  # flat tensors the forward writes in place (batch norm's running stats)
    outputs: list[tuple[tuple[int, ...], torch.dtype]]  # program outputs: shape, dtype
    extras: list[tuple[tuple[int, ...], torch.dtype]]
    layout: list[tuple[int, list[Slot | None], Slot | None, dict[str, Slot]]]  # node id, inputs, output, saved
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    views: list[tuple[Slot, list]]  # per view slot: (the slot it is a view of, the view ops from there)
    order: list[int]  # per user output: its place among the program's outputs (the float ones first)
    container: type | None  # tuple / list when the function returned several tensors
    keep_alive: tuple = ()  # objects whose identity the key uses (an apply key holds them)
    consts: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """What every call does the same, worked out once (see ``_extra_sources``, ``_pool_slots``)."""
        ex = self.executor
        self._extra_sources = _extra_sources(self.layout, len(self.extras))
        self._fixed_storages = frozenset(_storage(t) for t in [*self.consts.values(), *ex.param_arenas.values()])
        n_in, n_out = len(self.saved_inputs), len(self.saved_outputs)
        positions = {
            **{("input", i): k for k, i in enumerate(self.saved_inputs)},
            **{("output", j): n_in + k for k, j in enumerate(self.saved_outputs)},
            **{("extra", k): n_in + n_out + k for k in range(len(self.extras))},
        }
        self._fixed_tensors: list[torch.Tensor] = []  # after the saved tensors in the backward's pool
        self._view_steps: list[tuple[int, list]] = []  # after those: (base position, view ops) per view slot
        view_steps: dict[int, int] = {}  # view slot index -> its step

        def position(slot: Slot | None) -> int | tuple | None:
            """A slot's place in the pool; a view's as ("view", step), placed once the fixed are counted."""
            if slot is None:
                return None
            if slot.kind == "view":
                if slot.index not in view_steps:
                    base, ops = self.views[slot.index]  # the base is never a view (_layout follows chains)
                    self._view_steps.append((position(base), ops))
                    view_steps[slot.index] = len(self._view_steps) - 1
                return ("view", view_steps[slot.index])
            if slot.kind in ("const", "param"):
                if slot.kind == "const":
                    tensor = self.consts[slot.index]
                else:
                    tensor = ex.params[ex.program.graph.values[slot.index].name]
                self._fixed_tensors.append(tensor)
                return n_in + n_out + len(self.extras) + len(self._fixed_tensors) - 1
            return positions[(slot.kind, slot.index)]

        pool_slots = [
            (node_id, [position(s) for s in in_slots], position(out_slot), {n: position(s) for n, s in saved.items()})
            for node_id, in_slots, out_slot, saved in self.layout
        ]
        first_view = n_in + n_out + len(self.extras) + len(self._fixed_tensors)

        def placed(k: int | tuple | None) -> int | None:
            return first_view + k[1] if isinstance(k, tuple) else k

        self._pool_slots = [
            (node_id, [placed(k) for k in ins], placed(out), {n: placed(k) for n, k in saved.items()})
            for node_id, ins, out, saved in pool_slots
        ]
        self._blocked = check_replayable(ex.program)  # calls are recorded once and replayed (teeny.program.tape)
        self._replayed = Replayed
        self._forward_replay = Replayed(self._run_forward, self._blocked)
        self._backward_replays: dict[tuple[bool, ...], Replayed] = {}  # by which seeded outputs have a gradient

    def replay_as_cuda_graphs(self, always: bool = False) -> None:
        """From now on replay this entry's recorded calls as CUDA graphs on a GPU
        (``teeny.torch.graphed``) while ``teeny.core.config.cuda_graphs`` is on, or ``always``:
        for a whole model's region (``torch.compile(backend="teeny")``), whose replayed launches
        take more host time than its kernels take on the GPU."""
        pool = GraphPool()  # one for the forward's graphs and the backward's
        self._replayed = functools.partial(GraphedReplayed, pool=pool, always=always)
        self._forward_replay = GraphedReplayed(self._run_forward, self._blocked, pool, always)
        self._backward_replays.clear()

    @property
    def training(self) -> bool:
        return self.executor.training

    @functools.cached_property
    def flops(self) -> tuple[int, int]:
        """(forward, backward) flops of the program's products, as torch's FlopCounterMode counts them."""
        return self.executor.program.flops()

    @property
    def n_outputs(self) -> int:
        return len(self.outputs)

    @property
    def n_seeded(self) -> int:
        """How many outputs (the first) take a gradient in the backward."""
        return self.executor.program.seeded if self.training else 0

    # --- running -------------------------------------------------------------------------
    def forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the program: its outputs, the extras, then the new values of the inputs it
        updates in place (``mutated``; the inputs themselves are left alone). Nothing returned
        aliases an input. Recorded on the first call and replayed after (``teeny.program.tape``)."""
        return self._forward_replay(tensors)

    def backward(self, grads: Sequence[torch.Tensor | None], saved: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of the flat inputs in ``grad_inputs`` from the gradients of the seeded
        outputs (``n_seeded``; None: none flows back from that output). Recorded and replayed
        as the forward is, one tape per pattern of the outputs that have a gradient (a model's
        loss has one, the logits it also returns have none)."""
        replay = self._backward_replay_of(tuple(g is not None for g in grads))
        tensors = [*(g for g in grads if g is not None), *saved]
        if isinstance(saved, list):  # handed over (_input_gradients): a replay frees each after its last use
            saved.clear()
            return replay(tensors, consume=True)
        return replay(tensors)

    def keepable(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``forward``'s result as the caller may keep it: after a CUDA graph's replay the outputs
        are the graph's own memory, which its next replay writes again, so they are copied (the
        extras after them are not: the backward reads them, and the graph waits for it)."""
        if not getattr(self._forward_replay, "last_graphed", False):
            return list(outputs)
        n = self.n_outputs
        return [t.clone() for t in outputs[:n]] + list(outputs[n:])

    @property
    def _backward_replay(self) -> Replayed:
        """The backward's replay when every seeded output has its gradient."""
        return self._backward_replay_of((True,) * self.n_seeded)

    def _backward_replay_of(self, given: tuple[bool, ...]) -> Replayed:
        replay = self._backward_replays.get(given)
        if replay is None:
            run = functools.partial(self._run_backward_given, given)
            replay = self._backward_replays[given] = self._replayed(run, self._blocked)
        return replay

    def _run_backward_given(self, given: tuple[bool, ...], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``_run_backward`` of the gradients marked in ``given`` (the others None), then the saved tensors."""
        present = iter(tensors[: sum(given)])
        return self._run_backward([next(present) if g else None for g in given] + list(tensors[sum(given) :]))

    def _run_forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ex = self.executor
        # an input written in place is copied onto the executor's device here, so that the copy it
        # updates is the one returned (a CPU tensor given to a GPU program would be moved inside it)
        if self.mutated:
            tensors = [t.to(ex.device, copy=True) if i in self.mutated else t for i, t in enumerate(tensors)]
        feed = dict(zip(self.input_names, tensors))
        device = tensors[0].device if tensors else ex.device
        if self.training:
            outs, cache = ex.forward_train(feed)
            extras = []
            for node_id, part, key in self._extra_sources:
                t = cache.entries[node_id][part]
                extras.append(t if key is None else t[key])
        else:
            outs, extras = ex.forward(feed), []
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        updated = [tensors[i] for i in self.mutated]
        taken = {_storage(t) for i, t in enumerate(tensors) if i not in self.mutated}
        taken.update(self._fixed_storages)
        result = []
        for t in [*outs, *extras, *updated]:
            t = t.to(device)
            if not t.numel() or _storage(t) in taken:  # a view (a reshape of an input): give a new tensor
                t = t.clone()
            taken.add(_storage(t))
            result.append(t)
        return result

    def _run_backward(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        n = self.n_seeded
        grads, saved = tensors[:n], tensors[n:]
        ex = self.executor
        here = ex.device
        pool = [*(t.to(here).contiguous() for t in saved), *self._fixed_tensors]
        for base, view_ops in self._view_steps:  # views of saved tensors, made again rather than kept twice
            t = pool[base]
            for op in view_ops:
                t = op.view([t])
            pool.append(t)
        cache = ActivationCache(ex)
        for node_id, in_slots, out_slot, saved_slots in self._pool_slots:
            cache.entries[node_id] = {
                "inputs": [None if k is None else pool[k] for k in in_slots],
                "output": None if out_slot is None else pool[out_slot],
                "saved": {name: pool[k] for name, k in saved_slots.items()},
            }
        given = [g for g in grads if g is not None]
        device = given[0].device if given else (saved[0].device if saved else here)
        seeds = [None if g is None else g.to(device=here, dtype=dtype) for g, (_, dtype) in zip(grads, self.outputs)]
        if n == 1 and seeds[0] is None:
            shape, dtype = self.outputs[0]
            seeds[0] = torch.zeros(shape, dtype=dtype, device=here)
        computed = ex.backward(cache, seeds[0] if n == 1 else seeds)  # the executor decides on copies
        taken = {_storage(t) for t in saved} | {_storage(g) for g in given}
        result = []
        for i in self.grad_inputs:
            g = computed[self.input_names[i]].to(device)
            if not g.numel() or _storage(g) in taken:  # a view op's backward answered with a view of dy
                g = g.clone()
            taken.add(_storage(g))
            result.append(g)
        return result

    # --- what the caller sees -------------------------------------------------------------
    def unpack(self, outputs: Sequence[torch.Tensor]) -> Any:
        """The function's result (a tensor, or a tuple/list of them) from the forward's outputs."""
        values = [outputs[j] for j in self.order]
        return values[0] if self.container is None else self.container(values)


def _extra_sources(layout: list, n_extras: int) -> list[tuple[int, str, int | str | None]]:
    """Where the forward's cache holds each extra: (node id, ``"inputs"`` / ``"output"`` /
    ``"saved"``, the index or name within it, ``None`` for the output), first place first."""
    found: dict[int, tuple[int, str, int | str | None]] = {}
    for node_id, in_slots, out_slot, saved_slots in layout:
        places = [*((s, "inputs", i) for i, s in enumerate(in_slots)), (out_slot, "output", None)]
        places += [(s, "saved", name) for name, s in saved_slots.items()]
        for slot, part, key in places:
            if slot is not None and slot.kind == "extra":
                found.setdefault(slot.index, (node_id, part, key))
    return [found[k] for k in range(n_extras)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else -id(t)


# ----------------------------------------------------------------------------- compiling


def compile_function(*args: Any, **kwargs: Any) -> Compiled:
    """Trace ``fn`` with a graph input per tensor of ``args``/``kwargs`` (real or meta
    tensors: only shapes and dtypes are read), lower it and build its executor
    (``_compile``'s arguments). Built outside any active dispatch mode (``torch.compile``'s
    fake tensors, opcheck's checks) and without autograd: the executor's parameters and
    constants are real tensors, and lowering's dry run uses plain meta tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return _compile(*args, **kwargs)


def _is_torch_callable(fn: Any) -> bool:
    """Whether ``fn`` is PyTorch's own (``torch.sin``, ``F.gelu``, a ``torch.nn`` module)."""
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
    return (
        module.split(".")[0] == "torch"
        or isinstance(fn, torch.nn.Module)
        or type(fn).__name__ == "builtin_function_or_method"
    )


def _compile(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    wants_grad: Sequence[bool],
    key: str,
    label: str,
    input_labels: Sequence[str] | None = None,
    keep_alive: tuple = (),
    precision: str | None = None,
    recompute: bool = False,
) -> Compiled:
    graph = Graph(getattr(fn, "__name__", "fn"))
    flat: list[torch.Tensor] = []

    def symbolic(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            index = len(flat)
            flat.append(a)
            wants = bool(wants_grad[index]) and a.is_floating_point()
            named = input_labels is not None and index < len(input_labels)
            name = input_labels[index] if named else f"arg{index}"  # as the op's errors name it
            return graph.input(name, tuple(a.shape), a.dtype, requires_grad=wants)
        if isinstance(a, (list, tuple)):
            return type(a)(symbolic(b) for b in a)
        return a

    try:
        result = fn(*[symbolic(a) for a in args], **{k: symbolic(v) for k, v in kwargs.items()})
    except TypeError as exc:
        if "Tensor" not in str(exc) or not _is_torch_callable(fn):
            raise
        raise TeenyError(
            f"apply: {getattr(fn, '__name__', type(fn).__name__)} is PyTorch's, which cannot run on teeny's "
            "symbolic tensors: pass a function of teeny ops (teeny.ops.sin, ...), or call it on the torch tensors"
        ) from None
    container = type(result) if isinstance(result, (tuple, list)) else None
    outs = list(result) if container is not None else [result]
    for i, o in enumerate(outs):
        if not isinstance(o, Tensor) or o.graph is not graph:
            raise TeenyError(f"{label}: output {i} is not a teeny tensor of the traced graph (got {type(o).__name__})")
    wants_any = any(v.requires_grad for v in graph.inputs)
    floats = [i for i, o in enumerate(outs) if o.dtype.is_floating_point]
    program_order = floats + [i for i in range(len(outs)) if i not in floats]  # the seeded (float) outputs first
    graph.output(*[outs[i] for i in program_order])
    program = None
    if wants_any and floats:
        try:
            program = lower(graph, LoweringMode.TRAINING, seeded=len(floats), precision=precision, recompute=recompute)
        except NoGradientError:  # no gradient reaches an output (stop_gradient, integer paths)
            program = None
    if program is None:
        program = lower(graph, LoweringMode.INFERENCE, precision=precision)
    executor = Executor(program)
    for p in program.nodes:  # dropout's masks from torch's RNG, which torch.utils.checkpoint restores
        if hasattr(p.op, "torch_rng"):
            p.op.torch_rng = True
    consts = executor._consts  # the executor's own constants: what its kernels read
    input_names = [v.name for v in graph.inputs]
    labels = list(input_labels) if input_labels is not None else [f"argument {i}" for i in range(len(flat))]
    grad_inputs = tuple(i for i, v in enumerate(graph.inputs) if v.requires_grad and executor.training)
    layout, extras, saved_inputs, saved_outputs, views = (
        _layout(program, graph) if executor.training else ([], [], (), (), [])
    )
    return Compiled(
        key=key,
        label=label,
        executor=executor,
        input_names=input_names,
        input_labels=labels,
        grad_inputs=grad_inputs,
        mutated=_mutated_inputs(program, graph),
        outputs=[(tuple(v.shape), v.dtype) for v in program.outputs],
        extras=extras,
        layout=layout,
        saved_inputs=saved_inputs,
        saved_outputs=saved_outputs,
        views=views,
        order=[program_order.index(i) for i in range(len(outs))],
        container=container,
        keep_alive=keep_alive,
        consts=consts,
    )


def _layout(program, graph: Graph):
    """Where each tensor the backward reads comes from (see ``Slot``). A kept value that a view
    op made of a value the backward has anyway (an input, a parameter, an output, another kept
    value: the attention's output and its heads merged for the projection after it) is a view
    slot: returned once by the forward, not twice (the operator's outputs may not alias each
    other, so the second would be a copy)."""
    input_index = {v.id: i for i, v in enumerate(graph.inputs)}
    output_index = {v.id: j for j, v in enumerate(program.outputs)}
    extras: list[tuple[tuple[int, ...], torch.dtype]] = []
    by_value: dict[int, Slot] = {}
    saved_inputs: set[int] = set()
    saved_outputs: set[int] = set()
    views: list[tuple[Slot, list]] = []
    view_nodes = {p.node.id for p in program.nodes if p.is_view}
    written = {graph.inputs[i].id for i in _mutated_inputs(program, graph)}  # new values copied back after the call
    kept = set()  # the values some backward reads
    for p in program.nodes:
        if p.needs_backward:
            kept.update(v.id for v, keep in zip(p.node.inputs, p.saved_inputs) if keep)
            if p.node.op.saves_output:
                kept.add(p.node.output.id)

    def view_chain(v: Value) -> tuple[Value, list] | None:
        """(the value ``v`` is a view of, the view ops from it to ``v``) where that value is
        in the backward's pool anyway; else None."""
        ops = []
        while v.producer is not None and v.producer.id in view_nodes and v.id not in output_index:
            ops.append(v.producer.op)
            v = v.producer.inputs[0]
            if v.id in written:
                return None
            if v.kind != "node" or v.id in output_index or v.id in kept:
                return v, ops[::-1]
        return None

    def slot_of(v: Value) -> Slot:
        if v.id in by_value:
            return by_value[v.id]
        chain = view_chain(v)
        if chain is not None:
            by_value[v.id] = Slot("view", len(views))
            views.append((slot_of(chain[0]), chain[1]))
            return by_value[v.id]
        if v.id in output_index:
            saved_outputs.add(output_index[v.id])
            return Slot("output", output_index[v.id])
        if v.kind == "input":
            saved_inputs.add(input_index[v.id])
            return Slot("input", input_index[v.id])
        if v.kind in ("const", "param"):
            return Slot(v.kind, v.id)
        by_value[v.id] = Slot("extra", len(extras))
        extras.append((tuple(v.shape), v.dtype))
        return by_value[v.id]

    layout = []
    for p in program.nodes:
        if not p.needs_backward:
            continue
        node = p.node
        in_slots = [slot_of(v) if keep else None for v, keep in zip(node.inputs, p.saved_inputs)]
        out_slot = slot_of(node.output) if node.op.saves_output else None
        saved = {}
        for name, (shape, dtype) in node.op.extra_outputs([v.shape for v in node.inputs], node.dtype).items():
            saved[name] = Slot("extra", len(extras))
            extras.append((tuple(shape), dtype))
        layout.append((node.id, in_slots, out_slot, saved))
    return layout, extras, tuple(sorted(saved_inputs)), tuple(sorted(saved_outputs)), views


def _mutated_inputs(program, graph: Graph) -> tuple[int, ...]:
    """Graph inputs some op writes in place (``RuntimeOp.mutated_inputs``: batch norm's running
    statistics in training, embedding's max_norm renormalisation)."""
    input_index = {v.id: i for i, v in enumerate(graph.inputs)}
    mutated = set()
    for p in program.nodes:
        for k in p.node.op.mutated_inputs():
            v = p.node.inputs[k]
            if v.id in input_index:
                mutated.add(input_index[v.id])
    return tuple(sorted(mutated))


# ----------------------------------------------------------------------------- the cache

_ENTRIES: OrderedDict[str, Compiled] = OrderedDict()
# entries an owner holds (a torch.compile region its programs): found by key while the owner lives,
# freed with it (dynamo's reset, the model gone), never pushed out of the bounded cache above
_OWNED: weakref.WeakValueDictionary[str, Compiled] = weakref.WeakValueDictionary()
_BUILDERS: list[tuple[str, Callable[[str], Compiled]]] = []  # key prefix -> rebuild from the key


def add_builder(prefix: str, build: Callable[[str], Compiled]) -> None:
    """Keys starting with ``prefix`` are rebuilt by ``build(key)`` when not cached."""
    _BUILDERS.append((prefix, build))


def lookup(key: str) -> Compiled:
    """The compiled entry for ``key`` (rebuilt from the key where it describes the call)."""
    entry = _ENTRIES.get(key)
    if entry is not None:
        _ENTRIES.move_to_end(key)
        return entry
    entry = _OWNED.get(key)
    if entry is not None:
        return entry
    for prefix, build in _BUILDERS:
        if key.startswith(prefix):
            return remember(build(key))
    if not key.startswith("apply:"):  # an op key in another format: a compiled graph from an older teeny
        raise TeenyError(
            f"teeny key {key[:120]!r} is from another version of teeny, probably in a graph that torch.compile "
            "cached on disk: clear the cache (torch._inductor.utils.clear_inductor_caches(), or delete "
            "TORCHINDUCTOR_CACHE_DIR) and compile again"
        )
    raise TeenyError(f"no compiled teeny function for key {key[:200]!r} (it was evicted and cannot be rebuilt)")


def remember(entry: Compiled) -> Compiled:
    """Cache ``entry`` under its key (the least recently used go first past ``CACHE_SIZE``)."""
    _ENTRIES[entry.key] = entry
    _ENTRIES.move_to_end(entry.key)
    while len(_ENTRIES) > CACHE_SIZE:
        _ENTRIES.popitem(last=False)
    return entry


def remember_owned(entry: Compiled) -> Compiled:
    """Make ``entry`` findable by its key for as long as something else holds it (its owner: a
    ``torch.compile`` region), without the cache keeping it (or its executor's memory) alive."""
    _OWNED[entry.key] = entry
    return entry


def cache_size() -> int:
    """How many compiled entries are cached now."""
    return len(_ENTRIES)


def clear_cache() -> None:
    """Forget every compiled entry (op entries are rebuilt on their next call)."""
    _ENTRIES.clear()
    _APPLY_KEYS.clear()


# ----------------------------------------------------------------------------- the operators

_LIB = torch.library.Library("teeny", "FRAGMENT")  # keeps the registrations of this module alive


def _fake_outputs(entry: Compiled, device: torch.device) -> list[torch.Tensor]:
    inputs = entry.executor.program.inputs
    specs = [*entry.outputs, *entry.extras, *[(inputs[i].shape, inputs[i].dtype) for i in entry.mutated]]
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    from ..core.device import DEVICE

    return tensors[0].device if tensors else DEVICE


# Defined with the low-level Library API rather than torch.library.custom_op: the same schema,
# fake and autograd registrations, without custom_op's Python wrapper around each call (in the
# H200 run's profile, torch 2.11's custom_ops.backend_impl took 470 us per call, docs/archive/bench-journal.md).
_LIB.define("run_forward(str key, Tensor[] tensors) -> Tensor[]")
_LIB.define("run_backward(str key, Tensor?[] grads, Tensor[] saved) -> Tensor[]")


def run_forward(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the compiled entry ``key`` forwards: its outputs, then the extras its backward reads."""
    entry = lookup(key)
    return entry.keepable(entry.forward(tensors))


def run_backward(key: str, grads: list[torch.Tensor | None], saved: list[torch.Tensor]) -> list[torch.Tensor]:
    """teeny's backward kernels for entry ``key``: gradients of its inputs that want one, from
    the gradients of its seeded outputs."""
    return lookup(key).backward(grads, saved)


_LIB.impl("run_forward", run_forward, "CompositeExplicitAutograd")
_LIB.impl("run_backward", run_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("teeny::run_forward", lib=_LIB)
def _run_forward_fake(key, tensors):
    return _fake_outputs(lookup(key), _device_of(tensors))


@torch.library.register_fake("teeny::run_backward", lib=_LIB)
def _run_backward_fake(key, grads, saved):
    entry = lookup(key)
    device = _device_of([g for g in grads if g is not None] or saved)
    ex_inputs = entry.executor.program.inputs
    return [torch.empty(ex_inputs[i].shape, dtype=ex_inputs[i].dtype, device=device) for i in entry.grad_inputs]


def _setup_context(ctx, inputs, output) -> None:
    _save_for_backward(ctx, lookup(inputs[0]), inputs[1], output)


def _save_for_backward(ctx, entry: Compiled, flat: Sequence[torch.Tensor], output: Sequence[torch.Tensor]) -> None:
    ctx.entry = entry
    if not entry.training:
        ctx.save_for_backward()
        return
    saved_inputs = [flat[i] for i in entry.saved_inputs]
    for i, t in zip(entry.saved_inputs, saved_inputs):
        if t.is_inference():  # named here: torch's own refusal comes after the forward ran
            raise inference_tensor_error(f"{entry.label}: input '{entry.input_names[i]}'")
    extras = output[entry.n_outputs : entry.n_outputs + len(entry.extras)]
    ctx.save_for_backward(*saved_inputs, *[output[j] for j in entry.saved_outputs], *extras)
    if not torch.compiler.is_compiling():  # to name the input if one changes in place before the backward
        try:
            ctx.input_versions = [(i, weakref.ref(t), t._version) for i, t in zip(entry.saved_inputs, saved_inputs)]
        except (RuntimeError, TypeError):  # tensors under tracing (functional, fake) have no version to read
            ctx.input_versions = []


def _input_gradients(ctx, grads, eager: bool) -> list[torch.Tensor | None]:
    """The gradients of the flat inputs (``None`` each for an entry lowered for inference), through
    the backward operator, or straight through the entry when ``eager``."""
    entry: Compiled = ctx.entry
    if entry.key not in _ENTRIES and entry.key not in _OWNED:  # evicted since the forward: the autograd
        remember(entry)  # graph kept it alive
    if not entry.training:  # lowered for inference (stop_gradient): no gradient, one None per input
        return [None] * len(entry.input_names)
    try:
        saved = list(ctx.saved_tensors)
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            raise
        raise RuntimeError(_changed_message(ctx, entry)) from exc
    seeds = list(grads[: entry.n_seeded])
    if all(g is None for g in seeds):  # no float output reaches the loss: no gradient
        return [None] * len(entry.input_names)
    if not eager:
        computed = torch.ops.teeny.run_backward(entry.key, seeds, list(saved))
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*seeds, *saved)):
        raise RuntimeError(_double_backward_message(entry))
    else:  # the context lets go of the saved tensors (unless retain_graph), and the backward takes the list
        ctx.maybe_clear_saved_tensors()
        computed = entry.backward(seeds, saved)
    by_input = dict(zip(entry.grad_inputs, computed))
    return [by_input.get(i) for i in range(len(entry.input_names))]


def _backward(ctx, grads):
    return None, _input_gradients(ctx, grads, eager=False)


def _changed_message(ctx, entry: Compiled) -> str:
    changed = [
        entry.input_labels[i]
        for i, ref, version in getattr(ctx, "input_versions", [])
        if ref() is not None and ref()._version != version
    ]
    what = f"input {', '.join(repr(c) for c in changed)}" if changed else "an input or output"
    return (
        f"{entry.label}: {what} was modified in place between the forward and the backward; "
        "the backward kernels would read the new values and give a wrong gradient (clone it before changing it)"
    )


def _autograd_kernel(op, backward, setup_context, run):
    """The operator's Autograd kernel: ``register_autograd``'s own (``make_autograd_impl``, an
    ``autograd.Function`` whose forward redispatches below autograd), except for a call that
    records no graph on plain tensors outside any tracing, which is what a compiled graph makes
    at every call (AOTAutograd runs its forward and backward with grad mode off): that call goes
    straight to ``run``, the kernel the redispatch would reach, without the generated wrapper's
    metadata, keyset arithmetic and second dispatch (about a fifth of such a call's host time)."""
    from torch._library.autograd import Info, make_autograd_impl

    traced = make_autograd_impl(op, Info(backward, setup_context))

    def kernel(keyset, key, *lists):
        tensors = [t for group in lists for t in group]
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and _eager(tensors):
            return run(key, *lists)
        return traced(keyset, key, *lists)

    return kernel


_LIB.impl(
    "run_forward",
    _autograd_kernel(torch.ops.teeny.run_forward.default, _backward, _setup_context, run_forward),
    "Autograd",
    with_keyset=True,
)


def _double_backward_message(entry: Compiled) -> str:
    return (
        f"{entry.label}: double backward (create_graph=True, e.g. a gradient penalty) is not supported: "
        "teeny's backward kernels have no backward of their own"
    )


def _no_double_backward(ctx, inputs, output) -> None:
    raise RuntimeError(_double_backward_message(lookup(inputs[0])))


_LIB.impl(
    "run_backward",
    _autograd_kernel(torch.ops.teeny.run_backward.default, lambda ctx, grads: None, _no_double_backward, run_backward),
    "Autograd",
    with_keyset=True,
)


@register_flop_formula(torch.ops.teeny.run_forward, get_raw=True)
def _run_forward_flops(key, tensors, out_val=None) -> int:
    """torch's FlopCounterMode sees teeny's two operators, not the products inside: their counts."""
    return lookup(key).flops[0]


@register_flop_formula(torch.ops.teeny.run_backward, get_raw=True)
def _run_backward_flops(key, grads, saved, out_val=None) -> int:
    return lookup(key).flops[1]


class _EagerRun(torch.autograd.Function):
    """``run_forward`` and ``run_backward`` for plain tensors in eager mode: the same entry,
    context and gradients, without the two operators' dispatch and autograd wrappers (on the
    H200's host they cost more than the launches themselves, docs/archive/bench-journal.md)."""

    @staticmethod
    def forward(ctx, entry, *tensors):  # ctx in forward: apply() binds no signature per call then
        output = entry.forward(tensors)
        ctx.set_materialize_grads(False)
        _save_for_backward(ctx, entry, tensors, output)  # a graph's own outputs: its next replay waits for them
        return tuple(entry.keepable(output))

    @staticmethod
    def backward(ctx, *grads):
        if profiler._is_profiler_enabled:  # a range named after the op, inside _EagerRunBackward's
            with profiler.record_function(f"{ctx.entry.label} backward"):
                computed = _input_gradients(ctx, grads, eager=True)
        else:
            computed = _input_gradients(ctx, grads, eager=True)
        return None, *(computed or [None] * (len(ctx.needs_input_grad) - 1))


def _eager(tensors: Sequence[torch.Tensor]) -> bool:
    """Plain tensors with data, outside any tracing (torch.compile, make_fx, fake or functional
    tensors, dispatch modes such as opcheck's): the call can skip the operators' dispatch. Meta
    tensors go through the operators, whose fake implementations give their outputs' shapes."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta for t in tensors)
    )


def _refuse_functorch_wrappers(entry: Compiled, tensors: Sequence[torch.Tensor]) -> None:
    """torch.func's differentiating transforms (grad, vjp, jvp, jacrev, hessian) hand the op
    wrapped tensors, and so does torch.vmap when it reaches ``apply``: teeny's kernels read the
    data behind a tensor, which a wrapper does not expose. (torch.vmap of a registered op never
    gets here: it runs the op once per sample, on plain tensors.)"""
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise TeenyError(
            f"{entry.label}: torch.func transforms (grad, vjp, jvp, jacrev, hessian; vmap over "
            "teeny.torch.apply) are not supported: they pass wrapped tensors, whose data teeny's kernels cannot "
            "read. Differentiate with torch.autograd.grad or .backward(); torch.vmap of a torch.ops.teeny "
            "operator works (it runs the operator once per sample)"
        )


def call(entry: Compiled, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``entry`` through the operators (differentiably where it was lowered for training);
    in eager mode on plain tensors through ``_EagerRun``, which computes the same (under a
    profiler, in a range named after the op: ``teeny op gelu``, and ``... backward``)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        _refuse_functorch_wrappers(entry, tensors)
    if not _eager(tensors):
        results = torch.ops.teeny.run_forward(entry.key, list(tensors))
    elif profiler._is_profiler_enabled:
        with profiler.record_function(entry.label):
            results = _call_eager(entry, tensors)
    else:
        results = _call_eager(entry, tensors)
    if entry.mutated:  # the operator is functional: it returns the new values, written back here
        n = len(results) - len(entry.mutated)
        with torch.no_grad():
            for i, new in zip(entry.mutated, results[n:]):
                tensors[i].copy_(new)
        results = results[:n]
    return results


def _call_eager(entry: Compiled, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return entry.keepable(entry.forward(list(tensors)))
    if entry.training:
        return list(_EagerRun.apply(entry, *tensors))
    with torch.no_grad():  # lowered for inference, as no gradient reaches an output (stop_gradient): no record
        return entry.keepable(entry.forward(list(tensors)))


# ----------------------------------------------------------------------------- apply

_APPLY_KEYS: OrderedDict[Any, str] = OrderedDict()
_SERIAL = [0]


def _flat_tensors(a: Any) -> list[torch.Tensor]:
    """The tensors of ``a`` (nested lists and tuples too) in the order tracing numbers them."""
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for b in a for t in _flat_tensors(b)]
    return []


def _arg_key(a: Any, refs: list) -> Any:
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype, a.requires_grad and a.is_floating_point() and torch.is_grad_enabled())
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg_key(b, refs) for b in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(v, refs)) for k, v in a.items()))
    return _value_key(a, refs, depth=0)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, slice, type(Ellipsis))


def _value_key(v: Any, refs: list, depth: int) -> Any:
    """A hashable description of what ``v`` contributes to a traced function: plain values by
    value, containers (dicts too) by their contents, functions by what they compute, anything
    else by identity (kept alive in ``refs`` so that the identity cannot be reused while the key
    exists) together with the plain values it holds as attributes (``_plain_attributes``)."""
    if isinstance(v, _PLAIN):
        return (type(v).__name__, repr(v) if isinstance(v, float) else v)
    if isinstance(v, (tuple, list, frozenset)) and depth < 4:
        return (type(v).__name__, tuple(_value_key(b, refs, depth + 1) for b in v))
    if isinstance(v, dict) and depth < 4:
        return ("dict", tuple((_value_key(k, refs, depth + 1), _value_key(b, refs, depth + 1)) for k, b in v.items()))
    if isinstance(v, types.FunctionType) and depth < 4:
        return _function_key(v, refs, depth + 1)
    if isinstance(v, types.MethodType) and depth < 4:
        return ("method", _value_key(v.__func__, refs, depth + 1), _value_key(v.__self__, refs, depth + 1))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    refs.append(v)
    return ("id", id(v), _plain_attributes(v))


def _plain_attributes(v: Any) -> tuple:
    """The attributes of an object keyed by identity that hold plain values (a module's
    ``training``, a layer's ``p``; tuples of them), by value: a function reading ``self.training``
    is traced again after ``model.eval()``. One level only, and nothing it holds by reference
    (submodules, parameters, buffers), so a big model's key costs its own attributes, not its tree."""
    attributes = getattr(v, "__dict__", None)
    if not isinstance(attributes, dict) or isinstance(v, type):  # a class: by identity alone
        return ()
    return tuple(
        (name, _value_key(a, [], 0))
        for name, a in attributes.items()
        if isinstance(a, _PLAIN) or (type(a) is tuple and all(isinstance(b, _PLAIN) for b in a))
    )


def _function_key(fn: types.FunctionType, refs: list, depth: int) -> Any:
    closure = tuple(_value_key(c.cell_contents, refs, depth) for c in fn.__closure__ or ())
    defaults = _value_key(fn.__defaults__, refs, depth)
    kwdefaults = tuple(sorted((k, _value_key(v, refs, depth)) for k, v in (fn.__kwdefaults__ or {}).items()))
    names = _global_names(fn.__code__)
    read = tuple((n, _value_key(fn.__globals__[n], refs, depth)) for n in names if n in fn.__globals__)
    return ("fn", fn.__code__, closure, defaults, kwdefaults, read)


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions read globals too
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


def _describe(fn: Callable) -> str:
    return f"apply({getattr(fn, '__qualname__', type(fn).__name__)})"


def _apply(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a function of teeny symbolic tensors) on torch tensors, differentiably.

    Tensors among ``args``/``kwargs`` (nested lists too) become the function's inputs; other
    arguments are passed as they are and are part of the cache key. Returns what ``fn``
    returns: a tensor, or a tuple/list of tensors. Inputs that require a gradient get one
    from teeny's backward kernels; repeated backward (``retain_graph=True``) and
    ``torch.autograd.gradcheck`` work; ``create_graph=True`` raises an error naming the function.
    """
    refs: list = []
    struct = (_value_key(fn, refs, 0), _arg_key(args, refs), _arg_key(kwargs, refs))
    try:
        hash(struct)
    except TypeError:  # an unhashable value in the arguments: key it by identity
        refs.append(fn)
        struct = (("id", id(fn)), repr(_arg_key(args, refs)), repr(_arg_key(kwargs, refs)))
    flat = [t.contiguous() for t in _flat_tensors(args) + _flat_tensors(list(kwargs.values()))]
    key = _APPLY_KEYS.get(struct)
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None:
        _SERIAL[0] += 1
        key = f"apply:{_SERIAL[0]}:{_describe(fn)}"
        wants = [t.requires_grad and torch.is_grad_enabled() for t in flat]
        entry = remember(compile_function(fn, args, kwargs, wants, key, _describe(fn), keep_alive=(fn, *refs)))
        _APPLY_KEYS[struct] = key
        while len(_APPLY_KEYS) > CACHE_SIZE:
            _APPLY_KEYS.popitem(last=False)
    else:
        _ENTRIES.move_to_end(key)
        _APPLY_KEYS.move_to_end(struct)
    return entry.unpack(call(entry, flat))


_apply.__name__ = _apply.__qualname__ = "apply"


def __getattr__(name: str) -> Any:
    """``apply`` is ``_apply`` under ``torch.compiler.disable`` (its keys are built from Python objects;
    under torch.compile use the registered ops), made on first use: ``torch.compiler.disable``
    imports torch._dynamo, 1.0 of the 2.7 s that ``import teeny.torch`` took when it ran at import."""
    if name == "apply":
        globals()["apply"] = disabled = torch.compiler.disable(_apply)
        return disabled
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_key(key: str, prefix: str) -> Any:
    """The Python literal after ``prefix`` in a self-describing key."""
    return ast.literal_eval(key[len(prefix) :])
