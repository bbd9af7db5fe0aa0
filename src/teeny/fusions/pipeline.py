"""What every rewrite shares: its type (``RewriteFn``), its report (``RewriteReport``), the
node-by-node copy it makes of the graph (``Rebuild``), who reads each value (``readers``), and
``apply_rewrites``, which runs a list of them in order (what a rewrite is: ``teeny.fusions``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.graph import Graph, Node, Tensor, Value
from ..core.runtime import RuntimeOp

RewriteFn = Callable[[Graph, list[Value], bool], tuple[Graph, list[Value], str]]


@dataclass(frozen=True)
class RewriteReport:
    """What one rewrite changed in a program, as ``Program.summary()`` prints it."""

    rewrite: str
    changed: str

    def __str__(self) -> str:
        return f"{self.rewrite}: {self.changed}"


class Rebuild:
    """A copy of ``graph`` made node by node: ``copy(node)`` re-applies a node as it is,
    ``apply(op, inputs, name)`` adds a new one, ``self[old]`` is the new value of an old one.
    Inputs, parameters and constants are copied first, in their order (so the parameter arena
    is laid out as before)."""

    def __init__(self, graph: Graph):
        self.source, self.graph = graph, Graph(graph.name)
        self.new: dict[int, Value] = {}
        for v in graph.values:
            if v.kind == "input":
                copy = self.graph.input(v.name, v.shape, v.dtype, v.requires_grad)
            elif v.kind == "param":
                copy = self.graph.parameter(v.name, v.shape, v.init, v.dtype, v.requires_grad)
            elif v.kind == "const":
                copy = self.graph.constant(v.data, v.dtype, v.name)
            else:
                continue
            self.new[v.id] = copy.value

    def __getitem__(self, old: Value) -> Value:
        return self.new[old.id]

    def apply(self, op: RuntimeOp, inputs: Sequence[Value], name: str) -> Value:
        """A new node ``op(inputs)`` (new values), its shape and dtype inferred and checked."""
        return self.graph.apply(op, [Tensor(self.graph, v) for v in inputs], name=name).value

    def copy(self, node: Node) -> Value:
        """``node`` re-applied to the new values of its inputs."""
        out = self.apply(node.op, [self[v] for v in node.inputs], node.name)
        self.new[node.output.id] = out
        return out

    def replace(self, skipped: set[int], fused: Mapping[int, Any], fuse: Callable[[Node, Any], None]) -> None:
        """Every node of the source graph in order: those in ``skipped`` left out, each one in
        ``fused`` handed to ``fuse(node, fused[node.id])`` (which applies what replaces it and
        sets ``self.new`` for the values it stands for), the others copied."""
        for node in self.source.nodes:
            if node.id in skipped:
                continue
            if node.id in fused:
                fuse(node, fused[node.id])
            else:
                self.copy(node)

    def finish(self, outputs: Sequence[Value]) -> tuple[Graph, list[Value]]:
        """The new graph, with the new values of ``outputs`` as its outputs."""
        outs = [self[v] for v in outputs]
        self.graph.output(*[Tensor(self.graph, v) for v in outs])
        return self.graph, outs


def ancestors(outputs: Sequence[Value]) -> set[int]:
    """Ids of the values ``outputs`` are computed from (themselves included)."""
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v.id not in seen:
            seen.add(v.id)
            if v.producer is not None:
                stack.extend(v.producer.inputs)
    return seen


def wants_gradient() -> Callable[[Value | None], bool]:
    """A function telling whether a value wants a gradient: an input or a parameter marked
    ``requires_grad``, or a floating-point value computed from one (remembered per value)."""
    known: dict[int, bool] = {}

    def wants(value: Value | None) -> bool:
        if value is None:
            return False
        stack = [value]
        while stack:  # depth first without recursion: deep graphs
            v = stack[-1]
            if v.id in known:
                stack.pop()
                continue
            if v.producer is None:
                known[v.id] = bool(v.requires_grad) and v.kind in ("input", "param")
                stack.pop()
                continue
            pending = [u for u in v.producer.inputs if u.id not in known]
            if pending:
                stack.extend(pending)
                continue
            known[v.id] = v.dtype.is_floating_point and any(known[u.id] for u in v.producer.inputs)
            stack.pop()
        return known[value.id]

    return wants


def readers(graph: Graph, needed: set[int] | None = None) -> dict[int, list[tuple[Node, int]]]:
    """Per value id, the nodes that read it and at which input position; with ``needed`` (value
    ids, ``ancestors(outputs)``), only the nodes whose output is needed (a node a fused module
    call left behind reads its inputs until the lowering drops it)."""
    out: dict[int, list[tuple[Node, int]]] = {v.id: [] for v in graph.values}
    for node in graph.nodes:
        if needed is None or node.output.id in needed:
            for index, v in enumerate(node.inputs):
                out[v.id].append((node, index))
    return out


def matching(graph: Graph, find: Callable[[Node], Any]) -> dict[int, Any]:
    """Per node id, what ``find(node)`` says of each node it does not answer None for: the
    nodes a rewrite replaces, with what it needs to replace them."""
    found = {}
    for node in graph.nodes:
        match = find(node)
        if match is not None:
            found[node.id] = match
    return found


def left_out(chains: Mapping[int, Sequence[Node]], read_by, outputs: Sequence[Value]) -> set[int]:
    """Ids of the nodes a rewrite can leave out: of each chain (its nodes in graph order, keyed by
    the node that reads past them), those nothing else reads and that are no output."""
    kept = {v.id for v in outputs}
    skipped: set[int] = set()
    for reader_id, chain in chains.items():
        for link in reversed(chain):  # readers before what they read
            others = [r for r, _ in read_by[link.output.id] if r.id != reader_id and r.id not in skipped]
            if link.output.id not in kept and not others:
                skipped.add(link.id)
    return skipped


def nbytes(value: Value) -> int:
    return value.numel * value.dtype.itemsize


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def apply_rewrites(
    graph: Graph, outputs: list[Value], training: bool, rewrites: Sequence[RewriteFn]
) -> tuple[Graph, list[Value], list[RewriteReport]]:
    """Run ``rewrites`` in order; the final graph, its outputs and what each rewrite changed."""
    reports = []
    for rewrite in rewrites:
        graph, outputs, changed = rewrite(graph, outputs, training)
        if changed:
            reports.append(RewriteReport(getattr(rewrite, "__name__", str(rewrite)), changed))
    return graph, outputs, reports
