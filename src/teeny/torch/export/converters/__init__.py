"""ATen op -> teeny converters, one module per family; importing this package fills
``CONVERTERS`` (see ``base``)."""

from . import elementwise, layers, losses, shapes  # noqa: F401  (each registers its converters)
from .base import CONVERTERS, Env, Refused, converts, is_teeny, refuse
from .modules import fusion

__all__ = ["CONVERTERS", "Env", "Refused", "converts", "fusion", "is_teeny", "refuse"]
