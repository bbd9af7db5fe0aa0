"""``torch.nn.functional`` spellings of teeny's registered ops: the same arguments, teeny's kernels.

    import teeny.torch.nn.functional as TF
    y = TF.gelu(x, approximate="tanh")           # torch.ops.teeny.gelu underneath

In plain eager mode the calls skip the dispatcher's round trip (``teeny.torch.library.direct``);
under torch.compile, a dispatch mode or a tensor subclass they go through the operators.

A call whose arguments teeny has no kernel for (attention dropout, ``max_norm`` embeddings, a
``dtype=`` softmax, ...) raises ``Unsupported`` naming the argument; ``teeny.torch.patch``
catches it and lets PyTorch run that call (and reports it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...ops.activation.declarations import ACTIVATIONS, Activation
from .. import library

T = library.direct


class Unsupported(NotImplementedError):
    """teeny has no kernel for this combination of arguments (the message says which)."""


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise Unsupported(what)


def _floating(*tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            raise Unsupported(f"a {t.dtype} input (teeny's kernels here take floating-point tensors)")


# ---------------------------------------------------------------------------- activations


def _activation(declaration: Activation) -> Callable:
    """The ``torch.nn.functional`` spelling of a declared activation (``teeny.ops.activation``):
    torch's arguments and defaults (``inplace`` accepted: the result is a new tensor), numbers
    passed to ``torch.ops.teeny.<name>`` as floats. Assigned to this module's global of its name,
    so it imports and pickles by name."""
    name = declaration.name
    passed = [
        (i, float if annotation == "float" else None)
        for i, (p, annotation) in enumerate(declaration.annotations().items(), 1)
        if p != "inplace"
    ]

    def call(*args, **kwargs):
        values = declaration.bind(args, kwargs, "input")
        _floating(values[0])
        return getattr(T, name)(values[0], *[values[i] if cast is None else cast(values[i]) for i, cast in passed])

    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = f"``torch.nn.functional.{name}`` on teeny's kernels: {declaration.doc}"
    call.__signature__ = declaration.signature("input")
    return call


for _declaration in ACTIVATIONS:
    globals()[_declaration.name] = _activation(_declaration)
del _declaration


def prelu(input, weight):
    _floating(input)
    return T.prelu(input, weight)


def glu(input, dim=-1):
    _floating(input)
    return T.glu(input, dim)


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    _refuse(dim is None, "softmax without dim")
    _refuse(dtype is not None, "softmax with dtype=")
    _floating(input)
    return T.softmax(input, dim)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    _refuse(dim is None, "log_softmax without dim")
    _refuse(dtype is not None, "log_softmax with dtype=")
    _floating(input)
    return T.log_softmax(input, dim)


def swiglu(gate, up):
    """silu(gate) * up in one kernel pair (teeny-only: no torch.nn.functional counterpart)."""
    return T.swiglu(gate, up)


def geglu(gate, up, approximate="tanh"):
    """gelu(gate) * up in one kernel pair (Gemma's MLP; teeny-only, as ``swiglu``)."""
    return T.geglu(gate, up, approximate)


# ---------------------------------------------------------------------------- layers


def linear(input, weight, bias=None):
    _floating(input)
    return T.linear(input, weight, bias)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, out_dtype=None):
    """torch's, and ``out_dtype``: the result written in that dtype (see ``autocast_dtype``)."""
    _floating(input)
    return T.layer_norm(input, list(normalized_shape), weight, bias, float(eps), out_dtype)


def rms_norm(input, normalized_shape, weight=None, eps=None, *, out_dtype=None, weight_offset=0.0):
    """torch's, ``out_dtype`` as for ``layer_norm``, and ``weight_offset``: the scale is weight +
    weight_offset (Gemma's (1 + w) norm: 1)."""
    _floating(input)
    eps = None if eps is None else float(eps)
    return T.rms_norm(input, list(normalized_shape), weight, eps, out_dtype, float(weight_offset))


def autocast_dtype(module, input) -> torch.dtype | None:
    """The dtype a norm module writes when its ``autocast_output`` is set (``teeny.torch.patch``
    sets it on the pre-norms of GPT-2's and Llama's blocks, whose readers are products): under
    autocast, autocast's dtype, to which those products cast it first anyway, so the same
    numbers with one cast launch fewer each way (the norm writes bf16, and reads its gradient
    in bf16); otherwise None: torch's float32 output."""
    if not getattr(module, "autocast_output", False):
        return None
    return library.autocast_dtype([input])


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    _floating(input)
    return T.group_norm(input, num_groups, weight, bias, float(eps))


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    _refuse(momentum is None, "batch_norm with momentum=None (cumulative average)")
    _floating(input)
    return T.batch_norm(input, running_mean, running_var, weight, bias, bool(training), float(momentum), float(eps))


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    _refuse(max_norm is not None, "embedding with max_norm")
    _refuse(scale_grad_by_freq, "embedding with scale_grad_by_freq")
    _refuse(sparse, "embedding with sparse gradients")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return T.embedding(input, weight, padding_idx)


def dropout(input, p=0.5, training=True, inplace=False):
    _floating(input)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not training:  # the identity: like torch, the input itself, with no call at all
        return input
    return T.dropout(input, float(p), bool(training))


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    _floating(input)
    if isinstance(padding, str):
        return T.conv2d.padding(input, weight, bias, stride, padding, dilation, groups)
    return T.conv2d(input, weight, bias, stride, padding, dilation, groups)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    _refuse(return_indices, "max_pool2d with return_indices=True")
    _floating(input)
    return T.max_pool2d(input, kernel_size, [] if stride is None else stride, padding, dilation, ceil_mode)


def avg_pool2d(
    input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    _floating(input)
    return T.avg_pool2d(
        input, kernel_size, [] if stride is None else stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """As torch's. In eager mode, q, k and v that are the three column blocks of one
    (batch, length, 3 * heads * dim) tensor, split into heads by views (``qkv.split(d, 2)``,
    ``view``, ``transpose(1, 2)``: GPT-2's and nanoGPT's attention), are read from that tensor
    in place and its gradient is written whole: no copy of q, k, v, no concatenation of their
    gradients, and the output is the (batch, length, heads, dim) tensor the merge of the heads
    wants, seen as (batch, heads, length, dim)."""
    _refuse(dropout_p != 0.0, f"scaled_dot_product_attention with dropout_p={dropout_p}")
    _refuse(attn_mask is not None and is_causal, "scaled_dot_product_attention with both attn_mask and is_causal")
    _floating(query)
    scale = None if scale is None else float(scale)
    if attn_mask is None and not enable_gqa and not torch.compiler.is_compiling():
        qkv = _packed_source(query, key, value)
        if qkv is not None:
            return T.packed_attention(qkv, query.shape[1], bool(is_causal), scale).transpose(1, 2)
    return T.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, bool(is_causal), scale, bool(enable_gqa))


def _packed_source(query, key, value) -> torch.Tensor | None:
    """The contiguous (batch, length, 3 * heads * dim) tensor whose column blocks q, k and v
    are, as (batch, heads, length, dim) views; None if they are anything else."""
    base = query._base
    if base is None or key._base is not base or value._base is not base or base.dim() != 3 or query.dim() != 4:
        return None
    batch, length, width = base.shape
    heads, d = query.shape[1], query.shape[3]
    if not base.is_contiguous() or width != 3 * heads * d:
        return None
    if not query.shape == key.shape == value.shape == (batch, heads, length, d):
        return None
    if not query.stride() == key.stride() == value.stride() == (length * width, d, width, 1):
        return None
    start = base.storage_offset()
    offsets = (query.storage_offset() - start, key.storage_offset() - start, value.storage_offset() - start)
    return base if offsets == (0, heads * d, 2 * heads * d) else None


def _packed_attention(qkv, heads: int, is_causal: bool = False, scale: float | None = None):
    """softmax(q k^T * scale) v over q, k, v packed in qkv (batch, length, 3 * heads * dim);
    the output is (batch, length, heads, dim)."""
    from ...core.graph import graph_of
    from ...ops.attention.ops import AttentionOp

    op = AttentionOp(has_mask=False, is_causal=is_causal, scale=scale, enable_gqa=False, layout="packed", heads=heads)
    return graph_of(qkv).apply(op, [qkv])


library.register(
    _packed_attention,
    name="packed_attention",
    schema="Tensor qkv, int heads, bool is_causal=False, float? scale=None",
    autocast="product",
)


# ---------------------------------------------------------------------------- losses


def _reduction(size_average, reduce, reduction: str) -> str:
    _refuse(size_average is not None or reduce is not None, "the deprecated size_average/reduce arguments")
    return reduction


def cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    _floating(input)
    return T.cross_entropy(
        input, target, weight, int(ignore_index), _reduction(size_average, reduce, reduction), float(label_smoothing)
    )


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    _floating(input)
    return T.nll_loss(input, target, weight, int(ignore_index), _reduction(size_average, reduce, reduction))


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    _refuse(weight is not None, "mse_loss with weight")
    return T.mse_loss(input, target, _reduction(size_average, reduce, reduction))


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    _refuse(weight is not None, "l1_loss with weight")
    return T.l1_loss(input, target, _reduction(size_average, reduce, reduction))


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    return T.smooth_l1_loss(input, target, _reduction(size_average, reduce, reduction), float(beta))


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    _refuse(weight is not None, "huber_loss with weight")
    return T.huber_loss(input, target, reduction, float(delta))


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    return T.binary_cross_entropy(input, target, weight, _reduction(size_average, reduce, reduction))


def binary_cross_entropy_with_logits(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None
):
    return T.binary_cross_entropy_with_logits(
        input, target, weight, _reduction(size_average, reduce, reduction), pos_weight
    )


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    return T.kl_div(input, target, _reduction(size_average, reduce, reduction), bool(log_target))


ROUTED = {  # torch.nn.functional / torch functions -> their teeny spelling (what patch() reroutes)
    **{route: globals()[d.name] for d in ACTIVATIONS for route in d.routes},
    torch.nn.functional.prelu: prelu,
    torch.nn.functional.glu: glu,
    torch.nn.functional.softmax: softmax,
    torch.softmax: softmax,
    torch.Tensor.softmax: softmax,
    torch.nn.functional.log_softmax: log_softmax,
    torch.log_softmax: log_softmax,
    torch.Tensor.log_softmax: log_softmax,
    torch.nn.functional.linear: linear,
    torch.nn.functional.layer_norm: layer_norm,
    torch.nn.functional.rms_norm: rms_norm,
    torch.nn.functional.group_norm: group_norm,
    torch.nn.functional.batch_norm: batch_norm,
    torch.nn.functional.embedding: embedding,
    torch.nn.functional.dropout: dropout,
    torch.nn.functional.conv2d: conv2d,
    torch.nn.functional.max_pool2d: max_pool2d,
    torch.nn.functional.avg_pool2d: avg_pool2d,
    torch.nn.functional.scaled_dot_product_attention: scaled_dot_product_attention,
    torch.nn.functional.cross_entropy: cross_entropy,
    torch.nn.functional.nll_loss: nll_loss,
    torch.nn.functional.mse_loss: mse_loss,
    torch.nn.functional.l1_loss: l1_loss,
    torch.nn.functional.smooth_l1_loss: smooth_l1_loss,
    torch.nn.functional.huber_loss: huber_loss,
    torch.nn.functional.binary_cross_entropy: binary_cross_entropy,
    torch.nn.functional.binary_cross_entropy_with_logits: binary_cross_entropy_with_logits,
    torch.nn.functional.kl_div: kl_div,
}
