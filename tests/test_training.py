"""End to end: a teeny MLP against the same PyTorch MLP (gradients, and 20 optimizer steps of
losses), kill-and-resume, checkpoint integrity, resume refusals, diverging runs, run folders,
the `teeny train` command's errors, and the README's example."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import teeny
from helpers import regression_task
from teeny import Graph, LoweringMode, lower, ops
from teeny.training.loop import (
    CheckpointError,
    DivergedError,
    RunDirError,
    TrainConfig,
    load_checkpoint,
    save_checkpoint,
    train,
)
from teeny.training.models import MLP
from teeny.training.optim import SGD, AdamW


class TorchMLP(torch.nn.Module):
    def __init__(self, d_in, hidden, classes):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _pair(dtype, batch=13, d_in=11, hidden=17, classes=5):
    model = MLP(d_in, hidden, classes).to(dtype)
    g = Graph()
    x = g.input("x", (batch, d_in), dtype)
    y = g.input("y", (batch,), torch.int64)
    logits = model(x)
    g.output(ops.cross_entropy(logits, y), logits)
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING), seed=0)
    ref = TorchMLP(d_in, hidden, classes).to(dtype)
    ref.load_state_dict({k: v.detach().cpu().clone() for k, v in ex.params.items()})
    return ex, ref


def _data(dtype, steps, batch=13, d_in=11, classes=5):
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(batch, d_in, generator=gen).to(dtype), torch.randint(classes, (batch,), generator=gen))
        for _ in range(steps)
    ]


def test_mlp_parameter_gradients_match_pytorch():
    ex, ref = _pair(torch.float32)
    ((x, y),) = _data(torch.float32, 1)
    (loss, _), cache = ex.forward_train({"x": x, "y": y})
    ex.backward(cache)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-6, rtol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ex.grads[name].cpu(), p.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_mlp_graph_gradcheck_float64():
    model = MLP(3, 4, 3).to(torch.float64)  # small: every parameter element is perturbed twice
    g = Graph()
    x = g.input("x", (4, 3), torch.float64)
    y = g.input("y", (4,), torch.int64)
    g.output(ops.cross_entropy(model(x), y))
    gen = torch.Generator().manual_seed(0)
    teeny.gradcheck_graph(
        g, {"x": torch.randn(4, 3, dtype=torch.float64, generator=gen), "y": torch.randint(3, (4,), generator=gen)}
    )


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-4), (torch.float64, 1e-10)], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
def test_twenty_steps_of_losses_match_pytorch(dtype, rel, kind):
    """Each step on a new batch (the momentum and the moments carry over): in float32 teeny's
    losses stay within about 2e-7 of PyTorch's at every step, with no drift, well inside ``rel``."""
    ex, ref = _pair(dtype)
    if kind == "sgd_momentum":
        opt, ref_opt = SGD(ex, lr=0.05, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = AdamW(ex, lr=3e-3, weight_decay=0.05)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05)
    for step, (x, y) in enumerate(_data(dtype, 20)):
        opt.zero_grad()
        (loss, _), cache = ex.forward_train({"x": x, "y": y})
        ex.backward(cache)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        diff = abs(float(loss) - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
        assert diff < rel, f"step {step}: teeny {float(loss)} torch {ref_loss.item()}"


CKPT = "checkpoint.safetensors"


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def _config(tmp_path, name, **kw):
    return TrainConfig(
        epochs=2,
        batch_size=128,
        lr=2e-3,
        optimizer="adamw",
        out=str(tmp_path / name),
        progress=False,
        log_every=1,
        **kw,
    )


def test_kill_and_resume_gives_the_same_parameters(tmp_path):
    from teeny.training.models import make_task

    full = train(make_task("mlp"), _config(tmp_path, "full"), log=lambda *_: None)
    assert full["step"] == 22  # 2 epochs of 11 batches of 128
    # "killed" after 7 steps (mid-epoch), then resumed from its checkpoint
    part = train(make_task("mlp"), _config(tmp_path, "part", max_steps=7), log=lambda *_: None)
    assert part["step"] == 7
    resumed = train(
        make_task("mlp"),
        _config(tmp_path, "part"),
        resume=str(tmp_path / "part" / "checkpoint.safetensors"),
        log=lambda *_: None,
    )
    assert resumed["step"] == full["step"]
    for name, value in full["executor"].params.items():
        assert torch.equal(value, resumed["executor"].params[name]), name
    rows = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) > 10 and (tmp_path / "full" / "loss.png").stat().st_size > 1000


def test_truncated_or_foreign_checkpoint_is_refused(tmp_path):
    ex, _ = _pair(torch.float32)
    opt = AdamW(ex)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, ex, opt, step=3)
    params, state, meta = load_checkpoint(path)
    assert meta["step"] == "3" and set(params) == set(ex.params) and int(state["step"]) == 0
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(other))
    with pytest.raises(CheckpointError, match="not a teeny checkpoint"):
        load_checkpoint(other)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_atomic_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ex, _ = _pair(torch.float32)
    opt = AdamW(ex)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, ex, opt, step=1)
    import safetensors.torch

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError):
        save_checkpoint(path, ex, opt, step=2)
    assert load_checkpoint(path)[2]["step"] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors"]  # no .tmp left behind


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "resnet"], "unknown model 'resnet'"),
        (["train", "mlp", "--epochs", "0"], "must be >= 1"),
        (["train", "mlp", "--lr", "abc"], "expected a number"),
        (["train", "mlp", "--optimizer", "rmsprop"], "invalid choice"),
        (["train", "mlp", "--lr", "inf"], "must be a finite number"),
        (["train", "mlp", "--weight-decay", "nan"], "must be a finite number >= 0"),
    ],
)
def test_cli_bad_input_is_a_clear_message(argv, message, capsys):
    from teeny.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_unreadable_checkpoint(tmp_path, capsys):
    from teeny.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    code = main(["train", "mlp", "--resume", str(bad), "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2
    assert "unreadable" in capsys.readouterr().err


def _quiet(*args, **kwargs):
    pass


def test_train_your_own_graph_and_data(tmp_path):
    task, true_w = regression_task()
    # 10 epochs of 6 steps reach the true weights to float32 rounding (about 1e-7); lr 0.05 with
    # the default momentum 0.9 took 30 epochs to come within 5e-4
    config = TrainConfig(
        epochs=10, batch_size=16, lr=0.1, momentum=0.5, optimizer="sgd", out=str(tmp_path), progress=False
    )
    result = train(task, config, log=_quiet)
    params = result["executor"].params
    weight = [v for k, v in params.items() if k.endswith("weight")][0]
    torch.testing.assert_close(weight.cpu(), true_w, atol=1e-3, rtol=1e-3)
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoint.safetensors").exists()


def _strict_rows(path: Path) -> list[dict]:
    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("lr,why", [(1e30, r"the loss is (inf|nan)"), (3.0, "over 10000 times its first value")])
def test_diverging_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, lr, why):
    """--lr 1e30 overflows to inf/nan; a large lr grows the loss geometrically: both stop (they
    used to run on, exit 0 and save an all-NaN checkpoint), the checkpoint stays the last good one."""
    task, _ = regression_task()
    config = TrainConfig(
        epochs=20, batch_size=16, lr=lr, optimizer="sgd", momentum=0.0, out=str(tmp_path), progress=False
    )
    config.checkpoint_every = 1
    with pytest.raises(DivergedError, match=why) as info:
        train(task, config, log=_quiet)
    step = int(re.match(r"step (\d+):", str(info.value)).group(1))
    assert step >= 2 and f"from step {step - 1}" in str(info.value)
    params, _, meta = load_checkpoint(tmp_path / "checkpoint.safetensors")
    assert int(meta["step"]) == step - 1 and all(bool(torch.isfinite(p).all()) for p in params.values())
    rows = _strict_rows(tmp_path / "metrics.jsonl")
    assert rows[-1]["event"] == "diverged" and rows[-1]["step"] == step
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_checkpoint_keeps_the_model_and_the_whole_configuration(tmp_path):
    task, _ = regression_task()
    config = TrainConfig(epochs=1, batch_size=16, lr=0.05, optimizer="sgd", out=str(tmp_path), progress=False)
    train(task, config, log=_quiet)
    _, _, meta = load_checkpoint(tmp_path / "checkpoint.safetensors")
    assert meta["model"] == "regression"
    saved = json.loads(meta["config"])
    assert saved == {**config.settings(), "world_size": 1}


def _resume(tmp_path, task, allow_change=(), **changes):
    settings = dict(epochs=2, batch_size=16, lr=0.05, optimizer="sgd", schedule="cosine", progress=False)
    settings.update(changes)
    config = TrainConfig(**settings, out=str(tmp_path / "run"))
    ckpt = str(tmp_path / "run" / "checkpoint.safetensors")
    return train(task, config, resume=ckpt, allow_change=allow_change, log=_quiet)


def test_resume_refuses_a_change_that_breaks_exactness(tmp_path):
    task, _ = regression_task()
    first = TrainConfig(
        epochs=2, batch_size=16, lr=0.05, optimizer="sgd", schedule="cosine", out=str(tmp_path / "run"), progress=False
    )
    train(task, dataclasses_replace(first, max_steps=3), log=_quiet)
    for change, setting in [
        (dict(batch_size=8), "batch_size"),
        (dict(optimizer="adam"), "optimizer"),
        (dict(lr=0.01), "lr"),
        (dict(epochs=4), "epochs"),  # a cosine schedule depends on the total
    ]:
        with pytest.raises(CheckpointError, match=rf"with {setting}=.*--allow-change {setting}"):
            _resume(tmp_path, task, **change)
    other, _ = regression_task(name="other")
    with pytest.raises(CheckpointError, match="of model 'regression', not 'other'"):
        _resume(tmp_path, other)
    result = _resume(tmp_path, task, allow_change=["lr"], lr=0.01)  # deliberately
    assert result["step"] == 12
    assert _resume(tmp_path, task, lr=0.01) == {"step": 12, "nothing_to_do": True}  # the checkpoint has lr 0.01 now


def test_resume_may_add_epochs_under_a_constant_schedule(tmp_path):
    """With a constant schedule more epochs continue the same run: 2 then 4 epochs equal 4."""
    task, _ = regression_task()

    def config(name, **kw):
        return TrainConfig(batch_size=16, lr=0.05, optimizer="sgd", out=str(tmp_path / name), progress=False, **kw)

    straight = train(task, config("straight", epochs=4), log=_quiet)
    train(task, config("split", epochs=2), log=_quiet)
    resumed = train(task, config("split", epochs=4), resume=str(tmp_path / "split" / CKPT), log=_quiet)
    for name, value in straight["executor"].params.items():
        assert torch.equal(value, resumed["executor"].params[name]), name
    steps = [r["step"] for r in _strict_rows(tmp_path / "split" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 25))  # one log, no row twice


def test_resume_drops_log_rows_written_after_the_checkpoint(tmp_path):
    task, _ = regression_task()
    config = TrainConfig(epochs=1, batch_size=16, lr=0.05, optimizer="sgd", out=str(tmp_path), progress=False)
    config.checkpoint_every = 2
    train(task, dataclasses_replace(config, max_steps=2), log=_quiet)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a run killed after step 3, past its checkpoint
        f.write(json.dumps({"step": 3, "epoch": 0, "loss": 1.0, "lr": 0.05}) + "\n")
    train(task, config, resume=str(tmp_path / CKPT), log=_quiet)
    steps = [r["step"] for r in _strict_rows(tmp_path / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_new_run_into_the_same_folder_starts_a_fresh_log(tmp_path):
    task, _ = regression_task()
    config = TrainConfig(epochs=1, batch_size=32, lr=0.05, optimizer="sgd", out=str(tmp_path), progress=False)
    train(task, config, log=_quiet)
    said = []
    train(task, dataclasses_replace(config, max_steps=1), log=said.append)
    assert any("earlier run" in line and "starting afresh" in line for line in said)
    assert [r["step"] for r in _strict_rows(tmp_path / "metrics.jsonl")] == [1, 1]  # its loss and its epoch row


def test_unusable_out_folder_is_refused_before_training(tmp_path):
    task, _ = regression_task()
    file = tmp_path / "a_file"
    file.write_text("x")

    def run(out, **kw):
        config = TrainConfig(epochs=1, batch_size=16, lr=0.05, optimizer="sgd", out=str(out), progress=False)
        return train(task, config, log=_quiet, **kw)

    with pytest.raises(RunDirError, match="is a file"):
        run(file)
    with pytest.raises(RunDirError, match="lies under .*a_file, which is a file"):
        run(file / "sub" / "dir")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(RunDirError, match="not writable"):
            run(locked / "run")
    with pytest.raises(CheckpointError, match="does not exist"):  # a failed resume creates no folder
        run(tmp_path / "new" / "run", resume=str(tmp_path / "missing.safetensors"))
    assert not (tmp_path / "new").exists()


def test_readme_python_example_runs_as_written():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README.md has no Python example"
    exec(compile(blocks[0], "README.md", "exec"), {"print": _quiet})


def test_train_step_refuses_to_capture_per_run_state():
    """A CUDA graph would freeze dropout's per-run seed: such a step is never captured."""
    from teeny.training.loop import TrainStep
    from teeny.training.optim import SGD

    g = Graph()
    x = g.input("x", (4, 6))
    w = g.parameter("w", (6,), init=teeny.core.init.ones())
    g.output(ops.sum(ops.dropout(ops.mul(x, w), p=0.5)))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    with pytest.warns(UserWarning, match="dropout_.* change per run"):
        step = TrainStep(ex, SGD(ex, lr=0.0), cuda_graph=True)  # lr 0: only the mask can change the loss
    assert step.cuda_graph is False
    x = (2.0 ** torch.arange(24.0)).reshape(4, 6)  # every subset of kept elements has its own sum
    losses = [float(step({"x": x})) for _ in range(2)]
    assert losses[0] != losses[1]  # a fresh mask each step


def test_train_step_queues_without_waiting_for_the_gpu():
    """Steps with a changing learning rate, replayed as a CUDA graph: lr and the step counts
    reach the kernels every step without a host synchronisation (CUDA's sync debug mode raises
    on one), and the losses are PyTorch's SGD's. On the CPU the same steps run uncaptured."""
    from teeny.training.loop import TrainStep

    on_gpu = teeny.DEVICE.type == "cuda"
    ex, ref = _pair(torch.float32)
    ref.to(teeny.DEVICE)
    opt, ref_opt = SGD(ex, lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(ex, opt, cuda_graph=on_gpu)
    for i, (x, y) in enumerate(_data(torch.float32, 6)):
        x, y = x.to(teeny.DEVICE), y.to(teeny.DEVICE)
        opt.lr = ref_opt.param_groups[0]["lr"] = 0.1 / (i + 1)
        opt.zero_grad()
        if on_gpu and i >= 2:  # captured by now: each step is a replay
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = step({"x": x, "y": y})
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.reshape(()), ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")


@pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="CUDA graphs need the GPU")
def test_a_batch_written_into_the_captured_inputs_is_read_without_a_copy():
    """Feeding ``step.inputs`` themselves (a loader writing each batch into them) trains as
    feeding fresh tensors does, less the step's two copies of the batch."""
    from teeny.training.loop import TrainStep

    batches = [(x.to(teeny.DEVICE), y.to(teeny.DEVICE)) for x, y in _data(torch.float32, 5)]
    losses, copies = {}, {}
    for way in ("fresh tensors", "into the inputs"):
        ex, _ = _pair(torch.float32)
        step = TrainStep(ex, SGD(ex, lr=0.1), cuda_graph=True)
        losses[way], copies[way] = [], []
        for i, (x, y) in enumerate(batches):
            if i < 2:  # the eager first step, then the capture
                losses[way].append(float(step({"x": x, "y": y})))
                continue
            if way == "into the inputs":
                step.inputs["x"].copy_(x)
                step.inputs["y"].copy_(y)
            feed = step.inputs if way == "into the inputs" else {"x": x, "y": y}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = step(feed)
            copies[way].append(sum(e.name == "aten::copy_" and e.cpu_parent is None for e in prof.events()))
            losses[way].append(float(loss))
    assert losses["fresh tensors"] == losses["into the inputs"]
    assert [a - b for a, b in zip(copies["fresh tensors"], copies["into the inputs"])] == [2, 2, 2]
