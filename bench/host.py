"""Host time of a registered op per call (issue 12): with the launches stubbed, and with real launches.

    PYTHONPATH=src python3 bench/host.py                    # both parts (stubbed runs on the CPU too)
    PYTHONPATH=src python3 bench/host.py --only stubbed     # CPU (interpreter) or GPU
    PYTHONPATH=src python3 bench/host.py --only synced      # the GPU: real launches (bench_torch.py --only overhead)
    PYTHONPATH=src python3 bench/host.py --only executor    # Executor.forward_train + backward per node
    PYTHONPATH=src python3 bench/host.py --profile          # and cProfile of forward+backward

**stubbed** (the old bench_host.py). The lowest launch call is stubbed to a no-op: Triton's
compiled launcher (``CompiledKernel.run``) on the GPU, the interpreter's
``InterpretedFunction.run`` on the CPU. What is left is host work:
``torch.ops.teeny.gelu(x)`` (1024 floats) forward under ``no_grad`` and forward+backward,
against the raw ``activation_forward`` / ``activation_backward`` launches through the same
stub (on the GPU that includes Triton's own binding work, ``JITFunction.run``; on the CPU it is
next to nothing) and against torch's floor for any custom op, an identity
``autograd.Function``. Then each layer on its own, inner layers called directly with what the outer
one would pass them, so that the differences are each layer's own cost:

    library composite -> bridge.call -> Compiled.forward -> Executor.forward_train
      -> one node's launches (OpContext, forward_launches, run_launch) -> KernelInstance.launch

Times are the minimum over repeats of the mean of many calls, in microseconds of the process's
CPU time (all its threads: the autograd engine's too), which other work on a shared machine
disturbs less than the wall clock.

**synced** (the old ``bench_torch.py --only overhead``). ``torch.ops.teeny.gelu`` and
``teeny.torch.apply`` per call against the raw Triton launch of the same kernel, on a small tensor
(launch-bound), forward and forward+backward; the goal is at most 10 us over the raw kernels. Each
call synchronised (median), and the main rows also back to back (host time per call, one
synchronisation).

**executor** (issue 50: at most 30 us of host time per node, forward + backward). The uncaptured
``Executor.forward_train`` + ``backward`` of a training program, per node of the program: one
layer_norm, one attention, one linear, and a small GPT, each after ``zero_grad`` as in a training
step (and once without it, the parameters' gradients accumulating). With the launches stubbed
(``stubbed_launches``: the lowest launch call does nothing; the executor's runs are recorded under
the stub, so on a GPU the direct launchers of its tapes call the stub too; CPU or GPU) it is the
process's CPU time, forward and backward apart (minimum over repeats of the mean of many calls),
after three steps (the first records each node, the next ones the whole runs: ``teeny.program.tape``).
With real launches (GPU only) it is that CPU time again
(``real host``: the replays launch straight through Triton's C launcher; the GPU is synchronised
before each step, outside its timing, but a forward that reads flags, as the GPT's cross-entropy
does, waits for its kernels inside it), the time per step (``zero_grad``, ``forward_train``,
``backward``) issued back to back (``_time_back_to_back``: the host time where the kernels are
shorter), next to a synchronised step's wall time and the same step captured in a CUDA graph (the
kernels alone), both in ms per step. Shapes are GPU-sized on the GPU and small on the CPU, where the
buffers' allocation would otherwise be the cost, and on the CPU torch runs one thread (its idle
pool's spinning after ``zero_grad`` would count as CPU time).

Case names: ``host stubbed: <row>``, ``host synced: <row>`` and ``host executor: <case>, <row>``
(``<row>``: ``stubbed forward``, ``stubbed backward``, ``stubbed both``, ``stubbed both, gradients
accumulating``, ``real host forward+backward``, ``real forward+backward`` in us per node; ``real
step synchronised``, ``real step captured`` in ms), the implementation ``teeny``, ``torch`` or
``raw``; the ``ms`` column holds ms (us / 1000). On the GPU the rows are appended to
bench/results/<gpu>.csv unless ``--no-save``.
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import contextlib
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import teeny
import teeny.torch
import torch
import torch.nn.functional as F
from teeny import ops
from teeny.core.kernel import dtype_name
from teeny.core.runtime import OpContext
from teeny.program.lowering import extra_buffers, node_context
from teeny.torch import apply, bridge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import append_results, make_row, sync, wall_time  # noqa: E402


class Identity(torch.autograd.Function):
    """torch's floor: what its autograd costs any custom op, teeny's or not."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


@contextlib.contextmanager
def stubbed_launches():
    """The lowest launch call does nothing inside the ``with`` block."""
    if teeny.core.device.INTERPRETER:
        from triton.runtime.interpreter import InterpretedFunction as owner

        name, stub = "run", lambda self, *args, **kwargs: None
    else:
        from triton.compiler.compiler import CompiledKernel as owner

        name, stub = "run", property(lambda self: lambda *args: None)
    original = owner.__dict__[name]
    setattr(owner, name, stub)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat, timer=time.process_time)) / number * 1e6


def measure(number: int, repeat: int) -> dict[str, float]:
    from teeny.ops.activation import _gelu_erf, _gelu_erf_grad, activation_backward, activation_forward

    device = teeny.DEVICE
    n = 1024
    x = torch.randn(n, device=device, requires_grad=True)
    seed = torch.ones(n, device=device)
    y, dx = torch.empty(n, device=device), torch.empty(n, device=device)
    fwd, bwd = activation_forward.jit, activation_backward.jit

    def raw_forward():
        fwd[(1,)](x, y, n, 0.0, 0.0, FN=_gelu_erf, BLOCK=1024)

    def raw_backward():
        bwd[(1,)](x, seed, dx, n, 0.0, 0.0, GRAD=_gelu_erf_grad, BLOCK=1024)

    def op_forward():
        with torch.no_grad():
            torch.ops.teeny.gelu(x)

    def op_both():
        torch.ops.teeny.gelu(x).backward(seed)

    torch.ops.teeny.gelu(x).backward(seed)  # builds the entries (no_grad's too) and compiles
    op_forward()
    raw_forward(), raw_backward()
    entry = next(e for e in bridge._ENTRIES.values() if "gelu" in e.key and e.training)
    ex = entry.executor
    p = ex.program.nodes[0]
    instance = next(iter(ex.program.instances.values()))

    def node_launches():  # what the executor does for the node, less binding and caching
        out = ex._alloc(p.node.output.shape, p.node.output.dtype)
        ctx = OpContext.for_forward(
            **node_context(ex.program, p, dry_run=False),
            inputs=[x.detach()],
            output=out,
            saved=extra_buffers(p, ex._alloc),
        )
        ctx.run(p.op.forward_launches(ctx))

    ctx = OpContext.for_forward(**node_context(ex.program, p, dry_run=False), inputs=[x.detach()], output=y, saved={})
    launch = p.op.forward_launches(ctx)[0]
    values = teeny.core.runtime.check_packing(launch.kernel, launch.args, "bench", 1024)

    def cache_and_backward():
        outs, cache = ex.forward_train({entry.input_names[0]: x.detach()})
        ex.backward(cache, seed)

    def entry_both():
        out = entry.forward([x.detach()])
        entry.backward([seed], [x.detach()])
        return out

    rows = {
        "raw launches forward": raw_forward,
        "raw launches forward+backward": lambda: (raw_forward(), raw_backward()),
        "torch.ops.teeny.gelu forward (no_grad)": op_forward,
        "torch.ops.teeny.gelu forward+backward": op_both,
        "torch's floor: autograd.Function (identity) forward+backward": lambda: Identity.apply(x).backward(seed),
        "torch's own gelu forward+backward": lambda: torch.nn.functional.gelu(x).backward(seed),
        "  library composite + below (grad mode)": lambda: torch.ops.teeny.gelu(x),
        "  bridge.call + below": lambda: bridge.call(entry, [x]),
        "  Compiled.forward + below": lambda: entry.forward([x.detach()]),
        "  Executor.forward_train + below": lambda: ex.forward_train({entry.input_names[0]: x.detach()}),
        "  node launches (context, packing, run_launch) + below": node_launches,
        "  KernelInstance.launch (stubbed below it)": lambda: instance.launch((1, 1, 1), values),
        "  Compiled.forward + Compiled.backward": entry_both,
        "  Executor.forward_train + Executor.backward": cache_and_backward,
    }
    with stubbed_launches():
        return {name: _us(fn, number, repeat) for name, fn in rows.items()}


def profile(calls: int) -> None:
    import cProfile
    import pstats

    x = torch.randn(1024, device=teeny.DEVICE, requires_grad=True)
    seed = torch.ones(1024, device=teeny.DEVICE)
    torch.ops.teeny.gelu(x).backward(seed)
    with stubbed_launches():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            torch.ops.teeny.gelu(x).backward(seed)
        profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def _time_back_to_back(fn, calls: int, repeats: int = 7) -> float:
    """Seconds per call of ``fn()`` called ``calls`` times in a row, then synchronised once (the
    fastest of ``repeats``): with kernels this small the host is the bottleneck, so this is the
    host time of a call, without the per-call synchronisation's latency and its noise."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


# ----------------------------------------------------------------------------- real launches, synchronised


def overhead(device, tiny: bool, profile: bool = False) -> dict:
    from teeny.ops.activation import _gelu_erf, _gelu_erf_grad, activation_backward, activation_forward

    n = 1024
    x = torch.randn(n, device=device, requires_grad=True)
    y = torch.empty(n, device=device)
    dx = torch.empty(n, device=device)
    block = 1024
    grid = (1,)
    fwd = activation_forward.jit
    bwd = activation_backward.jit
    reps = 20 if tiny else 2000

    def raw_forward():
        fwd[grid](x, y, n, 0.0, 0.0, FN=_gelu_erf, BLOCK=block)

    def raw_both():
        fwd[grid](x, y, n, 0.0, 0.0, FN=_gelu_erf, BLOCK=block)
        bwd[grid](x, y, dx, n, 0.0, 0.0, GRAD=_gelu_erf_grad, BLOCK=block)

    seed = torch.ones(n, device=device)

    def op_forward():
        with torch.no_grad():
            torch.ops.teeny.gelu(x)

    def op_both():
        torch.ops.teeny.gelu(x).backward(seed)

    def apply_both():
        apply(ops.gelu, x).backward(seed)

    # through the operators, as compiled code calls them, against torch's own gelu compiled
    compiled_op = torch.compile(lambda t: torch.ops.teeny.gelu(t), fullgraph=True)
    compiled_torch = torch.compile(lambda t: F.gelu(t), fullgraph=True)

    def compiled_op_both():
        compiled_op(x).backward(seed)

    def compiled_torch_both():
        compiled_torch(x).backward(seed)

    def torch_forward():
        with torch.no_grad():
            F.gelu(x)

    def torch_both():
        F.gelu(x).backward(seed)

    def floor_both():
        Identity.apply(x).backward(seed)

    def replay_off(fn):
        def run():
            teeny.core.config.replay = False
            try:
                fn()
            finally:
                teeny.core.config.replay = True

        return run

    out = {}
    for name, fn in [
        ("raw kernel forward", raw_forward),
        ("raw kernels forward+backward", raw_both),
        ("torch.ops.teeny.gelu forward", op_forward),
        ("torch.ops.teeny.gelu forward+backward", op_both),
        ("torch.ops.teeny.gelu forward, replay off", replay_off(op_forward)),
        ("torch.ops.teeny.gelu forward+backward, replay off", replay_off(op_both)),
        ("teeny.torch.apply(gelu) forward+backward", apply_both),
        ("torch.compile(torch.ops.teeny.gelu) forward+backward", compiled_op_both),
        ("torch.compile(F.gelu) forward+backward", compiled_torch_both),
        ("F.gelu forward (torch eager)", torch_forward),
        ("F.gelu forward+backward (torch eager)", torch_both),
        ("autograd.Function identity forward+backward (torch's floor)", floor_both),
    ]:
        out[name] = wall_time(fn, warmup=reps // 10, reps=reps) * 1e6
    back_to_back = {  # the goal's measure: host time per call, calls issued back to back
        "raw kernel forward": raw_forward,
        "raw kernels forward+backward": raw_both,
        "torch.ops.teeny.gelu forward": op_forward,
        "torch.ops.teeny.gelu forward+backward": op_both,
        "F.gelu forward+backward (torch eager)": torch_both,
        "autograd.Function identity forward+backward (torch's floor)": floor_both,
    }
    for name, fn in back_to_back.items():
        out[f"{name}, back to back"] = _time_back_to_back(fn, calls=reps // 4 or 1) * 1e6
    if profile:  # where the host time of a registered op's forward+backward goes
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            op_both()
        sync()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    out["op overhead forward (us)"] = out["torch.ops.teeny.gelu forward"] - out["raw kernel forward"]
    out["op overhead forward+backward (us)"] = (
        out["torch.ops.teeny.gelu forward+backward"] - out["raw kernels forward+backward"]
    )
    out["op overhead forward+backward over raw + torch's floor (us)"] = (
        out["op overhead forward+backward (us)"] - out["autograd.Function identity forward+backward (torch's floor)"]
    )
    b2b = {name: out[f"{name}, back to back"] for name in back_to_back}
    out["op overhead forward, back to back (us)"] = b2b["torch.ops.teeny.gelu forward"] - b2b["raw kernel forward"]
    out["op overhead forward+backward over raw + torch's floor, back to back (us)"] = (
        b2b["torch.ops.teeny.gelu forward+backward"]
        - b2b["raw kernels forward+backward"]
        - b2b["autograd.Function identity forward+backward (torch's floor)"]
    )
    return out


# ----------------------------------------------------------------------------- the executor's host path


def executor_cases(device: torch.device) -> dict[str, Callable[[], tuple]]:
    """Case name -> ``make()`` giving (executor, feed, grad_output) of a training program."""
    from harness import teeny_program
    from teeny import Graph, LoweringMode, lower
    from teeny.training.models import GPT

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    rows, width, heads, length, head_dim = (8192, 768, 12, 1024, 64) if gpu else (256, 128, 2, 64, 32)

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype)

    def single(fn, *inputs):
        ex, feed = teeny_program(fn, inputs)
        return ex, feed, torch.randn(ex.program.outputs[0].shape, device=device, dtype=dtype)

    def gpt():
        layers, d, ctx, batch, vocab = (4, 256, 128, 16, 512) if gpu else (3, 64, 32, 4, 96)
        model = GPT(vocab, ctx, d, 4, layers).to(dtype)
        g = Graph("gpt")
        idx, targets = g.input("x", (batch, ctx), torch.int64), g.input("y", (batch, ctx), torch.int64)
        g.output(ops.cross_entropy(ops.reshape(model(idx), (-1, vocab)), ops.reshape(targets, (-1,))))
        tokens = [torch.randint(0, vocab, (batch, ctx), device=device) for _ in range(2)]
        return teeny.Executor(lower(g, LoweringMode.TRAINING)), dict(zip("xy", tokens)), None

    q = (8 if gpu else 2, heads, length, head_dim)
    return {
        f"layer_norm {dtype_name(dtype)} {rows}x{width}": lambda: single(
            lambda x, w, b: ops.layer_norm(x, (width,), w, b), randn(rows, width), randn(width), randn(width)
        ),
        f"causal attention {dtype_name(dtype)} {'x'.join(map(str, q))}": lambda: single(
            lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True), randn(*q), randn(*q), randn(*q)
        ),
        f"linear {dtype_name(dtype)} {rows}x{width}->{4 * width}": lambda: single(
            ops.linear, randn(rows, width), randn(4 * width, width), randn(4 * width)
        ),
        f"GPT {'4L d256' if gpu else '3L d64'} {dtype_name(dtype)}": gpt,
    }


def executor_host(make: Callable[[], tuple], number: int, repeat: int, real: bool) -> dict[str, float]:
    """One case's rows (see the module docstring): us per node, and ms per step for the real step."""
    from harness import bench_ms, capture

    ex, feed, seed = make()
    nodes = len(ex.program.nodes)

    def step():
        ex.zero_grad()
        out, cache = ex.forward_train(feed)
        ex.backward(cache, seed)
        return out

    def timed_apart(zero_grad: bool) -> tuple[float, float]:  # (forward, backward) us per node, process CPU time
        best = (float("inf"), float("inf"))
        for _ in range(repeat):
            forward = backward = 0.0
            for _ in range(number):
                if zero_grad:  # as a training step: the backward writes the parameters' gradients in place
                    ex.zero_grad()
                if real:  # the GPU idle: no launch of the step waits for room in its queue
                    sync()
                start = time.process_time()
                out, cache = ex.forward_train(feed)
                middle = time.process_time()
                ex.backward(cache, seed)
                forward, backward = forward + middle - start, backward + time.process_time() - middle
            best = min(best, (forward, backward), key=sum)
        return best[0] / number / nodes * 1e6, best[1] / number / nodes * 1e6

    rows = {"nodes": float(nodes)}
    # stubbed: this executor's runs recorded (each node's launches, then its whole steps) while the
    # lowest launch call does nothing, so that on a GPU too their direct launchers call the stub
    with stubbed_launches():
        for _ in range(3):  # the first steps record: each node, then the whole run per state of the gradients
            step()
        forward, backward = timed_apart(zero_grad=True)
        rows.update({"stubbed forward": forward, "stubbed backward": backward, "stubbed both": forward + backward})
        forward, backward = timed_apart(zero_grad=False)
        rows["stubbed both, gradients accumulating"] = forward + backward
    if real:
        ex, feed, seed = make()
        for _ in range(3):
            step()
        forward, backward = timed_apart(zero_grad=True)  # the replays' launches straight through Triton's launcher
        rows["real host forward+backward"] = forward + backward
        rows["real forward+backward"] = _time_back_to_back(step, calls=number) / nodes * 1e6
        rows["real step synchronised"] = wall_time(step, warmup=3, reps=max(number, 10)) * 1e3
        graph, _ = capture(step)
        rows["real step captured"] = bench_ms(graph.replay)
    return rows


def executor_part(device: torch.device, number: int, repeat: int, profile: bool) -> list[dict]:
    """Print the executor part's table and return its result rows."""
    real = device.type == "cuda"
    print(f"executor: us per node of forward_train + backward (launches stubbed: CPU time, min of {repeat} x {number})")
    threads = torch.get_num_threads()
    if not real:  # the process's CPU time would count torch's pool of threads spinning after zero_grad's fill
        torch.set_num_threads(1)
    saved = []
    try:
        for name, make in executor_cases(device).items():
            rows = executor_host(make, number, repeat, real)
            line = ", ".join(f"{row} {value:.1f}" for row, value in rows.items())
            print(f"  {name}: {line}", flush=True)
            for row, value in rows.items():
                if row != "nodes":
                    ms = value if row.startswith("real step") else value * 1e-3
                    saved.append(make_row("host", f"host executor: {name}, {row}", "teeny", ms))
    finally:
        torch.set_num_threads(threads)
    if profile:  # where the stubbed host path of the GPT's forward + backward goes
        import cProfile
        import pstats

        ex, feed, seed = list(executor_cases(device).values())[-1]()
        with teeny.core.kernel.intercept_launches(lambda *launch: None):
            ex.backward(ex.forward_train(feed)[1], seed)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(number):
                ex.backward(ex.forward_train(feed)[1], seed)
            profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return saved


def impl_of(row: str) -> str:
    """Which side a row times: a raw launch, torch's own (its gelu, its custom-op floor) or teeny's call."""
    row = row.strip()
    if row.startswith("raw"):
        return "raw"
    if row.startswith(("torch's", "F.gelu", "torch.compile(F.gelu)", "autograd.Function")):
        return "torch"
    return "teeny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", nargs="*", choices=["stubbed", "synced", "executor"], help="which parts (default: all)"
    )
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat (stubbed)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="few repeats: check that every part runs")
    parser.add_argument("--profile", action="store_true", help="cProfile 2000 forward+backward calls")
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/<gpu>.csv")
    args = parser.parse_args()
    parts = args.only or ["stubbed", "synced", "executor"]
    saved = []
    if "executor" in parts:
        number, repeat = (3, 2) if args.tiny else (max(args.number // 20, 20), args.repeat)
        saved += executor_part(teeny.DEVICE, number, repeat, args.profile)
    if "synced" in parts and teeny.DEVICE.type == "cuda":
        synced = overhead(teeny.DEVICE, args.tiny, args.profile)
        width = max(len(name) for name in synced)
        print("real launches, us per call (each synchronised unless 'back to back'):")
        for name, us in synced.items():
            print(f"{name:<{width}}  {us:8.1f}")
            saved.append(make_row("host", f"host synced: {name}", impl_of(name), us * 1e-3))
    elif "synced" in parts:
        print("synced: real launches need the GPU (skipped)")
    if "stubbed" not in parts:
        if saved and not args.no_save and not args.tiny and torch.cuda.is_available():
            print("results:", append_results(saved))
        return
    if args.tiny:
        args.number, args.repeat = 20, 2
    print(
        f"device: {teeny.core.device.describe()}; launches stubbed; us per call (min of {args.repeat} x {args.number})"
    )
    results = measure(args.number, args.repeat)
    width = max(len(name) for name in results)
    for name, us in results.items():
        print(f"{name:<{width}}  {us:8.1f}")
    for what, op, raw in [
        ("forward (no_grad)", "torch.ops.teeny.gelu forward (no_grad)", "raw launches forward"),
        ("forward+backward", "torch.ops.teeny.gelu forward+backward", "raw launches forward+backward"),
    ]:
        print(f"{'overhead ' + what + ' over raw':<{width}}  {results[op] - results[raw]:8.1f}")
    floor = results["torch's floor: autograd.Function (identity) forward+backward"]
    teeny_own = results["torch.ops.teeny.gelu forward+backward"] - results["raw launches forward+backward"] - floor
    print(f"{'teeny own forward+backward (over raw + floor)':<{width}}  {teeny_own:8.1f}")
    saved += [
        make_row("host", f"host stubbed: {name.strip()}", impl_of(name), us * 1e-3) for name, us in results.items()
    ]
    if saved and not args.no_save and not args.tiny and torch.cuda.is_available():
        print("results:", append_results(saved))
    if args.profile:
        profile(2000)


if __name__ == "__main__":
    main()
