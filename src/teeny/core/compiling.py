"""Compiling many Triton kernels at once, in worker processes, before their first launch.

Triton compiles a kernel the first time it is launched with a new specialisation, one at a
time, on the launching thread: about a second each on a GPU host (more for the products'
pipelined tiles), and a program has dozens of kernels, a tuning pass a dozen candidates per
product. The compiler holds Python's lock most of the time (threads do not help), so this module
forks worker processes instead: each compiles its share into Triton's cache on disk, and the
launches that follow in this process find their binaries there, as a second process would.

Two places hand work out:

* lowering: its dry run packs every launch of the program without running it; inside
  ``gathered()`` each such launch is specialised into a job, and ``lower`` compiles them all
  (``compile_all``) before the program first runs;
* tuning: ``specialised_launches`` runs the candidates' benches with every launch intercepted
  and timing off (``tuning.untimed``), and the products compile what they launch before timing;
  lowering defers the timing (``tuning.deferred``) and compiles every product's candidates in
  one pool (``batched``) before its dry run times them.

A launch is specialised with Triton's own binder (integers on ``== 1`` and ``% 16``, pointers on
16-byte alignment, float64 scalars), so the job is the one ``JITFunction.run`` compiles for it
(a dry run's meta tensors count as aligned: a view that is not compiles at its launch, as
before). Jobs already in Triton's disk cache are not handed out. On an NVIDIA GPU the workers
also build the kernels' launchers: Triton compiles one C module per kind of argument list with
the system's C compiler at a kernel's first launch (a few tenths of a second each, one after
another, in the launching process), and a program's kernels have dozens of kinds. The workers
only compile (no CUDA call); a job that fails there is left to its launch, which fails the same
way and says so where it belongs. ``config.compile_workers`` says how many (0 or 1: none). ``teeny.aot``
specialises its programs' launches here too, for a target it emulates.
"""

from __future__ import annotations  # noqa: I001  (teeny's device before triton)

import contextlib
import functools
import hashlib
import multiprocessing
import os
import sysconfig
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from . import config, tuning
from .device import INTERPRETER  # (before triton: it chooses interpreter or GPU)
from .kernel import intercept_launches

import torch
import triton
from triton import knobs
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.build import compile_module_from_src, platform_key
from triton.runtime.cache import get_cache_key, get_cache_manager
from triton.runtime.jit import compute_cache_key, create_function_from_signature

STALL_S = 120  # a pool in which no job finished for this long is stopped
LAUNCHER = "__triton_launcher"  # the module name Triton gives a kernel launcher


@dataclass
class Specialised:
    """One launch as Triton specialises it: ``key`` (JITFunction's in-memory cache key),
    what ``triton.compile`` takes (``source``, ``options``) and the parts of the source."""

    key: str
    source: Any  # ASTSource (GluonASTSource for a Gluon kernel)
    options: dict
    specialization: list  # (type, specialisation) of each argument, as the binder gives them
    signature: dict
    constexprs: dict
    attrs: dict


@dataclass(frozen=True)
class CompileJob:
    """What one worker compiles: ``triton.compile(source, target=target, options=options)``."""

    source: Any
    target: GPUTarget
    options: dict

    @functools.cached_property
    def cache_hash(self) -> str:
        """The name of the job's folder in Triton's disk cache (as ``triton.compile`` names it)."""
        backend = make_backend(self.target)
        options = backend.parse_options(dict(self.options, **self.source.parse_options()))
        key = get_cache_key(self.source, backend, options, env_vars=get_cache_invalidating_env_vars())
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    def cached(self) -> bool:
        """Whether Triton's disk cache holds the job's binary already."""
        return get_cache_manager(self.cache_hash).get_file(f"{self.source.name[:150]}.json") is not None

    def build(self) -> None:
        triton.compile(self.source, target=self.target, options=self.options)

    def launcher(self) -> LauncherJob | None:
        """The C launcher Triton builds for this kernel at its first launch on an NVIDIA GPU
        (``CudaLauncher``: its source depends on the arguments' kinds alone), or None: another
        backend, or host-side tensor descriptors (whose launcher needs the compiled kernel)."""
        if self.target.backend != "cuda":
            return None
        source = self.source
        signature = dict(source.signature)
        if any(isinstance(kind, str) and kind.startswith("tensordesc") for kind in signature.values()):
            return None
        names = source.fn.arg_names
        constants = {(names.index(k),) if isinstance(k, str) else k: v for k, v in source.constants.items()}
        from triton.backends.nvidia.driver import make_launcher

        return LauncherJob(make_launcher(constants, signature, None))


@dataclass(frozen=True)
class LauncherJob:
    """What one worker builds besides kernels: a kernel launcher's C source, compiled with the
    system's C compiler into Triton's cache as ``CudaLauncher`` would at the kernel's first
    launch (a few tenths of a second each, one after another, in the launching process)."""

    source: str

    @functools.cached_property
    def cache_hash(self) -> str:
        """The launcher's folder in Triton's disk cache (as ``compile_module_from_src`` names it)."""
        return hashlib.sha256((self.source + platform_key()).encode("utf-8")).hexdigest()

    def cached(self) -> bool:
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        return get_cache_manager(self.cache_hash).get_file(f"{LAUNCHER}{suffix}") is not None

    def build(self) -> None:
        from triton.backends.nvidia import driver  # (read here: a test may stand in for its libraries)

        dirs = driver.library_dirs()
        compile_module_from_src(self.source, LAUNCHER, dirs, driver.include_dirs, driver.libraries)


class Specialiser:
    """Specialises launches for one GPU ``target`` as ``JITFunction.run`` would (a binder per
    kernel, made as Triton makes it)."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.backend = make_backend(target)
        self._binders: dict[int, Any] = {}

    def specialise(self, jit: Any, args: list, launch_options: dict) -> Specialised:
        """``jit`` launched with ``args`` (the Triton function's own) and ``launch_options``."""
        binder = self._binders.get(id(jit))
        if binder is None:
            binder = self._binders[id(jit)] = create_function_from_signature(jit.signature, jit.params, self.backend)
        kwargs = dict(launch_options)
        kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key({}, specialization, options)
        packed, signature, constexprs, attrs = jit._pack_args(self.backend, kwargs, bound, specialization, options)
        source = (GluonASTSource if jit.is_gluon() else ASTSource)(jit, signature, constexprs, attrs)
        return Specialised(key, source, packed.__dict__, specialization, signature, constexprs, attrs)

    def job(self, spec: Specialised) -> CompileJob:
        return CompileJob(spec.source, self.target, spec.options)


@functools.cache
def _this_gpu() -> Specialiser:
    major, minor = torch.cuda.get_device_capability()
    return Specialiser(GPUTarget("cuda", major * 10 + minor, 32))


def _launch_job(instance, jit, args: list, options: dict) -> CompileJob | None:
    """The job of one intercepted launch on this process's GPU; None where this process has
    compiled it already (Triton's in-memory cache of ``jit`` holds it)."""
    kernel, gpu = instance.kernel, _this_gpu()
    spec = gpu.specialise(jit, kernel.arguments(*args) if kernel.arguments is not None else args, options)
    compiled = jit.device_caches.get(torch.cuda.current_device())  # (a defaultdict: .get makes nothing)
    return None if compiled is not None and spec.key in compiled[0] else gpu.job(spec)


def _enabled() -> bool:
    return not INTERPRETER and config.compile_workers > 1


def specialised_launches(calls: Iterable[Callable[[], Any]]) -> list[CompileJob]:
    """The kernels ``calls`` would compile on this process's GPU and that it has not compiled
    yet, each call run with launches intercepted (nothing runs) and tuning untimed. A call that
    raises (a candidate that cannot be built) adds what it launched before raising."""
    if not _enabled():
        return []
    jobs: list[CompileJob] = []

    def collect(instance, jit, args, options):
        job = _launch_job(instance, jit, args, options)
        if job is not None:
            jobs.append(job)

    with _collecting(collect), tuning.untimed():
        for call in calls:
            try:
                call()
            except Exception:  # timed (and reported) by the caller as it would be without this
                continue
    return jobs


_GATHERING: list[list[CompileJob]] = []


@contextlib.contextmanager
def gathered() -> Iterator[list[CompileJob]]:
    """Inside the ``with`` block, the launches a dry run packs (``gather``) are specialised
    into the list it yields; nothing is gathered under the interpreter or with no workers."""
    jobs: list[CompileJob] = []
    if not _enabled():
        yield jobs
        return
    _GATHERING.append(jobs)
    try:
        yield jobs
    finally:
        _GATHERING.remove(jobs)


def gathering() -> bool:
    return bool(_GATHERING)


def gather(fire: Callable[[], None]) -> None:
    """``fire()`` (a dry run's launch, checked and packed) with the launch intercepted: its job
    joins the innermost ``gathered()`` list. A launch that cannot be specialised is left to run
    (and fail, if it does) when the program runs."""
    jobs = _GATHERING[-1]

    def collect(instance, jit, args, options):
        try:
            job = _launch_job(instance, jit, args, options)
        except Exception:
            return
        if job is not None:
            jobs.append(job)

    with _collecting(collect):
        fire()


@contextlib.contextmanager
def _collecting(collect: Callable) -> Iterator[None]:
    """Inside the ``with`` block this thread's launches go to ``collect(instance, jit, args,
    options)`` instead of running (and unrecorded); another thread's launch runs as it would."""
    thread = threading.get_ident()

    def handler(instance, jit, grid, args, options):
        if threading.get_ident() == thread:
            collect(instance, jit, args, options)
        else:
            instance.run_jit(jit, grid, args, options)

    with intercept_launches(handler, recorded=False):
        yield


_BATCH = threading.local()  # .jobs: what compile_all collects inside batched() on this thread


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Inside the ``with`` block ``compile_all`` on this thread only collects its jobs; when the
    block ends they are compiled in one pool (lowering: the candidates of every product it
    tunes, instead of a pool for each product's few, each waiting for its slowest compile)."""
    outer = getattr(_BATCH, "jobs", None)
    _BATCH.jobs = jobs = []
    try:
        yield
    finally:
        _BATCH.jobs = outer
    compile_all(jobs)


_JOBS: list[CompileJob | LauncherJob] = []  # the jobs of the pool now running, inherited by its forked workers
_POOL_LOCK = threading.Lock()
_STALLED: list[bool] = []  # a pool once made no progress for STALL_S: later jobs compile as they launch


def compile_all(jobs: Sequence[CompileJob], workers: int | None = None) -> int:
    """Compile ``jobs`` into Triton's cache in ``workers`` forked processes (default
    ``config.compile_workers``); returns how many were handed out. Fewer than two distinct jobs,
    or fewer than two workers, compile nothing here: the launches compile them as they would.
    A pool in which no job finishes for ``STALL_S``, or that cannot be started, is given up (with a
    warning) and not tried again in this process; a worker that dies leaves its jobs to their
    launches. Inside ``batched()``: collected for its pool, 0 handed out now."""
    batch = getattr(_BATCH, "jobs", None)
    if batch is not None:
        batch.extend(jobs)
        return 0
    try:
        unique = _uncached(jobs)
    except Exception:  # Triton's cache is not usable here: the launches compile (and say why) as they would
        return 0
    count = min(config.compile_workers if workers is None else workers, len(unique))
    if count < 2 or _STALLED:
        return 0
    try:
        launchers = _uncached(_launchers(jobs))
    except Exception:  # (Triton's launchers changed shape: each kernel's first launch builds its own, as before)
        launchers = []
    with _POOL_LOCK:  # one pool at a time: its workers read _JOBS as it was when they forked
        return len(unique) if _compile_in_pool([*launchers, *unique], count) else 0


def _uncached(jobs: Sequence[CompileJob | LauncherJob]) -> list[CompileJob | LauncherJob]:
    """Each distinct job (by its place in Triton's cache) that is not in the cache yet."""
    return [job for job in {job.cache_hash: job for job in jobs}.values() if not job.cached()]


def _launchers(jobs: Sequence[CompileJob]) -> list[LauncherJob]:
    """The launchers the kernels of ``jobs`` will need in this process: one per kind of argument
    list (candidates of one kernel that differ in their constants alone share one), for the jobs
    whose target is this process's GPU (none for a target only emulated: ``teeny.aot``)."""
    if not _builds_launchers():
        return []
    target, seen, launchers = _this_gpu().target, set(), []
    for job in jobs:
        kinds = (id(job.source.fn), tuple(job.source.signature.items()), tuple(job.source.constants))
        if job.target == target and kinds not in seen:
            seen.add(kinds)
            launchers.append(job.launcher())
    return [launcher for launcher in launchers if launcher is not None]


@functools.cache
def _builds_launchers() -> bool:
    """Whether this process launches on an NVIDIA GPU whose driver library Triton finds."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    try:
        from triton.backends.nvidia import driver

        driver.library_dirs()
    except Exception:  # (no libcuda: its launchers cannot be linked)
        return False
    return True


def _compile_in_pool(unique: list[CompileJob | LauncherJob], count: int) -> bool:
    _JOBS[:] = unique
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process (3.12+)
                pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"), initializer=_quiet)
                pending = {pool.submit(_compile_one, i) for i in range(len(unique))}
        except (OSError, RuntimeError) as exc:  # no fork here (out of memory, a process limit)
            _STALLED.append(True)
            warnings.warn(
                f"teeny: no worker processes to compile kernels in ({type(exc).__name__}: {exc}); "
                "kernels compile as they launch",
                stacklevel=3,
            )
            return False
        while pending:
            done, pending = wait(pending, timeout=STALL_S, return_when=FIRST_COMPLETED)
            if not done:
                _STALLED.append(True)
                warnings.warn(
                    f"teeny: {len(pending)} of {len(unique)} kernels were still compiling in {count} worker "
                    f"processes after {STALL_S} s without progress; they compile as they launch, and this process "
                    "compiles that way from now on",
                    stacklevel=3,
                )
                for process in list(getattr(pool, "_processes", {}).values()):
                    process.kill()
                break
        pool.shutdown(wait=not pending, cancel_futures=True)
    finally:
        _JOBS.clear()
    return True


def _quiet() -> None:
    """A worker's output goes nowhere: a failing job fails again at its launch, which reports it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _compile_one(index: int) -> None:
    try:
        _JOBS[index].build()
    except Exception:
        pass
