"""``teeny.torch.patch(model)``: run a PyTorch model on teeny's kernel pairs, in place.

    report = teeny.torch.patch(model)      # a Hugging Face causal LM, or your own module
    print(report)                           # what was swapped, what was left to PyTorch and why
    report.coverage()                       # per part (norms, attention, rotary, MLP, block, head + loss)

What happens, in place and reversible only by rebuilding the model:

* **Submodules** whose class teeny has a drop-in for change class (``module.__class__``) to it:
  every ``torch.nn`` layer of ``teeny.torch.nn.DROP_INS``, and the layers of ``transformers``
  models, recognised by their structure (class name, children, attributes: ``transformers``
  stays optional) rather than the text of their forward, so a reformatted forward in a new
  release keeps its speed: RMS norms, Gemma's (1 + w) ones included (``layers``), GPT-2's
  ``Conv1D``, tanh-GELU activations, MLP and attention (``gpt2``), gated MLPs as one SwiGLU or
  GeGLU pair and mixture-of-experts experts one teeny call per expert (``layers``), decoder
  blocks with the residual add and the norm after it as one call (``blocks``), the rotary
  embedding (``rotary``) and the LM head with its loss (``head``). Parameters, buffers and hooks
  stay the very same objects, so tied weights stay tied, an optimizer built before the patch
  keeps working, and ``state_dict`` keys do not change. A layer with an option teeny has no
  kernel for (``padding_mode="reflect"``, ``max_norm``) is left as it is and reported.
* **Pre-norms under autocast**: the norms a block hands straight to products (GPT-2's ``ln_1``,
  Llama-family ``input_layernorm``, ...) get ``autocast_output``: under autocast they write
  autocast's dtype, to which those products cast their input first anyway (the same numbers, no
  cast launch after the norm, none before its backward); ``report.autocast_norms`` lists them.
* **The head and its loss**: in training with ``labels=``, one chunked teeny op (``head``);
  ``patch(model, fused_loss=False)`` keeps the logits always.
* **Functional calls** the model's own code makes (``F.scaled_dot_product_attention`` in the
  attention, ``F.cross_entropy`` in the loss, ``F.gelu``, ``torch.softmax``, ...; the list is
  ``teeny.torch.nn.functional.ROUTED``) are routed to teeny while the model's ``forward`` runs
  (``router``). A call with arguments teeny cannot run (attention dropout, a ``dtype=``
  softmax) goes to PyTorch and is counted in ``report.fallbacks``.

The patch is part of the model's classes, not of one instance (``classes``): ``copy.deepcopy``
(a reference or EMA model) is patched as the original and computes with its own weights;
``torch.save(model)`` / ``pickle`` round trip; ``state_dict`` loads either way; ``patch`` of a
patched model patches what is new in it (an adapter's layers) and returns the same report.

The model's forward turns the router on, and so does each transformer block's (unless it is on
already): under activation checkpointing (reentrant or not) a block runs again in the backward,
outside the model's forward, and recomputes on the same kernels as its forward ran. A
``transformers`` attention layer whose config says ``"sdpa"`` is switched to
``attn_implementation="teeny"`` (``attention``: transformers' own SDPA function, its call
routed to teeny's kernels), and a block whose attention is served so runs with the router off:
its other torch calls skip the router's handler.

One-call forwards never bypass what wraps a layer: GPT-2's attention and MLP read their layers'
weights, so a layer that is no longer the one patch made (PEFT's LoRA puts its own layer in its
place) or that has hooks (FSDP's) makes them run the layers' own calls instead: reported in
``report.left`` when the adapters come first, counted in ``report.fallbacks`` when they come
after. Llama-family layers call their projections, so adapters there run as PEFT wrote them.
Under ``torch.profiler`` every teeny call is a range named after its op (``teeny op
gpt2_attention``, ``... backward``; ``teeny.torch.bridge.call``).
"""

from __future__ import annotations

from torch import nn

from ..nn import DROP_INS
from ..nn import functional as TF
from . import attention, blocks, gpt2, head, layers, rotary
from .classes import (
    _new_patched,  # noqa: F401  (pickles of patched models name it here)
    from_transformers,
    labels,
    source,
    teeny_class,
)
from .report import PatchReport
from .router import Router  # noqa: F401  (registers the "routed" label)

__all__ = ["PatchReport", "patch"]


def _hugging_face_swap(module: nn.Module, report: PatchReport) -> tuple[type | None, str]:
    """The teeny class for a ``transformers`` module, recognised by structure, noting in the
    report's coverage what runs it; or None, and why a module teeny knows is left as it is ("" for
    one it does not know)."""
    cls = type(module)
    if not from_transformers(cls):
        return None, ""
    name = cls.__name__
    if layers.is_rms_norm(module):
        offset = layers.norm_weight_offset(module)
        if offset is None:
            report.note("norms", "PyTorch: computes another norm")
            return None, "an RMS norm that computes neither x̂ w nor x̂ (1 + w)"
        report.note("norms", "teeny")
        return teeny_class(cls, "rms_norm" if offset == 0 else "offset_rms_norm"), ""
    if name == "Conv1D" and hasattr(module, "nf"):
        return teeny_class(cls, "conv1d"), ""
    if name in layers.GELU_TANH:
        return teeny_class(cls, "gelu_tanh"), ""
    children = {child for child, _ in module.named_children()}
    if children == {"c_fc", "c_proj", "act", "dropout"} and type(module.act).__name__ in layers.GELU_TANH:
        why = _not_conv1d(module, ("c_fc", "c_proj"))
        report.note("mlp", f"PyTorch: {why.split(':')[0]}" if why else "teeny: one call")
        return (None, why) if why else (teeny_class(cls, "gpt2_mlp"), "")
    if name == "GPT2Model" and "create_causal_mask(" in source(cls.forward):
        return teeny_class(cls, "gpt2_model"), ""
    if name == "GPT2Attention" and hasattr(module, "scaling") and hasattr(module, "is_cross_attention"):
        why = _not_conv1d(module, ("c_attn", "c_proj"))
        report.note("attention", f"PyTorch: {why.split(':')[0]}" if why else "teeny: one call")
        return (None, why) if why else (teeny_class(cls, "gpt2_attention"), "")
    if name.endswith("Attention"):
        _note_attention(module, report)
        return None, ""
    if blocks.is_block(cls):
        target = gpt2.gpt2_block_swap(module) if name == "GPT2Block" else None
        if target is not None:
            report.note("block", "teeny: residual add + norm one call")
            return target, ""
        label, status = blocks.block_kind(module)
        report.note("block", status or _BLOCK_UNKNOWN)
        return teeny_class(cls, label), ""
    label, status = layers.experts_kind(module)
    if not status:
        label, status = layers.gated_mlp_kind(module)
    if status:
        report.note("mlp", status)
        return (teeny_class(cls, label), "") if label else (None, status)
    if name.endswith("MLP"):  # a plain MLP (StarCoder2's): its layers are swapped one by one, or not
        layers_only = all(_has_drop_in(child) for child in module.children())
        report.note("mlp", "teeny: its layers one by one" if layers_only else "PyTorch: its own code")
    return None, ""


def _has_drop_in(module: nn.Module) -> bool:
    """Whether patch gives ``module`` a teeny class of its own (a torch layer or an activation)."""
    cls = type(module)
    return cls in DROP_INS or cls.__name__ in layers.GELU_TANH or (cls.__name__ == "Conv1D" and hasattr(module, "nf"))


def _note_attention(module: nn.Module, report: PatchReport) -> None:
    """Note what runs an attention layer teeny leaves as it is: its product layers are swapped,
    its SDPA attention teeny's through transformers' interface (``attention``) or not, its rotary
    embedding teeny's or not (``rotary``)."""
    if attention.serve(module, report):
        report.note("attention", "teeny: attn_implementation teeny")
    else:
        report.note("attention", f"PyTorch: {attention.implementation(module) or 'its own'} attention")
    modeling, status = rotary.rotary_of(type(module))
    if status:
        report.note("rotary", status)


_BLOCK_UNKNOWN = "PyTorch: a layout teeny does not know (its own forward)"
_BLOCK_LEFT = (
    "a block layout teeny does not know: its own forward runs, with teeny's router on unless its attention is "
    "teeny's through transformers' interface (the residual add and the norm after the attention stay two calls; "
    "its layers are swapped)"
)


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


_ADAPTER_LEFT = (
    "a PEFT adapter: PEFT runs it and its layers, its functional calls unrouted (its small products and "
    "its base layer's cost less as PyTorch's calls than as teeny calls); the layers around it stay teeny's"
)


def _adapter_layers(model: nn.Module) -> set[str]:
    """The paths of the PEFT adapter layers in ``model`` (LoRA's and the other tuners': a
    ``base_layer`` and the adapters' own modules) that patch leaves to PEFT, with everything in
    them: an adapter adds small products (rank r) beside its base layer's, and in eager mode each
    teeny call costs host time that such products do not repay. The LM head's adapter is the
    exception: it is fused into the head + loss (``head``)."""
    heads = {id(getattr(m, "lm_head", None)) for m in model.modules()}
    return {
        path
        for path, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", None), nn.Module) and hasattr(m, "active_adapters")
        and id(m) not in heads
    }  # fmt: skip


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())


def patch(model: nn.Module, fused_loss: bool = True) -> PatchReport:
    """Swap the supported submodules of ``model`` for teeny's, fuse a causal LM's head and loss
    (``fused_loss``) and route its functional calls to teeny while it runs (see the module
    docstring); returns what was done. Patching a patched model again, or a model holding one
    (a ``PeftModel``), patches what is new in it (an adapter's layers) and returns the same report."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch(model): model must be a torch.nn.Module, got {type(model).__name__} {model!r:.60}")
    patched = (m for m in model.modules() if "routed" in labels(m))  # itself, or a model inside it (PEFT's)
    report = next((m.__dict__["_teeny_report"] for m in patched if "_teeny_report" in m.__dict__), None)
    if report is None:
        report = PatchReport(functional=sorted({getattr(f, "__name__", str(f)) for f in TF.ROUTED}))
    report.parts.clear()  # what runs each part, as the model now is

    def leave(path: str, cls: type, why: str) -> None:
        if (path, cls.__name__, why) not in report.left:
            report.left.append((path, cls.__name__, why))

    adapters = _adapter_layers(model)
    for path, module in model.named_modules():
        cls = type(module)
        if labels(module) or cls in DROP_INS.values():
            _note_patched(module, report)
            continue  # already teeny
        if any(path.startswith(f"{adapter}.") for adapter in adapters):
            continue  # a PEFT adapter's own layers: PEFT runs them (``_adapter_layers``)
        if path in adapters:
            module.__class__ = teeny_class(cls, "unrouted")
            leave(path, cls, _ADAPTER_LEFT)
            continue
        target, why = DROP_INS.get(cls), None
        if target is not None:
            why = layers.unsupported_option(module)
            target = None if why else target
            why = why and f"teeny has no kernel for {why}"
            if _is_norm(module):
                report.note("norms", "teeny" if target else "PyTorch: an option teeny lacks")
        else:
            target, why = _hugging_face_swap(module, report)
            if target is None and not why and _is_norm(module) and from_transformers(cls):
                report.note("norms", "PyTorch: no teeny drop-in")
        if target is not None:
            module.__class__ = target
            report.swapped.append((path, cls.__name__, target.__name__))
        elif why:
            leave(path, cls, why)
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            leave(path, cls, "no teeny drop-in (its functional calls are still routed)")
        if "block" in labels(module) and blocks.layout(module) is None:
            leave(path, cls, _BLOCK_LEFT)
    for path, block in model.named_modules():  # under autocast, no cast between these norms and their products
        for name in blocks.product_read_norms(block):
            getattr(block, name).autocast_output = True
            if (norm := f"{path}.{name}" if path else name) not in report.autocast_norms:
                report.autocast_norms.append(norm)
    report.fused_loss = head.fuse_head(model) if fused_loss else ""
    if report.fused_loss:
        fused = report.fused_loss.startswith("one chunked")
        why = report.fused_loss.removeprefix("left to the model (").removesuffix(")")
        capped = ", soft cap fused" if "soft cap" in report.fused_loss else ""
        report.note("head + loss", f"teeny: one chunked op{capped}" if fused else f"PyTorch: {why}")
    if "routed" not in labels(model):
        model.__class__ = teeny_class(type(model), "routed")
    for module in model.modules():  # where the router and the one-call forwards count
        if labels(module):
            module._teeny_report = report
    return report


# what the coverage says of a module patch swapped before (a model patched again)
_PATCHED_PARTS = {
    "rms_norm": ("norms", "teeny"), "offset_rms_norm": ("norms", "teeny"),
    "experts": ("mlp", "teeny: experts"),
    "gpt2_mlp": ("mlp", "teeny: one call"), "gpt2_attention": ("attention", "teeny: one call"),
    "pre_norm_block": ("block", "teeny: residual add + norm one call"),
    "sandwich_block": ("block", "teeny: residual add + norm one call"),
    "gpt2_block": ("block", "teeny: residual add + norm one call"),
}  # fmt: skip


def _note_patched(module: nn.Module, report: PatchReport) -> None:
    """Note in the coverage a module patch swapped before (patching a patched model again)."""
    for label in labels(module):
        if label in _PATCHED_PARTS:
            report.note(*_PATCHED_PARTS[label])
        elif label in ("gated_mlp", "gate_up_mlp"):
            report.note("mlp", layers.gated_mlp_kind(module)[1])
        elif label == "block":
            report.note("block", blocks.block_kind(module)[1] or _BLOCK_UNKNOWN)
    if type(module) in DROP_INS.values() and _is_norm(module):
        report.note("norms", "teeny")
