"""test_imports.py's fresh-process check: each module named in argv, imported first in a child
forked from a Python that has imported only torch; prints the list of (module, error) that failed.

    PYTHONPATH=src python tests/scripts/import_each_first.py teeny.core.graph teeny.ops

Two things make it cheaper without changing what a child runs:

* A module whose package, imported first, had already imported it needs no child of its own:
  importing ``teeny.ops.norm.kernels`` first imports ``teeny``, then ``teeny.ops`` (whose
  ``__init__`` imports every op module, that one included), then finds it in ``sys.modules``:
  the very same modules run in the very same order as when ``teeny.ops`` is imported first.
  Names are taken in sorted order (a package before its modules) and a module is skipped when a
  package above it imported it in a child that succeeded.
* Under the Triton interpreter, Triton's import is most of a child's time (about 0.2 s of 0.4),
  so the parent imports triton once, as ``teeny.core.device`` would (``TRITON_INTERPRET=1``:
  ``triton.language`` decorates its own functions for the interpreter at import), and takes
  every triton module out of ``sys.modules`` again. A child starts with no triton module, as a
  fresh Python does, and its first ``import triton...`` puts the parent's modules back (all of
  them at once, as importing ``triton`` itself would) instead of running them again. What the
  test looks for is unchanged: a teeny module that imports triton before ``teeny.core.device``
  has chosen still leaves ``triton.language`` in ``sys.modules`` when the device module
  decides, which refuses it; no teeny module is ever imported in the parent. (Whether teeny
  will choose the interpreter is asked in a child: the parent never touches CUDA, which a
  forked child could not use after it. On a GPU each child imports triton itself.)
"""

import importlib
import importlib.abc
import importlib.machinery
import multiprocessing
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # as a fresh Python starts: teeny.core.device decides
import torch  # noqa: E402  (imports no triton; each child starts from here)

FORK = multiprocessing.get_context("fork")
# what teeny's modules import of triton (the rest, if any, a child imports itself)
TRITON = (
    "triton.language",
    "triton.language.extra.libdevice",
    "triton.runtime.interpreter",
    "triton.compiler.code_generator",
    "triton.experimental.gluon",
    "triton.experimental.gluon.language.nvidia.hopper",
    "triton.experimental.gluon.nvidia.hopper",
)
HIDDEN: dict = {}  # the triton modules the parent imported, out of sys.modules until a child asks
SPECS: dict = {}


def _ask_interpreter(answer) -> None:
    choice = os.environ.get("TEENY_DEVICE", "auto").strip().lower() or "auto"
    answer.put(choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()))


def _chooses_interpreter() -> bool:
    """Whether teeny.core.device will choose the interpreter (as it decides it), asked in a child."""
    answer = FORK.Queue()
    process = FORK.Process(target=_ask_interpreter, args=(answer,))
    process.start()
    process.join()
    return answer.get(timeout=60)


def _import_triton_hidden() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    for name in TRITON:
        importlib.import_module(name)
    os.environ.pop("TRITON_INTERPRET")
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        HIDDEN[name] = sys.modules.pop(name)
        SPECS[name] = HIDDEN[name].__spec__
    assert "triton.language" in HIDDEN and not any(n == "teeny" or n.startswith("teeny.") for n in sys.modules)


class _Unhide(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The first import of a hidden module puts every hidden module back into ``sys.modules``
    and gives that one (its code already ran in the parent)."""

    def find_spec(self, name, path=None, target=None):
        if name not in HIDDEN:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        module = HIDDEN[spec.name]
        for name, hidden in HIDDEN.items():
            sys.modules.setdefault(name, hidden)
        HIDDEN.clear()
        return module

    def exec_module(self, module):
        module.__spec__ = SPECS[module.__name__]  # the import system set our spec on it


def child(name, results):
    sys.meta_path.insert(0, _Unhide())
    try:
        importlib.import_module(name)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    results.put((name, error, [m for m in sys.modules if m == "teeny" or m.startswith("teeny.")]))


def _packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


if __name__ == "__main__":
    if _chooses_interpreter():
        _import_triton_hidden()
    results, failed, imported = FORK.Queue(), [], {}  # imported: package -> what importing it first imported
    for name in sorted(sys.argv[1:]):
        if any(name in imported.get(package, ()) for package in _packages(name)):
            continue  # the same imports, in the same order, as that package's child ran
        process = FORK.Process(target=child, args=(name, results))
        process.start()
        process.join()
        found, error, modules = results.get(timeout=60)
        if error is not None:
            failed.append((found, error))
        else:
            imported[found] = set(modules)
    print(failed)
