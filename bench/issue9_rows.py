"""The issue-9 rows for the matrix products, the bias gradient and gelu, side by side in one run.

    PYTHONPATH=src python3 bench/issue9_rows.py [--budget 200] [--only matmul linear bias gelu]

Forward + backward per case, in ms:
* ``graph``: teeny's program (forward_train + backward) captured in a CUDA graph: kernels alone;
* ``apply``: teeny through ``interop.torch.apply`` (host work included), timed with do_bench;
* ``eager`` and ``compile``: PyTorch (cuBLAS for the products), timed with do_bench;
plus TFLOP/s for the products, the relative error (Frobenius) of the output and of each
input gradient against float64 for teeny and eager, and the peak memory of one fwd+bwd.

The bias gradient rows time ``common.sum_to_shape`` (what linear's backward launches for db)
against the copy ceiling measured here (a 1 GiB device-to-device copy). The gelu rows sweep the
unary pair's launch (BLOCK elements per program and num_warps) and time two variants of the
maths on the best launch: a copy (y = x, dx = dy: the kernels' structure alone) and gelu with
libdevice's tanh (where teeny's own tanh goes through expm1); the floor is 20 bytes per element
over the copy bandwidth. Linear layers are tuned at lowering: run bench/matmul_sweep.py first
in the same place ($OUT/tuning.json is shared) and the lowering here times nothing new.
Stops starting new cases after ``--budget`` seconds (default 200): about three and a half
minutes with the sweep's cache, more without it. Results also go to $OUT/issue9_rows.json.
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
from triton.language.extra import libdevice  # noqa: E402
# isort: on

import teeny.kernels.activation as activation  # noqa: E402
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


@triton.jit
def _gelu_libdevice(x, a, b):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit
def _gelu_libdevice_grad(x, dy, a, b):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = libdevice.tanh(inner)
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


def copy_act(x):
    return activation._activation(x, "copy", _copy, _copy_grad)


def gelu_libdevice(x):
    return activation._activation(x, "gelu_libdevice", _gelu_libdevice, _gelu_libdevice_grad)


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
    a = torch.empty(2**16 if SMOKE else 2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = tuning.time_ms(lambda: b.copy_(a), reps=10)
    return 2 * a.numel() / (ms * 1e-3)


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


def bias_case(rows, cols, dtype, bandwidth):
    dy = torch.randn(rows, cols, device=DEV).to(dtype)
    db = torch.empty(cols, device=DEV, dtype=dtype)
    launches = sum_to_shape(_Scratch(), dy, (rows, cols), db)

    def run():
        for launch in launches:
            run_launch(launch, launch.kernel.instance(dtype), "bias gradient", cols)

    ms = tuning.time_ms(run, reps=20)
    err = rel(db, dy.double().sum(0))
    eager = tuning.time_ms(lambda: dy.sum(0), reps=20)
    nbytes = dy.numel() * dy.element_size() + cols * db.element_size()
    return {
        "case": f"bias gradient {str(dtype)[6:]} {rows}x{cols}",
        "graph": ms,
        "eager": eager,
        "floor": nbytes / bandwidth * 1e3,
        "launches": len(launches),
        "teeny_err": err,
        "bandwidth_pct": nbytes / (ms * 1e-3) / bandwidth * 100,
    }


GELU_BLOCKS = [(1024, None), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (512, 4)]


def gelu_rows(bandwidth, with_compile):
    n = 2**12 if SMOKE else 2**27
    x = torch.randn(n, device=DEV)
    grad = torch.randn(n, device=DEV)
    floor = 20 * n / bandwidth * 1e3
    original = activation.ActivationOp.block
    rows, sweep = [], []
    try:
        for size, warps in GELU_BLOCKS:
            activation.ActivationOp.block = lambda self, b=Block(size, warps): b
            ms, _ = teeny_graph_ms(lambda t: ops.gelu(t, "tanh"), [x], grad)
            sweep.append((ms, size, warps))
        best_ms, size, warps = min(sweep)
        activation.ActivationOp.block = lambda self, b=Block(size, warps): b
        copy_ms, _ = teeny_graph_ms(copy_act, [x], grad)
        if not SMOKE:  # the interpreter has no libdevice
            lib_ms, (out, (dx,)) = teeny_graph_ms(gelu_libdevice, [x], grad)
    finally:
        activation.ActivationOp.block = original
    row = product_case(f"gelu (tanh) fp32 {n}", lambda t: ops.gelu(t, "tanh"),
                       lambda t: F.gelu(t, approximate="tanh"), [x], 0, with_compile)  # fmt: skip
    row["floor"] = floor
    row["sweep"] = [f"{s}/{w or 'default'} {m:.3f}" for m, s, w in sorted(sweep)]
    rows.append(row)
    ref = F.gelu(x.double(), approximate="tanh")
    rows.append({"case": f"  best launch {size}/{warps or 'default'}", "graph": best_ms, "floor": floor})
    rows.append({"case": "  copy maths (structure alone)", "graph": copy_ms, "floor": floor})
    if not SMOKE:
        rows.append({"case": "  gelu with libdevice tanh", "graph": lib_ms, "floor": floor, "teeny_err": rel(out, ref)})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=200.0)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out (~10 s to compile a case)")
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
    # cheapest and most wanted first: the budget may stop the run before the last ones
    cases = [("gelu", lambda: gelu_rows(bw, not args.no_compile))]
    for cols in (40,) if SMOKE else (768, 3072, 50304):
        cases.append(("bias", lambda cols=cols: bias_case(tokens, cols, torch.bfloat16, bw)))
    cases.append(
        ("matmul", lambda: product_case(f"matmul bf16 {m}^3", ops.matmul, torch.matmul,
                                        [rand(m, m), rand(m, m)], 6 * m**3, not args.no_compile))
    )  # fmt: skip
    for fin, fout in layers:
        cases.append(
            ("linear", lambda fin=fin, fout=fout: product_case(
                f"linear bf16 {tokens}x{fin}->{fout}", ops.linear, F.linear,
                [rand(tokens, fin), rand(fout, fin, scale=fin**-0.5), rand(fout)], 6 * tokens * fin * fout,
                not args.no_compile and fout == 3072))
        )  # fmt: skip
    cases.append(
        ("linear", lambda: product_case(f"linear fp32 {tokens}x{big}->{big}", ops.linear, F.linear,
                                        [rand(tokens, big, dtype=torch.float32), rand(big, big, dtype=torch.float32),
                                         rand(big, dtype=torch.float32)], 6 * tokens * big**2, not args.no_compile))
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
    if "bandwidth_pct" in r:
        extra += f"  {r['bandwidth_pct']:.0f}% of copy bandwidth, {r['launches']} launches"
    if "sweep" in r:
        extra += "\n    launch sweep (BLOCK/warps ms): " + ", ".join(r["sweep"])
    return f"{r['case']:36} {cells}{extra}"


if __name__ == "__main__":
    main()
