"""The element-wise activations, declared once: the ``Activation`` dataclass (its maths pair,
PyTorch's argument names and defaults, reference, layer name and samples), ``define`` (the
``teeny.ops`` function of a declaration) and ``ACTIVATIONS``, the table from which
``teeny.ops.activation`` generates its functions and layers, ``teeny.torch.nn`` its drop-ins and
``teeny.checks.samples.activation`` the registry's samples."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ...core.graph import graph_of
from .maths import (
    _celu,
    _celu_grad,
    _elu,
    _elu_grad,
    _gelu_erf,
    _gelu_erf_grad,
    _gelu_tanh,
    _gelu_tanh_grad,
    _hardshrink,
    _hardshrink_grad,
    _hardsigmoid,
    _hardsigmoid_grad,
    _hardswish,
    _hardswish_grad,
    _hardtanh,
    _hardtanh_grad,
    _leaky_relu,
    _leaky_relu_grad,
    _logsigmoid,
    _logsigmoid_grad,
    _mish,
    _mish_grad,
    _relu,
    _relu_grad,
    _sigmoid_fn,
    _sigmoid_grad,
    _silu,
    _silu_grad,
    _softcap,
    _softcap_grad,
    _softplus_fn,
    _softplus_grad,
    _softshrink,
    _softshrink_grad,
    _softsign,
    _softsign_grad,
    _tanh_fn,
    _tanh_grad,
    _tanhshrink,
    _tanhshrink_grad,
    _threshold,
    _threshold_grad,
)
from .ops import ActivationOp

REQUIRED = inspect.Parameter.empty  # the default of an argument that has none (threshold's threshold, value)


@dataclass(eq=False)
class Activation:
    """One element-wise op of the activation template, declared once.

    ``fn(x, a, b)`` / ``grad(x, dy, a, b)``: its ``@triton.jit`` maths; ``ref``: PyTorch's function
    of the same arguments; ``layer``: the ``torch.nn`` class (None: no layer). ``params``: the
    arguments after the input, name -> default (``REQUIRED``: none), with PyTorch's names, order
    and defaults (``inplace`` is accepted and ignored: a graph op always makes a new value); a
    ``bool`` or ``str`` default makes that type of argument, any other a ``float``. The kernel's
    scalars ``a`` and ``b`` are each a parameter's name or a constant. ``variants``: other maths
    chosen by the value of the ``str`` argument (gelu's ``approximate="tanh"``), each its own
    kernel ``<name>_<value>``. ``check(**arguments)``: why the arguments are invalid, or None.
    ``routes``: the torch functions ``teeny.torch.patch`` reroutes to it (default ``(ref,)``).
    Samples: values in ``domain`` pushed away from the ``kinks``, once per keyword set of ``samples``.
    """

    name: str
    layer: str | None
    fn: Any
    grad: Any
    ref: Callable
    doc: str
    params: dict[str, Any] = field(default_factory=dict)
    a: str | float = 0.0
    b: str | float = 0.0
    check: Callable[..., str | None] | None = None
    variants: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    routes: tuple[Callable, ...] | None = None
    kinks: tuple[float, ...] = ()
    domain: tuple[float, float] = (-3.0, 3.0)
    samples: tuple[dict, ...] = ({},)
    runtime_op: type[ActivationOp] = ActivationOp
    input: str = "x"  # the input's name in the teeny.ops function

    def __post_init__(self):
        if self.routes is None:
            self.routes = (self.ref,)
        self._defaults = tuple(self.params.values())
        self._positions = {name: i for i, name in enumerate(self.params, 1)}
        self._required = 1 + sum(d is REQUIRED for d in self._defaults)  # positional arguments a call needs
        self._signatures: dict[str, inspect.Signature] = {}

    def signature(self, input: str | None = None) -> inspect.Signature:
        """The Python signature: the input (named ``input``, default ``self.input``), then the
        parameters, annotated as ``torch.library``'s schemas read them."""
        input = input or self.input
        if input not in self._signatures:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            parameters = [inspect.Parameter(input, kind)]
            for (name, default), annotation in zip(self.params.items(), self.annotations().values()):
                parameters.append(inspect.Parameter(name, kind, default=default, annotation=annotation))
            self._signatures[input] = inspect.Signature(parameters, return_annotation="Tensor")
        return self._signatures[input]

    def annotations(self) -> dict[str, str]:
        """Each parameter's type, from its default: ``bool``, ``str``, else ``float``."""
        return {
            name: "bool" if isinstance(d, bool) else "str" if isinstance(d, str) else "float"
            for name, d in self.params.items()
        }

    def bind(self, args: tuple, kwargs: dict, input: str | None = None) -> tuple:
        """The call's arguments in order, the input first and defaults filled in, as Python binds
        them to ``signature(input)``; the common calls (positional, or keywords for parameters
        after them) without building a ``BoundArguments``: this runs in every eager call of
        ``teeny.torch.nn.functional``."""
        n = len(args)
        if self._required <= n <= len(self._defaults) + 1:
            if not kwargs:
                return args + self._defaults[n - 1 :]
            values = [*args, *self._defaults[n - 1 :]]
            for key, value in kwargs.items():
                i = self._positions.get(key, 0)
                if i < n:
                    break
                values[i] = value
            else:
                return tuple(values)
        try:
            bound = self.signature(input).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def op(self, arguments: dict) -> ActivationOp:
        """The graph op for these parameter values: checked, its maths and scalars chosen."""
        if self.check is not None and (message := self.check(**arguments)):
            raise ValueError(f"{self.name}: {message}")
        name, fn, grad = self.name, self.fn, self.grad
        if self.variants:
            choice, default = next((p, d) for p, d in self.params.items() if isinstance(d, str))
            value = arguments[choice]
            if value != default:
                if value not in self.variants:
                    options = " or ".join(repr(v) for v in (default, *self.variants))
                    raise ValueError(f"{self.name}: {choice} must be {options}, got {value!r}")
                name, (fn, grad) = self._variant_name(value), self.variants[value]
        a, b = (arguments[s] if isinstance(s, str) else s for s in (self.a, self.b))
        return self.runtime_op(name, fn, grad, a, b)

    def variant_kwargs(self) -> dict[str, dict]:
        """Each variant's kernel name and the keyword arguments that choose it."""
        choice = next((p for p, d in self.params.items() if isinstance(d, str)), None)
        return {self._variant_name(value): {choice: value} for value in self.variants}

    def _variant_name(self, value: str) -> str:
        return f"{self.name}_{value}"


def _graph_apply(x, op: ActivationOp):
    return graph_of(x).apply(op, [x])


def define(declaration: Activation, module: str, apply: Callable = _graph_apply) -> Callable:
    """The ``teeny.ops`` function of ``declaration``, as if written in ``module`` (its name,
    qualified name, docstring and signature; a module assigns it to its global of that name, so
    it pickles and imports by name): it binds the call, builds the op and ``apply(x, op)``
    adds the node (default: to ``x``'s graph)."""

    def function(*args, **kwargs):
        x, *values = declaration.bind(args, kwargs)
        return apply(x, declaration.op(dict(zip(declaration.params, values))))

    function.__name__ = function.__qualname__ = declaration.name
    function.__module__ = module
    function.__doc__ = declaration.doc
    function.__signature__ = declaration.signature()
    return function


def _softcap_reference(x, cap):
    """softcap in PyTorch (which has no function of its own for it)."""
    return cap * torch.tanh(x / cap)


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_INPLACE = {"inplace": False}

ACTIVATIONS = [
    Activation(
        "relu",
        "ReLU",
        _relu,
        _relu_grad,
        F.relu,
        "max(x, 0); the gradient at 0 is 0, as in PyTorch.",
        _INPLACE,
        routes=(F.relu, torch.relu),
        kinks=(0.0,),
    ),
    Activation(
        "leaky_relu",
        "LeakyReLU",
        _leaky_relu,
        _leaky_relu_grad,
        F.leaky_relu,
        "x if x > 0 else negative_slope * x; the gradient at 0 is negative_slope.",
        {"negative_slope": 0.01, **_INPLACE},
        a="negative_slope",
        kinks=(0.0,),
        samples=({}, {"negative_slope": 0.2}),
    ),
    Activation(
        "elu",
        "ELU",
        _elu,
        _elu_grad,
        F.elu,
        "x if x > 0 else alpha * (exp(x) - 1); the gradient at 0 is alpha.",
        {"alpha": 1.0, **_INPLACE},
        a="alpha",
        b=1.0,
        kinks=(0.0,),
        samples=({}, {"alpha": 0.5}),
    ),
    Activation(
        "selu",
        "SELU",
        _elu,
        _elu_grad,
        F.selu,
        "scale * elu(x, alpha) with PyTorch's constants alpha = 1.6733, scale = 1.0507.",
        _INPLACE,
        a=_SELU_ALPHA,
        b=_SELU_SCALE,
        kinks=(0.0,),
    ),
    Activation(
        "celu",
        "CELU",
        _celu,
        _celu_grad,
        F.celu,
        "x if x > 0 else alpha * (exp(x / alpha) - 1).",
        {"alpha": 1.0, **_INPLACE},
        a="alpha",
        check=lambda alpha, **_: "alpha cannot be 0" if alpha == 0 else None,
        kinks=(0.0,),
        samples=({}, {"alpha": 2.0}),
    ),
    Activation(
        "gelu",
        "GELU",
        _gelu_erf,
        _gelu_erf_grad,
        F.gelu,
        'x * Phi(x) (``approximate="none"``, erf form) or its tanh approximation (``"tanh"``).',
        {"approximate": "none"},
        variants={"tanh": (_gelu_tanh, _gelu_tanh_grad)},
    ),
    Activation("silu", "SiLU", _silu, _silu_grad, F.silu, "x * sigmoid(x).", _INPLACE, domain=(-8.0, 8.0)),
    Activation("mish", "Mish", _mish, _mish_grad, F.mish, "x * tanh(softplus(x)).", _INPLACE, domain=(-8.0, 8.0)),
    # torch.sigmoid and torch.tanh are not routed by teeny.torch.patch (F.sigmoid and F.tanh are deprecated)
    Activation(
        "sigmoid",
        "Sigmoid",
        _sigmoid_fn,
        _sigmoid_grad,
        torch.sigmoid,
        "1 / (1 + exp(-x)).",
        routes=(),
        domain=(-8.0, 8.0),
    ),
    Activation("tanh", "Tanh", _tanh_fn, _tanh_grad, torch.tanh, "tanh(x).", routes=()),
    Activation(
        "softcap",
        None,
        _softcap,
        _softcap_grad,
        _softcap_reference,
        "cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and final logits.",
        {"cap": REQUIRED},
        a="cap",
        check=lambda cap: None if cap > 0 else f"cap must be positive, got {cap}",
        routes=(),
        domain=(-40.0, 40.0),
        samples=({"cap": 5.0}, {"cap": 30.0}),
    ),
    Activation(
        "softplus",
        "Softplus",
        _softplus_fn,
        _softplus_grad,
        F.softplus,
        "log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold.",
        {"beta": 1.0, "threshold": 20.0},
        a="beta",
        b="threshold",
        check=lambda beta, **_: "beta cannot be 0" if beta == 0 else None,
        kinks=(0.5,),
        domain=(-8.0, 8.0),
        samples=({}, {"beta": 2.0, "threshold": 1.0}),
    ),
    Activation("softsign", "Softsign", _softsign, _softsign_grad, F.softsign, "x / (1 + |x|)."),
    Activation(
        "hardtanh",
        "Hardtanh",
        _hardtanh,
        _hardtanh_grad,
        F.hardtanh,
        "clamp(x, min_val, max_val); the gradient is 0 at and beyond both bounds.",
        {"min_val": -1.0, "max_val": 1.0, **_INPLACE},
        a="min_val",
        b="max_val",
        check=lambda min_val, max_val, **_: (
            f"min_val cannot be greater than max_val (got {min_val} > {max_val})" if min_val > max_val else None
        ),
        kinks=(-1.0, 1.0, -0.5, 2.0),
        samples=({}, {"min_val": -0.5, "max_val": 2.0}),
    ),
    Activation(
        "relu6",
        "ReLU6",
        _hardtanh,
        _hardtanh_grad,
        F.relu6,
        "hardtanh(x, 0, 6) (so the gradient at 0 and at 6 is 0, as in PyTorch).",
        _INPLACE,
        a=0.0,
        b=6.0,
        kinks=(0.0, 6.0),
        domain=(-2.0, 8.0),
    ),
    Activation(
        "hardsigmoid",
        "Hardsigmoid",
        _hardsigmoid,
        _hardsigmoid_grad,
        F.hardsigmoid,
        "relu6(x + 3) / 6; the gradient is 1/6 strictly inside (-3, 3), else 0.",
        _INPLACE,
        kinks=(-3.0, 3.0),
        domain=(-5.0, 5.0),
    ),
    Activation(
        "hardswish",
        "Hardswish",
        _hardswish,
        _hardswish_grad,
        F.hardswish,
        "x * relu6(x + 3) / 6.",
        _INPLACE,
        kinks=(-3.0, 3.0),
        domain=(-5.0, 5.0),
    ),
    Activation(
        "logsigmoid",
        "LogSigmoid",
        _logsigmoid,
        _logsigmoid_grad,
        F.logsigmoid,
        "log(sigmoid(x)) = -softplus(-x), computed without overflow.",
        domain=(-20.0, 20.0),
    ),
    Activation("tanhshrink", "Tanhshrink", _tanhshrink, _tanhshrink_grad, F.tanhshrink, "x - tanh(x)."),
    Activation(
        "softshrink",
        "Softshrink",
        _softshrink,
        _softshrink_grad,
        F.softshrink,
        "x - lambd if x > lambd, x + lambd if x < -lambd, else 0; lambd must be >= 0.",
        {"lambd": 0.5},
        a="lambd",
        check=lambda lambd: None if lambd >= 0 else f"lambd must be greater or equal to 0, got {lambd}",
        kinks=(-0.5, 0.5, -1.0, 1.0),
        samples=({}, {"lambd": 1.0}),
    ),
    Activation(
        "hardshrink",
        "Hardshrink",
        _hardshrink,
        _hardshrink_grad,
        F.hardshrink,
        "0 where -lambd <= x <= lambd, else x.",
        {"lambd": 0.5},
        a="lambd",
        kinks=(-0.5, 0.5, -1.0, 1.0),
        samples=({}, {"lambd": 1.0}),
    ),
    Activation(
        "threshold",
        "Threshold",
        _threshold,
        _threshold_grad,
        F.threshold,
        "value where x <= threshold, else x; the gradient is 0 where x <= threshold.",
        {"threshold": REQUIRED, "value": REQUIRED, **_INPLACE},
        a="threshold",
        b="value",
        kinks=(0.5, -1.0),
        samples=({"threshold": 0.5, "value": -2.0}, {"threshold": -1.0, "value": 3.0}),
    ),
]
