"""rotary_embedding beyond the registry's checks of its samples (``teeny.checks.samples.rotary``:
tests/test_ops.py, tests/test_torch_library.py): transformers' own rotary tables and
``apply_rotary_pos_emb``, the errors, and what the backward keeps."""

import pytest
import torch

from teeny import ops
from teeny.checks.facts import op_facts
from teeny.checks.samples.rotary import ROTARY
from teeny.core.errors import TeenyError
from teeny.core.graph import Graph, GraphError
from teeny.program.lowering import LoweringMode, lower
from teeny.torch import apply


def test_the_registrys_checks_run_in_every_dtype_with_the_backward():
    """tests/test_ops.py (float64 gradcheck, forward and backward against PyTorch) and
    tests/test_torch_library.py (torch.ops.teeny.rotary_embedding) check ROTARY's samples; they
    skip a dtype the op lacks, so say here that it lacks none."""
    facts = op_facts(ROTARY)
    assert {torch.float32, torch.float16, torch.bfloat16} <= set(facts.dtypes) and facts.has_backward


def test_transformers_tables_and_apply_rotary_pos_emb(gen):
    """q and k of a tiny Llama attention with the tables its rotary module makes (positions that
    differ per batch row), against transformers' apply_rotary_pos_emb; and a partial rotary as
    GPT-NeoX applies it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=40, num_attention_heads=4, head_dim=10, rope_theta=500.0)
    q, k = torch.randn(2, 4, 7, 10, generator=gen), torch.randn(2, 2, 7, 10, generator=gen)
    positions = torch.stack([torch.arange(7), torch.arange(3, 10)])
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply(ops.rotary_embedding, q, cos, sin), want_q)
    torch.testing.assert_close(apply(ops.rotary_embedding, k, cos, sin), want_k)

    cos, sin = (t[..., :2].repeat(1, 1, 2) for t in (cos, sin))  # the tables of a rotary dim of 4
    partial_q, _ = apply_rotary_pos_emb(q[..., :4], k[..., :4], cos, sin)
    got = apply(ops.rotary_embedding, q, cos, sin)
    torch.testing.assert_close(got, torch.cat((partial_q, q[..., 4:]), dim=-1))


def _trace(*shapes, dtypes=None):
    g = Graph()
    dtypes = dtypes or [torch.float32] * len(shapes)
    return ops.rotary_embedding(*(g.input(f"t{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))))


@pytest.mark.parametrize(
    "shapes, dtypes, message",
    [
        (((2, 7, 10), (1, 7, 10), (1, 7, 10)), None, r"x must have shape \(batch, heads, seq, head_dim\)"),
        (((2, 3, 7, 9), (1, 7, 9), (1, 7, 9)), None, r"rotary dim .*9.* must be even"),
        (((2, 3, 7, 6), (1, 7, 8), (1, 7, 8)), None, r"at most head_dim \(6\)"),
        (((2, 3, 7, 6), (1, 7, 6), (1, 7, 4)), None, r"cos and sin must have the same shape, got \(1, 7, 6\)"),
        (((2, 3, 7, 6), (1, 5, 6), (1, 5, 6)), None, r"\(2 or 1, 7, rotary_dim\) .* got \(1, 5, 6\)"),
        (((2, 3, 7, 6), (3, 7, 6), (3, 7, 6)), None, r"\(2 or 1, 7, rotary_dim\) .* got \(3, 7, 6\)"),
        (((2, 3, 7, 6), (7, 6), (7, 6)), None, r"\(2 or 1, 7, rotary_dim\) .* got \(7, 6\)"),
        (
            ((1, 1, 2, 4),) * 3,
            [torch.float32, torch.bfloat16, torch.bfloat16],
            "float32 tables for a half-precision x; got x float32, cos bfloat16, sin bfloat16",
        ),
        (
            ((1, 1, 2, 4),) * 3,
            [torch.bfloat16, torch.float32, torch.bfloat16],
            "got x bfloat16, cos float32, sin bfloat16",
        ),
        (((1, 1, 2, 4),) * 3, [torch.float32, torch.float64, torch.float64], "got x float32, cos float64"),
        (((1, 1, 2, 4), (1, 2, 4), (1, 2, 4)), [torch.int64] * 3, "floating-point x, cos and sin, got x of int64"),
    ],
)
def test_bad_inputs_name_what_is_wrong(shapes, dtypes, message):
    with pytest.raises(GraphError, match=r"rotary_embedding \(node .*" + message):
        _trace(*shapes, dtypes=dtypes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_x_with_float32_tables_is_the_float32_rotation_rounded_once(gen, dtype):
    """bf16 / fp16 x with float32 cos and sin (autocast's q and k with Llama's tables): y is the
    exact float32 rotation of x rounded once to x's dtype, and dx the float32 transposed rotation
    of dy rounded once; odd sizes, one table per batch row."""
    x = torch.randn(3, 5, 7, 10, generator=gen).to(dtype).requires_grad_()
    angles = torch.randn(3, 7, 5, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    dy = torch.randn(3, 5, 7, 10, generator=gen).to(dtype)

    def rotate(t, c, s):
        half = torch.cat((-t[..., 5:], t[..., :5]), dim=-1)
        return t * c[:, None] + half * s[:, None]

    y = apply(ops.rotary_embedding, x, cos, sin)
    assert y.dtype == dtype
    torch.testing.assert_close(y, rotate(x.detach().float(), cos, sin).to(dtype), atol=0, rtol=0)
    y.backward(dy)
    # the transpose of the rotation by (cos, sin) is the rotation by (cos, -sin) with the halves swapped back
    dx = dy.float() * cos[:, None] + torch.cat((dy.float()[..., 5:], -dy.float()[..., :5]), dim=-1) * sin[:, None]
    torch.testing.assert_close(x.grad, dx.to(dtype), atol=1e-2, rtol=1e-2)


def test_a_gradient_for_cos_is_refused_at_lowering_naming_the_op():
    g = Graph()
    x = g.input("x", (1, 2, 3, 4), requires_grad=True)
    cos, sin = g.input("cos", (1, 3, 4), requires_grad=True), g.input("sin", (1, 3, 4))
    g.output(ops.sum(ops.rotary_embedding(x, cos, sin)))
    with pytest.raises(TeenyError, match=r"op rotary_embedding \(node .*backward.*no gradient for cos and sin"):
        lower(g, LoweringMode.TRAINING)


def test_the_backward_keeps_cos_and_sin_only():
    g = Graph()
    x = g.input("x", (1, 2, 3, 4), requires_grad=True)
    y = ops.rotary_embedding(ops.mul(x, x), g.input("cos", (1, 3, 4)), g.input("sin", (1, 3, 4)))
    g.output(ops.sum(y))
    program = lower(g, LoweringMode.TRAINING)
    node = next(p for p in program.nodes if p.op.name == "rotary_embedding")
    assert node.saved_inputs == [False, True, True]


def test_a_patched_llama_rotates_in_teeny_under_autocast_as_transformers_promotes(gen):
    """Under bf16 autocast q and k leave their products in bf16 while Llama's cos and sin stay
    float32, and transformers' ``q * cos + rotate_half(q) * sin`` is float32 by type promotion:
    the patched model's dispatcher takes that call too (it fell back to transformers' ten small
    ops a call before), rotating in float32 and writing bf16, which the attention's autocast
    cast would make of the float32 rotation: the same values and gradients as the unpatched
    model's. Outside autocast the mixed call promotes as transformers' does (float32 out), and
    so does float32 q with bf16 tables."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    import teeny.torch as tt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    ref = LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    report = tt.patch(model)
    ids = torch.randint(0, 64, (2, 9), generator=gen)
    losses, grads = [], []
    for run in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        grads.append([p.grad for p in run.parameters()])
    assert report.routed["apply_rotary_pos_emb"] == 2  # one call per layer, under autocast
    torch.testing.assert_close(losses[1], losses[0], atol=1e-3, rtol=1e-3)
    for g, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, want, atol=1e-2, rtol=5e-2)

    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    angles = torch.randn(2, 5, 4, generator=gen).repeat(1, 1, 2)
    for q_dtype, table_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        args = (q.to(q_dtype), k.to(q_dtype), angles.cos().to(table_dtype), angles.sin().to(table_dtype))
        with tt.patching.router.Router(report):
            got = modeling_llama.apply_rotary_pos_emb(*args)
        want = modeling_llama.apply_rotary_pos_emb.original(*args)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == torch.float32
            torch.testing.assert_close(g, w)
    args = (q.bfloat16(), k.bfloat16(), angles.cos(), angles.sin())
    with tt.patching.router.Router(report), torch.autocast("cpu", dtype=torch.bfloat16):
        got = modeling_llama.apply_rotary_pos_emb(*args)
    want = modeling_llama.apply_rotary_pos_emb.original(*args)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and w.dtype == torch.float32
        torch.testing.assert_close(g, w.bfloat16(), atol=0, rtol=0)
    assert report.routed["apply_rotary_pos_emb"] == 5


def _rotate_unsplit(x, cos, sin):
    from teeny.core.graph import graph_of
    from teeny.ops.rotary import RotaryOp

    return graph_of(x, cos, sin).apply(RotaryOp("blhd"), [x, cos, sin])


@pytest.mark.parametrize("rotary_dim", [6, 4], ids=["whole", "partial"])
def test_the_unsplit_layout_rotates_as_the_split_one_with_a_float64_gradcheck(gen, rotary_dim):
    """``RotaryOp(layout="blhd")`` on x (batch, seq, heads, dim), as
    ``fusions.attention_layout.attention_in_place`` leaves Llama's q and k: the rotation of x's
    transpose, transposed back, with tables per batch row; its backward passes a float64
    gradcheck."""
    x = torch.randn(2, 5, 3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    cos, sin = torch.randn(2, 2, 5, rotary_dim, dtype=torch.float64, generator=gen).unbind(0)
    split = apply(ops.rotary_embedding, x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(apply(_rotate_unsplit, x, cos, sin), split, rtol=1e-12, atol=1e-12)
    rotate = lambda t: apply(_rotate_unsplit, t, cos, sin)  # noqa: E731
    assert torch.autograd.gradcheck(rotate, (x,), eps=1e-6, atol=1e-8, fast_mode=True)  # random projections
    with pytest.raises(ValueError, match=r"\(batch, seq, heads, head_dim\)"):
        graph = Graph()
        _rotate_unsplit(graph.input("x", (5, 3, 6)), graph.input("c", (1, 5, 6)), graph.input("s", (1, 5, 6)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_unsplit_layout_matches_pytorchs_rotation_and_its_gradient(gen, dtype):
    """Against PyTorch autograd on odd shapes (7 positions, 3 heads, head dim 10, rotary dim 6):
    ``x * cos + rotate_half(x) * sin`` on the first 6 columns of (batch, seq, heads, dim), the tables
    broadcast over the heads, forwards and the gradient of x."""
    x = torch.randn(2, 7, 3, 10, generator=gen).to(dtype).requires_grad_()
    cos, sin = torch.randn(2, 2, 7, 6, generator=gen).unbind(0)
    dy = torch.randn(2, 7, 3, 10, generator=gen).to(dtype)

    def reference(t):
        r, rest = t[..., :6].float(), t[..., 6:].float()
        c, s = cos[:, :, None], sin[:, :, None]
        rotated = r * c + torch.cat([-r[..., 3:], r[..., :3]], -1) * s
        return torch.cat([rotated, rest], -1).to(dtype)

    expected = reference(x)
    (expected_grad,) = torch.autograd.grad(expected, x, dy)
    out = apply(_rotate_unsplit, x, cos, sin)  # float32 tables; a bf16 x is rotated in float32, rounded once
    (grad,) = torch.autograd.grad(out, x, dy)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, expected_grad, rtol=tol, atol=tol)
