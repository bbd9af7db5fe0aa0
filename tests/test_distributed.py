"""Data-parallel training on the CPU: gloo, two processes on the Triton interpreter.

Two ranks with batch B/2 each take the same steps as one process with batch B (per-step losses
and final parameters: float64 to 1e-10, float32 to rounding) for SGD and AdamW, with and without
ZeRO-1, with gradient clipping, several gradient buckets, and a cross-entropy whose ignored
targets are spread unevenly over the ranks; a run killed mid-way and resumed on two ranks ends
bit for bit where an uninterrupted two-rank run ends (also through `teeny train --nproc 2`); a
rank that dies or hangs stops the other with a clear error within the timeout.

Each scenario starts its processes as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK in the environment) running this file as a script: ``python test_distributed.py
SCENARIO OUT``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
ROWS, BATCH = 48, 12  # 4 steps per epoch; 6 rows per rank
RUNS = [
    (optimizer, zero, dtype, None)
    for optimizer in ("sgd", "adamw")
    for zero in (False, True)
    for dtype in (torch.float64, torch.float32)
] + [("adamw", True, torch.float32, "fp16-mixed")]  # float16 compute, the loss scaler's counts summed over shards


def _name(optimizer: str, zero: bool, dtype: torch.dtype, precision: str | None = None) -> str:
    suffix = f"-{precision}" if precision else ""
    return f"{optimizer}{'-zero' if zero else ''}-{str(dtype).replace('torch.', '')}{suffix}"


def _task(dtype: torch.dtype, die_at: int | None = None, hang_at: int | None = None):
    """A two-layer classifier (57 parameters: an odd count leaves ZeRO-1 a one-element tail)
    with cross-entropy over targets of which a third are ignore_index. ``die_at`` / ``hang_at``:
    rank 1 (both ranks for ``die_at`` under DIE_ALL) exits / sleeps when fetching that step."""
    from teeny import Graph, Module, nn, ops
    from teeny.train import CallableTask

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


def _config(optimizer: str, zero: bool, dtype: torch.dtype, out: Path | None, **kw):
    from teeny.train import TrainConfig

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


# ----------------------------------------------------------------------------- workers


def worker(scenario: str, out: Path) -> int:
    import teeny.distributed as td
    from teeny.train import train

    world = td.init(timeout=float(os.environ.get("TIMEOUT", "60")))
    quiet = lambda *a, **k: None  # noqa: E731
    try:
        if scenario == "equivalence":
            try:
                train(_task(torch.float64), _config("sgd", False, torch.float64, None, batch_size=7), log=quiet)
                raise AssertionError("batch 7 on 2 ranks was accepted")
            except ValueError as exc:
                assert "does not divide evenly over 2 processes" in str(exc), exc
            for optimizer, zero, dtype, precision in RUNS:
                name = _name(optimizer, zero, dtype, precision)
                config = _config(optimizer, zero, dtype, out / name, precision=precision)
                result = train(_task(dtype), config, log=quiet)
                if world.rank == 0:
                    memory = result["memory_per_rank"]
                    (out / name / "memory.json").write_text(json.dumps(memory))
        elif scenario in ("killed", "resumed", "straight"):
            die_at = 4 if scenario == "killed" else None
            config = _config("adamw", True, torch.float32, out / scenario.replace("resumed", "killed"))
            config.checkpoint_every = 1
            resume = str(out / "killed" / "checkpoint.safetensors") if scenario == "resumed" else None
            train(_task(torch.float32, die_at=die_at), config, resume=resume, log=quiet)
        elif scenario == "nccl":  # world size 1 on the GPU: the step with its collectives as one CUDA graph
            import warnings

            from teeny import Executor, LoweringMode, lower
            from teeny.optim import AdamW
            from teeny.train import TrainStep

            task = _task(torch.float32)
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
            task = _task(
                torch.float64, die_at=3 if scenario == "dies" else None, hang_at=3 if scenario == "hangs" else None
            )
            try:
                train(task, _config("sgd", False, torch.float64, None), log=quiet)
            except td.DistributedError as exc:
                print(f"DistributedError: {exc}", file=sys.stderr)
                return 1
    finally:
        td.shutdown()
    return 0


# ----------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, out: Path, world: int = 2, **env) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world):
        environment = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TEENY_DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
            "NCCL_NVLS_ENABLE": "0",  # NVLink multicast stays off
            **{k: str(v) for k, v in env.items()},
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE), scenario, str(out)],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], wait: float = 300.0) -> list[tuple[int, str]]:
    results = []
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            raise AssertionError(f"a rank did not finish within {wait:.0f} s:\n{err[-3000:]}") from None
        results.append((p.returncode, err))
    return results


def _run(scenario: str, out: Path, **env) -> None:
    for rank, (code, err) in enumerate(_finish(_launch(scenario, out, **env))):
        assert code == 0, f"rank {rank} of {scenario} exited with {code}:\n{err[-3000:]}"


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and r.get("event") is None]


def _params(run: Path) -> dict[str, torch.Tensor]:
    from teeny.train import load_checkpoint

    return load_checkpoint(run / "checkpoint.safetensors")[0]


# ----------------------------------------------------------------------------- tests


def test_two_ranks_take_the_steps_of_one_process_with_the_whole_batch(tmp_path):
    from teeny.train import train

    _run("equivalence", tmp_path / "dp")
    for optimizer, zero, dtype, precision in RUNS:
        name = _name(optimizer, zero, dtype, precision)
        config = _config(optimizer, False, dtype, tmp_path / "one" / name, precision=precision)
        train(_task(dtype), config, log=lambda *a: None)
        ours, ref = _losses(tmp_path / "dp" / name), _losses(tmp_path / "one" / name)
        assert len(ours) == len(ref) == 8, name
        rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (2e-6, 1e-7)
        if precision == "fp16-mixed":  # each rank's float16 products round their half of the batch
            rtol, atol = 2e-2, 2e-3
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=rtol, atol=atol, msg=name)
        theirs = _params(tmp_path / "one" / name)
        for key, value in _params(tmp_path / "dp" / name).items():
            torch.testing.assert_close(
                value, theirs[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{name} {k}: {m}"
            )
        memory = json.loads((tmp_path / "dp" / name / "memory.json").read_text())
        if zero:  # each rank keeps half the optimizer state (plus the one-element tail)
            assert memory["optimizer_state_mib"] < 0.6 * memory["optimizer_state_unsharded_mib"], memory
        else:
            assert memory["optimizer_state_mib"] == memory["optimizer_state_unsharded_mib"], memory


def test_killed_and_resumed_on_two_ranks_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path):
    """AdamW with ZeRO-1, float32: both ranks die at step 4 (after the checkpoint of step 3),
    and the resumed run reloads the sharded optimizer state from the gathered checkpoint."""
    procs = _launch("killed", tmp_path, DIE_ALL=1)
    assert [code for code, _ in _finish(procs)] == [137, 137]
    from teeny.train import load_checkpoint

    assert load_checkpoint(tmp_path / "killed" / "checkpoint.safetensors")[2]["step"] == "3"
    _run("resumed", tmp_path)
    _run("straight", tmp_path)
    straight, resumed = _params(tmp_path / "straight"), _params(tmp_path / "killed")
    assert set(straight) == set(resumed)
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")


def test_a_rank_that_dies_stops_the_other_with_a_clear_error(tmp_path):
    start = time.monotonic()
    (code0, err0), (code1, _) = _finish(_launch("dies", tmp_path, TIMEOUT=60), wait=120)
    assert code1 == 137 and code0 == 1, err0
    assert "rank 0:" in err0 and "another process stopped" in err0, err0
    assert time.monotonic() - start < 60  # the broken connection is seen at once, not after the timeout


def test_a_rank_that_hangs_stops_the_other_within_the_timeout(tmp_path):
    procs = _launch("hangs", tmp_path, TIMEOUT=8)
    start = time.monotonic()
    try:
        code0, err0 = _finish(procs[:1], wait=120)[0]
        waited = time.monotonic() - start
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert code0 == 1 and "did not answer within 8 s" in err0, err0
    assert waited < 100, waited


def test_teeny_train_nproc_2_resumes_exactly(tmp_path):
    """The command as a user runs it: `teeny train mlp --nproc 2` (torchrun under the hood);
    stopped after 3 steps and resumed to 6, it ends with the parameters of a straight 6-step run."""

    def teeny(*args):
        env = {**os.environ, "TEENY_DEVICE": "cpu"}
        command = [sys.executable, "-m", "teeny", "train", "mlp", "--nproc", "2", "--epochs", "1", "--no-progress"]
        result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    printed = teeny("--steps", "6", "--out", str(tmp_path / "straight"))
    assert printed.count("teeny train mlp on 2 processes") == 1  # rank 0 alone prints
    teeny("--steps", "3", "--out", str(tmp_path / "split"))
    teeny("--steps", "6", "--resume", str(tmp_path / "split" / "checkpoint.safetensors"))
    straight, resumed = _params(tmp_path / "straight"), _params(tmp_path / "split")
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


def test_nccl_world_of_one_inside_a_captured_step(tmp_path):
    """On a GPU: one NCCL process; the data-parallel step, collectives included, is captured as
    one CUDA graph and gives the plain step's losses."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (NCCL)")
    out = tmp_path / "nccl"
    out.mkdir()
    for rank, (code, err) in enumerate(_finish(_launch("nccl", out, world=1, TEENY_DEVICE="cuda"))):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    report = json.loads((out / "nccl.json").read_text())
    assert report["plain"]["captured"] and report["parallel"]["captured"], report
    torch.testing.assert_close(
        torch.tensor(report["parallel"]["losses"]), torch.tensor(report["plain"]["losses"]), rtol=1e-6, atol=1e-7
    )


if __name__ == "__main__":
    import teeny.distributed as td

    code = worker(sys.argv[1], Path(sys.argv[2]))
    td.exit_after_failure(code)  # as `teeny train` does after a peer died or hung
    sys.exit(code)
