"""``Module`` and ``Parameter``: PyTorch-style model building blocks that emit graph nodes.

A ``Parameter`` declares a shape, dtype and initialiser; its name is its attribute path in the
model (``fc1.weight``). Calling a module on symbolic tensors binds its parameters to their
graph on first use and runs ``forward``, which adds op nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class Parameter:
    def __init__(self, shape, init, dtype: torch.dtype = torch.float32, trainable: bool = True):
        self.shape = tuple(int(s) for s in shape)
        self.init = init
        self.dtype = dtype
        self.trainable = trainable
        self._owner: Module | None = None
        self._local_name = "param"

    def full_name(self) -> str:
        prefix = self._owner.full_name() if self._owner is not None else ""
        return f"{prefix}.{self._local_name}" if prefix else self._local_name

    def __repr__(self) -> str:
        return f"Parameter({self.full_name()!r}, shape={self.shape})"


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parent", None)
        object.__setattr__(self, "_local_name", "")
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_children" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting attributes")
        if isinstance(value, Parameter):
            value._owner, value._local_name = self, name
            self._parameters[name] = value
        elif isinstance(value, Module):
            object.__setattr__(value, "_parent", self)
            object.__setattr__(value, "_local_name", name)
            self._children[name] = value
        object.__setattr__(self, name, value)

    def full_name(self) -> str:
        if self._parent is None:
            return ""
        prefix = self._parent.full_name()
        return f"{prefix}.{self._local_name}" if prefix else self._local_name

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        for p in self._parameters.values():
            yield p.full_name(), p
        for child in self._children.values():
            yield from child.named_parameters()

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def to(self, dtype: torch.dtype) -> Module:
        """Give every parameter ``dtype`` (before tracing), like ``torch.nn.Module.to``."""
        if not dtype.is_floating_point:
            raise TypeError(f"parameters must be floating point, got {dtype}")
        for p in self.parameters():
            p.dtype = dtype
        return self

    def train(self, mode: bool = True) -> Module:
        object.__setattr__(self, "training", mode)
        for child in self._children.values():
            child.train(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        children = ", ".join(f"{k}={type(v).__name__}" for k, v in self._children.items())
        return f"{type(self).__name__}({children})"


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)
        object.__setattr__(self, "layers", list(layers))

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class ModuleList(Module):
    def __init__(self, modules=()) -> None:
        super().__init__()
        object.__setattr__(self, "items", [])
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self.items)), module)
        self.items.append(module)

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Module:
        return self.items[i]
