"""teeny inside PyTorch and PyTorch models inside teeny, on the GPU (issues 12 and 13).

    PYTHONPATH=src python bench/bench_torch.py            # about 10 minutes on an H200
    PYTHONPATH=src python bench/bench_torch.py --tiny     # a smoke run of every part (CPU too)

1. Overhead of a registered op: ``torch.ops.teeny.gelu`` and ``teeny.torch.apply`` per call
   against the raw Triton launch of the same kernel, on a small tensor (launch-bound), forward
   and forward+backward; the goal is at most 10 us over the raw kernels. Each call synchronised
   (median), and the main rows also back to back (host time per call, one synchronisation).
2. A GPT-2-small training step from ``transformers`` (batch 8 x 512, AdamW): unpatched and
   ``teeny.torch.patch``-ed, eager and under ``torch.compile``, in float32 and under bfloat16
   autocast; step time and peak memory.
3. The same GPT-2-small imported with ``teeny.torch.from_torch`` and trained by teeny
   (``TrainStep``, CUDA graph), against ``teeny.models.GPT`` of the same size.

Prints a table and writes ``bench_torch.json`` under ``$OUT`` when set.
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import collections
import copy
import json
import os
import time
import traceback

import teeny
import teeny.torch
import torch
import torch.nn.functional as F
from teeny import LoweringMode, ops
from teeny.torch import apply, from_torch

from kernel_gaps import kernel_gaps


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, warmup: int, reps: int) -> float:
    """Median seconds of ``fn()`` (synchronised)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _time_back_to_back(fn, calls: int, repeats: int = 7) -> float:
    """Seconds per call of ``fn()`` called ``calls`` times in a row, then synchronised once (the
    fastest of ``repeats``): with kernels this small the host is the bottleneck, so this is the
    host time of a call, without the per-call synchronisation's latency and its noise."""
    fn()
    _sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _peak(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return torch.cuda.max_memory_allocated() / 2**20


# ----------------------------------------------------------------------------- 1. overhead


def overhead(device, tiny: bool, profile: bool = False) -> dict:
    from bench_host import Identity  # torch's floor for any custom op
    from teeny.kernels.activation import _gelu_erf, _gelu_erf_grad, activation_backward, activation_forward

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
            teeny.config.replay = False
            try:
                fn()
            finally:
                teeny.config.replay = True

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
        out[name] = _time(fn, warmup=reps // 10, reps=reps) * 1e6
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
        _sync()
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


# ----------------------------------------------------------------------------- 2. patched GPT-2


def _gpt2(tiny: bool, device):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if tiny:
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4)
        batch, length = 2, 8
    else:
        config = transformers.GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
        batch, length = 8, 512
    config.use_cache = False
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # teeny's attention has no dropout
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
    return model, ids, config


def patched_gpt2(device, tiny: bool, precisions: list[str], variants: list[str], profile: bool = False) -> dict:
    """The step of each variant in each precision ("fp32", or "bf16-autocast": float32 weights,
    the step under ``torch.autocast(bfloat16)``), eager variants first (the compiled ones take
    minutes to compile, and a slot that times out keeps what was printed)."""
    base, ids, _ = _gpt2(tiny, device)
    results = {}
    reps = 3 if tiny else 20
    known = {  # variant: (label, patched (teeny.torch.patch's keywords) or None, torch.compile mode or None)
        "eager": ("eager", None, None),
        "patched": ("patched eager", {}, None),
        "patched-logits": ("patched eager, head and loss unfused", {"fused_loss": False}, None),
        "compile": ("torch.compile", None, "default"),
        "patched-compile": ("patched + torch.compile", {}, "default"),
        "compile-ro": ("torch.compile reduce-overhead", None, "reduce-overhead"),
        "patched-compile-ro": ("patched + torch.compile reduce-overhead", {}, "reduce-overhead"),
    }
    plan = [(p, known[v]) for v in variants for p in precisions]
    for precision, (label, patch, mode) in plan:
        model = copy.deepcopy(base)
        swapped = None
        if patch is not None:  # what was swapped, in the results: a transformers version may not match
            swapped = collections.Counter(new for _, _, new in teeny.torch.patch(model, **patch).swapped)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        forward = torch.compile(model, mode=mode) if mode else model
        autocast = precision == "bf16-autocast"
        graphed = mode == "reduce-overhead" and device.type == "cuda"

        def step(optimizer=optimizer, forward=forward, autocast=autocast, graphed=graphed):
            if graphed:  # a new step: the CUDA graphs' outputs of the last one are dead
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = forward(ids, labels=ids).loss
            loss.backward()
            optimizer.step()

        name = f"{label}, {precision}"
        try:
            seconds = _time(step, warmup=2 if tiny else 5, reps=reps)
            results[name] = {"step ms": seconds * 1e3, "peak MiB": _peak(step)}
            if swapped is not None:
                results[name]["swapped"] = dict(swapped)
            if graphed:  # a graph inductor would not capture runs every kernel from the host
                from torch._dynamo.utils import counters

                results[name]["CUDA graph skips so far"] = counters["inductor"]["cudagraph_skips"]
            if profile:
                _profile_step(name, step, host=not mode)
        except Exception as exc:  # report and go on: one failing variant must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        print(f"patched GPT-2, {name}: {results[name]}", flush=True)  # a slot that times out keeps these
        del model, optimizer, forward
    return results


def _profile_step(name: str, step, host: bool = True) -> None:
    """The device time of three steps by kernel and the host's share (torch.profiler), then
    (``host``) the host's Python by function (cProfile)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        _sync()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"== profile of 3 steps: {name}\n" + prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    if torch.cuda.is_available():
        print(kernel_gaps(prof, steps=3), flush=True)
    if not host:
        return
    import cProfile
    import pstats

    profiler = cProfile.Profile()  # the host's Python: which functions the steps spend it in
    profiler.enable()
    for _ in range(3):
        step()
    _sync()
    profiler.disable()
    print(f"== host functions of 3 steps (cProfile): {name}", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


# ----------------------------------------------------------------------------- 3. imported GPT-2


def imported_gpt2(device, tiny: bool) -> dict:
    from teeny.models import GPT
    from teeny.optim import AdamW
    from teeny.train import TrainStep

    model, ids, config = _gpt2(tiny, device)
    model = model.cpu()
    ids_cpu = ids.cpu()

    def lm_loss(output, labels):
        logits = output.logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    results = {}
    start = time.perf_counter()
    graph = from_torch(model, {"input_ids": ids_cpu}, loss=lm_loss, targets=(ids_cpu,))
    results["import s"] = time.perf_counter() - start
    batch, length = ids.shape
    g = teeny.Graph("gpt")
    idx = g.input("x", (batch, length), torch.int64)
    y = g.input("y", (batch, length), torch.int64)
    native = GPT(config.vocab_size, length, config.n_embd, config.n_head, config.n_layer)
    logits = native(idx)
    flat = ops.reshape(ops.slice(logits, 1, 0, length - 1), ((length - 1) * batch, config.vocab_size))
    g.output(ops.cross_entropy(flat, ops.reshape(ops.slice(y, 1, 1, None), ((length - 1) * batch,))), logits)
    reps = 3 if tiny else 20
    for label, graph_, feed in [
        ("imported GPT-2 (teeny)", graph, {"input_ids": ids, "target": ids}),
        ("teeny.models.GPT", g, {"x": ids, "y": ids}),
    ]:
        executor = teeny.Executor(teeny.lower(graph_, LoweringMode.TRAINING))
        step = TrainStep(executor, AdamW(executor, lr=1e-4), cuda_graph=device.type == "cuda")
        try:
            seconds = _time(lambda: step(feed), warmup=3, reps=reps)
            results[label] = {"step ms": seconds * 1e3, "peak MiB": _peak(lambda: step(feed))}
        except Exception as exc:
            results[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: check that every part runs")
    parser.add_argument("--only", choices=["overhead", "patched", "imported"], nargs="*")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the registered op's host path; profile the patched eager steps"
    )
    parser.add_argument("--precisions", default="fp32,bf16-autocast", help="patched GPT-2: fp32, bf16-autocast")
    parser.add_argument(
        "--variants",
        default="eager,patched,compile,patched-compile",
        help="patched GPT-2: which steps, in order (also compile-ro, patched-compile-ro: mode reduce-overhead; "
        "patched-logits: patched with the head and loss left unfused)",
    )
    args = parser.parse_args()
    device = teeny.DEVICE
    parts = args.only or ["overhead", "patched", "imported"]
    report = {"device": teeny.device.describe(), "tiny": args.tiny}
    if "overhead" in parts:
        report["overhead (us per call)"] = overhead(device, args.tiny, args.profile)
    if "patched" in parts:
        report["GPT-2 training step, patched"] = patched_gpt2(
            device, args.tiny, args.precisions.split(","), args.variants.split(","), args.profile
        )
    if "imported" in parts:
        report["GPT-2 training step, imported"] = imported_gpt2(device, args.tiny)
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_torch.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
