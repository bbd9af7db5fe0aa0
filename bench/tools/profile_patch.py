"""Profile one training step of a patched model (``teeny.torch.patch``) under torch.profiler: the
host time per teeny op call and the GPU's busy time, to see where a patched eager step goes.

    PYTHONPATH=src python3 bench/tools/profile_patch.py bench/hf_models.py:qwen2_lora --steps 4
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
    args = parser.parse_args()
    import teeny.torch as tt
    from teeny.torch.task import load_factory

    model, batch = load_factory(args.factory)()
    model = model.cuda().train()
    batch = {k: v.cuda() for k, v in batch.items()}
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


if __name__ == "__main__":
    main()
