"""From a graph to a run: ``lowering`` (plan, validate, dry run on meta tensors -> ``Program``),
``executor`` (forward, the kept activations, the backward walk), ``replay`` (a node's launches
recorded and fired again), ``tape`` (a whole run recorded and replayed) and ``accumulate`` (the
kernel that sums fanned-in gradients)."""

from ..core import device as _device  # noqa: F401  (first: chooses interpreter or GPU before accumulate imports triton)
