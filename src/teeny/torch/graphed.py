"""A tape (``teeny.program.tape``) replayed as one CUDA graph: a call's whole host path cut to one launch.

A replayed tape still spends host time on every ATen call and every launch of the run, which a
program of a few hundred nodes (a whole model under ``torch.compile(backend="teeny")``) pays at
each call: on a slow host more than its kernels take. ``GraphedReplayed`` is a ``Replayed``
whose tape, once the call's inputs have settled, is captured into a CUDA graph, and later calls
replay the graph:

* **Inputs.** A graph reads the memory it was captured on. An input at the address it had at the
  previous call (a parameter, a buffer, a tensor the forward's own graph made) is read in place,
  the address checked at every call; one that moved (a new batch, a seed gradient) is copied into
  a buffer of the graph's. A tape is captured at the first call whose moving inputs are small
  (``MAX_COPIED`` bytes, or an eighth of all the inputs); until then the tape is replayed.
* **Outputs.** The tensors a replay returns live in the graph's memory and the next replay writes
  them again. They are handed out as new tensors over that memory (``detach``), and a replay
  takes place only when nothing else holds any of them any more (torch's count of the storage's
  users back to the graph's own): a gradient a parameter's ``.grad`` still holds (accumulation
  without ``zero_grad``), or activations whose backward has not run yet (two forwards before a
  backward), send that call down the tape's path, which allocates afresh. Outputs the caller
  keeps beyond the call (a model's loss and logits) are the caller's to copy
  (``bridge.Compiled.keepable``); ``last_graphed`` says whether a call's outputs are a graph's.
* **Memory.** The graphs of one program (its forward's and its backward's) share one memory pool,
  so the backward's temporaries reuse what the forward let go of. A graph captured later may then
  sit in memory an earlier one writes as scratch, so a graph replays only when the outputs of the
  graphs captured after it are let go too: the forward's replay waits for the backward's
  gradients (accumulated gradients send it down the tape's path).
* **Checks.** The flags ops ask to have checked are read after each replay, as the tape reads them.

Only where the tape runs on a GPU, outside any capture already under way, and while
``teeny.core.config.cuda_graphs`` is on (off by default, ``TEENY_CUDA_GRAPHS=1``: see
``teeny.core.config`` for why) or the region was compiled with ``mode="reduce-overhead"``. A
capture that fails (something in the run cannot be captured) leaves the tape's path, and says
why in ``not_graphed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core import config
from ..core.runtime import capturing, raise_failed_checks
from ..program.tape import Replayed, Tape

MAX_COPIED = 64 << 20  # bytes of moving inputs a graph copies in per call, at least
MAX_CAPTURES = 8  # captures per function: one per parameter set it is called with (then: the tape)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GraphPool:
    """The memory pool the graphs of one program share, and its graphs in the order they were
    captured (a graph's scratch memory may hold the outputs of those captured after it)."""

    def __init__(self) -> None:
        self.handle = None
        self.graphs: list[_Graph] = []

    def capture_into(self) -> tuple:
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle

    def may_replay(self, graph: _Graph) -> bool:
        """Nothing but the graphs hold ``graph``'s outputs or those of the graphs captured after it."""
        return all(g.free() for g in self.graphs[self.graphs.index(graph) :])


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory (an expanded tensor): such an input
    cannot be copied into a graph's buffer. Each dimension, by rising stride, must step past all
    that the smaller ones reach."""
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


class _Graph:
    """One tape captured: where its fixed inputs must be, the buffers its moving inputs are
    copied into, its outputs and flags (the graph's own tensors), and each output storage's use
    count with only the graph holding it."""

    def __init__(self, tape: Tape, tensors: Sequence[torch.Tensor], moving: Sequence[int], pool: GraphPool):
        self.fixed = [(i, t.data_ptr()) for i, t in enumerate(tensors) if i not in moving]
        inputs = list(tensors)
        self.buffers = []
        for i in moving:
            t = tensors[i]
            buffer = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
            inputs[i] = buffer
            self.buffers.append((i, buffer))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool.capture_into(), capture_error_mode="thread_local"):
            self.outputs, self.flags = tape.replay_captured(inputs)
        del inputs
        self.owned = [_use_count(t) for t in self.outputs]
        pool.graphs.append(self)

    def free(self) -> bool:
        """Whether nothing but the graph holds its outputs (a replay may write them again)."""
        return all(_use_count(t) <= n for t, n in zip(self.outputs, self.owned))

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(tensors[i].data_ptr() == address for i, address in self.fixed)

    def replay(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        for i, buffer in self.buffers:
            buffer.copy_(tensors[i])
        self.graph.replay()
        if self.flags:
            raise_failed_checks(self.flags)
        return [t.detach() for t in self.outputs]


class GraphedReplayed(Replayed):
    """``Replayed`` whose tapes are replayed as CUDA graphs (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[[list], list],
        blocked: str | None = None,
        pool: GraphPool | None = None,
        always: bool = False,
    ):
        super().__init__(fn, blocked)
        self.pool = pool or GraphPool()  # shared with the other direction's (bridge.Compiled)
        self.always = always  # graphs whatever config.cuda_graphs says (torch.compile's mode="reduce-overhead")
        self.graphs: dict[tuple | None, _Graph] = {}
        self.captures = 0  # a graph whose fixed inputs moved is captured again, up to MAX_CAPTURES times
        self.addresses: dict[tuple | None, list[int]] = {}  # the inputs' addresses at the pattern's last call
        self.not_graphed: str | None = None
        self.graph_replays = 0  # how many calls a graph answered (tests and benches read it)
        self.last_graphed = False  # whether the last call's outputs are a graph's (Compiled.forward copies them)

    def __call__(self, tensors: Sequence[torch.Tensor], consume: bool = False) -> list[torch.Tensor]:
        self.last_graphed = False
        return super().__call__(tensors, consume)

    def replay_tape(self, pattern: tuple | None, tape: Tape, tensors: Sequence[torch.Tensor], consume: bool):
        wanted = self.always or config.cuda_graphs
        if not wanted or self.not_graphed is not None or tape.device.type != "cuda" or capturing():
            return super().replay_tape(pattern, tape, tensors, consume)
        graph = self.graphs.get(pattern)
        if graph is not None and not graph.fits(tensors):  # a parameter was replaced: capture again
            self.pool.graphs.remove(self.graphs.pop(pattern))  # (its memory goes back once its outputs are let go)
            graph = None
        if graph is None:
            graph = self._capture(pattern, tape, tensors)
        if graph is None or not self.pool.may_replay(graph):
            self.addresses[pattern] = [t.data_ptr() for t in tensors]
            return super().replay_tape(pattern, tape, tensors, consume)
        outputs = graph.replay(tensors)
        if consume:
            tensors.clear()
        self.graph_replays += 1
        self.last_graphed = True
        return outputs

    def _capture(self, pattern: tuple | None, tape: Tape, tensors: Sequence[torch.Tensor]) -> _Graph | None:
        """The tape captured, when the inputs that moved since the last call are few (else None)."""
        before = self.addresses.get(pattern)
        if before is None:
            return None
        moving = [i for i, (t, address) in enumerate(zip(tensors, before)) if t.data_ptr() != address]
        moved = sum(tensors[i].untyped_storage().nbytes() for i in moving)
        total = sum(t.untyped_storage().nbytes() for t in tensors)
        if moved > max(MAX_COPIED, total // 8):
            return None
        if self.captures >= MAX_CAPTURES:
            self.not_graphed = f"its fixed inputs moved {MAX_CAPTURES} times: replayed as a tape from now on"
            return None
        if any(_overlaps_itself(tensors[i]) for i in moving):
            self.not_graphed = "an input that moves between calls overlaps itself (expanded): it cannot be copied in"
            return None
        try:
            graph = _Graph(tape, tensors, moving, self.pool)
        except Exception as exc:  # something in the run cannot be captured: the tape's path from now on
            self.not_graphed = f"the capture failed: {type(exc).__name__}: {str(exc)[:200]}"
            return None
        self.captures += 1
        self.graphs[pattern] = graph
        return graph
