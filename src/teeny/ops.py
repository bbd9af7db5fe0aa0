"""The functional op surface: ``teeny.ops.gelu(x)``, ``teeny.ops.cross_entropy(logits, y)``, ...

Each op family lives in one module under ``teeny/kernels/`` (kernel pair, RuntimeOp, the
functional op and its test samples); this module gathers their public functions.
"""

from .kernels.activation import *  # noqa: F401,F403
from .kernels.attention import *  # noqa: F401,F403
from .kernels.conv import *  # noqa: F401,F403
from .kernels.dropout import *  # noqa: F401,F403
from .kernels.elementwise import *  # noqa: F401,F403
from .kernels.embedding import *  # noqa: F401,F403
from .kernels.linear import *  # noqa: F401,F403
from .kernels.loss import *  # noqa: F401,F403
from .kernels.norm import *  # noqa: F401,F403
from .kernels.reduction import *  # noqa: F401,F403
from .kernels.shape import *  # noqa: F401,F403
