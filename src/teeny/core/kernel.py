"""``@kernel``: a Triton kernel that knows its name, source, parameters, dtypes and backward.

    @kernel
    def relu_backward(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr): ...

    @kernel(backward=relu_backward, half=True)
    def relu_forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr): ...

Parameter kinds come from the signature: a name ending in ``_ptr`` is a pointer, a
``tl.constexpr`` annotation is a compile-time constant, ``tl.int32`` / ``tl.int64`` /
``tl.float32`` annotations fix a scalar's kind, and any other parameter is a scalar (an int,
or a float in the kernel's compute precision). Pointers named in ``optional=`` may be passed
``None``; the kernel tests ``if bias_ptr is not None:`` (Triton specialises on it). A kernel that
makes TMA descriptors on the device declares ``device_scratch=True``. The packed
arguments of every launch are checked against these kinds (``runtime.check_packing``). A kernel
whose Triton function takes other arguments than teeny packs (``products.kernels.matmul_tma``,
``products.gluon.matmul_ws``: TMA descriptors made on the host) names ``arguments=``, a function
of the packed arguments giving Triton's; its signature is then the one teeny checks and packs.
A kernel that calls ``common.wait_for_previous()`` before it touches global memory declares
``pdl=True``: on Hopper, where ``config.pdl`` is on (off by default), it is launched with
programmatic dependent launch, so the GPU may start it before the kernel ahead of it has
signalled its end.

Dtype dispatch: a float kernel serves float32 and float64; ``half=True`` adds float16 and
bfloat16; ``dtypes=`` names any other set (integer and bool tensors for shape ops).
``kernel.instance(dtype)`` is the kernel built for one dtype; lowering creates the instances a
program needs, and ``built_instances()`` records every one (tests count them to prove that
inference builds no backward kernel).

float64 means float64 all the way: Triton types every Python float argument as float32, so the
float64 instance of a kernel launches a copy of the function whose float scalar parameters are
annotated ``tl.float64`` (``KernelInstance.scalar_types`` says what each launch passes).
"""

from __future__ import annotations  # noqa: I001  (teeny's device before triton)

import ast
import contextlib
import inspect
import linecache
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import device as _device  # noqa: F401  (before triton: it chooses interpreter or GPU)
from . import config, tuning

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITCallable

FLOAT_DTYPES = (torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
ALL_FLOAT_DTYPES = FLOAT_DTYPES + HALF_DTYPES
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
ANY_DTYPES = ALL_FLOAT_DTYPES + INT_DTYPES + (torch.bool,)

PARAM_KINDS = ("ptr", "i32", "i64", "f32", "scalar", "constexpr")
_ANNOTATION_KINDS = {"i32": "i32", "i64": "i64", "fp32": "f32", "int32": "i32", "int64": "i64", "float32": "f32"}

REGISTRY: dict[str, Kernel] = {}
_BUILT: list[tuple[str, torch.dtype]] = []


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how teeny names a dtype in messages."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class KernelParam:
    name: str
    kind: str  # one of PARAM_KINDS
    optional: bool = False  # a pointer that may be None


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
        backward: Kernel | Iterable[Kernel] | None = None,
        half: bool = False,
        dtypes: Iterable[torch.dtype] | None = None,
        optional: Iterable[str] = (),
        device_scratch: bool = False,
        pdl: bool = False,
        arguments: Callable[..., list] | None = None,
        source: str | None = None,
        name: str | None = None,
        register: bool = True,
    ):
        python_fn = getattr(fn, "fn", fn)  # accept an already-jitted function
        self.name = name or python_fn.__name__
        self._source = source
        self.python_fn = python_fn
        signature = inspect.signature(arguments or python_fn)
        optional = set(optional)
        self.params = tuple(
            KernelParam(p.name, _param_kind(p), p.name in optional) for p in signature.parameters.values()
        )
        self._param_by_name = {p.name: p for p in self.params}
        unknown = optional - {p.name for p in self.params if p.kind == "ptr"}
        if unknown:
            raise TypeError(f"kernel {self.name}: optional= names {sorted(unknown)}, which are not pointer parameters")
        self.jit = fn if hasattr(fn, "fn") else triton.jit(fn)
        self.device_scratch = device_scratch  # makes TMA descriptors on the device (tl.make_tensor_descriptor)
        self.arguments = arguments  # packed arguments -> the Triton function's (None: the same)
        self.pdl = pdl  # waits for the kernel before it (wait_for_previous) before touching memory
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
        self._float64_variants: dict[frozenset[str], Any] = {}
        self.launch_options: dict[torch.dtype | None, dict] = {}  # see tune()
        if register:
            REGISTRY[self.name] = self

    @property
    def source(self) -> str:
        """The kernel's Python text, read on first use: ``inspect.getsource`` of the ~50 kernels
        took 0.13 s of ``import teeny.ops`` when every ``@kernel`` read its own."""
        if self._source is None:
            self._source = textwrap.dedent(inspect.getsource(self.python_fn))
        return self._source

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

    def param(self, name: str) -> KernelParam | None:
        return self._param_by_name.get(name)

    def tune(self, dtype: torch.dtype | None = None, **options: Any) -> Kernel:
        """Default Triton launch options (``num_warps``, ``num_stages``) for every launch of this
        kernel, or of its ``dtype`` version; options a launch passes win."""
        self.launch_options[dtype] = dict(options)
        return self

    def options_for(self, dtype: torch.dtype) -> dict:
        return {**self.launch_options.get(None, {}), **self.launch_options.get(dtype, {})}

    def instance(self, dtype: torch.dtype) -> KernelInstance:
        """The kernel built for ``dtype``; refuses a dtype the kernel does not declare."""
        if dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            raise TypeError(f"kernel {self.name} has no {dtype_name(dtype)} version (it dispatches to {names})")
        inst = self._instances.get(dtype)
        if inst is None:
            settle(self.jit)
            inst = KernelInstance(self, dtype)
            self._instances[dtype] = inst
            _BUILT.append((self.name, dtype))
        return inst

    def jit_with_float64(self, names: frozenset[str]) -> Any:
        """The jitted function with the scalar parameters ``names`` typed ``tl.float64``."""
        jit = self._float64_variants.get(names)
        if jit is None:
            fn = self.python_fn
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__annotations__ = {**fn.__annotations__, **dict.fromkeys(names, tl.float64)}
            copy.__module__, copy.__qualname__, copy.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
            options = {
                k: getattr(self.jit, k)
                for k in ("do_not_specialize", "do_not_specialize_on_alignment")
                if getattr(self.jit, k, None)
            }
            if not options and hasattr(self.jit, "kwargs"):  # the interpreter keeps them as kwargs
                options = {k: v for k, v in self.jit.kwargs.items() if k.startswith("do_not_specialize") and v}
            jit = triton.jit(copy, **options)
            settle(jit)
            self._float64_variants[names] = jit
        return jit

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


@dataclass(frozen=True)
class LaunchRecord:
    """What one launch ran: the kernel, its dtype, grid, and the Triton type of each scalar."""

    kernel: str
    dtype: torch.dtype
    grid: tuple[int, ...]
    scalar_types: dict[str, str] = field(default_factory=dict)


_RECORDERS: list[list[LaunchRecord]] = []
_INTERCEPTORS: list[Callable] = []
_UNRECORDED: list[Callable] = []  # interceptors whose launches are not recorded


@contextlib.contextmanager
def record_launches() -> Iterator[list[LaunchRecord]]:
    """Collect a ``LaunchRecord`` for every kernel launch inside the ``with`` block."""
    log: list[LaunchRecord] = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


@contextlib.contextmanager
def intercept_launches(handler: Callable, *, recorded: bool = True) -> Iterator[None]:
    """Inside the ``with`` block no kernel runs: each launch calls
    ``handler(instance, jit, grid, args, options)`` instead (``jit`` is the Triton function the
    launch would run, ``args`` in signature order, ``options`` Triton's launch options). How an
    ahead-of-time build (``teeny.aot``) sees every launch a program makes, on meta tensors.
    ``recorded=False``: ``record_launches`` does not see them either (lowering's dry run, whose
    launches are specialised for compiling ahead, is not a run)."""
    _INTERCEPTORS.append(handler)
    if not recorded:
        _UNRECORDED.append(handler)
    try:
        yield
    finally:
        _INTERCEPTORS.remove(handler)
        if not recorded:
            _UNRECORDED.remove(handler)


@dataclass(frozen=True)
class KernelInstance:
    kernel: Kernel
    dtype: torch.dtype

    def scalar_types(self, params: Iterable[KernelParam], values: Iterable[Any]) -> dict[str, str]:
        """The Triton type each float and int scalar reaches the kernel as."""
        out = {}
        for p, v in zip(params, values):
            if p.kind in ("ptr", "constexpr") or isinstance(v, bool):
                continue
            if isinstance(v, float):
                out[p.name] = "fp64" if self.dtype == torch.float64 and p.kind == "scalar" else "fp32"
            elif isinstance(v, int):
                out[p.name] = "i64" if p.kind == "i64" or not -(2**31) <= v < 2**31 else "i32"
        return out

    def launch(self, grid: tuple[int, ...], args: list, **options: Any) -> None:
        """Launch over ``grid`` with ``args`` in signature order; ``options`` are Triton's
        launch options (num_warps, num_stages). Float scalars of a float64 instance are float64.
        A ``pdl`` kernel gets Triton's ``launch_pdl`` where the GPU has it (and so does what
        records or intercepts the launch: a tape, an ahead-of-time bundle)."""
        if self.kernel.pdl and config.pdl and _pdl_capable():
            options = {**options, "launch_pdl": True}
        jit = self.kernel.jit
        if _RECORDERS or self.dtype == torch.float64:
            types_ = self.scalar_types(self.kernel.params, args)
            wide = frozenset(name for name, t in types_.items() if t == "fp64")
            if wide:
                jit = self.kernel.jit_with_float64(wide)
            if not _UNRECORDED:
                for log in _RECORDERS:
                    log.append(LaunchRecord(self.kernel.name, self.dtype, tuple(grid), types_))
        if _INTERCEPTORS:
            _INTERCEPTORS[-1](self, jit, tuple(grid), list(args), dict(options))
            return
        self.run_jit(jit, grid, args, options)

    def run_jit(self, jit: Any, grid: tuple[int, ...], args: list, options: dict[str, Any]) -> Any:
        """Launch ``jit`` (this instance's Triton function, or its float64 variant) as it is:
        no recording, no interception. Returns what Triton returns: the compiled kernel on a
        GPU (``direct_launcher`` launches it again without Triton's argument binding)."""
        if self.kernel.device_scratch:
            # Triton asks a context-local allocator for the descriptors' global scratch memory; a
            # backward runs on torch's autograd thread, so set it at each launch, not once at import
            triton.set_allocator(_device_scratch)
        if self.kernel.arguments is not None:
            args = self.kernel.arguments(*args)
        return jit[grid](*args, **options)


def _pdl_capable() -> bool:
    """Whether the GPU launches programmatically dependent kernels: Hopper (sm_90) on, the GPUs
    that have the tensor memory accelerator too."""
    return tuning.has_tma()


def direct_launcher(
    compiled: Any, grid: tuple[int, ...], device_scratch: bool, arguments: Callable[..., list] | None = None
) -> Callable[[int, list], None] | None:
    """``launch(stream, args)``: the Triton-compiled kernel ``compiled`` launched straight
    through its C launcher over ``grid``, skipping ``JITFunction.run`` (argument binding,
    specialisation key, cache lookup) and Triton's Python launcher (which asks an allocator
    for scratch memory at every launch: most of a launch's host time). Global scratch (the
    TMA descriptors a ``device_scratch`` kernel makes) comes from ``_scratch``. Valid only for
    arguments that specialise as the ones it was compiled for (same scalars, pointers with the
    same 16-byte alignment). ``None`` where there is nothing to launch directly (the
    interpreter) or where Triton's launch hooks are set (a profiler that wants the full path).
    ``arguments``: the kernel's (``Kernel.arguments``), applied to the packed arguments first."""
    launch = _direct_launcher(compiled, grid, device_scratch)
    if launch is None or arguments is None:
        return launch

    def launch_arguments(stream: int, args: list) -> None:
        launch(stream, arguments(*args))

    return launch_arguments


def launches_watched() -> bool:
    """Whether something watches every launch, which a direct launcher would skip: a recorder
    (``record_launches``), an interceptor (``intercept_launches``) or Triton's launch hooks (a
    profiler). Launches then take ``KernelInstance.launch``'s full path."""
    return bool(_RECORDERS or _INTERCEPTORS) or _launch_hooks_set()


def _launch_hooks_set() -> bool:
    """Whether Triton's launch hooks are set (a ``HookChain`` with hooks in it, or a function)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(enter is not None and getattr(enter, "calls", True)) or bool(
        leave is not None and getattr(leave, "calls", True)
    )


def _direct_launcher(compiled: Any, grid: tuple[int, ...], device_scratch: bool) -> Callable[[int, list], None] | None:
    if compiled is None or not hasattr(compiled, "packed_metadata") or _launch_hooks_set():
        return None
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1, g2 = (*grid, 1, 1)[:3]
    native = getattr(run, "launch", None)
    needs = ("global_scratch_size", "num_ctas", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if native is None or not all(hasattr(run, a) for a in needs) or run.profile_scratch_size:  # Triton's own path

        def launch(stream: int, args: list) -> None:
            if device_scratch:
                triton.set_allocator(_device_scratch)
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)

        return launch
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
    scratch_bytes = g0 * g1 * g2 * run.num_ctas * run.global_scratch_size
    if not scratch_bytes:

        def launch_native(stream: int, args: list) -> None:
            native(g0, g1, g2, stream, function, cooperative, pdl, None, None, metadata, None, None, None, *args)

        return launch_native

    def launch_with_scratch(stream: int, args: list) -> None:
        scratch = _scratch(scratch_bytes, stream)
        native(g0, g1, g2, stream, function, cooperative, pdl, scratch, None, metadata, None, None, None, *args)

    return launch_with_scratch


_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream handle) -> the buffer its launches share


def _scratch(size: int, stream: int) -> torch.Tensor:
    """At least ``size`` bytes of global scratch for a launch on ``stream``. Launches on one
    stream run one after another, so they share one buffer, grown as needed (made by
    ``_outside_graph_pools``). While a CUDA graph is being captured each launch gets its own
    allocation instead: the graph's memory pool keeps it for the graph's replays, and a buffer
    grown later cannot free memory a graph still uses."""
    if torch.cuda.is_current_stream_capturing():
        return _device_scratch(size, 0, stream)
    device = torch.cuda.current_device()
    key = (device, stream)  # the default stream's handle is 0 on every device
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < size:
        if buffer is not None:
            torch.cuda.synchronize(device)  # launches queued on the stream may still read the old buffer
        buffer = _SCRATCH[key] = _outside_graph_pools(lambda: _device_scratch(size, 0, stream), device)
    return buffer


def _outside_graph_pools(allocate: Callable[[], torch.Tensor], device: int) -> torch.Tensor:
    """``allocate()`` on a thread of its own. While torch.compile's CUDA graphs warm up or record
    (mode="reduce-overhead"), torch routes every allocation of the calling thread into the graphs'
    private pool, and refuses a pool that holds a live tensor it did not hand out: a buffer kept
    across calls must come from torch's ordinary pool, which another thread's allocations do."""
    made: list[torch.Tensor] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            made.append(allocate())
        except BaseException as exc:  # handed to the caller (out of memory, say)
            failed.append(exc)

    thread = threading.Thread(target=run, name="teeny-scratch")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def _device_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch memory for a launch (a torch allocation on the current device, so CUDA-graph
    capture works; torch's blocks are aligned far beyond what descriptors need)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def settle(fn: Any) -> str:
    """Triton's ``cache_key`` of the ``@triton.jit`` function ``fn``, the same in every process:
    each function it calls is settled first, then ``fn`` is hashed afresh. (Triton adds a
    callee's ``tl.constexpr`` globals to its caller's key only if the callee was hashed first,
    so otherwise the key depends on the order a process hashed its kernels in: an ahead-of-time
    bundle's binaries go unfound, and Triton's disk cache misses.) Every kernel instance, and a
    function passed as a constexpr, is settled before its first launch. "" for an interpreted one."""
    if not isinstance(fn, JITCallable):
        return ""
    if not getattr(fn, "_teeny_settled", False):
        fn._teeny_settled = True  # (first: a function that calls itself)
        namespace = {**fn.__globals__, **inspect.getclosurevars(fn.fn).nonlocals}
        for node in ast.walk(fn.parse()):
            if isinstance(node, ast.Name):
                value = namespace.get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                value = getattr(namespace.get(node.value.id), node.attr, None)
            else:
                continue
            if isinstance(value, JITCallable):
                settle(value)
        fn.hash = None  # hashed again, now that its callees are
    return fn.cache_key


def kernel(fn: Callable | None = None, **options: Any) -> Kernel | Callable[[Callable], Kernel]:
    """Decorator: ``@kernel`` or ``@kernel(backward=..., half=True, dtypes=..., optional=...)``."""
    if fn is not None:
        return Kernel(fn, **options)
    return lambda f: Kernel(f, **options)


def built_instances() -> list[tuple[str, torch.dtype]]:
    """Every (kernel name, dtype) instance built so far, in order."""
    return list(_BUILT)


_SOURCE_COUNTER = [0]


def kernel_from_source(source: str, name: str | None = None, **options: Any) -> Kernel:
    """Build a ``@kernel`` from Triton source text defining one function.

    The text may start with ``@triton.jit`` or not, and may use ``tl`` and ``triton``.
    It is registered in ``linecache`` so that Triton (which reads source through
    ``inspect``) and tracebacks can see it.
    """
    text = textwrap.dedent(source).strip("\n") + "\n"
    _SOURCE_COUNTER[0] += 1
    filename = f"<teeny-source-{_SOURCE_COUNTER[0]}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    namespace: dict = {"triton": triton, "tl": tl}
    try:
        exec(compile(text, filename, "exec"), namespace)
    except SyntaxError as exc:
        raise SyntaxError(f"kernel source{' for ' + name if name else ''} does not parse: {exc}") from exc
    defined = [
        v
        for k, v in namespace.items()
        if k not in ("triton", "tl", "__builtins__") and (inspect.isfunction(v) or hasattr(v, "fn"))
    ]
    if not defined:
        raise ValueError(f"kernel source{' for ' + name if name else ''} defines no function")
    if name is not None:
        chosen = [
            f
            for f in defined
            if getattr(f, "__name__", None) == name or getattr(getattr(f, "fn", None), "__name__", None) == name
        ]
        if not chosen:
            raise ValueError(f"kernel source defines no function named {name!r}")
        target = chosen[0]
    else:
        target = defined[-1]  # helpers first, the kernel last
    python_fn = getattr(target, "fn", target)
    return Kernel(target, source=inspect.getsource(python_fn), **options)
