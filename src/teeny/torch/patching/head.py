"""The language-model head and its loss as one teeny call: a causal LM of ``transformers``
(``GPT2LMHeadModel``, ``*ForCausalLM`` with a plain ``lm_head``) called in training mode with
``labels=`` computes head and loss as one call, which lowers to the chunked head + cross-entropy
(``teeny.fusions.chunk_linear_cross_entropy``): the (tokens x vocabulary) logits are never stored,
and the output's ``logits`` is ``None``, as Liger-Kernel's fused linear cross-entropy does.

The loss is computed inside the head's own forward: the model's forward runs as written, and
where it calls its head, the head returns the loss (the model is given no labels, so it computes
none). So whatever wraps the head's call runs around the loss: FSDP2's and DeepSpeed's hooks
gather a sharded head weight for it and its backward. A PEFT LoRA adapter on the head (patched
after ``get_peft_model``) is fused too: the head's weight plus the adapters' ``scale B A`` is the
product's weight (vanilla LoRA without dropout in training; anything else runs PEFT's layer).

Gemma 2 and 3 soft-cap their logits after the head, cap * tanh(logits / cap) with the config's
``final_logit_softcapping``: the fused loss applies that cap as it reads the logits, and while
the head returns the loss the model's forward sees no cap (it would cap the loss). Other
post-processing of the logits (a scale) leaves head and loss to the model.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from .. import library
from .classes import base_forward, count_fallback, from_transformers, has_hooks, origin, source, swap, teeny_class


def _causal_lm_loss(x, weight, bias, target, ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0):
    """transformers' causal-LM loss of hidden states x (batch, length, d): the logits x W^T + b
    of positions 0 .. L-2 (upcast to float32 when they are half precision, as transformers does;
    soft-capped at ``softcap`` > 0 as Gemma 2 caps them) against the labels at 1 .. L-1; lowered,
    head and loss become one chunked op."""
    batch, length, features = x.shape
    rows = batch * (length - 1)
    logits = ops.linear(ops.reshape(ops.slice(x, 1, 0, length - 1), (rows, features)), weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = ops.to(logits, torch.float32)
    labels = ops.reshape(ops.slice(target, 1, 1, None), (rows,))
    return ops.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction, softcap=softcap)


library.register(
    _causal_lm_loss,
    name="causal_lm_loss",
    schema=(
        "Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, str reduction='mean', "
        "float softcap=0.0"
    ),
    autocast="product",
)


@swap("lm_head", _teeny_loss_of=None)
def _head_forward(self, input):
    """The LM head: its logits, or, inside ``_causal_lm_forward`` (``_teeny_loss_of``: the labels,
    the reduction and the soft cap), the loss of its logits."""
    if self._teeny_loss_of is None:
        return base_forward(self, "lm_head")(self, input)
    labels, reduction, softcap = self._teeny_loss_of
    return library.direct.causal_lm_loss(
        input, self.weight, self.bias, labels.to(input.device), -100, reduction, softcap
    )


def _lora_weight(layer: nn.Module) -> torch.Tensor | None:
    """The weight a PEFT LoRA ``layer`` applies, W + sum of scale B A over its active adapters,
    or None where it computes something else (dropout in training, a variant such as DoRA, a
    bias on B, merged or disabled adapters, W stored transposed)."""
    if layer.disable_adapters or layer.merged or getattr(layer, "fan_in_fan_out", False):
        return None
    weight = layer.base_layer.weight
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a, b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if name in getattr(layer, "lora_variant", {}) or b.bias is not None or a.bias is not None:
            return None
        if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
            return None
        if not isinstance(dropout, (nn.Dropout, nn.Identity)):
            return None
        weight = weight + layer.scaling[name] * (b.weight @ a.weight).to(weight.dtype)
    return weight


@swap("lora_head", _teeny_loss_of=None)
def _lora_head_forward(self, x, *args, **kwargs):
    """A PEFT LoRA layer on the LM head: PEFT's forward, or, inside ``_causal_lm_forward``, the
    loss of the logits of the merged weight (``_lora_weight``)."""
    if self._teeny_loss_of is None:
        return base_forward(self, "lora_head")(self, x, *args, **kwargs)
    labels, reduction, softcap = self._teeny_loss_of
    weight = _lora_weight(self)
    return library.direct.causal_lm_loss(x, weight, self.base_layer.bias, labels.to(x.device), -100, reduction, softcap)


def _is_lora(layer: nn.Module) -> bool:
    """Whether ``layer`` is PEFT's LoRA layer around a linear one."""
    return all(hasattr(layer, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters")) and (
        isinstance(layer.base_layer, nn.Linear)
    )


# config entries with which a causal LM scales its logits: left to the model (a scale of 1 changes nothing)
_LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "output_multiplier_scale")
# Gemma 2 and 3's soft cap in their forward, at the config's final_logit_softcapping read at each call:
# fused into the loss (``_causal_lm_forward``)
_SOFTCAP_SOURCE = (
    "logits / self.config.final_logit_softcapping",
    "torch.tanh(logits)",
    "logits * self.config.final_logit_softcapping",
)


def _soft_caps_logits(cls: type) -> bool:
    """Whether the forward of causal LM class ``cls`` (before patch) soft-caps its logits as Gemma 2's
    does, at the config's ``final_logit_softcapping``."""
    text = source(getattr(cls, "_teeny_origin", cls).forward)
    return all(line in text for line in _SOFTCAP_SOURCE)


def _causal_lm_head(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The LM head whose loss ``patch`` fuses, or None; and what the report says about it."""
    cls = origin(model)
    if not from_transformers(cls) or not (cls.__name__.endswith("ForCausalLM") or cls.__name__ == "GPT2LMHeadModel"):
        return None, ""
    head = getattr(model, "lm_head", None)
    lora = _is_lora(head) if head is not None else False
    if not isinstance(head, nn.Linear) and not lora:
        what = f"{type(head).__module__}.{type(head).__name__}"
        return None, f"left to the model ({cls.__name__}.lm_head is a {what}, not a linear layer)"
    config = getattr(model, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and not _soft_caps_logits(cls):
        why = "final_logit_softcapping, not as Gemma 2 does"
        return None, f"left to the model ({cls.__name__} post-processes its logits: {why})"
    for name in _LOGIT_POSTPROCESSING:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return None, f"left to the model ({cls.__name__} post-processes its logits: {name})"
    text = source(cls.forward)
    if "self.lm_head(" not in text or "self.loss_function(" not in text:
        return None, f"left to the model ({cls.__name__}.forward computes its loss another way)"
    what = "; the LoRA adapters merged into the head's weight" if lora else ""
    if softcap is not None:
        what += f"; the soft cap final_logit_softcapping = {softcap} fused into the loss"
    return head, f"one chunked teeny op in training with labels= (logits not stored, output.logits is None{what})"


def fuse_head(model: nn.Module) -> str:
    """Give the first causal LM in ``model`` (itself, or the one a ``PeftModel`` holds) and its
    head the classes that compute head and loss as one call; returns what the report says."""
    for lm in model.modules():
        head, why = _causal_lm_head(lm)
        if not why:
            continue
        if head is not None:
            label = "lora_head" if _is_lora(head) else "lm_head"
            if label not in getattr(type(head), "_teeny_labels", ()):
                head.__class__ = teeny_class(type(head), label)
            if "causal_lm" not in getattr(type(lm), "_teeny_labels", ()):
                lm.__class__ = teeny_class(type(lm), "causal_lm")
        return why
    return ""


def _takes_fused_loss(model: nn.Module, kwargs: dict) -> bool:
    """A training call with labels= that wants the standard loss and a dict output."""
    if kwargs.get("labels") is None or not model.training or not torch.is_grad_enabled():
        return False
    if kwargs.get("logits_to_keep", 0) != 0 or kwargs.get("shift_labels") is not None:
        return False
    return_dict = kwargs.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    extra = set(kwargs) - _FORWARD_ARGUMENTS
    return bool(return_dict) and not extra


# keyword arguments a causal LM's forward passes to its base model (the rest go to the loss)
_FORWARD_ARGUMENTS = {
    "input_ids",
    "attention_mask",
    "position_ids",
    "token_type_ids",
    "inputs_embeds",
    "labels",
    "use_cache",
    "return_dict",
    "num_items_in_batch",
    "logits_to_keep",
    "cache_position",
    "past_key_values",
    "output_attentions",
    "output_hidden_states",
}


def _head_unfused(head: nn.Module) -> str | None:
    """Why the head cannot return the loss now, or None: it must still be the layer patch made
    (a PEFT adapter put on it since replaces it), with no hooks but sharding's, and its adapters
    must merge (``_lora_weight``)."""
    if type(head).forward not in (_head_forward, _lora_head_forward):
        return f"lm_head is a {type(head).__module__}.{type(head).__name__} (an adapter?): the logits are computed"
    if has_hooks(head, sharding_ok=True):
        return "lm_head has hooks: the logits are computed"
    if type(head).forward is _lora_head_forward and _lora_weight(head) is None:
        return "lm_head's LoRA adapters do not merge (dropout, a variant): the logits are computed"
    return None


def _soft_cap_of(base: type) -> dict:
    """The class attribute of a causal LM class: whether its forward soft-caps its logits (``_soft_caps_logits``)."""
    return {"_teeny_soft_caps": _soft_caps_logits(base)}


@swap("causal_lm", per_class=_soft_cap_of)
def _causal_lm_forward(self, *args, **kwargs):
    """A causal LM's forward. In training with ``labels=`` (``_takes_fused_loss``): the model's own
    forward without labels, its head returning the loss (``_head_forward``) of the logits soft-capped
    as the forward caps them (Gemma 2: the config's cap, hidden from the forward meanwhile, which
    would cap the loss); the output as the model builds it, with that loss and no logits. A head
    the loss cannot be fused into now (``_head_unfused``) runs the model's own forward, logits and
    all (counted in ``report.fallbacks``)."""
    forward = base_forward(self, "causal_lm")
    if not _takes_fused_loss(self, kwargs):
        return forward(self, *args, **kwargs)
    head = self.lm_head
    why = _head_unfused(head)
    if why is not None:
        count_fallback(self, "causal_lm_loss", why)
        return forward(self, *args, **kwargs)
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    config = self.config
    softcap = getattr(config, "final_logit_softcapping", None) if self._teeny_soft_caps else None
    head._teeny_loss_of = (labels, "mean" if num_items is None else "sum", float(softcap or 0.0))
    try:
        if softcap is not None:
            config.final_logit_softcapping = None  # the head's loss applies it: the forward must not cap that loss
        out = forward(self, *args, **kwargs)
    finally:
        head._teeny_loss_of = None
        if softcap is not None:
            config.final_logit_softcapping = softcap
    loss = out.logits
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise RuntimeError(
            f"teeny.torch.patch: {type(self).__name__}.forward changed what its head returned (the fused loss) into "
            f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}; patch it with fused_loss=False"
        )
    if num_items is not None:
        loss = loss / num_items
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)
