"""``teeny.torch.nn``: every drop-in layer takes its ``torch.nn`` counterpart's constructor
arguments, has the same ``state_dict`` keys (a checkpoint loads either way, strictly) and
gives the same output and gradients; and the goal test of issue 12: a ``torch.nn`` MLP built
from ``teeny.torch.nn`` layers, compiled with ``fullgraph=True``, trains like the torch model
(every loss and parameter gradient, float32 tolerance and float64 tight)."""

import pickle
from copy import deepcopy

import pytest
import torch
from torch import nn

import teeny.torch.nn as tnn
from teeny.checks.registry import tolerance
from teeny.checks.samples import activation as activation_samples


def _randn(*shape, dtype=torch.float64, seed=0, low=None):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.abs() + low if low is not None else t


def _classes(n, c, seed=1):
    return torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))


# (teeny class, constructor arguments, inputs)
CASES = [
    (tnn.Linear, (5, 3), lambda: [_randn(4, 5)]),
    (tnn.Linear, (5, 3, False), lambda: [_randn(2, 4, 5)]),
    (tnn.LayerNorm, ((6,),), lambda: [_randn(3, 6)]),
    (tnn.LayerNorm, (6,), lambda: [_randn(2, 3, 6)]),
    (tnn.RMSNorm, (6,), lambda: [_randn(3, 6)]),
    (tnn.RMSNorm, ([2, 3],), lambda: [_randn(4, 2, 3)]),
    (tnn.GroupNorm, (2, 4), lambda: [_randn(3, 4, 5)]),
    (tnn.BatchNorm1d, (4,), lambda: [_randn(6, 4)]),
    (tnn.BatchNorm2d, (3,), lambda: [_randn(2, 3, 4, 4)]),
    (tnn.Embedding, (10, 4), lambda: [_classes(7, 10)]),
    (tnn.Embedding, (10, 4, 0), lambda: [_classes(7, 10)]),
    (tnn.Conv2d, (2, 3, 3), lambda: [_randn(2, 2, 6, 6)]),
    (tnn.Conv2d, (2, 4, 3, 2, 1, 1, 2), lambda: [_randn(1, 2, 7, 7)]),
    (tnn.PReLU, (), lambda: [_randn(3, 5)]),
    (tnn.Dropout, (0.0,), lambda: [_randn(3, 5)]),
    (tnn.MaxPool2d, (2,), lambda: [_randn(1, 2, 6, 6)]),
    (tnn.AvgPool2d, (3, 2, 1), lambda: [_randn(1, 2, 7, 7)]),
    (tnn.GLU, (-1,), lambda: [_randn(3, 6)]),
    (tnn.Softmax, (1,), lambda: [_randn(3, 5)]),
    (tnn.LogSoftmax, (-1,), lambda: [_randn(3, 5)]),
    (tnn.CrossEntropyLoss, (), lambda: [_randn(4, 5), _classes(4, 5)]),
    pytest.param(
        tnn.CrossEntropyLoss,
        (None, None, 1, None, "sum", 0.1),
        lambda: [_randn(4, 5), _classes(4, 5)],
    ),
    (tnn.NLLLoss, (), lambda: [torch.log_softmax(_randn(4, 5), 1), _classes(4, 5)]),
    (tnn.MSELoss, (), lambda: [_randn(4, 5), _randn(4, 5, seed=2)]),
    (tnn.L1Loss, (), lambda: [_randn(4, 5), _randn(4, 5, seed=2)]),
    (tnn.SmoothL1Loss, (), lambda: [_randn(4, 5), _randn(4, 5, seed=2)]),
    (tnn.HuberLoss, (), lambda: [_randn(4, 5), _randn(4, 5, seed=2)]),
    (tnn.BCELoss, (), lambda: [torch.sigmoid(_randn(4, 5)), torch.rand(4, 5, dtype=torch.float64)]),
    (tnn.BCEWithLogitsLoss, (), lambda: [_randn(4, 5), torch.rand(4, 5, dtype=torch.float64)]),
    (
        tnn.KLDivLoss,
        ("batchmean",),
        lambda: [torch.log_softmax(_randn(4, 5), 1), torch.softmax(_randn(4, 5, seed=3), 1)],
    ),
]


def _in_domain(declaration):
    """Inputs spread over the activation's sample domain (its kinks inside it)."""
    low, high = declaration.domain
    return lambda: [_randn(3, 5) * (high - low) / 4 + (high + low) / 2]


# the activations' drop-ins, from their declarations: each keyword set of their test cases
CASES += [
    pytest.param(
        getattr(tnn, d.layer),
        kwargs,
        _in_domain(d),
    )
    for d, kwargs in activation_samples.cases()
    if d.layer is not None
]


def _construct(cls, args):
    """``cls(*args)``, or ``cls(**args)`` for keyword arguments."""
    return cls(**args) if isinstance(args, dict) else cls(*args)


def _values(case):
    return case.values if hasattr(case, "values") else case


def _name(case):
    cls, args, _ = _values(case)
    return f"{cls.__name__}{args}"


def test_every_drop_in_has_a_case():
    assert {_values(case)[0] for case in CASES} == set(tnn.DROP_INS.values())


def test_generated_activations_are_module_level_and_pickle():
    """The drop-ins and functional entries generated from the activations' declarations are
    globals of their modules: they import by qualified name, pickle and deep-copy."""
    for name in tnn.ACTIVATION_LAYERS:
        cls = getattr(tnn, name)
        assert (cls.__module__, cls.__qualname__) == ("teeny.torch.nn", name)
        layer = cls(**next(kw for d, kw in activation_samples.cases() if d.layer == name))
        for copy in (pickle.loads(pickle.dumps(layer)), deepcopy(layer)):
            assert type(copy) is cls and repr(copy) == repr(layer)
    for route in tnn.functional.ROUTED.values():
        assert pickle.loads(pickle.dumps(route)) is route


@pytest.mark.parametrize("cls,args,inputs", CASES, ids=[_name(c) for c in CASES])
def test_drop_in_matches_torch_nn(cls, args, inputs):
    torch_cls = next(k for k, v in tnn.DROP_INS.items() if v is cls)
    torch.manual_seed(0)
    ref = _construct(torch_cls, args).double()
    torch.manual_seed(0)
    layer = _construct(cls, args).double()
    assert list(layer.state_dict()) == list(ref.state_dict())
    layer.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(layer.state_dict(), strict=True)
    xs = inputs()
    xs_ref = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
    xs_teeny = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
    out, expected = layer(*xs_teeny), ref(*xs_ref)
    atol, rtol = tolerance(torch.float64, 64)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    seed = _randn(*out.shape, seed=9)
    leaves = [x for x in xs_teeny if x.requires_grad] + list(layer.parameters())
    ref_leaves = [x for x in xs_ref if x.requires_grad] + list(ref.parameters())
    grads = torch.autograd.grad(out, leaves, seed, allow_unused=True)
    ref_grads = torch.autograd.grad(expected, ref_leaves, seed, allow_unused=True)
    if cls is tnn.Hardsigmoid:  # PyTorch's float64 CPU backward multiplies by 1/6 rounded to float32
        (x,), (g,), (r,) = xs, grads, ref_grads
        exact = torch.where((x > -3) & (x < 3), seed / 6, 0.0)  # hardsigmoid's derivative, float64 throughout
        torch.testing.assert_close(g, exact, atol=atol, rtol=rtol)
        torch.testing.assert_close(r, exact, atol=0, rtol=1e-7)  # PyTorch's: float32's rounding of 1/6
        if x.device.type == "cpu":
            assert not torch.allclose(r, exact, atol=atol, rtol=rtol), "PyTorch's CPU kernel is exact now"
        ref_grads = grads
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)
    for name, buffer in ref.named_buffers():  # batch norm's running statistics move the same way
        torch.testing.assert_close(dict(layer.named_buffers())[name], buffer, atol=atol, rtol=rtol)


def test_swiglu_mlp_uses_llama_names_and_computes_the_gated_mlp():
    mlp = tnn.SwiGLUMLP(6, 10).double()
    assert list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    x = _randn(3, 6)
    expected = mlp.down_proj.weight @ (
        torch.nn.functional.silu(mlp.gate_proj.weight @ x.T) * (mlp.up_proj.weight @ x.T)
    )
    torch.testing.assert_close(mlp(x), expected.T)


def test_scaled_dot_product_attention_layer():
    q, k, v = _randn(2, 2, 5, 4), _randn(2, 2, 5, 4, seed=1), _randn(2, 2, 5, 4, seed=2)
    out = tnn.ScaledDotProductAttention(is_causal=True)(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_over_packed_views_reads_them_in_place(causal):
    """q, k, v split by views out of one (batch, length, 3 * heads * dim) tensor (GPT-2's and
    nanoGPT's attention): one packed-layout call on that tensor, torch's output and gradient
    (float64, tight); q, k, v that are not such views go to the plain attention."""
    import teeny.torch.nn.functional as TF
    from teeny.torch import bridge

    b, length, heads, d = 2, 5, 3, 4
    qkv = _randn(b, length, 3 * heads * d).requires_grad_()
    ref = qkv.detach().clone().requires_grad_()

    def split(t):
        return [z.view(b, length, heads, d).transpose(1, 2) for z in t.split(heads * d, dim=2)]

    bridge.clear_cache()
    out = TF.scaled_dot_product_attention(*split(qkv), is_causal=causal, scale=0.3)
    expected = nn.functional.scaled_dot_product_attention(*split(ref), is_causal=causal, scale=0.3)
    assert out.shape == expected.shape and out.transpose(1, 2).is_contiguous()  # the merge of the heads is a view
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    grad = _randn(*out.shape, seed=3)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(qkv.grad, ref.grad, atol=1e-12, rtol=1e-12)
    assert {e.label for e in bridge._ENTRIES.values()} == {"teeny op packed_attention"}
    q, k, v = split(qkv.detach())
    TF.scaled_dot_product_attention(q, k.clone(), v)  # k copied out: not packed any more
    assert "teeny op scaled_dot_product_attention" in {e.label for e in bridge._ENTRIES.values()}


def test_an_option_without_a_kernel_is_refused_by_name():
    with pytest.raises(tnn.Unsupported, match="padding_mode='reflect'"):
        tnn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")(_randn(1, 2, 5, 5))
    with pytest.raises(tnn.Unsupported, match="max_norm"):
        tnn.Embedding(5, 3, max_norm=1.0)(_classes(3, 5))


# ------------------------------------------------------------------- the goal: a compiled MLP trains like torch


def _mlp(layers, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(
        layers.Linear(12, 16),
        layers.LayerNorm(16),
        layers.GELU(approximate="tanh"),
        layers.Dropout(0.0),
        layers.Linear(16, 16),
        layers.SiLU(),
        layers.RMSNorm(16, eps=1e-6),
        layers.Linear(16, 5),
    )
    return model.to(dtype)


@pytest.mark.parametrize(
    "dtype,backend", [(torch.float32, "inductor"), (torch.float64, "aot_eager")], ids=["float32", "float64"]
)
def test_compiled_mlp_of_drop_in_layers_trains_like_torch(dtype, backend):
    ref = _mlp(nn, dtype)
    model = _mlp(tnn, dtype)
    model.load_state_dict(ref.state_dict(), strict=True)
    loss_ref, loss_teeny = nn.CrossEntropyLoss(), tnn.CrossEntropyLoss()
    compiled = torch.compile(lambda x, y: loss_teeny(model(x), y), fullgraph=True, backend=backend)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    atol, rtol = tolerance(dtype, 16) if dtype == torch.float32 else (1e-12, 1e-12)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(8, 12, generator=gen).to(dtype)
        y = torch.randint(0, 5, (8,), generator=gen)
        for o in (opt, opt_ref):
            o.zero_grad()
        loss = compiled(x, y)
        loss.backward()
        expected = loss_ref(ref(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=atol, rtol=rtol, msg=lambda m: f"step {step} loss: {m}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}")
        opt.step()
        opt_ref.step()


def test_a_dropout_that_keeps_everything_is_the_input_itself():
    x = torch.randn(4, 5, requires_grad=True)
    assert tnn.functional.dropout(x, 0.0, True) is x  # as torch answers: no copy, no launch
    assert tnn.functional.dropout(x, 0.5, False) is x
    assert tnn.Dropout(0.0)(x) is x
    with pytest.raises(ValueError, match="between 0 and 1"):
        tnn.functional.dropout(x, 1.5, False)


def test_a_norm_writing_the_autocast_dtype_compiles_without_asking_whether_autocast_is_available(monkeypatch):
    """Whether autocast is on is read while compiling without ``torch.amp.is_autocast_available``:
    torch 2.11's dynamo cannot trace that call and broke the graph at every patched norm (the
    patched GPT-2's compiled step ran 2.6x slower on the GPU). Here the call raises while compiling."""
    available = torch.amp.is_autocast_available

    def refuse_while_compiling(device_type):
        if torch.compiler.is_compiling():
            raise RuntimeError("is_autocast_available called while compiling")
        return available(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse_while_compiling)
    norm = tnn.LayerNorm(8)
    norm.autocast_output = True
    x = torch.randn(3, 8)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = compiled(x)
        expected = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected)
    torch._dynamo.reset()
