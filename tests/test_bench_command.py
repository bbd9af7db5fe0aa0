"""`teeny bench FILE.py:make_model`: the factory contract, one row per variant from the same weights,
a failing variant that leaves the others running, and the errors of a factory that cannot be used."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from teeny.cli import main
from teeny.torch.bench import BenchModel, bench_model, compute_loss, format_table, parse_variants, run_bench

ROOT = Path(__file__).resolve().parents[1]
on_cpu = not torch.cuda.is_available()


def test_bench_command_runs_eager_and_teeny_patch_from_the_same_weights(tmp_path, capsys):
    """The command in this process (``main``, as ``python -m teeny`` calls it; a fresh process is
    ``--rounds``'s, below)."""
    pytest.importorskip("transformers")
    out = tmp_path / "out.json"
    spec = f"{ROOT / 'examples' / 'bench_llama.py'}:make_model"
    argv = ["bench", spec, "--steps", "1", "--warmup", "1", "--variants", "eager,teeny-patch", "--json", str(out)]
    argv += ["--precision", "fp32"]  # the same numbers on a GPU as on the CPU: no autocast
    code = main(argv)
    done = capsys.readouterr()
    assert code == 0, done.err
    table = [line for line in done.out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table] == ["variant", "eager", "teeny-patch"], done.out
    report = json.loads(out.read_text())
    assert report["steps"] == 1 and report["tokens_per_step"] == 2 * 32 and report["parameters"] > 0
    eager, patched = report["rows"]
    for row in (eager, patched):
        assert row["status"] == "ok", row
        assert row["step_ms"] > 0 and row["first_step_s"] > 0 and row["tokens_per_s"] > 0
        assert (row["peak_mib"] is None) == on_cpu
        assert len(row["losses"]) == 1 + 1 + 1 and all(math.isfinite(v) for v in row["losses"])
        assert row["last_loss"] < row["first_loss"]  # the same batch, learnt for two updates
    assert "TeenyLlamaMLP" in patched["note"]  # teeny's patch did swap the Llama's layers
    assert patched["losses"] == pytest.approx(eager["losses"], rel=1e-3)  # same initial weights, same updates


def test_a_factory_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, capsys):
    example = ROOT / "examples" / "bench_llama.py"
    assert main(["bench", f"{example}:missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "defines no function 'missing'" in err and "make_model" in err, err
    assert main(["bench", f"{tmp_path / 'nowhere.py'}:make_model"]) == 2
    assert "no file" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("def make_model():\n    return 3\n")
    assert main(["bench", f"{broken}:make_model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "must return (model, batch)" in err, err
    assert main(["bench", f"{broken}:make_model", "--variants", "eager,fast"]) == 2
    assert "unknown variant 'fast'" in capsys.readouterr().err


def test_the_factory_contract_forms_and_default_losses():
    model = nn.Linear(4, 2)
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    as_tuple = bench_model((model, (x,)))
    as_dict = bench_model({"model": model, "batch": (x,), "loss_fn": None})
    assert as_tuple == as_dict == BenchModel(model, (x,))
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        bench_model(("model", (x,)))
    with pytest.raises(TypeError, match="needs keys model, batch"):
        bench_model({"model": model})
    # teeny train --torch-model's contract: a torch.nn loss of (model(samples), targets)
    expected = nn.functional.cross_entropy(model(x), y)
    assert torch.equal(compute_loss(model, {"x": x, "y": y}, nn.CrossEntropyLoss()), expected)
    with pytest.raises(TypeError, match="no scalar loss"):
        compute_loss(model, (x,), None)  # a (3, 2) output is no loss
    assert parse_variants("eager,compile") == ["eager"] + [f"compile-{m}" for m in ("default", "reduce-overhead",
                                                           "max-autotune-no-cudagraphs")]  # fmt: skip


def test_a_failing_variant_is_a_row_and_the_others_go_on():
    """The loss refuses teeny's Linear: teeny-patch fails with its one-line error, eager still
    runs; Liger, absent or unable to patch a plain module, says why; compile on the CPU is skipped."""

    def loss_fn(model, batch):
        if any(type(m).__module__.startswith("teeny") for m in model.modules()):
            raise RuntimeError("no teeny here\nsecond line")
        return model(*batch).square().mean()

    made = BenchModel(nn.Sequential(nn.Linear(4, 2)), (torch.randn(3, 4),), loss_fn)
    variants = ["liger", "eager", "teeny-patch"] + (["compile-default"] if on_cpu else [])
    rows, settings = run_bench(made, variants, steps=1, warmup=0)
    by_name = {r.variant: r for r in rows}
    assert rows[-1].variant == "liger"  # Liger patches transformers process-wide: always last
    assert by_name["eager"].status == "ok" and by_name["eager"].tokens_per_s is None  # no input_ids
    assert by_name["teeny-patch"].status == "failed"
    assert by_name["teeny-patch"].note == "RuntimeError: no teeny here second line"
    assert by_name["liger"].status == "skipped" and by_name["liger"].note
    if on_cpu:
        assert by_name["compile-default"].status == "skipped" and "--compile-on-cpu" in by_name["compile-default"].note
    table = format_table(rows)
    assert "| teeny-patch |" in table and "failed: RuntimeError: no teeny here second line" in table
    assert settings["parameters"] == 4 * 2 + 2


def test_rounds_run_each_in_a_fresh_process_and_take_the_median(tmp_path, capsys):
    """``--rounds 2``: the command (here ``main`` in this process) runs twice, each round a process
    of its own (its JSON, here the rows of both), and a variant's step time is the median of its
    rounds', each kept."""
    factory = tmp_path / "tiny.py"
    factory.write_text(
        "import torch\n"
        "def make_model():\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))\n"
        "    return model, (torch.randn(7, 6),), lambda m, b: m(*b).square().mean()\n"
    )
    out = tmp_path / "out.json"
    argv = ["bench", f"{factory}:make_model", "--rounds", "2", "--steps", "2", "--warmup", "0"]
    argv += ["--variants", "eager,teeny-patch", "--precision", "fp32", f"--json={out}"]
    code = main(argv)
    done = capsys.readouterr()
    assert code == 0, done.err
    assert "round 2 of 2" in done.err and "round 1: eager " in done.err
    assert "the median of 2 rounds" in done.out
    report = json.loads(out.read_text())
    assert report["rounds"] == 2 and [r["variant"] for r in report["rows"]] == ["eager", "teeny-patch"]
    for row in report["rows"]:
        assert row["status"] == "ok" and len(row["round_ms"]) == 2
        assert min(row["round_ms"]) <= row["step_ms"] <= max(row["round_ms"])
        assert row["note"].startswith("rounds ")


def test_combining_rounds_takes_medians_and_keeps_a_failure():
    from teeny.torch.bench import Row, _without, combine_rounds

    def row(name, ms, status="ok", peak=10.0):
        return Row(name, status, "" if status == "ok" else "boom", 1.0, ms, 1000 / ms, peak, 2.0, 1.0, [2.0, 1.0])

    rounds = [[row("eager", 10.0), row("teeny-patch", 8.0, peak=5.0)],
              [row("eager", 30.0), row("teeny-patch", 9.0, peak=6.0)],
              [row("eager", 11.0), row("teeny-patch", 1.0, "failed")]]  # fmt: skip
    eager, patched = combine_rounds(rounds)
    assert eager.step_ms == 11.0 and eager.round_ms == [10.0, 30.0, 11.0] and eager.tokens_per_s == 1000 / 11.0
    assert patched.status == "failed" and patched.note == "boom"
    assert combine_rounds(rounds[:2])[1].peak_mib == 6.0
    argv = ["bench", "m.py:f", "--rounds", "3", "--json=a.json", "--steps", "2", "--json", "b.json"]
    assert _without(argv, ("--rounds", "--json")) == ["bench", "m.py:f", "--steps", "2"]


def test_the_backend_variants_each_compile_their_own_region_from_the_same_weights():
    """teeny-backend, -reduce-overhead (its CUDA graphs: none on the CPU) and +recompute each
    build a region of their own (a variant does not run the one before it compiled) and learn alike."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    made = BenchModel(model, (torch.randn(3, 4),), lambda m, batch: m(*batch).square().mean())
    variants = ["teeny-backend", "teeny-backend-reduce-overhead", "teeny-backend+recompute"]
    rows, _ = run_bench(made, variants, steps=1, warmup=1, precision="fp32")
    assert [r.variant for r in rows] == variants
    for row in rows:
        assert row.status == "ok", row.note
        assert row.note.startswith("1 regions, 1 teeny programs"), row.note
        assert row.losses == pytest.approx(rows[0].losses, rel=1e-5)
    assert rows[0].last_loss < rows[0].first_loss
