"""Every teeny op as a PyTorch operator: ``torch.ops.teeny.<name>``.

    y = torch.ops.teeny.gelu(x, "tanh")                 # teeny's kernels, torch autograd
    torch.compile(model, fullgraph=True)                # no graph break: the ops are opaque
    teeny.torch.register(my_teeny_function)             # your CustomOp or @kernel pair, the same way

Each op runs its ``teeny.ops`` function itself (never the registry's test wrapper around it)
and has a schema written from its ``teeny.ops`` signature (tensors, ``Tensor?`` for an
optional one, ``int[]`` shapes and dims, ``Scalar`` overloads where a number may take a tensor's
place) and a ``CompositeImplicitAutograd`` implementation that describes the call in a key
(shapes, dtypes, ``requires_grad`` flags and the other arguments, floats exactly: ``-0.0`` is
not ``0.0``) and runs it through the bridge's two generic operators (``teeny::run_forward`` /
``teeny::run_backward``, see ``teeny.torch.bridge``). Those carry the fake implementations
(shapes, on meta or fake tensors, without a launch) and the autograd formula, whose backward is
teeny's backward kernels fed exactly what the op's pair declares it saves. A model that calls
these ops compiles with ``torch.compile(fullgraph=True)``: the ops reach the graph as opaque
custom operators, on the CPU (the Triton interpreter) as on the GPU.

Autocast: under ``torch.autocast`` the products (``linear``, ``matmul``, ``conv2d``,
``scaled_dot_product_attention``) run in the autocast dtype; every other op runs in the dtype
of its first floating-point tensor (a float32 norm weight meets bf16 activations as bf16),
so bf16 in gives bf16 out, with no upcast copy. Ops whose kernels have no bf16 version say so.

teeny's own layers call the operators through ``library.direct``: the same operators, which
in plain eager mode go straight to their Python implementation, past the dispatcher.

Not registered: ``getitem`` and ``getitem_advanced`` (the index is an arbitrary Python object; use tensor indexing or
``teeny.torch.apply``). ``registered_ops()`` lists the rest.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TeenyError
from ..core.kernel import dtype_name
from ..core.runtime import RuntimeOp
from . import bridge

NAMESPACE = "teeny"


def _source_digest() -> str:
    """A digest of teeny's own source: compiled graphs that torch.compile caches on disk carry op
    keys, and an op's outputs (the extras its backward saves) may change with teeny's code, so a
    key from other code must not match."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


_DIGEST = _source_digest()
_PREFIX = f"op1-{_DIGEST}:"  # the key format's version and the code's digest


def _tag_compile_caches(digest: str) -> None:
    """Put teeny's source digest into torch.compile's cache keys (``cache_key_tag``, kept with
    any tag already set). Its on-disk caches know a graph by its code, where teeny's operators
    appear by name only; without the tag, a graph compiled against other teeny code would be
    loaded and fail on its op keys (``bridge.lookup`` says so) instead of being compiled again."""
    config = torch.compiler.config
    tag = f"teeny-{digest}"
    if tag not in config.cache_key_tag.split("+"):
        config.cache_key_tag = f"{config.cache_key_tag}+{tag}" if config.cache_key_tag else tag


_tag_compile_caches(_DIGEST)
_TENSOR = "<tensor>"  # marks a tensor's (shape, dtype, requires_grad) in a key; no schema value is this string
_DTYPE = "__dtype__"  # (marker, name): a torch.dtype argument in a key
_KEYS: dict[tuple, str] = {}

# argument names that are tensors in teeny's functional signatures
_TENSOR_NAMES = {
    "x",
    "input",
    "other",
    "weight",
    "bias",
    "target",
    "query",
    "key",
    "value",
    "attn_mask",
    "gate",
    "up",
    "a",
    "b",
    "idx",
    "w",
    "t",
    "running_mean",
    "running_var",
    "condition",
    "pos_weight",
    "cos",
    "sin",
}
_ANNOTATIONS = {
    "bool": "bool",
    "float": "float",
    "int": "int",
    "str": "str",
    "float | None": "float?",
    "int | None": "int?",
    "str | None": "str?",
    "bool | None": "bool?",
    "torch.dtype": "ScalarType",
    "torch.dtype | None": "ScalarType?",
}
_UNANNOTATED = {  # non-tensor arguments without annotation, by name
    "dim": "int[1]?",
    "alpha": "Scalar",
    "rounding_mode": "str?",
    "padding_idx": "int?",
    "normalized_shape": "int[1]",
    "shape": "int[]",
    "sizes": "int[]",
    "dims": "int[]",
    "chunks": "int",
    "s": "int",
    "exponent": "Tensor",
    "tensors": "Tensor[]",
}
# whole argument lists where the rules above do not fit; a name maps to one or more overloads
_OVERRIDES: dict[str, list[tuple[str, str]]] = {
    "conv2d": [
        (
            "",
            "Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, "
            "int[2] dilation=1, int groups=1",
        ),
        (
            "padding",
            "Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, str padding='valid', "
            "int[2] dilation=1, int groups=1",
        ),
    ],
    "max_pool2d": [
        (
            "",
            "Tensor input, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1, "
            "bool ceil_mode=False",
        ),
    ],
    "avg_pool2d": [
        (
            "",
            "Tensor input, int[2] kernel_size, int[2] stride=[], int[2] padding=0, bool ceil_mode=False, "
            "bool count_include_pad=True, int? divisor_override=None",
        ),
    ],
    "split": [
        ("", "Tensor x, int split_size_or_sections, int dim=0"),
        ("sizes", "Tensor x, int[] split_size_or_sections, int dim=0"),
    ],
    "clamp": [
        ("", "Tensor input, Scalar? min=None, Scalar? max=None"),
        ("Tensor", "Tensor input, Tensor? min=None, Tensor? max=None"),
    ],
    "logsumexp": [("", "Tensor x, int[1] dim, bool keepdim=False")],
    "squeeze": [("", "Tensor x, int[1]? dim=None")],
    "chunk": [("", "Tensor x, int chunks, int dim=0")],
    "batch_norm": [
        (
            "",
            "Tensor x, Tensor? running_mean, Tensor? running_var, Tensor? weight=None, Tensor? bias=None, "
            "bool training=False, float momentum=0.1, float eps=1e-05",
        )
    ],
}
_SCALAR_OVERLOADS = {  # ops whose second operand may be a Python number: an extra "Scalar" overload
    "add": "other",
    "sub": "other",
    "mul": "other",
    "div": "other",
    "pow": "exponent",
    "maximum": "other",
    "minimum": "other",
    "where": "other",
}
_MULTI_OUTPUT = {"split", "chunk"}
# how a call runs under autocast (see the module docstring and ``register``): "product" in
# autocast's dtype, "as_given" on its tensors' own dtypes, any other in its first float tensor's
_AUTOCAST = dict.fromkeys(("linear", "matmul", "conv2d", "scaled_dot_product_attention"), "product")
_SKIPPED = dict.fromkeys(
    ("getitem", "getitem_advanced"), "its index is an arbitrary Python object: use tensor indexing or teeny.torch.apply"
)
_EMPTY_MEANS_NONE = {("max_pool2d", "stride"), ("avg_pool2d", "stride")}  # ATen's spelling of "stride=None"


@dataclass
class Registered:
    """One registered overload: ``torch.ops.teeny.<name>.<overload>`` running ``fn``."""

    name: str
    overload: str
    fn: Callable
    schema: str
    arg_names: list[str]
    arg_types: list[str]
    multi_output: bool
    composite: Callable | None = None  # the implementation the dispatcher calls

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}" + (f".{self.overload}" if self.overload else "")

    @property
    def packet(self):
        return getattr(torch.ops.teeny, self.name)

    @property
    def op(self):
        return getattr(self.packet, self.overload or "default")


_REGISTERED: dict[str, Registered] = {}  # qualname -> overload
_FUNCTIONS: dict[str, Callable] = {}  # name -> teeny function (for rebuilding keys)
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


# ----------------------------------------------------------------------------- schemas


def _parse_arguments(arguments: str) -> list[tuple[str, str]]:
    """(type, name) of each argument of a schema's argument list (``*`` markers dropped)."""
    out = []
    for part in _split_top(arguments):
        part = part.strip()
        if not part or part == "*":
            continue
        declaration = part.split("=", 1)[0].strip()
        type_, name = declaration.rsplit(" ", 1)
        out.append((type_.strip(), name.strip()))
    return out


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _default(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_default(v) for v in value) + "]"
    return repr(value)


def schema_arguments(fn: Callable, name: str) -> str:
    """The argument list of ``fn``'s schema, from its signature (see module docstring)."""
    parts = []
    keyword_only = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD or p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        annotation = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", None)
        has_default = p.default is not inspect.Parameter.empty
        if p.name in _TENSOR_NAMES and (annotation is None or annotation is inspect.Parameter.empty.__name__):
            type_ = "Tensor?" if has_default and p.default is None else "Tensor"
        elif isinstance(annotation, str) and annotation in _ANNOTATIONS:
            type_ = _ANNOTATIONS[annotation]
        elif p.name in _UNANNOTATED:
            type_ = _UNANNOTATED[p.name]
        elif p.name in _TENSOR_NAMES:
            type_ = "Tensor?" if has_default and p.default is None else "Tensor"
        else:
            raise TypeError(f"{name}: no schema type for argument {p.name!r}; pass schema= to register()")
        if has_default and p.default is None and not type_.endswith("?"):
            type_ += "?"
        text = f"{type_} {p.name}"
        if has_default:
            text += f"={_default(p.default)}"
        parts.append(text)
    return ", ".join(parts)


# ----------------------------------------------------------------------------- calls


def _encode(value: Any, tensors: list, labels: list, label: str) -> Any:
    """The key's description of one argument; tensors go to ``tensors`` (made contiguous)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        wants = value.requires_grad and value.is_floating_point() and torch.is_grad_enabled()
        tensors.append(value.contiguous())
        labels.append(label)
        return (_TENSOR, tuple(int(s) for s in value.shape), dtype_name(value.dtype), wants)
    if isinstance(value, (list, tuple)):
        return tuple(_encode(v, tensors, labels, f"{label}[{i}]") for i, v in enumerate(value))
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.dtype):  # a key is a Python literal: a dtype travels by name
        return (_DTYPE, dtype_name(value))
    return value


def _is_tensor(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 4 and value[0] == _TENSOR


def _decode(value: Any, wants: list) -> Any:
    if _is_tensor(value):
        _, shape, dtype, grad = value
        wants.append(grad)
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _DTYPE:
        return getattr(torch, value[1])
    if isinstance(value, tuple):
        return tuple(_decode(v, wants) for v in value)
    return value


def _build(key: str) -> bridge.Compiled:
    """A compiled entry from an op key (the key says everything the trace needs)."""
    name, overload, args, kwargs = bridge.parse_key(key, _PREFIX)
    fn = _FUNCTIONS.get(name)
    if fn is None:
        raise TeenyError(f"torch.ops.teeny.{name}: no teeny function registered under that name")
    wants: list[bool] = []
    real_args = [_decode(a, wants) for a in args]
    real_kwargs = {k: _decode(v, wants) for k, v in kwargs}
    labels = _labels(kwargs)
    label = f"teeny op {name}"
    return bridge.compile_function(fn, tuple(real_args), real_kwargs, wants, key, label, labels)


def _labels(kwargs) -> list[str]:
    out: list[str] = []

    def walk(value, label):
        if _is_tensor(value):
            out.append(label)
        elif isinstance(value, tuple):
            for i, v in enumerate(value):
                walk(v, f"{label}[{i}]")

    for k, v in kwargs:
        walk(v, k)
    return out


def _qualname(name: str, overload: str) -> str:
    return f"{NAMESPACE}::{name}" + (f".{overload}" if overload else "")


bridge.add_builder(_PREFIX, _build)


def _autocast(reg: Registered, values: list) -> list:
    """Cast floating-point tensors as autocast would (see module docstring)."""
    tensors = [v for v in _flat(values) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not tensors:
        return values
    device_type = tensors[0].device.type
    if not autocast_on(device_type):
        return values
    rule = _AUTOCAST.get(reg.name, "first")
    if rule == "as_given":
        return values
    if rule == "product":
        target = torch.get_autocast_dtype(device_type)
    else:
        target = tensors[0].dtype
    return [_cast(v, target) for v in values]


def autocast_dtype(args) -> torch.dtype | None:
    """The autocast dtype of the device of the first floating-point argument (None: autocast off there)."""
    for a in args:
        if a.is_floating_point():
            device_type = a.device.type
            return torch.get_autocast_dtype(device_type) if autocast_on(device_type) else None
    return None


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (never for a device it has no mode for: meta).
    While compiling, tensors are on real devices, and the availability check is left out: torch
    2.11's dynamo cannot trace it and breaks the graph there (at every patched norm)."""
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def _flat(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_flat(v))
        else:
            out.append(v)
    return out


def _cast(v: Any, dtype: torch.dtype) -> Any:
    """``v`` (or the tensors of a list) in ``dtype``, contiguous: one copy for a cast transposed view."""
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
        return v.to(dtype, memory_format=torch.contiguous_format)
    if isinstance(v, (list, tuple)):
        return type(v)(_cast(b, dtype) for b in v)
    return v


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype)


def _call_signature(args: tuple, kwargs: dict, grad: bool) -> tuple | None:
    """What a call's key depends on, cheaply: each plain tensor's shape, dtype and gradient
    flag, each other argument's type and value (lists of numbers too), the autocast dtype.
    None for anything else (tensor subclasses, lists of tensors, NaN): the key is built in full."""
    parts = []
    for a in (*args, *kwargs.values()):
        kind = type(a)
        if kind in _PLAIN_TENSORS:
            parts.append((a.shape, a.dtype, grad and a.requires_grad))
        elif kind in _PLAIN_VALUES and a == a:
            parts.append((kind, a.hex() if kind is float else a))  # -0.0 == 0.0, but not in hex
        elif kind in (list, tuple) and all(type(e) in (int, float, bool) and e == e for e in a):
            parts.append((kind, tuple(e.hex() if type(e) is float else e for e in a), tuple(map(type, a))))
        else:
            return None
    if kwargs:
        parts.append(tuple(kwargs))
    if torch._C._is_any_autocast_enabled():
        parts.append(autocast_dtype([a for a in (*args, *kwargs.values()) if type(a) in _PLAIN_TENSORS]))
    return tuple(parts)


def _exact(value: Any) -> Any:
    """``value`` (a call's description) with each float as its hex text: -0.0 and 0.0 are equal
    and hash alike, but a kernel given one or the other gives inf or -inf (``1 / x``)."""
    if type(value) is float:
        return (float, value.hex())
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


_NO_DEFAULT = object()


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is exactly ``default`` (its type too: 1 is not 1.0 nor True; -0.0 is not 0.0)."""
    if default is _NO_DEFAULT or type(value) is not type(default) or isinstance(value, torch.Tensor):
        return False
    return _exact(value) == _exact(default) if type(value) in (float, int, bool, str, type(None)) else False


def _implementation(reg: Registered) -> Callable:
    names = reg.arg_names
    parameters = inspect.signature(reg.fn).parameters
    defaults = {n: p.default for n, p in parameters.items() if n in names and p.default is not p.empty}
    # the common call (plain tensors and values): its key, and where each of its tensors comes
    # from (a position or a keyword) with the dtype autocast gives it, in one hit
    known_calls: dict[tuple, tuple[str, list[tuple[int | str, torch.dtype | None]]]] = {}

    def composite(*args, **kwargs):
        signature = _call_signature(args, kwargs, torch.is_grad_enabled())
        hit = None if signature is None else known_calls.get(signature)
        if hit is not None:
            key, picks = hit
            tensors = []
            for source, dtype in picks:
                t = args[source] if type(source) is int else kwargs[source]
                tensors.append(t.contiguous() if dtype is None else _cast(t, dtype))
            return run(key, tensors)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        # arguments left out take the teeny function's defaults; one given as its default is left
        # out too, so that a call gets one key whether it spells a default out or not
        given = [n for n in names if n in bound and not _is_default(bound[n], defaults.get(n, _NO_DEFAULT))]
        originals = [bound[n] for n in given]
        values = _autocast(reg, originals)
        tensors: list[torch.Tensor] = []
        labels: list[str] = []
        encoded = []
        for value, name in zip(values, given):
            if (reg.name, name) in _EMPTY_MEANS_NONE and isinstance(value, (list, tuple)) and not value:
                value = None
            encoded.append(_encode(value, tensors, labels, name))
        call = (reg.name, reg.overload, (), tuple(zip(given, encoded)))
        exact = _exact(call)
        key = _KEYS.get(exact)
        if key is None:  # the key text once per signature, not per call
            key = _KEYS[exact] = _PREFIX + repr(call)
        if signature is not None:
            positions = {n: i for i, n in enumerate(names[: len(args)])}
            known_calls[signature] = (
                key,
                [
                    (positions.get(n, n), None if v is a else v.dtype)
                    for n, a, v in zip(given, originals, values)
                    if isinstance(a, torch.Tensor)
                ],
            )
        return run(key, tensors)

    def run(key: str, tensors: list[torch.Tensor]):
        entry = bridge.lookup(key)
        out = entry.unpack(bridge.call(entry, tensors))
        return list(out) if reg.multi_output else out

    return composite


class _Direct:
    """``torch.ops.teeny`` for teeny's own layers (``teeny.torch.nn``, ``teeny.torch.patch``):
    the same operators, but a call in plain eager mode goes straight to the operator's Python
    implementation instead of through the dispatcher, whose round trip into Python costs about
    as much as the rest of the call (bench/host.py). Plain eager: nothing is compiling,
    no dispatch mode, no functorch transform, no function mode but ones that pass teeny's
    operators through unchanged (a class attribute ``passes_teeny_ops = True``: patch's
    router), and the arguments are plain tensors and values. Any other call goes through the
    operator, so every mode, subclass and tracer sees it. Names with several overloads are
    the operators themselves."""

    def __getattr__(self, name: str):
        packet = getattr(torch.ops.teeny, name)
        overloads = [r for r in _REGISTERED.values() if r.name == name]
        call = packet if len(overloads) != 1 else _direct_call(overloads[0].composite, packet)
        setattr(self, name, call)
        return call


def _direct_call(composite: Callable, packet) -> Callable:
    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return packet(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return packet(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TENSORS:
                return packet(*args, **kwargs)
        modes = torch._C._len_torch_function_stack()
        if not modes:
            return composite(*args, **kwargs)
        for i in range(modes):
            if not getattr(torch._C._get_function_stack_at(i), "passes_teeny_ops", False):
                return packet(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # as inside the mode's handler: teeny's own torch calls skip it
            return composite(*args, **kwargs)

    return call


direct = _Direct()


# ----------------------------------------------------------------------------- registering


def _define(name: str, overload: str, fn: Callable, arguments: str, multi_output: bool) -> Registered:
    qualname = _qualname(name, overload)
    if qualname in _REGISTERED:
        raise ValueError(f"torch.ops.{NAMESPACE}.{name}{'.' + overload if overload else ''} is already registered")
    returns = "Tensor[]" if multi_output else "Tensor"
    schema = f"{name}{'.' + overload if overload else ''}({arguments}) -> {returns}"
    parsed = _parse_arguments(arguments)
    reg = Registered(name, overload, fn, schema, [n for _, n in parsed], [t for t, _ in parsed], multi_output)
    _LIB.define(schema)
    reg.composite = _implementation(reg)
    _LIB.impl(f"{name}{'.' + overload if overload else ''}", reg.composite, "CompositeImplicitAutograd")
    _REGISTERED[qualname] = reg
    _FUNCTIONS[name] = fn
    return reg


def register(
    fn: Callable | RuntimeOp | type,
    name: str | None = None,
    schema: str | None = None,
    n_inputs: int | None = None,
    multi_output: bool = False,
    autocast: str = "first",
) -> Callable:
    """Register a teeny function, or a ``RuntimeOp``/``CustomOp`` (instance or class), as
    ``torch.ops.teeny.<name>``; returns the operator.

    A function of symbolic tensors gets its schema from its signature (tensor arguments named
    like teeny's: ``x``, ``input``, ``weight``, ...; annotated ``int``/``float``/``bool``/``str``
    scalars) unless ``schema`` gives the argument list, e.g. ``"Tensor x, float scale=1.5"``.
    An op takes ``n_inputs`` tensors (default: its ``n_activation_inputs``) and no other
    argument. Forward and backward run teeny's kernels through the bridge, so the operator
    differentiates, compiles (``fullgraph=True``) and passes ``torch.library.opcheck``.
    ``autocast``: how the call runs under autocast: ``"first"`` in the dtype of its first
    floating-point tensor, ``"product"`` in autocast's dtype, as products do (see the module
    docstring), ``"as_given"`` on its tensors as they come (a function that casts what it must).
    """
    if autocast not in ("first", "product", "as_given"):
        raise ValueError(f"register: autocast must be 'first', 'product' or 'as_given', got {autocast!r}")
    if isinstance(fn, type) and issubclass(fn, RuntimeOp):
        fn = fn()
    if isinstance(fn, RuntimeOp):
        op = fn
        count = n_inputs if n_inputs is not None else op.n_activation_inputs
        name = name or op.name
        arg_names = [f"x{i}" for i in range(count)]

        def apply_op(**named):
            from ..core.graph import graph_of

            xs = [named[n] for n in arg_names]
            return graph_of(*xs).apply(op, xs)

        apply_op.__name__ = name
        fn = apply_op
        schema = schema or ", ".join(f"Tensor {n}" for n in arg_names)
    name = name or getattr(fn, "__name__", None)
    if not name or not name.isidentifier():
        raise ValueError(f"register: give the operator a name (got {name!r})")
    arguments = schema if schema is not None else schema_arguments(fn, name)
    _AUTOCAST[name] = autocast
    reg = _define(name, "", fn, arguments, multi_output)
    return reg.packet


def register_all() -> dict[str, Registered]:
    """Register every op of teeny's registry (``teeny.checks.samples.all_ops()``) once."""
    from .. import ops
    from ..checks.samples import all_ops

    for info in all_ops():
        if info.name in _SKIPPED or _qualname(info.name, "") in _REGISTERED:
            continue
        fn = _functional(info, ops)
        if fn is None:
            _SKIPPED[info.name] = "a registry variant with fixed arguments (its **kwargs have no schema)"
            continue
        overloads = _OVERRIDES.get(info.name)
        if overloads is None:
            overloads = [("", schema_arguments(fn, info.name))]
            scalar = _SCALAR_OVERLOADS.get(info.name)
            if scalar is not None:
                parsed = overloads[0][1]
                overloads.append(("Scalar", _with_scalar(parsed, scalar)))
        for overload, arguments in overloads:
            _define(info.name, overload, fn, arguments, info.name in _MULTI_OUTPUT)
    return dict(_REGISTERED)


def _functional(info, ops) -> Callable | None:
    """What ``torch.ops.teeny.<info.name>`` runs: the ``teeny.ops`` function of that name where a
    schema can describe its arguments, never the registry's test wrapper around it (``chunk``'s
    sample concatenates the parts); else the registry's op (a variant such as ``gelu_tanh``, or
    ``view``'s, which takes the sizes ``*shape`` spreads as one list); None when neither has a schema."""
    fn = getattr(ops, info.name, None)
    if fn is not None and not _takes_var_arguments(fn):
        return fn
    return None if _takes_var_arguments(info.op, positional=False) else info.op


def _takes_var_arguments(fn: Callable, positional: bool = True) -> bool:
    """Whether ``fn`` takes ``**kwargs`` (or ``*args`` too, when ``positional``)."""
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)[: 2 if positional else 1]
    return any(p.kind in kinds for p in inspect.signature(fn).parameters.values())


def _with_scalar(arguments: str, name: str) -> str:
    parts = []
    for part in _split_top(arguments):
        part = part.strip()
        declaration = part.split("=", 1)[0].strip()
        if declaration.rsplit(" ", 1)[-1] == name:
            part = part.replace(declaration, f"Scalar {name}", 1)
        parts.append(part)
    return ", ".join(parts)


def registered_ops() -> dict[str, Registered]:
    """Every registered overload, by qualified name (``teeny::gelu``, ``teeny::add.Scalar``)."""
    return dict(_REGISTERED)


def skipped_ops() -> dict[str, str]:
    """teeny ops that are not registered, and why."""
    return dict(_SKIPPED)


register_all()
