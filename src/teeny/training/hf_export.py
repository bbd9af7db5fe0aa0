"""Write a native teeny GPT (``teeny train gpt``) as a Hugging Face ``transformers`` model
directory: ``config.json`` and ``model.safetensors`` that ``AutoModelForCausalLM.from_pretrained``
loads as a ``GPT2LMHeadModel`` giving the same logits. Plain JSON and safetensors: transformers is
not imported here.

teeny's GPT is GPT-2's architecture: learned token and position embeddings, pre-norm blocks
(LayerNorm with bias, eps 1e-5; causal attention scaled by 1/sqrt(head_dim); a 4x MLP with
tanh-approximated GELU), a final LayerNorm and an untied head. The names and layouts map as

    tok.weight                      -> transformer.wte.weight
    pos                             -> transformer.wpe.weight            (n_positions = block_size)
    blocks.i.ln1, ln2               -> transformer.h.i.ln_1, ln_2
    blocks.i.attn.{q,k,v}_proj      -> transformer.h.i.attn.c_attn        [W_q; W_k; W_v]^T, [b_q; b_k; b_v]
    blocks.i.attn.out_proj          -> transformer.h.i.attn.c_proj        W^T
    blocks.i.fc, proj               -> transformer.h.i.mlp.c_fc, c_proj   W^T
    ln                              -> transformer.ln_f
    head.weight                     -> lm_head.weight                     (tie_word_embeddings false)

(GPT-2's ``Conv1D`` stores its weight as (in, out), the transpose of a Linear's.)

One difference changes numbers: teeny's head has a bias and GPT-2's ``lm_head`` has none (nor has
any transformers causal LM with GPT-2's blocks). It is folded into the final LayerNorm's bias and
a rank-one change of the head, exactly in real arithmetic. With x̂ the normalised row (its entries
sum to 0), teeny computes W (γ⊙x̂ + β) + b. For g = 1/γ (elementwise), (W + a gᵀ)(γ⊙x̂) = W(γ⊙x̂)
+ a Σx̂ = W(γ⊙x̂), so the head may gain any a gᵀ; choosing β' = β + κγ with κ = 1 - gᵀβ/d (so that
s = gᵀβ' = d) and a = (b - κWγ)/s gives (W + a gᵀ) β' = Wβ + b. The exported ``ln_f.bias`` and
``lm_head.weight`` therefore differ from teeny's ``ln.bias`` and ``head.weight`` (computed in float64,
then rounded once); the logits agree to float32 rounding. A LayerNorm weight with an entry near 0
(|γ_i| < 1e-6 max|γ|) makes the fold inexact and is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TeenyError

ARCHITECTURE = "GPT2LMHeadModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExportError(TeenyError):
    """The export cannot be written as asked: not a GPT, parameters that do not fit its spec, or a
    target folder that is not empty (exit code 2: bad input)."""

    exit_code = 2


@dataclass(frozen=True)
class GPTShape:
    """What defines a teeny GPT besides its parameters' values."""

    vocab_size: int
    block_size: int
    d_model: int
    n_heads: int
    n_layers: int


def export_hf(
    source: str | os.PathLike | Any | dict[str, torch.Tensor],
    directory: str | os.PathLike,
    *,
    spec: dict | None = None,
    dtype: torch.dtype | None = None,
    force: bool = False,
) -> Path:
    """Write the GPT ``source`` (a ``teeny train gpt`` checkpoint path, an ``Executor`` or a dict of
    parameters) into ``directory`` as ``config.json`` + ``model.safetensors`` of a transformers
    ``GPT2LMHeadModel`` (see the module docstring for the mapping) and return the folder. ``spec``
    says what the parameters do not: ``{"size": "small"}`` (a ``teeny train --size``) or
    ``{"n_heads": N}``; a checkpoint's own is used when it is None. ``dtype`` (default: the
    parameters') is the stored one. A ``directory`` that exists and is not empty is refused unless
    ``force``. Raises ``ExportError`` (or ``CheckpointError``) naming what does not fit."""
    params, found_spec = _read_source(source)
    spec = dict(found_spec if spec is None else spec)
    shape = gpt_shape(params, spec)
    dtype = dtype or params["tok.weight"].dtype
    if dtype not in _DTYPES:
        raise ExportError(f"cannot store a transformers model in {dtype}; choose one of {', '.join(_DTYPES.values())}")
    out = _target(Path(directory), force)
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(params, shape).items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(hf_config(shape, dtype), indent=2) + "\n")
    return out


def _read_source(source) -> tuple[dict[str, torch.Tensor], dict]:
    """(parameters on the CPU, the spec the source carries: a checkpoint's ``model_spec``, else {})."""
    if isinstance(source, (str, os.PathLike)):
        from .loop import load_checkpoint

        params, _, meta = load_checkpoint(source)
        model = meta.get("model")
        if model != "gpt":
            raise ExportError(f"checkpoint {source} is of model {model!r}; only the native gpt can be exported")
        try:
            spec = json.loads(meta.get("model_spec", "{}"))
        except json.JSONDecodeError:
            spec = None
        if not isinstance(spec, dict):
            raise ExportError(f"checkpoint {source}: metadata field 'model_spec' is not a JSON object")
        return params, spec
    params = getattr(source, "params", source)  # an Executor holds its parameters in .params
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise ExportError(f"expected a checkpoint path, an Executor or a dict of tensors, got {type(source).__name__}")
    return {k: v.detach().cpu() for k, v in params.items()}, {}


def _target(directory: Path, force: bool) -> Path:
    if directory.exists() and not directory.is_dir():
        raise ExportError(f"{directory} is a file, not a folder")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise ExportError(f"{directory} exists and is not empty (--force / force=True writes into it)")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def gpt_shape(params: dict[str, torch.Tensor], spec: dict) -> GPTShape:
    """The GPT that ``params`` belong to, with ``spec`` (``size`` or ``n_heads``) for its heads;
    every parameter's name and shape is checked against a GPT of that shape."""
    from .models import GPT_SIZES

    if "tok.weight" not in params or "pos" not in params:
        raise ExportError("these are not a teeny GPT's parameters (no tok.weight and pos)")
    (vocab_size, d_model), block_size = params["tok.weight"].shape, params["pos"].shape[0]
    n_layers = len({k.split(".")[1] for k in params if k.startswith("blocks.")})
    shape = dict(vocab_size=vocab_size, block_size=block_size, d_model=d_model, n_layers=n_layers)
    if "n_heads" in spec:
        n_heads = spec["n_heads"]
    elif spec.get("size") in GPT_SIZES:
        sized = GPT_SIZES[spec["size"]]
        differs = [f"{k} {v} (size {spec['size']}: {sized[k]})" for k, v in shape.items() if v != sized.get(k, v)]
        if differs:
            raise ExportError(f"the parameters are not of a gpt of size {spec['size']!r}: " + ", ".join(differs))
        n_heads = sized["n_heads"]
    else:
        raise ExportError(f"spec {spec} names no gpt size ({', '.join(GPT_SIZES)}) and no n_heads")
    if not isinstance(n_heads, int) or n_heads <= 0 or d_model % n_heads:
        raise ExportError(f"n_heads {n_heads!r} does not divide d_model {d_model}")
    shape = GPTShape(n_heads=n_heads, **shape)
    expected = {name: tuple(p.shape) for name, p in _model(shape).named_parameters()}
    missing, unexpected = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise ExportError(f"the parameters do not fit a GPT {shape}: {what}")
    for name, want in expected.items():
        if tuple(params[name].shape) != want:
            raise ExportError(f"parameter {name} has shape {tuple(params[name].shape)}, a GPT {shape} has {want}")
    return shape


def _model(shape: GPTShape):
    from .models import GPT

    return GPT(shape.vocab_size, shape.block_size, shape.d_model, shape.n_heads, shape.n_layers)


def hf_state_dict(params: dict[str, torch.Tensor], shape: GPTShape) -> dict[str, torch.Tensor]:
    """``params`` under GPT2LMHeadModel's names and layouts, the head bias folded (module docstring)."""
    out = {"transformer.wte.weight": params["tok.weight"], "transformer.wpe.weight": params["pos"]}
    for i in range(shape.n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [f"{src}attn.{p}_proj" for p in "qkv"]
        out[f"{dst}attn.c_attn.weight"] = torch.cat([params[f"{p}.weight"] for p in qkv]).T
        out[f"{dst}attn.c_attn.bias"] = torch.cat([params[f"{p}.bias"] for p in qkv])
        for teeny_name, hf_name in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{dst}{hf_name}.weight"] = params[f"{src}{teeny_name}.weight"]
            out[f"{dst}{hf_name}.bias"] = params[f"{src}{teeny_name}.bias"]
        for teeny_name, hf_name in (("attn.out_proj", "attn.c_proj"), ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj")):
            out[f"{dst}{hf_name}.weight"] = params[f"{src}{teeny_name}.weight"].T
            out[f"{dst}{hf_name}.bias"] = params[f"{src}{teeny_name}.bias"]
    head, ln_bias = fold_head_bias(params["head.weight"], params["head.bias"], params["ln.weight"], params["ln.bias"])
    out.update({"transformer.ln_f.weight": params["ln.weight"], "transformer.ln_f.bias": ln_bias})
    out["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in out.items()}


def fold_head_bias(
    weight: torch.Tensor, bias: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head weight W', final LayerNorm bias β') with W'(γ⊙x̂ + β') = W(γ⊙x̂ + β) + b for every
    normalised row x̂ (module docstring); unchanged when the bias is zero."""
    if not bias.any():
        return weight, ln_bias
    w, b, gamma, beta = (t.detach().double() for t in (weight, bias, ln_weight, ln_bias))
    if bool((gamma.abs() < 1e-6 * gamma.abs().max()).any()):
        raise ExportError(
            "the final LayerNorm's weight has an entry near 0, so the head bias cannot be folded exactly into "
            "GPT-2's bias-free lm_head"
        )
    g = 1 / gamma
    kappa = 1 - (g @ beta) / gamma.numel()
    folded_beta = beta + kappa * gamma
    a = (b - kappa * (w @ gamma)) / (g @ folded_beta)
    return (w + torch.outer(a, g)).to(weight.dtype), folded_beta.to(ln_bias.dtype)


def hf_config(shape: GPTShape, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a GPT2LMHeadModel of ``shape`` computing what teeny's GPT does."""
    model = _model(shape)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": shape.vocab_size,
        "n_positions": shape.block_size,
        "n_embd": shape.d_model,
        "n_layer": shape.n_layers,
        "n_head": shape.n_heads,
        "n_inner": model.blocks[0].fc.out_features,
        "activation_function": "gelu_pytorch_tanh",  # teeny's Block: ops.gelu(approximate="tanh")
        "layer_norm_epsilon": model.ln.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,  # scaled_dot_product_attention's 1/sqrt(head_dim)
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": _DTYPES[dtype],
    }
