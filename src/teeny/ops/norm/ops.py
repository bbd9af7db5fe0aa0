"""The normalisation RuntimeOps: ``NormOp`` (one node: its forward, recompute and backward
launches, its dw/db partial rows) and where each op's statistics rows lie (``LayerNormOp``,
``GroupNormOp``, ``BatchNormOp``)."""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ...core.common import acc_dtype, cdiv, pow2, sum_partials, tl_acc_dtype
from ...core.kernel import dtype_name
from ...core.runtime import ArgVisitor, Launch, OpContext, RuntimeOp
from . import tiling
from .kernels import (
    BATCH_STATS,
    COLUMN_CHANNEL,
    DY_LIKE_X,
    PER_PROGRAM,
    PER_ROW,
    RUNNING_STATS,
    SAVED_STATS,
    norm_backward,
    norm_forward,
    norm_weight_backward,
)
from .tiling import Rows, launch_block, max_programs, tile_shape


def shape_text(shape) -> str:
    """A shape as PyTorch's messages write it: (3, 4)."""
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _dy_layout(ctx: OpContext) -> dict:
    """DY_ROW_LEN and dy_row_stride of the backward kernels: DY_LIKE_X for a contiguous dy, else
    the length of dy's last dim and the distance between its rows."""
    dy = ctx.grad_output
    if dy.is_contiguous():
        return dict(DY_ROW_LEN=DY_LIKE_X, dy_row_stride=0)
    return dict(DY_ROW_LEN=dy.shape[-1], dy_row_stride=ctx.grad_output_row_stride)


class NormOp(RuntimeOp):
    """One normalisation node. Inputs: x, then (batch_norm) running_mean, running_var, then
    weight and bias when given. Subclasses say where the statistics rows lie (``stats_rows``)."""

    n_activation_inputs = 1
    kernel = norm_forward
    centred = True
    out_dtype: torch.dtype | None = None  # y's dtype when not x's (LayerNormOp's out_dtype)
    weight_offset = 0.0  # the affine scale is weight + weight_offset (rms_norm's; Gemma's (1 + w): 1)
    strided_grad_output = True  # the backward reads dy in place from a row-strided gradient
    grad_accumulates = True  # dx added to the gradient of x's other readers (a residual stream's)

    def __init__(self, name: str, *, eps: float, has_weight: bool, has_bias: bool, n_running: int = 0):
        self.name, self.eps = name, float(eps)
        self.has_weight, self.has_bias = has_weight, has_bias
        self.weight_index = 1 + n_running if has_weight else None
        self.bias_index = 1 + n_running + has_weight if has_bias else None
        affine = tuple(i for i in (self.weight_index, self.bias_index) if i is not None)
        self.differentiable_inputs = (0,) + affine  # running statistics never get a gradient
        self.saves_inputs = (0,) + ((self.weight_index,) if has_weight else ())

    def stats_rows(self, shape) -> Rows:
        raise NotImplementedError

    def affine_shape(self, shape) -> tuple[int, ...]:
        raise NotImplementedError

    def param_shapes(self, input_shapes):
        return [self.affine_shape(input_shapes[0])] * (len(input_shapes) - 1)

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(
                f"{self.name} expects a floating-point input, got {str(input_dtypes[0]).replace('torch.', '')}"
            )

    def output_dtype(self, input_dtypes):
        return self.out_dtype or input_dtypes[0]

    def extra_outputs(self, input_shapes, dtype):
        rows = self.stats_rows(input_shapes[0]).rows
        stats = {"rstd": ((rows,), acc_dtype(dtype))}
        if self.centred:
            stats["mean"] = ((rows,), acc_dtype(dtype))
        return stats

    def stats_source(self) -> tl.constexpr:
        return BATCH_STATS

    def running_stats(self, ctx: OpContext):
        """(running_mean, running_var) the forward reads or updates, or (None, None)."""
        return None, None

    def momentum(self) -> float:
        return 0.0

    def sources(self, ctx: OpContext) -> dict:
        """What the forward normalises: x (``teeny.fusions.residual_norm.AddNormOp``: the sum of two
        tensors it also writes)."""
        return dict(x_ptr=ctx.inputs[0], residual_numel=1, RESIDUAL_REPEATS=False)

    def grad_copy(self, ctx: OpContext) -> torch.Tensor | None:
        """Where the backward also writes dx in another dtype (``grad_copies_input0``), or None."""
        return None

    def _affine(self, tensors: list):
        """weight and bias (or None) out of a list laid out like the node's inputs."""
        w = tensors[self.weight_index] if self.has_weight else None
        b = tensors[self.bias_index] if self.has_bias else None
        return w, b

    def forward_launches(self, ctx: OpContext) -> list[Launch]:
        return self._normalise(ctx, self.sources(ctx), self.stats_source(), self.running_stats(ctx))

    @property
    def recomputable(self) -> tuple[int, ...]:
        """y again from x, the affine parameters and the saved mean and rstd."""
        return tuple(i for i in (0, self.weight_index, self.bias_index) if i is not None)

    def recompute_launches(self, ctx: OpContext) -> list[Launch]:
        plain = dict(x_ptr=ctx.inputs[0], residual_numel=1, RESIDUAL_REPEATS=False)  # AddNormOp: x is the sum
        return self._normalise(ctx, plain, SAVED_STATS, (None, None))

    def _normalise(self, ctx: OpContext, sources: dict, stats, running) -> list[Launch]:
        (x,) = ctx.inputs
        w, b = self._affine([x, *ctx.params])
        rows = self.stats_rows(x.shape)
        rows_per_tile, block = tile_shape(rows.rows, rows.row_len, ctx.dtype)
        running_mean, running_var = running
        args = ArgVisitor().visit(
            **sources,
            w_ptr=w,
            b_ptr=b,
            y_ptr=ctx.output,
            mean_ptr=ctx.saved.get("mean"),
            rstd_ptr=ctx.saved["rstd"],
            running_mean_ptr=running_mean,
            running_var_ptr=running_var,
            eps=self.eps,
            momentum=self.momentum(),
            w_offset=self.weight_offset,
            STATS=stats,
            COMPUTE=tl_acc_dtype(ctx.dtype),
            ROWS=rows_per_tile,
            **rows.index_args(),
        )
        grid = (cdiv(rows.rows, rows_per_tile),)
        sizes = launch_block(norm_forward, block=block, tile=rows_per_tile * block, elements_per_warp=1024)
        return [Launch(norm_forward, grid, args, sizes)]

    def backward_launches(self, ctx: OpContext) -> list[Launch]:
        x = ctx.inputs[0]
        w, _ = self._affine([x, *ctx.params])
        (dx,) = ctx.grad_inputs
        dw, db = self._affine([dx, *ctx.grad_params])
        rows = self.stats_rows(x.shape)
        rows_per_tile, block = tile_shape(rows.rows, rows.row_len, ctx.dtype)
        if rows.channel_is_row:  # a row is a whole channel: its sums are dw, db
            target = PER_ROW
        elif rows.channel == COLUMN_CHANNEL and rows.row_len <= block:  # fused: partial rows per program
            target = PER_PROGRAM
        else:
            target = None  # norm_weight_backward
        fused = target is not None and (dw is not None or db is not None)
        n_tiles = cdiv(rows.rows, rows_per_tile)
        tiles_per_program = max(1, cdiv(n_tiles, max_programs())) if fused and target == PER_PROGRAM else 1
        n_programs = cdiv(n_tiles, tiles_per_program)

        if target == PER_PROGRAM:
            dw_out, db_out, both = _partial_rows(ctx, dw, db, n=n_programs, channels=rows.row_len)
        else:
            dw_out, db_out = (None if target is None else dw), (None if target is None else db)
        launches = []
        if dx is not None or fused:
            args = ArgVisitor().visit(
                x_ptr=x,
                w_ptr=w,
                dy_ptr=ctx.grad_output,
                dx_ptr=dx,
                dx_add_ptr=ctx.grad_input_addend if dx is not None else None,
                dx_copy_ptr=self.grad_copy(ctx) if dx is not None else None,
                mean_ptr=ctx.saved.get("mean"),
                rstd_ptr=ctx.saved["rstd"],
                dw_ptr=dw_out,
                db_ptr=db_out,
                tiles_per_program=tiles_per_program,
                w_offset=self.weight_offset,
                STATS=self.stats_source(),
                AFFINE_GRAD=target if target is not None else PER_ROW,  # unused without dw_ptr / db_ptr
                COMPUTE=tl_acc_dtype(ctx.dtype),
                ROWS=rows_per_tile,
                **rows.index_args(),
                **_dy_layout(ctx),
            )
            sizes = launch_block(norm_backward, block=block, tile=rows_per_tile * block, elements_per_warp=512)
            launches.append(Launch(norm_backward, (n_programs,), args, sizes))
        if fused and target == PER_PROGRAM:
            launches += _sum_partial_rows(dw, db, dw_partial=dw_out, db_partial=db_out, both=both)
        if target is None and (dw is not None or db is not None):
            launches += self._weight_backward(ctx, rows, dw, db)
        return launches

    def _weight_backward(self, ctx: OpContext, rows: Rows, dw, db) -> list[Launch]:
        """dw/db through norm_weight_backward's partial rows and ``sum_partials``."""
        x, channels, spatial = ctx.inputs[0], rows.channels, rows.spatial
        outer = x.numel() // max(channels * spatial, 1)
        n_partials = cdiv(outer, tiling.ROWS_PER_WEIGHT_PROGRAM)
        block_s = min(pow2(spatial), 256)
        block_c = max(1, min(pow2(channels), 2048 // block_s, 1024))
        dw_partial, db_partial, both = _partial_rows(ctx, dw, db, n=n_partials, channels=channels)
        args = ArgVisitor().visit(
            x_ptr=x,
            dy_ptr=ctx.grad_output,
            mean_ptr=ctx.saved.get("mean"),
            rstd_ptr=ctx.saved["rstd"],
            dw_partial_ptr=dw_partial,
            db_partial_ptr=db_partial,
            outer=outer,
            channels=channels,
            groups=rows.groups,
            SPATIAL=spatial,
            ROWS_PER_PROGRAM=tiling.ROWS_PER_WEIGHT_PROGRAM,
            COMPUTE=tl_acc_dtype(ctx.dtype),
            BLOCK_C=block_c,
            BLOCK_S=block_s,
            **_dy_layout(ctx),
        )
        launches = [Launch(norm_weight_backward, (n_partials, cdiv(channels, block_c)), args)]
        return launches + _sum_partial_rows(dw, db, dw_partial=dw_partial, db_partial=db_partial, both=both)


def _partial_rows(ctx: OpContext, dw, db, *, n: int, channels: int) -> tuple:
    """Float32 (float64) buffers of n partial rows for dw and for db (None where that gradient
    is not wanted), and, when both are, the one (2, n, channels) buffer they are halves of."""
    dtype = acc_dtype(ctx.dtype)
    if dw is not None and db is not None:
        both = ctx.empty((2, n, channels), dtype)
        return both[0], both[1], both
    return *(ctx.empty((n, channels), dtype) if g is not None else None for g in (dw, db)), None


def _sum_partial_rows(dw, db, *, dw_partial, db_partial, both) -> list[Launch]:
    """dw and db from their partial rows (``_partial_rows``): both in one launch when both are wanted."""
    if both is not None:
        return sum_partials(both, dw, db)
    return [launch for grad, rows in ((dw, dw_partial), (db, db_partial)) if grad is not None
            for launch in sum_partials(rows, grad)]  # fmt: skip


class LayerNormOp(NormOp):
    """layer_norm / rms_norm: each row of prod(normalized_shape) trailing elements. ``out_dtype``:
    y written in that dtype (computed as always in x's float32 or float64), dy read in it.
    ``weight_offset``: the scale is weight + weight_offset (Gemma's RMSNorm: 1)."""

    def __init__(self, normalized_shape, *, eps, has_weight, has_bias, centred=True, out_dtype=None, weight_offset=0.0):
        name = "layer_norm" if centred else "rms_norm"
        super().__init__(name, eps=eps, has_weight=has_weight, has_bias=has_bias)
        self.normalized_shape = tuple(normalized_shape)
        self.centred = centred
        if weight_offset and not has_weight:
            raise ValueError(f"{name}: weight_offset={weight_offset} offsets a weight, but no weight was given")
        self.weight_offset = float(weight_offset)
        if out_dtype is not None and not out_dtype.is_floating_point:
            raise TypeError(f"{self.name}: out_dtype must be a floating-point dtype, got {dtype_name(out_dtype)}")
        self.out_dtype = out_dtype

    def affine_shape(self, shape):
        return self.normalized_shape

    def stats_rows(self, shape):
        row_len = math.prod(self.normalized_shape)
        rows = math.prod(shape[: len(shape) - len(self.normalized_shape)])
        return Rows(
            rows=rows,
            row_len=row_len,
            inner=row_len,
            row_stride=row_len,
            outer_stride=0,
            spatial=1,
            channels=row_len,
            groups=1,
        )

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape, ns = tuple(input_shapes[0]), self.normalized_shape
        if len(ns) == 0 or len(shape) < len(ns) or shape[len(shape) - len(ns) :] != ns:
            raise ValueError(
                f"given normalized_shape={list(ns)}, expected input with shape [*, "
                f"{', '.join(str(s) for s in ns)}], but got input of size {shape_text(shape)}"
            )


class GroupNormOp(NormOp):
    """group_norm over x of shape (N, C, *): rows are (n, group), C / num_groups channels each."""

    def __init__(self, num_groups, *, eps, has_weight, has_bias):
        super().__init__("group_norm", eps=eps, has_weight=has_weight, has_bias=has_bias)
        self.num_groups = int(num_groups)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def stats_rows(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        row_len = (c // self.num_groups) * spatial
        return Rows(
            rows=n * self.num_groups,
            row_len=row_len,
            inner=row_len,
            row_stride=row_len,
            outer_stride=0,
            spatial=spatial,
            channels=c,
            groups=self.num_groups,
        )

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ValueError(f"group_norm expects an input of shape (N, C, *), got {shape_text(shape)}")
        if self.num_groups <= 0 or shape[1] % self.num_groups:
            raise ValueError(
                f"expected the number of channels ({shape[1]}) to be divisible by num_groups "
                f"({self.num_groups}), but got input of shape {shape_text(shape)}"
            )


class BatchNormOp(NormOp):
    """batch_norm over x of shape (N, C, *): one statistics row per channel. Inputs: x,
    running_mean, running_var (when given), weight, bias (when given)."""

    strided_grad_output = False  # its rows (channels) gather dy across rows of the gradient

    def __init__(self, *, has_running, training, momentum, eps, has_weight, has_bias):
        n_running = 2 if has_running else 0
        super().__init__("batch_norm", eps=eps, has_weight=has_weight, has_bias=has_bias, n_running=n_running)
        self.has_running, self.training, self._momentum = has_running, bool(training), float(momentum)

    def affine_shape(self, shape):
        return (shape[1],) if len(shape) >= 2 else (0,)

    def stats_rows(self, shape):
        n, c, spatial = shape[0], shape[1], math.prod(shape[2:])
        return Rows(
            rows=c,
            row_len=n * spatial,
            inner=spatial,
            row_stride=spatial,
            outer_stride=c * spatial,
            spatial=spatial,
            channels=c,
            groups=c,
            channel_is_row=True,
        )

    def check_inputs(self, input_shapes, input_dtypes):
        super().check_inputs(input_shapes, input_dtypes)
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ValueError(f"batch_norm expects an input of shape (N, C, *), got {shape_text(shape)}")
        if self.training and shape[0] * math.prod(shape[2:]) <= 1:
            raise ValueError(
                f"expected more than 1 value per channel when training, got input of size {shape_text(shape)}"
            )

    def stats_source(self):
        return BATCH_STATS if self.training else RUNNING_STATS

    def running_stats(self, ctx):
        return (ctx.params[0], ctx.params[1]) if self.has_running else (None, None)

    def mutated_inputs(self):
        """In training the forward writes the running statistics (its params 0 and 1) in place."""
        return (1, 2) if self.training and self.has_running else ()

    def momentum(self):
        return self._momentum
