"""The tiles of the attention kernels: BLOCK_M x BLOCK_N per kernel, warps and pipeline stages,
measured per dtype and head dim (the tables), and the choice for one call (``attention_tiles``)
with the head dims' padding (``head_blocks``). The forward and dq keep BLOCK_M queries in
registers and stream keys; dkdv keeps BLOCK_N keys and streams queries (``kernels.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core import tuning
from ...core.common import cdiv, pow2
from ...core.device import INTERPRETER

__all__ = ["AttentionTiles", "Tiles", "attention_tiles", "head_blocks"]


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile: BLOCK_M query rows by BLOCK_N keys, and Triton's warps and pipeline
    stages (None: the kernel's default)."""

    block_m: int
    block_n: int
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class AttentionTiles:
    """The tiles of the three kernels of one call."""

    forward: Tiles
    dq: Tiles
    dkdv: Tiles


# bf16/fp16 on the GPU, by padded head dim: the fastest tiles of each kernel in the H200 sweep of
# bench/tools/attention.py (causal bf16 4x16x2048; docs/archive/bench-journal.md version 3): d64 fwd 64x64/w4/s3
# 0.106 ms, dq 64x64/w4/s3 0.113, dkdv 64x128/w4/s3 0.203; d128 fwd 64x64/w4/s3 0.190, dq
# 128x64/w8/s3 0.231, dkdv 64x128/w8/s3 0.374. The forward and dq keep BLOCK_M queries in
# registers and stream keys; dkdv keeps BLOCK_N keys and streams queries.
HALF_TILES = {
    64: AttentionTiles(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 128, 4, 3)),
    128: AttentionTiles(Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 128, 8, 3)),
    256: AttentionTiles(Tiles(64, 32, 4, 2), Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2)),
}
# dkdv's grid is (key/value heads, key blocks): with grouped keys and values (GQA) at a short
# length, 128-key blocks leave too few programs to balance causal work over the GPU (the Llama's
# 8 x 4 heads x 1024 keys: 256 programs, 1.9 waves on the H100, each summing 4 query heads).
# Below DKDV_MIN_WAVES waves of them, 32 x 64 tiles: H100, bf16 8x16x1024x64 with 4 key/value
# heads, causal (bench/tools/attention.py, BENCH_SWEEP; docs/performance.md, v41): 0.104 ms
# against 0.180 for 64 x 128 (64 x 64: 0.108, 64 x 128 on 8 warps: 0.118).
HALF_FEW_PROGRAMS_DKDV = Tiles(32, 64, 4, 3)
DKDV_MIN_WAVES = 4
# float32 products at tf32x3 run on tensor cores (three tf32 MMAs a product; the hi/lo halves
# of each operand double its registers), for head dims up to 64. Swept on the H200 (fwd + bwd,
# causal, docs/archive/bench-journal.md v14): at 64x8x128x32 one warpgroup on 64 x 64 tiles, 0.131 ms (128-row
# tiles 0.162: half of each causal diagonal block is masked); at 4x16x2048x64 two warpgroups on
# 128-row tiles (64 x 128 for dK/dV), 3.08 ms (64 x 64: 4.59).
FLOAT32_TILES = AttentionTiles(Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2))
FLOAT32_LONG_TILES = AttentionTiles(Tiles(128, 64, 8, 2), Tiles(128, 64, 8, 2), Tiles(64, 128, 8, 2))
FLOAT32_LONG = 512  # queries and keys from which the long tiles are used
# float64 products run on FMA units / float64 MMA, and wider float32 heads: small tiles.
WIDE_TILES = AttentionTiles(Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2))

# Under the interpreter each program costs about a millisecond whatever its size: one wide
# tile per head where it fits. Tests set TILE_OVERRIDE (``teeny.ops.attention.tuning.TILE_OVERRIDE``)
# to run several blocks per head.
INTERPRETER_TILE = 128
TILE_OVERRIDE: AttentionTiles | None = None


def head_blocks(dtype: torch.dtype, *, d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV): head dims padded to a power of two (>= 16 for tl.dot).

    On the H200 (Triton 3.6), bf16 attention with head dims padded to 32/16 gave wrong results
    and an illegal memory access while 64 was right (cf. triton-lang/triton#11366, wgmma with
    BLOCK_D=32): half-precision head dims are padded to at least 64 there."""
    least = 64 if dtype in (torch.float16, torch.bfloat16) and not INTERPRETER else 16
    return max(least, pow2(d)), max(least, pow2(dv))


def attention_tiles(dtype: torch.dtype, *, d: int, dv: int, q_len: int, k_len: int, kv_heads: int) -> AttentionTiles:
    """The tiles for one call (shapes are static per program); ``kv_heads``: the key/value heads
    of every batch element together (dkdv's programs per key block)."""
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    if INTERPRETER:
        m = min(INTERPRETER_TILE, max(16, pow2(q_len)))
        n = min(INTERPRETER_TILE, max(16, pow2(k_len)))
        return AttentionTiles(Tiles(m, n), Tiles(m, n), Tiles(m, n))
    if dtype in (torch.float16, torch.bfloat16):
        head = max(64, pow2(max(d, dv)))
        tiles = HALF_TILES[head] if head in HALF_TILES else HALF_TILES[256]
        programs = kv_heads * cdiv(k_len, tiles.dkdv.block_n)
        if head == 64 and programs < DKDV_MIN_WAVES * tuning.multiprocessors():
            tiles = AttentionTiles(tiles.forward, tiles.dq, HALF_FEW_PROGRAMS_DKDV)
        return tiles
    if dtype == torch.float32 and max(d, dv) <= 64:
        return FLOAT32_LONG_TILES if min(q_len, k_len) >= FLOAT32_LONG else FLOAT32_TILES
    return WIDE_TILES
