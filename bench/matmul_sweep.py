"""Sweep teeny's matmul configurations on the GPU against cuBLAS, product by product.

    PYTHONPATH=src python3 bench/matmul_sweep.py [--budget 230] [--only bf16 ...]

For each case (4096^3 matmul, and the GPT-2-small linear layers at M = 8192 tokens:
768->768, 768->3072, 3072->768, 768->50304) and each of its three products (forward, and the
two gradients: dA/dX and dB/dW, operands read in place in their layouts), this runs teeny's
tuning pass (``linear.choose_config``: every candidate timed inside a CUDA graph, the winner
written to the tuning cache, ``$OUT/tuning.json`` unless TEENY_TUNING_CACHE is set), then times
the winner and the cuBLAS product (torch.matmul / torch.addmm on the same strided views, also
in a CUDA graph) on the same data, and prints TFLOP/s and the relative error (Frobenius) of
both against a float64 product of the same inputs.

Dtypes: bf16 on every case; fp16, fp32 (tf32x3: teeny's default, tf32, ieee) and fp64 on the
4096^3 matmul. The bf16 4096^3 products also show teeny's strided (pre-Hopper) kernel.
The run stops starting new products after ``--budget`` seconds (default 230) and says which
it skipped, so it ends in about four minutes. Results also go to $OUT/matmul_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/teeny-bench"))
OUT.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TEENY_TUNING_CACHE", str(OUT / "tuning.json"))

import torch  # noqa: E402

import teeny  # noqa: E402,F401  (chooses the device before triton is imported)
import teeny.kernels.linear as linear  # noqa: E402
from teeny import tuning  # noqa: E402
from teeny.runtime import run_launch  # noqa: E402

DEV = teeny.DEVICE
GPT2 = [(768, 768), (768, 3072), (3072, 768), (768, 50304)]
TOKENS = 8192


def cases(selected, smoke: bool = False):
    """(case name, dtype, precision, {product name: (Product, has_bias)}); ``smoke``: tiny sizes
    (a check of this script under the interpreter)."""
    m, gpt2, tokens = (40, [(24, 40)], 37) if smoke else (4096, GPT2, TOKENS)
    mm = linear.MatmulOp()._plans((m, m), (m, m))
    mm_products = {name: (plan(), False) for name, plan in mm.items()}
    precisions = [
        (torch.bfloat16, "tf32"),
        (torch.float32, "tf32x3"),
        (torch.float16, "tf32"),
        (torch.float32, "tf32"),
        (torch.float32, "ieee"),
        (torch.float64, "ieee"),
    ]
    out = [(f"matmul {m}^3", torch.bfloat16, "tf32", mm_products)]
    for fin, fout in gpt2:  # the GPT-2 layers before the other dtypes: the budget may end the run
        products = linear.LinearOp.products([(tokens, fin), (fout, fin)])
        out.append(
            (f"linear {tokens}x{fin}->{fout}", torch.bfloat16, "tf32",
             {name: (p, name == "forward") for name, p in products.items()})
        )  # fmt: skip
    for dtype, precision in precisions[1:]:
        out.append((f"matmul {m}^3", dtype, precision, mm_products))
    label = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
    for case in out:
        tag = f"{label[case[1]]}-{case[2]}" if case[1] == torch.float32 else label[case[1]]
        if not selected or any(s in tag or s in case[0] for s in selected):
            yield case[0], case[1], case[2], case[3], tag


def operand(p_sizes, strides, dtype, gen):
    """A random operand laid out with ``strides`` (a transposed one is a view of its storage)."""
    extent = 1 + sum((s - 1) * st for s, st in zip(p_sizes, strides))
    storage = torch.randn(extent, generator=gen, device=DEV, dtype=torch.float32).to(dtype)
    return storage, torch.as_strided(storage, p_sizes, strides)


def cublas(name, xv, yv, z, bias):
    if bias is not None:
        return lambda: torch.addmm(bias, xv, yv, out=z)
    return lambda: torch.matmul(xv, yv, out=z)


def rel_err(z, ref):
    return float((z.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def describe(config):
    tiles = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']}s{config['num_stages']}"
    if config["kernel"] == "strided":
        return f"strided {tiles}"
    return tiles + (f" k/{config['SPLIT_K']}" if config["SPLIT_K"] > 1 else "") + (" sub" if config["SUBTILE"] else "")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=230.0, help="seconds after which no new product starts")
    parser.add_argument("--only", nargs="*", default=[], help="case or dtype tags (bf16, fp32-tf32x3, 768->3072, ...)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script on the CPU")
    args = parser.parse_args()
    assert args.smoke or torch.cuda.is_available(), "this benchmark needs the GPU"
    start = time.time()
    import triton

    print(f"{tuning.gpu_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"SMs {tuning.multiprocessors()}  tuning cache {tuning.cache_path()}", flush=True)  # fmt: skip
    gen = torch.Generator(device=DEV).manual_seed(0)
    if args.smoke:  # the interpreter's dot is float32-exact: compare with float64 all the same
        torch.backends.cuda.matmul.allow_tf32 = False
    rows, skipped = [], []
    print(f"{'case':24} {'product':11} {'dtype':12} {'teeny ms':>9} {'TF/s':>6} {'err':>8} | {'cuBLAS':>8} "
          f"{'TF/s':>6} {'err':>8} | {'x':>5}  config")  # fmt: skip
    for case, dtype, precision, products, tag in cases(args.only, args.smoke):
        for name, (p, has_bias) in products.items():
            if time.time() - start > args.budget:
                skipped.append(f"{case} {name} {tag}")
                continue
            sweep = []
            t0 = time.time()
            best = linear.choose_config(p, dtype, precision, has_bias, observe=lambda c, ms: sweep.append((ms, c)))
            tune_s = time.time() - t0
            xs, xv = operand((p.M, p.K), p.x, dtype, gen)
            ys, yv = operand((p.K, p.N), p.y, dtype, gen)
            bias = torch.randn(p.N, generator=gen, device=DEV).to(dtype) if has_bias else None
            z = torch.empty(p.M, p.N, device=DEV, dtype=dtype)
            ref = xv.double() @ yv.double()
            if bias is not None:
                ref += bias.double()
            scratch = lambda s, d: torch.empty(s, device=DEV, dtype=d)  # noqa: E731
            configs = [best]
            if tag == "bf16" and case.startswith("matmul"):
                configs.append(linear._STRIDED_CANDIDATES["half"][0])
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32" and dtype == torch.float32
            flops = 2 * p.M * p.N * p.K
            zc = torch.empty_like(z)
            c_ms = tuning.time_ms(cublas(name, xv, yv, zc, bias))
            c_err = rel_err(zc, ref)
            for config in configs:
                launches = linear.product_launches(p, xs, ys, z, bias, dtype, precision, config, scratch)

                def run(launches=launches):
                    for launch in launches:
                        run_launch(launch, launch.kernel.instance(dtype), "sweep", p.work())

                ms = tuning.time_ms(run)
                err = rel_err(z, ref)
                row = dict(case=case, product=name, dtype=tag, teeny_ms=ms, teeny_tflops=flops / ms / 1e9,
                           teeny_err=err, cublas_ms=c_ms, cublas_tflops=flops / c_ms / 1e9, cublas_err=c_err,
                           config=config, tune_s=tune_s,
                           sweep=[(m, describe(c)) for m, c in sorted(sweep, key=lambda t: t[0] or 1e9)])  # fmt: skip
                rows.append(row)
                print(
                    f"{case:24} {name:11} {tag:12} {ms:9.3f} {row['teeny_tflops']:6.0f} {err:8.1e} | {c_ms:8.3f} "
                    f"{row['cublas_tflops']:6.0f} {c_err:8.1e} | {c_ms / ms:5.2f}  {describe(config)}",
                    flush=True,
                )
            if sweep:
                timed = sorted(sweep, key=lambda t: t[0] if t[0] is not None else 1e9)
                cells = ", ".join(
                    f"{describe(c)} {m:.3f}" if m is not None else f"{describe(c)} FAIL" for m, c in timed
                )
                print(f"    sweep ({tune_s:.0f} s): {cells}", flush=True)
            del xs, ys, z, zc, ref
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    if skipped:
        print(f"skipped (budget {args.budget:.0f} s): {'; '.join(skipped)}")
    print(f"total {time.time() - start:.0f} s")
    (OUT / "matmul_sweep.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
