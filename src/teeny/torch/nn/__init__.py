"""Drop-in ``torch.nn`` layers that run teeny's kernel pairs.

    layer = teeny.torch.nn.Linear(784, 10)        # torch.nn.Linear's arguments and state_dict keys
    layer.load_state_dict(torch_linear.state_dict())

Each class subclasses its ``torch.nn`` counterpart and replaces only ``forward`` (through
``torch.ops.teeny.*``, see ``teeny.torch.library``; in plain eager mode straight into the
operators' implementation, ``library.direct``): construction, initialisation, parameters,
buffers, ``state_dict`` keys and ``repr`` are PyTorch's own, so a checkpoint loads either way
and ``teeny.torch.patch`` can turn a torch layer into its teeny one in place. The element-wise
activations' drop-ins (``ReLU``, ``LeakyReLU``, ``GELU``, ...) are generated from their declarations
in ``teeny.ops.activation.ACTIVATIONS``, as their ``functional`` entries are. ``SwiGLUMLP`` and
``ScaledDotProductAttention`` have no ``torch.nn`` class; they follow Llama's naming
(``gate_proj``/``up_proj``/``down_proj``) and ``F.scaled_dot_product_attention``'s arguments.
Arguments teeny has no kernel for (``padding_mode="reflect"``, ``max_norm``, attention
dropout) raise ``Unsupported`` when the layer runs, naming the argument.
"""

from __future__ import annotations

from torch import nn

from ...ops.activation.declarations import ACTIVATIONS, Activation
from . import functional as F
from .functional import Unsupported

__all__ = [  # and the activations' drop-ins
    "Linear",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "Embedding",
    "Dropout",
    "Conv2d",
    "MaxPool2d",
    "AvgPool2d",
    "PReLU",
    "GLU",
    "Softmax",
    "LogSoftmax",
    "SwiGLUMLP",
    "ScaledDotProductAttention",
    "CrossEntropyLoss",
    "NLLLoss",
    "MSELoss",
    "L1Loss",
    "SmoothL1Loss",
    "HuberLoss",
    "BCELoss",
    "BCEWithLogitsLoss",
    "KLDivLoss",
    "DROP_INS",
    "Unsupported",
    "functional",
] + [d.layer for d in ACTIVATIONS if d.layer is not None]
functional = F


# ---------------------------------------------------------------------------- layers with weights


class Linear(nn.Linear):
    def forward(self, input):
        return F.linear(input, self.weight, self.bias)


class LayerNorm(nn.LayerNorm):
    autocast_output = False  # under autocast, write autocast's dtype (``functional.autocast_dtype``)

    def forward(self, input):
        out_dtype = F.autocast_dtype(self, input)
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, out_dtype=out_dtype)


class RMSNorm(nn.RMSNorm):
    autocast_output = False  # as LayerNorm's

    def forward(self, input):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps, out_dtype=F.autocast_dtype(self, input))


class GroupNorm(nn.GroupNorm):
    def forward(self, input):
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNorm:
    """torch's batch-norm forward (running statistics, ``num_batches_tracked``) on teeny's kernels."""

    def forward(self, input):
        self._check_input_dim(input)
        if self.momentum is None:
            raise Unsupported("batch_norm with momentum=None (cumulative moving average)")
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        return F.batch_norm(
            input,
            self.running_mean if use_running else None,
            self.running_var if use_running else None,
            self.weight,
            self.bias,
            batch_stats,
            self.momentum,
            self.eps,
        )


class BatchNorm1d(_BatchNorm, nn.BatchNorm1d):
    pass


class BatchNorm2d(_BatchNorm, nn.BatchNorm2d):
    pass


class Embedding(nn.Embedding):
    def forward(self, input):
        return F.embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


class Conv2d(nn.Conv2d):
    def forward(self, input):
        if self.padding_mode != "zeros":
            raise Unsupported(f"Conv2d with padding_mode={self.padding_mode!r}")
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PReLU(nn.PReLU):
    def forward(self, input):
        return F.prelu(input, self.weight)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the Llama MLP, with the gate fused in one pair."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention`` as a layer: forward(query, key, value, attn_mask=None)."""

    def __init__(self, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False):
        super().__init__()
        self.is_causal, self.scale, self.enable_gqa = is_causal, scale, enable_gqa

    def forward(self, query, key, value, attn_mask=None):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, self.is_causal and attn_mask is None, self.scale, self.enable_gqa
        )


# ---------------------------------------------------------------------------- layers without weights


class Dropout(nn.Dropout):
    def forward(self, input):
        return F.dropout(input, self.p, self.training)


class MaxPool2d(nn.MaxPool2d):
    def forward(self, input):
        return F.max_pool2d(
            input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, self.return_indices
        )


class AvgPool2d(nn.AvgPool2d):
    def forward(self, input):
        return F.avg_pool2d(
            input,
            self.kernel_size,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
        )


class GLU(nn.GLU):
    def forward(self, input):
        return F.glu(input, self.dim)


class Softmax(nn.Softmax):
    def forward(self, input):
        return F.softmax(input, self.dim)


class LogSoftmax(nn.LogSoftmax):
    def forward(self, input):
        return F.log_softmax(input, self.dim)


def _activation_drop_in(declaration: Activation) -> type:
    """``torch.nn.<layer>`` of a declared activation (``teeny.ops.activation``) with its forward
    on ``functional.<name>``, passed the layer's attributes named like the activation's
    arguments (torch's layers keep them under those names; ``inplace`` is left out). A class of
    this module, its global of its name: it imports, pickles and deep-copies like a written one."""
    base = getattr(nn, declaration.layer)
    call = getattr(F, declaration.name)
    attributes = tuple(p for p in declaration.params if p != "inplace")

    def forward(self, input):
        return call(input, *[getattr(self, a) for a in attributes])

    forward.__qualname__ = f"{declaration.layer}.forward"
    namespace = {
        "forward": forward,
        "__module__": __name__,
        "__qualname__": declaration.layer,
        "__doc__": f"``torch.nn.{declaration.layer}`` on teeny's kernels (``functional.{declaration.name}``).",
    }
    return type(declaration.layer, (base,), namespace)


ACTIVATION_LAYERS = [d.layer for d in ACTIVATIONS if d.layer is not None]
for _declaration in ACTIVATIONS:
    if _declaration.layer is not None:
        globals()[_declaration.layer] = _activation_drop_in(_declaration)
del _declaration


# ---------------------------------------------------------------------------- losses


class CrossEntropyLoss(nn.CrossEntropyLoss):
    def forward(self, input, target):
        return F.cross_entropy(
            input, target, self.weight, None, self.ignore_index, None, self.reduction, self.label_smoothing
        )


class NLLLoss(nn.NLLLoss):
    def forward(self, input, target):
        return F.nll_loss(input, target, self.weight, None, self.ignore_index, None, self.reduction)


class MSELoss(nn.MSELoss):
    def forward(self, input, target):
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(nn.L1Loss):
    def forward(self, input, target):
        return F.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(nn.SmoothL1Loss):
    def forward(self, input, target):
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(nn.HuberLoss):
    def forward(self, input, target):
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class BCELoss(nn.BCELoss):
    def forward(self, input, target):
        return F.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(nn.BCEWithLogitsLoss):
    def forward(self, input, target):
        return F.binary_cross_entropy_with_logits(
            input, target, self.weight, reduction=self.reduction, pos_weight=self.pos_weight
        )


class KLDivLoss(nn.KLDivLoss):
    def forward(self, input, target):
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


DROP_INS: dict[type, type] = {  # torch.nn class -> its teeny drop-in (patch() swaps exact types only)
    cls.__mro__[1] if cls.__mro__[1] is not _BatchNorm else cls.__mro__[2]: cls
    for cls in (
        Linear,
        LayerNorm,
        RMSNorm,
        GroupNorm,
        BatchNorm1d,
        BatchNorm2d,
        Embedding,
        Conv2d,
        PReLU,
        Dropout,
        MaxPool2d,
        AvgPool2d,
        GLU,
        Softmax,
        LogSoftmax,
        CrossEntropyLoss,
        NLLLoss,
        MSELoss,
        L1Loss,
        SmoothL1Loss,
        HuberLoss,
        BCELoss,
        BCEWithLogitsLoss,
        KLDivLoss,
        *(globals()[name] for name in ACTIVATION_LAYERS),
    )
}
