"""Time to the first training step, cold and warm, of each variant of a ``teeny bench`` model:
issue 48's goal (cold: ≤ inductor's; warm: ≤ 10 s).

    python3 bench/tools/first_step.py examples/bench_llama.py:make_gpu_model \
        --variants compile-default,teeny-backend [--json out.json]

Each variant runs twice, each time in a fresh process (``teeny bench --steps 4``): first with
empty caches of its own (Triton's, teeny's tuning, inductor's), then again with what the first
process left in them. Prints one row per variant: cold and warm first step, step time; with
``--phases``, where each process's time went (``bench/tools/phase_times.py``: lowering, compile
pools, tuning, Triton's in-process compiles, the backend's handoff).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def first_step(spec: str, variant: str, caches: Path, timeout: float, phases: bool = False) -> dict:
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TEENY_TUNING_CACHE": str(caches / "tuning.json"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
    }
    out = caches / f"run-{len(list(caches.glob('run-*.json')))}.json"
    command = [sys.executable, "-m", "teeny", "bench", spec, "--variants", variant, "--steps", "4", "--warmup", "1"]
    timings = out.with_suffix(".phases.json")
    if phases:  # the same process with teeny's phases timed (phase_times.py)
        command[1:1] = [str(Path(__file__).with_name("phase_times.py")), str(timings)]
    try:
        run = subprocess.run([*command, "--json", str(out)], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"over {timeout:.0f} s"}
    if run.returncode != 0 or not out.exists():
        return {"status": f"exit {run.returncode}: {run.stderr.strip()[-300:]}"}
    row = json.loads(out.read_text())["rows"][0]
    if timings.exists():
        row["phases"] = json.loads(timings.read_text())
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--variants", default="compile-default,teeny-backend")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--json")
    parser.add_argument("--phases", action="store_true", help="time teeny's phases too (bench/tools/phase_times.py)")
    args = parser.parse_args()
    rows = []
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="first-step-") as folder:
            cold = first_step(args.spec, variant, Path(folder), args.timeout, args.phases)
            warm = first_step(args.spec, variant, Path(folder), args.timeout, args.phases)
        rows.append({"variant": variant, "cold": cold, "warm": warm})
        print(
            f"{variant:18s} cold first step {cold.get('first_step_s', float('nan')):7.2f} s  "
            f"warm {warm.get('first_step_s', float('nan')):7.2f} s  step {warm.get('step_ms', float('nan')):7.2f} ms  "
            f"{cold.get('status', '')} / {warm.get('status', '')}",
            flush=True,
        )
        for when, row in (("cold", cold), ("warm", warm)):
            if row.get("phases"):
                spent = ", ".join(f"{k} {v['s']:.2f} s ({v['calls']})" for k, v in row["phases"].items())
                built = row["phases"].get("backend", {}).get("s")
                if built is not None and "first_step_s" in row:  # the rest: the step's own runs, recording
                    spent += f"; first step outside the backend {row['first_step_s'] - built:.2f} s"
                print(f"{'':18s} {when} phases: {spent}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.spec, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
