"""Kernel pairs, one op family per module: forward kernel, backward kernel, RuntimeOp, and the
functional op with its test samples (an ``OpInfo``)."""
