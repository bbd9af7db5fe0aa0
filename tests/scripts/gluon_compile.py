"""Compile check of test_linear_gluon.py: matmul_ws's launch of each case (a product's sizes and
operand strides, with or without the bias, an addend (``"addend": true``) or a Z of another dtype
(``"out": "float32"``)) compiled for sm_90 as an ahead-of-time bundle would
(Triton's arguments: the descriptors matmul_ws makes on the host); its grid, wgmma, TMA,
shared memory and register counts.

    python tests/scripts/gluon_compile.py '[{"name": "bf16 forward", "dtype": "bfloat16",
        "M": 328, "N": 200, "K": 136, "x": [136, 1], "y": [1, 136], "bias": true}]'
"""

from sm90 import cases, compile_launch, report, root_cause, tma_counts  # first: the interpreter off

# isort: split

import torch

from teeny.core import tuning
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning

tuning.multiprocessors = lambda: 132
results = []
for case in cases():
    dtype = getattr(torch, case["dtype"])
    M, N, K = case["M"], case["N"], case["K"]
    p = products_launches.Product(M, N, K, tuple(case["x"]), tuple(case["y"]), (N, 1), [], [])
    x, y = (torch.empty(n, dtype=dtype) for n in (M * K, K * N))
    z = torch.empty(M * N, dtype=getattr(torch, case.get("out", case["dtype"])))
    bias = torch.empty(N, dtype=dtype) if case["bias"] else None
    addend = torch.empty(M * N, dtype=dtype) if case.get("addend") else None
    launch = products_launches._ws_launch(p, x, y, z, bias, dtype, products_tuning._WS_CONFIG, addend)
    row = dict(case=case["name"], grid=list(launch.grid))
    try:
        entry, ptx = compile_launch(launch)
        registers = {line.split()[-1].strip(";") for line in ptx.splitlines() if "setmaxnreg" in line}
        row.update(
            ok=True,
            wgmma=ptx.count("wgmma.mma_async"),
            shared=entry["shared"],
            waits=ptx.count("griddepcontrol.wait"),
            global_stores=ptx.count("st.global"),
            setmaxnreg=sorted(registers),
            **tma_counts(ptx),
        )
    except Exception as exc:
        row.update(ok=False, error=root_cause(exc))
    results.append(row)
report(results)
