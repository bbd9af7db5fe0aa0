"""Element-wise, reduction and softmax launches: forward+backward time against PyTorch eager, at
memory-bound sizes (GB/s against the bytes each must move) and at a small size where the host
(argument packing, ~20 us per Triton launch) dominates.

    PYTHONPATH=src python3 bench/bench_elementwise.py [--json out.json]

Run it on two trees (before and after a change) to compare; it uses only the public ops, so it
runs on either. Takes about a minute on an H200 (plus compilation). Results go to stdout and, if
$OUT is set, to $OUT/bench_elementwise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch
import triton

import teeny
from teeny import ops
from teeny.interop.torch import apply

DEV = "cuda"


def cases():
    rows, cols = 16384, 4096
    a = torch.randn(rows, cols, device=DEV)
    bias = torch.randn(cols, device=DEV)
    b = torch.randn(rows, cols, device=DEV)
    h = a.to(torch.bfloat16)
    small, small_bias = torch.randn(64, 64, device=DEV), torch.randn(64, device=DEV)
    n = rows * cols
    return [
        # name, teeny fn, torch fn, inputs, bytes moved forward+backward (fp32 = 4 bytes)
        ("add bias fp32 16384x4096", lambda x, y: ops.add(x, y), lambda x, y: x + y, [a, bias], 4 * 3 * n),
        ("mul fp32 16384x4096", ops.mul, torch.mul, [a, b], 4 * 8 * n),
        ("mul by 0.3 bf16 16384x4096", lambda x: x * 0.3, lambda x: x * 0.3, [h], 2 * 4 * n),
        ("clamp -0.5 0.7 fp32", lambda x: ops.clamp(x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7), [a], 4 * 5 * n),
        ("sum dim -1 fp32", lambda x: ops.sum(x, -1), lambda x: x.sum(-1), [a], 4 * 2 * n),
        ("mean dim 0 fp32", lambda x: ops.mean(x, 0), lambda x: x.mean(0), [a], 4 * 2 * n),
        ("sum all fp32 (split)", lambda x: ops.sum(x), lambda x: x.sum(), [a], 4 * 2 * n),
        ("var dim -1 fp32", lambda x: ops.var(x, -1), lambda x: x.var(-1), [a], 4 * 4 * n),
        ("softmax bf16", lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1), [h], 2 * 5 * n),
        ("add bias fp32 64x64 (host)", lambda x, y: ops.add(x, y), lambda x, y: x + y, [small, small_bias], 0),
        ("mul fp32 64x64 by 0.3 (host)", lambda x: x * 0.3, lambda x: x * 0.3, [small], 0),
    ]


def fwd_bwd(fn, inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    dy = torch.randn_like(out)

    def step():
        y = fn(*leaves)
        torch.autograd.grad(y, leaves, dy)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    assert teeny.DEVICE.type == "cuda", "run on the GPU machine"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"teeny {commit} on {torch.cuda.get_device_name()}")
    print(f"{'case':32} {'teeny ms':>9} {'eager ms':>9} {'teeny GB/s':>11} {'eager GB/s':>11}")
    results = []
    for name, ours, theirs, inputs, nbytes in cases():
        t = triton.testing.do_bench(fwd_bwd(lambda *xs, f=ours: apply(f, *xs), inputs), return_mode="median")
        e = triton.testing.do_bench(fwd_bwd(theirs, inputs), return_mode="median")
        gbs = lambda ms: f"{nbytes / ms / 1e6:11.0f}" if nbytes else f"{'-':>11}"
        print(f"{name:32} {t:9.4f} {e:9.4f} {gbs(t)} {gbs(e)}")
        results.append(dict(case=name, teeny_ms=t, eager_ms=e, bytes=nbytes))
    payload = dict(commit=commit, device=torch.cuda.get_device_name(), results=results)
    for path in [
        args.json,
        os.path.join(os.environ["OUT"], "bench_elementwise.json") if os.environ.get("OUT") else None,
    ]:
        if path:
            with open(path, "w") as f:
                json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
