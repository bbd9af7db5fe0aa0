"""A run of teeny's host path recorded once and replayed: a call cut down to its launches.

An executor's run (``Executor.forward_train``, ``backward``) and a registered op's call
(``teeny.torch``, which runs an executor) take the executor's host path: inputs bound and
checked, per node its buffers, its launches (``replay.NodeReplay``) and the bookkeeping of its
cache entry and gradients. For one call signature all of that comes out the same every time;
only the tensors differ. ``Replayed(fn)`` runs ``fn(tensors) -> list[Tensor]`` normally once,
recording what it does to the device as a ``Tape``: each ATen call (allocations, views,
zeroing, copies) through a ``TorchDispatchMode``, each kernel launch through
``kernel.intercept_launches``, over numbered slots (the inputs, then every tensor the run
made; a tensor it read but did not make, such as an executor's constant, is kept as it is).
Later calls on tensors of the same shapes, strides, dtypes, device and 16-byte alignment, and with
the same aliasing among them (which inputs are one tensor, which share memory: a run given
``(x, x)`` reads one slot twice, so a ``Replayed`` keeps a tape per aliasing pattern), replay
that tape (written out once as one Python function, ``_straight_line``): the ATen calls again,
each launch straight through Triton's C launcher (``kernel.direct_launcher``; a TMA kernel's
descriptors in one scratch buffer per stream) on a GPU, and the flags ops asked to have checked
(``OpContext.check_after``) read as the executor reads them.

The full path runs instead (``Replayed.not_recorded`` says why) when the run handed a value
from the device to the host (``.item()``: a branch may depend on it), when ``fn``'s program
has an op that is not ``capturable`` (dropout's per-run seed), under a dispatch mode or another
launch interceptor (opcheck, an ahead-of-time capture), and with ``teeny.core.config.replay``
off (``TEENY_REPLAY=0``). A tensor ``fn`` reads that the run did not make is kept as it is:
an executor's parameters, constants and gradient arena (``own``: the same tensors every run;
the executor keeps one backward tape per state of its gradients, see ``Executor.backward``).
A ``teeny.torch`` call whose program has trainable parameters of its own is not taped itself
(``check_replayable``): the executor it runs tapes its runs. While launches are being recorded
(``kernel.record_launches``), intercepted, or watched by a profiler's launch hooks, a replay
launches through the full ``KernelInstance.launch``, so every launch is still seen.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..core import config
from ..core.kernel import (
    _INTERCEPTORS,
    KernelInstance,
    direct_launcher,
    intercept_launches,
    launches_watched,
)
from ..core.runtime import _CHECK_SINKS, launch_failed, raise_failed_checks

ALIGN = 16  # bytes: the alignment Triton specialises pointers on and TMA needs
MAX_PATTERNS = 4  # tapes kept per function, one per aliasing pattern of its inputs; others take the full path
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors as they are (no subclass, no fake tensor)


@dataclass(frozen=True)
class _Slot:
    """A tensor of the tape, by number."""

    index: int


def _template(value: Any, slots: dict[int, int], unknown: list) -> Any:
    """``value`` with every tensor the run knows replaced by its ``_Slot``; the tensors it does
    not know are kept as they are and listed in ``unknown``."""
    if isinstance(value, torch.Tensor):
        index = slots.get(id(value))
        if index is None:
            unknown.append(value)
            return value
        return _Slot(index)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v, slots, unknown) for v in value)
    if isinstance(value, dict):
        return {k: _template(v, slots, unknown) for k, v in value.items()}
    return value


def _slots_in(template: Any) -> set[int]:
    """The slots a template reads (empty: it holds no tensor of the run)."""
    if isinstance(template, _Slot):
        return {template.index}
    if isinstance(template, (list, tuple)):
        return set().union(*(_slots_in(v) for v in template)) if template else set()
    if isinstance(template, dict):
        return _slots_in(list(template.values()))
    return set()


def _fill(template: Any, slots: list) -> Any:
    if isinstance(template, _Slot):
        return slots[template.index]
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(v, slots) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, slots) for k, v in template.items()}
    return template


def _filler(template: Any) -> Callable[[list], Any]:
    """A function of the slots giving ``template`` filled in (the template itself when it
    holds no slot); top-level slots of a flat list are filled by position, the common case."""
    if not _slots_in(template):
        return lambda slots: template
    if isinstance(template, (list, tuple)) and not any(
        isinstance(v, (list, tuple, dict)) and _slots_in(v) for v in template
    ):
        positions = [(i, v.index) for i, v in enumerate(template) if isinstance(v, _Slot)]
        base = list(template)

        def flat(slots: list) -> list:
            out = base.copy()
            for i, k in positions:
                out[i] = slots[k]
            return out

        return flat
    return lambda slots: _fill(template, slots)


def _tensors(value: Any) -> list[torch.Tensor] | None:
    """The tensors of an ATen call's result (None when it holds something else: a host value)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            inner = _tensors(v)
            if inner is None:
                return None
            out.extend(inner)
        return out
    return None


class _AtenStep:
    """One ATen call; the tensors of its result that are new become the slots in ``made``
    (``single``: the result was one tensor)."""

    def __init__(self, func, args: list, kwargs: dict, made: list[tuple[int, int]], single: bool):
        self.templates = (args, kwargs)
        self.factory = _factory(func, args, kwargs)
        self.call = _caller(func, args, kwargs, self.factory)
        self.made = made  # (position among the result's tensors, slot)
        self.single = single
        self.writes = func._schema.is_mutable  # changes a tensor it was given: never dropped

    def reads(self) -> set[int]:
        return _slots_in(self.templates)

    def run(self, slots: list, stream: int | None) -> None:
        out = self.call(slots)
        if self.made:
            tensors = [out] if isinstance(out, torch.Tensor) else _tensors(out) or []
            for position, index in self.made:
                slots[index] = tensors[position]

    def lines(self, name: str, env: dict) -> list[str]:
        """The step as source lines of ``_straight_line`` (its objects put in ``env``)."""
        if not self.made:
            env[name] = self.call
            return [f"{name}(s)"]
        if not self.single or len(self.made) != 1:
            env[name] = self
            return [f"{name}.run(s, stream)"]
        slot = self.made[0][1]
        if self.factory is None:
            env[name] = self.call
            return [f"s[{slot}] = {name}(s)"]
        env[name], env[f"{name}_size"], env[f"{name}_dtype"], env[f"{name}_device"] = self.factory
        return [f"s[{slot}] = {name}({name}_size, dtype={name}_dtype, device={name}_device)"]


_aten = torch.ops.aten
_PLAIN_FACTORY = {
    "layout": (None, torch.strided),
    "pin_memory": (None, False),
    "memory_format": (None, torch.contiguous_format),
}


def _factory(func, args: list, kwargs: dict) -> tuple | None:
    """``(torch.empty or torch.zeros, size, dtype, device)`` for an allocation of a plain
    contiguous buffer (None for any other call)."""
    plain = all(kwargs.get(k) in ok for k, ok in _PLAIN_FACTORY.items())
    if func in (_aten.empty.memory_format, _aten.zeros.default) and plain and not _slots_in(args):
        make = torch.empty if func is _aten.empty.memory_format else torch.zeros
        return make, tuple(args[0]), kwargs.get("dtype"), kwargs.get("device")
    return None


def _caller(func, args: list, kwargs: dict, factory: tuple | None) -> Callable[[list], Any]:
    """``slots -> func(args, kwargs)`` filled in; the calls every run makes (allocations, views,
    clones, zeroing) through torch's Python functions, which cost a fraction of an operator
    call's dispatch from Python."""
    plain = all(kwargs.get(k) in ok for k, ok in _PLAIN_FACTORY.items())
    if factory is not None:
        make, size, dtype, device = factory
        return lambda slots: make(size, dtype=dtype, device=device)
    if args and isinstance(args[0], _Slot) and not _slots_in(args[1:]) and not _slots_in(kwargs):
        k, rest = args[0].index, args[1:]
        if func is _aten.view.default:
            return lambda slots: slots[k].view(rest[0])
        if func is _aten.zero_.default:
            return lambda slots: slots[k].zero_()
        if func is _aten.clone.default and plain:
            return lambda slots: slots[k].clone(memory_format=torch.contiguous_format)
    fill_args, fill_kwargs = _filler(args), _filler(kwargs)
    return lambda slots: func(*fill_args(slots), **fill_kwargs(slots))


class _ViewStep:
    """A view of one slot (``select``, ``slice``, ``as_strided``, ...) made again as the recorded
    run's was: its sizes and strides, at the same offset from the slot's start. (The slot's own
    layout is the recorded one: a tape fits only inputs laid out as the recorded run's.)"""

    writes = False

    def __init__(self, of: int, size: torch.Size, stride: tuple[int, ...], offset: int, slot: int):
        self.of, self.size, self.stride, self.offset = of, tuple(size), stride, offset
        self.made = ((0, slot),)
        self.slot = slot

    def reads(self) -> set[int]:
        return {self.of}

    def run(self, slots: list, stream: int | None) -> None:
        t = slots[self.of]
        slots[self.slot] = t.as_strided(self.size, self.stride, t.storage_offset() + self.offset)

    def lines(self, name: str, env: dict) -> list[str]:
        env[f"{name}_size"], env[f"{name}_stride"] = self.size, self.stride
        view = f"t.as_strided({name}_size, {name}_stride, t.storage_offset() + {int(self.offset)})"
        return [f"t = s[{self.of}]", f"s[{self.slot}] = {view}"]


_VIEW_FUNCS: dict[Any, bool] = {}  # ATen overload -> whether its result is a view of its first argument


def _is_view_of_first(func, args: tuple, template: tuple, out: Any) -> bool:
    """Whether ``func``'s result ``out`` is a view of its first argument, a slot, laid out in
    that argument's dtype and memory, with no other tensor of the run among its arguments."""
    view = _VIEW_FUNCS.get(func)
    if view is None:
        schema = func._schema
        view = _VIEW_FUNCS[func] = (
            not schema.is_mutable and len(schema.returns) == 1 and schema.returns[0].alias_info is not None
        )
    if not view or not args or not isinstance(template[0][0], _Slot) or not isinstance(out, torch.Tensor):
        return False
    base = args[0]
    return (
        out.dtype == base.dtype
        and out.device == base.device
        and not _slots_in(template[0][1:])
        and not _slots_in(template[1])
        and (not out.numel() or _memory(out) == _memory(base))
    )


class _LaunchStep:
    """One kernel launch; on a GPU straight through Triton's compiled launcher."""

    made: tuple = ()
    writes = True

    def __init__(self, instance: KernelInstance, jit, grid: tuple, args: list, options: dict, compiled: Any):
        self.instance, self.jit, self.grid, self.options = instance, jit, grid, options
        self.template = args
        self.args = _filler(args)
        self.direct = direct_launcher(compiled, grid, instance.kernel.device_scratch, instance.kernel.arguments)

    def reads(self) -> set[int]:
        return _slots_in(self.template)

    def run(self, slots: list, stream: int | None) -> None:
        self.fire(self.args(slots), stream)

    def lines(self, name: str, env: dict) -> list[str]:
        env[name] = self
        template = self.template
        if not isinstance(template, list) or any(isinstance(v, (list, tuple, dict)) for v in template):
            return [f"{name}.run(s, stream)"]
        values = []
        for i, v in enumerate(template):
            if isinstance(v, _Slot):
                values.append(f"s[{v.index}]")
            else:
                env[f"{name}_{i}"] = v
                values.append(f"{name}_{i}")
        return [f"{name}.fire([{', '.join(values)}], stream)"]

    def fire(self, args: list, stream: int | None) -> None:
        if stream is None:  # launches are being recorded or intercepted: the full path
            self.instance.launch(self.grid, args, **self.options)
        elif self.direct is not None:
            try:
                self.direct(stream, args)
            except Exception as exc:
                shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
                raise launch_failed("replayed launch", self.instance, shapes, exc) from exc
        else:
            self.instance.run_jit(self.jit, self.grid, args, self.options)


def _live(steps: list, needed: set[int]) -> list:
    """``steps`` without the ATen calls whose results nothing later reads (the host-side helper
    tensors of launch building: element sizes, meta shapes); calls that write stay."""
    needed = set(needed)
    kept = []
    for step in reversed(steps):
        if step.writes or any(index in needed for _, index in step.made):
            needed |= step.reads()
            kept.append(step)
    return kept[::-1]


def _signature(t: torch.Tensor) -> tuple:
    """What a recorded run's choices may depend on in an input tensor."""
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % ALIGN)


def aliasing(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """Which inputs are one tensor and which share a storage: per input, the first input that is
    the same object and the first that shares its storage; None when all are apart (the common
    case). A run given ``(x, x)`` numbers ``x`` once, and one given a view of another input may
    decide by their shared memory (the executor's in-place gradients): its tape fits only calls
    aliased alike."""
    ids = [id(t) for t in tensors]
    storages = [_storage_of(t) for t in tensors]
    if len(set(ids)) == len(set(storages)) == len(tensors):
        return None
    first: dict[int, int] = {}
    first_storage: dict[int, int] = {}
    pairs = enumerate(zip(ids, storages))
    return tuple((first.setdefault(a, i), first_storage.setdefault(b, i)) for i, (a, b) in pairs)


def _storage_of(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of (its own number for a tensor without one: sparse)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return -id(t)


@dataclass(eq=False)  # (compared and hashed as itself: Executor keys its backward tapes by it)
class Tape:
    """The steps of one recorded run over its slots, what its inputs looked like, which
    slots it returned and which flags it checks after the launches."""

    signatures: list[tuple]
    steps: list
    n_slots: int
    outputs: list[int]
    checks: list[tuple[int, str, Callable]]
    device: torch.device

    def __post_init__(self) -> None:
        """Per step, the slots no later step reads and the caller does not get back: a replay
        lets go of them right after it, so a tensor lives as long as the run needs it (as the
        executor's own run frees it), not to the end of the replay."""
        kept = set(self.outputs) | {k for k, _, _ in self.checks}
        last: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for k in (*step.reads(), *(k for _, k in step.made)):
                last[k] = i
        frees: list[list[int]] = [[] for _ in self.steps]
        for k, i in last.items():
            if k not in kept:
                frees[i].append(k)
        self.frees = [tuple(f) for f in frees]
        self._run = _straight_line(self.steps, self.frees)

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        if len(tensors) != len(self.signatures):
            return False
        for t, (shape, stride, dtype, device, residue) in zip(tensors, self.signatures):
            if (
                type(t) not in _PLAIN
                or t.data_ptr() % ALIGN != residue
                or t.stride() != stride
                or t.shape != shape
                or t.dtype != dtype
                or t.get_device() != device
            ):
                return False
        return self.on_current_device()

    def on_current_device(self) -> bool:
        """A GPU tape launches kernels loaded on its device, on that device's current stream."""
        return self.device.type != "cuda" or torch.cuda.current_device() == self.device.index

    def replay(self, tensors: Sequence[torch.Tensor], consume: bool = False) -> list[torch.Tensor]:
        """Run the tape on ``tensors``; with ``consume`` (a list the caller hands over) it is
        emptied, so each input is freed after its last use too."""
        slots: list = [*tensors, *([None] * (self.n_slots - len(tensors)))]
        if consume:
            tensors.clear()
        if launches_watched():  # a recorder, an interceptor, a profiler's launch hooks: the full path
            stream = None
        elif self.device.type == "cuda":
            stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        else:
            stream = 0
        self._run(slots, stream)
        if self.checks:
            raise_failed_checks([(slots[k], where, describe) for k, where, describe in self.checks])
        return [slots[k] for k in self.outputs]

    def replay_captured(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple]]:
        """A replay on a GPU while a CUDA graph captures it (``teeny.torch.graphed``): its outputs,
        and its flags in ``raise_failed_checks``' form, to be read after each of the graph's replays."""
        slots: list = [*tensors, *([None] * (self.n_slots - len(tensors)))]
        self._run(slots, torch._C._cuda_getCurrentRawStream(self.device.index))
        return [slots[k] for k in self.outputs], [(slots[k], where, describe) for k, where, describe in self.checks]


def _straight_line(steps: list, frees: list[tuple[int, ...]]) -> Callable[[list, int | None], None]:
    """``run(slots, stream)``: the steps written out as one Python function, in order, each
    step's objects bound by name and the slots it was the last to read set to None after it:
    a replay walks no list of steps and makes no call per step beyond the step's own."""
    env: dict[str, Any] = {}
    body = []
    for i, (step, done) in enumerate(zip(steps, frees)):
        body.extend(step.lines(f"step{i}", env))
        if done:
            body.append(" = ".join(f"s[{k}]" for k in done) + " = None")
    source = "def run(s, stream):\n" + "".join(f"    {line}\n" for line in body or ["pass"])
    exec(compile(source, "<teeny tape>", "exec"), env)
    return env["run"]


_ALIASES = (_aten.detach.default, _aten.alias.default)


class _Recording(TorchDispatchMode):
    """Records the ATen calls and the launches of one run (see the module docstring)."""

    def __init__(self, inputs: Sequence[torch.Tensor], own: frozenset[int] = frozenset()):
        super().__init__()
        self.own = own  # memory whose tensors are the same every run (an executor's arenas): constants
        self.slots: dict[int, int] = {}  # id of a live tensor -> its slot; a tensor's id leaves as it dies
        self.storages: Counter = Counter()  # the memory of the live tensors the run was given or made
        for i, t in enumerate(inputs):  # a tensor given twice is its first slot; the later ones go unread
            if id(t) not in self.slots:
                self._name(t, i)  # (a run may free an input it was handed: its id leaves too)
        self.n_slots = len(inputs)
        self.device = next((t.device for t in inputs if t.is_cuda), torch.device("cpu"))
        self.steps: list = []
        self.failure: str | None = None
        self.thread = threading.get_ident()  # launches from other threads are theirs, not recorded

    def _new_slot(self, t: torch.Tensor) -> int:
        index = self.n_slots
        self.n_slots += 1
        self._name(t, index)
        if t.is_cuda:
            self.device = t.device
        return index

    def _name(self, t: torch.Tensor, index: int) -> None:
        """``t`` is slot ``index`` while it lives: the run frees what it is done with, as the
        executor does, and a later tensor given the same id (or memory) is a new one."""
        key, memory = id(t), _memory(t)
        self.slots[key] = index
        if memory is not None:
            self.storages[memory] += 1
        weakref.finalize(t, self._forget, key, index, memory)

    def _forget(self, key: int, index: int, memory: int | None) -> None:
        if self.slots.get(key) == index:
            del self.slots[key]
        if memory is not None:
            self.storages[memory] -= 1
            if self.storages[memory] <= 0:
                del self.storages[memory]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failure is not None:
            return out
        tensors = _tensors(out)
        if tensors is None:
            self.failure = f"{func} handed a value to the host ({type(out).__name__})"
            return out
        if func in _ALIASES and id(args[0]) in self.slots:  # the same data, no autograd history: the same slot
            self._name(out, self.slots[id(args[0])])
            return out
        template = (self._template(list(args)), self._template(kwargs))
        made = [(position, self._new_slot(t)) for position, t in enumerate(tensors) if id(t) not in self.slots]
        if len(made) == 1 == len(tensors) and _is_view_of_first(func, args, template, out):
            base = args[0]
            offset = out.storage_offset() - base.storage_offset()
            self.steps.append(_ViewStep(template[0][0].index, out.size(), out.stride(), offset, made[0][1]))
        else:
            self.steps.append(_AtenStep(func, *template, made, isinstance(out, torch.Tensor)))
        return out

    def launch(self, instance: KernelInstance, jit, grid: tuple, args: list, options: dict) -> None:
        if threading.get_ident() != self.thread:
            instance.run_jit(jit, grid, args, options)
            return
        with _disable_current_modes():  # the launch itself (the interpreter's ATen calls) is not recorded
            compiled = instance.run_jit(jit, grid, args, options)
        if self.failure is None:
            self.steps.append(_LaunchStep(instance, jit, grid, self._template(args), options, compiled))

    def _template(self, value: Any) -> Any:
        """``_template`` of an argument; a tensor the run did not make (through ATen) is kept as
        a constant, unless it shares memory with one the run did make or was given: a view made
        without ATen (``.data``, ``from_numpy``) would then be frozen to this run's memory."""
        unknown: list = []
        template = _template(value, self.slots, unknown)
        for t in unknown:
            if _memory(t) is not None and _memory(t) in self.storages and _memory(t) not in self.own:
                self.failure = "a tensor made outside ATen shares memory with one of the run's"
        return template


def _memory(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory (None: it has none: empty, or a meta tensor)."""
    return t.untyped_storage().data_ptr() if t.numel() and t.device.type != "meta" else None


def record(
    fn: Callable[[list], list[torch.Tensor]],
    tensors: Sequence[torch.Tensor],
    consume: bool = False,
    own: frozenset[int] = frozenset(),
):
    """``(fn(tensors), tape)``: ``fn`` run once with its device work recorded; ``tape`` is a
    ``Tape`` replaying it, or the reason (a string) why the run cannot be replayed. With
    ``consume`` (a list the caller hands over) ``fn`` gets ``tensors``' items as the only list
    holding them, and may let go of each (``_handed``). ``own``: the memory (``_memory``) of
    tensors that ``fn`` reads as the same tensors every run (an executor's parameters)."""
    signatures = [_signature(t) for t in tensors]
    recording = _Recording(tensors, own)
    checks: list = []
    _CHECK_SINKS[recording.thread] = checks
    try:
        with intercept_launches(recording.launch), recording:
            result = fn(_handed(tensors, consume))
    finally:
        del _CHECK_SINKS[recording.thread]
    raise_failed_checks(checks)  # the recorded run's own flags, now that its kernels have run
    tape: Tape | str
    outputs = [recording.slots.get(id(t)) for t in result]
    flags = [recording.slots.get(id(flag)) for flag, _, _ in checks]
    if recording.failure is not None:
        tape = recording.failure
    elif any(k is None for k in outputs):
        tape = "an output is not a tensor the run made or was given"
    elif any(k is None for k in flags):
        tape = "a checked flag is not a tensor the run made"
    else:
        tape = Tape(
            signatures=signatures,
            steps=_live(recording.steps, {*outputs, *flags}),
            n_slots=recording.n_slots,
            outputs=outputs,
            checks=[(k, where, describe) for k, (_, where, describe) in zip(flags, checks)],
            device=recording.device,  # the device the launches run on (a GPU program may take CPU index tensors)
        )
    return result, tape


class Replayed:
    """``fn(tensors) -> list[Tensor]``, recorded on its first call and replayed after (see the
    module docstring). ``blocked`` names why ``fn`` may never be replayed (None: it may). Each
    aliasing pattern of the inputs (``aliasing``) has its own tape, recorded on its first call:
    a tape recorded on ``(x, x)`` is never replayed on ``(a, b)``, nor one of ``(a, b)`` on ``(x, x)``."""

    def __init__(
        self, fn: Callable[[list], list[torch.Tensor]], blocked: str | None = None, own: frozenset[int] = frozenset()
    ):
        self.fn = fn
        self.own = own  # the memory of the tensors fn reads as the same every run (record)
        self.tapes: dict[tuple | None, Tape] = {}  # by aliasing pattern
        self.not_recorded: str | None = blocked
        self.replays = 0  # how many calls a tape answered (tests and benches read it)
        self.answered: Tape | None = None  # the tape that answered the last call (__call__)

    @property
    def tape(self) -> Tape | None:
        """The tape of inputs that are all apart, else the first recorded (None: none yet)."""
        return self.tapes.get(None) or next(iter(self.tapes.values()), None)

    def __call__(self, tensors: Sequence[torch.Tensor], consume: bool = False) -> list[torch.Tensor]:
        """``fn(tensors)``, replayed where a tape fits; ``consume``: ``tensors`` is a list handed
        over, which a replay empties (``Tape.replay``). ``answered``: the tape that replayed or
        recorded the call (None: ``fn`` ran as it is)."""
        self.answered = None
        if not config.replay or not _recordable_now():
            return self.fn(_handed(tensors, consume))
        pattern = aliasing(tensors)
        tape = self.tapes.get(pattern)
        if tape is not None:
            if tape.fits(tensors):  # (plain tensors only)
                self.answered = tape
                return self.replay_tape(pattern, tape, tensors, consume)
            return self.fn(_handed(tensors, consume))
        if self.not_recorded is not None or len(self.tapes) >= MAX_PATTERNS:
            return self.fn(_handed(tensors, consume))
        if any(type(t) not in _PLAIN for t in tensors):  # a subclass, a fake tensor: never recorded
            return self.fn(_handed(tensors, consume))
        result, recorded = record(self.fn, tensors, consume, self.own)
        if isinstance(recorded, str):
            self.not_recorded = recorded
        else:
            self.tapes[pattern] = self.answered = recorded
        return result

    def call_laid_out_as(self, tape: Tape, tensors: list[torch.Tensor], consume: bool = False) -> list[torch.Tensor]:
        """A call whose tensors the caller knows are laid out and aliased as those of an earlier
        call that ``tape`` answered (an executor's cache made by one forward tape, with seeds of
        its own): replayed without checking them, where a replay may run now."""
        pattern = next((p for p, t in self.tapes.items() if t is tape), ())
        if pattern == () or not config.replay or not _recordable_now() or not tape.on_current_device():
            return self(tensors, consume)
        self.answered = tape
        return self.replay_tape(pattern, tape, tensors, consume)

    def replay_tape(self, pattern: tuple | None, tape: Tape, tensors: Sequence[torch.Tensor], consume: bool):
        """A call the tape of ``pattern`` fits (``teeny.torch.graphed`` replays it as a CUDA graph)."""
        self.replays += 1
        return tape.replay(tensors, consume)


def _handed(tensors: Sequence[torch.Tensor], consume: bool) -> list[torch.Tensor]:
    """The list ``fn`` is called with: a copy of ``tensors``, or with ``consume`` its items in a
    new list, ``tensors`` emptied, so that ``fn`` may free each by emptying the list."""
    given = list(tensors)
    if consume:
        tensors.clear()
    return given


def _recordable_now() -> bool:
    """No dispatch mode, no other launch interceptor (their view of the run must be the full one)."""
    return torch._C._len_torch_dispatch_stack() == 0 and not _INTERCEPTORS


def not_capturable(program) -> str | None:
    """Why none of a program's runs may be replayed (None: they may): ops that take host state
    that changes per run (dropout's seed)."""
    blockers = [p.node.name for p in program.nodes if not p.op.capturable]
    return f"nodes {', '.join(blockers)} take host state that changes per run" if blockers else None


def check_replayable(program) -> str | None:
    """Why a ``teeny.torch`` call of a program may not be replayed, or None (see the module
    docstring); the executor replays its own runs, parameters and all (``Executor.backward``)."""
    if any(v.kind == "param" for v in program.graph.values):
        return not_capturable(program) or "the program has parameters of its own"
    return not_capturable(program)
