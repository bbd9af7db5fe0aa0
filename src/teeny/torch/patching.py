"""``teeny.torch.patch(model)``: run a PyTorch model on teeny's kernel pairs, in place.

    report = teeny.torch.patch(model)      # a Hugging Face GPT-2 or Llama, or your own module
    print(report)                           # what was swapped, what was left to PyTorch and why

Two things happen, both in place and both reversible only by rebuilding the model:

* **Submodules** whose class teeny has a drop-in for change class (``module.__class__``) to it:
  every ``torch.nn`` layer of ``teeny.torch.nn.DROP_INS``, and, recognised by class name so that
  ``transformers`` stays optional, Hugging Face's ``*RMSNorm`` (Llama, Mistral, Qwen2, ...),
  GPT-2's ``Conv1D`` (x @ W + b as teeny's ``linear`` of W^T: the bias in the product's
  epilogue and its gradient in dW's; W^T is made once a call, in autocast's cast where there is
  one), the tanh-GELU activations (``NewGELUActivation``, ...), GPT-2's MLP (``c_fc``, a
  tanh-GELU ``act``, ``c_proj``: one teeny call of three nodes, so one autograd node and one
  replay, not three) and gated MLPs (``gate_proj``/``up_proj``/``down_proj`` with a SiLU
  ``act_fn``: one fused SwiGLU pair).
  Parameters, buffers and hooks stay the very same objects, so tied weights stay tied, an
  optimizer built before the patch keeps working, and ``state_dict`` keys do not change. A
  layer with an option teeny has no kernel for (``padding_mode="reflect"``, ``max_norm``) is
  left as it is and reported.
* **Functional calls** the model's own code makes (``F.scaled_dot_product_attention`` in the
  attention, ``F.cross_entropy`` in the loss, ``F.gelu``, ``torch.softmax``, ...; the list is
  ``teeny.torch.nn.functional.ROUTED``) are routed to teeny while the model's ``forward`` runs,
  through a ``TorchFunctionMode``. A call with arguments teeny cannot run (attention dropout,
  a ``dtype=`` softmax) goes to PyTorch and is counted in ``report.fallbacks``.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import ops
from . import library
from .nn import DROP_INS
from .nn import functional as TF


@dataclass
class PatchReport:
    """What ``patch`` did: ``swapped`` (path, old class, new class), ``left`` (path, class,
    why), the functional calls it routes, and at run time ``routed``/``fallbacks`` counts (of
    eager calls: under ``torch.compile`` a count would be a guard that fails every call)."""

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)
    functional: list[str] = field(default_factory=list)
    routed: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        kinds = Counter(new for _, _, new in self.swapped)
        lines = [f"teeny.torch.patch: swapped {len(self.swapped)} modules"]
        lines += [f"  {count:4d} x {name}" for name, count in sorted(kinds.items())]
        lines.append(f"  routes {len(self.functional)} functional calls (F.scaled_dot_product_attention, ...)")
        if self.routed:
            lines.append("  routed so far: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.routed.items())))
        if self.fallbacks:
            lines.append("  run by PyTorch (no teeny kernel for those arguments):")
            lines += [f"    {name}: {why} (x{n})" for (name, why), n in sorted(self.fallbacks.items())]
        if self.left:
            lines.append(f"  left {len(self.left)} modules with their own parameters or buffers to PyTorch:")
            lines += [f"    {path or '<root>'} ({cls}): {why}" for path, cls, why in self.left]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- module swaps


def _unsupported_option(module: nn.Module) -> str | None:
    """Why a torch layer with a drop-in cannot be swapped (an option teeny has no kernel for)."""
    if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
        return f"padding_mode={module.padding_mode!r}"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        return "max_norm / scale_grad_by_freq / sparse"
    if isinstance(module, nn.MaxPool2d) and module.return_indices:
        return "return_indices=True"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        return "momentum=None"
    return None


def _rms_norm_forward(self, hidden_states):
    return TF.rms_norm(hidden_states, [self.weight.shape[-1]], self.weight, self.variance_epsilon)


def _conv1d_forward(self, x):  # transformers' Conv1D: x @ weight + bias, weight (in, out)
    return library.direct.linear(x, self.weight.t(), self.bias)


def _gelu_tanh_forward(self, input):
    return TF.gelu(input, "tanh")


def _gelu_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias):
    """linear, tanh-GELU, linear (weights (out, in)) as one teeny call."""
    return ops.linear(ops.gelu(ops.linear(x, fc_weight, fc_bias), "tanh"), proj_weight, proj_bias)


library.register(
    _gelu_mlp,
    name="gelu_mlp",
    schema="Tensor x, Tensor fc_weight, Tensor? fc_bias, Tensor proj_weight, Tensor? proj_bias",
    product=True,
)


def _gpt2_mlp_forward(self, hidden_states):  # c_fc, act, c_proj, dropout; Conv1D weights are (in, out)
    fc, proj = self.c_fc, self.c_proj
    return self.dropout(library.direct.gelu_mlp(hidden_states, fc.weight.t(), fc.bias, proj.weight.t(), proj.bias))


def _swiglu_mlp_forward(self, x):
    return self.down_proj(TF.swiglu(self.gate_proj(x), self.up_proj(x)))


_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def _teeny_subclass(cls: type, forward, label: str) -> type:
    """``cls`` with ``forward`` replaced (made once per class)."""
    key = (cls, label)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Teeny{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _SUBCLASSES[key]


def _hugging_face_swap(module: nn.Module) -> type | None:
    """The teeny class for a ``transformers`` module, recognised by name and attributes."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    name = cls.__name__
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, nn.Parameter):
        if "forward" in cls.__dict__ and "1.0 + self.weight" in _source(cls.forward):
            return None  # Gemma-style (1 + weight) norms compute something else
        return _teeny_subclass(cls, _rms_norm_forward, "rms_norm")
    if name == "Conv1D" and hasattr(module, "nf"):
        return _teeny_subclass(cls, _conv1d_forward, "conv1d")
    if name in _GELU_TANH:
        return _teeny_subclass(cls, _gelu_tanh_forward, "gelu_tanh")
    if all(hasattr(module, a) for a in ("c_fc", "c_proj", "act", "dropout")) and len(list(module.children())) == 4:
        conv1d = all(type(getattr(module, a)).__name__ == "Conv1D" for a in ("c_fc", "c_proj"))
        if conv1d and type(module.act).__name__ in _GELU_TANH:
            return _teeny_subclass(cls, _gpt2_mlp_forward, "gpt2_mlp")
    if all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        if type(module.act_fn).__name__ in ("SiLU", "SiLUActivation") and len(list(module.children())) == 4:
            return _teeny_subclass(cls, _swiglu_mlp_forward, "swiglu_mlp")
    return None


def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


# ----------------------------------------------------------------------------- functional calls


class _Router(TorchFunctionMode):
    """Routes the functional calls of ``teeny.torch.nn.functional.ROUTED`` to teeny."""

    passes_teeny_ops = True  # teeny's operators run unchanged under it (``library.direct`` may skip it)

    def __init__(self, report: PatchReport):
        super().__init__()
        self.report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = TF.ROUTED.get(func)
        if route is not None:
            name = getattr(func, "__name__", str(func))
            try:
                out = route(*args, **kwargs)
            except TF.Unsupported as exc:
                if not torch.compiler.is_compiling():
                    self.report.fallbacks[(name, str(exc))] += 1
            else:
                if not torch.compiler.is_compiling():
                    self.report.routed[name] += 1
                return out
        return func(*args, **kwargs)


def patch(model: nn.Module) -> PatchReport:
    """Swap the supported submodules of ``model`` for teeny's and route its functional calls
    to teeny while it runs (see the module docstring); returns what was done."""
    report = PatchReport(functional=sorted({getattr(f, "__name__", str(f)) for f in TF.ROUTED}))
    for path, module in model.named_modules():
        cls = type(module)
        if cls.__module__ == __name__ or cls in DROP_INS.values():
            continue  # already teeny
        target = DROP_INS.get(cls)
        if target is not None:
            why = _unsupported_option(module)
            if why is not None:
                report.left.append((path, cls.__name__, f"teeny has no kernel for {why}"))
                continue
        else:
            target = _hugging_face_swap(module)
        if target is not None:
            module.__class__ = target
            report.swapped.append((path, cls.__name__, target.__name__))
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            report.left.append((path, cls.__name__, "no teeny drop-in (its functional calls are still routed)"))
    if not getattr(model, "_teeny_patched", False):
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with _Router(report):
                return original(*args, **kwargs)

        model.forward = forward
        model._teeny_patched = True
        model._teeny_report = report
    else:
        previous = model._teeny_report
        previous.swapped += report.swapped
        previous.left = report.left
        report = previous
    return report
