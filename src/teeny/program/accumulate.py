"""out = a + b, element-wise over flat buffers: how the executor sums gradients.

Used where a value fans out (its gradient is the sum of its consumers' gradients) and where a
parameter's gradient accumulates across backward passes until ``zero_grad``. ``out`` may be
``a`` itself (in-place accumulation into the gradient arena). Half-precision values add in
float32 and round once (the interpreter also adds raw bfloat16 wrongly).
"""

import torch
import triton
import triton.language as tl

from ..core.common import ELEMENTWISE_BLOCK, upcast
from ..core.kernel import kernel
from ..core.runtime import ArgVisitor, CheckedLaunch, Launch, fire, launch_kernel

BLOCK = ELEMENTWISE_BLOCK


@kernel(half=True)
def accumulate_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, (upcast(a) + upcast(b)).to(out_ptr.dtype.element_ty), mask=mask)


_CHECKED: dict[tuple[torch.dtype, int], CheckedLaunch] = {}  # (dtype, size) -> its launch, checked once


def accumulate(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``out = a + b`` (contiguous tensors of one dtype and size)."""
    n = out.numel()
    if not n:
        return
    checked = _CHECKED.get((out.dtype, n))
    if checked is not None:  # the packing of every launch of this size was checked by the first
        fire(checked, [a, b, out, n, BLOCK])
        return
    args = ArgVisitor().visit(a_ptr=a, b_ptr=b, out_ptr=out, n=n)
    launch = Launch(accumulate_kernel, (triton.cdiv(n, BLOCK),), args, BLOCK)
    _CHECKED[out.dtype, n] = launch_kernel(launch, out.dtype, "gradient accumulation")
