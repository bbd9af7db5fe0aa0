"""Rotary embeddings: transformers' attention layers rotate q and k by calling their modeling
module's function ``apply_rotary_pos_emb(q, k, cos, sin)``. ``patch`` puts a dispatcher in that
function's place: while a patched model runs (``router.running``) it rotates q and k as one teeny
call (``rotary_pair``: two ``rotary_embedding`` kernel pairs); any other caller, and any call it
cannot take (other arguments, cos and sin that want a gradient, under torch.compile, where the
rotation is traced), gets transformers' own function. Unpatched models are not changed.

A modeling module's function is replaced only after it was run once on small random inputs and
gave Hugging Face's rotation, ``x cos + rotate_half(x) sin`` over the first columns of x (partial
rotary: the columns past cos's width pass through): a module whose function rotates otherwise
(interleaved pairs, say) keeps it, and the report says so.
"""

from __future__ import annotations

import sys

import torch

from ... import ops
from .. import library
from .router import running


def _rotary_pair(q, k, cos, sin, in_q_dtype: bool = False):
    """q and k rotated by the same tables (``teeny.ops.rotary_embedding``), one teeny call, in
    the dtype PyTorch's type promotion gives Hugging Face's ``q * cos + rotate_half(q) * sin``:
    with bf16 q and k and float32 cos and sin the rotation is float32 (the exact upcast of q,
    then the rotation). ``in_q_dtype``: that float32 rotation is written in q's dtype instead,
    rounded once (under autocast, where q and k come from the products in bf16 and the
    attention casts them to bf16 before it reads them: the same numbers, without a float32 copy
    of q and k and the attention's two casts)."""
    if in_q_dtype and q.dtype.itemsize == 2 and cos.dtype == sin.dtype == torch.float32:
        return ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)
    dtype = torch.promote_types(q.dtype, cos.dtype)
    q, k, cos, sin = (t if t.dtype == dtype else ops.to(t, dtype) for t in (q, k, cos, sin))
    return ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)


library.register(
    _rotary_pair, name="rotary_pair", schema="Tensor q, Tensor k, Tensor cos, Tensor sin, bool in_q_dtype=False",
    multi_output=True, autocast="as_given",
)  # fmt: skip


def _reference(x, cos, sin):
    """Hugging Face's rotation of x (batch, heads, seq, dim) by cos, sin (batch, seq, r)."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rotated[..., r // 2 :], rotated[..., : r // 2]), dim=-1)
    return torch.cat((rotated * cos + half * sin, rest), dim=-1)


def _rotates_as_hugging_face(function, rotary_dim: int) -> bool:
    """Whether ``function(q, k, cos, sin)`` gives ``_reference``'s rotation of q and k with tables
    ``rotary_dim`` wide (head_dim 8), on small random float64 inputs."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64), torch.randn(2, 1, 5, 8, generator=gen,
                                                                                       dtype=torch.float64)  # fmt: skip
    angles = torch.randn(2, 5, rotary_dim // 2, generator=gen, dtype=torch.float64)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    try:
        with torch.no_grad():
            out = function(q, k, cos, sin)
        return all(torch.allclose(y, _reference(x, cos, sin)) for y, x in zip(out, (q, k), strict=True))
    except Exception:  # noqa: BLE001  (any failure: it does not rotate as Hugging Face does)
        return False


class RotaryDispatch:
    """Stands in for a modeling module's ``apply_rotary_pos_emb``: teeny's rotation while a
    patched model runs (``router.running``), the module's own otherwise."""

    def __init__(self, original, partial: bool):
        self.original, self.partial = original, partial
        self.__wrapped__ = original  # inspect and functools see transformers' function
        self.__name__ = getattr(original, "__name__", "apply_rotary_pos_emb")
        self.__doc__ = getattr(original, "__doc__", None)

    def _takes(self, q, k, cos, sin, args, kwargs) -> bool:
        if args or any(v is not None and (name != "unsqueeze_dim" or v != 1) for name, v in kwargs.items()):
            return False
        if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or cos.requires_grad or sin.requires_grad:
            return False
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or q.shape[-1] != k.shape[-1]:
            return False
        if not (q.is_floating_point() and cos.is_floating_point() and q.dtype == k.dtype and cos.dtype == sin.dtype):
            return False  # (q's and cos's dtypes may differ, as under autocast: _rotary_pair promotes)
        width = cos.shape[-1]
        return width == q.shape[-1] or (self.partial and width < q.shape[-1] and width % 2 == 0)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        report = None if torch.compiler.is_compiling() else running()
        if report is None or not self._takes(q, k, cos, sin, args, kwargs):
            return self.original(q, k, cos, sin, *args, **kwargs)
        report.routed["apply_rotary_pos_emb"] += 1
        device = q.device.type
        rounded = library.autocast_on(device) and torch.get_autocast_dtype(device) == q.dtype != cos.dtype
        return library.direct.rotary_pair(q, k, cos, sin, rounded)


def rotary_of(cls: type) -> tuple[str, str]:
    """Put the dispatcher in place of the ``apply_rotary_pos_emb`` of attention class ``cls``'s
    modeling module (once per module); returns (module name, what the report says), or ("", "")
    when that module has no such function."""
    module = sys.modules.get(cls.__module__)
    function = getattr(module, "apply_rotary_pos_emb", None)
    if function is None:
        return "", ""
    if isinstance(function, RotaryDispatch):
        return module.__name__, "teeny: rotary_embedding"
    if not _rotates_as_hugging_face(function, 8):
        return module.__name__, "PyTorch: its apply_rotary_pos_emb rotates otherwise"
    module.apply_rotary_pos_emb = RotaryDispatch(function, partial=_rotates_as_hugging_face(function, 4))
    return module.__name__, "teeny: rotary_embedding"
