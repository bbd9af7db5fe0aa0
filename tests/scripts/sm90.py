"""What every compile check under tests/scripts imports first: the interpreter off (teeny then
builds real @triton.jit kernels), torch told that a GPU exists, and ``SKIP <json reason>`` printed
(exit 0) where Triton cannot compile for sm_90 on this machine; then the helpers the checks use.

Import it before torch, triton and teeny. A check runs on its own too, for debugging:
``python tests/scripts/<check>.py '<json cases>'``."""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def probe(x_ptr):
    tl.store(x_ptr, 1.0)


try:
    triton.compile(ASTSource(probe, {"x_ptr": "*fp32"}, {}), target=TARGET)
except Exception as exc:
    print("SKIP " + json.dumps(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:300]))
    sys.exit(0)


def cases() -> list:
    """The cases of the check: the JSON list in its first argument."""
    return json.loads(sys.argv[1])


def report(results) -> None:
    """What the test reads back: ``RESULTS <json>``."""
    print("RESULTS " + json.dumps(results))


def root_cause(exc: BaseException) -> str:
    """What a failed compile says, from the innermost exception."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc)[-500:]}"


_COMPILERS = {}


def compile_launch(launch):
    """A teeny Launch compiled for sm_90 (132 multiprocessors) as an ahead-of-time bundle would:
    Triton's arguments specialised (a kernel's ``arguments=`` applied); (the plan's entry, the PTX)."""
    from teeny.aot.bundle import Target
    from teeny.aot.capture import Compiler
    from teeny.core import runtime

    compiler = _COMPILERS.get("sm90") or _COMPILERS.setdefault("sm90", Compiler(Target(90, 132)))
    block = runtime.as_block(launch.block)
    values = runtime.check_packing(launch.kernel, launch.args, "compile check", block.size)
    if launch.kernel.arguments is not None:
        values = launch.kernel.arguments(*values)
    options = {k: v for k, v in (("num_warps", block.num_warps), ("num_stages", block.num_stages)) if v is not None}
    spec = compiler.specialise(launch.kernel.jit, values, options)
    entry, files = compiler.compile(launch.kernel.jit, spec)
    return entry, files["ptx"].decode()


def tma_counts(ptx: str) -> dict:
    """How many TMA loads and stores a kernel's PTX issues."""
    return dict(
        tma_loads=ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global"),
        tma_stores=ptx.count("cp.async.bulk.tensor.2d.global.shared"),
    )
