"""The autograd engine's device threads, simulated on CPU: a CUDA backward runs on a
thread that the engine hands the calling thread's state (the random-op kernels' handler
among it), but none of the caller's context variables."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from compile_rng._torch.core_internals import set_thread_object, thread_object
from compile_rng.eager import random_kernels


def on_a_device_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on another thread handed this thread's random-op handler, as the engine
    hands it to a device thread; its result."""
    handed, result = thread_object(random_kernels._THREAD_KEY), []

    def device_thread() -> None:
        set_thread_object(random_kernels._THREAD_KEY, handed)
        try:
            result.append(fn())
        finally:
            set_thread_object(random_kernels._THREAD_KEY, None)

    worker = threading.Thread(target=device_thread)
    worker.start()
    worker.join()
    return result[0]
