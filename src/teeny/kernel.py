"""``@kernel``: a Triton kernel that knows its name, source, parameters, dtypes and backward.

    @kernel
    def relu_backward(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr): ...

    @kernel(backward=relu_backward, half=True)
    def relu_forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr): ...

Parameter kinds come from the signature: a name ending in ``_ptr`` is a pointer, a
``tl.constexpr`` annotation is a compile-time constant, ``tl.int32`` / ``tl.int64`` /
``tl.float32`` annotations fix a scalar's kind, and any other parameter is a scalar of
either kind. The packed arguments of every launch are checked against these kinds.

Dtype dispatch: a float kernel serves float32 and float64; ``half=True`` adds float16 and
bfloat16. ``kernel.instance(dtype)`` is the kernel built for one dtype; lowering creates the
instances a program needs, and ``built_instances()`` records every one (tests count them to
prove that inference builds no backward kernel).
"""

from __future__ import annotations

import inspect
import linecache
import textwrap
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from . import device as _device  # noqa: F401,I001  (first: chooses interpreter or GPU before triton loads)
import triton

FLOAT_DTYPES = (torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
ALL_FLOAT_DTYPES = FLOAT_DTYPES + HALF_DTYPES

PARAM_KINDS = ("ptr", "i32", "i64", "f32", "scalar", "constexpr")
_ANNOTATION_KINDS = {"i32": "i32", "i64": "i64", "fp32": "f32", "int32": "i32", "int64": "i64", "float32": "f32"}

REGISTRY: dict[str, "Kernel"] = {}
_BUILT: list[tuple[str, torch.dtype]] = []


@dataclass(frozen=True)
class KernelParam:
    name: str
    kind: str  # one of PARAM_KINDS


def _param_kind(param: inspect.Parameter) -> str:
    annotation = param.annotation
    if annotation is not inspect.Parameter.empty:
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        text = str(text)
        if "constexpr" in text:
            return "constexpr"
        short = text.split(".")[-1]
        if short in _ANNOTATION_KINDS:
            return _ANNOTATION_KINDS[short]
        annotation_str = str(annotation)
        for key, kind in _ANNOTATION_KINDS.items():
            if annotation_str in (key, f"tl.{key}", f"triton.language.{key}"):
                return kind
    if param.name.endswith("_ptr"):
        return "ptr"
    return "scalar"


class Kernel:
    """A Triton kernel with what teeny needs to know about it (see module docstring)."""

    def __init__(
        self,
        fn: Callable,
        *,
        backward: "Kernel | Iterable[Kernel] | None" = None,
        half: bool = False,
        dtypes: Iterable[torch.dtype] | None = None,
        source: str | None = None,
        name: str | None = None,
        register: bool = True,
    ):
        python_fn = getattr(fn, "fn", fn)  # accept an already-jitted function
        self.name = name or python_fn.__name__
        self.source = source if source is not None else textwrap.dedent(inspect.getsource(python_fn))
        signature = inspect.signature(python_fn)
        self.params = tuple(KernelParam(p.name, _param_kind(p)) for p in signature.parameters.values())
        self.jit = fn if hasattr(fn, "fn") else triton.jit(fn)
        if backward is None:
            self.backward: tuple[Kernel, ...] = ()
        elif isinstance(backward, Kernel):
            self.backward = (backward,)
        else:
            self.backward = tuple(backward)
        for b in self.backward:
            if not isinstance(b, Kernel):
                raise TypeError(f"kernel {self.name}: backward= must be @kernel functions, got {b!r}")
        self.dtypes = tuple(dtypes) if dtypes is not None else (ALL_FLOAT_DTYPES if half else FLOAT_DTYPES)
        self._instances: dict[torch.dtype, KernelInstance] = {}
        self.launch_options: dict[torch.dtype | None, dict] = {}  # see tune()
        if register:
            REGISTRY[self.name] = self

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

    def tune(self, dtype: torch.dtype | None = None, **options) -> "Kernel":
        """Default Triton launch options (``num_warps``, ``num_stages``) for every launch of this
        kernel, or of its ``dtype`` version; options an op passes to a launch win."""
        self.launch_options[dtype] = dict(options)
        return self

    def options_for(self, dtype: torch.dtype) -> dict:
        return {**self.launch_options.get(None, {}), **self.launch_options.get(dtype, {})}

    def instance(self, dtype: torch.dtype) -> "KernelInstance":
        """The kernel built for ``dtype``; refuses a dtype the kernel does not declare."""
        if dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            raise TypeError(f"kernel {self.name} has no {str(dtype).replace('torch.', '')} version (it dispatches to {names})")
        inst = self._instances.get(dtype)
        if inst is None:
            inst = KernelInstance(self, dtype)
            self._instances[dtype] = inst
            _BUILT.append((self.name, dtype))
        return inst

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


@dataclass(frozen=True)
class KernelInstance:
    kernel: Kernel
    dtype: torch.dtype

    def launch(self, grid: tuple[int, ...], args: list, **options) -> None:
        """Launch over ``grid``; ``options`` are Triton's launch options (num_warps, num_stages)."""
        self.kernel.jit[grid](*args, **options)


def kernel(fn: Callable | None = None, **options) -> Kernel | Callable[[Callable], Kernel]:
    """Decorator: ``@kernel`` or ``@kernel(backward=..., half=True, dtypes=...)``."""
    if fn is not None:
        return Kernel(fn, **options)
    return lambda f: Kernel(f, **options)


def built_instances() -> list[tuple[str, torch.dtype]]:
    """Every (kernel name, dtype) instance built so far, in order."""
    return list(_BUILT)


_SOURCE_COUNTER = [0]


def kernel_from_source(source: str, name: str | None = None, **options) -> Kernel:
    """Build a ``@kernel`` from Triton source text defining one function.

    The text may start with ``@triton.jit`` or not, and may use ``tl`` and ``triton``.
    It is registered in ``linecache`` so that Triton (which reads source through
    ``inspect``) and tracebacks can see it.
    """
    import triton.language as tl

    text = textwrap.dedent(source).strip("\n") + "\n"
    _SOURCE_COUNTER[0] += 1
    filename = f"<teeny-source-{_SOURCE_COUNTER[0]}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    namespace: dict = {"triton": triton, "tl": tl}
    try:
        exec(compile(text, filename, "exec"), namespace)
    except SyntaxError as exc:
        raise SyntaxError(f"kernel source{' for ' + name if name else ''} does not parse: {exc}") from exc
    defined = [v for k, v in namespace.items() if k not in ("triton", "tl", "__builtins__")
               and (inspect.isfunction(v) or hasattr(v, "fn"))]
    if not defined:
        raise ValueError(f"kernel source{' for ' + name if name else ''} defines no function")
    if name is not None:
        chosen = [f for f in defined if getattr(f, "__name__", None) == name or getattr(getattr(f, "fn", None), "__name__", None) == name]
        if not chosen:
            raise ValueError(f"kernel source defines no function named {name!r}")
        target = chosen[0]
    else:
        target = defined[-1]  # helpers first, the kernel last
    python_fn = getattr(target, "fn", target)
    return Kernel(target, source=inspect.getsource(python_fn), **options)
