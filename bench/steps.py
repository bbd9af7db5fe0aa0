"""Whole training steps, teeny against PyTorch (eager and torch.compile modes), in one run.

The same model is built twice, in teeny (``teeny.training.models``) and in torch.nn with the same layers,
shapes, dtype and optimizer; a step is zero_grad + forward + backward + optimizer update. teeny's
step is ``teeny.training.loop.TrainStep`` captured as a CUDA graph. Prints step ms two ways (alone:
the median of steps each timed between a synchronisation; queued: steps issued back to back, as
a training loop runs them), tokens (samples) per second queued and peak memory per step; with
``--profile`` also teeny's time per kernel name from one eager step (torch.profiler) and where its
captured step idles between kernels (``kernel_gaps``), with
``--launches`` its time per launch (which node, kernel, grid and tile constexprs), with
``--host`` where the host time of its queued step goes.

    PYTHONPATH=src python3 bench/steps.py --models gpt6,mlp --modes eager,default,reduce-overhead
    PYTHONPATH=src python3 bench/steps.py --models gpt2 --precision bf16-mixed --no-rewrites-row

Case names are ``step <model>`` (``step <model> bf16-mixed``), the models of ``CASES``; each
row (implementation, ms alone; queued ms, tokens/s and peak MiB in its note) is appended to
bench/results/<gpu>.csv (bench/harness.py) unless ``--no-save``.

``--precision bf16-mixed`` keeps the models' parameters float32 (teeny: ``lower(...,
precision="bf16-mixed")``; torch: ``torch.autocast`` to bfloat16 around the forward and loss).
Each teeny row prints its program's launch count, memory plan and graph rewrites; the
"teeny, no rewrites" row (``lower(..., rewrites=())``) measures what the rewrites buy, the
"teeny, recompute" row (``--recompute``: ``lower(..., recompute=True)``) what recomputing the
norms' and activations' outputs in the backward costs and saves. ``TEENY_PDL=1`` in the
environment launches teeny's products and attention with programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as tnn
import torch.nn.functional as F

import teeny

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_ratios, append_results, capture, make_row  # noqa: E402
from teeny import LoweringMode, lower, ops
from teeny.core import config, runtime
from teeny.core.graph import Graph
from teeny.fusions import DEFAULT_REWRITES
from teeny.training.loop import TrainStep
from teeny.training.models import GPT
from teeny.training.optim import SGD, AdamW
from tools.kernel_gaps import kernel_gaps  # noqa: E402

DEV = teeny.DEVICE

CASES = {
    "gpt2": dict(kind="gpt", layers=12, d=768, heads=12, ctx=1024, batch=8, vocab=50304, dtype=torch.bfloat16),
    "gpt6": dict(kind="gpt", layers=6, d=768, heads=12, ctx=256, batch=16, vocab=50304, dtype=torch.bfloat16),
    "gpt4": dict(kind="gpt", layers=4, d=256, heads=8, ctx=128, batch=64, vocab=96, dtype=torch.float32),
    "mlp": dict(kind="mlp", sizes=(784, 256, 256, 10), batch=128, dtype=torch.float32),
    "mlp_bf16": dict(kind="mlp", sizes=(784, 256, 256, 10), batch=128, dtype=torch.bfloat16),
    "mlp_big": dict(kind="mlp", sizes=(4096,) * 5, batch=8192, dtype=torch.bfloat16, gelu=True),
}


# ----------------------------------------------------------------------------- torch models


class TorchBlock(tnn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (tnn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)

        def split(z):
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TorchGPT(tnn.Module):
    def __init__(self, vocab, ctx, d, heads, layers):
        super().__init__()
        self.tok = tnn.Embedding(vocab, d)
        self.pos = tnn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = tnn.ModuleList(TorchBlock(d, heads) for _ in range(layers))
        self.ln, self.head = tnn.LayerNorm(d), tnn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class TorchMLP(tnn.Module):
    def __init__(self, sizes, gelu):
        super().__init__()
        self.layers = tnn.ModuleList(tnn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.act = (lambda z: F.gelu(z, approximate="tanh")) if gelu else F.relu

    def forward(self, x, targets):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return F.cross_entropy(x, targets) if targets.dtype == torch.int64 else F.mse_loss(x, targets)


# ----------------------------------------------------------------------------- teeny models


class TeenyMLP(teeny.Module):
    def __init__(self, sizes, gelu):
        super().__init__()
        self.layers = teeny.nn.ModuleList(teeny.nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.gelu = gelu

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = ops.gelu(x, approximate="tanh") if self.gelu else ops.relu(x)
        return x


def batch_for(case):
    g = torch.Generator().manual_seed(0)
    if case["kind"] == "gpt":
        shape = (case["batch"], case["ctx"])
        idx = torch.randint(0, case["vocab"], shape, generator=g)
        return idx.to(DEV), torch.randint(0, case["vocab"], shape, generator=g).to(DEV)
    x = torch.randn(case["batch"], case["sizes"][0], generator=g).to(DEV, case["dtype"])
    if case.get("gelu"):
        return x, torch.randn(case["batch"], case["sizes"][-1], generator=g).to(DEV, case["dtype"])
    return x, torch.randint(0, case["sizes"][-1], (case["batch"],), generator=g).to(DEV)


def teeny_step(case, precision=None, rewrites=None, recompute=False):
    dtype = torch.float32 if precision else case["dtype"]
    g = Graph("step")
    if case["kind"] == "gpt":
        model = GPT(case["vocab"], case["ctx"], case["d"], case["heads"], case["layers"]).to(dtype)
        idx = g.input("x", (case["batch"], case["ctx"]), torch.int64)
        y = g.input("y", (case["batch"], case["ctx"]), torch.int64)
        logits = model(idx)
        g.output(ops.cross_entropy(ops.reshape(logits, (-1, case["vocab"])), ops.reshape(y, (-1,))))
    else:
        model = TeenyMLP(case["sizes"], case.get("gelu", False)).to(dtype)
        x = g.input("x", (case["batch"], case["sizes"][0]), dtype)
        if case.get("gelu"):
            y = g.input("y", (case["batch"], case["sizes"][-1]), dtype)
            g.output(ops.mse_loss(model(x), y))
        else:
            y = g.input("y", (case["batch"],), torch.int64)
            g.output(ops.cross_entropy(model(x), y))
    options = {} if rewrites is None else {"rewrites": rewrites}
    program = lower(g, LoweringMode.TRAINING, precision=precision, recompute=recompute, **options)
    for line in program.summary().splitlines()[-(2 + bool(recompute) + len(program.rewrites)) :]:
        print("   ", line.strip())
    ex = teeny.Executor(program)
    opt = AdamW(ex, lr=1e-4) if case["kind"] == "gpt" else SGD(ex, lr=1e-3)
    return ex, opt


def torch_model(case, precision=None):
    if case["kind"] == "gpt":
        model = TorchGPT(case["vocab"], case["ctx"], case["d"], case["heads"], case["layers"])
    else:
        model = TorchMLP(case["sizes"], case.get("gelu", False))
    model = model.to(DEV, torch.float32 if precision else case["dtype"])
    if case["kind"] == "gpt":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, opt


def timed(step, warmup, steps):
    """(median ms of a step timed alone, ms per step of ``steps`` queued back to back, peak MiB).
    Alone: each step between two events and a synchronisation, so host work inside the step
    (teeny's optimizer prepare, a graph's launch) counts in full. Queued: the steps issued
    without a synchronisation, as a training loop runs them (teeny's reads the loss every 20
    steps), so host work overlaps the GPU's."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), start.elapsed_time(end) / steps, peak


def teeny_row(
    case, x, y, steps, profile, precision=None, rewrites=None, label="teeny, no rewrites", host=False, recompute=False
):
    ex, opt = teeny_step(case, precision, rewrites, recompute)
    step = TrainStep(ex, opt, cuda_graph=DEV.type == "cuda")
    t0 = time.perf_counter()
    step({"x": x, "y": y})
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    step({"x": x, "y": y})  # captures the graph; then the batch is already in its input buffers, as
    feed = step.inputs or {"x": x, "y": y}  # torch's captured step reads its batch (no copy)
    ms, queued, _ = timed(lambda: step(feed), 3, steps)
    # the graph's memory pool was taken at capture, before the peak counter was reset: measure
    # the step's peak on the same step run eagerly (activations allocated as torch's are)
    eager = TrainStep(ex, opt, cuda_graph=False)
    _, _, mem = timed(lambda: eager({"x": x, "y": y}), 1, 1)
    if host:
        print_host(label if rewrites is not None else "teeny", lambda: step(feed))
    if profile == "launches":
        print_launches(label if rewrites is not None else "teeny", lambda: eager({"x": x, "y": y}))
    elif profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            eager({"x": x, "y": y})
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        print(f"  teeny profile ({len(events)} kernel names, {total / 1000:.2f} ms GPU):")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:15]:
            print(
                f"    {e.key[:48]:48} {e.count:5d} x {e.device_time_total / max(e.count, 1):8.1f} us"
                f" = {100 * e.device_time_total / total:5.1f}%"
            )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(feed)
            torch.cuda.synchronize()
        print("  teeny's captured step (CUDA graph), 3 steps:\n" + kernel_gaps(prof, steps=3))
    return ("teeny (CUDA graph)" if rewrites is None and not recompute else label, ms, queued, mem, first)


def print_host(label, step, calls=300):
    """Where the host time of a queued step goes: its wall time per call issued back to back
    (the GPU catching up only where the host waits on it), cProfile's busiest functions, and
    the CUDA runtime calls by host time (torch.profiler)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    issued = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    print(f"  {label}: host {issued * 1e6:.1f} us a step issued back to back")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def print_launches(label, step):
    """GPU time of every launch of one eager step, by where it ran and what (kernel, grid,
    block): each launch runs inside a profiler range of that name. Prints the 30 longest and
    appends all of them to $OUT/launches.jsonl (to diff two variants)."""
    original = runtime.run_launch

    def labelled(launch, instance, where, *args, **kwargs):
        block = runtime.as_block(launch.block)
        consts = " ".join(  # the constexprs (upper-case names): tiles, epilogue, layout
            f"{v.name}={getattr(v.value, '__name__', v.value)}"
            for v in launch.args.visits
            if v.name and v.name.isupper() and not torch.is_tensor(v.value)
        )
        name = (
            f"{where} | {launch.kernel.name} grid={tuple(launch.grid)} w{block.num_warps} s{block.num_stages} {consts}"
        )
        with torch.profiler.record_function("launch: " + name):
            return original(launch, instance, where, *args, **kwargs)

    runtime.run_launch = labelled
    replay, config.replay = config.replay, False  # every launch through run_launch (a replay skips it)
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
    finally:
        runtime.run_launch = original
        config.replay = replay
    times: dict[str, list] = {}  # label -> [launches, total us]
    for e in prof.events():
        if e.name.startswith("launch: "):
            entry = times.setdefault(e.name[8:], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total
    total = sum(us for _, us in times.values())
    print(f"  {label}: {sum(n for n, _ in times.values())} launches, {total / 1000:.2f} ms GPU; the longest:")
    for name, (n, us) in sorted(times.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"    {us:8.1f} us {n:3d}x  {name[:220]}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "launches.jsonl"), "a") as f:
            f.write(json.dumps({"label": label, "launches": times}) + "\n")


def torch_row(case, mode, x, y, steps, precision=None):
    model, opt = torch_model(case, precision)
    fn = model if mode in ("eager", "cudagraph") else torch.compile(model, mode=None if mode == "default" else mode)

    def torch_step():
        opt.zero_grad(set_to_none=mode != "cudagraph")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = fn(x, y)
        loss.backward()
        opt.step()

    run = torch_step
    if mode == "cudagraph":  # the eager step captured by hand as one CUDA graph (the anchor)
        graph, _ = capture(torch_step)
        run = graph.replay
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms, queued, mem = timed(run, 3, steps)
    return (f"torch {mode}", ms, queued, mem, first)


def run_case(
    name, case, modes, steps, profile, precision=None, no_rewrites_row=False, without=(), host=False, recompute=False
):
    if precision:  # float32 parameters: float inputs stay float32 as well
        case = {**case, "dtype": torch.float32}
    x, y = batch_for(case)
    tokens = x.numel() if case["kind"] == "gpt" else x.shape[0]
    print(f"{name}: {case}{', ' + precision if precision else ''}")
    rows = [teeny_row(case, x, y, steps, profile, precision, host=host)]
    torch.cuda.empty_cache()
    if no_rewrites_row:
        rows.append(teeny_row(case, x, y, steps, False, precision, rewrites=()))
        torch.cuda.empty_cache()
    if recompute:  # what writing norms' and activations' outputs again in the backward costs and saves
        rows.append(teeny_row(case, x, y, steps, profile, precision, label="teeny, recompute", recompute=True))
        torch.cuda.empty_cache()
    for left_out in without:  # what one default rewrite buys: the step without it
        rewrites = tuple(r for r in DEFAULT_REWRITES if r.__name__ != left_out)
        launches = "launches" if profile == "launches" else False
        rows.append(teeny_row(case, x, y, steps, launches, precision, rewrites, f"teeny w/o {left_out}"))
        torch.cuda.empty_cache()
    for mode in modes:
        rows.append(torch_row(case, mode, x, y, steps, precision))
        torch.cuda.empty_cache()
    compiled = [r for r in rows if r[0].startswith("torch ") and r[0] != "torch eager"]
    best = min((r[1] for r in compiled), default=math.nan)
    best_queued = min((r[2] for r in compiled), default=math.nan)
    for label, ms, queued, mem, first in rows:
        print(
            f"  {label:22} {ms:8.3f} ms alone {queued:8.3f} ms queued {tokens / queued * 1000:12.0f} tok/s"
            f"  peak {mem:8.0f} MiB  first {first:6.1f} s"
        )
    ratio, ratio_queued = rows[0][1] / best, rows[0][2] / best_queued
    print(f"  teeny / best of the others but eager = {ratio:.2f} alone, {ratio_queued:.2f} queued")
    case_name = f"step {name}" + (f" {precision}" if precision else "")
    saved = add_ratios(
        [
            make_row(
                "steps",
                case_name,
                impl_name(label),
                ms,
                note=f"queued {queued:.3f} ms, "
                f"{tokens / queued * 1000:.0f} tok/s, peak {mem:.0f} MiB, first {first:.1f} s",
            )  # fmt: skip
            for label, ms, queued, mem, first in rows
        ]
    )
    return {
        "case": name,
        "precision": precision,
        "rows": rows,
        "teeny_over_best": ratio,
        "queued": ratio_queued,
        "saved": saved,
    }


def impl_name(label: str) -> str:
    """The results file's implementation name of a row label: ``teeny (CUDA graph)`` -> ``teeny``,
    ``teeny, recompute`` -> ``teeny-recompute``, ``torch reduce-overhead`` -> ``compile-reduce-overhead``."""
    if label == "teeny (CUDA graph)":
        return "teeny"
    if label.startswith("teeny"):
        return "teeny-" + label.removeprefix("teeny").strip(" ,").replace(" ", "-")
    mode = label.removeprefix("torch ")
    if mode in ("eager", "cudagraph"):
        return "eager" if mode == "eager" else "eager-cudagraph"
    return "compile" if mode == "default" else f"compile-{mode}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/<gpu>.csv")
    parser.add_argument("--models", default="gpt6,mlp,mlp_bf16")
    parser.add_argument("--modes", default="eager,default,reduce-overhead", help="also: max-autotune, cudagraph")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="teeny's GPU time per kernel name")
    parser.add_argument("--launches", action="store_true", help="teeny's GPU time per launch (every teeny row)")
    parser.add_argument("--host", action="store_true", help="where the host time of teeny's queued step goes")
    parser.add_argument("--precision", choices=["bf16-mixed"], help="float32 parameters, bfloat16 compute")
    parser.add_argument("--no-rewrites-row", action="store_true", help="also time teeny with lower(rewrites=())")
    parser.add_argument("--recompute", action="store_true", help="also time teeny with lower(recompute=True)")
    parser.add_argument("--without", default="", help="also time teeny without these default rewrites (names, commas)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    without = [w for w in args.without.split(",") if w]
    unknown = sorted(set(without) - {r.__name__ for r in DEFAULT_REWRITES})
    if unknown:
        parser.error(f"--without {','.join(unknown)}: not among the default rewrites")
    results = [
        run_case(
            m,
            CASES[m],
            modes,
            args.steps,
            "launches" if args.launches else args.profile,
            args.precision,
            args.no_rewrites_row,
            without,
            args.host,
            args.recompute,
        )
        for m in args.models.split(",")
    ]
    if not args.no_save:
        print("results:", append_results([row for r in results for row in r["saved"]]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "steps.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
