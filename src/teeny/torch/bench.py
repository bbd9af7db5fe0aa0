"""``teeny bench FILE.py:make_model``: your training step under eager, torch.compile, teeny and Liger.

    # my_model.py
    def make_model():
        model = transformers.LlamaForCausalLM(config)      # any torch.nn.Module
        ids = torch.randint(0, config.vocab_size, (8, 1024))
        return model, {"input_ids": ids, "labels": ids}    # loss_fn optional

    teeny bench my_model.py:make_model --steps 20 --json bench.json

**The factory.** ``make_model()`` returns ``(model, batch)``, ``(model, batch, loss_fn)``, a dict
with those keys or a ``BenchModel``. ``batch`` is a dict (``model(**batch)``) or a tuple
(``model(*batch)``) of tensors. ``loss_fn(model, batch)`` returns the loss; without it the loss
is the output's ``.loss`` (a Hugging Face model called with ``labels=``), its ``"loss"`` or its
first item. A ``torch.nn`` loss module (the ``teeny train --torch-model`` contract) is
``loss_fn(model(first), second)`` of the batch's first two tensors.

**The variants.** Each starts from a copy of the same initial weights, on the same batch with
the same seed: ``eager``; ``compile-<mode>`` (``torch.compile`` in each of ``COMPILE_MODES``;
``compile`` names all three); ``teeny-patch`` (``teeny.torch.patch``); ``teeny-patch+compile``
(patched, then compiled in the default mode); ``teeny-backend`` (``torch.compile(model,
backend="teeny")``: the whole model as teeny programs; ``-reduce-overhead``: in that mode, its
programs replayed as CUDA graphs; ``+recompute``: with the option ``recompute``); ``liger``
(Liger-Kernel's patch for the model's transformers type, when installed; it patches
transformers' module functions for the whole process, so it always runs last). On the CPU the
compiled variants are skipped unless asked for (inductor builds C++ for minutes there) and
Liger, whose kernels need a GPU, is skipped.

**A step** is ``zero_grad``, the forward and loss (under bfloat16 autocast with
``precision="bf16-autocast"``, the default on CUDA; float32 otherwise), ``backward`` and
``torch.optim.AdamW`` (fused on CUDA). Each variant takes one first step (its time is the
compile cost), ``warmup`` steps, then ``steps`` timed ones (CUDA events on the GPU; otherwise
``time.perf_counter``, synchronised), and reports the mean step time, tokens/s (when the batch
has ``input_ids``), the peak of ``torch.cuda.max_memory_allocated`` (GPU only) and the losses of
the first and the last step. A variant that fails gets its error in its row; the others go on.

**Rounds.** ``--rounds N`` runs the whole command N times, one round after another, each in a
fresh process (Liger's patch stays for a process's life): a variant's step time is then the
median of its rounds' (each round's is in the row's ``round_ms`` and its note), its peak the
highest, its first step and losses the first round's. A host-bound step (PyTorch eager, a patch)
runs at the host's speed, and a shared host's speed drifts by tens of percent within minutes:
rounds interleave the variants in time, so a drift no longer falls on one variant alone.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core import device as teeny_device
from ..core.extras import install_hint

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
PRECISIONS = ("fp32", "bf16-autocast")


@dataclass(frozen=True)
class Variant:
    """One way to run the step: teeny's patch, a torch.compile mode (inductor), teeny's
    torch.compile backend, Liger-Kernel's patch."""

    name: str
    teeny_patch: bool = False
    compile_mode: str | None = None
    liger: bool = False
    teeny_backend: bool = False  # torch.compile(model, backend="teeny")
    backend_mode: str | None = None  # torch.compile's mode for the teeny backend
    backend_options: tuple = ()  # its options (name, value), e.g. (("recompute", True),)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager"),
        *(Variant(f"compile-{mode}", compile_mode=mode) for mode in COMPILE_MODES),
        Variant("teeny-patch", teeny_patch=True),
        Variant("teeny-patch+compile", teeny_patch=True, compile_mode="default"),
        Variant("teeny-backend", teeny_backend=True),
        Variant("teeny-backend-reduce-overhead", teeny_backend=True, backend_mode="reduce-overhead"),
        Variant("teeny-backend+recompute", teeny_backend=True, backend_options=(("recompute", True),)),
        Variant("liger", liger=True),
    )
}


@dataclass
class BenchModel:
    """What ``make_model()`` returns (or the tuple / dict it stands for); see the module docstring."""

    model: nn.Module
    batch: dict[str, Any] | tuple
    loss_fn: Callable | None = None


@dataclass
class Row:
    """One variant's result: ``status`` is ``ok``, ``failed`` (``note`` the error) or ``skipped``
    (``note`` why). Times in seconds / milliseconds, memory in MiB (None where not measured)."""

    variant: str
    status: str
    note: str = ""
    first_step_s: float | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)  # each round's step time (``--rounds``)


def parse_variants(text: str) -> list[str]:
    """Comma-separated variant names in order (``compile``: every compile mode; ``all``: every
    variant); an unknown name raises ``ValueError`` listing the known ones."""
    names: list[str] = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        expanded = (
            list(VARIANTS)
            if word == "all"
            else [f"compile-{m}" for m in COMPILE_MODES]
            if word == "compile"
            else [word]
        )
        for name in expanded:
            if name not in VARIANTS:
                raise ValueError(f"unknown variant {name!r}; choose from all, compile, {', '.join(VARIANTS)}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no variant given")
    return names


def bench_model(made: Any) -> BenchModel:
    """``make_model()``'s result as a ``BenchModel``; a result that breaks the contract raises
    ``TypeError`` saying how."""
    if isinstance(made, dict):
        unknown = set(made) - {"model", "batch", "loss_fn"}
        if unknown or not {"model", "batch"} <= set(made):
            raise TypeError(f"make_model()'s dict needs keys model, batch (and loss_fn), got {sorted(made)}")
        made = BenchModel(**made)
    elif isinstance(made, (tuple, list)) and len(made) in (2, 3):
        made = BenchModel(*made)
    elif not isinstance(made, BenchModel):
        raise TypeError(
            f"make_model() must return (model, batch) or (model, batch, loss_fn), got {type(made).__name__}"
        )
    if not isinstance(made.model, nn.Module):
        raise TypeError(f"make_model() returned a {type(made.model).__name__} as the model, not a torch.nn.Module")
    if not isinstance(made.batch, (dict, tuple, list)):
        raise TypeError(f"make_model()'s batch must be a dict or a tuple of tensors, got {type(made.batch).__name__}")
    if made.loss_fn is not None and not callable(made.loss_fn):
        raise TypeError(f"make_model()'s loss_fn is a {type(made.loss_fn).__name__}, not a function")
    return made


def compute_loss(model: Callable, batch: dict | tuple, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of one forward of ``model`` (the module or its compiled wrapper) on ``batch``."""
    if isinstance(loss_fn, nn.Module):  # teeny train --torch-model's contract: loss(model(samples), targets)
        first, second = list(batch.values() if isinstance(batch, dict) else batch)[:2]
        return loss_fn(model(first), second)
    if loss_fn is not None:
        return loss_fn(model, batch)
    out = model(**batch) if isinstance(batch, dict) else model(*batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out.get("loss") if isinstance(out, dict) else out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"the model's output ({type(out).__name__}) has no scalar loss (.loss, ['loss'] or its first item); "
            "give make_model() a loss_fn(model, batch)"
        )
    return loss


def _to(batch: dict | tuple, device: torch.device) -> dict | tuple:
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {k: move(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(move(v) for v in batch)


def _tokens(batch: dict | tuple) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return ids.numel() if isinstance(ids, torch.Tensor) else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _liger_absent(model: nn.Module, device: torch.device) -> str | None:
    """Why Liger-Kernel cannot run this model here, or None."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return f"liger_kernel is not installed ({install_hint('liger_kernel')})"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        return "not a transformers model (no config.model_type): Liger-Kernel patches those only"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger-Kernel has no patch for model type {model_type!r}"
    if device.type != "cuda":
        return "Liger-Kernel's kernels run on CUDA only"
    return None


def _skip_reason(variant: Variant, model: nn.Module, device: torch.device, compile_on_cpu: bool) -> str | None:
    if variant.liger:
        return _liger_absent(model, device)
    if variant.compile_mode and device.type == "cpu":
        if not compile_on_cpu:
            return "on the CPU inductor builds C++ for minutes; --compile-on-cpu runs it"
        if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
            return "inductor on the CPU needs a C++ compiler (c++, g++ or clang++), and none is on PATH"
    return None


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_variant(
    variant: Variant,
    made: BenchModel,
    batch: dict | tuple,
    *,
    device: torch.device,
    steps: int,
    warmup: int,
    precision: str,
    lr: float,
    seed: int,
) -> Row:
    """Build ``variant`` from a copy of ``made.model`` and time its step; see the module docstring."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = copy.deepcopy(made.model).to(device).train()
    note = ""
    if variant.teeny_patch:
        from .patching import patch

        swapped = Counter(new for _, _, new in patch(model).swapped)
        note = "swapped " + ", ".join(f"{n} {name}" for name, n in sorted(swapped.items()))
    if variant.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        # the transformers model itself (inside a PEFT model, its base model): Liger patches its layers
        _apply_liger_kernel_to_instance(model=model.get_base_model() if hasattr(model, "get_base_model") else model)
    forward = torch.compile(model, mode=variant.compile_mode) if variant.compile_mode else model
    if variant.teeny_backend:
        from . import backend

        options = dict(variant.backend_options) or None
        forward = torch.compile(model, backend="teeny", mode=variant.backend_mode, options=options)
        regions_before = len(backend.reports())
    graphed = cuda and variant.compile_mode == "reduce-overhead"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    autocast = precision == "bf16-autocast"

    def step() -> torch.Tensor:
        if graphed:  # a new step: the last step's CUDA-graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = compute_loss(forward, batch, made.loss_fn)
        loss.backward()
        optimizer.step()
        return loss.detach().float().clone()  # clone: a CUDA graph's output is overwritten by its next replay

    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    losses = [step()]
    _sync(device)
    first_step_s = time.perf_counter() - start  # with the compile cost
    losses += [step() for _ in range(warmup)]
    seconds = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            losses.append(step())
            end.record()
            seconds.append((begin, end))
        else:
            start = time.perf_counter()
            losses.append(step())
            seconds.append(time.perf_counter() - start)
    _sync(device)
    if cuda:
        seconds = [begin.elapsed_time(end) / 1e3 for begin, end in seconds]
    mean = sum(seconds) / len(seconds)
    tokens = _tokens(batch)
    values = [float(v) for v in losses]
    if variant.teeny_backend:
        note = backend.summary(backend.reports()[regions_before:])
    return Row(
        variant=variant.name,
        status="ok",
        note=note,
        first_step_s=first_step_s,
        step_ms=mean * 1e3,
        tokens_per_s=tokens / mean if tokens else None,
        peak_mib=torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        first_loss=values[0],
        last_loss=values[-1],
        losses=values,
    )


def run_bench(
    made: BenchModel,
    variants: list[str],
    *,
    steps: int = 10,
    warmup: int = 3,
    precision: str | None = None,
    lr: float = 1e-4,
    seed: int = 0,
    compile_on_cpu: bool = False,
    log: Callable[[str], None] = lambda line: None,
    show_traceback: bool = False,
) -> tuple[list[Row], dict[str, Any]]:
    """Every variant of ``variants`` (names of ``VARIANTS``) on teeny's device, Liger last; the
    rows in the order run and the run's settings."""
    device = teeny_device.DEVICE
    precision = precision or ("bf16-autocast" if device.type == "cuda" else "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    order = sorted(variants, key=lambda name: VARIANTS[name].liger)  # Liger patches transformers for good
    made = dataclasses.replace(made, model=made.model.to("cpu"))  # the weights every variant copies; off the GPU
    batch = _to(made.batch, device)
    rows = []
    for name in order:
        variant = VARIANTS[name]
        reason = _skip_reason(variant, made.model, device, compile_on_cpu)
        if reason:
            rows.append(Row(name, "skipped", reason))
            log(f"{name}: skipped: {reason}")
            continue
        log(f"{name}: running {1 + warmup + steps} steps")
        try:
            row = run_variant(
                variant, made, batch, device=device, steps=steps, warmup=warmup, precision=precision, lr=lr, seed=seed
            )
        except Exception as exc:  # one variant failing must not hide the others
            if show_traceback:
                traceback.print_exc()
            row = Row(name, "failed", _one_line(exc))
        log(f"{name}: {row.status}: {row.note}" if row.status != "ok" else f"{name}: {_summary(row)}")
        rows.append(row)
        if variant.compile_mode or variant.teeny_backend:
            torch._dynamo.reset()  # the next variant compiles afresh, within the recompile limits
        gc.collect()
    tokens = _tokens(batch)
    settings = {
        "device": teeny_device.describe(),
        "precision": precision,
        "steps": steps,
        "warmup": warmup,
        "lr": lr,
        "seed": seed,
        "tokens_per_step": tokens,
        "parameters": sum(p.numel() for p in made.model.parameters()),
        "torch": torch.__version__,
        "transformers": getattr(sys.modules.get("transformers"), "__version__", None),
        "teeny": getattr(sys.modules.get("teeny"), "__version__", None),
    }
    return rows, settings


def _summary(row: Row) -> str:
    """An ``ok`` row on one line: what a run cut short by a time limit still leaves on stderr."""
    peak = "" if row.peak_mib is None else f", peak {row.peak_mib:,.0f} MiB"
    return (
        f"first step {row.first_step_s:.2f} s, {row.step_ms:.2f} ms/step{peak}, "
        f"loss {row.first_loss:.4f} -> {row.last_loss:.4f}"
    )


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def format_table(rows: list[Row]) -> str:
    """The rows as a Markdown table (``vs eager``: eager's step time over the variant's)."""
    eager = next((r.step_ms for r in rows if r.variant == "eager" and r.status == "ok"), None)
    lines = [
        "| variant | first step s | step ms | vs eager | tokens/s | peak MiB | first loss | last loss | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        speedup = eager / r.step_ms if eager and r.step_ms else None
        note = r.note if r.status == "ok" else f"{r.status}: {r.note}"
        cells = [
            r.variant,
            _cell(r.first_step_s, ".2f"),
            _cell(r.step_ms, ".2f"),
            "–" if speedup is None else f"{speedup:.2f}x",
            _cell(r.tokens_per_s, ",.0f"),
            _cell(r.peak_mib, ",.0f"),
            _cell(r.first_loss, ".4f"),
            _cell(r.last_loss, ".4f"),
            note.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per variant from the rows of each round (see the module docstring's Rounds): ``ok``
    when every round's is, with the median step time; else the first round's row that is not."""
    rows = []
    for name in [r.variant for r in rounds[0]]:
        runs = [next(r for r in rows_ if r.variant == name) for rows_ in rounds]
        bad = next((r for r in runs if r.status != "ok"), None)
        if bad is not None:
            rows.append(bad)
            continue
        first = runs[0]
        step_ms = statistics.median(r.step_ms for r in runs)
        peaks = [r.peak_mib for r in runs if r.peak_mib is not None]
        tokens = first.tokens_per_s * first.step_ms / step_ms if first.tokens_per_s else None
        ms = ", ".join(f"{r.step_ms:.2f}" for r in runs)
        note = f"rounds {ms} ms" + (f"; {first.note}" if first.note else "")
        rows.append(dataclasses.replace(first, step_ms=step_ms, tokens_per_s=tokens, peak_mib=max(peaks, default=None),
                                        note=note, round_ms=[r.step_ms for r in runs]))  # fmt: skip
    return rows


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt value`` or ``--opt=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in options)):
            out.append(a)
    return out


def _bench_rounds(args, say: Callable[[str], None]) -> int:
    """``--rounds N``: the same command N times in fresh processes, combined (``combine_rounds``)."""
    argv = _without(getattr(args, "argv", None) or sys.argv[1:], ("--rounds", "--json"))
    rounds, report = [], {}
    fields = {f.name for f in dataclasses.fields(Row)}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            say(f"round {i + 1} of {args.rounds}")
            path = f"{folder}/round{i}.json"
            done = subprocess.run([sys.executable, "-m", "teeny", *argv, "--json", path], stdout=subprocess.DEVNULL)
            try:
                with open(path) as f:
                    report = json.load(f)
            except OSError:  # the round could not load the factory (its error is on stderr)
                return done.returncode or 2
            rounds.append([Row(**{k: v for k, v in row.items() if k in fields}) for row in report["rows"]])
            # each round's times as it ends: a run cut short by a time limit still says what it measured
            times = (f"{r.variant} {r.step_ms:.2f} ms" if r.step_ms else f"{r.variant} {r.status}" for r in rounds[-1])
            say(f"round {i + 1}: {', '.join(times)}")
    rows = combine_rounds(rounds)
    report.update(rounds=args.rounds, rows=[dataclasses.asdict(r) for r in rows])
    _print_report(args, report, rows)
    if args.json:
        _write_report(args.json, report, say)
    return 1 if any(r.status == "failed" for r in rows) else 0


def _print_report(args, settings: dict[str, Any], rows: list[Row]) -> None:
    tokens = settings["tokens_per_step"]
    rounds = settings.get("rounds", 1)
    print(
        f"teeny bench {args.spec} on {settings['device']}: {settings['parameters']:,} parameters, "
        f"{settings['precision']}, {settings['steps']} timed steps after 1 + {settings['warmup']} warm-up"
        + (f", {tokens:,} tokens a step" if tokens else "")
        + (f"; the median of {rounds} rounds, each in a fresh process" if rounds > 1 else "")
        + "\n"
    )
    print(format_table(rows))


def _write_report(path: str, report: dict[str, Any], say: Callable[[str], None]) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    say(f"results in {path}")


def cmd_bench(args) -> int:
    """``teeny bench``: the table on stdout, ``--json`` to a file; exit 2 for a factory that
    cannot be loaded or breaks the contract, 1 when a variant failed, else 0."""
    from .task import load_factory

    def say(line: str) -> None:
        print(f"teeny bench: {line}", file=sys.stderr, flush=True)

    if getattr(args, "rounds", 1) > 1:
        return _bench_rounds(args, say)

    try:
        variants = parse_variants(args.variants)
        factory = load_factory(args.spec)
    except (ValueError, OSError) as exc:
        print(f"teeny bench: {args.spec}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        made = bench_model(factory())
    except Exception as exc:  # the user's factory failed (a missing package, a bad return): one line, not a traceback
        print(f"teeny bench: {args.spec}: {_one_line(exc)}", file=sys.stderr)
        return 2
    rows, settings = run_bench(
        made,
        variants,
        steps=args.steps,
        warmup=args.warmup,
        precision=args.precision,
        lr=args.lr,
        seed=args.seed,
        compile_on_cpu=args.compile_on_cpu,
        log=say,
        show_traceback=args.traceback,
    )
    _print_report(args, settings, rows)
    if args.json:
        _write_report(args.json, {"model": args.spec, **settings, "rows": [dataclasses.asdict(r) for r in rows]}, say)
    return 1 if any(r.status == "failed" for r in rows) else 0
