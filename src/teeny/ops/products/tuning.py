"""Which kernel, tiles, warps, stages and schedule a product gets: the candidate configurations
per operand precision (with the measurements that chose them), the heuristic ``default_config``
used where nothing is timed (the interpreter, small products, ``TEENY_TUNING=0``), and
``choose_config``, which has ``teeny.core.tuning`` time the ``candidates`` on the GPU once per
static shape at lowering and caches the winner on disk.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ...core import compiling, tuning
from ...core.common import cdiv
from ...core.device import DEVICE, INTERPRETER
from ...core.runtime import run_launch
from . import gluon
from .kernels import IEEE, ROW_SUM_COLUMNS, TF32, TF32X3, matmul_product, matmul_tma
from .launches import Epilogue, Product, product_launches, schedule

# A configuration is a dict: the kernel ("tma" or "strided"), its tile constexprs and Triton's
# num_warps / num_stages. "tma" ones add SUBTILE (the epilogue stores half tiles), STREAM_K
# (how many of the last waves of tiles are shared out stream-K; 0: none), OCCUPANCY (programs
# per multiprocessor: 2 lets one program's epilogue overlap the other's products) and K_MAJOR
# (float32: copy MN-major operands K-major first, see candidates); products that also sum X's
# rows add FUSED_SUMS (in the kernel, or a separate column sum); a float32 one may name
# PRECISION "ieee" (the FMA units: exact, and for a small product faster than tf32x3's three
# tensor-core products). Candidates per operand precision (what the tuning pass times); the
# first of each list is the default where nothing is timed.


def _cfg(bm, bn, bk, warps, stages, subtile=False, stream_k=0, occupancy=1, kind="tma", fma=False) -> dict:
    config = {"kernel": kind, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
              "num_warps": warps, "num_stages": stages}  # fmt: skip
    if kind in ("tma", "ws"):
        config.update(SUBTILE=subtile, STREAM_K=stream_k, OCCUPANCY=occupancy, K_MAJOR=False)
    if fma:  # float32 on the FMA units, exact: a small product's latency without tf32x3's splits
        config["PRECISION"] = IEEE
    return config


# H200 (bench/tools/matmul_sweep.py, run 3): 128x256x64 w8s3 wins at 4096^3 (0.98x cuBLAS) and on
# long rows; 128x128 tiles on 768-wide outputs; 128x64 tiles on small ones.
_TMA_CANDIDATES = {
    "half": [
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 256, 64, 8, 4, subtile=True),
        _cfg(256, 128, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 4, 4),
        _cfg(128, 128, 128, 8, 3),
        _cfg(64, 256, 64, 4, 4),
        _cfg(128, 64, 64, 4, 5),
        # two programs per multiprocessor (at most half the shared memory each)
        _cfg(128, 128, 64, 4, 2, occupancy=2),
        _cfg(128, 128, 32, 4, 4, occupancy=2),
        _cfg(128, 128, 64, 4, 3, subtile=True, occupancy=2),
    ],
    TF32X3: [
        _cfg(128, 128, 32, 8, 3),
        _cfg(128, 256, 32, 8, 2, subtile=True),
        _cfg(128, 128, 32, 4, 4),
        _cfg(64, 128, 32, 4, 4),
        _cfg(128, 64, 32, 4, 4),
        _cfg(128, 128, 16, 8, 5),
    ],
    TF32: [
        _cfg(128, 256, 32, 8, 3, subtile=True),
        _cfg(128, 128, 32, 8, 4),
        _cfg(256, 128, 32, 8, 3, subtile=True),
        _cfg(128, 128, 64, 8, 2),
    ],
    IEEE: [  # float32 on FMA units: smaller tiles, no tensor cores
        _cfg(64, 64, 32, 4, 3),
        _cfg(128, 64, 32, 8, 3),
        _cfg(128, 128, 16, 8, 3),
    ],
    "float64": [  # DMMA
        _cfg(64, 64, 16, 4, 3),
        _cfg(64, 128, 16, 4, 3),
        _cfg(128, 64, 16, 8, 3),
        _cfg(128, 128, 16, 8, 2),
    ],
}
# how many of each list (the first) also get stream-K and K_MAJOR variants
_VARIANTS_OF = {"half": 11, TF32X3: 4, TF32: 2, IEEE: 2, "float64": 2}
# matmul_ws (gluon.py): 128 x 192 tiles of two warpgroups, half precision, no activation
# epilogue (an addend, or a float32 Z), no fused row sums, Z not transposed. H200, 4,096-row
# GPT-2 layers (v19): 0.97-1.08x cuBLAS on forwards and dX where matmul_tma's tuned best was
# 0.69-0.95x.
_WS_CONFIG = _cfg(gluon.BLOCK_M, gluon.BLOCK_N, gluon.BLOCK_K, 4, gluon.PIPELINE_STAGES, kind="ws")


def _ws_computes(epilogue: str | None, out_dtype: torch.dtype | None) -> bool:
    """Whether matmul_ws computes a product with this epilogue (``Epilogue.kind``) into Z of
    ``out_dtype``: no epilogue or an addend into half Z; no epilogue into float32 Z."""
    if out_dtype is None:
        return epilogue in (None, "addend")
    return out_dtype == torch.float32 and epilogue is None


# Small products (under TUNE_MIN_MACS: the small MLP's 128-row layers) are latency-bound: a
# few programs of big tiles leave the GPU idle. These small tiles (all with stream-K variants)
# are what bench/tools/matmul_sweep.py --only mlp times for them; _small_default picks from them.
_SMALL_FMA = [_cfg(64, 64, 32, 4, 3, fma=True), _cfg(32, 64, 32, 4, 3, fma=True), _cfg(64, 32, 32, 4, 3, fma=True),
              _cfg(32, 32, 64, 4, 3, fma=True)]  # fmt: skip
_SMALL_TMA_CANDIDATES = {
    "half": [_cfg(64, 64, 64, 4, 3), _cfg(64, 128, 64, 4, 3), _cfg(64, 64, 128, 4, 2), _cfg(128, 64, 64, 4, 3)],
    TF32X3: [_cfg(64, 64, 32, 4, 3), _cfg(64, 32, 32, 4, 4), _cfg(64, 128, 32, 4, 3)] + _SMALL_FMA,
    TF32: [_cfg(64, 64, 32, 4, 3), _cfg(64, 32, 32, 4, 4)] + _SMALL_FMA,
}
_SMALL_STRIDED_FMA = [
    _cfg(bm, bn, bk, w, 3, kind="strided", fma=True)
    for bm, bn, bk, w in ((32, 32, 32, 4), (16, 64, 32, 4), (64, 16, 32, 4), (16, 16, 64, 2))
]
_SMALL_STRIDED_CANDIDATES = {
    "half": [_cfg(32, 32, 64, 4, 3, kind="strided"), _cfg(16, 64, 64, 4, 3, kind="strided"),
             _cfg(64, 16, 64, 4, 3, kind="strided"), _cfg(64, 64, 64, 4, 3, kind="strided")],
    TF32X3: [_cfg(32, 32, 32, 4, 3, kind="strided")] + _SMALL_STRIDED_FMA,
    TF32: [_cfg(32, 32, 32, 4, 3, kind="strided")] + _SMALL_STRIDED_FMA,
}  # fmt: skip

# What a multiprocessor offers a program (227 KiB on Hopper), less a margin for the barriers;
# two programs per multiprocessor share 228 KiB less 1 KiB reserved for each. The estimate
# below is an upper bound: bench/tools/compile_check.py prints what each candidate takes (128x256x64
# bf16, 3 stages: 196 KiB against 208 estimated).
SHARED_MEMORY_BUDGET = 226 * 1024
SHARED_MEMORY_PER_PAIR = 112 * 1024


def _shared_bytes(
    config: dict,
    dtype: torch.dtype,
    row_sums: bool = False,
    epilogue: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> int:
    """Shared memory a TMA configuration needs: num_stages operand tiles, the epilogue's staging
    tile (of ``out_dtype``, Z's, where it is not the operands') and the row sums' (K x 16) tile
    of ones (stream-K partials are stored from registers); with a derivative epilogue
    (``Epilogue.kind``), the box h is loaded into. (An activation epilogue's store of h reuses
    Z's staging tile: sm_90 compiles of every candidate, with ``bench/tools/compile_check.py
    --match gelu``, take exactly these sizes.)"""
    size = torch.empty((), dtype=dtype).element_size()
    out_size = size if out_dtype is None else torch.empty((), dtype=out_dtype).element_size()
    operands = config["num_stages"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * size
    store_n = config["BLOCK_N"] // 2 if config["SUBTILE"] else config["BLOCK_N"]
    ones = config["BLOCK_K"] * ROW_SUM_COLUMNS.value * size if row_sums and config.get("FUSED_SUMS", True) else 0
    aux = config["BLOCK_M"] * store_n * out_size if epilogue in ("derivative", "addend") else 0
    return operands + config["BLOCK_M"] * store_n * out_size + ones + aux


def _fits(config: dict, dtype: torch.dtype, **needs) -> bool:
    """Whether ``config`` fits one multiprocessor's shared memory (``needs``: ``_shared_bytes``')."""
    budget = SHARED_MEMORY_BUDGET if config["OCCUPANCY"] == 1 else SHARED_MEMORY_PER_PAIR
    return _shared_bytes(config, dtype, **needs) <= budget


# H200, bf16 4096^3 forward+backward (bench/tools/tune_launch.py, version 1): 8 warps and 4 stages for
# 128x128x32 half tiles, 0.93 ms against 1.12 ms for Triton's default 4 warps / 3 stages.
_STRIDED_CANDIDATES = {
    "half": [_cfg(128, 128, 32, 8, 4, kind="strided"), _cfg(128, 128, 64, 8, 3, kind="strided"),
             _cfg(64, 128, 32, 4, 4, kind="strided")],
    TF32X3: [_cfg(128, 128, 32, 8, 3, kind="strided"), _cfg(64, 64, 32, 4, 3, kind="strided")],
    TF32: [_cfg(128, 128, 32, 8, 3, kind="strided"), _cfg(64, 128, 32, 4, 4, kind="strided")],
    IEEE: [_cfg(64, 64, 32, 4, 3, kind="strided"), _cfg(128, 64, 32, 8, 3, kind="strided")],
    "float64": [_cfg(64, 64, 16, 4, 3, kind="strided"), _cfg(64, 128, 16, 4, 3, kind="strided")],
}  # fmt: skip

# the interpreter pays per program instance, not per element: few, wide ones
_INTERPRETER_CONFIG = _cfg(256, 256, 64, 4, 2, kind="strided")

STREAM_K_MAX_WAVES = 4  # beyond this many waves of tiles an idle last wave costs little: no stream-K
STREAM_K_FULL_WAVE = 0.8  # a last wave this full (of the multiprocessors) leaves little to share out
TUNE_MIN_MACS = 2**30  # smaller products (a few microseconds) take the heuristic without timing
PADDED_CANDIDATES = 4  # matmul_tma configurations timed on padded copies (each first compile takes seconds)


def _macs(p: Product) -> int:
    return p.work() * p.K * math.prod(d[0] for d in p.reduced)


def _small(p: Product) -> bool:
    """Whether ``p`` is small enough to take the heuristic without timing (see TUNE_MIN_MACS)."""
    return _macs(p) < TUNE_MIN_MACS


def _precision_class(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    if dtype == torch.float64:
        return "float64"
    return precision


def _stream_k_useful(p: Product, config: dict, waves: int) -> bool:
    """Whether STREAM_K = waves changes ``config``'s schedule for ``p`` in a way worth timing:
    the whole tiles would leave a last wave under STREAM_K_FULL_WAVE full, within a few waves."""
    plain = schedule(p, config)
    tiles = plain.dp_tiles
    full = config["OCCUPANCY"] * tuning.multiprocessors()
    last_wave = tiles - (cdiv(tiles, full) - 1) * full
    if cdiv(tiles, full) > STREAM_K_MAX_WAVES or last_wave >= STREAM_K_FULL_WAVE * full:
        return False
    shared = schedule(p, {**config, "STREAM_K": waves})
    return shared != plain and (waves == 1 or shared != schedule(p, {**config, "STREAM_K": waves - 1}))


def _k_major_useful(p: Product) -> bool:
    """float32 tensor cores (tf32, tf32x3) read both operands K-major only: an MN-major operand
    tile is transposed through shared memory in every program that reads it (H200, 4096^3
    tf32x3: 0.81x cuBLAS with one such operand, 0.72x with two, 1.74x with none), so a K-major
    copy made once (one pass over the operand, its rows padded to 16 bytes) is worth timing."""
    return not (p.x[1] == 1 and p.y[1] != 1)


def candidates(
    p: Product,
    *,
    dtype: torch.dtype,
    precision: str,
    has_bias: bool,
    row_sums: bool = False,
    epilogue: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> list[dict]:
    """The configurations the tuning pass times for ``p`` (the first is the heuristic's pick);
    ``row_sums``: the product also sums X's rows (linear's bias gradient); ``epilogue``: it
    applies an activation (``Epilogue.kind``); ``out_dtype``: Z's dtype where it is not the
    operands' (a float32 dW of half operands). A configuration the epilogue's
    aux box leaves without room is tried with half-tile stores (SUBTILE), which halve that box."""
    if INTERPRETER:
        return [_INTERPRETER_CONFIG]
    cls = _precision_class(dtype, precision)
    small = _small(p)
    strided = list(_STRIDED_CANDIDATES[cls]) + (_SMALL_STRIDED_CANDIDATES.get(cls, []) if small else [])
    aligned = p.tma_layout(dtype) is not None
    # rows not 16-byte aligned (a vocabulary of 50,257): matmul_tma on padded copies, for a
    # product big enough to pay for them, timed against the strided kernel
    if not tuning.has_tma() or not (aligned or (p.paddable() and not small and epilogue is None)):
        return strided
    out = []
    needs = dict(epilogue=epilogue, out_dtype=out_dtype)  # what the configurations' shared memory holds
    options = _TMA_CANDIDATES[cls] + (_SMALL_TMA_CANDIDATES.get(cls, []) if small else [])
    for index, option in enumerate(options):
        variants = [option]
        if index < _VARIANTS_OF[cls] or index >= len(_TMA_CANDIDATES[cls]):
            variants += [{**option, "STREAM_K": w} for w in (1, 2) if _stream_k_useful(p, option, w)]
            if cls in (TF32X3, TF32) and "PRECISION" not in option and _k_major_useful(p):
                variants += [{**v, "K_MAJOR": True} for v in variants]
        for v in variants:
            if (epilogue or out_dtype) and not v["SUBTILE"] and not _fits(v, dtype, **needs):
                v = {**v, "SUBTILE": True}
            # half tiles stored transposed go through a layout conversion in shared memory
            # (sm_90, 128x256x64 in 4 stages: 288 KiB): a transposed Z takes whole-tile stores
            if v["SUBTILE"] and p.z_transposed:
                continue
            if _fits(v, dtype, **needs) and v not in out:
                out.append(v)
    if row_sums:  # fused into the kernel, or (a few) the separate column sum, to compare
        fused = [{**c, "FUSED_SUMS": True} for c in out if _fits(c, dtype, row_sums=True, **needs)]
        out = fused + [{**c, "FUSED_SUMS": False} for c in out[:3]]
    if cls == "half" and aligned and not p.z_transposed and _ws_computes(epilogue, out_dtype):
        out.append({**_WS_CONFIG, "FUSED_SUMS": False} if row_sums else dict(_WS_CONFIG))
    return out if aligned else out[:PADDED_CANDIDATES] + strided


SMALL_STREAM_K_MIN_K_TILES = 16  # a small product's tiles are shared out stream-K from this many K tiles
# _small_default's reach: products of up to ~2.6x the MACs of the largest swept (128 x 784 x 256);
# bigger ones (a 4096-token layer of 256 features: 2^28) are not latency-bound the same way
SMALL_DEFAULT_MAX_MACS = 2**26


def _small_default(
    p: Product, dtype: torch.dtype, precision: str, epilogue: str | None, out_dtype: torch.dtype | None = None
) -> dict | None:
    """The pick for a small product, from the H200 sweep of the small MLP's layers (128 rows;
    docs/archive/bench-journal.md, version 9), where it is 2-4x faster than the big-tile default:

    * half: 64x64 tiles, K in one or two 128-wide steps (64 wide past K = 256);
    * float32 with both operands K-major (a forward): 64x32 tf32x3 tiles; with an MN-major operand
      (dX, dW), which float32 tensor cores would transpose through shared memory: 32x64 tiles on
      the FMA units (exact);
    * the strided kernel (rows not 16-byte aligned: a 10-wide output): 32x32x64 half tiles,
      16x16x64 float32 ones on the FMA units;
    * tiles shared out stream-K from SMALL_STREAM_K_MIN_K_TILES K tiles each (K = 784: yes; 256: no).

    None for float64 (the general rule)."""
    cls = _precision_class(dtype, precision)
    if cls == "float64":
        return None
    layout = p.tma_layout(dtype) if tuning.has_tma() else None
    if layout is None:
        if cls == "half":
            return _cfg(32, 32, 64, 4, 3, kind="strided")
        return _cfg(16, 16, 64, 2, 3, kind="strided", fma=True)
    if cls == "half":
        config = _cfg(64, 64, 128, 4, 2) if p.K <= 256 else _cfg(64, 64, 64, 4, 3)
    elif layout.x_k_contiguous and layout.y_k_contiguous:
        config = _cfg(64, 32, 32, 4, 4)
    else:
        config = _cfg(32, 64, 32, 4, 3, fma=True)
    if cdiv(p.K, config["BLOCK_K"]) >= SMALL_STREAM_K_MIN_K_TILES and _stream_k_useful(p, config, 1):
        config["STREAM_K"] = 1
    if (epilogue or out_dtype) and not _fits(config, dtype, epilogue=epilogue, out_dtype=out_dtype):
        config["SUBTILE"] = True
    return config


def default_config(
    p: Product,
    *,
    dtype: torch.dtype,
    precision: str,
    has_bias: bool,
    row_sums: bool = False,
    epilogue: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> dict:
    """The heuristic: for a small product (under SMALL_DEFAULT_MAX_MACS) ``_small_default``; else
    the first candidate, unless the output has fewer of its tiles than the GPU has
    multiprocessors: then, for a product the tuning pass would time (TUNE_MIN_MACS), the first
    half-size whole-tile candidate (its tiles twice as many), or below that size the first
    stream-K variant. (H200, v17: at 4,096 rows of GPT-2's layers stream-K took 1.5-3.5x the
    best whole tiles; this pick, 128x128x64 w8s4, took 1.0-1.35x the tuned best.)"""
    if not INTERPRETER and _macs(p) < SMALL_DEFAULT_MAX_MACS:
        config = _small_default(p, dtype, precision, epilogue, out_dtype)
        if config is not None:
            return {**config, "FUSED_SUMS": True} if row_sums and config["kernel"] == "tma" else config
    options = candidates(
        p,
        dtype=dtype,
        precision=precision,
        has_bias=has_bias,
        row_sums=row_sums,
        epilogue=epilogue,
        out_dtype=out_dtype,
    )
    config = options[0]
    if config["kernel"] == "tma" and schedule(p, config).dp_tiles < tuning.multiprocessors():
        area = config["BLOCK_M"] * config["BLOCK_N"] // 2
        tma = [c for c in options if c["kernel"] == "tma" and c["OCCUPANCY"] == 1 and c.get("FUSED_SUMS", True)]
        if _small(p):
            picks = [c for c in tma if c["STREAM_K"]]
        else:
            picks = [c for c in tma if c["BLOCK_M"] * c["BLOCK_N"] == area and not c["STREAM_K"]]
        if picks:
            config = picks[0]
    return config


def _extent(sizes_strides) -> int:
    """Elements a strided operand spans: 1 + sum (size - 1) * stride."""
    return 1 + sum((s - 1) * abs(st) for s, st in sizes_strides if s > 0)


def _bench_for(
    p: Product,
    *,
    dtype: torch.dtype,
    precision: str,
    has_bias: bool,
    row_sums: bool,
    epilogue,
    where: str,
    out_dtype: torch.dtype | None = None,
) -> Callable[[dict], float]:
    """A timing function for tuning: runs ``p``'s launches with a configuration on random data
    (allocated at the first call, so that a cached choice allocates nothing), with ``epilogue``'s
    activation where it is not None."""
    buffers: list = []

    def operands():
        if not buffers:
            batch = p.kept + p.reduced
            x = torch.randn(_extent([(p.M, p.x[0]), (p.K, p.x[1])] + [(d[0], d[1]) for d in batch]), device=DEVICE)
            y = torch.randn(_extent([(p.K, p.y[0]), (p.N, p.y[1])] + [(d[0], d[2]) for d in batch]), device=DEVICE)
            z = torch.empty(_extent([(p.M, p.z[0]), (p.N, p.z[1])] + [(d[0], d[3]) for d in p.kept]), device=DEVICE)
            bias = torch.randn(p.N, device=DEVICE) if has_bias else None
            sums = torch.empty(p.M, device=DEVICE) if row_sums else None
            aux = torch.randn_like(z) if epilogue is not None else None
            buffers.extend(t if t is None else t.to(dtype) for t in (x, y, z, bias, sums, aux))
            if out_dtype is not None:  # Z, its row sums and the epilogue's tile in Z's dtype
                buffers[2:] = [t if t is None else t.to(out_dtype) for t in buffers[2:]]
        return buffers

    def bench(config: dict) -> float:
        x, y, z, bias, sums, aux = operands()
        scratch = lambda shape, dt: torch.empty(shape, device=DEVICE, dtype=dt)  # noqa: E731
        timed = None if epilogue is None else Epilogue(epilogue.activation, aux, epilogue.derivative)
        launches = product_launches(
            p,
            config,
            x=x,
            y=y,
            z=z,
            bias=bias,
            dtype=dtype,
            precision=precision,
            scratch=scratch,
            row_sums=sums,
            epilogue=timed,
        )

        def run():
            for launch in launches:
                run_launch(launch, launch.kernel.instance(dtype), where, p.work())

        return tuning.time_ms(run)

    return bench


def choose_config(
    p: Product,
    *,
    dtype: torch.dtype,
    precision: str,
    has_bias: bool,
    row_sums: bool = False,
    epilogue: Epilogue | None = None,
    out_dtype: torch.dtype | None = None,
    observe: Callable[[dict, float | None], None] | None = None,
    time_small: bool = False,
    timing: bool = True,
) -> dict:
    """The configuration of product ``p``: tuned on the GPU (or cached), else the heuristic.
    ``row_sums``: the product also sums X's rows; ``epilogue``: it applies that activation;
    ``out_dtype``: Z's dtype where it is not the operands' (``candidates``). ``observe(config,
    ms)`` sees every timing (``None``: the candidate failed); ``time_small``: a small product is
    timed too (how bench/tools/matmul_sweep.py finds SMALL_DEFAULTS). ``timing=False``: the cached
    choice or the heuristic, nothing timed (a program's run, which may be recording a tape or a
    CUDA graph: lowering's dry run is where products are timed)."""
    kind = None if epilogue is None else epilogue.kind
    wanted = dict(
        dtype=dtype, precision=precision, has_bias=has_bias, row_sums=row_sums, epilogue=kind, out_dtype=out_dtype
    )
    options = candidates(p, **wanted)
    default = default_config(p, **wanted)
    key = {**p.key(), "dtype": str(dtype).replace("torch.", ""), "precision": precision, "bias": has_bias}
    if row_sums:
        key["row_sums"] = True
    if kind is not None:
        key["epilogue"] = kind
    if out_dtype is not None:
        key["out_dtype"] = str(out_dtype).replace("torch.", "")
    if p.paddable() and p.z_rows_unaligned((out_dtype or dtype).itemsize):  # stored through pointers since v43
        key["z_store"] = "pointers"  # (padded and copied before): choices cached before are not this one's
    kernel_name = matmul_tma.name if default["kernel"] == "tma" else matmul_product.name
    if _small(p) and not time_small:
        return default  # a few microseconds at most: not worth timing
    if not timing:
        return tuning.choose(kernel_name, key, options, default, None)
    bench = measure = _bench_for(p, **{**wanted, "epilogue": epilogue}, where=f"tuning {kernel_name} {key}")
    if observe is not None:

        def bench(config: dict) -> float:
            try:
                ms = measure(config)
            except Exception:
                observe(config, None)
                raise
            observe(config, ms)
            return ms

    def compile_all(configs):  # every candidate's kernels compiled at once, in worker processes
        compiling.compile_all(compiling.specialised_launches(functools.partial(measure, c) for c in configs))

    return tuning.choose(kernel_name, key, options, default, bench, before_timing=compile_all)
