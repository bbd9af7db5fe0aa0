"""The ``teeny`` command: ``teeny ops``, ``teeny gradcheck [OP ...]``, ``teeny train MODEL``.

The device is chosen before teeny is imported (``--device`` sets TEENY_DEVICE), because the
Triton interpreter must be switched on before any kernel is defined.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODELS = ("mlp", "cnn", "gpt")  # teeny.models.make_task knows each; kept here so parsing imports no kernel
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
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="teeny", description="Triton kernel pairs that train models.")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="where kernels run (default: the GPU if there is one, else the Triton interpreter)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_ops = sub.add_parser("ops", help="list every registered op with its dtypes and whether it has a backward")
    p_ops.add_argument("--json", action="store_true", help="machine-readable output")

    p_grad = sub.add_parser("gradcheck", help="check backward kernels against central finite differences (float64)")
    p_grad.add_argument("ops", nargs="*", metavar="OP", help="ops to check (default: all)")
    p_grad.add_argument("--json", action="store_true", help="machine-readable output")

    p_train = sub.add_parser("train", help="train a model")
    p_train.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    p_train.add_argument("--epochs", type=_positive_int)
    p_train.add_argument("--batch-size", type=_positive_int)
    p_train.add_argument("--lr", type=_positive_float)
    p_train.add_argument("--optimizer", choices=["sgd", "adam", "adamw"])
    p_train.add_argument("--weight-decay", type=float)
    p_train.add_argument("--schedule", choices=["constant", "cosine"])
    p_train.add_argument("--clip", type=_positive_float, help="clip gradients to this global norm")
    p_train.add_argument(
        "--size", choices=SIZES, default="small", help="gpt: model size (gpt2: 12 layers, d 768, context 1024)"
    )
    p_train.add_argument(
        "--precision", choices=["bf16-mixed"], help="bf16-mixed: bfloat16 compute, float32 master weights"
    )
    p_train.add_argument("--seed", type=int, default=0)
    p_train.add_argument("--steps", type=_positive_int, help="stop after this many steps in total")
    p_train.add_argument("--out", default="runs/latest", help="folder for checkpoint, metrics.jsonl and loss.png")
    p_train.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint file")
    p_train.add_argument("--no-progress", action="store_true")
    p_train.add_argument(
        "--device",
        dest="train_device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="same as the global --device",
    )

    p_build = sub.add_parser("build", help="compile a model's kernels ahead of time for GPU targets (no GPU needed)")
    p_build.add_argument("model", help=f"one of: {', '.join(MODELS)}, or module:function (batch size -> Graph)")
    p_build.add_argument("--target", default="cuda:90", help="cuda:ARCH[@SMS], comma-separated: cuda:90,cuda:80")
    p_build.add_argument("--mode", choices=["training", "inference"], default="training")
    p_build.add_argument("--batch-size", type=_positive_int)
    p_build.add_argument("--size", choices=SIZES, default="small", help="gpt: model size")
    p_build.add_argument("--params", metavar="CHECKPOINT", help="store these parameters (a checkpoint, or 'init')")
    p_build.add_argument("--seed", type=int, default=0)
    p_build.add_argument("-o", "--out", required=True, help="the bundle file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = getattr(args, "train_device", None) or args.device
    if device:
        os.environ["TEENY_DEVICE"] = device
    try:
        if args.command == "ops":
            return cmd_ops(args)
        if args.command == "gradcheck":
            return cmd_gradcheck(args)
        if args.command == "build":
            from .aot import cmd_build

            return cmd_build(args)
        return cmd_train(args, parser)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_ops(args) -> int:
    from .ops import all_ops

    rows = []
    for info in all_ops():
        rows.append(
            {
                "name": info.name,
                "family": info.family,
                "dtypes": [str(d).replace("torch.", "") for d in info.dtypes],
                "backward": info.has_backward,
                "kernels": [k.name for k in info.kernels],
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


def cmd_gradcheck(args) -> int:
    import torch

    from .gradcheck import gradcheck
    from .ops import all_ops

    infos = {i.name: i for i in all_ops()}
    unknown = [name for name in args.ops if name not in infos]
    if unknown:
        print(f"teeny gradcheck: unknown op(s) {', '.join(unknown)}; `teeny ops` lists them", file=sys.stderr)
        return 2
    selected = [infos[n] for n in args.ops] if args.ops else list(infos.values())
    rows, failed = [], 0
    for info in selected:
        if not info.has_backward:
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


def cmd_train(args, parser) -> int:
    if args.model not in MODELS:
        print(f"teeny train: unknown model {args.model!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    import torch  # noqa: F401

    from . import device
    from .models import make_task
    from .train import CheckpointError, TrainConfig, train

    task = make_task(args.model, args.size)
    settings = dict(task.defaults)
    settings.pop("epoch_tokens", None)
    for key in ("epochs", "batch_size", "lr", "optimizer", "weight_decay", "schedule", "clip", "precision"):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    config = TrainConfig(**settings, seed=args.seed, out=args.out, max_steps=args.steps, progress=not args.no_progress)
    print(
        f"teeny train {args.model} on {device.describe()}: {config.epochs} epochs, batch {config.batch_size}, "
        f"{config.optimizer} lr {config.lr}{', ' + config.precision if config.precision else ''}"
    )
    try:
        result = train(task, config, resume=args.resume)
    except (CheckpointError, ValueError) as exc:
        print(f"teeny train: {exc}", file=sys.stderr)
        return 2
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "executor"}
    print("final:", json.dumps(shown))
    if args.model == "gpt":
        print("sample:\n" + task.sample(result["executor"].params))
    if args.out:
        print(f"checkpoint, metrics.jsonl and loss.png in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
