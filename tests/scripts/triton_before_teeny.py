"""test_core.py: on the interpreter, importing triton.language before teeny is a clear error.

TEENY_DEVICE=cpu python tests/scripts/triton_before_teeny.py   # fails with "Import a teeny module first"
"""

import triton.language  # noqa: F401  (first, on purpose)

import teeny

teeny.ops  # noqa: B018  (the lazy attribute that loads the package)
