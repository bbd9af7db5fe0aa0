"""``load(FILE)``: a bundle's program on the GPU, its kernels taken from the bundle.

The loader rebuilds the bundle's program the way the build did (same source, same switches),
checks that it lowers to the planned nodes, and hands each compiled kernel to Triton: every
binary is placed in the cache of the ``JITFunction`` that launches it, under the cache key the
build computed for that launch (Triton's own key: specialisation and options). The program
then runs through teeny's ordinary launch path, and each launch finds its binary where a
just-in-time compilation would have left it, so nothing is compiled. Inside the bundle's own
calls (``forward``, ``step``, ``strict()``) a compilation is an error naming the kernel and the
launch, not a silent JIT; ``count_compilations()`` counts them anywhere.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..core import device as _device  # noqa: F401  (first: chooses interpreter or GPU before triton loads)

# isort: split
import triton
from triton.compiler import ASTSource, CompiledKernel
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime import driver as triton_driver

from .. import __version__
from ..core.device import DEVICE
from ..core.kernel import REGISTRY, Kernel, settle
from ..program.executor import Executor
from ..program.lowering import LoweringMode, lower
from .bundle import Bundle, BundleError, check_versions, select_target
from .capture import launch_site
from .program import check_same_program, make_graph

# ---------------------------------------------------------------------- compile counting

_COUNTERS: list[list[dict]] = []
_STRICT: list[str] = []  # bundles whose calls are running: a compilation there is refused


def _on_compile(jit: Any, key: Any) -> None:
    """Called before a ``JITFunction`` compiles (a cache miss): count it, or refuse it inside a
    bundle's calls. (Triton's ``jit_cache_hook`` would do, but it serialises the constexprs to
    JSON first, which fails for the @triton.jit maths functions teeny passes as constexprs.)"""
    record = {"kernel": jit.fn.__name__, "module": jit.fn.__module__, "key": str(key), "where": launch_site()}
    for counter in _COUNTERS:
        counter.append(record)
    if _STRICT:
        raise BundleError(
            f"bundle {_STRICT[-1]} holds no binary for this launch of {record['kernel']} (specialisation "
            f"{record['key']}), so Triton would compile it: the program differs from the bundle's plan. Rebuild "
            "the bundle for this GPU, or launch outside the bundle's calls to let Triton compile"
        )


def _install_hook() -> None:
    from triton.runtime.jit import JITFunction

    original = JITFunction._do_compile
    if getattr(original, "_teeny", False):
        return

    def _do_compile(self, key, *args, **kwargs):
        _on_compile(self, key)
        return original(self, key, *args, **kwargs)

    _do_compile._teeny = True
    JITFunction._do_compile = _do_compile


@contextlib.contextmanager
def count_compilations() -> Iterator[list[dict]]:
    """A list that collects every Triton JIT compilation inside the block (kernel, cache key,
    launch site): a cache miss of any ``JITFunction``."""
    _install_hook()
    records: list[dict] = []
    _COUNTERS.append(records)
    try:
        yield records
    finally:
        _COUNTERS.remove(records)


# ------------------------------------------------------------------------------ loading


def _kernels_by_name(plan: dict, program) -> dict[str, Kernel]:
    """The kernels the plan names: registered ones (their modules imported), and those of the
    program's own instances (custom ops' kernels built from source)."""
    for module in sorted({entry["module"] for entry in plan["kernels"]}):
        if module and module.startswith("teeny."):
            importlib.import_module(module)
    kernels = dict(REGISTRY)
    kernels.update({inst.kernel.name: inst.kernel for inst in program.instances.values()})
    return kernels


def install_kernels(bundle: Bundle, plan: dict, program, where: str) -> list[CompiledKernel]:
    """Place every binary of ``plan`` in the cache of the JITFunction that launches it."""
    kernels = _kernels_by_name(plan, program)
    device = triton_driver.active.get_current_device()
    installed = []
    with tempfile.TemporaryDirectory(prefix="teeny-bundle-") as folder:
        for entry in plan["kernels"]:
            kernel = kernels.get(entry["kernel"])
            if kernel is None:
                raise BundleError(f"{where}: kernel {entry['kernel']} ({entry['module']}) is not defined in this teeny")
            names = frozenset(entry["float64_scalars"])
            jit = kernel.jit_with_float64(names) if names else kernel.jit
            if settle(jit) != entry["fn_key"]:
                raise BundleError(
                    f"{where}: kernel {entry['kernel']} ({entry['module']}) differs from the source the bundle was "
                    "compiled from; rebuild it"
                )
            group = {}
            for ext, name in entry["files"].items():
                path = Path(folder) / f"{entry['id']}.{ext}"
                path.write_bytes(bundle.read(name))
                group[path.name] = str(path)
            signature = dict(entry["signature"])
            constexprs = {name: entry["constexprs"].get(name) for name, ty in signature.items() if ty == "constexpr"}
            source = (GluonASTSource if jit.is_gluon() else ASTSource)(jit, signature, constexprs)
            compiled = CompiledKernel(source, group, entry["hash"])
            cache, _, cache_target, _, _ = jit.device_caches[device]
            if cache_target.arch != plan["arch"]:
                raise BundleError(f"{where}: Triton targets sm_{cache_target.arch} here, the plan sm_{plan['arch']}")
            installed.append(cache.setdefault(entry["key"], compiled))
    return installed


def prepare_launchers(compiled: list[CompiledKernel], threads: int | None = None) -> None:
    """Build each binary's host launcher now, in parallel: a small C module Triton compiles with
    the system's C compiler (and caches) the first time a kernel of that signature launches,
    which the JIT path does one kernel at a time. Only host work (no CUDA call); a launcher that
    fails here is built at its launch as usual."""
    launcher_cls = triton_driver.active.launcher_cls

    def build(kernel: CompiledKernel) -> None:
        try:
            launcher_cls(kernel.src, kernel.metadata)
        except Exception:  # the launch builds it again and reports a real failure
            pass

    with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(build, compiled))


class LoadedBundle:
    """A bundle's program, ready on the GPU: ``forward(inputs)``, and for training bundles
    ``step(feed)`` (one training step, as ``teeny.training.loop.TrainStep``) with ``optimizer``.

    ``executor`` is the program's ``Executor``; ``task`` the built-in model's task (data)
    when the bundle was built from one; ``plan`` the target's plan; ``kernels`` its binaries.
    """

    def __init__(self, bundle: Bundle, target: str, plan: dict, program, executor, task, optimizer, train_step):
        self.bundle, self.target, self.plan = bundle, target, plan
        self.manifest = bundle.manifest
        self.program, self.executor, self.task = program, executor, task
        self.optimizer, self._train_step = optimizer, train_step

    @property
    def kernels(self) -> list[dict]:
        return self.plan["kernels"]

    @contextlib.contextmanager
    def strict(self) -> Iterator[None]:
        """Inside the block a JIT compilation is an error (``BundleError``, raised at the launch)."""
        _install_hook()
        _STRICT.append(str(self.bundle.path))
        try:
            yield
        finally:
            _STRICT.pop()

    def forward(self, inputs: Any = None, **kwargs: torch.Tensor):
        """Run the program forwards (no compilation allowed)."""
        with self.strict():
            return self.executor.forward(inputs, **kwargs)

    def step(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        """One training step: zero_grad, forward_train, backward, clip, optimizer update; returns
        the loss as a device tensor. Set ``optimizer.lr`` for a schedule."""
        if self._train_step is None:
            raise BundleError(f"bundle {self.bundle.path} was built for inference: it holds no backward kernel")
        with self.strict():
            return self._train_step(feed)

    def __repr__(self) -> str:
        m = self.manifest
        return f"<LoadedBundle {m['name']} {m['mode']} {self.target}: {len(self.kernels)} kernels>"


def load(
    path: str | Path,
    *,
    params: dict[str, torch.Tensor] | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    cuda_graph: bool | None = None,
    prepare: bool = True,
    trusted: bool = False,
) -> LoadedBundle:
    """Load the bundle ``path`` for this process's GPU and return its program, ready to run
    with zero JIT compilations. Refused (``BundleError``) when the bundle holds no kernels for
    this GPU's compute capability, or was built by another teeny or Triton. Parameters come
    from ``params``, else the bundle, else the initialisers with ``seed`` (default: the build's).
    ``cuda_graph`` captures training steps as CUDA graphs (default: on the GPU); ``prepare``
    builds Triton's host launchers of all kernels up front, in parallel (``prepare_launchers``).
    A stored graph resolves only teeny's own classes, so a bundle from elsewhere runs no code of
    its own while it loads; ``trusted=True`` also resolves other modules' ops (your ``CustomOp``)."""
    bundle = Bundle(path)
    where = f"bundle {bundle.path}"
    manifest = bundle.manifest
    check_versions(manifest, __version__, triton.__version__, where)
    device = DEVICE if device is None else torch.device(device)
    if device.type not in ("cuda", "meta"):
        raise BundleError(f"{where}: loading needs the GPU of the bundle's target; teeny runs on {device} here")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    entry, warning = select_target(
        manifest, major * 10 + minor, torch.cuda.get_device_properties(index).multi_processor_count, where
    )
    if warning:
        warnings.warn(warning, stacklevel=2)
    plan = bundle.plan(entry["name"])
    mode = manifest["mode"]
    graph_pickle = bundle.read(manifest["source"]["file"]) if manifest["source"]["kind"] == "graph" else None
    graph, task, _ = make_graph(manifest["source"], mode, manifest["config"], graph_pickle, trusted)
    program = lower(graph, LoweringMode(mode))
    if params is None and manifest.get("params"):
        from safetensors.torch import load as load_safetensors

        params = load_safetensors(bundle.read(manifest["params"]))
    executor = Executor(program, seed=manifest.get("seed", 0) if seed is None else seed, device=device)
    if params is not None:
        try:
            executor.load_params(params)
        except (KeyError, ValueError) as exc:
            raise BundleError(f"{where}: the parameters do not fit the program: {exc}") from None
    check_same_program(plan["program"], program, executor, where)
    compiled = install_kernels(bundle, plan, program, where)
    if prepare:
        prepare_launchers(compiled)
    optimizer = train_step = None
    if program.mode is LoweringMode.TRAINING:
        from ..training.loop import TrainConfig, TrainStep, make_optimizer

        train = manifest["train"]
        settings = {k: train[k] for k in ("optimizer", "lr", "weight_decay", "momentum") if k in train}
        optimizer = make_optimizer(executor, TrainConfig(**settings))
        use_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        train_step = TrainStep(executor, optimizer, train.get("clip"), cuda_graph=use_graph)
    return LoadedBundle(bundle, entry["name"], plan, program, executor, task, optimizer, train_step)
