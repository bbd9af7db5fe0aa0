"""Test samples of ``to`` (``teeny.ops.cast``)."""

import torch

from ...core.kernel import dtype_name
from ...ops import to
from ..registry import OpInfo, Sample, make, register

# The sample's input has the dtype under test; the target dtype is the one the output has
# (``OpInfo.output_dtype``): every float input is cast to every other float dtype here.


_TARGETS = {
    torch.float32: torch.bfloat16,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float64: torch.float64,
}


def _cast_samples(dtype, gen):
    target = _TARGETS[dtype]
    return [
        Sample((make(gen, *shape).to(dtype), target), name=f"{shape} -> {dtype_name(target)}")
        for shape in ((3, 37), (129, 7), (1,), (0, 5))
    ]


register(
    OpInfo(
        "to",
        to,
        lambda x, dtype: x.to(dtype),
        _cast_samples,
        family="cast",
        output_dtype=lambda dtype: _TARGETS[dtype],
        gradcheck_samples=lambda gen: [Sample((make(gen, 4, 5, dtype=torch.float64), torch.float64))],
        notes="float64 gradcheck through a float64 target (a cast to a narrower dtype rounds the "
        "finite differences away); narrowing casts are checked against torch in test_cast.py",
    )
)
