"""Compile check of teeny.core.compiling (run by tests/test_compiling.py): three launches of one
kernel, specialised for an emulated sm_90, compiled at once in two worker processes into a fresh
Triton cache; compiling them again in this process must find every one in that cache.

    python tests/scripts/compile_ahead.py
"""

import json
import os
import tempfile

from teeny.aot.worker import emulate_cuda

emulate_cuda(90, 132)  # before teeny chooses its device: the GPU path, with no GPU behind it
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="teeny-compile-ahead-")

# isort: split

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from teeny.aot.bundle import Target  # noqa: E402
from teeny.aot.capture import Compiler  # noqa: E402
from teeny.core.kernel import kernel  # noqa: E402


@kernel(register=False)
def scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale, mask=mask)


compiler = Compiler(Target.parse("cuda:90"))
x, y = torch.empty(1000, device="meta"), torch.empty(1000, device="meta")
jit = scaled_copy.jit
specs = [
    compiler.specialise(jit, [x, y, n, 2.0, block], {"num_warps": 4})
    for n, block in ((1000, 128), (1000, 256), (16, 128))
]
handed = compiler.compile_ahead(specs + specs[:1])  # (a job named twice is compiled once)
hits = []
knobs.compilation.listener = lambda **info: hits.append(info["cache_hit"])
for spec in specs:
    compiler.compile(jit, spec)
print("RESULTS " + json.dumps({"handed": handed, "cache_hits": hits, "keys": len({s.key for s in specs})}))
