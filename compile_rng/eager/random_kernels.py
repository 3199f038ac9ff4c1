"""Kernels for torch's random ops: compile_rng's stream inside a step, torch's own outside.

Inside compile_rng's eager stream (a ``compile_rng.step``, a ``compile_rng.compile``d
call, :func:`~compile_rng.eager.dispatch_modes.eager_stream`) every aten random op on a
plain tensor must draw compile_rng's values, and every other op must run as in stock
torch, at its speed. A dispatch mode sees every op (a Python call each: +2.6 us per op
on a Zen 4 core, before any work); instead each random overload (the
``nondeterministic_seeded`` tag) gets a Python kernel at each backend key where torch
has one - torch.library's own pattern: ``get_kernel``, then ``impl`` over it. The kernel
calls the *handler* of the stream the thread is in, and torch's kernel, with the same
dispatch keys, where there is none. Every other op never reaches Python.

Why the backend keys: they sit below autograd, where a dispatch mode sits, so autograd
records torch's own backward (dropout's mask multiply) around compile_rng's values, and
in-place ops get torch's version counting. Tracing (FakeTensor, Dynamo, export) runs
the Meta kernels, which stay torch's. CompositeImplicitAutograd ops (``dropout``, SDPA,
``lstm``) are left alone: they decompose, above autograd, into the ops served here.

The handler lives in the thread's dispatcher state, which the autograd engine hands to
its device threads: a CUDA backward's recomputation (activation checkpointing) draws
from the stream as its forward did, as it did under the dispatch mode. The kernels are
registered at the first stream (``compile_rng.installation`` makes the change, through
:func:`set_installer`) and stay until ``compile_rng.uninstall()`` (uninstalled, a stream
registers them for its own length); outside a stream a random op pays one Python call on
its way to torch's kernel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from compile_rng._torch.core_internals import OpOverload, set_thread_object, thread_object
from compile_rng._torch.dynamo_internals import disable_dynamo, never_traced

#: ``handler(op, args, kwargs, stock)``: what a stream does with random op ``op``
#: (``stock(*args, **kwargs)`` runs torch's kernel).
Handler = Callable[[OpOverload, tuple, dict, Callable[..., Any]], Any]

_THREAD_KEY = "compile_rng_random_op_handler"
_installer: Callable[[], AbstractContextManager[None]] | None = None


def set_installer(installer: Callable[[], AbstractContextManager[None]]) -> None:
    """Set what a stream enters to have the kernels registered (``compile_rng.installation``'s:
    registered until ``uninstall()``; uninstalled, for the stream's length)."""
    global _installer
    _installer = installer


def kernel(op: OpOverload, stock: Any) -> Callable[..., Any]:
    """The kernel registered for ``op`` over torch's ``stock`` kernel (a
    ``torch.library.get_kernel`` result), to be registered ``with_keyset``."""

    def random_op_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        handler = thread_object(_THREAD_KEY)
        if handler is None:
            return stock.call_boxed(keyset, *args, **kwargs)
        return _handled(handler, op, args, kwargs, lambda *a, **k: stock.call_boxed(keyset, *a, **k))

    # Dynamo's frame hook would compile the kernel's frame where a compiled function's
    # eager code (between graphs) calls a random op: the kernel's own frame is never
    # traced (every kernel shares this code), and the handler runs with Dynamo off.
    _never_traced_once(random_op_kernel.__code__)
    return random_op_kernel


@functools.cache
def _never_traced_once(code: Any) -> None:
    never_traced(code)


@disable_dynamo
def _handled(handler: Handler, op: OpOverload, args: tuple, kwargs: dict, stock: Callable[..., Any]) -> Any:
    return handler(op, args, kwargs, stock)


def active() -> Handler | None:
    """The handler random ops on this thread go to, if any."""
    return thread_object(_THREAD_KEY)


@contextlib.contextmanager
def drawing(handler: Handler | None) -> Iterator[None]:
    """Random ops on plain tensors inside the block go to ``handler`` (None: to torch's
    kernels, as a DTensor region of torch's own tracker needs)."""
    if handler is not None and _installer is None:  # compile_rng.installation offers it on import
        raise RuntimeError("compile_rng internal error: the random ops' kernels were never offered")
    with _installer() if handler is not None else contextlib.nullcontext():
        previous = active()
        set_thread_object(_THREAD_KEY, handler)
        try:
            yield
        finally:
            set_thread_object(_THREAD_KEY, previous)
