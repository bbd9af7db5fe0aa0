"""The training loop's callbacks (``teeny.training.callbacks``): what a user's callback hears and
when, and the TensorBoard writer (``teeny train --log tensorboard``). The JSONL and PNG writers are
rebuilt on the same hooks; test_training.py and test_run_folder.py check their files as before, and
here the JSONL rows are compared with what a callback received."""

import json
import sys

import pytest

from helpers import regression_task
from teeny.cli import main
from teeny.training.callbacks import Callback
from teeny.training.loop import CHECKPOINT_NAME, DivergedError, TrainConfig, train


def _task():
    task, _ = regression_task(evaluate=lambda params: {"val_loss": 0.25})
    return task


def _config(out, **kw):
    settings = dict(epochs=2, batch_size=16, lr=0.05, optimizer="sgd", out=out and str(out), progress=False)
    return TrainConfig(**{**settings, **kw})


def _quiet(*args, **kwargs):
    pass


class Recorder(Callback):
    """Every call, in order."""

    def __init__(self, stop_at_step=None):
        self.calls, self.stop_at_step = [], stop_at_step

    def on_train_start(self, run):
        self.calls.append(("start", run.start_step))

    def on_step(self, step, metrics):
        self.calls.append(("step", step, metrics))
        if step == self.stop_at_step:
            raise KeyboardInterrupt  # the run is killed here, past its last checkpoint

    def on_eval(self, epoch, metrics):
        self.calls.append(("eval", epoch, metrics))

    def on_checkpoint(self, path, step):
        self.calls.append(("checkpoint", path.name, step))

    def on_train_end(self, run):
        self.calls.append(("end", run.error, run.diverged))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


# ------------------------------------------------------------------------- a user's callback


def test_a_callback_hears_every_step_evaluation_and_checkpoint_in_order(tmp_path):
    recorder = Recorder()
    train(_task(), _config(tmp_path, checkpoint_every=4), log=_quiet, callbacks=[recorder])
    kinds = [(call[0], call[1]) for call in recorder.calls]
    steps = [("step", s) for s in range(1, 13)]
    assert kinds == [
        ("start", 0),
        *steps[:4],
        ("checkpoint", CHECKPOINT_NAME),
        *steps[4:6],
        ("eval", 0),
        *steps[6:8],
        ("checkpoint", CHECKPOINT_NAME),
        *steps[8:12],
        ("checkpoint", CHECKPOINT_NAME),
        ("eval", 1),
        ("end", None),
    ]
    assert [call[2] for call in recorder.calls if call[0] == "checkpoint"] == [4, 8, 12]
    assert recorder.calls[-1] == ("end", None, None)
    # the metrics are metrics.jsonl's rows, line for line
    assert [call[2] for call in recorder.calls if call[0] in ("step", "eval")] == _rows(tmp_path / "metrics.jsonl")
    step_row, eval_row = recorder.calls[1][2], next(call[2] for call in recorder.calls if call[0] == "eval")
    assert list(step_row) == ["step", "epoch", "loss", "lr"] and step_row["step"] == 1 and step_row["epoch"] == 0
    assert list(eval_row) == ["step", "epoch", "train_loss", "val_loss"] and eval_row["step"] == 6


def test_a_callback_hears_the_run_without_a_folder_and_its_divergence(tmp_path):
    recorder = Recorder()
    train(_task(), _config(None, epochs=1), log=_quiet, callbacks=[recorder])
    kinds = [call[0] for call in recorder.calls]
    assert kinds.count("step") == 6 and "eval" in kinds and "checkpoint" not in kinds
    recorder = Recorder()
    with pytest.raises(DivergedError) as info:
        train(_task(), _config(tmp_path, lr=1e30, momentum=0.0), log=_quiet, callbacks=[recorder])
    (_, error, (step, why)) = recorder.calls[-1]
    assert error is info.value and str(info.value).startswith(f"step {step}: {why}")
    assert recorder.calls[-2][0] == "step" and recorder.calls[-2][2]["loss"] is None  # strict JSON: no inf, no nan
    assert _rows(tmp_path / "metrics.jsonl")[-1] == {"step": step, "event": "diverged", "detail": why}


# ------------------------------------------------------------------------------ TensorBoard


def test_teeny_train_log_tensorboard_writes_the_loss_of_every_step(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    argv = ["train", "mlp", "--epochs", "1", "--steps", "3", "--out", str(out), "--no-progress"]
    assert main([*argv, "--log", "jsonl,tensorboard"]) == 0
    assert "checkpoint, metrics.jsonl and events.out.tfevents.* in" in capsys.readouterr().out
    checkpoint, events, *rest = sorted(p.name for p in out.iterdir())
    assert checkpoint == CHECKPOINT_NAME and events.startswith("events.out.tfevents.") and rest == ["metrics.jsonl"]
    losses = [(row["step"], row["loss"]) for row in _rows(out / "metrics.jsonl") if "loss" in row]
    assert [step for step, _ in losses] == [1, 2, 3]
    assert _scalars(out, "loss") == [(step, pytest.approx(loss, rel=1e-6)) for step, loss in losses]
    assert [step for step, _ in _scalars(out, "train_loss")] == [3]  # the epoch's row, at its step


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    config = _config(tmp_path, epochs=1, checkpoint_every=2, log_to=("jsonl", "tensorboard"))
    killed = Recorder(stop_at_step=3)
    with pytest.raises(KeyboardInterrupt):  # step 3 is logged (writers come first), then the run dies
        train(_task(), config, log=_quiet, callbacks=[killed])
    assert killed.calls[-1][0] == "end" and isinstance(killed.calls[-1][1], KeyboardInterrupt)
    assert [step for step, _ in _scalars(tmp_path, "loss")] == [1, 2, 3]
    train(_task(), config, resume=str(tmp_path / CHECKPOINT_NAME), log=_quiet)
    assert [step for step, _ in _scalars(tmp_path, "loss")] == [1, 2, 3, 4, 5, 6]  # step 3 once, from the resumed run
    assert [row["step"] for row in _rows(tmp_path / "metrics.jsonl") if "loss" in row] == [1, 2, 3, 4, 5, 6]
    train(_task(), config, log=_quiet)  # a fresh run: the earlier run's event files go
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_a_missing_or_unknown_writer_is_refused_in_one_line_before_training(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "mlp", "--epochs", "1", "--steps", "1", "--out", str(out), "--no-progress"]
    assert main([*argv, "--log", "jsonl,csv"]) == 2
    err = capsys.readouterr().err
    assert err == "teeny train: unknown metrics writer 'csv'; choose from jsonl, png, tensorboard\n"
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    assert main([*argv, "--log", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "needs tensorboard: pip install 'teeny-triton[train]'" in err and err.count("\n") == 1
    assert not out.exists()
