"""Write a kernel pair, check its gradient, use it from PyTorch.

    PYTHONPATH=src python examples/kernel_pair.py

The op is a "squareplus" activation, y = (x + sqrt(x^2 + b)) / 2, with derivative
dy/dx = (1 + x / sqrt(x^2 + b)) / 2. Its forward kernel names its backward kernel; a
RuntimeOp says how to launch both, in the one-kernel contract (``pack_args`` and ``grid``,
``pack_backward_args`` and ``backward_grid``; ``teeny.core.runtime`` documents it);
teeny.gradcheck compares the backward kernel with finite differences in float64;
teeny.torch.register makes it torch.ops.teeny.squareplus, which
differentiates with torch autograd and compiles with torch.compile(fullgraph=True).
"""

import teeny  # noqa: I001  (before triton: teeny picks the GPU, or the Triton interpreter on a CPU)
import teeny.torch
import torch
import triton.language as tl
from teeny.core.graph import graph_of
from teeny.core.kernel import kernel
from teeny.core.runtime import RuntimeOp

BLOCK = 1024


@kernel
def squareplus_backward(x_ptr, dy_ptr, dx_ptr, n, b, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    dy = tl.load(dy_ptr + offsets, mask=inside)
    tl.store(dx_ptr + offsets, dy * 0.5 * (1 + x / tl.sqrt(x * x + b)), mask=inside)


@kernel(backward=squareplus_backward)
def squareplus_forward(x_ptr, y_ptr, n, b, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside)
    tl.store(y_ptr + offsets, 0.5 * (x + tl.sqrt(x * x + b)), mask=inside)


class SquareplusOp(RuntimeOp):
    name = "squareplus"
    kernel = squareplus_forward
    saves_inputs = True  # the backward reads x

    def __init__(self, b: float = 4.0):
        self.b = b

    def block(self):
        return BLOCK

    def pack_args(self, inputs, params, output, output_shape, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], y_ptr=output, n=output.numel(), b=self.b)

    def backward_grid(self, input_shapes, output_shape):
        return self.grid(input_shapes, output_shape)

    def pack_backward_args(self, inputs, params, output, output_shape, dy, dy_stride, dx, dparams, visitor, saved=None):
        visitor.visit(x_ptr=inputs[0], dy_ptr=dy, dx_ptr=dx[0], n=dy.numel(), b=self.b)


def squareplus(x, b: float = 4.0):
    """The functional op: adds one node to the graph x belongs to."""
    return graph_of(x).apply(SquareplusOp(b), [x])


if __name__ == "__main__":
    # 1. the backward kernel against central finite differences, in float64
    x = torch.randn(5, 37, dtype=torch.float64)
    teeny.gradcheck(squareplus, x)
    print("teeny.gradcheck: squareplus's backward kernel matches finite differences")

    # 2. a PyTorch operator: torch.ops.teeny.squareplus(x, b)
    op = teeny.torch.register(squareplus)
    t = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda u: op(u, 2.0), (t,))
    print("torch.autograd.gradcheck through torch.ops.teeny.squareplus: ok")

    # 3. inside a model, compiled with no graph break
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6))
    compiled = torch.compile(lambda u: op(model(u), 4.0).sum(), fullgraph=True, backend="aot_eager")
    loss = compiled(torch.randn(3, 6))
    loss.backward()
    print(
        f"torch.compile(fullgraph=True): loss {loss.item():.4f}, first weight's grad {model[0].weight.grad.norm():.4f}"
    )
