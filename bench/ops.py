"""Forward + backward of teeny's ops against PyTorch eager, torch.compile and Liger-Kernel: the
memory-bound ops (against the copy ceiling), the products (against cuBLAS) and attention
(against each SDPA backend).

    PYTHONPATH=src python3 bench/ops.py                        # every case, about 5 minutes on an H100
    PYTHONPATH=src python3 bench/ops.py --area memory products  # an area or two
    PYTHONPATH=src python3 bench/ops.py --only layer_norm swiglu --compile default,max-autotune
    PYTHONPATH=src python3 bench/ops.py --list                  # the case names (any machine)

teeny's program is captured in a CUDA graph and replayed; torch runs as it runs (bench/harness.py).
``bytes`` is the fewest bytes forward + backward must move (each input read once, each output
written once), ``flops`` the products' 6 M K N (attention: forward 4 B H L^2 D, halved when
causal, backward 2.5x). Results: a table on stdout, rows appended to bench/results/<gpu>.csv.
torch.compile runs by default only for the cases of the first table (compile=True): about 10 s
of compiling a case.

The cases come from the scripts this file replaced (their names kept, so that old numbers in
docs/archive/bench-journal.md compare): bench_ops.py (the first rows of each area),
bench_elementwise.py, bench_norm_loss.py, bench_shape_embedding.py, issue9_rows.py (the unary
rows, the GPT-2 linear layers; the bias gradient's cost is the difference between a layer's row
with and without bias) and bench_attention.py's time section.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Case, liger_functions, main_for  # noqa: E402

DEV = "cuda"
ROWS, COLS = 16384, 4096  # the memory-bound tables' standard matrix
N27 = 2**27


def _t():
    """torch and torch.nn.functional, imported when a case is made (not when the table is read)."""
    import torch
    import torch.nn.functional as F

    return torch, F


def _ops():
    from teeny import ops

    return ops


def _randn(*shape, dtype="float32", scale=1.0, seed=0):
    torch, _ = _t()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(getattr(torch, dtype))


def _case(name, area, make, **kw) -> Case:
    return Case(name=name, area=area, make=make, **kw)


# ----------------------------------------------------------------------------- memory-bound


def memory_cases() -> list[Case]:
    torch, F = _t()
    ops = _ops
    L = _liger
    bf16 = "bfloat16"
    n = ROWS * COLS
    out: list[Case] = []

    # bench_ops.py's rows, with torch.compile and Liger-Kernel
    out.append(_case("gelu_tanh fp32 2^27", "memory", lambda: dict(
        inputs=[_randn(N27)], teeny=lambda x: ops().gelu(x, "tanh"), torch=lambda x: F.gelu(x, approximate="tanh")),
        bytes=20 * N27, compile=True))  # fmt: skip
    out.append(_case("softmax fp32 16384x4096", "memory", lambda: dict(
        inputs=[_randn(ROWS, COLS)], teeny=lambda x: ops().softmax(x, -1), torch=lambda x: torch.softmax(x, -1)),
        bytes=20 * n, compile=True))  # fmt: skip
    out.append(_case("layer_norm bf16 16384x4096", "memory", lambda: dict(
        inputs=[_randn(ROWS, COLS, dtype=bf16), _randn(COLS, dtype=bf16, seed=1), _randn(COLS, dtype=bf16, seed=2)],
        teeny=lambda x, w, b: ops().layer_norm(x, (COLS,), w, b),
        torch=lambda x, w, b: F.layer_norm(x, (COLS,), w, b),
        liger=(lambda x, w, b: L()["layer_norm"].apply(x, w, b, 1e-5)) if "layer_norm" in L() else None),
        bytes=10 * n, compile=True))  # fmt: skip
    out.append(_case("rms_norm bf16 16384x4096", "memory", lambda: dict(
        inputs=[_randn(ROWS, COLS, dtype=bf16), _randn(COLS, dtype=bf16, seed=1)],
        teeny=lambda x, w: ops().rms_norm(x, (COLS,), w, 1e-6),
        torch=lambda x, w: F.rms_norm(x, (COLS,), w, 1e-6),
        liger=(lambda x, w: L()["rms_norm"].apply(x, w, 1e-6, 0.0, "llama")) if "rms_norm" in L() else None),
        bytes=10 * n, compile=True))  # fmt: skip
    out.append(_case("swiglu bf16 16384x4096", "memory", lambda: dict(
        inputs=[_randn(ROWS, COLS, dtype=bf16), _randn(ROWS, COLS, dtype=bf16, seed=1)],
        teeny=lambda a, b: ops().swiglu(a, b), torch=lambda a, b: F.silu(a) * b,
        liger=(lambda a, b: L()["swiglu"].apply(a, b)) if "swiglu" in L() else None),
        bytes=2 * 7 * n, compile=True))  # fmt: skip
    out.append(_case("cross_entropy bf16 8192x32000", "memory", lambda: dict(
        inputs=[_randn(8192, 32000, dtype=bf16), torch.randint(32000, (8192,), device=DEV)],
        teeny=lambda x, t: ops().cross_entropy(x, t), torch=lambda x, t: F.cross_entropy(x, t),
        liger=(lambda x, t: L()["cross_entropy"].apply(x, t, None, -100, 0.0, 0.0, "mean", None, False)[0])
        if "cross_entropy" in L() else None),
        bytes=6 * 8192 * 32000, compile=True))  # fmt: skip

    # the unary family against the copy floor (issue9_rows.py): 20 bytes an fp32 element
    out.append(_case("tanh fp32 2^27", "memory", lambda: dict(
        inputs=[_randn(N27)], teeny=lambda x: ops().tanh(x), torch=torch.tanh), bytes=20 * N27))  # fmt: skip
    out.append(_case("mish fp32 2^27", "memory", lambda: dict(
        inputs=[_randn(N27)], teeny=lambda x: ops().mish(x), torch=F.mish), bytes=20 * N27))  # fmt: skip

    # element-wise and reductions (bench_elementwise.py)
    def ew(name, teeny, ref, shapes, nbytes, dtype="float32"):
        def make():
            return dict(inputs=[_randn(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)], teeny=teeny, torch=ref)

        out.append(_case(name, "memory", make, bytes=nbytes))

    big = [(ROWS, COLS)]
    ew("add bias fp32 16384x4096", lambda x, y: ops().add(x, y), lambda x, y: x + y, [(ROWS, COLS), (COLS,)], 12 * n)
    ew("mul fp32 16384x4096", lambda x, y: ops().mul(x, y), torch.mul, [(ROWS, COLS), (ROWS, COLS)], 32 * n)
    ew("mul by 0.3 bf16 16384x4096", lambda x: x * 0.3, lambda x: x * 0.3, big, 8 * n, dtype=bf16)
    ew("clamp -0.5 0.7 fp32", lambda x: ops().clamp(x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7), big, 20 * n)
    ew("sum dim -1 fp32", lambda x: ops().sum(x, -1), lambda x: x.sum(-1), big, 8 * n)
    ew("mean dim 0 fp32", lambda x: ops().mean(x, 0), lambda x: x.mean(0), big, 8 * n)
    ew("sum all fp32 (split)", lambda x: ops().sum(x), lambda x: x.sum(), big, 8 * n)
    ew("var dim -1 fp32", lambda x: ops().var(x, -1), lambda x: x.var(-1), big, 16 * n)
    ew("softmax bf16", lambda x: ops().softmax(x, -1), lambda x: torch.softmax(x, -1), big, 10 * n, dtype=bf16)
    ew("add bias fp32 64x64 (host)", lambda x, y: ops().add(x, y), lambda x, y: x + y, [(64, 64), (64,)], 0)
    ew("mul fp32 64x64 by 0.3 (host)", lambda x: x * 0.3, lambda x: x * 0.3, [(64, 64)], 0)

    # norms and losses (bench_norm_loss.py)
    def norm_inputs(rows, cols):
        return [_randn(rows, cols, dtype=bf16), _randn(cols, dtype=bf16, seed=1).abs() + 0.5,
                _randn(cols, dtype=bf16, seed=2)]  # fmt: skip

    out.append(_case("layer_norm bf16 8192x768 (GPT-2's rows)", "memory", lambda: dict(
        inputs=norm_inputs(8192, 768), teeny=lambda x, w, b: ops().layer_norm(x, (768,), w, b),
        torch=lambda x, w, b: F.layer_norm(x, (768,), w, b)), bytes=10 * 8192 * 768))  # fmt: skip
    out.append(_case("layer_norm bf16 16384x4096, dy a row-strided slice", "memory", lambda: dict(
        inputs=norm_inputs(ROWS, COLS), grad=_randn(ROWS, COLS + 64, dtype=bf16, seed=3)[:, 32 : 32 + COLS],
        teeny=lambda x, w, b: ops().layer_norm(x, (COLS,), w, b),
        torch=lambda x, w, b: F.layer_norm(x, (COLS,), w, b)), bytes=10 * n))  # fmt: skip
    img = (64, 256, 32, 32)
    out.append(_case("group_norm bf16 64x256x32x32, 32 groups", "memory", lambda: dict(
        inputs=[_randn(*img, dtype=bf16), _randn(256, dtype=bf16, seed=1).abs() + 0.5, _randn(256, dtype=bf16, seed=2)],
        teeny=lambda x, w, b: ops().group_norm(x, 32, w, b),
        torch=lambda x, w, b: F.group_norm(x, 32, w, b)), bytes=10 * 64 * 256 * 32 * 32))  # fmt: skip
    out.append(_case("batch_norm bf16 64x256x32x32 training", "memory", lambda: dict(
        inputs=[_randn(*img, dtype=bf16), _randn(256, dtype=bf16, seed=1).abs() + 0.5, _randn(256, dtype=bf16, seed=2)],
        teeny=lambda x, w, b: ops().batch_norm(x, None, None, w, b, training=True),
        torch=lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
        bytes=10 * 64 * 256 * 32 * 32))  # fmt: skip

    def ignored_targets():
        t = torch.randint(0, 32000, (8192,), device=DEV)
        t[::7] = -100
        return t

    out.append(_case("cross_entropy bf16 8192x32000 (ignore_index rows)", "memory", lambda: dict(
        inputs=[_randn(8192, 32000, dtype=bf16), ignored_targets()],
        teeny=lambda x, t: ops().cross_entropy(x, t), torch=lambda x, t: F.cross_entropy(x, t)),
        bytes=6 * 8192 * 32000))  # fmt: skip
    out.append(_case("cross_entropy bf16 8192x32000 label_smoothing 0.1", "memory", lambda: dict(
        inputs=[_randn(8192, 32000, dtype=bf16), ignored_targets()],
        teeny=lambda x, t: ops().cross_entropy(x, t, label_smoothing=0.1),
        torch=lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)), bytes=6 * 8192 * 32000))  # fmt: skip
    out.append(_case("sums: bias add bf16 8192x4096 (db: column sums)", "memory", lambda: dict(
        inputs=[_randn(8192, 4096, dtype=bf16), _randn(4096, dtype=bf16, seed=1)],
        teeny=lambda x, b: ops().add(x, b), torch=lambda x, b: x + b), bytes=10 * 8192 * 4096))  # fmt: skip
    out.append(_case("sums: mse_loss bf16 8192x4096 mean (one scalar from many partials)", "memory", lambda: dict(
        inputs=[_randn(8192, 4096, dtype=bf16), _randn(8192, 4096, dtype=bf16, seed=1)],
        teeny=lambda x, t: ops().mse_loss(x, t), torch=lambda x, t: F.mse_loss(x, t)),
        bytes=10 * 8192 * 4096))  # fmt: skip
    out.append(_case("mse_loss fp32 2^26 mean", "memory", lambda: dict(
        inputs=[_randn(2**26), _randn(2**26, seed=1)],
        teeny=lambda x, t: ops().mse_loss(x, t), torch=lambda x, t: F.mse_loss(x, t)), bytes=20 * 2**26))  # fmt: skip

    # shape, embedding and dropout (bench_shape_embedding.py)
    vocab, dim = 50257, 768
    emb_bytes = 8 * 1024 * 8 * 2 + 8 * 1024 * dim * 2 * 4 + vocab * dim * 2 * 2  # ids twice, gather, dy, dW
    for det in (False, True):
        out.append(_case(f"embedding bf16 {vocab}x{dim}, 8x1024 tokens, deterministic={det}", "memory",
            lambda det=det: dict(
                inputs=[torch.randint(0, vocab, (8, 1024), device=DEV), _randn(vocab, dim, dtype=bf16)],
                grad_of=1, teeny=lambda i, w: ops().embedding(i, w, deterministic=det), torch=F.embedding),
            bytes=emb_bytes))  # fmt: skip
    x4 = 8192 * 8192 * 4
    out.append(_case("transpose fp32 8192x8192", "memory", lambda: dict(
        inputs=[_randn(8192, 8192)], teeny=lambda t: ops().transpose(t, 0, 1),
        torch=lambda t: t.transpose(0, 1).contiguous()), bytes=4 * x4))  # fmt: skip
    out.append(_case("concat fp32 4096x(4096+2048) dim 1", "memory", lambda: dict(
        inputs=[_randn(4096, 4096), _randn(4096, 2048, seed=1)], teeny=lambda p, q: ops().concat([p, q], 1),
        torch=lambda p, q: torch.cat([p, q], 1)), bytes=4 * 4096 * 6144 * 4))  # fmt: skip
    out.append(_case("getitem fp32 8192x8192 [:, 1::2]", "memory", lambda: dict(
        inputs=[_randn(8192, 8192)], teeny=lambda t: t[:, 1::2], torch=lambda t: t[:, 1::2]),
        bytes=3 * x4))  # fmt: skip
    out.append(_case("getitem fp32 8192x4096 [index of 16384 rows]", "memory", lambda: dict(
        inputs=[_randn(8192, 4096), torch.randint(-8192, 8192, (16384,), device=DEV)],
        teeny=lambda t, i: t[i], torch=lambda t, i: t[i]),
        bytes=16384 * 4096 * 4 * 2 + 2 * 8192 * 4096 * 4))  # fmt: skip
    out.append(_case("expand fp32 8192x1 -> 8192x8192", "memory", lambda: dict(
        inputs=[_randn(8192, 1)], teeny=lambda t: ops().expand(t, 8192, 8192),
        torch=lambda t: t.expand(8192, 8192).contiguous()), bytes=2 * x4))  # fmt: skip
    out.append(_case("dropout fp32 2^27 p=0.1 (timing only: masks differ from torch)", "memory", lambda: dict(
        inputs=[_randn(N27)], check=False, teeny=lambda t: ops().dropout(t, 0.1, seed=1),
        torch=lambda t: F.dropout(t, 0.1)), bytes=16 * N27))  # fmt: skip
    return out


_LIGER: dict | None = None


def _liger() -> dict:
    global _LIGER
    if _LIGER is None:
        _LIGER = liger_functions()
    return _LIGER


# ----------------------------------------------------------------------------- products


def product_cases() -> list[Case]:
    torch, F = _t()
    ops = _ops
    out = [_case("matmul bf16 4096^3", "products", lambda: dict(
        inputs=[_randn(4096, 4096, dtype="bfloat16"), _randn(4096, 4096, dtype="bfloat16", seed=1)],
        teeny=lambda a, b: ops().matmul(a, b), torch=lambda a, b: a @ b), flops=6 * 4096**3, compile=True)]  # fmt: skip

    def linear(name, tokens, fin, fout, dtype, bias=True):
        def make():
            xs = [_randn(tokens, fin, dtype=dtype), _randn(fout, fin, dtype=dtype, scale=fin**-0.5, seed=1)]
            if bias:
                xs.append(_randn(fout, dtype=dtype, seed=2))
            return dict(inputs=xs, teeny=lambda *a: ops().linear(*a), torch=F.linear)

        out.append(_case(name, "products", make, flops=6 * tokens * fin * fout))

    linear("linear fp32 8192x4096->4096", 8192, 4096, 4096, "float32")
    for fin, fout in [(768, 768), (768, 3072), (3072, 768), (768, 50304)]:  # GPT-2 small's layers
        linear(f"linear bf16 8192x{fin}->{fout}", 8192, fin, fout, "bfloat16")
    linear("linear bf16 8192x768->50304, no bias", 8192, 768, 50304, "bfloat16", bias=False)
    return out


# ----------------------------------------------------------------------------- attention


def attention_cases() -> list[Case]:
    torch, F = _t()
    ops = _ops
    out = []

    def make(shape, variant, kv_heads=4):
        def build():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            B, H, L, D = shape
            hkv = kv_heads if variant.startswith("gqa") else H
            xs = [_randn(B, H, L, D, dtype="bfloat16"), _randn(B, hkv, L, D, dtype="bfloat16", seed=1),
                  _randn(B, hkv, L, D, dtype="bfloat16", seed=2)]  # fmt: skip
            kw = dict(is_causal=variant.endswith("causal"))
            if hkv != H:
                kw["enable_gqa"] = True
            if variant == "key-padding mask":  # every other sequence has its last 25% of keys padded
                mask = torch.ones(B, 1, 1, L, device=DEV, dtype=torch.bool)
                mask[::2, ..., L - L // 4 :] = False
                xs.append(mask)

            def teeny_fn(q, k, v, *m):
                return ops().scaled_dot_product_attention(q, k, v, *m, **kw)

            def torch_fn(q, k, v, *m):
                return F.scaled_dot_product_attention(q, k, v, *m, **kw)

            def backend(b):
                def run(*a):
                    with sdpa_kernel([b]):
                        return torch_fn(*a)

                return run

            impls = {"sdpa-flash": backend(SDPBackend.FLASH_ATTENTION),
                     "sdpa-efficient": backend(SDPBackend.EFFICIENT_ATTENTION)}  # fmt: skip
            if hasattr(SDPBackend, "CUDNN_ATTENTION"):
                impls["sdpa-cudnn"] = backend(SDPBackend.CUDNN_ATTENTION)
            return dict(inputs=xs, teeny=teeny_fn, torch=torch_fn, impls=impls)

        B, H, L, D = shape
        fwd = 4.0 * B * H * L * L * D * (0.5 if variant.endswith("causal") else 1.0)
        return build, 3.5 * fwd

    build, flops = make((4, 16, 2048, 64), "causal")
    out.append(_case("causal attention bf16 4x16x2048x64", "attention", build, flops=flops, compile=True))
    for shape in [(4, 16, 2048, 64), (8, 12, 1024, 64), (4, 16, 2048, 128)]:
        for variant in ["key-padding mask", "gqa causal"] + (["causal"] if shape != (4, 16, 2048, 64) else []):
            build, flops = make(shape, variant)
            name = f"attention bf16 {'x'.join(map(str, shape))} {variant}"
            out.append(_case(name, "attention", build, flops=flops))
    return out


def make_cases() -> list[Case]:
    return memory_cases() + product_cases() + attention_cases()


if __name__ == "__main__":
    main_for("ops", __doc__, make_cases)
