"""Compile check of test_attention.py: lowers each case (lowering's dry run packs every launch
without running it), records the launches and compiles each one for sm_90 with the signature,
constexprs and alignment hints Triton's launcher would give it.

    python tests/scripts/attention_compile.py '[{"name": "causal", "dtype": "bfloat16",
        "shapes": [[1, 2, 64, 32], [1, 2, 64, 32], [1, 2, 64, 32]], "kwargs": {"is_causal": true}}]'
"""

from sm90 import TARGET, cases, report, root_cause  # first: the interpreter off, a GPU pretended

# isort: split

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.compiler import ASTSource

from teeny import ops
from teeny.core import runtime
from teeny.core import tuning as core_tuning
from teeny.core.graph import Graph
from teeny.ops.attention import tuning
from teeny.ops.attention.tuning import AttentionTiles, Tiles
from teeny.program.lowering import LoweringMode, lower

core_tuning.multiprocessors = lambda: 132  # the H200's (the tiles of a small grid depend on it)
recorded = []
run_launch = runtime.run_launch


def record(launch, instance, *args, **kwargs):
    recorded.append((launch, instance))
    return run_launch(launch, instance, *args, **kwargs)


runtime.run_launch = record

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool}
results, seen = [], set()
for case in cases():
    tiles = case.get("tiles")  # [[block_m, block_n, warps, stages]] * 3: forward, dq, dkdv
    tuning.TILE_OVERRIDE = AttentionTiles(*(Tiles(*t) for t in tiles)) if tiles else None
    dtype = DTYPES[case["dtype"]]
    graph = Graph()
    wants = case.get("grad", [True, True, True])
    q, k, v = (graph.input(n, tuple(s), dtype, requires_grad=w) for n, s, w in zip("qkv", case["shapes"], wants))
    kwargs = dict(case.get("kwargs", {}))
    if "mask" in case:
        kwargs["attn_mask"] = graph.input("mask", tuple(case["mask"]), DTYPES[case["mask_dtype"]])
    graph.output(ops.scaled_dot_product_attention(q, k, v, **kwargs))
    recorded.clear()
    lower(graph, LoweringMode.TRAINING)
    for launch, instance in recorded:
        block = runtime.as_block(launch.block)
        values = runtime.check_packing(launch.kernel, launch.args, "compile check", block.size)
        types = instance.scalar_types(launch.kernel.params, values)
        wide = frozenset(n for n, t in types.items() if t == "fp64")
        fn = launch.kernel.jit_with_float64(wide) if wide else launch.kernel.jit
        # the signature, constants and alignment hints Triton's launcher would derive
        signature, constexprs, attrs = {}, {}, {}
        for i, (p, jp, value) in enumerate(zip(launch.kernel.params, fn.params, values)):
            if p.kind == "constexpr" or value is None:
                signature[p.name], constexprs[p.name] = "constexpr", value
                continue
            specialize = not jp.do_not_specialize and not isinstance(value, float)
            align = not jp.do_not_specialize_on_alignment
            ty, key = native_specialize_impl(BaseBackend, value, False, specialize, align)
            if jp.annotation_type:
                ty = jp.annotation_type
            elif ty == "constexpr":
                signature[p.name], constexprs[p.name] = "constexpr", key
                continue
            signature[p.name] = ty
            if key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = {k: v for k, v in (("num_warps", block.num_warps), ("num_stages", block.num_stages)) if v}
        key = (launch.kernel.name, str(sorted(signature.items())), str(sorted(constexprs.items())), str(options))
        if key in seen:
            continue
        seen.add(key)
        row = dict(case=case["name"], kernel=launch.kernel.name)
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
            ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
            row.update(
                ok=True,
                wgmma=ptx.count("wgmma.mma_async"),
                waits=ptx.count("griddepcontrol.wait"),
                pipelined="async_copy_global_to_local" in ttgir,
                shared=compiled.metadata.shared,
                options=options,
                blocks=[constexprs.get("BLOCK_M"), constexprs.get("BLOCK_N")],
            )
        except Exception as exc:
            row.update(ok=False, error=root_cause(exc))
        results.append(row)
report(results)
