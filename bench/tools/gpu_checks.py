"""float64 on the GPU is float64: the cases of issue 17, against PyTorch float64 on the same card.

Prints one line per case with the largest absolute difference (0 or ~1e-16 expected; the bug gave
1e-8). Run on the GPU machine: PYTHONPATH=src python3 bench/tools/gpu_checks.py
"""

import torch
import torch.nn.functional as F

import teeny
from teeny import ops
from teeny.torch import apply

DEV = teeny.DEVICE
f64 = dict(dtype=torch.float64, device=DEV)


def check(name, fn, ref, *args, **kwargs):
    xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    rs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    try:
        out = apply(fn, *xs, **kwargs)
        expected = ref(*rs, **kwargs)
        g = torch.linspace(-1, 1, out.numel(), **f64).view(out.shape)
        grads = torch.autograd.grad(out, [x for x in xs if x.requires_grad], g)
        rgrads = torch.autograd.grad(expected, [r for r in rs if r.requires_grad], g)
        diffs = [float((a - b).abs().max()) for a, b in zip(grads, rgrads)]
        err = max([float((out - expected).abs().max())] + diffs)
        print(f"{name:40} max abs difference {err:.3e} {'ok' if err < 1e-12 else 'FLOAT32-LIKE'}")
    except Exception as exc:  # report and go on: this is a survey
        print(f"{name:40} ERROR {type(exc).__name__}: {str(exc)[:200]}")


x = torch.tensor([-1.5, 2.0, -0.25, 0.7], **f64)
check("leaky_relu 0.1", ops.leaky_relu, F.leaky_relu, x, negative_slope=0.1)
check("elu alpha 0.3", ops.elu, F.elu, x, alpha=0.3)
check("softplus beta 0.7", ops.softplus, F.softplus, x, beta=0.7)
check("hardtanh -0.3 0.7", ops.hardtanh, F.hardtanh, x, min_val=-0.3, max_val=0.7)
check(
    "layer_norm eps 1e-5",
    lambda t: ops.layer_norm(t, (2,)),
    lambda t: F.layer_norm(t, (2,)),
    torch.tensor([[0.003, -0.002]], **f64),
)
check("group_norm 3 groups", lambda t: ops.group_norm(t, 3), lambda t: F.group_norm(t, 3), torch.randn(2, 6, 1, **f64))
q, k, v = torch.randn(1, 1, 4, 7, **f64), torch.randn(1, 1, 6, 7, **f64), torch.randn(1, 1, 6, 3, **f64)
check("attention default scale", ops.scaled_dot_product_attention, F.scaled_dot_product_attention, q, k, v)
check(
    "attention scale 0.3",
    lambda a, b, c: ops.scaled_dot_product_attention(a, b, c, scale=0.3),
    lambda a, b, c: F.scaled_dot_product_attention(a, b, c, scale=0.3),
    torch.randn(5, 8, **f64),
    torch.randn(6, 8, **f64),
    torch.randn(6, 5, **f64),
)
mask = torch.rand(5, 9, device=DEV) > 0.3
mask[:, 0] = True
check(
    "attention bool mask float64",
    lambda a, b, c, m: ops.scaled_dot_product_attention(a, b, c, attn_mask=m),
    lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m),
    torch.randn(1, 1, 5, 4, **f64),
    torch.randn(1, 1, 9, 4, **f64),
    torch.randn(1, 1, 9, 4, **f64),
    mask,
)
check(
    "huber delta 0.7",
    lambda a, b: ops.huber_loss(a, b, delta=0.7),
    lambda a, b: F.huber_loss(a, b, delta=0.7),
    torch.tensor([0.0, 3.0], **f64),
    torch.tensor([1.5, 0.1], **f64),
)
check(
    "cross_entropy label smoothing 0.1",
    lambda a, t: ops.cross_entropy(a, t, label_smoothing=0.1),
    lambda a, t: F.cross_entropy(a, t, label_smoothing=0.1),
    torch.randn(4, 7, **f64),
    torch.tensor([1, 0, 6, 3], device=DEV),
)
