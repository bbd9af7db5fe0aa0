"""The examples for the tools people train with run in their tiny CPU configurations, in this
process (``main([...])``), and train as they would without teeny: the Hugging Face ``Trainer``
logs the losses of the uncompiled run, PEFT LoRA trains its adapters alone (the example checks
gradients and frozen weights itself) with plain PyTorch's losses on both of teeny's paths, and the
Lightning module's losses are eager mode's and fall."""

import ast
import importlib.util
from pathlib import Path

import pytest

import teeny
from helpers import float32_precision_kept, fresh_compile  # noqa: F401  (fresh_compile: the fixture, used through pytestmark)
from teeny.torch import backend

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["hf_trainer", "peft_lora", "lightning_module"]
# float32 on the CPU agrees to rounding; on a GPU teeny's float32 products are tf32x3, torch's are not
RTOL = 1e-5 if teeny.DEVICE.type == "cpu" else 1e-3


def _example(name: str):
    """``examples/<name>.py`` imported as a module."""
    spec = importlib.util.spec_from_file_location(f"teeny_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("fresh_compile")


@pytest.fixture(autouse=True)
def _float32_precision_put_back():
    """An example may switch TF32 on for the process (the Trainer's ``torch_compile``): the tests
    after it, Lightning's setup among them, find torch's float32 precision flags as they were."""
    with float32_precision_kept():
        yield


def _assert_same_falling_losses(losses, reference):
    assert losses == pytest.approx(reference, rel=RTOL, abs=1e-6)
    assert losses[-1] < losses[0]


def test_the_hf_trainer_logs_the_losses_of_the_uncompiled_run():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = _example("hf_trainer")  # TrainingArguments(torch_compile_backend="teeny")
    losses = example.main(["--tiny", "--steps", "2"])
    assert "teeny program" in backend.report()
    _assert_same_falling_losses(losses, example.main(["--tiny", "--steps", "2", "--eager"]))


@pytest.fixture(scope="module")
def _lora_reference():
    pytest.importorskip("peft")
    return _example("peft_lora").main(["--tiny", "--teeny", "off", "--steps", "3"])


@pytest.mark.parametrize("path", ["compile", "patch"])
def test_peft_lora_trains_the_adapters_alone_with_pytorchs_losses(path, _lora_reference):
    # main asserts that each LoRA matrix got a gradient and changed, and that no base tensor did
    losses = _example("peft_lora").main(["--tiny", "--teeny", path, "--steps", "3"])
    if path == "compile":
        assert "teeny program" in backend.report()
    _assert_same_falling_losses(losses, _lora_reference)


def test_the_lightning_module_trains_as_in_eager_mode():
    pytest.importorskip("lightning")
    example = _example("lightning_module")
    losses = example.main(["--tiny", "--steps", "8"])
    assert len(losses) == 8
    assert "teeny program" in backend.report()
    _assert_same_falling_losses(losses, example.main(["--tiny", "--steps", "8", "--eager"]))


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_says_how_to_run_it_and_the_readme_lists_it(name):
    docstring = ast.get_docstring(ast.parse((ROOT / "examples" / f"{name}.py").read_text()))
    assert f"python examples/{name}.py" in docstring
    assert f"python examples/{name}.py" in (ROOT / "README.md").read_text()
