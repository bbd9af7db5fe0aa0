"""The name "teeny" in accelerate's list of dynamo backends, for Hugging Face's ``Trainer``.

``TrainingArguments(torch_compile=True, torch_compile_backend="teeny")`` reaches ``torch.compile``
through accelerate: the ``Trainer`` builds ``accelerate.utils.TorchDynamoPlugin(backend=...)``,
whose ``__post_init__`` converts the name to accelerate's own enum ``DynamoBackend``
(``DynamoBackend(name.upper())``, also for ``ACCELERATE_DYNAMO_BACKEND``), a fixed list that
refuses any other name with ``ValueError: 'TEENY' is not a valid DynamoBackend``. torch itself
finds "teeny" (the ``torch_dynamo_backends`` entry point); only accelerate's list lacks it.

``register()`` adds the member ``TEENY`` to that enum, made as accelerate makes its own (a ``str``
enum: ``DynamoBackend("TEENY")``, ``DynamoBackend.TEENY``, iteration and ``DynamoBackend.list()``
know it). The plugin's ``to_kwargs()`` hands its ``.value.lower()``, "teeny", to
``torch.compile(model, backend=...)``, which finds teeny's backend by name.

``import teeny.torch`` calls ``install()``: it registers at once when accelerate is imported
already, otherwise when ``accelerate.utils`` is first imported (a one-shot ``sys.meta_path``
hook), so that importing teeny never imports accelerate, an optional dependency. An accelerate
whose ``DynamoBackend`` is not such an enum is left alone, with its own error.
"""

from __future__ import annotations

import enum
import sys

NAME = "TEENY"  # accelerate's spelling: values are upper case, lowered for torch.compile
MODULE = "accelerate.utils"  # where accelerate defines (re-exports) DynamoBackend and TorchDynamoPlugin


def register(backends: type | None = None) -> bool:
    """Add ``TEENY`` to accelerate's ``DynamoBackend`` (``backends``, imported when not given);
    True when it is there (again: registering twice changes nothing), False when the enum is not
    the one this knows how to extend (then nothing is changed)."""
    if backends is None:
        from accelerate.utils import DynamoBackend as backends
    if not (isinstance(backends, enum.EnumMeta) and issubclass(backends, str)):
        return False
    if NAME in backends.__members__:
        return True
    try:
        member_map, value_map, names = backends._member_map_, backends._value2member_map_, backends._member_names_
        member = str.__new__(backends, NAME)  # the member type's __new__, as enum makes each member
        member._name_ = member._value_ = NAME
        member.__objclass__ = backends
        member._sort_order_ = len(names)
        member_map[NAME] = value_map[NAME] = member
        names.append(NAME)
        type.__setattr__(backends, NAME, member)  # EnumType.__setattr__ refuses member names
        if backends(NAME) is member and backends[NAME] is member and list(backends)[-1] is member:
            return True
    except Exception:  # noqa: BLE001  (an enum of another make: leave accelerate as it was)
        pass
    _unregister(backends)
    return False


def _unregister(backends: type) -> None:
    """Undo a partial ``register`` (and, in tests, a whole one)."""
    for table in ("_member_map_", "_value2member_map_"):
        getattr(backends, table, {}).pop(NAME, None)
    names = getattr(backends, "_member_names_", [])
    if NAME in names:
        names.remove(NAME)
    if NAME in vars(backends):
        type.__delattr__(backends, NAME)


class _Registering:
    """The loader of ``accelerate.utils`` that registers once the module has run. It hands the
    module its own loader back first, so the module is as the import system would have made it."""

    def __init__(self, spec, hook: _WhenImported):
        self.spec, self.loader, self.hook = spec, spec.loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.spec.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.hook.remove()
        try:
            register(getattr(module, "DynamoBackend", None))
        except Exception:  # noqa: BLE001  (never break accelerate's import)
            pass

    def __getattr__(self, name: str):  # get_source, get_filename, is_package, ...
        return getattr(self.loader, name)


class _WhenImported:
    """A ``sys.meta_path`` finder for ``accelerate.utils`` alone: it lets the other finders find
    it and wraps the loader in ``_Registering``; it removes itself once the module has run."""

    teeny_accelerate_hook = True

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != MODULE:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Registering(spec, self)
                return spec
        return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Register now when accelerate is imported already, else when it is imported (idempotent;
    never imports accelerate)."""
    module = sys.modules.get(MODULE)
    if module is not None:
        if hasattr(module, "DynamoBackend"):
            register(module.DynamoBackend)
        return
    if not any(getattr(finder, "teeny_accelerate_hook", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())
