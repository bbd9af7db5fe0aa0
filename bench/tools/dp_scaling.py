"""Data-parallel scaling of GPT-2 small on several GPUs of one machine (issue 15): teeny's
``DataParallel`` against PyTorch DDP on the same model, in the same invocation.

    PYTHONPATH=src python3 bench/tools/dp_scaling.py --gpus 2                       # every run below
    PYTHONPATH=src python3 bench/tools/dp_scaling.py --runs teeny:1,teeny:2         # a subset (fits 10 minutes)
    PYTHONPATH=src python3 bench/tools/dp_scaling.py --runs torch:1,torch:2,teeny-zero:2

Runs (each in a fresh ``torchrun --standalone``; NVLink multicast stays off):
  teeny:N       GPT-2 small (12 layers, d 768, 12 heads, context 1024, vocab 50304, untied head with
                bias), bf16-mixed (float32 parameters and AdamW state, bfloat16 compute; ``--precision
                none --dtype D`` trains plain ``D`` parameters instead),
                AdamW, clip 1.0, per-GPU batch ``--batch``, the step captured as a CUDA graph with its
                NCCL collectives, 25 MiB gradient buckets;
  teeny-zero:N  the same with ZeRO-1 (optimizer state sharded);
  torch:N       the same model in PyTorch (eager, ``F.scaled_dot_product_attention``), DDP with 25 MiB
                buckets and ``gradient_as_bucket_view``, fused AdamW, clip 1.0.
Default runs: teeny, teeny-zero and torch at 1 GPU and at every power of two up to ``--gpus``.

Each run reports tokens/s over all GPUs (the mean step over ``--steps`` after 5 warm-up steps,
CUDA events on rank 0), the step time, peak memory per rank (``max_memory_allocated``), and, at
N > 1, a ``torch.profiler`` trace of 3 steps on rank 0: the NCCL kernel time and the share of it
that overlaps compute kernels on another stream (the overlap of all-reduce with backward). The
table adds scaling (tokens/s at N over N x tokens/s at 1; goal >= 95% at 2 GPUs, >= 93% at 4
and 8). Rows go to stdout as JSON and to $OUT/dp_scaling.jsonl, traces to $OUT/trace-*.json.

Expected time on H200s: a teeny run 2-4 minutes the first time (Triton compiles ~40 kernels;
later runs hit the cache), a torch run about 1 minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

VOCAB, CONTEXT, D_MODEL, HEADS, LAYERS = 50304, 1024, 768, 12, 12
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ----------------------------------------------------------------------------- measuring


def _overlap(trace_path: str) -> dict:
    """NCCL kernel time in a chrome trace and how much of it overlaps other (compute) kernels."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
    merged: list[list[float]] = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in nccl)
    covered = 0.0
    for a, b in nccl:
        for c, d in merged:
            if d <= a:
                continue
            if c >= b:
                break
            covered += min(b, d) - max(a, c)
    return {
        "kernels_traced": len(kernels),
        "nccl_kernels": len(nccl),
        "nccl_us": total,
        "overlapped_pct": 100 * covered / total if total else None,
    }


def _time_steps(step, steps: int) -> float:
    """Mean ms per call of ``step()`` over ``steps`` calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _profile(step, name: str, rank: int, world: int) -> dict | None:
    if world == 1 or rank != 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    out = os.environ.get("OUT", "/tmp")
    path = os.path.join(out, f"trace-{name}-{world}.json")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return {"trace": path, **_overlap(path)}


# ----------------------------------------------------------------------------- workers


def _tokens(batch: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    feeds = []
    for _ in range(2):
        x = torch.randint(VOCAB, (batch, CONTEXT + 1), generator=gen)
        feeds.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return feeds


def teeny_worker(args) -> dict:
    import teeny.training.distributed as td

    world = td.init(timeout=600)  # before any kernel: binds the process to its GPU
    from teeny import Executor, Graph, LoweringMode, lower, ops
    from teeny.training.loop import TrainStep
    from teeny.training.models import GPT
    from teeny.training.optim import AdamW

    mixed = args.precision != "none"
    dtype = torch.float32 if mixed else getattr(torch, args.dtype)
    model = GPT(VOCAB, CONTEXT, D_MODEL, HEADS, LAYERS).to(dtype)
    g = Graph("gpt2")
    idx, y = g.input("x", (args.batch, CONTEXT), torch.int64), g.input("y", (args.batch, CONTEXT), torch.int64)
    logits = model(idx)
    rows = args.batch * CONTEXT
    g.output(ops.cross_entropy(ops.reshape(logits, (rows, VOCAB)), ops.reshape(y, (rows,))))
    ex = Executor(lower(g, LoweringMode.TRAINING, precision=args.precision if mixed else None), seed=0)
    opt = AdamW(ex, lr=1e-4, weight_decay=0.1)
    parallel = td.DataParallel(world, ex, opt, zero=args.zero, bucket_mb=25)
    step = TrainStep(ex, opt, clip=1.0, cuda_graph=True, parallel=parallel)
    feeds = [{"x": x, "y": t} for x, t in _tokens(args.batch, world.rank)]
    calls = [0]

    def one():
        step(feeds[calls[0] % 2])
        calls[0] += 1

    for _ in range(5):  # eager, capture, replays
        one()
    ms = _time_steps(one, args.steps)
    captured = bool(step.cuda_graph and step.graph is not None)
    trace = _profile(one, "teeny-zero" if args.zero else "teeny", world.rank, world.size)
    result = {
        "captured": captured,
        "memory": parallel.memory(),
        "buckets": len(parallel.buckets),
        "loss": float(step.static_loss if captured else 0.0),
    }
    td.shutdown()
    return {"ms": ms, "trace": trace, **result}


class TorchGPT(torch.nn.Module):
    """teeny.training.models.GPT in PyTorch: the same layers, q/k/v as three products, untied head with bias."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(LAYERS):
            block = nn.Module()
            block.ln1, block.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            block.q, block.k, block.v, block.o = (nn.Linear(D_MODEL, D_MODEL) for _ in range(4))
            block.fc, block.proj = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)
            self.blocks.append(block)
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx, targets):
        import torch.nn.functional as F

        b, t = idx.shape
        x = self.tok(idx) + self.pos
        for blk in self.blocks:
            h = blk.ln1(x)

            def heads(z):
                return z.view(b, t, HEADS, D_MODEL // HEADS).transpose(1, 2)

            a = F.scaled_dot_product_attention(heads(blk.q(h)), heads(blk.k(h)), heads(blk.v(h)), is_causal=True)
            x = x + blk.o(a.transpose(1, 2).reshape(b, t, D_MODEL))
            x = x + blk.proj(F.gelu(blk.fc(blk.ln2(x)), approximate="tanh"))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def torch_worker(args) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mixed = args.precision != "none"
    model = TorchGPT().to(device=device, dtype=torch.float32 if mixed else getattr(torch, args.dtype))
    ddp = DistributedDataParallel(model, device_ids=[local], bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    feeds = [(x.to(device), t.to(device)) for x, t in _tokens(args.batch, rank)]
    calls = [0]

    def one():
        x, t = feeds[calls[0] % 2]
        calls[0] += 1
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
            loss = ddp(x, t)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()

    for _ in range(5):
        one()
    ms = _time_steps(one, args.steps)
    trace = _profile(one, "torch", rank, world)
    dist.destroy_process_group()
    return {"ms": ms, "trace": trace, "captured": False}


def worker(args) -> int:
    torch.cuda.reset_peak_memory_stats()
    result = teeny_worker(args) if args.worker == "teeny" else torch_worker(args)
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) == 0:
        result.update(
            tokens_per_s=world * args.batch * CONTEXT / (result["ms"] / 1000),
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
        )
        print("RESULT " + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------- driver


def _run(kind: str, world: int, args) -> dict:
    impl = "torch" if kind == "torch" else "teeny"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        os.path.abspath(__file__),
        "--worker",
        impl,
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--dtype={args.dtype}",
        f"--precision={args.precision}",
    ]
    if kind == "teeny-zero":
        command.append("--zero")
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    row = {"run": kind, "gpus": world, "seconds": round(time.perf_counter() - started, 1)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    row.update(json.loads(lines[-1][len("RESULT ") :]))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--runs", help="comma-separated KIND:GPUS (KIND: teeny, teeny-zero, torch)")
    parser.add_argument("--batch", type=int, default=8, help="per-GPU batch (sequences of 1024 tokens)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="with --precision none")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "none"])
    parser.add_argument("--timeout", type=int, default=540, help="seconds per run")
    parser.add_argument("--worker", choices=["teeny", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.runs:
        runs = [(k, int(n)) for k, n in (item.split(":") for item in args.runs.split(","))]
    else:
        sizes = [1] + [2**i for i in range(1, int(math.log2(max(args.gpus, 1))) + 1)]
        kinds = ("teeny", "teeny-zero", "torch")
        runs = [(kind, n) for kind in kinds for n in sizes if not (kind == "teeny-zero" and n == 1)]
    if max(n for _, n in runs) > torch.cuda.device_count():
        print(f"asked for {max(n for _, n in runs)} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    rows = []
    out = os.environ.get("OUT")
    for kind, n in runs:
        row = _run(kind, n, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(os.path.join(out, "dp_scaling.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    single = {r["run"]: r for r in rows if r["gpus"] == 1 and "error" not in r}
    print()
    print("| run | GPUs | tokens/s | step ms | scaling | peak GiB/rank | state MiB/rank | NCCL overlapped | graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['run']} | {r['gpus']} | failed: see the JSON row | | | | | | |")
            continue
        base = single.get(r["run"]) or (single.get("teeny") if r["run"] == "teeny-zero" else None)
        scaling = f"{100 * r['tokens_per_s'] / (r['gpus'] * base['tokens_per_s']):.1f}%" if base else "–"
        trace = r.get("trace") or {}
        overlap = trace.get("overlapped_pct")
        state = (r.get("memory") or {}).get("optimizer_state_mib")
        print(
            f"| {r['run']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['ms']:.2f} | {scaling} "
            f"| {r['peak_memory_gib']:.2f} | {'–' if state is None else f'{state:.0f}'} "
            f"| {'–' if overlap is None else f'{overlap:.0f}%'} | {'yes' if r.get('captured') else 'no'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
