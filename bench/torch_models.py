"""Hugging Face models inside teeny's PyTorch bridge and imported into teeny, on the GPU (issues 12, 13).

    PYTHONPATH=src python3 bench/torch_models.py            # about 9 minutes on an H200
    PYTHONPATH=src python3 bench/torch_models.py --only patched --precisions bf16-autocast \
        --variants eager,patched,compile-ro,patched-compile-ro     # issue 12's table, one run
    PYTHONPATH=src python3 bench/torch_models.py --tiny     # a smoke run of every part (CPU too)

(The registered op's per-call overhead, part 1 of the old bench_torch.py, is ``bench/host.py
--only synced``.)

2. A GPT-2-small training step from ``transformers`` (batch 8 x 512, AdamW): unpatched and
   ``teeny.torch.patch``-ed, eager and under ``torch.compile``, in float32 and under bfloat16
   autocast; step time and peak memory.
3. The same GPT-2-small imported with ``teeny.torch.from_torch`` and trained by teeny
   (``TrainStep``, CUDA graph), against ``teeny.training.models.GPT`` of the same size.

Case names: ``hf gpt2 8x512 <precision>`` with the variant as the implementation (``eager``,
``patched``, ``compile``, ``patched-compile``, ``compile-ro``, ...), and ``hf gpt2 8x512 imported``
(``teeny-imported``, ``teeny-native``); rows go to bench/results/<gpu>.csv unless ``--no-save``
or ``--tiny``. Prints a table and writes ``bench_torch.json`` under ``$OUT`` when set.
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import collections
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import teeny
import teeny.torch
import torch
import torch.nn.functional as F
from teeny import LoweringMode, ops
from teeny.torch import from_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_ratios, append_results, make_row, sync, wall_time  # noqa: E402
from tools.kernel_gaps import kernel_gaps  # noqa: E402


def _peak(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**20


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
            seconds = wall_time(step, warmup=2 if tiny else 5, reps=reps)
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
        sync()
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
    sync()
    profiler.disable()
    print(f"== host functions of 3 steps (cProfile): {name}", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


# ----------------------------------------------------------------------------- 3. imported GPT-2


def imported_gpt2(device, tiny: bool) -> dict:
    from teeny.training.loop import TrainStep
    from teeny.training.models import GPT
    from teeny.training.optim import AdamW

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
        ("teeny.training.models.GPT", g, {"x": ids, "y": ids}),
    ]:
        executor = teeny.Executor(teeny.lower(graph_, LoweringMode.TRAINING))
        step = TrainStep(executor, AdamW(executor, lr=1e-4), cuda_graph=device.type == "cuda")
        try:
            seconds = wall_time(lambda: step(feed), warmup=3, reps=reps)
            results[label] = {"step ms": seconds * 1e3, "peak MiB": _peak(lambda: step(feed))}
        except Exception as exc:
            results[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return results


VARIANT_IMPLS = {  # the result file's implementation names of patched_gpt2's labels
    "eager": "eager",
    "patched eager": "patched",
    "patched eager, head and loss unfused": "patched-logits",
    "torch.compile": "compile",
    "patched + torch.compile": "patched-compile",
    "torch.compile reduce-overhead": "compile-reduce-overhead",
    "patched + torch.compile reduce-overhead": "patched-compile-reduce-overhead",
}


def result_rows(report: dict) -> list[dict]:
    """The report's step times as result rows (bench/harness.py); peak memory in the note."""
    rows = []
    for name, r in report.get("GPT-2 training step, patched", {}).items():
        label, precision = name.rsplit(", ", 1)
        note = f"peak {r['peak MiB']:.0f} MiB" if "peak MiB" in r else r.get("error", "")
        rows.append(make_row("torch_models", f"hf gpt2 8x512 {precision}", VARIANT_IMPLS.get(label, label),
                             r.get("step ms"), note=note))  # fmt: skip
    for label, r in report.get("GPT-2 training step, imported", {}).items():
        if isinstance(r, dict):
            impl = "teeny-imported" if label.startswith("imported") else "teeny-native"
            note = f"peak {r['peak MiB']:.0f} MiB" if "peak MiB" in r else r.get("error", "")
            rows.append(make_row("torch_models", "hf gpt2 8x512 imported", impl, r.get("step ms"), note=note))
    return add_ratios(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: check that every part runs")
    parser.add_argument("--only", choices=["patched", "imported"], nargs="*")
    parser.add_argument("--no-save", action="store_true", help="do not append to bench/results/<gpu>.csv")
    parser.add_argument("--profile", action="store_true", help="profile the patched steps")
    parser.add_argument("--precisions", default="fp32,bf16-autocast", help="patched GPT-2: fp32, bf16-autocast")
    parser.add_argument(
        "--variants",
        default="eager,patched,compile,patched-compile",
        help="patched GPT-2: which steps, in order (also compile-ro, patched-compile-ro: mode reduce-overhead; "
        "patched-logits: patched with the head and loss left unfused)",
    )
    args = parser.parse_args()
    device = teeny.DEVICE
    parts = args.only or ["patched", "imported"]
    report = {"device": teeny.core.device.describe(), "tiny": args.tiny}
    if "patched" in parts:
        report["GPT-2 training step, patched"] = patched_gpt2(
            device, args.tiny, args.precisions.split(","), args.variants.split(","), args.profile
        )
    if "imported" in parts:
        report["GPT-2 training step, imported"] = imported_gpt2(device, args.tiny)
    if not args.tiny and not args.no_save and torch.cuda.is_available():
        print("results:", append_results(result_rows(report)))
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_torch.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
