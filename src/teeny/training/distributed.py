"""Data-parallel training over ``torch.distributed``: NCCL on GPUs, gloo on CPUs.

Start one process per GPU (or per CPU worker) with torchrun, which sets up the env:// rendezvous:
``torchrun --nproc-per-node N -m teeny train MODEL ...`` or ``teeny train MODEL --nproc N``. In
your own script call ``teeny.training.distributed.init()`` before building executors, then ``train()``
(or a ``TrainStep`` with ``parallel=DataParallel(...)``) runs data-parallel.

A step (``DataParallel`` inside ``TrainStep``):

* Every process runs the same program on its rows of the global batch (``data.shard``). Rank r's
  loss is a mean over its c_r terms (samples, or targets not equal to ignore_index), so its
  backward is seeded with w_r = c_r / sum_q c_q instead of 1: the sum over ranks of the
  gradients is then the gradient of the mean over all ranks' terms, as one process with the
  whole batch computes it, and the reported loss is sum_r w_r loss_r. The counts are summed
  across ranks inside the step (one tiny all-reduce that overlaps the forward).
* The executor lays the gradient arena out in reverse order of first use, so the backward
  finishes it front to back. It is cut into buckets of about ``bucket_mb``; each bucket's
  all-reduce (a sum) starts as soon as the backward has written its last gradient, as an async
  collective (on NCCL's own stream on the GPU, on gloo's threads on the CPU), so communication
  overlaps the rest of the backward. The optimizer updates bucket by bucket and waits for each
  bucket's collective just before that bucket's launch; clipping waits for all of them.
* ZeRO stage 1 (``zero=True``): buckets are reduce-scattered instead. Rank r owns the r-th slice
  of every bucket, keeps optimizer state for its slices only (1/N of it), updates them with the
  same kernels, and all-gathers each bucket's parameters after its update; the few elements past
  the last multiple of N (fewer than N) are all-reduced and updated on every rank. Checkpoints
  hold the gathered, unsharded state, so they do not depend on the number of ranks.
* CUDA graphs: on the GPU the whole step, NCCL collectives included, is captured by
  ``TrainStep`` (PyTorch captures NCCL collectives from NCCL 2.9.6 on). Gloo's collectives run
  on the host and cannot be captured (the CPU path never captures). Where a capture fails (an
  older NCCL, ``TORCH_NCCL_BLOCKING_WAIT=1``, ``NCCL_ALGO`` settings that need host work),
  ``TrainStep`` says so and trains eagerly.
* Non-trainable parameters (BatchNorm's running statistics) are rank-local, as in DDP with
  ``broadcast_buffers=False``: rank 0's are evaluated and saved.

Faults: every collective runs under the process group's timeout (``init(timeout=...)``,
``teeny train --timeout``). A rank that dies breaks its connections and the others stop at once
with ``DistributedError``; a rank that hangs makes the others stop once the timeout passes (on
the GPU NCCL's watchdog aborts the communicator after the timeout); such a process then ends with
its error (``end_process``: `teeny train` exits 1), not through the broken group's
teardown, which can abort it. A batch that does not split
evenly over the ranks, or more ranks per machine than GPUs, is refused before training starts.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..program.executor import Executor
    from .optim import Optimizer

T = TypeVar("T")

# the one-tensor collectives (renamed in torch 2.13; the old names warn there)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistributedError(RuntimeError):
    """A data-parallel run cannot go on: another process died or hung, or the setup is wrong."""

    exit_code = 1  # what `teeny` exits with (a wrong setup is refused by `init`, which the command reports as 2)


@dataclass(frozen=True)
class World:
    """This process's place in the process group."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: float  # seconds a collective may wait

    def collective(self, what: str, fn: Callable[[], T]) -> T:
        """Run a collective call (or a wait on one), turning a failure into a ``DistributedError``
        that says what this rank was doing."""
        try:
            return fn()
        except DistributedError:
            raise
        except RuntimeError as exc:
            global _FAILED
            _FAILED = True
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(
                f"rank {self.rank}: {what} failed: another process stopped, or did not answer within "
                f"{self.timeout:g} s ({detail})"
            ) from exc


_WORLD: World | None = None
_FAILED = False  # a collective of this process failed: a peer died or hung


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"{name} is not set")
        return default
    return int(value)


def init(timeout: float = 600.0, backend: str | None = None) -> World:
    """Join the process group torchrun set up (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK): NCCL on this process's GPU (``cuda:LOCAL_RANK``), or gloo on the
    CPU. ``timeout``: seconds any collective may wait for the other processes. Call it before
    anything runs a teeny kernel (the device is chosen on first use)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DistributedError(
            f"teeny.training.distributed.init(): {', '.join(missing)} not set; start the processes with torchrun "
            "(torchrun --nproc-per-node N ...) or `teeny train MODEL --nproc N`"
        )
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    rank, size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK", 0)
    choice = os.environ.get("TEENY_DEVICE", "auto").strip().lower() or "auto"
    use_cuda = choice in ("cuda", "gpu") or (choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise DistributedError("TEENY_DEVICE=cuda, but torch sees no CUDA device")
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            local_size = _env_int("LOCAL_WORLD_SIZE", size)
            raise DistributedError(
                f"{local_size} processes on this machine, but it has {gpus} GPU(s): start at most {gpus}"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if use_cuda else "gloo")
    options: dict[str, Any] = {"backend": backend, "init_method": "env://", "timeout": timedelta(seconds=timeout)}
    if backend == "nccl":
        options["device_id"] = device
    try:
        dist.init_process_group(**options)
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(f"rank {rank}: could not join the process group: {exc}") from exc
    from ..core.device import DEVICE  # after set_device: teeny's default device is this process's GPU

    if DEVICE != device:
        raise DistributedError(
            f"rank {rank}: teeny chose {DEVICE} before teeny.training.distributed.init() bound this process to "
            f"{device}; "
            "call init() before running any teeny kernel"
        )
    _WORLD = World(rank, size, local_rank, device, backend, float(timeout))
    return _WORLD


def current() -> World | None:
    """The ``World`` of this process: the one ``init()`` joined, one describing a process group
    the caller initialised itself, or None outside a process group."""
    if _WORLD is not None:
        return _WORLD
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    local = _env_int("LOCAL_RANK", 0)
    return World(dist.get_rank(), dist.get_world_size(), local, device, backend, 600.0)


def shutdown() -> None:
    """Leave the process group (at the end of a run). After a failed collective the group is
    left as it is: a peer is gone or hung, and tearing the group down waits on it or, with gloo,
    can abort the process ("terminate called without an active exception") instead of letting
    it exit with its error; a worker ends through ``end_process``."""
    global _WORLD
    if dist.is_available() and dist.is_initialized() and not _FAILED:
        dist.destroy_process_group()
    _WORLD = None


def end_process(code: int) -> None:
    """End this process now with ``code`` (output flushed), past the interpreter's teardown: gloo's
    threads can abort that teardown ("terminate called without an active exception") after a
    failed collective, and on a loaded machine now and then after a clean run too, which turns a
    finished run into a failed one. For the end of ``teeny train``'s workers, after ``shutdown``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def agree(world: World | None, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result, or raise on every rank the
    error it raised (checks of files only rank 0 reads or writes: the others must not go on, or
    hang, when they fail). Without a world, just ``fn()``."""
    if world is None:
        return fn()
    outcome: list[Any] = [None]
    if world.rank == 0:
        try:
            outcome = [("ok", fn())]
        except Exception as exc:  # every rank raises it below
            try:
                pickle.dumps(exc)
            except Exception:
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            outcome = [("error", exc)]
    world.collective("waiting for rank 0", lambda: dist.broadcast_object_list(outcome, src=0))
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


# ----------------------------------------------------------------------------- DataParallel


@dataclass
class Bucket:
    """Gradient arena elements [start, end) of one dtype, reduced by one collective once the
    backward of node ``ready_after`` has run; this rank updates ``owned`` of it."""

    dtype: torch.dtype
    start: int
    end: int
    owned: tuple[int, int]
    scatter: bool  # reduce-scatter (ZeRO-1) rather than all-reduce
    ready_after: int
    issued: bool = False  # this step's collective has started
    work: Any = field(default=None, repr=False)


class DataParallel:
    """Averages gradients across the ranks of ``world`` for ``executor`` and ``optimizer`` (see
    the module docstring); ``TrainStep(..., parallel=this)`` runs the steps. Broadcasts rank 0's
    parameters to every rank at once."""

    def __init__(
        self, world: World, executor: Executor, optimizer: Optimizer, zero: bool = False, bucket_mb: float = 25.0
    ):
        if optimizer.executor is not executor:
            raise ValueError("DataParallel: the optimizer belongs to another executor")
        if optimizer.step_count:
            raise ValueError("DataParallel: wrap the optimizer before its first step")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if getattr(executor, "_data_parallel", None) is not None:
            raise ValueError("DataParallel: this executor is already data-parallel")
        executor._data_parallel = self
        self.world, self.executor, self.optimizer, self.zero = world, executor, optimizer, zero
        self.bucket_mb = bucket_mb
        self.buckets = self._plan_buckets(bucket_mb)
        self.by_range: dict[tuple[torch.dtype, int], Bucket] = {}
        ranges: dict[torch.dtype, list[tuple[int, int]]] = {}
        for b in self.buckets:
            spans = ranges.setdefault(b.dtype, [])
            self.by_range[(b.dtype, len(spans))] = b
            spans.append(b.owned)
        optimizer.own(ranges)
        self._hook_backward()
        device = executor.device
        self.count = torch.zeros(1, dtype=torch.float64, device=device)  # this rank's loss terms (set per step)
        self.total = torch.zeros(1, dtype=torch.float64, device=device)
        self.weight = torch.ones(1, dtype=torch.float64, device=device)
        self._count_work = self._loss_work = None
        self._loss: torch.Tensor | None = None
        self._gathers: list[Any] = []
        self.broadcast_params()

    # --- layout ----------------------------------------------------------------------------
    def _plan_buckets(self, bucket_mb: float) -> list[Bucket]:
        from ..program.executor import gradient_final_node

        size, rank = self.world.size, self.world.rank
        final = gradient_final_node(self.executor.program)
        buckets = []
        for dtype, total in self.executor.grad_numel.items():
            if not total:
                continue
            entries = [(v, offset) for v, offset in self.executor.arena_params[dtype] if offset < total]

            def ready_after(position: int) -> int:
                for v, offset in entries:
                    if offset <= position < offset + self.executor.span(v):
                        return final[v.id]
                raise AssertionError(position)

            element = torch.empty((), dtype=dtype).element_size()
            cap = max(1, int(bucket_mb * 2**20) // element)
            step = size if self.zero else 1
            cap = max(step, cap // step * step)
            even = total - total % step
            start = 0
            while start < even:
                end = min(start + cap, even)
                if self.zero:
                    chunk = (end - start) // size
                    owned = (start + rank * chunk, start + (rank + 1) * chunk)
                else:
                    owned = (start, end)
                buckets.append(Bucket(dtype, start, end, owned, self.zero, ready_after(end - 1)))
                start = end
            if even < total:  # ZeRO-1: the last few elements (fewer than the ranks), on every rank
                buckets.append(Bucket(dtype, even, total, (even, total), False, ready_after(total - 1)))
        return buckets

    def _hook_backward(self) -> None:
        """Start each bucket's collective right after the node whose backward writes its last
        gradient. (The executor has no backward hook of its own: this wraps its per-node method.)"""
        program = self.executor.program
        index_of = {id(p): i for i, p in enumerate(program.nodes)}
        ready: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            ready.setdefault(b.ready_after, []).append(b)
        node_backward = self.executor._node_backward

        def node_backward_then_reduce(p, *args) -> None:
            node_backward(p, *args)
            for b in ready.get(index_of[id(p)], ()):
                self._reduce(b)

        self.executor._node_backward = node_backward_then_reduce

    # --- collectives -----------------------------------------------------------------------
    def _reduce(self, b: Bucket) -> None:
        b.issued = True
        grads = self.executor.grad_arenas[b.dtype][b.start : b.end]
        if b.scatter:
            mine = grads[b.owned[0] - b.start : b.owned[1] - b.start]
            b.work = self.world.collective(
                "reduce-scatter of gradients", lambda: _reduce_scatter(mine, grads, async_op=True)
            )
        else:
            b.work = self.world.collective("all-reduce of gradients", lambda: dist.all_reduce(grads, async_op=True))

    def _wait(self, b: Bucket) -> None:
        if b.work is not None:
            work, b.work = b.work, None
            self.world.collective("waiting for the gradients of the other ranks", work.wait)

    def broadcast_params(self) -> None:
        """Every rank takes rank 0's parameters (all of them, non-trainable ones included)."""
        for arena in self.executor.param_arenas.values():
            self.world.collective("broadcast of rank 0's parameters", lambda a=arena: dist.broadcast(a, src=0))

    def sync_from_lead(self, state: dict[str, torch.Tensor] | None) -> None:
        """After rank 0 loaded a checkpoint: broadcast its parameters, and its (unsharded) optimizer
        ``state`` (given on rank 0 only), which every other rank loads."""
        self.broadcast_params()
        optimizer, device = self.optimizer, self.world.device
        template = {
            "step": torch.zeros((), dtype=torch.int64),
            "lr": torch.zeros((), dtype=torch.float64),
            "param_steps": torch.zeros(len(optimizer.slots), dtype=torch.int64),
        }
        if optimizer.scaler is not None:
            template["loss_scale"] = torch.zeros(optimizer.scaler.state.numel(), dtype=torch.float64)
        for name, arenas in optimizer.state.items():
            for dtype in arenas:
                key = f"{name}.{str(dtype).replace('torch.', '')}"
                template[key] = torch.zeros(self.executor.grad_numel[dtype], dtype=dtype)
        full = {}
        for key in sorted(template):
            t = (state[key] if self.world.rank == 0 else template[key]).to(device=device, dtype=template[key].dtype)
            t = t.contiguous().clone()
            self.world.collective("broadcast of the optimizer state", lambda t=t: dist.broadcast(t, src=0))
            full[key] = t
        if self.world.rank != 0:
            optimizer.load_state_dict(full)

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """The optimizer state as an unsharded optimizer holds it (gathered from every rank under
        ZeRO-1: a collective, so every rank calls it)."""
        state = self.optimizer.state_dict()
        if not self.zero:
            return state
        size = self.world.size
        full = {k: v for k, v in state.items() if k in self.optimizer.counter_keys()}
        for name, arenas in self.optimizer.state.items():
            for dtype, local in arenas.items():
                gathered = torch.empty(size * local.numel(), dtype=dtype, device=local.device)
                self.world.collective("gathering the optimizer state", lambda g=gathered, t=local: _all_gather(g, t))
                out = torch.zeros(self.executor.grad_numel[dtype], dtype=dtype, device=local.device)
                for (rdtype, index), b in self.by_range.items():
                    if rdtype != dtype:
                        continue
                    _, _, offset = self.optimizer.ranges[dtype][index]
                    if not b.scatter:  # replicated: every rank holds the same
                        out[b.start : b.end].copy_(local[offset : offset + b.end - b.start])
                        continue
                    chunk = (b.end - b.start) // size
                    for q in range(size):
                        source = gathered[q * local.numel() + offset :][:chunk]
                        out[b.start + q * chunk : b.start + (q + 1) * chunk].copy_(source)
                full[f"{name}.{str(dtype).replace('torch.', '')}"] = out
        return full

    # --- one step (called by TrainStep) ------------------------------------------------------
    def set_loss_count(self, count: int) -> None:
        """How many terms this rank's loss averages over in the coming step (host side)."""
        self.count.fill_(float(count))

    def start_step(self) -> None:
        """Sum the ranks' loss counts (overlapping the forward)."""
        for b in self.buckets:
            b.issued = False
        self.total.copy_(self.count)
        self._count_work = self.world.collective(
            "all-reduce of the loss counts", lambda: dist.all_reduce(self.total, async_op=True)
        )

    def loss_seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The backward's seed, w_r = c_r / sum c; starts summing the weighted losses."""
        work, self._count_work = self._count_work, None
        self.world.collective("waiting for the loss counts", work.wait)
        torch.div(self.count, self.total, out=self.weight)
        self._loss = loss.detach().to(torch.float64).reshape(1) * self.weight
        self._loss_work = self.world.collective(
            "all-reduce of the loss", lambda: dist.all_reduce(self._loss, async_op=True)
        )
        return self.weight.to(loss.dtype).reshape(loss.shape)

    def end_backward(self) -> None:
        """Start the collective of any bucket whose last node did not run (none in practice)."""
        for b in self.buckets:
            if not b.issued:
                self._reduce(b)

    def wait_range(self, dtype: torch.dtype, index: int) -> None:
        """Before the optimizer updates its owned range ``index`` of ``dtype``: that bucket's gradients."""
        self._wait(self.by_range[(dtype, index)])

    def gather_range(self, dtype: torch.dtype, index: int) -> None:
        """After the update of a reduce-scattered bucket: gather its parameters from every rank."""
        b = self.by_range[(dtype, index)]
        if not b.scatter:
            return
        params = self.executor.param_arenas[dtype][b.start : b.end]
        mine = params[b.owned[0] - b.start : b.owned[1] - b.start]
        self._gathers.append(
            self.world.collective("all-gather of parameters", lambda: _all_gather(params, mine, async_op=True))
        )

    def clip_options(self) -> dict[str, Any]:
        """``clip_grad_norm`` arguments for the averaged gradients (waits for all of them)."""
        for b in self.buckets:
            self._wait(b)
        if not self.zero:
            return {}
        norm_ranges: dict[torch.dtype, list[tuple[int, int]]] = {}
        scale_ranges: dict[torch.dtype, list[tuple[int, int]]] = {}
        for b in self.buckets:
            scale_ranges.setdefault(b.dtype, []).append(b.owned)
            if b.scatter or self.world.rank == 0:  # a replicated tail counts once
                norm_ranges.setdefault(b.dtype, []).append(b.owned)

        def reduce(sum_squares: torch.Tensor) -> None:
            self.world.collective("all-reduce of the gradient norm", lambda: dist.all_reduce(sum_squares))

        return {"norm_ranges": norm_ranges, "scale_ranges": scale_ranges, "reduce": reduce}

    def finish_step(self, loss: torch.Tensor) -> torch.Tensor:
        """Wait for the parameter gathers and the loss; returns the global loss (float64)."""
        for work in self._gathers:
            self.world.collective("waiting for the parameters of the other ranks", work.wait)
        self._gathers = []
        work, self._loss_work = self._loss_work, None
        self.world.collective("waiting for the loss of the other ranks", work.wait)
        return self._loss.reshape(())

    # --- reports -----------------------------------------------------------------------------
    def memory(self) -> dict[str, float]:
        """MiB per rank: parameters, gradients, this rank's optimizer state, and the state an
        unsharded optimizer would hold."""

        def mib(tensors) -> float:
            return sum(t.numel() * t.element_size() for t in tensors) / 2**20

        state = [t for arenas in self.optimizer.state.values() for t in arenas.values()]
        unsharded = sum(
            self.executor.grad_numel[dtype] * torch.empty((), dtype=dtype).element_size()
            for arenas in self.optimizer.state.values()
            for dtype in arenas
        )
        return {
            "params_mib": mib(self.executor.param_arenas.values()),
            "grads_mib": mib(self.executor.grad_arenas.values()),
            "optimizer_state_mib": mib(state),
            "optimizer_state_unsharded_mib": unsharded / 2**20,
        }

    def describe(self) -> str:
        m = self.memory()
        text = (
            f"data-parallel over {self.world.size} processes ({self.world.backend}), {len(self.buckets)} gradient "
            f"bucket(s) of <= {self.bucket_mb:g} MiB; per rank: parameters {m['params_mib']:.2f} MiB, gradients "
            f"{m['grads_mib']:.2f} MiB, optimizer state {m['optimizer_state_mib']:.2f} MiB"
        )
        if self.zero:
            text += f" (ZeRO-1; unsharded {m['optimizer_state_unsharded_mib']:.2f} MiB)"
        return text
