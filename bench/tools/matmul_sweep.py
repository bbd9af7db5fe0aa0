"""Sweep teeny's matmul configurations on the GPU against cuBLAS, product by product.

    PYTHONPATH=src python3 bench/tools/matmul_sweep.py [--budget 120] [--only bf16 768->768 ...]

For each case and each of its three products (forward, and the two gradients: dA/dX and
dB/dW, operands read in place in their layouts), this runs teeny's tuning pass
(``products.tuning.choose_config``: every candidate timed inside a CUDA graph, the winner written to the
tuning cache, ``$OUT/tuning.json`` unless TEENY_TUNING_CACHE is set), checks every candidate's
result (a wrong one is marked WRONG), then times the winner and cuBLAS (torch.matmul /
torch.addmm on the same strided views, also in a CUDA graph) on the same data, and prints
TFLOP/s and the relative error (Frobenius, on up to 512 rows) of both against float64.

linear's dW also computes the bias gradient (the row sums of dY^T, fused into the product or
not, as tuned): its cuBLAS column is cuBLAS dW plus torch's dY.sum(0), and ``dW alone`` is
teeny's winner without the row sums.

Cases, most wanted first (the budget may stop the run): the GPT-2-small linear layers at
M = 8192 tokens (768->768, 768->3072, 3072->768, 768->50304) in bf16; float32 (tf32x3, teeny's
default) for linear 8192x4096->4096 and at 4096^3; bf16 at 4096^3; then the small MLP's layers
(128 rows; ``--only mlp``), timed although teeny does not time products that small when it
lowers (the heuristic's pick, ``default``, is printed beside the winner). ``--tokens 4096
--conv1d`` sweeps the layers of the patched transformers GPT-2 instead (8 x 512 tokens, weights
stored (in, out), c_attn 768->2304 among them). The run stops starting
new products after ``--budget`` seconds and says which it skipped. Results also go to
$OUT/matmul_sweep.json.
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
from teeny.core import tuning  # noqa: E402
from teeny.core.runtime import run_launch  # noqa: E402
from teeny.fusions.transposed_weights import TransposedWeightLinearOp  # noqa: E402
from teeny.ops.products import launches as products_launches  # noqa: E402
from teeny.ops.products import tuning as products_tuning  # noqa: E402
from teeny.ops.products.ops import LinearOp, MatmulOp  # noqa: E402

DEV = teeny.DEVICE
GPT2 = [(768, 768), (768, 3072), (3072, 768), (768, 50304)]
GPT2_CONV1D = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # transformers' GPT-2: c_attn, c_proj, c_fc, c_proj
TOKENS = 8192
MLP, MLP_ROWS = [(784, 256), (256, 256), (256, 10)], 128  # bench/steps.py's small MLP, batch 128
CHECK_ROWS = 256  # rows from each end of Z compared with float64


def cases(selected, smoke: bool = False, tokens: int = TOKENS, conv1d: bool = False):
    """(case name, dtype, precision, {product name: (Product, has_bias, row_sums)}, tag);
    ``smoke``: tiny sizes (a check of this script under the interpreter); ``tokens``: the rows
    of the GPT-2 layers; ``conv1d``: their weights stored (in, out), as transformers' Conv1D
    keeps them (``TransposedWeightLinearOp``: dW written transposed, db fused as in linear)."""
    m, gpt2, big = (40, [(24, 40)], 24) if smoke else (4096, GPT2_CONV1D if conv1d else GPT2, 4096)
    tokens = 37 if smoke else tokens
    mlp_rows, mlp = (24, [(40, 10)]) if smoke else (MLP_ROWS, MLP)
    mm = {name: (plan(), False, False) for name, plan in MatmulOp()._plans((m, m), (m, m)).items()}

    def linear_products(rows, fin, fout, transposed=False):
        if transposed:
            products = TransposedWeightLinearOp.products([(rows, fin), (fin, fout)])
        else:
            products = LinearOp.products([(rows, fin), (fout, fin)])
        return {name: (p, name == "forward", name == "grad_weight") for name, p in products.items()}

    kind = "conv1d" if conv1d else "linear"
    out = [(f"{kind} {tokens}x{fin}->{fout}", torch.bfloat16, "tf32", linear_products(tokens, fin, fout, conv1d))
           for fin, fout in gpt2]  # fmt: skip
    out.append((f"linear {tokens}x{big}->{big}", torch.float32, "tf32x3", linear_products(tokens, big, big)))
    out.append((f"matmul {m}^3", torch.float32, "tf32x3", mm))
    out.append((f"matmul {m}^3", torch.bfloat16, "tf32", mm))
    for dtype, precision in ((torch.float32, "tf32x3"), (torch.bfloat16, "tf32")):
        for fin, fout in mlp:  # small products (timed although under products.tuning.TUNE_MIN_MACS)
            out.append((f"mlp linear {mlp_rows}x{fin}->{fout}", dtype, precision, linear_products(mlp_rows, fin, fout)))
    label = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
    for case, dtype, precision, products in out:
        tag = f"{label[dtype]}-{precision}" if dtype == torch.float32 else label[dtype]
        if not selected or any(s in tag or s in case for s in selected):
            yield case, dtype, precision, products, tag


def operand(p_sizes, strides, dtype, gen):
    """A random operand laid out with ``strides`` (a transposed one is a view of its storage)."""
    extent = 1 + sum((s - 1) * st for s, st in zip(p_sizes, strides))
    storage = torch.randn(extent, generator=gen, device=DEV, dtype=torch.float32).to(dtype)
    return storage, torch.as_strided(storage, p_sizes, strides)


def rel_err(z, ref):
    return float((z.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def describe(config):
    tiles = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']}s{config['num_stages']}"
    if config["kernel"] == "strided":
        return f"strided {tiles}" + (" fma" if config.get("PRECISION") == "ieee" else "")
    if config["kernel"] == "ws":  # matmul_ws (Gluon): two warpgroups on 128 x 192 tiles
        return f"ws {tiles}" + ("" if config.get("FUSED_SUMS", True) else " unfused")
    flags = [(f"sk{config['STREAM_K']}", config["STREAM_K"]), ("sub", config["SUBTILE"]),
             ("x2", config["OCCUPANCY"] == 2), ("kmajor", config["K_MAJOR"]),
             ("unfused", not config.get("FUSED_SUMS", True)), ("fma", config.get("PRECISION") == "ieee")]  # fmt: skip
    return tiles + "".join(f" {name}" for name, on in flags if on)


def graph_ms(fn) -> float:
    return tuning.time_ms(fn)


def sweep_product(case, name, tag, p, dtype, precision, has_bias, with_sums, gen) -> dict:
    """Tune one product, check every candidate, time the winner against cuBLAS; print and return its row."""
    sweep = []
    t0 = time.time()
    wanted = dict(dtype=dtype, precision=precision, has_bias=has_bias, row_sums=with_sums)
    best = products_tuning.choose_config(p, **wanted, observe=lambda c, ms: sweep.append((ms, c)), time_small=True)
    default = products_tuning.default_config(p, **wanted)
    tune_s = time.time() - t0
    xs, xv = operand((p.M, p.K), p.x, dtype, gen)
    ys, yv = operand((p.K, p.N), p.y, dtype, gen)
    bias = torch.randn(p.N, generator=gen, device=DEV).to(dtype) if has_bias else None
    zs, z = operand((p.M, p.N), p.z, dtype, gen)  # Z as the product writes it (Conv1D's dW: transposed)
    sums = torch.empty(p.M, device=DEV, dtype=dtype) if with_sums else None
    ends = [torch.arange(CHECK_ROWS), torch.arange(p.M - CHECK_ROWS, p.M)]
    check = (torch.cat(ends) if p.M > 2 * CHECK_ROWS else torch.arange(p.M)).to(DEV)
    ref = xv[check].double() @ yv.double()
    if bias is not None:
        ref += bias.double()
    ref_sums = xv.double().sum(1) if with_sums else None
    scratch = lambda s, d: torch.empty(s, device=DEV, dtype=d)  # noqa: E731

    def teeny_run(config, sums=sums):
        launches = products_launches.product_launches(
            p, config, x=xs, y=ys, z=zs, bias=bias, dtype=dtype, precision=precision, scratch=scratch, row_sums=sums
        )

        def run():
            for launch in launches:
                run_launch(launch, launch.kernel.instance(dtype), "sweep", p.work())

        return run

    def error(config) -> float:
        zs.fill_(float("nan"))
        if sums is not None:
            sums.fill_(float("nan"))
        teeny_run(config)()
        err = rel_err(z[check], ref)
        return max(err, rel_err(sums, ref_sums)) if sums is not None else err

    flops = 2 * p.M * p.N * p.K
    zc = torch.empty(p.M, p.N, device=DEV, dtype=dtype)
    if bias is not None:
        c_ms = graph_ms(lambda: torch.addmm(bias, xv, yv, out=zc))
    else:
        c_ms = graph_ms(lambda: torch.matmul(xv, yv, out=zc))
    c_err = rel_err(zc[check], ref)
    extra = {}
    if with_sums:  # cuBLAS has no bias gradient: torch's column sum of dY beside it
        dy, db = xv.t(), torch.empty(p.M, device=DEV, dtype=dtype)
        extra["torch_sum_ms"] = graph_ms(lambda: torch.sum(dy, 0, out=db))
        extra["cublas_dw_ms"] = c_ms
        c_ms += extra["torch_sum_ms"]
    ms = graph_ms(teeny_run(best))
    err = error(best)
    if with_sums:
        extra["teeny_dw_alone_ms"] = graph_ms(teeny_run(best, None))
    checked = [(m, c, error(c) if m is not None else None) for m, c in sweep]
    wrong = [describe(c) for m, c, e in checked if e is not None and not e <= max(4 * c_err, 1e-5)]
    row = dict(case=case, product=name, dtype=tag, teeny_ms=ms, teeny_tflops=flops / ms / 1e9, teeny_err=err,
               cublas_ms=c_ms, cublas_tflops=flops / c_ms / 1e9, cublas_err=c_err, config=best, tune_s=tune_s,
               wrong=wrong, **extra,
               sweep=[(m, describe(c), e) for m, c, e in sorted(checked, key=lambda t: t[0] or 1e9)],
               )  # fmt: skip
    line = (
        f"{case:24} {name:11} {tag:12} {ms:9.3f} {row['teeny_tflops']:6.0f} {err:8.1e} | {c_ms:8.3f} "
        f"{row['cublas_tflops']:6.0f} {c_err:8.1e} | {c_ms / ms:5.2f}  {describe(best)}"
    )
    if with_sums:
        line += (
            f"\n    with the bias gradient; dW alone {extra['teeny_dw_alone_ms']:.3f} ms against cuBLAS "
            f"{extra['cublas_dw_ms']:.3f} ({extra['cublas_dw_ms'] / extra['teeny_dw_alone_ms']:.2f}x), "
            f"torch's dY.sum(0) {extra['torch_sum_ms']:.3f} ms"
        )
    default_ms = next((m for m, c in sweep if c == default), None)
    if default != best and default_ms is not None:
        line += f"\n    the untimed heuristic's pick: {describe(default)} {default_ms:.3f} ms"
    row["default"], row["default_ms"] = describe(default), default_ms
    print(line, flush=True)
    if wrong:
        print(f"    WRONG results from: {', '.join(wrong)}", flush=True)
    if sweep:
        timed = sorted(checked, key=lambda t: t[0] if t[0] is not None else 1e9)
        cells = ", ".join(f"{describe(c)} {m:.3f}" if m is not None else f"{describe(c)} FAIL" for m, c, _ in timed)
        print(f"    sweep ({tune_s:.0f} s): {cells}", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which no new product starts")
    parser.add_argument("--only", nargs="*", default=[], help="case or dtype tags (bf16, fp32-tf32x3, 768->3072, ...)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script on the CPU")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="rows of the GPT-2 layers' products")
    parser.add_argument("--conv1d", action="store_true", help="the GPT-2 layers with (in, out) weights, as Conv1D")
    args = parser.parse_args()
    assert args.smoke or torch.cuda.is_available(), "this benchmark needs the GPU"
    start = time.time()
    import triton

    print(f"{tuning.gpu_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"SMs {tuning.multiprocessors()}  tuning cache {tuning.cache_path()}", flush=True)  # fmt: skip
    gen = torch.Generator(device=DEV).manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS SGEMM: full precision, like teeny's default
    rows, skipped = [], []
    print(f"{'case':24} {'product':11} {'dtype':12} {'teeny ms':>9} {'TF/s':>6} {'err':>8} | {'cuBLAS':>8} "
          f"{'TF/s':>6} {'err':>8} | {'x':>5}  config")  # fmt: skip
    for case, dtype, precision, products, tag in cases(args.only, args.smoke, args.tokens, args.conv1d):
        for name, (p, has_bias, with_sums) in products.items():
            if time.time() - start > args.budget:
                skipped.append(f"{case} {name} {tag}")
                continue
            rows.append(sweep_product(case, name, tag, p, dtype, precision, has_bias, with_sums, gen))
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
    if skipped:
        print(f"skipped (budget {args.budget:.0f} s): {'; '.join(skipped)}")
    print(f"total {time.time() - start:.0f} s")
    (OUT / "matmul_sweep.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
