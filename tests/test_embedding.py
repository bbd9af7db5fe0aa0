"""embedding family beyond the generic harness: determinism, padding_idx, max_norm's in-place
renormalisation, scale_grad_by_freq's counts, checked and unchecked out-of-range indices,
layer init, errors."""

import pytest
import torch
import torch.nn.functional as F

import teeny
import teeny.core.config
from teeny import Graph
from teeny.torch import apply, clear_cache


def _grad(fn, idx, weight, grad_out):
    w = weight.detach().clone().requires_grad_()
    out = apply(fn, idx, w)
    (g,) = torch.autograd.grad(out, (w,), grad_out)
    return out, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_backward_is_bit_reproducible_and_matches_torch(dtype, gen):
    idx = torch.randint(0, 5, (6, 7), generator=gen)  # many repeats per row
    weight = torch.randn(5, 9, generator=gen).to(dtype)
    grad_out = torch.randn(6, 7, 9, generator=gen).to(dtype)

    def fn(i, w):
        return teeny.ops.embedding(i, w, deterministic=True)

    _, g1 = _grad(fn, idx, weight, grad_out)
    _, g2 = _grad(fn, idx, weight, grad_out)
    assert torch.equal(
        g1.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        g2.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    # summed in fp32 in position order, rounded once: the same as torch on float64, rounded
    ref = torch.zeros(5, 9, dtype=torch.float64).index_add_(0, idx.reshape(-1), grad_out.double().reshape(-1, 9))
    if dtype == torch.float32:
        torch.testing.assert_close(g1.double(), ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(g1.double(), ref, atol=3e-2, rtol=2e-2)


def test_config_deterministic_is_read_at_trace_time(monkeypatch):
    g = Graph()
    idx, w = g.input("i", (3,), torch.int64), g.input("w", (4, 2))
    assert teeny.ops.embedding(idx, w).value.producer.op.deterministic is False
    monkeypatch.setattr(teeny.core.config, "deterministic", True)
    y = teeny.ops.embedding(idx, w)
    monkeypatch.setattr(teeny.core.config, "deterministic", False)
    assert y.value.producer.op.deterministic  # traced while the switch was on
    g.output(y)
    w.value.requires_grad = True
    program = teeny.lower(g, teeny.LoweringMode.TRAINING)
    assert "index_backward_sorted[float32]" in program.kernel_names()
    assert "index_backward[float32]" not in program.kernel_names()
    assert teeny.ops.embedding(idx, w, deterministic=True).value.producer.op.deterministic


@pytest.mark.parametrize("deterministic", [False, True])
def test_padding_row_forward_and_zero_gradient(deterministic, gen):
    idx = torch.tensor([[0, 2, 2], [1, 2, 3]])
    weight = torch.randn(4, 3, generator=gen)
    grad_out = torch.randn(2, 3, 3, generator=gen)
    out, g = _grad(
        lambda i, w: teeny.ops.embedding(i, w, padding_idx=-2, deterministic=deterministic), idx, weight, grad_out
    )
    torch.testing.assert_close(out, F.embedding(idx, weight))  # the padding row is still returned
    assert torch.equal(g[2], torch.zeros(3))
    w = weight.clone().requires_grad_()
    F.embedding(idx, w, padding_idx=2).backward(grad_out)
    torch.testing.assert_close(g, w.grad)


def test_unused_rows_get_zero_gradient(gen):
    idx = torch.tensor([4, 4, 0])
    weight = torch.randn(6, 2, generator=gen)
    for deterministic in (False, True):
        _, g = _grad(lambda i, w: teeny.ops.embedding(i, w, deterministic=deterministic), idx, weight, torch.ones(3, 2))
        assert torch.equal(g, torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0], [2, 2], [0, 0]]))


def test_int32_indices(gen):
    idx = torch.randint(0, 5, (4, 3), generator=gen, dtype=torch.int32)
    weight = torch.randn(5, 7, generator=gen)
    torch.testing.assert_close(apply(teeny.ops.embedding, idx, weight), F.embedding(idx, weight))


def test_embedding_layer_init_and_names():
    layer = teeny.nn.Embedding(10, 4, padding_idx=3)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    assert layer.weight.shape == (10, 4)
    values = layer.weight.init(layer.weight.shape, torch.Generator().manual_seed(0), torch.float32)
    assert torch.equal(values[3], torch.zeros(4))
    others = torch.cat([values[:3], values[4:]])
    assert 0.5 < others.std() < 1.5 and others.abs().max() > 1.0  # N(0, 1)
    assert teeny.nn.Embedding(5, 2, padding_idx=-1).padding_idx == 4


def test_embedding_errors():
    g = Graph()
    w = g.input("w", (4, 2))
    with pytest.raises(teeny.GraphError, match="int64 or int32"):
        teeny.ops.embedding(g.input("f", (3,)), w)
    with pytest.raises(ValueError, match="out of range"):
        teeny.ops.embedding(g.input("i", (3,), torch.int64), w, padding_idx=4)
    with pytest.raises(ValueError, match="2-D"):
        teeny.ops.embedding(g.input("j", (3,), torch.int64), g.input("v", (4,)))
    with pytest.raises(ValueError, match="out of range"):
        teeny.nn.Embedding(3, 2, padding_idx=-4)


@pytest.fixture
def checks(monkeypatch):
    """Set ``teeny.core.config.check_indices`` for one test (interop's cached programs, traced with
    the other setting, are dropped before and after)."""

    def set_checks(flag: bool) -> None:
        monkeypatch.setattr(teeny.core.config, "check_indices", flag)
        clear_cache()

    yield set_checks
    clear_cache()


@pytest.mark.parametrize("bad", [7, -1, 3])
def test_out_of_range_index_raises_when_checked(bad, checks):
    checks(True)
    with pytest.raises(
        teeny.TeenyError, match=rf"op embedding \(node .*\): index {bad} is out of range for 3 embeddings"
    ):
        apply(teeny.ops.embedding, torch.tensor([[1, 0], [bad, 2]]), torch.randn(3, 2))


def test_out_of_range_index_reads_zeros_when_unchecked(checks):
    """With the check off nothing is checked: an out-of-range index reads zeros, adds nothing."""
    checks(False)
    idx = torch.tensor([1, 7, -1])
    weight = torch.randn(3, 2)
    for deterministic in (False, True):
        out, g = _grad(
            lambda i, w: teeny.ops.embedding(i, w, deterministic=deterministic), idx, weight, torch.ones(3, 2)
        )
        assert torch.equal(out[0], weight[1]) and torch.equal(out[1:], torch.zeros(2, 2))
        assert torch.equal(g, torch.tensor([[0.0, 0.0], [1, 1], [0, 0]]))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, float("inf")])
def test_max_norm_renormalises_the_referenced_rows_in_place_like_torch(norm_type, gen):
    idx = torch.tensor([[0, 3, 3], [5, 0, 1]])  # rows 2 and 4 are not referenced
    weight = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 2
    weight[1] *= 0.01  # referenced but within max_norm: unchanged
    ours, theirs = weight.clone(), weight.clone()
    out = apply(lambda i, w: teeny.ops.embedding(i, w, max_norm=0.9, norm_type=norm_type), idx, ours)
    expected = F.embedding(idx, theirs, max_norm=0.9, norm_type=norm_type)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)  # the weight itself changed
    assert torch.equal(ours[[1, 2, 4]], weight[[1, 2, 4]])
    norms = torch.linalg.vector_norm(ours[[0, 3, 5]], ord=norm_type, dim=1)
    torch.testing.assert_close(norms, torch.full((3,), 0.9, dtype=torch.float64), atol=1e-6, rtol=0)


def test_max_norm_renormalises_the_layer_parameter_in_its_arena(gen):
    layer = teeny.nn.Embedding(5, 4, max_norm=1.0)
    g = Graph()
    idx = g.input("i", (3,), torch.int64)
    g.output(layer(idx).sum())
    ex = teeny.Executor(teeny.lower(g, teeny.LoweringMode.TRAINING))
    before = ex.params["weight"].cpu().clone()
    loss, cache = ex.forward_train({"i": torch.tensor([4, 0, 4])})
    ex.backward(cache)
    after = ex.params["weight"]
    expected = before.clone()
    F.embedding(torch.tensor([4, 0, 4]), expected, max_norm=1.0)
    torch.testing.assert_close(after.cpu(), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(after.cpu(), before)
    torch.testing.assert_close(loss.cpu(), expected[[4, 0, 4]].sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_scale_grad_by_freq_divides_by_the_count_in_the_batch(deterministic):
    idx = torch.tensor([[2, 2, 0], [2, 5, 0]])
    weight = torch.randn(6, 3)
    _, g = _grad(
        lambda i, w: teeny.ops.embedding(i, w, scale_grad_by_freq=True, deterministic=deterministic),
        idx,
        weight,
        torch.ones(2, 3, 3),
    )
    assert torch.equal(g, torch.tensor([[1.0] * 3, [0] * 3, [1] * 3, [0] * 3, [0] * 3, [1] * 3]))


def test_embedding_option_errors():
    g = Graph()
    i, w = g.input("i", (3,), torch.int64), g.input("w", (4, 2))
    with pytest.raises(ValueError, match="norm_type must be positive"):
        teeny.ops.embedding(i, w, max_norm=1.0, norm_type=0.0)
    with pytest.raises(ValueError, match="max_norm must be non-negative"):
        teeny.ops.embedding(i, w, max_norm=-1.0)
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        teeny.ops.embedding(i, w, sparse=True)
