"""Train a PyTorch model with teeny's training loop: ``torch_model_task("file.py:make_model")``.

    # my_model.py
    def make_model():
        model = TinyResNet()                      # any torch.nn.Module
        x = torch.zeros(32, 1, 8, 8)              # example inputs: shapes and dtypes, batch first
        y = torch.zeros(32, dtype=torch.long)
        return model, {"x": x, "y": y}, torch.nn.CrossEntropyLoss()     # loss optional

    task = teeny.torch.torch_model_task("my_model.py:make_model")      # a teeny.training.loop.CallableTask
    teeny.training.loop.train(task, teeny.training.loop.TrainConfig(epochs=2))

``make_model()`` returns ``(module, example_inputs)`` or ``(module, example_inputs, loss)``.
``example_inputs`` is a dict of two named tensors, samples and targets, batch first. Without
``loss`` the module takes both and its first output is the loss (like nanoGPT, or a Hugging
Face model called with ``labels=``); with ``loss``, ``loss(module(samples), targets)`` is.
The data come from a bundled data set whose samples fit the two example inputs (shapes after
the batch dim, integer or float): ``digits`` ((64,) float images, class labels),
``digits-image`` ((1, 8, 8)) or ``chars`` ((T,) token ids, next-token targets); ``data=``
chooses one, otherwise the first that fits is taken. The graph is imported (``from_torch``,
positionally: its inputs take the names of ``forward``'s arguments) for the loop's batch size
in training mode; evaluation imports it again in eval mode and reports the mean loss on
held-out data. ``task.torch_module`` is the module, for ``to_torch`` after training;
``save_torch_state`` writes its ``state_dict`` as safetensors (``teeny train --torch-model``:
``DIR/torch_model.safetensors``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TeenyError
from .export import from_torch

_DATA_SETS = ("digits", "digits-image", "chars")


def load_factory(spec: str) -> Callable[[], Any]:
    """The function ``name`` of the Python file in ``"path/to/file.py:name"``. A spec that names
    no such file or function raises ``ValueError`` (or ``FileNotFoundError``) saying which."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"expected path/to/file.py:function, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no file {file}")
    module_name = f"teeny_torch_model_{abs(hash(str(file.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, file)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"cannot import {file} (not a Python file?)")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(file.resolve().parent))  # the file may import its neighbours
    try:
        loader_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        defined = sorted(
            k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module_name
        )
        known = f" (it defines {', '.join(defined)})" if defined else ""
        raise ValueError(f"{file} defines no function {name!r}{known}")
    return factory


def _unpack(made: Any):
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise TypeError("make_model() must return (module, example_inputs) or (module, example_inputs, loss)")
    module, example, loss = made[0], made[1], made[2] if len(made) == 3 else None
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"make_model() returned a {type(module).__name__}, not a torch.nn.Module")
    if (
        not isinstance(example, dict)
        or len(example) < 2
        or not all(isinstance(t, torch.Tensor) for t in example.values())
    ):
        raise TypeError("make_model()'s example inputs must be a dict of at least two named tensors (input, target)")
    return module, dict(example), loss


class _Data:
    """A bundled data set as (x, y) batches for the first two example inputs."""

    def __init__(self, name: str, example: dict[str, torch.Tensor]):
        from ..training import data

        self.name = name
        (self.x_name, x_example), (self.y_name, y_example) = list(example.items())[:2]
        self.x_dtype, self.y_dtype = x_example.dtype, y_example.dtype
        if name in ("digits", "digits-image"):
            self.train_set, self.test_set = data.digits(image=name == "digits-image")
            shapes = (tuple(self.train_set.x.shape[1:]), ())
            kinds = (True, False)
        else:
            self.block = int(x_example.shape[1]) if x_example.dim() == 2 else 0
            self.corpus = data.CharCorpus(max_chars=400_000)
            shapes = ((self.block,), (self.block,))
            kinds = (False, False)
        fits = [
            tuple(t.shape[1:]) == shape and t.is_floating_point() == floating
            for t, shape, floating in zip((x_example, y_example), shapes, kinds)
        ]
        if not all(fits):
            raise ValueError(
                f"the example inputs {self.x_name} {tuple(x_example.shape)} {x_example.dtype}, "
                f"{self.y_name} {tuple(y_example.shape)} {y_example.dtype} do not fit data set {name!r} "
                f"(samples {shapes[0]} {'float' if kinds[0] else 'int'}, targets {shapes[1]} "
                f"{'float' if kinds[1] else 'int'})"
            )

    def feed(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.x_name: x.to(self.x_dtype), self.y_name: y.to(self.y_dtype)}

    def example(self, batch_size: int) -> dict[str, torch.Tensor]:
        if self.name == "chars":
            x, y = self.corpus.batch("train", batch_size, self.block, torch.Generator().manual_seed(0))
        else:
            x, y = self.train_set.x[:batch_size], self.train_set.y[:batch_size]
        return self.feed(x, y)

    def steps_per_epoch(self, batch_size: int) -> int:
        if self.name == "chars":
            return max(1, 40_000 // (batch_size * self.block))
        return len(self.train_set) // batch_size

    def batches(self, epoch: int, batch_size: int, seed: int) -> Iterable[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        if self.name == "chars":
            for _ in range(self.steps_per_epoch(batch_size)):
                yield self.feed(*self.corpus.batch("train", batch_size, self.block, gen))
        else:
            for x, y in self.train_set.batches(batch_size, gen):
                yield self.feed(x, y)

    def held_out(self, batch_size: int) -> Iterable[dict[str, torch.Tensor]]:
        if self.name == "chars":
            gen = torch.Generator().manual_seed(1)
            for _ in range(4):
                yield self.feed(*self.corpus.batch("val", batch_size, self.block, gen))
        else:
            for x, y in self.test_set.batches(batch_size):
                yield self.feed(x, y)


def torch_model_task(spec: str | Callable[[], Any], data: str | None = None, name: str | None = None):
    """A ``teeny.training.loop.CallableTask`` training the PyTorch model that ``spec`` makes (a
    ``"file.py:make_model"`` string or the function itself); see the module docstring."""
    from ..program.executor import Executor
    from ..program.lowering import LoweringMode, lower
    from ..training.loop import CallableTask

    factory = load_factory(spec) if isinstance(spec, (str, os.PathLike)) else spec
    module, example, loss = _unpack(factory())
    candidates = [data] if data is not None else list(_DATA_SETS)
    errors, chosen = [], None
    for candidate in candidates:
        if candidate not in _DATA_SETS:
            raise ValueError(f"unknown data set {candidate!r}; choose from {', '.join(_DATA_SETS)}")
        try:
            chosen = _Data(candidate, example)
            break
        except ValueError as exc:
            errors.append(str(exc))
    if chosen is None:
        raise ValueError("no bundled data set fits the model: " + "; ".join(errors))
    data_set = chosen
    input_names: list[str] = []

    def graph_for(batch_size: int, training: bool):
        feed = data_set.example(batch_size)
        x, y = feed[data_set.x_name], feed[data_set.y_name]
        module.train(training)
        try:
            graph = from_torch(module, (x, y)) if loss is None else from_torch(module, (x,), loss=loss, targets=(y,))
        finally:
            module.train(True)
        names = [v.name for v in graph.inputs]
        if len(names) != 2:
            raise TeenyError(f"the imported model takes inputs {names}; a data set gives two (samples, targets)")
        input_names[:] = names
        return graph

    def feeds(pairs):
        for feed in pairs:
            yield dict(zip(input_names, (feed[data_set.x_name], feed[data_set.y_name])))

    evaluator: dict[str, Any] = {}

    def evaluate(params: dict[str, torch.Tensor]) -> dict[str, float]:
        size = min(64, len(getattr(data_set, "test_set", ())) or 64)
        if "executor" not in evaluator:
            evaluator["executor"] = Executor(lower(graph_for(size, False), LoweringMode.INFERENCE))
        executor = evaluator["executor"]
        executor.load_params(params)
        losses = []
        for feed in feeds(data_set.held_out(size)):
            out = executor.forward(feed)
            losses.append(float((out[0] if isinstance(out, tuple) else out).float().mean()))
        return {"held_out_loss": sum(losses) / max(1, len(losses))}

    task = CallableTask(
        name=name or type(module).__name__,
        build=lambda batch_size: graph_for(batch_size, True),
        batches=lambda epoch, batch_size, seed: feeds(data_set.batches(epoch, batch_size, seed)),
        steps_per_epoch=data_set.steps_per_epoch,
        evaluate=evaluate,
    )
    task.torch_module = module
    task.data_set = data_set.name
    return task


TORCH_STATE_NAME = "torch_model.safetensors"  # what `teeny train --torch-model` writes beside its checkpoint


def save_torch_state(module: torch.nn.Module, path: str | os.PathLike) -> None:
    """Write ``module.state_dict()`` to ``path`` as safetensors, not a pickle. Tensors that share
    memory (a head tied to the embedding) are stored once (``safetensors.torch.save_model``), so
    read it back with ``safetensors.torch.load_model(module, path)``, which ties them again."""
    from safetensors.torch import save_model

    save_model(module, os.fspath(path), metadata={"format": "pt"}, force_contiguous=True)
