"""The layers of ``transformers`` models that ``patch`` swaps, recognised by their structure (class
name, children, attributes), not by the text of their forward:

* RMS norms (``*RMSNorm``: a weight and an epsilon), the plain ``x̂ w`` and Gemma's ``x̂ (1 + w)``,
  told apart by running the norm once on a small random input (``norm_weight_offset``);
* GPT-2's ``Conv1D`` (x @ W + b with W (in, out): teeny's ``linear`` of W^T, read in place) and the
  tanh-GELU activations;
* gated MLPs, ``down(act(gate(x)) * up(x))``: SiLU as one SwiGLU pair, tanh or erf GELU as GeGLU;
  with separate ``gate_proj``/``up_proj`` (Llama, Gemma, ...) or one ``gate_up_proj`` (Phi-3);
* mixture-of-experts experts (``*Experts`` with 3-D ``gate_up_proj``/``down_proj`` weights, SiLU):
  each expert's MLP one teeny call over the tokens routed to it; the router stays PyTorch's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ... import ops
from .. import library
from ..nn import functional as TF
from .classes import base_forward, from_transformers, origin, source, swap

# ----------------------------------------------------------------------------- norms


def _epsilon(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


@swap("rms_norm", autocast_output=False, weight_offset=0.0)
def _rms_norm_forward(self, hidden_states):
    out_dtype = TF.autocast_dtype(self, hidden_states)
    return TF.rms_norm(hidden_states, [self.weight.shape[-1]], self.weight, _epsilon(self), out_dtype=out_dtype,
                       weight_offset=self.weight_offset)  # fmt: skip


swap("offset_rms_norm", autocast_output=False, weight_offset=1.0)(_rms_norm_forward)


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers RMS norm: a ``*RMSNorm`` with a weight over the last
    dim and an epsilon."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return (
        cls.__name__.endswith("RMSNorm")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and isinstance(eps, float)
        and not any(True for _ in module.children())
    )


def norm_weight_offset(module: nn.Module) -> float | None:
    """What the RMS norm ``module`` scales x̂ by: its weight w (0.0), Gemma's 1 + w (1.0), or
    neither (None). Found by running a copy of it with a random weight once on a small random
    input (its own weight may be all ones, where 2 x̂ w and x̂ (1 + w) agree); where its weight
    is not a plain tensor on a device (the meta device, a shard), by its source text."""
    weight = module.weight
    if weight.device.type == "meta" or type(weight) not in (torch.Tensor, nn.Parameter):
        text = source(type(module).forward).replace(" ", "")
        return 1.0 if "(1.0+self.weight" in text or "(1+self.weight" in text else 0.0
    gen = torch.Generator().manual_seed(0)
    width = weight.shape[-1]
    x = torch.randn(3, width, generator=gen).to(weight.device, weight.dtype)
    probe = copy.deepcopy(module)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(width, generator=gen))
        try:
            y = type(module).forward(probe, x).float()
        except Exception:  # noqa: BLE001  (a norm that takes other arguments: not one patch knows)
            return None
        loose = weight.dtype.itemsize < 4
        for offset in (0.0, 1.0):
            expected = torch.nn.functional.rms_norm(
                x.float(), (width,), probe.weight.float() + offset, _epsilon(module)
            )
            if y.shape == expected.shape and torch.allclose(y, expected, rtol=2e-2 if loose else 1e-4, atol=1e-3):
                return offset
    return None


# ----------------------------------------------------------------------------- GPT-2's Conv1D, GELU


def conv1d_linear(x, weight, bias):
    """transformers' Conv1D, x @ W + b with W (in, out): a linear of W^T, which lowering reads
    in place (``rewrites.read_transposed_weights``): no transposed copy of W, nor of dW."""
    return ops.linear(x, ops.transpose(weight, 0, 1), bias)


library.register(
    conv1d_linear, name="conv1d_linear", schema="Tensor x, Tensor weight, Tensor? bias", autocast="product"
)


@swap("conv1d")
def conv1d_forward(self, x):
    return library.direct.conv1d_linear(x, self.weight, self.bias)


@swap("gelu_tanh")
def _gelu_tanh_forward(self, input):
    return TF.gelu(input, "tanh")


GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}

# ----------------------------------------------------------------------------- gated MLPs


def gating(act: nn.Module) -> str | None:
    """The gated pair an MLP with activation ``act`` runs: "silu" (SwiGLU), "tanh" or "none"
    (GeGLU with that GELU), or None."""
    name = origin(act).__name__  # patch swaps the tanh-GELU modules themselves too
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in GELU_TANH or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "tanh"
    if (name == "GELUActivation" and not getattr(act, "use_gelu_python", False)) or type(act) is nn.GELU:
        return "none"
    return None


def _gated(gate, up, gating_: str):
    if gating_ == "silu":
        return TF.swiglu(gate, up)
    return TF.geglu(gate, up, gating_)


@swap("gated_mlp")
def _gated_mlp_forward(self, x):
    """down(act(gate(x)) * up(x)), the activation and product one teeny pair (SwiGLU or GeGLU)."""
    return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), gating(self.act_fn)))


@swap("gate_up_mlp")
def _gate_up_mlp_forward(self, x):
    """Phi-3's MLP: gate and up are the two halves of one product, gate_up_proj(x)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(_gated(gate, up, gating(self.activation_fn)))


def gated_mlp_kind(module: nn.Module) -> tuple[str, str]:
    """The label of a gated MLP's teeny class ("" when none) and what runs it ("" for a module
    that is not a gated MLP)."""
    names = sorted(name for name, _ in module.named_children())
    if names == ["act_fn", "down_proj", "gate_proj", "up_proj"]:
        label, act = "gated_mlp", module.act_fn
    elif names == ["activation_fn", "down_proj", "gate_up_proj"]:
        label, act = "gate_up_mlp", module.activation_fn
    else:
        return "", ""
    kind = gating(act)
    if kind is None:
        return "", f"PyTorch: {type(act).__name__} gate"
    return label, "teeny: SwiGLU" if kind == "silu" else "teeny: GeGLU"


# ----------------------------------------------------------------------------- mixture-of-experts


def expert_mlp(x, gate_up_weight, down_weight):
    """One expert's SwiGLU MLP over its tokens x (n, d): gate and up the two halves of
    x gate_up_weight^T (gate_up_weight (2 i, d)), then down_weight (d, i)."""
    hidden = ops.linear(x, gate_up_weight)
    width = hidden.shape[-1] // 2
    gated = ops.swiglu(ops.slice(hidden, -1, 0, width), ops.slice(hidden, -1, width, None))
    return ops.linear(gated, down_weight)


library.register(
    expert_mlp, name="expert_mlp", schema="Tensor x, Tensor gate_up_weight, Tensor down_weight", autocast="product"
)

# the layout transformers' ``use_experts_implementation`` describes, which ``expert_mlp`` computes
_PLAIN_EXPERTS = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                  "has_post_expert_norm": False}  # fmt: skip


def _plain_experts(module: nn.Module) -> str | None:
    """Why the experts ``module`` are not what ``expert_mlp`` computes, or None."""
    for name, value in _PLAIN_EXPERTS.items():
        if getattr(module, name, value) != value:
            return f"{name}={getattr(module, name)}"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "no 3-D gate_up_proj and down_proj weights"
    experts, inner, width = (*gate_up.shape,) if gate_up.dim() == 3 else (0, 0, 0)
    if down.shape != (experts, width, inner // 2) or inner % 2:
        return f"weights of shapes {tuple(gate_up.shape)}, {tuple(down.shape)}"
    if gating(getattr(module, "act_fn", None)) != "silu":
        return "an activation other than SiLU"
    apply_gate = type(module).__dict__.get("_apply_gate") or getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and not apply_gate.__module__.startswith("transformers.integrations"):
        return "its own _apply_gate"
    return None


@swap("experts")
def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Each expert's MLP over the tokens routed to it as one teeny call, weighted and summed into
    the output as transformers' own experts do; another experts implementation chosen in the
    config (``_experts_implementation``) runs transformers'."""
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager") or torch.compiler.is_compiling():
        return base_forward(self, "experts")(self, hidden_states, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    experts = self.gate_up_proj.shape[0]
    for expert in torch.unique(top_k_index).tolist():
        if not 0 <= expert < experts:  # expert parallelism marks the experts of other ranks so
            continue
        tokens, slots = torch.where(top_k_index == expert)
        y = library.direct.expert_mlp(hidden_states[tokens], self.gate_up_proj[expert], self.down_proj[expert])
        out.index_add_(0, tokens, (y * top_k_weights[tokens, slots, None]).to(out.dtype))
    return out


def experts_kind(module: nn.Module) -> tuple[str, str]:
    """ "experts" for transformers experts that ``expert_mlp`` computes ("" when not) and what runs
    them ("" for a module that is no experts module)."""
    cls = origin(module)
    if not (from_transformers(cls) and cls.__name__.endswith("Experts") and hasattr(module, "gate_up_proj")):
        return "", ""
    why = _plain_experts(module)
    return ("", f"PyTorch: experts with {why}") if why else ("experts", "teeny: experts")


# ----------------------------------------------------------------------------- torch layers' options


def unsupported_option(module: nn.Module) -> str | None:
    """Why a torch layer with a drop-in cannot be swapped (an option teeny has no kernel for)."""
    if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
        return f"padding_mode={module.padding_mode!r}"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        return "max_norm / scale_grad_by_freq / sparse"
    if isinstance(module, nn.MaxPool2d) and module.return_indices:
        return "return_indices=True"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        return "momentum=None"
    if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin)) and module.dim is None:
        return "dim=None (torch's implicit, deprecated choice of the dimension)"
    return None
