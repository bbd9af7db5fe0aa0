"""The shared harness of teeny's benchmarks: cases, one timing function, the ceilings, the check
against eager, and the per-GPU results file.

A case is a row of a table (``Case``): a stable name, an area, the bytes or FLOPs it must move or
do, and a ``make`` function that builds its inputs and functions only when the case runs (the
tables are cheap to import on any machine). ``run_case`` then, for each implementation:

* ``teeny``: the function lowered as one training program (``lower(graph, TRAINING)``), its
  ``forward_train`` + ``backward`` captured in a CUDA graph and replayed, so the time is the
  kernels', not the Python host path's (host time made sub-millisecond cases swing 2x between
  runs: docs/archive/bench-journal.md, version 2);
* ``eager``: the PyTorch function, forward + backward, timed as it runs;
* ``compile`` (and ``compile-<mode>``): ``torch.compile`` of it, when the case asks or ``--compile``;
* ``liger``: Liger-Kernel's function where the case names one and the package imports;
* any other implementation the case adds (SDPA's backends, say).

Each is checked against eager first (relative Frobenius error of the output and of the first
differentiable input's gradient), then timed with ``triton.testing.do_bench`` (median, ms). The
rows (date, commit, GPU, case, implementation, ms, GB/s, TFLOP/s, ratio to the best torch time,
error) are printed as a table and appended to ``bench/results/<gpu-slug>.csv`` case by case, so a
run stopped by its time limit keeps what it measured.

The CSV, case selection and formatting are plain Python (tested on the CPU by tests/test_bench.py);
everything that touches the GPU imports torch and triton inside the function that needs them.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
FIELDS = ["date", "commit", "gpu", "bench", "case", "impl", "ms", "gbps", "tflops", "ratio", "error", "note"]
TORCH_IMPLS = ("eager", "compile", "sdpa", "torch")  # implementations whose best time is the ratio's base


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One row of a benchmark table.

    ``name`` is stable (results are compared by it across commits): ``<op> <dtype> <shape>[,
    variant]``. ``make()`` returns a dict with ``inputs`` (a list of tensors; floating ones get
    gradients), ``teeny`` and ``torch`` (functions of those inputs, teeny's written with
    ``teeny.ops`` on graph symbols), and optionally ``liger`` (a function), ``impls`` (more
    torch-side functions by name), ``grad`` (the output's gradient; random by default),
    ``grad_of`` (which input's gradient is checked; the first differentiable one by default) and
    ``check`` (False: time only, as for dropout, whose masks differ from torch's)."""

    name: str
    area: str
    make: Callable[[], dict]
    bytes: float = 0.0  # the fewest bytes forward + backward must move (each input read once, ...)
    flops: float = 0.0  # forward + backward
    compile: bool = False  # time torch.compile too by default (about 10 s of compiling a case)
    tags: tuple[str, ...] = field(default_factory=tuple)


def select(cases: Sequence[Case], only: Iterable[str] | None = None, areas: Iterable[str] | None = None) -> list[Case]:
    """The cases whose name contains one of ``only`` (any, if none given) and whose area is one
    of ``areas`` (any, if none given), in table order. A word of ``only`` that selects nothing is
    an error: a misspelt case must not pass as an empty run."""
    only = [o for o in (only or []) if o]
    areas = [a for a in (areas or []) if a]
    unknown = sorted(set(areas) - {c.area for c in cases})
    if unknown:
        raise ValueError(f"no area {', '.join(unknown)}; the areas are {sorted({c.area for c in cases})}")
    chosen = [c for c in cases if (not areas or c.area in areas)]
    if only:
        missing = [o for o in only if not any(o in c.name for c in chosen)]
        if missing:
            raise ValueError(f"no case matches {missing}; run with --list to see the names")
        chosen = [c for c in chosen if any(o in c.name for o in only)]
    return chosen


def check_unique(cases: Sequence[Case]) -> None:
    """Case names are keys of the results file: two rows of one name would mix their numbers."""
    seen: set[str] = set()
    for case in cases:
        if case.name in seen:
            raise ValueError(f"case name {case.name!r} appears twice")
        seen.add(case.name)


# ----------------------------------------------------------------------------- rows and the CSV


def gpu_slug(gpu: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: the results file's name."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


def commit() -> str:
    """``$BENCH_COMMIT`` if set (the device machine's copy of the tree may have no .git), else the
    short hash of HEAD with ``+dirty`` when tracked files under src/ differ from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def gpu_name() -> str:
    """The CUDA device's name, or ``cpu`` (then nothing here times anything)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def make_row(bench: str, case: str, impl: str, ms: float, *, nbytes: float = 0.0, flops: float = 0.0,
             error: float | None = None, note: str = "") -> dict:  # fmt: skip
    """A result row (date, commit and gpu are filled in by ``append_results``)."""
    ok = ms is not None and math.isfinite(ms) and ms > 0
    return dict(
        bench=bench,
        case=case,
        impl=impl,
        ms=ms,
        gbps=nbytes / ms / 1e6 if ok and nbytes else None,
        tflops=flops / ms / 1e9 if ok and flops else None,
        ratio=None,
        error=error,
        note=note,
    )


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's time over the best torch time of its case (eager, compile, SDPA backends)."""
    best: dict[str, float] = {}
    for r in rows:
        if r.get("ms") and r["impl"].startswith(TORCH_IMPLS):
            best[r["case"]] = min(best.get(r["case"], math.inf), r["ms"])
    for r in rows:
        base = best.get(r["case"])
        r["ratio"] = r["ms"] / base if r.get("ms") and base else None
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3e}" if value and abs(value) < 1e-3 else f"{value:.6g}"
    return str(value)


def append_results(rows: list[dict], gpu: str | None = None, folder: Path | None = None) -> Path:
    """Append ``rows`` to ``<folder>/<gpu-slug>.csv`` (bench/results by default), with today's
    date, the commit and the GPU; writes the header when the file is new. Returns the path."""
    gpu = gpu or gpu_name()
    folder = Path(folder or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{gpu_slug(gpu)}.csv"
    new = not path.exists() or path.stat().st_size == 0
    stamp = dict(date=datetime.date.today().isoformat(), commit=commit(), gpu=gpu)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in {**stamp, **row}.items()})
    return path


def read_results(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def latest(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """The last row of each (case, impl) in file order: today's number of each."""
    return {(r["case"], r["impl"]): r for r in rows}


def format_table(rows: list[dict]) -> str:
    """Rows as a Markdown table: one line per case, each implementation's ms in a column, then
    teeny's GB/s or TFLOP/s, its ratio to the best torch time and its error."""
    impls: list[str] = []
    cases: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
        cases.setdefault(r["case"], {})[r["impl"]] = r

    def num(value, digits=3):
        if value in (None, ""):
            return "-"
        value = float(value)
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)

    head = ["case", *(f"{i} ms" for i in impls), "teeny GB/s | TFLOP/s", "teeny / best torch", "teeny err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_impl in cases.items():
        t = by_impl.get("teeny", {})
        rate = "-"
        if t.get("gbps") not in (None, ""):
            rate = f"{float(t['gbps']):.0f} GB/s"
        elif t.get("tflops") not in (None, ""):
            rate = f"{float(t['tflops']):.0f} TFLOP/s"
        err = t.get("error")
        err = f"{float(err):.1e}" if err not in (None, "") else "-"
        cells = [name, *(num(by_impl.get(i, {}).get("ms")) for i in impls), rate, num(t.get("ratio"), 2), err]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def parser(description: str) -> argparse.ArgumentParser:
    """The options every case module takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", metavar="WORD", help="the cases whose name contains one of these")
    p.add_argument("--list", action="store_true", help="print the case names and stop")
    p.add_argument("--no-save", action="store_true", help="do not append to bench/results/<gpu>.csv")
    return p


def list_cases(cases: Sequence[Case]) -> str:
    return "\n".join(f"{c.area:10} {c.name}" for c in cases)


# ----------------------------------------------------------------------------- GPU: timing


def setup() -> None:
    """Full-precision float32 products in cuBLAS (teeny's float32 default, tf32x3, is as exact)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """Median ms of ``fn`` (``triton.testing.do_bench``: device events, L2 flushed between runs)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median", grad_to_none=grad_to_none))


def sync() -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_time(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median seconds of ``fn()`` by the host's clock, synchronised: what a user waits for, host
    time included (the CUDA-graph timings above leave it out)."""
    import time

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def capture(fn: Callable[[], object]):
    """``fn`` captured as a CUDA graph after warm-up runs on a side stream (which compile the
    kernels and fill allocator pools): returns (graph, the outputs of the captured run)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    torch.cuda.synchronize()
    return graph, outs


def teeny_program(fn: Callable, inputs: Sequence):
    """``fn`` on graph symbols lowered for training: (executor, feed). Floating inputs get gradients."""
    import teeny
    from teeny import Graph, LoweringMode, lower

    g = Graph(getattr(fn, "__name__", "case"))
    syms = [
        g.input(f"x{i}", tuple(t.shape), t.dtype, requires_grad=t.is_floating_point()) for i, t in enumerate(inputs)
    ]
    g.output(fn(*syms))
    return teeny.Executor(lower(g, LoweringMode.TRAINING)), {f"x{i}": t for i, t in enumerate(inputs)}


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (NaN never passes: it propagates)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def copy_bandwidth() -> float:
    """Bytes/s (read + written) of a 1 GiB device-to-device copy: the memory ceiling."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), warmup=50, rep=200)
    return 2 * 2**30 / (ms * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """FLOP/s of cuBLAS's bf16 n x n x n product on random data: the arithmetic ceiling."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: torch.matmul(a, b, out=c), warmup=50, rep=200)
    return 2 * n**3 / (ms * 1e-3)


def ceilings(bench: str) -> list[dict]:
    """The two ceilings as result rows (measured in the same run as the cases, on the same card)."""
    bw, fl = copy_bandwidth(), matmul_flops()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, cuBLAS bf16 8192^3 {fl / 1e12:.0f} TFLOP/s", flush=True)
    return [
        make_row(bench, "ceiling: copy 1 GiB", "torch", 2 * 2**30 / bw * 1e3, nbytes=2 * 2**30),
        make_row(bench, "ceiling: matmul bf16 8192^3", "torch", 2 * 8192**3 / fl * 1e3, flops=2 * 8192**3),
    ]


def liger_functions() -> dict:
    """Liger-Kernel's autograd functions by op, or {} when it does not import (the column stays empty)."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:  # not installed
        print(f"liger-kernel unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}
    return dict(
        cross_entropy=LigerCrossEntropyFunction,
        layer_norm=LigerLayerNormFunction,
        rms_norm=LigerRMSNormFunction,
        swiglu=LigerSiLUMulFunction,
    )


def _first_grad_index(inputs) -> int:
    return next((i for i, t in enumerate(inputs) if t.is_floating_point()), 0)


def run_case(bench: str, case: Case, compile_modes: Sequence[str] = ()) -> list[dict]:
    """Check and time every implementation of ``case``: one result row each (a failing
    implementation gives a row with its error in ``note`` and no time)."""
    import torch

    spec = case.make()
    inputs = spec["inputs"]
    k = spec.get("grad_of", _first_grad_index(inputs))
    check = spec.get("check", True)

    def leaves():
        return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]

    ref_in = leaves()
    ref_out = spec["torch"](*ref_in)
    grad = spec.get("grad")
    if grad is None:
        grad = torch.randn_like(ref_out)
    ref_out.backward(grad)
    ref_grad = ref_in[k].grad

    def error(out, dx) -> float | None:
        if not check:
            return None
        errs = [rel_err(out, ref_out)] + ([rel_err(dx, ref_grad)] if dx is not None and ref_grad is not None else [])
        return max(errs)

    rows = []

    # teeny: the training program's forward + backward captured in a CUDA graph
    try:
        ex, feed = teeny_program(spec["teeny"], inputs)

        def step():
            out, cache = ex.forward_train(feed)
            return out, ex.backward(cache, grad)

        out, grads = step()
        err = error(out, grads.get(f"x{k}"))
        note = ""
        try:
            graph, _ = capture(step)
            ms = bench_ms(graph.replay)
        except Exception as exc:  # a capture failure: time the eager program instead, and say so
            note = f"no CUDA graph ({type(exc).__name__}: {str(exc)[:120]})"
            ms = bench_ms(step)
        rows.append(make_row(bench, case.name, "teeny", ms, nbytes=case.bytes, flops=case.flops, error=err, note=note))
    except Exception as exc:
        rows.append(make_row(bench, case.name, "teeny", None, note=f"failed: {type(exc).__name__}: {str(exc)[:200]}"))

    # torch-side implementations, timed as they run
    impls = {"eager": spec["torch"]}
    for mode in compile_modes:
        label = "compile" if mode == "default" else f"compile-{mode}"
        impls[label] = torch.compile(spec["torch"], mode=None if mode == "default" else mode)
    if spec.get("liger") is not None:
        impls["liger"] = spec["liger"]
    impls.update(spec.get("impls", {}))
    for label, fn in impls.items():
        xs = leaves()
        try:
            out = fn(*xs)
            out.backward(grad)
            err = error(out, xs[k].grad)

            def run(fn=fn, xs=xs):
                fn(*xs).backward(grad)

            ms = bench_ms(run, grad_to_none=[t for t in xs if t.requires_grad])
            rows.append(make_row(bench, case.name, label, ms, nbytes=case.bytes, flops=case.flops, error=err))
        except Exception as exc:
            rows.append(make_row(bench, case.name, label, None, note=f"failed: {type(exc).__name__}: {str(exc)[:200]}"))
    spec.clear()
    torch.cuda.empty_cache()  # the case's tensors go with this frame; the next case has the memory
    return add_ratios(rows)


def main_for(bench: str, description: str, make_cases: Callable[[], list[Case]], argv=None) -> None:
    """The command line of a table of cases: ``--only``, ``--area``, ``--list``, ``--compile``,
    ``--no-save``; ceilings first, then each case checked, timed, printed and saved."""
    p = parser(description)
    p.add_argument("--area", nargs="*", metavar="AREA", help="the cases of these areas")
    p.add_argument("--compile", default="", metavar="MODES",
                   help="torch.compile modes for every case (default, max-autotune, ...); 'none': not even the "
                        "cases that ask for it (default: 'default' for the cases marked compile=True)")  # fmt: skip
    p.add_argument("--no-ceilings", action="store_true", help="skip measuring the copy and matmul ceilings")
    args = p.parse_args(argv)
    cases = make_cases()
    check_unique(cases)
    chosen = select(cases, args.only, args.area)
    if args.list:
        print(list_cases(chosen))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"{bench}: the benchmarks need a CUDA GPU (run on the device machine; --list works anywhere)")
    setup()
    gpu = gpu_name()
    print(f"{bench} on {gpu} at {commit()}: torch {torch.__version__}, {len(chosen)} cases", flush=True)
    modes = [] if args.compile == "none" else [m for m in args.compile.split(",") if m]
    all_rows: list[dict] = []
    if not args.no_ceilings:
        all_rows += ceilings(bench)
        if not args.no_save:
            append_results(all_rows, gpu)
    for case in chosen:
        rows = run_case(bench, case, modes or (["default"] if case.compile and args.compile != "none" else []))
        for r in rows:
            line = f"  {case.name:56} {r['impl']:18} {_cell(r['ms']) or '-':>10} ms"
            if r.get("error") is not None:
                line += f"  err {r['error']:.1e}"
            print(line + (f"  {r['note']}" if r.get("note") else ""), flush=True)
        all_rows += rows
        if not args.no_save:
            append_results(rows, gpu)
    print()
    print(format_table(all_rows))
