"""test_install.py: teeny without its extras, and what ``import teeny.torch`` loads.

python tests/scripts/without_extras.py core sklearn tqdm ...            # import, lower, run without them
python tests/scripts/without_extras.py train sklearn tqdm ... -- --log png  # `teeny train mlp ARGS` without them
python tests/scripts/without_extras.py loaded transformers teeny.aot ...   # which of these `import teeny.torch` loads

Prints one line of JSON: what the test checks.
"""

import json
import sys


def block(names) -> None:
    """Make the named packages unimportable, as if they were not installed: ``None`` in
    ``sys.modules`` fails their import (ImportError naming the package) and makes
    ``importlib.util.find_spec`` answer None, as torch._dynamo's trace rules ask of several."""
    for name in names:
        sys.modules[name] = None


def core() -> dict:
    """Import teeny, lower and run a small training graph, and see what the optional helpers say."""
    import torch

    import teeny
    import teeny.ops
    import teeny.torch
    from teeny import Executor, Graph, LoweringMode, lower, ops
    from teeny.core import extras

    g = Graph()
    x = g.input("x", (4, 8))
    w = g.parameter("w", (8, 3))
    g.output(ops.sum(ops.relu(ops.matmul(x, w))))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    loss, cache = ex.forward_train({"x": torch.ones(4, 8)})
    ex.backward(cache)
    y = teeny.torch.apply(lambda t: ops.relu(t), torch.tensor([-1.0, 2.0]))
    return {
        "loss_finite": bool(torch.isfinite(loss)),
        "grad_shape": list(ex.grads["w"].shape),
        "apply": y.tolist(),
        "registered": hasattr(torch.ops.teeny, "gelu"),
        "optional": {name: extras.optional(name) is not None for name in extras.DEGRADED},
    }


def train(argv) -> dict:
    """``teeny train mlp`` (one step) with ``argv`` added: its exit code and what it printed on stderr."""
    import contextlib
    import io
    import tempfile

    from teeny.cli import main

    err = io.StringIO()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stderr(err):
        code = main(["train", "mlp", "--epochs", "1", "--steps", "1", "--out", out, *argv])
    return {"code": code, "stderr": err.getvalue()}


def loaded(watched) -> dict:
    """Which of ``watched`` modules ``import teeny.torch`` brought into ``sys.modules``."""
    import teeny.torch  # noqa: F401

    return {"loaded": sorted(name for name in watched if name in sys.modules)}


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    names, args = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    if mode == "loaded":
        result = loaded(names)
    else:
        block(names)
        result = core() if mode == "core" else train(args)
    print(json.dumps(result))
