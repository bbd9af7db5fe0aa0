"""Where the normalisation kernels' rows lie and how tiles and programs cover them: the layout of
the statistics rows of x (``Rows``), the (ROWS, BLOCK) tile of a launch, its warps and stages, and
the programs of the fused backward. The sizes are module constants, read when a node's launches
are made (tests lower them to reach long rows, multi-row tiles and several programs on the CPU)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from ...core.common import pow2
from ...core.device import DEVICE, INTERPRETER
from ...core.kernel import Kernel
from ...core.runtime import Block
from .kernels import COLUMN_CHANNEL, GROUP_CHANNEL, ROW_CHANNEL

MAX_BLOCK = 4096 if INTERPRETER else 16384  # longest column block of one row; longer rows loop (tests lower it)
INTERPRETER_TILE = 1 << 15  # elements of one tile under the interpreter (few, wide programs)
GPU_TILE = 4096  # elements of one tile on the GPU (short rows: several rows per program)
PROGRAMS_PER_SM = 2  # programs (= dw/db partial rows) of the fused backward on the GPU
INTERPRETER_PROGRAMS = 4  # the same under the interpreter
ROWS_PER_WEIGHT_PROGRAM = 32  # rows reduced by one program of norm_weight_backward


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Where the statistics rows of x lie (see the index maths above the kernels, ``kernels.py``)."""

    rows: int
    row_len: int
    inner: int
    row_stride: int
    outer_stride: int
    spatial: int  # elements per channel in a row (rows of x)
    channels: int
    groups: int
    channel_is_row: bool = False

    @property
    def channel(self) -> tl.constexpr:
        """The CHANNEL constant of the kernels."""
        if self.channel_is_row:
            return ROW_CHANNEL
        return COLUMN_CHANNEL if self.groups == 1 and self.spatial == 1 else GROUP_CHANNEL

    def index_args(self) -> dict:
        """The kernels' index arguments, by name."""
        return dict(
            n_rows=self.rows,
            row_stride=self.row_stride,
            outer_stride=self.outer_stride,
            channels_per_group=self.channels // max(self.groups, 1),
            groups=self.groups,
            ROW_LEN=self.row_len,
            INNER=max(self.inner, 1),
            SPATIAL=self.spatial,
            CHANNEL=self.channel,
        )


def column_block(n: int) -> int:
    """BLOCK for rows of ``n`` elements: the row's power of two, 16 to ``MAX_BLOCK``."""
    return max(16, min(pow2(n), MAX_BLOCK))


def tile_shape(rows: int, row_len: int, dtype: torch.dtype) -> tuple[int, int]:
    """(ROWS, BLOCK) of a tile: a block of the row, and as many rows as fill the tile budget
    (on the GPU, half as many float64 elements: they take two registers each)."""
    block = column_block(row_len)
    budget = INTERPRETER_TILE if INTERPRETER else GPU_TILE // (2 if dtype == torch.float64 else 1)
    return max(1, min(budget // block, pow2(rows))), block


def launch_block(kernel: Kernel, *, block: int, tile: int, elements_per_warp: int) -> Block:
    """The ``BLOCK`` size, num_warps for the tile (about ``elements_per_warp`` each, 4 to 16) and
    two pipeline stages for the row loop (docs/archive/bench-journal.md: on the H200 stages=2 beat 1 and the
    default 3 for bf16 16384x4096), unless the kernel was tuned (Kernel.tune, bench/tools/tune_launch.py)."""
    if INTERPRETER or kernel.launch_options:
        return Block(block)
    return Block(block, num_warps=max(4, min(16, tile // elements_per_warp)), num_stages=2)


@functools.cache
def _sm_count() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def max_programs() -> int:
    """Programs (and dw/db partial rows) of the fused backward: a few per SM on the GPU, so
    that every SM streams rows while the partial rows stay few."""
    return INTERPRETER_PROGRAMS if INTERPRETER else PROGRAMS_PER_SM * _sm_count()
