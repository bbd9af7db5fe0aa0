"""Compile teeny's matmul and conv kernels for the H200 (sm_90) on a machine without a GPU, and
print what the compiler made of each configuration (every launch of it: the product, stream-K's
segment sums, float32's K-major copies): tensor-core instructions (wgmma, mma), TMA copies,
shared memory, registers and spills. A candidate that does not compile, or that needs more
shared memory than a multiprocessor has (227 KiB; 113 KiB each for two per multiprocessor),
is listed as such.

    python3 bench/tools/compile_check.py [--quick] [--match gelu]   # from the repository root, no GPU needed

It pretends CUDA is there while teeny is imported, so that the kernels are JIT functions (not
the interpreter's) and the GPU configuration lists are the ones checked.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TEENY_DEVICE"] = "cuda"
os.environ["TEENY_TUNING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

torch.cuda.is_available = lambda: True  # only for choosing the kernel mode at import
torch.cuda.current_device = lambda: 0

import triton  # noqa: E402

import teeny.ops.activation as activation  # noqa: E402
from teeny.aot.bundle import Target  # noqa: E402
from teeny.aot.capture import Compiler  # noqa: E402
from teeny.core import tuning  # noqa: E402
from teeny.fusions.transposed_weights import TransposedWeightLinearOp  # noqa: E402
from teeny.ops.products import kernels as products_kernels  # noqa: E402
from teeny.ops.products import launches as products_launches  # noqa: E402
from teeny.ops.products import tuning as products_tuning  # noqa: E402
from teeny.ops.products.ops import LinearOp  # noqa: E402

tuning.multiprocessors = lambda: 132  # an H200
tuning.has_tma = lambda: True
tuning.gpu_name = lambda: "NVIDIA H200 (compile check)"
SMEM_LIMIT = 227 * 1024
SMEM_PER_PAIR = 113 * 1024  # two programs per multiprocessor: 228 KiB less 1 KiB each
COMPILER = Compiler(Target(90, 132))  # an H200's sm_90, as teeny.aot builds bundles for it
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
}


def compile_launch(launch, dtype):
    """One teeny Launch compiled for sm_90 as an ahead-of-time bundle would (``teeny.aot``'s
    compiler: Triton's arguments specialised, a kernel's ``arguments=`` applied, so matmul_tma
    gets its host-made TMA descriptors): (ptx text, cubin bytes, shared memory bytes)."""
    from teeny.core.runtime import as_block, check_packing

    block = as_block(launch.block)
    values = check_packing(launch.kernel, launch.args, "compile_check", block.size)
    if launch.kernel.arguments is not None:
        values = launch.kernel.arguments(*values)
    options = {k: v for k, v in (("num_warps", block.num_warps), ("num_stages", block.num_stages)) if v is not None}
    entry, files = COMPILER.compile(launch.kernel.jit, COMPILER.specialise(launch.kernel.jit, values, options))
    return files["ptx"].decode(), files["cubin"], entry["shared"]


def describe(compiled, occupancy: int = 1) -> str:
    ptx, cubin, smem = compiled
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    regs = next((part for line in usage.splitlines() for part in line.split() if part.startswith("REG:")), "REG:?")
    local = next((part for line in usage.splitlines() for part in line.split() if part.startswith("LOCAL:")), "")
    flags = " TOO MUCH SHARED MEMORY" if smem > (SMEM_LIMIT if occupancy == 1 else SMEM_PER_PAIR) else ""
    return (
        f"wgmma {ptx.count('wgmma.mma_async'):3d} mma {ptx.count('mma.sync'):3d} "
        f"tma {ptx.count('cp.async.bulk.tensor'):2d} smem {smem // 1024:3d}K {regs} {local}{flags}"
    )


def matmul_cases(quick: bool):
    """(label, dtype, precision, product, has_bias, row_sums, epilogue, out_dtype) for linear's
    three products at two GPT-2 shapes (768->3072: many tiles; 768->768: dW shared out
    stream-K), dW with the bias gradient fused, MLPOp's two epilogue products: 768->3072 forward
    with its GELU (h stored) and the dX of 3072->768 with GELU's derivative (h loaded), dX with
    the waiting gradient added (``addend_epilogue``), and the float32 dW (and db) of bfloat16
    operands that ``fusions.master_weights`` asks for, plain and Conv1D's transposed."""
    dtypes = [(torch.bfloat16, None)]
    if not quick:
        dtypes += [(torch.float16, None), (torch.float32, "tf32x3"), (torch.float32, "tf32"),
                   (torch.float32, "ieee"), (torch.float64, None)]  # fmt: skip
    for fin, fout in ((768, 3072), (768, 768)):
        products = LinearOp.products([(8192, fin), (fout, fin)])
        for dtype, precision in dtypes:
            precision = precision or products_kernels.dot_precision(dtype, False)
            for name, p in products.items():
                if fout == 768 and name != "grad_weight":
                    continue
                label = f"{fin}->{fout} {name:11}"
                yield label, dtype, precision, p, name == "forward", name == "grad_weight", None, None
    conv1d_dw = TransposedWeightLinearOp.products([(8192, 768), (768, 3072)])["grad_weight"]
    yield "conv1d dW (Z^T) + db ", torch.bfloat16, "tf32", conv1d_dw, False, True, None, None
    yield "conv1d dW fp32 (Z^T) + db", torch.bfloat16, "tf32", conv1d_dw, False, True, None, torch.float32
    linear = LinearOp.products([(8192, 1024), (2816, 1024)])
    yield "1024->2816 dW fp32 + db", torch.bfloat16, "tf32", linear["grad_weight"], False, True, None, torch.float32
    yield "1024->2816 dX + addend", torch.bfloat16, "tf32", linear["grad_input"], False, False, ("addend", True), None
    gelu = activation.ActivationOp("gelu_tanh", activation._gelu_tanh, activation._gelu_tanh_grad)
    forward = LinearOp.products([(8192, 768), (3072, 768)])["forward"]
    grad_input = LinearOp.products([(8192, 3072), (768, 3072)])["grad_input"]
    for dtype, precision in dtypes[:1] if quick else dtypes[:3]:
        precision = precision or products_kernels.dot_precision(dtype, False)
        yield "768->3072 fwd+gelu  ", dtype, precision, forward, True, False, (gelu, False), None
        yield "3072->768 dX*gelu'  ", dtype, precision, grad_input, False, False, (gelu, True), None


def specialisation(launch) -> tuple:
    """What a compiled kernel depends on: constexprs, pointer dtypes and which are None."""
    kinds = {param.name: param.kind for param in launch.kernel.params}
    out = []
    for v in launch.args.visits:
        if isinstance(v.value, torch.Tensor):
            out.append((v.name, str(v.value.dtype)))
        elif v.value is None or kinds.get(v.name) == "constexpr":
            out.append((v.name, str(v.value)))
    return tuple(out)


def describe_config(config) -> str:
    text = (
        f"{config['kernel']:7} {config['BLOCK_M']:3}x{config['BLOCK_N']:3}x{config['BLOCK_K']:3} "
        f"w{config['num_warps']} s{config['num_stages']}"
    )
    if config["kernel"] == "tma":
        flags = [("sub", config["SUBTILE"]), (f"sk{config['STREAM_K']}", config["STREAM_K"]),
                 ("x2", config["OCCUPANCY"] == 2), ("kmajor", config["K_MAJOR"]),
                 ("unfused", not config.get("FUSED_SUMS", True))]  # fmt: skip
        text += "".join(f" {name}" for name, on in flags if on)
    return text


def op_launches():
    """(label, launch, dtype) of every launch lowering's dry run checks for a few graphs of the
    other paths: strided products (batched, unaligned), conv2d and pooling, forward and backward."""
    import teeny.core.runtime as runtime
    from teeny import Graph, LoweringMode, lower, ops

    recorded = []
    original = runtime.run_launch

    def record(launch, instance, where, work, dry_run=False, shapes=""):
        recorded.append((where, launch, instance.dtype))
        return original(launch, instance, where, work, dry_run, shapes)

    def graph(build, shapes, dtype):
        g = Graph()
        xs = [g.input(f"x{i}", s, dtype, requires_grad=True) for i, s in enumerate(shapes)]
        out = build(*xs)
        g.output(*(out if isinstance(out, tuple) else (out,)))
        lower(g, LoweringMode.TRAINING)

    runtime.run_launch = record
    try:
        for dtype in (torch.bfloat16, torch.float32):
            graph(ops.matmul, [(8, 256, 64), (8, 64, 256)], dtype)
            graph(ops.linear, [(512, 100), (300, 100), (300,)], dtype)
            graph(lambda x, w, b: ops.conv2d(x, w, b, padding=1), [(8, 64, 32, 32), (64, 64, 3, 3), (64,)], dtype)
            graph(lambda x: ops.max_pool2d(x, 3, stride=2, padding=1, return_indices=True), [(8, 64, 32, 32)], dtype)
            graph(lambda x: ops.avg_pool2d(x, 2), [(8, 64, 32, 32)], dtype)
    finally:
        runtime.run_launch = original
    return recorded


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="bf16 linear products only")
    parser.add_argument("--match", default="", help="only the linear products whose label has this text")
    args = parser.parse_args()
    meta = torch.device("meta")
    failures = 0
    t0 = time.time()
    if not args.quick:
        seen = set()
        for where, launch, dtype in op_launches():
            values = tuple(
                v.value if not isinstance(v.value, torch.Tensor) else str(v.value.dtype) for v in launch.args.visits
            )
            key = (launch.kernel.name, dtype, values)
            if key in seen:
                continue
            seen.add(key)
            what = f"{where.split(' (')[0][3:]:12} {launch.kernel.name:24} {str(dtype)[6:]:8}"
            try:
                print(f"{what:68} {describe(compile_launch(launch, dtype))}", flush=True)
            except Exception as exc:
                failures += 1
                print(f"{what:68} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
    compiled = {}
    for label, dtype, precision, p, has_bias, row_sums, act, out_dtype in matmul_cases(args.quick):
        if args.match not in label:
            continue
        x, y = (torch.empty(n, dtype=dtype, device=meta) for n in (p.M * p.K, p.K * p.N))
        z = torch.empty(p.M * p.N, dtype=out_dtype or dtype, device=meta)
        bias = torch.empty(p.N, dtype=dtype, device=meta) if has_bias else None
        sums = torch.empty(p.M, dtype=out_dtype or dtype, device=meta) if row_sums else None
        if act is None:
            epilogue = None
        elif act[0] == "addend":
            epilogue = products_launches.addend_epilogue(torch.empty_like(z))
        else:
            epilogue = products_launches.Epilogue(act[0], torch.empty_like(z), derivative=act[1])
        kind = None if epilogue is None else epilogue.kind
        wanted = dict(dtype=dtype, precision=precision, has_bias=has_bias, row_sums=row_sums, epilogue=kind)
        for config in products_tuning.candidates(p, **wanted, out_dtype=out_dtype):
            launches = products_launches.product_launches(
                p, config, x=x, y=y, z=z, bias=bias, dtype=dtype, precision=precision,
                scratch=lambda s, d: torch.empty(s, dtype=d, device=meta), row_sums=sums, epilogue=epilogue,
            )  # fmt: skip
            estimate = products_tuning._shared_bytes(config, dtype, row_sums, kind, out_dtype) // 1024
            what = f"{label} {str(dtype)[6:]:8} {precision:6} {describe_config(config)} (est. {estimate}K)"
            cells = []
            for launch in launches:
                key = (launch.kernel.name, dtype, config["num_warps"], config["num_stages"], specialisation(launch))
                try:
                    if key not in compiled:
                        compiled[key] = describe(compile_launch(launch, dtype), config.get("OCCUPANCY", 1))
                    cells.append(f"{launch.kernel.name}: {compiled[key]}")
                except Exception as exc:
                    failures += 1
                    cells.append(f"{launch.kernel.name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
            print(f"{what:78} {' | '.join(cells)}", flush=True)
    print(f"{failures} failed, {time.time() - t0:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
