"""``NodeReplay``: a node's launches built and checked once, then fired again with each run's tensors.

For one program every run of a node builds the same launches: shapes, dtypes, kernels, grids
and scalar arguments are fixed at lowering; only the tensors differ. A ``NodeReplay`` runs one
phase of one node (its forward, recompute or backward) the full way once (``OpContext``, the
op's launch list, the packing checks) and records each checked launch with its arguments as a
template over that run's tensors. Each tensor of a template is one of

* the node's *roles*: the tensors the executor hands the context (inputs and parameters,
  output, extra outputs; in backward also ``grad_output``, the gradient buffers and the addend),
* a buffer the op made while building its launches (``ctx.empty`` / ``ctx.zeros``), made again
  at each replay,
* or a view of one of those, made again with ``as_strided`` (a view that starts where its root
  does, read by a kernel as a pointer only, is passed as the root: the same address and dtype).

What the executor reads back (the gradients an op may have replaced by views, the flags of
``OpContext.check_after``) is templated the same way, and so are the tensors that building the
launches zeroed in place (``zero_()``: an embedding's gradient before its atomic adds), zeroed
again before the replay's launches as they were before the recorded run's.

A later run whose roles are laid out as the recorded run's were (``layout``: which are ``None``,
which share memory and at what offset, their strides and 16-byte alignment) fires the recorded
launches with its own tensors. On a GPU each goes straight through Triton's C launcher
(``kernel.direct_launcher`` of the kernel Triton compiled for the recorded launch, on the stream
current at the replay), skipping Triton's argument binding, specialisation and cache lookup. That
is valid because the launch specialises as the recorded one did: its scalars are the recorded
ones, and its tensors have the recorded dtypes and 16-byte alignment (the layout's for the roles,
the allocator's for the buffers, the recorded offsets from those for the views). Elsewhere (the
interpreter), while something watches every launch (``kernel.launches_watched``: a recorder, an
interceptor, a profiler's launch hooks) and while another device is current, the launches go
through ``runtime.fire`` as every launch does.

A run is not recorded, and that layout keeps the full path (``not_recorded`` says why), when the
op is not ``capturable`` (its launches take host state that changes per run), when building the
launches did anything on the device but make buffers and views and zero tensors (another in-place
write, a copy, a sort, a value read to the host: a replay would skip it), or when a launch reads a
tensor of none of the kinds above (one the op keeps itself). ``teeny.core.config.replay = False``
makes every run take the full path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core import config
from ..core.kernel import _INTERCEPTORS, direct_launcher, intercept_launches, launches_watched
from ..core.runtime import ARENA_ALIGN, CheckedLaunch, OpContext, RuntimeOp, fire, launch_failed

MAX_LAYOUTS = 4  # recordings kept per node phase; a run laid out otherwise takes the full path
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors as they are (no subclass, no fake tensor)
_aten = torch.ops.aten
_ZEROS = _aten.zeros.default
_ZERO_ = _aten.zero_.default
_FACTORIES = (_aten.empty.memory_format, _aten.empty_strided.default, _ZEROS)


def storage_id(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of: the same for every view of one storage, on meta tensors
    too (whose addresses are all 0), so that a program captured on meta (``teeny.aot``) takes
    the decisions it takes on the GPU."""
    return t.untyped_storage()._cdata


def layout(
    roles: Sequence[torch.Tensor | None], fresh: int = 0, fixed: int = 0, storages: dict | None = None
) -> tuple | None:
    """What a recording depends on besides the program: per role ``None``, or its strides, its
    address modulo 16 and, if an earlier role shares its memory, that role and the offset between
    them. The roles that bit ``i`` of ``fresh`` marks were allocated by the executor (contiguous,
    aligned as the allocator aligns; another role in their memory is a view the program makes of
    them, the same every run), so their shape implies their layout: only whether a later role is
    the same tensor is noted. Those that bit ``i`` of ``fixed`` marks are the executor's own, the
    same tensor at that place every run (a parameter, a constant, a view of the gradient arena):
    only whether a role not fixed shares their memory is noted, and ``storages`` keeps their
    storage by place. ``None`` when a role is not a plain tensor (a subclass, a fake tensor)."""
    first: dict[int, tuple[int, torch.Tensor, bool]] = {}  # storage -> (first role in it, that role, fixed)
    allocated: dict[int, int] = {}  # id -> the fresh role that tensor is
    key: list = [fresh, fixed]
    for i, t in enumerate(roles):
        if t is None:
            key.append(None)
        elif fresh >> i & 1:
            allocated.setdefault(id(t), i)
            key.append(None)
        elif fixed >> i & 1:
            known = storages.get(i)
            if known is None or known[0] is not t:
                known = storages[i] = (t, t.untyped_storage()._cdata)
            shared = first.get(known[1])
            if shared is None:
                first[known[1]] = (i, t, True)
                key.append(None)
            else:  # (two fixed roles always share it alike)
                key.append(None if shared[2] else (shared[0], t.storage_offset() - shared[1].storage_offset()))
        elif allocated and id(t) in allocated:
            key.append(allocated[id(t)])
        elif type(t) not in _PLAIN:
            return None
        else:
            storage = t.untyped_storage()._cdata
            shared = first.get(storage)
            if shared is None:
                first[storage] = (i, t, False)
                key.append((t.stride(), t.data_ptr() % ARENA_ALIGN))
            else:
                offset = t.storage_offset() - shared[1].storage_offset()
                key.append((t.stride(), t.data_ptr() % ARENA_ALIGN, shared[0], offset))
    return tuple(key)


def _is_view(func: Any) -> bool:
    schema = func._schema
    return not schema.is_mutable and bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


class _Observer(TorchDispatchMode):
    """Watches the ATen calls of a node's launch building: the buffers it makes, the tensors it
    zeroes, and the first call that does anything else than make a buffer or a view (which a
    replay would skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.Tensor, bool]] = []  # (buffer, zeroed)
        self.zeroed: list[torch.Tensor] = []  # zeroed in place (zero_)
        self.refused: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES:
            self.made.append((out, func is _ZEROS))
        elif func is _ZERO_:
            self.zeroed.append(args[0])
        elif self.refused is None and not _is_view(func):
            self.refused = f"building its launches calls {func} (a replay would skip it)"
        return out


class _Untemplatable(Exception):
    """A tensor of the recorded run that is neither a role, a buffer the op made, nor a view of one."""


@dataclass(frozen=True)
class _Recording:
    """One phase of one node for one layout of its roles. Tensors are numbered: the roles, then
    the ``buffers`` made again per run, then the ``views`` of those; ``zeroed`` are zeroed in
    place before the launches, as building them did in the recorded run; each launch is its
    ``CheckedLaunch``, its argument values with ``None`` for tensors, (position, tensor number)
    for each tensor, and its direct launcher. ``device``: the GPU current when the run was
    recorded, whose compiled kernels the direct launchers launch (None: the launches have none:
    the interpreter, launch hooks set when it was recorded)."""

    buffers: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool], ...]
    views: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]  # (of tensor, size, stride, offset)
    zeroed: tuple[int, ...]
    launches: tuple[tuple[CheckedLaunch, list, tuple[tuple[int, int], ...], Callable[[int, list], None] | None], ...]
    device: int | None
    produced: tuple[int | None, ...]  # the gradients the executor reads back (None: none)
    checks: tuple[tuple[int, str, Callable], ...]  # (flag, where, describe) of check_after

    def replay(self, roles: Sequence[torch.Tensor | None], checks: list | None) -> list:
        tensors = list(roles)
        for size, stride, dtype, device, zeroed in self.buffers:
            buffer = torch.empty_strided(size, stride, dtype=dtype, device=device)
            tensors.append(buffer.zero_() if zeroed else buffer)
        for of, size, stride, offset in self.views:
            t = tensors[of]
            tensors.append(t.as_strided(size, stride, t.storage_offset() + offset))
        for k in self.zeroed:
            tensors[k].zero_()
        stream = self._stream()
        for checked, constants, slots, direct in self.launches:
            values = constants.copy()
            for position, k in slots:
                values[position] = tensors[k]
            if stream is None:
                fire(checked, values)
                continue
            try:
                direct(stream, values)
            except Exception as exc:
                raise launch_failed(checked.where, checked.instance, checked.input_shapes, exc) from exc
        if checks is not None:
            checks.extend((tensors[k], where, describe) for k, where, describe in self.checks)
        return [None if k is None else tensors[k] for k in self.produced]

    def _stream(self) -> int | None:
        """The handle of the stream the direct launches go on now (the current one, read at each
        replay as Triton reads it), or None: take the full path."""
        if self.device is None or launches_watched() or torch._C._cuda_getDevice() != self.device:
            return None  # (the compiled kernels were loaded on the recording's device)
        return torch._C._cuda_getCurrentRawStream(self.device)  # (torch.cuda's, without its checks)


class _Templater:
    """Numbers the tensors of a recorded run (see ``_Recording``)."""

    def __init__(self, roles: Sequence[torch.Tensor | None], made: list[tuple[torch.Tensor, bool]]):
        self.roots = [*roles, *(t for t, _ in made)]
        self.zeroed = [False] * len(roles) + [z for _, z in made]
        self.number = {}  # id(tensor) -> its number
        self.storage = {}  # storage -> the first root in it
        for k, t in enumerate(self.roots):
            if isinstance(t, torch.Tensor):
                self.number.setdefault(id(t), k)
                self.storage.setdefault(storage_id(t), k)
        self.n_roles = len(roles)
        self.used_buffers: dict[int, int] = {}  # root number -> its number in the recording
        self.views: dict[tuple, int] = {}  # (of root, size, stride, offset) -> its number among the views

    def __call__(self, t: torch.Tensor, pointer: bool = False) -> int:
        """``t``'s number; for a ``pointer`` (all a kernel reads of it is its address and dtype)
        a view that starts where its root does is the root itself."""
        k = self.number.get(id(t))
        if k is None:
            root = self.storage.get(storage_id(t))
            if root is None or self.roots[root].dtype != t.dtype:
                raise _Untemplatable(
                    f"a launch reads a {tuple(t.shape)} {t.dtype} tensor that is not the node's, "
                    "nor a buffer or a view it made"
                )
            of = self._root(root)
            offset = t.storage_offset() - self.roots[root].storage_offset()
            if pointer and offset == 0:
                return of
            k = self.views.setdefault((of, tuple(t.shape), t.stride(), offset), len(self.views))
            return -1 - k  # a view: numbered after the buffers, once their count is known
        return self._root(k)

    def _root(self, k: int) -> int:
        if k < self.n_roles:
            return k
        return self.n_roles + self.used_buffers.setdefault(k, len(self.used_buffers))

    def recording(self, zeroed, launches, produced, checks, direct, device) -> _Recording:
        first_view = self.n_roles + len(self.used_buffers)

        def final(k: int) -> int:
            return k if k >= 0 else first_view - 1 - k

        buffers = []
        for root in self.used_buffers:  # in numbering order (dicts keep insertion order)
            t = self.roots[root]
            buffers.append((tuple(t.shape), t.stride(), t.dtype, t.device, self.zeroed[root]))
        views = tuple((final(of), size, stride, offset) for of, size, stride, offset in self.views)
        return _Recording(
            buffers=tuple(buffers),
            views=views,
            zeroed=tuple(map(final, zeroed)),
            launches=tuple(
                (checked, constants, tuple((position, final(k)) for position, k in slots), launcher)
                for (checked, constants, slots), launcher in zip(launches, direct or [None] * len(launches))
            ),
            device=device,
            produced=tuple(None if k is None else final(k) for k in produced),
            checks=tuple((final(k), where, describe) for k, where, describe in checks),
        )


def _record(
    roles: Sequence[torch.Tensor | None],
    observer: _Observer,
    checked: list[tuple[CheckedLaunch, list]],
    produced: list,
    checks: list,
    compiled: list,
) -> _Recording:
    """The recording of a run (``_Untemplatable`` when a tensor cannot be templated);
    ``compiled``: what Triton compiled for each launch (``_compiled_into``)."""
    number = _Templater(roles, observer.made)
    zeroed = [number(t) for t in observer.zeroed]
    launches = []
    for launch, values in checked:
        kernel = launch.instance.kernel
        pointers = [p.kind == "ptr" and kernel.arguments is None for p in kernel.params]  # no host-side use
        constants = [None if isinstance(v, torch.Tensor) else v for v in values]
        slots = tuple((i, number(v, pointers[i])) for i, v in enumerate(values) if isinstance(v, torch.Tensor))
        launches.append((launch, constants, slots))
    # no direct launches for a run on meta tensors (teeny.aot's verification, under an emulated
    # driver on a machine that may have no CUDA): their launches only ever take the full path
    on_meta = any(t is not None and t.is_meta for t in roles)
    direct = None if on_meta else _direct_launchers(checked, compiled)
    return number.recording(
        zeroed,
        launches,
        [None if g is None else number(g) for g in produced],
        [(number(flag), where, describe) for flag, where, describe in checks],
        direct,
        None if direct is None else torch.cuda.current_device(),
    )


def _direct_launchers(checked: list[tuple[CheckedLaunch, list]], compiled: list) -> tuple | None:
    """Each launch's ``direct_launcher``, or None unless every launch has one: the recorded run
    fired each checked launch once, in order, each compiling (or finding) ``compiled``'s kernel."""
    if not checked or len(compiled) != len(checked):  # none, or another interceptor took them
        return None
    direct = []
    for (launch, _), (instance, grid, kernel) in zip(checked, compiled):
        if instance is not launch.instance or grid != launch.grid:
            return None
        k = instance.kernel
        direct.append(direct_launcher(kernel, grid, k.device_scratch, k.arguments))
    return None if None in direct else tuple(direct)


@contextlib.contextmanager
def _compiled_into(compiled: list) -> Iterator[None]:
    """Inside the ``with`` block each launch of this thread runs as it would, and what Triton
    returns for it (the compiled kernel on a GPU) is added to ``compiled`` as (instance, grid,
    kernel). Nothing is added under another interceptor, whose view of the launches is its own."""
    if _INTERCEPTORS:
        yield
        return
    thread = threading.get_ident()

    def run(instance, jit, grid, args, options) -> None:
        kernel = instance.run_jit(jit, grid, args, options)
        if threading.get_ident() == thread:
            compiled.append((instance, grid, kernel))

    with intercept_launches(run):
        yield


class NodeReplay:
    """The recorded launches of one phase of one node's op: one recording per layout of its
    roles (at most ``MAX_LAYOUTS``), and why a layout was not recorded (``not_recorded``)."""

    def __init__(self, op: RuntimeOp):
        self.op = op
        self.recordings: dict[tuple, _Recording] = {}
        self.not_recorded: dict[tuple, str] = {}
        self.storages: dict[int, tuple[torch.Tensor, int]] = {}  # the fixed roles' storages (layout)

    def run(
        self,
        roles: Sequence[torch.Tensor | None],
        context: Callable[[], OpContext],
        checks: list | None = None,
        fresh: int = 0,
        fixed: int = 0,
    ) -> list:
        """Run the phase on ``roles`` (the tensors ``context()`` hands its ``OpContext``, in a
        fixed order; bit ``i`` of ``fresh`` set where role ``i`` was just allocated, of ``fixed``
        where it is the executor's own tensor for that place, see ``layout``); the flags
        ``check_after`` asks for are added to ``checks``. Returns the context's gradients after
        the run (``grad_inputs + grad_params``; empty in forward)."""
        key = layout(roles, fresh, fixed, self.storages) if config.replay else None
        recording = self.recordings.get(key)
        if recording is not None:
            return recording.replay(roles, checks)
        if key is None or key in self.not_recorded:
            ctx = context()
            ctx.run(ctx.build_launches())
            return [*ctx.grad_inputs, *ctx.grad_params]
        return self._run_recorded(key, roles, context, checks)

    def _run_recorded(self, key: tuple, roles, context: Callable[[], OpContext], checks: list | None) -> list:
        """The full path, watched: recorded for ``key`` when it can be replayed."""
        first_check = len(checks) if checks is not None else 0
        observer = _Observer()
        with observer:  # not around the launches themselves: the interpreter's call torch
            ctx = context()
            launches = ctx.build_launches()
        compiled: list = []
        with _compiled_into(compiled):
            checked = ctx.run(launches)
        produced = [*ctx.grad_inputs, *ctx.grad_params]
        reason = observer.refused
        if not self.op.capturable:
            reason = "the op is not capturable (its launches take host state that changes per run)"
        elif len(self.recordings) >= MAX_LAYOUTS:
            reason = f"{MAX_LAYOUTS} layouts of its tensors were recorded already"
        if reason is None:
            try:
                self.recordings[key] = _record(
                    roles, observer, checked, produced, checks[first_check:] if checks else [], compiled
                )
            except _Untemplatable as exc:
                reason = str(exc)
        if reason is not None:
            self.not_recorded[key] = reason
        return produced
