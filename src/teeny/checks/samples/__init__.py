"""Every op's test samples: one module per op family (named like the family under ``teeny.ops``),
each registering its ops' ``OpInfo`` in ``teeny.checks.registry`` when imported. Importing this
package imports them all; ``all_ops()`` lists what they registered."""

import importlib
import pkgutil

from ... import ops  # noqa: F401  (families whose samples have not moved here yet register on import)
from ..registry import OPS, OpInfo

__all__ = ["OPS", "all_ops"]  # OPS: the registry, filled

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def all_ops() -> list[OpInfo]:
    """Every registered op."""
    return list(OPS.values())
