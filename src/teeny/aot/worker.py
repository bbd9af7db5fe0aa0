"""``python -m teeny.aot.worker REQUEST RESULT``: one build step for one GPU target, in a
process that emulates that target.

teeny decides at import whether it runs on a GPU (compiled kernels, GPU tile sizes, grids of
a few programs per SM) or under the Triton interpreter (other tile sizes, no compiled kernel),
and the program a build compiles must be the GPU's. So the build runs here: before teeny is
imported, ``emulate_cuda`` makes torch report one CUDA device of the target (capability and SM
count), with no GPU behind it; every tensor of the build lives on the meta device, and Triton
compiles for the named target. ``verify`` additionally replaces Triton's driver by one that
loads nothing and records each launch, so the loader's whole path (kernels installed in
Triton's caches, the JIT's own specialisation and lookup, the launch) runs on a CPU.

The request and the result are pickled dicts (see ``teeny.aot.build`` / ``teeny.aot.verify``).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
import types

# opt-in shared memory per block by arch (what Triton checks a binary against at load)
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


_EMULATED: dict = {}  # the target teeny sees now: arch, sm_count, device index


def emulate_cuda(arch: int, sm_count: int) -> None:
    """Make torch, and so ``teeny.core.device``, see a CUDA device of compute capability ``arch``
    with ``sm_count`` SMs. Must run before teeny is imported; no CUDA call reaches a driver.
    ``use_target`` switches to another target later in the same process."""
    if "teeny.core.device" in sys.modules:
        raise RuntimeError("emulate_cuda must run before teeny chooses its device")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TEENY_DEVICE"] = "cuda"
    import torch

    _EMULATED.update(arch=arch, sm_count=sm_count, device=0)

    def properties(device=None):
        arch = _EMULATED["arch"]
        return types.SimpleNamespace(
            name=f"teeny build target sm_{arch}",
            major=arch // 10,
            minor=arch % 10,
            multi_processor_count=_EMULATED["sm_count"],
            total_memory=80 * 2**30,
            warp_size=32,
        )

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: _EMULATED["device"] + 1
    torch.cuda.current_device = lambda: _EMULATED["device"]
    torch.cuda.get_device_properties = properties
    torch.cuda.get_device_capability = lambda device=None: (_EMULATED["arch"] // 10, _EMULATED["arch"] % 10)
    torch.cuda.get_device_name = lambda device=None: properties().name
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.synchronize = lambda device=None: None


def use_target(arch: int, sm_count: int, device: int = 0) -> None:
    """Emulate another target from now on: what teeny computed from the device and kept
    (``functools.cache`` of its modules, e.g. the SM count) is forgotten."""
    _EMULATED.update(arch=arch, sm_count=sm_count, device=device)
    for name, module in list(sys.modules.items()):
        if name.startswith("teeny.") and module is not None:
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", "") == name:
                    value.cache_clear()


class RecordingDriver:
    """A Triton driver for an emulated GPU: binaries are 'loaded' as their names and each
    launch is recorded as ``(binary hash, grid)`` instead of run."""

    def __init__(self, arch: int, device: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = device
        self.launches: list[tuple[str, tuple[int, int, int]]] = []
        shared = MAX_SHARED.get(arch, 101376)
        self.utils = types.SimpleNamespace(
            get_device_properties=lambda device: {"max_shared_mem": shared, "multiprocessor_count": 1},
            load_binary=lambda name, binary, shared_bytes, device: (None, name, 0, 0, 1024),
        )
        driver = self

        class Launcher:
            def __init__(self, src, metadata):
                self.hash = metadata.hash

            def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
                driver.launches.append((self.hash, (grid_x, grid_y, grid_z)))

        self.launcher_cls = Launcher

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0


# ------------------------------------------------------------------------------ commands


def build_job(job: dict, targets: list) -> dict:
    """One bundle's contents: its program's plan and kernels for each target (and its initial
    parameters when asked)."""
    import torch
    import triton

    from ..program.executor import Executor
    from ..program.lowering import LoweringMode, lower
    from .capture import plan_target
    from .program import current_config, make_graph, train_settings

    mode = LoweringMode(job["mode"])
    config = {**current_config(), **job["config"]}  # the GPU's defaults, then the job's
    # the graph the building process stored a moment ago: its own code, trusted
    graph, task, source = make_graph(job["source"], job["mode"], config, job.get("graph_pickle"), trusted=True)
    train = train_settings(task, job.get("train") or {}) if mode is LoweringMode.TRAINING else None
    result = {
        "plans": [],
        "files": {},
        "config": config,
        "source": source,
        "train": train,
        "versions": {"triton": triton.__version__, "torch": torch.__version__},
    }
    for target in targets:
        use_target(target.arch, target.sm_count)
        program = lower(graph, mode)  # lowered per target: its dry run sees the target's grids
        plan, files = plan_target(target, program, train, job.get("seed", 0))
        result["plans"].append(plan)
        result["files"].update(files)
    if job.get("init_params"):
        from safetensors.torch import save

        params = Executor(program, seed=job.get("seed", 0), device="cpu").state_dict()
        result["params"] = save({k: v.contiguous() for k, v in params.items()})
    return result


def build(request: dict) -> dict:
    """Every job of the request for every target."""
    from .bundle import Target

    targets = [Target(**t) for t in request["targets"]]
    return {"jobs": [build_job(job, targets) for job in request["jobs"]]}


def verify_target(path: str, entry: dict, device: int) -> dict:
    """Load the bundle as on a GPU of ``entry``'s target (through a recording driver) and run its
    program's passes: the JIT compilations, and whether each launch ran the planned binary."""
    import torch
    from triton.runtime import driver as triton_driver

    from ..core.errors import TeenyError
    from ..program.accumulate import accumulate
    from . import loader

    use_target(entry["arch"], entry["sm_count"], device)
    recording = RecordingDriver(entry["arch"], device)
    triton_driver.set_active(recording)
    result: dict = {}
    with loader.count_compilations() as compiled:
        bundle = loader.load(path, device="meta")
        plan = bundle.plan
        feed = {v.name: torch.empty(v.shape, dtype=v.dtype, device="meta") for v in bundle.program.inputs}
        ran: dict[str, list] = {}
        for run in plan["runs"]:
            start = len(recording.launches)
            if run == "train_step":
                bundle.step(feed)
            elif run == "accumulate_step":
                with bundle.strict():
                    _, cache = bundle.executor.forward_train(feed)
                    bundle.executor.backward(cache)
            else:
                bundle.forward(feed)
            ran[run] = [h for h, _ in recording.launches[start:]]
    by_id = {k["id"]: k for k in plan["kernels"]}
    result["target"] = bundle.target
    result["compilations"] = [c["kernel"] for c in compiled]
    result["launches"] = len(recording.launches)
    result["runs_match"] = {
        run: ran.get(run) == [by_id[launch["binary"]]["hash"] for launch in launches]
        for run, launches in plan["runs"].items()
    }
    planned_grids = [(*launch["grid"], 1, 1)[:3] for run in plan["runs"].values() for launch in run]
    result["grids_match"] = planned_grids == [grid for _, grid in recording.launches]
    used = {h for h, _ in recording.launches}
    result["unused_binaries"] = [k["id"] for k in plan["kernels"] if k["hash"] not in used]
    if bundle.executor.training:  # a launch the bundle has no binary for: refused, not compiled
        a = torch.empty(1025, device="meta", dtype=torch.float32)
        try:
            with bundle.strict():
                accumulate(a[1:], a[1:], a[1:])  # 4-byte offset: another specialisation
            result["strict_refusal"] = None
        except TeenyError as exc:
            result["strict_refusal"] = str(exc)
    return result


def verify(request: dict) -> dict:
    """Every target of every bundle of the request, each on its own emulated device."""
    from .bundle import Bundle

    results, device = [], 0
    for path in request["paths"]:
        rows = []
        for entry in Bundle(path).manifest["targets"]:
            rows.append(verify_target(path, entry, device))
            device += 1
        results.append(rows)
    return {"bundles": results}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path, "rb") as f:
        request = pickle.load(f)
    for entry in reversed(request.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    emulate_cuda(90, 132)  # the first target switches it (use_target)
    try:
        result = {"ok": True, **(build(request) if request["command"] == "build" else verify(request))}
    except Exception as exc:  # reported by the caller, with the traceback
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(result_path, "wb") as f:
        pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
