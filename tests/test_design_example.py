"""The worked example of docs/design.md ("Adding an op") runs as written: the new activation is
listed with its computed facts, passes the float64 finite-difference check, matches its PyTorch
reference in every dtype, and works as a layer and from PyTorch."""

import re
from pathlib import Path

import pytest
import torch

import teeny
from helpers import assert_matches_torch
from teeny.checks.facts import op_facts
from teeny.checks.samples import OPS

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    text = DESIGN.read_text()
    section = text[text.index("### A worked example") :]
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
    stated = int(re.search(r"That is (\d+) lines besides the imports", DESIGN.read_text()).group(1))
    assert len(lines) == stated, f"the worked example has {len(lines)} lines; docs/design.md says {stated}"


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
        assert_matches_torch(
            squareplus,
            OPS["squareplus"].ref,
            *sample.args,
            kwargs=sample.kwargs,
            dtype=torch.float32,
            reduction=sample.reduction,
            gen=gen,
            name=f"squareplus {sample.name}",
        )


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
