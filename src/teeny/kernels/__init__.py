"""Kernel pairs, one op family per module: forward kernel, backward kernel, RuntimeOp, and the
functional op with its test samples (an ``OpInfo``)."""

from .. import device as _device  # noqa: F401,E402  (before any kernel module imports triton)
