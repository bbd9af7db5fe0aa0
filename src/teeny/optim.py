"""Optimizers and learning-rate schedules over an ``Executor``'s parameter arenas.

Parameters and gradients live in one flat arena per dtype, so a step is one kernel launch per
arena (one in practice) whatever the number of parameters. Optimizer state (momentum buffers,
Adam moments) is laid out like the arena. The update rules are PyTorch's (see
``teeny.kernels.optim``). Learning-rate schedules are plain functions of the step that the
training loop applies by setting ``optimizer.lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .executor import Executor
from .kernels import optim as K
from .kernels.optim import (
    BLOCK,
    adam_step_kernel,
    blocks,
    clip_factor_kernel,
    scale_by_factor_kernel,
    sgd_step_kernel,
    sum_squares_partial_kernel,
)
from .runtime import ArgVisitor, Launch, launch_kernel


def _check_positive(name: str, value: float, allow_zero: bool = True) -> None:
    if not (value > 0 or (allow_zero and value == 0)) or math.isnan(value):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


class Optimizer:
    state_names: tuple[str, ...] = ()

    def __init__(self, executor: Executor, lr: float):
        if not executor.training:
            raise ValueError("optimizers need an executor of a program lowered for TRAINING")
        _check_positive("lr", lr)
        self.executor = executor
        self.lr = float(lr)
        self.base_lr = float(lr)
        self.step_count = 0
        # lr, step and the other hyperparameters, read by the kernels from device memory (K.LR, ...)
        self.hyper = torch.zeros(K.N_HYPER, dtype=torch.float64, device=executor.device)
        self.state: dict[str, dict[torch.dtype, torch.Tensor]] = {
            name: {dtype: torch.zeros_like(arena) for dtype, arena in executor.param_arenas.items()}
            for name in self.state_names
        }

    def zero_grad(self) -> None:
        self.executor.zero_grad()

    def step(self) -> None:
        """One update of every parameter: ``prepare()`` then ``launch()``."""
        self.prepare()
        self.launch()

    def prepare(self) -> None:
        """Advance the step count and publish lr and step to the device (host side)."""
        self.step_count += 1
        values = [0.0] * K.N_HYPER
        values[K.LR.value], values[K.STEP.value] = self.lr, float(self.step_count)
        for slot, value in self.hyperparameters().items():
            values[slot.value] = float(value)
        self.hyper.copy_(torch.tensor(values, dtype=torch.float64))

    def hyperparameters(self) -> dict:
        """The constant hyperparameters by buffer slot."""
        return {}

    def launch(self) -> None:
        """The update kernels alone (one launch per arena): what a CUDA graph captures."""
        for dtype, params in self.executor.param_arenas.items():
            if params.numel():
                self._update(dtype, params, self.executor.grad_arenas[dtype])

    def _update(self, dtype, params, grads) -> None:
        raise NotImplementedError

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {
            "step": torch.tensor(self.step_count, dtype=torch.int64),
            "lr": torch.tensor(self.lr, dtype=torch.float64),
        }
        for name, arenas in self.state.items():
            for dtype, t in arenas.items():
                out[f"{name}.{str(dtype).replace('torch.', '')}"] = t
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        for name, arenas in self.state.items():
            for dtype, t in arenas.items():
                key = f"{name}.{str(dtype).replace('torch.', '')}"
                if key not in state:
                    raise KeyError(f"optimizer state is missing {key!r}")
                if state[key].shape != t.shape:
                    raise ValueError(
                        f"optimizer state {key!r} has shape {tuple(state[key].shape)}, expected {tuple(t.shape)}"
                    )
                t.copy_(state[key].to(t.device, t.dtype))


class SGD(Optimizer):
    state_names = ("momentum_buffer",)

    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        for name, value in (("momentum", momentum), ("weight_decay", weight_decay)):
            _check_positive(name, value)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum, self.dampening, self.weight_decay, self.nesterov = momentum, dampening, weight_decay, nesterov
        super().__init__(executor, lr)

    def hyperparameters(self) -> dict:
        return {K.MOMENTUM: self.momentum, K.DAMPENING: self.dampening, K.WEIGHT_DECAY: self.weight_decay}

    def _update(self, dtype, params, grads) -> None:
        n = params.numel()
        buf = self.state["momentum_buffer"][dtype]
        args = ArgVisitor().visit(
            p_ptr=params,
            g_ptr=grads,
            buf_ptr=buf,
            hyper_ptr=self.hyper,
            n=n,
            NESTEROV=self.nesterov,
            USE_MOMENTUM=self.momentum != 0,
            BLOCK=BLOCK,
        )
        launch_kernel(Launch(sgd_step_kernel, (blocks(n),), args), dtype, "optimizer SGD")


class Adam(Optimizer):
    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        _check_positive("eps", eps)
        _check_positive("weight_decay", weight_decay)
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        super().__init__(executor, lr)

    def hyperparameters(self) -> dict:
        return {K.BETA1: self.betas[0], K.BETA2: self.betas[1], K.EPS: self.eps, K.WEIGHT_DECAY: self.weight_decay}

    def _update(self, dtype, params, grads) -> None:
        n = params.numel()
        args = ArgVisitor().visit(
            p_ptr=params,
            g_ptr=grads,
            m_ptr=self.state["exp_avg"][dtype],
            v_ptr=self.state["exp_avg_sq"][dtype],
            hyper_ptr=self.hyper,
            n=n,
            DECOUPLED=self.decoupled,
            BLOCK=BLOCK,
        )
        launch_kernel(Launch(adam_step_kernel, (blocks(n),), args), dtype, f"optimizer {type(self).__name__}")


class AdamW(Adam):
    decoupled = True

    def __init__(
        self,
        executor: Executor,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(executor, lr, betas, eps, weight_decay)


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def clip_grad_norm(executor: Executor, max_norm: float) -> torch.Tensor:
    """Scale all gradients so that their global L2 norm is at most ``max_norm`` (like
    torch.nn.utils.clip_grad_norm_); returns the norm before clipping as a device tensor
    (no host synchronisation)."""
    _check_positive("max_norm", max_norm, allow_zero=False)
    arenas = [g for g in executor.grad_arenas.values() if g.numel()]
    counts = [blocks(g.numel()) for g in arenas]
    device = executor.device
    partials = torch.empty(max(sum(counts), 1), dtype=torch.float32, device=device)
    norm = torch.zeros(1, dtype=torch.float32, device=device)
    factor = torch.ones(1, dtype=torch.float32, device=device)
    offset = 0
    where = "clip_grad_norm"
    for grads, count in zip(arenas, counts):
        args = ArgVisitor().visit(g_ptr=grads, partial_ptr=partials[offset:], n=grads.numel(), BLOCK=BLOCK)
        launch_kernel(Launch(sum_squares_partial_kernel, (count,), args), grads.dtype, where)
        offset += count
    args = ArgVisitor().visit(
        partial_ptr=partials, n_partials=offset, norm_ptr=norm, factor_ptr=factor, max_norm=float(max_norm), BLOCK=BLOCK
    )
    launch_kernel(Launch(clip_factor_kernel, (1,), args), torch.float32, where)
    for grads in arenas:
        args = ArgVisitor().visit(g_ptr=grads, factor_ptr=factor, n=grads.numel(), BLOCK=BLOCK)
        launch_kernel(Launch(scale_by_factor_kernel, (blocks(grads.numel()),), args), grads.dtype, where)
    return norm[0]


# --------------------------------------------------------------------------- LR schedules
Schedule = Callable[[int], float]  # step (0-based) -> multiplier of the base learning rate


def constant_schedule() -> Schedule:
    return lambda step: 1.0


def warmup_schedule(warmup_steps: int, after: Schedule | None = None) -> Schedule:
    """Linear warmup from 1/warmup_steps to 1 over ``warmup_steps``, then ``after``."""
    after = after or constant_schedule()
    return lambda step: (step + 1) / warmup_steps if step < warmup_steps else after(step - warmup_steps)


def cosine_schedule(total_steps: int, warmup_steps: int = 0, min_factor: float = 0.0) -> Schedule:
    """Optional linear warmup, then cosine decay from 1 to ``min_factor`` at ``total_steps``."""
    decay = max(total_steps - warmup_steps, 1)

    def cosine(step: int) -> float:
        progress = min(step / decay, 1.0)
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))

    return warmup_schedule(warmup_steps, cosine) if warmup_steps else cosine


def step_schedule(step_size: int, gamma: float = 0.1) -> Schedule:
    """Multiply by ``gamma`` every ``step_size`` steps (torch.optim.lr_scheduler.StepLR)."""
    return lambda step: gamma ** (step // step_size)
