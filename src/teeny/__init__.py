"""teeny: neural networks whose every op is a Triton forward kernel paired with a backward kernel.

trace -> Graph -> lower(graph, mode) -> Program -> Executor.forward_train -> ActivationCache
-> Executor.backward -> gradients -> optimizer step.
"""

from . import device  # first: chooses the GPU or the Triton interpreter before any kernel exists
from .device import DEVICE
from .kernel import Kernel, built_instances, kernel, kernel_from_source
from .runtime import ArgVisitor, CustomOp, GridError, MissingBackwardError, OpContext, PackingError, RuntimeOp, TeenyError
from .graph import Graph, GraphError, Tensor
from . import init
from .module import Module, Parameter
from . import nn, ops
from .lowering import LoweringMode, Program, lower
from .executor import ActivationCache, Executor
from .gradcheck import GradcheckError, gradcheck, gradcheck_graph
from .registry import OpInfo, Sample, register

__version__ = "0.1.0"

__all__ = [
    "DEVICE", "Kernel", "built_instances", "kernel", "kernel_from_source", "ArgVisitor", "CustomOp", "GridError", "MissingBackwardError",
    "OpContext", "PackingError", "RuntimeOp", "TeenyError", "Graph", "GraphError", "Tensor", "init", "Module",
    "Parameter", "nn", "ops", "LoweringMode", "Program", "lower", "ActivationCache", "Executor", "GradcheckError",
    "gradcheck", "gradcheck_graph", "OpInfo", "Sample", "register",
]
