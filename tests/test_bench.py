"""The benchmark harness's plain-Python parts (bench/harness.py): case selection, result rows,
the per-GPU CSV and the table. Nothing here needs a GPU; the case tables are only listed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
harness = pytest.importorskip("harness")


def _case(name, area="memory"):
    return harness.Case(name=name, area=area, make=lambda: {})


CASES = [
    _case("layer_norm bf16 16384x4096"),
    _case("layer_norm bf16 8192x768 (GPT-2's rows)"),
    _case("rms_norm bf16 16384x4096"),
    _case("matmul bf16 4096^3", "products"),
]


def test_select_by_name_words_and_area_in_table_order():
    assert [c.name for c in harness.select(CASES)] == [c.name for c in CASES]
    assert [c.name for c in harness.select(CASES, ["rms", "matmul"])] == [CASES[2].name, CASES[3].name]
    assert [c.name for c in harness.select(CASES, ["layer_norm"], ["memory"])] == [CASES[0].name, CASES[1].name]
    assert [c.name for c in harness.select(CASES, None, ["products"])] == ["matmul bf16 4096^3"]


def test_a_word_or_area_that_selects_nothing_is_an_error():
    with pytest.raises(ValueError, match="no case matches"):
        harness.select(CASES, ["layer_nrom"])
    with pytest.raises(ValueError, match="no area"):
        harness.select(CASES, None, ["attention"])


def test_duplicate_case_names_are_refused():
    with pytest.raises(ValueError, match="twice"):
        harness.check_unique([*CASES, _case("matmul bf16 4096^3")])


def test_rows_carry_rates_and_the_ratio_to_the_best_torch_time():
    rows = harness.add_ratios(
        [
            harness.make_row("ops", "c", "teeny", 0.5, nbytes=2e9, error=1e-6),
            harness.make_row("ops", "c", "eager", 1.0, nbytes=2e9),
            harness.make_row("ops", "c", "compile", 0.8, nbytes=2e9),
            harness.make_row("ops", "c", "liger", 0.4, nbytes=2e9),  # not torch: not the base
            harness.make_row("ops", "c", "eager-failed", None, note="failed"),
        ]
    )
    teeny = rows[0]
    assert teeny["gbps"] == pytest.approx(4000.0)
    assert teeny["tflops"] is None
    assert teeny["ratio"] == pytest.approx(0.5 / 0.8)
    assert rows[3]["ratio"] == pytest.approx(0.5)
    assert rows[4]["ratio"] is None and rows[4]["gbps"] is None
    flops = harness.make_row("ops", "m", "teeny", 2.0, flops=4e12)
    assert flops["tflops"] == pytest.approx(2000.0)


def test_append_results_writes_one_file_per_gpu_with_one_header(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    gpu = "NVIDIA H100 80GB HBM3"
    first = [harness.make_row("ops", "layer_norm bf16 16384x4096", "teeny", 0.2, nbytes=6.7e8, error=2e-5)]
    path = harness.append_results(first, gpu, tmp_path)
    assert path == tmp_path / "nvidia-h100-80gb-hbm3.csv"
    harness.append_results([harness.make_row("ops", "layer_norm bf16 16384x4096", "teeny", 0.19)], gpu, tmp_path)
    harness.append_results([harness.make_row("ops", "x", "eager", 1.0)], "NVIDIA H200", tmp_path)
    lines = path.read_text().splitlines()
    assert lines[0].split(",") == harness.FIELDS
    assert len(lines) == 3 and sum(line.startswith("date,") for line in lines) == 1
    rows = harness.read_results(path)
    assert {r["commit"] for r in rows} == {"abc1234"} and {r["gpu"] for r in rows} == {gpu}
    assert float(rows[0]["error"]) == pytest.approx(2e-5)
    assert harness.latest(rows)[("layer_norm bf16 16384x4096", "teeny")]["ms"] == "0.19"
    assert (tmp_path / "nvidia-h200.csv").exists()


def test_format_table_puts_each_implementation_in_a_column():
    rows = harness.add_ratios(
        [
            harness.make_row("ops", "swiglu bf16 16384x4096", "teeny", 0.25, nbytes=1.9e9, error=3e-3),
            harness.make_row("ops", "swiglu bf16 16384x4096", "eager", 0.45),
            harness.make_row("ops", "matmul bf16 4096^3", "teeny", 0.55, flops=4.1e11),
        ]
    )
    table = harness.format_table(rows).splitlines()
    assert table[0] == "| case | teeny ms | eager ms | teeny GB/s | TFLOP/s | teeny / best torch | teeny err |"
    assert table[2] == "| swiglu bf16 16384x4096 | 0.250 | 0.450 | 7600 GB/s | 0.56 | 3.0e-03 |"
    assert table[3] == "| matmul bf16 4096^3 | 0.550 | - | 745 TFLOP/s | - | - |"


def test_gpu_slug():
    assert harness.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert harness.gpu_slug("  ") == "unknown"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the case tables are built with torch")
def test_the_op_tables_have_unique_names_in_known_areas():
    ops = pytest.importorskip("ops")
    cases = ops.make_cases()
    harness.check_unique(cases)
    assert {c.area for c in cases} == {"memory", "products", "attention"}
    names = {c.name for c in cases}
    for kept in ("gelu_tanh fp32 2^27", "layer_norm bf16 16384x4096", "matmul bf16 4096^3",
                 "causal attention bf16 4x16x2048x64", "linear bf16 8192x768->50304"):  # fmt: skip
        assert kept in names
    assert all(c.bytes or c.flops or "(host)" in c.name for c in cases)


@pytest.mark.slow
def test_ops_lists_its_cases_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCH / "ops.py"), "--list", "--area", "products"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if done.returncode != 0 and "No module named 'torch'" in done.stderr:
        pytest.skip("torch is not installed")
    assert done.returncode == 0, done.stderr
    assert "matmul bf16 4096^3" in done.stdout and "layer_norm" not in done.stdout
