"""GPU time of the norm and loss kernels (forward + backward), teeny against PyTorch eager.

    PYTHONPATH=src python3 bench/bench_norm_loss.py [--only NAME ...]     (about 2 minutes on an H200)
    PYTHONPATH=src python3 bench/bench_norm_loss.py --only 8192x768 --sweep   (the fused backward's programs)
    PYTHONPATH=src python3 bench/bench_norm_loss.py --only sums --sum-sweep   (sum_to_shape's tiles)

teeny runs through its ``Executor`` (zero_grad, forward_train, backward) captured once as a CUDA
graph and replayed, so the numbers time the kernels, not the Python host path (bench/NOTES.md:
host time made sub-millisecond cases swing 2x between runs). PyTorch eager is timed as it runs.
Each case first checks teeny's output and input gradient against eager (relative error).
``--sweep`` times the selected cases again for each number of programs of the fused norm
backward (``norm.PROGRAMS_PER_SM``) and row tile (``norm.GPU_TILE``); ``--sum-sweep`` those
of the column and scalar sums (``common._SUM_TILE``, ``_SUM_WIDTH``, ``_PARTIAL_STEPS``). The
same script runs on any commit of teeny (it uses only the public API): run it before and after a
kernel change in one session. Results go to stdout and, when ``$OUT`` is set, to
``$OUT/bench_norm_loss.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

import teeny
from teeny import Executor, Graph, LoweringMode, lower, ops

DEV = "cuda"


def _teeny_step(build, inputs: dict, params: dict, grad_output):
    """A zero-argument function running one training step of the graph ``build`` makes."""
    g = Graph()
    symbols = {
        name: g.input(name, tuple(t.shape), t.dtype, requires_grad=t.is_floating_point()) for name, t in inputs.items()
    }
    weights = {name: g.parameter(name, tuple(t.shape), dtype=t.dtype) for name, t in params.items()}
    g.output(build(**symbols, **weights))
    ex = Executor(lower(g, LoweringMode.TRAINING), params=params)
    result = {}

    def step():
        ex.zero_grad()
        out, cache = ex.forward_train(inputs)
        result["out"] = out
        result["grads"] = ex.backward(cache, grad_output)

    return step, result


def _graph_replay(step):
    """``step`` captured as a CUDA graph (after a warm-up that compiles the kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make_cases() -> list[dict]:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    rows, cols = 16384, 4096
    h = torch.randn(rows, cols, device=DEV, dtype=bf16)
    w = torch.rand(cols, device=DEV, dtype=bf16) + 0.5
    b = torch.randn(cols, device=DEV, dtype=bf16)
    dy = torch.randn(rows, cols, device=DEV, dtype=bf16)
    wide = torch.randn(rows, cols + 64, device=DEV, dtype=bf16)
    img = torch.randn(64, 256, 32, 32, device=DEV, dtype=bf16)
    cw, cb = torch.rand(256, device=DEV, dtype=bf16) + 0.5, torch.randn(256, device=DEV, dtype=bf16)
    logits = torch.randn(8192, 32000, device=DEV, dtype=bf16)
    target = torch.randint(0, 32000, (8192,), device=DEV)
    target[::7] = -100
    big = torch.randn(2**26, device=DEV)
    big_t = torch.randn(2**26, device=DEV)
    n_norm = rows * cols
    short = dict(x=torch.randn(8192, 768, device=DEV, dtype=bf16), dy=torch.randn(8192, 768, device=DEV, dtype=bf16))
    wide8192 = torch.randn(8192, 4096, device=DEV, dtype=bf16)
    short_w, short_b = torch.rand(768, device=DEV, dtype=bf16) + 0.5, torch.randn(768, device=DEV, dtype=bf16)
    return [
        dict(
            name="layer_norm bf16 8192x768 (GPT-2's rows)",
            inputs={"x": short["x"]},
            params={"w": short_w, "b": short_b},
            grad=short["dy"],
            teeny=lambda x, w, b: ops.layer_norm(x, (768,), w, b),
            torch=lambda x, w, b: F.layer_norm(x, (768,), w, b),
            bytes=5 * 2 * 8192 * 768,
        ),
        dict(
            name="layer_norm bf16 16384x4096",
            inputs={"x": h},
            params={"w": w, "b": b},
            grad=dy,
            teeny=lambda x, w, b: ops.layer_norm(x, (cols,), w, b),
            torch=lambda x, w, b: F.layer_norm(x, (cols,), w, b),
            bytes=5 * 2 * n_norm,
        ),
        dict(
            name="layer_norm bf16 16384x4096, dy a row-strided slice",
            inputs={"x": h},
            params={"w": w, "b": b},
            grad=wide[:, 32 : 32 + cols],
            teeny=lambda x, w, b: ops.layer_norm(x, (cols,), w, b),
            torch=lambda x, w, b: F.layer_norm(x, (cols,), w, b),
            bytes=5 * 2 * n_norm,
        ),
        dict(
            name="rms_norm bf16 16384x4096",
            inputs={"x": h},
            params={"w": w},
            grad=dy,
            teeny=lambda x, w: ops.rms_norm(x, (cols,), w, 1e-6),
            torch=lambda x, w: F.rms_norm(x, (cols,), w, 1e-6),
            bytes=5 * 2 * n_norm,
        ),
        dict(
            name="group_norm bf16 64x256x32x32, 32 groups",
            inputs={"x": img},
            params={"w": cw, "b": cb},
            grad=torch.randn_like(img),
            teeny=lambda x, w, b: ops.group_norm(x, 32, w, b),
            torch=lambda x, w, b: F.group_norm(x, 32, w, b),
            bytes=5 * 2 * img.numel(),
        ),
        dict(
            name="batch_norm bf16 64x256x32x32 training",
            inputs={"x": img},
            params={"w": cw, "b": cb},
            grad=torch.randn_like(img),
            teeny=lambda x, w, b: ops.batch_norm(x, None, None, w, b, training=True),
            torch=lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
            bytes=5 * 2 * img.numel(),
        ),
        dict(
            name="cross_entropy bf16 8192x32000 (ignore_index rows)",
            inputs={"x": logits, "t": target},
            params={},
            grad=None,
            teeny=lambda x, t: ops.cross_entropy(x, t),
            torch=lambda x, t: F.cross_entropy(x, t),
            bytes=3 * 2 * logits.numel(),
        ),
        dict(
            name="cross_entropy bf16 8192x32000 label_smoothing 0.1",
            inputs={"x": logits, "t": target},
            params={},
            grad=None,
            teeny=lambda x, t: ops.cross_entropy(x, t, label_smoothing=0.1),
            torch=lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
            bytes=3 * 2 * logits.numel(),
        ),
        dict(
            name="sums: bias add bf16 8192x4096 (db: column sums)",
            inputs={"x": wide8192},
            params={"b": torch.randn(4096, device=DEV, dtype=bf16)},
            grad=torch.randn_like(wide8192),
            teeny=lambda x, b: ops.add(x, b),
            torch=lambda x, b: x + b,
            bytes=5 * 2 * wide8192.numel(),
        ),
        dict(
            name="sums: mse_loss bf16 8192x4096 mean (one scalar from many partials)",
            inputs={"x": wide8192, "t": torch.randn_like(wide8192)},
            params={},
            grad=None,
            teeny=lambda x, t: ops.mse_loss(x, t),
            torch=lambda x, t: F.mse_loss(x, t),
            bytes=5 * 2 * wide8192.numel(),
        ),
        dict(
            name="mse_loss fp32 2^26 mean",
            inputs={"x": big, "t": big_t},
            params={},
            grad=None,
            teeny=lambda x, t: ops.mse_loss(x, t),
            torch=lambda x, t: F.mse_loss(x, t),
            bytes=5 * 4 * big.numel(),
        ),
    ]


def _torch_step(case):
    """PyTorch eager forward + backward of the case; returns (step, output, first input's gradient)."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in case["inputs"].items()}
    params = {k: v.detach().clone().requires_grad_() for k, v in case["params"].items()}
    wanted = [t for t in [*leaves.values(), *params.values()] if t.requires_grad]

    def step():
        out = case["torch"](**leaves, **params)
        grad = case["grad"] if case["grad"] is not None else torch.ones_like(out)
        return out, torch.autograd.grad(out, wanted, grad)

    return step


def run(case) -> dict:
    step, result = _teeny_step(case["teeny"], case["inputs"], case["params"], case["grad"])
    torch_step = _torch_step(case)
    step()
    ref_out, ref_grads = torch_step()
    first = next(iter(case["inputs"]))
    err_out = _rel(result["out"], ref_out)
    err_grad = _rel(result["grads"][first], ref_grads[0])
    try:
        replay = _graph_replay(step)
        teeny_ms = triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median")
    except Exception as exc:  # a capture failure: report the eager path instead
        print(f"  capture failed ({type(exc).__name__}: {exc}); timing without a CUDA graph")
        teeny_ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    torch_ms = triton.testing.do_bench(torch_step, warmup=25, rep=200, return_mode="median")
    return dict(
        name=case["name"],
        teeny_ms=teeny_ms,
        torch_eager_ms=torch_ms,
        teeny_tb_s=case["bytes"] / (teeny_ms * 1e-3) / 1e12,
        rel_err_out=err_out,
        rel_err_grad=err_grad,
    )


def sweep(cases: list[dict]) -> None:
    """Each case again for every (programs per SM, row tile) of the fused norm backward."""
    from teeny.kernels import norm

    default = (norm.PROGRAMS_PER_SM, norm.GPU_TILE)
    print("| case | programs per SM | tile | teeny ms (graph) | TB/s |")
    print("|---|---|---|---|---|")
    try:
        for case in (c for c in cases if "norm" in c["name"] and "sums" not in c["name"]):
            for programs in (1, 2, 4, 8, 16):
                for tile in (2048, 4096, 8192, 16384):
                    norm.PROGRAMS_PER_SM, norm.GPU_TILE = programs, tile
                    r = run(case)
                    mark = " (default)" if (programs, tile) == default else ""
                    print(f"| {r['name']} | {programs} | {tile}{mark} | {r['teeny_ms']:.4f} | {r['teeny_tb_s']:.2f} |")
    finally:
        norm.PROGRAMS_PER_SM, norm.GPU_TILE = default


def sum_sweep(cases: list[dict]) -> None:
    """Each case again for every (tile, widest contiguous tile, partial steps) of the sums."""
    from teeny.kernels import common

    default = (common._SUM_TILE, common._SUM_WIDTH, common._PARTIAL_STEPS)
    print("| case | tile | width | partial steps | teeny ms (graph) | TB/s |")
    print("|---|---|---|---|---|---|")
    try:
        for case in (c for c in cases if c["name"].startswith("sums:")):
            for tile, width, steps in ((2048, 64, 10**9), (2048, 64, 4), (4096, 128, 4), (8192, 64, 4),
                                       (8192, 128, 4), (8192, 256, 4), (16384, 256, 4)):  # fmt: skip
                common._SUM_TILE, common._SUM_WIDTH, common._PARTIAL_STEPS = tile, width, steps
                r = run(case)
                mark = " (default)" if (tile, width, steps) == default else ""
                row = f"| {r['name']} | {tile} | {width} | {steps}{mark} | {r['teeny_ms']:.4f}"
                print(f"{row} | {r['teeny_tb_s']:.2f} |")
    finally:
        common._SUM_TILE, common._SUM_WIDTH, common._PARTIAL_STEPS = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run the cases whose name contains one of these")
    parser.add_argument("--sweep", action="store_true", help="also sweep the fused norm backward's programs and tile")
    parser.add_argument("--sum-sweep", action="store_true", help="also sweep sum_to_shape's tiles and partial steps")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"teeny {teeny.__file__}; {device}; torch {torch.__version__}, triton {triton.__version__}")
    results = []
    print("| case (fwd+bwd) | teeny ms (graph) | TB/s | torch eager ms | rel err out / dx |")
    print("|---|---|---|---|---|")
    for case in make_cases():
        if args.only and not any(s in case["name"] for s in args.only):
            continue
        r = run(case)
        results.append(r)
        print(
            f"| {r['name']} | {r['teeny_ms']:.3f} | {r['teeny_tb_s']:.2f} | {r['torch_eager_ms']:.3f} | "
            f"{r['rel_err_out']:.1e} / {r['rel_err_grad']:.1e} |",
            flush=True,
        )
    chosen = [c for c in make_cases() if not args.only or any(s in c["name"] for s in args.only)]
    if args.sweep:
        sweep(chosen)
    if args.sum_sweep:
        sum_sweep(chosen)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_norm_loss.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
