"""Ahead-of-time bundles on the GPU: zero compilations, the JIT path's results, and cold start.

    PYTHONPATH=src python3 bench/aot.py [--bundles DIR] [--steps 30]     # on the GPU machine
    PYTHONPATH=src python3 bench/aot.py --build-only DIR                  # anywhere (no GPU)

1. Builds the bundles (no GPU used: ``teeny.aot.build_many`` compiles in worker processes that
   emulate the target) for this GPU's target (cuda:90@132 on an H200; ``--target`` to choose):
   the char GPT (small) for training (also for cuda:80: the loader must pick) and for inference,
   the MLP for training. ``--bundles DIR`` takes bundles built elsewhere instead (``--build-only
   DIR`` on the CPU machine, then carry DIR).
2. Runs each case in a fresh process with its own empty Triton cache and times process start ->
   first training step done (synchronised), then trains ``--steps`` steps (the model's lr
   schedule, CUDA graphs as ``teeny train``), counting Triton JIT compilations throughout:
   mlp-jit, mlp-bundle, gpt-jit (the JIT path), gpt-bundle (the loader, launchers built up front
   in parallel), gpt-jit-warm and gpt-bundle-warm (the same, with the Triton cache the cold runs
   left), gpt-bundle-serial (launchers built at each first launch, as the JIT path does).
   The GPT runs also compare inference logits (JIT executor against the inference bundle).
3. Checks: the bundle runs compile nothing; their first step launches exactly the plan's
   train_step (kernels and grids); MLP losses and GPT logits are bit-identical to the JIT path's;
   GPT losses are compared with the JIT path's and with the JIT path's own run-to-run spread (its
   embedding backward adds with atomics, so two JIT runs may differ in the last bits).

Case names ``aot <case> cold start`` (ms from process start to the first step done, the
compilations in the note), appended to bench/results/<gpu>.csv unless ``--no-save``. Results go to
stdout and, when ``$OUT`` is set, to ``$OUT/bench_aot.json``. Takes about 2 minutes,
at most 3 (a 150 s budget from the start: cases that would start after it are skipped and
reported, a running one is stopped 20 s after it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 150
BUNDLES = {  # name: (model, mode, also for sm_80)
    "gpt-training": ("gpt", "training", True),
    "gpt-inference": ("gpt", "inference", False),
    "mlp-training": ("mlp", "training", False),
}


def this_gpu() -> str:
    """``cuda:ARCH@SMS`` of this machine's GPU (a MIG slice has fewer SMs), else ``cuda:90``."""
    code = (
        "import torch; p = torch.cuda.get_device_properties(0); "
        "print(f'cuda:{p.major}{p.minor}@{p.multi_processor_count}')"
    )
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except subprocess.TimeoutExpired:
        return ""


def build_bundles(folder: Path, target: str) -> dict:
    """The bundles of BUNDLES in ``folder`` for ``target`` (two worker processes in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    from teeny import aot

    folder.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list] = {}
    for name, (model, mode, with_80) in BUNDLES.items():
        targets = f"{target},cuda:80" if with_80 and not target.startswith("cuda:80") else target
        groups.setdefault(targets, []).append((model, folder / f"{name}.teeny", {"target": targets, "mode": mode}))
    started = time.perf_counter()
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(aot.build_many, groups.values()))
    return {"build_seconds": round(time.perf_counter() - started, 1), "targets": sorted(groups)}


# ------------------------------------------------------------------------------ a case


def child(spec: dict) -> None:
    """One case in this fresh process: writes its results to ``spec["result"]``."""
    t0 = spec["t0"]  # the parent's clock just before it started this process
    marks = {"python_started": time.time() - t0}
    import torch

    import teeny

    teeny.core.device  # noqa: B018  (the device first: it decides interpreter or GPU before triton loads)
    from teeny import aot
    from teeny.core.kernel import record_launches
    from teeny.training.optim import constant_schedule, cosine_schedule

    marks["imported"] = time.time() - t0
    model, bundles = spec["model"], Path(spec["bundles"])
    out: dict = {"case": spec["case"], "device": teeny.core.device.describe()}
    with aot.count_compilations() as compiled:
        if spec["path"] == "jit":
            from teeny.program.executor import Executor
            from teeny.program.lowering import LoweringMode, lower
            from teeny.training.loop import TrainConfig, TrainStep, make_optimizer
            from teeny.training.models import make_task

            task = make_task(model)
            train = aot.Bundle(bundles / f"{model}-training.teeny").manifest["train"]  # the same settings
            batch = task.defaults["batch_size"]
            executor = Executor(lower(task.train_graph(batch), LoweringMode.TRAINING), seed=0)
            optimizer = make_optimizer(
                executor, TrainConfig(**{k: train[k] for k in ("optimizer", "lr", "weight_decay", "momentum")})
            )
            step = TrainStep(executor, optimizer, train["clip"], cuda_graph=teeny.DEVICE.type == "cuda")
        else:
            bundle = aot.load(bundles / f"{model}-training.teeny", prepare=spec["prepare"])
            out["target"] = bundle.target
            task, optimizer, step, train = bundle.task, bundle.optimizer, bundle.step, bundle.manifest["train"]
            batch = bundle.manifest["source"]["batch_size"]
        marks["ready"] = time.time() - t0
        steps = spec["steps"]
        total = task.steps_per_epoch(batch) * task.defaults.get("epochs", 1)
        schedule = (
            cosine_schedule(total, train["warmup_steps"]) if train["schedule"] == "cosine" else constant_schedule()
        )
        feeds, epoch = [], 0
        while len(feeds) < steps:  # the first steps of a run: epoch 0, then 1, ...
            feeds.extend(feed for _, feed in zip(range(steps - len(feeds)), task.batches(epoch, batch, 0)))
            epoch += 1
        losses = []
        with record_launches() as first_launches:
            optimizer.lr = train["lr"] * schedule(0)
            losses.append(float(step(feeds[0])))  # reading the loss synchronises
        marks["first_step_done"] = time.time() - t0
        for i, feed in enumerate(feeds[1:], start=1):
            optimizer.lr = train["lr"] * schedule(i)
            losses.append(float(step(feed)))  # now: a replayed step returns the same tensor each time
        marks["steps_done"] = time.time() - t0
        out["compilations_training"] = len(compiled)
        if model == "gpt":  # the model's logits from its initial parameters: JIT executor vs inference bundle
            x = feeds[0]["x"]
            if spec["path"] == "jit":
                program = lower(task._graph(batch, False), LoweringMode.INFERENCE)
                logits = Executor(program, seed=0).forward({"x": x})
            else:
                logits = aot.load(bundles / "gpt-inference.teeny", prepare=spec["prepare"]).forward({"x": x})
            torch.save(logits.cpu(), spec["result"] + ".logits.pt")  # .cpu() synchronises
    out["marks"] = {k: round(v, 3) for k, v in marks.items()}
    out["losses"] = losses
    out["compilations"] = len(compiled)
    out["compiled_kernels"] = sorted({c["kernel"] for c in compiled})
    out["first_step_launches"] = [[r.kernel, list(r.grid)] for r in first_launches]
    Path(spec["result"]).write_text(json.dumps(out))


def run_case(case: str, spec: dict, folder: Path, deadline: float) -> dict:
    """Run one case in a fresh process (its own Triton cache folder ``spec['cache']``)."""
    if time.perf_counter() > deadline:
        return {"case": case, "skipped": "time budget spent"}
    result = folder / f"{case}.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(folder / spec.pop("cache")))
    spec = {**spec, "case": case, "result": str(result), "t0": time.time()}
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=max(10.0, deadline + 20 - time.perf_counter()),
        )
    except subprocess.TimeoutExpired as exc:
        return {"case": case, "error": f"timed out after {exc.timeout:.0f} s"}
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not result.exists():
        return {"case": case, "error": (proc.stderr or proc.stdout)[-2500:], "wall_s": round(wall, 1)}
    out = json.loads(result.read_text())
    out["wall_s"] = round(wall, 1)
    warnings = [line for line in proc.stderr.splitlines() if "Warning" in line]
    if warnings:
        out["warnings"] = warnings[-5:]
    return out


def compare(results: dict, bundles: Path, folder: Path) -> dict:
    import torch

    from teeny import aot

    checks: dict = {}

    def losses(case):
        return results.get(case, {}).get("losses")

    for case, r in results.items():
        if "bundle" in case and "compilations" in r:
            checks[f"{case}: compilations"] = r["compilations"]
    plan = aot.Bundle(bundles / "gpt-training.teeny").plan("cuda:90")
    planned = [[launch["kernel"], launch["grid"]] for launch in plan["runs"]["train_step"]]
    for case in ("gpt-bundle", "gpt-jit"):
        if "first_step_launches" in results.get(case, {}):
            checks[f"{case}: first step launches == plan train_step"] = results[case]["first_step_launches"] == planned
    for model in ("mlp", "gpt"):
        jit, bundle = losses(f"{model}-jit"), losses(f"{model}-bundle")
        if jit and bundle:
            checks[f"{model}: bundle losses == jit losses (bitwise)"] = jit == bundle
            checks[f"{model}: max |bundle - jit| loss"] = max(abs(a - b) for a, b in zip(jit, bundle))
    jit_warm = losses("gpt-jit-warm")
    if losses("gpt-jit") and jit_warm:
        checks["gpt: jit losses == jit-warm losses (run-to-run)"] = losses("gpt-jit") == jit_warm
        checks["gpt: max |jit - jit-warm| loss"] = max(abs(a - b) for a, b in zip(losses("gpt-jit"), jit_warm))
    logits = {c: folder / f"{c}.json.logits.pt" for c in ("gpt-jit", "gpt-bundle")}
    if all(p.exists() for p in logits.values()):
        a, b = (torch.load(p) for p in logits.values())
        checks["gpt: inference logits bundle == jit (bitwise)"] = bool(torch.equal(a, b))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/<gpu>.csv")
    parser.add_argument("--bundles", type=Path, help="use the bundles in this folder instead of building them")
    parser.add_argument("--build-only", type=Path, metavar="DIR", help="build the bundles into DIR and stop")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--target", help="build for this target (default: this machine's GPU, e.g. cuda:90@132)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.build_only:
        print(json.dumps(build_bundles(args.build_only, args.target or "cuda:90")))
        return
    from teeny import aot

    deadline = time.perf_counter() + BUDGET_S
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-aot-") as tmp:
        folder = Path(tmp)
        bundles = args.bundles
        if bundles is None:
            bundles = folder / "bundles"
            report.update(build_bundles(bundles, args.target or this_gpu() or "cuda:90"))
            print(f"built the bundles for {report['targets']} in {report['build_seconds']} s", flush=True)
        report["bundles"] = {
            name: {t["name"]: t["kernels"] for t in aot.Bundle(bundles / f"{name}.teeny").manifest["targets"]}
            for name in BUNDLES
        }
        common = {"bundles": str(bundles), "steps": args.steps, "prepare": True}
        cases = {  # the essential comparisons first: a case that would start after the budget is skipped
            "mlp-jit": {"model": "mlp", "path": "jit", "cache": "cache-mlp-jit"},
            "mlp-bundle": {"model": "mlp", "path": "bundle", "cache": "cache-mlp-bundle"},
            "gpt-jit": {"model": "gpt", "path": "jit", "cache": "cache-jit"},
            "gpt-bundle": {"model": "gpt", "path": "bundle", "cache": "cache-bundle"},
            "gpt-jit-warm": {"model": "gpt", "path": "jit", "cache": "cache-jit"},
            "gpt-bundle-warm": {"model": "gpt", "path": "bundle", "cache": "cache-bundle"},
            "gpt-bundle-serial": {"model": "gpt", "path": "bundle", "cache": "cache-serial", "prepare": False},
        }
        results = {}
        for case, spec in cases.items():
            results[case] = run_case(case, {**common, **spec}, folder, deadline)
            r = results[case]
            marks = r.get("marks", {})
            print(
                f"{case:18} first step done {marks.get('first_step_done', '-'):>7} s after process start "
                f"(imported {marks.get('imported', '-')}, ready {marks.get('ready', '-')}), "
                f"compilations {r.get('compilations', '-')}, wall {r.get('wall_s', '-')} s"
                + (f"  ERROR {r['error'][-300:]}" if "error" in r else "")
                + (f"  SKIPPED ({r['skipped']})" if "skipped" in r else ""),
                flush=True,
            )
        report["cases"] = results
        report["checks"] = compare(results, bundles, folder)
    for name, value in report["checks"].items():
        print(f"  {name}: {value}")
    cold = {c: results[c].get("marks", {}).get("first_step_done") for c in results}
    report["cold_start_s"] = cold
    print("cold start (process start -> first step done, s):", json.dumps(cold))
    if not args.no_save:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from harness import append_results, make_row

        rows = [
            make_row(
                "aot",
                f"aot {case} cold start",
                "teeny",
                None if s is None else s * 1e3,
                note=f"compilations {results[case].get('compilations', '-')}",
            )  # fmt: skip
            for case, s in cold.items()
        ]
        print("results:", append_results(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_aot.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
