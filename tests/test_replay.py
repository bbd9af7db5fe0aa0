"""The executor's node replay (``teeny.program.replay``): each node's launches built and checked
once, then fired again with each run's tensors; the full path where a replay would be wrong.
(What a whole run's tape records is those replays' launches: test_run_tapes.py.)"""

import pytest
import torch

import teeny
from helpers import assert_same_token_steps, token_feed, token_model, token_step
from teeny import Graph, LoweringMode, TeenyError, lower, ops
from teeny.core.errors import KernelLaunchError
from teeny.core.init import normal
from teeny.core.kernel import record_launches
from teeny.program.executor import Executor


@pytest.fixture(autouse=True)
def _node_by_node(monkeypatch):
    """The executors made here replay node by node (``teeny.program.replay``): their whole runs'
    tapes (``teeny.program.tape``, tested in test_run_tapes.py) never record."""
    from teeny.program import executor, tape

    def node_by_node(fn, blocked, own):
        return tape.Replayed(fn, "runs replayed node by node (test_replay.py)", own)

    monkeypatch.setattr(executor, "Replayed", node_by_node)


def _param(g: Graph, name: str, shape: tuple):
    return g.parameter(name, shape, init=normal(0.5))


def test_replayed_runs_give_what_the_full_path_gives(monkeypatch):
    program = lower(token_model(), LoweringMode.TRAINING)
    replayed, full = Executor(program, seed=3), Executor(program, seed=3)
    for seed in range(3):
        ours = token_step(replayed, token_feed(seed))
        monkeypatch.setattr(teeny.core.config, "replay", False)
        assert_same_token_steps(ours, token_step(full, token_feed(seed)))
        monkeypatch.setattr(teeny.core.config, "replay", True)
    for run in replayed._runs.values():  # every node recorded, but the embedding's backward (below)
        assert run.planned.is_view or run.forward.recordings, run.planned.name
        assert run.backward.recordings or run.backward.not_recorded, run.planned.name
    # the full path never records
    assert not any(run.forward.recordings or run.backward.recordings for run in full._runs.values())


def test_a_replay_launches_what_the_full_path_launches(monkeypatch):
    ex = Executor(lower(token_model(), LoweringMode.TRAINING))
    token_step(ex, token_feed(0))
    with record_launches() as replayed:
        token_step(ex, token_feed(1))
    monkeypatch.setattr(teeny.core.config, "replay", False)
    with record_launches() as full:
        token_step(ex, token_feed(1))
    assert replayed == full


def test_a_tensor_zeroed_while_building_the_launches_is_zeroed_again_by_a_replay(monkeypatch):
    """The embedding's backward zeroes its gradient before its kernel adds rows into it
    (``zero_()`` while building its launches): a replay zeroes it again before its launches."""
    ex = Executor(lower(token_model(), LoweringMode.TRAINING))
    first = token_step(ex, token_feed(0), zero_grad=False)
    (embedding,) = [run for run in ex._runs.values() if run.planned.op.name == "embedding"]
    # role 5, its gradient: after the indices, the weight and the output (not kept), dy and no index gradient
    assert [recording.zeroed for recording in embedding.backward.recordings.values()] == [(5,)]
    second = token_step(ex, token_feed(0), zero_grad=False)  # accumulating: twice the first gradient
    torch.testing.assert_close(second[2]["table"], 2 * first[2]["table"])
    monkeypatch.setattr(teeny.core.config, "replay", False)
    torch.testing.assert_close(token_step(ex, token_feed(0), zero_grad=False)[2]["table"], 3 * first[2]["table"])


def test_launch_building_that_does_more_on_the_device_takes_the_full_path():
    """The deterministic embedding's backward sorts the indices while building its launches: a
    replay would skip that, so it is not recorded."""
    g = Graph()
    idx = g.input("idx", (4, 6), torch.int64)
    g.output(ops.sum(ops.embedding(idx, _param(g, "table", (10, 8)), deterministic=True)))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    feed = {"idx": token_feed(0)["idx"]}
    grads = []
    for _ in range(2):
        ex.zero_grad()
        ex.backward(ex.forward_train(feed)[1])
        grads.append(ex.grads["table"].clone())
    (embedding,) = [run for run in ex._runs.values() if run.planned.op.name == "embedding"]
    assert not embedding.backward.recordings
    assert "aten.sort" in next(iter(embedding.backward.not_recorded.values()))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


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


def test_the_layout_of_fixed_roles_notes_only_which_other_roles_share_their_memory():
    """The executor's own tensors (``fixed``: parameters, the same tensor at their place every
    run) are not laid out again; a role that is not fixed but lies in their memory, before or
    after them, is noted."""
    from teeny.program.replay import layout

    arena = torch.zeros(64)
    w, b, elsewhere = arena[:16], arena[16:32], arena[32:48]
    x, y = torch.randn(16), torch.randn(16)
    storages: dict = {}
    plain = layout([x, w, b], fixed=0b110, storages=storages)
    assert plain == layout([y, w, b], fixed=0b110, storages=storages) and set(storages) == {1, 2}
    assert layout([elsewhere, w, b], fixed=0b110, storages=storages) != plain
    assert layout([w, b, elsewhere], fixed=0b011, storages={}) != layout([w, b, x], fixed=0b011, storages={})
    assert layout([x, w, b], fixed=0b000) != plain  # which roles are fixed is part of the layout


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
    ex = Executor(lower(token_model(), LoweringMode.TRAINING))
    token_step(ex, token_feed(0))
    feed = token_feed(1)
    _, cache = ex.forward_train(feed)
    feed["idx"].zero_()  # the embedding's backward reads it
    with pytest.raises(TeenyError, match="input 'idx' was modified in place"):
        ex.backward(cache)


on_gpu = pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="the interpreter has no compiled launcher")
off_gpu = pytest.mark.skipif(
    teeny.DEVICE.type == "cuda", reason="stands in for a GPU's current device and stream (a GPU runs its own below)"
)


class _StandIns:
    """Stand-ins for what Triton compiles, its C launcher and CUDA's current device and stream:
    the "compiled kernel" of a launch is what it ran, and its direct launcher runs that again
    through Triton (the interpreter), noting the stream it was handed."""

    def __init__(self, monkeypatch):
        from teeny.core.kernel import KernelInstance
        from teeny.program import replay

        run_jit = KernelInstance.run_jit
        self.full = 0  # launches through KernelInstance.run_jit (the full path)
        self.streams: list[int] = []  # one per direct launch
        self.failing = False  # the C launcher raises (a launch failed)

        def compiling(instance, jit, grid, args, options):
            self.full += 1
            run_jit(instance, jit, grid, args, options)
            return instance, jit, options

        def direct_launcher(compiled, grid, device_scratch, arguments):
            instance, jit, options = compiled

            def launch(stream, args):
                if self.failing:
                    raise RuntimeError("invalid argument")
                self.streams.append(stream)
                run_jit(instance, jit, grid, args, options)

            return launch

        self.device, self.stream = 0, 7
        monkeypatch.setattr(KernelInstance, "run_jit", compiling)
        monkeypatch.setattr(replay, "direct_launcher", direct_launcher)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: self.device, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: self.stream, raising=False)


@off_gpu
def test_a_replay_launches_through_the_direct_launchers_on_the_current_stream(monkeypatch):
    """Each recorded launch keeps the direct launcher of what Triton compiled for it; a replay
    fires it with the run's tensors on the stream current then, and gives what the full path gives."""
    program = lower(token_model(), LoweringMode.TRAINING)
    reference = [token_step(Executor(program, seed=3), token_feed(seed)) for seed in range(3)]
    stand_ins = _StandIns(monkeypatch)
    ex = Executor(program, seed=3)
    assert_same_token_steps(token_step(ex, token_feed(0)), reference[0])  # recorded
    assert stand_ins.full and not stand_ins.streams
    stand_ins.full, stand_ins.stream = 0, 9
    assert_same_token_steps(token_step(ex, token_feed(1)), reference[1])
    assert stand_ins.full == 0 and stand_ins.streams and set(stand_ins.streams) == {9}
    stand_ins.streams.clear()
    stand_ins.stream = 11  # read again at each replay
    assert_same_token_steps(token_step(ex, token_feed(2)), reference[2])
    assert stand_ins.full == 0 and set(stand_ins.streams) == {11}
    stand_ins.failing = True  # a failing direct launch is named as runtime.fire names one
    failed = r"\(node 'embedding_0', forward\): kernel index_forward for float32 failed on inputs .*: RuntimeError"
    with pytest.raises(KernelLaunchError, match=failed):
        token_step(ex, token_feed(0))


@off_gpu
def test_a_replay_takes_the_full_path_while_launches_are_watched_or_another_device_is_current(monkeypatch):
    """Launch hooks (a profiler), an interceptor, a recorder and another current device than the
    recording's (whose compiled kernels the direct launchers hold) each send a replay's launches
    through ``runtime.fire``."""
    from triton import knobs

    from teeny.core.kernel import intercept_launches

    ex = Executor(lower(token_model(), LoweringMode.TRAINING))
    stand_ins = _StandIns(monkeypatch)
    token_step(ex, token_feed(0))

    def full_path_only(step) -> None:
        stand_ins.full, stand_ins.streams = 0, []
        step()
        assert stand_ins.full and not stand_ins.streams

    hook = knobs.runtime.launch_enter_hook
    hook.add(_no_op)
    try:
        full_path_only(lambda: token_step(ex, token_feed(1)))
    finally:
        hook.remove(_no_op)
    with record_launches() as log:
        full_path_only(lambda: token_step(ex, token_feed(1)))
    assert log
    intercepted = []
    with intercept_launches(lambda instance, *launch: intercepted.append(instance)):
        ex.forward_train(token_feed(1))
    assert intercepted and not stand_ins.streams
    stand_ins.device = 1
    full_path_only(lambda: token_step(ex, token_feed(1)))
    stand_ins.device = 0
    stand_ins.streams = []
    token_step(ex, token_feed(1))
    assert stand_ins.streams


def _no_op(*args) -> None:
    """A launch hook (as a profiler sets)."""


@on_gpu
def test_on_a_gpu_a_replay_launches_straight_through_the_compiled_launcher(monkeypatch):
    """Every recorded launch has a direct launcher of the kernel Triton compiled for it; a
    replayed step calls no ``JITFunction.run`` (but where a profiler's launch hook is set), on
    the current stream, and gives what the full path gives."""
    from triton import knobs

    from teeny.core.kernel import KernelInstance

    program = lower(token_model(), LoweringMode.TRAINING)
    ex, reference = Executor(program, seed=3), Executor(program, seed=3)
    token_step(ex, token_feed(0))
    for run in ex._runs.values():
        for phase in (run.forward, run.backward):
            for recording in phase.recordings.values():
                if recording.launches:  # (a view's backward may have none)
                    assert recording.device == torch.cuda.current_device(), run.planned.name
                    assert all(direct is not None for *_, direct in recording.launches), run.planned.name

    def refused(*args, **kwargs):
        raise AssertionError("a replayed launch took Triton's full path")

    with monkeypatch.context() as patched:
        patched.setattr(KernelInstance, "run_jit", refused)
        ours = token_step(ex, token_feed(1))
    run_jit, full = KernelInstance.run_jit, []

    def counted(*args):
        full.append(args[0])
        return run_jit(*args)

    knobs.runtime.launch_enter_hook.add(_no_op)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(KernelInstance, "run_jit", counted)
            hooked = token_step(ex, token_feed(1))
    finally:
        knobs.runtime.launch_enter_hook.remove(_no_op)
    assert full
    stream = torch.cuda.Stream()  # the current stream, read at each replay
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = token_step(ex, token_feed(2))
    stream.synchronize()
    monkeypatch.setattr(teeny.core.config, "replay", False)
    assert_same_token_steps(ours, token_step(reference, token_feed(1)))
    assert_same_token_steps(hooked, ours)
    assert_same_token_steps(on_stream, token_step(reference, token_feed(2)))
