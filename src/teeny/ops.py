"""The functional op surface: ``teeny.ops.gelu(x)``, ``teeny.ops.cross_entropy(logits, y)``, ...

Each op family lives in one module under ``teeny/kernels/`` (kernel pair, RuntimeOp, the
functional op and its test samples); this module gathers their public functions, binds the
operators of symbolic tensors (``x + y``, ``x @ w``, ``x[0]``, ``x.T``) to them, and lists
every registered op (``all_ops``).
"""

from .graph import bind_operators
from .kernels.activation import *  # noqa: F401,F403
from .kernels.attention import *  # noqa: F401,F403
from .kernels.cast import *  # noqa: F401,F403
from .kernels.conv import *  # noqa: F401,F403
from .kernels.dropout import *  # noqa: F401,F403
from .kernels.elementwise import *  # noqa: F401,F403
from .kernels.embedding import *  # noqa: F401,F403
from .kernels.linear import *  # noqa: F401,F403
from .kernels.loss import *  # noqa: F401,F403
from .kernels.norm import *  # noqa: F401,F403
from .kernels.reduction import *  # noqa: F401,F403
from .kernels.shape import *  # noqa: F401,F403
from .kernels.unary import *  # noqa: F401,F403
from .registry import OPS, OpInfo

bind_operators(
    add=add,
    sub=sub,
    mul=mul,
    div=div,
    neg=neg,
    pow=pow,
    matmul=matmul,  # noqa: F405
    getitem=getitem,
    transpose=transpose,
    reshape=reshape,
    permute=permute,  # noqa: F405
    sum=sum,
    mean=mean,
    to=to,
)  # noqa: F405


def all_ops() -> list[OpInfo]:
    """Every registered op (the families above register theirs when imported)."""
    return list(OPS.values())
