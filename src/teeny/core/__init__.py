"""The bottom layer: the device choice, ``@kernel``, how an op is launched (``RuntimeOp``,
``OpContext``, ``Launch``), the graph, tuning, errors and the jit helpers every family shares.

``device`` is imported first: Triton decides interpreter or compiler when a kernel is defined.
"""

from . import device  # noqa: F401
