"""The worked example of docs/design.md ("Adding an op") runs as written: the new activation is
listed with its computed facts, passes the float64 finite-difference check, matches its PyTorch
reference in every dtype, and works as a layer and from PyTorch."""

import re
from pathlib import Path

import pytest
import torch

import teeny
from teeny.facts import op_facts
from teeny.registry import OPS, tolerance
from teeny.torch import apply

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    text = DESIGN.read_text()
    section = text[text.index("## Adding an op: a worked example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # a file of its own: compiled Triton (not the interpreter) reads a kernel's source back from it
    source = tmp_path_factory.mktemp("design") / "design_example.py"
    source.write_text(code)
    namespace: dict = {"__name__": "design_example"}
    exec(compile(code, str(source), "exec"), namespace)
    yield namespace, code
    OPS.pop("squareplus", None)  # the registry is process-wide: leave it as the suite found it


def test_the_example_is_short(example):
    _, code = example
    lines = [
        line for line in code.splitlines() if line.strip() and not line.lstrip().startswith(("#", "import", "from"))
    ]
    assert len(lines) == 13, f"the worked example has {len(lines)} lines; docs/design.md says 13"


def test_the_new_activation_has_computed_facts_and_a_true_gradient(example):
    namespace, _ = example
    squareplus = namespace["squareplus"]
    facts = op_facts("squareplus")
    assert facts.has_backward
    assert set(facts.dtypes) == {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    teeny.gradcheck(squareplus, x, kwargs={"b": 0.3})
    for sample in OPS["squareplus"].samples(torch.float32, gen):
        (t,) = sample.args
        t = t.to(teeny.DEVICE).requires_grad_()
        out = apply(lambda u, kw=sample.kwargs: squareplus(u, **kw), t)
        ref_t = t.detach().double().requires_grad_()
        ref = OPS["squareplus"].ref(ref_t, **sample.kwargs)
        atol, rtol = tolerance(torch.float32, sample.reduction)
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
        dy = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (g,) = torch.autograd.grad(out, t, dy.to(out.dtype).to(teeny.DEVICE))
        (r,) = torch.autograd.grad(ref, ref_t, dy.to(ref.device))
        torch.testing.assert_close(g.double(), r, atol=atol, rtol=rtol)


def test_the_new_layer_applies_it(example):
    namespace, _ = example
    layer = namespace["Squareplus"](b=1.0)
    g = teeny.Graph()
    x = g.input("x", (2, 5), torch.float64)
    g.output(layer(x))
    ex = teeny.Executor(teeny.lower(g, teeny.LoweringMode.INFERENCE))
    xs = torch.linspace(-3, 3, 10, dtype=torch.float64).reshape(2, 5)
    torch.testing.assert_close(ex.forward({"x": xs}).cpu(), 0.5 * (xs + torch.sqrt(xs * xs + 1.0)))


def test_the_new_activation_registers_as_a_pytorch_operator(example):
    namespace, _ = example
    op = teeny.torch.register(namespace["squareplus"])
    x = torch.randn(4, 6, dtype=torch.float64).to(teeny.DEVICE).requires_grad_()
    y = op(x, 0.3)
    (g,) = torch.autograd.grad(y.sum(), x)
    expected = 0.5 * (1.0 + x / torch.sqrt(x * x + 0.3))
    torch.testing.assert_close(y, 0.5 * (x + torch.sqrt(x * x + 0.3)), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g, expected.detach(), atol=1e-12, rtol=1e-12)
