"""Module calls that become one teeny op: ``fusion(class path, module, nodes)`` says which converter
computes a whole module call (``importer`` finds the module's run of ATen calls through
``nn_module_stack``)."""

from __future__ import annotations

import functools
import pydoc
import re
from collections.abc import Callable

import torch

from .... import ops
from .base import refuse

aten = torch.ops.aten

# ----------------------------------------------------------------------------- fused modules

# Modules whose maths teeny has one kernel pair for, recognised by class name (transformers
# stays optional): their run of ATen calls in the exported graph (one per module call, found
# through nn_module_stack) becomes that one op. fuse(env, activation input, parameters, module)
_GELU_TANH_MODULES = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}


def _fuse_gelu_tanh(env, x, params, module):
    refuse(params, "parameters in an activation")
    return ops.gelu(env.tensor(x), "tanh")


def _fuse_rms_norm(env, x, params, module, eps: float, weight_offset: float):
    refuse(len(params) != 1, "not a weight-and-epsilon RMSNorm")
    x = env.tensor(x)
    weight = env.tensor(params[0], x.dtype)
    return ops.rms_norm(x, tuple(weight.shape), weight, eps, weight_offset=weight_offset)


# Gemma's RMSNorms scale by (1 + weight), in float32: `output * (1.0 + self.weight.float())`
_ONE_PLUS_WEIGHT = re.compile(r"\(\s*1(\.0*)?\s*\+\s*self\.weight\b")


def _epsilon(nodes) -> float | None:
    """The epsilon an RMSNorm's ATen calls add to the mean square (``mean(x^2) + eps``)."""
    for node in nodes:
        if (
            node.target in (aten.add.Tensor, aten.add.Scalar)
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is aten.mean.dim
            and isinstance(node.args[1], float)
        ):
            return node.args[1]
    return None


def fusion(class_path: str, module, nodes) -> Callable | None:
    """The converter of a whole call of a module of class ``class_path`` (``module`` itself, or
    None where only its class is known, and ``nodes``: its ATen calls), or None."""
    name = class_path.rsplit(".", 1)[-1]
    if name in _GELU_TANH_MODULES:
        return _fuse_gelu_tanh
    if name.endswith("RMSNorm"):
        from ...patching.classes import source as _source

        cls = type(module) if module is not None else pydoc.locate(class_path)
        eps = _epsilon(nodes)
        if not isinstance(cls, type) or eps is None:
            return None
        offset = 1.0 if _ONE_PLUS_WEIGHT.search(_source(cls.forward)) else 0.0
        return functools.partial(_fuse_rms_norm, eps=eps, weight_offset=offset)
    return None
