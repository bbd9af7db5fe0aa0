"""teeny ops inside PyTorch: kept for existing imports; the bridge lives in ``teeny.torch``.

y = teeny.interop.torch.apply(teeny.ops.gelu, x)      # x: a torch tensor
y.sum().backward()                                     # runs teeny's backward kernels
"""

from __future__ import annotations

from ..torch.bridge import apply, clear_cache

__all__ = ["apply", "clear_cache"]
