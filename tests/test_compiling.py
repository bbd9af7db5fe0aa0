"""teeny.core.compiling: kernels compiled at once in worker processes before their first launch.

On the CPU: launches specialised for an emulated sm_90 and compiled in two workers land in
Triton's cache, where this process then finds every one (tests/scripts/compile_ahead.py); a
pool that stops making progress is given up with a warning; tuning runs ``before_timing`` only
when it times. On a GPU: a product's tuning pass compiles its candidates ahead, and timing them
compiles nothing more.
"""

import json
import os
import time
import warnings

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import build as triton_build
from triton.runtime.jit import JITFunction

import teeny
from helpers import run_script
from teeny.core import compiling, tuning
from teeny.core.device import DEVICE
from teeny.ops.products import kernels as products_kernels
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning


def test_launches_compiled_ahead_are_found_in_tritons_cache():
    result = run_script("compile_ahead", env={**os.environ, "TEENY_COMPILE_WORKERS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    found = json.loads(line[len("RESULTS ") :])
    assert found == {"handed": 3, "cache_hits": [True, True, True], "keys": 3}


def _fill_source(x_ptr, VALUE: tl.constexpr):
    tl.store(x_ptr, VALUE)


_fill = JITFunction(_fill_source)  # compiled, not interpreted, under TRITON_INTERPRET=1 too


def _jobs(*values):
    """Compile jobs for sm_90 of a one-line kernel, one per constant (nothing is compiled here)."""
    target = GPUTarget("cuda", 90, 32)
    return [compiling.CompileJob(ASTSource(_fill, {"x_ptr": "*fp32"}, {"VALUE": v}), target, {}) for v in values]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(compiling, "_STALLED", [])


def test_a_pool_that_makes_no_progress_is_given_up_and_not_used_again(empty_cache, monkeypatch):
    monkeypatch.setattr(compiling, "STALL_S", 1)
    monkeypatch.setattr(compiling.triton, "compile", lambda *a, **k: time.sleep(60))  # the workers inherit it
    jobs = _jobs(1.0, 2.0, 3.0)
    began = time.perf_counter()
    with pytest.warns(UserWarning, match="without progress"):
        assert compiling.compile_all(jobs, workers=2) == 3
    assert time.perf_counter() - began < 20  # the stuck workers were killed, not waited for
    assert compiling._STALLED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiling.compile_all(jobs, workers=2) == 0  # compiled as they launch from now on


def test_a_failing_job_leaves_the_others_and_compiled_jobs_are_not_handed_out_again(empty_cache):
    jobs = _jobs("not a number", 1.0, 2.0, 1.0)
    assert compiling.compile_all(jobs, workers=2) == 3  # the repeated job handed out once
    assert [job.cached() for job in jobs] == [False, True, True, True]
    assert compiling.compile_all(jobs, workers=2) == 0  # only the failing one is left: the launch compiles it
    assert compiling.compile_all(_jobs(4.0, 5.0), workers=1) == 0  # one worker: none forked
    assert not any(job.cached() for job in _jobs(4.0, 5.0))


def test_tuning_prepares_the_candidates_once_and_only_when_it_times_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    tuning.forget_memory()
    candidates = [{"BLOCK": 64}, {"BLOCK": 128}]
    prepared = []
    bench = lambda config: {64: 2.0, 128: 1.0}[config["BLOCK"]]  # noqa: E731
    for _ in range(2):
        choice = tuning.choose("k", {"M": 5}, candidates, {"BLOCK": 32}, bench, before_timing=prepared.append)
        assert choice == {"BLOCK": 128}
    assert prepared == [candidates]  # the second choice was the cached one
    tuning.forget_memory()


def test_a_kernels_launcher_is_built_ahead_as_triton_builds_it_at_the_first_launch(empty_cache, tmp_path, monkeypatch):
    from triton.backends.nvidia import driver

    # this machine's stand-in for a GPU host: sm_90 is "this GPU", and with no libcuda here the
    # launcher is built without linking it (its place in the cache depends on its source alone)
    monkeypatch.setattr(compiling, "_builds_launchers", lambda: True)
    monkeypatch.setattr(compiling, "_this_gpu", lambda: compiling.Specialiser(GPUTarget("cuda", 90, 32)))
    monkeypatch.setattr(driver, "library_dirs", lambda: [])
    monkeypatch.setattr(driver, "libraries", [])
    jobs = _jobs(1.0, 2.0)
    launchers = compiling._launchers(jobs)
    assert len(launchers) == 1  # two constants of one kernel: one kind of argument list
    assert compiling._launchers(_jobs(1.0) + [compiling.CompileJob(jobs[0].source, GPUTarget("cuda", 80, 32), {})])
    assert not compiling._launchers([compiling.CompileJob(jobs[0].source, GPUTarget("cuda", 80, 32), {})])

    kernel = triton.compile(jobs[0].source, target=jobs[0].target)
    made = []

    def stop(src, **_):  # what CudaLauncher compiles at the kernel's first launch
        made.append(src)
        raise RuntimeError("stop")

    built = driver.compile_module_from_src
    monkeypatch.setattr(driver, "compile_module_from_src", stop)
    with pytest.raises(RuntimeError, match="stop"):
        driver.CudaLauncher(kernel.src, kernel.metadata)
    assert made == [launchers[0].source]
    monkeypatch.setattr(driver, "compile_module_from_src", built)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "another"))  # (the kernel compiled above is not there)
    assert not launchers[0].cached()
    assert compiling.compile_all(jobs, workers=2) == 2  # the kernels handed out, their launcher beside them
    assert launchers[0].cached() and all(job.cached() for job in jobs)


def test_launchers_that_cannot_be_worked_out_leave_the_kernels_to_the_pool(empty_cache, monkeypatch):
    def changed(jobs):
        raise AttributeError("a Triton whose launchers are made otherwise")

    monkeypatch.setattr(compiling, "_launchers", changed)
    jobs = _jobs(6.0, 7.0)
    assert compiling.compile_all(jobs, workers=2) == 2
    assert all(job.cached() for job in jobs)


@pytest.mark.skipif(not torch.cuda.is_available() or not tuning.has_tma(), reason="needs a GPU with TMA")
def test_a_products_candidates_are_compiled_ahead_and_timing_compiles_nothing_more(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(compiling, "_STALLED", [])
    tuning.forget_memory()
    handed, jobs_handed = [], []
    compile_all = compiling.compile_all
    monkeypatch.setattr(
        compiling,
        "compile_all",
        lambda jobs, workers=None: jobs_handed.extend(jobs) or handed.append(compile_all(jobs, 4)),
    )
    compiled_here = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **info: compiled_here.append(not info["cache_hit"]))
    launchers_here = []  # a kernel launcher's C module built in this process (the workers' are theirs)
    build = triton_build._build
    monkeypatch.setattr(triton_build, "_build", lambda *a: launchers_here.append(a[0]) or build(*a))
    # bf16 2048 x 1040 x 528: big enough to be timed, a shape no other test tunes
    p = products_launches.Product(2048, 1040, 528, (528, 1), (1040, 1), (1040, 1), [], [])
    config = products_tuning.choose_config(p, dtype=torch.bfloat16, precision=products_kernels.IEEE, has_bias=False)
    assert config in products_tuning.candidates(
        p, dtype=torch.bfloat16, precision=products_kernels.IEEE, has_bias=False
    )
    assert len(handed) == 1 and handed[0] >= 2
    assert compiled_here and not any(compiled_here)  # every launch of the timing found its binary in the cache
    # and its launcher, but for kernels taking host-side tensor descriptors (TMA), whose launcher
    # Triton works out from the compiled kernel (CompileJob.launcher: None): at most one per kind
    # of argument list of those; cuda_utils is Triton's driver module, built once per cache folder
    described = {
        (id(job.source.fn), tuple(job.source.signature.items()), tuple(sorted(map(str, job.source.constants))))
        for job in jobs_handed
        if isinstance(job, compiling.CompileJob) and job.launcher() is None
    }
    built = [name for name in launchers_here if name != "cuda_utils"]
    assert set(built) <= {compiling.LAUNCHER} and len(built) <= len(described)
    tuning.forget_memory()


def test_launches_intercepted_for_compiling_are_not_recorded():
    from teeny.core.kernel import intercept_launches, kernel, record_launches

    @kernel(register=False)
    def copy_one(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr))

    x = torch.ones(1)
    seen = []
    with record_launches() as log:
        with intercept_launches(lambda *launch: seen.append(launch), recorded=False):
            copy_one.instance(torch.float32).launch((1,), [x, x])
        assert len(seen) == 1 and log == []  # specialised for compiling: not a launch of a run
        with intercept_launches(lambda *launch: seen.append(launch)):
            copy_one.instance(torch.float32).launch((1,), [x, x])
        assert len(seen) == 2 and len(log) == 1  # how an ahead-of-time build intercepts: recorded


def test_a_pool_that_cannot_start_is_given_up_with_a_warning(empty_cache, monkeypatch):
    def no_fork(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(compiling, "ProcessPoolExecutor", no_fork)
    with pytest.warns(UserWarning, match="no worker processes"):
        assert compiling.compile_all(_jobs(6.0, 7.0), workers=2) == 0
    assert compiling._STALLED


def test_the_default_workers_share_the_hosts_cpus_among_torchruns_processes():
    import subprocess
    import sys

    def workers(**env):
        environment = {k: v for k, v in os.environ.items() if k not in ("TEENY_COMPILE_WORKERS", "LOCAL_WORLD_SIZE")}
        code = "from teeny.core import config; print(config.compile_workers)"
        run = subprocess.run([sys.executable, "-c", code], env={**environment, **env}, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout)

    cpus = len(os.sched_getaffinity(0))
    assert workers() == min(16, cpus)
    assert workers(LOCAL_WORLD_SIZE="2") == min(16, cpus // 2)
    assert workers(TEENY_COMPILE_WORKERS="0") == 0


def test_while_one_thread_collects_launches_another_threads_launch_runs():
    import threading

    from teeny.core.kernel import kernel

    @kernel(register=False)
    def add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    x = torch.zeros(1, device=DEVICE)
    seen = []
    launch = lambda: add_one.instance(torch.float32).launch((1,), [x])  # noqa: E731
    with compiling._collecting(lambda *collected: seen.append(collected)):
        launch()  # this thread's: specialised for compiling, not run
        other = threading.Thread(target=launch)  # (an autograd thread, a second model's loop)
        other.start()
        other.join()
    assert len(seen) == 1 and x.item() == 1.0  # the other thread's launch ran


def test_untimed_benches_are_this_threads_only():
    import threading

    def work():  # a millisecond of what time_ms times: the GPU's time there, the host's on the CPU
        if torch.cuda.is_available():
            torch.cuda._sleep(2_000_000)  # cycles: about a millisecond at a GPU's 1.5-2 GHz
        else:
            time.sleep(0.001)

    timed = []
    with tuning.untimed():
        assert tuning.time_ms(work, reps=2) == 0.0
        other = threading.Thread(target=lambda: timed.append(tuning.time_ms(work, reps=2)))
        other.start()
        other.join()
    assert timed[0] >= 0.5  # another thread's tuning still times (a 0 would be cached as the winner)


def test_a_deferred_choice_answers_the_default_and_hands_over_its_preparation(tmp_path, monkeypatch):
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    tuning.forget_memory()
    candidates, timed, prepared = [{"BLOCK": 64}, {"BLOCK": 128}], [], []

    def bench(config):
        timed.append(config)
        return {64: 2.0, 128: 1.0}[config["BLOCK"]]

    with tuning.deferred() as preparations:
        for key in ({"M": 5}, {"M": 5}, {"M": 6}):
            assert tuning.choose("k", key, candidates, {"BLOCK": 32}, bench, prepared.append) == {"BLOCK": 32}
    assert not timed and not prepared and len(preparations) == 2  # one preparation per choice
    for prepare in preparations.values():
        prepare()
    assert prepared == [candidates, candidates]
    assert tuning.choose("k", {"M": 5}, candidates, {"BLOCK": 32}, bench, prepared.append) == {"BLOCK": 128}
    assert timed == candidates  # timed once deferred no more, and nothing was kept of the deferred answer
    tuning.forget_memory()


def test_jobs_batched_are_compiled_in_one_pool_when_the_block_ends(empty_cache, monkeypatch):
    pools = []
    compile_in_pool = compiling._compile_in_pool
    monkeypatch.setattr(
        compiling, "_compile_in_pool", lambda jobs, count: pools.append(len(jobs)) or compile_in_pool(jobs, count)
    )
    monkeypatch.setattr(teeny.core.config, "compile_workers", 2)
    first, second = _jobs(11.0, 12.0), _jobs(13.0, 11.0)
    with compiling.batched():
        assert compiling.compile_all(first) == 0 and compiling.compile_all(second) == 0
        assert not pools and not any(job.cached() for job in first + second)
    # one pool, the repeated job once, with the kernels' one launcher where this process has a GPU
    assert pools == [3 + len(compiling._launchers(first))]
    assert all(job.cached() for job in first + second)


def test_lowering_compiles_every_products_candidates_in_one_pool_before_timing_any(tmp_path, monkeypatch):
    from teeny import Graph, LoweringMode, lower, ops

    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    monkeypatch.setattr(products_tuning, "_small", lambda p: False)
    tuning.forget_memory()
    events = []

    def bench_for(p, **_):
        def measure(config):
            if getattr(tuning._UNTIMED, "depth", 0):  # a candidate's launches being specialised, not timed
                return 0.0
            events.append(("time", p.key()["M"] if "M" in p.key() else None))
            return float(config.get("BLOCK_M", 1) * config.get("BLOCK_N", 1) + config.get("num_warps", 1))

        return measure

    def collected(jobs, workers=None):
        events.append("pool" if getattr(compiling._BATCH, "jobs", None) is None else "batched")
        return compile_all(jobs, workers)

    compile_all = compiling.compile_all
    monkeypatch.setattr(products_tuning, "_bench_for", bench_for)
    monkeypatch.setattr(compiling, "compile_all", collected)
    g = Graph("two products")
    x = g.input("x", (24, 40), torch.float32)
    h = ops.linear(x, g.parameter("w1", (56, 40)), g.parameter("b1", (56,)))
    g.output(ops.sum(ops.linear(h, g.parameter("w2", (8, 56)))))
    lower(g, LoweringMode.TRAINING, rewrites=())
    prepared = events.count("batched")
    assert prepared >= 3  # the products of both layers, forwards and backwards
    assert events[: prepared + 1] == ["batched"] * prepared + ["pool"]  # every preparation, then one pool
    assert all(isinstance(e, tuple) for e in events[prepared + 1 : -1])  # then timing only
    assert events[-1] == "pool"  # and the program's own kernels
    tuning.forget_memory()
