"""teeny.core.tuning: the choice of a launch configuration per static shape, its disk cache, and the
ops choosing at lowering. The cache logic runs on the CPU with a fake timing function."""

import json

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, lower
from teeny.core import tuning
from teeny.ops.products import kernels as products_kernels
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning
from teeny.ops.products.ops import LinearOp

CANDIDATES = [{"BLOCK": 64, "num_warps": 4}, {"BLOCK": 128, "num_warps": 8}, {"BLOCK": 256, "num_warps": 8}]
DEFAULT = {"BLOCK": 32, "num_warps": 4}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Tuning switched on (as on a GPU) with a cache file of its own."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(path))
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    tuning.forget_memory()
    yield path
    tuning.forget_memory()


def _bench(times, calls):
    def bench(config):
        calls.append(config["BLOCK"])
        return times[config["BLOCK"]]

    return bench


def test_fastest_candidate_is_chosen_and_cached_on_disk(cache):
    calls = []
    choice = tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 2.0, 128: 1.0, 256: 3.0}, calls))
    assert choice == CANDIDATES[1] and calls == [64, 128, 256]
    entries = json.loads(cache.read_text())["entries"]
    (key,) = entries
    assert tuning.gpu_name() in key and f"triton {__import__('triton').__version__}" in key and '"M": 3' in key
    assert entries[key]["config"] == CANDIDATES[1] and entries[key]["ms"] == 1.0
    # a new process (nothing in memory) reads the file and times nothing
    tuning.forget_memory()
    again = []
    assert (
        tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 0.1, 128: 9.0, 256: 9.0}, again))
        == (CANDIDATES[1])
    )
    assert again == []
    # another key, another kernel: timed afresh, the first entry kept
    fast_64, fast_256 = _bench({64: 0.1, 128: 9.0, 256: 9.0}, again), _bench({64: 9.0, 128: 9.0, 256: 0.1}, again)
    assert tuning.choose("k", {"M": 4}, CANDIDATES, DEFAULT, fast_64)["BLOCK"] == 64
    assert tuning.choose("other", {"M": 3}, CANDIDATES, DEFAULT, fast_256)["BLOCK"] == 256
    assert len(json.loads(cache.read_text())["entries"]) == 3


def test_cached_choice_outside_the_candidates_is_timed_again(cache):
    tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 2.0, 128: 1.0, 256: 3.0}, []))
    tuning.forget_memory()
    calls = []
    fewer = [CANDIDATES[0], CANDIDATES[2]]  # the kernel's candidate list changed since
    assert tuning.choose("k", {"M": 3}, fewer, DEFAULT, _bench({64: 2.0, 256: 1.0}, calls)) == CANDIDATES[2]
    assert calls == [64, 256]


def test_cached_choice_is_timed_again_against_a_candidate_added_since(cache):
    tuning.choose("k", {"M": 3}, CANDIDATES[:2], DEFAULT, _bench({64: 2.0, 128: 1.0}, []))
    tuning.forget_memory()
    calls = []  # a new kernel joined the candidates (matmul_ws did): the cached winner is not enough
    assert (
        tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 2.0, 128: 1.0, 256: 0.5}, calls))
        == (CANDIDATES[2])
    )
    assert calls == [64, 128, 256]
    tuning.forget_memory()
    again = []  # and now it is cached with all three timed
    assert (
        tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 0.1, 128: 0.1, 256: 9.0}, again))
        == (CANDIDATES[2])
    )
    assert again == []


def test_failing_candidates_are_skipped_and_all_failing_gives_the_default(cache):
    def bench(config):
        if config["BLOCK"] != 128:
            raise RuntimeError("out of resources: shared memory")
        return 5.0

    assert tuning.choose("k", {"M": 1}, CANDIDATES, DEFAULT, bench) == CANDIDATES[1]

    def broken(config):
        raise RuntimeError("does not compile")

    with pytest.warns(UserWarning, match="every candidate failed"):
        assert tuning.choose("k", {"M": 2}, CANDIDATES, DEFAULT, broken) == DEFAULT


def test_unreadable_cache_file_is_replaced(cache):
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        choice = tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 1.0, 128: 2.0, 256: 3.0}, []))
    assert choice == CANDIDATES[0]
    assert json.loads(cache.read_text())["format"] == tuning.CACHE_FORMAT


def test_tuning_off_gives_the_default_and_times_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "t.json"))
    monkeypatch.setattr(tuning, "enabled", lambda: False)
    calls = []
    assert tuning.choose("k", {"M": 3}, CANDIDATES, DEFAULT, _bench({64: 1.0, 128: 1.0, 256: 1.0}, calls)) == DEFAULT
    assert calls == [] and not (tmp_path / "t.json").exists()


def test_switch_and_cache_location_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TEENY_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() == tmp_path / "teeny" / "tuning.json"
    monkeypatch.setenv("TEENY_TUNING_CACHE", str(tmp_path / "x.json"))
    assert tuning.cache_path() == tmp_path / "x.json"
    monkeypatch.setenv("TEENY_TUNING", "0")
    assert not tuning.enabled()
    monkeypatch.setenv("TEENY_TUNING", "1")
    assert tuning.enabled() == (teeny.DEVICE.type == "cuda")  # never under the interpreter


def test_products_choose_their_configuration_at_lowering(monkeypatch):
    seen = []
    small = {"kernel": "strided", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
             "num_stages": 2}  # fmt: skip

    def choose(kernel, key, candidates, default, bench, before_timing=None):
        seen.append((kernel, key["M"], key["N"], key["K"], key["bias"]))
        return small

    monkeypatch.setattr(tuning, "choose", choose)
    monkeypatch.setattr(products_tuning, "TUNE_MIN_MACS", 0)  # time even these tiny products
    g = Graph()
    x = g.input("x", (37, 5), requires_grad=True)
    g.output(
        teeny.ops.linear(x, g.parameter("w", (6, 5), teeny.core.init.kaiming_uniform(5)), g.parameter("b", (6,))).sum()
    )
    program = lower(g, LoweringMode.TRAINING)
    # forward (37 x 6, K 5, bias), dX (37 x 5, K 6), dW (6 x 5, K 37): each chosen once, at lowering
    assert sorted(seen) == sorted(
        [("matmul_product", 37, 6, 5, True), ("matmul_product", 37, 5, 6, False), ("matmul_product", 6, 5, 37, False)]
    )
    op = next(p.op for p in program.nodes if p.op.name == "linear")
    assert sorted(key[0] for key in op.configs) == ["forward", "grad_input", "grad_weight"]  # (name, shape) keys
    assert all(config is small for config in op.configs.values())
    ex = teeny.Executor(program)
    xs = torch.randn(37, 5)
    out, cache = ex.forward_train({"x": xs.to(teeny.DEVICE)})
    ex.backward(cache)
    assert len(seen) == 3  # running the program chooses nothing again
    w, b = ex.params["w"].cpu(), ex.params["b"].cpu()
    torch.testing.assert_close(out.cpu(), (xs @ w.T + b).sum(), atol=1e-4, rtol=1e-5)


def test_heuristic_splits_few_output_tiles_stream_k_or_into_smaller_tiles(monkeypatch):
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(tuning, "has_tma", lambda: True)
    monkeypatch.setattr(tuning, "multiprocessors", lambda: 132)
    # untimed (under TUNE_MIN_MACS): 8 tiles of 128 x 256 over 2,048 rows, shared out stream-K
    dw_small = LinearOp.products([(2048, 512), (512, 512)])["grad_weight"]
    config = products_tuning.default_config(
        dw_small, dtype=torch.bfloat16, precision="tf32", has_bias=False, row_sums=True
    )
    assert config["kernel"] == "tma" and config["STREAM_K"] and config["FUSED_SUMS"]
    plan = products_launches.schedule(dw_small, config)
    assert plan.programs == 64 and plan.dp_tiles == 0 and plan.sk_tiles == 8 and plan.slots > 1  # 4 K tiles each
    # one the tuning pass would time: 18 tiles of 128 x 256, so whole 128 x 128 tiles (v17's sweep)
    dw = LinearOp.products([(8192, 768), (768, 768)])["grad_weight"]
    config = products_tuning.default_config(dw, dtype=torch.bfloat16, precision="tf32", has_bias=False, row_sums=True)
    assert (config["BLOCK_M"], config["BLOCK_N"], config["STREAM_K"], config["FUSED_SUMS"]) == (128, 128, 0, True)
    fwd = LinearOp.products([(8192, 768), (3072, 768)])["forward"]  # 768 tiles: all whole
    assert products_tuning.default_config(fwd, dtype=torch.bfloat16, precision="tf32", has_bias=True)["STREAM_K"] == 0
    options = products_tuning.candidates(dw, dtype=torch.bfloat16, precision="tf32", has_bias=False, row_sums=True)
    assert {c["FUSED_SUMS"] for c in options} == {True, False} and any(c["OCCUPANCY"] == 2 for c in options)
    for dtype, precision in ((torch.float32, "tf32x3"), (torch.bfloat16, "tf32")):
        for c in products_tuning.candidates(dw, dtype=dtype, precision=precision, has_bias=False, row_sums=True):
            budget = (
                products_tuning.SHARED_MEMORY_BUDGET if c["OCCUPANCY"] == 1 else products_tuning.SHARED_MEMORY_PER_PAIR
            )
            assert products_tuning._shared_bytes(c, dtype, row_sums=True) <= budget
    # float32: dW reads both operands MN-major, so K-major copies are among the candidates
    assert any(
        c["K_MAJOR"] for c in products_tuning.candidates(dw, dtype=torch.float32, precision="tf32x3", has_bias=False)
    )
    assert not any(
        c["K_MAJOR"] for c in products_tuning.candidates(fwd, dtype=torch.float32, precision="tf32x3", has_bias=True)
    )


def test_stream_k_schedule_gives_every_program_its_share():
    """The host's schedule and the kernels' owners agree: every K tile of the shared tiles is
    taken by exactly one program, the programs' shares differ by at most one K tile."""
    p = LinearOp.products([(8192, 768), (3072, 768)])["grad_weight"]
    config = products_tuning._cfg(128, 256, 64, 8, 3, stream_k=1)
    plan = products_launches.schedule(p, config)  # 72 tiles on the interpreter's 4 "multiprocessors"
    k_tiles = 8192 // 64
    total = plan.sk_tiles * k_tiles
    shares = [(q + 1) * total // plan.programs - q * total // plan.programs for q in range(plan.programs)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1
    for i in range(plan.sk_tiles):
        first = ((i * k_tiles + 1) * plan.programs - 1) // total
        last = ((i + 1) * k_tiles * plan.programs - 1) // total
        assert first * total // plan.programs <= i * k_tiles < (first + 1) * total // plan.programs
        assert last * total // plan.programs <= (i + 1) * k_tiles - 1 < (last + 1) * total // plan.programs
        assert last - first + 1 <= plan.slots


def test_small_products_take_the_heuristic_without_timing(monkeypatch):
    calls = []
    monkeypatch.setattr(tuning, "choose", lambda *args: calls.append(args))
    p = LinearOp.products([(128, 256), (784, 256)])["forward"]  # 2.6e7 multiply-adds
    config = products_tuning.choose_config(p, dtype=torch.float32, precision="ieee", has_bias=True)
    assert calls == [] and config == products_tuning.default_config(
        p, dtype=torch.float32, precision="ieee", has_bias=True
    )


def test_a_derivative_epilogue_leaves_room_for_the_box_it_loads(monkeypatch):
    """A derivative epilogue loads h through a TMA box of its own (the H200 refuses 128x256x64
    in 3 stages with it: 272 KiB of 227): the candidates leave room for it, taking half-tile
    stores where that makes a configuration fit, and so does the heuristic's pick; an activation
    epilogue stores h through Z's staging tile and keeps every plain candidate of matmul_tma."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(tuning, "has_tma", lambda: True)
    monkeypatch.setattr(tuning, "multiprocessors", lambda: 132)
    products = LinearOp.products([(8192, 3072), (768, 3072)])
    plain = products_tuning.candidates(products["grad_input"], dtype=torch.bfloat16, precision="tf32", has_bias=False)
    loads = products_tuning.candidates(
        products["grad_input"], dtype=torch.bfloat16, precision="tf32", has_bias=False, epilogue="derivative"
    )
    for c in loads:
        budget = products_tuning.SHARED_MEMORY_BUDGET if c["OCCUPANCY"] == 1 else products_tuning.SHARED_MEMORY_PER_PAIR
        store_n = c["BLOCK_N"] // 2 if c["SUBTILE"] else c["BLOCK_N"]
        assert products_tuning._shared_bytes(c, torch.bfloat16) + c["BLOCK_M"] * store_n * 2 <= budget
        assert c in plain or {**c, "SUBTILE": False} in plain  # a plain candidate, or it with half-tile stores
    big = [(c["BLOCK_M"], c["BLOCK_N"], c["num_stages"], c["SUBTILE"]) for c in loads]
    assert (128, 256, 3, True) in big and (128, 256, 3, False) not in big
    forward = products["forward"]
    plain_forward = products_tuning.candidates(forward, dtype=torch.bfloat16, precision="tf32", has_bias=True)
    assert plain_forward[-1]["kernel"] == "ws"  # matmul_ws has no activation epilogue
    assert (
        products_tuning.candidates(
            forward, dtype=torch.bfloat16, precision="tf32", has_bias=True, epilogue="activation"
        )
        == plain_forward[:-1]
    )
    pick = products_tuning.default_config(
        products["grad_input"], dtype=torch.bfloat16, precision="tf32", has_bias=False, epilogue="derivative"
    )
    assert pick == loads[0]


def test_parallel_writers_keep_each_others_entries(cache, monkeypatch):
    """Two ranks tuning at once, each adding its entry: the one whose write fell between the
    other's read and write used to be lost (the other wrote back the file as it had read it).
    Here rank 1 writes while rank 0 is between its read and its write; with the lock it waits."""
    import threading

    read = tuning._read
    rank1 = threading.Thread(target=tuning._write, args=(cache, "rank 1", {"config": {"BLOCK": 128}}))

    def read_then_let_rank1_write(path):
        entries = read(path)
        if rank1.ident is None:  # rank 0's read, inside its write
            rank1.start()
            rank1.join(timeout=1.0)  # done at once without a lock; waiting on rank 0's with one
        return entries

    monkeypatch.setattr(tuning, "_read", read_then_let_rank1_write)
    tuning._write(cache, "rank 0", {"config": {"BLOCK": 64}})
    rank1.join()
    assert set(json.loads(cache.read_text())["entries"]) == {"rank 0", "rank 1"}


def test_a_product_launched_at_several_shapes_keeps_a_configuration_per_shape(monkeypatch):
    """The chunked head + loss runs its linear on chunks of rows, the last one short: each shape's
    configuration is its own (a configuration per product name ran the short chunk's on every
    chunk, launching a kernel the dry run had not built for those shapes: the H100 refused it)."""
    from teeny import fusions

    monkeypatch.setattr(fusions.chunked_loss, "CHUNKED_LOGITS_MIN_BYTES", 0)
    monkeypatch.setattr(fusions.chunked_loss, "CHUNK_ROW_MULTIPLE", 4)
    monkeypatch.setattr(fusions.chunked_loss, "LOGITS_CHUNK_BYTES", 1)  # chunks of 4 rows: 4, 4, 4, 3
    monkeypatch.setattr(products_tuning, "TUNE_MIN_MACS", 0)

    def choose(
        kernel, key, candidates, default, bench, before_timing=None
    ):  # another block size for the short chunk's products
        block = 16 if 3 in (key["M"], key["N"], key["K"]) else 32
        return {"kernel": "strided", "BLOCK_M": block, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2,
                "num_warps": 4, "num_stages": 2}  # fmt: skip

    monkeypatch.setattr(tuning, "choose", choose)
    g = Graph()
    x = g.input("x", (15, 8), requires_grad=True)
    y = g.input("y", (15,), torch.int64)
    g.output(teeny.ops.cross_entropy(teeny.nn.Linear(8, 11)(x), y))
    program = lower(g, LoweringMode.TRAINING)
    (node,) = program.nodes
    linear = node.op.linear
    assert {config["BLOCK_M"] for config in linear.configs.values()} == {16, 32}
    ex = teeny.Executor(program, seed=0)
    feed = {"x": torch.randn(15, 8).to(teeny.DEVICE), "y": torch.randint(11, (15,)).to(teeny.DEVICE)}
    loss, cache = ex.forward_train(feed)  # every chunk's launch is one the dry run built
    grads = ex.backward(cache)
    reference = lower(g, LoweringMode.TRAINING, rewrites=())
    plain = teeny.Executor(reference, seed=0)
    want, plain_cache = plain.forward_train(feed)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["x"], plain.backward(plain_cache)["x"], rtol=1e-5, atol=1e-6)
