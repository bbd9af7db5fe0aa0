"""Profile one training step of a patched model (``teeny.torch.patch``) under torch.profiler: the
host time per teeny op call and the GPU's busy time, to see where a patched eager step goes.

    PYTHONPATH=src python3 bench/tools/profile_patch.py bench/hf_models.py:qwen2_lora --steps 4

Then, with ``--host``, the same step under cProfile (no torch.profiler: its per-ATen-call records
inflate host time), the step's wall time without any profiler, and how many teeny calls were
answered by their tapes (``teeny.program.tape``) against those that took the full path, and why.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="FILE.py:FUNCTION returning (model, batch), as teeny bench takes")
    parser.add_argument("--steps", type=int, default=4, help="untimed steps before the profiled one")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--unpatched", action="store_true", help="profile the model as it is (the baseline)")
    parser.add_argument("--liger", action="store_true", help="Liger-Kernel's patch instead of teeny's")
    parser.add_argument("--host", action="store_true", help="also cProfile the step and count tape replays")
    args = parser.parse_args()
    import teeny.torch as tt
    from teeny.torch.task import load_factory

    model, batch = load_factory(args.factory)()
    model = model.cuda().train()
    batch = {k: v.cuda() for k, v in batch.items()}
    if args.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model.get_base_model() if hasattr(model, "get_base_model") else model)
    elif not args.unpatched:
        print(tt.patch(model).coverage())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()

    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        torch.cuda.synchronize()
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)
    events = profile.key_averages()
    teeny = [e for e in events if e.key.startswith("teeny op")]
    host_ms = sum(e.cpu_time_total for e in teeny) / 1e3
    print(f"teeny op ranges: {sum(e.count for e in teeny)} calls, {host_ms:.1f} ms host")
    if args.host:
        host_profile(step)
    memory_phases(model, batch, optimizer)


def memory_phases(model, batch, optimizer) -> None:
    """Peak memory of the step's forward and of its backward, over what is allocated before each."""
    mib = 2**20
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    torch.cuda.synchronize()
    after_forward, forward_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated()
    print(
        f"memory MiB: before the step {start / mib:.0f}, forward peak {forward_peak / mib:.0f}, "
        f"held after the forward {after_forward / mib:.0f}, backward peak {backward_peak / mib:.0f}"
    )


def host_profile(step) -> None:
    """Wall time of the step unprofiled, cProfile of one step, and the tapes' replays."""
    import cProfile
    import gc
    import pstats
    import time

    from teeny.program.tape import Replayed

    def replays() -> int:
        return sum(r.replays for r in gc.get_objects() if isinstance(r, Replayed))

    torch.cuda.synchronize()
    before, start = replays(), time.perf_counter()
    for _ in range(5):
        step()
    host = (time.perf_counter() - start) / 5 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 5 * 1e3
    per_step = (replays() - before) / 5
    print(f"step unprofiled: {wall:.1f} ms wall, host returns after {host:.1f} ms; {per_step:.0f} replays a step")
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
    blocked = [r.not_recorded for r in gc.get_objects() if isinstance(r, Replayed) and r.not_recorded]
    print(f"not recorded: {len(blocked)}", sorted(set(blocked))[:10])


if __name__ == "__main__":
    main()
