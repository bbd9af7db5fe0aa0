"""The training loop: batches -> forward_train -> backward -> (clip) -> optimizer step, with
evaluation, a progress bar, callbacks that hear of every step, evaluation and checkpoint (the
metrics writers among them: JSON lines, a loss curve PNG, TensorBoard; ``callbacks``), and
checkpoints that resume exactly.

A checkpoint (safetensors) holds the parameters, the optimizer state, the position (global
step), the model's name and the whole training configuration. Data order is a function of
(seed, epoch), so a run resumed from the checkpoint of step s sees the same batches from step s
on as an uninterrupted run, and ends with the same parameters; a resume whose settings would
break that (another batch size, optimizer, learning rate, ... or, under a cosine schedule,
another number of epochs) is refused, naming the setting, unless ``allow_change`` lists it.
Checkpoints are written to a temporary file of their own name, flushed, and renamed over the old
one, so a crash mid-write (or a full disk) leaves the previous checkpoint intact, and no temporary
file survives a failed write. The metadata holds the sha256 of every tensor's bytes; a tensor
changed after it was written is refused on load, by name. A checkpoint's mode follows the umask.

A loss that is not finite, or that grows past ``diverge_factor`` times its first value, stops
training with ``DivergedError`` naming the step; the last checkpoint written is from before it.
``metrics.jsonl`` is strict JSON (a non-finite value is written as null). A run that does not
resume starts a fresh folder: the checkpoint and the writers' files of an earlier run there are
removed. A run owns its folder while it lasts (``RunFolder``: ``<out>/.lock``, holding its PID):
a second run into the same folder is refused, naming the first's PID.

A task must yield as many batches per epoch as its ``steps_per_epoch`` says (the schedule and the
resume position count on it), and ``evaluate`` must return a dict of metric names to numbers;
otherwise ``TaskError`` names the task and what it did.

Under ``torch.distributed`` (``teeny.training.distributed.init()``, e.g. started by torchrun), ``train``
runs data-parallel: the batch size is the global batch, split evenly over the processes; each
sees its rows of every batch (a disjoint shard, fixed by seed, epoch and rank); gradients are
averaged through ``teeny.training.distributed.DataParallel``; only rank 0 prints, calls the callbacks (writes
metrics) and checkpoints.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import numbers
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.extras import optional
from ..core.graph import Graph
from ..fusions import PRECISIONS
from ..program.executor import Executor
from ..program.lowering import LoweringMode, lower
from .callbacks import WRITERS, Callback, CallbackList, Run
from .data import shard
from .optim import OPTIMIZERS, GradScaler, Optimizer, clip_grad_norm, constant_schedule, cosine_schedule

if TYPE_CHECKING:
    from .distributed import DataParallel, World

CHECKPOINT_FORMAT = "teeny-checkpoint-2"
CHECKPOINT_NAME = "checkpoint.safetensors"


# ``exit_code``: what ``teeny`` exits with after printing the error's message (2: bad input, refused
# before training; 1: the run failed)


class CheckpointError(Exception):
    """A checkpoint cannot be used: unreadable, truncated, altered, for another model, or written
    with settings that the resumed run would not continue exactly."""

    exit_code = 2


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a folder taken away); the previous one is kept."""

    exit_code = 1


class RunDirError(ValueError):
    """The output folder cannot hold a run (a file, under a file, not writable, or in use by another run)."""

    exit_code = 2


class TaskError(ValueError):
    """A task broke its contract: fewer or more batches than ``steps_per_epoch`` says, or an
    ``evaluate`` that returns something other than a dict of numbers."""

    exit_code = 2


class DivergedError(RuntimeError):
    """The loss became non-finite or diverged; training stopped."""

    exit_code = 1


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32  # the global batch: split evenly over the processes of a data-parallel run
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
    # None: the graph's dtypes; "bf16-mixed" / "fp16-mixed": half compute, float32 master weights
    # ("fp16-mixed" with dynamic loss scaling: optim.GradScaler)
    precision: str | None = None
    recompute: bool = False  # write norms' and activations' outputs again in the backward (less memory)
    cuda_graph: bool | None = None  # None: on when the executor runs on a GPU
    log_every: int | None = None  # read the losses back (a synchronisation) every N steps; None: 1 on CPU, 20 on GPU
    diverge_factor: float | None = 1e4  # stop at a loss over this times max(|first loss|, 1); None: non-finite only
    zero: bool = False  # data-parallel: shard the optimizer state over the processes (ZeRO stage 1)
    bucket_mb: float = 25.0  # data-parallel: gradient all-reduce bucket size in MiB
    log_to: tuple[str, ...] = ("jsonl", "png")  # the built-in writers of metrics (callbacks.WRITERS), by name

    def validate(self) -> None:
        def finite(x) -> bool:
            return x is None or math.isfinite(x)

        checks = [
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch size must be >= 1, got {self.batch_size}"),
            (self.lr > 0 and finite(self.lr), f"learning rate must be a finite number > 0, got {self.lr}"),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}",
            ),
            (self.schedule in ("constant", "cosine"), f"unknown schedule {self.schedule!r}; choose constant or cosine"),
            (
                self.clip is None or (self.clip > 0 and finite(self.clip)),
                f"clip must be a finite number > 0, got {self.clip}",
            ),
            (
                self.weight_decay >= 0 and finite(self.weight_decay),
                f"weight decay must be a finite number >= 0, got {self.weight_decay}",
            ),
            (self.momentum >= 0 and finite(self.momentum), f"momentum must be finite and >= 0, got {self.momentum}"),
            (self.warmup_steps >= 0, f"warmup steps must be >= 0, got {self.warmup_steps}"),
            (
                self.diverge_factor is None or self.diverge_factor > 1,
                f"diverge_factor must be > 1 or None, got {self.diverge_factor}",
            ),
            (self.bucket_mb > 0 and finite(self.bucket_mb), f"bucket size must be > 0 MiB, got {self.bucket_mb}"),
            (
                self.precision is None or self.precision in PRECISIONS,
                f"unknown precision {self.precision!r}; choose {', '.join(PRECISIONS)} (or none)",
            ),
            *(
                (name in WRITERS, f"unknown metrics writer {name!r}; choose from {', '.join(WRITERS)}")
                for name in self.log_to
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def settings(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (stored in checkpoints)."""
        values = asdict(self)
        values["dtype"] = str(self.dtype).replace("torch.", "")
        values["log_to"] = list(self.log_to)
        return values


# what a resumed run must share with its checkpoint to continue it exactly (epochs too under a
# cosine schedule, whose shape depends on the total number of steps)
EXACT_SETTINGS = (
    "batch_size",
    "lr",
    "optimizer",
    "weight_decay",
    "momentum",
    "schedule",
    "warmup_steps",
    "clip",
    "seed",
    "dtype",
    "zero",
    "world_size",
)


def make_optimizer(executor: Executor, config: TrainConfig) -> Optimizer:
    cls = OPTIMIZERS[config.optimizer]
    if config.optimizer == "sgd":
        return cls(executor, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return cls(executor, lr=config.lr, weight_decay=config.weight_decay)


# ------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    path: str | os.PathLike,
    executor: Executor,
    optimizer: Optimizer,
    step: int,
    meta: dict | None = None,
    optimizer_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write parameters, optimizer state (``optimizer_state`` if given, e.g. gathered from the
    shards of a ZeRO-1 run, else ``optimizer.state_dict()``), step and ``meta`` atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = optimizer.state_dict() if optimizer_state is None else optimizer_state
    tensors = {f"param/{k}": v.detach().cpu().contiguous() for k, v in executor.params.items()}
    tensors.update({f"optim/{k}": v.detach().cpu().contiguous() for k, v in state.items()})
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "step": str(step),
        "optimizer": type(optimizer).__name__,
        **{k: v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()},
    }
    metadata[CHECKSUM_FIELD] = json.dumps({name: _sha256(t) for name, t in tensors.items()}, sort_keys=True)
    from safetensors import SafetensorError

    tmp = None
    try:
        # a name of its own: two writers never share a temporary file (and a crash leaves one `RunFolder.sweep` finds)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a checkpoint is as readable as any file
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:  # a full disk reaches us as either
        kept = "; the checkpoint already there is kept" if path.exists() else ""
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split())
        raise CheckpointWriteError(f"cannot write checkpoint {path}: {reason}{kept}") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


CHECKSUM_FIELD = "sha256"  # metadata: JSON {tensor name: sha256 of its bytes}


def _sha256(tensor: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes as safetensors stores them (C order)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def _umask() -> int:
    """The process's umask (read without changing it where /proc tells it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _meta_json(path: str | os.PathLike, meta: dict[str, str], field: str, default: str) -> Any:
    """The JSON value of metadata ``field`` (``default`` where absent); an error naming file and field."""
    try:
        return json.loads(meta.get(field, default))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: metadata field {field!r} is not valid JSON ({exc})") from None


def _verify(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Compare every tensor with the checksum written beside it; refuse the first that differs."""
    if CHECKSUM_FIELD not in metadata:
        warnings.warn(f"checkpoint {path} has no checksums (written by an older teeny): not verified", stacklevel=3)
        return
    sums = _meta_json(path, metadata, CHECKSUM_FIELD, "{}")
    if not isinstance(sums, dict):
        raise CheckpointError(f"checkpoint {path}: metadata field {CHECKSUM_FIELD!r} is not a dict of checksums")
    missing = sorted(set(sums) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {path}: tensor {missing[0]} is missing (its checksum is in the metadata)")
    for name, tensor in tensors.items():
        if name not in sums:
            raise CheckpointError(f"checkpoint {path}: tensor {name} has no checksum in the metadata")
        if _sha256(tensor) != sums[name]:
            raise CheckpointError(
                f"checkpoint {path}: tensor {name} does not match its checksum: the file was changed or damaged "
                "after it was written"
            )


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """(params, optimizer state, metadata); refuses unreadable, truncated or altered files (each
    tensor is checked against the sha256 written with it), naming the file and what is wrong."""
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
    found = metadata.get("format")
    if found != CHECKPOINT_FORMAT:
        if isinstance(found, str) and found.startswith("teeny-checkpoint-"):
            raise CheckpointError(
                f"{path} was written by another version of teeny ({found}, this one reads {CHECKPOINT_FORMAT}): "
                "its optimizer state is laid out differently, so it cannot be resumed"
            )
        raise CheckpointError(f"{path} is not a teeny checkpoint (format {found!r})")
    step = metadata.get("step", "")
    if not step.isdigit():
        raise CheckpointError(f"checkpoint {path}: metadata field 'step' is {step!r}, not a step number")
    _verify(path, tensors, metadata)
    params = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
    state = {k[len("optim/") :]: v for k, v in tensors.items() if k.startswith("optim/")}
    return params, state, metadata


# the `teeny train` flag of each setting a resume compares; a setting missing here has none
_FLAGS = {
    "batch_size": "--batch-size",
    "lr": "--lr",
    "optimizer": "--optimizer",
    "weight_decay": "--weight-decay",
    "schedule": "--schedule",
    "clip": "--clip",
    "seed": "--seed",
    "zero": "--zero",
    "world_size": "--nproc",
    "epochs": "--epochs",
}


def _as_argument(setting: str, value: Any) -> str:
    """How to ask `teeny train` for ``setting`` = ``value``, in a form its parser accepts."""
    flag = _FLAGS.get(setting)
    if flag is None:
        return f"{setting}={value} (a TrainConfig setting; the command has no flag for it)"
    if value is None or value is False or (setting == "world_size" and value == 1):
        return f"leave out {flag}"
    return flag if value is True else f"{flag} {value}"


def check_resumable(
    path: str | os.PathLike,
    meta: dict[str, str],
    task,
    settings: dict[str, Any],
    allow_change: Iterable[str] = (),
) -> None:
    """Refuse to resume from a checkpoint of another model, or with settings that would not continue
    its run exactly (``settings``: ``TrainConfig.settings()`` plus ``world_size``), unless
    ``allow_change`` names them (``"all"``: any)."""
    model = meta.get("model")
    if model is not None and model != task.name:
        raise CheckpointError(f"checkpoint {path} is of model {model!r}, not {task.name!r}")
    spec = _meta_json(path, meta, "model_spec", "{}")
    if spec != dict(getattr(task, "spec", {})):
        raise CheckpointError(f"checkpoint {path} is of {task.name} {spec}, not {dict(getattr(task, 'spec', {}))}")
    saved = _meta_json(path, meta, "config", "{}")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: metadata field 'config' is not a dict of settings")
    allowed = set(allow_change)
    names = list(EXACT_SETTINGS)
    if "cosine" in (saved.get("schedule"), settings.get("schedule")):
        names.append("epochs")
    if "all" in allowed:
        return
    differ = [k for k in names if k in saved and saved[k] != settings.get(k) and k not in allowed]
    if differ:
        was = ", ".join(f"{k}={saved[k]}" for k in differ)
        now = ", ".join(f"{k}={settings.get(k)}" for k in differ)
        raise CheckpointError(
            f"checkpoint {path} was written with {was}; this run has {now}: resuming would not continue that run "
            f"exactly. Use the checkpoint's settings ({', '.join(_as_argument(k, saved[k]) for k in differ)}), or "
            f"pass --allow-change {','.join(differ)} to resume with the new ones deliberately"
        )


# ------------------------------------------------------------------------------ tasks


@dataclass
class CallableTask:
    """A training task from plain functions, for your own graph and data:

    * ``build(batch_size)`` returns the training ``Graph`` (its first output is the loss),
    * ``batches(epoch, batch_size, seed)`` yields input feeds (dicts of tensors) in an order
      fixed by its arguments (so that resuming is exact),
    * ``steps_per_epoch(batch_size)`` says how many it yields,
    * ``evaluate(params)`` (optional) returns metrics from the current parameters,
    * ``loss_count(feed)`` (optional, for data-parallel runs) says how many terms the loss of a
      feed averages over (default: its rows), so that ranks' losses combine into the global mean.
    """

    name: str
    build: Callable[[int], Graph]
    batches: Callable[[int, int, int], Iterable[dict]]
    steps_per_epoch: Callable[[int], int]
    evaluate: Callable[[dict], dict] = lambda params: {}
    loss_count: Callable[[dict], int] | None = None

    def train_graph(self, batch_size: int, dtype: torch.dtype = torch.float32):
        return self.build(batch_size)


def loss_count(task, feed: dict[str, torch.Tensor]) -> int:
    """How many terms the loss of ``feed`` averages over: the task's ``loss_count(feed)`` if it
    has one, else the rows (first dimension) of the feed's first tensor."""
    count = getattr(task, "loss_count", None)
    if callable(count):
        return int(count(feed))
    first = next(iter(feed.values()))
    return int(first.shape[0]) if first.dim() else 1


# ------------------------------------------------------------------------- one step


class TrainStep:
    """zero_grad, forward_train, backward, optional clipping and the optimizer update.

    On a GPU the whole step is a fixed sequence of launches over static shapes, so with
    ``cuda_graph=True`` it is captured once as a CUDA graph and replayed: the first call runs
    eagerly (compiling every kernel), the second captures, later ones copy the batch into the
    static input buffers and replay. The learning rate and step counts reach the optimizer
    kernels through device memory (``Optimizer.prepare``), so schedules keep working.
    With ``parallel`` (a ``teeny.training.distributed.DataParallel``) the step also combines the ranks'
    losses and gradients (collectives included in the captured graph where NCCL allows it).
    An ``optim.GradScaler`` attached to the optimizer scales the backward's seed and unscales
    the gradients before clipping and the update (float16 training).
    Returns the loss as a device tensor (reading it is the caller's choice: it synchronises).
    ``inputs``: the captured graph's input buffers (after the second call); a feed of these
    very tensors (a loader writing each batch into them) is not copied.
    """

    def __init__(
        self,
        executor: Executor,
        optimizer: Optimizer,
        clip: float | None = None,
        cuda_graph: bool = False,
        parallel: DataParallel | None = None,
    ):
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
        self.parallel = parallel
        self.with_grad = [v.name for v, _, _ in optimizer.slots]  # the backward writes every one of them
        self.calls = 0
        self.graph = None
        self.captured_segments = None
        self.static_feed: dict[str, torch.Tensor] = {}
        self.static_loss = None

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The input buffers the captured graph reads (empty until the graph is captured)."""
        return self.static_feed

    def _body(self, feed) -> torch.Tensor:
        executor, parallel, scaler = self.executor, self.parallel, self.optimizer.scaler
        executor.zero_grad()
        if parallel is not None:
            parallel.start_step()
        outputs, cache = executor.forward_train(feed)
        loss = outputs[0] if isinstance(outputs, tuple) else outputs
        seed = None if parallel is None else parallel.loss_seed(loss)
        if scaler is not None:
            seed = scaler.seed(loss, seed)
        executor.backward(cache, seed)
        if parallel is None:
            if scaler is not None:
                scaler.unscale(executor)
            if self.clip:
                clip_grad_norm(executor, self.clip)
            self.optimizer.launch()
            return loss
        parallel.end_backward()
        if scaler is not None or self.clip:
            options = parallel.clip_options()  # waits for every bucket
            if scaler is not None:  # ZeRO-1: each rank counts its shard, the counts are summed
                scaler.unscale(
                    executor,
                    count_ranges=options.get("norm_ranges"),
                    scale_ranges=options.get("scale_ranges"),
                    reduce=options.get("reduce"),
                )
            if self.clip:
                clip_grad_norm(executor, self.clip, **options)
        self.optimizer.launch(before=parallel.wait_range, after=parallel.gather_range)
        return parallel.finish_step(loss)

    def __call__(self, feed: dict[str, torch.Tensor], loss_count: int | None = None) -> torch.Tensor:
        self.calls += 1
        self.optimizer.prepare(self.with_grad)
        if self.parallel is not None:
            self.parallel.set_loss_count(loss_count if loss_count is not None else len(next(iter(feed.values()))))
        if self.graph is not None and self.optimizer.segments != self.captured_segments:
            self.graph = None  # the launches changed (per-parameter step counts diverged): capture again
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
            self.captured_segments = list(self.optimizer.segments)
        else:
            for k, v in feed.items():
                static = self.static_feed[k]
                if v is not static:  # a loader that writes into ``inputs`` saves the copy
                    static.copy_(v, non_blocking=True)
        self.graph.replay()
        return self.static_loss


# ------------------------------------------------------------------------------ loop


def _row(**values: Any) -> dict[str, Any]:
    """A metrics row as strict JSON values: JSON has no NaN or Infinity, so non-finite floats become None."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def _batch_count_error(task, epoch: int, batch_size: int, yielded: str, declared: int) -> TaskError:
    """A task's batches and its ``steps_per_epoch`` disagree (the schedule, the progress bar and
    the resume position count on the latter)."""
    return TaskError(
        f"task {task.name!r}: batches(epoch={epoch}, batch_size={batch_size}) yielded {yielded} batches, but "
        f"steps_per_epoch({batch_size}) says {declared}: make the two agree"
    )


def _metrics(task, returned: Any) -> dict[str, float]:
    """``task.evaluate``'s metrics as floats; ``TaskError`` unless they are a dict of names to numbers."""
    if isinstance(returned, dict) and all(
        isinstance(k, str) and (isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1))
        for k, v in returned.items()
    ):
        return {k: float(v) for k, v in returned.items()}
    shown = repr(returned)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise TaskError(
        f"task {task.name!r}: evaluate() returned {type(returned).__name__} {shown}; it must return a dict of "
        "metric names to numbers"
    )


def check_out_dir(out: Path) -> None:
    """Raise ``RunDirError`` unless ``out`` is (or can be made) a writable folder; creates nothing."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(f"--out {out} lies under {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"--out {out}: {existing} is not writable")


def _run_dir_files(out: Path) -> list[str]:
    """The files of a run in ``out``: its checkpoint and what any writer writes (whatever that run logged)."""
    checkpoint = [CHECKPOINT_NAME] if (out / CHECKPOINT_NAME).exists() else []
    return checkpoint + [p.name for writer in WRITERS.values() for p in sorted(out.glob(writer.files))]


LOCK_NAME = ".lock"


class RunFolder:
    """A run's hold on its output folder: ``<out>/.lock``, locked with ``fcntl.flock`` and holding
    the run's PID. The kernel drops the lock when the process ends, however it ends, so the lock
    file of a run that died is simply taken over. ``release`` removes the lock file, and the
    folders ``acquire`` created if the run left nothing in them."""

    def __init__(self, out: Path):
        self.out = out
        self.fd: int | None = None
        self.created: list[Path] = []  # deepest first

    def acquire(self) -> None:
        """Create the folder and lock it; ``RunDirError`` if it cannot be made or another run holds it."""
        folder, missing = self.out, []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # /proc, /sys, a read-only mount: places `check_out_dir` cannot judge
            raise RunDirError(f"--out {self.out}: cannot create the folder ({exc.strerror})") from None
        self.created = missing
        path = self.out / LOCK_NAME
        while self.fd is None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                self._remove_created()
                raise RunDirError(f"--out {self.out}: cannot write there ({exc.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self._remove_created()
                raise RunDirError(
                    f"--out {self.out} is in use by another teeny train run (PID {owner}, in {path}): wait for it "
                    "to end, or choose another --out"
                ) from None
            except OSError as exc:  # a file system without locks: go on unguarded, as before locks
                warnings.warn(f"cannot lock {path} ({exc.strerror}): another run could write there too", stacklevel=2)
            try:  # a run that released between our open and our lock removed the file: lock the new one
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                self.fd = fd
            else:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Remove the lock file, then unlock (a run waiting on the old file then finds it gone)."""
        if self.fd is None:
            return
        (self.out / LOCK_NAME).unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:  # the run wrote there: keep it (and its parents)
                break
        self.created = []

    def sweep(self) -> None:
        """Remove the temporary files of a checkpoint write that crashed (none is in progress: the folder is ours)."""
        for leftover in [*self.out.glob(f".{CHECKPOINT_NAME}.*.tmp"), self.out / (CHECKPOINT_NAME + ".tmp")]:
            leftover.unlink(missing_ok=True)


class _Losses:
    """The losses of the steps since the last read, kept on the device (a read synchronises):
    one copy per step, one transfer per ``log_every`` steps."""

    def __init__(self, size: int, device: torch.device):
        self.buffer = torch.zeros(size, dtype=torch.float64, device=device)
        self.steps: list[tuple[int, int, float]] = []  # (step, epoch, lr)

    def add(self, loss: torch.Tensor, step: int, epoch: int, lr: float) -> None:
        self.buffer[len(self.steps)].copy_(loss.detach().reshape(()))
        self.steps.append((step, epoch, lr))

    def read(self) -> list[tuple[int, int, float, float]]:
        if not self.steps:
            return []
        values = self.buffer[: len(self.steps)].tolist()
        rows = [(s, e, lr, v) for (s, e, lr), v in zip(self.steps, values)]
        self.steps = []
        return rows


def train(
    task,
    config: TrainConfig,
    resume: str | None = None,
    log=print,
    allow_change: Iterable[str] = (),
    world: World | None = None,
    callbacks: Iterable[Callback] = (),
) -> dict:
    """Train ``task``'s model; returns the final metrics (and writes logs and checkpoints to
    ``config.out`` when set). ``resume``: a checkpoint to continue from; ``allow_change``: settings
    the resumed run may change although that breaks exactness (``"all"`` for any). ``world``: the
    data-parallel process group (default: ``teeny.training.distributed.current()``, None outside one).
    ``callbacks`` (``teeny.training.callbacks``) hear of every step, evaluation and checkpoint on
    rank 0, after the writers ``config.log_to`` names. A resume with nothing left to do returns
    ``{"step": ..., "nothing_to_do": True}``. The run holds ``config.out`` (``RunFolder``) until it
    returns or raises."""
    from . import distributed

    config.validate()
    world = distributed.current() if world is None else world
    lead = world is None or world.rank == 0
    writers = [WRITERS[name]() for name in config.log_to] if lead and config.out else []  # imports what they need
    hooks = CallbackList([*writers, *callbacks] if lead else [])
    folder = RunFolder(Path(config.out)) if config.out else None
    error = None
    try:
        return _train(task, config, resume, log, allow_change, world, folder, hooks)
    except BaseException as exc:
        error = exc
        raise
    finally:
        try:
            hooks.end(error)  # while the folder is still this run's
        finally:
            if folder is not None:
                folder.release()


def _train(
    task,
    config: TrainConfig,
    resume: str | None,
    log,
    allow_change: Iterable[str],
    world: World | None,
    folder: RunFolder | None,
    hooks: CallbackList,
) -> dict:
    from . import distributed

    size, rank = (world.size, world.rank) if world is not None else (1, 0)
    lead = rank == 0
    say = log if lead else (lambda *args, **kwargs: None)
    if config.batch_size % size:
        raise ValueError(
            f"batch size {config.batch_size} does not divide evenly over {size} processes: choose a multiple of {size}"
        )
    local_batch = config.batch_size // size
    out = Path(config.out) if config.out else None
    steps_per_epoch = task.steps_per_epoch(config.batch_size)
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {config.batch_size} is larger than the training set")
    total_steps = steps_per_epoch * config.epochs
    stop_at = min(total_steps, config.max_steps) if config.max_steps is not None else total_steps
    settings = {**config.settings(), "world_size": size}
    spec = dict(getattr(task, "spec", {}))

    # rank 0 checks the folder and the checkpoint before anything is built or created
    loaded: dict[str, Any] = {}

    def check() -> int:
        if out:
            check_out_dir(out)
        step = 0
        if resume:
            params, state, meta = load_checkpoint(resume)
            check_resumable(resume, meta, task, settings, allow_change)
            loaded.update(params=params, state=state)
            step = int(meta["step"])
        if folder is not None:
            folder.acquire()  # the last check: a refused run creates nothing
        return step

    step = distributed.agree(world, check)
    if resume and step >= stop_at:
        say(
            f"checkpoint {resume} is at step {step} of {stop_at}: nothing left to do "
            "(raise --epochs or --steps to train further)"
        )
        return {"step": step, "nothing_to_do": True}

    graph = task.train_graph(local_batch, config.dtype)
    program = lower(graph, LoweringMode.TRAINING, precision=config.precision, recompute=config.recompute)
    executor = Executor(program, seed=config.seed, device=world and world.device)
    optimizer = make_optimizer(executor, config)
    if config.precision == "fp16-mixed":
        GradScaler(optimizer)  # float16 gradients need the loss scaled
    parallel = None
    if world is not None:
        parallel = distributed.DataParallel(world, executor, optimizer, zero=config.zero, bucket_mb=config.bucket_mb)
        say(parallel.describe())
    if resume:

        def load() -> None:
            try:
                executor.load_params(loaded["params"])
                optimizer.load_state_dict(loaded["state"])
            except (KeyError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {resume} does not fit model {task.name}: {exc}") from None

        distributed.agree(world, load)
        if parallel is not None:
            parallel.sync_from_lead(loaded.get("state"))
        say(f"resumed from {resume} at step {step}")

    # the folder is this run's now (created by the last check, so a failed check left nothing behind)
    last_saved = None
    continuing = resume is not None and out is not None and Path(resume).resolve() == (out / CHECKPOINT_NAME).resolve()
    if out and lead:
        earlier = _run_dir_files(out) if out.is_dir() and not continuing else []
        folder.sweep()
        if earlier:  # another run's files: this run starts its own log there
            say(f"{out} held an earlier run ({', '.join(earlier)}): starting afresh there")
            for name in earlier:
                (out / name).unlink()
    if continuing:
        last_saved = step
    run = Run(out=out, config=config, model=task.name, start_step=step, continues=continuing)
    hooks.on_train_start(run)
    meta = {"model": task.name, "model_spec": spec, "config": settings}

    def stop(at: int, why: str) -> None:
        """Training went bad at step ``at``: raise (the callbacks learn why from ``run.diverged``)."""
        run.diverged = (at, why)
        kept = (
            f"the last good checkpoint, from step {last_saved}, is {out / CHECKPOINT_NAME}"
            if last_saved is not None
            else "no checkpoint was written before it"
        )
        raise DivergedError(f"step {at}: {why}; training stopped ({kept})")

    def save() -> None:
        nonlocal last_saved
        if not out:
            return
        if not all(bool(torch.isfinite(arena).all()) for arena in executor.param_arenas.values()):
            stop(step, "the parameters are no longer finite")
        state = parallel.optimizer_state_dict() if parallel is not None else None  # a collective under ZeRO-1
        path = out / CHECKPOINT_NAME
        distributed.agree(world, lambda: save_checkpoint(path, executor, optimizer, step, meta, optimizer_state=state))
        last_saved = step
        hooks.on_checkpoint(path, step)

    schedule = cosine_schedule(total_steps, config.warmup_steps) if config.schedule == "cosine" else constant_schedule()
    on_gpu = executor.device.type == "cuda"
    use_graph = on_gpu if config.cuda_graph is None else config.cuda_graph
    log_every = config.log_every or (20 if on_gpu else 1)
    train_step = TrainStep(executor, optimizer, config.clip, cuda_graph=use_graph, parallel=parallel)
    losses = _Losses(log_every, executor.device)
    last_eval: dict = {}
    first_loss: list[float] = []
    epoch_sum, epoch_count = 0.0, 0
    progress = None
    if config.progress and lead:
        tqdm = optional("tqdm")  # the [train] extra brings it; without it, no bar (extras.DEGRADED)
        if tqdm is not None:
            progress = tqdm.tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=True)
    t_start, samples = time.perf_counter(), 0

    def flush() -> None:
        """Read the pending losses (one synchronisation), log them, stop if one went bad."""
        nonlocal epoch_sum, epoch_count
        for s, epoch, lr, value in losses.read():
            bad = not math.isfinite(value)
            if not bad and not first_loss:
                first_loss.append(value)
            factor = config.diverge_factor
            limit = factor * max(abs(first_loss[0]), 1.0) if factor and first_loss else None
            hooks.on_step(s, _row(step=s, epoch=epoch, loss=value, lr=lr))
            if bad or (limit is not None and value > limit):
                grown = f"the loss reached {value:.4g}, over {factor:g} times its first value"
                stop(s, f"the loss is {value}" if bad else grown)
            epoch_sum, epoch_count = epoch_sum + value, epoch_count + 1
            if progress is not None:
                rate = samples / max(time.perf_counter() - t_start, 1e-9)
                progress.set_postfix(loss=f"{value:.4f}", samples_per_s=f"{rate:.0f}")

    try:
        for epoch in range(step // steps_per_epoch, config.epochs):
            skip = step - epoch * steps_per_epoch  # batches already done in this epoch (resuming)
            epoch_sum, epoch_count, epoch_batches, yielded = 0.0, 0, 0, 0
            for index, feed in enumerate(task.batches(epoch, config.batch_size, config.seed)):
                yielded = index + 1
                if index < skip:
                    continue
                if step >= stop_at:
                    break
                if index >= steps_per_epoch:
                    raise _batch_count_error(
                        task, epoch, config.batch_size, f"more than {steps_per_epoch}", steps_per_epoch
                    )
                if size > 1:
                    feed = shard(feed, rank, size)
                optimizer.lr = config.lr * schedule(step)
                loss = train_step(feed, loss_count(task, feed) if parallel is not None else None)
                step += 1
                samples += config.batch_size
                epoch_batches += 1
                losses.add(loss, step, epoch, optimizer.lr)
                if step % log_every == 0 or step == stop_at:
                    flush()
                if progress is not None:
                    progress.update(1)
                if config.checkpoint_every and step % config.checkpoint_every == 0:
                    flush()
                    save()
            flush()
            if step < stop_at and yielded < steps_per_epoch:
                raise _batch_count_error(task, epoch, config.batch_size, f"only {yielded}", steps_per_epoch)
            if step >= stop_at and epoch_batches == 0:
                break
            finished_epoch = step % steps_per_epoch == 0 or step >= stop_at
            if epoch_batches and finished_epoch:
                last_eval = _metrics(task, task.evaluate(executor.params))
                mean_loss = epoch_sum / max(epoch_count, 1)
                hooks.on_eval(epoch, _row(step=step, epoch=epoch, train_loss=mean_loss, **last_eval))
                shown = ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
                line = f"epoch {epoch + 1}/{config.epochs}: loss {mean_loss:.4f}, {shown}"
                (progress.write if progress is not None else say)(line)
                if not config.checkpoint_every:
                    save()
            if step >= stop_at:
                break
    finally:
        if progress is not None:
            progress.close()
    flush()
    elapsed = time.perf_counter() - t_start
    if out and last_saved != step:
        save()
    result = {"step": step, "seconds": elapsed, "samples_per_s": samples / max(elapsed, 1e-9), **last_eval}
    if getattr(task, "block_size", None):
        result["tokens_per_s"] = result["samples_per_s"] * task.block_size
    if parallel is not None:
        result["memory_per_rank"] = parallel.memory()
    result["executor"], result["optimizer"] = executor, optimizer
    if optimizer.scaler is not None:
        result["loss_scale"], result["skipped_steps"] = optimizer.scaler.scale, optimizer.scaler.skipped_steps
    return result
