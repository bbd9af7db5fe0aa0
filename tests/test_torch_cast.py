"""``teeny.torch.cast`` (the dtype cast the importer needs): PyTorch parity forwards and
backwards between every pair of float dtypes (a cast's gradient is the cast back, so a finite
difference check through a narrower dtype would only measure its rounding), integer and bool
sources (no gradient), and truncation toward zero into integers."""

import pytest
import torch

from teeny.graph import GraphError
from teeny.torch import apply
from teeny.torch.cast import cast

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PAIRS = [(s, t) for s in FLOATS for t in FLOATS if s != t]


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}-{t}".replace("torch.", "") for s, t in PAIRS])
def test_float_casts_match_torch_forward_and_backward(source, target):
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0)).to(source).requires_grad_()
    y = apply(lambda t: cast(t, target), x)
    assert y.dtype == target
    ref = x.detach().to(target)
    narrow = min(torch.finfo(source).eps, 1) < torch.finfo(target).eps
    # the Triton interpreter truncates when narrowing where the GPU rounds to nearest even: one unit apart
    atol = torch.finfo(target).eps * 4 if narrow else 0.0
    torch.testing.assert_close(y.double(), ref.double(), atol=atol, rtol=atol)
    seed = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)).to(target)
    (g,) = torch.autograd.grad(y, x, seed)
    assert g.dtype == source
    back_atol = torch.finfo(source).eps * 4 if torch.finfo(source).eps > torch.finfo(target).eps else 0.0
    torch.testing.assert_close(g.double(), seed.to(source).double(), atol=back_atol, rtol=back_atol)


def test_integer_and_bool_sources_cast_without_a_gradient():
    idx = torch.tensor([3, -1, 0, 7])
    torch.testing.assert_close(apply(lambda t: cast(t, torch.float32), idx), idx.float())
    mask = torch.tensor([True, False, True])
    torch.testing.assert_close(apply(lambda t: cast(t, torch.float64), mask), mask.double())
    x = torch.tensor([1.7, -2.2, 0.5, -0.5])
    torch.testing.assert_close(apply(lambda t: cast(t, torch.int64), x), x.to(torch.int64))  # toward zero


def test_a_dtype_that_is_not_one_is_refused():
    with pytest.raises(GraphError, match="dtype must be a torch.dtype"):
        apply(lambda t: cast(t, "float16"), torch.randn(3))
