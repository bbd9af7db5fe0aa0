"""teeny inside PyTorch, and PyTorch models inside teeny.

* ``teeny.torch.apply(fn, *tensors)``: any teeny function on torch tensors, differentiably.
* ``torch.ops.teeny.<name>``: every teeny op as a registered PyTorch operator (fake
  implementations for shapes, autograd through teeny's backward kernels), usable under
  ``torch.compile(fullgraph=True)``; ``teeny.torch.register(...)`` adds your own
  ``CustomOp`` or ``@kernel`` pair the same way (``teeny.torch.library``).
* ``teeny.torch.nn``: drop-in ``torch.nn.Module`` layers (same constructor arguments and
  ``state_dict`` keys as ``torch.nn``) running teeny's kernels.
* ``teeny.torch.patch(model)``: swap the supported submodules of a model in place (Hugging Face
  GPT-2 and Llama too).
* ``torch.compile(model, backend="teeny")``: the whole model as teeny programs, trained by an
  ordinary PyTorch loop (``teeny.torch.backend``; installed, the name is registered through an
  entry point; from a source tree, ``import teeny.torch.backend`` registers it).
* ``teeny.torch.from_torch(module, example_inputs)``: a teeny ``Graph`` from a PyTorch module
  (``torch.export``), ``teeny.torch.to_torch(executor, module)`` hands the weights back, and
  ``teeny.torch.torch_model_task("file.py:make_model")`` makes it a training task.
"""

from __future__ import annotations

import importlib

from ..core import device as _device  # noqa: F401  (first: chooses interpreter or GPU before triton loads)
from . import (
    accelerate_name,
    library,  # noqa: F401  (registers torch.ops.teeny.<name> for every op)
)
from .bridge import cache_size, clear_cache
from .library import register, register_all, registered_ops

_LAZY = {
    "apply": "bridge",  # its torch.compiler.disable imports torch._dynamo (1 s): on first use
    "patch": "patching",
    "PatchReport": "patching",
    "from_torch": "export",
    "to_torch": "export",
    "UnsupportedError": "export",
    "torch_model_task": "task",
    "load_factory": "task",
}
_SUBMODULES = {"backend", "bridge", "library", "nn", "patching", "export", "task"}

accelerate_name.install()  # TrainingArguments(torch_compile_backend="teeny"): accelerate knows the name

__all__ = [
    "cache_size",
    "clear_cache",
    "register",
    "register_all",
    "registered_ops",
    *sorted(_LAZY),
    *sorted(_SUBMODULES),
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'teeny.torch' has no attribute {name!r}")
