"""Module calls that become one teeny op: ``fusion(class name, module)`` says which converter
computes a whole module call (``importer`` finds the module's run of ATen calls through
``nn_module_stack``)."""

from __future__ import annotations

from collections.abc import Callable

from .... import ops
from .base import refuse

# ----------------------------------------------------------------------------- fused modules

# Modules whose maths teeny has one kernel pair for, recognised by class name (transformers
# stays optional): their run of ATen calls in the exported graph (one per module call, found
# through nn_module_stack) becomes that one op. fuse(env, activation input, parameters, module)
_GELU_TANH_MODULES = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}


def _fuse_gelu_tanh(env, x, params, module):
    refuse(params, "parameters in an activation")
    return ops.gelu(env.tensor(x), "tanh")


def _fuse_rms_norm(env, x, params, module):
    refuse(len(params) != 1 or not hasattr(module, "variance_epsilon"), "not a weight-and-epsilon RMSNorm")
    x = env.tensor(x)
    weight = env.tensor(params[0], x.dtype)
    return ops.rms_norm(x, tuple(weight.shape), weight, float(module.variance_epsilon))


def fusion(class_name: str, module) -> Callable | None:
    """The converter of a whole call of ``module`` (class ``class_name``), or None."""
    if class_name in _GELU_TANH_MODULES:
        return _fuse_gelu_tanh
    if class_name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
        from ...patching import _source

        if "1.0 + self.weight" not in _source(type(module).forward):  # Gemma-style norms scale by 1 + weight
            return _fuse_rms_norm
    return None
