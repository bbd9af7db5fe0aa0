"""The chunked head + cross-entropy's loss kernel against the padding of its logits rows (v16).

    PYTHONPATH=src python bench/loss_row_stride.py

GPT-2's head (4,096 rows, d 768, vocabulary 50,257, bf16) lowered with the logits rows padded to
a multiple of 8 elements (50,264: 16 bytes, enough for TMA) and of 16 (50,272, the default:
a row length and offsets Triton knows are divisible by 16, so the loss kernel moves the rows
in 16-byte vectors), forward_train timed with tuning off, and the class-loss kernel's own time
from torch.profiler. H200, v16, before the loss kernel read whole padded rows (its masks at
50,257 columns allowed only one bf16 a load): 436 us a chunk at 50,264, 546 at 50,272, against
87 us for GPT-2 small's vocabulary of 50,304 in the bench_steps step.

    PYTHONPATH=src python bench/loss_row_stride.py 50304:16 50272:16 50257:48   # classes:align pairs
"""

import os
import sys
import time

os.environ.setdefault("TEENY_TUNING", "0")  # the heuristic's configurations: the same for both strides

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import teeny  # noqa: E402
from teeny import Graph, LoweringMode, lower, ops  # noqa: E402
from teeny.executor import Executor  # noqa: E402
from teeny.kernels import loss  # noqa: E402


def run(align: int, rows: int = 4096, d: int = 768, classes: int = 50257) -> None:
    loss.ROW_ALIGN = align
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
    print(
        f"{classes} classes, rows {-(-classes // align) * align} apart: forward {step:.3f} ms, "
        f"class_loss_forward {per_call:.1f} us a chunk"
    )


if __name__ == "__main__":
    # "classes:align" pairs (v17 run 2: which of the row length and the class count is slow)
    for case in sys.argv[1:] or ["50257:8", "50257:16", "50257:8", "50257:16"]:
        classes, align = map(int, case.split(":"))
        run(align, classes=classes)
