"""``torch.compile(model, backend="teeny")``: the region torch._dynamo captures runs as teeny programs.

    model = torch.compile(model, backend="teeny")     # registered through the torch_dynamo_backends entry point
    loss = model(input_ids=x, labels=x).loss          # an ordinary training loop: torch's optimizer,
    loss.backward(); optimizer.step()                 # GradScaler, clipping, accumulation unchanged

Dynamo hands the backend one FX graph per captured region, with every parameter and buffer
lifted to an input (the user's own tensors, in place). ``teeny_backend`` returns a ``Region``:

1. **Trace.** ``torch.export`` turns the graph into ATen training IR (the importer's vocabulary,
   ``teeny.torch.export``), in the region's own dtypes. Called under autocast, the program is
   lowered in teeny's mixed precision of autocast's dtype (half-precision compute, float32
   parameters cast once per step, float32 losses: ``lower(precision="bf16-mixed")``).
2. **Import.** The importer's walk turns it into a teeny ``Graph`` whose inputs are the region's
   inputs (a parameter is an input that wants a gradient), lowered for training when grad mode
   is on and an input wants a gradient, for inference otherwise.
3. **Run.** The program runs as **one autograd node** (``teeny.torch.bridge``): its forward
   keeps what teeny's backward kernels need, its backward runs them, and autograd puts the
   gradients into ``param.grad`` with torch's own accumulation, so whatever the user does with
   gradients keeps working. Each call is replayed from a tape of its launches (``teeny.program.tape``),
   or, with ``teeny.core.config.cuda_graphs`` on, as one CUDA graph on a GPU once the inputs
   have settled (``teeny.torch.graphed``).
   Inputs the graph writes in place (BatchNorm's running statistics, ``num_batches_tracked``)
   are written back after the call.
4. **Partition.** When the region has calls teeny has no op for, the ATen graph is split with
   torch.fx's ``CapabilityBasedPartitioner``: the runs of calls teeny can import become teeny
   programs (each a ``Region`` of its own, split again where it refuses calls in turn), the
   rest runs as the ATen calls PyTorch traced, in eager mode, and so do runs that compute no
   floating-point values (a padding mask built from positions). Under autocast the split graph
   runs in the region's own dtypes: teeny's programs in mixed precision, PyTorch's calls in
   float32. Nothing fails because an op is missing.

``torch.compile(model, backend="teeny", mode="reduce-overhead")`` (or ``"max-autotune"``): the region
replays as CUDA graphs on a GPU, as with ``teeny.core.config.cuda_graphs`` on, for this model only.

``torch.compile(model, backend="teeny", options={"recompute": True})``: the outputs of norms and
element-wise activations, and mixed precision's half-precision copies of the parameters, are not
kept for the backward but written again there
(``lower(recompute=True)``): less activation memory for a few more memory-bound launches.

Shapes are static per program: a call whose tensors differ in shape, dtype or ``requires_grad``
from every program the region has builds a new one (kept: a shape seen before is not built
again), so dynamo's dynamic shapes work too. ``report()`` says what ran where, per region;
``TEENY_LOG=1`` prints it as each region is built.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import os
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..core.errors import TeenyError
from ..core.graph import Tensor
from . import bridge
from .export.importer import UnsupportedError, _export, _Import

log = logging.getLogger("teeny.backend")
if os.environ.get("TEENY_LOG", "").strip() not in ("", "0"):
    log.setLevel(logging.INFO)
    if not log.handlers:
        log.addHandler(logging.StreamHandler())


@dataclass
class RegionReport:
    """What one captured region became: ``programs`` built (one per call signature), the ATen
    calls each teeny program holds (``teeny_calls``), and the calls left to PyTorch with why."""

    name: str
    programs: int = 0
    teeny_calls: Counter = field(default_factory=Counter)  # ATen op (or fused module class) -> calls
    teeny_nodes: int = 0  # nodes of the teeny programs, after teeny's rewrites
    # weak references to the programs' bridge entries (their replays: ``replayed``): a report kept
    # in this module's list must not keep a region's memory alive after dynamo lets it go
    entries: list[weakref.ref] = field(default_factory=list)
    torch_calls: dict[str, str] = field(default_factory=dict)  # ATen op -> why teeny left it
    build_seconds: float = 0.0

    def live_entries(self) -> list:
        """The programs' bridge entries still alive (dynamo still holds their region)."""
        return [entry for entry in (ref() for ref in self.entries) if entry is not None]

    def replayed(self) -> str:
        """Whether the programs' calls replay their recorded launches (``teeny.program.tape``) and
        as CUDA graphs (``teeny.torch.graphed``), or why not."""
        parts = []
        live = self.live_entries()
        if self.entries and not live:
            return "released"
        for entry in live:
            for way, replays in (("forward", [entry._forward_replay]), ("backward", entry._backward_replays.values())):
                reasons = {r.not_recorded for r in replays if r.not_recorded}
                not_graphed = {r.not_graphed for r in replays if getattr(r, "not_graphed", None)}
                if reasons:
                    parts.append(f"{way} not replayed: {'; '.join(sorted(reasons))}")
                elif any(getattr(r, "graph_replays", 0) for r in replays):
                    parts.append(f"{way} as a CUDA graph")
                elif not_graphed:
                    parts.append(f"{way} replayed, not as a CUDA graph: {'; '.join(sorted(not_graphed))}")
                elif any(r.replays for r in replays):
                    parts.append(f"{way} replayed")
        return ", ".join(parts)

    def __str__(self) -> str:
        teeny, left = sum(self.teeny_calls.values()), len(self.torch_calls)
        lines = [
            f"{self.name}: {self.programs} teeny program{'s' if self.programs != 1 else ''}, "
            f"{teeny} calls in teeny ({self.teeny_nodes} nodes), {left} kinds left to PyTorch, "
            f"built in {self.build_seconds:.1f} s"
        ]
        fused = [f"{n} x {what}" for what, n in sorted(self.teeny_calls.items()) if what.endswith("(one op)")]
        if fused:
            lines.append(f"  runs of calls as one teeny op: {', '.join(fused)}")
        lines += [f"  PyTorch runs {op}: {why}" for op, why in sorted(self.torch_calls.items())]
        return "\n".join(lines)


_REPORTS: list[RegionReport] = []


def reports() -> list[RegionReport]:
    """The report of every region compiled with ``backend="teeny"`` in this process, in order."""
    return list(_REPORTS)


def report() -> str:
    """What every region compiled with ``backend="teeny"`` in this process became, as text."""
    if not _REPORTS:
        return "teeny backend: no region compiled yet"
    return "\n".join(str(r) for r in _REPORTS)


def summary(regions: Sequence[RegionReport]) -> str:
    """One line for ``regions``: how many, their programs and nodes, and what PyTorch ran."""
    left = sorted({op for r in regions for op in r.torch_calls})
    programs = sum(r.programs for r in regions)
    nodes = sum(r.teeny_nodes for r in regions)
    line = f"{len(regions)} regions, {programs} teeny programs of {nodes} nodes"
    line += f"; PyTorch runs {', '.join(left)}" if left else "; nothing left to PyTorch"
    replays = sorted({part for r in regions for part in r.replayed().split(", ") if part})
    return line + (f"; {', '.join(replays)}" if replays else "")


def reset() -> None:
    """Forget the reports (``torch._dynamo.reset()`` forgets the compiled regions)."""
    _REPORTS.clear()


# ----------------------------------------------------------------------------- the region


def _signature(args: Sequence[Any]) -> tuple:
    """What a program is built for: each tensor's shape, dtype, device and whether it wants a
    gradient (with grad mode), each other argument's value, and the autocast state."""
    grad = torch.is_grad_enabled()
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), a.dtype, a.device.type, grad and a.requires_grad))
        else:
            parts.append(a)
    return (*parts, _autocast_state())


def _autocast_state() -> tuple:
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in ("cuda", "cpu") if torch.is_autocast_enabled(device)
    )


_MIXED = {torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}


def _precision(tensors: Sequence[torch.Tensor]) -> str | None:
    """The region under autocast on its tensors' device: teeny's mixed precision of that dtype
    (products and the rest in half precision, float32 parameters read once per step and cast,
    losses in float32; ``lower(precision=...)``), which is autocast's contract, with teeny's
    own placement of the casts rather than autocast's op-by-op policy."""
    device = tensors[0].device.type if tensors else "cpu"
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype not in _MIXED:
        raise TeenyError(f"backend 'teeny': autocast to {dtype} is not supported (bfloat16 or float16)")
    return _MIXED[dtype]


def _autocast_output_dtypes(gm: torch.fx.GraphModule) -> list[torch.dtype | None]:
    """The dtype of each of the region's outputs as dynamo traced it, under the caller's
    autocast (None for one that is not a tensor)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    values = [
        a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in pytree.tree_leaves(output.args[0])
    ]
    return [v.dtype if isinstance(v, torch.Tensor) else None for v in values]


def _as_autocast_made(value: Any, dtype: torch.dtype | None) -> Any:
    """An output of a region traced without autocast (a teeny or a torch tensor), in the
    half-precision dtype autocast made it in (a model's logits: bfloat16 from the head's
    product, as eager gives them, and not a float32 copy); other outputs as they are (a loss
    stays float32)."""
    if isinstance(value, (Tensor, torch.Tensor)) and value.dtype == torch.float32 and dtype in _MIXED:
        return value.to(dtype)
    return value


def _traced(gm: torch.fx.GraphModule, args: Sequence[Any], half: torch.dtype | None = None) -> torch.fx.GraphModule:
    """The region's graph as ``torch.export`` traces it: a function of the call's tensors only
    (the other arguments, dynamo's symbolic sizes and scalars, fixed at this call's values,
    which the program's signature holds). A graph, not a module around one: export keeps the
    graph's module paths (``nn_module_stack``), which the module fusions read. Traced outside
    any autocast: the region's own dtypes, which mixed precision then lowers (``_precision``).
    ``half``: the caller's autocast dtype, which dynamo wrote into the graph wherever the model
    casts to a dtype it read off a tensor (``x.to(input_dtype)`` after a float32 norm): those
    casts become casts to float32, the region's own dtype, where mixed precision places its own."""
    graph = copy.deepcopy(gm.graph)
    if half is not None:
        own = lambda a: torch.float32 if isinstance(a, torch.dtype) and a == half else a  # noqa: E731
        method = {torch.bfloat16: "bfloat16", torch.float16: "half"}[half]  # x.bfloat16(), x.half()
        for node in graph.nodes:
            if node.op in ("call_method", "call_function"):
                node.args, node.kwargs = pytree.tree_map(own, node.args), pytree.tree_map(own, dict(node.kwargs))
            if node.op == "call_method" and node.target == method:
                node.target = "float"
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, args):
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, nn.Module):  # the body of a `with` block a partition was handed: an attribute
            setattr(gm, node.name, value)
            with graph.inserting_before(node):
                node.replace_all_uses_with(graph.get_attr(node.name))
            graph.erase_node(node)
            continue
        for user in list(node.users):
            swap = lambda a: value if a is node else a  # noqa: B023 (used at once)
            user.args = pytree.tree_map(swap, user.args)
            user.kwargs = pytree.tree_map(swap, dict(user.kwargs))
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


def _scalar_inputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Inputs that are Python numbers dynamo wrapped in a tensor (a layer norm's eps under
    ``dynamic=True``) and the graph reads back with ``.item()``: the graph is changed to read
    the number itself, which the region then passes (a static program fixes its value)."""
    found = set()
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        users = list(node.users)
        if users and all(u.op == "call_method" and u.target == "item" for u in users):
            for user in users:
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
            found.add(index)
    if found:
        gm.recompile()
    return frozenset(found)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


@dataclass
class _Program:
    """One built program of a region: its bridge entry, where each output of the region comes
    from (``("out", k)`` the entry's k-th output, ``("value", v)`` a constant), and which inputs
    the graph writes in place (the entry returns their new values after the outputs)."""

    entry: bridge.Compiled
    outputs: list[tuple[str, Any]]
    written: list[int]

    def __call__(self, args: Sequence[Any]) -> tuple:
        tensors = _tensors(args)
        results = self.entry.unpack(bridge.call(self.entry, tensors))  # the traced function's order
        n = len(results) - len(self.written)
        if self.written:
            with torch.no_grad():
                for i, new in zip(self.written, results[n:]):
                    tensors[i].copy_(new)
        return tuple(results[k] if kind == "out" else k for kind, k in self.outputs)


class Region:
    """One region dynamo captured: built into a teeny program per call signature (``_Program``),
    or split into teeny programs and ATen calls where teeny lacks an op (``_Split``)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        name: str,
        recompute: bool = False,
        precision: str | None = None,
        cuda_graphs: bool = False,
    ):
        self.gm, self.name, self.recompute = gm, name, recompute
        self.cuda_graphs = cuda_graphs  # replayed as CUDA graphs on a GPU whatever config.cuda_graphs says
        self.precision = precision  # a split region's partition: its mixed precision (run outside autocast)
        self.report = RegionReport(name)
        _REPORTS.append(self.report)
        self.programs: dict[tuple, Any] = {}
        self.names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.scalars = _scalar_inputs(gm)

    def __call__(self, *args: Any) -> tuple:
        if self.scalars:
            args = tuple(a.item() if i in self.scalars else a for i, a in enumerate(args))
        key = _signature(args)
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self._build(list(args))
        return program(list(args))

    def _build(self, args: list[Any]):
        precision = self.precision or _precision(_tensors(args))
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):  # traced as written
            return self._build_as_written(args, precision)

    def _build_as_written(self, args: list[Any], precision: str | None):
        start = time.perf_counter()
        tensors = _tensors(args)
        half = next((dtype for dtype, name in _MIXED.items() if name == precision), None)
        ep = _export(_traced(self.gm, args, half), tuple(tensors), {}, f"the region {self.name}")
        try:
            if not tensors:
                raise UnsupportedError([("<region>", self.name, "no tensor inputs: nothing for teeny to compute")])
            program = self._program(ep, args, precision)
        except UnsupportedError as exc:
            for op, _, why in exc.calls:
                self.report.torch_calls.setdefault(op, why)
            program = _Split.of(self, args, exc, half)
        self.report.programs += 1
        self.report.build_seconds += time.perf_counter() - start
        log.info("%s", self.report)
        return program

    def _program(self, ep, args: list[Any], precision: str | None) -> _Program:
        tensors = _tensors(args)
        labels = [n for n, a in zip(self.names, args) if isinstance(a, torch.Tensor)]
        plan: dict[str, Any] = {}

        placeholders = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        parameters = frozenset(name for name, t in zip(placeholders, tensors) if isinstance(t, nn.Parameter))
        autocast_dtypes = _autocast_output_dtypes(self.gm) if precision and not self.precision else None

        def imported(*symbolic):
            bound = list(symbolic)
            walk = _Import(symbolic[0].graph, ep, bound=bound, parameter_inputs=parameters)
            outputs = walk.run()
            if walk.unsupported:
                raise UnsupportedError(walk.unsupported, frozenset(walk.refused_nodes))
            written = [i for i, name in enumerate(placeholders) if walk.env[name] is not bound[i]]
            if autocast_dtypes is not None and len(autocast_dtypes) == len(outputs):
                outputs = [_as_autocast_made(v, d) for v, d in zip(outputs, autocast_dtypes)]
            results, layout = [], []
            for value in outputs:
                if isinstance(value, Tensor):
                    layout.append(("out", len(results)))
                    results.append(value)
                else:
                    layout.append(("value", value))
            plan.update(outputs=layout, written=written, calls=walk.converted)
            return tuple(results + [walk.env[placeholders[i]] for i in written])

        wants = [torch.is_grad_enabled() and t.requires_grad for t in tensors]
        key = f"region:{self.name}:{len(self.programs)}:{id(self)}"
        label = f"region {self.name}"
        entry = bridge.remember_owned(  # held by this region's programs, freed with it
            bridge.compile_function(
                imported, tuple(tensors), {}, wants, key, label, labels, (self,), precision, self.recompute
            )
        )
        entry.replay_as_cuda_graphs(always=self.cuda_graphs)  # (else as config.cuda_graphs says, call by call)
        self.report.teeny_calls.update(plan["calls"])
        self.report.teeny_nodes += len(entry.executor.program.nodes)
        self.report.entries.append(weakref.ref(entry))
        return _Program(entry, plan["outputs"], plan["written"])


# ----------------------------------------------------------------------------- partitioning


class _Split:
    """A region with calls teeny has no op for: its ATen graph with each run of importable calls
    fused into a submodule that is a ``Region`` of its own (split again where it refuses calls
    in turn), the rest run by PyTorch as the ATen calls it traced.

    Under autocast the graph is traced, and run, in the region's own dtypes, as ``_traced``
    gives them: the teeny partitions lower in autocast's mixed precision (half-precision
    compute, float32 between them), PyTorch runs the calls teeny lacks in float32, and the
    region's outputs come back in the dtypes autocast gives them. PyTorch's calls would not
    meet autocast's cast policy halfway through a graph traced without it."""

    def __init__(self, region: Region, gm: torch.fx.GraphModule, is_refused, half: torch.dtype | None):
        from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
        from torch.fx.passes.operator_support import OperatorSupportBase

        class Importable(OperatorSupportBase):
            def is_node_supported(self, submodules, node) -> bool:
                if node.op != "call_function":
                    return False
                if node.target is operator.getitem:
                    source = node.args[0]
                    return isinstance(source, torch.fx.Node) and self.is_node_supported(submodules, source)
                if _writes_its_input(node) and not self.is_node_supported(submodules, node.args[0]):
                    return False  # it changes a tensor from outside teeny: autograd must see it change
                return not is_refused(node)

        partitioner = CapabilityBasedPartitioner(gm, Importable(), allows_single_node_partition=True)
        partitions = []
        for partition in partitioner.propose_partitions():
            if any(map(_computes_floats, partition.nodes)):
                partitions.append(partition)
                continue
            for node in partition.nodes:
                if node.target is not operator.getitem and str(node.target) not in _VIEWS_AND_CASTS:
                    region.report.torch_calls.setdefault(str(node.target), _INTEGER_WORK)
        self.gm = partitioner.fuse_partitions(partitions)
        precision = _MIXED.get(half)
        for node in self.gm.graph.nodes:
            if node.op == "call_module" and node.target.startswith("fused_"):  # not ep.module()'s _guards_fn
                sub = self.gm.get_submodule(node.target)
                part = Region(
                    sub, f"{region.name}.{node.target}", region.recompute, precision or region.precision,
                    region.cuda_graphs,
                )  # fmt: skip
                setattr(self.gm, node.target, _RegionModule(part))
        self.gm.recompile()
        self.half = half
        self.output_dtypes = _autocast_output_dtypes(region.gm) if half is not None else []

    @staticmethod
    def of(region: Region, args: list[Any], refused: UnsupportedError, half: torch.dtype | None):
        """The region split where teeny refused calls; all of it run by PyTorch when the
        refused calls are not found in the graph traced again (nothing to split on)."""
        ep = _export(_traced(region.gm, args, half), tuple(_tensors(args)), {}, f"the region {region.name}")
        gm = ep.module()  # the lifted constants (a rotary table) back in as attributes: called with the user inputs
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        if refused.nodes and refused.nodes <= {n.name for n in calls}:  # the same trace: refuse those very calls
            is_refused = lambda node: node.name in refused.nodes
        else:  # refuse every call of those ops
            ops = {op for op, _, _ in refused.calls}
            is_refused = lambda node: str(node.target) in ops or getattr(node.target, "__name__", "") in ops
        if not any(is_refused(n) for n in calls):
            is_refused = lambda node: True  # noqa: E731
        return _Split(region, gm, is_refused, half)

    def __call__(self, args: Sequence[Any]) -> tuple:
        with _own_dtypes(self.half, _tensors(args)):
            out = self.gm(*_tensors(args))
        out = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        if len(self.output_dtypes) == len(out):
            out = tuple(_as_autocast_made(v, d) for v, d in zip(out, self.output_dtypes))
        return out


_VIEWS_AND_CASTS = {
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.expand.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.slice.Tensor", "aten.select.int",
    "aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.alias.default", "aten.detach.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten._assert_tensor_metadata.default",
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.lift_fresh_copy.default",
}  # fmt: skip


def _writes_its_input(node: torch.fx.Node) -> bool:
    """Whether an ATen call writes its first argument in place (``x.div_(...)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not isinstance(node.args[0], torch.fx.Node):
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


_INTEGER_WORK = "integer or boolean work (a mask from positions): teeny computes floating point"


def _computes_floats(node: torch.fx.Node) -> bool:
    """Whether a call computes floating-point values (not a view, cast or range of them): a run
    without one (a mask built from integer positions) is left to PyTorch, where a teeny
    program would cost a call and compute nothing of the model's."""
    value = node.meta.get("val")
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return floating and node.target is not operator.getitem and str(node.target) not in _VIEWS_AND_CASTS


def _own_dtypes(half: torch.dtype | None, tensors: Sequence[torch.Tensor]):
    """Autocast off on the tensors' device while a graph traced in the region's own dtypes runs."""
    if half is None:
        return contextlib.nullcontext()
    return torch.autocast(tensors[0].device.type if tensors else "cpu", enabled=False)


class _RegionModule(nn.Module):
    """A partition's ``Region`` as the submodule the partitioned graph calls."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region

    def forward(self, *args):
        out = self.region(*args)
        return out if len(out) != 1 else out[0]


# ----------------------------------------------------------------------------- the backend


OPTIONS = {"recompute": "norms', activations' and weight casts' outputs made again in the backward, not kept (a bool)"}


# torch.compile's modes: whether the region replays as CUDA graphs (as inductor's modes use them)
MODES = {"default": False, "reduce-overhead": True, "max-autotune": True, "max-autotune-no-cudagraphs": False}


def teeny_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict | None = None,
    mode: str | None = None,
    **other: Any,
) -> Region:
    """The ``torch.compile`` backend: the captured region as teeny programs (module docstring).
    The program for ``example_inputs`` is built now, so the first step's time includes it.
    ``options``: ``torch.compile``'s, the keys of ``OPTIONS``; ``mode``: its mode, one of
    ``MODES`` ("reduce-overhead" and "max-autotune" replay the region as CUDA graphs)."""
    if other:
        raise TeenyError(f"backend 'teeny' takes no {' or '.join(sorted(other))} (options: {sorted(OPTIONS)})")
    if mode is not None and mode not in MODES:
        raise TeenyError(f"backend 'teeny': unknown mode {mode!r} (known: {', '.join(MODES)})")
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        known = "; ".join(f"{k}: {what}" for k, what in OPTIONS.items())
        raise TeenyError(f"backend 'teeny': unknown option {', '.join(map(repr, unknown))} (known: {known})")
    recompute = options.get("recompute", False)
    if not isinstance(recompute, bool):
        raise TeenyError(f"backend 'teeny': option 'recompute' must be True or False, got {recompute!r}")
    region = Region(gm, f"region{len(_REPORTS)}", recompute=recompute, cuda_graphs=MODES.get(mode, False))
    example = list(example_inputs)
    if all(type(a) in (torch.Tensor, nn.Parameter, int, float, bool) for a in example):  # not dynamic shapes
        region.programs[_signature(example)] = region._build(example)
    return region


def _register() -> None:
    """Make ``backend="teeny"`` known to torch._dynamo when teeny runs from a source tree
    (``PYTHONPATH=src``). Installed, the ``torch_dynamo_backends`` entry point names it and
    dynamo registers it itself on first use (registering it here too would be a duplicate)."""
    from importlib.metadata import entry_points

    if entry_points(group="torch_dynamo_backends", name="teeny"):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "teeny" not in _COMPILER_FNS:
        register_backend(teeny_backend, name="teeny")


_register()
