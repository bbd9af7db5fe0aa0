"""Ahead-of-time bundles: build a program for a GPU you do not have, run it there with no JIT.

    teeny build gpt --target cuda:90,cuda:80 --mode training -o gpt.teeny       # any machine, no GPU
    bundle = teeny.aot.load("gpt.teeny")                                        # on the H200
    loss = bundle.step({"x": x, "y": y})                                        # zero compilations

``build(graph_or_model, path, target=..., mode=...)`` lowers the program and compiles every
kernel instance it launches, forward and backward in training (with the optimizer, clipping and
gradient-accumulation launches of a training step), forward only in inference, for each target.
The launches are found by running the program's real code on meta tensors in a process that
emulates the target (``teeny.aot.worker``: teeny's GPU choices of tiles and grids, none of the
interpreter's), and each is specialised with Triton's own binder, so the binary compiled for a
launch is the one its just-in-time compilation on the GPU would produce, under the same cache
key. ``load(path)`` rebuilds the program, places each binary in Triton's cache under that key,
and runs teeny's ordinary launch path: outputs and training losses are those of the JIT path.
``verify(path)`` runs the loader on the CPU against an emulated GPU of each target and reports
compilations (none) and which binary each launch ran.

Bundle format, version 1: a zip archive (``.teeny``) holding

* ``manifest.json``: ``format`` ("teeny-bundle"), ``format_version`` (1), ``teeny_version``,
  ``triton_version``, ``torch_version``, ``created``, ``name``, ``mode`` (training | inference),
  ``source`` (``{"kind": "model", "model", "size", "batch_size"}`` or ``{"kind": "graph",
  "file": "graph.pkl"}``), ``config`` (the ``teeny.core.config`` switches the graph was traced with),
  ``train`` (optimizer, lr, weight_decay, momentum, clip, schedule, warmup_steps; training
  only), ``seed``, ``params`` (``"params.safetensors"`` or null), ``targets`` (per target:
  ``name`` "cuda:90", ``arch``, ``sm_count``, ``plan`` file, counts);
* ``targets/<cuda90>/plan.json``: ``program`` (inputs, parameters with their arena offsets,
  outputs, nodes with op, inputs, shape, dtype and whether they run backwards, the lowering's
  kernel instances), ``buffers`` (every storage a launch touches: bytes, label), ``runs``
  (``train_step``, ``accumulate_step``, ``forward``: each launch in order with its site, phase
  (forward, backward, accumulate, clip, optimizer), kernel, dtype, grid, launch options, binary
  and packed arguments: per parameter its Triton type, specialisation, and buffer + element
  offset or value), ``kernels`` (per binary: id, kernel, module, dtype, float64 scalars, whether
  it is a declared backward kernel, the phases that launch it, the kernel's source key, Triton's
  cache key, signature, constexprs (the tile configuration: BLOCK sizes), attributes, num_warps,
  num_stages, shared memory, files), ``warnings`` (specialised integers that change between
  runs), ``compile_seconds``;
* ``targets/<cuda90>/kernels/k<N>.cubin | .ptx | .json``: the binary, its PTX, Triton's metadata;
* ``graph.pkl``: a stored graph (kernels and Triton functions by reference), read back by an
  unpickler that resolves only teeny's own classes, torch dtypes and plain containers, so loading
  a bundle you did not build runs none of its code (``load(..., trusted=True)`` also resolves
  other modules' ops, such as your ``CustomOp``); ``params.safetensors``: the parameters, when stored.

A bundle is refused (``BundleError``) when its format version, teeny version or Triton version
differ from the loading process's, or when it holds no kernels for the GPU's compute capability.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .bundle import FORMAT, FORMAT_VERSION, Bundle, BundleError, Target, parse_targets, write_bundle

__all__ = [
    "Bundle",
    "BundleError",
    "Target",
    "build",
    "build_many",
    "count_compilations",
    "load",
    "parse_targets",
    "verify",
]

MODES = ("training", "inference")


def load(path, **kwargs):
    """Load a bundle for this GPU (see ``teeny.aot.loader.load``)."""
    from .loader import load as _load

    return _load(path, **kwargs)


def count_compilations():
    """Collect every Triton JIT compilation inside a ``with`` block (see ``loader.count_compilations``)."""
    from .loader import count_compilations as _count

    return _count()


# ------------------------------------------------------------------------------ workers


def _run_worker(request: dict) -> dict:
    """Run ``request`` in a target-emulating worker process (``teeny.aot.worker``); its result."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("TEENY_DEVICE", None)
    src_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="teeny-build-") as folder:
        req, res, log = (Path(folder) / name for name in ("request", "result", "log"))
        req.write_bytes(pickle.dumps({**request, "sys_path": list(sys.path)}))
        with open(log, "wb") as out:
            code = subprocess.call(
                [sys.executable, "-m", "teeny.aot.worker", str(req), str(res)], env=env, stdout=out, stderr=out
            )
        if code != 0 or not res.exists():
            tail = log.read_text(errors="replace")[-3000:]
            raise BundleError(f"teeny.aot {request['command']}: the worker process failed (exit {code}):\n{tail}")
        result = pickle.loads(res.read_bytes())
    if not result["ok"]:
        raise BundleError(f"teeny.aot {request['command']} failed: {result['error']}\n{result['traceback'][-3000:]}")
    return result


# ------------------------------------------------------------------------------ build


def _source(graph_or_model: Any, size: str, batch_size: int | None) -> tuple[dict, bytes | None, str, list[str]]:
    """(source, graph pickle, name, parameters whose values must be stored)."""
    if isinstance(graph_or_model, str):
        from ..training.models import NAMES

        if graph_or_model not in NAMES:
            raise BundleError(f"unknown model {graph_or_model!r}; choose from {', '.join(NAMES)} or pass a Graph")
        return (
            {"kind": "model", "model": graph_or_model, "size": size, "batch_size": batch_size},
            None,
            graph_or_model,
            [],
        )
    from ..core.graph import Graph
    from .program import store_graph

    if not isinstance(graph_or_model, Graph):
        raise BundleError(f"build: expected a teeny Graph or a model name, got {type(graph_or_model).__name__}")
    data, need_values = store_graph(graph_or_model)
    return {"kind": "graph", "name": graph_or_model.name, "file": "graph.pkl"}, data, graph_or_model.name, need_values


def _params_bytes(params: Any, graph: Any, seed: int) -> bytes | None:
    """safetensors bytes of ``params``: a dict of tensors, a teeny checkpoint, or (for a graph
    whose initialisers cannot be stored) its parameters initialised with ``seed``."""
    from safetensors.torch import save

    if params is None and graph is not None:
        from ..program.executor import Executor
        from ..program.lowering import lower

        params = Executor(lower(graph), seed=seed, device="cpu").state_dict()
    if isinstance(params, (str, os.PathLike)):
        from ..training.loop import CheckpointError, load_checkpoint

        try:
            params, _, _ = load_checkpoint(params)
        except CheckpointError as exc:
            raise BundleError(str(exc)) from None
    return save({name: t.detach().cpu().contiguous() for name, t in params.items()})


def build(
    graph_or_model: Any,
    path: str | os.PathLike | None = None,
    *,
    target: str | list = "cuda:90",
    mode: str = "training",
    batch_size: int | None = None,
    size: str = "small",
    params: Any = None,
    seed: int = 0,
    train: dict | None = None,
    config: dict[str, bool] | None = None,
) -> Path:
    """Build a bundle of ``graph_or_model`` (a ``Graph``, or a model ``teeny train`` knows:
    "mlp", "cnn", "gpt" of ``size`` at ``batch_size``, default the model's) for ``mode``
    ("training" or "inference") and every target of ``target`` ("cuda:90,cuda:80"); returns
    the bundle's path (default ``<name>-<mode>.teeny``). Needs no GPU.

    ``params``: parameters to store (a dict of tensors, a teeny checkpoint file, or "init" for
    the initial ones); without, the loader initialises them with ``seed`` as the JIT path does
    (a graph whose initialisers cannot be stored always stores them). ``train`` overrides the
    optimizer settings a training bundle compiles for (optimizer, lr, weight_decay, momentum,
    clip, ...; default the model's); ``config`` the ``teeny.core.config`` switches a model is traced
    with (default the GPU's)."""
    options = dict(target=target, mode=mode, batch_size=batch_size, size=size, params=params, seed=seed)
    return build_many([(graph_or_model, path, {**options, "train": train, "config": config})])[0]


def build_many(items: list[tuple[Any, Any, dict]]) -> list[Path]:
    """Build several bundles in one worker process: ``items`` are ``(graph_or_model, path,
    options)`` with ``build``'s keyword options. Cheaper than one ``build`` each (one process
    start, one import, and kernels two bundles share are compiled once)."""
    jobs, outs, all_targets = [], [], None
    for graph_or_model, path, options in items:
        mode = getattr(options.get("mode", "training"), "value", options.get("mode", "training"))
        if mode not in MODES:
            raise BundleError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        targets = parse_targets(options.get("target", "cuda:90"))
        if all_targets is not None and targets != all_targets:
            raise BundleError("build_many: every bundle must be built for the same targets")
        all_targets = targets
        seed = options.get("seed", 0)
        source, graph_pickle, name, need_values = _source(
            graph_or_model, options.get("size") or "small", options.get("batch_size")
        )
        graph = graph_or_model if source["kind"] == "graph" else None
        params = options.get("params")
        init_params = params == "init" and graph is None
        stored = None
        if (params is not None and not init_params) or need_values:
            stored = _params_bytes(None if params in (None, "init") else params, graph, seed)
        jobs.append(
            {
                "source": source,
                "graph_pickle": graph_pickle,
                "mode": mode,
                "train": dict(options.get("train") or {}),
                "config": dict(options.get("config") or {}),
                "seed": seed,
                "init_params": init_params,
                "stored": stored,
                "name": name,
            }
        )
        outs.append(Path(path) if path is not None else Path(f"{name}-{mode}.teeny"))
        _check_out(outs[-1], f"{name}-{mode}.teeny")  # before minutes of compiling, not after
    started = time.perf_counter()
    worker_jobs = [{k: v for k, v in job.items() if k not in ("stored", "name")} for job in jobs]
    result = _run_worker({"command": "build", "jobs": worker_jobs, "targets": [vars(t) for t in all_targets]})
    seconds = round((time.perf_counter() - started) / len(jobs), 2)
    return [
        _write(out, job, job_result, all_targets, seconds) for out, job, job_result in zip(outs, jobs, result["jobs"])
    ]


def _check_out(out: Path, default_name: str) -> None:
    """Refuse a bundle path that cannot be written: a folder, a path under a file, or a place
    where no file can be made (a read-only mount, /proc). Creates nothing."""
    if out.is_dir():
        raise BundleError(f"cannot write the bundle to {out}: it is a folder (name a file, e.g. {out / default_name})")
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise BundleError(f"cannot write the bundle to {out}: it lies under {existing}, which is a file")
    try:  # os.access says yes to root anywhere; making a file is the test that holds
        fd, probe = tempfile.mkstemp(prefix=".teeny-build-", dir=existing)
    except OSError as exc:
        raise BundleError(
            f"cannot write the bundle to {out}: no file can be made in {existing} ({exc.strerror})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _write(out: Path, job: dict, result: dict, targets: list[Target], seconds: float) -> Path:
    from .. import __version__

    files: dict[str, bytes] = dict(result["files"])
    entries = []
    for t, plan in zip(targets, result["plans"]):
        plan_name = f"targets/{t.key}/plan.json"
        files[plan_name] = _json_bytes(plan)
        entries.append(
            {
                "name": t.name,
                "arch": t.arch,
                "sm_count": t.sm_count,
                "plan": plan_name,
                "kernels": len(plan["kernels"]),
                "launches": {run: len(launches) for run, launches in plan["runs"].items()},
                "compile_seconds": plan["compile_seconds"],
            }
        )
        for message in plan["warnings"]:
            warnings.warn(f"{out}: {t.name}: {message}", stacklevel=3)
    if job["graph_pickle"] is not None:
        files["graph.pkl"] = job["graph_pickle"]
    stored = result.get("params") if job["init_params"] else job["stored"]
    if stored is not None:
        files["params.safetensors"] = stored
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "teeny_version": __version__,
        "triton_version": result["versions"]["triton"],
        "torch_version": result["versions"]["torch"],
        "python": sys.version.split()[0],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "name": job["name"],
        "mode": job["mode"],
        "source": result["source"],
        "config": result["config"],
        "train": result["train"],
        "seed": job["seed"],
        "params": "params.safetensors" if stored is not None else None,
        "targets": entries,
        "build_seconds": seconds,
    }
    try:
        return write_bundle(out, manifest, files)
    finally:  # write_bundle's temporary file, left where the write or the rename failed (a full disk)
        out.with_name(out.name + ".tmp").unlink(missing_ok=True)


def _json_bytes(obj: Any) -> bytes:
    import json

    return json.dumps(obj, indent=None, separators=(",", ":")).encode()


def verify(paths: str | os.PathLike | list) -> list[dict] | list[list[dict]]:
    """Load each bundle on an emulated GPU of each of its targets (no GPU needed) and run its
    program's passes: per target, the JIT compilations (expected: none), whether every launch
    ran the binary and grid the plan says, the binaries no launch used, and (training) the
    refusal of a launch the bundle has no binary for. One list per bundle (just the list for
    one path)."""
    single = not isinstance(paths, (list, tuple))
    items = [paths] if single else list(paths)
    for p in items:
        Bundle(p)  # refuse a damaged file here, not in the worker
    result = _run_worker({"command": "verify", "paths": [str(Path(p).resolve()) for p in items], "target": None})
    return result["bundles"][0] if single else result["bundles"]


# ------------------------------------------------------------------------------ command


def cmd_build(args) -> int:
    """``teeny build MODEL --target ... -o FILE``: MODEL is mlp, cnn, gpt or ``module:function``
    (a function of the batch size returning a Graph)."""
    model: Any = args.model
    try:
        if ":" in model:
            import importlib

            module, _, function = model.partition(":")
            model = getattr(importlib.import_module(module), function)(args.batch_size)
        path = build(
            model,
            args.out,
            target=args.target,
            mode=args.mode,
            batch_size=args.batch_size,
            size=args.size,
            params=args.params,
            seed=args.seed,
        )
    except (BundleError, ImportError, AttributeError) as exc:
        print(f"teeny build: {exc}", file=sys.stderr)
        return 2
    manifest = Bundle(path).manifest
    for t in manifest["targets"]:
        print(f"{t['name']}@{t['sm_count']}: {t['kernels']} kernels, launches {t['launches']}")
    size_kib = Path(path).stat().st_size / 1024
    print(f"wrote {path} ({size_kib:.0f} KiB, {manifest['mode']}, built in {manifest['build_seconds']} s)")
    return 0
