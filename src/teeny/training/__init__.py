"""Training: optimizers and their kernels (``optim``, ``optim_kernels``), the loop with its
checkpoints (``loop``), data parallelism (``distributed``), bundled data sets (``data``) and
models (``models``)."""

from ..core import device as _device  # noqa: F401  (before the optimizer kernels import triton)
