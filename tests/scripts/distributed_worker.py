"""The ranks of test_distributed.py: each process runs one scenario as torchrun would start it
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK in the environment), writing what the
test reads under OUT. The test imports ``make_task`` and ``train_config`` from here to train the
same model in one process.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 TEENY_DEVICE=cpu \
        python tests/scripts/distributed_worker.py equivalence /tmp/dp

SCENARIO: equivalence, killed, resumed, straight, nccl, dies, hangs (DIE_ALL, TIMEOUT in the
environment shape the failures); several, comma-separated (straight,killed), run one after the
other in the same processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROWS, BATCH = 24, 12  # 2 steps per epoch, 4 in the 2 epochs; 6 rows per rank
RUNS = [
    (optimizer, zero, dtype, None)
    for optimizer in ("sgd", "adamw")
    for zero in (False, True)
    for dtype in (torch.float64, torch.float32)
] + [("adamw", True, torch.float32, "fp16-mixed")]  # float16 compute, the loss scaler's counts summed over shards


def run_name(optimizer: str, zero: bool, dtype: torch.dtype, precision: str | None = None) -> str:
    suffix = f"-{precision}" if precision else ""
    return f"{optimizer}{'-zero' if zero else ''}-{str(dtype).replace('torch.', '')}{suffix}"


def make_task(dtype: torch.dtype, die_at: int | None = None, hang_at: int | None = None):
    """A two-layer classifier (57 parameters: an odd count leaves ZeRO-1 a one-element tail)
    with cross-entropy over targets of which a third are ignore_index. ``die_at`` / ``hang_at``:
    rank 1 (both ranks for ``die_at`` under DIE_ALL) exits / sleeps when fetching that step."""
    from teeny import Graph, Module, nn, ops
    from teeny.training.loop import CallableTask

    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(ROWS, 5, generator=gen, dtype=torch.float64).to(dtype)
    ys = torch.randint(3, (ROWS,), generator=gen)
    ys[torch.randperm(ROWS, generator=gen)[: ROWS // 3]] = -100

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(5, 6, dtype=dtype)
            self.fc2 = nn.Linear(6, 3, dtype=dtype)

        def forward(self, x):
            return self.fc2(ops.gelu(self.fc1(x)))

    def build(batch):
        g = Graph("dp")
        x, y = g.input("x", (batch, 5), dtype), g.input("y", (batch,), torch.int64)
        g.output(ops.cross_entropy(Net()(x), y))
        return g

    def batches(epoch, batch, seed):
        order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for i in range(ROWS // batch):
            step = epoch * (ROWS // batch) + i + 1
            rank = int(os.environ.get("RANK", "0"))
            if step == die_at and (rank == 1 or os.environ.get("DIE_ALL")):
                os._exit(137)  # killed: no cleanup, no last checkpoint
            if step == hang_at and rank == 1:
                time.sleep(600)
            rows = order[i * batch : (i + 1) * batch]
            yield {"x": xs[rows], "y": ys[rows]}

    def count(feed):
        return int((feed["y"] != -100).sum())

    return CallableTask("dp", build, batches, lambda batch: ROWS // batch, loss_count=count)


def train_config(optimizer: str, zero: bool, dtype: torch.dtype, out: Path | None, **kw):
    from teeny.training.loop import TrainConfig

    settings = dict(
        epochs=2,
        batch_size=BATCH,
        lr=0.05 if optimizer == "sgd" else 0.02,
        optimizer=optimizer,
        weight_decay=0.01,
        clip=0.5 if optimizer == "adamw" else None,  # ZeRO-1's norm is summed across the ranks' shards
        schedule="cosine",
        dtype=dtype,
        zero=zero,
        bucket_mb=100 * 8 / 2**20,  # 100 float64 elements: buckets that cut parameters in two
        progress=False,
        out=str(out) if out else None,
        log_every=1,
    )
    settings.update(kw)
    return TrainConfig(**settings)


def worker(scenarios: str, out: Path) -> int:
    import teeny.training.distributed as td

    world = td.init(timeout=float(os.environ.get("TIMEOUT", "60")))
    try:
        for scenario in scenarios.split(","):
            code = run(scenario, out, world)
            if code:
                return code
    finally:
        td.shutdown()
    return 0


def run(scenario: str, out: Path, world) -> int:
    """One scenario on the initialised process group ``world``: 0, or 1 for a clear DistributedError."""
    import teeny.training.distributed as td
    from teeny.training.loop import train

    quiet = lambda *a, **k: None  # noqa: E731
    if scenario == "equivalence":
        try:
            config = train_config("sgd", False, torch.float64, None, batch_size=7)
            train(make_task(torch.float64), config, log=quiet)
            raise AssertionError("batch 7 on 2 ranks was accepted")
        except ValueError as exc:
            assert "does not divide evenly over 2 processes" in str(exc), exc
        for optimizer, zero, dtype, precision in RUNS:
            name = run_name(optimizer, zero, dtype, precision)
            config = train_config(optimizer, zero, dtype, out / name, precision=precision)
            result = train(make_task(dtype), config, log=quiet)
            if world.rank == 0:
                memory = result["memory_per_rank"]
                (out / name / "memory.json").write_text(json.dumps(memory))
    elif scenario in ("killed", "resumed", "straight"):
        die_at = 4 if scenario == "killed" else None
        config = train_config("adamw", True, torch.float32, out / scenario.replace("resumed", "killed"))
        config.checkpoint_every = 1
        resume = str(out / "killed" / "checkpoint.safetensors") if scenario == "resumed" else None
        train(make_task(torch.float32, die_at=die_at), config, resume=resume, log=quiet)
    elif scenario == "nccl":  # world size 1 on the GPU: the step with its collectives as one CUDA graph
        import warnings

        from teeny import Executor, LoweringMode, lower
        from teeny.training.loop import TrainStep
        from teeny.training.optim import AdamW

        task = make_task(torch.float32)
        feeds = list(task.batches(0, BATCH, 0))
        report = {}
        for kind in ("plain", "parallel"):
            ex = Executor(lower(task.build(BATCH), LoweringMode.TRAINING), seed=0)
            opt = AdamW(ex, lr=0.02)
            parallel = td.DataParallel(world, ex, opt, bucket_mb=100 * 4 / 2**20) if kind == "parallel" else None
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="CUDA graph capture failed")  # fail, not fall back
                step = TrainStep(ex, opt, clip=0.5, cuda_graph=True, parallel=parallel)
                losses = [float(step(feeds[i % len(feeds)], 10)) for i in range(6)]
            report[kind] = {"losses": losses, "captured": step.graph is not None}
        (out / "nccl.json").write_text(json.dumps(report))
    elif scenario in ("dies", "hangs"):
        task = make_task(
            torch.float64, die_at=3 if scenario == "dies" else None, hang_at=3 if scenario == "hangs" else None
        )
        try:
            train(task, train_config("sgd", False, torch.float64, None), log=quiet)
        except td.DistributedError as exc:
            print(f"DistributedError: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    import teeny.training.distributed as td

    td.end_process(worker(sys.argv[1], Path(sys.argv[2])))  # as `teeny train` ends its workers
