"""``teeny.torch.apply`` and the bridge under PyTorch's autograd rules (issue 11, items 4-7):
in-place changes between forward and backward, repeated backward, ``torch.autograd.gradcheck``,
double backward, several outputs, and a cache that an inline lambda does not grow. The
Executor's own in-place check is here too."""

import pytest
import torch

import teeny
from teeny import Graph, LoweringMode, TeenyError, lower, ops
from teeny.torch import apply, bridge


def _x(*shape, grad=True, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


# ------------------------------------------------------------------- in-place changes (item 4)


def test_executor_refuses_a_backward_after_an_input_changed_in_place():
    g = Graph()
    x = g.input("x", (3,), requires_grad=True)
    g.output(ops.sum(ops.exp(x)))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    xs = torch.zeros(3, device=teeny.DEVICE)  # on the GPU a CPU tensor would be copied, and its change harmless
    _, cache = ex.forward_train({"x": xs})
    xs.fill_(5.0)  # exp'(0) = 1; the kernels would now read exp(5) = 148.4
    with pytest.raises(TeenyError, match="input 'x' was modified in place"):
        ex.backward(cache)
    _, cache = ex.forward_train({"x": xs})  # a fresh forward is fine
    torch.testing.assert_close(ex.backward(cache)["x"].cpu(), torch.full((3,), 5.0).exp())


def test_executor_names_the_input_behind_a_saved_view():
    g = Graph()
    x = g.input("x", (2, 3), requires_grad=True)
    g.output(ops.sum(ops.exp(ops.reshape(x, (6,)))))  # exp saves the reshape's view of x
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    xs = torch.zeros(2, 3, device=teeny.DEVICE)
    _, cache = ex.forward_train({"x": xs})
    xs[1].add_(1.0)
    with pytest.raises(TeenyError, match="input 'x'"):
        ex.backward(cache)


def test_executor_refuses_a_backward_after_a_parameter_changed_in_place():
    g = Graph()
    x = g.input("x", (4,))
    w = g.parameter("w", (4,), init=teeny.core.init.constant(0.5))
    g.output(ops.sum(x * w))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    _, cache = ex.forward_train({"x": torch.ones(4)})
    ex.params["w"].mul_(2.0)
    with pytest.raises(TeenyError, match="parameter 'w'"):
        ex.backward(cache)


def test_apply_refuses_a_backward_after_an_input_changed_in_place():
    x = torch.zeros(3, requires_grad=True)
    b = x * 1.0
    y = apply(ops.exp, b)
    with torch.no_grad():
        b.fill_(5.0)
    with pytest.raises(RuntimeError, match=r"apply\(exp\): input 'argument 0' was modified in place"):
        y.sum().backward()


def test_apply_refuses_a_backward_after_its_output_changed_in_place():
    x = torch.zeros(2, 3, requires_grad=True)
    y = apply(ops.softmax, x, 1)  # softmax's backward reads its output
    with torch.no_grad():
        y.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_a_kept_view_of_a_tensor_the_backward_has_anyway_is_made_again_not_returned_twice():
    """linear keeps its input, here a reshape of what softmax keeps (its output) or of the
    function's own input: the backward makes the view again from that tensor instead of the
    forward returning it as one more tensor, which would be a copy (an operator's outputs may
    not alias each other or its inputs)."""
    x, w = _x(3, 4, 6), _x(5, 24, seed=1)
    cases = {
        "of softmax's output": (lambda a, b: ops.linear(ops.reshape(ops.softmax(a, -1), (3, 24)), b), 1),
        "of the input": (lambda a, b: ops.linear(ops.reshape(a, (3, 24)), b), 0),
    }
    references = {
        "of softmax's output": lambda a, b: torch.nn.functional.linear(torch.softmax(a, -1).reshape(3, 24), b),
        "of the input": lambda a, b: torch.nn.functional.linear(a.reshape(3, 24), b),
    }
    for name, (fn, n_extras) in cases.items():
        x.grad = w.grad = None
        apply(fn, x, w).square().sum().backward()
        entry = next(reversed(bridge._ENTRIES.values()))
        assert len(entry.extras) == n_extras and len(entry.views) == 1, name
        expected = torch.autograd.grad(references[name](x, w).square().sum(), (x, w))
        torch.testing.assert_close((x.grad, w.grad), expected)
    y = apply(cases["of the input"][0], x, w)  # the view is made from the input itself: a change to it is seen
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


# ------------------------------------------------------------------- repeated and double backward (item 5)


def test_backward_twice_with_retain_graph():
    x = _x(4, 5)
    y = apply(ops.gelu, x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)
    torch.testing.assert_close(first, torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)[0])


def test_gradcheck_over_apply():
    x, w = _x(3, 4), _x(2, 4, seed=1)
    assert torch.autograd.gradcheck(lambda a, b: apply(ops.linear, a, b), (x, w))


def test_create_graph_raises_an_error_naming_the_function():
    x = _x(4)
    y = apply(ops.tanh, x).sum()
    with pytest.raises(RuntimeError, match=r"apply\(tanh\): double backward .* not supported"):
        torch.autograd.grad(y, x, create_graph=True)


def test_gradient_without_create_graph_still_works_after_the_refusal():
    x = _x(4)
    (g,) = torch.autograd.grad(apply(ops.tanh, x).sum(), x)
    torch.testing.assert_close(g, 1 - x.detach().tanh() ** 2)


# ------------------------------------------------------------------- several outputs (item 6)


def test_apply_of_a_function_returning_several_tensors():
    x = _x(3, 7)
    a, b, c = apply(lambda t: ops.split(t, [2, 4, 1], 1), x)
    assert [a.shape, b.shape, c.shape] == [(3, 2), (3, 4), (3, 1)]
    (a.sum() * 2 + (b * b).sum() + c.exp().sum()).backward()
    expected = torch.cat(
        [torch.full((3, 2), 2.0, dtype=torch.float64), 2 * x.detach()[:, 2:6], x.detach()[:, 6:].exp()], 1
    )
    torch.testing.assert_close(x.grad, expected)


def test_apply_returning_a_tuple_of_different_ops_and_an_unused_output():
    x = _x(5)
    s, e = apply(lambda t: (ops.sin(t), ops.exp(t)), x)
    assert isinstance(s, torch.Tensor) and s.shape == (5,)
    e.sum().backward()  # the gradient of the unused output is zero
    torch.testing.assert_close(x.grad, x.detach().exp())
    assert torch.autograd.gradcheck(lambda t: apply(lambda u: (ops.sin(u), ops.exp(u) * u), t), (_x(4),))


def _residual_norm(x, residual, weight):
    """A residual stream's junction: the sum (read downstream) and its norm in another dtype."""
    s = ops.add(ops.to(x, residual.dtype), residual)
    return s, ops.layer_norm(s, (s.shape[-1],), weight, None, out_dtype=torch.bfloat16)


def test_outputs_of_several_dtypes_take_a_gradient_each_and_no_concatenating_copy():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 37, generator=gen).to(torch.bfloat16).requires_grad_()
    residual = torch.randn(5, 37, generator=gen, requires_grad=True)
    weight = torch.randn(37, generator=gen, requires_grad=True)
    s, y = apply(_residual_norm, x, residual, weight)
    assert (s.dtype, y.dtype) == (torch.float32, torch.bfloat16)
    ds, dy = torch.randn(5, 37, generator=gen), torch.randn(5, 37, generator=gen).to(torch.bfloat16)
    torch.autograd.backward([s, y], [ds, dy])
    xr, rr, wr = (t.detach().clone().requires_grad_() for t in (x, residual, weight))
    sr = xr.float() + rr
    yr = torch.nn.functional.layer_norm(sr, (37,), wr).to(torch.bfloat16)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    torch.testing.assert_close(y, yr)
    torch.autograd.backward([sr, yr], [ds, dy])
    for got, want in [(x.grad, xr.grad), (residual.grad, rr.grad), (weight.grad, wr.grad)]:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # only one of the two reaches the loss: the other's gradient is None, not a zero seed
    for pick in (0, 1):
        xs = [t.detach().clone().requires_grad_() for t in (x, residual, weight)]
        out = apply(_residual_norm, *xs)[pick]
        (out.float() * 3).sum().backward()
        refs = [t.detach().clone().requires_grad_() for t in (x, residual, weight)]
        sr = refs[0].float() + refs[1]
        ref = (sr, torch.nn.functional.layer_norm(sr, (37,), refs[2]).to(torch.bfloat16))[pick]
        (ref.float() * 3).sum().backward()
        for got, want in zip(xs, refs):  # (torch leaves the weight's None where the norm is unused)
            expected = torch.zeros_like(want) if want.grad is None else want.grad
            torch.testing.assert_close(got.grad, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("inside", ["layer_norm", "exp"])
def test_an_expanded_seed_of_an_output_also_read_inside_is_added_as_it_is(inside):
    """``s.sum()`` seeds s with an expanded gradient (stride 0, one element of storage); s is
    also read inside the function, and the gradient from there joins that seed: elementwise, not
    as if the seed were contiguous (which read past its one element)."""

    def fn(x, r):
        s = ops.add(x, r)
        return s, (ops.layer_norm(s, (7,)) if inside == "layer_norm" else ops.exp(s))

    x, r = _x(3, 7, seed=4), _x(3, 7, seed=5)
    s, y = apply(fn, x, r)
    (s.sum() + (y * torch.arange(7.0, dtype=y.dtype)).sum()).backward()
    xr, rr = (t.detach().clone().requires_grad_() for t in (x, r))
    sr = xr + rr
    yr = torch.nn.functional.layer_norm(sr, (7,)) if inside == "layer_norm" else sr.exp()
    (sr.sum() + (yr * torch.arange(7.0, dtype=yr.dtype)).sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(r.grad, rr.grad)


def test_several_seeded_outputs_in_float64_pass_gradcheck_and_an_output_used_twice_adds():
    def fn(a, b):
        s = ops.mul(a, b)
        return s, ops.tanh(s), s  # s returned twice: both gradients reach a and b

    a, b = _x(3, 4, seed=1), _x(3, 4, seed=2)
    assert torch.autograd.gradcheck(lambda p, q: apply(fn, p, q), (a, b))
    s1, t, s2 = apply(fn, a, b)
    (s1.sum() + 2 * s2.sum()).backward()
    torch.testing.assert_close(a.grad, 3 * b.detach())


def test_executor_backward_from_several_seeded_outputs():
    g = Graph("two")
    x = g.input("x", (4,), torch.float64, requires_grad=True)
    w = g.parameter("w", (4,), dtype=torch.float64)
    g.output(ops.mul(x, w), ops.exp(x))
    program = lower(g, LoweringMode.TRAINING, seeded=2)
    ex = teeny.Executor(program)
    ex.params["w"].copy_(torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64))
    feed = {"x": torch.arange(4.0, dtype=torch.float64)}
    _, cache = ex.forward_train(feed)
    with pytest.raises(ValueError, match="starts its backward from 2 outputs"):
        ex.backward(cache, torch.ones(4, dtype=torch.float64))
    ones = torch.ones(4, dtype=torch.float64)
    grads = ex.backward(cache, [ones, None])  # only the product's gradient flows back
    torch.testing.assert_close(grads["x"], ex.params["w"])
    _, cache = ex.forward_train(feed)
    grads = ex.backward(cache, [ones, ones])
    torch.testing.assert_close(grads["x"], ex.params["w"] + feed["x"].exp().to(teeny.DEVICE))
    assert ones.eq(1).all()  # the seeds are the caller's: never written over
    with pytest.raises(ValueError, match="seeded=3"):
        lower(g, LoweringMode.TRAINING, seeded=3)


# ------------------------------------------------------------------- the cache (item 7)


def test_inline_lambda_is_traced_once():
    x = _x(3, 4)
    bridge.clear_cache()  # a cache filled by earlier tests would evict one entry for the new one
    before = bridge.cache_size()
    for _ in range(5):  # a new function object each time, computing the same thing
        y = apply(lambda t: ops.exp(t) * 2.0, x)
    assert bridge.cache_size() == before + 1
    torch.testing.assert_close(y, x.detach().exp() * 2)


def test_lambdas_differing_in_a_closed_over_value_are_not_confused():
    x = _x(3)
    results = []
    for scale in (2.0, 3.0):
        results.append(apply(lambda t: ops.mul(t, scale), x))
    torch.testing.assert_close(results[0], 2 * x.detach())
    torch.testing.assert_close(results[1], 3 * x.detach())


def test_a_method_reading_an_attribute_is_traced_again_when_it_changes():
    """An object is keyed by identity and by the plain values it holds: ``self.training``
    read by a method after ``eval()``, ``self.scale`` after it changed."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 2.0
            self.inner = torch.nn.Linear(3, 3)  # held by reference: not part of the key

        def step(self, t):
            return ops.mul(t, self.scale) if self.training else ops.exp(t)

    block, x = Block(), _x(3, grad=False)
    for _ in range(2):
        block.train()
        torch.testing.assert_close(apply(block.step, x), 2 * x)
        block.eval()
        torch.testing.assert_close(apply(block.step, x), x.exp())
    block.train()
    block.scale = 5.0
    torch.testing.assert_close(apply(block.step, x), 5 * x)
    block.inner.weight.data.add_(1.0)  # no retrace for what the key does not read
    before = bridge.cache_size()
    apply(block.step, x)
    assert bridge.cache_size() == before


def test_a_dict_a_lambda_closes_over_is_keyed_by_its_contents():
    x = _x(3, grad=False)
    settings = {"scale": 2.0, "activation": "exp"}

    def fn(t):
        y = ops.mul(t, settings["scale"])
        return ops.exp(y) if settings["activation"] == "exp" else ops.sin(y)

    torch.testing.assert_close(apply(fn, x), (2 * x).exp())
    settings["scale"] = 3.0
    torch.testing.assert_close(apply(fn, x), (3 * x).exp())
    settings["activation"] = "sin"
    torch.testing.assert_close(apply(fn, x), (3 * x).sin())
    torch.testing.assert_close(apply(lambda t: ops.mul(t, settings["scale"]), x), 3 * x)


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(bridge, "CACHE_SIZE", 3)
    x = _x(2)
    for n in range(6):  # six different functions
        apply(lambda t, n=n: ops.mul(t, float(n)), x)
    assert bridge.cache_size() <= 3


def test_an_entry_evicted_before_its_backward_still_backpropagates(monkeypatch):
    monkeypatch.setattr(bridge, "CACHE_SIZE", 1)
    x = _x(3)
    y = apply(ops.sin, x)
    apply(ops.cos, x)  # evicts sin's entry
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())


def test_mixed_requires_grad_and_non_contiguous_inputs():
    x = _x(4, 6).detach()[:, ::2].requires_grad_()  # non-contiguous
    w = _x(2, 3, seed=1).detach()  # frozen
    y = apply(ops.linear, x, w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 2, dtype=torch.float64) @ w)
    assert w.grad is None


def test_inference_under_no_grad_keeps_nothing_for_a_backward():
    x = _x(3)
    with torch.no_grad():
        y = apply(ops.exp, x)
    assert not y.requires_grad
    torch.testing.assert_close(y, x.detach().exp())


def test_a_training_lowering_that_fails_is_a_loud_error_not_an_inference_program(monkeypatch):
    """Only "no gradient reaches the output" makes the bridge lower for inference; any other
    failure of the training lowering (a backward launch that cannot be packed) is raised, not
    turned into an output without a gradient (which surfaced as "element 0 of tensors does not
    require grad" at the user's backward)."""
    real = bridge.lower

    def failing(graph, mode, *args, **kwargs):
        if mode is LoweringMode.TRAINING:
            raise TeenyError("op linear (node 'linear_0', backward) failed while packing its launch")
        return real(graph, mode, *args, **kwargs)

    monkeypatch.setattr(bridge, "lower", failing)
    bridge.clear_cache()
    with pytest.raises(TeenyError, match="failed while packing"):
        apply(ops.tanh, _x(3))
    with torch.no_grad():  # nothing to differentiate: the inference lowering, as before
        torch.testing.assert_close(apply(ops.tanh, _x(3)), _x(3).detach().tanh())
    bridge.clear_cache()
