"""``python -m teeny ...`` is the ``teeny`` command (torchrun starts it so: ``torchrun -m teeny train``)."""

import sys

from .cli import main

sys.exit(main())
