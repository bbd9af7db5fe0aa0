"""Compile check of test_linear.py: matmul_tma's launch of each case (a product, its bias, row
sums and activation epilogue, a configuration) compiled for sm_90 as an ahead-of-time bundle
would, with the host's TMA descriptors; the signature, and the PTX's TMA and descriptor counts.

    python tests/scripts/linear_tma_compile.py '[{"name": "bf16 forward", "dtype": "bfloat16",
        "product": [328, 200, 136, [136, 1], [1, 136], [200, 1], [], []], "bias": true,
        "row_sums": false, "epilogue": false, "config": [128, 128, 64, 8, 3]}]'
"""

from sm90 import cases, compile_launch, report, root_cause, tma_counts  # first: the interpreter off

# isort: split

import torch

from teeny.core import tuning
from teeny.ops.activation import ActivationOp, _gelu_tanh, _gelu_tanh_grad
from teeny.ops.products import kernels as products_kernels
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning

tuning.multiprocessors = lambda: 132
gelu = ActivationOp("gelu_tanh", _gelu_tanh, _gelu_tanh_grad)
results = []
for case in cases():
    dtype = getattr(torch, case["dtype"])
    p = products_launches.Product(*case["product"])
    x, y, z = (torch.empty(n, dtype=dtype) for n in (p.M * p.K, p.K * p.N, p.M * p.N))
    bias = torch.empty(p.N, dtype=dtype) if case["bias"] else None
    sums = torch.empty(p.M, dtype=dtype) if case["row_sums"] else None
    epilogue = products_launches.Epilogue(gelu, torch.empty(p.M * p.N, dtype=dtype)) if case["epilogue"] else None
    launches = products_launches.product_launches(
        p,
        products_tuning._cfg(*case["config"]),
        x=x,
        y=y,
        z=z,
        bias=bias,
        dtype=dtype,
        precision="tf32x3" if dtype == torch.float32 else "tf32",
        scratch=lambda shape, d: torch.empty(shape, dtype=d),
        row_sums=sums,
        epilogue=epilogue,
    )
    row = dict(case=case["name"])
    try:
        entry, ptx = compile_launch(next(la for la in launches if la.kernel is products_kernels.matmul_tma))
        row.update(
            ok=True,
            signature=entry["signature"],
            tensormap_writes=ptx.count("tensormap"),
            waits=ptx.count("griddepcontrol.wait"),
            **tma_counts(ptx),
        )
    except Exception as exc:
        row.update(ok=False, error=root_cause(exc))
    results.append(row)
report(results)
