"""Compile check of test_rewrites.py: the chunked head's loss kernel (class_loss_forward) for
each vocabulary size (a number, or "<size>:<cap>" for logits soft-capped at cap), compiled for
sm_90 with the signature and alignment hints Triton's launcher would give it (lowering's dry run
packs the launch); its global loads and stores by width.

    python tests/scripts/loss_ptx_check.py '[50257, 50304, "50257:30.0"]'
"""

from sm90 import TARGET, cases, report  # first: the interpreter off, a GPU pretended

# isort: split

import json
import os
import re
import sys
import types

import torch

os.environ["TEENY_TUNING"] = "0"
torch.cuda.get_device_capability = lambda *a: (9, 0)
torch.cuda.get_device_properties = lambda *a: types.SimpleNamespace(multi_processor_count=132)

import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import teeny  # noqa: E402
from teeny import Graph, LoweringMode, lower, ops  # noqa: E402
from teeny.core import runtime  # noqa: E402
from teeny.fusions import chunked_loss  # noqa: E402

chunked_loss.CHUNKED_LOGITS_MIN_BYTES = 0
recorded = []
run_launch = runtime.run_launch


def record(launch, instance, *args, **kwargs):
    recorded.append(launch)
    return run_launch(launch, instance, *args, **kwargs)


runtime.run_launch = record
out = {}
for case in cases():
    classes, _, cap = str(case).partition(":")
    classes, cap = int(classes), float(cap or 0.0)
    recorded.clear()
    g = Graph("head")
    x = g.input("x", (64, 16), torch.bfloat16, requires_grad=True)
    y = g.input("y", (64,), torch.int64)
    g.output(ops.cross_entropy(teeny.nn.Linear(16, classes, bias=False, dtype=torch.bfloat16)(x), y, softcap=cap))
    lower(g, LoweringMode.TRAINING)
    (launch,) = [r for r in recorded if r.kernel.name == "class_loss_forward"]
    values = runtime.check_packing(launch.kernel, launch.args, "ptx check", 128)
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, value) in enumerate(zip(launch.kernel.params, values)):
        if p.kind == "constexpr" or value is None:
            signature[p.name], constexprs[p.name] = "constexpr", 1 if p.name == "ROWS" else value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, not isinstance(value, float), True)
        if ty == "constexpr":
            signature[p.name], constexprs[p.name] = "constexpr", key
            continue
        signature[p.name] = ty
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        compiled = triton.compile(ASTSource(launch.kernel.jit, signature, constexprs, attrs), target=TARGET)
    except Exception as exc:
        print("SKIP " + json.dumps(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:300]))
        sys.exit(0)
    ptx = compiled.asm["ptx"]
    out[str(case)] = {kind: sorted(set(re.findall(kind + r"\.global[.\w]*", ptx))) for kind in ("ld", "st")}
report(out)
