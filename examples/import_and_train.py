"""Import a PyTorch model into teeny, train it with teeny's optimizer, hand the weights back.

    PYTHONPATH=src python examples/import_and_train.py

A small CNN with BatchNorm, written against torch.nn, on scikit-learn's 8x8 digits:
teeny.torch.from_torch traces it (torch.export) into a teeny graph with every parameter and
buffer under its state_dict name; teeny's executor trains it with AdamW on teeny's kernel
pairs; teeny.torch.to_torch loads the result back into the torch module (strict=True), which
is then evaluated by PyTorch itself. The same model trains from the command line through a
factory (see teeny.torch.task): `teeny train --torch-model examples/import_and_train.py:make_model`.
"""

import torch
from torch import nn

import teeny
import teeny.torch
from teeny.training.data import digits


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        # no conv bias before a BatchNorm (it cancels); momentum 0.3: the running statistics
        # catch up with the weights within this short demo
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, momentum=0.3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16, momentum=0.3), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.classifier = nn.Linear(16, 10)

    def forward(self, images):
        return self.classifier(torch.flatten(self.features(images), 1))


def make_model(batch_size: int = 32):
    """For teeny.torch.torch_model_task: the module, example inputs (samples, targets), the loss."""
    example = {"x": torch.zeros(batch_size, 1, 8, 8), "y": torch.zeros(batch_size, dtype=torch.long)}
    return SmallCNN(), example, nn.CrossEntropyLoss()


if __name__ == "__main__":
    torch.manual_seed(0)
    model, _, loss = make_model()
    train_set, test_set = digits(image=True)
    batches = list(train_set.batches(32, torch.Generator().manual_seed(0)))
    x0, y0 = batches[0]
    graph = teeny.torch.from_torch(model, (x0,), loss=loss, targets=(y0,))
    print(f"imported {len(graph.nodes)} nodes, parameters: {', '.join(v.name for v in graph.params)}")
    executor = teeny.Executor(teeny.lower(graph, teeny.LoweringMode.TRAINING))
    optimizer = teeny.training.optim.AdamW(executor, lr=2e-2, weight_decay=0.0)
    names = [v.name for v in graph.inputs]  # the forward's argument name, then "target"
    for step, (x, y) in enumerate(batches[:45]):
        executor.zero_grad()
        (value, _), cache = executor.forward_train(dict(zip(names, (x, y))))
        executor.backward(cache)
        optimizer.step()
        if step % 15 == 0:
            print(f"step {step}: loss {float(value):.4f}")
    teeny.torch.to_torch(executor, model)  # load_state_dict(strict=True) inside
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_set.x).argmax(1) == test_set.y).float().mean()
    print(f"PyTorch evaluates the teeny-trained weights: test accuracy {accuracy:.3f}")
