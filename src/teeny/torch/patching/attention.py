"""Attention through transformers' own ``AttentionInterface``: ``attn_implementation="teeny"``.

A transformers attention layer calls the attention function its config names
(``config._attn_implementation``) from ``AttentionInterface``, and the model builds its masks by
the same name from ``AttentionMaskInterface``. ``patch`` registers ``"teeny"`` in both and
switches a layer whose config says ``"sdpa"`` to it:

* the attention function is transformers' own SDPA function, unchanged (its masks, GQA, causal
  and cache logic, as the installed release has them), run with teeny's router on, so that its
  ``F.scaled_dot_product_attention`` call is teeny's kernel pair; a call teeny cannot take
  (dropout, a soft cap) goes to PyTorch's and is counted in ``report.fallbacks``;
* the masks are SDPA's.

The router is then on only inside the attention function: a block whose attention is served here
runs without it (``routes_calls``), so its other torch calls (views, PEFT's adapters,
the residual adds) skip the router's Python handler, and activation checkpointing recomputes
through the same function as the forward ran. ``config._attn_implementation`` is not written
by ``save_pretrained``; an unpickled model's classes import teeny, which registers the name
again. A config set to another implementation (``"eager"``) is left to it, under the router.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .classes import UNPICKLING
from .report import PatchReport
from .router import Router, block_running, unrouted

NAME = "teeny"


def _attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention with its ``scaled_dot_product_attention`` call routed to teeny."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if Router.is_on():  # a model patched inside another, or a block that kept the router
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    report = getattr(module, "_teeny_report", None) or PatchReport()
    with Router(report):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def _register() -> None:
    """``"teeny"`` in transformers' attention and mask interfaces (once; transformers is imported by then)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is not _attention:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def implementation(attention: nn.Module | None) -> str | None:
    """The attention implementation a transformers attention layer's config names (None: none)."""
    config = getattr(attention, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def serve(attention: nn.Module, report: PatchReport) -> bool:
    """Switch a transformers attention layer whose config names ``"sdpa"`` to teeny's function
    (``"teeny"`` already: a patched model's copy); whether teeny's function serves it now."""
    current = implementation(attention)
    if current not in ("sdpa", NAME):
        return False
    _register()
    if current == "sdpa":
        attention.config._attn_implementation = NAME
    attention._teeny_report = report
    return True


def served(block: nn.Module) -> bool:
    """Whether a block's attention (``self_attn``) runs through teeny's attention function."""
    return implementation(getattr(block, "self_attn", None)) == NAME


def routes_calls(forward):
    """``forward`` (a block's) run with teeny's router on, unless it is on already: the model's
    forward enters it, but under activation checkpointing a block runs again in the backward,
    outside the model's forward, and must then route the calls it routed the first time (else
    the recomputation is another computation: ``CheckpointError``, or PyTorch's gradients).
    A block whose attention teeny serves through transformers' interface (``attention.served``)
    runs with the router off instead, forward and recomputation alike. Under torch.compile
    nothing is recomputed in Python, and the model's forward enters the router."""

    @functools.wraps(forward)
    def routed(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        if served(self):
            with block_running(self._teeny_report), unrouted():
                return forward(self, *args, **kwargs)
        if Router.is_on():
            return forward(self, *args, **kwargs)
        with Router(self._teeny_report):
            return forward(self, *args, **kwargs)

    return routed


def register_if_loaded() -> None:
    """Register ``"teeny"`` when transformers is loaded (never imports it): a model unpickled in
    a fresh process (``classes._new_patched``) may have configs naming it."""
    if "transformers.modeling_utils" in sys.modules and "transformers.masking_utils" in sys.modules:
        _register()


register_if_loaded()
UNPICKLING.append(register_if_loaded)
