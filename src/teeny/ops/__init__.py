"""The functional op surface: ``teeny.ops.gelu(x)``, ``teeny.ops.cross_entropy(logits, y)``, ...

Each op family lives in one module or package here (kernel pair, RuntimeOp, the functional
op, its layer); this module gathers their public functions and binds the operators of symbolic
tensors (``x + y``, ``x @ w``, ``x[0]``, ``x.T``) to them.
"""

from ..core import device as _device  # noqa: F401  (first: chooses interpreter or GPU before triton loads)
from ..core.graph import bind_operators
from .activation import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .cast import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .elementwise import *  # noqa: F401,F403
from .lookup import *  # noqa: F401,F403
from .loss import *  # noqa: F401,F403
from .masks import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .products import *  # noqa: F401,F403
from .reduction import *  # noqa: F401,F403
from .rotary import *  # noqa: F401,F403
from .shape import *  # noqa: F401,F403
from .unary import *  # noqa: F401,F403

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
