"""The router: while a patched model's forward runs, the functional calls its code makes
(``teeny.torch.nn.functional.ROUTED``: ``F.scaled_dot_product_attention``, ``F.cross_entropy``,
...) go to teeny, through a ``TorchFunctionMode``; a call teeny cannot run goes to PyTorch and is
counted in the report's ``fallbacks``.

Every torch call made under the router passes through its Python handler (a few microseconds
each). A transformer block whose attention teeny serves through transformers' own interface
(``attention.routes_calls``) needs no router: it runs with the router off, and ``running()``
says which patched model runs (the rotary dispatcher reads it)."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from ..nn import functional as TF
from .classes import base_forward, swap
from .report import PatchReport


class Router(TorchFunctionMode):
    """Routes the functional calls of ``teeny.torch.nn.functional.ROUTED`` to teeny."""

    passes_teeny_ops = True  # teeny's operators run unchanged under it (``library.direct`` may skip it)

    def __init__(self, report: PatchReport):
        super().__init__()
        self.report = report
        self.paused = 0  # > 0 while a module patch leaves to PyTorch runs (``runs_unrouted``)

    @staticmethod
    def active() -> Router | None:
        """The router that is on (in eager mode: the function modes' stack is not traced), or None."""
        for i in range(torch._C._len_torch_function_stack()):
            mode = torch._C._get_function_stack_at(i)
            if isinstance(mode, Router):
                return mode
        return None

    @staticmethod
    def is_on() -> bool:
        return Router.active() is not None

    def count(self, name: str) -> None:
        """Count a call routed to teeny (eager calls only)."""
        if not torch.compiler.is_compiling():
            self.report.routed[name] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = None if self.paused else TF.ROUTED.get(func)
        if route is not None:
            name = getattr(func, "__name__", str(func))
            try:
                out = route(*args, **kwargs)
            except TF.Unsupported as exc:
                if not torch.compiler.is_compiling():
                    self.report.fallbacks[(name, str(exc))] += 1
            else:
                self.count(name)
                return out
        return func(*args, **kwargs)


class _Running(threading.local):
    report: PatchReport | None = None  # the report of the patched block running in this thread


_RUNNING = _Running()


def running() -> PatchReport | None:
    """The report of the patched model running in this thread (eager mode): its router's, or
    that of a block running without the router; None outside any."""
    if _RUNNING.report is not None:
        return _RUNNING.report
    router = Router.active()
    return router.report if router is not None else None


@contextlib.contextmanager
def block_running(report: PatchReport):
    """``running()`` says ``report`` inside the ``with`` block (a block that runs without the router)."""
    outer, _RUNNING.report = _RUNNING.report, report
    try:
        yield
    finally:
        _RUNNING.report = outer


@contextlib.contextmanager
def unrouted(router: Router | None = None):
    """The router off for the ``with`` block (``router``: the active one, when the caller has
    looked it up already): stepped off the function-mode stack when it is on top (the common
    case), so torch calls skip its handler altogether; under another mode it stays and lets every
    call through to PyTorch (``paused``)."""
    if router is None:
        router = None if torch.compiler.is_compiling() else Router.active()
    if router is None:
        yield
        return
    depth = torch._C._len_torch_function_stack()
    if torch._C._get_function_stack_at(depth - 1) is router:
        torch._C._pop_torch_function_stack()
        try:
            yield
        finally:
            torch._C._push_on_torch_function_stack(router)
        return
    router.paused += 1
    try:
        yield
    finally:
        router.paused -= 1


@swap("routed")
def _routed_forward(self, *args, **kwargs):
    """The patched model's forward: its own, with teeny's router on (unless one is on already,
    in eager mode: a model patched inside another; torch.compile traces it entering)."""
    forward = base_forward(self, "routed")
    if not torch.compiler.is_compiling() and Router.is_on():
        return forward(self, *args, **kwargs)
    with Router(self._teeny_report):
        return forward(self, *args, **kwargs)


@swap("unrouted")
def _unrouted_forward(self, *args, **kwargs):
    """The forward of a module patch leaves to its own code (a PEFT adapter layer): its functional
    calls go to PyTorch, not to teeny (its ``F.linear`` calls of rank-r products would each cost a
    teeny call's host time), while the model around it stays routed; the router is off meanwhile
    (``unrouted``: a LoRA layer makes about ten calls, 1,100 a step of a checkpointed Llama with
    LoRA on its seven projections, that then skip the router's handler)."""
    forward = base_forward(self, "unrouted")
    router = None if torch.compiler.is_compiling() else Router.active()  # (the stack is not traced)
    if router is None:
        return forward(self, *args, **kwargs)
    with unrouted(router):
        return forward(self, *args, **kwargs)
