"""Transformer blocks: the residual add after a block's attention and the norm after it as one teeny
call (``residual_norm``); how a block's calls are routed: ``attention.routes_calls``.

Blocks are recognised by their structure, never by the text of their forward: a ``transformers``
``*DecoderLayer`` whose children are exactly those of one of the layouts below (module names; a
config that makes the block parallel, ``use_parallel_residual`` and the like, matches none).
What each layout computes, with r the block's input:

* pre-norm (Llama, Mistral, Qwen, Gemma, Granite, Phi-3, MoE layers, ...):
  ``h = r + m·drop(attn(norm1(r)))``, ``out = h + m·drop(mlp(norm2(h)))``, where ``m`` is the
  block's ``residual_multiplier`` (Granite; else 1) and ``drop`` its ``resid_*_dropout`` (Phi-3);
* sandwich (Gemma 2, Gemma 3): ``h = r + post1(attn(norm1(r)))``, ``out = h + post2(mlp(norm2(h)))``;
* post-norm (OLMo 2, OLMo 3, EXAONE 4): ``h = r + norm1(attn(r))``, ``out = h + norm2(mlp(h))``:
  nothing to fuse, the block's own forward runs.

The add and the norm that follows it are one call (``_junction``); everything else is the
block's own layers, called as the block's forward calls them. A block whose layout is none of
these keeps its own forward, and is reported. Every block runs under teeny's router, unless its
attention is teeny's through transformers' interface (``attention.routes_calls``): then without it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ... import ops
from .. import library
from ..nn import DROP_INS
from ..nn import functional as TF
from .attention import routes_calls
from .classes import base_forward, from_transformers, origin, swap
from .layers import _epsilon, _rms_norm_forward


def _residual_norm(x, residual, weight, bias, eps: float, centred: bool, out_dtype=None, weight_offset: float = 0.0):
    """A pre-norm block's junction: s = residual + x (x, a sublayer's output, upcast to the
    stream's dtype first: bf16 under autocast) and the next norm of s, layer_norm (``centred``)
    or rms_norm (scale weight + ``weight_offset``), written in ``out_dtype``. Lowered, one
    launch forwards (the norm reads x in its own dtype, writes s and y:
    ``rewrites.fuse_residual_norm``); backwards the norm adds its dx to s's gradient as it
    writes it, and the upcast's backward casts that for x."""
    if x.dtype != residual.dtype:
        x = ops.to(x, residual.dtype)
    s = ops.add(residual, x)
    shape = [residual.shape[-1]]
    if centred:
        return s, ops.layer_norm(s, shape, weight, bias, eps, out_dtype=out_dtype)
    return s, ops.rms_norm(s, shape, weight, eps, out_dtype=out_dtype, weight_offset=weight_offset)


library.register(
    _residual_norm,
    name="residual_norm",
    schema="Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "ScalarType? out_dtype=None, float weight_offset=0.0",
    multi_output=True,
    autocast="as_given",
)


def junction(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(residual + x, norm of it) as one teeny call when ``norm`` is a teeny layer or RMS norm
    without hooks over the last dim, and x is no wider a float than the stream; else None."""
    if norm._forward_hooks or norm._forward_pre_hooks or not residual.is_floating_point():
        return None
    if not x.is_floating_point() or x.dtype.itemsize > residual.dtype.itemsize or x.shape != residual.shape:
        return None
    weight, offset = getattr(norm, "weight", None), 0.0
    if type(norm) is DROP_INS[nn.LayerNorm]:
        if len(norm.normalized_shape) != 1:
            return None
        eps, centred, bias = norm.eps, True, norm.bias
    elif type(norm).forward is _rms_norm_forward:
        eps, centred, bias, offset = _epsilon(norm), False, None, norm.weight_offset
    else:
        return None
    if weight is None or weight.shape != residual.shape[-1:]:
        return None
    out_dtype = TF.autocast_dtype(norm, residual)
    return library.direct.residual_norm(x, residual, weight, bias, float(eps), centred, out_dtype, float(offset))


def _add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(residual + x, norm of it): one teeny call where it can be (``junction``), else two."""
    joined = junction(norm, x, residual)
    if joined is not None:
        return joined
    hidden_states = residual + x
    return hidden_states, norm(hidden_states)


def signature_of(base: type) -> dict:
    """The class attribute of a block class: the signature of the forward it patches."""
    return {"_teeny_signature": inspect.signature(base.forward)}


def attention_arguments(block: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The arguments a block call hands its attention, by name: all but the hidden states, as the
    block's own forward passes them (its defaults included, its ``**kwargs`` spread)."""
    bound = block._teeny_signature.bind(block, None, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    params = list(block._teeny_signature.parameters.values())
    del arguments[params[0].name], arguments[params[1].name]
    for p in params:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(p.name, {}))
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            arguments.pop(p.name, None)
    return arguments


def _sublayer_output(out):
    """A sublayer's output tensor (an attention returns (output, weights); some MoE MLPs (output, router scores))."""
    return out[0] if isinstance(out, tuple) else out


def _residual_branch(block: nn.Module, x: torch.Tensor, dropout: str) -> torch.Tensor:
    """What a pre-norm block adds to its stream for a sublayer's output x: x, through the block's
    residual dropout named ``dropout`` (Phi-3) and times its ``residual_multiplier`` (Granite)."""
    drop = getattr(block, dropout, None)
    if drop is not None:
        x = drop(x)
    multiplier = getattr(block, "residual_multiplier", None)
    return x if multiplier is None else x * multiplier


@swap("pre_norm_block", per_class=signature_of)
@routes_calls
def _pre_norm_forward(self, hidden_states, *args, **kwargs):
    """A pre-norm block (see the module docstring), the add and post_attention_layernorm one call."""
    attention = attention_arguments(self, args, kwargs)
    x = _sublayer_output(self.self_attn(hidden_states=self.input_layernorm(hidden_states), **attention))
    hidden_states, normed = _add_then_norm(
        self.post_attention_layernorm, _residual_branch(self, x, "resid_attn_dropout"), hidden_states
    )
    return hidden_states + _residual_branch(self, _sublayer_output(self.mlp(normed)), "resid_mlp_dropout")


@swap("sandwich_block", per_class=signature_of)
@routes_calls
def _sandwich_forward(self, hidden_states, *args, **kwargs):
    """A sandwich block (Gemma 2 and 3), the add and pre_feedforward_layernorm one call."""
    attention = attention_arguments(self, args, kwargs)
    x = _sublayer_output(self.self_attn(hidden_states=self.input_layernorm(hidden_states), **attention))
    hidden_states, normed = _add_then_norm(self.pre_feedforward_layernorm, self.post_attention_layernorm(x),
                                           hidden_states)  # fmt: skip
    return hidden_states + self.post_feedforward_layernorm(_sublayer_output(self.mlp(normed)))


@swap("block")
@routes_calls
def _block_forward(self, *args, **kwargs):
    """A block whose own forward runs (post-norm blocks, and blocks of a layout teeny does not know)."""
    return base_forward(self, "block")(self, *args, **kwargs)


# layout label -> (its children's names, optional children, which of them are pre-norms and the
# sublayer each feeds: norm -> (sublayer, the products that read the norm's output first))
_PRE_NORMS_ATTENTION = ("self_attn", (("q_proj", "k_proj", "v_proj"), ("qkv_proj",)))
_PRE_NORMS_MLP = ("mlp", (("gate_proj", "up_proj"), ("gate_up_proj",), ("c_fc",), ("up_proj",)))
LAYOUTS = {
    "pre_norm_block": (
        {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"},
        {"resid_attn_dropout", "resid_mlp_dropout"},
        {"input_layernorm": _PRE_NORMS_ATTENTION, "post_attention_layernorm": _PRE_NORMS_MLP},
    ),
    "sandwich_block": (
        {
            "input_layernorm",
            "self_attn",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "mlp",
        },  # fmt: skip
        set(),
        {"input_layernorm": _PRE_NORMS_ATTENTION, "pre_feedforward_layernorm": _PRE_NORMS_MLP},
    ),
    "post_norm_block": ({"self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"}, set(), {}),
}
# config flags that make a block of the same children compute something else (parallel branches)
_PARALLEL_FLAGS = ("use_parallel_residual", "parallel_attn", "parallel_residual", "parallel_block")


def is_block(cls: type) -> bool:
    """A transformers block class (``*DecoderLayer``, GPT-2's ``GPT2Block``)."""
    return from_transformers(cls) and (cls.__name__ == "GPT2Block" or cls.__name__.endswith("DecoderLayer"))


def layout(block: nn.Module) -> str | None:
    """The label of ``block``'s layout in ``LAYOUTS``, or None."""
    cls = origin(block)
    if not from_transformers(cls) or not cls.__name__.endswith("DecoderLayer"):
        return None
    config = getattr(block, "config", None) or getattr(getattr(block, "self_attn", None), "config", None)
    if any(getattr(config, flag, False) for flag in _PARALLEL_FLAGS):
        return None
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    if params[1:2] != ["hidden_states"]:
        return None
    children = {name for name, _ in block.named_children()}
    for label, (required, optional, _) in LAYOUTS.items():
        if required <= children <= required | optional:
            return label
    return None


def block_kind(block: nn.Module) -> tuple[str, str]:
    """The label of a decoder layer's teeny class and what the report says runs it ("" for a
    layout teeny does not know, which keeps its own forward: label "block")."""
    label = layout(block)
    if label is None:
        return "block", ""
    if label == "post_norm_block":
        return "block", "teeny: own forward (post-norms: nothing to fuse)"
    return label, "teeny: residual add + norm one call"


def product_read_norms(block: nn.Module) -> list[str]:
    """The names of ``block``'s teeny norms whose output only products read: the pre-norms of its
    layout (``LAYOUTS``; GPT-2's ``ln_1``/``ln_2``) whose sublayer has those products. Under
    autocast they write autocast's dtype, which the products cast to first anyway."""
    labels = getattr(type(block), "_teeny_labels", ())
    if "gpt2_block" in labels:
        pre_norms = {"ln_1": ("attn", (("c_attn",),)), "ln_2": ("mlp", (("c_fc",),))}
    else:
        label = next((name for name in labels if name in LAYOUTS), None)
        pre_norms = LAYOUTS[label][2] if label else {}
    names = []
    for norm, (reader, product_sets) in pre_norms.items():
        sublayer = getattr(block, reader, None)
        if not hasattr(getattr(block, norm, None), "autocast_output") or sublayer is None:
            continue
        children = {name for name, _ in sublayer.named_children()}
        if any(set(products) <= children and _products_only(sublayer, products) for products in product_sets):
            names.append(norm)
    return names


def _products_only(sublayer: nn.Module, products: tuple[str, ...]) -> bool:
    """Whether ``sublayer``'s children named ``products`` are all product layers (linear or Conv1D,
    possibly an adapter around one: its base layer casts its input under autocast as well)."""
    for name in products:
        layer = getattr(sublayer, name)
        layer = getattr(layer, "base_layer", layer)
        if not isinstance(layer, nn.Linear) and origin(layer).__name__ != "Conv1D":
            return False
    return True
