"""Mistakes at the engine's boundary are refused with an error naming what was wrong, never a
silently wrong number or a crash deep in a run: a parameter update between ``forward_train`` and
``backward``, another executor's activations, sizes that are not ints, an unlowered graph, a
graph edited into a cycle, gradcheck of integer inputs."""

import pytest
import torch

import teeny
from teeny import Executor, Graph, GraphError, LoweringMode, TeenyError, lower, ops
from teeny.core import init
from teeny.training.optim import AdamW


def _mlp(name="g"):
    g = Graph(name)
    x = g.input("x", (4, 3))
    w = g.parameter("w", (2, 3), init.normal(0.5))
    g.output(ops.linear(x, w).sum())
    return g


def test_step_between_forward_and_backward():
    ex = Executor(lower(_mlp(), LoweringMode.TRAINING))
    opt = AdamW(ex, lr=0.1)
    _, cache = ex.forward_train({"x": torch.randn(4, 3)})
    opt.step(with_grad=["w"])
    with pytest.raises(TeenyError, match="parameter 'w' was modified in place"):
        ex.backward(cache)


def test_cache_of_other_executor():
    a = Executor(lower(_mlp(), LoweringMode.TRAINING))
    b = Executor(lower(_mlp(), LoweringMode.TRAINING))
    _, cache = b.forward_train({"x": torch.randn(4, 3)})
    with pytest.raises(TeenyError, match="another Executor"):
        a.backward(cache)


def test_shapes():
    g = Graph()
    for bad in [(3.5, 3), (True, 3)]:
        with pytest.raises(GraphError, match="sequence of ints"):
            g.input("x", bad)


def test_executor_of_graph():
    with pytest.raises(TypeError, match="lower it first"):
        Executor(_mlp())


def test_cycle():
    g = Graph()
    x = g.input("x", (3,))
    a = ops.gelu(x)
    b = ops.gelu(a)
    g.output(b.sum())
    g.nodes[0].inputs[0] = b.value
    with pytest.raises(GraphError, match="cycle"):
        lower(g, LoweringMode.INFERENCE)


def test_gradcheck_of_int_tensor():
    with pytest.raises(teeny.GradcheckError, match="floating-point tensors, and got int64"):
        teeny.gradcheck(teeny.ops.gelu, torch.arange(6).reshape(2, 3))


def test_patch_of_a_function_is_refused():
    import teeny.torch as tt

    with pytest.raises(TypeError, match="must be a torch.nn.Module, got builtin_function_or_method"):
        tt.patch(torch.sin)


def test_patch_leaves_a_softmax_without_dim():
    """torch picks such a softmax's dimension implicitly; the drop-in would need one: left, reported."""
    import teeny.torch as tt

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Softmax())
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        expected = model(x)
    report = tt.patch(model)
    assert [(path, why.split(" (")[0]) for path, _, why in report.left] == [("1", "teeny has no kernel for dim=None")]
    with pytest.warns(UserWarning, match="Implicit dimension"):
        torch.testing.assert_close(model(x), expected)


def test_a_stored_graph_cannot_run_code_while_it_loads(tmp_path):
    """A bundle's graph is read by an unpickler that resolves teeny's own classes only."""
    import os
    import pickle

    from teeny.aot.bundle import BundleError
    from teeny.aot.program import load_graph, store_graph

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    with pytest.raises(BundleError, match="posix.system, outside teeny: refused"):
        load_graph(pickle.dumps(Payload()))
    assert not (tmp_path / "ran").exists()
    graph = _mlp()
    data, _ = store_graph(graph)
    assert [n.op.name for n in load_graph(data).nodes] == [n.op.name for n in graph.nodes]


@pytest.mark.parametrize("fn", [torch.sin, torch.nn.functional.gelu, torch.nn.ReLU()])
def test_apply_of_a_pytorch_function_says_so(fn):
    from teeny.torch import apply

    with pytest.raises(TeenyError, match="is PyTorch's, which cannot run on teeny's symbolic tensors"):
        apply(fn, torch.randn(3))
