"""The `teeny` command: ops listing and gradcheck, human and JSON output, exit codes."""

import json

import pytest

from teeny.checks.samples import all_ops
from teeny.cli import main


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

    from teeny.checks.registry import OpInfo, Sample
    from teeny.checks.samples import OPS
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


@pytest.mark.slow
def test_command_runs_in_a_fresh_process():
    """As a user runs it: a new interpreter, nothing imported first (catches import-order bugs)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "teeny.cli", "ops", "--json"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == len(all_ops())


def _teeny(*argv, **kwargs):
    """The command in a fresh interpreter, as a user runs it."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "teeny", *argv], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.slow
def test_output_closed_early_ends_quietly():
    """`teeny ops | head` used to end in a BrokenPipeError traceback (`true` reads nothing and
    leaves at once, so the listing always meets a closed pipe)."""
    import subprocess
    import sys

    result = subprocess.run(
        f"{sys.executable} -m teeny ops | true; echo ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.strip() == "141", result.stdout
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.slow
def test_device_cuda_without_a_gpu_is_one_line(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = _teeny("--device", "cuda", "ops")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no CUDA device" in result.stderr, result.stderr


def test_train_refuses_an_unusable_out_before_training(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["train", "mlp", "--out", str(file / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "lies under" in err and "which is a file" in err and "Traceback" not in err


def test_train_resume_with_nothing_left_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "mlp", "--epochs", "1", "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    ckpt = str(out / "checkpoint.safetensors")
    assert main(["train", "mlp", "--epochs", "1", "--steps", "2", "--resume", ckpt, "--no-progress"]) == 0
    assert "nothing left to do" in capsys.readouterr().out
    assert main(["train", "mlp", "--epochs", "1", "--batch-size", "32", "--resume", ckpt, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "batch_size=64" in err and "--batch-size 64" in err and "--allow-change batch_size" in err


def test_the_command_knows_the_models_make_task_builds():
    from teeny.cli import MODELS
    from teeny.training.models import NAMES

    assert MODELS == NAMES


def test_train_torch_model_without_that_function_is_one_line(tmp_path, capsys):
    """`--torch-model file.py:missing` used to end in an AttributeError traceback."""
    model = tmp_path / "model.py"
    model.write_text("def make_model():\n    pass\n")
    assert main(["train", "--torch-model", f"{model}:missing", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{model} defines no function 'missing' (it defines make_model)" in err, err


def test_train_on_several_processes_hands_teenys_options_to_each_process_unread():
    """``teeny train --nproc 2 ... --log jsonl``: torchrun's parser must not read teeny's options
    (``--log`` is an abbreviation of torchrun's own ``--log-dir``): each process gets them as given."""
    import sys

    from teeny.cli import torchrun_options

    argv = ["train", "mlp", "--log", "jsonl", "--out", "runs/x"]
    options = torchrun_options(2, argv)
    assert options.nproc_per_node == "2" and options.no_python
    assert [options.training_script, *options.training_script_args] == [sys.executable, "-m", "teeny", *argv]
