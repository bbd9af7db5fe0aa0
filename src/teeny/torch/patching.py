"""``teeny.torch.patch(model)``: run a PyTorch model on teeny's kernel pairs, in place.

    report = teeny.torch.patch(model)      # a Hugging Face GPT-2 or Llama, or your own module
    print(report)                           # what was swapped, what was left to PyTorch and why

Two things happen, both in place and both reversible only by rebuilding the model:

* **Submodules** whose class teeny has a drop-in for change class (``module.__class__``) to it:
  every ``torch.nn`` layer of ``teeny.torch.nn.DROP_INS``, and, recognised by class name so that
  ``transformers`` stays optional, Hugging Face's ``*RMSNorm`` (Llama, Mistral, Qwen2, ...),
  GPT-2's ``Conv1D`` (x @ W + b as teeny's ``linear`` of W^T, which reads W (in, out) in
  place: the bias in the product's epilogue), the tanh-GELU activations
  (``NewGELUActivation``, ...), GPT-2's MLP (``c_fc``, a tanh-GELU ``act``, ``c_proj``: one
  teeny call of three nodes, so one autograd node and one replay, not three), GPT-2's
  attention (``c_attn``, causal attention reading the heads' q, k, v in place from its output,
  ``c_proj``: one teeny call, no head-split copies; a cache, a padding mask, cross-attention or
  attention dropout runs transformers' own code; under torch.compile the ``GPT2Model`` around
  the layers, swapped too, tells them when the mask it builds is the causal one) and gated MLPs
  (``gate_proj``/``up_proj``/``down_proj`` with a SiLU ``act_fn``: one fused SwiGLU pair).
  Parameters, buffers and hooks stay the very same objects, so tied weights stay tied, an
  optimizer built before the patch keeps working, and ``state_dict`` keys do not change. A
  layer with an option teeny has no kernel for (``padding_mode="reflect"``, ``max_norm``) is
  left as it is and reported.
* **Pre-norms under autocast**: the norms a transformer block hands straight to products
  (GPT-2's ``ln_1``/``ln_2``, Llama-family ``input_layernorm``/``post_attention_layernorm``)
  get ``autocast_output``: under autocast they write autocast's dtype, to which those products
  cast their input first anyway (the same numbers, no cast launch after the norm, none before
  its backward); ``report.autocast_norms`` lists them.
* **The language-model head and its loss**: a causal LM of ``transformers`` (``GPT2LMHeadModel``,
  ``*ForCausalLM`` with a plain ``lm_head``) called in training mode with ``labels=`` computes
  head and loss as one teeny call, which lowers to the chunked head + cross-entropy
  (``teeny.fusions.chunk_linear_cross_entropy``): the (tokens x vocabulary) logits are never
  stored, and the output's ``logits`` is ``None``, as Liger-Kernel's fused linear cross-entropy
  does. In eval mode, under ``no_grad`` or without labels the logits are computed as before.
  ``patch(model, fused_loss=False)`` keeps them always.
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
    fused_loss: str = ""  # the head + loss fused, or why not ("" when the model has no LM head)
    autocast_norms: list[str] = field(default_factory=list)  # pre-norms that write autocast's dtype (see patch)

    def __str__(self) -> str:
        kinds = Counter(new for _, _, new in self.swapped)
        lines = [f"teeny.torch.patch: swapped {len(self.swapped)} modules"]
        lines += [f"  {count:4d} x {name}" for name, count in sorted(kinds.items())]
        lines.append(f"  routes {len(self.functional)} functional calls (F.scaled_dot_product_attention, ...)")
        if self.fused_loss:
            lines.append(f"  head + loss: {self.fused_loss}")
        if self.autocast_norms:
            n = len(self.autocast_norms)
            lines.append(f"  {n} pre-norms write autocast's dtype under autocast (products read them)")
        if self.routed:
            lines.append("  routed so far: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.routed.items())))
        if self.fallbacks:
            lines.append("  run by PyTorch (no teeny kernel for those arguments):")
            lines += [f"    {name}: {why} (x{n})" for (name, why), n in sorted(self.fallbacks.items())]
        if self.left:
            lines.append(f"  left {len(self.left)} modules to PyTorch:")
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
    if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin)) and module.dim is None:
        return "dim=None (torch's implicit, deprecated choice of the dimension)"
    return None


def _rms_norm_forward(self, hidden_states):
    out_dtype = TF.autocast_dtype(self, hidden_states)
    return TF.rms_norm(hidden_states, [self.weight.shape[-1]], self.weight, self.variance_epsilon, out_dtype=out_dtype)


def _conv1d_linear(x, weight, bias):
    """transformers' Conv1D, x @ W + b with W (in, out): a linear of W^T, which lowering reads
    in place (``rewrites.read_transposed_weights``): no transposed copy of W, nor of dW."""
    return ops.linear(x, ops.transpose(weight, 0, 1), bias)


library.register(
    _conv1d_linear, name="conv1d_linear", schema="Tensor x, Tensor weight, Tensor? bias", autocast="product"
)


def _conv1d_forward(self, x):
    return library.direct.conv1d_linear(x, self.weight, self.bias)


def _gelu_tanh_forward(self, input):
    return TF.gelu(input, "tanh")


def _gelu_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias):
    """GPT-2's MLP as one teeny call: Conv1D, tanh-GELU, Conv1D (weights (in, out), read in place)."""
    hidden = ops.gelu(_conv1d_linear(x, fc_weight, fc_bias), "tanh")
    return _conv1d_linear(hidden, proj_weight, proj_bias)


library.register(
    _gelu_mlp,
    name="gelu_mlp",
    schema="Tensor x, Tensor fc_weight, Tensor? fc_bias, Tensor proj_weight, Tensor? proj_bias",
    autocast="product",
)


def _gpt2_attention(x, attn_weight, attn_bias, proj_weight, proj_bias, heads: int, scale: float | None = None):
    """GPT-2's causal self-attention as one teeny call: c_attn (a Conv1D, W (in, 3 d)), the heads'
    attention read from its output in place (q, k, v its three column blocks), the heads merged
    by a view, c_proj; its gradient is written whole into c_attn's output gradient."""
    qkv = _conv1d_linear(x, attn_weight, attn_bias)
    heads_out = TF._packed_attention(qkv, heads, True, scale)  # (batch, length, heads, dim)
    return _conv1d_linear(ops.reshape(heads_out, tuple(x.shape[:-1]) + (proj_weight.shape[0],)), proj_weight, proj_bias)


library.register(
    _gpt2_attention,
    name="gpt2_attention",
    schema="Tensor x, Tensor attn_weight, Tensor? attn_bias, Tensor proj_weight, Tensor? proj_bias, int heads, "
    "float? scale=None",
    autocast="product",
)


def _causal_lm_loss(x, weight, bias, target, ignore_index: int = -100, reduction: str = "mean"):
    """transformers' causal-LM loss of hidden states x (batch, length, d): the logits x W^T + b
    of positions 0 .. L-2 (upcast to float32 when they are half precision, as transformers does)
    against the labels at 1 .. L-1; lowered, head and loss become one chunked op."""
    batch, length, features = x.shape
    rows = batch * (length - 1)
    logits = ops.linear(ops.reshape(ops.slice(x, 1, 0, length - 1), (rows, features)), weight, bias)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = ops.to(logits, torch.float32)
    labels = ops.reshape(ops.slice(target, 1, 1, None), (rows,))
    return ops.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


library.register(
    _causal_lm_loss,
    name="causal_lm_loss",
    schema="Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, str reduction='mean'",
    autocast="product",
)


def _head_forward(self, input):
    """The LM head: its logits, or (inside ``_causal_lm_forward``) its input, the hidden states."""
    if self._teeny_hidden_only:
        return input
    return type(self).__mro__[1].forward(self, input)


_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _causal_lm_head(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The LM head whose loss ``patch`` fuses, or None; and what the report says about it."""
    cls = type(model)
    if not cls.__module__.startswith("transformers.") or not (
        cls.__name__.endswith("ForCausalLM") or cls.__name__ == "GPT2LMHeadModel"
    ):
        return None, ""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return None, f"left to the model ({cls.__name__}.lm_head is not a linear layer)"
    config = getattr(model, "config", None)
    for name in _LOGIT_POSTPROCESSING:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return None, f"left to the model ({cls.__name__} post-processes its logits: {name})"
    source = _source(cls.forward)
    if "self.lm_head(" not in source or "self.loss_function(" not in source:
        return None, f"left to the model ({cls.__name__}.forward computes its loss another way)"
    return head, "one chunked teeny op in training with labels= (logits not stored, output.logits is None)"


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


def _causal_lm_forward(model: nn.Module, head: nn.Module, forward, args: tuple, kwargs: dict):
    """The model's own forward up to the head (which passes its input through), then head and
    loss as one teeny call; the output as the model builds it, with the loss and no logits."""
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    head._teeny_hidden_only = True
    try:
        out = forward(*args, **kwargs)
    finally:
        head._teeny_hidden_only = False
    hidden = out.logits
    reduction = "mean" if num_items is None else "sum"
    loss = library.direct.causal_lm_loss(hidden, head.weight, head.bias, labels.to(hidden.device), -100, reduction)
    if num_items is not None:
        loss = loss / num_items
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)


def _gpt2_mlp_forward(self, hidden_states):  # c_fc, act, c_proj, dropout; Conv1D weights are (in, out)
    fc, proj = self.c_fc, self.c_proj
    return self.dropout(library.direct.gelu_mlp(hidden_states, fc.weight, fc.bias, proj.weight, proj.bias))


# GPT2Attention.forward's arguments that must be None for plain causal self-attention, and
# those that then change nothing
_ABSENT_IN_SELF_ATTENTION = ("cache", "past_key_values", "layer_past", "attention_mask", "head_mask",
                             "encoder_hidden_states", "encoder_attention_mask")  # fmt: skip
_IGNORED_IN_SELF_ATTENTION = {"use_cache", "cache_position", "position_ids", "output_attentions", "is_causal"}


def _plain_causal_self_attention(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a GPT2Attention call is what ``gpt2_attention`` computes: self-attention through
    SDPA with its causal mask only (no cache, padding mask or cross-attention), no attention
    dropout in training, no attention weights returned. The causal mask alone is None in eager
    mode; under torch.compile transformers always builds it, and it is known to be the causal
    one when the call of the GPT2Model around the layer gave nothing that changes it (it marks
    its layers: ``_gpt2_model_forward``). The mark counts only while compiling, where the
    decision is traced from the model call's own arguments."""
    if args or module.is_cross_attention or getattr(module.config, "_attn_implementation", None) != "sdpa":
        return False
    if (module.training and module.attn_dropout.p > 0) or kwargs.get("output_attentions"):
        return False
    absent = _ABSENT_IN_SELF_ATTENTION
    if getattr(module, "_teeny_mask_is_causal", False) and torch.compiler.is_compiling():
        absent = tuple(n for n in absent if n != "attention_mask")
    if kwargs.get("is_causal", True) is not True or any(kwargs.get(n) is not None for n in absent):
        return False
    return set(kwargs) <= set(_ABSENT_IN_SELF_ATTENTION) | _IGNORED_IN_SELF_ATTENTION


# GPT2Model's arguments that leave the mask it builds the causal one (any other that is given
# may change it: a padding mask, positions marking packed sequences, a cache)
_MASK_NEUTRAL_ARGUMENTS = {"input_ids", "inputs_embeds", "token_type_ids", "use_cache", "return_dict",
                           "output_attentions", "output_hidden_states"}  # fmt: skip


def _builds_causal_mask_only(args: tuple, kwargs: dict) -> bool:
    """Whether the attention mask GPT2Model builds for this call of its forward is its causal
    mask alone: the token ids the only positional argument, and every other argument given
    (not None) one that leaves the mask alone."""
    return len(args) <= 1 and all(v is None or k in _MASK_NEUTRAL_ARGUMENTS for k, v in kwargs.items())


def _gpt2_model_forward(self, *args, **kwargs):
    """GPT2Model's forward; under torch.compile it first marks its one-call attention layers
    with whether the mask it is about to build is its causal one alone (``_builds_causal_mask_only``)."""
    forward = type(self).__mro__[1].forward
    if not torch.compiler.is_compiling():
        return forward(self, *args, **kwargs)
    causal_only = _builds_causal_mask_only(args, kwargs)
    layers = [m for m in self.modules() if type(m).forward is _gpt2_attention_forward]
    for layer in layers:
        layer._teeny_mask_is_causal = causal_only
    try:
        return forward(self, *args, **kwargs)
    finally:
        for layer in layers:
            layer._teeny_mask_is_causal = False


def _gpt2_attention_forward(self, hidden_states, *args, **kwargs):
    """c_attn, causal attention over its output read in place, c_proj: one teeny call; any other
    use (a cache, a padding mask, cross-attention, attention dropout) runs transformers' code."""
    if not _plain_causal_self_attention(self, args, kwargs):
        return type(self).__mro__[1].forward(self, hidden_states, *args, **kwargs)
    attn, proj = self.c_attn, self.c_proj
    scale = float(self.scaling)
    out = library.direct.gpt2_attention(hidden_states, attn.weight, attn.bias, proj.weight, proj.bias,
                                        self.num_heads, scale)  # fmt: skip
    return self.resid_dropout(out), None


def _residual_norm(x, residual, weight, bias, eps: float, centred: bool, out_dtype=None):
    """A pre-norm block's junction: s = residual + x (x, a sublayer's output, upcast to the
    stream's dtype first: bf16 under autocast) and the next norm of s, layer_norm (``centred``)
    or rms_norm, written in ``out_dtype``. Lowered, one launch forwards (the norm reads x in its
    own dtype, writes s and y: ``rewrites.fuse_residual_norm``); backwards the norm adds its dx
    to s's gradient as it writes it, and the upcast's backward casts that for x."""
    if x.dtype != residual.dtype:
        x = ops.to(x, residual.dtype)
    s = ops.add(residual, x)
    shape = [residual.shape[-1]]
    if centred:
        return s, ops.layer_norm(s, shape, weight, bias, eps, out_dtype=out_dtype)
    return s, ops.rms_norm(s, shape, weight, eps, out_dtype=out_dtype)


library.register(
    _residual_norm,
    name="residual_norm",
    schema="Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "ScalarType? out_dtype=None",
    multi_output=True,
    autocast="as_given",
)


def _junction(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(residual + x, norm of it) as one teeny call when ``norm`` is a teeny layer or RMS norm
    without hooks over the last dim, and x is no wider a float than the stream; else None."""
    if norm._forward_hooks or norm._forward_pre_hooks or not residual.is_floating_point():
        return None
    if not x.is_floating_point() or x.dtype.itemsize > residual.dtype.itemsize or x.shape != residual.shape:
        return None
    weight = getattr(norm, "weight", None)
    if type(norm) is DROP_INS[nn.LayerNorm]:
        if len(norm.normalized_shape) != 1:
            return None
        eps, centred, bias = norm.eps, True, norm.bias
    elif type(norm).forward is _rms_norm_forward:
        eps, centred, bias = norm.variance_epsilon, False, None
    else:
        return None
    if weight is None or weight.shape != residual.shape[-1:]:
        return None
    out_dtype = TF.autocast_dtype(norm, residual)
    return library.direct.residual_norm(x, residual, weight, bias, float(eps), centred, out_dtype)


def _gpt2_block_forward(
    self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
    use_cache=False, **kwargs,
):  # fmt: skip
    """transformers' GPT2Block.forward, with the attention's residual add and ln_2 as one teeny
    call (``_junction``); with cross-attention, transformers' own. The cache goes by the name
    this transformers version gives it (``_teeny_cache``)."""
    cache = kwargs.pop(self._teeny_cache, cache)
    if encoder_hidden_states is not None:
        return type(self).__mro__[1].forward(self, hidden_states, cache, attention_mask, encoder_hidden_states,
                                             encoder_attention_mask=encoder_attention_mask, use_cache=use_cache,
                                             **kwargs)  # fmt: skip
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, use_cache=use_cache,
                               **{self._teeny_cache: cache}, **kwargs)  # fmt: skip
    joined = _junction(self.ln_2, attn_output, residual)
    if joined is None:  # transformers' own, from the residual add
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states))
    hidden_states, normed = joined
    return hidden_states + self.mlp(normed)


def _decoder_layer_forward(
    self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
    position_embeddings=None, **kwargs,
):  # fmt: skip
    """A Llama-family decoder layer's forward (transformers'), with the attention's residual add
    and post_attention_layernorm as one teeny call (``_junction``) where it can be."""
    cache = kwargs.pop(self._teeny_cache, cache)
    residual = hidden_states
    hidden_states, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
        position_ids=position_ids, use_cache=use_cache, position_embeddings=position_embeddings,
        **{self._teeny_cache: cache}, **kwargs,
    )  # fmt: skip
    joined = _junction(self.post_attention_layernorm, hidden_states, residual)
    if joined is None:
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
    hidden_states, normed = joined
    return hidden_states + self.mlp(normed)


# the block forwards patch replaces: the parameters of transformers' own, and its statements
# (comments and line breaks left out) in order; the replacement computes the same only where
# the original reads exactly so. "{cache}" stands for the cache's name, which transformers
# renamed (``_CACHE_NAMES``)
_BLOCKS = {
    "gpt2_block": (
        _gpt2_block_forward,
        ("self", "hidden_states", "{cache}", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
         "use_cache", "kwargs"),
        ("residual = hidden_states hidden_states = self.ln_1(hidden_states) attn_output, _ = self.attn( "
         "hidden_states, {cache}={cache}, attention_mask=attention_mask, use_cache=use_cache, **kwargs, ) "
         "hidden_states = attn_output + residual if encoder_hidden_states is not None:",
         "residual = hidden_states hidden_states = self.ln_2(hidden_states) feed_forward_hidden_states = "
         "self.mlp(hidden_states) hidden_states = residual + feed_forward_hidden_states return hidden_states"),
    ),
    "decoder_layer": (
        _decoder_layer_forward,
        ("self", "hidden_states", "attention_mask", "position_ids", "{cache}", "use_cache", "position_embeddings",
         "kwargs"),
        ("residual = hidden_states hidden_states = self.input_layernorm(hidden_states) hidden_states, _ = "
         "self.self_attn( hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids, "
         "{cache}={cache}, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs, ) hidden_states = "
         "residual + hidden_states residual = hidden_states hidden_states = self.post_attention_layernorm("
         "hidden_states) hidden_states = self.mlp(hidden_states) hidden_states = residual + hidden_states "
         "return hidden_states",),
    ),
}  # fmt: skip


def _statements(source: str) -> str:
    """``source`` without comments, its whitespace runs one space each."""
    import re

    return " ".join(re.sub(r"#.*", "", source).split())


_CACHE_NAMES = ("cache", "past_key_values")  # transformers >= 5.2x, and before
_BLOCK_LEFT = (
    "its forward reads unlike the transformers forwards teeny knows: its own forward runs (the residual add "
    "and the norm after the attention stay two calls; its layers are swapped)"
)


def _is_block(cls: type) -> bool:
    """A transformers block class of the kind ``_BLOCKS`` may replace the forward of."""
    return cls.__module__.startswith("transformers.") and (
        cls.__name__ == "GPT2Block" or cls.__name__.endswith("DecoderLayer")
    )


def _block_swap(cls: type) -> type | None:
    """The teeny subclass of a transformer block class whose forward is one of ``_BLOCKS``'."""
    import inspect

    try:
        parameters = tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    source = _statements(_source(cls.forward))
    for cache in _CACHE_NAMES:
        for label, (forward, expected, fragments) in _BLOCKS.items():
            if parameters != tuple(p.replace("{cache}", cache) for p in expected):
                continue
            at = 0
            for fragment in fragments:  # each one after the one before
                at = source.find(fragment.replace("{cache}", cache), at)
                if at < 0:
                    break
            else:
                return _teeny_subclass(cls, forward, label, _teeny_cache=cache)
    return None


def _swiglu_mlp_forward(self, x):
    return self.down_proj(TF.swiglu(self.gate_proj(x), self.up_proj(x)))


_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def _teeny_subclass(cls: type, forward, label: str, **attributes) -> type:
    """``cls`` with ``forward`` replaced and ``attributes`` added (made once per class)."""
    key = (cls, label)
    if key not in _SUBCLASSES:
        namespace = {"forward": forward, "__module__": __name__, **attributes}
        _SUBCLASSES[key] = type(f"Teeny{cls.__name__}", (cls,), namespace)
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
        return _teeny_subclass(cls, _rms_norm_forward, "rms_norm", autocast_output=False)
    if name == "Conv1D" and hasattr(module, "nf"):
        return _teeny_subclass(cls, _conv1d_forward, "conv1d")
    if name in _GELU_TANH:
        return _teeny_subclass(cls, _gelu_tanh_forward, "gelu_tanh")
    if all(hasattr(module, a) for a in ("c_fc", "c_proj", "act", "dropout")) and len(list(module.children())) == 4:
        conv1d = all(type(getattr(module, a)).__name__ == "Conv1D" for a in ("c_fc", "c_proj"))
        if conv1d and type(module.act).__name__ in _GELU_TANH:
            return _teeny_subclass(cls, _gpt2_mlp_forward, "gpt2_mlp")
    if name == "GPT2Model" and "create_causal_mask(" in _source(cls.forward):
        return _teeny_subclass(cls, _gpt2_model_forward, "gpt2_model")
    if name == "GPT2Attention" and all(
        type(getattr(module, a, None)).__name__ == "Conv1D" for a in ("c_attn", "c_proj")
    ):
        if hasattr(module, "scaling") and hasattr(module, "is_cross_attention"):
            return _teeny_subclass(cls, _gpt2_attention_forward, "gpt2_attention")
    if _is_block(cls):
        return _block_swap(cls)
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


# pre-norms a transformer block hands straight to a sublayer whose first ops are products:
# norm -> (that sublayer, its products of the norm's output)
_PRE_NORM_READERS = {
    "ln_1": ("attn", ("c_attn",)),  # GPT-2
    "ln_2": ("mlp", ("c_fc",)),
    "input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),  # Llama, Mistral, Qwen2, ...
    "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj")),
}


def _product_read_norms(block: nn.Module) -> list[str]:
    """The names of ``block``'s teeny norms whose output only products read: the block's forward
    reads ``hidden_states = self.<norm>(hidden_states)`` and hands that straight to the sublayer
    of ``_PRE_NORM_READERS``, which has the products (a post-norm whose output joins the
    residual stream, as OLMo-2's does, does not match)."""
    import re

    names = []
    for norm, (reader, products) in _PRE_NORM_READERS.items():
        sublayer = getattr(block, reader, None)
        if not hasattr(getattr(block, norm, None), "autocast_output") or sublayer is None:
            continue
        if not all(hasattr(sublayer, p) for p in products):
            continue
        pattern = (
            rf"hidden_states = self\.{norm}\(hidden_states\)\n(?:\s*#.*\n)*"
            rf"\s*[\w, ]+ = self\.{reader}\(\s*(?:hidden_states=)?hidden_states[,)]"
        )
        cls = type(block)
        if cls.__module__ == __name__:  # a block patch swapped: transformers' forward says what reads what
            cls = cls.__mro__[1]
        if re.search(pattern, _source(cls.forward)):
            names.append(norm)
    return names


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


def patch(model: nn.Module, fused_loss: bool = True) -> PatchReport:
    """Swap the supported submodules of ``model`` for teeny's, fuse a causal LM's head and loss
    (``fused_loss``) and route its functional calls to teeny while it runs (see the module
    docstring); returns what was done."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch(model): model must be a torch.nn.Module, got {type(model).__name__} {model!r:.60}")
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
        elif _is_block(cls):
            report.left.append((path, cls.__name__, _BLOCK_LEFT))
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            report.left.append((path, cls.__name__, "no teeny drop-in (its functional calls are still routed)"))
    for path, block in model.named_modules():  # under autocast, no cast between these norms and their products
        for name in _product_read_norms(block):
            getattr(block, name).autocast_output = True
            report.autocast_norms.append(f"{path}.{name}" if path else name)
    head, report.fused_loss = _causal_lm_head(model) if fused_loss else (None, "")
    if head is not None and not getattr(head, "_teeny_patched", False):
        head.__class__ = _teeny_subclass(type(head), _head_forward, "lm_head")
        head._teeny_hidden_only = False
        head._teeny_patched = True
    if not getattr(model, "_teeny_patched", False):
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with _Router(report):
                if head is not None and _takes_fused_loss(model, kwargs):
                    return _causal_lm_forward(model, head, original, args, kwargs)
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
