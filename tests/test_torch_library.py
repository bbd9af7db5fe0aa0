"""``torch.ops.teeny.<name>``: every registered op passes ``torch.library.opcheck`` (schema,
autograd registration, fake tensors, AOT dispatch) and ``torch.autograd.gradcheck`` in float64
on one registry sample; ``torch.compile(fullgraph=True)`` with no graph break; autocast;
double backward refused by name; mixed ``requires_grad``; user ops registered with one call."""

import math

import pytest
import torch

from teeny import ops
from teeny.checks.facts import op_facts
from teeny.checks.samples import OPS
from teeny.core.runtime import ArgVisitor, CustomOp
from teeny.torch import bridge, library

REGISTERED = library.registered_ops()
BY_NAME = {reg.name: reg for reg in REGISTERED.values() if not reg.overload}
OVERLOADS = sorted(q for q, reg in REGISTERED.items() if reg.name in OPS)


def _torch_args(sample, dtype=None, grad=True):
    """The sample's arguments, tensors copied (in ``dtype`` when float) and marked for a gradient."""
    counter = [0]

    def go(a):
        if isinstance(a, torch.Tensor):
            i = counter[0]
            counter[0] += 1
            t = a.detach().clone()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.requires_grad_(grad and sample.wants_grad(i, t))
        if isinstance(a, (list, tuple)):
            return type(a)(go(b) for b in a)
        return a

    return go(tuple(sample.args)), {k: go(v) for k, v in sample.kwargs.items()}


def _calls(qualname, samples, limit=2):
    """Up to ``limit`` samples that the overload's schema accepts (a Python number where the
    schema has a tensor, say, is left to the other overload or to ``teeny.torch.apply``)."""
    packet = REGISTERED[qualname].op
    found = []
    for sample in samples:
        args, kwargs = _torch_args(sample)
        try:
            with torch.no_grad():
                packet(*args, **kwargs)
        except RuntimeError as exc:
            if (
                "Expected a value of type" in str(exc)
                or "expected at most" in str(exc)
                or "Unknown keyword" in str(exc)
            ):
                continue
            raise
        found.append(sample)
        if len(found) == limit:
            break
    return packet, found


def test_every_registry_op_is_registered_or_listed_as_skipped():
    names = {r.name for r in REGISTERED.values()}
    for name in OPS:
        assert name in names or name in library.skipped_ops(), name


@pytest.mark.parametrize("qualname", OVERLOADS, ids=str)
def test_opcheck(qualname, gen):
    reg = REGISTERED[qualname]
    packet, samples = _calls(qualname, OPS[reg.name].samples(torch.float32, gen), limit=1)
    if reg.overload and not samples:
        pytest.skip(f"no registry sample of {reg.name} fits the overload {reg.schema}")
    assert samples, f"no registry sample of {reg.name} fits its schema {reg.schema}"
    for sample in samples:
        args, kwargs = _torch_args(sample)
        torch.library.opcheck(packet, args, kwargs)


@pytest.mark.parametrize("qualname", OVERLOADS, ids=str)
def test_gradcheck_float64(qualname, gen):
    info = OPS[REGISTERED[qualname].name]
    if not op_facts(info).has_backward:
        pytest.skip("no backward")
    packet, samples = _calls(qualname, info.gradcheck_inputs(gen), limit=1)
    samples = [s for s in samples if s.has_gradient_to_check()]
    if not samples:
        pytest.skip("no differentiable sample fits the schema")
    args, kwargs = _torch_args(samples[0], torch.float64)
    flat = samples[0].tensors()
    leaves = [t for t in _flat(args) if t.requires_grad]

    def fn(*xs):
        replaced = iter(xs)
        new_args = _replace(args, lambda t: next(replaced) if t.requires_grad else t)
        out = packet(*new_args, **kwargs)
        return tuple(out) if isinstance(out, list) else out

    assert len(flat) >= len(leaves)
    assert torch.autograd.gradcheck(fn, tuple(leaves), fast_mode=True)


def _flat(a):
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (list, tuple)):
        return [t for b in a for t in _flat(b)]
    return []


def _replace(a, fn):
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_replace(b, fn) for b in a)
    return a


# ------------------------------------------------------------------- torch.compile


class _TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(8, 6, generator=gen, dtype=torch.float64) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(3, 8, generator=gen, dtype=torch.float64) * 0.3)
        self.g = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))

    def forward(self, x, y):
        h = torch.ops.teeny.gelu(torch.ops.teeny.linear(x, self.w1), "tanh")
        h = torch.ops.teeny.rms_norm(h, [8], self.g, 1e-6)
        return torch.ops.teeny.cross_entropy(torch.ops.teeny.linear(h, self.w2), y)


def test_compile_fullgraph_without_graph_break_matches_eager():
    model = _TinyMLP()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0])
    explanation = torch._dynamo.explain(model)(x, y)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager = model(x, y)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(x, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager, rtol=0, atol=1e-12)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_compile_with_inductor():
    f = torch.compile(lambda a: torch.ops.teeny.softmax(a * 2.0, -1).sum(0), fullgraph=True)
    a = torch.randn(3, 7, requires_grad=True)
    out = f(a)
    out.backward(torch.ones(7))
    torch.testing.assert_close(out, torch.softmax(a.detach() * 2.0, -1).sum(0))
    assert a.grad is not None and torch.isfinite(a.grad).all()


_COMPILE_IN_A_FRESH_PROCESS = """
import sys
import torch
from teeny.torch import bridge, library
if sys.argv[1] != "same":  # another teeny: its op keys carry another digest
    bridge._BUILDERS[:] = [(p, b) for p, b in bridge._BUILDERS if p != library._PREFIX]
    library._PREFIX = "op1-000000000000:"
    bridge.add_builder(library._PREFIX, library._build)
    if sys.argv[1] == "other":  # its import tags the caches with its digest
        torch.compiler.config.cache_key_tag = ""
        library._tag_compile_caches("000000000000")
# teeny's operator alone: a graph of no kernel of inductor's own, so no C++ compiler runs
f = torch.compile(lambda a: torch.ops.teeny.softmax(a, -1), fullgraph=True)
a = torch.randn(3, 7, requires_grad=True)
out = f(a)
out.backward(torch.linspace(-1, 1, 21).reshape(3, 7))
torch.testing.assert_close(out, torch.softmax(a.detach(), -1))
assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0
print("ran")
"""


@pytest.mark.slow
def test_a_graph_compiled_against_other_teeny_code_is_compiled_again(tmp_path):
    """torch.compile's on-disk caches know a graph by its code, where teeny's operators appear
    by name only: teeny's source digest in ``torch.compiler.config.cache_key_tag`` keeps a
    process with other teeny code from loading a cached graph whose op keys it cannot run. The
    last run shows what happens without the tag: the cached graph is loaded and its keys refused."""
    import os
    import subprocess
    import sys

    assert f"teeny-{library._DIGEST}" in torch.compiler.config.cache_key_tag.split("+")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TEENY_DEVICE": "cpu"}

    def run(version):
        return subprocess.run(
            [sys.executable, "-c", _COMPILE_IN_A_FRESH_PROCESS, version],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    for version in ("same", "other"):
        result = run(version)
        assert result.returncode == 0 and "ran" in result.stdout, (version, result.stderr[-2000:])
    untagged = run("untagged")  # other op keys, the first run's cache tag
    assert untagged.returncode != 0 and "is from another version of teeny" in untagged.stderr


def test_a_wrong_argument_is_named_as_the_schema_names_it():
    """The op's error names the tensor by its argument name, not by its place in the trace."""
    from teeny.core.graph import GraphError

    with pytest.raises(GraphError, match=r"parameter 'weight' has shape \(4,\), expected \(5,\)"):
        torch.ops.teeny.rms_norm(torch.randn(3, 5), [5], torch.randn(4), 1e-6)


# ------------------------------------------------------------------- autograd semantics


def test_mixed_requires_grad_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, generator=gen, dtype=torch.float64)[:, ::2].requires_grad_()
    w = torch.randn(4, 5, generator=gen, dtype=torch.float64)  # frozen
    b = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    out = torch.ops.teeny.linear(x, w, b)
    out.backward(torch.ones_like(out))
    ref_x, ref_b = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.nn.functional.linear(ref_x, w, ref_b).backward(torch.ones(6, 4, dtype=torch.float64))
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(b.grad, ref_b.grad)
    assert w.grad is None


def test_retain_graph_backward_twice():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = torch.ops.teeny.layer_norm(x, [4]).pow(2).sum()
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_double_backward_names_the_op():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = torch.ops.teeny.softplus(x).sum()
    with pytest.raises(RuntimeError, match="teeny op softplus: double backward"):
        torch.autograd.grad(y, x, create_graph=True)


def test_torch_func_transforms_are_refused_by_name_and_vmap_works():
    """torch.func's differentiating transforms hand the op wrapped tensors: a TeenyError naming
    the op says so (before: torch's note about an autograd.Function's setup_context). vmap of a
    registered op runs it once per sample, backward included; vmap over ``apply`` is refused."""
    from teeny.core.errors import TeenyError
    from teeny.torch import apply
    from teeny.torch.nn import Linear

    x = torch.randn(3, 7, dtype=torch.float64)
    refused = "torch.func transforms .* are not supported"
    with pytest.raises(TeenyError, match=f"teeny op gelu: {refused}"):
        torch.func.grad(lambda t: torch.ops.teeny.gelu(t).sum())(x)
    with pytest.raises(TeenyError, match=f"teeny op gelu: {refused}"):
        torch.func.vjp(torch.ops.teeny.gelu, x)
    layer = Linear(7, 4, dtype=torch.float64)
    params = dict(layer.named_parameters())
    with pytest.raises(TeenyError, match=f"teeny op linear: {refused}"):
        torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params)
    with pytest.raises(TeenyError, match=refused):
        torch.vmap(lambda row: apply(lambda r: ops.softmax(r, 0), row))(x)

    reference = torch.nn.Linear(7, 4, dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    out = torch.vmap(layer, in_dims=1)(x.T)  # torch's batching fallback: a loop over the samples
    out.square().sum().backward()
    torch.vmap(reference, in_dims=1)(x.T).square().sum().backward()
    torch.testing.assert_close(out, reference(x))
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_meta_tensors_give_shapes_forwards_and_backwards():
    """On meta tensors an op runs its fake implementation, as torch's own ops do: a model built
    under ``torch.device("meta")`` runs forwards and backwards for shapes, then takes real
    storage with ``to_empty`` and ``reset_parameters`` and computes what torch does."""
    from teeny.torch import nn as tnn

    x = torch.randn(4, 5, device="meta", requires_grad=True)
    torch.ops.teeny.layer_norm(x, [5]).sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == (4, 5)
    with torch.device("meta"):
        model = torch.nn.Sequential(tnn.Linear(5, 7), tnn.GELU(), tnn.LayerNorm(7), tnn.Linear(7, 2))
    out = model(torch.randn(3, 5, device="meta"))
    out.sum().backward()
    assert out.shape == (3, 2) and model[0].weight.grad.shape == (7, 5)
    model.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for layer in model:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    reference = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2)
    )
    reference.load_state_dict(model.state_dict())
    real = torch.randn(3, 5)
    torch.testing.assert_close(model(real), reference(real))


def test_an_inference_tensor_in_a_call_that_records_a_gradient_is_named():
    """Under inference mode the op runs; a tensor made there and fed to a call that saves it for
    the backward is named (before: "Inference tensors do not track version counter")."""
    from teeny.core.errors import TeenyError

    with torch.inference_mode():
        x = torch.randn(4, 5)
        assert torch.ops.teeny.linear(x, torch.randn(3, 5)).is_inference()
    w = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(TeenyError, match="input 'input' is an inference tensor"):
        torch.ops.teeny.linear(x, w)
    torch.ops.teeny.linear(x.clone(), w).sum().backward()  # the clone is a normal tensor
    torch.testing.assert_close(w.grad, x.sum(0).expand(3, 5))


def _flops(model, x, target=None):
    """(forward, backward) flops torch's FlopCounterMode counts for a loss of ``model(x)``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, target) if target is not None else out.sum()
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops() - forward


def test_flop_counter_counts_teenys_products_as_torch_counts_its_own():
    """FlopCounterMode sees teeny's two generic operators, not the products inside them; their
    registered formulas count what torch counts for its own layers (before: 0 for teeny)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from teeny.torch import nn as tnn

    torch.manual_seed(0)
    ours = torch.nn.Sequential(tnn.Linear(12, 32), tnn.GELU(), tnn.Linear(32, 5))
    theirs = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    x, target = torch.randn(7, 12), torch.randint(0, 5, (7,))
    for inputs in (x, x.clone().requires_grad_()):  # the first layer's dX only where x wants one
        assert _flops(ours, inputs, target) == _flops(theirs, inputs, target) != (0, 0)
    ours = torch.nn.Sequential(tnn.Conv2d(3, 4, 3, padding=1), tnn.ReLU(), tnn.Conv2d(4, 2, 3, stride=2))
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3, stride=2)
    )
    assert _flops(ours, torch.randn(2, 3, 9, 9)) == _flops(theirs, torch.randn(2, 3, 9, 9))
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    attention = lambda q: torch.ops.teeny.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    shape = (2, 3, 5, 8)
    assert _flops(attention, q) == (sdpa_flop_count(shape, shape, shape), sdpa_backward_flop_count(*[shape] * 4))


def test_autocast_bf16_in_bf16_out():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(6, 8, generator=gen)  # float32 weight, as in a model under autocast
    g = torch.ones(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.ops.teeny.linear(x, w)
        y = torch.ops.teeny.layer_norm(h, [6], g)  # the float32 norm weight meets bf16 activations
    assert h.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(torch.nn.functional.linear(x.float(), w.bfloat16().float()), [6])
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.05)


def test_a_plain_call_keyed_once_still_follows_grad_mode_autocast_and_strides():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, generator=gen)[:, ::2].requires_grad_()  # non-contiguous
    w = torch.randn(6, 8, generator=gen)
    with torch.no_grad():
        assert torch.ops.teeny.linear(x, w).grad_fn is None
    for _ in range(2):  # the second call finds the key of the first
        out = torch.ops.teeny.linear(x, w)
        out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, 2 * torch.ones(4, 6) @ w)
    with torch.no_grad():
        assert torch.ops.teeny.linear(x, w).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same tensors: autocast's key, not the plain one
        for _ in range(2):  # the second call finds the key and the casts of the first
            assert torch.ops.teeny.linear(x, w).dtype == torch.bfloat16
        for _ in range(2):  # the float32 norm weight cast to the bf16 activations on every call
            y = torch.ops.teeny.layer_norm(torch.ops.teeny.linear(x, w), [6], torch.ones(6))
            assert y.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):  # another autocast dtype: another key
        assert torch.ops.teeny.linear(x, w).dtype == torch.float16
    assert torch.ops.teeny.linear(x, w).dtype == torch.float32


def test_a_keyed_call_with_values_tells_them_apart(monkeypatch):
    x = torch.randn(4, 8)
    for _ in range(2):  # the second round answers from the one-hit keys of the first
        torch.testing.assert_close(torch.ops.teeny.leaky_relu(x, 0.25), torch.nn.functional.leaky_relu(x, 0.25))
        torch.testing.assert_close(torch.ops.teeny.leaky_relu(x, 0.5), torch.nn.functional.leaky_relu(x, 0.5))
        torch.testing.assert_close(torch.ops.teeny.gelu(x, "tanh"), torch.nn.functional.gelu(x, approximate="tanh"))
        torch.testing.assert_close(torch.ops.teeny.gelu(x), torch.nn.functional.gelu(x))
        y = torch.ops.teeny.layer_norm(x, [8], eps=0.5)  # a keyword: its own key
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, [8], eps=0.5))
        torch.testing.assert_close(torch.ops.teeny.layer_norm(x, [8]), torch.nn.functional.layer_norm(x, [8]))
    monkeypatch.setattr(library, "_encode", lambda *a: pytest.fail("a known call was keyed again"))
    torch.ops.teeny.gelu(x, "tanh")
    torch.ops.teeny.layer_norm(x, [8], eps=0.5)


def _number_of(key: str, slot: int) -> float:
    """The Python number an elementwise op's compiled entry holds in operand ``slot``."""
    (node,) = [p for p in bridge.lookup(key).executor.program.nodes if hasattr(p.op, "slots")]
    return node.op.slots[slot].number


def test_a_negative_zero_scalar_is_keyed_apart_from_zero():
    """-0.0 == 0.0 (and hashes alike): a call with -0.0 after one with 0.0 reused its key."""
    bridge.clear_cache()
    x = torch.ones(3)
    for _ in range(2):  # the second round answers from the one-hit keys of the first
        for zero in (0.0, -0.0):
            torch.ops.teeny.div.Scalar(x, zero)
            (key,) = [k for k in bridge._ENTRIES if k.endswith(f" {zero!r})))")]
            assert math.copysign(1.0, _number_of(key, 1)) == math.copysign(1.0, zero)
    assert len(bridge._ENTRIES) == 2


def test_a_negative_zero_scalar_keeps_its_sign():
    """On the GPU -0.0 is a float32 argument; the interpreter would make it +0.0, so it travels there
    as a one-element tensor."""
    x = torch.tensor([1.0, -2.0, 0.0])
    for zero in (0.0, -0.0, 0.0):
        torch.testing.assert_close(torch.ops.teeny.div.Scalar(x, zero), x / zero, equal_nan=True)
        torch.testing.assert_close(torch.ops.teeny.add(x * 0, zero), x * 0 + zero)  # -0.0 + -0.0 is -0.0
        assert torch.equal(torch.ops.teeny.add(x * 0, zero).signbit(), (x * 0 + zero).signbit())


def test_split_chunk_and_stop_gradient_run_the_ops_not_their_registry_samples():
    """The registry checks split/chunk/stop_gradient through wrappers (the parts concatenated in
    reverse); the registered operators are the ops themselves, and match torch's."""
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    calls = [
        (lambda t: torch.ops.teeny.chunk(t, 3), lambda t: torch.chunk(t, 3)),
        (lambda t: torch.ops.teeny.chunk(t, 2, 1), lambda t: torch.chunk(t, 2, 1)),
        (lambda t: torch.ops.teeny.split(t, 3), lambda t: torch.split(t, 3)),
        (lambda t: torch.ops.teeny.split(t, 3, dim=-1), lambda t: torch.split(t, 3, dim=-1)),
        (lambda t: torch.ops.teeny.split.sizes(t, [2, 5]), lambda t: torch.split(t, [2, 5])),
        (lambda t: [torch.ops.teeny.stop_gradient(t) * t], lambda t: [t.detach() * t]),
    ]
    for teeny_call, torch_call in calls:
        got, want = teeny_call(x), torch_call(x)
        assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        weights = [torch.randn(w.shape, dtype=w.dtype) for w in want]
        (got_grad,) = torch.autograd.grad(got, x, weights)
        (want_grad,) = torch.autograd.grad(want, x, weights)
        torch.testing.assert_close(got_grad, want_grad)
    for name in ("split", "chunk", "stop_gradient"):
        assert library.registered_ops()[f"teeny::{name}"].fn is getattr(ops, name)


def test_direct_calls_skip_the_dispatcher_only_in_plain_eager_mode():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    took = []
    call = library._direct_call(lambda *a: took.append("direct"), lambda *a: took.append("operator"))

    class Seeing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassingTeenyOps(Seeing):
        passes_teeny_ops = True

    class Dispatching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    x = torch.randn(3)
    call(x, "tanh")
    with PassingTeenyOps():
        call(x)
    with Seeing():  # a mode of the user's sees the operator
        call(x)
    with Dispatching():
        call(x)
    call(x.as_subclass(Sub))
    torch.func.vmap(lambda t: call(t) or t)(torch.randn(2, 3))
    assert took == ["direct", "direct", "operator", "operator", "operator", "operator"]


def test_teenys_layers_call_directly_and_a_users_mode_still_sees_the_operator():
    from torch.overrides import TorchFunctionMode

    from teeny.torch.nn import functional as TF

    seen = []

    class Seeing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, requires_grad=True)
    ref = TF.gelu(x, "tanh")
    with Seeing():
        y = TF.gelu(x, "tanh")
    assert "teeny.gelu" in seen
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(torch.nn.functional.gelu(x, approximate="tanh").sum(), x)[0])


# ------------------------------------------------------------------- user ops


class Cube(CustomOp):
    """y = x^3, dx = 3 x^2 dy: a user op from Triton source text."""

    name = "user_cube"

    def lower_source(self):
        return """
@triton.jit
def cube_forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x * x * x, mask=offs < n)
"""

    def lower_backward_source(self):
        return """
@triton.jit
def cube_backward(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    dy = tl.load(dy_ptr + offs, mask=offs < n)
    tl.store(dx_ptr + offs, 3.0 * x * x * dy, mask=offs < n)
"""

    def block(self):
        return 64

    def pack_args(self, inputs, params, output, output_shape, visitor: ArgVisitor, saved=None):
        visitor.visit(x_ptr=inputs[0], y_ptr=output, n=inputs[0].numel())

    def pack_backward_args(self, inputs, params, output, output_shape, dy, dy_stride, dx, dp, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], dy_ptr=dy, dx_ptr=dx[0], n=inputs[0].numel())

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)


def test_register_a_custom_op_with_one_call():
    op = library.register(Cube)
    x = torch.randn(70, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(op, (x,))
    torch.testing.assert_close(op(x), x.detach() ** 3)
    torch.library.opcheck(op, (x,))
    compiled = torch.compile(lambda t: op(t).sum(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), (x.detach() ** 3).sum())


def test_register_a_teeny_function_with_its_signature():
    def user_scaled_swish(x, beta: float = 1.0):
        return x * ops.sigmoid(x * beta)

    op = library.register(user_scaled_swish)
    assert "float beta=1.0" in library.registered_ops()["teeny::user_scaled_swish"].schema
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(op(x, 2.0), x.detach() * torch.sigmoid(2.0 * x.detach()))
    assert torch.autograd.gradcheck(lambda t: op(t, 2.0), (x,))
    with pytest.raises(ValueError, match="already registered"):
        library.register(user_scaled_swish)
