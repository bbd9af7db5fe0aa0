"""teeny without its extras (issue: core dependencies torch, triton, numpy, safetensors; the rest
behind ``[train]``, ``[hf]``, ``[bench]``, ``[test]``): in a fresh process with every optional
package made unimportable (``tests/scripts/without_extras.py``), teeny imports, lowers and runs a
graph, ``teeny train`` refuses what needs an extra in one line naming it, and what degrades
(``extras.DEGRADED``) degrades. ``import teeny.torch`` loads none of the heavy modules its first
use does not need (what it loads, not how long it takes: timings are not tested)."""

import json
import re
import sys
from pathlib import Path

import pytest

from helpers import run_script
from teeny.core import extras

ROOT = Path(__file__).resolve().parents[1]
ALL_OPTIONAL = sorted(extras.PACKAGES)


def _run(*args: str) -> dict:
    done = run_script("without_extras", *args, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _refusal(feature: str, package: str) -> str:
    extra = extras.PACKAGES[package][1]
    return f"teeny train: {feature} needs {extras.PACKAGES[package][0]}: pip install 'teeny-triton[{extra}]'\n"


def test_every_optional_package_is_in_its_extra_of_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=\[ ;]", dep)[0] for dep in project["dependencies"]}
    assert core == {"torch", "triton", "numpy", "safetensors"}
    extras_of = project["optional-dependencies"]
    listed = {extra: {re.split(r"[<>=\[ ;]", dep)[0] for dep in deps} for extra, deps in extras_of.items()}
    for package, (distribution, extra) in extras.PACKAGES.items():
        assert distribution in listed[extra], f"{package}: pyproject.toml's [{extra}] lacks {distribution}"
    assert "teeny-triton[train,examples]" in extras_of["test"]  # make test runs the training tests and the examples


def test_require_names_the_feature_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(extras.MissingExtraError) as caught:
        extras.require("matplotlib", "the loss-curve PNG")
    assert str(caught.value) == "the loss-curve PNG needs matplotlib: pip install 'teeny-triton[train]'"
    assert isinstance(caught.value, ImportError) and caught.value.exit_code == 2
    with pytest.raises(KeyError, match="not an optional package"):
        extras.require("numpy", "arrays")  # a core dependency is imported plainly


@pytest.mark.slow
def test_core_works_without_any_extra():
    result = _run("core", *ALL_OPTIONAL)
    assert result == {
        "loss_finite": True,
        "grad_shape": [8, 3],
        "apply": [0.0, 2.0],
        "registered": True,
        "optional": dict.fromkeys(extras.DEGRADED, False),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "blocked, args, feature, package",
    [
        (ALL_OPTIONAL, [], "the digits data set", "sklearn"),
        (["matplotlib"], ["--log", "png"], "the png writer (--log png)", "matplotlib"),
    ],
)
def test_train_refuses_a_missing_extra_in_one_line(blocked, args, feature, package):
    result = _run("train", *blocked, "--", "--no-progress", *args)
    assert result == {"code": 2, "stderr": _refusal(feature, package)}


@pytest.mark.slow
def test_train_runs_without_tqdm():
    """No progress bar, and training runs (without threadpoolctl, which scikit-learn needs for the
    digits, teeny imports and runs: test_core_works_without_any_extra)."""
    result = _run("train", "tqdm", "--", "--log", "jsonl")
    assert result["code"] == 0, result["stderr"]


@pytest.mark.slow
def test_import_teeny_torch_loads_nothing_its_first_use_does_not_need():
    """Not transformers, matplotlib or scikit-learn, not the AOT tools or the training loop, and
    not torch._dynamo (``torch.compiler.disable`` on ``apply`` imports it on first use)."""
    watched = ["transformers", "matplotlib", "sklearn", "teeny.aot", "teeny.training.loop", "torch._dynamo"]
    assert _run("loaded", *watched) == {"loaded": []}
