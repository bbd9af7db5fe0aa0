"""An executor's whole runs recorded once and replayed (``teeny.program.tape`` under
``Executor.forward_train`` / ``forward`` / ``backward``): the same numbers as running node by
node, the same refusals, and the full path wherever a tape could be wrong."""

import gc
import weakref

import pytest
import torch

import teeny
from helpers import assert_same_token_steps, token_feed, token_model, token_step
from teeny import Graph, LoweringMode, TeenyError, lower, ops
from teeny.program.executor import Executor


def _replays(ex: Executor) -> tuple[int, int]:
    """(forward, backward) runs that a tape answered."""
    return ex._forward_tapes[True].replays, sum(t.replays for t in ex._backward_tapes.values())


@pytest.mark.parametrize("recompute", [False, True])
def test_replayed_steps_give_what_running_node_by_node_gives(monkeypatch, recompute):
    """Steps after zero_grad and steps whose gradients accumulate (each its own backward tape,
    as whether a gradient is known to be zero decides where the backward writes it)."""
    program = lower(token_model(fan_out=True), LoweringMode.TRAINING, recompute=recompute)
    taped, reference = Executor(program, seed=2), Executor(program, seed=2)
    for seed, zero_grad in [(0, True), (1, True), (2, False), (3, False), (4, True), (5, False)]:
        monkeypatch.setattr(teeny.core.config, "replay", False)
        expected = token_step(reference, token_feed(seed), zero_grad)
        monkeypatch.setattr(teeny.core.config, "replay", True)
        assert_same_token_steps(token_step(taped, token_feed(seed), zero_grad), expected)
    assert _replays(taped) == (5, 4)  # all but the first forward and the first backward of each state
    assert len(taped._backward_tapes) == 2


def _replayed_forward() -> tuple[Executor, dict, torch.Tensor, object]:
    """An executor whose second forward_train a tape answered: (executor, feed, loss, cache)."""
    ex = Executor(lower(token_model(fan_out=True), LoweringMode.TRAINING))
    token_step(ex, token_feed(0))
    feed = token_feed(1)
    loss, cache = ex.forward_train(feed)
    assert ex._forward_tapes[True].replays == 1
    return ex, feed, loss, cache


def test_a_cache_its_forward_tape_made_is_not_checked_again_for_a_loss_seeded_by_the_executor(monkeypatch):
    """With ``grad_output=None`` the seed is the executor's own (ones: aliasing nothing), so a
    cache made by the forward tape that made the last one is laid out as that one was: the
    backward tape takes it unchecked. A caller's seed is checked with the cache, as ever."""
    from teeny.program.tape import Tape

    program = lower(token_model(fan_out=True), LoweringMode.TRAINING)
    ex, reference = Executor(program, seed=4), Executor(program, seed=4)
    checked = []
    fits = Tape.fits
    monkeypatch.setattr(Tape, "fits", lambda tape, tensors: checked.append(len(tensors)) or fits(tape, tensors))
    for seed in range(4):
        checked.clear()
        result = token_step(ex, token_feed(seed))
        with monkeypatch.context() as off:
            off.setattr(teeny.core.config, "replay", False)
            assert_same_token_steps(result, token_step(reference, token_feed(seed)))
    assert checked == [len(token_feed(0))]  # the forward's inputs only
    assert _replays(ex) == (3, 3)
    ex.zero_grad()
    loss, cache = ex.forward_train(token_feed(5))
    checked.clear()
    ex.backward(cache, torch.ones_like(loss))
    assert len(checked) == 1 and checked[0] > 1  # the caller's seed and the cache


def test_a_replayed_forward_keeps_what_the_backward_reads_and_the_backward_frees_it():
    ex, feed, loss, cache = _replayed_forward()
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
    ex, feed, _, cache = _replayed_forward()
    feed["idx"].zero_()  # the embedding's backward reads it
    with pytest.raises(TeenyError, match="input 'idx' was modified in place between forward_train and backward"):
        ex.backward(cache)


def test_flags_checked_after_a_replayed_forward_still_raise(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", True)  # read when the graph is traced
    g = Graph()
    x, t = g.input("logits", (4, 3), requires_grad=True), g.input("target", (4,), torch.int64)
    g.output(ops.cross_entropy(x * 2.0, t))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    logits = torch.randn(4, 3, device=teeny.DEVICE)
    for _ in range(2):
        ex.forward_train({"logits": logits, "target": torch.tensor([0, 2, 1, 2], device=teeny.DEVICE)})
    assert ex._forward_tapes[True].replays == 1
    with pytest.raises(TeenyError, match=r"cross_entropy \(node 'cross_entropy_\d', forward\): target class index 3 "):
        ex.forward_train({"logits": logits, "target": torch.tensor([0, 3, 1, 2], device=teeny.DEVICE)})


def test_a_one_node_program_replays_its_node_only():
    """Its node's replay is its whole run already: a tape would add only its checks."""
    g = Graph()
    g.output(ops.gelu(g.input("x", (6, 5), requires_grad=True)))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    for _ in range(3):
        _, cache = ex.forward_train({"x": torch.randn(6, 5, device=teeny.DEVICE)})
        ex.backward(cache, torch.ones(6, 5, device=teeny.DEVICE))
    assert _replays(ex) == (0, 0) and "one node" in ex._forward_tapes[True].not_recorded
    (run,) = ex._runs.values()
    assert run.forward.recordings and run.backward.recordings


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
    ex = Executor(lower(token_model(fan_out=True), LoweringMode.TRAINING))
    token_step(ex, token_feed(0))
    token_step(ex, token_feed(1))
    seen = []
    original = ex._node_backward

    def hook(p, *args):
        seen.append(p.node.name)
        original(p, *args)

    ex._node_backward = hook
    token_step(ex, token_feed(2))
    assert len(seen) == sum(p.needs_backward for p in ex.program.nodes)


def test_launches_are_seen_while_recorded_or_intercepted():
    """A replay under ``record_launches`` launches what the node-by-node run launches."""
    from teeny.core.kernel import record_launches

    ex = Executor(lower(token_model(fan_out=True), LoweringMode.TRAINING))
    for seed in range(3):
        token_step(ex, token_feed(seed))
    assert _replays(ex) == (2, 2)
    with record_launches() as replayed:
        token_step(ex, token_feed(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(teeny.core.config, "replay", False)
        with record_launches() as full:
            token_step(ex, token_feed(0))
    assert [launch.kernel for launch in replayed] == [launch.kernel for launch in full]


@pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="the interpreter has no compiled launcher")
def test_on_a_gpu_replayed_runs_launch_straight_through_the_compiled_launcher():
    from teeny.program.tape import _LaunchStep

    ex = Executor(lower(token_model(fan_out=True), LoweringMode.TRAINING))
    for seed in range(3):
        token_step(ex, token_feed(seed))
    tapes = [*ex._forward_tapes[True].tapes.values(), *(t.tape for t in ex._backward_tapes.values())]
    for tape in tapes:
        launches = [step for step in tape.steps if isinstance(step, _LaunchStep)]
        assert launches and all(step.direct is not None for step in launches)
