"""The two ranks of the DDP and FSDP2 cells of ``tests/test_patch_matrix.py``. Each process runs as
torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK in the environment)
and, for every model type of the matrix, patches the test's model and trains it one step on its
half of the batch (rank r: row r), wrapped in DDP, then sharded with FSDP2 (``fully_shard`` on each
decoder layer, on the head apart, with the embedding where the two are tied, and on the root).
Rank 0 writes OUT (``torch.save``): the transformers version, and for each (model type, cell) the
loss averaged over the ranks with every parameter's whole gradient, or the error as text.

    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 TEENY_DEVICE=cpu \
        python tests/scripts/patch_matrix_ranks.py /tmp/out.pt   # and RANK=1 beside it
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def load_matrix():
    """``tests/test_patch_matrix.py`` as a module: its model types, models and batch."""
    tests = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tests))  # its ``helpers``, as pytest puts tests/ on the path
    path = tests / "test_patch_matrix.py"
    spec = importlib.util.spec_from_file_location("teeny_test_patch_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decoder_layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def step(matrix, family: str, cell: str, rank: int, world: int):
    """One training step of the patched model of ``family`` on this rank's half of the batch."""
    import teeny.torch as tt

    model = matrix._model(family)
    tt.patch(model)
    if cell == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        fully_shard([embedding, head] if head.weight is embedding.weight else head, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    ids = matrix._ids()[rank : rank + 1]
    wrapped.train()
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None and hasattr(grad, "full_tensor"):  # FSDP2: this rank's shard (a DTensor)
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    return loss / world, grads


def worker(out: Path) -> int:
    import teeny.training.distributed as td

    world = td.init(timeout=120.0)
    matrix = load_matrix()
    results = {}
    try:
        for family in matrix.FAMILIES:
            for cell in ("DDP", "FSDP2"):
                try:
                    results[family, cell] = step(matrix, family, cell, world.rank, world.size)
                except Exception as exc:  # the test reports it with the other cells' results
                    traceback.print_exc()
                    results[family, cell] = f"{type(exc).__name__}: {exc}"
        if world.rank == 0:
            torch.save({"transformers": matrix.VERSION, "results": results}, out)
    finally:
        td.shutdown()
    return 0


if __name__ == "__main__":
    import teeny.training.distributed as td

    td.end_process(worker(Path(sys.argv[1])))  # as `teeny train` ends its workers
