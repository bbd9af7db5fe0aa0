"""Callbacks: what the training loop tells the world as it trains, and the writers built on them.

``train(task, config, callbacks=[...])`` calls each callback, on rank 0 only, in this order:

* ``on_train_start(run)`` once, before the first step (``run``: the folder, the configuration, the
  model's name, the step it starts from),
* ``on_step(step, metrics)`` for every step, in order, when its loss is read back (every
  ``log_every`` steps): ``{"step", "epoch", "loss", "lr"}``,
* ``on_eval(epoch, metrics)`` at the end of each epoch: ``{"step", "epoch", "train_loss", **evaluate()}``
  (``train_loss``: the mean loss of the epoch's steps; the rest: what the task's ``evaluate`` returned),
* ``on_checkpoint(path, step)`` after each checkpoint is in place,
* ``on_train_end(run)`` once, however training ended: ``run.error`` is what it raised (None: it
  finished), ``run.diverged`` the step and reason when the loss diverged.

``metrics`` are the rows ``metrics.jsonl`` holds: plain dicts of ints and floats, strict JSON (a
non-finite value arrives as None); ``epoch`` counts from 0. A resumed run starts at the step after
its checkpoint's. An exception in a callback stops training like any other error.

The built-in writers are callbacks too, chosen by name with ``TrainConfig.log_to`` (``teeny train
--log jsonl,png,tensorboard``; default jsonl and png), each writing into the run's folder (or the
folder it was given): ``JsonlMetrics`` (``metrics.jsonl``), ``LossCurvePng`` (``loss.png``, needs
matplotlib) and ``TensorBoard`` (``events.out.tfevents.*`` through torch's ``SummaryWriter``, needs
the tensorboard package).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..core.extras import require


@dataclass
class Run:
    """What callbacks are told about the run. ``out``: its folder (None when ``config.out`` is unset);
    ``start_step``: 0, or the step of the checkpoint it resumed; ``continues``: it resumed the checkpoint
    in its own folder, whose files hold its history up to ``start_step``. Set before ``on_train_end``:
    ``error``, what training raised (None: it finished), and ``diverged``, (step, why) when the loss
    diverged (``error`` is then the ``DivergedError``)."""

    out: Path | None
    config: Any  # its teeny.training.loop.TrainConfig (not imported: the loop imports this module)
    model: str
    start_step: int = 0
    continues: bool = False
    error: BaseException | None = None
    diverged: tuple[int, str] | None = None


class Callback:
    """Base of training callbacks: override the hooks you need; each does nothing here."""

    def on_train_start(self, run: Run) -> None:
        """Training is about to take its first step."""

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` is done: ``{"step", "epoch", "loss", "lr"}``."""

    def on_eval(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Epoch ``epoch`` is done and evaluated: ``{"step", "epoch", "train_loss", **evaluate()}``."""

    def on_checkpoint(self, path: Path, step: int) -> None:
        """The checkpoint of step ``step`` is in place at ``path``."""

    def on_train_end(self, run: Run) -> None:
        """Training ended (``run.error``: None when it finished)."""


class CallbackList(Callback):
    """Calls each hook of every callback in turn. ``end(error)`` calls ``on_train_end`` once, and only
    after ``on_train_start``: a run refused before its first step tells the callbacks nothing."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.callbacks = list(callbacks)
        self.run: Run | None = None

    def on_train_start(self, run: Run) -> None:
        self.run = run
        for callback in self.callbacks:
            callback.on_train_start(run)

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_step(step, metrics)

    def on_eval(self, epoch: int, metrics: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_eval(epoch, metrics)

    def on_checkpoint(self, path: Path, step: int) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(path, step)

    def on_train_end(self, run: Run) -> None:
        for callback in self.callbacks:
            callback.on_train_end(run)

    def end(self, error: BaseException | None) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.error = error
            self.on_train_end(run)


# ------------------------------------------------------------------------------ writers


def _optional(module: str, package: str, writer: str) -> ModuleType:
    """Import ``module`` for ``writer``, or refuse in one line naming the extra that brings ``package``
    (``teeny.core.extras.MissingExtraError``, exit code 2: refused before training)."""
    return require(module, f"the {writer} writer (--log {writer})", package=package)


class FileWriter(Callback):
    """A writer of files in one folder: the one given, else the run's. ``files``: the name (a glob
    where there are several) of what it writes there; a run that does not resume its folder removes
    an earlier run's (``teeny.training.loop``)."""

    files: str

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else None

    def _folder(self, run: Run) -> Path:
        folder = self.folder or run.out
        if folder is None:
            raise ValueError(f"{type(self).__name__} has no folder to write to: give it one, or set TrainConfig.out")
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def read_rows(path: Path, until: int) -> list[dict]:
    """The rows of a metrics.jsonl up to step ``until`` (those after it were written by a run that went
    on past its last checkpoint); none if there is no file. A line torn by a crash is skipped."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= until:
            rows.append(row)
    return rows


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row, allow_nan=False) + "\n"


class JsonlMetrics(FileWriter):
    """``metrics.jsonl``: one strict-JSON line per step and per evaluation, as each arrives (a crash
    keeps every line before it), and ``{"step", "event": "diverged", "detail"}`` when the loss
    diverged. A run that continues its folder keeps the lines up to its checkpoint's step; any other
    run starts the file afresh."""

    files = "metrics.jsonl"

    def on_train_start(self, run: Run) -> None:
        self.path = self._folder(run) / self.files
        kept = read_rows(self.path, run.start_step) if run.continues else []
        with open(self.path, "w") as f:
            f.writelines(_line(row) for row in kept)

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(_line(row))

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._append(metrics)

    def on_eval(self, epoch: int, metrics: dict[str, Any]) -> None:
        self._append(metrics)

    def on_train_end(self, run: Run) -> None:
        if run.diverged is not None:
            step, why = run.diverged
            self._append({"step": step, "event": "diverged", "detail": why})


class LossCurvePng(FileWriter):
    """``loss.png``: the training loss of every step and the validation loss of every epoch (with
    the unigram entropy where the task reports one), drawn when training finishes or diverges (a
    run that continues its folder draws its history from metrics.jsonl too)."""

    files = "loss.png"

    def __init__(self, folder: str | os.PathLike | None = None):
        super().__init__(folder)
        _optional("matplotlib", "matplotlib", "png")  # refused before training, not at its end

    def on_train_start(self, run: Run) -> None:
        self.path = self._folder(run) / self.files
        history = run.out / JsonlMetrics.files if run.continues and run.out else None
        self.rows = read_rows(history, run.start_step) if history else []

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append(metrics)

    def on_eval(self, epoch: int, metrics: dict[str, Any]) -> None:
        self.rows.append(metrics)

    def on_train_end(self, run: Run) -> None:
        if self.rows and (run.error is None or run.diverged is not None):
            plot_losses(self.rows, self.path)


def plot_losses(rows: list[dict], path: Path) -> None:
    """Draw the loss curves of metrics rows (those without a loss or val_loss are skipped) into ``path``."""
    matplotlib = require("matplotlib", "the loss-curve PNG")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s for s, _ in points], [v for _, v in points], label="train loss")
    evals = [r for r in rows if r.get("val_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
        if "unigram_entropy" in evals[-1]:
            ax.axhline(evals[-1]["unigram_entropy"], color="gray", linestyle="--", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class TensorBoard(FileWriter):
    """TensorBoard event files (``tensorboard --logdir <folder>``): every metric as a scalar under its
    metrics.jsonl name (``loss``, ``lr``, ``train_loss``, ``val_loss``, ...) at its step. A run that
    continues its folder purges the steps after its checkpoint from the earlier files."""

    files = "events.out.tfevents.*"

    def __init__(self, folder: str | os.PathLike | None = None):
        super().__init__(folder)
        self.summary_writer = _optional("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.writer = None

    def on_train_start(self, run: Run) -> None:
        purge_step = run.start_step + 1 if run.continues else None
        self.writer = self.summary_writer(log_dir=str(self._folder(run)), purge_step=purge_step)

    def _scalars(self, step: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            if name not in ("step", "epoch") and value is not None:
                self.writer.add_scalar(name, value, step)

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._scalars(step, metrics)

    def on_eval(self, epoch: int, metrics: dict[str, Any]) -> None:
        self._scalars(metrics["step"], metrics)

    def on_train_end(self, run: Run) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


WRITERS: dict[str, type[FileWriter]] = {"jsonl": JsonlMetrics, "png": LossCurvePng, "tensorboard": TensorBoard}
