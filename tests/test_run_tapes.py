"""An executor's whole runs recorded once and replayed (``teeny.program.tape`` under
``Executor.forward_train`` / ``forward`` / ``backward``): the same numbers as running node by
node, the same refusals, and the full path wherever a tape could be wrong."""

import gc
import weakref

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, TeenyError, lower, ops
from teeny.core.init import normal
from teeny.program.executor import Executor


def _param(g: Graph, name: str, shape: tuple):
    return g.parameter(name, shape, init=normal(0.5))


def _model(recompute: bool = False) -> Graph:
    """Tokens through an embedding, a residual block that reads its input twice (fan-out), a
    product and a loss; with ``recompute`` the gelu's output is written again in the backward."""
    g = Graph("taped")
    idx = g.input("idx", (4, 6), torch.int64)
    x = g.input("x", (4, 6, 8), requires_grad=True)
    target = g.input("target", (24,), torch.int64)
    table, w, b = _param(g, "table", (10, 8)), _param(g, "w", (5, 8)), _param(g, "b", (5,))
    ln_w, ln_b = _param(g, "ln_w", (8,)), _param(g, "ln_b", (8,))
    h = ops.layer_norm(ops.embedding(idx, table) + x * 2.0, (8,), ln_w, ln_b)
    h = h + ops.gelu(h)
    logits = ops.linear(h, w, b)
    g.output(ops.cross_entropy(ops.reshape(logits, (24, 5)), target))
    return g


def _feed(seed: int) -> dict:
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
    """The same numbers; the embedding table's gradient on a GPU adds rows with atomics."""
    exact = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(a[0], b[0], **exact)
    torch.testing.assert_close(a[1], b[1], **exact)
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **({} if name == "table" else exact))


def _replays(ex: Executor) -> tuple[int, int]:
    """(forward, backward) runs that a tape answered."""
    return ex._forward_tapes[True].replays, sum(t.replays for t in ex._backward_tapes.values())


@pytest.mark.parametrize("recompute", [False, True])
def test_replayed_steps_give_what_running_node_by_node_gives(monkeypatch, recompute):
    """Steps after zero_grad and steps whose gradients accumulate (each its own backward tape,
    as whether a gradient is known to be zero decides where the backward writes it)."""
    program = lower(_model(), LoweringMode.TRAINING, recompute=recompute)
    taped, reference = Executor(program, seed=2), Executor(program, seed=2)
    for seed, zero_grad in [(0, True), (1, True), (2, False), (3, False), (4, True), (5, False)]:
        monkeypatch.setattr(teeny.core.config, "replay", False)
        expected = _step(reference, _feed(seed), zero_grad)
        monkeypatch.setattr(teeny.core.config, "replay", True)
        _equal(_step(taped, _feed(seed), zero_grad), expected)
    assert _replays(taped) == (5, 4)  # all but the first forward and the first backward of each state
    assert len(taped._backward_tapes) == 2


def test_a_replayed_forward_keeps_what_the_backward_reads_and_the_backward_frees_it():
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    _step(ex, _feed(0))
    feed = _feed(1)
    loss, cache = ex.forward_train(feed)
    assert ex._forward_tapes[True].replays == 1
    inputs = {id(t) for t in feed.values()}
    kept = [weakref.ref(t) for t in cache.flat if id(t) not in inputs]
    assert kept and cache.num_tensors() == len({id(t) for t in cache.tensors()})
    ex.backward(cache)
    del loss
    gc.collect()
    assert all(ref() is None for ref in kept)
    assert cache.flat is None and len(cache) == 0
    with pytest.raises(TeenyError, match="already consumed"):
        ex.backward(cache)


def test_an_input_changed_in_place_is_refused_after_a_replayed_forward():
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    _step(ex, _feed(0))
    feed = _feed(1)
    _, cache = ex.forward_train(feed)
    assert ex._forward_tapes[True].replays == 1
    feed["idx"].zero_()  # the embedding's backward reads it
    with pytest.raises(TeenyError, match="input 'idx' was modified in place between forward_train and backward"):
        ex.backward(cache)


def test_flags_checked_after_a_replayed_forward_still_raise(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)  # read when the graph is traced
    g = Graph()
    x, t = g.input("logits", (4, 3), requires_grad=True), g.input("target", (4,), torch.int64)
    g.output(ops.cross_entropy(x, t))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    logits = torch.randn(4, 3, device=teeny.DEVICE)
    for _ in range(2):
        ex.forward_train({"logits": logits, "target": torch.tensor([0, 2, 1, 2], device=teeny.DEVICE)})
    assert ex._forward_tapes[True].replays == 1
    with pytest.raises(TeenyError, match=r"cross_entropy \(node 'cross_entropy_0', forward\): target class index 3 "):
        ex.forward_train({"logits": logits, "target": torch.tensor([0, 3, 1, 2], device=teeny.DEVICE)})


def test_one_tensor_given_for_two_inputs_has_a_tape_of_its_own():
    """``(x, x)`` against ``(a, b)``: the run decides by their shared memory, so a tape recorded
    on one aliasing never answers the other."""
    g = Graph()
    a, b = g.input("a", (5, 7), requires_grad=True), g.input("b", (5, 7), requires_grad=True)
    g.output(ops.sum(a * b))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    x, y = torch.randn(5, 7, device=teeny.DEVICE), torch.randn(5, 7, device=teeny.DEVICE)
    for _ in range(2):
        for first, second in [(x, y), (x, x)]:
            _, cache = ex.forward_train({"a": first, "b": second})
            grads = ex.backward(cache)
            torch.testing.assert_close(grads["a"], second)
            torch.testing.assert_close(grads["b"], first)
    assert len(ex._forward_tapes[True].tapes) == 2 and ex._forward_tapes[True].replays == 2


def test_inference_runs_are_replayed_too():
    g = Graph()
    x = g.input("x", (6, 5))
    g.output(ops.gelu(ops.relu(x)) * 3.0)
    ex = Executor(lower(g, LoweringMode.INFERENCE))
    inputs = [torch.randn(6, 5, device=teeny.DEVICE) for _ in range(3)]
    outs = [ex.forward({"x": t}) for t in inputs]
    assert ex._forward_tapes[False].replays == 2
    for t, out in zip(inputs, outs):
        torch.testing.assert_close(out, torch.nn.functional.gelu(torch.relu(t)) * 3.0, atol=1e-5, rtol=1e-5)


def test_a_program_with_an_op_that_is_not_capturable_is_never_taped():
    """Dropout draws its seed per run: a tape would repeat the recorded mask."""
    g = Graph()
    x = g.input("x", (64,), requires_grad=True)
    g.output(ops.sum(ops.dropout(x, 0.5)))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    masks = []
    for _ in range(3):
        _, cache = ex.forward_train({"x": torch.ones(64, device=teeny.DEVICE)})
        masks.append(ex.backward(cache)["x"] != 0)
    assert not torch.equal(masks[1], masks[2])
    assert "take host state that changes per run" in ex._forward_tapes[True].not_recorded
    assert _replays(ex) == (0, 0)


def test_a_hook_on_each_node_backward_sees_every_node():
    """A per-node hook (data parallelism's gradient reduction) replaces ``_node_backward``: a
    backward tape would skip it, so the backward runs node by node."""
    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    _step(ex, _feed(0))
    _step(ex, _feed(1))
    seen = []
    original = ex._node_backward

    def hook(p, *args):
        seen.append(p.node.name)
        original(p, *args)

    ex._node_backward = hook
    _step(ex, _feed(2))
    assert len(seen) == sum(p.needs_backward for p in ex.program.nodes)


def test_launches_are_seen_while_recorded_or_intercepted():
    """A replay under ``record_launches`` launches what the node-by-node run launches."""
    from teeny.core.kernel import record_launches

    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    for seed in range(3):
        _step(ex, _feed(seed))
    assert _replays(ex) == (2, 2)
    with record_launches() as replayed:
        _step(ex, _feed(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(teeny.core.config, "replay", False)
        with record_launches() as full:
            _step(ex, _feed(0))
    assert [launch.kernel for launch in replayed] == [launch.kernel for launch in full]


@pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="the interpreter has no compiled launcher")
def test_on_a_gpu_replayed_runs_launch_straight_through_the_compiled_launcher():
    from teeny.program.tape import _LaunchStep

    ex = Executor(lower(_model(), LoweringMode.TRAINING))
    for seed in range(3):
        _step(ex, _feed(seed))
    tapes = [*ex._forward_tapes[True].tapes.values(), *(t.tape for t in ex._backward_tapes.values())]
    for tape in tapes:
        launches = [step for step in tape.steps if isinstance(step, _LaunchStep)]
        assert launches and all(step.direct is not None for step in launches)
