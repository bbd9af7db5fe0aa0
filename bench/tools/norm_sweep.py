"""The fused add + norm of a float32 residual stream (``AddNormOp`` as mixed precision lowers a
transformer's junction: the stream's sum with a bf16 sublayer output, rms_norm or layer_norm, a
bf16 output; backward with the gradient waiting from the later layers added and the branch's
bf16 gradient written beside the stream's) at a model's width, swept over the norm kernels'
tiling: per kernel time from the profiler, against the bytes each must move.

    PYTHONPATH=src python3 bench/tools/norm_sweep.py [--cases 8192x1024:rms,8192x768:layer]

The tiling is ``teeny.ops.norm.tiling``'s module constants (``GPU_TILE``: elements of a tile,
``PROGRAMS_PER_SM``: programs of the fused backward, each writing one partial row of dw), set
per case before the program is lowered. A row of the table: shape, norm, tile, programs per SM,
forward and backward microseconds, and what fraction of the copy ceiling (3.0 TB/s on the H100,
4.24 on the H200) the backward's bytes make.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, "src")
import teeny  # noqa: E402
from teeny import Graph, LoweringMode, lower, ops  # noqa: E402
from teeny.ops.norm import tiling  # noqa: E402

CEILING_TBS = {"H100": 3.0, "H200": 4.24}


def _program(rows: int, width: int, norm: str):
    """The junction as mixed precision makes it of a float32 model: the sublayer (a linear of
    a narrow input, computed in bf16) added to the float32 stream and normalised."""
    g = Graph("junction")
    stream = g.input("stream", (rows, width), torch.float32, requires_grad=True)
    x = g.input("x", (rows, 64), torch.float32, requires_grad=True)
    w = g.input("w", (width, 64), torch.float32, requires_grad=True)
    weight = g.input("weight", (width,), torch.float32, requires_grad=True)
    s = ops.add(stream, ops.linear(x, w))
    y = ops.rms_norm(s, (width,), weight) if norm == "rms" else ops.layer_norm(s, (width,), weight)
    g.output(y, s)  # s also an output: its gradient waits for the norm's backward to add to it
    program = lower(g, LoweringMode.TRAINING, precision="bf16-mixed", seeded=2)
    names = {p.op.name for p in program.nodes}
    assert any(name.startswith("add_") for name in names), names  # the fused add + norm
    return program


def _kernel_us(fn, names) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for evt in prof.key_averages():
        for name in names:
            if evt.key.startswith(name):
                out[name] = out.get(name, 0.0) + evt.device_time_total / 20
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8192x1024:rms,8192x768:layer", help="the Llama's, GPT-2's")
    parser.add_argument("--tiles", default="2048,4096,8192")
    parser.add_argument("--programs", default="2,4,8")
    args = parser.parse_args()
    card = next((k for k in CEILING_TBS if k in torch.cuda.get_device_name()), "H100")
    head = "| shape | norm | tile | programs/SM | forward us | backward us (+ partial sums) |"
    print(f"{head} backward bytes at {card} copy speed |")
    print("|---|---|---|---|---|---|---|")
    for shape, norm in (case.split(":") for case in args.cases.split(",")):
        rows, width = (int(n) for n in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        feed = {
            "stream": torch.randn(rows, width, device="cuda", generator=gen),
            "x": torch.randn(rows, 64, device="cuda", generator=gen),
            "w": torch.randn(width, 64, device="cuda", generator=gen) / 8,
            "weight": torch.rand(width, device="cuda", generator=gen) + 0.5,
        }
        dy = torch.randn(rows, width, device="cuda", generator=gen)  # y is cast back to float32 at the output
        ds = torch.randn(rows, width, device="cuda", generator=gen)
        # backward bytes: x (f32), dy (bf16), the waiting gradient (f32) read; dx (f32), the branch's (bf16) written
        moved = rows * width * (4 + 2 + 4 + 4 + 2)
        for tile, per_sm in itertools.product(args.tiles.split(","), args.programs.split(",")):
            tiling.GPU_TILE, tiling.PROGRAMS_PER_SM = int(tile), int(per_sm)
            ex = teeny.Executor(_program(rows, width, norm))

            def step(ex=ex):
                _, cache = ex.forward_train(feed)
                ex.backward(cache, [dy, ds])

            for _ in range(3):
                step()
            us = _kernel_us(step, ("norm_forward", "norm_backward", "sum_to_shape"))
            back = us.get("norm_backward", 0.0)
            sums = us.get("sum_to_shape", 0.0)
            share = moved / (back * 1e-6) / (CEILING_TBS[card] * 1e12) if back else 0.0
            print(
                f"| {shape} | {norm} | {tile} | {per_sm} | {us.get('norm_forward', 0.0):.1f} | "
                f"{back:.1f} (+{sums:.1f}) | {share:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
