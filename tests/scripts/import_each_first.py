"""test_imports.py's fresh-process check: each module named in argv, imported first in a child
forked from a Python that has imported only torch; prints the list of (module, error) that failed.

    PYTHONPATH=src python tests/scripts/import_each_first.py teeny.core.graph teeny.ops
"""

import importlib
import multiprocessing
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # as a fresh Python starts: teeny.core.device decides
import torch  # noqa: E402, F401  (imports no triton; each child starts from here)


def child(name, results):
    try:
        importlib.import_module(name)
        results.put((name, None))
    except Exception as exc:
        results.put((name, f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    fork = multiprocessing.get_context("fork")
    results, failed = fork.Queue(), []
    for name in sys.argv[1:]:
        process = fork.Process(target=child, args=(name, results))
        process.start()
        process.join()
        found = results.get(timeout=60)
        if found[1] is not None:
            failed.append(found)
    print(failed)
