"""Host time of a registered op per call, with the device work taken out (issue 12).

    PYTHONPATH=src python bench/bench_host.py               # CPU (interpreter) or GPU
    PYTHONPATH=src python bench/bench_host.py --profile     # and cProfile of forward+backward

The lowest launch call is stubbed to a no-op: Triton's compiled launcher (``CompiledKernel.run``)
on the GPU, the interpreter's ``InterpretedFunction.run`` on the CPU. What is left is host work:
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
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import contextlib
import time
import timeit

import teeny
import teeny.torch
import torch
from teeny.lowering import extra_buffers, make_context
from teeny.torch import bridge


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
    if teeny.device.INTERPRETER:
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
    from teeny.kernels.activation import _gelu_erf, _gelu_erf_grad, activation_backward, activation_forward

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
        ctx = make_context(ex.program, p, [x.detach()], out, extra_buffers(p, ex._alloc), dry_run=False)
        ctx.run(p.op.forward_launches(ctx))

    launch = p.op.forward_launches(make_context(ex.program, p, [x.detach()], y, {}, dry_run=False))[0]
    values = teeny.runtime.check_packing(launch.kernel, launch.args, "bench", 1024)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile 2000 forward+backward calls")
    args = parser.parse_args()
    print(f"device: {teeny.device.describe()}; launches stubbed; us per call (min of {args.repeat} x {args.number})")
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
    if args.profile:
        profile(2000)


if __name__ == "__main__":
    main()
