"""Optional packages: teeny needs torch, triton, numpy and safetensors; every other package comes
with an extra of ``pip install 'teeny-triton[EXTRA]'`` and is imported, through ``require`` or
``optional``, inside the function that needs it, so that ``import teeny.torch`` and lowering and
running a graph work without any of them.

    train   scikit-learn (the digits data set), matplotlib (loss.png), tensorboard (--log tensorboard),
            tqdm (the progress bar), threadpoolctl (one BLAS thread under the Triton interpreter)
    hf      transformers (Hugging Face models: teeny.torch.patch's tests, examples)
    bench   liger-kernel and transformers (the comparisons of bench/)
    test    pytest, pytest-xdist, hypothesis, ruff, transformers and all of train

``require`` refuses a missing package with one line naming the feature and the extra (a
``MissingExtraError``, both a ``TeenyError`` and an ``ImportError``). Features that work without
their package, less well, go through ``optional``; ``DEGRADED`` says what each one loses.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import TeenyError

DISTRIBUTION = "teeny-triton"

# import name -> (the distribution pip installs, the extra that brings it); pyproject.toml lists the
# same distributions under the same extras (tests/test_install.py compares the two)
PACKAGES: dict[str, tuple[str, str]] = {
    "sklearn": ("scikit-learn", "train"),
    "matplotlib": ("matplotlib", "train"),
    "tensorboard": ("tensorboard", "train"),
    "tqdm": ("tqdm", "train"),
    "threadpoolctl": ("threadpoolctl", "train"),
    "transformers": ("transformers", "hf"),
    "liger_kernel": ("liger-kernel", "bench"),
}

# what still works, and what is lost, without a package that ``optional`` imports
DEGRADED: dict[str, str] = {
    "tqdm": "training prints its log lines but shows no progress bar",
    "threadpoolctl": "under the Triton interpreter tl.dot runs on every BLAS thread (slower on a busy machine)",
}


class MissingExtraError(TeenyError, ImportError):
    """A feature needs a package of an extra that is not installed (the message names both)."""

    exit_code = 2  # what `teeny` exits with: a setting that cannot run here, refused before the work


def install_hint(package: str) -> str:
    """``pip install 'teeny-triton[EXTRA]'`` for the extra that brings ``package`` (an import name)."""
    _, extra = PACKAGES[package]
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(module: str, feature: str, package: str | None = None) -> ModuleType:
    """Import ``module`` for ``feature`` (a phrase: "the loss-curve PNG"), or raise a
    ``MissingExtraError`` of one line: "the loss-curve PNG needs matplotlib: pip install
    'teeny-triton[train]'". ``package``: the optional package (an import name in ``PACKAGES``)
    when it is not ``module``'s top level (``torch.utils.tensorboard`` needs ``tensorboard``).
    An ImportError from inside an installed package (a broken install) is raised as it is."""
    package = package or module.partition(".")[0]
    if package not in PACKAGES:
        raise KeyError(f"require: {package!r} is not an optional package of teeny (PACKAGES)")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name not in (package, module):
            raise
        raise MissingExtraError(f"{feature} needs {PACKAGES[package][0]}: {install_hint(package)}") from None


def optional(module: str) -> ModuleType | None:
    """``module``, or None when it is not installed, for a feature that works without it (less
    well: ``DEGRADED`` says how)."""
    if module.partition(".")[0] not in DEGRADED:
        raise KeyError(f"optional: {module!r} has no entry in DEGRADED; a feature that needs it uses require()")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != module.partition(".")[0]:
            raise
        return None
