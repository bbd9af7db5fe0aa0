"""Activations: y = f(x) element-wise, dx = f'(x) * dy; plus the gated ones and PReLU.

Element-wise unary activations share one kernel pair: ``activation_forward`` applies the op's
``fn(x, a, b)`` and ``activation_backward`` its ``grad(x, dy, a, b)`` (the derivative times dy,
recomputed from the saved input x), both small ``@triton.jit`` functions passed as compile-time
constants, so each activation compiles to its own specialised kernel. ``a`` and ``b`` carry the
op's scalar arguments (negative_slope, alpha, beta, threshold, ...). Half-precision inputs are
computed in float32. Gradients at kinks follow PyTorch's backward formulas exactly (relu'(0) = 0,
leaky_relu'(0) = negative_slope, hardtanh' = 0 at both bounds, ...).

Each of these activations is one ``Activation`` declaration in ``ACTIVATIONS`` (its maths pair, its
arguments with PyTorch's names and defaults, its PyTorch reference and ``torch.nn`` class name,
its sample domain and kinks). Everything else is generated from that row: the ``teeny.ops``
function, the ``teeny.nn`` layer, the ``teeny.torch.nn`` drop-in and ``functional`` entry, the
registry's samples (``teeny.checks.samples.activation``) and the tests' cases.

Gated activations (``glu``, ``swiglu``, ``geglu``) share a second pair, ``gated_forward`` /
``gated_backward``: y = u * act(g), where (u, g) are the two halves of x along ``dim`` (glu,
act = sigmoid) or two separate inputs (g = gate, u = up; swiglu: act = silu, geglu: act = gelu,
its tanh form by default). ``prelu`` has its own pair, its weight gradient reduced per channel
with fp32 partials and a second pass.

Files, in the order the data moves:

``maths.py``         each activation's ``fn``/``grad`` pair of ``@triton.jit`` functions and the
                     helpers they share (overflow-free sigmoid, accurate log1p, expm1, tanh)
``kernels.py``       the kernel pairs: ``activation_forward``/``_backward`` (the template),
                     ``gated_forward``/``_backward``, ``prelu_forward``/``_backward``
``ops.py``           the RuntimeOps (``ActivationOp``, ``GatedOp``, ``PReLUOp``): launches, partials
``declarations.py``  ``Activation`` (one row: maths, PyTorch's arguments, reference, samples),
                     ``define`` (a row's ``teeny.ops`` function) and the table ``ACTIVATIONS``
``functional.py``    the hand-written functional ops: ``apply_activation``, ``glu``, ``swiglu``, ``geglu``, ``prelu``
this file            the public surface: the functions generated from ``ACTIVATIONS`` (module
                     globals here, so they import and pickle by name), ``activation_layer`` and
                     the layers

The test samples live in ``teeny.checks.samples.activation``; the ``teeny.torch.nn`` drop-ins in
``teeny.torch.nn``.
"""

from __future__ import annotations

import inspect

import torch

from ...core import init as _init
from ...core.module import Module, Parameter

# what this file uses, and the names importers took from the former module teeny/ops/activation.py
from .declarations import ACTIVATIONS, REQUIRED, Activation, define  # noqa: F401
from .functional import apply_activation, geglu, glu, prelu, swiglu  # noqa: F401
from .kernels import (  # noqa: F401
    activation_backward,
    activation_forward,
    gated_backward,
    gated_forward,
    prelu_backward,
    prelu_forward,
)
from .maths import _gelu_erf, _gelu_erf_grad, _gelu_tanh, _gelu_tanh_grad  # noqa: F401
from .ops import ActivationOp, GatedOp, PReLUOp  # noqa: F401

for _declaration in ACTIVATIONS:
    globals()[_declaration.name] = define(_declaration, __name__)
del _declaration


# ---------------------------------------------------------------------------------- layers


def activation_layer(name: str, fn) -> type[Module]:
    """The ``nn`` layer of ``fn``: its constructor takes ``fn``'s arguments after the input (the
    names and defaults of PyTorch's layer, ``inplace`` accepted and ignored) and its forward
    applies ``fn``."""
    signature = inspect.signature(fn)
    options = inspect.Signature(list(signature.parameters.values())[1:])

    def __init__(self, *args, **kwargs):
        Module.__init__(self)
        try:
            bound = options.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        bound.apply_defaults()
        self.kwargs = {k: v for k, v in bound.arguments.items() if k != "inplace"}

    def forward(self, x):
        return fn(x, **self.kwargs)

    def __repr__(self):
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"

    doc = f"Layer applying ``{fn.__name__}``: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else ''}"
    return type(
        name,
        (Module,),
        {"__init__": __init__, "forward": forward, "__repr__": __repr__, "__doc__": doc, "__module__": __name__},
    )


for _declaration in ACTIVATIONS:
    if _declaration.layer is not None:
        globals()[_declaration.layer] = activation_layer(_declaration.layer, globals()[_declaration.name])
del _declaration
GLU = activation_layer("GLU", glu)


class PReLU(Module):
    """prelu with a learnt ``weight`` of ``num_parameters`` elements, initialised to ``init``."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_parameters = num_parameters
        self.weight = Parameter((num_parameters,), _init.constant(init), dtype=dtype)

    def forward(self, x):
        return prelu(x, self.weight)


__all__ = [d.name for d in ACTIVATIONS] + ["prelu", "glu", "swiglu", "geglu"]
NN_LAYERS = [d.layer for d in ACTIVATIONS if d.layer is not None] + ["PReLU", "GLU"]
