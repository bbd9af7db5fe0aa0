"""Data-parallel training on the CPU: gloo, two processes on the Triton interpreter.

Two ranks with batch B/2 each take the same steps as one process with batch B (per-step losses
and final parameters: float64 to 1e-10, float32 to rounding) for SGD and AdamW, with and without
ZeRO-1, with gradient clipping, several gradient buckets, and a cross-entropy whose ignored
targets are spread unevenly over the ranks; a run killed mid-way and resumed on two ranks ends
bit for bit where an uninterrupted two-rank run ends (also through `teeny train --nproc 2`); a
rank that dies or hangs stops the other with a clear error within the timeout.

Each scenario starts its processes as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK in the environment) running ``tests/scripts/distributed_worker.py SCENARIO OUT``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import load_script, script

pytestmark = pytest.mark.slow  # every test starts processes

ranks = load_script("distributed_worker")  # what each rank runs; the test trains the same in one process


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
                [sys.executable, str(script("distributed_worker")), scenario, str(out)],
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
    from teeny.training.loop import load_checkpoint

    return load_checkpoint(run / "checkpoint.safetensors")[0]


# ----------------------------------------------------------------------------- tests


def test_two_ranks_take_the_steps_of_one_process_with_the_whole_batch(tmp_path):
    from teeny.training.loop import train

    _run("equivalence", tmp_path / "dp")
    for optimizer, zero, dtype, precision in ranks.RUNS:
        name = ranks.run_name(optimizer, zero, dtype, precision)
        config = ranks.train_config(optimizer, False, dtype, tmp_path / "one" / name, precision=precision)
        train(ranks.make_task(dtype), config, log=lambda *a: None)
        ours, ref = _losses(tmp_path / "dp" / name), _losses(tmp_path / "one" / name)
        assert len(ours) == len(ref) == 4, name  # 2 epochs of 2 steps
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
    """AdamW with ZeRO-1, float32: both ranks die at step 4 of 4 (after the checkpoint of step 3,
    in the middle of the second epoch), and the resumed run reloads the sharded optimizer state
    from the gathered checkpoint. The same processes run the uninterrupted run first, then die."""
    procs = _launch("straight,killed", tmp_path, DIE_ALL=1)
    assert [code for code, _ in _finish(procs)] == [137, 137]
    from teeny.training.loop import load_checkpoint

    assert load_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")[2]["step"] == "4"
    assert load_checkpoint(tmp_path / "killed" / "checkpoint.safetensors")[2]["step"] == "3"
    _run("resumed", tmp_path)
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
