"""GPT-2 (transformers' ``GPT2Model``): its MLP and its attention as one teeny call each, and its
block with the attention's residual add and ``ln_2`` as one call.

* MLP (``c_fc``, a tanh-GELU ``act``, ``c_proj``): one teeny call of three nodes, so one autograd
  node and one replay, not three.
* Attention (``c_attn``, causal attention reading the heads' q, k, v in place from its output,
  ``c_proj``): one teeny call, no head-split copies. A cache, a padding mask, cross-attention or
  attention dropout runs transformers' own code. Under torch.compile the ``GPT2Model`` around the
  layers, swapped too, tells them when the mask it builds is the causal one.
"""

from __future__ import annotations

import torch

from ... import ops
from .. import library
from ..nn import functional as TF
from .attention import routes_calls
from .blocks import attention_arguments, junction, signature_of
from .classes import base_forward, count_fallback, not_plain, swap, teeny_class
from .layers import conv1d_forward, conv1d_linear


def _gelu_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias):
    """GPT-2's MLP as one teeny call: Conv1D, tanh-GELU, Conv1D (weights (in, out), read in place)."""
    hidden = ops.gelu(conv1d_linear(x, fc_weight, fc_bias), "tanh")
    return conv1d_linear(hidden, proj_weight, proj_bias)


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
    qkv = conv1d_linear(x, attn_weight, attn_bias)
    heads_out = TF._packed_attention(qkv, heads, True, scale)  # (batch, length, heads, dim)
    return conv1d_linear(ops.reshape(heads_out, tuple(x.shape[:-1]) + (proj_weight.shape[0],)), proj_weight, proj_bias)


library.register(
    _gpt2_attention,
    name="gpt2_attention",
    schema="Tensor x, Tensor attn_weight, Tensor? attn_bias, Tensor proj_weight, Tensor? proj_bias, int heads, "
    "float? scale=None",
    autocast="product",
)


@swap("gpt2_mlp")
def _gpt2_mlp_forward(self, hidden_states):  # c_fc, act, c_proj, dropout; Conv1D weights are (in, out)
    why = not_plain(self, ("c_fc", "c_proj"), conv1d_forward)
    if why is not None:
        count_fallback(self, "gelu_mlp", why)
        return base_forward(self, "gpt2_mlp")(self, hidden_states)
    fc, proj = self.c_fc, self.c_proj
    return self.dropout(library.direct.gelu_mlp(hidden_states, fc.weight, fc.bias, proj.weight, proj.bias))


# GPT2Attention.forward's arguments that must be None for plain causal self-attention, and
# those that then change nothing
_ABSENT_IN_SELF_ATTENTION = ("cache", "past_key_values", "layer_past", "attention_mask", "head_mask",
                             "encoder_hidden_states", "encoder_attention_mask")  # fmt: skip
_IGNORED_IN_SELF_ATTENTION = {"use_cache", "cache_position", "position_ids", "output_attentions", "is_causal"}


def _plain_causal_self_attention(module, args: tuple, kwargs: dict) -> bool:
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


@swap("gpt2_model")
def _gpt2_model_forward(self, *args, **kwargs):
    """GPT2Model's forward; under torch.compile it first marks its one-call attention layers
    with whether the mask it is about to build is its causal one alone (``_builds_causal_mask_only``)."""
    forward = base_forward(self, "gpt2_model")
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


@swap("gpt2_attention")
def _gpt2_attention_forward(self, hidden_states, *args, **kwargs):
    """c_attn, causal attention over its output read in place, c_proj: one teeny call; any other
    use (a cache, a padding mask, cross-attention, attention dropout) runs transformers' code."""
    if not _plain_causal_self_attention(self, args, kwargs):
        return base_forward(self, "gpt2_attention")(self, hidden_states, *args, **kwargs)
    why = not_plain(self, ("c_attn", "c_proj"), conv1d_forward)
    if why is not None:
        count_fallback(self, "gpt2_attention", why)
        return base_forward(self, "gpt2_attention")(self, hidden_states, *args, **kwargs)
    attn, proj = self.c_attn, self.c_proj
    scale = float(self.scaling)
    out = library.direct.gpt2_attention(hidden_states, attn.weight, attn.bias, proj.weight, proj.bias,
                                        self.num_heads, scale)  # fmt: skip
    return self.resid_dropout(out), None


@swap("gpt2_block", per_class=signature_of)
@routes_calls
def _gpt2_block_forward(self, hidden_states, *args, **kwargs):
    """GPT2Block's forward, with the attention's residual add and ln_2 as one teeny call
    (``junction``); with cross-attention, transformers' own. The arguments go to the attention by
    the names the block's own forward gives them (the cache's was renamed between versions)."""
    arguments = attention_arguments(self, args, kwargs)
    if arguments.pop("encoder_hidden_states", None) is not None:
        return base_forward(self, "gpt2_block")(self, hidden_states, *args, **kwargs)
    arguments.pop("encoder_attention_mask", None)
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), **arguments)
    joined = junction(self.ln_2, attn_output, residual)
    if joined is None:  # transformers' own, from the residual add
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states))
    hidden_states, normed = joined
    return hidden_states + self.mlp(normed)


_GPT2_BLOCK = {"ln_1", "attn", "ln_2", "mlp"}  # and, with cross-attention, these two:
_GPT2_CROSS = {"crossattention", "ln_cross_attn"}


def gpt2_block_swap(block) -> type | None:
    """The teeny class of a GPT-2 block (``GPT2Block`` with its children), or None."""
    children = {name for name, _ in block.named_children()}
    if type(block).__name__ != "GPT2Block" or not _GPT2_BLOCK <= children <= _GPT2_BLOCK | _GPT2_CROSS:
        return None
    return teeny_class(type(block), "gpt2_block")
