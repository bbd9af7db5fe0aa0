"""Where a process's time to its first step goes: a Python module run with teeny's phases timed.

    python3 bench/tools/phase_times.py OUT.json -m teeny bench examples/bench_llama.py:make_gpu_model ...

Runs the module (``-m``) or script as ``python3`` would, with these wrapped in timers, and writes
each one's calls and total wall seconds to OUT.json when the process ends (``bench/tools/
first_step.py --phases`` runs each of its processes so):

* ``backend``: a region ``torch.compile`` handed to teeny built into a program (``Region``: all
  of what follows for it), within it ``torch.export`` (the region's ATen graph) and
  ``compile_function`` (that graph traced into a teeny graph, rewritten and lowered);
* ``lowering``: ``teeny.program.lowering.lower`` (planning, the dry run, and the pool that compiles
  the program's kernels ahead);
* ``compile pools``: ``teeny.core.compiling.compile_all`` (the program's, and each timed product's);
* ``tuning``: ``teeny.core.tuning.choose`` where it times candidates (their pool included);
* ``triton in-process``: Triton's ``JITFunction._do_compile``, a kernel compiled at its launch or
  loaded from the disk cache;
* ``C launchers in-process``: Triton's ``runtime.build._build``, a kernel launcher's C module
  compiled with gcc at the kernel's first launch (``teeny.core.compiling`` builds them in its
  workers: what is left here was not in a pool).

The totals nest (lowering holds its pools and the tuning its dry run starts); they are each
phase's own wall time, not a partition.
"""

from __future__ import annotations

import atexit
import functools
import json
import runpy
import sys
import time
from pathlib import Path

TOTALS: dict[str, list[float]] = {}  # phase -> [calls, seconds]


def timed(owner, name: str, phase: str) -> None:
    """Wrap ``owner.name`` so that its calls add to ``TOTALS[phase]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total = TOTALS.setdefault(phase, [0, 0.0])
            total[0] += 1
            total[1] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def install() -> None:
    """The timers, set before the code that calls these imports them by name."""
    from teeny.program import lowering  # noqa: I001  (first: teeny chooses the interpreter or the GPU before triton)
    from teeny.core import compiling, tuning
    from triton.runtime.jit import JITFunction

    timed(lowering, "lower", "lowering")
    timed(compiling, "compile_all", "compile pools")
    timed(tuning, "choose", "tuning")
    timed(JITFunction, "_do_compile", "triton in-process")
    from triton.runtime import build

    timed(build, "_build", "C launchers in-process")  # (gcc, at a kernel's first launch)
    from teeny.torch import backend, bridge  # (after lower is wrapped: the modules it imports take it by name)

    # (the method, not ``teeny_backend``: dynamo holds the function it registered at import)
    timed(backend.Region, "_build_as_written", "backend")
    timed(backend, "_export", "torch.export")
    timed(bridge, "compile_function", "compile_function")


def main() -> None:
    out, *command = sys.argv[1:]
    install()
    atexit.register(lambda: Path(out).write_text(json.dumps({k: {"calls": n, "s": s} for k, (n, s) in TOTALS.items()})))
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main()
