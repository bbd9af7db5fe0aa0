"""The executor's node replay (``teeny.program.replay``): each node's launches built and checked
once, then fired again with each run's tensors; the full path where a replay would be wrong."""

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, TeenyError, lower, ops
from teeny.core.init import normal
from teeny.core.kernel import record_launches
from teeny.program.executor import Executor


def _param(g: Graph, name: str, shape: tuple):
    return g.parameter(name, shape, init=normal(0.5))


def _model() -> Graph:
    """Tokens through an embedding, a product with a (..., d) input, layer norm and a loss."""
    g = Graph("replayed")
    idx = g.input("idx", (4, 6), torch.int64)
    x = g.input("x", (4, 6, 8), requires_grad=True)
    target = g.input("target", (24,), torch.int64)
    table, w, b = _param(g, "table", (10, 8)), _param(g, "w", (5, 8)), _param(g, "b", (5,))
    ln_w, ln_b = _param(g, "ln_w", (8,)), _param(g, "ln_b", (8,))
    h = ops.layer_norm(ops.embedding(idx, table) + x * 2.0, (8,), ln_w, ln_b)
    logits = ops.linear(ops.gelu(h), w, b)
    g.output(ops.cross_entropy(ops.reshape(logits, (24, 5)), target))
    return g


def _feed(seed: int) -> dict:
    """On the executor's device: a CPU tensor given to a GPU program is copied over, and the
    copy (not the caller's tensor) is what the backward reads."""
    gen = torch.Generator().manual_seed(seed)
    feed = {
        "idx": torch.randint(0, 10, (4, 6), generator=gen),
        "x": torch.randn(4, 6, 8, generator=gen),
        "target": torch.randint(0, 5, (24,), generator=gen),
    }
    return {name: t.to(teeny.DEVICE) for name, t in feed.items()}


def _step(ex: Executor, feed: dict, zero_grad: bool = True):
    if zero_grad:
        ex.zero_grad()
    loss, cache = ex.forward_train(feed)
    grads = ex.backward(cache)
    return loss.clone(), grads["x"].clone(), {name: g.clone() for name, g in ex.grads.items()}


def _equal(a, b) -> None:
    """The same numbers; to the last bit but for the embedding table's gradient on a GPU, whose
    backward adds rows with atomics (in whatever order they land)."""
    loss_a, dx_a, grads_a = a
    loss_b, dx_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(dx_a, dx_b, rtol=0, atol=0)
    for name in grads_a:
        atomic = name == "table" and teeny.DEVICE.type == "cuda"
        tol = dict(rtol=1e-6, atol=1e-7) if atomic else dict(rtol=0, atol=0)
        torch.testing.assert_close(grads_a[name], grads_b[name], **tol, msg=name)


def test_replayed_runs_give_what_the_full_path_gives(monkeypatch):
    program = lower(_model(), LoweringMode.TRAINING)
    replayed, full = Executor(program, seed=3), Executor(program, seed=3)
    for seed in range(3):
        ours = _step(replayed, _feed(seed))
        monkeypatch.setattr(teeny.core.config, "replay", False)
        _equal(ours, _step(full, _feed(seed)))
        monkeypatch.setattr(teeny.core.config, "replay", True)
    for run in replayed._runs.values():  # every node recorded, but the embedding's backward (below)
        assert run.planned.is_view or run.forward.recordings, run.planned.name
        assert run.backward.recordings or run.backward.not_recorded, run.planned.name
    # the full path never records
    assert not any(run.forward.recordings or run.backward.recordings for run in full._runs.values())


def test_a_replay_launches_what_the_full_path_launches(monkeypatch):
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    _step(ex, _feed(0))
    with record_launches() as replayed:
        _step(ex, _feed(1))
    monkeypatch.setattr(teeny.core.config, "replay", False)
    with record_launches() as full:
        _step(ex, _feed(1))
    assert replayed == full


def test_launch_building_that_writes_on_the_device_takes_the_full_path():
    """The embedding's backward zeroes its gradient before its kernel adds into it (``zero_()``
    while building its launches): a replay would skip that, so it is not recorded."""
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    first = _step(ex, _feed(0), zero_grad=False)
    (embedding,) = [run for run in ex._runs.values() if run.planned.op.name == "embedding"]
    assert not embedding.backward.recordings
    assert "aten.zero_" in next(iter(embedding.backward.not_recorded.values()))
    second = _step(ex, _feed(0), zero_grad=False)  # accumulating: twice the first gradient
    torch.testing.assert_close(second[2]["table"], 2 * first[2]["table"])


def test_a_run_laid_out_otherwise_is_recorded_apart(monkeypatch):
    """Gradients written in place (after zero_grad) or into buffers of their own, and a
    non-contiguous seed: each layout of a node's tensors has its own recording."""
    g = Graph()
    x = g.input("x", (6, 8), requires_grad=True)
    w, b = _param(g, "w", (8,)), _param(g, "b", (8,))
    g.output(ops.layer_norm(x, (8,), w, b))
    program = lower(g, LoweringMode.TRAINING)
    ex, reference = Executor(program, seed=1), Executor(program, seed=1)
    feed = {"x": torch.randn(6, 8)}
    seeds = [torch.randn(6, 8), torch.randn(8, 6).t(), torch.randn(1, 8).expand(6, 8)]
    for seed in seeds:
        for executor, replay in [(ex, True), (reference, False)]:
            monkeypatch.setattr(teeny.core.config, "replay", replay)
            executor.zero_grad()
            for _ in range(2):  # the second backward adds into the gradients the first wrote
                out, cache = executor.forward_train(feed)
                executor.backward(cache, seed)
        torch.testing.assert_close(ex.grads["w"], reference.grads["w"], rtol=0, atol=0)
        torch.testing.assert_close(ex.grads["b"], reference.grads["b"], rtol=0, atol=0)
    (run,) = ex._runs.values()
    assert len(run.backward.recordings) > 1


def test_flags_checked_after_a_replayed_forward_still_raise(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)  # read when the graph is traced
    g = Graph()
    x, t = g.input("logits", (4, 3), requires_grad=True), g.input("target", (4,), torch.int64)
    g.output(ops.cross_entropy(x, t))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    logits = torch.randn(4, 3)
    ex.forward_train({"logits": logits, "target": torch.tensor([0, 2, 1, 2])})  # recorded
    with pytest.raises(TeenyError, match=r"cross_entropy \(node 'cross_entropy_0', forward\): target class index 3 "):
        ex.forward_train({"logits": logits, "target": torch.tensor([0, 3, 1, 2])})  # replayed


def test_an_op_that_is_not_capturable_takes_the_full_path():
    """Dropout's launches take a seed drawn per run: a replay would repeat the recorded mask."""
    g = Graph()
    x = g.input("x", (64,), requires_grad=True)
    g.output(ops.dropout(x, 0.5))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    masks = [ex.forward_train({"x": torch.ones(64)})[0] != 0 for _ in range(3)]
    assert not torch.equal(masks[1], masks[2])
    (run,) = ex._runs.values()
    assert not run.forward.recordings
    assert "not capturable" in next(iter(run.forward.not_recorded.values()))


def test_an_input_changed_in_place_is_refused_after_a_replayed_forward():
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    _step(ex, _feed(0))
    feed = _feed(1)
    _, cache = ex.forward_train(feed)
    feed["idx"].zero_()  # the embedding's backward reads it
    with pytest.raises(TeenyError, match="input 'idx' was modified in place"):
        ex.backward(cache)
