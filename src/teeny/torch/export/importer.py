"""The import: ``from_torch`` exports the module with ``torch.export``, walks the exported graph
(placeholders: user inputs, parameters, buffers, constants; calls: converted by ``CONVERTERS``,
computed now by PyTorch when they depend on no input, or one teeny op for a fusable module call or
for the last call of a run one op computes, such as a rotary embedding: ``converters.patterns``),
and collects every call it cannot convert into one ``UnsupportedError``; ``to_torch`` loads the
trained weights back into the module."""

from __future__ import annotations

import copy
import inspect
import operator
import os
import re
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ... import ops
from ...core.errors import TeenyError
from ...core.graph import Graph, Tensor
from ...ops.cast import to as cast
from ..library import NAMESPACE, registered_ops
from .converters import CONVERTERS, Env, Refused, fusion, is_teeny, patterns

aten = torch.ops.aten
# `with torch.no_grad()` and `with torch.autocast(...)` blocks, as torch.export records them
_SET_GRAD_ENABLED = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


class UnsupportedError(TeenyError):
    """The module makes calls teeny cannot import; ``calls`` lists each (op, where, why), and
    ``nodes`` names their nodes in the exported graph."""

    def __init__(self, calls: list[tuple[str, str, str]], nodes: frozenset[str] = frozenset()):
        self.calls, self.nodes = calls, nodes
        lines = [f"{len(calls)} call{'s' if len(calls) != 1 else ''} cannot be imported into teeny:"]
        lines += [f"  {op} at {where}: {why}" for op, where, why in calls]
        super().__init__("\n".join(lines))


# -------------------------------------------------------------------------- factories on inputs

_LIKE = {  # new_ones(x), zeros_like(x): of x only its shape matters, so PyTorch computes them now
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.scalar_tensor.default,
}


# ----------------------------------------------------------------------------- fused module calls


@dataclass
class _Region:
    """The consecutive ATen calls of one module call."""

    nodes: list
    fuse: Callable
    module: nn.Module | None
    name: str  # the module's class


_PASS_THROUGH = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.alias.default,
    aten.contiguous.default,
}


def _passes_through(node, source) -> bool:
    """Whether ``node`` is ``source`` itself (a cast to its own dtype, an alias)."""
    val, src = node.meta.get("val"), source.meta.get("val")
    return (
        node.target in _PASS_THROUGH
        and node.args
        and node.args[0] is source
        and isinstance(val, torch.Tensor)
        and isinstance(src, torch.Tensor)
        and val.dtype == src.dtype
        and tuple(val.shape) == tuple(src.shape)
    )


def _regions(graph: torch.fx.Graph, root: nn.Module | None) -> dict[str, _Region]:
    """Fusable module calls, by the name of their first node. Without ``root`` (a region
    torch.compile captured: the modules are not at hand) a module is known by its class alone."""
    runs: list[tuple[str, str, str, list]] = []
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op != "call_function" or not stack:
            runs.append(("", "", "", [node]))
            continue
        key, (path, cls) = list(stack.items())[-1]
        if runs and runs[-1][0] == key and key:
            runs[-1][3].append(node)
        else:
            runs.append((key, path, cls, [node]))
    out = {}
    for key, path, cls, nodes in runs:
        if not key:
            continue
        module = None
        if root is not None:
            try:
                module = root.get_submodule(re.sub(r"^L\['self'\]\.?", "", path))
            except AttributeError:
                continue
        class_path = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        fuse = fusion(class_path, module, nodes)
        if fuse is not None:
            out[nodes[0].name] = _Region(nodes, fuse, module, class_path.rsplit(".", 1)[-1])
    return out


# ----------------------------------------------------------------------------- the import


def _where(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"^L\['self'\]\.?", "", path)
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or "")
    line = ""
    if frames:
        file, number, code = frames[-1]
        line = f" ({os.path.basename(file)}:{number}: {code.strip()})"
    return f"{path or '<root>'}{line}"


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return str(target) if isinstance(target, torch._ops.OpOverload) else name


class _Import:
    """Walks one exported program, filling ``graph``."""

    def __init__(
        self,
        graph: Graph,
        ep,
        prefix: str = "",
        bound: Sequence[Any] = (),
        input_names=None,
        canonical=None,
        root: nn.Module | None = None,
        parameter_inputs: frozenset[str] = frozenset(),
    ):
        self.graph, self.ep, self.prefix = graph, ep, prefix
        self.root = root
        self.regions = _regions(ep.graph, root)
        self.parameter_inputs = parameter_inputs  # user inputs that are the module's parameters (torch.compile's)
        self.parameter_values: set[int] = set()  # ids of the graph values they are bound to
        self.fused: set[str] = set()  # nodes a fused module call already computed
        self.canonical = canonical or {}  # storage key -> the module's own name for a tensor (tied weights)
        self.by_storage: dict[tuple, Tensor] = {}
        self.env: dict[str, Any] = {}
        self.unsupported: list[tuple[str, str, str]] = []
        self.converted: Counter = Counter()  # ATen op -> calls that became teeny ops
        self.refused_nodes: set[str] = set()  # names of the calls in ``unsupported``
        self.bound = list(bound)  # values for the first user inputs (a loss's model outputs)
        self.input_names = input_names
        self.int_buffers: list[str] = []
        self.autocast = False  # inside an enabled autocast region
        self.constants: dict[tuple, tuple[torch.Tensor, Tensor]] = {}  # (id, dtype) -> (constant, graph tensor)

    def run(self) -> list[Any]:
        signature = self.ep.graph_signature
        specs = {spec.arg.name: spec for spec in signature.input_specs}
        state = self.ep.state_dict
        constants = self.ep.constants
        bound = iter(self.bound)
        user_index = 0
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                spec = specs[node.name]
                kind = spec.kind.name
                if kind == "USER_INPUT":
                    value = next(bound, None)
                    val = node.meta.get("val")
                    if value is None and not isinstance(val, torch.Tensor):
                        value = val  # a plain argument (use_cache=False): the export specialised on it
                    elif value is None:
                        name = self.input_names[user_index] if self.input_names else node.name
                        value = self.graph.input(name, tuple(val.shape), val.dtype)
                    user_index += 1
                    self.env[node.name] = value
                    if node.name in self.parameter_inputs and isinstance(value, Tensor):
                        self.parameter_values.add(value.value.id)
                elif kind == "PARAMETER":
                    self.env[node.name] = self._parameter(spec.target, state[spec.target], True, node)
                elif kind == "BUFFER":
                    data = state[spec.target] if spec.persistent else constants[spec.target]
                    if spec.persistent and data.is_floating_point() and not _only_attention_mask(node):
                        self.env[node.name] = self._parameter(spec.target, data, False, node)
                    else:
                        if spec.persistent:
                            self.int_buffers.append(self.prefix + spec.target)
                        self.env[node.name] = data.detach().clone()
                elif kind == "CONSTANT_TENSOR":
                    self.env[node.name] = constants[spec.target].detach().clone()
                else:
                    raise TeenyError(f"from_torch: exported input {node.name} of kind {kind} is not supported")
            elif node.op == "get_attr":  # the body of a higher-order call (a `with` block)
                self.env[node.name] = getattr(self.ep.graph_module, node.target)
            elif node.op == "call_function":
                self._visit(node)
            elif node.op == "output":
                outputs = pytree.tree_map(self._value, node.args[0])
                return self._user_outputs(outputs)
        raise TeenyError("from_torch: the exported graph has no output")

    def _visit(self, node) -> None:
        """Convert one call: as part of a fused module call, or on its own."""
        if node.name in self.fused:
            return
        region = self.regions.get(node.name)
        if region is not None and self._fuse(region):
            return
        self.env[node.name] = self._call(node)

    def _fuse(self, region: _Region) -> bool:
        """Compute a fusable module call as its one teeny op; False (convert call by call) when
        the run does not have one activation input and one output."""
        inside = {n.name for n in region.nodes}
        inputs: list = []
        for n in region.nodes:
            for a in pytree.tree_leaves((n.args, n.kwargs)):
                if isinstance(a, torch.fx.Node) and a.name not in inside and a not in inputs:
                    inputs.append(a)
        leaving = [n for n in region.nodes if any(u.name not in inside for u in n.users)]
        params = [a for a in inputs if self._is_state(a)]
        activations = [a for a in inputs if a not in params]
        if len(activations) != 1 or not isinstance(self.env.get(activations[0].name), Tensor):
            return False
        # x.to(x.dtype) inside the module is x itself, and the code after the module may read it
        passing = [n for n in leaving if _passes_through(n, activations[0])]
        leaving = [n for n in leaving if n not in passing]
        if len(leaving) != 1:
            return False
        env = Env(self.graph, leaving[0])
        try:
            result = region.fuse(env, self.env[activations[0].name], [self.env[p.name] for p in params], region.module)
        except Refused:
            return False
        if result.dtype != env.out_dtype():
            result = cast(result, env.out_dtype())
        self._check(leaving[0], result)
        self.env[leaving[0].name] = result
        for n in passing:
            self.env[n.name] = self.env[activations[0].name]
        self.fused.update(inside)
        self.converted[f"{region.name} (one op)"] += 1
        return True

    def _is_state(self, node) -> bool:
        """Whether ``node`` is a parameter or buffer of the module (a graph parameter, or an input
        that is one: torch.compile lifts the module's state to inputs)."""
        value = self.env.get(node.name)
        if isinstance(value, Tensor):
            return value.value.kind == "param" or value.value.id in self.parameter_values
        spec = next((s for s in self.ep.graph_signature.input_specs if s.arg.name == node.name), None)
        return spec is not None and spec.kind.name in ("PARAMETER", "BUFFER")

    def _parameter(self, name: str, value: torch.Tensor, parameter: bool, node) -> Tensor:
        """One teeny parameter per tensor: tied weights (two state_dict names, one tensor) share
        it, under the name the module's ``named_parameters`` gives. A parameter the graph never
        reads is non-trainable (no gradient reaches it, so an optimizer must leave it alone)."""
        key = _storage_key(value)
        existing = self.by_storage.get(key)
        if existing is not None:
            return existing
        data = value.detach().clone()
        used = len(node.users) > 0 or any(
            len(n.users) > 0 for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self._aliases(key)
        )
        trainable = parameter and value.requires_grad and data.is_floating_point() and used
        name = self.canonical.get(key, name)
        tensor = self.graph.parameter(
            self.prefix + name, tuple(data.shape), init=_copy_init(data), dtype=data.dtype, trainable=trainable
        )
        self.by_storage[key] = tensor
        return tensor

    def _aliases(self, key: tuple) -> set[str]:
        """Placeholder names whose state tensor is the one with storage ``key``."""
        names = set()
        for spec in self.ep.graph_signature.input_specs:
            if spec.kind.name in ("PARAMETER", "BUFFER") and spec.target in self.ep.state_dict:
                if _storage_key(self.ep.state_dict[spec.target]) == key:
                    names.add(spec.arg.name)
        return names

    def _value(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        return a

    def _user_outputs(self, outputs) -> list[Any]:
        specs = self.ep.graph_signature.output_specs
        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        user = []
        for spec, value in zip(specs, flat):
            kind = spec.kind.name
            if kind in ("USER_OUTPUT", "LOSS_OUTPUT"):
                user.append(value)
            elif kind == "BUFFER_MUTATION" and spec.target.endswith("num_batches_tracked"):
                continue
            else:
                self.unsupported.append((kind.lower(), spec.target or "<root>", "the module writes its own state"))
        return user

    def _call(self, node) -> Any:
        target = node.target
        args = pytree.tree_map(self._value, node.args)
        kwargs = pytree.tree_map(self._value, dict(node.kwargs))
        if target is _SET_GRAD_ENABLED:  # with torch.no_grad() / torch.enable_grad(): ...
            enabled, body, *operands = args
            outputs = self._inline(body, operands)
            return outputs if enabled else [ops.stop_gradient(v) if isinstance(v, Tensor) else v for v in outputs]
        if target is _AUTOCAST:  # with torch.autocast(...): ... (enabled=False: HF's rotary embeddings)
            _device, dtype, enabled, _cache, body, *operands = args
            outer, self.autocast = self.autocast, enabled
            first = len(self.graph.nodes)
            try:
                return self._inline(body, operands)
            finally:
                self.autocast = outer
                if not enabled:  # the model's own dtypes, whatever precision the program is lowered in
                    for made in self.graph.nodes[first:]:
                        made.op = copy.copy(made.op)
                        made.op.in_float32 = True
        if target is operator.getitem:
            container, index = args
            return None if container is None else container[index]
        if not is_teeny(list(args) + list(kwargs.values())):  # depends on no input: PyTorch computes it now
            if target is aten.add_.Tensor and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
                return args[0]  # num_batches_tracked += 1: the count stays with the torch module
            return _fold(target, args, kwargs)
        if target in _LIKE:  # new_ones(x, ...), zeros_like(x): only x's shape matters
            dummy = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, Tensor) else a for a in args]
            return _fold(target, dummy, kwargs)
        if self.autocast:
            args, kwargs = _autocast_inputs(node, args, kwargs)
        env = Env(self.graph, node)
        fused = self._pattern(node)
        if fused is not None:
            return fused
        converter = CONVERTERS.get(target) or _registered_teeny_op(target)
        try:
            if converter is None:
                raise Refused("teeny has no op for it")
            result = converter(env, *args, **kwargs)
        except Refused as exc:
            return self._refuse(node, _op_name(target), str(exc))
        except (ValueError, TypeError, TeenyError) as exc:
            return self._refuse(node, _op_name(target), f"{type(exc).__name__}: {exc}")
        self._check(node, result)
        self.converted[_op_name(target)] += 1
        if getattr(target, "_schema", None) is not None and target._schema.is_mutable and node.args:
            first = node.args[0]
            if isinstance(first, torch.fx.Node) and isinstance(self.env.get(first.name), Tensor):
                self.env[first.name] = result  # x.add_(y): later readers of x see the new value
        return result

    def _inline(self, body: torch.fx.GraphModule, operands: list[Any]) -> list[Any]:
        """The values of a higher-order call's body graph, converted call by call in a scope of its
        own (its node names are its own), with ``operands`` bound to its placeholders."""
        outer = self.env, self.regions, self.fused
        self.env, self.regions, self.fused = {}, _regions(body.graph, self.root), set()
        try:
            operand = iter(operands)
            for node in body.graph.nodes:
                if node.op == "placeholder":
                    self.env[node.name] = next(operand)
                elif node.op == "get_attr":
                    self.env[node.name] = getattr(body, node.target)
                elif node.op == "call_function":
                    self._visit(node)
                elif node.op == "output":
                    return list(pytree.tree_map(self._value, node.args[0]))
        finally:
            self.env, self.regions, self.fused = outer
        raise TeenyError("from_torch: the body of a higher-order call has no output")

    def _pattern(self, node) -> Tensor | None:
        """``node`` as the one teeny op that computes the run of calls it ends (``patterns``:
        a gated MLP, a rotary embedding), or None where the op does not give the node's shape and
        dtype. The run's calls were converted already; lowering drops those nothing else reads."""
        found = patterns.match(node)
        val = node.meta.get("val")
        if found is None or not isinstance(val, torch.Tensor):
            return None
        values = [self.env.get(n.name) for n in found.inputs]
        if not all(isinstance(v, (Tensor, torch.Tensor)) and v.dtype.is_floating_point for v in values):
            return None
        if any(isinstance(values[i], Tensor) and _may_need_gradient(values[i]) for i in found.no_gradient):
            return None
        env, dtype = Env(self.graph, node), val.dtype if found.promote else None
        try:
            result = found.fn(*[self._operand(env, v, dtype) for v in values], **found.kwargs)
        except (ValueError, TypeError, TeenyError):
            return None
        if tuple(result.shape) != tuple(val.shape) or result.dtype != val.dtype:
            return None
        self.converted[f"{found.name} (one op)"] += 1
        return result

    def _operand(self, env: Env, value: Any, dtype: torch.dtype | None) -> Tensor:
        """A teeny tensor for ``value`` (cast to ``dtype``): one graph constant for a constant,
        however many calls read it (every layer's rotary embedding reads the same two tables)."""
        if not isinstance(value, torch.Tensor):
            return env.tensor(value, dtype)
        key = (id(value), dtype)
        if key not in self.constants:
            self.constants[key] = (value, env.tensor(value, dtype))  # holding value keeps its id its own
        return self.constants[key][1]

    def _check(self, node, result) -> None:
        val = node.meta.get("val")
        if isinstance(result, Tensor) and isinstance(val, torch.Tensor):
            if tuple(result.shape) != tuple(val.shape) or result.dtype != val.dtype:
                raise TeenyError(
                    f"from_torch: {_op_name(node.target)} at {_where(node)} became a teeny tensor of shape "
                    f"{tuple(result.shape)} {result.dtype}, but PyTorch computes {tuple(val.shape)} {val.dtype}"
                )

    def _refuse(self, node, op: str, why: str) -> Any:
        """Note ``node`` as a call teeny cannot import, and stand in for its value."""
        self.unsupported.append((op, _where(node), why))
        self.refused_nodes.add(node.name)
        return self._stand_in(node)

    def _stand_in(self, node) -> Any:
        """A placeholder with the node's shape, so that the walk goes on and finds every unsupported call."""

        def make(val):
            if isinstance(val, torch.Tensor):
                name = f"__unsupported_{len(self.graph.values)}"
                return self.graph.input(name, tuple(val.shape), val.dtype)
            return val

        return pytree.tree_map(make, node.meta.get("val"))


def _autocast_inputs(node, args, kwargs):
    """Autocast's casts, made explicit: inside an autocast region torch computed each call's
    output dtype (``val``) by autocast's policy (products in the low precision, reductions and
    losses in float32, the rest promoted), so a call whose floating output dtype differs from a
    floating input's reads that input cast to the output's dtype first, as autocast does."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return args, kwargs

    def to_output_dtype(a):
        if isinstance(a, Tensor) and a.dtype.is_floating_point and a.dtype != val.dtype:
            return cast(a, val.dtype)
        return a

    return pytree.tree_map(to_output_dtype, args), pytree.tree_map(to_output_dtype, kwargs)


def _may_need_gradient(tensor: Tensor) -> bool:
    """Whether ``tensor`` is computed from a trainable parameter or an input that wants a gradient."""
    stack, seen = [tensor.value], set()
    while stack:
        value = stack.pop()
        if value.id in seen:
            continue
        seen.add(value.id)
        if value.requires_grad:
            return True
        if value.producer is not None:
            stack.extend(value.producer.inputs)
    return False


def _registered_teeny_op(target) -> Callable | None:
    """The converter of a ``torch.ops.teeny.<name>`` call (a patched model's layer, a registered
    ``CustomOp``): the teeny function it was registered for, applied to the graph's tensors."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE:
        return None
    registered = registered_ops().get(target.name())
    if registered is None:
        return None
    return lambda env, *args, **kwargs: registered.fn(*args, **kwargs)


def _only_attention_mask(node) -> bool:
    """Whether a buffer is read only as the mask of attention calls: a constant, then (a mask
    carries no gradient), not a parameter of the graph."""
    return bool(node.users) and all(
        user.target == aten.scaled_dot_product_attention.default
        and (user.kwargs.get("attn_mask") is node or (len(user.args) > 3 and user.args[3] is node))
        for user in node.users
    )


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def _fold(target, args, kwargs):
    with torch.no_grad():
        return target(*args, **kwargs)


def _copy_init(data: torch.Tensor):
    def init(shape, generator, dtype):
        return data.to(dtype).clone()

    return init


class _Loss(nn.Module):
    """``loss(output, *targets)`` as a module, for export (its state is prefixed ``loss.``)."""

    def __init__(self, loss: Callable, out_spec):
        super().__init__()
        self.loss_fn = loss
        self.out_spec = out_spec

    def forward(self, *flat):
        n = self.out_spec.num_leaves
        output = pytree.tree_unflatten(list(flat[:n]), self.out_spec)
        return self.loss_fn(output, *flat[n:])


def _example(val: torch.Tensor) -> torch.Tensor:
    if val.is_floating_point():
        return torch.randn(tuple(val.shape), dtype=val.dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(tuple(val.shape), dtype=val.dtype)


def _export(module: nn.Module, args: tuple, kwargs: dict, what: str):
    """``torch.export.export``, its failures said in one line: teeny imports programs of static
    shapes whose Python does not branch on tensor values."""
    try:
        return torch.export.export(module, args, kwargs)
    except Exception as exc:  # torch.export's own errors have no common base class
        text = str(exc)
        # torch prints the graph traced so far into its message: say its last user line, and the reason
        lines = [line.strip() for line in text.splitlines()]
        reason = next((s for s in lines if s and not s.startswith(("def ", "#")) and "=" not in s[:40]), "")
        user = [f for f in traceback.extract_tb(exc.__traceback__) if not _library_file(f.filename)]
        at = (
            f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno} ({(user[-1].line or '')[:80]})"
            if user
            else ""
        )
        data_dependent = "data-dependent" in text or type(exc).__name__.startswith("GuardOnDataDependent")
        hint = (
            "the forward branches on a tensor's value (data-dependent control flow), which a static teeny program "
            "cannot follow"
            if data_dependent
            else "torch.export cannot trace it"
        )
        first = reason or type(exc).__name__
        raise TeenyError(f"from_torch: {what}: {hint}{at}: {type(exc).__name__}: {first[:160]}") from None


def _library_file(path: str) -> bool:
    """Whether ``path`` is torch's, teeny's or another installed package's (not the user's model)."""
    return any(
        part in path for part in ("site-packages", "dist-packages", f"{os.sep}torch{os.sep}", f"{os.sep}teeny{os.sep}")
    )


def from_torch(
    module: nn.Module,
    example_inputs: Any,
    loss: Callable | None = None,
    targets: Sequence[torch.Tensor] = (),
    name: str | None = None,
) -> Graph:
    """A teeny ``Graph`` computing ``module`` (see the module docstring).

    ``example_inputs``: a tensor, a tuple of positional arguments, or a dict of keyword
    arguments, with the shapes the graph is built for (shapes are static). Without ``loss``
    the graph's outputs are the module's (flattened; the first is the loss in training, as
    for a Hugging Face model called with ``labels=``). With ``loss``, a callable
    ``loss(output, *targets)`` (``torch.nn.CrossEntropyLoss()``, a function of ``F`` calls),
    the graph's first output is that loss and ``targets`` gives example targets (graph
    inputs ``target``, ``target1``, ...); the module's outputs follow. Raises
    ``UnsupportedError`` listing every call teeny has no op for, and ``TeenyError`` naming the
    argument when the example inputs do not fit ``forward``. Non-tensor arguments
    (``use_cache=False``, ``return_dict``) are fixed at the values given; a Hugging Face model's
    ``use_cache`` defaults to False (a training graph keeps no cache).
    """
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        args, kwargs = tuple(example_inputs), {}
    what = f"{type(module).__name__}.forward"
    try:
        signature = inspect.signature(module.forward)
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TeenyError(f"from_torch: the example inputs do not fit {what}{signature}: {exc}") from None
    if "use_cache" in signature.parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False  # a Hugging Face model: a training graph returns no cache
    ep = _export(module, args, kwargs, what)
    graph = Graph(name or type(module).__name__)
    canonical = {}
    for key, t in [*module.named_parameters(), *module.named_buffers()]:  # first names of tied tensors win
        canonical.setdefault(_storage_key(t), key)
    main = _Import(graph, ep, canonical=canonical, root=module)
    outputs = main.run()
    unsupported = list(main.unsupported)
    if loss is not None:
        out_node = next(n for n in ep.graph.nodes if n.op == "output")
        user_vals = [
            a.meta["val"]
            for a, spec in zip(out_node.args[0], ep.graph_signature.output_specs)
            if spec.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT")
        ]
        wrapper = _Loss(loss, ep.call_spec.out_spec)
        loss_ep = torch.export.export(wrapper, (*[_example(v) for v in user_vals], *targets))
        names = [f"__output{i}" for i in range(len(user_vals))] + [
            "target" if i == 0 else f"target{i}" for i in range(len(targets))
        ]
        loss_import = _Import(graph, loss_ep, prefix="loss.", bound=outputs, input_names=names, root=wrapper)
        loss_outputs = loss_import.run()
        unsupported += loss_import.unsupported
        outputs = loss_outputs + outputs
    if unsupported:
        raise UnsupportedError(unsupported)
    tensors = [o for o in outputs if isinstance(o, Tensor)]
    if not tensors:
        raise TeenyError("from_torch: the module returns no tensor computed from its inputs or parameters")
    graph.output(*tensors)
    return graph


# ----------------------------------------------------------------------------- the way back


def to_torch(source: Any, module: nn.Module, strict: bool = True) -> nn.Module:
    """Load teeny's parameters into ``module`` with ``load_state_dict(strict=strict)``.

    ``source``: an ``Executor``, a dict of tensors (``executor.state_dict()``), or the path of
    a checkpoint written by ``teeny train``. Tied weights (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) are filled from the one teeny trained; integer buffers
    (``num_batches_tracked``) and anything else teeny does not hold keep the module's value.
    Returns ``module``."""
    if isinstance(source, (str, os.PathLike)):
        from ...training.loop import load_checkpoint

        params, _, _ = load_checkpoint(source)
    elif hasattr(source, "params") and hasattr(source, "program"):
        params = source.params
    else:
        params = dict(source)
    own = module.state_dict(keep_vars=True)
    by_storage: dict[tuple, str] = {}
    for key, t in own.items():
        if key in params and isinstance(t, torch.Tensor) and t.numel():
            by_storage[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = key
    full = {}
    for key, t in own.items():
        if key in params:
            full[key] = params[key]
            continue
        tied = (
            by_storage.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))) if t.numel() else None
        )
        full[key] = params[tied] if tied is not None else t.detach()
    unknown = sorted(k for k in params if k not in own and not k.startswith("loss."))
    if strict and unknown:
        raise KeyError(f"to_torch: teeny parameters {unknown} are not in the module's state_dict")
    module.load_state_dict({k: v.detach().to(own[k].device) for k, v in full.items()}, strict=strict)
    return module
