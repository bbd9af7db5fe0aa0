"""The `teeny` command: ops listing and gradcheck, human and JSON output, exit codes."""

import json

from teeny.cli import main
from teeny.ops import all_ops


def test_ops_lists_every_registered_op_with_backward_and_dtypes(capsys):
    assert main(["ops", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["name"] for r in rows}
    assert names == {i.name for i in all_ops()}
    expected = {
        "relu",
        "gelu",
        "softmax",
        "linear",
        "matmul",
        "cross_entropy",
        "layer_norm",
        "sum",
        "mean",
        "mse_loss",
        "add",
        "mul",
        "sub",
        "scaled_dot_product_attention",
        "conv2d",
        "embedding",
        "dropout",
        "max_pool2d",
    }
    assert expected <= names, expected - names
    for r in rows:
        assert r["backward"] is True, r
        assert {"float32", "float64"} <= set(r["dtypes"]), r
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "relu" in out and "with a backward" in out


def test_gradcheck_command_passes_and_reports(capsys):
    assert main(["gradcheck", "relu", "softmax", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == ["relu", "softmax"]
    assert all(r["status"] == "ok" and r["samples"] >= 1 for r in rows)
    assert main(["gradcheck", "gelu"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


def test_gradcheck_command_fails_loudly(capsys, monkeypatch):
    import torch

    from teeny.registry import OPS, OpInfo, Sample
    from test_core import WrongGradSquare  # its backward is twice too large

    bad = OpInfo(
        "wrong_grad_square",
        lambda x: x.graph.apply(WrongGradSquare(), [x]),
        lambda x: 1.5 * x * x,
        lambda dtype, gen: [Sample((torch.randn(3, 4, dtype=dtype, generator=gen),), name="3x4")],
    )
    monkeypatch.setitem(OPS, "wrong_grad_square", bad)
    assert main(["gradcheck", "wrong_grad_square"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "numerical" in out and "0 passed, 1 failed" in out
    assert main(["gradcheck", "nonexistent_op"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_command_runs_in_a_fresh_process():
    """As a user runs it: a new interpreter, nothing imported first (catches import-order bugs)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "teeny.cli", "ops", "--json"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == len(all_ops())
