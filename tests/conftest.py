import os
import tempfile

import pytest
import torch

# torch.compile caches compiled graphs on disk, keyed without teeny's code: a graph cached by
# another checkout of teeny would be replayed. Each test session compiles into its own folder.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="teeny-inductor-"))

import teeny

on_gpu = teeny.DEVICE.type == "cuda"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def pytest_report_header(config):
    return f"teeny device: {teeny.device.describe()}"


_assert_close = torch.testing.assert_close


def _assert_close_any_device(actual, expected, *args, **kwargs):
    """The suite runs unchanged on the CPU and on a GPU: references are often computed on the
    CPU while teeny's executor returns tensors on its own device. Compare values, not places."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.device != expected.device:
        actual, expected = actual.cpu(), expected.cpu()
    return _assert_close(actual, expected, *args, **kwargs)


_equal, _allclose = torch.equal, torch.allclose


def _on_one_device(fn):
    def wrapper(a, b, *args, **kwargs):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device != b.device:
            a, b = a.cpu(), b.cpu()
        return fn(a, b, *args, **kwargs)

    return wrapper


if on_gpu:
    torch.testing.assert_close = _assert_close_any_device
    torch.equal, torch.allclose = _on_one_device(_equal), _on_one_device(_allclose)


# What every compile check's script starts with: the interpreter off (teeny then builds real
# @triton.jit kernels), torch told that a GPU exists, and a skip where Triton cannot compile
# for sm_90 on this machine.
SM90_PREAMBLE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)

@triton.jit
def probe(x_ptr):
    tl.store(x_ptr, 1.0)

try:
    triton.compile(ASTSource(probe, {"x_ptr": "*fp32"}, {}), target=TARGET)
except Exception as exc:
    print("SKIP " + json.dumps(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:300]))
    sys.exit(0)


def root_cause(exc):
    # what a failed compile says, from the innermost exception
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc)[-500:]}"


_COMPILERS = {}


def compile_launch(launch):
    # a teeny Launch compiled for sm_90 (132 multiprocessors) as an ahead-of-time bundle would:
    # Triton's arguments specialised (a kernel's arguments= applied); (the plan's entry, the PTX)
    from teeny import runtime
    from teeny.aot.bundle import Target
    from teeny.aot.capture import Compiler

    compiler = _COMPILERS.get("sm90") or _COMPILERS.setdefault("sm90", Compiler(Target(90, 132)))
    block = runtime.as_block(launch.block)
    values = runtime.check_packing(launch.kernel, launch.args, "compile check", block.size)
    if launch.kernel.arguments is not None:
        values = launch.kernel.arguments(*values)
    options = {k: v for k, v in (("num_warps", block.num_warps), ("num_stages", block.num_stages)) if v is not None}
    spec = compiler.specialise(launch.kernel.jit, values, options)
    entry, files = compiler.compile(launch.kernel.jit, spec)
    return entry, files["ptx"].decode()


def tma_counts(ptx):
    # how many TMA loads and stores a kernel's PTX issues
    return dict(tma_loads=ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global"),
                tma_stores=ptx.count("cp.async.bulk.tensor.2d.global.shared"))
"""


@pytest.fixture
def compile_check(tmp_path):
    """Run ``source`` (a script that compiles kernels for the H200 without the interpreter and
    prints ``RESULTS <json>``, or ``SKIP <json reason>``), after ``SM90_PREAMBLE``, on ``cases``
    in a fresh process: the parsed results, or a skip. Triton reads kernel source from a file,
    so the script is one."""
    import json
    import subprocess
    import sys

    def run(name: str, source: str, cases, timeout: int):
        script = tmp_path / f"{name}.py"
        script.write_text(SM90_PREAMBLE + source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run(
            [sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True, env=env, timeout=timeout
        )
        lines = done.stdout.splitlines()
        skip = [line for line in lines if line.startswith("SKIP ")]
        if skip:
            pytest.skip(json.loads(skip[0][5:]))
        results = [line for line in lines if line.startswith("RESULTS ")]
        assert results, f"{name} crashed:\n{done.stderr[-3000:]}"
        return json.loads(results[0][8:])

    return run
