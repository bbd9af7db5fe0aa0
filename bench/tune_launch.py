"""Try Triton launch options (num_warps, num_stages) for the kernels behind a benchmark case and
print the time of each variant: the data behind the ``Kernel.tune(...)`` lines in the kernels.
(Matrix products choose their tiles, warps and stages per shape at lowering: bench/matmul_sweep.py
shows that tuning pass.)

    PYTHONPATH=src python3 bench/tune_launch.py
"""

from __future__ import annotations

import itertools

import torch
import triton

import bench_ops  # noqa: E402  (same folder)
from teeny.interop.torch import apply
from teeny.kernel import REGISTRY

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
    cases = {c["name"]: c for c in bench_ops.make_cases({})}
    for prefix, (names, dtype, warps, stages) in GROUPS.items():
        case = next((c for n, c in cases.items() if n.startswith(prefix)), None)
        kernels = [REGISTRY[n] for n in names if n in REGISTRY]
        if case is None or not kernels:
            continue
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in case["inputs"]]
        out = apply(case["teeny"], *xs)
        grad = torch.randn_like(out)
        rows = []
        for w, s in itertools.product(warps, stages):
            for k in kernels:
                k.tune(dtype, num_warps=w, num_stages=s)
            try:
                ms = triton.testing.do_bench(
                    bench_ops.fwd_bwd(lambda *a: apply(case["teeny"], *a), xs, grad),
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
