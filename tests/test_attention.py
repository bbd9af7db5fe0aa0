"""scaled_dot_product_attention and CausalSelfAttention: what the generic harness does not see
(several key/query blocks on every tiling, fully masked rows, partial gradients, what is saved,
float64 scalars and bool masks, that the GPU kernels compile, broadcast batch dims, the dropout
mask's statistics and its reuse in backward, errors)."""

import math

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import assert_matches_torch, compile_for_sm90
from teeny import ops
from teeny.checks.samples.attention import dropout_keep_reference
from teeny.core.common import mix_seed
from teeny.core.graph import Graph, GraphError
from teeny.core.kernel import record_launches
from teeny.ops.attention import tuning
from teeny.ops.attention.tuning import AttentionTiles, Tiles
from teeny.program.lowering import LoweringMode, lower
from teeny.torch import apply
from teeny.training.models import CausalSelfAttention

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
    return assert_matches_torch(
        ops.scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        *tensors,
        kwargs=kwargs,
        dtype=dtype,
        reduction=reduction,
        gen=gen,
        name="attention",
    )


TILINGS = {
    "16x16": AttentionTiles(Tiles(16, 16), Tiles(16, 16), Tiles(16, 16)),
    # the GPU's shapes of tiles: forward/dq with more queries than keys, dkdv with more keys
    "32x16 / dkdv 16x32": AttentionTiles(Tiles(32, 16), Tiles(32, 16), Tiles(16, 32)),
}


@pytest.fixture(params=["default", *TILINGS])
def tiling(request, monkeypatch):
    """The default tiles (one wide tile per head under the interpreter), and small tiles of
    either aspect, so that a head spans several query and key blocks: the unchecked loops, the
    causal diagonal and the partial last blocks all run."""
    if request.param != "default":
        if not teeny.core.device.INTERPRETER:
            pytest.skip("the GPU's tiles are the default there")
        monkeypatch.setattr(tuning, "TILE_OVERRIDE", TILINGS[request.param])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gqa_on_the_gpus_small_grid_tiles(gen, monkeypatch, dtype):
    """The tiles a small GQA grid takes on the GPU (forward and dq 64 x 64, dkdv 32 x 64:
    ``HALF_FEW_PROGRAMS_DKDV``), run here by the interpreter: causal, 150 queries and keys (dkdv
    streams 5 blocks of 32 queries past 3 blocks of 64 keys, partial tails and the diagonal), 4
    query heads on 2 key/value heads, against torch in float64."""
    usual = tuning.HALF_TILES[64]
    monkeypatch.setattr(tuning, "TILE_OVERRIDE", AttentionTiles(usual.forward, usual.dq, tuning.HALF_FEW_PROGRAMS_DKDV))
    q, k, v = _qkv(gen, dtype, (2, 4, 150, 24), (2, 2, 150, 24))
    _compare(gen, dtype, [q, k, v], 150, is_causal=True, enable_gqa=True)


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
    sdpa = lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    reference = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    assert_matches_torch(sdpa, reference, *tensors, grad=wanted, tol=(1e-4, 1e-4), gen=gen)


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


def test_default_scale_is_one_over_sqrt_head_dim(gen):
    q, k, v = _qkv(gen, torch.float32, (1, 1, 5, 7), (1, 1, 6, 7))
    a = apply(ops.scaled_dot_product_attention, q, k, v)
    b = apply(ops.scaled_dot_product_attention, q, k, v, scale=1 / math.sqrt(7))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scale", [-0.45, 0.0], ids=["negative", "zero"])
def test_negative_and_zero_scales(gen, tiling, scale):
    """The kernels fold |scale| into exp2 and flip the sign of q (k in dkdv) for a negative one.
    The reference is written out: PyTorch's math path gives NaN for a negative causal scale
    (it multiplies q and k by sqrt(scale))."""
    tensors = _qkv(gen, torch.float32, (2, 2, 19, 6), (2, 2, 23, 6))

    def reference(q, k, v):
        causal = torch.ones(19, 23, dtype=torch.bool, device=q.device).tril()
        return torch.softmax((q @ k.transpose(-2, -1) * scale).masked_fill(~causal, -math.inf), -1) @ v

    sdpa = lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)  # noqa: E731
    assert_matches_torch(sdpa, reference, *tensors, dtype=torch.float32, reduction=23, gen=gen)


# --------------------------------------------------------------------------- float64


def _compare_float64(gen, tensors, **kwargs):
    """float64 all the way: within the rounding of a few dozen terms."""
    kwargs = dict(kwargs=kwargs, dtype=torch.float64, tol=(1e-12, 1e-12), gen=gen, name="attention")
    assert_matches_torch(ops.scaled_dot_product_attention, F.scaled_dot_product_attention, *tensors, **kwargs)


@pytest.mark.parametrize(
    "shapes, kwargs",
    [
        (((1, 1, 4, 7), (1, 1, 6, 7), (1, 1, 6, 3)), {}),  # default scale 1/sqrt(7)
        (((5, 8), (6, 8), (6, 5)), {"scale": 0.3}),
        (((2, 3, 17, 5), (2, 3, 19, 5), None), {"is_causal": True}),
    ],
    ids=["default scale", "scale 0.3", "causal"],
)
def test_float64_scales_reach_the_kernels_as_float64(gen, shapes, kwargs):
    """Issue 17: a float32 scale was off by ~1e-8 in float64; non-dyadic scales now match to
    float64 rounding, and every launch passes the scale (and the dropout scale) as fp64."""
    tensors = _qkv(gen, torch.float64, *shapes)
    with record_launches() as log:
        _compare_float64(gen, tensors, **kwargs)
    launches = [r for r in log if r.kernel.startswith("attention")]
    assert {r.kernel for r in launches} == {"attention_forward", "attention_backward_dq", "attention_backward_dkdv"}
    for r in launches:
        assert r.scalar_types["scale"] == "fp64" and r.scalar_types["dropout_scale"] == "fp64", r


@pytest.mark.parametrize(
    "shapes, mask_shape",
    [
        (((1, 1, 5, 4), (1, 1, 9, 4)), (5, 9)),
        (((1, 1, 5, 4), (1, 1, 9, 4)), (1, 1, 1, 9)),  # key padding
        (((2, 2, 37, 40), (2, 2, 45, 40)), (37, 45)),
    ],
    ids=["(5,9) mask", "key padding", "(2,2,37,40)"],
)
def test_float64_bool_masks(gen, tiling, shapes, mask_shape):
    """Issue 17's cases (they failed to compile on the GPU; test_kernels_compile_for_the_h200
    compiles them here), at float64 precision on every tiling."""
    tensors = _qkv(gen, torch.float64, *shapes)
    mask = torch.rand(mask_shape, generator=gen) > 0.3
    mask[..., 0] = True  # no fully masked row: PyTorch's float64 reference gives NaN there
    _compare_float64(gen, tensors, attn_mask=mask)


def _case(name, dtype, q, k, v, mask=None, mask_dtype="bool", grad=(True, True, True), **kwargs):
    case = dict(name=name, dtype=dtype, shapes=[q, k, v], kwargs=kwargs, grad=list(grad))
    if mask is not None:
        case.update(mask=mask, mask_dtype=mask_dtype)
    return case


def _compile_cases(dtype):
    """Cases that between them launch every variant of the kernels in ``dtype``: both mask
    kinds, causal, dropout, GQA, broadcast batch dims (sum_to_shape), and partial gradients
    (the dq kernel computing only delta, dkdv writing only dK or only dV)."""
    odd = ((2, 2, 37, 40), (2, 2, 45, 40), (2, 2, 45, 40))
    cases = [
        _case("bool mask, odd lengths and head dim", dtype, *odd, mask=(37, 45)),
        _case(
            "float mask, gqa, k/v broadcast over batch",
            dtype,
            (2, 4, 37, 40),
            (2, 45, 40),
            (2, 45, 24),
            mask=(4, 37, 45),
            mask_dtype=dtype,
            enable_gqa=True,
        ),
        _case("causal dropout, only dK", dtype, *odd, grad=(False, True, False), is_causal=True, dropout_p=0.2),
        _case("causal, only dV", dtype, *odd, grad=(False, False, True), is_causal=True),
    ]
    if dtype == "float64":  # issue 17's own cases
        cases += [
            _case("issue 17 (5,9) bool mask", dtype, (1, 1, 5, 4), (1, 1, 9, 4), (1, 1, 9, 4), mask=(5, 9)),
            _case("issue 17 key padding", dtype, (1, 1, 5, 4), (1, 1, 9, 4), (1, 1, 9, 4), mask=(1, 1, 1, 9)),
        ]
    if dtype == "float32":  # GPT 4L's attention (teeny train gpt --size large)
        cases.append(_case("causal 64x8x128x32", dtype, *[(64, 8, 128, 32)] * 3, is_causal=True))
        cases.append(_case("causal 8x12x512x64 (long tiles)", dtype, *[(8, 12, 512, 64)] * 3, is_causal=True))
    if dtype == "bfloat16":  # the benchmark's shape: the tensor-core path
        cases = [
            _case("causal 4x16x2048x64", dtype, *[(4, 16, 2048, 64)] * 3, is_causal=True),
            _case("bool mask 8x12x1024x64", dtype, *[(8, 12, 1024, 64)] * 3, mask=(8, 1, 1024, 1024)),
        ]
    return cases


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.slow
def test_kernels_compile_for_the_h200(dtype):
    """Issue 17: float64 attention with a bool mask failed to compile on the GPU, which the
    interpreter cannot show. Every variant teeny launches compiles for sm_90 here, with the
    signature and alignment hints Triton's launcher would give it; bf16 uses Hopper's wgmma and
    pipelined (cp.async) loads in all three kernels, float32 (tf32x3) wgmma; each kernel waits for
    the one before it (programmatic dependent launch). Slow (a few seconds per kernel)."""
    rows = compile_for_sm90("attention_compile", _compile_cases(dtype), timeout=1800)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, "\n".join(f"{r['case']}: {r['kernel']}: {r['error']}" for r in failed)
    kernels = {r["kernel"] for r in rows}
    assert {"attention_forward", "attention_backward_dq", "attention_backward_dkdv"} <= kernels
    attention = [r for r in rows if r["kernel"].startswith("attention_")]
    assert all(r["waits"] == 1 for r in attention), attention  # programmatic dependent launch
    if dtype == "bfloat16":  # Hopper tensor cores, loads pipelined through shared memory
        assert all(r["wgmma"] > 0 and r["pipelined"] for r in rows), rows
    if dtype == "float32":  # tf32x3 on Hopper's tensor cores
        gpt = [r for r in rows if r["case"] in ("causal 64x8x128x32", "causal 8x12x512x64 (long tiles)")]
        assert len(gpt) == 6 and all(r["wgmma"] > 0 for r in gpt), gpt


# --------------------------------------------------------------------------- broadcasting


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [
        ((2, 3, 5, 4), (7, 4), (7, 4)),
        ((5, 4), (2, 3, 7, 4), (2, 3, 7, 4)),
        ((2, 3, 5, 4), (3, 7, 4), (3, 7, 4)),
        ((2, 3, 5, 4), (2, 1, 7, 4), (2, 1, 7, 4)),
        ((3, 5, 4), (2, 3, 7, 4), (7, 6)),
        ((1, 3, 5, 4), (2, 3, 7, 4), (2, 1, 7, 4)),
        ((2, 1, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4)),
        ((2, 2, 3, 5, 4), (2, 2, 3, 7, 4), (3, 7, 4)),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_dims_broadcast_like_torch(gen, q_shape, k_shape, v_shape, causal):
    """Issue 18: query, key and value of different ranks (or size-1 dims) broadcast as in PyTorch,
    and the gradient of a broadcast operand is summed over the dims it was broadcast along."""
    tensors = _qkv(gen, torch.float32, q_shape, k_shape, v_shape)
    _compare(gen, torch.float32, tensors, 7 * 6, is_causal=causal)


def test_gqa_with_broadcast_batch(gen, tiling):
    q, k, v = _qkv(gen, torch.float32, (2, 4, 9, 5), (2, 11, 5), (2, 11, 3))  # 2 key/value heads, no batch dim
    _compare(gen, torch.float32, [q, k, v], 22, enable_gqa=True, is_causal=True)


def test_mask_broadcast_with_broadcast_inputs(gen, tiling):
    q, k, v = _qkv(gen, torch.float32, (2, 3, 9, 5), (11, 5), (3, 11, 4))
    mask = torch.rand(3, 1, 11, generator=gen) > 0.2
    mask[..., 0] = True
    _compare(gen, torch.float32, [q, k, v], 11, attn_mask=mask)


# --------------------------------------------------------------------------- dropout


def _dropout_reference(q, k, v, p, step_seed, causal=False):
    """float64 attention whose weights are multiplied by the Philox mask of ``step_seed``,
    computed in numpy (an account of the mask independent of the kernels)."""
    q, k, v = (_ref(t) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    weights = torch.softmax(scores, -1)
    keep = dropout_keep_reference(step_seed, weights[..., 0, 0].numel(), *weights.shape[-2:], p)
    return (weights * keep.reshape(weights.shape) / (1 - p)) @ v, (q, k, v)


def _dropout_executor(shapes, **kwargs):
    g = Graph()
    ins = [g.input(n, s, torch.float32, requires_grad=True) for n, s in zip("qkv", shapes)]
    g.output(ops.scaled_dot_product_attention(*ins, **kwargs))
    return teeny.Executor(lower(g, LoweringMode.TRAINING))


def test_dropout_keeps_weights_with_probability_one_minus_p_and_rescales(gen):
    """q = k = 0 makes every weight 1/Lk and v = identity returns the weights: each output is
    0 or 1 / ((1 - p) Lk), about a fraction p are 0, their mean is 1/Lk, and the zeros are
    exactly the Philox mask of the run's seed."""
    p, lk = 0.3, 64
    q = torch.zeros(1, 2, 48, 8)
    k = torch.zeros(1, 2, lk, 8)
    v = torch.eye(lk).expand(1, 2, lk, lk).contiguous()
    ex = _dropout_executor([q.shape, k.shape, v.shape], dropout_p=p, seed=11)
    out = ex.forward({"q": q, "k": k, "v": v}).cpu().double()
    scaled = out * lk * (1 - p)
    kept = scaled > 0.5
    torch.testing.assert_close(scaled[kept], torch.ones_like(scaled[kept]))
    assert torch.all(scaled[~kept] == 0)
    assert abs((~kept).double().mean().item() - p) < 0.03  # 6144 draws: std 0.006
    assert abs(out.mean().item() * lk - 1) < 0.05
    expected = dropout_keep_reference(mix_seed(11, 0), 2, 48, lk, p).reshape(kept.shape)
    assert torch.equal(kept, expected)


def test_dropout_draws_a_new_mask_per_run_and_backward_uses_its_forwards(gen):
    shapes = [(2, 2, 13, 6), (2, 2, 17, 6), (2, 2, 17, 5)]
    q, k, v = _qkv(gen, torch.float32, *shapes)
    ex = _dropout_executor(shapes, dropout_p=0.4, seed=5, is_causal=True)
    feed = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
    out1, cache1 = ex.forward_train(feed)
    out2, cache2 = ex.forward_train(feed)
    assert not torch.allclose(out1, out2)
    grad_out = torch.randn(out1.shape, generator=gen, dtype=torch.float64)
    grads = ex.backward(cache1, grad_out.float())  # after the second forward: the first run's mask
    for step, out in ((0, out1), (1, out2)):
        ref, ref_in = _dropout_reference(q, k, v, 0.4, mix_seed(5, step), causal=True)
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
        if step == 0:
            for name, r in zip("qkv", torch.autograd.grad(ref, ref_in, grad_out)):
                torch.testing.assert_close(grads[name].cpu().double(), r, atol=1e-5, rtol=1e-5)


def test_dropout_fixed_mask_repeats_and_seeds_differ(gen):
    shapes = [(1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4)]
    q, k, v = _qkv(gen, torch.float32, *shapes)
    feed = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
    fixed = _dropout_executor(shapes, dropout_p=0.5, seed=3, fixed_mask=True)
    assert torch.equal(fixed.forward(feed), fixed.forward(feed))
    other = _dropout_executor(shapes, dropout_p=0.5, seed=4, fixed_mask=True)
    assert not torch.equal(fixed.forward(feed), other.forward(feed))


def test_dropout_of_one_gives_zeros_and_dropout_is_not_captured(gen):
    shapes = [(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4)]
    q, k, v = _qkv(gen, torch.float32, *shapes)
    ex = _dropout_executor(shapes, dropout_p=1.0)
    out, cache = ex.forward_train({"q": q.detach(), "k": k.detach(), "v": v.detach()})
    assert torch.all(out == 0)
    grads = ex.backward(cache, torch.ones(out.shape))
    assert all(torch.all(g == 0) for g in grads.values())
    assert [p.op.capturable for p in ex.program.nodes] == [False]  # the per-run seed is host state
    assert [p.op.capturable for p in _dropout_executor(shapes).program.nodes] == [True]


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
        ([(1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 7, 4)], None, {}, "key and value must have the same length"),
        ([(1, 2, 5, 4), (1, 3, 6, 4), (1, 3, 6, 4)], None, {}, "not broadcastable.*enable_gqa"),
        ([(1, 4, 5, 4), (1, 3, 6, 4), (1, 3, 6, 4)], None, {"enable_gqa": True}, "divide the query heads"),
        ([(1, 4, 5, 4), (1, 2, 6, 4), (1, 1, 6, 4)], None, {"enable_gqa": True}, "must be equal"),
        ([(4,), (6, 4), (6, 4)], None, {}, "at least 2 dimensions"),
        ([(2, 3, 4, 5, 4), (2, 1, 4, 7, 4), (1, 3, 1, 7, 4)], None, {}, "cannot index"),
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
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        _trace([(1, 2, 5, 4)] * 3, dropout_p=1.5)
    with pytest.raises(TypeError, match="scale must be a float"):
        _trace([(1, 2, 5, 4)] * 3, scale="0.5")


# --------------------------------------------------------------------------------- layer


def _layer_parts_exist():
    return all(hasattr(ops, n) for n in ("linear", "reshape", "transpose")) and hasattr(teeny.nn, "Linear")


def test_causal_self_attention_parameters():
    if not _layer_parts_exist():
        pytest.skip("linear/shape families not available")
    layer = CausalSelfAttention(12, 3)
    names = dict(layer.named_parameters())
    assert sorted(names) == sorted(
        f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")
    )
    assert names["q_proj.weight"].shape == (12, 12) and names["out_proj.bias"].shape == (12,)
    assert len(list(CausalSelfAttention(12, 3, bias=False).named_parameters())) == 4
    with pytest.raises(ValueError, match="multiple of n_heads"):
        CausalSelfAttention(10, 3)


def test_causal_self_attention_matches_torch(gen):
    if not _layer_parts_exist():
        pytest.skip("linear/shape families not available")
    batch, length, d_model, n_heads = 2, 7, 12, 3
    layer = CausalSelfAttention(d_model, n_heads)
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


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_attention_dropout_under_checkpoint_recomputes_the_forwards_mask(reentrant):
    """On the PyTorch path the dropout seed is drawn from torch's RNG, which checkpointing
    restores before recomputing: the gradients are those of the forward's mask (the same as a
    run without checkpointing from the same RNG state)."""
    from teeny.torch import apply

    def attend(q, k, v):
        return teeny.ops.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen, requires_grad=True) for _ in range(3))
    torch.manual_seed(3)
    plain = apply(attend, q, k, v)
    expected = torch.autograd.grad(plain.sum(), (q, k, v))
    torch.manual_seed(3)
    y = torch.utils.checkpoint.checkpoint(lambda *t: apply(attend, *t) * 1.0, q, k, v, use_reentrant=reentrant)
    torch.testing.assert_close(y, plain)
    for t in (q, k, v):
        t.grad = None
    y.sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(got, want)


def test_dkdv_takes_smaller_tiles_where_its_grid_has_too_few_programs(monkeypatch):
    """Half-precision head dim 64: dkdv's grid is (key/value heads, key blocks); where 128-key
    blocks give under DKDV_MIN_WAVES waves of programs (the Llama's GQA, 8 x 4 heads x 1,024
    keys: 256 programs on 132 multiprocessors), dkdv takes 32 x 64 tiles and the other kernels
    keep theirs; GPT-2's 8 x 12 heads and longer sequences keep 64 x 128."""
    from teeny.core import tuning as core_tuning

    monkeypatch.setattr(tuning, "INTERPRETER", False)
    monkeypatch.setattr(core_tuning, "multiprocessors", lambda: 132)
    usual = tuning.HALF_TILES[64]

    def tiles(kv_heads, length=1024, d=64):
        return tuning.attention_tiles(torch.bfloat16, d=d, dv=d, q_len=length, k_len=length, kv_heads=kv_heads)

    llama = tiles(8 * 4)
    assert llama == AttentionTiles(usual.forward, usual.dq, tuning.HALF_FEW_PROGRAMS_DKDV)
    assert llama.dkdv == Tiles(32, 64, 4, 3)
    assert tiles(8 * 12) == usual  # GPT-2: 768 programs, 5.8 waves
    assert tiles(4 * 16, length=2048) == usual
    assert tiles(4 * 4, length=8192) == usual  # 16 x 64 blocks: 1,024 programs
    assert tiles(8 * 4, d=128) == tuning.HALF_TILES[128]  # head dim 128: swept without GQA only
