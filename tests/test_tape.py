"""Calls recorded once and replayed (``teeny.program.tape``): every registered op gives the same outputs
and gradients replayed as through the full host path; what cannot be replayed is not, and says
why; a call that does not fit the recording (alignment, strides) takes the full path; checks,
in-place updates, launch records and repeated backwards behave as without replay."""

import threading

import pytest
import torch
import triton
import triton.language as tl
from tests.test_torch_library import OVERLOADS, REGISTERED, _calls, _flat, _torch_args

import teeny
from teeny.checks.samples import OPS
from teeny.core import config, tuning
from teeny.core.kernel import kernel, record_launches
from teeny.program.tape import Replayed
from teeny.torch import bridge, library


def _run(packet, sample, calls: int):
    """Outputs and gradients of ``calls`` forward+backward calls of ``packet`` on ``sample``."""
    results = []
    for _ in range(calls):
        args, kwargs = _torch_args(sample)
        out = packet(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        floats = [o for o in outs if o.requires_grad]
        if floats:
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
        leaves = _flat((args, list(kwargs.values())))
        grads = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        results.append([o.detach().clone() for o in outs] + [g.clone() for g in grads if g is not None])
    return results


def _replays():
    return {
        (entry.label, way): (run.replays, run.not_recorded)
        for entry in bridge._ENTRIES.values()
        for way, run in (("forward", entry._forward_replay), ("backward", entry._backward_replay))
        if way == "forward" or entry.training  # (an entry lowered for inference never runs a backward)
    }


@pytest.mark.parametrize("qualname", OVERLOADS, ids=str)
def test_a_replayed_call_computes_what_the_full_path_does(qualname, gen, monkeypatch):
    reg = REGISTERED[qualname]
    packet, samples = _calls(qualname, OPS[reg.name].samples(torch.float32, gen), limit=1)
    if not samples:
        pytest.skip(f"no registry sample fits {reg.schema}")
    bridge.clear_cache()
    replayed = _run(packet, samples[0], calls=3)  # recorded, then replayed twice
    seen = _replays()
    monkeypatch.setattr(config, "replay", False)
    full = _run(packet, samples[0], calls=1)[0]
    for call in replayed:
        assert len(call) == len(full)
        for got, want in zip(call, full):
            assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True, rtol=0, atol=0)
    for (label, way), (replays, reason) in seen.items():
        if reason is None:
            assert replays >= 1, f"{label} {way} was recorded but never replayed"
        else:  # the only runs that may not be replayed: ops that take host state per run
            assert "take host state that changes per run" in reason, f"{label} {way}: {reason}"


def _entry(label: str):
    """The entry of ``label`` used last (an op has one per signature: grad mode, shapes)."""
    return [e for e in bridge._ENTRIES.values() if e.label == label][-1]


def test_dropout_is_never_replayed_and_draws_a_new_mask_each_call():
    bridge.clear_cache()
    x = torch.ones(64, 64)
    masks = [torch.ops.teeny.dropout(x, 0.5, True) for _ in range(3)]
    assert not torch.equal(masks[1], masks[2])
    run = _entry("teeny op dropout")._forward_replay
    assert run.replays == 0 and "dropout" in run.not_recorded


def test_a_run_that_reads_a_device_value_on_the_host_is_not_replayed():
    run = Replayed(lambda ts: [ts[0] * 2 if ts[0].sum().item() > 0 else ts[0] * 3])
    x = torch.ones(4)
    assert torch.equal(run([x])[0], x * 2)
    assert torch.equal(run([-x])[0], -x * 3)  # the branch is taken again, not replayed
    assert run.tape is None and "host" in run.not_recorded


def test_a_view_made_without_aten_is_not_frozen_into_the_tape():
    run = Replayed(lambda ts: [torch.from_numpy(ts[0].numpy()) * 2])  # a view the dispatch mode never sees
    assert torch.equal(run([torch.ones(3)])[0], torch.full((3,), 2.0))
    assert torch.equal(run([torch.full((3,), 5.0)])[0], torch.full((3,), 10.0))
    assert run.tape is None and "outside ATen" in run.not_recorded


def test_a_misaligned_input_or_other_strides_take_the_full_path():
    bridge.clear_cache()
    base = torch.randn(1 + 6 * 5)
    aligned = base[:30].view(6, 5)
    shifted = base[1:].view(6, 5)  # 4 bytes off the 16-byte alignment the recording saw
    torch.ops.teeny.gelu(aligned)
    run = _entry("teeny op gelu")._forward_replay
    torch.ops.teeny.gelu(aligned)
    assert run.replays == 1
    out = torch.ops.teeny.gelu(shifted)
    assert run.replays == 1
    torch.testing.assert_close(out, torch.nn.functional.gelu(shifted))

    x = torch.randn(6, 5, requires_grad=True)
    for grad in (torch.ones(6, 5), torch.ones(6, 5), torch.ones(5, 6).t(), torch.ones(()).expand(6, 5)):
        torch.ops.teeny.gelu(x).backward(grad)
    backward = _entry("teeny op gelu")._backward_replay
    assert backward.replays == 1  # the second call; the transposed and the expanded gradients did not fit
    expected = torch.autograd.grad(torch.nn.functional.gelu(x), x, torch.ones(6, 5))[0]
    torch.testing.assert_close(x.grad, 4 * expected)


def test_a_replayed_index_check_still_raises_naming_the_op(monkeypatch):
    monkeypatch.setattr(config, "check_indices", True)  # off by default on a GPU
    bridge.clear_cache()
    weight = torch.randn(10, 4)
    for _ in range(2):
        torch.ops.teeny.embedding(torch.tensor([1, 2, 3]), weight)
    run = _entry("teeny op embedding")._forward_replay
    assert run.replays == 1 and run.tape.checks
    with pytest.raises(teeny.TeenyError, match=r"op embedding .*index 12"):
        torch.ops.teeny.embedding(torch.tensor([1, 12, 3]), weight)
    assert run.replays == 2


def test_a_replay_updates_running_statistics_in_place():
    bridge.clear_cache()
    x = torch.randn(8, 3, 5, 5)
    mean, var = torch.zeros(3), torch.ones(3)
    ref_mean, ref_var = mean.clone(), var.clone()
    for _ in range(3):
        torch.ops.teeny.batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
        torch.nn.functional.batch_norm(x, ref_mean, ref_var, None, None, True, 0.1, 1e-5)
    assert _entry("teeny op batch_norm")._forward_replay.replays == 2
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var)


def test_recorded_launches_see_a_replay():
    bridge.clear_cache()
    x = torch.randn(7, 9, requires_grad=True)
    w = torch.randn(5, 9, requires_grad=True)
    torch.ops.teeny.linear(x, w).sum().backward()  # recorded
    with record_launches() as log:
        torch.ops.teeny.linear(x, w).sum().backward()
    assert _entry("teeny op linear")._forward_replay.replays == 1
    config_replay = config.replay
    try:
        config.replay = False
        with record_launches() as full:
            torch.ops.teeny.linear(x, w).sum().backward()
    finally:
        config.replay = config_replay
    assert [r.kernel for r in log] == [r.kernel for r in full]


def test_retain_graph_backward_twice_replays_the_backward():
    bridge.clear_cache()
    x = torch.randn(6, 7, requires_grad=True)
    y = torch.ops.teeny.layer_norm(x, [7])
    y.backward(torch.ones_like(y), retain_graph=True)
    first = x.grad.clone()
    y.backward(torch.ones_like(y))
    assert _entry("teeny op layer_norm")._backward_replay.replays == 1
    torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter has no compiled launcher")
def test_on_a_gpu_a_replay_launches_straight_through_the_compiled_launcher():
    from teeny.program.tape import _LaunchStep

    bridge.clear_cache()
    x = torch.randn(7, 9, device="cuda", requires_grad=True)
    for _ in range(2):
        torch.ops.teeny.layer_norm(x, [9]).sum().backward()
    entry = _entry("teeny op layer_norm")
    for run in (entry._forward_replay, entry._backward_replay):
        launches = [step for step in run.tape.steps if isinstance(step, _LaunchStep)]
        assert launches and all(step.direct is not None for step in launches)
        # kernels without scratch memory skip Triton's Python launcher as well
        assert all(step.direct.__name__ == "launch_native" for step in launches)


class _FakeLauncher:
    """Stands for Triton's ``CudaLauncher``: its C launcher records each call."""

    def __init__(self, global_scratch: int, profile_scratch: int = 0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch, profile_scratch
        self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, False
        self.calls: list[tuple] = []
        self.python_calls = 0

    def launch(self, *args):
        self.calls.append(args)

    def __call__(self, *args):  # Triton's Python launcher: allocates scratch itself
        self.python_calls += 1


def test_direct_launches_share_one_scratch_buffer_per_stream_and_allocate_afresh_under_capture(monkeypatch):
    import importlib
    from types import SimpleNamespace

    kernel_module = importlib.import_module("teeny.core.kernel")  # (``teeny.core.kernel`` is also the decorator)
    allocated, threads, capturing, synced = [], [], [False], []

    def allocate(size, alignment, stream):
        allocated.append(size)
        threads.append(threading.get_ident())
        return torch.empty(size, dtype=torch.int8)

    monkeypatch.setattr(kernel_module, "_device_scratch", allocate)
    monkeypatch.setattr(kernel_module, "_SCRATCH", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    def launcher(grid, global_scratch, profile_scratch=0, pdl=False):
        run = _FakeLauncher(global_scratch, profile_scratch)
        run.launch_pdl = pdl
        compiled = SimpleNamespace(run=run, function="fn", packed_metadata="meta")
        return kernel_module.direct_launcher(compiled, grid, device_scratch=True), run

    small, run = launcher((4, 2), 128)
    assert small.__name__ == "launch_with_scratch"
    small(7, ["a", "b"])
    small(7, ["c", "d"])
    assert allocated == [4 * 2 * 128]  # one buffer: a grid's programs each take 128 bytes of it
    first, second = run.calls
    assert first[:7] == (4, 2, 1, 7, "fn", False, False) and first[8:] == (None, "meta", None, None, None, "a", "b")
    assert first[7] is second[7] and first[7].numel() == 1024
    big, big_run = launcher((8, 2), 128)
    big(7, [])
    small(7, [])
    assert allocated == [1024, 2048]  # grown once for the bigger grid, then shared by both
    assert synced == [0]  # after the launches that may still read the smaller one
    assert big_run.calls[0][7] is run.calls[-1][7]
    small(9, [])
    assert allocated[-1] == 1024 and run.calls[-1][7] is not big_run.calls[0][7]  # another stream, its own
    capturing[0] = True
    small(7, [])
    small(7, [])
    assert allocated[-2:] == [1024, 1024] and run.calls[-1][7] is not run.calls[-2][7]  # kept by each graph
    assert len(kernel_module._SCRATCH) == 2  # capture left the shared buffers alone
    # the shared buffers come from threads of their own (outside any CUDA graph pool this thread
    # is routed to), the captured launches' from this thread (the graph's pool)
    here = threading.get_ident()
    assert all(t != here for t in threads[:3]) and threads[-2:] == [here, here]

    plain, plain_run = launcher((3,), 0)
    plain(7, ["x"])
    assert plain.__name__ == "launch_native" and plain_run.calls[0][7] is None
    profiled, profiled_run = launcher((3,), 128, profile_scratch=64)  # Triton's own path allocates both
    profiled(7, [])
    assert profiled_run.python_calls == 1 and not profiled_run.calls
    overlapping, overlapping_run = launcher((3,), 128, pdl=True)  # may start before the last one ends
    overlapping(7, [])  # the C launcher itself takes the programmatic dependent launch flag
    assert overlapping_run.python_calls == 0 and overlapping_run.calls[0][6] is True


@kernel(device_scratch=True, register=False)
def _copy_through_a_device_descriptor(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = x, through a TMA descriptor each program makes on the device (global scratch memory)."""
    desc = tl.make_tensor_descriptor(x_ptr, [n], [1], [BLOCK])
    start = tl.program_id(0) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, desc.load([start]), mask=offsets < n)


@pytest.mark.skipif(not torch.cuda.is_available() or not tuning.has_tma(), reason="needs a GPU with TMA")
def test_device_descriptor_kernels_replay_with_one_shared_scratch_buffer_and_capture_into_a_cuda_graph():
    """A kernel that makes TMA descriptors on the device (``device_scratch=True``), launched
    directly: its programs' descriptors live in the stream's one shared scratch buffer, kept
    across launches; a CUDA graph captured over it replays right after its input changed."""
    from teeny.core.kernel import _SCRATCH, direct_launcher

    n, block = 1000, 128
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    instance = _copy_through_a_device_descriptor.instance(torch.float32)
    grid = (triton.cdiv(n, block),)
    compiled = instance.run_jit(instance.kernel.jit, grid, [x, y, n, block], {})
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    launch = direct_launcher(compiled, grid, device_scratch=True)
    assert launch.__name__ == "launch_with_scratch"
    stream = torch.cuda.current_stream().cuda_stream
    y.zero_()
    launch(stream, [x, y, n, block])
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    buffers = {k: b.data_ptr() for k, b in _SCRATCH.items()}
    assert buffers  # the descriptors live in the stream's one shared buffer
    launch(stream, [x, y, n, block])
    assert {k: b.data_ptr() for k, b in _SCRATCH.items()} == buffers
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        launch(torch.cuda.current_stream().cuda_stream, [x, y, n, block])  # (the graph's capture stream)
    torch.cuda.current_stream().wait_stream(side)
    x.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or not tuning.has_tma(), reason="needs a GPU with TMA")
def test_tma_products_replay_directly_and_capture_into_a_cuda_graph(monkeypatch):
    """matmul_tma's descriptors are made on the host at each launch (``Kernel(arguments=...)``):
    replayed products launch straight through Triton's C launcher with no scratch memory, give
    right results, and a CUDA graph captured over one replays right after its input changed."""
    from teeny.ops.products.kernels import matmul_tma
    from teeny.program.tape import _LaunchStep

    monkeypatch.setenv("TEENY_TUNING", "0")  # the heuristic's TMA configuration: timing them all takes minutes
    bridge.clear_cache()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ w.float().t()
    results = [torch.ops.teeny.linear(x, w) for _ in range(3)]
    steps = [s for s in _entry("teeny op linear")._forward_replay.tape.steps if isinstance(s, _LaunchStep)]
    products = [s for s in steps if s.instance.kernel is matmul_tma]
    assert products and all(s.direct.__name__ == "launch_arguments" for s in products)
    for z in results:
        torch.testing.assert_close(z.float(), expected, atol=1.0, rtol=2e-2)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        captured = torch.ops.teeny.linear(x, w)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(2 * x)
    graph.replay()
    torch.testing.assert_close(captured.float(), 2 * expected, atol=2.0, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or not tuning.has_tma(), reason="needs a GPU with TMA")
def test_tma_products_under_torch_compile_cuda_graphs(monkeypatch):
    """torch.compile(mode="reduce-overhead") warms its CUDA graphs up and records them with this
    thread's allocations routed into the graphs' pool, and then refuses a pool holding a live
    tensor it did not hand out (docs/archive/bench-journal.md, version 16); the products' TMA descriptors,
    made on the host at recording, hold the graphs' addresses."""
    monkeypatch.setenv("TEENY_TUNING", "0")
    bridge.clear_cache()
    torch._dynamo.reset()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def loss(x, w):
        return torch.ops.teeny.linear(x, w).float().square().mean()

    expected = loss(x, w)
    (expected_grad,) = torch.autograd.grad(expected, w)
    compiled = torch.compile(loss, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        value = compiled(x, w)
        (grad,) = torch.autograd.grad(value, w)
        torch.testing.assert_close(value, expected, rtol=1e-3, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-2, atol=1e-4)
    torch._dynamo.reset()


def test_replay_can_be_switched_off(monkeypatch):
    bridge.clear_cache()
    monkeypatch.setattr(config, "replay", False)
    x = torch.randn(10)
    for _ in range(3):
        torch.ops.teeny.gelu(x)
    run = _entry("teeny op gelu")._forward_replay
    assert run.tape is None and run.replays == 0
    assert library.registered_ops()  # the ops themselves are untouched


def test_a_tape_recorded_on_one_tensor_given_twice_is_not_replayed_on_two():
    """A first call ``mul(x, x)`` numbers ``x`` once; replaying its tape on ``(a, b)`` read ``b``
    twice. Each aliasing pattern has its own tape, both orders, and each is replayed."""
    bridge.clear_cache()
    x, a, b = (torch.randn(4, 5, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for first, second in (((x, x), (a, b)), ((a, b), (x, x))):
        bridge.clear_cache()
        for _ in range(2):
            for p, q in (first, second):
                torch.testing.assert_close(torch.ops.teeny.mul(p, q), p * q, rtol=0, atol=0)
        assert _entry("teeny op mul")._forward_replay.replays == 2
    q, k, v = (torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bridge.clear_cache()
    torch.ops.teeny.scaled_dot_product_attention(q, q, q)
    got = torch.ops.teeny.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_a_replay_keeps_the_aliasing_of_the_gradients_it_was_recorded_with():
    """Backward given the same tensor as the gradient of both outputs, then distinct ones."""
    bridge.clear_cache()
    x = torch.randn(3, 5, requires_grad=True)
    g1, g2 = torch.randn(3, 5), torch.randn(3, 5)
    for grads in ((g1, g1), (g1, g2), (g1, g1), (g1, g2)):
        a, b = teeny.torch.apply(lambda t: (teeny.ops.mul(t, 2.0), teeny.ops.mul(t, 3.0)), x)
        (got,) = torch.autograd.grad((a, b), x, grads)
        torch.testing.assert_close(got, 2 * grads[0] + 3 * grads[1])


def test_apply_given_one_tensor_twice_then_two():
    bridge.clear_cache()
    x, a, b = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)

    def product(p, q):
        return teeny.ops.mul(p, q)

    for p, q in ((x, x), (a, b), (x, x), (a, b)):
        torch.testing.assert_close(teeny.torch.apply(product, p, q), p * q, rtol=0, atol=0)


def test_each_kind_of_step_is_written_out_and_replays_as_it_ran():
    """A tape's steps run as one generated function: an allocation, a view, a call with several
    results (split), one zeroing in place, a clone, each on the slots they were recorded on."""

    def fn(tensors):
        x, y = tensors
        out = torch.empty(3, 4)
        out.copy_(x[1:] * 2)  # a view of an input, a call with one result, a copy into a buffer
        first, second = y.split([2, 3])  # several results
        second.zero_()  # in place, a result of its own made nothing new
        return [out, first.clone(), second, y]

    replayed = Replayed(fn)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 4, generator=gen), torch.randn(5, 2, generator=gen)
        want_y = y.clone()
        want_y[2:] = 0
        out, first, second, y_out = replayed([x, y])
        torch.testing.assert_close(out, x[1:] * 2, rtol=0, atol=0)
        torch.testing.assert_close(first, want_y[:2], rtol=0, atol=0)
        assert second.data_ptr() == y.data_ptr() + 2 * 2 * 4 and not second.any() and y_out is y
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    assert replayed.replays == 2 and replayed.not_recorded is None
