"""Which device teeny runs on, decided once, before any kernel is defined.

With a CUDA GPU teeny launches its Triton kernels on it. Without one it runs the very same
kernels through the Triton interpreter on the CPU (``TRITON_INTERPRET=1``), which Triton reads
when ``@triton.jit`` decorates a function, so this module must be imported before any kernel
module. A user forces a choice with ``TEENY_DEVICE=cpu`` or ``TEENY_DEVICE=cuda`` in the
environment before importing teeny (the ``teeny`` command's ``--device`` flag does this).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from .extras import optional

_CHOICES = ("auto", "cpu", "cuda")


def _decide() -> torch.device:
    choice = os.environ.get("TEENY_DEVICE", "auto").strip().lower() or "auto"
    if choice == "gpu":
        choice = "cuda"
    if choice not in _CHOICES:
        raise ValueError(f"TEENY_DEVICE={choice!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("TEENY_DEVICE=cuda but torch sees no CUDA device")
    if choice == "cpu":
        if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise ImportError(
                "triton was imported before teeny on a machine where teeny runs kernels through the Triton "
                "interpreter; Triton decides interpreter or compiler when it is imported. Import a teeny module "
                "first (`import teeny.ops`, `import teeny.torch`: a bare `import teeny` chooses no device yet, so "
                "that TEENY_DEVICE may still be set), or set TRITON_INTERPRET=1 before starting Python."
            )
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    if choice == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:0, not cuda
    return torch.device(choice)


DEVICE: torch.device = _decide()
INTERPRETER: bool = DEVICE.type == "cpu"


def _interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar argument used as a loop bound
    (``range(0, K, BLOCK)``) into an int with ``int(array_of_one)``, which numpy >= 2.4 refuses;
    index through ``.item()`` instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_teeny", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._teeny = True
    interpreter._patch_lang_tensor = patched


def _interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts float32 to bfloat16 by truncation, where the GPU (and
    PyTorch) round to nearest even: every bfloat16 store on the CPU was biased towards zero by up
    to one unit in the last place; and it bit-casts an integer to bfloat16. Convert the value,
    rounding to nearest even, as the GPU does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "_teeny", False):
        return

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16:
            # float32 (or an integer, which the interpreter bit-cast) to bfloat16: nearest even
            values = np.asarray(src.data, dtype=np.float32)
            bits = np.ascontiguousarray(values).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(values)
            if nan.any():
                rounded = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)  # stay a (quiet) NaN
            return interpreter.TensorHandle(rounded.reshape(np.shape(values)), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._teeny = True
    builder.cast_impl = cast_impl
    for name in ("create_fp_trunc", "create_si_to_fp", "create_ui_to_fp"):  # lambdas bound to the original
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))


def _single_threaded_blas() -> None:
    """Under the interpreter tl.dot is numpy's matmul on small tiles, which multi-threaded OpenBLAS
    made 100-200x slower on a loaded 2-core machine (10-20 ms for a 256x256x16 product against
    0.1 ms on one thread): pin the BLAS libraries of this process to one thread."""
    threadpoolctl = optional("threadpoolctl")  # the [train] extra brings it; without it, slower (extras.DEGRADED)
    if threadpoolctl is not None:
        threadpoolctl.threadpool_limits(1, user_api="blas")


if INTERPRETER:
    _interpreter_loop_bounds()
    _interpreter_bf16_rounding()
    _single_threaded_blas()
    # the interpreter also evaluates masked-out lanes (log(0), 0/0 there are discarded by the mask)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def describe() -> str:
    if INTERPRETER:
        return "cpu (Triton interpreter)"
    return f"cuda ({torch.cuda.get_device_name(DEVICE)})"
