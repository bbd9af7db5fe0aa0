"""How a product becomes launches: ``Product`` describes one (its sizes and every operand's
strides), ``schedule`` shares its tiles out over ``matmul_tma``'s persistent programs, and
``product_launches`` builds the launches that compute it with a configuration (``tuning.py``
chooses that): the strided kernel, the Hopper kernels with their K-major or padded copies and
stream-K second pass, and the bias gradient's row sums where the kernel does not fuse them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core import tuning
from ...core.common import DOT_UPCAST_BF16, acc_dtype, cdiv, pow2, sum_to_shape, tl_acc_dtype
from ...core.runtime import ArgVisitor, Block, Launch
from .gluon import matmul_ws
from .kernels import TF32, TF32X3, matmul_copy, matmul_product, matmul_sum_segments, matmul_tma, plus_addend

# ------------------------------------------------------------------- product description

MAX_KEPT_DIMS = 3  # batch dims of the result, after collapsing
MAX_REDUCED_DIMS = 2  # broadcast batch dims summed inside a program, after collapsing
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned bases and row strides


def contiguous_strides(shape) -> list[int]:
    """The strides of a contiguous tensor of ``shape`` (a size-0 dim counted as 1)."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return strides[::-1]


@dataclass(frozen=True)
class TmaLayout:
    """How ``matmul_tma`` reads a 2-D product: which operand dim is contiguous, and the other
    stride of each operand (in elements)."""

    x_k_contiguous: bool
    y_k_contiguous: bool
    x_stride: int
    y_stride: int
    z_stride: int
    z_transposed: bool = False  # Z stored (N, M), its rows z_stride apart
    z_pointers: bool = False  # Z's rows not 16-byte aligned: stored through pointers, not TMA


@dataclass
class Product:
    """One product: Z[g] = sum_r X[g, r] @ Y[g, r] with every access through strides.
    ``kept``: (size, x, y, z strides) per batch dim of Z; ``reduced``: (size, x, y strides)."""

    M: int
    N: int
    K: int
    x: tuple[int, int]  # strides of X over (m, k)
    y: tuple[int, int]  # (k, n)
    z: tuple[int, int]  # (m, n)
    kept: list[tuple[int, int, int, int]]
    reduced: list[tuple[int, int, int]]

    @property
    def batch(self) -> int:
        return math.prod(d[0] for d in self.kept)

    def work(self) -> int:
        return self.batch * self.M * self.N

    @property
    def z_transposed(self) -> bool:
        """Whether Z is stored transposed, (N, M) (Conv1D's dW written into W's (in, out))."""
        return self.z[1] != 1

    def tma_layout(self, dtype: torch.dtype) -> TmaLayout | None:
        """The layout for ``matmul_tma``, or None where the product is batched, empty, or an
        operand (Z too: it may be stored transposed) has no unit stride or rows that are not
        16-byte aligned."""
        if self.kept or self.reduced or min(self.M, self.N, self.K) == 0:
            return None
        if 1 not in self.x or 1 not in self.y or 1 not in self.z:
            return None
        size = torch.empty((), dtype=dtype).element_size()
        rows = (_row_stride(self.x), _row_stride(self.y), _row_stride(self.z))
        if any((stride * size) % TMA_ALIGN for stride in rows):
            return None
        return TmaLayout(self.x[1] == 1, self.y[1] != 1, *rows, self.z_transposed)  # X is (m, k), Y (k, n)

    def paddable(self) -> bool:
        """Whether ``matmul_tma`` can compute the product, on copies of the operands (and a
        result) whose rows are not 16-byte aligned, padded: 2-D, not empty, a unit stride in
        each operand and a unit column stride in Z (a vocabulary of 50,257: ``product_launches``)."""
        if self.kept or self.reduced or min(self.M, self.N, self.K) == 0 or self.z_transposed:
            return False
        return 1 in self.x and 1 in self.y

    def z_rows_unaligned(self, z_size: int) -> bool:
        """Whether Z's rows (elements of ``z_size`` bytes) are not 16-byte aligned, so that
        ``matmul_tma`` stores Z through pointers rather than TMA (a vocabulary of 50,257)."""
        return (_row_stride(self.z) * z_size) % TMA_ALIGN != 0

    def key(self) -> dict:
        """What a tuned configuration depends on."""
        return {"M": self.M, "N": self.N, "K": self.K, "x": self.x, "y": self.y, "z": self.z,
                "kept": self.kept, "reduced": self.reduced}  # fmt: skip


def _row_stride(strides: tuple[int, int]) -> int:
    """The stride of an operand's (or Z's) other dim than its contiguous one (the second dim
    where both strides are 1): the stride of its rows as TMA reads or writes them."""
    return strides[0] if strides[1] == 1 else strides[1]


def _collapse(dims: list[tuple]) -> list[tuple]:
    """Drop size-1 dims and merge neighbours whose strides (every operand) nest."""
    out: list[tuple] = []
    for d in dims:
        if d[0] == 1:
            continue
        if out and all(po == do * d[0] for po, do in zip(out[-1][1:], d[1:])):
            prev = out.pop()
            d = (prev[0] * d[0],) + d[1:]
        out.append(d)
    return out


def plan_product(M, N, K, x, y, z, batch: list[tuple[int, int, int, int]], where: str) -> Product:
    """``batch``: per broadcast batch dim, (size, x, y, z strides); a zero z stride on a dim of
    size > 1 makes it a reduced dim."""
    kept = _collapse([d for d in batch if d[3] != 0 or d[0] == 1])
    reduced = _collapse([d[:3] for d in batch if d[3] == 0 and d[0] != 1])
    if len(kept) > MAX_KEPT_DIMS or len(reduced) > MAX_REDUCED_DIMS:
        raise ValueError(
            f"{where}: this pattern of broadcast batch dims needs {len(kept)} batch and {len(reduced)} "
            f"summed dims; the kernel supports {MAX_KEPT_DIMS} and {MAX_REDUCED_DIMS} "
            "(reshape the operands to fewer batch dims)"
        )
    return Product(M, N, K, x, y, z, kept, reduced)


# ------------------------------------------------------------------- the stream-K schedule

STREAM_K_MIN_K_TILES = 4  # a stream-K program takes at least this many K tiles
SEGMENT_SUM_ELEMENTS = 8192  # partial elements a program of matmul_sum_segments loads at once
SEGMENT_SUM_MAX_SLOTS = 16  # segments it loads at once
COPY_BLOCK = 64  # tile edge of matmul_copy


@dataclass(frozen=True)
class Schedule:
    """How ``matmul_tma``'s ``programs`` share out a product: tiles 0 .. dp_tiles - 1 whole, the
    ``sk_tiles`` after them stream-K, a shared tile's segments in up to ``slots`` partial boxes
    (slots 1: no tile is shared, no second pass)."""

    programs: int
    dp_tiles: int
    sk_tiles: int
    slots: int


def schedule(p: Product, config: dict) -> Schedule:
    """The schedule of ``p`` under a TMA ``config``: STREAM_K = w shares out the tiles of the last
    w waves (a wave: one tile per program), where each program gets enough K tiles. A product of
    fewer tiles than multiprocessors is all stream-K, on as many programs as get that many K tiles
    each (a 128x784 by 784x256 product: 2 tiles of 25 K tiles on 12 programs, not 2)."""
    tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
    k_tiles = cdiv(p.K, config["BLOCK_K"])
    full = config["OCCUPANCY"] * tuning.multiprocessors()
    whole = Schedule(min(tiles, full), tiles, 0, 1)
    if not config["STREAM_K"]:
        return whole
    dp_tiles = max(0, cdiv(tiles, full) - config["STREAM_K"]) * full
    sk_tiles = tiles - dp_tiles
    total = sk_tiles * k_tiles
    programs = full
    if total < full * STREAM_K_MIN_K_TILES:  # too few K tiles for every program to get enough
        programs = 0 if dp_tiles else total // STREAM_K_MIN_K_TILES  # (whole tiles go round all)
        if programs <= sk_tiles:
            return whole
    # the owners of tile i, as _segment_owners computes them in the kernels
    slots = max(((i + 1) * k_tiles * programs - 1) // total - ((i * k_tiles + 1) * programs - 1) // total + 1
                for i in range(sk_tiles))  # fmt: skip
    return whole if slots == 1 else Schedule(programs, dp_tiles, sk_tiles, slots)


# ------------------------------------------------------------------- launches


@dataclass(frozen=True)
class Epilogue:
    """An element-wise activation in a product's epilogue (``MLPOp``): ``activation`` is an
    ``activation.ActivationOp`` (its ``fn``, ``grad``, ``a``, ``b``). Forwards, Z = fn(h) of
    h = the product (+ bias), h also written to ``aux`` when given; with ``derivative``, Z =
    grad(h, the product), the gradient through the activation, h read from ``aux``. ``aux``
    lies like Z."""

    activation: Any
    aux: torch.Tensor | None
    derivative: bool = False

    @property
    def kind(self) -> str:
        """What the epilogue does with h: "activation" (stores it) or "derivative" (loads it), or
        "addend" (a derivative that only adds: ``addend_epilogue``)."""
        if self.derivative and isinstance(self.activation, _Sum):
            return "addend"
        return "derivative" if self.derivative else "activation"

    def args(self) -> dict:
        op = self.activation
        return dict(
            aux_ptr=self.aux,
            act_a=op.a,
            act_b=op.b,
            ACTIVATION=None if self.derivative else op.fn,
            DERIVATIVE=op.grad if self.derivative else None,
        )


class _Sum:
    """What ``Epilogue`` reads of an activation, for a sum: no function forwards; backwards, the
    loaded tile plus the product (``kernels.plus_addend``)."""

    fn, grad, a, b = None, plus_addend, 0.0, 0.0


def addend_epilogue(addend: torch.Tensor) -> Epilogue:
    """Z = ``addend`` + the product, ``addend`` laid out like Z (and may be Z itself): a gradient
    summed into the one waiting as the product writes it (``LinearOp``'s dX, ``grad_accumulates``),
    rounded as the product stored alone and a separate sum would round it."""
    return Epilogue(_Sum(), addend, derivative=True)


NO_EPILOGUE_ARGS = dict(aux_ptr=None, act_a=0.0, act_b=0.0, ACTIVATION=None, DERIVATIVE=None)


def _epilogue_args(epilogue: Epilogue | None, p: Product, z: torch.Tensor) -> dict:
    if epilogue is None:
        return NO_EPILOGUE_ARGS
    if p.kept or p.reduced or p.z_transposed or (epilogue.aux is not None and epilogue.aux.stride() != z.stride()):
        raise ValueError(
            f"an activation epilogue needs a 2-D product, Z's rows contiguous and an aux tensor laid out like Z ({p})"
        )
    return epilogue.args()


def _product_args(p: Product, x, y, z, bias, dtype: torch.dtype, precision: str, config: dict) -> ArgVisitor:
    kept = list(p.kept) + [(1, 0, 0, 0)] * (MAX_KEPT_DIMS - len(p.kept))
    reduced = list(p.reduced) + [(1, 0, 0)] * (MAX_REDUCED_DIMS - len(p.reduced))
    v = ArgVisitor().visit(x_ptr=x, y_ptr=y, z_ptr=z, bias_ptr=bias, M=p.M, N=p.N, K=p.K)
    v.visit(sxm=p.x[0], sxk=p.x[1], syk=p.y[0], syn=p.y[1], szm=p.z[0], szn=p.z[1])
    v.visit(G1=kept[1][0], G2=kept[2][0], R1=reduced[1][0], n_red=math.prod(d[0] for d in reduced))
    for operand, name in ((1, "x"), (2, "y"), (3, "z")):
        v.visit(**{f"s{name}g{i}": d[operand] for i, d in enumerate(kept)})
    for operand, name in ((1, "x"), (2, "y")):
        v.visit(**{f"s{name}r{i}": d[operand] for i, d in enumerate(reduced)})
    return v.visit(ACC=tl_acc_dtype(dtype), PRECISION=precision, UPCAST=dtype == torch.bfloat16 and DOT_UPCAST_BF16)


def _tiles(config: dict) -> dict:
    return {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}


class _ScratchContext:
    """What ``sum_to_shape`` uses of an OpContext: somewhere to put its partials."""

    def __init__(self, scratch: Callable[[tuple, torch.dtype], torch.Tensor]):
        self._scratch = scratch

    def empty(self, shape, dtype=None) -> torch.Tensor:
        return self._scratch(tuple(shape), dtype)


def _copy_launch(src, dst, rows: int, cols: int, src_stride: int, dst_stride: int, transpose: bool) -> Launch:
    """``matmul_copy`` of src (rows, cols), rows src_stride apart, into dst (see the kernel)."""
    args = ArgVisitor().visit(src_ptr=src, dst_ptr=dst, rows=rows, cols=cols, src_stride=src_stride,
                              dst_stride=dst_stride, TRANSPOSE=transpose, BLOCK=COPY_BLOCK)  # fmt: skip
    grid = (cdiv(rows, COPY_BLOCK), cdiv(cols, COPY_BLOCK))
    return Launch(matmul_copy, grid, args, Block(num_warps=4), work=rows * cols)


def padded_length(n: int, size: int) -> int:
    """``n`` elements of ``size`` bytes rounded up to a multiple of 16 bytes (TMA's row alignment)."""
    per = TMA_ALIGN // math.gcd(TMA_ALIGN, size)
    return cdiv(n, per) * per


def _tma_operands(p: Product, x, y, z, size: int, k_major: bool, scratch, epilogue: bool):
    """What ``matmul_tma`` reads and writes for ``p`` (operands of ``size`` bytes an element; Z
    may be wider): each operand as it lies, or a K-major copy of it with 16-byte aligned rows,
    where its rows are not aligned or where ``k_major`` asks for one and it lies MN-major; Z as it
    lies, through TMA where its rows are aligned, else through pointers (``z_pointers``; no
    activation epilogue, whose h goes through TMA as Z does). Returns (launches before, X, Y, Z to
    use, their TmaLayout)."""
    before: list[Launch] = []
    k_rows = padded_length(p.K, size)

    def k_major_copy(t, sizes_strides, k_contiguous: bool, rows: int) -> torch.Tensor:
        """``t`` viewed as (rows, K) (``sizes_strides`` of X's (m, k) or Y's (n, k)) in a copy with
        rows k_rows apart."""
        (_, s_rows), (_, s_k) = sizes_strides
        dst = scratch((rows, k_rows), t.dtype)
        if k_contiguous:  # rows not aligned: the same layout, padded
            before.append(_copy_launch(t, dst, rows, p.K, s_rows, k_rows, transpose=False))
        else:
            before.append(_copy_launch(t, dst, p.K, rows, s_k, k_rows, transpose=True))
        return dst

    x_k, y_k = p.x[1] == 1, p.y[1] != 1  # X is (m, k), Y (k, n)
    x_row, y_row = _row_stride(p.x), _row_stride(p.y)
    if (x_row * size) % TMA_ALIGN or (k_major and not x_k):
        x, x_k, x_row = k_major_copy(x, [(p.M, p.x[0]), (p.K, p.x[1])], x_k, p.M), True, k_rows
    if (y_row * size) % TMA_ALIGN or (k_major and not y_k):
        y, y_k, y_row = k_major_copy(y, [(p.N, p.y[1]), (p.K, p.y[0])], y_k, p.N), True, k_rows
    z_row = _row_stride(p.z)
    # rows not aligned (a transposed Z is: product_launches refuses it otherwise): stored as Z lies, from registers
    z_pointers = p.z_rows_unaligned(z.element_size())
    if z_pointers and epilogue:
        raise ValueError(f"an activation epilogue needs Z's rows 16-byte aligned ({p})")
    return before, x, y, z, TmaLayout(x_k, y_k, x_row, y_row, z_row, p.z_transposed, z_pointers)


def _tma_launches(p: Product, x, y, z, bias, row_sums, layout: TmaLayout, dtype, precision, config, scratch, epilogue):
    """matmul_tma's launch for ``config`` (and matmul_sum_segments' where tiles are shared)."""
    sched = schedule(p, config)
    shared = sched.slots > 1
    box_rows = sched.slots * sched.sk_tiles * config["BLOCK_M"]
    partials = scratch((box_rows, config["BLOCK_N"]), acc_dtype(dtype)) if shared else None
    partial_sums = scratch((box_rows,), acc_dtype(dtype)) if shared and row_sums is not None else None
    args = ArgVisitor().visit(
        x_ptr=x,
        y_ptr=y,
        z_ptr=z,
        bias_ptr=bias,
        row_sums_ptr=row_sums,
        partial_ptr=partials,
        partial_sums_ptr=partial_sums,
        M=p.M,
        N=p.N,
        K=p.K,
        x_stride=layout.x_stride,
        y_stride=layout.y_stride,
        z_stride=layout.z_stride,
        programs=sched.programs,
        dp_tiles=sched.dp_tiles,
        X_K_CONTIGUOUS=layout.x_k_contiguous,
        Y_K_CONTIGUOUS=layout.y_k_contiguous,
        ACC=tl_acc_dtype(dtype),
        PRECISION=precision,
        # float32 row sums at float32 accuracy even where the product is plain tf32
        ROW_SUM_PRECISION=TF32X3 if precision == TF32 and dtype == torch.float32 else precision,
        UPCAST=dtype == torch.bfloat16 and DOT_UPCAST_BF16,
        SUBTILE=config["SUBTILE"],
        **_tiles(config),
        **epilogue,
        Z_TRANSPOSED=layout.z_transposed,
        Z_POINTERS=layout.z_pointers,
    )
    block = Block(num_warps=config["num_warps"], num_stages=config["num_stages"])
    launches = [Launch(matmul_tma, (sched.programs,), args, block, work=p.work())]
    if shared:
        slots = min(pow2(sched.slots), SEGMENT_SUM_MAX_SLOTS)
        chunk = min(config["BLOCK_M"], max(1, SEGMENT_SUM_ELEMENTS // (slots * config["BLOCK_N"])))
        sums = ArgVisitor().visit(
            partial_ptr=partials, partial_sums_ptr=partial_sums, z_ptr=z, bias_ptr=bias, row_sums_ptr=row_sums,
            M=p.M, N=p.N, K=p.K, z_stride=layout.z_stride, programs=sched.programs, dp_tiles=sched.dp_tiles,
            ACC=tl_acc_dtype(dtype), SLOTS=slots, CHUNK_M=chunk, **_tiles(config), **epilogue,
            Z_TRANSPOSED=layout.z_transposed,
        )  # fmt: skip
        grid = (sched.sk_tiles, config["BLOCK_M"] // chunk)
        launches.append(Launch(matmul_sum_segments, grid, sums, Block(num_warps=4), work=p.work()))
    return launches


def _ws_launch(p: Product, x, y, z, bias, dtype: torch.dtype, config: dict, addend=None) -> Launch:
    """matmul_ws's launch: one persistent program per multiprocessor (or per tile, if fewer).
    ``addend``: a tensor laid out like Z, of its half dtype, summed in the epilogue."""
    layout = p.tma_layout(dtype)
    half_z = z.dtype == dtype
    if (
        dtype not in (torch.float16, torch.bfloat16)
        or z.dtype not in (dtype, torch.float32)
        or layout is None
        or layout.z_transposed
        or (addend is not None and (not half_z or addend.dtype != dtype))
    ):
        raise ValueError(
            f"matmul_ws computes half-precision 2-D products with 16-byte aligned rows into Z of their dtype "
            f"(with or without an addend) or of float32 (without), Z not transposed: not {dtype} into {z.dtype}"
            f"{f' with a {addend.dtype} addend' if addend is not None else ''} ({p})"
        )
    args = ArgVisitor().visit(
        x_ptr=x, y_ptr=y, z_ptr=z, bias_ptr=bias, addend_ptr=addend, M=p.M, N=p.N, K=p.K, x_stride=layout.x_stride,
        y_stride=layout.y_stride, z_stride=layout.z_stride, X_K_CONTIGUOUS=layout.x_k_contiguous,
        Y_K_CONTIGUOUS=layout.y_k_contiguous, STAGES=config["num_stages"],
    )  # fmt: skip
    tiles = cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"])
    grid = (min(tiles, tuning.multiprocessors()),)
    return Launch(matmul_ws, grid, args, Block(num_warps=config["num_warps"]), work=p.work())


def product_launches(
    p: Product,
    config: dict,
    *,
    x: torch.Tensor,
    y: torch.Tensor,
    z: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype,
    precision: str,
    scratch: Callable[[tuple, torch.dtype], torch.Tensor],
    row_sums: torch.Tensor | None = None,
    epilogue: Epilogue | None = None,
) -> list[Launch]:
    """The launches computing ``p`` with ``config``: X, Y and Z are the tensors ``x``, ``y`` and
    ``z`` that ``p``'s strides index, ``dtype`` the operands' dtype, ``precision`` tl.dot's
    (``scratch(shape, dtype)`` allocates the partials of stream-K tiles and K-major copies);
    ``row_sums``: also the sums of X's rows over the contraction (X must then be stored
    transposed and contiguous, (K, M), as linear's dY is), in the kernel or by ``sum_to_shape``;
    ``epilogue``: an activation applied before the store (see ``Epilogue``; ``matmul_ws`` takes
    only an addend). Z (and the row sums) may be of a wider dtype than the operands (a float32 dW
    of bfloat16 operands; through ``matmul_ws`` without an addend)."""
    precision = config.get("PRECISION", precision)
    tma = config["kernel"] == "tma"
    if tma and not p.paddable() and p.tma_layout(dtype) is None:
        raise ValueError(f"matmul_tma cannot read this product ({p}): use a strided configuration")
    fused = row_sums is not None and tma and config.get("FUSED_SUMS", True)
    epilogue_args = _epilogue_args(epilogue, p, z)
    if config["kernel"] == "ws":
        if epilogue is not None and epilogue.kind != "addend":
            raise ValueError(f"matmul_ws has no activation epilogue ({p})")
        launches = [_ws_launch(p, x, y, z, bias, dtype, config, epilogue_args["aux_ptr"])]
    elif not tma:
        args = _product_args(p, x, y, z, bias, dtype, precision, config).visit(**_tiles(config), **epilogue_args)
        grid = (p.batch * cdiv(p.M, config["BLOCK_M"]) * cdiv(p.N, config["BLOCK_N"]),)
        block = Block(num_warps=config["num_warps"], num_stages=config["num_stages"])
        launches = [Launch(matmul_product, grid, args, block, work=p.work())]
    else:
        launches, xk, yk, zk, layout = _tma_operands(
            p, x, y, z, x.element_size(), config["K_MAJOR"], scratch, epilogue is not None
        )
        launches += _tma_launches(p, xk, yk, zk, bias, row_sums if fused else None, layout, dtype, precision, config,
                                  scratch, epilogue_args)  # fmt: skip
    if row_sums is not None and not fused:
        if p.x[0] != 1:
            raise ValueError(f"the row sums of X need X stored transposed, (K, M) with unit column stride, not {p.x}")
        launches += sum_to_shape(_ScratchContext(scratch), x, (p.K, p.M), row_sums, strides=(p.x[1], 1))
    return launches
