import torch, teeny
from teeny.interop.torch import apply
from triton.testing import do_bench
import teeny.ops as O
torch.manual_seed(0)
cases = [
 ("sum rows fp32 16384x4096", O.sum, torch.sum, (16384, 4096), torch.float32, dict(dim=-1)),
 ("sum dim0 fp32 16384x4096", O.sum, torch.sum, (16384, 4096), torch.float32, dict(dim=0)),
 ("sum all fp32 2^27", O.sum, torch.sum, (1 << 27,), torch.float32, dict()),
 ("var (0,2) bf16 64x512x512", O.var, torch.var, (64, 512, 512), torch.bfloat16, dict(dim=(0, 2))),
 ("amax rows bf16 8192x32000", O.max, torch.amax, (8192, 32000), torch.bfloat16, dict(dim=-1)),
 ("softmax fp32 16384x4096", O.softmax, torch.softmax, (16384, 4096), torch.float32, dict(dim=-1)),
 ("softmax bf16 8192x32000", O.softmax, torch.softmax, (8192, 32000), torch.bfloat16, dict(dim=-1)),
 ("softmax fp32 dim1 64x1024x256", O.softmax, torch.softmax, (64, 1024, 256), torch.float32, dict(dim=1)),
 ("logsumexp fp32 16384x4096", O.logsumexp, torch.logsumexp, (16384, 4096), torch.float32, dict(dim=-1)),
]
for name, op, ref, shape, dt, kw in cases:
    x = torch.randn(shape, device="cuda", dtype=dt)
    out = apply(op, x, **kw)
    r = ref(x.float(), **kw)
    err = (out.float() - r).abs().max().item()
    t = do_bench(lambda: apply(op, x, **kw))
    tr = do_bench(lambda: ref(x, **kw))
    xg = x.clone().requires_grad_(True)
    def fb():
        y = apply(op, xg, **kw); y.backward(torch.ones_like(y))
    def fbr():
        y = ref(xg, **kw); y.backward(torch.ones_like(y))
    tb, tbr = do_bench(fb), do_bench(fbr)
    gb = x.numel() * x.element_size() / 1e9
    print(f"{name:34s} err {err:.2e}  fwd {t*1e3:8.1f}us torch {tr*1e3:8.1f}us ({gb/t*1e3:6.0f} GB/s read) | fwd+bwd {tb*1e3:8.1f}us torch {tbr*1e3:8.1f}us")
