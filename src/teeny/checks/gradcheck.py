"""Numerical gradient checks: central differences against what the backward kernels produce.

For a function f of the inputs and parameters, with a fixed random projection R of its
output (so a non-scalar output reduces to the scalar L = sum(R * f)), the numerical
derivative of L along element i of input x is

    (L(x + h e_i) - L(x - h e_i)) / 2h

and must match the gradient the backward kernels give for R as ``grad_output``. In float64
(h = 1e-6) the match is tight; in float32 (h = 1e-3) it is looser. For large tensors the
``directional`` mode checks one random direction v instead of every element:
(L(x + h v) - L(x - h v)) / 2h  against  <grad x, v>.

Failures say which input or parameter, which element, the numerical value and the
analytical one. A NaN or inf on either side is a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import TeenyError
from ..core.graph import Graph, Tensor, trace_function
from ..fusions import DEFAULT_REWRITES
from ..program.lowering import LoweringMode, lower
from .registry import flat_tensors

DEFAULTS = {
    torch.float64: dict(eps=1e-6, atol=1e-5, rtol=1e-4),
    torch.float32: dict(eps=1e-3, atol=2e-2, rtol=2e-2),
}


class GradcheckError(TeenyError):
    pass


@dataclass
class Mismatch:
    what: str
    index: tuple | str
    numerical: float
    analytical: float

    def __str__(self) -> str:
        return f"{self.what}[{self.index}]: numerical {self.numerical:.6g}, analytical {self.analytical:.6g}"


@dataclass
class GradcheckResult:
    checked: dict[str, int] = field(default_factory=dict)  # name -> number of elements or directions checked
    mismatches: list[Mismatch] = field(default_factory=list)
    max_abs_error: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def report(self, limit: int = 10) -> str:
        if self.ok:
            checked = ", ".join(f"{k}: {v}" for k, v in self.checked.items())
            return f"gradcheck passed ({checked}; max error {self.max_abs_error:.3g})"
        lines = [f"gradcheck failed: {len(self.mismatches)} mismatches"]
        lines += [f"  {m}" for m in self.mismatches[:limit]]
        if len(self.mismatches) > limit:
            lines.append(f"  ... and {len(self.mismatches) - limit} more")
        return "\n".join(lines)


def gradcheck_graph(
    graph: Graph,
    inputs: dict[str, torch.Tensor],
    *,
    params: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    eps: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    mode: str = "auto",
    max_elements: int = 400,
    seed: int = 0,
    raise_on_failure: bool = True,
    rewrites: Sequence[Callable] = DEFAULT_REWRITES,
    recompute: bool = False,
) -> GradcheckResult:
    """Check every gradient of ``graph``'s first output: w.r.t. inputs marked ``requires_grad``
    and trainable parameters. ``mode``: "full" (every element), "directional" (one random
    direction per tensor), or "auto" (full up to ``max_elements`` elements, else directional).
    ``rewrites``, ``recompute``: what to lower with, as ``lower`` takes them."""
    from ..program.executor import Executor

    if mode not in ("auto", "full", "directional"):
        raise ValueError(f"mode must be auto, full or directional, got {mode!r}")
    program = lower(graph, LoweringMode.TRAINING, rewrites=rewrites, recompute=recompute)
    executor = Executor(program, seed=seed)
    if params is not None:
        executor.load_params(params, strict=False)
    out_value = program.loss
    dtype = dtype or out_value.dtype
    tol = DEFAULTS.get(dtype, DEFAULTS[torch.float32])
    eps = tol["eps"] if eps is None else eps
    atol = tol["atol"] if atol is None else atol
    rtol = tol["rtol"] if rtol is None else rtol

    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {k: v.to(executor.device) for k, v in inputs.items()}
    projection = (
        torch.randn(out_value.shape, generator=gen, dtype=torch.float64).to(out_value.dtype).to(executor.device)
    )

    def objective() -> float:
        out = executor.forward(inputs)
        out = out[0] if isinstance(out, tuple) else out
        return float((out.double() * projection.double()).sum())

    out, cache = executor.forward_train(inputs)
    input_grads = executor.backward(cache, projection)
    targets: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for v in program.inputs:
        if v.requires_grad:
            targets.append((f"input '{v.name}'", inputs[v.name], input_grads[v.name]))
    for v in program.params:
        if v.requires_grad:
            targets.append((f"parameter '{v.name}'", executor.params[v.name], executor.grads[v.name].clone()))
    if not targets:
        raise GradcheckError("nothing to check: no input requires a gradient and no parameter is trainable")

    result = GradcheckResult()
    for what, tensor, analytic in targets:
        analytic = analytic.detach().double().cpu()
        flat = tensor.view(-1)
        use_full = mode == "full" or (mode == "auto" and flat.numel() <= max_elements)
        if use_full:
            numeric = torch.empty(flat.numel(), dtype=torch.float64)
            for i in range(flat.numel()):
                original = flat[i].item()
                flat[i] = original + eps
                plus = objective()
                flat[i] = original - eps
                minus = objective()
                flat[i] = original
                numeric[i] = (plus - minus) / (2 * eps)
            _compare(result, what, numeric.view(tensor.shape), analytic, atol, rtol)
            result.checked[what] = flat.numel()
        else:
            direction = torch.randn(tensor.shape, generator=gen, dtype=torch.float64)
            direction /= direction.norm().clamp_min(1e-12)
            original = tensor.detach().clone()
            step = (direction * eps).to(tensor.dtype).to(tensor.device)
            tensor.add_(step)
            plus = objective()
            tensor.copy_(original)
            tensor.sub_(step)
            minus = objective()
            tensor.copy_(original)
            numeric = torch.tensor([(plus - minus) / (2 * eps)], dtype=torch.float64)
            expected = torch.tensor([float((analytic * direction).sum())], dtype=torch.float64)
            _compare(result, what, numeric, expected, atol, rtol, index_name="direction")
            result.checked[what] = 1
    if raise_on_failure and not result.ok:
        raise GradcheckError(result.report())
    return result


def _compare(
    result: GradcheckResult,
    what: str,
    numeric: torch.Tensor,
    analytic: torch.Tensor,
    atol: float,
    rtol: float,
    index_name: str | None = None,
) -> None:
    if numeric.shape != analytic.shape:
        result.mismatches.append(Mismatch(what, "shape", float("nan"), float("nan")))
        return
    error = (numeric - analytic).abs()
    bad = ~(error <= atol + rtol * numeric.abs())  # NaN compares false: a NaN is a failure
    finite = error[torch.isfinite(error)]
    if finite.numel():
        result.max_abs_error = max(result.max_abs_error, float(finite.max()))
    for flat_index in torch.nonzero(bad.view(-1)).view(-1).tolist():
        if index_name is not None:
            index: tuple | str = index_name
        else:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), numeric.shape))
        result.mismatches.append(
            Mismatch(what, index, float(numeric.view(-1)[flat_index]), float(analytic.reshape(-1)[flat_index]))
        )


def gradcheck(fn: Callable[..., Tensor], *args: Any, requires_grad=None, **options: Any) -> GradcheckResult:
    """Gradcheck a function of symbolic tensors at the given torch tensors, e.g.
    ``gradcheck(teeny.ops.gelu, torch.randn(3, 37, dtype=torch.float64))``."""
    kwargs = options.pop("kwargs", None)
    tensors = flat_tensors([*args, *(kwargs or {}).values()])
    if not any(t.is_floating_point() for t in tensors):
        dtypes = ", ".join(str(t.dtype).replace("torch.", "") for t in tensors) or "no tensor"
        raise GradcheckError(
            f"gradcheck differentiates with respect to floating-point tensors, and got {dtypes}: "
            "pass at least one float64 (or float32) tensor"
        )
    graph, feed = trace_function(fn, args, kwargs, requires_grad)
    return gradcheck_graph(graph, feed, **options)
