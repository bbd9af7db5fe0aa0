"""The chunked head's loss kernel (``class_loss_forward`` with its gradient written over the
logits) on one chunk of GPT-2's head, across column blocks, rows per program and warps.

    PYTHONPATH=src python bench/tools/loss_sweep.py            # 2,048 x 50,257 bf16 (rows 50,272 apart)
    PYTHONPATH=src python bench/tools/loss_sweep.py --smoke    # tiny sizes: check the script (CPU too)

A chunk reads the logits once from memory and writes their gradient over them (its second
pass reads the rows again, from L2 if they are still there): 2 x rows x row length x 2 bytes.
Each configuration is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``), reported
in us and TB/s of those bytes, and its loss, lse and gradient checked against the default's.
The default (``ClassLossOp.tile_shape``, Triton's 4 warps) comes first.

``--row-align CLASSES:ALIGN ...`` (the old loss_row_stride.py, v16-v17) times instead GPT-2's head
(4,096 rows, d 768, bf16) lowered with the logits rows padded to a multiple of ALIGN elements:
forward_train with tuning off, and the class-loss kernel's own time (torch.profiler). v16 found
436 us a chunk at 50,264 columns apart and 546 at 50,272 before the loss kernel read whole padded
rows (its masks at 50,257 columns had allowed only one bf16 a load).

    PYTHONPATH=src python3 bench/tools/loss_sweep.py --row-align 50257:8 50257:16 50304:16
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import itertools
import os

import teeny.ops  # chooses the device (a bare `import teeny` does not yet)
import torch
import triton

from teeny.core.common import cdiv
from teeny.fusions import chunked_loss
from teeny.ops.loss.kernels import class_loss_forward
from teeny.ops.loss.ops import ClassLossOp


def row_align(align: int, classes: int, rows: int = 4096, d: int = 768) -> None:
    """GPT-2's head + loss with the logits rows ``align`` elements apart: forward ms and the
    class-loss kernel's us a chunk."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from teeny import Executor, Graph, LoweringMode, lower, ops

    chunked_loss.ROW_ALIGN = align
    g = Graph("head")
    x = g.input("x", (rows, d), torch.bfloat16, requires_grad=True)
    y = g.input("y", (rows,), torch.int64)
    g.output(ops.cross_entropy(teeny.nn.Linear(d, classes, bias=False, dtype=torch.bfloat16)(x), y))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    feed = {"x": torch.randn(rows, d, device=teeny.DEVICE, dtype=torch.bfloat16),
            "y": torch.randint(0, classes, (rows,), device=teeny.DEVICE)}  # fmt: skip
    for _ in range(3):
        ex.forward_train(feed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        ex.forward_train(feed)
    torch.cuda.synchronize()
    step = (time.perf_counter() - start) / 10 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            ex.forward_train(feed)
        torch.cuda.synchronize()
    kernel = [e for e in prof.key_averages() if e.key == "class_loss_forward"]
    per_call = kernel[0].device_time_total / kernel[0].count if kernel else float("nan")
    print(f"{classes} classes, rows {cdiv(classes, align) * align} apart: forward {step:.3f} ms, "
          f"class_loss_forward {per_call:.1f} us a chunk")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=50257)
    parser.add_argument("--row-align", nargs="*", metavar="CLASSES:ALIGN", help="time the head per row padding")
    args = parser.parse_args()
    if args.row_align is not None:
        os.environ["TEENY_TUNING"] = "0"  # the heuristic's configurations: the same for every padding
        for pair in args.row_align or ["50257:8", "50257:16"]:
            classes, align = map(int, pair.split(":"))
            row_align(align, classes)
        return
    rows, classes = (4, 100) if args.smoke else (args.rows, args.classes)
    padded = cdiv(classes, chunked_loss.ROW_ALIGN) * chunked_loss.ROW_ALIGN
    device = teeny.DEVICE
    gen = torch.Generator(device=device).manual_seed(0)
    source = torch.randn(rows, padded, device=device, dtype=torch.bfloat16, generator=gen) * 4
    target = torch.randint(0, classes, (rows,), device=device, generator=gen)
    op = ClassLossOp("cross_entropy", from_logits=True, reduction="sum")
    default_rows, default_block = op.tile_shape(rows, classes)
    blocks = [256, 512] if args.smoke else [1024, 2048, 4096, 8192]
    configs = [(default_rows, default_block, 4)] + [
        (r, b, w)
        for r, b, w in itertools.product([1, 2, 4], blocks, [4, 8, 16] if not args.smoke else [4])
        if r * b <= 16384 and (r, b, w) != (default_rows, default_block, 4)
    ]
    moved = 2 * rows * padded * 2
    reference = None
    print(f"class_loss_forward, {rows} x {classes} bf16 (rows {padded} apart), {moved / 1e6:.0f} MB each way and back")
    for r, b, w in configs:
        logits = source.clone()
        lse = torch.empty(rows, device=device, dtype=torch.float32)
        programs = cdiv(rows, r)
        out = torch.empty((programs, 1), device=device, dtype=torch.float32)
        kwargs = op.kernel_args(
            logits[:, :classes], target, weight=None, lse=lse, mass=None, shape=(rows, classes), padded_rows=padded
        )
        kwargs.update(ROWS=r, BLOCK_C=b, out_ptr=out, bad_index_ptr=None, grad_ptr=logits[:, :classes])

        def launch(kwargs=kwargs, programs=programs, w=w):
            class_loss_forward.jit[(programs,)](**kwargs, num_warps=w)

        launch()
        result = (out.sum(), lse.clone(), logits[:, :classes].float())
        if reference is None:
            reference = result
        ok = all(torch.allclose(a, e, rtol=2e-2, atol=2e-2) for a, e in zip(result, reference))
        if device.type == "cuda":
            ms = triton.testing.do_bench_cudagraph(launch, rep=50)
            rate = f"{ms * 1e3:8.1f} us {moved / ms / 1e9:6.2f} TB/s"
        else:
            rate = "(not timed on the CPU)"
        print(f"  rows {r} block {b:5d} warps {w:2d}: {rate}{'' if ok else '  WRONG'}", flush=True)


if __name__ == "__main__":
    main()
