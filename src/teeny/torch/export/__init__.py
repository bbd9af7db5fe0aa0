"""Bring your PyTorch model: ``from_torch(module, example_inputs)`` -> a teeny ``Graph``, and
``to_torch(executor, module)`` hands the trained weights back.

    graph = teeny.torch.from_torch(model, (x, y))          # model(x, y) returns the loss
    executor = teeny.Executor(teeny.lower(graph, teeny.LoweringMode.TRAINING))
    ...                                                     # train with teeny's optimizers
    teeny.torch.to_torch(executor, model)                   # load_state_dict(strict=True) inside

Tracing is ``torch.export`` (its training IR, the ATen ops before decomposition), not
``torch.fx.symbolic_trace``: export runs the real Python code with fake tensors, so models
with shape arithmetic, ``if`` on shapes, ``**kwargs`` and output dataclasses (Hugging Face
GPT-2 and Llama, which ``symbolic_trace`` cannot trace without their own tracer) come out as
one flat graph of ATen calls; it lifts every parameter and buffer to an input named by its
``state_dict`` key (tied weights once), and records for every call the module path
(``nn_module_stack``) and the source line (``stack_trace``) that the error for an unsupported
call needs. The ATen level is also the smallest vocabulary to map: every ``F.*``, tensor
method and operator arrives as one of a few hundred ATen ops.

The graph: user inputs keep their argument names; parameters become teeny parameters under
their ``state_dict`` names, initialised with the module's values (``requires_grad=False``
parameters are non-trainable); floating-point buffers (BatchNorm's running statistics) are
non-trainable parameters, which teeny's ``batch_norm`` updates in place in training;
non-persistent buffers and tensor constants become graph constants. Computations that depend
on no input and no parameter (causal masks, position ids, rotary tables) are run once by
PyTorch at import and become constants. Train/eval behaviour is the module's mode at import:
import ``module.train()`` for a training graph (dropout draws a new mask per step, batch norm
uses batch statistics and updates the running ones), ``module.eval()`` for inference.
Integer buffers (``num_batches_tracked``) stay with the torch module (teeny does not count).

Rewrites keep an imported model as fast as one written in teeny: a module call whose
maths teeny has one kernel pair for (Hugging Face's tanh-GELU activations and ``*RMSNorm``s,
recognised by class name) becomes that op instead of its run of ATen calls (``nn_module_stack``
says which calls belong to it), ``silu(gate) * up`` becomes one ``swiglu`` pair, and a folded
attention mask that is exactly causal becomes
``is_causal=True``, so the attention kernel skips the masked blocks instead of reading a mask.

Every ATen call without a teeny op is collected, and ``UnsupportedError`` lists each one
with its module path and source line, not just the first.

The package: ``importer`` (the ``torch.export`` call, the graph walk, parameters, ``to_torch``)
and ``converters`` (one converter per ATen op, a module per family: ``elementwise``, ``shapes``,
``layers``, ``losses``, and ``modules`` for whole module calls).
"""

from .converters import CONVERTERS
from .importer import UnsupportedError, from_torch, to_torch

__all__ = ["from_torch", "to_torch", "UnsupportedError", "CONVERTERS"]
