"""The data-parallel step at world size 1 on one GPU: NCCL inside a captured CUDA graph, and its
overhead over the plain step (issue 14; goal <= 3%).

    PYTHONPATH=src python3 bench/tools/dist_overhead.py [--steps 50] [--repeats 5] [--only MLP]

Starts a one-process NCCL group itself (or joins the one torchrun made), then for each model
builds two identical executors (same seed, same batches): one trained by the plain
``TrainStep``, one by ``TrainStep(parallel=DataParallel(...))``, both captured as CUDA graphs.
It checks that both captured (the collectives included), that their losses agree, and times
the steps (CUDA events; the median over repeats of the mean step over ``--steps``, the two
interleaved so that clock drift hits both). Prints a table and writes dist_overhead.json to
$OUT if set. Takes about 2 minutes on an H200 (mostly compiling the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import warnings

import torch


def _one_process_group() -> None:
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(name, value)  # NVLink multicast stays off (device README)


def _milliseconds(fn) -> float:
    """Wall time of ``fn`` in ms: CUDA events on the GPU, the host clock on the CPU."""
    if not torch.cuda.is_available():
        import time

        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _cases():
    """(name, build(dtype) -> (graph, batches), optimizer kwargs, clip)."""
    from teeny import Graph, ops
    from teeny.training.models import MLP

    def mlp(batch=128):
        def build():
            model = MLP(784, 256, 10)
            g = Graph("mlp")
            x, y = g.input("x", (batch, 784)), g.input("y", (batch,), torch.int64)
            g.output(ops.cross_entropy(model(x), y))
            gen = torch.Generator().manual_seed(0)
            feeds = [{"x": torch.randn(batch, 784, generator=gen), "y": torch.randint(10, (batch,), generator=gen)}]
            return g, feeds

        return build

    def gpt(size):
        def build():
            from teeny.training.models import make_task

            task = make_task("gpt", size)
            batch = task.defaults["batch_size"]
            g = task.train_graph(batch)
            feeds = [feed for _, feed in zip(range(4), task.batches(0, batch, 0))]
            return g, feeds

        return build

    return [
        ("MLP 784-256-10 batch 128 fp32, SGD", mlp(), "sgd", None),
        ("char GPT 4L d256 ctx128 batch 64 fp32, AdamW, clip 1", gpt("large"), "adamw", 1.0),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", help="run the cases whose name contains this (e.g. MLP)")
    args = parser.parse_args()
    _one_process_group()
    import teeny.training.distributed as td

    world = td.init(timeout=120)  # before any kernel: binds this process to its GPU
    from teeny import Executor, LoweringMode, lower
    from teeny.training.loop import TrainStep
    from teeny.training.optim import SGD, AdamW

    on_gpu = world.device.type == "cuda"  # on the CPU (gloo) the script only checks that it runs
    results = []
    for name, build, optimizer, clip in _cases():
        if args.only and args.only not in name:
            continue
        steps, losses = {}, {}
        for kind in ("plain", "data-parallel"):
            graph, feeds = build()
            ex = Executor(lower(graph, LoweringMode.TRAINING), seed=0)
            opt = SGD(ex, lr=1e-3, momentum=0.9) if optimizer == "sgd" else AdamW(ex, lr=1e-4)
            parallel = td.DataParallel(world, ex, opt) if kind == "data-parallel" else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = TrainStep(ex, opt, clip=clip, cuda_graph=on_gpu, parallel=parallel)
                losses[kind] = [float(step(feeds[i % len(feeds)])) for i in range(6)]  # eager, capture, replays
            captured = step.cuda_graph and step.graph is not None
            steps[kind] = (step, feeds, captured, [str(w.message) for w in caught])
        timings: dict[str, list[float]] = {"plain": [], "data-parallel": []}
        for _ in range(args.repeats):
            for kind in ("plain", "data-parallel"):
                step, feeds, _, _ = steps[kind]
                timings[kind].append(_milliseconds(lambda: [step(feeds[i % len(feeds)]) for i in range(args.steps)]))
                timings[kind][-1] /= args.steps
        plain, parallel_ms = statistics.median(timings["plain"]), statistics.median(timings["data-parallel"])
        drift = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["data-parallel"], losses["plain"]))
        row = {
            "case": name,
            "plain_ms": plain,
            "data_parallel_ms": parallel_ms,
            "overhead_pct": 100 * (parallel_ms / plain - 1),
            "plain_captured": steps["plain"][2],
            "data_parallel_captured": steps["data-parallel"][2],
            "capture_warnings": steps["data-parallel"][3],
            "max_rel_loss_difference": drift,
            "timings_ms": timings,
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("| case | plain step | data-parallel step (NCCL, world 1) | overhead | both captured | loss agreement |")
    print("|---|---|---|---|---|---|")
    for r in results:
        both = r["plain_captured"] and r["data_parallel_captured"]
        print(
            f"| {r['case']} | {r['plain_ms']:.3f} ms | {r['data_parallel_ms']:.3f} ms | {r['overhead_pct']:+.1f}% "
            f"| {'yes' if both else 'NO'} | {r['max_rel_loss_difference']:.1e} |"
        )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "dist_overhead.json"), "w") as f:
            json.dump(results, f, indent=1)
    td.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
