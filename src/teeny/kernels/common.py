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


# Under the interpreter each program instance costs about a millisecond whatever its size, while
# numpy handles a wide block almost as fast as a narrow one: use few, wide programs there.
ELEMENTWISE_BLOCK = 16384 if INTERPRETER else 1024

