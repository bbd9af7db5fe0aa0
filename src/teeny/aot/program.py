"""The program a bundle is about, rebuilt the same way on both sides of a build.

The build's worker and the loader both turn a bundle's *source* into a ``Graph``: a built-in
model (``make_task(model, size)`` at a batch size) traced under the bundle's switches
(``teeny.core.config``), or a user ``Graph`` stored as a pickle in which kernels and Triton
functions are references (resolved to the loading process's own objects, so a graph traced
under the interpreter loads with the GPU's kernels) and parameter initialisers that are not
importable are replaced by the bundle's stored parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from ..core import config as teeny_config
from ..core.graph import Graph
from ..core.kernel import REGISTRY, Kernel, dtype_name
from .bundle import BundleError

CONFIG_SWITCHES = ("allow_tf32", "deterministic", "check_indices")


def current_config() -> dict[str, bool]:
    """The ``teeny.core.config`` switches as they are now."""
    return {name: bool(getattr(teeny_config, name)) for name in CONFIG_SWITCHES}


@contextlib.contextmanager
def switches(values: dict[str, bool]) -> Iterator[None]:
    """``teeny.core.config`` set to ``values`` inside the block (read when a graph is traced)."""
    unknown = sorted(set(values) - set(CONFIG_SWITCHES))
    if unknown:
        raise BundleError(f"unknown teeny.core.config switches {unknown}; known: {', '.join(CONFIG_SWITCHES)}")
    old = current_config()
    for name, value in values.items():
        setattr(teeny_config, name, bool(value))
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(teeny_config, name, value)


_TASKS: dict = {}
TRAIN_SETTINGS = ("optimizer", "lr", "weight_decay", "momentum", "clip", "schedule", "warmup_steps")


def make_graph(
    source: dict, mode: str, config: dict[str, bool], graph_pickle: bytes | None = None, trusted: bool = False
):
    """``(graph, task, source)`` for a bundle's source: ``task`` is the built-in model's task
    (data, defaults) or ``None`` for a stored graph; ``source`` has its defaults filled in (the
    model's batch size)."""
    if source["kind"] == "graph":
        if graph_pickle is None:
            raise BundleError("the bundle's source is a stored graph, but graph.pkl is missing")
        return load_graph(graph_pickle, trusted), None, dict(source)
    from ..training.models import make_task

    with switches(config):
        size = source.get("size") or "small"
        key = (source["model"], size, tuple(sorted(config.items())))
        task = _TASKS.get(key)
        if task is None:  # a task is reused (its data loads once per process)
            try:
                task = _TASKS[key] = make_task(source["model"], size)
            except KeyError:
                raise BundleError(f"unknown model {source['model']!r}") from None
        batch = int(source.get("batch_size") or task.defaults["batch_size"])
        if mode == "training":
            graph = task.train_graph(batch)
        else:
            graph = task._graph(batch, False)  # the model alone: inputs x, output logits
    return graph, task, {**source, "size": source.get("size") or "small", "batch_size": batch}


def train_settings(task, overrides: dict) -> dict:
    """The optimizer and clipping a training bundle is built for: ``TrainConfig``'s defaults,
    then the model's, then ``overrides`` (``None`` values ignored)."""
    from ..training.loop import TrainConfig

    unknown = sorted(set(overrides) - set(TRAIN_SETTINGS))
    if unknown:
        raise BundleError(f"unknown training settings {unknown}; known: {', '.join(TRAIN_SETTINGS)}")
    base = TrainConfig()
    settings = {k: getattr(base, k) for k in TRAIN_SETTINGS}
    if task is not None:
        settings.update({k: v for k, v in task.defaults.items() if k in TRAIN_SETTINGS})
    settings.update({k: v for k, v in overrides.items() if v is not None})
    try:
        TrainConfig(**settings).validate()
    except ValueError as exc:
        raise BundleError(f"training settings: {exc}") from None
    return settings


# ------------------------------------------------------------------------ graph pickles


class StoredParameter:
    """The initialiser of a parameter whose values the bundle stores: zeros, replaced by the
    stored values when the executor loads them."""

    def __call__(self, shape: tuple, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)


def _registered_kernel(name: str) -> Kernel:
    from .. import ops  # noqa: F401  (registers every op family's kernels)

    kernel = REGISTRY.get(name)
    if kernel is None:
        raise BundleError(f"the stored graph uses kernel {name}, which this teeny does not define")
    return kernel


def _module_attr(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _triton_function(module: str, name: str) -> Any:
    """A stored graph's reference to a ``@triton.jit`` function: only such a function resolves
    (a reference to any other attribute would let a bundle call it while loading)."""
    found = _module_attr(module, name)
    if not _is_triton_function(found):
        raise BundleError(f"the stored graph refers to {module}.{name}, which is not a Triton function")
    return found


def _is_triton_function(obj: Any) -> bool:
    return inspect.isfunction(getattr(obj, "fn", None)) and not inspect.isfunction(obj)


def _importable(obj: Any) -> bool:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or "<" in name:
        return False
    try:
        return _module_attr(module, name) is obj
    except (ImportError, AttributeError):
        return False


class _GraphPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Kernel):
            if REGISTRY.get(obj.name) is not obj:
                raise BundleError(
                    f"kernel {obj.name} is not registered (built with register=False), so a graph holding it "
                    "cannot be stored; keep such kernels on the op's class (CustomOp does)"
                )
            return _registered_kernel, (obj.name,)
        if _is_triton_function(obj):  # a @triton.jit function (compiled or interpreted): by reference
            module, name = obj.fn.__module__, obj.fn.__qualname__
            try:
                found = _module_attr(module, name)
            except (ImportError, AttributeError):
                found = None
            if found is not obj:
                raise BundleError(f"Triton function {module}.{name} is not a module attribute, so it cannot be stored")
            return _triton_function, (module, name)
        return NotImplemented


def store_graph(graph: Graph) -> tuple[bytes, list[str]]:
    """The graph as bytes, and the names of the parameters whose initialiser could not be
    stored (their values must then be stored in the bundle)."""
    replaced = {}
    for v in graph.params:
        if v.init is not None and not _importable(v.init):
            replaced[v.id] = v.init
            v.init = StoredParameter()
    try:
        buffer = io.BytesIO()
        try:
            _GraphPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(graph)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise BundleError(
                f"graph {graph.name!r} cannot be stored in a bundle: {exc} (ops must be instances of importable "
                "classes whose attributes are plain values, kernels or module-level functions)"
            ) from None
    finally:
        for v in graph.params:
            if v.id in replaced:
                v.init = replaced[v.id]
    return buffer.getvalue(), [v.name for v in graph.params if v.id in replaced]


_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "slice", "complex", "bytearray"}


class _GraphUnpickler(pickle.Unpickler):
    """Resolves only what a stored graph is made of, so that loading a bundle runs no code of the
    bundle's choosing: teeny's own classes (ops, the graph's parts, enums), torch dtypes and
    sizes, plain containers, kernels by registered name and Triton functions by reference. With
    ``trusted``, classes and Triton functions of other modules (a user's ``CustomOp``) resolve
    too: that is a pickle of code the loading process imports, to be used only on bundles you
    built or trust."""

    def __init__(self, file: io.BytesIO, trusted: bool):
        super().__init__(file)
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return _module_attr(module, name)
        if module == "collections" and name == "OrderedDict":
            return _module_attr(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, type(torch.Size))):
            found = getattr(torch, name)
            if isinstance(found, torch.dtype) or found is torch.Size:
                return found
        if module == __name__ and name in ("_registered_kernel", "_triton_function", "StoredParameter"):
            return globals()[name]
        own = module == "teeny" or module.startswith("teeny.")
        if own or self.trusted:
            try:
                found = _module_attr(module, name.split(".")[0])
                for part in name.split(".")[1:]:
                    found = getattr(found, part)
            except (ImportError, AttributeError) as exc:
                raise BundleError(
                    f"the stored graph needs {module}.{name}, which this process cannot import: {exc}"
                ) from None
            if isinstance(found, type) and found.__module__ == module:
                return found  # a class (an op, a part of the graph, an enum); its instances carry no code
        where = "outside teeny" if not own else "not a class"
        hint = " (load(..., trusted=True) if you built this bundle or trust it)" if not own and not self.trusted else ""
        raise BundleError(f"the stored graph refers to {module}.{name}, {where}: refused{hint}")


def load_graph(data: bytes, trusted: bool = False) -> Graph:
    """A graph from ``store_graph``'s bytes, resolving only a graph's own parts (see
    ``_GraphUnpickler``): a bundle from elsewhere cannot run code while it loads."""
    try:
        graph = _GraphUnpickler(io.BytesIO(data), trusted).load()
    except (ImportError, AttributeError) as exc:
        raise BundleError(f"the stored graph needs code this process cannot import: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise BundleError(f"the stored graph is damaged: {exc}") from None
    if not isinstance(graph, Graph):
        raise BundleError(f"graph.pkl holds a {type(graph).__name__}, not a teeny Graph")
    return graph


# ------------------------------------------------------------------------ descriptions


def describe_program(program, executor) -> dict:
    """Nodes, inputs, outputs and the parameter layout of ``program`` (as planned with ``executor``)."""
    nodes = []
    for p in program.nodes:
        node = p.node
        nodes.append(
            {
                "name": node.name,
                "op": node.op.name,
                "inputs": [v.name for v in node.inputs],
                "shape": list(node.output.shape),
                "dtype": dtype_name(node.output.dtype),
                "backward": p.needs_backward,
            }
        )
    return {
        "mode": program.mode.value,
        "inputs": [
            {"name": v.name, "shape": list(v.shape), "dtype": dtype_name(v.dtype), "requires_grad": v.requires_grad}
            for v in program.inputs
        ],
        "params": [
            {
                "name": v.name,
                "shape": list(v.shape),
                "dtype": dtype_name(v.dtype),
                "trainable": v.requires_grad,
                "offset": executor.params[v.name].storage_offset(),
            }
            for v in program.params
        ],
        "outputs": [v.name for v in program.outputs],
        "nodes": nodes,
        "kernel_instances": program.kernel_names(),
    }


def check_same_program(planned: dict, program, executor, where: str) -> None:
    """Refuse when the program lowered here differs from the one the bundle was planned for
    (the model's code changed since the build)."""
    here = describe_program(program, executor)
    for key in ("mode", "inputs", "params", "outputs"):
        if here[key] != planned[key]:
            raise BundleError(f"{where}: the program lowered here has other {key} than the bundle's plan; rebuild it")
    if len(here["nodes"]) != len(planned["nodes"]):
        raise BundleError(
            f"{where}: the program lowered here has {len(here['nodes'])} nodes, the bundle's plan "
            f"{len(planned['nodes'])}; rebuild it"
        )
    for mine, theirs in zip(here["nodes"], planned["nodes"]):
        if mine != theirs:
            raise BundleError(
                f"{where}: node '{mine['name']}' ({mine['op']}) differs from the bundle's plan "
                f"(node '{theirs['name']}', {theirs['op']}); rebuild it"
            )
