"""Profile one training step of a Hugging Face model under ``torch.compile(backend="teeny")``
(bf16 autocast, fused AdamW): GPU time per kernel name, GPU busy vs the step's wall time.

    python3 bench/tools/profile_backend.py examples/bench_llama.py:make_gpu_model [--backend inductor]

``--mode reduce-overhead``: torch.compile's mode (the teeny backend then replays the region as
CUDA graphs): the GPU's idle time between the graphs, which the kernels' sum does not show.

``--cprofile``: the first step (compilation, tuning, recording) and a later one under cProfile,
the functions that took the most time in each: where the first step's seconds go, and whether a
later step's host time is the replays' or something else's.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, "src")
import teeny.torch.backend  # noqa: E402,F401  (registers backend="teeny" from the source tree)
from teeny.torch.task import load_factory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--backend", default="teeny")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--mode", default=None, help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the first step and a later one")
    args = parser.parse_args()
    model, batch = load_factory(args.spec)()[:2]
    model = model.cuda().train()
    batch = {k: v.cuda() for k, v in batch.items()}
    compiled = torch.compile(model, backend=args.backend, mode=args.mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        if args.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(**batch).loss
        loss.backward()
        optimizer.step()

    if args.cprofile:
        _cprofiled("first step", step, args.rows)
    for _ in range(4):
        step()
    if args.cprofile:
        _cprofiled("a later step", step, args.rows)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 5 * 1e3
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    what = f"{args.backend} ({args.mode or 'default'})"
    print(f"{what}: step {wall:.2f} ms wall, GPU busy {gpu:.2f} ms ({100 * gpu / wall:.0f}%)")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


def _cprofiled(what: str, step, rows: int) -> None:
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    step()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(rows * 2)
    stats.sort_stats("tottime").print_stats(rows)
    print(f"== {what}: {time.perf_counter() - start:.2f} s under cProfile")
    print(text.getvalue())


if __name__ == "__main__":
    main()
