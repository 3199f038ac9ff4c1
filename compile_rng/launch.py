"""Local CPU ranks and progress lines: the one helper the demo, the examples, the
benchmarks and the tests share.

* :func:`spawn` runs ``body(rank, world, *args)`` on ``world`` gloo ranks of this
  machine (a fresh process group on a free port) and raises if any rank fails;
* :func:`progress` prints a timestamped line on stderr, on rank 0 only, so that a
  person at a terminal sees what a long step is doing.
"""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import sys
import time
from collections.abc import Callable

_START = time.perf_counter()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, body: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
        dist.barrier()  # no rank tears down while another is still in a collective
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without
    # an active exception") after the body has passed. Failures raise before this line.
    # multiprocessing's own exit step still runs: it releases the semaphores of Inductor's
    # compile workers, which the parent's resource tracker would otherwise report leaked.
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(body: Callable, world: int, *args) -> None:
    """``body(rank, world, *args)`` on ``world`` gloo ranks (each with the default
    process group initialized); raises if any rank fails. ``body`` and ``args`` must be
    picklable (a module-level function)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), body, args), nprocs=world, join=True)


def progress(message: str) -> None:
    """``[compile_rng +12.3s] message`` on stderr, from rank 0 (or a process without a
    process group) only."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"[compile_rng +{time.perf_counter() - _START:.1f}s] {message}", file=sys.stderr, flush=True)
