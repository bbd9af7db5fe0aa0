"""Shape ops beyond the generic harness: views that do not copy, integer and bool tensors (and
the dtypes the registry derives for them), Tensor methods, stop_gradient, the split path of
expand's backward, advanced indexing (PyTorch's placement rules, repeated indices, the
deterministic path, checked and unchecked out-of-range indices), cat's type promotion,
layers, and error messages."""

import pytest
import torch

import teeny
import teeny.core.config
import teeny.ops as O
from helpers import run_teeny
from teeny.checks.facts import op_facts
from teeny.torch import apply, clear_cache

_VIEWS = {
    "reshape": (lambda x: O.reshape(x, (7, -1)), lambda x: x.reshape(7, -1)),
    "flatten": (lambda x: O.flatten(x), lambda x: x.flatten()),
    "squeeze": (lambda x: O.squeeze(x, 1), lambda x: x.squeeze(1)),
    "unsqueeze": (lambda x: O.unsqueeze(x, 0), lambda x: x.unsqueeze(0)),
    "stop_gradient": (lambda x: O.stop_gradient(x), lambda x: x.detach()),
    "rows": (lambda x: x[1:2], lambda x: x[1:2]),
    "transpose-size1": (lambda x: O.transpose(x, 0, 1), lambda x: x.transpose(0, 1)),
    "expand-noop": (lambda x: O.expand(x, 2, 1, 7), lambda x: x.expand(2, 1, 7)),
    "drop-size1": (lambda x: x[:, 0], lambda x: x[:, 0]),
    "concat-one": (lambda x: O.concat([x], 1), lambda x: torch.cat([x], 1)),
}


@pytest.mark.parametrize("name", list(_VIEWS))
def test_views_do_not_copy(name):
    fn, ref = _VIEWS[name]
    x = torch.randn(2, 1, 7).to(teeny.DEVICE)
    out, _, _ = run_teeny(fn, x)
    assert x.data_ptr() <= out.data_ptr() < x.data_ptr() + x.numel() * x.element_size()
    assert torch.equal(out, ref(x))


def test_view_backward_is_a_view_and_gradients_match():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = apply(lambda t: O.unsqueeze(O.flatten(O.reshape(t, (5, 3))), 0), x)
    g = torch.randn(1, 15, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(dx, g.view(3, 5))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_and_bool_tensors(dtype):
    x = torch.arange(2 * 3 * 5).reshape(2, 3, 5).to(dtype)
    y = torch.arange(2 * 3 * 2).reshape(2, 3, 2).to(dtype)
    cases = [
        (lambda a, b: O.transpose(a, 0, 2), lambda a, b: a.transpose(0, 2)),
        (lambda a, b: a[1, ::2, -3:], lambda a, b: a[1, ::2, -3:]),
        (lambda a, b: O.concat([a, b], -1), lambda a, b: torch.cat([a, b], -1)),
        (lambda a, b: O.expand(a[:, :1], 4, 2, 3, 5), lambda a, b: a[:, :1].expand(4, 2, 3, 5)),
        (lambda a, b: a.reshape(5, 6), lambda a, b: a.reshape(5, 6)),
    ]
    for fn, ref in cases:
        out, _, _ = run_teeny(fn, x, y)
        assert out.dtype == dtype
        assert torch.equal(out.cpu(), ref(x, y))


def test_tensor_methods():
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)

    def fn(t):
        a = t.reshape(12, 5).T  # (5, 12)
        b = t.view(4, 15)[1:3, ::4].transpose(0, 1)  # (4, 2)
        c = t.permute(2, 0, 1)[..., 0]  # (5, 4)
        return O.concat([a[:, 0:4], O.expand(b.T.reshape(4, 2)[:, :1].T, 5, 4), c], 1)

    def ref(t):
        a = t.reshape(12, 5).T
        b = t.view(4, 15)[1:3, ::4].transpose(0, 1)
        c = t.permute(2, 0, 1)[..., 0]
        return torch.cat([a[:, 0:4], b.T.reshape(4, 2)[:, :1].T.expand(5, 4), c], 1)

    out, expected = apply(fn, x), ref(x)
    torch.testing.assert_close(out, expected)
    g = torch.randn(expected.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(expected, x, g)[0])


def test_split_returns_parts_like_torch():
    x = torch.randn(3, 11)
    g = teeny.Graph()
    t = g.input("x", (3, 11))
    parts = O.split(t, 4, dim=1)
    assert [p.shape for p in parts] == [tuple(p.shape) for p in torch.split(x, 4, dim=1)]
    assert [p.shape for p in O.split(t, [1, 2], 0)] == [(1, 11), (2, 11)]
    assert [p.shape for p in O.chunk(t, 2, 1)] == [(3, 6), (3, 5)]
    assert [p.shape for p in O.split(g.input("e", (0, 2)), 0)] == [(0, 2)]


def test_stop_gradient_blocks_the_gradient():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y = apply(lambda t: O.concat([t, O.detach(t)], 1), x)
    (dx,) = torch.autograd.grad(y, x, torch.ones(2, 6, dtype=torch.float64))
    assert torch.equal(dx, torch.ones(2, 3, dtype=torch.float64))
    g = teeny.Graph()
    t = g.input("x", (2, 3), requires_grad=True)
    g.output(O.stop_gradient(t))
    with pytest.raises(teeny.TeenyError, match="depends on no trainable parameter"):
        teeny.lower(g, teeny.LoweringMode.TRAINING)


@pytest.mark.parametrize("in_shape,out_shape", [((1,), (5000,)), ((3, 1, 2), (150, 3, 5, 2))])
def test_expand_backward_split_over_programs(in_shape, out_shape):
    x = torch.randn(*in_shape, requires_grad=True)
    y = apply(lambda t: O.expand(t, *out_shape), x)
    g = torch.randn(out_shape)
    (dx,) = torch.autograd.grad(y, x, g)
    (ref,) = torch.autograd.grad(x.expand(out_shape), x, g)
    torch.testing.assert_close(dx, ref, atol=1e-4, rtol=1e-4)


def test_gradients_of_empty_selections_are_zero():
    x = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    for fn in (lambda t: O.expand(t, 0, 5), lambda t: t[:, 7:]):
        g = teeny.Graph()
        t = g.input("x", (1, 5), torch.float64, requires_grad=True)
        g.output(fn(t))
        ex = teeny.Executor(teeny.lower(g, teeny.LoweringMode.TRAINING))
        out, cache = ex.forward_train({"x": x.detach()})
        grads = ex.backward(cache, torch.empty(out.shape, dtype=torch.float64))
        assert torch.equal(grads["x"].cpu(), torch.zeros(1, 5, dtype=torch.float64))


def test_layers_match_torch():
    x = torch.randn(2, 3, 4, 5)
    out = apply(lambda t: teeny.nn.Flatten()(t), x)
    assert torch.equal(out, torch.nn.Flatten()(x))
    out = apply(lambda t: teeny.nn.Unflatten(1, (2, 6))(teeny.nn.Flatten(1, 2)(t)), x)
    assert torch.equal(out, torch.nn.Unflatten(1, (2, 6))(torch.nn.Flatten(1, 2)(x)))
    assert "Flatten" in teeny.nn.__all__ and "Unflatten" in teeny.nn.__all__


def _graph_x(shape=(3, 4)):
    return teeny.Graph().input("x", shape)


@pytest.mark.parametrize(
    "fn,message",
    [
        (
            lambda x: O.reshape(x, (5, -1)),
            r"shape \[5, -1\] is invalid for input of size 12.*\(3, 4\)|\(3, 4\).*size 12",
        ),
        (lambda x: O.reshape(x, (5, 2)), r"shape \[5, 2\] is invalid for input of size 12"),
        (lambda x: O.reshape(x, (-1, -1)), "only one dimension can be inferred"),
        (lambda x: O.transpose(x, 0, 2), r"dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"),
        (lambda x: O.permute(x, (0, 0)), "repeated dim"),
        (lambda x: O.permute(x, (1, 0, 2)), "number of dims don't match"),
        (lambda x: O.flatten(x, 1, 0), "start_dim cannot come after end_dim"),
        (lambda x: O.unsqueeze(x, 3), "dimension out of range"),
        (lambda x: x[3], "index 3 is out of bounds for dimension 0 with size 3"),
        (lambda x: x[:, -5], "index -5 is out of bounds for dimension 1 with size 4"),
        (lambda x: x[::-1], "step must be positive"),
        (lambda x: x[::0], "step must be positive"),
        (lambda x: O.slice(x, 1, 0, 3, 0), "step must be positive"),
        (lambda x: x[0, 0, 0], "too many indices for tensor of dimension 2"),
        (lambda x: x[..., ...], "single ellipsis"),
        (lambda x: x[x], "index tensor 'x' is a torch.float32: index tensors must be int64 or int32"),
        (lambda x: x[x.graph.input("m", (3,), torch.bool)], "boolean mask"),
        (lambda x: x[[0, 3]], "index 3 is out of bounds for dimension 0 with size 3"),
        (lambda x: x[:, [-5]], "index -5 is out of bounds for dimension 1 with size 4"),
        (lambda x: x[[0, 1], [0, 1, 2]], r"could not be broadcast together with shapes \[2\], \[3\]"),
        (lambda x: x[[0.5]], "must be a list of ints"),
        (lambda x: x[[True]], "must be a list of ints"),
        (lambda x: x[True], "not supported"),
        (lambda x: O.split(x, [1, 1]), r"sum exactly to 3 .*split_sizes=\[1, 1\]"),
        (lambda x: O.split(x, 0), "split_size can only be 0"),
        (lambda x: O.expand(x, 3, 5), r"expanded size of the tensor \(5\) must match the existing size \(4\)"),
        (lambda x: O.expand(x, 4), "number of sizes provided"),
        (lambda x: O.expand(x, -1, 3, 4), "leading, non-existing dimension"),
        (lambda x: O.concat([x, x.graph.input("y", (2, 5))], 0), "sizes of tensors must match except in dimension 0"),
        (lambda x: O.concat([x, x.graph.input("y", (3,))], 0), "same number of dimensions"),
        (lambda x: O.concat([]), "non-empty"),
        (lambda x: O.stack([x, x.graph.input("y", (3, 5))]), "equal size"),
        (lambda x: O.narrow(x, 1, 2, 3), "exceeds dimension size"),
        (lambda x: O.chunk(x, 0), "greater than 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(fn, message):
    with pytest.raises((ValueError, TypeError, IndexError), match=message):
        fn(_graph_x())


def test_rank_above_six_after_merging_is_refused_clearly():
    g = teeny.Graph()
    x = g.input("x", (2,) * 7)
    g.output(O.permute(x, (6, 5, 4, 3, 2, 1, 0)))
    with pytest.raises(teeny.TeenyError, match="at most 6"):
        teeny.lower(g)


def test_shape_op_facts_include_integer_and_bool_dtypes():
    for name in ("transpose", "getitem", "concat", "reshape"):
        dtypes = op_facts(name).dtypes
        assert torch.int64 in dtypes and torch.bool in dtypes and torch.float32 in dtypes, name


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_advanced_indexing_and_promoting_concat_on_integer_and_bool_tensors(dtype):
    x = (torch.arange(4 * 5 * 3).reshape(4, 5, 3) % 3).to(dtype)
    i = torch.tensor([[3, -1], [0, 0]])
    out, _, _ = run_teeny(lambda a, b: a[b, :, [2, 0]], x, i)
    assert out.dtype == dtype and torch.equal(out.cpu(), x[i, :, [2, 0]])
    y = torch.tensor([[7, 1, 2]], dtype=torch.int32)
    out, _, _ = run_teeny(lambda a, b: O.concat([a[0], b]), x, y)
    assert out.dtype == torch.promote_types(dtype, torch.int32)
    assert torch.equal(out.cpu(), torch.cat([x[0], y]))


def _index_cases():
    gen = torch.Generator().manual_seed(3)

    def i(size, *shape):
        return torch.randint(-size, size, shape, generator=gen)

    s = slice
    return [
        (0, s(None), [1, 2]),  # the int selects first: [1, 2] is alone, so B stays in place
        (s(None), 0, [1, 2]),
        ([0, 1], s(None), [1, 2]),  # apart: B first
        (s(None), [0, 1], [1, 2]),  # adjacent: B in place
        (None, [0, 1], Ellipsis, [2, 3]),  # None counts as a dim
        (s(1, 3), [0, 1], 2),
        ([[0], [1]], s(None), i(7, 3)),  # broadcast (2, 1) with (3,)
        (i(5), s(None), [1, 2]),  # a 0-d index drops its dim like an int
        ([0, 1], i(6), [1, 2]),  # ... and does not separate its neighbours
        (s(None, None, 2), None, i(6, 2, 2), s(1, 6, 3)),
        (i(5, 4, 1), i(6, 3), i(7, 1, 1)),
        (s(None), []),
        (torch.tensor([1, -1]),),  # a torch tensor while tracing: a constant
        (i(5, 3).to(torch.int32), s(2, 4)),
    ]


@pytest.mark.parametrize("deterministic", [False, True])
def test_advanced_indexing_follows_pytorch(deterministic, monkeypatch):
    monkeypatch.setattr(teeny.core.config, "deterministic", deterministic)
    x = torch.randn(5, 6, 7, dtype=torch.float64, requires_grad=True)
    gen = torch.Generator().manual_seed(4)
    for index in _index_cases():
        expected = x[index]
        out = apply(lambda t, i: O.getitem(t, i), x, index)
        assert out.shape == expected.shape, index
        assert torch.equal(out, expected), index
        g = torch.randn(expected.shape, dtype=torch.float64, generator=gen)
        (dx,) = torch.autograd.grad(out, x, g)
        torch.testing.assert_close(dx, torch.autograd.grad(expected, x, g)[0], atol=1e-13, rtol=1e-13)
    clear_cache()


def test_advanced_indexing_deterministic_backward_is_bit_reproducible(monkeypatch):
    monkeypatch.setattr(teeny.core.config, "deterministic", True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, requires_grad=True)
    index = (torch.randint(0, 3, (200,), generator=gen), slice(None))  # every row named ~67 times
    g = torch.randn(200, 7, generator=gen)
    grads = [torch.autograd.grad(apply(lambda t, i: O.getitem(t, i), x, index), x, g)[0] for _ in range(2)]
    clear_cache()
    assert torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))
    expected = torch.zeros(3, 7, dtype=torch.float64).index_add_(0, index[0], g.double())
    torch.testing.assert_close(grads[0].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checked", [True, False])
def test_out_of_range_index_tensor(checked, monkeypatch):
    monkeypatch.setattr(teeny.core.config, "check_indices", checked)
    clear_cache()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 6], [-7, 5]])
    try:
        if checked:
            with pytest.raises(teeny.TeenyError, match=r"op getitem .*index (6|-7) is out of bounds for dimension 1"):
                apply(lambda t, i: t[1:3, i], x, index)
            return
        # unchecked: an out-of-range index reads 0 and gets no gradient
        out = apply(lambda t, i: t[1:3, i], x, index)
        expected = x[1:3, index.clamp(0, 5)].detach() * torch.tensor([[1.0, 0], [0, 1]], dtype=torch.float64)
        assert torch.equal(out.detach(), expected)
        (dx,) = torch.autograd.grad(out, x, torch.ones(out.shape, dtype=torch.float64))
        assert dx.sum().item() == 4 and dx[1:3, [0, 5]].sum().item() == 4
    finally:
        clear_cache()


def test_concat_promotes_dtypes_like_torch():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    c = torch.arange(3).reshape(1, 3)
    out = apply(lambda p, q, r: O.concat([p, q, r]), a, b, c)
    expected = torch.cat([a, b, c])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    g = torch.randn(4, 3, dtype=torch.float64)
    da, db = torch.autograd.grad(out, (a, b), g)
    assert da.dtype == torch.float32 and torch.equal(da, g[:2].float())
    assert torch.equal(db, g[2:3])
    out = apply(lambda p, q: O.stack([p, q]), torch.tensor([True, False]), torch.tensor([2, 3], dtype=torch.uint8))
    assert out.dtype == torch.uint8 and torch.equal(out, torch.tensor([[1, 0], [2, 3]], dtype=torch.uint8))
