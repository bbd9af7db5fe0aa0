"""The products' ops: ``matmul`` (torch.matmul semantics) and ``linear`` (y = x W^T + b) as
RuntimeOps, their functional forms and the ``Linear`` layer. Each op describes its forward and
backward as ``launches.Product``s; ``ProductOp.product`` chooses each one's configuration at
lowering (``tuning.choose_config``) and builds its launches (``launches.product_launches``).
The ops that only graph rewrites make (``TransposedWeightLinearOp``, ``SharedInputLinearOp``,
``MLPOp``) live beside their patterns in ``teeny.fusions``.
"""

from __future__ import annotations

import math

import torch

from ...core import config as teeny_config
from ...core import init
from ...core.common import sum_to_shape
from ...core.errors import TeenyError
from ...core.graph import graph_of
from ...core.module import Module, Parameter
from ...core.runtime import Launch, OpContext, RuntimeOp
from .kernels import dot_precision, matmul_product
from .launches import TMA_ALIGN, Product, addend_epilogue, contiguous_strides, plan_product, product_launches
from .tuning import choose_config


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % TMA_ALIGN == 0 for t in tensors)


class ProductOp(RuntimeOp):
    """Shared launch code of matmul, linear and the fused products (``teeny.fusions``): each
    product's configuration is chosen (tuned) during lowering's dry run and reused by every run
    of the program."""

    kernel = matmul_product

    def __init__(self):
        self.allow_tf32 = teeny_config.allow_tf32  # read at trace time
        self.configs: dict[tuple, dict] = {}  # by product name and shape (``_config_key``)

    def precision(self, dtype: torch.dtype) -> str:
        return dot_precision(dtype, self.allow_tf32)

    def product(
        self, ctx: OpContext, name: str, p: Product, *, x, y, z, bias=None, row_sums=None, epilogue=None
    ) -> list[Launch]:
        """The launches of one product (``name`` tells the op's products apart) of X = ``x`` and
        Y = ``y`` into Z = ``z``; ``row_sums``: also X's row sums, ``epilogue``: an activation
        (see ``product_launches``)."""
        precision = self.precision(ctx.dtype)
        out_dtype = z.dtype if z.dtype != ctx.dtype else None  # a float32 dW of half operands
        key = _config_key(name, p)
        config = self.configs.get(key)
        if config is None or ctx.dry_run:
            config = self.configs[key] = choose_config(
                p,
                dtype=ctx.dtype,
                precision=precision,
                has_bias=bias is not None,
                row_sums=row_sums is not None,
                epilogue=epilogue,
                out_dtype=out_dtype,
                timing=ctx.dry_run,  # a run's product the dry run did not see: nothing timed inside the run
            )
        aux = None if epilogue is None else epilogue.aux
        if config["kernel"] in ("tma", "ws") and not ctx.dry_run and not _aligned(x, y, z, aux):
            # the executor keeps parameters and inputs 16-byte aligned, and fresh buffers are: the plan holds
            raise TeenyError(f"{ctx.where}: a TMA product's operand is not 16-byte aligned ({p})")
        return product_launches(
            p, config, x=x, y=y, z=z, bias=bias, dtype=ctx.dtype, precision=precision,
            scratch=lambda s, d: ctx.empty(s, d), row_sums=row_sums, epilogue=epilogue,
        )  # fmt: skip


def _config_key(name: str, p: Product) -> tuple:
    """Which chosen configuration a product reuses: its name in the op and its shape and strides.
    One op may launch a product of several shapes (the chunked head + loss runs its linear on
    chunks of rows, the last one short), and a configuration chosen for one shape is not the one
    the dry run built the kernels of another shape for."""
    return (name, p.M, p.N, p.K, p.x, p.y, p.z, tuple(p.kept), tuple(p.reduced))


# ------------------------------------------------------------------------------- matmul


def promoted_shapes(a_shape, b_shape):
    """torch.matmul's 1-D promotion: (K,) @ ... -> (1, K); ... @ (K,) -> (K, 1)."""
    a = (1,) + tuple(a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b = tuple(b_shape) + (1,) if len(b_shape) == 1 else tuple(b_shape)
    return a, b


def product_flops(batch: int, m: int, n: int, k: int, backward_products: int) -> tuple[int, int]:
    """(forward, backward) flops of Z = X @ Y (batch of m x k by k x n) whose backward launches
    ``backward_products`` products of the same size (dX, dW: one each wanted)."""
    one = 2 * batch * m * n * k
    return one, one * backward_products


class MatmulOp(ProductOp):
    """torch.matmul for any ranks >= 1, batch dims broadcast."""

    name = "matmul"
    n_activation_inputs = 2
    saves_inputs = True

    def check_inputs(self, input_shapes, input_dtypes):
        a_shape, b_shape = input_shapes
        for which, shape, dt in (("first", a_shape, input_dtypes[0]), ("second", b_shape, input_dtypes[1])):
            if len(shape) == 0:
                raise ValueError(f"matmul: both arguments need at least 1 dimension, but the {which} is 0-d")
            if not dt.is_floating_point:
                raise TypeError(f"matmul: expects floating point tensors, the {which} is {dt}")
        a, b = promoted_shapes(a_shape, b_shape)
        if a[-1] != b[-2]:
            raise ValueError(
                f"matmul: shapes {tuple(a_shape)} and {tuple(b_shape)} cannot be multiplied "
                f"(inner dims {a[-1]} and {b[-2]} differ)"
            )
        try:
            torch.broadcast_shapes(a[:-2], b[:-2])
        except RuntimeError:
            raise ValueError(
                f"matmul: batch dims of {tuple(a_shape)} and {tuple(b_shape)} do not broadcast ({a[:-2]} vs {b[:-2]})"
            ) from None
        for plan in self._plans(a_shape, b_shape).values():
            plan()  # raises for unsupported broadcasting patterns

    def flops(self, input_shapes, grad_mask):
        a, b = promoted_shapes(*input_shapes)
        batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
        return product_flops(batch, a[-2], b[-1], a[-1], sum(map(bool, grad_mask[:2])))

    def output_shape(self, input_shapes):
        a_shape, b_shape = input_shapes
        a, b = promoted_shapes(a_shape, b_shape)
        out = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        if len(a_shape) > 1:
            out += (a[-2],)
        if len(b_shape) > 1:
            out += (b[-1],)
        return out

    def _plans(self, a_shape, b_shape):
        """The three products (forward, dA, dB) for these shapes, as lazy builders."""
        a, b = promoted_shapes(a_shape, b_shape)
        M, K, N = a[-2], a[-1], b[-1]
        if len(b) == 2 and len(a) > 2:  # (..., M, K) @ (K, N): fold the batch into the rows
            M, a = math.prod(a[:-1]), (math.prod(a[:-1]), K)
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
        n = len(batch)
        sa, sb = contiguous_strides(a), contiguous_strides(b)
        sc = contiguous_strides(batch + (M, N))

        def batch_strides(shape, strides):
            shape, strides = (1,) * (n + 2 - len(shape)) + tuple(shape), [0] * (n + 2 - len(shape)) + strides
            return [0 if shape[i] == 1 else strides[i] for i in range(n)]

        ab, bb, cb = batch_strides(a, sa), batch_strides(b, sb), sc[:n]
        where = f"matmul {tuple(a_shape)} @ {tuple(b_shape)}"
        return {
            # Y = A @ B
            "forward": lambda: plan_product(
                M, N, K, (sa[-2], sa[-1]), (sb[-2], sb[-1]), (sc[-2], sc[-1]),
                [(batch[i], ab[i], bb[i], cb[i]) for i in range(n)], where,
            ),
            # dA = dY @ B^T, summed over the dims A is broadcast along
            "grad_a": lambda: plan_product(
                M, K, N, (sc[-2], sc[-1]), (sb[-1], sb[-2]), (sa[-2], sa[-1]),
                [(batch[i], cb[i], bb[i], ab[i]) for i in range(n)], where,
            ),
            # dB = A^T @ dY, summed over the dims B is broadcast along
            "grad_b": lambda: plan_product(
                K, N, M, (sa[-1], sa[-2]), (sc[-2], sc[-1]), (sb[-2], sb[-1]),
                [(batch[i], ab[i], cb[i], bb[i]) for i in range(n)], where,
            ),
        }  # fmt: skip

    def forward_launches(self, ctx):
        a, b = ctx.inputs
        p = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])["forward"]()
        return self.product(ctx, "forward", p, x=a, y=b, z=ctx.output)

    def backward_launches(self, ctx):
        a, b = ctx.inputs
        da, db = ctx.grad_inputs
        plans = self._plans(ctx.input_shapes[0], ctx.input_shapes[1])
        launches = []
        if da is not None:
            launches += self.product(ctx, "grad_a", plans["grad_a"](), x=ctx.grad_output, y=b, z=da)
        if db is not None:
            launches += self.product(ctx, "grad_b", plans["grad_b"](), x=a, y=ctx.grad_output, z=db)
        return launches


def matmul(input, other):
    """torch.matmul(input, other): 1-D operands promoted and squeezed, batch dims broadcast;
    gradients summed over broadcast dims (in fp32, inside the kernel, no atomics)."""
    return graph_of(input, other).apply(MatmulOp(), [input, other])


# ------------------------------------------------------------------------------- linear


def row_stride_of(y: torch.Tensor) -> int | None:
    """The row stride of a product result (or its gradient) given as a row-strided view, rows over
    its leading dims (None: contiguous): a linear's products read and write it so
    (``LinearOp.products``' ``y_row_stride``; a chunk of logits, a gradient with padded rows)."""
    return None if y.is_contiguous() else y.stride(-2)


class LinearOp(ProductOp):
    """y = x W^T + b over the flattened leading dims of x."""

    name = "linear"
    n_activation_inputs = 1
    saves_inputs = (0, 1)  # x for dW, W for dX; the bias is not needed
    grad_over_input = True
    grad_accumulates = True  # dX added to the gradient x's other readers left, in the product's epilogue
    strided_grad_output = True  # dY read through its row stride (rows padded to 16 bytes: TMA)

    def __init__(self, has_bias: bool):
        super().__init__()
        self.has_bias = has_bias

    def check_inputs(self, input_shapes, input_dtypes):
        x, w = input_shapes[0], input_shapes[1]
        if not all(d.is_floating_point for d in input_dtypes):
            raise TypeError(f"linear: expects floating point tensors, got {[str(d) for d in input_dtypes]}")
        if len(x) == 0:
            raise ValueError("linear: input must have at least 1 dimension, got a 0-d tensor")
        if len(w) != 2:
            raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w)}")
        if x[-1] != w[1]:
            raise ValueError(
                f"linear: input shape {tuple(x)} and weight shape {tuple(w)} cannot be multiplied "
                f"(in_features {x[-1]} vs {w[1]})"
            )
        if self.has_bias and tuple(input_shapes[2]) != (w[0],):
            raise ValueError(
                f"linear: bias must have shape ({w[0]},) to match weight {tuple(w)}, got {tuple(input_shapes[2])}"
            )

    def output_shape(self, input_shapes):
        return tuple(input_shapes[0][:-1]) + (input_shapes[1][0],)

    def flops(self, input_shapes, grad_mask):
        p = self.products(input_shapes)["forward"]
        return product_flops(1, p.M, p.N, p.K, sum(map(bool, grad_mask[:2])))

    @staticmethod
    def products(input_shapes, y_row_stride: int | None = None) -> dict[str, Product]:
        """Y = X W^T, dX = dY W and dW = dY^T X over the rows of the flattened x; the rows of Y
        (and dY) ``y_row_stride`` apart (default: contiguous; a chunk of logits whose rows are
        padded to 16 bytes, ``fusions.chunked_loss.LinearCrossEntropyOp``)."""
        x, w = input_shapes[0], input_shapes[1]
        rows, fin, fout = math.prod(x[:-1]), w[1], w[0]
        ys = y_row_stride or fout
        return {
            "forward": Product(rows, fout, fin, (fin, 1), (1, fin), (ys, 1), [], []),
            "grad_input": Product(rows, fin, fout, (ys, 1), (fin, 1), (fin, 1), [], []),
            "grad_weight": Product(fout, fin, rows, (1, ys), (fin, 1), (fin, 1), [], []),
        }

    def forward_launches(self, ctx):
        (x,), w = ctx.inputs, ctx.params[0]
        bias = ctx.params[1] if self.has_bias else None
        p = self.products(ctx.input_shapes, row_stride_of(ctx.output))["forward"]
        return self.product(ctx, "forward", p, x=x, y=w, z=ctx.output, bias=bias)

    def backward_launches(self, ctx):
        go = ctx.grad_output
        products = self.products(ctx.input_shapes, row_stride_of(go))
        (x,), w = ctx.inputs, ctx.params[0]
        (dx,) = ctx.grad_inputs
        dw = ctx.grad_params[0]
        dbias = ctx.grad_params[1] if self.has_bias else None
        launches = []
        if dw is not None:  # dW = dY^T X, and db (dY's column sums) fused: the product reads dY's columns
            launches += self.product(ctx, "grad_weight", products["grad_weight"], x=go, y=x, z=dw, row_sums=dbias)
        elif dbias is not None:
            launches += sum_to_shape(ctx, go, ctx.output_shape, dbias, strides=go.stride())
        if dx is not None:  # after dW, which reads x: dX may be written over x (grad_over_input)
            launches += grad_input_launches(self, ctx, products["grad_input"], w, dx)
        return launches


def grad_input_launches(op: ProductOp, ctx: OpContext, p: Product, w, dx) -> list[Launch]:
    """A linear's dX = dY W (product ``p``) into ``dx``, plus the gradient that x's other readers
    left (``OpContext.grad_input_addend``, ``grad_accumulates``) added in the product's epilogue."""
    addend = ctx.grad_input_addend
    if addend is None:
        return op.product(ctx, "grad_input", p, x=ctx.grad_output, y=w, z=dx)
    return op.product(ctx, "grad_input+addend", p, x=ctx.grad_output, y=w, z=dx, epilogue=addend_epilogue(addend))


def linear(input, weight, bias=None):
    """F.linear: y = input @ weight^T + bias for input of shape (..., in_features)."""
    inputs = [input, weight] + ([bias] if bias is not None else [])
    return graph_of(*inputs).apply(LinearOp(bias is not None), inputs)


class Linear(Module):
    """nn.Linear(in_features, out_features, bias=True): weight (out, in) and bias (out,),
    both U(-1/sqrt(in), 1/sqrt(in)) like PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter((out_features, in_features), init.kaiming_uniform(in_features), dtype=dtype)
        self.bias = Parameter((out_features,), init.kaiming_uniform(in_features), dtype=dtype) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None})"
