"""The activation family's RuntimeOps: ``ActivationOp`` (one element-wise activation on the
template kernels), ``GatedOp`` (glu, swiglu) and ``PReLUOp`` (its weight gradient split over
about ``PRELU_TARGET_PROGRAMS`` programs)."""

from __future__ import annotations

import math

from ...core.common import ELEMENTWISE_BLOCK, acc_dtype, cdiv, sum_partials
from ...core.runtime import ArgVisitor, Launch, RuntimeOp
from .kernels import (
    activation_backward,
    activation_forward,
    gated_backward,
    gated_forward,
    prelu_backward,
    prelu_forward,
)

BLOCK = ELEMENTWISE_BLOCK


class ActivationOp(RuntimeOp):
    """An element-wise activation: ``fn``/``grad`` are its @triton.jit maths, ``a``/``b`` its
    scalar arguments (float64 in float64 kernels)."""

    kernel = activation_forward
    saves_inputs = True
    recomputable = (0,)
    grad_in_place = True

    def __init__(self, name: str, fn, grad, a: float = 0.0, b: float = 0.0):
        self.name, self.fn, self.grad, self.a, self.b = name, fn, grad, float(a), float(b)

    def block(self):
        return BLOCK

    def forward_launches(self, ctx):
        (x,) = ctx.inputs
        args = ArgVisitor().visit(x_ptr=x, y_ptr=ctx.output, n=x.numel(), a=self.a, b=self.b, FN=self.fn)
        return [Launch(activation_forward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]

    def backward_launches(self, ctx):
        (x,), (dx,) = ctx.inputs, ctx.grad_inputs
        args = ArgVisitor().visit(
            x_ptr=x, dy_ptr=ctx.grad_output, dx_ptr=dx, n=x.numel(), a=self.a, b=self.b, GRAD=self.grad
        )
        return [Launch(activation_backward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]


class GatedOp(RuntimeOp):
    """y = u * act(g): ``glu`` (u, g = the halves of one input along ``dim``) or ``swiglu`` /
    ``geglu`` (g = gate, u = up: two inputs of one shape)."""

    kernel = gated_forward
    saves_inputs = True

    def __init__(self, name: str, act, act_grad, dim: int | None):
        self.name, self.act, self.act_grad, self.dim = name, act, act_grad, dim
        self.n_activation_inputs = 1 if dim is not None else 2
        self.recomputable = tuple(range(self.n_activation_inputs))

    def check_inputs(self, input_shapes, input_dtypes):
        if self.dim is None:
            gate, up = input_shapes
            if tuple(gate) != tuple(up):
                raise ValueError(f"gate and up must have the same shape, got {tuple(gate)} and {tuple(up)}")
            return
        (shape,) = input_shapes
        if len(shape) == 0:
            raise ValueError("glu does not support scalars because halving size must be even")
        if not -len(shape) <= self.dim < len(shape):
            raise ValueError(f"dim {self.dim} is out of range for a {len(shape)}-d input")
        if shape[self.dim % len(shape)] % 2:
            raise ValueError(
                f"halving dimension must be even, but dimension {self.dim % len(shape)} is size "
                f"{shape[self.dim % len(shape)]}"
            )

    def output_shape(self, input_shapes):
        shape = list(input_shapes[0])
        if self.dim is not None:
            shape[self.dim % len(shape)] //= 2
        return tuple(shape)

    def block(self):
        return BLOCK

    def _layout(self, ctx) -> dict:
        """The kernel's layout arguments: half_row, row_stride, g_offset and SPLIT."""
        n = math.prod(ctx.output_shape)
        if self.dim is None:
            return dict(half_row=max(n, 1), row_stride=max(n, 1), g_offset=0, SPLIT=False)
        shape = ctx.input_shapes[0]
        dim = self.dim % len(shape)
        half_row = (shape[dim] // 2) * math.prod(shape[dim + 1 :])
        return dict(half_row=max(half_row, 1), row_stride=2 * half_row, g_offset=half_row, SPLIT=True)

    def _sources(self, inputs) -> dict:
        u, g = (inputs[0], inputs[0]) if self.dim is not None else (inputs[1], inputs[0])
        return dict(u_ptr=u, g_ptr=g)

    def forward_launches(self, ctx):
        n = ctx.output.numel()
        args = ArgVisitor().visit(**self._sources(ctx.inputs), y_ptr=ctx.output, n=n, ACT=self.act, **self._layout(ctx))
        return [Launch(gated_forward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]

    def backward_launches(self, ctx):
        if self.dim is not None:
            du = dg = ctx.grad_inputs[0]
        else:
            dg, du = ctx.grad_inputs
        args = ArgVisitor().visit(
            **self._sources(ctx.inputs),
            dy_ptr=ctx.grad_output,
            du_ptr=du,
            dg_ptr=dg,
            n=ctx.grad_output.numel(),
            ACT=self.act,
            ACT_GRAD=self.act_grad,
            **self._layout(ctx),
        )
        return [Launch(gated_backward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]


PRELU_TARGET_PROGRAMS = 1024  # backward: split channels until about this many programs run


class PReLUOp(RuntimeOp):
    """prelu(x, weight): weight (1,) (or a scalar) shared by all elements, or (C,) along dim 1."""

    name = "prelu"
    kernel = prelu_forward
    saves_inputs = True
    recomputable = (0, 1)

    def param_shapes(self, input_shapes):
        return [None]

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes
        if len(w) > 1:
            raise ValueError(f"weight must be a scalar or a 1-d tensor, got shape {tuple(w)}")
        channels = x[1] if len(x) >= 2 else 1
        numel = math.prod(w)
        if numel != 1 and numel != channels:
            raise ValueError(
                f"weight has {numel} parameters but the input has {channels} channels "
                f"(dim 1 of shape {tuple(x)}); use 1 parameter or one per channel"
            )

    @staticmethod
    def _layout(input_shapes):
        """(channels, inner, per_channel) with x viewed as (outer, channels, inner)."""
        x, w = input_shapes
        n = math.prod(x)
        if math.prod(w) == 1:
            return 1, 1, n
        channels, inner = x[1], math.prod(x[2:])
        return channels, inner, n // channels if channels else 0

    def block(self):
        return BLOCK

    def forward_launches(self, ctx):
        channels, inner, _ = self._layout(ctx.input_shapes)
        (x,), (w,), y = ctx.inputs, ctx.params, ctx.output
        args = ArgVisitor().visit(x_ptr=x, w_ptr=w, y_ptr=y, n=y.numel(), channels=channels, inner=inner)
        return [Launch(prelu_forward, self.grid(ctx.input_shapes, ctx.output_shape), args, BLOCK)]

    def backward_launches(self, ctx):
        channels, inner, per_channel = self._layout(ctx.input_shapes)
        (x,), (w,) = ctx.inputs, ctx.params
        (dx,), (dw,) = ctx.grad_inputs, ctx.grad_params
        splits = max(1, min(cdiv(per_channel, BLOCK), cdiv(PRELU_TARGET_PROGRAMS, max(channels, 1))))
        partials = ctx.empty((splits, channels), acc_dtype(ctx.dtype)) if dw is not None else None
        args = ArgVisitor().visit(
            x_ptr=x,
            w_ptr=w,
            dy_ptr=ctx.grad_output,
            dx_ptr=dx,
            partial_ptr=partials,
            per_channel=per_channel,
            channels=channels,
            inner=inner,
            splits=splits,
        )
        # the weight gradient has work (zeros) even for an empty input
        launches = [
            Launch(prelu_backward, (channels, splits, 1), args, BLOCK, work=channels if dw is not None else None)
        ]
        if dw is not None:
            launches += sum_partials(partials, dw)
        return launches
