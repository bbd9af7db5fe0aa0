"""teeny: neural networks whose every op is a Triton forward kernel paired with a backward kernel.

trace -> Graph -> lower(graph, mode) -> Program -> Executor.forward_train -> ActivationCache
-> Executor.backward -> gradients -> optimizer step.

Names are imported on first use, so that a program (like the ``teeny`` command) can choose the
device (``TEENY_DEVICE``) before the first kernel is defined; ``teeny.core.device`` is always
imported before any kernel module.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DEVICE": "core.device",
    "Kernel": "core.kernel",
    "built_instances": "core.kernel",
    "kernel": "core.kernel",
    "kernel_from_source": "core.kernel",
    "record_launches": "core.kernel",
    "ArgVisitor": "core.runtime",
    "CustomOp": "core.runtime",
    "OpContext": "core.runtime",
    "RuntimeOp": "core.runtime",
    "Launch": "core.runtime",
    "Block": "core.runtime",
    "TeenyError": "core.errors",
    "GridError": "core.errors",
    "MissingBackwardError": "core.errors",
    "NoGradientError": "core.errors",
    "PackingError": "core.errors",
    "KernelLaunchError": "core.errors",
    "Graph": "core.graph",
    "GraphError": "core.graph",
    "Tensor": "core.graph",
    "Module": "core.module",
    "Parameter": "core.module",
    "LoweringMode": "program.lowering",
    "Program": "program.lowering",
    "lower": "program.lowering",
    "ActivationCache": "program.executor",
    "Executor": "program.executor",
    "GradcheckError": "checks.gradcheck",
    "gradcheck": "checks.gradcheck",
    "gradcheck_graph": "checks.gradcheck",
    "OpInfo": "checks.registry",
    "Sample": "checks.registry",
    "register": "checks.registry",
    "load": "aot",
}
# the folders, bottom layer first: each imports only from those before it
_SUBMODULES = ("core", "ops", "nn", "fusions", "program", "checks", "training", "torch", "aot")

_TORCH_EXPORTS = {"from_torch", "to_torch"}  # teeny.torch.export: loaded only when asked for

__all__ = sorted(_EXPORTS) + sorted(_TORCH_EXPORTS) + list(_SUBMODULES)


def _load() -> None:
    """Import the device choice, every op family and the exported names (once)."""
    importlib.import_module(f"{__name__}.core.device")
    importlib.import_module(f"{__name__}.checks.samples")
    for module in set(_EXPORTS.values()):
        importlib.import_module(f"{__name__}.{module}")
    # set after every import: importing a submodule named like a function (kernel, gradcheck)
    # binds the module to the package attribute; the function is the public name
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __getattr__(name: str):
    if name in _TORCH_EXPORTS:
        importlib.import_module(f"{__name__}.core.device")
        return getattr(importlib.import_module(f"{__name__}.torch.export"), name)
    if name in _EXPORTS:
        _load()
        return globals()[name]
    if name in _SUBMODULES:  # also reached by `from . import ops` inside the package: import only that
        importlib.import_module(f"{__name__}.core.device")
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'teeny' has no attribute {name!r}")
