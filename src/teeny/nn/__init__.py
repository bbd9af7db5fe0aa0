"""Layers: ``teeny.nn.Linear``, ``teeny.nn.LayerNorm``, ... with PyTorch's initialisation.

``Module``/``Parameter`` come from ``teeny.core.module``; each op family module lists its layers in
``NN_LAYERS`` and they are gathered here.
"""

from ..core.module import Module, ModuleList, Parameter, Sequential
from ..ops import (
    activation,
    attention,
    cast,
    conv,
    elementwise,
    lookup,
    loss,
    masks,
    norm,
    products,
    reduction,
    rotary,
    shape,
)

_FAMILIES = (
    activation,
    attention,
    cast,
    conv,
    elementwise,
    lookup,
    loss,
    masks,
    norm,
    products,
    reduction,
    rotary,
    shape,
)
for _family in _FAMILIES:
    for _name in _family.NN_LAYERS:
        globals()[_name] = getattr(_family, _name)
del _family, _name

__all__ = ["Module", "ModuleList", "Parameter", "Sequential"] + [n for f in _FAMILIES for n in f.NN_LAYERS]
