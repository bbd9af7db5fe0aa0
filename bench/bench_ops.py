"""Forward+backward time of teeny kernels against PyTorch eager, torch.compile and Liger-Kernel
(where it has the op), with the bytes each must move and the copy-bandwidth floor.

    PYTHONPATH=src python bench/bench_ops.py [--only NAME ...] [--json out.json]

Each case checks teeny's output and input gradient against eager first (relative error printed),
then times forward+backward with triton.testing.do_bench (median, ms).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

import teeny
from teeny import ops
from teeny.interop.torch import apply

DEV = "cuda"


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def liger():
    try:
        import liger_kernel.transformers as lt  # noqa: F401
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return dict(
            cross_entropy=LigerCrossEntropyFunction,
            layer_norm=LigerLayerNormFunction,
            rms_norm=LigerRMSNormFunction,
            swiglu=LigerSiLUMulFunction,
        )
    except Exception as exc:  # not installed: the column stays empty
        print(f"liger-kernel unavailable: {exc}", file=sys.stderr)
        return {}


def make_cases(L):
    cases = []
    n = 2**27
    x = torch.randn(n, device=DEV)
    cases.append(
        dict(
            name="gelu_tanh fp32 2^27",
            inputs=[x],
            bytes=20 * n,
            teeny=lambda x: ops.gelu(x, "tanh"),
            torch=lambda x: F.gelu(x, approximate="tanh"),
        )
    )
    rows, cols = 16384, 4096
    s = torch.randn(rows, cols, device=DEV)
    cases.append(
        dict(
            name="softmax fp32 16384x4096",
            inputs=[s],
            bytes=20 * rows * cols,
            teeny=lambda x: ops.softmax(x, -1),
            torch=lambda x: torch.softmax(x, -1),
        )
    )
    h = torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(cols, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(cols, device=DEV, dtype=torch.bfloat16)
    ln = dict(
        name="layer_norm bf16 16384x4096",
        inputs=[h, w, b],
        bytes=10 * rows * cols,
        teeny=lambda x, w, b: ops.layer_norm(x, (cols,), w, b),
        torch=lambda x, w, b: F.layer_norm(x, (cols,), w, b),
    )
    if "layer_norm" in L:
        ln["liger"] = lambda x, w, b: L["layer_norm"].apply(x, w, b, 1e-5)
    cases.append(ln)
    rms = dict(
        name="rms_norm bf16 16384x4096",
        inputs=[h, w],
        bytes=10 * rows * cols,
        teeny=lambda x, w: ops.rms_norm(x, (cols,), w, 1e-6),
        torch=lambda x, w: F.rms_norm(x, (cols,), w, 1e-6),
    )
    if "rms_norm" in L:
        rms["liger"] = lambda x, w: L["rms_norm"].apply(x, w, 1e-6, 0.0, "llama")
    cases.append(rms)
    a = torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16)
    sw = dict(
        name="swiglu bf16 16384x4096",
        inputs=[a, h],
        bytes=2 * 7 * rows * cols,
        teeny=lambda a, b: ops.swiglu(a, b),
        torch=lambda a, b: F.silu(a) * b,
    )
    if "swiglu" in L:
        sw["liger"] = lambda a, b: L["swiglu"].apply(a, b)
    cases.append(sw)
    N, V = 8192, 32000
    logits = torch.randn(N, V, device=DEV, dtype=torch.bfloat16)
    target = torch.randint(V, (N,), device=DEV)
    ce = dict(
        name="cross_entropy bf16 8192x32000",
        inputs=[logits, target],
        bytes=6 * N * V,
        teeny=lambda x, t: ops.cross_entropy(x, t),
        torch=lambda x, t: F.cross_entropy(x, t),
    )
    if "cross_entropy" in L:
        ce["liger"] = lambda x, t: L["cross_entropy"].apply(x, t, None, -100, 0.0, 0.0, "mean", None, False)[0]
    cases.append(ce)
    m = 4096
    A = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    B = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    cases.append(
        dict(
            name="matmul bf16 4096^3",
            inputs=[A, B],
            flops=6 * m**3,
            teeny=lambda a, b: ops.matmul(a, b),
            torch=lambda a, b: a @ b,
        )
    )
    Bz, H, T, D = 4, 16, 2048, 64
    q, k, v = (torch.randn(Bz, H, T, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    cases.append(
        dict(
            name="causal attention bf16 4x16x2048x64",
            inputs=[q, k, v],
            flops=2.5 * 4 * Bz * H * T * T * D,
            teeny=lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True),
            torch=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        )
    )
    return cases


def fwd_bwd(fn, inputs, grad):
    def run():
        out = fn(*inputs)
        out.backward(grad)

    return run


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--json")
    args = parser.parse_args()
    assert teeny.DEVICE.type == "cuda", "benchmarks need a GPU"
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    L = liger()
    results = []
    for case in make_cases(L):
        if args.only and not any(o in case["name"] for o in args.only):
            continue
        float_inputs = [t for t in case["inputs"] if t.is_floating_point()]

        def fresh():
            return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in case["inputs"]]

        impls = {
            "teeny": lambda *xs, f=case["teeny"]: apply(f, *xs),
            "eager": case["torch"],
            "compile": torch.compile(case["torch"]),
        }
        if "liger" in case:
            impls["liger"] = case["liger"]
        ref_in = fresh()
        ref_out = case["torch"](*ref_in)
        grad = torch.randn_like(ref_out)
        ref_out.backward(grad)
        row = {"case": case["name"]}
        for label, fn in impls.items():
            xs = fresh()
            try:
                out = fn(*xs)
                out.backward(grad)
                err_out = rel_err(out, ref_out)
                err_grad = rel_err(xs[0].grad, ref_in[0].grad)
                ms = triton.testing.do_bench(
                    fwd_bwd(fn, xs, grad),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                    grad_to_none=[t for t in xs if t.requires_grad],
                )
            except Exception as exc:
                print(f"  {case['name']} {label}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            row[label] = ms
            row[f"{label}_err"] = max(err_out, err_grad)
        if "bytes" in case:
            row["floor_ms"] = case["bytes"] / bw * 1e3
        if "flops" in case:
            row["tflops_teeny"] = case["flops"] / (row.get("teeny", float("nan")) * 1e-3) / 1e12
            row["tflops_eager"] = case["flops"] / (row.get("eager", float("nan")) * 1e-3) / 1e12
        results.append(row)
        del float_inputs
        torch.cuda.empty_cache()
    print()
    print(f"{'case':38} {'teeny':>8} {'eager':>8} {'compile':>8} {'liger':>8} {'floor':>8}  teeny err")
    for r in results:
        cells = [f"{r[k]:8.3f}" if k in r else f"{'-':>8}" for k in ("teeny", "eager", "compile", "liger", "floor_ms")]
        extra = f"  {r.get('teeny_err', float('nan')):.1e}"
        if "tflops_teeny" in r:
            extra += f"  ({r['tflops_teeny']:.0f} vs {r['tflops_eager']:.0f} TFLOP/s)"
        print(f"{r['case']:38} {' '.join(cells)}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
