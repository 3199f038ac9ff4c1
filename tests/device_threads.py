"""The autograd engine's device threads, simulated on CPU: a CUDA backward runs on a
thread that the engine hands the calling thread's state (the random-op kernels' handler
and their dispatch key among it), but none of the caller's context variables."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from compile_rng._torch.core_internals import thread_object
from compile_rng.eager import random_kernels


def on_a_device_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on another thread handed this thread's random-op handler (and with it the
    kernels' dispatch key), as the engine hands them to a device thread; its result."""
    handed, result = thread_object(random_kernels._THREAD_KEY), []

    def device_thread() -> None:
        random_kernels._hold(handed)
        try:
            result.append(fn())
        finally:
            random_kernels._hold(None)

    worker = threading.Thread(target=device_thread)
    worker.start()
    worker.join()
    return result[0]


def stream_key_in_thread_state() -> bool:
    """Whether the random ops' C++ kernels sit at the key a stream includes in the thread's
    dispatch state (torch 2.13+), not at the backend keys (2.11, 2.12): Dynamo's tensor
    guards then tell a call in a stream from one outside."""
    from compile_rng._torch import core_internals
    from compile_rng.eager import native_kernels

    return core_internals.below_python_key(native_kernels.load().LIVE_KEY)
