"""The issue-9 rows for the matrix products, the bias gradient and gelu, side by side in one run.

    PYTHONPATH=src python3 bench/issue9_rows.py [--budget 200] [--only matmul linear bias gelu]

Forward + backward per case, in ms:
* ``graph``: teeny's program (forward_train + backward) captured in a CUDA graph: kernels alone;
* ``apply``: teeny through ``interop.torch.apply`` (host work included), timed with do_bench;
* ``eager`` and ``compile``: PyTorch (cuBLAS for the products), timed with do_bench;
plus TFLOP/s for the products, the relative error (Frobenius) of the output and of each
input gradient against float64 for teeny and eager, and the peak memory of one fwd+bwd.

The bias gradient rows time linear's dW product for the GPT-2 layers with the bias gradient
(dY's column sums, fused into dW where the tuning chose so) and without it: the difference is
what the bias gradient costs; beside it ``common.sum_to_shape`` alone (the separate column sum)
and torch's dY.sum(0), against the copy floor. The copy bandwidth is the best of a 1 GiB
device-to-device copy three ways (copy_ in a CUDA graph, copy_ eagerly, an element-wise kernel
in a graph), each printed. The unary rows (gelu tanh, tanh, mish; fp32 2^27, forward +
backward) compare with the floor (20 bytes per element over the copy bandwidth); gelu also
sweeps the launch (BLOCK elements per program, num_warps) and times a copy through the same
kernels (y = x, dx = dy: their structure alone). Linear layers are tuned at lowering: run
bench/matmul_sweep.py first in the same place ($OUT/tuning.json is shared) and the lowering
here times nothing new. torch.compile runs for gelu only unless --compile-all (about 10 s a case).
Stops starting new cases after ``--budget`` seconds (default 60): about a minute with the
sweep's cache. Results also go to $OUT/issue9_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/teeny-bench"))
OUT.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("TEENY_TUNING_CACHE", str(OUT / "tuning.json"))

# isort: off
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import teeny.device  # noqa: E402  (chooses the device before triton is imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (the jit functions below need it in their globals)
# isort: on

import teeny.kernels.activation as activation  # noqa: E402
import teeny.kernels.linear as linear  # noqa: E402
from teeny import Executor, Graph, LoweringMode, lower, ops, tuning  # noqa: E402
from teeny.interop.torch import apply  # noqa: E402
from teeny.kernels.common import sum_to_shape  # noqa: E402
from teeny.runtime import Block, run_launch  # noqa: E402

DEV = teeny.DEVICE
SMOKE = False  # --smoke: tiny sizes, the script checked on the CPU


# ----------------------------------------------------------------------------- gelu variants


@triton.jit
def _copy(x, a, b):
    return x


@triton.jit
def _copy_grad(x, dy, a, b):
    return dy


def copy_act(x):
    return activation.apply_activation(x, "copy", _copy, _copy_grad)


# ----------------------------------------------------------------------------- timing


def do_bench(fn) -> float:
    if DEV.type != "cuda":
        return tuning.time_ms(fn, reps=2)
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def teeny_program(fn, inputs):
    g = Graph(getattr(fn, "__name__", "case"))
    syms = [g.input(f"x{i}", tuple(t.shape), t.dtype, requires_grad=True) for i, t in enumerate(inputs)]
    g.output(fn(*syms))
    return Executor(lower(g, LoweringMode.TRAINING)), {f"x{i}": t for i, t in enumerate(inputs)}


def teeny_graph_ms(fn, inputs, grad):
    """fwd+bwd of teeny's program captured in a CUDA graph; also returns one run's results."""
    ex, feed = teeny_program(fn, inputs)

    def step():
        out, cache = ex.forward_train(feed)
        return out, ex.backward(cache, grad)

    out, grads = step()
    result = (out.detach().clone(), [grads[f"x{i}"].clone() for i in range(len(inputs))])
    return tuning.time_ms(lambda: step(), reps=5), result


def fwd_bwd(fn, xs, grad):
    def run():
        out = fn(*xs)
        out.backward(grad)

    return run


def peak_mib(run) -> float:
    if DEV.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rel(a, b) -> float:
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp_min(1e-300))


def copy_bandwidth() -> float:
    """Bytes moved (read + write) per second by the best of three 1 GiB device-to-device copies:
    run 3 measured 2.71 TB/s for copy_ captured in a CUDA graph, where kernels reach 4.24."""
    a = torch.empty(2**12 if SMOKE else 2**28, dtype=torch.float32, device=DEV)
    b = torch.empty_like(a)
    nbytes = 2 * a.numel() * a.element_size()
    ways = {
        "copy_ in a graph": tuning.time_ms(lambda: b.copy_(a), reps=10),
        "copy_ eagerly": do_bench(lambda: b.copy_(a)),
        "mul by 1 in a graph": tuning.time_ms(lambda: torch.mul(a, 1.0, out=b), reps=10),
    }
    print("copy 1 GiB: " + ", ".join(f"{way} {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s" for way, ms in ways.items()))
    return nbytes / (min(ways.values()) * 1e-3)


# ----------------------------------------------------------------------------- cases


def product_case(name, teeny_fn, torch_fn, inputs, flops, with_compile=True):
    """One fwd+bwd case of a product: every column, errors against float64."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref_in = [t.detach().double().requires_grad_(True) for t in inputs]
    ref_out = torch_fn(*ref_in)
    grad = torch.randn(ref_out.shape, device=DEV, dtype=torch.float32).to(inputs[0].dtype)
    ref_out.backward(grad.double())
    row = {"case": name}
    ms, (out, grads) = teeny_graph_ms(teeny_fn, inputs, grad)
    row["graph"] = ms
    row["teeny_err"] = max([rel(out, ref_out)] + [rel(g, r.grad) for g, r in zip(grads, ref_in)])
    row["apply"] = do_bench(fwd_bwd(lambda *xs: apply(teeny_fn, *xs), leaves, grad))
    row["teeny_peak_mib"] = peak_mib(fwd_bwd(lambda *xs: apply(teeny_fn, *xs), leaves, grad))
    eager_in = [t.detach().clone().requires_grad_(True) for t in inputs]
    eager_out = torch_fn(*eager_in)
    eager_out.backward(grad)
    row["eager_err"] = max([rel(eager_out, ref_out)] + [rel(t.grad, r.grad) for t, r in zip(eager_in, ref_in)])
    row["eager"] = do_bench(fwd_bwd(torch_fn, leaves, grad))
    row["eager_peak_mib"] = peak_mib(fwd_bwd(torch_fn, leaves, grad))
    if with_compile:
        compiled = torch.compile(torch_fn)
        compiled(*leaves).backward(grad)
        row["compile"] = do_bench(fwd_bwd(compiled, leaves, grad))
    if flops:
        for col in ("graph", "eager"):
            row[f"{col}_tflops"] = flops / (row[col] * 1e-3) / 1e12
    return row


class _Scratch:
    """What sum_to_shape needs of an OpContext: somewhere to put its partials."""

    def empty(self, shape, dtype=None):
        return torch.empty(tuple(shape), dtype=dtype, device=DEV)


def bias_case(tokens, fin, fout, bandwidth):
    """linear's dW for a (tokens, fin) -> fout layer with and without the bias gradient, its
    tuned configuration; the separate column sum; torch's."""
    dtype = torch.bfloat16
    p = linear.LinearOp.products([(tokens, fin), (fout, fin)])["grad_weight"]
    config = linear.choose_config(p, dtype, "tf32", False, row_sums=True)
    dy = torch.randn(tokens, fout, device=DEV).to(dtype)
    x = torch.randn(tokens, fin, device=DEV).to(dtype)
    dw = torch.empty(fout, fin, device=DEV, dtype=dtype)
    db = torch.empty(fout, device=DEV, dtype=dtype)
    scratch = _Scratch().empty

    def timed(launches):
        def run():
            for launch in launches:
                run_launch(launch, launch.kernel.instance(dtype), "bias gradient", fout)

        return tuning.time_ms(run, reps=20)

    with_db = timed(linear.product_launches(p, dy, x, dw, None, dtype, "tf32", config, scratch, db))
    err = rel(db, dy.double().sum(0))
    alone = timed(linear.product_launches(p, dy, x, dw, None, dtype, "tf32", config, scratch, None))
    separate_launches = sum_to_shape(_Scratch(), dy, (tokens, fout), db)
    separate = timed(separate_launches)
    eager = tuning.time_ms(lambda: dy.sum(0), reps=20)
    nbytes = dy.numel() * dy.element_size() + fout * db.element_size()
    how = "fused" if config.get("FUSED_SUMS", True) and config["kernel"] == "tma" else "separate"
    return {
        "case": f"bias gradient bf16 {tokens}x{fout} ({how})",
        "graph": with_db - alone,
        "eager": eager,
        "floor": nbytes / bandwidth * 1e3,
        "teeny_err": err,
        "dw_ms": alone,
        "dw_db_ms": with_db,
        "separate_ms": separate,
        "separate_launches": len(separate_launches),
        "separate_pct": nbytes / (separate * 1e-3) / bandwidth * 100,
    }


GELU_BLOCKS = [(1024, None), (2048, 8), (4096, 8)]  # run 3: 1024 / default (4) warps fastest of 8


def unary_rows(bandwidth, with_compile):
    n = 2**12 if SMOKE else 2**27
    x = torch.randn(n, device=DEV)
    grad = torch.randn(n, device=DEV)
    floor = 20 * n / bandwidth * 1e3
    original = activation.ActivationOp.block
    sweep = []
    try:
        for size, warps in GELU_BLOCKS:
            activation.ActivationOp.block = lambda self, b=Block(size, warps): b
            ms, _ = teeny_graph_ms(lambda t: ops.gelu(t, "tanh"), [x], grad)
            sweep.append((ms, size, warps))
    finally:
        activation.ActivationOp.block = original
    copy_ms, _ = teeny_graph_ms(copy_act, [x], grad)
    rows = []
    for name, mine, theirs in [
        ("gelu (tanh)", lambda t: ops.gelu(t, "tanh"), lambda t: F.gelu(t, approximate="tanh")),
        ("tanh", ops.tanh, torch.tanh),
        ("mish", ops.mish, F.mish),
    ]:
        row = product_case(f"{name} fp32 {n}", mine, theirs, [x], 0, with_compile and name.startswith("gelu"))
        row["floor"] = floor
        if name.startswith("gelu"):
            row["sweep"] = [f"{s}/{w or 'default'} {m:.3f}" for m, s, w in sorted(sweep)]
        rows.append(row)
    rows.append({"case": "  copy through the unary kernels", "graph": copy_ms, "floor": floor})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out (~10 s to compile a case)")
    parser.add_argument("--compile-all", action="store_true", help="torch.compile every case, not only gelu")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, no torch.compile: check the script on the CPU"
    )
    args = parser.parse_args()
    global SMOKE
    SMOKE = args.smoke
    if SMOKE:
        args.no_compile = True
    start = time.time()
    print(f"{tuning.gpu_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    print(f"{'case (fwd+bwd, ms)':36} {'graph':>8} {'apply':>8} {'eager':>8} {'compile':>8} {'floor':>8}")
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS SGEMM: full precision, as teeny's default
    gen = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    m, tokens, big = (40, 37, 24) if SMOKE else (4096, 8192, 4096)
    layers = [(24, 40)] if SMOKE else [(768, 768), (768, 3072), (3072, 768), (768, 50304)]
    compile_all = args.compile_all and not args.no_compile
    # most wanted first: the budget may stop the run before the last ones
    cases = [("unary", lambda: unary_rows(bw, not args.no_compile))]
    for fin, fout in layers:
        cases.append(("bias", lambda fin=fin, fout=fout: bias_case(tokens, fin, fout, bw)))
    cases.append(
        ("linear", lambda: product_case(f"linear fp32 {tokens}x{big}->{big}", ops.linear, F.linear,
                                        [rand(tokens, big, dtype=torch.float32), rand(big, big, dtype=torch.float32),
                                         rand(big, dtype=torch.float32)], 6 * tokens * big**2, compile_all))
    )  # fmt: skip
    for fin, fout in layers:
        cases.append(
            ("linear", lambda fin=fin, fout=fout: product_case(
                f"linear bf16 {tokens}x{fin}->{fout}", ops.linear, F.linear,
                [rand(tokens, fin), rand(fout, fin, scale=fin**-0.5), rand(fout)], 6 * tokens * fin * fout,
                compile_all))
        )  # fmt: skip
    cases.append(
        ("matmul", lambda: product_case(f"matmul bf16 {m}^3", ops.matmul, torch.matmul,
                                        [rand(m, m), rand(m, m)], 6 * m**3, compile_all))
    )  # fmt: skip

    rows, skipped = [], []
    for tag, make in cases:
        if args.only and tag not in args.only:
            continue
        if time.time() - start > args.budget:
            skipped.append(tag)
            continue
        try:
            made = make()
        except Exception as exc:
            print(f"{tag}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        for row in made if isinstance(made, list) else [made]:
            rows.append(row)
            print(_line(row), flush=True)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    if skipped:
        print(f"skipped (budget): {', '.join(skipped)}")
    print(f"total {time.time() - start:.0f} s")
    (OUT / "issue9_rows.json").write_text(json.dumps({"copy_bandwidth": bw, "rows": rows}, indent=1, default=str))


def _line(r) -> str:
    cells = " ".join(f"{r[k]:8.3f}" if k in r else f"{'-':>8}" for k in ("graph", "apply", "eager", "compile", "floor"))
    extra = ""
    if "graph_tflops" in r:
        extra += f"  {r['graph_tflops']:.0f} vs {r['eager_tflops']:.0f} TFLOP/s"
    if "teeny_err" in r:
        extra += f"  err {r['teeny_err']:.1e}" + (f" (eager {r['eager_err']:.1e})" if "eager_err" in r else "")
    if "teeny_peak_mib" in r:
        extra += f"  peak {r['teeny_peak_mib']:.0f}/{r['eager_peak_mib']:.0f} MiB"
    if "dw_ms" in r:
        extra += (
            f"  (dW {r['dw_ms']:.3f}, dW + db {r['dw_db_ms']:.3f}; separate column sum {r['separate_ms']:.3f} ms, "
            f"{r['separate_pct']:.0f}% of copy bandwidth, {r['separate_launches']} launches)"
        )
    if "sweep" in r:
        extra += "\n    launch sweep (BLOCK/warps ms): " + ", ".join(r["sweep"])
    return f"{r['case']:36} {cells}{extra}"


if __name__ == "__main__":
    main()
