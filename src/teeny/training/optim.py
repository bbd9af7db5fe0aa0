"""Optimizers over the executor's flat parameter arenas: an update is one kernel launch per
arena (one in practice) whatever the number of parameters. The update rules are PyTorch's (see
``teeny.training.optim_kernels``). Learning-rate schedules are plain functions of the step that the
training loop applies by setting ``optimizer.lr``.

What an optimizer touches is what ``torch.optim`` touches. The executor lays each arena out
with the parameters its backward writes first (``Executor.arena_order``), so an update covers
that prefix only: non-trainable parameters (frozen weights, BatchNorm's running statistics) and
trainable ones the loss does not reach are never changed, not even by weight decay. A parameter
without a gradient in a step (no backward since ``zero_grad``: PyTorch's ``.grad is None``) is
skipped as PyTorch skips it: no decay, no momentum or moment update, and its step count (Adam's
bias correction, SGD's first-step momentum) does not advance. Each parameter keeps its own step
count; consecutive parameters with a gradient and equal counts share one launch, so the common
step is one launch over the prefix. Optimizer state (momentum buffers, Adam moments) is laid out
like that prefix (or like the ranges a process owns, for ZeRO-1: ``Optimizer.own``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..core.common import sum_partials
from ..core.errors import TeenyError
from ..core.graph import Value
from ..core.runtime import ArgVisitor, Launch, launch_kernel
from ..program.executor import Executor
from . import optim_kernels as K
from .optim_kernels import (
    BLOCK,
    adam_step_kernel,
    blocks,
    clip_factor_kernel,
    loss_scale_update_kernel,
    loss_seed_kernel,
    scale_by_factor_kernel,
    sgd_step_kernel,
    sum_squares_partial_kernel,
    unscale_partial_kernel,
)

Ranges = dict[torch.dtype, list[tuple[int, int]]]  # per arena dtype: [start, end) element ranges


def _check_positive(name: str, value: float, allow_zero: bool = True) -> None:
    if not (value > 0 or (allow_zero and value == 0)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")


def _tiling(spans: list[tuple[int, int, int]], n: int) -> list[tuple[int, int]] | None:
    """The ranges that cover [0, n) one after another with the ends of ``spans`` (None if they stop short)."""
    bounds = [0] + [b for _, b, _ in spans]
    return [(bounds[i], bounds[i + 1]) for i in range(len(spans))] if bounds[-1] == n else None


class _HostUpload:
    """Copies host values into a device tensor without making the host wait for the stream.

    PyTorch makes a copy from pageable memory synchronise the stream (it waits for all the work
    queued before it), so the next step could not be queued while this one runs. On CUDA the
    values go through two pinned host buffers used in turn, each written again only once its
    last copy has finished (an event recorded behind it): the host may run one step ahead of
    the GPU. Elsewhere the copy is a plain one.
    """

    def __init__(self, target: torch.Tensor):
        self.target = target
        pinned = target.device.type == "cuda"
        count = 2 if pinned else 1
        self.buffers = [torch.empty(target.shape, dtype=target.dtype, pin_memory=pinned) for _ in range(count)]
        self.done = [torch.cuda.Event() if pinned else None for _ in self.buffers]
        self.turn = 0

    def __call__(self, values: list[float]) -> None:
        buffer, done = self.buffers[self.turn], self.done[self.turn]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has finished
        buffer.numpy()[:] = values
        self.target.copy_(buffer, non_blocking=done is not None)
        if done is not None:
            done.record(torch.cuda.current_stream(self.target.device))  # the stream the copy went on
        self.turn = (self.turn + 1) % len(self.buffers)


@dataclass(frozen=True)
class Segment:
    """One update launch: arena elements [start, end) of one dtype, whose optimizer state starts at
    ``state_start`` and whose parameters share the step count in slot ``slot``; ``range_index``
    is the owned range it lies in."""

    dtype: torch.dtype
    start: int
    end: int
    state_start: int
    slot: int
    range_index: int


class Optimizer:
    state_names: tuple[str, ...] = ()

    def __init__(self, executor: Executor, lr: float):
        if not executor.training:
            raise ValueError("optimizers need an executor of a program lowered for TRAINING")
        _check_positive("lr", lr)
        self.executor = executor
        self.lr = float(lr)
        self.base_lr = float(lr)
        self.step_count = 0  # steps taken (prepare calls)
        # the parameters the backward writes, in arena order, each with its own step count
        self.slots: list[tuple[Value, torch.dtype, int]] = [
            (v, dtype, offset)
            for dtype, entries in executor.arena_params.items()
            for v, offset in entries
            if offset < executor.grad_numel[dtype]
        ]
        self.param_steps = [0] * len(self.slots)
        # lr and the other hyperparameters (K.LR, ...), then the step counts, read by the kernels from device memory
        self.hyper = torch.zeros(K.N_HYPER + len(self.slots), dtype=torch.float64, device=executor.device)
        self._upload = _HostUpload(self.hyper)
        # the ranges of each arena this optimizer updates, with where their state starts
        self.ranges: dict[torch.dtype, list[tuple[int, int, int]]] = {
            dtype: [(0, n, 0)] for dtype, n in executor.grad_numel.items() if n
        }
        self.sharded = False
        self.state = self._allocate_state()
        self.segments: list[Segment] = []
        self._planned: frozenset | None = None  # the names the segments were planned for (equal step counts)
        self.scaler: GradScaler | None = None  # set by GradScaler(optimizer)
        self._advanced: list[int] = []  # the slots the last prepare() advanced

    def _allocate_state(self) -> dict[str, dict[torch.dtype, torch.Tensor]]:
        device = self.executor.device
        sizes = {dtype: sum(end - start for start, end, _ in ranges) for dtype, ranges in self.ranges.items()}
        return {
            name: {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
            for name in self.state_names
        }

    def own(self, ranges: Ranges) -> None:
        """Update only these ranges of the arenas (ZeRO-1: each process updates its shard, then the
        processes gather the parameters); the optimizer state then holds these ranges alone, one
        after another. Call before the first step."""
        if self.step_count:
            raise TeenyError("Optimizer.own(): call it before the first step")
        owned: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for dtype, spans in ranges.items():
            limit, offset = self.executor.grad_numel.get(dtype, 0), 0
            owned[dtype] = []
            for start, end in spans:
                if not 0 <= start <= end <= limit:
                    raise ValueError(f"Optimizer.own(): [{start}, {end}) is outside the {limit} updatable elements")
                owned[dtype].append((start, end, offset))
                offset += end - start
        tiled = all(
            [(a, b) for a, b, _ in owned.get(dtype, [])] == _tiling(owned.get(dtype, []), n)
            for dtype, n in self.executor.grad_numel.items()
            if n
        )
        self.ranges, self.sharded = owned, not tiled  # sharded: the state of some elements lives elsewhere
        self._planned = None  # the segments cut the ranges: plan them again
        self.state = self._allocate_state()

    def zero_grad(self) -> None:
        self.executor.zero_grad()

    def step(self, with_grad: Iterable[str] | None = None) -> None:
        """One update of every parameter that has a gradient: ``prepare()`` then ``launch()``."""
        self.prepare(with_grad)
        self.launch()
        # Triton's writes leave torch's version counters as they were: count the update, so that a
        # backward whose forward_train ran before it refuses (saved parameters are arena views)
        for dtype in self.ranges:
            torch.autograd.graph.increment_version(self.executor.param_arenas[dtype])

    def prepare(self, with_grad: Iterable[str] | None = None) -> None:
        """Host side of a step: advance the step counts of the parameters with a gradient, plan the
        launches, and publish lr and the step counts to the device. ``with_grad`` names the
        parameters that have a gradient this step; by default those a backward has written since
        the executor's last ``zero_grad`` (write into ``executor.grads`` yourself only after one)."""
        names = self._with_grad(with_grad)
        self.settle()
        self.step_count += 1
        self._advanced = [i for i, (v, _, _) in enumerate(self.slots) if v.name in names]
        for i in self._advanced:
            self.param_steps[i] += 1
        uniform = len(set(self.param_steps)) <= 1  # then the plan depends on the names alone
        planned = frozenset(names)
        if not (uniform and planned == self._planned):
            self.segments = self._plan(names)
            self._planned = planned if uniform else None
        values = [0.0] * K.N_HYPER
        values[K.LR.value] = self.lr
        for slot, value in self.hyperparameters().items():
            values[slot.value] = float(value)
        self._upload(values + [float(s) for s in self.param_steps])

    def settle(self) -> None:
        """With a loss scaler: if the last step was skipped (its gradients overflowed), take back
        the step counts it advanced, as PyTorch's optimizer never counts a skipped step. Reads the
        scaler's flag (a synchronisation); ``prepare`` and ``state_dict`` call it."""
        if self.scaler is not None and self._advanced and self.scaler.skipped():
            for i in self._advanced:
                self.param_steps[i] -= 1
            self.scaler.skipped_steps += 1
        self._advanced = []

    def _skip_flag(self) -> torch.Tensor | None:
        return None if self.scaler is None else self.scaler.found

    def _with_grad(self, with_grad: Iterable[str] | None) -> set[str]:
        if with_grad is None:
            written = self.executor._zeroed  # the gradients no backward has written since zero_grad
            return {v.name for v, _, _ in self.slots if v.id not in written}
        names = set(with_grad)
        unknown = sorted(names - {v.name for v, _, _ in self.slots})
        if unknown:
            raise ValueError(
                f"with_grad names {unknown}, which the backward never writes (non-trainable parameters, or "
                "ones the loss does not reach): an optimizer does not update them"
            )
        return names

    def _plan(self, names: set[str]) -> list[Segment]:
        """The launches of a step: each owned range cut into runs of consecutive parameters that
        have a gradient and equal step counts (one run, one launch, in the common case)."""
        segments = []
        for dtype, ranges in self.ranges.items():
            runs: list[tuple[int, int, int]] = []  # (start, end, slot)
            for i, (v, vdtype, offset) in enumerate(self.slots):
                if vdtype != dtype or v.name not in names:
                    continue
                end = offset + self.executor.span(v)  # with the padding before the next parameter
                if runs and runs[-1][1] == offset and self.param_steps[runs[-1][2]] == self.param_steps[i]:
                    runs[-1] = (runs[-1][0], end, runs[-1][2])
                else:
                    runs.append((offset, end, i))
            for index, (lo, hi, state_lo) in enumerate(ranges):
                for start, end, slot in runs:
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        segments.append(Segment(dtype, a, b, state_lo + a - lo, slot, index))
        return segments

    def hyperparameters(self) -> dict:
        """The constant hyperparameters by buffer slot."""
        return {}

    def launch(
        self,
        before: Callable[[torch.dtype, int], None] | None = None,
        after: Callable[[torch.dtype, int], None] | None = None,
    ) -> None:
        """The update kernels alone (one launch per arena in the common case): what a CUDA graph
        captures. ``before(dtype, i)`` / ``after(dtype, i)`` run around the launches of owned range
        i (data-parallel training waits there for that range's gradients and gathers it after)."""
        for dtype, ranges in self.ranges.items():
            for index in range(len(ranges)):
                if before is not None:
                    before(dtype, index)
                for segment in self.segments:
                    if segment.dtype == dtype and segment.range_index == index:
                        self._update(segment)
                if after is not None:
                    after(dtype, index)

    def _views(self, s: Segment) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Parameters, gradients, state and step count of segment ``s``."""
        n = s.end - s.start
        params = self.executor.param_arenas[s.dtype][s.start : s.end]
        grads = self.executor.grad_arenas[s.dtype][s.start : s.end]
        state = {name: t[s.dtype][s.state_start : s.state_start + n] for name, t in self.state.items()}
        step = self.hyper[K.N_HYPER + s.slot : K.N_HYPER + s.slot + 1]
        return params, grads, state, step

    def _update(self, segment: Segment) -> None:
        raise NotImplementedError

    # --- checkpoints ---------------------------------------------------------------------
    def counter_keys(self) -> tuple[str, ...]:
        """The entries of ``state_dict`` that are not laid out like the arenas."""
        return ("step", "lr", "param_steps") + (() if self.scaler is None else ("loss_scale",))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Step counts and state (of the owned ranges, when sharded), and the loss scaler's."""
        self.settle()
        out = {
            "step": torch.tensor(self.step_count, dtype=torch.int64),
            "lr": torch.tensor(self.lr, dtype=torch.float64),
            "param_steps": torch.tensor(self.param_steps, dtype=torch.int64),
        }
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.state.detach().cpu().clone()
        for name, arenas in self.state.items():
            for dtype, t in arenas.items():
                out[f"{name}.{str(dtype).replace('torch.', '')}"] = t
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a state written by ``state_dict`` of an unsharded optimizer (a sharded one takes its
        own ranges out of it)."""
        steps = state.get("param_steps")
        if steps is None or tuple(steps.shape) != (len(self.slots),):
            raise ValueError(
                f"optimizer state has {'no' if steps is None else len(steps)} parameter step counts, "
                f"expected {len(self.slots)}"
            )
        for name, arenas in self.state.items():
            for dtype, t in arenas.items():
                key = f"{name}.{str(dtype).replace('torch.', '')}"
                if key not in state:
                    raise KeyError(f"optimizer state is missing {key!r}")
                full = self.executor.grad_numel[dtype]
                if tuple(state[key].shape) != (full,):
                    raise ValueError(f"optimizer state {key!r} has shape {tuple(state[key].shape)}, expected ({full},)")
                source = state[key].to(t.device, t.dtype)
                for start, end, offset in self.ranges[dtype]:
                    t[offset : offset + end - start].copy_(source[start:end])
        if self.scaler is not None:
            if "loss_scale" not in state:
                raise KeyError("optimizer state is missing 'loss_scale' (the checkpoint was not trained with one)")
            self.scaler.state.copy_(state["loss_scale"].to(self.scaler.state.device, torch.float64))
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        self.param_steps = [int(s) for s in steps]
        self._advanced = []


class SGD(Optimizer):
    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        for name, value in (("momentum", momentum), ("weight_decay", weight_decay)):
            _check_positive(name, value)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum, self.dampening, self.weight_decay, self.nesterov = momentum, dampening, weight_decay, nesterov
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(executor, lr)

    def hyperparameters(self) -> dict:
        return {K.MOMENTUM: self.momentum, K.DAMPENING: self.dampening, K.WEIGHT_DECAY: self.weight_decay}

    def _update(self, segment: Segment) -> None:
        params, grads, state, step = self._views(segment)
        args = ArgVisitor().visit(
            p_ptr=params,
            g_ptr=grads,
            buf_ptr=state.get("momentum_buffer"),
            hyper_ptr=self.hyper,
            step_ptr=step,
            skip_ptr=self._skip_flag(),
            n=params.numel(),
            NESTEROV=self.nesterov,
            BLOCK=BLOCK,
        )
        launch_kernel(Launch(sgd_step_kernel, (blocks(params.numel()),), args), segment.dtype, "optimizer SGD")


class Adam(Optimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        _check_positive("eps", eps)
        _check_positive("weight_decay", weight_decay)
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        super().__init__(executor, lr)

    def hyperparameters(self) -> dict:
        return {K.BETA1: self.betas[0], K.BETA2: self.betas[1], K.EPS: self.eps, K.WEIGHT_DECAY: self.weight_decay}

    def _update(self, segment: Segment) -> None:
        params, grads, state, step = self._views(segment)
        args = ArgVisitor().visit(
            p_ptr=params,
            g_ptr=grads,
            m_ptr=state["exp_avg"],
            v_ptr=state["exp_avg_sq"],
            hyper_ptr=self.hyper,
            step_ptr=step,
            skip_ptr=self._skip_flag(),
            n=params.numel(),
            DECOUPLED=self.decoupled,
            BLOCK=BLOCK,
        )
        where = f"optimizer {type(self).__name__}"
        launch_kernel(Launch(adam_step_kernel, (blocks(params.numel()),), args), segment.dtype, where)


class AdamW(Adam):
    decoupled = True

    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(executor, lr, betas, eps, weight_decay)


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def clip_grad_norm(
    executor: Executor,
    max_norm: float,
    *,
    norm_ranges: Ranges | None = None,
    scale_ranges: Ranges | None = None,
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (like
    torch.nn.utils.clip_grad_norm_); returns the norm before clipping as a float64 device tensor
    (no host synchronisation). The norm is summed in float64 from per-block partial sums (float32
    blocks for float32 gradients, float64 for float64 ones).

    By default every gradient the backward writes counts and is scaled. Data-parallel training
    with sharded gradients passes the ``norm_ranges`` it counts and the ``scale_ranges`` it scales,
    and ``reduce``, which sums the one-element float64 sum of squares across processes in place."""
    _check_positive("max_norm", max_norm, allow_zero=False)
    prefix = {dtype: [(0, n)] for dtype, n in executor.grad_numel.items() if n}
    norm_ranges = prefix if norm_ranges is None else norm_ranges
    scale_ranges = prefix if scale_ranges is None else scale_ranges
    where = "clip_grad_norm"
    device = executor.device
    pieces = [executor.grad_arenas[d][a:b] for d, spans in norm_ranges.items() for a, b in spans if b > a]
    counts = [blocks(g.numel()) for g in pieces]
    partials = torch.empty(max(sum(counts), 1), dtype=torch.float64, device=device)
    sum_squares = torch.zeros(1, dtype=torch.float64, device=device)
    offset = 0
    for grads, count in zip(pieces, counts):
        args = ArgVisitor().visit(g_ptr=grads, partial_ptr=partials[offset:], n=grads.numel(), BLOCK=BLOCK)
        launch_kernel(Launch(sum_squares_partial_kernel, (count,), args), grads.dtype, where)
        offset += count
    if offset:
        for launch in sum_partials(partials[:offset].view(offset, 1), sum_squares):
            launch_kernel(launch, torch.float64, where)
    if reduce is not None:
        reduce(sum_squares)
    norm = torch.empty(1, dtype=torch.float64, device=device)
    factor = torch.empty(1, dtype=torch.float64, device=device)
    args = ArgVisitor().visit(sum_squares_ptr=sum_squares, norm_ptr=norm, factor_ptr=factor, max_norm=float(max_norm))
    launch_kernel(Launch(clip_factor_kernel, (1,), args), torch.float64, where)
    for dtype, spans in scale_ranges.items():
        for a, b in spans:
            if b > a:
                grads = executor.grad_arenas[dtype][a:b]
                args = ArgVisitor().visit(g_ptr=grads, factor_ptr=factor, n=b - a, BLOCK=BLOCK)
                launch_kernel(Launch(scale_by_factor_kernel, (blocks(b - a),), args), dtype, where)
    return norm[0]


class GradScaler:
    """Dynamic loss scaling for float16 compute (``precision="fp16-mixed"``), PyTorch's rule
    (``torch.amp.GradScaler``). The backward starts from the scale S instead of 1, so that small
    float16 gradients do not flush to zero; ``unscale`` divides the gradients by S again (before
    clipping and the update) and counts those that are inf or NaN. A step with any (S was too
    large: float16 overflowed) updates nothing (parameters, optimizer state, step counts) and
    multiplies S by ``backoff_factor``; ``growth_interval`` clean steps in a row multiply it by
    ``growth_factor``.

    Everything happens on the device: S, the clean-step count and the overflow flag live in a
    float64 buffer that the kernels read and write, so a captured step replays it. The host hears
    of a skipped step at the next ``Optimizer.prepare`` (one synchronisation per step), which
    keeps its per-parameter step counts exact. ``TrainStep`` applies a scaler attached to its
    optimizer; ``train()`` attaches one for ``precision="fp16-mixed"``."""

    def __init__(
        self,
        optimizer: Optimizer,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        _check_positive("init_scale", init_scale, allow_zero=False)
        if not (growth_factor > 1 and math.isfinite(growth_factor)):
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must lie in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        if optimizer.scaler is not None:
            raise TeenyError("this optimizer already has a GradScaler")
        self.executor = optimizer.executor
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.state = torch.tensor([init_scale, 0.0, 0.0], dtype=torch.float64, device=self.executor.device)
        self.found = self.state[K.FOUND_INF.value : K.FOUND_INF.value + 1]
        self.skipped_steps = 0  # steps skipped so far (counted as the host hears of them)
        optimizer.scaler = self

    @property
    def scale(self) -> float:
        """The current loss scale (reads the device: a synchronisation)."""
        return float(self.state[K.SCALE.value])

    def skipped(self) -> bool:
        """Whether the last unscaled step found an inf or NaN (a synchronisation)."""
        return bool(self.found.item())

    def seed(self, loss: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """The backward's seed: S (times ``base``, a data-parallel rank's loss weight), shaped like the loss."""
        seed = torch.empty_like(loss)
        n = seed.numel()
        args = ArgVisitor().visit(scaler_ptr=self.state, base_ptr=base, seed_ptr=seed, n=n, BLOCK=BLOCK)
        launch_kernel(Launch(loss_seed_kernel, (blocks(n),), args), seed.dtype, "GradScaler seed")
        return seed

    def unscale(
        self,
        executor: Executor,
        *,
        count_ranges: Ranges | None = None,
        scale_ranges: Ranges | None = None,
        reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Divide the gradients by S, count the non-finite ones, and update S and the skip flag.
        Data-parallel training with sharded gradients passes the ranges it counts and scales and
        ``reduce`` (a sum across processes), as for ``clip_grad_norm``."""
        where = "GradScaler unscale"
        device = executor.device
        prefix = {dtype: [(0, n)] for dtype, n in executor.grad_numel.items() if n}
        scale_ranges = prefix if scale_ranges is None else scale_ranges
        count_ranges = prefix if count_ranges is None else count_ranges
        counted = {(d, a, b) for d, spans in count_ranges.items() for a, b in spans if b > a}
        scaled = [(d, a, b) for d, spans in scale_ranges.items() for a, b in spans if b > a]
        if not counted <= set(scaled):
            raise ValueError("GradScaler.unscale: every counted range must also be a scaled range")
        pieces = [p for p in scaled if p in counted] + [p for p in scaled if p not in counted]  # counted first
        counted_blocks = sum(blocks(b - a) for d, a, b in pieces if (d, a, b) in counted)
        partials = torch.zeros(max(sum(blocks(b - a) for _, a, b in pieces), 1), dtype=torch.float64, device=device)
        nonfinite = torch.zeros(1, dtype=torch.float64, device=device)
        offset = 0
        for dtype, a, b in pieces:
            grads = executor.grad_arenas[dtype][a:b]
            args = ArgVisitor().visit(g_ptr=grads, scaler_ptr=self.state, partial_ptr=partials[offset:], n=b - a)
            args.visit(BLOCK=BLOCK)
            launch_kernel(Launch(unscale_partial_kernel, (blocks(b - a),), args), dtype, where)
            offset += blocks(b - a)
        if counted_blocks:
            for launch in sum_partials(partials[:counted_blocks].view(counted_blocks, 1), nonfinite):
                launch_kernel(launch, torch.float64, where)
        if reduce is not None:
            reduce(nonfinite)
        args = ArgVisitor().visit(scaler_ptr=self.state, nonfinite_ptr=nonfinite)
        args.visit(growth_factor=self.growth_factor, backoff_factor=self.backoff_factor)
        args.visit(growth_interval=self.growth_interval)
        launch_kernel(Launch(loss_scale_update_kernel, (1,), args), torch.float64, where)


# --------------------------------------------------------------------------- LR schedules
Schedule = Callable[[int], float]  # step (0-based) -> multiplier of the base learning rate


def constant_schedule() -> Schedule:
    return lambda step: 1.0


def warmup_schedule(warmup_steps: int, after: Schedule | None = None) -> Schedule:
    """Linear warmup from 1/warmup_steps to 1 over ``warmup_steps``, then ``after``."""
    after = after or constant_schedule()
    return lambda step: (step + 1) / warmup_steps if step < warmup_steps else after(step - warmup_steps)


def cosine_schedule(total_steps: int, warmup_steps: int = 0, min_factor: float = 0.0) -> Schedule:
    """Optional linear warmup, then cosine decay from 1 to ``min_factor`` at ``total_steps``."""
    decay = max(total_steps - warmup_steps, 1)

    def cosine(step: int) -> float:
        progress = min(step / decay, 1.0)
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    return warmup_schedule(warmup_steps, cosine) if warmup_steps else cosine


def step_schedule(step_size: int, gamma: float = 0.1) -> Schedule:
    """Multiply by ``gamma`` every ``step_size`` steps (torch.optim.lr_scheduler.StepLR)."""
    return lambda step: gamma ** (step // step_size)
