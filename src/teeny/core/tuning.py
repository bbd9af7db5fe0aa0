"""Launch configurations chosen per static shape when a program is lowered.

Shapes are static per program, so an op can pick its tile configuration once, at lowering: a
short timing pass on the GPU over a few candidates, whose winner is kept in memory and in a
cache file on disk, so that the next process (and the next program with the same shape) reads
it instead of timing again. Under the Triton interpreter, or with tuning switched off, the op's
heuristic default is the answer.

    config = tuning.choose("matmul_tma", key, candidates, default, bench)

``key`` names what the choice depends on (shape, dtype, layout, precision, ...): a JSON-able
value. Every cache entry is also keyed by the GPU's name and the Triton version, so a cache
copied to another machine, or kept across a Triton upgrade, is not misread. ``candidates`` are
JSON-able dicts (tile sizes, ``num_warps``, ``num_stages``); ``bench(config)`` runs the op's
launches with ``config`` on real tensors and returns milliseconds (``time_ms`` measures a
callable inside a CUDA graph, so that host launch cost does not hide the kernel's time). A
candidate that fails to compile or launch (too much shared memory, ...) is skipped; a cached
winner that is no longer among the candidates is timed again.

Where: ``$TEENY_TUNING_CACHE`` (a file path) if set, else ``$XDG_CACHE_HOME/teeny/tuning.json``
(``~/.cache/teeny/tuning.json``). Timing runs on a GPU unless ``TEENY_TUNING=0``;
``TEENY_TUNING=1`` cannot switch it on under the interpreter (there is nothing to time).

Also here, because configuration choices need them: the facts of the GPU (``gpu_name``,
``multiprocessors``, ``has_tma``). (The global scratch memory that kernels creating TMA
descriptors need is given at their launch: ``@kernel(device_scratch=True)``.)
"""

from __future__ import annotations  # noqa: I001  (teeny's device before triton)

import contextlib
import fcntl
import functools
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .device import DEVICE, INTERPRETER  # (before triton: it chooses interpreter or GPU)

import torch
import triton

Config = dict[str, Any]

CACHE_FORMAT = 1
_MEMORY: dict[str, Config] = {}


# ----------------------------------------------------------------------------- the machine


@functools.cache
def gpu_name() -> str:
    """The GPU's name as the driver reports it ("NVIDIA H200"); "interpreter" on the CPU."""
    if INTERPRETER:
        return "interpreter"
    return torch.cuda.get_device_name(DEVICE)


@functools.cache
def multiprocessors() -> int:
    """Streaming multiprocessors of the GPU (132 on an H200): the size of a persistent grid.
    Under the interpreter, 4 (each program instance costs about a millisecond there)."""
    if INTERPRETER:
        return 4
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


@functools.cache
def has_tma() -> bool:
    """Whether the GPU has the tensor memory accelerator (Hopper, compute capability 9.0, on)."""
    if INTERPRETER:
        return False
    return torch.cuda.get_device_capability(DEVICE)[0] >= 9


# ----------------------------------------------------------------------------- switches


def enabled() -> bool:
    """Whether ``choose`` times candidates: on a GPU unless ``TEENY_TUNING=0``."""
    if INTERPRETER:
        return False
    return os.environ.get("TEENY_TUNING", "1").strip().lower() not in ("0", "false", "off", "no", "")


def cache_path() -> Path:
    """The cache file: ``$TEENY_TUNING_CACHE``, else ``$XDG_CACHE_HOME/teeny/tuning.json``."""
    explicit = os.environ.get("TEENY_TUNING_CACHE", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base).expanduser() / "teeny" / "tuning.json"


def entry_key(kernel: str, key: Any) -> str:
    """The cache key of one choice: GPU, Triton version, kernel and the caller's key."""
    return f"{gpu_name()} | triton {triton.__version__} | {kernel} | {json.dumps(key, sort_keys=True)}"


# ----------------------------------------------------------------------------- the cache file


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"teeny tuning cache {path} is unreadable ({exc}); starting a new one", stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _write(path: Path, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key``, keeping what other processes wrote: under an exclusive lock on
    ``<path>.lock`` (parallel ranks tuning at once wait their turn instead of each writing back the
    file as it read it, without the others' entries), read the file, merge, write a temporary
    file and rename it (a reader, who takes no lock, never sees half a file)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            entries = _read(path)
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"format": CACHE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
    except OSError as exc:  # a read-only home: keep the choice in memory only
        warnings.warn(f"teeny tuning cache {path} cannot be written ({exc})", stacklevel=3)
    finally:
        if tmp is not None:  # a write that failed half way (a full disk)
            Path(tmp).unlink(missing_ok=True)


def cached(kernel: str, key: Any) -> Config | None:
    """The cached choice for ``kernel`` and ``key`` on this machine, if any."""
    full = entry_key(kernel, key)
    if full in _MEMORY:
        return _MEMORY[full]
    entry = _read(cache_path()).get(full)
    return dict(entry["config"]) if isinstance(entry, dict) and isinstance(entry.get("config"), dict) else None


def forget_memory() -> None:
    """Drop the choices held in memory (the disk cache stays): for tests."""
    _MEMORY.clear()
    _PREPARED.clear()


# ----------------------------------------------------------------------------- choosing


def choose(
    kernel: str,
    key: Any,
    candidates: Sequence[Config],
    default: Config,
    bench: Callable[[Config], float] | None,
    before_timing: Callable[[Sequence[Config]], Any] | None = None,
) -> Config:
    """The configuration to launch ``kernel`` with for ``key``: the cached winner (if it was timed
    against every one of ``candidates``), else the fastest of ``candidates`` by ``bench`` (then
    cached), else ``default`` (tuning off, no bench: nothing is timed, or every candidate failed).
    ``before_timing(candidates)`` runs once before the candidates are timed (only then): where
    the products compile them all at once (``teeny.core.compiling``); inside ``deferred()`` it
    is handed to the caller instead, and the default answered."""
    if not enabled() or not candidates:
        return default
    full = entry_key(kernel, key)
    hit = _MEMORY.get(full)
    if hit is not None:
        return hit
    entry = _read(cache_path()).get(full)
    if isinstance(entry, dict) and entry.get("config") in list(candidates):
        timed = [t[1] for t in entry.get("timed", []) if isinstance(t, list) and len(t) == 2]
        if all(c in timed for c in candidates):  # a candidate added since (a new kernel) is timed
            _MEMORY[full] = dict(entry["config"])
            return _MEMORY[full]
    if bench is None:
        return default
    if before_timing is not None and full not in _PREPARED:
        pending = getattr(_DEFERRED, "pending", None)
        if pending is not None:  # (deferred): prepared with the others first, timed on a second pass
            pending.setdefault(full, functools.partial(_prepare, full, before_timing, list(candidates)))
            return dict(default)
        before_timing(candidates)
    timings = []
    for config in candidates:
        try:
            ms = float(bench(config))
        except Exception as exc:  # out of shared memory, registers, an unsupported layout: skip it
            timings.append((math.inf, config, f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        timings.append((ms if math.isfinite(ms) else math.inf, config, None))
    finite = [t for t in timings if math.isfinite(t[0])]
    if not finite:
        reasons = "; ".join(f"{c}: {why}" for _, c, why in timings[:3])
        warnings.warn(f"tuning {kernel} for {key}: every candidate failed ({reasons}); using the default", stacklevel=2)
        _MEMORY[full] = dict(default)
        return _MEMORY[full]
    ms, best, _ = min(finite, key=lambda t: t[0])
    _MEMORY[full] = dict(best)
    _write(
        cache_path(),
        full,
        {"config": dict(best), "ms": ms, "timed": [[t[0] if math.isfinite(t[0]) else None, t[1]] for t in timings]},
    )
    return _MEMORY[full]


_DEFERRED = threading.local()  # .pending: the innermost deferred() block's preparations on this thread
_PREPARED: set[str] = set()  # choices whose deferred preparation ran: timed without running it again


def _prepare(full: str, before_timing: Callable[[Sequence[Config]], Any], candidates: list[Config]) -> None:
    before_timing(candidates)
    _PREPARED.add(full)


@contextlib.contextmanager
def deferred() -> Iterator[dict[str, Callable[[], Any]]]:
    """Inside the ``with`` block, a choice ``choose`` would time after a ``before_timing`` is not
    timed: it answers the default and keeps nothing, and the dict it yields gets that choice's
    preparation (``before_timing`` with its candidates, once per choice). Lowering runs every
    such preparation together (one pool compiles every product's candidates:
    ``teeny.core.compiling.batched``), then chooses again, timing."""
    outer = getattr(_DEFERRED, "pending", None)
    _DEFERRED.pending = pending = {}
    try:
        yield pending
    finally:
        _DEFERRED.pending = outer


_UNTIMED = threading.local()  # .depth: untimed() blocks open on this thread


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Inside the ``with`` block ``time_ms`` (on this thread) calls its function once and returns
    0: how ``teeny.core.compiling`` sees the launches a bench makes without timing them."""
    _UNTIMED.depth = getattr(_UNTIMED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNTIMED.depth -= 1


def time_ms(fn: Callable[[], None], reps: int = 10, rounds: int = 3) -> float:
    """Milliseconds per call of ``fn`` on the GPU: one eager call (compiles, checks it runs),
    then ``reps`` calls captured in a CUDA graph and replayed ``rounds`` times (the median).
    Falls back to timing eager calls with CUDA events where capture is refused, and to the wall
    clock without a GPU."""
    fn()
    if getattr(_UNTIMED, "depth", 0):
        return 0.0
    if DEVICE.type != "cuda":  # the interpreter: wall-clock time of eager calls
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - began) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:  # not capturable: time eager calls instead
        graph = None
        torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(reps):
                fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    del graph
    return sorted(samples)[len(samples) // 2]
