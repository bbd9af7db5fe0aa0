"""Forward+backward time of the shape, embedding and dropout kernels against PyTorch eager.

    PYTHONPATH=src python3 bench/bench_shape_embedding.py        # about 1-2 minutes on an H200

Uses only calls that exist before and after the launch-contract conversion of these families,
so running it on two versions compares them (advanced indexing is skipped where it is missing).
Each case first checks teeny's output and first input gradient against eager (relative error),
then times forward + backward with ``triton.testing.do_bench`` (median, ms). ``floor`` is the
fewest bytes the op must move forwards and backwards over the measured copy bandwidth. Results
go to stdout and, as JSON, to ``$OUT/bench_shape_embedding.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
import triton

import teeny
from teeny import ops
from teeny.interop.torch import apply

DEV = "cuda"


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + written)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases() -> list[dict]:
    out = []
    vocab, dim, tokens = 50257, 768, 8 * 1024
    idx = torch.randint(0, vocab, (8, 1024), device=DEV)
    w = torch.randn(vocab, dim, device=DEV, dtype=torch.bfloat16)
    moved = _nbytes(idx) * 2 + tokens * dim * 2 * 4 + _nbytes(w) * 2  # gather, dy read, dW zero + write
    for deterministic in (False, True):
        out.append(
            dict(
                name=f"embedding bf16 {vocab}x{dim}, 8x1024 tokens, deterministic={deterministic}",
                teeny=lambda i, t, d=deterministic: ops.embedding(i, t, deterministic=d),
                torch=F.embedding,
                inputs=[idx, w],
                grad_of=1,
                bytes=moved,
            )
        )
    x = torch.randn(8192, 8192, device=DEV)
    out.append(
        dict(
            name="transpose fp32 8192x8192",
            teeny=lambda t: ops.transpose(t, 0, 1),
            torch=lambda t: t.transpose(0, 1).contiguous(),
            inputs=[x],
            bytes=4 * _nbytes(x),
        )
    )
    a, b = torch.randn(4096, 4096, device=DEV), torch.randn(4096, 2048, device=DEV)
    out.append(
        dict(
            name="concat fp32 4096x(4096+2048) dim 1",
            teeny=lambda p, q: ops.concat([p, q], 1),
            torch=lambda p, q: torch.cat([p, q], 1),
            inputs=[a, b],
            bytes=4 * _nbytes(a, b),
        )
    )
    out.append(
        dict(
            name="getitem fp32 8192x8192 [:, 1::2]",
            teeny=lambda t: t[:, 1::2],
            torch=lambda t: t[:, 1::2],
            inputs=[x],
            bytes=3 * _nbytes(x),
        )
    )
    rows = torch.randint(-8192, 8192, (16384,), device=DEV)
    out.append(
        dict(
            name="getitem fp32 8192x4096 [index of 16384 rows]",
            teeny=lambda t, i: t[i],
            torch=lambda t, i: t[i],
            inputs=[x[:, :4096].contiguous(), rows],
            bytes=16384 * 4096 * 4 * 2 + 2 * 8192 * 4096 * 4,
            advanced=True,
        )
    )
    y = torch.randn(8192, 1, device=DEV)
    out.append(
        dict(
            name="expand fp32 8192x1 -> 8192x8192",
            teeny=lambda t: ops.expand(t, 8192, 8192),
            torch=lambda t: t.expand(8192, 8192).contiguous(),
            inputs=[y],
            bytes=2 * 8192 * 8192 * 4,
        )
    )
    d = torch.randn(2**27, device=DEV)
    out.append(
        dict(
            name="dropout fp32 2^27 p=0.1 (timing only: masks differ from torch)",
            teeny=lambda t: ops.dropout(t, 0.1, seed=1),
            torch=lambda t: F.dropout(t, 0.1),
            inputs=[d],
            bytes=4 * _nbytes(d),
            check=False,
        )
    )
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def main() -> None:
    assert teeny.DEVICE.type == "cuda", "this benchmark needs a GPU"
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    results = []
    for case in cases():
        k = case.get("grad_of", 0)

        def fresh(case=case, k=k):
            return [t.detach().clone().requires_grad_(j == k) for j, t in enumerate(case["inputs"])]

        row = {"case": case["name"], "floor_ms": case["bytes"] / bw * 1e3}
        for label, fn in (("teeny", lambda *xs, f=case["teeny"]: apply(f, *xs)), ("eager", case["torch"])):
            xs = fresh()
            try:
                out = fn(*xs)
            except Exception as exc:  # e.g. advanced indexing on a version without it
                row[label] = f"unavailable: {type(exc).__name__}: {str(exc)[:80]}"
                continue
            grad = torch.randn_like(out)
            out.backward(grad)
            if label == "teeny" and case.get("check", True):
                ref_in = fresh()
                ref = case["torch"](*ref_in)
                ref.backward(grad)
                row["rel_err_out"] = rel_err(out, ref)
                row["rel_err_grad"] = rel_err(xs[k].grad, ref_in[k].grad)

            def step(fn=fn, xs=xs, grad=grad):
                fn(*xs).backward(grad)

            row[label] = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
        results.append(row)
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c)) for c in ("teeny", "eager")]
        errs = f"err out {row.get('rel_err_out', float('nan')):.1e} grad {row.get('rel_err_grad', float('nan')):.1e}"
        print(f"{row['case']:70} teeny {cells[0]} ms  eager {cells[1]} ms  floor {row['floor_ms']:.3f} ms  {errs}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_shape_embedding.json"), "w") as f:
            json.dump({"copy_bandwidth": bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
