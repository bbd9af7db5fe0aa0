"""Try Triton launch options (num_warps, num_stages) for the kernels behind a benchmark case and
print the time of each variant: the data behind the ``Kernel.tune(...)`` lines in the kernels.
(Matrix products choose their tiles, warps and stages per shape at lowering: bench/tools/matmul_sweep.py
shows that tuning pass.)

    PYTHONPATH=src python3 bench/tools/tune_launch.py
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import itertools
import sys
from pathlib import Path

import teeny.ops  # noqa: F401
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops as bench_ops  # noqa: E402  (bench/ops.py: the cases)
from teeny.core.kernel import REGISTRY  # noqa: E402
from teeny.torch import apply  # noqa: E402

GROUPS = {
    "causal attention bf16": (
        ["attention_forward", "attention_backward_dkdv", "attention_backward_dq"],
        torch.bfloat16,
        (4, 8),
        (2, 3),
    ),
    "layer_norm bf16": (["norm_forward", "norm_backward", "norm_weight_backward"], torch.bfloat16, (4, 8, 16), (1, 2)),
    "rms_norm bf16": (["norm_forward", "norm_backward", "norm_weight_backward"], torch.bfloat16, (4, 8, 16), (1, 2)),
    "cross_entropy bf16": (["class_loss_forward", "class_loss_backward"], torch.bfloat16, (4, 8, 16), (1, 2)),
}


def main():
    cases = {c.name: c for c in bench_ops.make_cases()}
    for prefix, (names, dtype, warps, stages) in GROUPS.items():
        case = next((c for n, c in cases.items() if n.startswith(prefix)), None)
        kernels = [REGISTRY[n] for n in names if n in REGISTRY]
        if case is None or not kernels:
            continue
        case = case.make()
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in case["inputs"]]
        out = apply(case["teeny"], *xs)
        grad = torch.randn_like(out)
        rows = []
        for w, s in itertools.product(warps, stages):
            for k in kernels:
                k.tune(dtype, num_warps=w, num_stages=s)
            try:
                ms = triton.testing.do_bench(
                    lambda case=case, xs=xs, grad=grad: apply(case["teeny"], *xs).backward(grad),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                    grad_to_none=[t for t in xs if t.requires_grad],
                )
            except Exception as exc:  # a variant that does not compile (too many registers, ...)
                print(f"{prefix} warps={w} stages={s}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append((ms, w, s))
        for k in kernels:
            k.launch_options.pop(dtype, None)
        rows.sort()
        print(f"{prefix}: " + ", ".join(f"w{w}/s{s} {ms:.3f}" for ms, w, s in rows))


if __name__ == "__main__":
    main()
