"""The chunked head's loss kernel (``class_loss_forward`` with its gradient written over the
logits) on one chunk of GPT-2's head, across column blocks, rows per program and warps.

    PYTHONPATH=src python bench/loss_sweep.py            # 2,048 x 50,257 bf16 (rows 50,272 apart)
    PYTHONPATH=src python bench/loss_sweep.py --smoke    # tiny sizes: check the script (CPU too)

A chunk reads the logits once from memory and writes their gradient over them (its second
pass reads the rows again, from L2 if they are still there): 2 x rows x row length x 2 bytes.
Each configuration is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``), reported
in us and TB/s of those bytes, and its loss, lse and gradient checked against the default's.
The default (``ClassLossOp._blocks``, Triton's 4 warps) comes first.
"""

from __future__ import annotations  # noqa: I001  (teeny before triton: it chooses the device)

import argparse
import itertools

import teeny.ops  # chooses the device (a bare `import teeny` does not yet)
import torch
import triton

from teeny.kernels import loss
from teeny.kernels.common import cdiv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=50257)
    args = parser.parse_args()
    rows, classes = (4, 100) if args.smoke else (args.rows, args.classes)
    padded = cdiv(classes, loss.ROW_ALIGN) * loss.ROW_ALIGN
    device = teeny.DEVICE
    gen = torch.Generator(device=device).manual_seed(0)
    source = torch.randn(rows, padded, device=device, dtype=torch.bfloat16, generator=gen) * 4
    target = torch.randint(0, classes, (rows,), device=device, generator=gen)
    op = loss.ClassLossOp("cross_entropy", from_logits=True, reduction="sum")
    default_rows, default_block = op._blocks(rows, classes)
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
        kwargs = op.kernel_args(logits[:, :classes], target, None, lse, None, (rows, classes), padded)
        kwargs.update(ROWS=r, BLOCK_C=b, out_ptr=out, bad_index_ptr=None, grad_ptr=logits[:, :classes])

        def launch(kwargs=kwargs, programs=programs, w=w):
            loss.class_loss_forward.jit[(programs,)](**kwargs, num_warps=w)

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
