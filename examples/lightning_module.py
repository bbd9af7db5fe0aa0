"""Train a Lightning module compiled with the teeny backend, with Lightning's ``Trainer``.

    .venv/bin/python examples/lightning_module.py         # CPU: a small MLP, 30 steps
    .venv/bin/python examples/lightning_module.py --eager # the same without teeny, to compare
    PYTHONPATH=src python3 examples/lightning_module.py   # GPU: a wider MLP, bf16-mixed, 200 steps

(``.venv``: ``make install``, teeny with its ``[examples]`` extra, as ``make test`` makes it. On the
GPU machine, with torch, triton and lightning installed, run from the source tree.)

The module compiles itself in place in ``configure_model`` (the hook Lightning calls before it
sets up the optimizer), ``self.compile(backend="teeny")``: it stays the same module with the same
parameters and ``state_dict`` keys, so Lightning's optimizer step, precision plugin and checkpoints
see an ordinary module, while ``forward`` (linear layers, LayerNorm, GELU) and its backward run as
teeny kernels. The loss stays in ``training_step``, in plain PyTorch. (Compile your own module, as
here: a torch.nn module of PyTorch's own, an ``nn.Sequential`` or ``nn.Linear``, compiled in place
with ``.compile()`` compiles nothing, as Dynamo skips torch.nn's frames; ``torch.compile(it)``,
which wraps it, does compile it.)

The data is synthetic: points around a few centres, to be told apart. ``main`` returns the
training losses, one per step.
"""

from teeny.torch import backend  # noqa: I001  (first: on a CPU, teeny picks the Triton interpreter)
import argparse

import lightning
import torch
import torch.nn.functional as F
from torch import nn


class Classifier(lightning.LightningModule):
    def __init__(self, features: int, width: int, classes: int, use_teeny: bool = True, lr: float = 3e-3):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, width), nn.LayerNorm(width), nn.GELU(),
            nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),
            nn.Linear(width, classes),
        )  # fmt: skip
        self.use_teeny, self.lr = use_teeny, lr
        self.losses: list[float] = []

    def configure_model(self):
        if self.use_teeny:
            self.compile(backend="teeny")  # in place: the same module, parameters and state_dict keys

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def clusters(count: int, features: int, classes: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``count`` points scattered around ``classes`` random centres, labelled by their centre."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(classes, features, generator=gen)
    labels = torch.randint(0, classes, (count,), generator=gen)
    return torch.utils.data.TensorDataset(centres[labels] + torch.randn(count, features, generator=gen), labels)


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available())
    parser.add_argument("--eager", action="store_true", help="run without teeny (the reference)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 30 tiny, 200 on the GPU)")
    args = parser.parse_args(argv)
    features, width, classes, batch = (16, 32, 4, 16) if args.tiny else (256, 2048, 16, 1024)
    steps = args.steps or (30 if args.tiny else 200)

    lightning.seed_everything(0, verbose=False)
    model = Classifier(features, width, classes, use_teeny=not args.eager)
    # drop_last: every batch has the same shape, so teeny builds one program (shapes are static)
    data = torch.utils.data.DataLoader(clusters(steps * batch, features, classes), batch_size=batch, drop_last=True)
    trainer = lightning.Trainer(
        accelerator="auto", max_steps=steps, precision="32-true" if args.tiny else "bf16-mixed",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)

    print(f"loss: first step {model.losses[0]:.4f}, last step {model.losses[-1]:.4f} ({len(model.losses)} steps)")
    if not args.eager:
        print(backend.report())
    return model.losses


if __name__ == "__main__":
    main()
