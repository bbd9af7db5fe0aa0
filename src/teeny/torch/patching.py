"""``teeny.torch.patch(model)``: run a PyTorch model on teeny's kernel pairs, in place.

    report = teeny.torch.patch(model)      # a Hugging Face GPT-2 or Llama, or your own module
    print(report)                           # what was swapped, what was left to PyTorch and why

What happens, in place and reversible only by rebuilding the model:

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
  left as it is and reported. A transformers block whose forward teeny does not know keeps it
  (reported), and runs it with its functional calls routed (the last point).
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

The patch is part of the model's classes, not of one instance. Each class patch makes is a
subclass of the module's own (``_teeny_class``: the model's own class keeps its name, so
``config.architectures`` stays right; the others are ``Teeny<name>``), whose ``forward`` is one
of this module's functions. So ``copy.deepcopy(model)`` (a reference or EMA model) is patched
as the original and computes with its own weights; ``torch.save(model)`` / ``pickle`` round
trip (the classes pickle as their original class and labels, and are made again on loading);
``state_dict`` loads either way; ``patch`` of a patched model patches what is new in it (an
adapter's layers) and returns the same report.

The model's forward turns the router on, and so does each transformer block's (unless it is on
already): under activation checkpointing (``model.gradient_checkpointing_enable()``, reentrant
or not) a block runs again in the backward, outside the model's forward, and recomputes on the
same kernels as its forward ran.

One-call forwards never bypass what wraps a layer: GPT-2's attention and MLP and the fused head
+ loss read their layers' weights, so a layer that is no longer the one patch made (PEFT's LoRA
puts its own layer in its place) or that has hooks (FSDP's) makes them run the layers' own
calls instead: reported in ``report.left`` when the adapters come first, counted in
``report.fallbacks`` when they come after. ``patch`` of a ``PeftModel`` fuses the head and loss
of the causal LM inside it. Under ``torch.profiler`` every teeny call is a range named after its
op (``teeny op gpt2_attention``, ``... backward``; ``teeny.torch.bridge.call``).
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
    eager calls: under ``torch.compile`` a count would be a guard that fails every call).
    ``fallbacks`` counts, by (name, why), the routed calls PyTorch ran and the one-call forwards
    that ran as their layers' calls (a PEFT adapter on a layer whose weight they read)."""

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
            lines.append(
                "  run by PyTorch, or as separate calls (teeny has no kernel for that call, or a layer changed):"
            )
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
    return self._teeny_bases["lm_head"].forward(self, input)


_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _causal_lm_head(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The LM head whose loss ``patch`` fuses, or None; and what the report says about it."""
    cls = getattr(type(model), "_teeny_origin", type(model))
    if not cls.__module__.startswith("transformers.") or not (
        cls.__name__.endswith("ForCausalLM") or cls.__name__ == "GPT2LMHeadModel"
    ):
        return None, ""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        what = f"{type(head).__module__}.{type(head).__name__}"
        return None, f"left to the model ({cls.__name__}.lm_head is a {what}, not a linear layer: an adapter?)"
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


def _causal_lm_forward(self, *args, **kwargs):
    """A causal LM's forward. In training with ``labels=`` (``_takes_fused_loss``): the model's own
    forward up to the head (which passes its input through), then head and loss as one teeny
    call; the output as the model builds it, with the loss and no logits. The head must still be
    the one patch made, without hooks: a PEFT adapter put on it since, or a hook (FSDP's), runs
    the model's own forward, logits and all (counted in ``report.fallbacks``)."""
    forward = self._teeny_bases["causal_lm"].forward
    if not _takes_fused_loss(self, kwargs):
        return forward(self, *args, **kwargs)
    head = self.lm_head
    why = _not_plain(self, ("lm_head",), _head_forward)
    if why is not None:
        _count_fallback(self, "causal_lm_loss", why)
        return forward(self, *args, **kwargs)
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    head._teeny_hidden_only = True
    try:
        out = forward(self, *args, **kwargs)
    finally:
        head._teeny_hidden_only = False
    hidden = out.logits
    reduction = "mean" if num_items is None else "sum"
    loss = library.direct.causal_lm_loss(hidden, head.weight, head.bias, labels.to(hidden.device), -100, reduction)
    if num_items is not None:
        loss = loss / num_items
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)


def _not_plain(module: nn.Module, names: tuple[str, ...], forward) -> str | None:
    """Why a one-call forward of ``module`` may not read its layers ``names``' weights itself, or
    None: each must still be a layer patch made to run ``forward``, without hooks. A PEFT adapter
    put on one since the patch replaces it by its own layer, and a hook (FSDP's gathers a
    sharded weight) runs only when the layer is called: reading the weight would skip either."""
    for name in names:
        layer = getattr(module, name)
        if type(layer).forward is not forward:
            what = f"{type(layer).__module__}.{type(layer).__name__}"
            return f"{name} is a {what} (an adapter?): the layers' own calls run"
        if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks:
            return f"{name} has hooks: the layers' own calls run"
    return None


def _count_fallback(module: nn.Module, name: str, why: str) -> None:
    """Count in the report that a one-call forward ran as separate calls (eager calls only, as routed calls)."""
    report = getattr(module, "_teeny_report", None)
    if report is not None and not torch.compiler.is_compiling():
        report.fallbacks[(name, why)] += 1


def _gpt2_mlp_forward(self, hidden_states):  # c_fc, act, c_proj, dropout; Conv1D weights are (in, out)
    why = _not_plain(self, ("c_fc", "c_proj"), _conv1d_forward)
    if why is not None:
        _count_fallback(self, "gelu_mlp", why)
        return self._teeny_bases["gpt2_mlp"].forward(self, hidden_states)
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
    forward = self._teeny_bases["gpt2_model"].forward
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
        return self._teeny_bases["gpt2_attention"].forward(self, hidden_states, *args, **kwargs)
    why = _not_plain(self, ("c_attn", "c_proj"), _conv1d_forward)
    if why is not None:
        _count_fallback(self, "gpt2_attention", why)
        return self._teeny_bases["gpt2_attention"].forward(self, hidden_states, *args, **kwargs)
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


def _routes_calls(forward):
    """``forward`` (a block's) run with teeny's router on, unless it is on already: the model's
    forward enters it, but under activation checkpointing a block runs again in the backward,
    outside the model's forward, and must then route the calls it routed the first time (else
    the recomputation is another computation: ``CheckpointError``, or PyTorch's gradients).
    Under torch.compile nothing is recomputed in Python, and the model's forward enters it."""

    @functools.wraps(forward)
    def routed(self, *args, **kwargs):
        if torch.compiler.is_compiling() or _Router.is_on():
            return forward(self, *args, **kwargs)
        with _Router(self._teeny_report):
            return forward(self, *args, **kwargs)

    return routed


@_routes_calls
def _gpt2_block_forward(
    self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
    use_cache=False, **kwargs,
):  # fmt: skip
    """transformers' GPT2Block.forward, with the attention's residual add and ln_2 as one teeny
    call (``_junction``); with cross-attention, transformers' own. The cache goes by the name
    this transformers version gives it (``_teeny_cache``)."""
    cache = kwargs.pop(self._teeny_cache, cache)
    if encoder_hidden_states is not None:
        forward = self._teeny_bases["gpt2_block"].forward
        return forward(self, hidden_states, cache, attention_mask, encoder_hidden_states,
                       encoder_attention_mask=encoder_attention_mask, use_cache=use_cache, **kwargs)  # fmt: skip
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, use_cache=use_cache,
                               **{self._teeny_cache: cache}, **kwargs)  # fmt: skip
    joined = _junction(self.ln_2, attn_output, residual)
    if joined is None:  # transformers' own, from the residual add
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states))
    hidden_states, normed = joined
    return hidden_states + self.mlp(normed)


@_routes_calls
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


@_routes_calls
def _block_forward(self, *args, **kwargs):
    """A transformer block whose forward teeny does not know (``_BLOCK_LEFT``): its own."""
    return self._teeny_bases["block"].forward(self, *args, **kwargs)


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
    "its forward reads unlike the transformers forwards teeny knows: its own forward runs, with teeny's "
    "router on (the residual add and the norm after the attention stay two calls; its layers are swapped)"
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
        for label, (_, expected, fragments) in _BLOCKS.items():
            if parameters != tuple(p.replace("{cache}", cache) for p in expected):
                continue
            at = 0
            for fragment in fragments:  # each one after the one before
                at = source.find(fragment.replace("{cache}", cache), at)
                if at < 0:
                    break
            else:
                return _teeny_class(cls, label)
    return None


def _swiglu_mlp_forward(self, x):
    return self.down_proj(TF.swiglu(self.gate_proj(x), self.up_proj(x)))


_GELU_TANH = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "GELUTanhActivation"}


def _cache_name(cls: type) -> str | None:
    """The name ``cls.forward`` gives its cache argument (``_CACHE_NAMES``), or None."""
    import inspect

    parameters = inspect.signature(cls.forward).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), None)


def _signed(forward, like):
    """``forward``, seen by ``inspect.signature`` as ``like``: a model's own forward keeps its
    parameters' names for the tools that read them (the Trainer keeps the dataset's columns that
    the forward takes)."""

    @functools.wraps(like)
    def signed(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return signed


_CLASSES: dict[tuple[type, str], type] = {}


def _teeny_class(base: type, label: str) -> type:
    """``base`` with the forward of ``_SWAPS[label]``: the class ``patch`` gives a module (made
    once per base and label). Its forward finds its base in ``_teeny_bases[label]`` (a
    patched model's own class may be made on top of another of patch's classes); its instances pickle and
    deep-copy as (the first class that is not patch's, the labels on top of it) and their state
    (``_reduce_patched``), so ``torch.save(model)`` and ``copy.deepcopy(model)`` work and a
    fresh process that unpickles a patched model makes the same classes again."""
    key = (base, label)
    if key not in _CLASSES:
        forward, attributes = _SWAPS[label]
        origin = getattr(base, "_teeny_origin", base)
        namespace = {
            "__module__": __name__,
            "__reduce_ex__": _reduce_patched,
            "forward": _signed(forward, base.forward) if label in _MODEL_LABELS else forward,
            "_teeny_bases": {**getattr(base, "_teeny_bases", {}), label: base},  # its forward calls its base's
            "_teeny_origin": origin,
            "_teeny_labels": getattr(base, "_teeny_labels", ()) + (label,),
            **attributes,
        }
        if label in _BLOCKS:
            namespace["_teeny_cache"] = _cache_name(base)
        name = base.__name__ if label in _MODEL_LABELS else f"Teeny{base.__name__}"
        _CLASSES[key] = type(name, (base,), namespace)
    return _CLASSES[key]


def _reduce_patched(self, protocol):
    """``__reduce_ex__`` of patch's classes: as ``object``'s (their state, by ``__getstate__``),
    with the class made again by ``_new_patched`` from its origin and labels, which pickle by name."""
    new, (cls, *_), *state = object.__reduce_ex__(self, max(protocol, 2))
    if "_teeny_labels" not in cls.__dict__:  # a class made from patch's (FSDP's, say): its own way
        return (new, (cls,), *state)
    return (_new_patched, (cls._teeny_origin, cls._teeny_labels), *state)


def _new_patched(origin: type, labels: tuple[str, ...]) -> nn.Module:
    """An empty instance of the class ``_teeny_class`` makes from ``origin`` and ``labels`` (unpickling fills it)."""
    cls = origin
    for label in labels:
        cls = _teeny_class(cls, label)
    return cls.__new__(cls)


def _hugging_face_swap(module: nn.Module) -> tuple[type | None, str]:
    """The teeny class for a ``transformers`` module, recognised by name and attributes; or
    None, and why a module teeny knows is left as it is ("" for one it does not know)."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None, ""
    name = cls.__name__
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, nn.Parameter):
        if "forward" in cls.__dict__ and "1.0 + self.weight" in _source(cls.forward):
            return None, ""  # Gemma-style (1 + weight) norms compute something else
        return _teeny_class(cls, "rms_norm"), ""
    if name == "Conv1D" and hasattr(module, "nf"):
        return _teeny_class(cls, "conv1d"), ""
    if name in _GELU_TANH:
        return _teeny_class(cls, "gelu_tanh"), ""
    if all(hasattr(module, a) for a in ("c_fc", "c_proj", "act", "dropout")) and len(list(module.children())) == 4:
        if type(module.act).__name__ in _GELU_TANH:
            why = _not_conv1d(module, ("c_fc", "c_proj"))
            return (None, why) if why else (_teeny_class(cls, "gpt2_mlp"), "")
    if name == "GPT2Model" and "create_causal_mask(" in _source(cls.forward):
        return _teeny_class(cls, "gpt2_model"), ""
    if name == "GPT2Attention" and hasattr(module, "scaling") and hasattr(module, "is_cross_attention"):
        why = _not_conv1d(module, ("c_attn", "c_proj"))
        return (None, why) if why else (_teeny_class(cls, "gpt2_attention"), "")
    if _is_block(cls):
        return _block_swap(cls), ""
    if all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        if type(module.act_fn).__name__ in ("SiLU", "SiLUActivation") and len(list(module.children())) == 4:
            return _teeny_class(cls, "swiglu_mlp"), ""
    return None, ""


def _not_conv1d(module: nn.Module, names: tuple[str, ...]) -> str:
    """Why the one-call forward of GPT-2's attention or MLP cannot read its layers ``names``, or
    "": one is no Conv1D (a PEFT adapter wraps it, say), which the call would skip."""
    for name in names:
        layer = getattr(module, name)
        if getattr(type(layer), "_teeny_origin", type(layer)).__name__ != "Conv1D":
            return (
                f"{name} is a {type(layer).__module__}.{type(layer).__name__}, not a Conv1D (an adapter?): "
                "its own forward runs, the layers' calls apart"
            )
    return ""


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
        cls = getattr(type(block), "_teeny_origin", type(block))  # transformers' forward says what reads what
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

    @staticmethod
    def is_on() -> bool:
        """Whether a router is on (in eager mode: the function modes' stack is not traced)."""
        stack = range(torch._C._len_torch_function_stack())
        return any(isinstance(torch._C._get_function_stack_at(i), _Router) for i in stack)

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


def _routed_forward(self, *args, **kwargs):
    """The patched model's forward: its own, with teeny's router on (unless one is on already,
    in eager mode: a model patched inside another; torch.compile traces it entering)."""
    forward = self._teeny_bases["routed"].forward
    if not torch.compiler.is_compiling() and _Router.is_on():
        return forward(self, *args, **kwargs)
    with _Router(self._teeny_report):
        return forward(self, *args, **kwargs)


# label -> (forward, class attributes) of each class patch makes (``_teeny_class``)
_SWAPS = {
    "rms_norm": (_rms_norm_forward, {"autocast_output": False}),
    "conv1d": (_conv1d_forward, {}),
    "gelu_tanh": (_gelu_tanh_forward, {}),
    "gpt2_mlp": (_gpt2_mlp_forward, {}),
    "gpt2_model": (_gpt2_model_forward, {}),
    "gpt2_attention": (_gpt2_attention_forward, {}),
    "swiglu_mlp": (_swiglu_mlp_forward, {}),
    **{label: (forward, {}) for label, (forward, _, _) in _BLOCKS.items()},
    "block": (_block_forward, {}),
    "lm_head": (_head_forward, {"_teeny_hidden_only": False}),
    "causal_lm": (_causal_lm_forward, {}),
    "routed": (_routed_forward, {}),
}
_MODEL_LABELS = ("causal_lm", "routed")  # a model's own class: its name and forward's signature stay


def _labels(module: nn.Module) -> tuple[str, ...]:
    return getattr(type(module), "_teeny_labels", ())


def _causal_lm(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, str]:
    """The causal LM of ``model`` (itself, or the first inside it: a ``PeftModel`` holds one), its
    head whose loss ``patch`` fuses or None, and what the report says about it."""
    for module in model.modules():
        head, why = _causal_lm_head(module)
        if why:
            return module, head, why
    return None, None, ""


def patch(model: nn.Module, fused_loss: bool = True) -> PatchReport:
    """Swap the supported submodules of ``model`` for teeny's, fuse a causal LM's head and loss
    (``fused_loss``) and route its functional calls to teeny while it runs (see the module
    docstring); returns what was done. Patching a patched model again patches what is new in
    it (a PEFT adapter's layers) and returns the same report."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch(model): model must be a torch.nn.Module, got {type(model).__name__} {model!r:.60}")
    report = model.__dict__.get("_teeny_report") if "routed" in _labels(model) else None
    if report is None:
        report = PatchReport(functional=sorted({getattr(f, "__name__", str(f)) for f in TF.ROUTED}))

    def leave(path: str, cls: type, why: str) -> None:
        if (path, cls.__name__, why) not in report.left:
            report.left.append((path, cls.__name__, why))

    for path, module in model.named_modules():
        cls = type(module)
        if _labels(module) or cls in DROP_INS.values():
            continue  # already teeny
        target, why = DROP_INS.get(cls), None
        if target is not None:
            why = _unsupported_option(module)
            target = None if why else target
            why = why and f"teeny has no kernel for {why}"
        else:
            target, why = _hugging_face_swap(module)
        if target is not None:
            module.__class__ = target
            report.swapped.append((path, cls.__name__, target.__name__))
        elif why:
            leave(path, cls, why)
        elif _is_block(cls):  # its own forward, under the router (``_routes_calls``)
            module.__class__ = _teeny_class(cls, "block")
            leave(path, cls, _BLOCK_LEFT)
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            leave(path, cls, "no teeny drop-in (its functional calls are still routed)")
    for path, block in model.named_modules():  # under autocast, no cast between these norms and their products
        for name in _product_read_norms(block):
            getattr(block, name).autocast_output = True
            if (norm := f"{path}.{name}" if path else name) not in report.autocast_norms:
                report.autocast_norms.append(norm)
    lm, head, report.fused_loss = _causal_lm(model) if fused_loss else (None, None, "")
    if head is not None:
        if "lm_head" not in _labels(head):
            head.__class__ = _teeny_class(type(head), "lm_head")
        if "causal_lm" not in _labels(lm):
            lm.__class__ = _teeny_class(type(lm), "causal_lm")
    if "routed" not in _labels(model):
        model.__class__ = _teeny_class(type(model), "routed")
    for module in model.modules():  # where the router and the one-call forwards count
        if _labels(module):
            module._teeny_report = report
    return report
