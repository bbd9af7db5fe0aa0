"""scaled_dot_product_attention and CausalSelfAttention: what the generic harness does not see
(several key/query blocks, fully masked rows, partial gradients, what is saved, errors)."""

import math

import pytest
import torch
import torch.nn.functional as F

import teeny
from teeny import ops
from teeny.graph import Graph, GraphError
from teeny.interop.torch import apply
from teeny.lowering import LoweringMode, lower
from teeny.registry import tolerance

DEV = teeny.DEVICE


def _qkv(gen, dtype, q_shape, k_shape, v_shape=None):
    shapes = (q_shape, k_shape, v_shape or k_shape)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV, dtype).requires_grad_() for s in shapes]


def _ref(t, keep_grad=True):
    """A float64 CPU copy for PyTorch's reference."""
    out = t.detach().cpu()
    out = out.double() if out.is_floating_point() else out
    return out.requires_grad_(t.requires_grad) if keep_grad else out


def _compare(gen, dtype, tensors, reduction, **kwargs):
    """teeny vs torch (float64 reference) on the output and the q/k/v gradients."""
    kwargs = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    out = apply(ops.scaled_dot_product_attention, *tensors, **kwargs)
    ref_in = [_ref(t) for t in tensors]
    ref_kwargs = {k: (_ref(v, False) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ref = F.scaled_dot_product_attention(*ref_in, **ref_kwargs)
    atol, rtol = tolerance(dtype, reduction)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, tensors, grad_out.to(DEV, dtype))
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.cpu().double(), r, atol=atol, rtol=rtol, msg=lambda m, n=name: f"d{n}: {m}")
    return out.cpu(), [g.cpu() for g in grads]


@pytest.fixture(params=["default", "per-head 16x16", "packed 16x16"])
def tiling(request, monkeypatch):
    """The default tiling (the interpreter packs heads into one wide tile), the GPU's per-head
    tiling with 16 x 16 tiles, and packed 16 x 16 tiles (many blocks straddling head boundaries)."""
    from teeny.kernels import attention

    if request.param == "per-head 16x16":
        monkeypatch.setattr(attention, "PACK_HEADS", False)
        if not teeny.device.INTERPRETER:
            pytest.skip("the GPU's tiling is the default there")
    elif request.param == "packed 16x16":
        if not teeny.device.INTERPRETER:
            pytest.skip("packing heads is an interpreter tiling")
        monkeypatch.setattr(attention, "PACKED_TILE", 16)
    return request.param


# several query and key blocks, head dims not powers of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lq, lk, causal", [(37, 41, False), (37, 19, True), (19, 37, True)])
def test_multi_block_matches_torch(gen, tiling, dtype, lq, lk, causal):
    q, k, v = _qkv(gen, dtype, (1, 2, lq, 20), (1, 2, lk, 20), (1, 2, lk, 11))
    _compare(gen, dtype, [q, k, v], max(lq, lk), is_causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_and_odd_lengths_across_tilings(gen, tiling, causal):
    q, k, v = _qkv(gen, torch.float32, (2, 4, 7, 5), (2, 2, 9, 5), (2, 2, 9, 3))
    _compare(gen, torch.float32, [q, k, v], 9, is_causal=causal, enable_gqa=True)


def test_bool_mask_across_tilings(gen, tiling):
    q, k, v = _qkv(gen, torch.float32, (2, 3, 11, 4), (2, 3, 13, 4))
    mask = torch.rand(2, 1, 11, 13, generator=gen) > 0.4
    mask[0, 0, 3] = False  # a fully masked row
    _compare(gen, torch.float32, [q, k, v], 13, attn_mask=mask)


def test_multi_block_mask_broadcast_over_batch_and_heads(gen, tiling):
    q, k, v = _qkv(gen, torch.float32, (2, 2, 21, 6), (2, 2, 35, 6))
    mask = torch.randn(2, 1, 21, 35, generator=gen) * 2
    _compare(gen, torch.float32, [q, k, v], 35, attn_mask=mask, scale=0.25)


def test_causal_is_top_left_aligned(gen):
    # Lq > Lk: query i sees keys 0..min(i, Lk-1); rows past Lk see every key
    q, k, v = _qkv(gen, torch.float32, (1, 1, 7, 4), (1, 1, 3, 4))
    out, _ = _compare(gen, torch.float32, [q, k, v], 7, is_causal=True)
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :].detach().cpu())  # row 0 sees key 0 only


@pytest.mark.parametrize("kind", ["additive -inf", "bool"])
def test_fully_masked_rows_give_zero_output_and_gradient(gen, kind):
    """As PyTorch's fused kernels: a query row that sees no key outputs 0 and passes no gradient."""
    q, k, v = _qkv(gen, torch.float32, (1, 2, 5, 3), (1, 2, 6, 3))
    keep = torch.rand(5, 6, generator=gen) > 0.3
    keep[:, 0] = True
    keep[2] = False  # row 2 sees nothing
    mask = keep if kind == "bool" else torch.zeros(5, 6).masked_fill(~keep, float("-inf"))
    out, (dq, dk, dv) = _compare(gen, torch.float32, [q, k, v], 6, attn_mask=mask)
    assert torch.all(out[:, :, 2] == 0) and torch.all(dq[:, :, 2] == 0)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_empty_key_sequence_gives_zeros(gen):
    q = torch.randn(1, 2, 3, 4, generator=gen).to(DEV)
    kv = torch.randn(1, 2, 0, 4, generator=gen).to(DEV)
    out = apply(ops.scaled_dot_product_attention, q, kv, kv)
    assert out.shape == (1, 2, 3, 4) and torch.all(out == 0)


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (1, 2)])
def test_only_some_inputs_need_gradients(gen, wanted):
    tensors = _qkv(gen, torch.float32, (1, 2, 9, 5), (1, 2, 7, 5))
    tensors = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(tensors)]
    out = apply(ops.scaled_dot_product_attention, *tensors, is_causal=True)
    ref_in = [_ref(t) for t in tensors]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, [tensors[i] for i in wanted], grad_out.to(DEV, torch.float32))
    ref_grads = torch.autograd.grad(ref, [ref_in[i] for i in wanted], grad_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.cpu().double(), r, atol=1e-4, rtol=1e-4)


def test_training_saves_output_and_logsumexp_but_no_attention_matrix(gen):
    g = Graph()
    q = g.input("q", (1, 2, 23, 4), requires_grad=True)
    k = g.input("k", (1, 2, 29, 4), requires_grad=True)
    v = g.input("v", (1, 2, 29, 4), requires_grad=True)
    g.output(ops.scaled_dot_product_attention(q, k, v))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    feed = {
        n: torch.randn(s, generator=gen) for n, s in (("q", (1, 2, 23, 4)), ("k", (1, 2, 29, 4)), ("v", (1, 2, 29, 4)))
    }
    out, cache = ex.forward_train(feed)
    (entry,) = cache.entries.values()
    assert set(entry["saved"]) == {"lse"} and entry["saved"]["lse"].shape == (1, 2, 23)
    assert entry["saved"]["lse"].dtype == torch.float32
    assert all(t.numel() < 23 * 29 for t in cache.tensors())  # nothing of the Lq x Lk size
    grads = ex.backward(cache, torch.ones(1, 2, 23, 4))
    assert set(grads) == {"q", "k", "v"}


def test_float64_matches_torch_tightly(gen):
    q, k, v = _qkv(gen, torch.float64, (2, 3, 17, 5), (2, 3, 19, 5))
    mask = torch.randn(17, 19, generator=gen, dtype=torch.float64)
    out = apply(ops.scaled_dot_product_attention, q, k, v, attn_mask=mask.to(DEV))
    ref = F.scaled_dot_product_attention(_ref(q), _ref(k), _ref(v), attn_mask=mask)
    # the default scale 1/sqrt(D) reaches the kernel as a float32 scalar: ~1e-7 relative
    torch.testing.assert_close(out.cpu(), ref, atol=1e-6, rtol=1e-6)


def test_default_scale_is_one_over_sqrt_head_dim(gen):
    q, k, v = _qkv(gen, torch.float32, (1, 1, 5, 7), (1, 1, 6, 7))
    a = apply(ops.scaled_dot_product_attention, q, k, v)
    b = apply(ops.scaled_dot_product_attention, q, k, v, scale=1 / math.sqrt(7))
    torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------- errors


def _trace(shapes, dtypes=None, **kwargs):
    g = Graph()
    dtypes = dtypes or [torch.float32] * len(shapes)
    ts = [g.input(f"t{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    mask = ts[3] if len(ts) > 3 else None
    return ops.scaled_dot_product_attention(ts[0], ts[1], ts[2], attn_mask=mask, **kwargs)


@pytest.mark.parametrize(
    "shapes, dtypes, kwargs, message",
    [
        ([(1, 2, 5, 4), (1, 2, 6, 3), (1, 2, 6, 4)], None, {}, "same head dim"),
        ([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 7, 4)], None, {}, "key and value must agree"),
        ([(1, 2, 5, 4), (1, 3, 6, 4), (1, 3, 6, 4)], None, {}, "same batch dims"),
        ([(1, 4, 5, 4), (1, 3, 6, 4), (1, 3, 6, 4)], None, {"enable_gqa": True}, "must divide query heads"),
        ([(5, 4), (6, 4, 1, 1, 1), (6, 4, 1, 1, 1)], None, {}, "2 to 4 dimensions"),
        ([(2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4)], None, {}, "same number of dimensions"),
        ([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), (5, 7)], None, {}, "not broadcastable"),
        ([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), (1, 1, 1, 5, 6)], None, {}, "not broadcastable"),
        ([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), (5, 6)], [torch.float32] * 3 + [torch.int64], {}, "bool or have"),
        (
            [(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), (5, 6)],
            [torch.float32] * 3 + [torch.float64],
            {},
            "different float dtypes",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(shapes, dtypes, kwargs, message):
    with pytest.raises(GraphError, match=message):
        _trace(shapes, dtypes, **kwargs)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="not both"):
        _trace([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), (5, 6)], is_causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        _trace([(1, 2, 5, 4)] * 3, dropout_p=0.1)


# --------------------------------------------------------------------------------- layer


def _layer_parts_exist():
    return all(hasattr(ops, n) for n in ("linear", "reshape", "transpose")) and hasattr(teeny.nn, "Linear")


def test_causal_self_attention_parameters():
    if not _layer_parts_exist():
        pytest.skip("linear/shape families not available")
    layer = teeny.models.CausalSelfAttention(12, 3)
    names = dict(layer.named_parameters())
    assert sorted(names) == sorted(
        f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")
    )
    assert names["q_proj.weight"].shape == (12, 12) and names["out_proj.bias"].shape == (12,)
    assert len(list(teeny.models.CausalSelfAttention(12, 3, bias=False).named_parameters())) == 4
    with pytest.raises(ValueError, match="multiple of n_heads"):
        teeny.models.CausalSelfAttention(10, 3)


def test_causal_self_attention_matches_torch(gen):
    if not _layer_parts_exist():
        pytest.skip("linear/shape families not available")
    batch, length, d_model, n_heads = 2, 7, 12, 3
    layer = teeny.models.CausalSelfAttention(d_model, n_heads)
    g = Graph()
    x = g.input("x", (batch, length, d_model), requires_grad=True)
    g.output(layer(x))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING), seed=3)
    params = {n: t.detach().cpu().double().requires_grad_() for n, t in ex.params.items()}
    xs = torch.randn(batch, length, d_model, generator=gen)
    out, cache = ex.forward_train({"x": xs})

    def ref_forward(x):
        def proj(name, t):
            return F.linear(t, params[f"{name}.weight"], params[f"{name}.bias"])

        def heads(t):
            return t.view(batch, length, n_heads, d_model // n_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(proj("q_proj", x)), heads(proj("k_proj", x)), heads(proj("v_proj", x)), is_causal=True
        )
        return proj("out_proj", y.transpose(1, 2).reshape(batch, length, d_model))

    x_ref = xs.double().requires_grad_()
    ref = ref_forward(x_ref)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = ex.backward(cache, grad_out.float())
    ref.backward(grad_out)
    torch.testing.assert_close(grads["x"].cpu().double(), x_ref.grad, atol=1e-5, rtol=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(
            ex.grads[name].cpu().double(), p.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
