"""What `teeny train` promises about its folder, its checkpoints and its failures (README, "What
`teeny train` guarantees"): one run per folder (a lock naming the holder's PID, a dead holder's
lock taken over), checkpoints written under a temporary name of their own with the umask's mode
and a checksum verified on load, tasks held to their contract, and each mistake ending in one
line with its exit code and nothing left behind. test_training.py covers resuming and the
atomic write itself."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import regression_task
from teeny.cli import main
from teeny.training.loop import (
    CHECKPOINT_NAME,
    CheckpointError,
    RunDirError,
    RunFolder,
    TaskError,
    TrainConfig,
    load_checkpoint,
    train,
)


def _task(**options):
    task, _ = regression_task(**options)
    return task


def _config(out, **kw):
    settings = dict(epochs=1, batch_size=16, lr=0.05, optimizer="sgd", out=str(out), progress=False)
    return TrainConfig(**{**settings, **kw})


def _quiet(*args, **kwargs):
    pass


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------------- one run per folder


def test_a_second_run_into_a_held_folder_is_refused_naming_the_first(tmp_path):
    """Two runs into one --out used to delete each other's files, share one .tmp name and mix
    their metrics; now the second is refused before touching anything."""
    out = tmp_path / "run"
    train(_task(), _config(out), log=_quiet)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert ".lock" not in before  # released at the end of the run
    first = RunFolder(out)
    first.acquire()  # the first run, still going
    try:
        with pytest.raises(RunDirError, match=rf"in use by another teeny train run \(PID {os.getpid()}"):
            train(_task(), _config(out), log=_quiet)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before
    finally:
        first.release()
    train(_task(), _config(out, max_steps=2), log=_quiet)  # free again
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][0] == 1


def test_the_command_refuses_a_held_folder_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    first = RunFolder(out)
    first.acquire()
    try:
        assert main(["train", "mlp", "--out", str(out), "--no-progress"]) == 2
    finally:
        first.release()
    _one_line_error(capsys, f"PID {os.getpid()}", str(out))
    assert not out.exists()  # the folder the holder made is gone with it


@pytest.mark.slow
def test_the_lock_of_a_run_that_died_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX);"
            " os.write(fd, str(os.getpid()).encode()); print('held', flush=True); sys.stdin.read()",
            str(out / ".lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"PID {holder.pid}"):
            train(_task(), _config(out), log=_quiet)
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".lock").read_text() == str(holder.pid)  # its PID stays, but nothing holds the lock
    assert train(_task(), _config(out), log=_quiet)["step"] == 6
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME, "loss.png", "metrics.jsonl"]


def test_checkpoint_temporary_files_have_names_of_their_own(tmp_path, monkeypatch):
    import safetensors.torch

    written, real = [], safetensors.torch.save_file

    def record(tensors, filename, metadata=None):
        written.append(Path(filename).name)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", record)
    config = _config(tmp_path, checkpoint_every=1, max_steps=2)
    train(_task(), config, log=_quiet)
    assert len(written) == 2 and len(set(written)) == 2, written
    assert all(name.startswith(f".{CHECKPOINT_NAME}.") and name.endswith(".tmp") for name in written), written


@pytest.mark.parametrize("where", ["/proc/x", "/sys/x"])
def test_out_where_no_folder_can_be_made_is_one_line(where, capsys):
    """As root, os.access allows /proc and /sys; making the folder there raised a raw traceback."""
    assert main(["train", "mlp", "--out", where, "--no-progress"]) == 2
    _one_line_error(capsys, f"--out {where}")
    assert not os.path.exists(where)


# ------------------------------------------------------------------------------ checkpoints


def _rewrite(path: Path, tensors=None, metadata=None) -> None:
    """Write ``path`` again with some tensors or metadata fields replaced (the rest as they were)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta, old = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({**old, **(tensors or {})}, str(path), metadata={**old_meta, **(metadata or {})})


def test_a_checkpoint_with_altered_tensors_is_refused_naming_file_and_tensor(tmp_path):
    """Ten weights scaled by 1.5 used to resume without a word and end 0.09 off the exact run."""
    out = tmp_path / "run"
    train(_task(), _config(out, epochs=2, max_steps=3), log=_quiet)
    ckpt = out / CHECKPOINT_NAME
    params, _, _ = load_checkpoint(ckpt)
    name = next(k for k in params if k.endswith("weight"))
    weight = params[name].clone()
    weight.view(-1)[:10] *= 1.5
    _rewrite(ckpt, tensors={f"param/{name}": weight})
    with pytest.raises(CheckpointError, match=rf"{ckpt}: tensor param/{name} does not match its checksum"):
        train(_task(), _config(out, epochs=2), resume=str(ckpt), log=_quiet)


def test_checkpoint_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        train(_task(), _config(tmp_path / "a", max_steps=1), log=_quiet)
        os.umask(0o077)
        train(_task(), _config(tmp_path / "b", max_steps=1), log=_quiet)
    finally:
        os.umask(old)
    assert (tmp_path / "a" / CHECKPOINT_NAME).stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b" / CHECKPOINT_NAME).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("step", "seven", "metadata field 'step' is 'seven'"),
        ("config", "{broken", "metadata field 'config' is not valid JSON"),
        ("model_spec", "[", "metadata field 'model_spec' is not valid JSON"),
    ],
)
def test_damaged_checkpoint_metadata_names_the_file_and_the_field(tmp_path, field, value, message):
    out = tmp_path / "run"
    train(_task(), _config(out, epochs=2, max_steps=2), log=_quiet)
    ckpt = out / CHECKPOINT_NAME
    _rewrite(ckpt, metadata={field: value})
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: {message}"):
        train(_task(), _config(out, epochs=2), resume=str(ckpt), log=_quiet)


def test_a_resume_refusal_suggests_arguments_the_parser_accepts(tmp_path):
    """A checkpoint without --clip used to suggest `--clip None`, which the parser refuses."""
    out = tmp_path / "run"
    train(_task(), _config(out, epochs=2, max_steps=2), log=_quiet)
    with pytest.raises(CheckpointError) as info:
        train(_task(), _config(out, epochs=2, clip=1.0, batch_size=8), resume=str(out / CHECKPOINT_NAME), log=_quiet)
    message = str(info.value)
    assert "(--batch-size 16, leave out --clip)" in message and "--clip None" not in message, message
    assert "--allow-change batch_size,clip" in message


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, capsys, error
):
    """A full disk used to end in 29 lines of safetensors traceback (the old checkpoint survived)."""
    import safetensors
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def fill_the_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 1:
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"half a checkpoint")
        if error == "OSError":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(safetensors.torch, "save_file", fill_the_disk)
    out = tmp_path / "run"
    argv = ["train", "mlp", "--epochs", "1", "--steps", "2", "--checkpoint-every", "1", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 1
    _one_line_error(capsys, f"cannot write checkpoint {out / CHECKPOINT_NAME}", "the checkpoint already there is kept")
    assert load_checkpoint(out / CHECKPOINT_NAME)[2]["step"] == "1"
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME, "metrics.jsonl"]  # no .tmp, no .lock


# ------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize("declared,yielded", [(8, "only 6"), (4, "more than 4")])
def test_a_task_whose_batches_disagree_with_its_steps_per_epoch_is_refused(tmp_path, declared, yielded):
    """Fewer batches than declared used to train silently fewer steps while the schedule and the
    progress bar counted the declared number."""
    with pytest.raises(
        TaskError, match=rf"task 'regression': batches\(epoch=0, .*yielded {yielded} .* says {declared}"
    ):
        train(_task(steps=declared), _config(tmp_path, epochs=2), log=_quiet)


def test_a_task_whose_evaluate_returns_no_metrics_is_refused(tmp_path, capsys):
    with pytest.raises(TaskError, match=r"task 'regression': evaluate\(\) returned str 'good'; it must return a dict"):
        train(_task(evaluate=lambda params: "good"), _config(tmp_path), log=_quiet)
    result = train(_task(evaluate=lambda params: {"error": torch.tensor(0.5)}), _config(tmp_path), log=_quiet)
    assert result["error"] == 0.5 and json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["error"]
