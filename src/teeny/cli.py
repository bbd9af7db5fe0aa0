"""The ``teeny`` command: ``teeny ops``, ``teeny gradcheck [OP ...]``, ``teeny train MODEL``,
``teeny bench FILE.py:make_model``, ``teeny export-hf CHECKPOINT -o DIR``.

The device is chosen before teeny is imported (``--device`` sets TEENY_DEVICE), because the
Triton interpreter must be switched on before any kernel is defined. Each subcommand is one
``add_<name>`` function (its arguments) and one ``cmd_<name>`` function (what it does).

``teeny train`` runs data-parallel when started by torchrun (``torchrun --nproc-per-node N -m
teeny train MODEL ...``); ``teeny train MODEL --nproc N`` starts torchrun itself. Exit codes: 0
done, 1 failed (``gradcheck``: an op failed; ``bench``: a variant failed; ``train``: the loss
diverged, a process died or hung, a file could not be written), 2 bad input (arguments,
checkpoint, output folder or one in use, a model file or task that breaks its contract), 130
interrupted, 141 output closed early (``teeny ops | head``). Every failure teeny expects ends in
one line on stderr (``_exit_code`` maps errors to codes); a traceback means a bug in teeny.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

MODELS = ("mlp", "cnn", "gpt")  # teeny.training.models.make_task knows each; kept here so parsing imports no kernel
DEVICES = ("auto", "cpu", "cuda")
SIZES = ("small", "large", "gpt2")  # the gpt sizes make_task knows


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="teeny", description="Triton kernel pairs that train models.")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="where kernels run (default: the GPU if there is one, else the Triton interpreter)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_ops(sub)
    add_gradcheck(sub)
    add_train(sub)
    add_build(sub)
    add_bench(sub)
    add_export_hf(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    problem = _choose_device(getattr(args, "train_device", None) or args.device)
    if problem:
        print(f"teeny: {problem}", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `teeny ops | head`: the reader left; end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the final flush at exit must not fail again
        return 141
    except Exception as exc:
        code = _exit_code(exc)
        if code is None:  # not a failure teeny expects: a bug, shown with its traceback
            raise
        print(f"teeny {args.command}: {_one_line(exc)}", file=sys.stderr)
        return code


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of a failure teeny expects, or None for a bug. teeny's errors carry theirs
    (``exit_code``: 2 bad input, 1 the run failed); any other ``OSError`` is a file that could not
    be read or written (a full disk, a folder taken away): 1."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    return 1 if isinstance(exc, OSError) else None


def _one_line(exc: BaseException) -> str:
    """An error's message on one line (an ``OSError`` as its file and reason)."""
    if isinstance(exc, OSError) and exc.strerror and not hasattr(exc, "exit_code"):
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return " ".join(str(exc).split())


def _choose_device(device: str | None) -> str | None:
    """Set TEENY_DEVICE before anything imports teeny's kernels; a problem as one line, or None."""
    if device:
        os.environ["TEENY_DEVICE"] = device
    choice = os.environ.get("TEENY_DEVICE", "auto").strip().lower() or "auto"
    if choice not in (*DEVICES, "gpu"):
        return f"TEENY_DEVICE={choice!r}: expected one of {', '.join(DEVICES)}"
    if choice in ("cuda", "gpu"):
        import torch

        if not torch.cuda.is_available():
            return "--device cuda, but torch sees no CUDA device here (use --device cpu, or run on a GPU machine)"
    return None


# ------------------------------------------------------------------------------ teeny ops


def add_build(sub) -> None:
    p = sub.add_parser("build", help="compile a model's kernels ahead of time for GPU targets (no GPU needed)")
    p.add_argument("model", help=f"one of: {', '.join(MODELS)}, or module:function (batch size -> Graph)")
    p.add_argument("--target", default="cuda:90", help="cuda:ARCH[@SMS], comma-separated: cuda:90,cuda:80")
    p.add_argument("--mode", choices=["training", "inference"], default="training")
    p.add_argument("--batch-size", type=_positive_int)
    p.add_argument(
        "--size", choices=SIZES, default="small", help="gpt: model size (gpt2: 12 layers, d 768, context 1024)"
    )
    p.add_argument("--params", metavar="CHECKPOINT", help="store these parameters (a checkpoint, or 'init')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", required=True, help="the bundle file to write")
    p.set_defaults(run=cmd_build)


def cmd_build(args) -> int:
    from .aot import cmd_build as build

    return build(args)


def add_ops(sub) -> None:
    p = sub.add_parser("ops", help="list every registered op with its dtypes and whether it has a backward")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_ops)


def cmd_ops(args) -> int:
    from .checks.facts import op_facts
    from .checks.samples import all_ops

    rows = []
    for info in all_ops():
        facts = op_facts(info)
        rows.append(
            {
                "name": info.name,
                "family": info.family,
                "dtypes": [str(d).replace("torch.", "") for d in facts.dtypes],
                "backward": facts.has_backward,
                "kernels": [k.name for k in facts.kernels],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'op':24} {'family':12} {'backward':8}  dtypes")
    for r in rows:
        print(f"{r['name']:24} {r['family']:12} {'yes' if r['backward'] else 'no':8}  {', '.join(r['dtypes'])}")
    print(f"{len(rows)} ops, {sum(r['backward'] for r in rows)} with a backward")
    return 0


# ------------------------------------------------------------------------ teeny gradcheck


def add_gradcheck(sub) -> None:
    p = sub.add_parser("gradcheck", help="check backward kernels against central finite differences (float64)")
    p.add_argument("ops", nargs="*", metavar="OP", help="ops to check (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_gradcheck)


def cmd_gradcheck(args) -> int:
    import torch

    from .checks.facts import op_facts
    from .checks.gradcheck import gradcheck
    from .checks.samples import all_ops

    infos = {i.name: i for i in all_ops()}
    unknown = [name for name in args.ops if name not in infos]
    if unknown:
        print(f"teeny gradcheck: unknown op(s) {', '.join(unknown)}; `teeny ops` lists them", file=sys.stderr)
        return 2
    selected = [infos[n] for n in args.ops] if args.ops else list(infos.values())
    rows, failed = [], 0
    for info in selected:
        if not op_facts(info).has_backward:
            rows.append(
                {
                    "op": info.name,
                    "status": "n/a",
                    "samples": 0,
                    "max_error": None,
                    "detail": "inference-only op: no backward to check",
                }
            )
            continue
        gen = torch.Generator().manual_seed(0)
        status, detail, max_err, count = "ok", "", 0.0, 0
        for sample in info.gradcheck_inputs(gen):
            if not sample.has_gradient_to_check():
                continue  # e.g. stop_gradient: nothing differentiable to check in this sample
            try:
                result = gradcheck(
                    info.op, *sample.args, kwargs=sample.kwargs, requires_grad=sample.wants_grad, raise_on_failure=False
                )
            except Exception as exc:  # an op that cannot even run is a failure, reported, not a crash
                status, detail = "error", f"{sample.name}: {type(exc).__name__}: {exc}"
                break
            count += 1
            max_err = max(max_err, result.max_abs_error)
            if not result.ok:
                status, detail = "FAIL", f"{sample.name}: " + result.report(limit=3)
                break
        if status == "ok" and count == 0:
            status = "n/a"  # no sample has a gradient to check (stop_gradient)
        failed += status not in ("ok", "n/a")
        rows.append({"op": info.name, "status": status, "samples": count, "max_error": max_err, "detail": detail})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'op':24} {'status':8} {'samples':>7} {'max abs error':>14}")
        for r in rows:
            err = "" if r["max_error"] is None else f"{r['max_error']:.2e}"
            print(f"{r['op']:24} {r['status']:8} {r['samples']:>7} {err:>14}")
            if r.get("detail"):
                print(f"    {r['detail']}")
        print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------- teeny bench


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time your model's training step: eager, torch.compile, teeny, Liger-Kernel (see teeny.torch.bench)",
    )
    p.add_argument("spec", metavar="FILE.py:FUNCTION", help="returns (model, batch[, loss_fn]); see teeny.torch.bench")
    p.add_argument("--steps", type=_positive_int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=_non_negative_int, default=3, help="untimed steps after the first (default 3)")
    p.add_argument(
        "--variants",
        default="all",
        help="comma-separated, in order: eager, compile (every mode) or compile-default, compile-reduce-overhead, "
        "compile-max-autotune-no-cudagraphs, teeny-patch, teeny-patch+compile, liger; default all",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="run every variant this many times, each round in a fresh process; the step time is the median "
        "over the rounds (default 1)",
    )
    p.add_argument(  # teeny.torch.bench.PRECISIONS, named here so that parsing imports no kernel
        "--precision", choices=["fp32", "bf16-autocast"], help="default: bf16-autocast on CUDA, fp32 on the CPU"
    )
    p.add_argument("--lr", type=_positive_float, default=1e-4, help="AdamW's learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-on-cpu", action="store_true", help="run the torch.compile variants on the CPU too")
    p.add_argument("--traceback", action="store_true", help="print a failed variant's traceback to stderr")
    p.add_argument("--device", dest="train_device", choices=DEVICES, default=None, help="same as the global --device")
    p.set_defaults(run=cmd_bench)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def cmd_bench(args) -> int:
    from .torch.bench import cmd_bench as bench

    return bench(args)


# ---------------------------------------------------------------------------- teeny train


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (data-parallel with --nproc N or under torchrun)")
    p.add_argument("model", nargs="?", help=f"one of: {', '.join(MODELS)} (or --torch-model)")
    p.add_argument(
        "--torch-model",
        metavar="FILE.py:FUNCTION",
        help="train the torch.nn.Module that FUNCTION returns (with example inputs; see teeny.torch.task)",
    )
    p.add_argument("--data", choices=["digits", "digits-image", "chars"], help="--torch-model: the bundled data set")
    p.add_argument("--epochs", type=_positive_int)
    p.add_argument("--batch-size", type=_positive_int, help="the global batch (split over --nproc processes)")
    p.add_argument("--lr", type=_positive_float)
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"])
    p.add_argument("--weight-decay", type=_non_negative_float)
    p.add_argument("--schedule", choices=["constant", "cosine"])
    p.add_argument("--clip", type=_positive_float, help="clip gradients to this global norm")
    p.add_argument(
        "--size", choices=SIZES, default="small", help="gpt: model size (gpt2: 12 layers, d 768, context 1024)"
    )
    p.add_argument(
        "--precision",
        choices=["bf16-mixed", "fp16-mixed"],
        help="bfloat16 / float16 compute with float32 master weights (fp16: with dynamic loss scaling)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="keep less for the backward: write norms' and activations' outputs again there (2-6%% slower on the H200)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=_positive_int, help="stop after this many steps in total")
    p.add_argument("--checkpoint-every", type=_positive_int, metavar="STEPS", help="default: every epoch")
    p.add_argument(
        "--out",
        help="folder for the checkpoint and the --log files (default: the resumed checkpoint's folder, else "
        "runs/latest); a run that does not resume replaces an earlier run's files there; one run at a time "
        "(a second is refused while the first holds DIR/.lock)",
    )
    p.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint file")
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="SETTING",
        help="resume although SETTING (e.g. batch_size, lr; comma-separated or repeated; 'all') differs from the "
        "checkpoint's, which breaks exactness",
    )
    p.add_argument(
        "--log",
        metavar="WRITERS",
        help="where metrics go, comma-separated: jsonl (metrics.jsonl), png (loss.png), tensorboard (event files; "
        "needs the tensorboard package); default jsonl,png",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--nproc", type=_positive_int, help="train data-parallel on N processes (starts torchrun)")
    p.add_argument("--zero", action="store_true", help="data-parallel: shard the optimizer state (ZeRO stage 1)")
    p.add_argument("--bucket-mb", type=_positive_float, help="data-parallel: gradient bucket size (MiB, default 25)")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="data-parallel: seconds to wait for another process before stopping (default 600)",
    )
    p.add_argument(
        "--device",
        dest="train_device",
        choices=DEVICES,
        default=None,
        help="same as the global --device",
    )
    p.set_defaults(run=cmd_train)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_train(args) -> int:
    if args.torch_model and args.model:
        print("teeny train: give a model name or --torch-model, not both", file=sys.stderr)
        return 2
    if not args.torch_model and args.model not in MODELS:
        print(f"teeny train: unknown model {args.model!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    if args.nproc and not _under_torchrun():
        return start_torchrun(args.nproc, _without_nproc(args.argv))
    world = None
    if _under_torchrun():
        from .training.distributed import DistributedError, init

        if args.nproc and args.nproc != int(os.environ["WORLD_SIZE"]):
            started = os.environ["WORLD_SIZE"]
            print(f"teeny train: --nproc {args.nproc}, but torchrun started {started} processes", file=sys.stderr)
            return 2
        try:
            world = init(timeout=args.timeout)  # before any kernel: binds this process to its GPU
        except DistributedError as exc:
            print(f"teeny train: {exc}", file=sys.stderr)
            return 2
    try:
        code = _train(args, world)
    finally:
        if world is not None:
            from .training.distributed import shutdown

            shutdown()
    if world is not None:
        from .training.distributed import end_process

        end_process(code)  # every file is written and closed: end past the group's teardown
    return code


def _train(args, world) -> int:
    lead = world is None or world.rank == 0
    say = print if lead else (lambda *a, **k: None)
    from .core import device
    from .training.distributed import DistributedError
    from .training.loop import TrainConfig, train
    from .training.models import make_task

    if args.torch_model:
        from .core.errors import TeenyError
        from .torch.task import torch_model_task

        try:
            task = torch_model_task(args.torch_model, data=args.data)
        except (ValueError, OSError, TeenyError) as exc:  # a factory that cannot be loaded or imported
            print(f"teeny train: --torch-model {args.torch_model}: {_one_line(exc)}", file=sys.stderr)
            return 2
    else:
        task = make_task(args.model, args.size)
    settings = dict(getattr(task, "defaults", None) or {})
    settings.pop("epoch_tokens", None)
    for key in (
        "epochs",
        "batch_size",
        "lr",
        "optimizer",
        "weight_decay",
        "schedule",
        "clip",
        "checkpoint_every",
        "precision",
    ):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    if args.bucket_mb is not None:
        settings["bucket_mb"] = args.bucket_mb
    if args.log is not None:  # TrainConfig refuses an unknown name
        settings["log_to"] = tuple(name.strip() for name in args.log.split(",") if name.strip())
    out = args.out or (os.path.dirname(os.path.abspath(args.resume)) if args.resume else "runs/latest")
    config = TrainConfig(
        **settings,
        seed=args.seed,
        out=out,
        max_steps=args.steps,
        progress=not args.no_progress,
        zero=args.zero,
        recompute=args.recompute,
    )
    where = device.describe() if world is None else f"{world.size} processes on {device.describe()}"
    say(
        f"teeny train {task.name} on {where}: {config.epochs} epochs, batch {config.batch_size}, "
        f"{config.optimizer} lr {config.lr}"
    )
    allow = [name.strip() for item in args.allow_change for name in item.split(",") if name.strip()]
    try:
        result = train(task, config, resume=args.resume, allow_change=allow, world=world, log=say)
    except Exception as exc:
        code = 2 if isinstance(exc, ValueError) else _exit_code(exc)  # ValueError: a setting TrainConfig refused
        if code is None:
            raise
        if lead or isinstance(exc, DistributedError):  # the others raise what rank 0 found; a lost peer, their own
            print(f"teeny train: {_one_line(exc)}", file=sys.stderr)
        return code
    if result.get("nothing_to_do"):
        return 0
    objects = ("executor", "optimizer")
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k not in objects}
    say("final:", json.dumps(shown))
    if args.model == "gpt" and lead:
        say("sample:\n" + task.sample(result["executor"].params))
    if args.torch_model and lead:  # the trained weights back in the torch module, and its state_dict as safetensors
        from .torch import to_torch
        from .torch.task import TORCH_STATE_NAME, save_torch_state

        to_torch(result["executor"], task.torch_module)
        save_torch_state(task.torch_module, os.path.join(config.out, TORCH_STATE_NAME))
        say(f"torch state_dict in {os.path.join(config.out, TORCH_STATE_NAME)}")
    from .training.callbacks import WRITERS

    written = ["checkpoint", *(WRITERS[name].files for name in config.log_to)]
    say(f"{', '.join(written[:-1])}{' and ' if len(written) > 1 else ''}{written[-1]} in {config.out}")
    return 0


# ------------------------------------------------------------------------ teeny export-hf


def add_export_hf(sub) -> None:
    p = sub.add_parser(
        "export-hf", help="write a `teeny train gpt` checkpoint as a transformers model folder (GPT2LMHeadModel)"
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint.safetensors of `teeny train gpt`")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="the folder for config.json and model.safetensors")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--force", action="store_true", help="write into DIR although it is not empty")
    p.set_defaults(run=cmd_export_hf)


def cmd_export_hf(args) -> int:
    import torch

    from .training.hf_export import ARCHITECTURE, export_hf

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_hf(args.checkpoint, args.out, dtype=dtype, force=args.force)
    print(f"{ARCHITECTURE} in {out}: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    rest, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--nproc":
            skip = True
        elif not token.startswith("--nproc="):
            rest.append(token)
    return rest


def torchrun_options(nproc: int, argv: list[str]):
    """torchrun's options for ``python -m teeny ARGV`` on ``nproc`` processes. "--" ends torchrun's
    own options: without it torchrun's parser reads teeny's (``--log`` as an abbreviation of its
    ``--log-dir``) and refuses the command."""
    from torch.distributed.run import get_args_parser

    command = ["--standalone", f"--nproc-per-node={nproc}", "--no-python", "--", sys.executable, "-m", "teeny"]
    return get_args_parser().parse_args([*command, *argv])


def start_torchrun(nproc: int, argv: list[str]) -> int:
    """Run ``python -m teeny ARGV`` on ``nproc`` processes of this machine through torchrun
    (standalone rendezvous) and return the exit code of the first process that failed (0 if
    none did). Each process prints its own errors; rank 0 prints the progress."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are reported below
    try:
        run(torchrun_options(nproc, argv))
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        first = min(codes)
        code = codes[first]
        if code not in (1, 2):  # not one of teeny's own failures, which the process has explained
            print(f"teeny train: process {first} ended with exit code {code}", file=sys.stderr)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
