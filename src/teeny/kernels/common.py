"""Small pieces shared by kernels and ops: compute dtypes, launch sizes, scalar constants."""

from __future__ import annotations

import triton
import triton.language as tl

from ..device import INTERPRETER


@triton.jit
def upcast(x):
    """The dtype to compute in: float64 stays float64, everything else becomes float32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def elementwise_grid(n: int, block: int) -> tuple[int, int, int]:
    return (cdiv(n, block), 1, 1)


# tl.dot on bfloat16 operands gives garbage under the 3.6 interpreter: upcast there only.
DOT_UPCAST_BF16 = INTERPRETER
