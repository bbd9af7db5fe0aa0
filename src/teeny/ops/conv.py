"""2-D convolution and pooling: ``conv2d``, ``max_pool2d``, ``avg_pool2d`` (torch.nn.functional semantics).

conv2d is an implicit GEMM per group g (no im2col buffer; every operand tile is a masked gather):

    forward  Y[n, co, oh, ow] = b[co] + sum_{c, kh, kw} X[n, c, ih, iw] * W[co, c, kh, kw]
             with ih = oh*sh - ph + kh*dh, iw = ow*sw - pw + kw*dw (zero outside X):
             a (N*HO*WO) x COG tile of Y, looping over K = CG*KH*KW.
    dX       dX[n, c, ih, iw] = sum_{co, kh, kw} dY[n, co, oh, ow] * W[co, c, kh, kw] over the
             (oh, ow) with oh*sh = ih + ph - kh*dh (a gather over output positions, no atomics):
             a (N*H*W) x CG tile of dX, looping over COG*KH*KW.
    dW, db   dW[co, c, kh, kw] = sum_{n, oh, ow} dY[n, co, oh, ow] * X[n, c, ih, iw] and
             db[co] = sum_{n, oh, ow} dY[n, co, oh, ow]: a COG x K tile per chunk of the
             N*HO*WO positions, written as fp32 partials and summed by a second pass
             (``common.sum_partials``); db comes from the same dY tiles (fused).

Pooling shares one kernel pair (MODE, MAX_POOL or AVG_POOL, selects the maths): the forward
walks each output's window (padding is -inf for max, zeros for avg); max keeps the first
maximum in scan order (a NaN wins, like PyTorch's CPU kernel) and saves its plane index
ih*W + iw, which ``max_pool2d(..., return_indices=True)`` also returns (as int64, like PyTorch:
a second node runs the forward kernel writing only the indices). The backward is a gather over
input positions, with or without overlapping windows, no atomics:

    max  dX[i] = sum of dY[o] over the windows o that contain i and whose saved arg-max is i
    avg  dX[i] = sum of dY[o] / divisor(o) over the windows o that contain i

Half inputs compute in float32, float64 in float64. The dots' precision is matmul's
(``linear.dot_precision``): float64 exact, float32 tf32x3 on the GPU (as accurate as full
precision) or tf32 when ``teeny.core.config.allow_tf32`` was set before tracing; bfloat16 operands
are upcast to float32 before ``tl.dot`` under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core import config as teeny_config
from ..core import init
from ..core.common import DOT_UPCAST_BF16, acc_dtype, cdiv, sum_partials, sum_to_shape_kernel, tl_acc_dtype
from ..core.device import INTERPRETER
from ..core.graph import graph_of
from ..core.kernel import kernel
from ..core.module import Module, Parameter
from ..core.runtime import ArgVisitor, Launch, RuntimeOp
from .products.kernels import dot_precision

__all__ = ["conv2d", "max_pool2d", "avg_pool2d"]
NN_LAYERS = ["Conv2d", "MaxPool2d", "AvgPool2d"]


# ----------------------------------------------------------------------------- kernels


@kernel(half=True)
def conv2d_input_backward(
    dy_ptr,
    w_ptr,
    dx_ptr,
    C,
    H,
    W,
    CO,
    HO,
    WO,
    M,
    CG,
    COG,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dX tile (input positions x input channels of group g) = gathered dY @ W (see module)."""
    g = tl.program_id(2)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_c = offs_c < CG
    HW = H * W
    HOWO = HO * WO
    n = offs_m // HW
    q = offs_m % HW
    ih = (q // W).to(tl.int32)
    iw = (q % W).to(tl.int32)
    KHKW = KH * KW
    K = COG * KHKW
    dy_rows = dy_ptr + n * CO * HOWO
    w_base = w_ptr + (g * COG).to(tl.int64) * CG * KHKW
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        co = k // KHKW
        r = k % KHKW
        kh = r // KW
        kw = r % KW
        oh_num = ih[:, None] + pad_h - (kh * dil_h)[None, :]
        ow_num = iw[:, None] + pad_w - (kw * dil_w)[None, :]
        ok = (oh_num >= 0) & (ow_num >= 0)
        oh_num = tl.where(ok, oh_num, 0)
        ow_num = tl.where(ok, ow_num, 0)
        oh = oh_num // stride_h
        ow = ow_num // stride_w
        ok = ok & (oh * stride_h == oh_num) & (ow * stride_w == ow_num) & (oh < HO) & (ow < WO)
        ok = ok & mask_m[:, None] & mask_k[None, :]
        a = tl.load(dy_rows[:, None] + ((g * COG + co).to(tl.int64) * HOWO)[None, :] + oh * WO + ow, mask=ok, other=0.0)
        b = tl.load(
            w_base + (co.to(tl.int64) * CG * KHKW + r)[:, None] + (offs_c * KHKW)[None, :],
            mask=mask_k[:, None] & mask_c[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    dx = dx_ptr + (n * C * HW + q)[:, None] + ((g * CG + offs_c).to(tl.int64) * HW)[None, :]
    tl.store(dx, acc.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


@kernel(half=True, optional=("dw_ptr", "db_ptr"))
def conv2d_weight_backward(
    x_ptr,
    dy_ptr,
    dw_ptr,
    db_ptr,
    C,
    H,
    W,
    CO,
    HO,
    WO,
    P,
    CG,
    COG,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    chunk,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_CO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One chunk of positions of dW (COG x K tile of group g) = dY^T @ gathered X, and of db
    (column sums of the same dY tiles); written to partials[split] (see module)."""
    KHKW = KH * KW
    K = CG * KHKW
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_co = tl.program_id(0) // tiles_k
    pid_k = tl.program_id(0) % tiles_k
    split = tl.program_id(1)
    g = tl.program_id(2)
    offs_co = pid_co * BLOCK_CO + tl.arange(0, BLOCK_CO)
    mask_co = offs_co < COG
    co = (g * COG + offs_co).to(tl.int64)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = k < K
    c = k // KHKW
    r = k % KHKW
    kh = r // KW
    kw = r % KW
    HW = H * W
    HOWO = HO * WO
    x_cols = x_ptr + (g * CG + c).to(tl.int64) * HW
    acc = tl.zeros((BLOCK_CO, BLOCK_K), dtype=ACC)
    bias_acc = tl.zeros((BLOCK_CO,), dtype=ACC)
    start = split.to(tl.int64) * chunk
    for p0 in range(0, chunk, BLOCK_P):
        p = start + p0 + tl.arange(0, BLOCK_P)
        mask_p = p < P
        n = p // HOWO
        s = p % HOWO
        a = tl.load(
            dy_ptr + (n * CO * HOWO + s)[None, :] + (co * HOWO)[:, None],
            mask=mask_co[:, None] & mask_p[None, :],
            other=0.0,
        )
        if db_ptr is not None:
            bias_acc += tl.sum(a.to(ACC), axis=1)
        if dw_ptr is not None:
            oh = (s // WO).to(tl.int32)
            ow = (s % WO).to(tl.int32)
            ih = (oh * stride_h - pad_h)[:, None] + (kh * dil_h)[None, :]
            iw = (ow * stride_w - pad_w)[:, None] + (kw * dil_w)[None, :]
            ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & mask_p[:, None] & mask_k[None, :]
            b = tl.load(x_cols[None, :] + (n * C * HW)[:, None] + ih * W + iw, mask=ok, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if dw_ptr is not None:
        dw = dw_ptr + split.to(tl.int64) * CO * K + co[:, None] * K + k[None, :]
        tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=mask_co[:, None] & mask_k[None, :])
    if db_ptr is not None:
        tl.store(
            db_ptr + split.to(tl.int64) * CO + co, bias_acc.to(db_ptr.dtype.element_ty), mask=mask_co & (pid_k == 0)
        )


@kernel(backward=(conv2d_input_backward, conv2d_weight_backward, sum_to_shape_kernel), half=True, optional=("b_ptr",))
def conv2d_forward(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    C,
    H,
    W,
    CO,
    HO,
    WO,
    M,
    CG,
    COG,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    ACC: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Y tile (output positions x output channels of group g) = gathered X @ W^T + b (see module)."""
    g = tl.program_id(2)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_co = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_co = offs_co < COG
    HW = H * W
    HOWO = HO * WO
    n = offs_m // HOWO
    s = offs_m % HOWO
    ih0 = (s // WO).to(tl.int32) * stride_h - pad_h
    iw0 = (s % WO).to(tl.int32) * stride_w - pad_w
    KHKW = KH * KW
    K = CG * KHKW
    x_rows = x_ptr + n * C * HW + (g * CG).to(tl.int64) * HW
    co = (g * COG + offs_co).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        c = k // KHKW
        r = k % KHKW
        ih = ih0[:, None] + ((r // KW) * dil_h)[None, :]
        iw = iw0[:, None] + ((r % KW) * dil_w)[None, :]
        ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & mask_m[:, None] & mask_k[None, :]
        a = tl.load(x_rows[:, None] + (c.to(tl.int64) * HW)[None, :] + ih * W + iw, mask=ok, other=0.0)
        b = tl.load(w_ptr + (co * K)[None, :] + k[:, None], mask=mask_k[:, None] & mask_co[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if b_ptr is not None:
        acc += tl.load(b_ptr + co, mask=mask_co, other=0.0).to(ACC)[None, :]
    y = y_ptr + (n * CO * HOWO + s)[:, None] + (co * HOWO)[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_co[None, :])


MAX_POOL = tl.constexpr(0)  # pooling modes (the MODE constexpr)
AVG_POOL = tl.constexpr(1)


@kernel(half=True, optional=("idx_ptr",))
def pool2d_backward(
    dy_ptr,
    idx_ptr,
    dx_ptr,
    n,
    H,
    W,
    HO,
    WO,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    divisor,
    MODE: tl.constexpr,
    COUNT_PAD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dX[i] gathered from the windows that contain input position i (see module)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    HW = H * W
    plane = offs // HW
    q = (offs % HW).to(tl.int32)
    ih = q // W
    iw = q % W
    dy_plane = dy_ptr + plane * HO * WO
    acc = tl.zeros((BLOCK,), dtype=ACC)
    for kh in range(0, KH):
        oh_num = ih + pad_h - kh * dil_h
        ok_h = oh_num >= 0
        oh = tl.where(ok_h, oh_num, 0) // stride_h
        ok_h = ok_h & (oh * stride_h == oh_num) & (oh < HO)
        # avg: the window's extent along h (clipped to the padded input; to the input if not COUNT_PAD)
        h0 = oh * stride_h - pad_h
        h1 = tl.minimum(h0 + KH, H + pad_h)
        if not COUNT_PAD:
            h0 = tl.maximum(h0, 0)
            h1 = tl.minimum(h1, H)
        for kw in range(0, KW):
            ow_num = iw + pad_w - kw * dil_w
            ok = ok_h & (ow_num >= 0) & mask
            ow = tl.where(ok, ow_num, 0) // stride_w
            ok = ok & (ow * stride_w == ow_num) & (ow < WO)
            o = oh * WO + ow
            dy = tl.load(dy_plane + o, mask=ok, other=0.0).to(ACC)
            if MODE == MAX_POOL:
                hit = tl.load(idx_ptr + plane * HO * WO + o, mask=ok, other=-1) == q
                acc += tl.where(hit, dy, 0.0)
            else:
                if divisor != 0:
                    acc += dy / divisor
                else:
                    w0 = ow * stride_w - pad_w
                    w1 = tl.minimum(w0 + KW, W + pad_w)
                    if not COUNT_PAD:
                        w0 = tl.maximum(w0, 0)
                        w1 = tl.minimum(w1, W)
                    acc += dy / tl.maximum((h1 - h0) * (w1 - w0), 1).to(ACC)
    tl.store(dx_ptr + offs, acc.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(backward=pool2d_backward, half=True, optional=("y_ptr", "idx_ptr"))
def pool2d_forward(
    x_ptr,
    y_ptr,
    idx_ptr,
    n,
    H,
    W,
    HO,
    WO,
    KH,
    KW,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dil_h,
    dil_w,
    divisor,
    MODE: tl.constexpr,
    COUNT_PAD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Y[o] = max (saving the arg-max when idx_ptr is given) or mean of output o's window (see
    module); y_ptr None: only the arg-max (return_indices)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    HOWO = HO * WO
    plane = offs // HOWO
    s = (offs % HOWO).to(tl.int32)
    h0 = (s // WO) * stride_h - pad_h
    w0 = (s % WO) * stride_w - pad_w
    x_plane = x_ptr + plane * H * W
    best = tl.full((BLOCK,), float("-inf"), ACC)
    best_index = tl.full((BLOCK,), -1, tl.int32)
    total = tl.zeros((BLOCK,), dtype=ACC)
    for kh in range(0, KH):
        ih = h0 + kh * dil_h
        ok_h = (ih >= 0) & (ih < H) & mask
        for kw in range(0, KW):
            iw = w0 + kw * dil_w
            ok = ok_h & (iw >= 0) & (iw < W)
            v = tl.load(x_plane + ih * W + iw, mask=ok, other=0.0).to(ACC)
            if MODE == MAX_POOL:
                take = ok & ((v > best) | (v != v) | (best_index < 0))
                best = tl.where(take, v, best)
                best_index = tl.where(take, ih * W + iw, best_index)
            else:
                total += v
    if MODE == MAX_POOL:
        if y_ptr is not None:
            tl.store(y_ptr + offs, best.to(y_ptr.dtype.element_ty), mask=mask)
        if idx_ptr is not None:
            tl.store(idx_ptr + offs, best_index.to(idx_ptr.dtype.element_ty), mask=mask)
    else:
        if divisor != 0:
            total = total / divisor
        else:
            h1 = tl.minimum(h0 + KH, H + pad_h)
            w1 = tl.minimum(w0 + KW, W + pad_w)
            if not COUNT_PAD:
                h0 = tl.maximum(h0, 0)
                w0 = tl.maximum(w0, 0)
                h1 = tl.minimum(h1, H)
                w1 = tl.minimum(w1, W)
            total = total / tl.maximum((h1 - h0) * (w1 - w0), 1).to(ACC)
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------- argument handling


def _pair(value, what: str, op: str) -> tuple[int, int]:
    """An int or a sequence of one or two ints, as a pair (like torch's _pair)."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {what} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) in (1, 2)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])
    raise TypeError(f"{op}: {what} must be an int or a pair of ints, got {value!r}")


def _spatial(shape, op: str) -> tuple[int, int, int, int]:
    """(N, C, H, W) of a (N, C, H, W) or unbatched (C, H, W) input."""
    if len(shape) == 4:
        return tuple(shape)
    if len(shape) == 3:
        return (1,) + tuple(shape)
    raise ValueError(f"{op}: expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape {tuple(shape)}")


def _block(size: int, low: int, high: int) -> int:
    """The power of two covering ``size``, clamped to [low, high]."""
    return max(low, min(high, triton.next_power_of_2(max(size, 1))))


# ------------------------------------------------------------------------------- conv2d


@dataclass(frozen=True)
class ConvGeometry:
    N: int
    C: int
    H: int
    W: int
    CO: int
    CG: int  # input channels per group
    COG: int  # output channels per group
    KH: int
    KW: int
    HO: int
    WO: int
    pad: tuple[int, int]  # top, left (a "same" padding's extra goes to the bottom/right)

    def sizes(self) -> dict[str, int]:
        """The geometry arguments every conv kernel takes, by name."""
        return dict(C=self.C, H=self.H, W=self.W, CO=self.CO, HO=self.HO, WO=self.WO, CG=self.CG, COG=self.COG,
                    KH=self.KH, KW=self.KW)  # fmt: skip


if INTERPRETER:  # few, large program instances
    _CONV_BLOCK_M, _CONV_MAX_N, _CONV_MAX_K, _WGRAD_BLOCK_P = 512, 64, 64, 512
    _WGRAD_TARGET_PROGRAMS, _WGRAD_MIN_CHUNK, _POOL_BLOCK = 4, 512, 16384
else:
    _CONV_BLOCK_M, _CONV_MAX_N, _CONV_MAX_K, _WGRAD_BLOCK_P = 64, 64, 32, 32
    _WGRAD_TARGET_PROGRAMS, _WGRAD_MIN_CHUNK, _POOL_BLOCK = 1024, 256, 256


class Conv2dOp(RuntimeOp):
    """F.conv2d(input, weight, bias, stride, padding, dilation, groups)."""

    name = "conv2d"
    kernel = conv2d_forward
    n_activation_inputs = 1
    saves_inputs = (0, 1)  # X for dW, W for dX
    grad_over_input = True

    def __init__(self, has_bias: bool, stride, padding, dilation, groups):
        self.has_bias = has_bias
        self.stride = _pair(stride, "stride", "conv2d")
        self.dilation = _pair(dilation, "dilation", "conv2d")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"conv2d: padding must be 'same', 'valid', an int or a pair, got {padding!r}")
            if padding == "same" and self.stride != (1, 1):
                raise ValueError("conv2d: padding='same' is not supported for strided convolutions")
            self.padding = padding
        else:
            self.padding = _pair(padding, "padding", "conv2d")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"conv2d: groups must be a positive int, got {groups!r}")
        self.groups = groups
        if min(self.stride) < 1:
            raise ValueError(f"conv2d: stride must be positive, got {self.stride}")
        if min(self.dilation) < 1:
            raise ValueError(f"conv2d: dilation must be positive, got {self.dilation}")
        if not isinstance(self.padding, str) and min(self.padding) < 0:
            raise ValueError(f"conv2d: padding must be non-negative, got {self.padding}")
        self.allow_tf32 = teeny_config.allow_tf32  # read at trace time

    def param_shapes(self, input_shapes):
        return [None, None] if self.has_bias else [None]

    def check_inputs(self, input_shapes, input_dtypes):
        if not all(d.is_floating_point for d in input_dtypes):
            raise TypeError(f"conv2d: expects floating point tensors, got {[str(d) for d in input_dtypes]}")
        w = input_shapes[1]
        if len(w) != 4:
            raise ValueError(
                f"conv2d: weight must be 4-D (out_channels, in_channels/groups, kH, kW), got shape {tuple(w)}"
            )
        self.geometry(input_shapes)
        if self.has_bias and tuple(input_shapes[2]) != (w[0],):
            raise ValueError(
                f"conv2d: bias must have shape ({w[0]},) to match weight {tuple(w)}, got {tuple(input_shapes[2])}"
            )

    def geometry(self, input_shapes) -> ConvGeometry:
        x, w = input_shapes[0], input_shapes[1]
        N, C, H, W = _spatial(x, "conv2d")
        CO, CG, KH, KW = w
        if CG * self.groups != C:
            raise ValueError(
                f"conv2d: input {tuple(x)} has {C} channels, but weight {tuple(w)} with groups="
                f"{self.groups} expects {CG * self.groups} (in_channels/groups = {CG})"
            )
        if CO % self.groups:
            raise ValueError(f"conv2d: out_channels {CO} of weight {tuple(w)} is not divisible by groups={self.groups}")
        (sh, sw), (dh, dw) = self.stride, self.dilation
        eff_h, eff_w = dh * (KH - 1) + 1, dw * (KW - 1) + 1
        if self.padding == "same":
            total_h, total_w = eff_h - 1, eff_w - 1
            pad, padded = (total_h // 2, total_w // 2), (H + total_h, W + total_w)
        else:
            pad = (0, 0) if self.padding == "valid" else self.padding
            padded = (H + 2 * pad[0], W + 2 * pad[1])
        if padded[0] < eff_h or padded[1] < eff_w:
            raise ValueError(
                f"conv2d: padded input size per channel ({padded[0]} x {padded[1]}) is smaller than the "
                f"(dilated) kernel size ({eff_h} x {eff_w}) of weight {tuple(w)}"
            )
        HO, WO = (padded[0] - eff_h) // sh + 1, (padded[1] - eff_w) // sw + 1
        return ConvGeometry(N, C, H, W, CO, CG, CO // self.groups, KH, KW, HO, WO, pad)

    def output_shape(self, input_shapes):
        g = self.geometry(input_shapes)
        batch = (g.N,) if len(input_shapes[0]) == 4 else ()
        return batch + (g.CO, g.HO, g.WO)

    def flops(self, input_shapes, grad_mask):
        g = self.geometry(input_shapes)
        one = 2 * g.N * g.CO * g.HO * g.WO * g.CG * g.KH * g.KW
        return one, one * (bool(grad_mask[0]) + bool(grad_mask[1]))  # dX, dW

    def _window(self, g: ConvGeometry) -> dict[str, int]:
        (sh, sw), (dh, dw) = self.stride, self.dilation
        return dict(stride_h=sh, stride_w=sw, pad_h=g.pad[0], pad_w=g.pad[1], dil_h=dh, dil_w=dw)

    def _dot(self, dtype: torch.dtype) -> dict:
        return dict(
            ACC=tl_acc_dtype(dtype),
            PRECISION=dot_precision(dtype, self.allow_tf32),
            UPCAST=dtype == torch.bfloat16 and DOT_UPCAST_BF16,
        )

    def _gemm(self, ctx, kernel_, g: ConvGeometry, pointers: dict, positions: int, cols: int, depth: int) -> Launch:
        """One implicit GEMM over ``positions`` x ``cols`` per group, contracting ``depth``."""
        dtype = ctx.dtype
        half = dtype in (torch.float16, torch.bfloat16)
        block_m = _CONV_BLOCK_M * (2 if half and not INTERPRETER else 1)
        block_n = _block(cols, 16, _CONV_MAX_N)
        block_k = _block(depth, 16, 16 if dtype == torch.float64 and not INTERPRETER else _CONV_MAX_K)
        args = ArgVisitor().visit(**pointers, **g.sizes(), M=positions, **self._window(g), **self._dot(dtype))
        args.visit(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        grid = (cdiv(positions, block_m), cdiv(cols, block_n), self.groups)
        return Launch(kernel_, grid, args, work=positions * cols * self.groups)

    def forward_launches(self, ctx):
        g = self.geometry(ctx.input_shapes)
        (x,), w = ctx.inputs, ctx.params[0]
        bias = ctx.params[1] if self.has_bias else None
        pointers = dict(x_ptr=x, w_ptr=w, b_ptr=bias, y_ptr=ctx.output)
        return [self._gemm(ctx, conv2d_forward, g, pointers, g.N * g.HO * g.WO, g.COG, g.CG * g.KH * g.KW)]

    def backward_launches(self, ctx):
        g = self.geometry(ctx.input_shapes)
        (x,), w = ctx.inputs, ctx.params[0]
        (dx,), dw = ctx.grad_inputs, ctx.grad_params[0]
        db = ctx.grad_params[1] if self.has_bias else None
        go = ctx.grad_output
        launches = []
        if dw is not None or db is not None:
            launches += self._weight_backward(ctx, g, x, go, dw, db)
        if dx is not None:  # after dW, which reads x: dX may be written over x (grad_over_input)
            pointers = dict(dy_ptr=go, w_ptr=w, dx_ptr=dx)
            launches.append(
                self._gemm(ctx, conv2d_input_backward, g, pointers, g.N * g.H * g.W, g.CG, g.COG * g.KH * g.KW)
            )
        return launches

    def _weight_backward(self, ctx, g: ConvGeometry, x, go, dw, db) -> list[Launch]:
        """dW and db over the N*HO*WO positions, split into chunks: fp32 partials per chunk,
        then ``sum_partials`` (one chunk: written directly)."""
        dtype = ctx.dtype
        K = g.CG * g.KH * g.KW
        positions = g.N * g.HO * g.WO
        block_co = _block(g.COG, 16, 64)
        block_k = _block(K, 16, 64 if INTERPRETER else 32) if dw is not None else 16
        tiles = cdiv(g.COG, block_co) * (cdiv(K, block_k) if dw is not None else 1)
        splits = max(1, min(cdiv(positions, _WGRAD_MIN_CHUNK), _WGRAD_TARGET_PROGRAMS // (tiles * self.groups)))
        chunk = cdiv(cdiv(max(positions, 1), splits), _WGRAD_BLOCK_P) * _WGRAD_BLOCK_P
        splits = max(1, cdiv(positions, chunk))
        acc = acc_dtype(dtype)
        dw_out = dw if splits == 1 or dw is None else ctx.empty((splits, g.CO * K), acc)
        db_out = db if splits == 1 or db is None else ctx.empty((splits, g.CO), acc)
        args = ArgVisitor().visit(x_ptr=x, dy_ptr=go, dw_ptr=dw_out, db_ptr=db_out, **g.sizes(), P=positions)
        args.visit(**self._window(g), chunk=chunk, **self._dot(dtype))
        args.visit(BLOCK_CO=block_co, BLOCK_K=block_k, BLOCK_P=_WGRAD_BLOCK_P)
        # the gradients have work (zeros) even for an empty batch
        launches = [Launch(conv2d_weight_backward, (tiles, splits, self.groups), args, work=g.CO * K)]
        if splits > 1:
            if dw is not None:
                launches += sum_partials(dw_out, dw.view(-1))
            if db is not None:
                launches += sum_partials(db_out, db)
        return launches


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv2d: input (N, C_in, H, W) or (C_in, H, W), weight (C_out, C_in/groups, kH, kW),
    bias (C_out,); stride/padding/dilation an int or a pair; padding also 'same' or 'valid'."""
    inputs = [input, weight] + ([bias] if bias is not None else [])
    return graph_of(*inputs).apply(Conv2dOp(bias is not None, stride, padding, dilation, groups), inputs)


# ------------------------------------------------------------------------------ pooling


def _pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape (a ceil-mode window must start inside the input or left padding)."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


class Pool2dOp(RuntimeOp):
    """max_pool2d / avg_pool2d: one kernel pair, MODE chooses the maths."""

    kernel = pool2d_forward
    saves_inputs = False  # the backward needs only the shapes (and max's saved arg-max)

    def __init__(
        self,
        is_max: bool,
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode: bool,
        count_include_pad: bool = True,
        divisor_override=None,
    ):
        self.is_max = is_max
        self.name = "max_pool2d" if is_max else "avg_pool2d"
        self.kernel_size = _pair(kernel_size, "kernel_size", self.name)
        self.stride = (
            self.kernel_size if stride is None or stride == () or stride == [] else _pair(stride, "stride", self.name)
        )
        self.padding = _pair(padding, "padding", self.name)
        self.dilation = _pair(dilation, "dilation", self.name)
        self.ceil_mode = bool(ceil_mode)
        self.count_include_pad = bool(count_include_pad)
        if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
            raise ValueError(f"{self.name}: divisor_override must be a non-zero int, got {divisor_override!r}")
        self.divisor = divisor_override or 0
        if min(self.kernel_size) < 1:
            raise ValueError(f"{self.name}: kernel_size must be positive, got {self.kernel_size}")
        if min(self.stride) < 1:
            raise ValueError(f"{self.name}: stride must be positive, got {self.stride}")
        if min(self.dilation) < 1:
            raise ValueError(f"{self.name}: dilation must be positive, got {self.dilation}")
        for p, k, d in zip(self.padding, self.kernel_size, self.dilation):
            limit = ((k - 1) * d + 1) // 2 if is_max else k // 2
            if p < 0 or p > limit:
                what = "effective kernel size" if is_max else "kernel size"
                raise ValueError(
                    f"{self.name}: pad should be at most half of {what}, but got pad={p}, "
                    f"kernel_size={k}" + (f" and dilation={d}" if is_max else "")
                )

    def check_inputs(self, input_shapes, input_dtypes):
        if not input_dtypes[0].is_floating_point:
            raise TypeError(f"{self.name}: expects a floating point input, got {input_dtypes[0]}")
        self.output_shape(input_shapes)

    def output_shape(self, input_shapes):
        x = input_shapes[0]
        N, C, H, W = _spatial(x, self.name)
        HO, WO = (
            _pool_output_size(size, k, s, p, d, self.ceil_mode)
            for size, k, s, p, d in zip((H, W), self.kernel_size, self.stride, self.padding, self.dilation)
        )
        if HO < 1 or WO < 1:
            raise ValueError(
                f"{self.name}: input of shape {tuple(x)} is too small for kernel_size {self.kernel_size}, "
                f"stride {self.stride}, padding {self.padding}, dilation {self.dilation}: "
                f"the output would be {HO} x {WO}"
            )
        return tuple(x[:-2]) + (HO, WO)

    def extra_outputs(self, input_shapes, dtype):
        if not self.is_max:
            return {}
        H, W = input_shapes[0][-2:]
        index_dtype = torch.int32 if H * W < 2**31 else torch.int64
        return {"indices": (self.output_shape(input_shapes), index_dtype)}

    def block(self):
        return _POOL_BLOCK

    def _args(self, ctx, n: int, **pointers) -> ArgVisitor:
        (H, W), (HO, WO) = ctx.input_shapes[0][-2:], ctx.output_shape[-2:]
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        return ArgVisitor().visit(
            **pointers, n=n, H=H, W=W, HO=HO, WO=WO, KH=kh, KW=kw, stride_h=sh, stride_w=sw, pad_h=ph, pad_w=pw,
            dil_h=dh, dil_w=dw, divisor=self.divisor, MODE=MAX_POOL if self.is_max else AVG_POOL,
            COUNT_PAD=self.count_include_pad, ACC=tl_acc_dtype(ctx.dtype),
        )  # fmt: skip

    def forward_launches(self, ctx):
        (x,), y = ctx.inputs, ctx.output
        args = self._args(ctx, y.numel(), x_ptr=x, y_ptr=y, idx_ptr=ctx.saved.get("indices"))
        return [Launch(pool2d_forward, (cdiv(y.numel(), _POOL_BLOCK),), args, _POOL_BLOCK)]

    def backward_launches(self, ctx):
        (dx,) = ctx.grad_inputs
        args = self._args(ctx, dx.numel(), dy_ptr=ctx.grad_output, idx_ptr=ctx.saved.get("indices"), dx_ptr=dx)
        return [Launch(pool2d_backward, (cdiv(dx.numel(), _POOL_BLOCK),), args, _POOL_BLOCK, work=dx.numel())]


class MaxPool2dIndicesOp(Pool2dOp):
    """The arg-max of each max_pool2d window as an index into its input plane (ih * W + iw),
    int64 like PyTorch's ``return_indices``: the forward kernel writing only the indices. No
    gradient flows through indices; the values' node carries it."""

    differentiable_inputs = ()

    def __init__(self, kernel_size, stride, padding, dilation, ceil_mode: bool):
        super().__init__(True, kernel_size, stride, padding, dilation, ceil_mode)
        self.name = "max_pool2d_indices"

    def output_dtype(self, input_dtypes):
        return torch.int64

    def extra_outputs(self, input_shapes, dtype):
        return {}

    def forward_launches(self, ctx):
        (x,), indices = ctx.inputs, ctx.output
        args = self._args(ctx, indices.numel(), x_ptr=x, y_ptr=None, idx_ptr=indices)
        return [Launch(pool2d_forward, (cdiv(indices.numel(), _POOL_BLOCK),), args, _POOL_BLOCK)]


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """F.max_pool2d on (N, C, H, W) or (C, H, W): the gradient goes to the first maximum of
    each window in scan order (saved at the forward). ``return_indices=True`` returns
    ``(values, indices)`` as PyTorch does: int64 positions of each maximum in its input plane."""
    graph = graph_of(input)
    values = graph.apply(Pool2dOp(True, kernel_size, stride, padding, dilation, ceil_mode), [input])
    if not return_indices:
        return values
    return values, graph.apply(MaxPool2dIndicesOp(kernel_size, stride, padding, dilation, ceil_mode), [input])


def avg_pool2d(
    input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    """F.avg_pool2d on (N, C, H, W) or (C, H, W)."""
    op = Pool2dOp(False, kernel_size, stride, padding, 1, ceil_mode, count_include_pad, divisor_override)
    return graph_of(input).apply(op, [input])


# ---------------------------------------------------------------------------------- layers


class Conv2d(Module):
    """nn.Conv2d: weight (out, in/groups, kH, kW) and bias (out,), both
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in/groups * kH * kW, like PyTorch."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if groups < 1 or in_channels % groups:
            raise ValueError(f"Conv2d: in_channels ({in_channels}) must be divisible by groups ({groups})")
        if out_channels % groups:
            raise ValueError(f"Conv2d: out_channels ({out_channels}) must be divisible by groups ({groups})")
        if padding_mode != "zeros":
            raise ValueError(f"Conv2d: only padding_mode='zeros' is supported, got {padding_mode!r}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = _pair(kernel_size, "kernel_size", "Conv2d")
        self.stride, self.padding, self.dilation = stride, padding, dilation
        Conv2dOp(bias, stride, padding, dilation, groups)  # validates the arguments now
        fan_in = in_channels // groups * self.kernel_size[0] * self.kernel_size[1]
        self.weight = Parameter(
            (out_channels, in_channels // groups, *self.kernel_size), init.kaiming_uniform(fan_in), dtype=dtype
        )
        self.bias = Parameter((out_channels,), init.kaiming_uniform(fan_in), dtype=dtype) if bias else None

    def forward(self, x):
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def __repr__(self) -> str:
        return (
            f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, bias={self.bias is not None})"
        )


class MaxPool2d(Module):
    def __init__(
        self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False, ceil_mode: bool = False
    ):
        super().__init__()
        self.kwargs = dict(
            kernel_size=kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            ceil_mode=ceil_mode,
            return_indices=return_indices,
        )

    def forward(self, x):
        return max_pool2d(x, **self.kwargs)

    def __repr__(self) -> str:
        return f"MaxPool2d({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


class AvgPool2d(Module):
    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override=None,
    ):
        super().__init__()
        self.kwargs = dict(
            kernel_size=kernel_size,
            stride=stride,
            padding=padding,
            ceil_mode=ceil_mode,
            count_include_pad=count_include_pad,
            divisor_override=divisor_override,
        )

    def forward(self, x):
        return avg_pool2d(x, **self.kwargs)

    def __repr__(self) -> str:
        return f"AvgPool2d({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"
