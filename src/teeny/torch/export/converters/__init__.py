"""ATen op -> teeny converters, one module per family; importing this package fills
``CONVERTERS`` (see ``base``). Beyond one call at a time: ``modules`` makes a whole module call
one teeny op, ``patterns`` a run of calls (a gated MLP, a rotary embedding)."""

from . import elementwise, layers, losses, shapes  # noqa: F401  (each registers its converters)
from .base import CONVERTERS, Env, Refused, converts, is_teeny, refuse
from .modules import fusion

__all__ = ["CONVERTERS", "Env", "Refused", "converts", "fusion", "is_teeny", "refuse"]
