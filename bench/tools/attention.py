"""Attention on the GPU in depth: checks against float64, per-kernel times, the tile sweep.

(The headline rows, teeny against each SDPA backend, are the ``attention`` area of bench/ops.py
and go to the results file; this tool is for working on the kernels.)

    PYTHONPATH=src python3 bench/tools/attention.py [--sections check,warm,time,sweep,compile] [--budget 200]

Sections run in child processes (a crash or an illegal memory access costs only that process;
the next case runs in a fresh one), all within ``--budget`` seconds (about 4 minutes with the
process starts):

* ``check``: (12 processes at once) teeny on odd shapes against a float64 reference on the GPU
  (bf16, fp16, fp32, fp64: bool and float masks, causal, GQA, broadcast batch dims, dropout
  whose mask must equal the numpy Philox reference bit for bit, issue 17's float64 bool-mask
  cases at 1e-12).
* ``warm``: every teeny kernel the timing sections use, compiled into Triton's on-disk cache by
  several processes at once (so that the serial sections below do not wait for compiles).
* ``time``: bf16 forward + backward at 4x16x2048x64, 8x12x1024x64 and 4x16x2048x128, causal,
  key-padding masked, and GQA (4 key/value heads): teeny's launches captured in a CUDA graph
  (total, forward alone, and per kernel from the profiler), against each torch SDPA backend
  that runs the case (eager, and captured in a CUDA graph too), with TFLOP/s, the error of each
  against a float64 reference (max |x - ref| / max |ref|, output and dq, dk, dv) and peak memory.
* ``sweep``: tile configurations of the three kernels at 4x16x2048x{64,128} causal, per kernel
  time from the profiler; ``BENCH_SWEEP="8x16x1024x64:gqa causal,..."`` sweeps those shapes and
  variants instead (then ``warm`` compiles only the sweep's kernels).
* ``compile``: torch.compile of SDPA forward + backward at the first shape, if time is left.

``BENCH_DTYPE=float32`` times and sweeps float32 instead (tf32x3 products): causal at GPT 4L's
64x8x128x32 (``teeny train gpt --size large``), GPT-2's 8x12x512x64 (the patched bench) and
4x16x2048x64, with tile candidates for float32.

Prints a table per section and writes every row to $OUT/bench_attention.json when $OUT is set.
FLOPs: forward 4 B H Lq Lk D (halved when causal), backward 2.5x the forward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # bench/: the shared harness
from harness import capture  # noqa: E402

DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu": a slow smoke test of the check and warm logic

DTYPE = os.environ.get("BENCH_DTYPE", "bfloat16")  # or "float32"
if DTYPE == "float32":
    SHAPES = [(64, 8, 128, 32), (8, 12, 512, 64), (4, 16, 2048, 64)]
    VARIANTS = ["causal"]
else:
    SHAPES = [(4, 16, 2048, 64), (8, 12, 1024, 64), (4, 16, 2048, 128)]
    VARIANTS = ["causal", "key-padding mask", "gqa causal"]
KV_HEADS_GQA = 4


def cases():
    return [(shape, variant) for shape in SHAPES for variant in VARIANTS]


# ------------------------------------------------------------------------ in-process helpers


def _setup():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


def bench_dtype():
    import torch

    return getattr(torch, DTYPE)


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def rel_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def make_inputs(shape, variant, dtype, seed=0):
    import torch

    B, H, L, D = shape
    gen = torch.Generator(device=DEV).manual_seed(seed)
    hkv = KV_HEADS_GQA if variant.startswith("gqa") else H
    q = torch.randn(B, H, L, D, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(B, hkv, L, D, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(B, hkv, L, D, device=DEV, dtype=dtype, generator=gen)
    gout = torch.randn(B, H, L, D, device=DEV, dtype=dtype, generator=gen)
    kwargs = dict(is_causal=variant.endswith("causal"), enable_gqa=hkv != H)
    if variant == "key-padding mask":  # every other sequence has its last 25% of keys padded
        mask = torch.ones(B, 1, 1, L, device=DEV, dtype=torch.bool)
        mask[::2, ..., L - L // 4 :] = False
        kwargs["attn_mask"] = mask
    return q, k, v, gout, kwargs


def flops(shape, variant) -> float:
    B, H, L, D = shape
    fwd = 4.0 * B * H * L * L * D * (0.5 if variant.endswith("causal") else 1.0)
    return fwd * 3.5  # forward + backward (2.5x)


def teeny_executor(q, k, v, kwargs):
    import teeny
    from teeny import ops
    from teeny.core.graph import Graph
    from teeny.program.lowering import LoweringMode, lower

    g = Graph()
    ins = [g.input(n, tuple(t.shape), t.dtype, requires_grad=True) for n, t in zip("qkv", (q, k, v))]
    kw = dict(kwargs)
    feed = dict(zip("qkv", (q, k, v)))
    if "attn_mask" in kw:
        m = kw["attn_mask"]
        kw["attn_mask"] = g.input("mask", tuple(m.shape), m.dtype)
        feed["mask"] = m
    g.output(ops.scaled_dot_product_attention(*ins, **kw))
    return teeny.Executor(lower(g, LoweringMode.TRAINING)), feed


def bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def kernel_times(replay, names=("attention_forward", "attention_backward_dq", "attention_backward_dkdv")):
    """Mean device time (ms) per launch of each named kernel over ten replays (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = {}
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                replay()
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            for name in names:
                if evt.key.startswith(name):
                    total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
                    out[name] = round(total / max(evt.count, 1) / 1000.0, 4)
    except Exception as exc:  # the profiler is a nicety: the totals stand without it
        out["profiler_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def reference(q, k, v, gout, kwargs):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    kw = dict(kwargs)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ins, **kw)
        grads = torch.autograd.grad(ref, ins, gout.double())
    return ref.detach(), [g.detach() for g in grads]


def errors(out, grads, ref, ref_grads) -> dict:
    return dict(out=rel_err(out, ref), **{f"d{n}": rel_err(g, r) for n, g, r in zip("qkv", grads, ref_grads)})


# ------------------------------------------------------------------------------- sections


def check_cases():
    """(name, dtype name, shapes, tolerance, kwargs, reference) of the GPU correctness checks;
    masks are made from their shapes by ``_check_inputs`` (``bool:shape`` / ``float:shape``)."""
    odd = [(2, 3, 37, 40), (2, 3, 45, 40), (2, 3, 45, 24)]
    out = []
    out += [
        ("odd lengths and head dims", "float16", odd, 5e-3, {}, None),
        ("causal Lq<Lk", "float16", odd, 5e-3, {"is_causal": True}, None),
    ]
    for dtype, tol in (("bfloat16", 3e-2), ("float32", 1e-5), ("float64", 1e-12)):
        out += [
            ("odd lengths and head dims", dtype, odd, tol, {}, None),
            ("causal Lq<Lk", dtype, odd, tol, {"is_causal": True}, None),
            ("causal Lq>Lk", dtype, [(2, 3, 45, 40), (2, 3, 37, 40), (2, 3, 37, 40)], tol, {"is_causal": True}, None),
            ("bool mask", dtype, odd, tol, {"attn_mask": "bool:2,1,37,45"}, None),
            ("float mask, scale 0.3", dtype, odd, tol, {"attn_mask": "float:37,45", "scale": 0.3}, None),
            (
                "gqa causal",
                dtype,
                [(2, 4, 37, 40), (2, 2, 45, 40), (2, 2, 45, 24)],
                tol,
                {"is_causal": True, "enable_gqa": True},
                None,
            ),
            ("k, v broadcast over batch", dtype, [(2, 3, 37, 40), (3, 45, 40), (45, 24)], tol, {}, None),
            ("multi-block causal 300x300 d64", dtype, [(1, 2, 300, 64)] * 3, tol, {"is_causal": True}, None),
            ("multi-block 257x513 d128", dtype, [(1, 2, 257, 128), (1, 2, 513, 128), (1, 2, 513, 128)], tol, {}, None),
            (
                "dropout 0.3 causal (Philox reference)",
                dtype,
                [(2, 2, 37, 40)] * 3,
                tol,
                {"dropout_p": 0.3, "is_causal": True, "seed": 9, "fixed_mask": True},
                "philox",
            ),
        ]
    issue = [(1, 1, 5, 4), (1, 1, 9, 4), (1, 1, 9, 4)]
    out += [
        ("issue 17 (5,9) bool mask", "float64", issue, 1e-12, {"attn_mask": "bool:5,9"}, None),
        ("issue 17 key padding", "float64", issue, 1e-12, {"attn_mask": "pad:1,1,1,9"}, None),
        (
            "issue 17 (2,2,37,40)",
            "float64",
            [(2, 2, 37, 40), (2, 2, 45, 40), (2, 2, 45, 40)],
            1e-12,
            {"attn_mask": "bool:37,45"},
            None,
        ),
        ("dropout mask equals the numpy Philox reference", "float32", None, 0, {}, "mask"),
    ]
    return out


def _check_inputs(kwargs, dtype, gen):
    import torch

    out = {}
    for key, value in kwargs.items():
        if isinstance(value, str) and ":" in value:
            kind, shape = value.split(":")
            shape = tuple(int(x) for x in shape.split(","))
            if kind == "float":
                value = torch.randn(shape, generator=gen).to(dtype)
            else:
                value = torch.rand(shape, generator=gen) > 0.3
                value[..., 0] = True  # no fully masked row (PyTorch's reference gives NaN there)
                if kind == "pad":
                    value[..., :6] = True
                    value[..., 6:] = False
            value = value.to(DEV)
        out[key] = value
    return out


def check_one(index: int) -> dict:
    torch = _setup()
    import torch.nn.functional as F

    from teeny import ops
    from teeny.checks.samples import attention as attention_samples
    from teeny.core.common import mix_seed
    from teeny.torch import apply

    name, dtype_name, shapes, tol, kwargs, special = check_cases()[index]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(index)
    row = dict(section="check", case=name, dtype=dtype_name, index=index)
    try:
        if special == "mask":  # q = k = 0, v = identity: the output is the kept weights
            lk, p = 96, 0.25
            q = torch.zeros(2, 3, 80, 16, device=DEV)
            k = torch.zeros(2, 3, lk, 16, device=DEV)
            v = torch.eye(lk, device=DEV).expand(2, 3, lk, lk).contiguous()
            out = apply(ops.scaled_dot_product_attention, q, k, v, dropout_p=p, seed=21, fixed_mask=True)
            kept = (out.cpu() * lk * (1 - p)) > 0.5
            expected = attention_samples.dropout_keep_reference(mix_seed(21, 0), 6, 80, lk, p).reshape(kept.shape)
            row.update(ok=bool(torch.equal(kept, expected)), dropped=float((~kept).float().mean()))
            return row
        ts = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV, dtype).requires_grad_() for s in shapes]
        kw = _check_inputs(kwargs, dtype, gen)
        out = apply(ops.scaled_dot_product_attention, *ts, **kw)
        ref_in = [t.detach().double().requires_grad_() for t in ts]
        ref_kw = {
            k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()
        }
        ref_fn = attention_samples.reference if special == "philox" else F.scaled_dot_product_attention
        if special == "philox":
            ref_in_cpu = [t.detach().cpu().requires_grad_() for t in ref_in]
            ref = ref_fn(*ref_in_cpu, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ref_kw.items()})
            ref_in = ref_in_cpu
        else:
            ref = ref_fn(*ref_in, **ref_kw)
        gout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad(out, ts, gout.to(DEV, dtype))
        ref_grads = torch.autograd.grad(ref, ref_in, gout.to(ref.device))
        errs = errors(out.cpu(), [g.cpu() for g in grads], ref.cpu(), [g.cpu() for g in ref_grads])
        row.update(errs, ok=all(e <= tol for e in errs.values()), tol=tol)
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600])
    return row


def time_case(shape, variant, deadline: float) -> list[dict]:
    torch = _setup()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = bench_dtype()
    q, k, v, gout, kwargs = make_inputs(shape, variant, dtype)
    total_flops = flops(shape, variant)
    name = f"{'x'.join(map(str, shape))} {variant}"
    ref, ref_grads = reference(q, k, v, gout, kwargs)
    rows = []

    # teeny: forward + backward captured in a CUDA graph, and the forward alone
    row = dict(section="time", case=name, impl="teeny (CUDA graph)")
    try:
        ex, feed = teeny_executor(q, k, v, kwargs)

        def step():
            out, cache = ex.forward_train(feed)
            grads = ex.backward(cache, gout)
            return out, [grads[n] for n in "qkv"]

        out, grads = step()
        torch.cuda.synchronize()
        row.update(errors(out, grads, ref, ref_grads))
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        graph, _ = capture(step)
        ms = bench_ms(graph.replay)
        row.update(ms=round(ms, 4), tflops=round(total_flops / ms * 1e-9, 1))
        row.update(kernel_times(graph.replay))
        fwd_graph, _ = capture(lambda: ex.forward_train(feed)[0])
        row["forward_ms"] = round(bench_ms(fwd_graph.replay), 4)
        del graph, fwd_graph
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {exc}"[:800])
    rows.append(row)
    print(json.dumps(row), flush=True)

    # torch SDPA, each backend that takes the case
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def torch_step():
        out = F.scaled_dot_product_attention(*leaves, **kwargs)
        return out, list(torch.autograd.grad(out, leaves, gout))

    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends.append(("cudnn", SDPBackend.CUDNN_ATTENTION))
    for label, backend in backends:
        if time.time() > deadline:
            break
        row = dict(section="time", case=name, impl=f"torch sdpa {label}")
        try:
            with sdpa_kernel([backend]):
                out, grads = torch_step()
                torch.cuda.synchronize()
                row.update(errors(out, grads, ref, ref_grads))
                del out, grads
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                torch_step()
                torch.cuda.synchronize()
                row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
                ms = bench_ms(torch_step)
                row.update(ms=round(ms, 4), tflops=round(total_flops / ms * 1e-9, 1))
                try:
                    graph, _ = capture(torch_step)
                    row["graph_ms"] = round(bench_ms(graph.replay), 4)
                    fwd = lambda: F.scaled_dot_product_attention(*leaves, **kwargs)  # noqa: E731
                    with torch.no_grad():
                        fwd_graph, _ = capture(fwd)
                    row["forward_ms"] = round(bench_ms(fwd_graph.replay), 4)
                    del graph, fwd_graph
                except Exception as exc:
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_configs(head_dim: int):
    from teeny.ops.attention.tuning import AttentionTiles, Tiles

    if DTYPE == "float32":  # (block_m, block_n, warps, stages); the default first
        fwd = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 3)]
        dq = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 3)]
        dkdv = [(64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 3)]
    elif head_dim <= 64:
        fwd = [
            (128, 64, 4, 3),
            (128, 64, 4, 4),
            (128, 128, 8, 3),
            (64, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (64, 128, 4, 3),
            (64, 64, 4, 4),
            (64, 64, 8, 3),
        ]
        dq = [
            (128, 32, 4, 3),
            (128, 64, 8, 3),
            (64, 64, 4, 3),
            (128, 32, 8, 4),
            (128, 64, 4, 3),
            (64, 32, 4, 4),
            (128, 32, 4, 5),
            (64, 64, 8, 3),
            (64, 64, 4, 4),
        ]
        dkdv = [  # (the last two for the Llama's GQA: 64 keys a program, twice the programs)
            (32, 128, 4, 3),
            (64, 128, 8, 3),
            (32, 64, 4, 3),
            (64, 64, 4, 3),
            (32, 128, 8, 4),
            (64, 128, 4, 3),
            (32, 128, 4, 5),
            (64, 64, 4, 4),
            (128, 64, 8, 3),
        ]
    else:
        fwd = [
            (128, 64, 8, 3),
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (64, 64, 4, 3),
            (128, 32, 8, 3),
            (64, 128, 8, 2),
            (128, 64, 8, 2),
        ]
        dq = [
            (128, 32, 8, 3),
            (64, 64, 4, 3),
            (128, 64, 8, 3),
            (64, 32, 4, 3),
            (128, 32, 4, 3),
            (128, 32, 8, 2),
            (64, 64, 8, 2),
        ]
        dkdv = [
            (32, 128, 8, 3),
            (64, 64, 4, 3),
            (64, 128, 8, 3),
            (32, 64, 4, 3),
            (32, 128, 4, 3),
            (32, 128, 8, 2),
            (64, 64, 8, 2),
        ]
    return [AttentionTiles(Tiles(*f), Tiles(*a), Tiles(*b)) for f, a, b in zip(fwd, dq, dkdv)]


def section_sweep(deadline: float, start: int = 0) -> list[dict]:
    _setup()
    from teeny.ops.attention import tuning

    rows = []
    for index, (shape, variant, i, tiles) in enumerate(sweep_jobs()):
        if index < start:
            continue
        if time.time() > deadline:
            break
        row = dict(
            section="sweep",
            case=f"{'x'.join(map(str, shape))} {variant}",
            config=i,
            index=index,
            forward=tiles.forward.__dict__,
            dq=tiles.dq.__dict__,
            dkdv=tiles.dkdv.__dict__,
        )
        try:
            tuning.TILE_OVERRIDE = tiles
            q, k, v, gout, kwargs = make_inputs(shape, variant, bench_dtype())
            ex, feed = teeny_executor(q, k, v, kwargs)

            def step():
                out, cache = ex.forward_train(feed)
                grads = ex.backward(cache, gout)
                return out, [grads[n] for n in "qkv"]

            graph, _ = capture(step)
            ms = bench_ms(graph.replay)
            row.update(ms=round(ms, 4), tflops=round(flops(shape, variant) / ms * 1e-9, 1))
            row.update(kernel_times(graph.replay))
            del graph
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}"[:400])
        finally:
            tuning.TILE_OVERRIDE = None
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sweep_jobs():
    """(shape, variant, index, tiles) of every sweep run: BENCH_SWEEP's cases, else the defaults."""
    chosen = os.environ.get("BENCH_SWEEP")
    if chosen:
        wanted = [part.split(":") for part in chosen.split(",")]
        cases = [(tuple(int(n) for n in shape.split("x")), variant) for shape, variant in wanted]
    else:
        cases = [(shape, "causal") for shape in (SHAPES if DTYPE == "float32" else (SHAPES[0], SHAPES[2]))]
    return [(s, variant, i, tiles) for s, variant in cases for i, tiles in enumerate(sweep_configs(s[3]))]


def warm_one(index: int) -> dict:
    """Compile (into Triton's on-disk cache) the kernels of timing case or sweep job ``index``
    by running one eager step, so that the serial timing sections do not wait for compiles."""
    _setup()
    from teeny.ops.attention import tuning

    timing = [] if os.environ.get("BENCH_SWEEP") else [(shape, variant, None) for shape, variant in cases()]
    jobs = timing + [(s, variant, t) for s, variant, _, t in sweep_jobs()]
    shape, variant, tiles = jobs[index]
    row = dict(section="warm", index=index, case=f"{'x'.join(map(str, shape))} {variant}")
    t0 = time.time()
    try:
        tuning.TILE_OVERRIDE = tiles
        q, k, v, gout, kwargs = make_inputs(shape, variant, bench_dtype())
        ex, feed = teeny_executor(q, k, v, kwargs)
        out, cache = ex.forward_train(feed)
        ex.backward(cache, gout)
        sync()
        row["seconds"] = round(time.time() - t0, 1)
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {exc}"[:300])
    return row


def n_warm_jobs() -> int:
    return (0 if os.environ.get("BENCH_SWEEP") else len(cases())) + len(sweep_jobs())


def section_compile(deadline: float) -> list[dict]:
    torch = _setup()
    import torch.nn.functional as F

    shape, variant = SHAPES[0], "causal"
    q, k, v, gout, kwargs = make_inputs(shape, variant, bench_dtype())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fn = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs))

    def step():
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, gout)

    row = dict(section="compile", case=f"{'x'.join(map(str, shape))} {variant}", impl="torch.compile sdpa")
    try:
        step()
        torch.cuda.synchronize()
        ms = bench_ms(step)
        row.update(ms=round(ms, 4), tflops=round(flops(shape, variant) / ms * 1e-9, 1))
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {exc}"[:300])
    print(json.dumps(row), flush=True)
    return [row]


# ----------------------------------------------------------------------------------- driver


def child(args) -> None:
    deadline = args.deadline
    if args.section in ("check", "warm"):
        one, n = (check_one, len(check_cases())) if args.section == "check" else (warm_one, n_warm_jobs())
        for index in range(args.start, n, args.stride):
            if time.time() > deadline:
                break
            row = one(index)
            print(json.dumps(row), flush=True)
            if "CUDA" in row.get("error", "") or "illegal" in row.get("error", ""):
                sys.exit(3)
    elif args.section == "time":
        for index, (shape, variant) in enumerate(cases()):
            if index >= args.start and time.time() < deadline:
                rows = time_case(shape, variant, deadline)
                print(json.dumps(dict(done=index)), flush=True)
                if any("CUDA" in r.get("error", "") or "illegal" in r.get("error", "") for r in rows):
                    sys.exit(3)
    elif args.section == "sweep":
        section_sweep(deadline, args.start)
    elif args.section == "compile":
        section_compile(deadline)


PARALLEL = int(
    os.environ.get("BENCH_PARALLEL", "12")
)  # check and warm: compiles dominate, so several processes at once


def _child_cmd(section, deadline, start, stride=1):
    return [
        sys.executable,
        HERE,
        "--child",
        section,
        "--deadline",
        str(deadline),
        "--start",
        str(start),
        "--stride",
        str(stride),
    ]


def _rows_of(stdout: str) -> list:
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run_parallel(section: str, deadline: float, rows: list) -> None:
    """check / warm: PARALLEL children, each taking every PARALLEL-th case."""
    procs = [
        subprocess.Popen(
            _child_cmd(section, deadline, r, PARALLEL), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(PARALLEL)
    ]
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(5.0, deadline - time.time() + 30))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        rows.extend(r for r in _rows_of(out) if "done" not in r)
        if proc.returncode != 0:
            rows.append(dict(section=section, crash=proc.returncode, stderr=err[-1500:]))


def run_serial(section: str, deadline: float, rows: list) -> None:
    """time / sweep / compile: one child at a time; after a crash the next child starts with
    the case after the one that crashed."""
    start = 0
    while time.time() < deadline:
        cmd = _child_cmd(section, deadline, start)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, deadline - time.time() + 30))
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            done = subprocess.CompletedProcess(cmd, -9, out, "timeout")
        last_done, clean = None, True
        for row in _rows_of(done.stdout):
            if "done" in row:
                last_done, clean = row["done"], True
            else:
                rows.append(row)
                clean = False
        if done.returncode == 0 or section == "compile":
            if done.returncode != 0:
                rows.append(dict(section=section, crash=done.returncode, stderr=(done.stderr or "")[-1500:]))
            return
        print(f"[{section}] child exited {done.returncode}: {(done.stderr or '')[-800:]}", flush=True)
        rows.append(dict(section=section, crash=done.returncode, stderr=(done.stderr or "")[-1500:]))
        base = start - 1 if last_done is None else last_done
        start = base + (1 if clean and last_done is not None else 2)  # skip the case that died


def fmt(x, width=8, digits=3):
    if x is None:
        return "-".rjust(width)
    if isinstance(x, float):
        return f"{x:.{digits}g}".rjust(width) if abs(x) < 1e-2 and x else f"{x:.{digits}f}".rjust(width)
    return str(x).rjust(width)


def report(rows: list) -> None:
    checks = [r for r in rows if r.get("section") == "check"]
    if checks:
        print("\n== check (GPU, against float64): max |x - ref| / max |ref|")
        for r in checks:
            errs = " ".join(f"{k} {r[k]:.1e}" for k in ("out", "dq", "dk", "dv") if k in r)
            print(
                f"  {'ok ' if r.get('ok') else 'BAD'} {r.get('dtype', ''):9} {r['case']:42} {errs} {r.get('error', '')}"
            )
    times = [r for r in rows if r.get("section") == "time"]
    if times:
        print(f"\n== time ({DTYPE} fwd+bwd, ms; TFLOP/s; errors against float64)")
        print(
            f"  {'case':34} {'impl':22} {'ms':>8} {'TFLOP/s':>8} {'graph':>8} {'fwd':>8} {'k:fwd':>8} {'k:dq':>8}"
            f" {'k:dkdv':>8} {'MiB':>7} {'err out':>8} {'err dq':>8} {'err dk':>8} {'err dv':>8}"
        )
        for r in times:
            print(
                f"  {r['case']:34} {r['impl']:22} {fmt(r.get('ms'))} {fmt(r.get('tflops'), 8, 1)}"
                f" {fmt(r.get('graph_ms'))} {fmt(r.get('forward_ms'))} {fmt(r.get('attention_forward'))}"
                f" {fmt(r.get('attention_backward_dq'))} {fmt(r.get('attention_backward_dkdv'))}"
                f" {fmt(r.get('peak_mib'), 7, 0)} {fmt(r.get('out'), 8, 2)} {fmt(r.get('dq'), 8, 2)}"
                f" {fmt(r.get('dk'), 8, 2)} {fmt(r.get('dv'), 8, 2)} {r.get('error', '')}"
            )
    sweeps = [r for r in rows if r.get("section") == "sweep"]
    if sweeps:
        print(f"\n== sweep ({DTYPE} causal; tiles block_m x block_n / warps / stages; per-kernel ms)")
        for r in sweeps:
            t = " ".join(
                f"{k} {r[k]['block_m']}x{r[k]['block_n']}/w{r[k]['num_warps']}/s{r[k]['num_stages']}"
                for k in ("forward", "dq", "dkdv")
            )
            print(
                f"  {r['case']:24} {t:70} total {fmt(r.get('ms'))} fwd {fmt(r.get('attention_forward'))}"
                f" dq {fmt(r.get('attention_backward_dq'))} dkdv {fmt(r.get('attention_backward_dkdv'))}"
                f" {r.get('error', '')}"
            )
    warm = [r for r in rows if r.get("section") == "warm"]
    if warm:
        slow = max((r.get("seconds", 0) for r in warm), default=0)
        bad = [f"{r['case']}: {r['error']}" for r in warm if "error" in r]
        print(f"\n== warm: {len(warm)} jobs, slowest {slow} s" + "".join(f"\n  BAD {b}" for b in bad))
    for r in rows:
        if r.get("section") == "compile":
            print(
                f"\n== torch.compile {r['case']}: {fmt(r.get('ms'))} ms {fmt(r.get('tflops'), 8, 1)} TFLOP/s"
                f" {r.get('error', '')}"
            )
        if "crash" in r:
            print(f"\n!! {r['section']} child crashed ({r['crash']}): {r['stderr'][-600:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="check,warm,time,sweep,compile")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for everything")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stride", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.section = args.child
        child(args)
        return
    t0 = time.time()
    end = t0 + args.budget
    sections = args.sections.split(",")
    # share of the budget per section (what is left over passes on)
    shares = {"check": 0.2, "warm": 0.15, "time": 0.3, "sweep": 0.25, "compile": 0.1}
    rows: list = []
    import torch
    import triton

    device = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"torch {torch.__version__} triton {triton.__version__} {device}", flush=True)
    for i, section in enumerate(sections):
        later = sum(shares.get(s, 0.1) for s in sections[i + 1 :])
        mine = shares.get(section, 0.1)
        deadline = time.time() + (end - time.time()) * mine / (mine + later)
        if section == sections[-1]:
            deadline = end
        (run_parallel if section in ("check", "warm") else run_serial)(section, deadline, rows)
        print(f"[{section}] done at {time.time() - t0:.0f} s", flush=True)
    report(rows)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
