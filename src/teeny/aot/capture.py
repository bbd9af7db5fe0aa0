"""Every launch a program makes, specialised and compiled for a target.

Runs in a process that emulates the target (``teeny.aot.worker``): teeny has chosen the GPU
path (compiled kernels, GPU tile sizes, SM-count grids), but no GPU is there. The program is
executed on **meta** tensors with the launches intercepted (``kernel.intercept_launches``):
the executor, the ops, the optimizer, clipping and gradient accumulation run their real code,
so every launch passes through ``runtime.fire`` with its packed arguments, and nothing
runs. A training program runs

* ``train_step``: one ``TrainStep`` (zero_grad, forward_train, backward, clip, optimizer),
* ``accumulate_step``: forward_train and backward again without zero_grad (gradients added
  into the arena: the accumulation launches), and
* ``forward``: a plain forward (evaluation);

an inference program runs ``forward`` only.

Each launch is specialised with Triton's own binder for the target's backend, from the very
arguments the launch passes: meta tensors carry their storage offsets (a parameter view into
the arena is 16-byte aligned only where its offset is), fresh buffers are assumed 16-byte
aligned as torch's allocations are, integers specialise on ``== 1`` and ``% 16``, float64
kernels run their float64 copy. The cache key computed here is the one ``JITFunction.run``
computes for the same launch on the GPU, which is how the loader finds the binary.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core import device as _device  # noqa: F401  (first: chooses interpreter or GPU before triton loads)

# isort: split
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITCallable

from ..core.compiling import Specialised, Specialiser, compile_all
from ..core.kernel import REGISTRY, KernelInstance, dtype_name, intercept_launches, settle
from ..program.executor import Executor
from ..program.lowering import LoweringMode, Program
from .bundle import Target

KEPT_FILES = ("json", "cubin", "ptx")  # Triton's metadata, the binary, and its PTX (for reading)


@dataclass
class Captured:
    """One intercepted launch: in which run and where, what would run, on what."""

    run: str
    where: str
    instance: KernelInstance
    jit: Any
    grid: tuple[int, ...]
    args: list
    options: dict


def launch_site() -> str:
    """The ``where`` of the ``runtime.fire`` call on the stack ("op linear (node 'fc1', forward)",
    "optimizer AdamW", ...): every launch passes through it."""
    from ..core.runtime import fire

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is fire.__code__:
            return str(frame.f_locals["checked"].where)
        frame = frame.f_back
    return "?"


def phase_of(where: str) -> str:
    """forward | backward | accumulate | clip | optimizer: what a launch site is part of."""
    if where.endswith(", backward)"):
        return "backward"
    if where.startswith("gradient accumulation"):
        return "accumulate"
    if where.startswith("clip_grad_norm"):
        return "clip"
    if where.startswith("optimizer"):
        return "optimizer"
    return "forward"


def run_program(program: Program, train: dict | None, seed: int = 0):
    """Run ``program`` on meta tensors, intercepting every launch: ``(captured, executor,
    optimizer, feed)``. ``train`` holds the optimizer settings of a training program."""
    executor = Executor(program, seed=seed, device="meta")
    feed = {v.name: torch.empty(v.shape, dtype=v.dtype, device="meta") for v in program.inputs}
    captured: list[Captured] = []
    current = ["forward"]

    def intercept(instance, jit, grid, args, options):
        captured.append(Captured(current[0], launch_site(), instance, jit, grid, args, options))

    optimizer = None
    with intercept_launches(intercept):
        if program.mode is LoweringMode.TRAINING:
            from ..training.loop import TrainConfig, TrainStep, make_optimizer

            settings = {k: train[k] for k in ("optimizer", "lr", "weight_decay", "momentum") if k in train}
            optimizer = make_optimizer(executor, TrainConfig(**settings))
            current[0] = "train_step"
            TrainStep(executor, optimizer, train.get("clip"))(feed)
            current[0] = "accumulate_step"
            _, cache = executor.forward_train(feed)
            executor.backward(cache)
            current[0] = "forward"
        executor.forward(feed)
    return captured, executor, optimizer, feed


# ------------------------------------------------------------------------ specialising


class Compiler(Specialiser):
    """Specialises launches and compiles them for one target, as ``JITFunction.run`` would."""

    def __init__(self, target: Target):
        super().__init__(GPUTarget(target.backend, target.arch, target.warp_size))

    def compile_ahead(self, specs: list[Specialised]) -> int:
        """Compile ``specs`` at once in worker processes (``compiling.compile_all``), so that
        ``compile`` finds each in Triton's cache; returns how many were handed out."""
        return compile_all([self.job(spec) for spec in specs])

    def compile(self, jit, spec: Specialised) -> tuple[dict, dict[str, bytes]]:
        """``(entry, files)``: what the loader needs to know of the binary, and its files by extension."""
        compiled = triton.compile(spec.source, target=self.target, options=spec.options)
        files = {}
        for name, path in compiled.metadata_group.items():
            ext = name.rsplit(".", 1)[-1]
            if ext in KEPT_FILES:
                files[ext] = Path(path).read_bytes()
        names = jit.arg_names
        meta = compiled.metadata
        entry = {
            "key": spec.key,
            "signature": {k: _jsonable(v) for k, v in spec.signature.items()},
            "constexprs": {names[path[0]]: _jsonable(v) for path, v in spec.constexprs.items()},
            "attrs": {names[path[0]]: _jsonable(v) for path, v in spec.attrs.items()},
            "name": meta.name,
            "hash": meta.hash,
            "num_warps": meta.num_warps,
            "num_stages": meta.num_stages,
            "shared": meta.shared,
        }
        return entry, files


def _jsonable(value: Any) -> Any:
    """A JSON form of a specialisation or argument value (for reading the plan)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, JITCallable):
        return f"jit:{value.fn.__module__}.{value.fn.__qualname__}"
    if hasattr(value, "value") and type(value).__name__ == "constexpr":
        return _jsonable(value.value)
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return str(value)


# ------------------------------------------------------------------------------ the plan


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _buffer_labels(executor, optimizer, feed) -> dict[int, str]:
    labels = {}
    for dtype, arena in executor.param_arenas.items():
        labels[_storage(arena)] = f"parameters {dtype_name(dtype)}"
    for dtype, arena in executor.grad_arenas.items():
        labels[_storage(arena)] = f"gradients {dtype_name(dtype)}"
    if optimizer is not None:
        labels[_storage(optimizer.hyper)] = "optimizer hyperparameters"
        for name, arenas in optimizer.state.items():
            for dtype, t in arenas.items():
                labels[_storage(t)] = f"optimizer {name} {dtype_name(dtype)}"
    for name, t in feed.items():
        labels[_storage(t)] = f"input {name}"
    return labels


def varying_specialisations(runs: dict[str, list]) -> list[str]:
    """Launch sites whose specialised integer arguments take other values in another run (a
    host-side counter, a seed): a later run may ask for a specialisation (``== 1``, ``% 16``)
    the bundle does not hold. A node's launches are matched across runs by site, kernel and
    occurrence."""
    seen: dict[tuple, list] = {}
    for launches in runs.values():
        count: dict[tuple, int] = {}
        for launch in launches:
            if "(node '" not in launch["where"]:
                continue  # gradient accumulation and optimizer sites are not one launch per run
            site = (launch["where"], launch["kernel"])
            count[site] = count.get(site, 0) + 1
            seen.setdefault((*site, count[site]), []).append(launch)
    warnings = []
    for (where, kernel, _), launches in seen.items():
        for i, arg in enumerate(launches[0]["args"]):
            args = [launch["args"][i] for launch in launches]
            values = {a.get("value") for a in args if type(a.get("value")) is int}
            if len(values) > 1 and any(a["spec"] is not None for a in args):
                warnings.append(
                    f"{where}: kernel {kernel} argument '{arg['name']}' takes the values {sorted(values)} in "
                    "different runs and Triton specialises it (== 1, % 16): a later run may need a binary the "
                    "bundle does not hold (declare it do_not_specialize in the kernel's @triton.jit)"
                )
    return sorted(set(warnings))


def backward_kernel_names() -> set[str]:
    """Names of the kernels some forward kernel declares as its backward."""
    from .. import ops  # noqa: F401  (registers every op family)

    return {b.name for k in REGISTRY.values() for b in k.backward}


def plan_target(target: Target, program: Program, train: dict | None, seed: int = 0) -> tuple[dict, dict[str, bytes]]:
    """The plan of ``program`` for ``target`` and its compiled kernels (archive name -> bytes)."""
    from .program import describe_program

    captured, executor, optimizer, feed = run_program(program, train, seed)
    compiler = Compiler(target)
    labels = _buffer_labels(executor, optimizer, feed)
    buffers: dict[int, dict] = {}
    binaries: dict[tuple[int, str], dict] = {}
    files: dict[str, bytes] = {}
    runs: dict[str, list] = {}
    backward_names = backward_kernel_names()
    folder = f"targets/{target.key}"
    started = time.perf_counter()
    specs = []
    for c in captured:
        kernel = c.instance.kernel
        triton_args = kernel.arguments(*c.args) if kernel.arguments is not None else c.args
        specs.append(compiler.specialise(c.jit, triton_args, c.options))
    compiler.compile_ahead(list({(id(c.jit), spec.key): spec for c, spec in zip(captured, specs)}.values()))
    for c, spec in zip(captured, specs):
        kernel = c.instance.kernel
        entry = binaries.get((id(c.jit), spec.key))
        if entry is None:
            entry, kernel_files = compiler.compile(c.jit, spec)
            wide = next((sorted(n) for n, j in kernel._float64_variants.items() if j is c.jit), [])
            kid = f"k{len(binaries)}"
            entry = {
                "id": kid,
                "kernel": kernel.name,
                "module": kernel.python_fn.__module__,
                "dtype": dtype_name(c.instance.dtype),
                "float64_scalars": wide,
                "fn_key": settle(c.jit),
                "options": c.options,
                "backward": kernel.name in backward_names,
                "phases": [],
                **entry,
                "files": {},
            }
            for ext, data in kernel_files.items():
                name = f"{folder}/kernels/{kid}.{ext}"
                files[name] = data
                entry["files"][ext] = name
            binaries[(id(c.jit), spec.key)] = entry
        phase = phase_of(c.where)
        if phase not in entry["phases"]:
            entry["phases"].append(phase)
        args = []
        # (a kernel with ``arguments=`` is specialised on Triton's arguments, not on the packed ones)
        kinds = spec.specialization if kernel.arguments is None else [(None, None)] * len(c.args)
        for param, value, (kind, attr) in zip(kernel.params, c.args, kinds):
            arg: dict[str, Any] = {"name": param.name, "type": _jsonable(kind), "spec": _jsonable(attr)}
            if isinstance(value, torch.Tensor):
                sid = _storage(value)
                if sid not in buffers:
                    buffers[sid] = {
                        "id": len(buffers),
                        "bytes": value.untyped_storage().nbytes(),
                        "label": labels.get(sid, "scratch"),
                    }
                arg.update(buffer=buffers[sid]["id"], offset=value.storage_offset(), dtype=dtype_name(value.dtype))
                arg["shape"] = list(value.shape)
            else:
                arg["value"] = _jsonable(value)
            args.append(arg)
        runs.setdefault(c.run, []).append(
            {
                "where": c.where,
                "phase": phase,
                "kernel": kernel.name,
                "dtype": dtype_name(c.instance.dtype),
                "grid": list(c.grid),
                "options": c.options,
                "binary": entry["id"],
                "args": args,
            }
        )
    plan = {
        "warnings": varying_specialisations(runs),
        "target": target.name,
        "arch": target.arch,
        "sm_count": target.sm_count,
        "program": describe_program(program, executor),
        "buffers": sorted(buffers.values(), key=lambda b: b["id"]),
        "runs": runs,
        "kernels": sorted(binaries.values(), key=lambda e: int(e["id"][1:])),
        "compile_seconds": round(time.perf_counter() - started, 2),
    }
    return plan, files
