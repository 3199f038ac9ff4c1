"""Kernels for torch's random ops: compile_rng's stream inside a step, torch's own outside.

Inside compile_rng's eager stream (a ``compile_rng.step``, a ``compile_rng.compile``d
call, :func:`~compile_rng.eager.dispatch_modes.eager_stream`) every aten random op on a
plain tensor must draw compile_rng's values, and every other op must run as in stock
torch, at its speed. A dispatch mode sees every op (a Python call each: +2.6 us per op
on a Zen 4 core, before any work); instead each random overload (the
``nondeterministic_seeded`` tag) gets a kernel in C++ (:mod:`compile_rng.eager.native_kernels`)
at a dispatch key that only a stream's thread state includes: outside every stream no
dispatch reaches it, and every random op runs torch's kernels exactly as stock torch. In a
stream that kernel calls the Python kernel here (:func:`kernel`, registered at a dispatch
key no dispatch reaches), which calls the *handler* of the stream the thread is in, over
torch's kernels below the key (read at each call, so a backend registered at any time is
served). Every other op passes the key by a fallthrough. (Where no C++ compiler is found,
the Python kernels sit at the backend keys themselves: every random op then enters Python
once a stream has run.)

Why those keys: they sit below autograd, where a dispatch mode sits, so autograd records
torch's own backward (dropout's mask multiply) around compile_rng's values, and in-place
ops get torch's version counting. Tracing (FakeTensor, Dynamo, export) runs the Meta
kernels, which stay torch's. CompositeImplicitAutograd ops (``dropout``, SDPA, ``lstm``)
are left alone: they decompose, above autograd, into the ops served here.

The handler lives in the thread's state with the included key, which the autograd engine
hands its device threads: a CUDA backward's recomputation (activation checkpointing) draws
from the stream as its forward did, with a copy of the caller's context variables (the
step's rows and names, which a device thread does not have). The kernels are served
from the first stream (``compile_rng.installation`` makes the change, through
:func:`set_installer`) until ``compile_rng.uninstall()``, which leaves those at the
stream's key registered, with no handler, for the next stream; the installer also hands
over the switch of the key (:func:`set_key_switch`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from compile_rng._torch.core_internals import OpOverload, backend_key, set_thread_object, thread_object
from compile_rng._torch.dynamo_internals import disable_dynamo, never_traced

#: ``handler(op, args, kwargs, stock)``: what a stream does with random op ``op``
#: (``stock(*args, **kwargs)`` runs torch's kernel).
Handler = Callable[[OpOverload, tuple, dict, Callable[..., Any]], Any]

_THREAD_KEY = "compile_rng_random_op_handler"
_installer: Callable[[], AbstractContextManager[None]] | None = None
# includes the C++ kernels' dispatch key in this thread's state, or takes it out (None: the
# Python kernels sit at the backend keys)
_key_switch: Callable[[bool], bool] | None = None


@dataclass(frozen=True)
class _Drawing:
    """What the thread state holds inside a stream: the handler, the thread that entered
    the stream (None: a recomputation's, whose draws run in ``context`` on every thread) and
    its context variables (the step's rows, names, batch dim). A backward's device thread
    (the engine hands it the caller's thread state) has none of the caller's context
    variables: the handler runs there in a copy of these."""

    handler: Handler
    thread: int | None
    context: contextvars.Context
    stream: bool = True  # False: a guard (a layout block's), which is no stream


_open_lock = threading.Lock()
_open = [0]  # streams open in this process, on any thread (uninstall() refuses inside one)


def set_installer(installer: Callable[[], AbstractContextManager[None]]) -> None:
    """Set what a stream enters to have the kernels registered (``compile_rng.installation``'s:
    registered until ``uninstall()``; uninstalled, for the stream's length)."""
    global _installer
    _installer = installer


def set_key_switch(switch: Callable[[bool], bool] | None) -> None:
    """Set what includes the C++ kernels' dispatch key in a thread's state (returning the
    previous setting), or None where the Python kernels sit at the backend keys."""
    global _key_switch
    _key_switch = switch


def kernel(op: OpOverload, stocks: dict[Any, Any] | None) -> Callable[..., Any]:
    """The Python kernel for ``op``, to be registered ``with_keyset``: the stream's handler,
    over torch's kernel for the call. ``stocks`` (backend key -> torch's kernel,
    ``torch.library.get_kernel`` results read before any registration) where the kernel sits
    at the backend keys; None under the C++ kernels, which call it with the keys below
    theirs: the op is redispatched to those."""

    def random_op_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if stocks is None:
            stock = functools.partial(op.redispatch, keyset)
        else:
            stock = functools.partial(stocks[backend_key(keyset)].call_boxed, keyset)
        drawing = thread_object(_THREAD_KEY)
        if drawing is None:
            return stock(*args, **kwargs)
        return _handled(drawing, op, args, kwargs, stock)

    # Dynamo's frame hook would compile the kernel's frame where a compiled function's
    # eager code (between graphs) calls a random op: the kernel's own frame is never
    # traced (every kernel shares this code), and the handler runs with Dynamo off.
    _never_traced_once(random_op_kernel.__code__)
    return random_op_kernel


@functools.cache
def _never_traced_once(code: Any) -> None:
    never_traced(code)


@disable_dynamo
def _handled(drawing: _Drawing, op: OpOverload, args: tuple, kwargs: dict, stock: Callable[..., Any]) -> Any:
    if drawing.thread == threading.get_ident():
        return drawing.handler(op, args, kwargs, stock)
    return drawing.context.copy().run(drawing.handler, op, args, kwargs, stock)


def active() -> Handler | None:
    """The handler of the stream random ops on this thread draw from, if any."""
    drawing = thread_object(_THREAD_KEY)
    return drawing.handler if drawing is not None and drawing.stream else None


@contextlib.contextmanager
def guarded(guard: Handler) -> Iterator[None]:
    """Outside every stream, random ops in the block go to ``guard`` (which runs
    ``stock`` for what it lets through); inside a stream the stream's handler stays."""
    if thread_object(_THREAD_KEY) is not None:
        yield
        return
    if _installer is None:
        raise RuntimeError("compile_rng internal error: the random ops' kernels were never offered")
    with _installer():
        _hold(_Drawing(guard, threading.get_ident(), contextvars.copy_context(), stream=False))
        try:
            yield
        finally:
            _hold(None)


def stream_here() -> tuple[Handler, contextvars.Context] | None:
    """The stream random ops here draw from - its handler and a copy of the context its
    draws run in - or None outside every stream (what a recomputation must draw from)."""
    held = thread_object(_THREAD_KEY)
    if held is None or not held.stream:
        return None
    return held.handler, (contextvars.copy_context() if held.thread == threading.get_ident() else held.context)


def stream_context() -> contextvars.Context | None:
    """The context the stream's draws here run in when it is not this thread's own (a
    backward's device thread: the caller's; a recomputation: its forward's), else None.
    Code that reads the stream's context variables for a draw (DTensor's tracker) runs in
    a copy of it."""
    held = thread_object(_THREAD_KEY)
    return None if held is None or not held.stream or held.thread == threading.get_ident() else held.context


def open_streams() -> int:
    """How many streams are open in this process, on every thread."""
    return _open[0]


@contextlib.contextmanager
def drawing(handler: Handler | None, context: contextvars.Context | None = None) -> Iterator[None]:
    """Random ops on plain tensors inside the block go to ``handler`` (None: to torch's
    kernels, as a DTensor region of torch's own tracker needs), with the context variables
    as they are now (:func:`refreshed` after changing one a draw reads), or - a
    recomputation - in a copy of ``context`` on every thread."""
    if handler is not None and _installer is None:  # compile_rng.installation offers it on import
        raise RuntimeError("compile_rng internal error: the random ops' kernels were never offered")
    with _installer() if handler is not None else contextlib.nullcontext(), _counted(handler is not None):
        previous = thread_object(_THREAD_KEY)
        if handler is None:
            _hold(None)
        elif context is None:
            _hold(_Drawing(handler, threading.get_ident(), contextvars.copy_context()))
        else:
            _hold(_Drawing(handler, None, context))
        pid = os.getpid()
        try:
            yield
        finally:
            # a process forked inside the block draws torch's values (_forget_in_child)
            _hold(previous if os.getpid() == pid else None)


def _hold(drawing: _Drawing | None) -> None:
    # the thread's object and the C++ kernels' key go together: the key is included exactly
    # while there is an object to serve the draws
    set_thread_object(_THREAD_KEY, drawing)
    if _key_switch is not None:
        _key_switch(drawing is not None)


@contextlib.contextmanager
def _counted(stream: bool) -> Iterator[None]:
    if not stream:
        yield
        return
    with _open_lock:
        _open[0] += 1
    pid = os.getpid()
    try:
        yield
    finally:
        with _open_lock:
            _open[0] = _open[0] - 1 if os.getpid() == pid else 0


def _forget_in_child() -> None:
    # A process forked inside a stream (a DataLoader's workers started in a step) copied
    # the forking thread's handler: its random ops are torch's, as in any other process.
    global _open_lock
    _hold(None)
    _open_lock = threading.Lock()  # another thread may have held it at the fork
    _open[0] = 0


os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def refreshed() -> Iterator[None]:
    """Inside a stream, after setting a context variable its draws read (a microbatch's
    rows): the block's draws on a backward's device thread see it too."""
    handler = active()
    with drawing(handler) if handler is not None else contextlib.nullcontext():
        yield
