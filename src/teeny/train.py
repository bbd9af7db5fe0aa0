"""The training loop: batches -> forward_train -> backward -> (clip) -> optimizer step, with
evaluation, a progress bar, metrics as JSON lines, a loss curve PNG, and checkpoints that
resume exactly.

A checkpoint (safetensors) holds the parameters, the optimizer state and the position (global
step). Data order is a function of (seed, epoch), so a run resumed from the checkpoint of step
s sees the same batches from step s on as an uninterrupted run, and ends with the same
parameters. Checkpoints are written to a temporary file, flushed, and renamed over the old one,
so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .executor import Executor
from .graph import Graph
from .lowering import LoweringMode, lower
from .optim import OPTIMIZERS, Optimizer, clip_grad_norm, constant_schedule, cosine_schedule
from .rewrites import PRECISIONS

CHECKPOINT_FORMAT = "teeny-checkpoint-1"


class CheckpointError(Exception):
    """A checkpoint cannot be used: unreadable, truncated, or for another model."""


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.9
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    clip: float | None = None
    seed: int = 0
    out: str | None = "runs/latest"
    checkpoint_every: int | None = None  # steps; None = at the end of each epoch
    max_steps: int | None = None  # stop after this many steps in total (e.g. to test resuming)
    progress: bool = True
    dtype: torch.dtype = torch.float32
    precision: str | None = None  # None: the graph's dtypes; "bf16-mixed": bfloat16 compute, float32 master weights
    cuda_graph: bool | None = None  # None: on when the executor runs on a GPU
    log_every: int | None = None  # read the loss back (a synchronisation) every N steps; None: 1 on CPU, 20 on GPU

    def validate(self) -> None:
        checks = [
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"learning rate must be > 0, got {self.lr}"),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}",
            ),
            (self.schedule in ("constant", "cosine"), f"unknown schedule {self.schedule!r}; choose constant or cosine"),
            (self.clip is None or self.clip > 0, f"clip must be > 0, got {self.clip}"),
            (self.weight_decay >= 0, f"weight decay must be >= 0, got {self.weight_decay}"),
            (
                self.precision is None or self.precision in PRECISIONS,
                f"unknown precision {self.precision!r}; choose {', '.join(PRECISIONS)} (or none)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def make_optimizer(executor: Executor, config: TrainConfig) -> Optimizer:
    cls = OPTIMIZERS[config.optimizer]
    if config.optimizer == "sgd":
        return cls(executor, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return cls(executor, lr=config.lr, weight_decay=config.weight_decay)


# ------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    path: str | os.PathLike, executor: Executor, optimizer: Optimizer, step: int, meta: dict | None = None
) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{k}": v.detach().cpu().contiguous() for k, v in executor.params.items()}
    tensors.update({f"optim/{k}": v.detach().cpu().contiguous() for k, v in optimizer.state_dict().items()})
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "step": str(step),
        "optimizer": type(optimizer).__name__,
        **{k: str(v) for k, v in (meta or {}).items()},
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """(params, optimizer state, metadata); refuses unreadable or truncated files."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt): {exc}") from None
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a teeny checkpoint (format {metadata.get('format')!r})")
    params = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
    state = {k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")}
    return params, state, metadata


# ------------------------------------------------------------------------------ tasks


@dataclass
class CallableTask:
    """A training task from plain functions, for your own graph and data:

    * ``build(batch_size)`` returns the training ``Graph`` (its first output is the loss),
    * ``batches(epoch, batch_size, seed)`` yields input feeds (dicts of tensors) in an order
      fixed by its arguments (so that resuming is exact),
    * ``steps_per_epoch(batch_size)`` says how many it yields,
    * ``evaluate(params)`` (optional) returns metrics from the current parameters.
    """

    name: str
    build: Callable[[int], Graph]
    batches: Callable[[int, int, int], Iterable[dict]]
    steps_per_epoch: Callable[[int], int]
    evaluate: Callable[[dict], dict] = lambda params: {}

    def train_graph(self, batch_size: int, dtype: torch.dtype = torch.float32):
        return self.build(batch_size)


# ------------------------------------------------------------------------- one step


class TrainStep:
    """zero_grad, forward_train, backward, optional clipping and the optimizer update.

    On a GPU the whole step is a fixed sequence of launches over static shapes, so with
    ``cuda_graph=True`` it is captured once as a CUDA graph and replayed: the first call runs
    eagerly (compiling every kernel), the second captures, later ones copy the batch into the
    static input buffers and replay. The learning rate and step count reach the optimizer
    kernels through device memory (``Optimizer.prepare``), so schedules keep working.
    Returns the loss as a device tensor (reading it is the caller's choice: it synchronises).
    """

    def __init__(self, executor: Executor, optimizer: Optimizer, clip: float | None = None, cuda_graph: bool = False):
        blockers = [p.node.name for p in executor.program.nodes if not p.op.capturable]
        if cuda_graph and blockers:
            import warnings

            warnings.warn(
                f"not capturing the step as a CUDA graph: {', '.join(blockers)} change per run; training eagerly",
                stacklevel=2,
            )
            cuda_graph = False
        if cuda_graph and executor.device.type != "cuda":
            raise ValueError("CUDA graphs need the GPU")
        self.executor, self.optimizer, self.clip, self.cuda_graph = executor, optimizer, clip, cuda_graph
        self.calls = 0
        self.graph = None
        self.static_feed: dict[str, torch.Tensor] = {}
        self.static_loss = None

    def _body(self, feed) -> torch.Tensor:
        self.executor.zero_grad()
        outputs, cache = self.executor.forward_train(feed)
        loss = outputs[0] if isinstance(outputs, tuple) else outputs
        self.executor.backward(cache)
        if self.clip:
            clip_grad_norm(self.executor, self.clip)
        self.optimizer.launch()
        return loss

    def __call__(self, feed: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        self.optimizer.prepare()
        if not self.cuda_graph or self.calls == 1:
            return self._body(feed)
        if self.graph is None:
            device = self.executor.device
            self.static_feed = {k: v.to(device, copy=True) for k, v in feed.items()}
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.static_loss = self._body(self.static_feed)
            except Exception as exc:  # an op that cannot be captured: say so and run eagerly
                import warnings

                warnings.warn(
                    f"CUDA graph capture failed ({type(exc).__name__}: {exc}); training eagerly", stacklevel=2
                )
                self.cuda_graph = False
                torch.cuda.synchronize(device)
                return self._body(feed)
            self.graph = graph
        else:
            for k, v in feed.items():
                self.static_feed[k].copy_(v, non_blocking=True)
        self.graph.replay()
        return self.static_loss


# ------------------------------------------------------------------------------ loop


class MetricsLog:
    def __init__(self, out: Path | None):
        self.path = out / "metrics.jsonl" if out else None
        self.rows: list[dict] = []

    def write(self, **row) -> None:
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def plot_losses(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, label="train loss")
    evals = [r for r in rows if "val_loss" in r]
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


def train(task, config: TrainConfig, resume: str | None = None, log=print) -> dict:
    """Train ``task``'s model; returns the final metrics (and writes logs and checkpoints to
    ``config.out`` when set)."""
    config.validate()
    out = Path(config.out) if config.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    graph = task.train_graph(config.batch_size, config.dtype)
    executor = Executor(lower(graph, LoweringMode.TRAINING, precision=config.precision), seed=config.seed)
    optimizer = make_optimizer(executor, config)
    steps_per_epoch = task.steps_per_epoch(config.batch_size)
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {config.batch_size} is larger than the training set")
    total_steps = steps_per_epoch * config.epochs
    schedule = cosine_schedule(total_steps, config.warmup_steps) if config.schedule == "cosine" else constant_schedule()
    on_gpu = executor.device.type == "cuda"
    use_graph = on_gpu if config.cuda_graph is None else config.cuda_graph
    log_every = config.log_every or (20 if on_gpu else 1)
    train_step = TrainStep(executor, optimizer, config.clip, cuda_graph=use_graph)
    step = 0
    if resume:
        params, state, meta = load_checkpoint(resume)
        try:
            executor.load_params(params)
            optimizer.load_state_dict(state)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {resume} does not fit model {task.name}: {exc}") from None
        step = int(meta["step"])
        log(f"resumed from {resume} at step {step}")
    metrics = MetricsLog(out)
    last_eval: dict = {}
    stop_at = min(total_steps, config.max_steps) if config.max_steps is not None else total_steps
    progress = None
    if config.progress:
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=True)
    t_start, samples = time.perf_counter(), 0
    try:
        for epoch in range(step // steps_per_epoch, config.epochs):
            skip = step - epoch * steps_per_epoch  # batches already done in this epoch (resuming)
            epoch_loss, epoch_batches = torch.zeros((), dtype=torch.float64, device=executor.device), 0
            for index, feed in enumerate(task.batches(epoch, config.batch_size, config.seed)):
                if index < skip:
                    continue
                if step >= stop_at:
                    break
                optimizer.lr = config.lr * schedule(step)
                loss = train_step(feed)
                step += 1
                samples += config.batch_size
                epoch_batches += 1
                epoch_loss += loss.detach().double()  # stays on the device: no synchronisation
                if step % log_every == 0 or step == stop_at:
                    loss_value = float(loss)
                    metrics.write(step=step, epoch=epoch, loss=loss_value, lr=optimizer.lr)
                    if progress is not None:
                        rate = samples / max(time.perf_counter() - t_start, 1e-9)
                        progress.set_postfix(loss=f"{loss_value:.4f}", samples_per_s=f"{rate:.0f}")
                if progress is not None:
                    progress.update(1)
                if out and config.checkpoint_every and step % config.checkpoint_every == 0:
                    save_checkpoint(out / "checkpoint.safetensors", executor, optimizer, step)
            if step >= stop_at and epoch_batches == 0:
                break
            finished_epoch = step % steps_per_epoch == 0 or step >= stop_at
            if epoch_batches and finished_epoch:
                last_eval = task.evaluate(executor.params)
                mean_loss = float(epoch_loss) / epoch_batches
                metrics.write(step=step, epoch=epoch, train_loss=mean_loss, **last_eval)
                shown = ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
                line = f"epoch {epoch + 1}/{config.epochs}: loss {mean_loss:.4f}, {shown}"
                (progress.write if progress is not None else log)(line)
                if out and not config.checkpoint_every:
                    save_checkpoint(out / "checkpoint.safetensors", executor, optimizer, step)
            if step >= stop_at:
                break
    finally:
        if progress is not None:
            progress.close()
    elapsed = time.perf_counter() - t_start
    if out:
        save_checkpoint(out / "checkpoint.safetensors", executor, optimizer, step)
    if out and metrics.rows:
        plot_losses(metrics.rows, out / "loss.png")
    result = {"step": step, "seconds": elapsed, "samples_per_s": samples / max(elapsed, 1e-9), **last_eval}
    if getattr(task, "block_size", None):
        result["tokens_per_s"] = result["samples_per_s"] * task.block_size
    result["executor"] = executor
    return result
