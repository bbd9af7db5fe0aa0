"""teeny's switches, in one place. Each is read when a graph is traced (so a program keeps the
behaviour it was built with) unless its description says otherwise.

    teeny.core.config.allow_tf32 = True          # float32 products on TF32 tensor cores (default False)
    teeny.core.config.deterministic = True       # bit-reproducible backward passes (no atomics)
    teeny.core.config.check_indices = False      # device-side range checks of index inputs
    teeny.core.config.replay = False             # every call takes the full host path
    teeny.core.config.pdl = True                 # programmatic dependent launch on Hopper (default False)
    teeny.core.config.cuda_graphs = True         # torch.compile(backend="teeny") regions as CUDA graphs (default False)
    teeny.core.config.compile_workers = 0        # no worker processes compiling kernels ahead (default: the CPUs)

``allow_tf32``: like ``torch.backends.cuda.matmul.allow_tf32``; float32 products are full
precision by default, float64 is always exact.
``deterministic``: ops whose fastest backward adds with atomics (embedding, getitem with index
tensors) use a sort-based, bit-reproducible one instead.
``check_indices``: embedding indices, getitem index tensors and the class indices of
cross_entropy / nll_loss are checked against their range inside the kernels, and an
out-of-range index raises an error naming the op and the index instead of reading garbage
(with the check off, an out-of-range embedding or getitem index reads 0 and gets no gradient,
and an out-of-range class gives a NaN loss). On by default under the interpreter (CPU), off on the GPU, where the check
costs a host synchronisation per step; ``TEENY_CHECK_INDICES=1`` or ``=0`` sets the default.
``replay`` (read at each call, not at tracing): a call of a registered op or of ``apply`` is
recorded once and replayed (``teeny.program.tape``) instead of running the executor's host path each
time, and the executor fires each node's launches as recorded on its first run
(``teeny.program.replay``) instead of building them again; ``TEENY_REPLAY=0`` sets the default off.
``cuda_graphs`` (read at each call): a region that ``torch.compile(model, backend="teeny")``
built replays its recorded calls as CUDA graphs on a GPU once its inputs have settled
(``teeny.torch.graphed``), instead of replaying their launches one by one. Off by default: on the
H100 host it was measured on, the replayed launches kept up with the GPU (Llama 156M: 20.8-21.0
ms either way) and the graphs held 0.6 GiB more (the forward's activations stay in the graphs'
memory through the backward); ``TEENY_CUDA_GRAPHS=1`` sets the default on, for a host too slow
to issue a step's launches in the time its kernels take.
``compile_workers`` (read when a graph is lowered and when a product is tuned): how many
processes compile the kernels a program will launch, and the candidates a tuning pass will time,
all at once before they run (``teeny.core.compiling``), instead of each on its first launch; 0 or
1: none. Default: the CPUs this process may use, shared among the processes of one host under
``torchrun`` (``LOCAL_WORLD_SIZE``), at most 16; ``TEENY_COMPILE_WORKERS`` sets it.
``pdl`` (read at launch: set it before a program first runs): kernels declared ``@kernel(pdl=True)``
(the products and attention, which wait for the kernel before them inside) are launched with
programmatic dependent launch on Hopper GPUs, so each may start before the one ahead of it has
signalled its end. Off by default: teeny's captured training steps idle ~0.1 ms between their
kernels, and PDL did not make GPT 6L's step faster (docs/archive/bench-journal.md, version 27);
``TEENY_PDL=1`` sets the default on.
"""

from __future__ import annotations

import os

from .device import INTERPRETER

allow_tf32: bool = False
deterministic: bool = False
check_indices: bool = os.environ.get("TEENY_CHECK_INDICES", "1" if INTERPRETER else "0").strip() not in ("0", "")
replay: bool = os.environ.get("TEENY_REPLAY", "1").strip() not in ("0", "")
cuda_graphs: bool = os.environ.get("TEENY_CUDA_GRAPHS", "0").strip() not in ("0", "")
_host_share = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "").strip() or 1))
compile_workers: int = int(os.environ.get("TEENY_COMPILE_WORKERS", "").strip() or min(16, _host_share))
pdl: bool = os.environ.get("TEENY_PDL", "0").strip() not in ("0", "")
