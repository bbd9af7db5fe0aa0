"""teeny: neural networks whose every op is a Triton forward kernel paired with a backward kernel.

trace -> Graph -> lower(graph, mode) -> Program -> Executor.forward_train -> ActivationCache
-> Executor.backward -> gradients -> optimizer step.

Names are imported on first use, so that a program (like the ``teeny`` command) can choose the
device (``TEENY_DEVICE``) before the first kernel is defined; ``teeny.device`` is always
imported before any kernel module.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DEVICE": "device",
    "Kernel": "kernel",
    "built_instances": "kernel",
    "kernel": "kernel",
    "kernel_from_source": "kernel",
    "ArgVisitor": "runtime",
    "CustomOp": "runtime",
    "GridError": "runtime",
    "MissingBackwardError": "runtime",
    "NoGradientError": "runtime",
    "OpContext": "runtime",
    "PackingError": "runtime",
    "RuntimeOp": "runtime",
    "TeenyError": "runtime",
    "Launch": "runtime",
    "Block": "runtime",
    "KernelLaunchError": "runtime",
    "record_launches": "kernel",
    "Graph": "graph",
    "GraphError": "graph",
    "Tensor": "graph",
    "Module": "module",
    "Parameter": "module",
    "LoweringMode": "lowering",
    "Program": "lowering",
    "lower": "lowering",
    "ActivationCache": "executor",
    "Executor": "executor",
    "GradcheckError": "gradcheck",
    "gradcheck": "gradcheck",
    "gradcheck_graph": "gradcheck",
    "OpInfo": "registry",
    "Sample": "registry",
    "register": "registry",
    "load": "aot",
}
_SUBMODULES = {
    "device",
    "init",
    "nn",
    "ops",
    "optim",
    "interop",
    "models",
    "data",
    "train",
    "registry",
    "kernels",
    "graph",
    "lowering",
    "executor",
    "runtime",
    "module",
    "config",
    "aot",
    "distributed",
    "torch",
}

_TORCH_EXPORTS = {"from_torch", "to_torch"}  # teeny.torch.export: loaded only when asked for

__all__ = sorted(_EXPORTS) + sorted(_TORCH_EXPORTS) + sorted(_SUBMODULES)


def _load() -> None:
    """Import the device choice, every op family and the exported names (once)."""
    importlib.import_module(f"{__name__}.device")
    importlib.import_module(f"{__name__}.ops")
    importlib.import_module(f"{__name__}.interop.torch")
    for module in set(_EXPORTS.values()):
        importlib.import_module(f"{__name__}.{module}")
    # set after every import: importing a submodule named like a function (kernel, gradcheck)
    # binds the module to the package attribute; the function is the public name
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str):
    if name in _TORCH_EXPORTS:
        importlib.import_module(f"{__name__}.device")
        return getattr(importlib.import_module(f"{__name__}.torch.export"), name)
    if name in _EXPORTS:
        _load()
        return globals()[name]
    if name in _SUBMODULES:  # also reached by `from . import init` inside the package: import only that
        importlib.import_module(f"{__name__}.device")
        module = importlib.import_module(f"{__name__}.{name}")
        if name == "interop":
            importlib.import_module(f"{__name__}.interop.torch")
        return module
    raise AttributeError(f"module 'teeny' has no attribute {name!r}")
