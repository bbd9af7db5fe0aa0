"""The classes ``patch`` gives modules: subclasses of the module's own class, made once per (class,
label), whose ``forward`` is a module-level function registered here with ``@swap(label)``.

A patched module's class is ``Teeny<Name>`` (a model's own class keeps its name, so
``config.architectures`` stays right), defined in ``teeny.torch.patching``. Its forward finds the
class it patched in ``_teeny_bases[label]``, so it can call the original forward. Instances pickle
and deep-copy as (the first class that is not patch's, the labels on top of it) and their state:
``torch.save(model)`` and ``copy.deepcopy(model)`` work, and a fresh process that unpickles a
patched model makes the same classes again (``_new_patched``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

# label -> (forward, class attributes, attributes worked out from the base class)
SWAPS: dict[str, tuple] = {}
UNPICKLING: list = []  # called before a patched module is made again (``attention`` registers its name)
MODEL_LABELS = ("causal_lm", "routed")  # a model's own class: its name and forward's signature stay
_CLASSES: dict[tuple[type, str], type] = {}


def swap(label: str, per_class=None, **attributes):
    """Register ``forward`` as the forward of the classes labelled ``label``, with these class
    ``attributes`` (and those ``per_class(base)`` returns)."""

    def register(forward):
        SWAPS[label] = (forward, attributes, per_class)
        return forward

    return register


def teeny_class(base: type, label: str) -> type:
    """``base`` with the forward registered as ``label``: the class ``patch`` gives a module."""
    key = (base, label)
    if key not in _CLASSES:
        forward, attributes, per_class = SWAPS[label]
        namespace = {
            "__module__": "teeny.torch.patching",
            "__reduce_ex__": _reduce_patched,
            "forward": _signed(forward, base.forward) if label in MODEL_LABELS else forward,
            "_teeny_bases": {**getattr(base, "_teeny_bases", {}), label: base},  # its forward calls its base's
            "_teeny_origin": getattr(base, "_teeny_origin", base),
            "_teeny_labels": getattr(base, "_teeny_labels", ()) + (label,),
            **attributes,
            **(per_class(base) if per_class else {}),
        }
        name = base.__name__ if label in MODEL_LABELS else f"Teeny{base.__name__}"
        _CLASSES[key] = type(name, (base,), namespace)
    return _CLASSES[key]


def _signed(forward, like):
    """``forward``, seen by ``inspect.signature`` as ``like``: a model's own forward keeps its
    parameters' names for the tools that read them (the Trainer keeps the dataset's columns that
    the forward takes)."""

    @functools.wraps(like)
    def signed(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return signed


def _reduce_patched(self, protocol):
    """``__reduce_ex__`` of patch's classes: as ``object``'s (their state, by ``__getstate__``),
    with the class made again by ``_new_patched`` from its origin and labels, which pickle by name."""
    new, (cls, *_), *state = object.__reduce_ex__(self, max(protocol, 2))
    if "_teeny_labels" not in cls.__dict__:  # a class made from patch's (FSDP's, say): its own way
        return (new, (cls,), *state)
    return (_new_patched, (cls._teeny_origin, cls._teeny_labels), *state)


def _new_patched(origin: type, labels: tuple[str, ...]) -> nn.Module:
    """An empty instance of the class ``teeny_class`` makes from ``origin`` and ``labels`` (unpickling fills it)."""
    for hook in UNPICKLING:
        hook()
    cls = origin
    for label in labels:
        cls = teeny_class(cls, label)
    return cls.__new__(cls)


def labels(module: nn.Module) -> tuple[str, ...]:
    """The labels of the classes patch made ``module``'s class from (none: not patched)."""
    return getattr(type(module), "_teeny_labels", ())


def origin(module: nn.Module) -> type:
    """``module``'s class before patch (its own class when not patched)."""
    return getattr(type(module), "_teeny_origin", type(module))


def base_forward(module: nn.Module, label: str):
    """The forward ``module``'s class had before patch gave it ``label``'s (unbound)."""
    return type(module)._teeny_bases[label].forward


def source(fn) -> str:
    """``fn``'s source text, or "" where it has none."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def from_transformers(cls: type) -> bool:
    """Whether ``cls`` is one of the ``transformers`` library's classes (recognised by module name,
    so that transformers stays optional)."""
    return cls.__module__.startswith("transformers.")


_SHARDING_HOOKS = ("torch.distributed.", "deepspeed.")  # hooks that gather a sharded weight and change nothing else


def has_hooks(module: nn.Module, sharding_ok: bool = False) -> bool:
    """Whether ``module`` has hooks (``sharding_ok``: other than FSDP's or DeepSpeed's, which
    gather its weights around its own forward and leave its result alone)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values(),
             *module._backward_hooks.values(), *module._backward_pre_hooks.values()]  # fmt: skip
    if sharding_ok:
        hooks = [h for h in hooks if not getattr(h, "__module__", "").startswith(_SHARDING_HOOKS)]
    return bool(hooks)


def not_plain(module: nn.Module, names: tuple[str, ...], forward) -> str | None:
    """Why a one-call forward of ``module`` may not read its layers ``names``' weights itself, or
    None: each must still be a layer patch made to run ``forward``, without hooks. A PEFT adapter
    put on one since the patch replaces it by its own layer, and a hook (FSDP's gathers a
    sharded weight) runs only when the layer is called: reading the weight would skip either."""
    for name in names:
        layer = getattr(module, name)
        if type(layer).forward is not forward:
            what = f"{type(layer).__module__}.{type(layer).__name__}"
            return f"{name} is a {what} (an adapter?): the layers' own calls run"
        if has_hooks(layer):
            return f"{name} has hooks: the layers' own calls run"
    return None


def count_fallback(module: nn.Module, name: str, why: str) -> None:
    """Count in the report that a one-call forward ran as separate calls (eager calls only: under
    torch.compile a count would be a guard that fails every call)."""
    report = getattr(module, "_teeny_report", None)
    if report is not None and not torch.compiler.is_compiling():
        report.fallbacks[(name, why)] += 1
