"""Local CPU ranks and progress lines: the one helper the demo, the examples, the
benchmarks and the tests share.

* :func:`spawn` runs ``body(rank, world, *args)`` on ``world`` gloo ranks of this
  machine (a fresh process group on a free port, each rank with its share of the
  cores, as torchrun gives them) and raises if any rank fails; under
  ``torchrun`` (one or several nodes) it runs this process's rank instead, in the
  process group torchrun's environment describes;
* :func:`progress` prints a timestamped line on stderr, on rank 0 only, so that a
  person at a terminal sees what a long step is doing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator

_START = time.perf_counter()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cores_shared(world: int) -> Iterator[None]:
    """The environment ``world`` local ranks start in: each gets its share of this
    machine's cores (``OMP_NUM_THREADS=cores // world``), as torchrun gives them
    (``OMP_NUM_THREADS=1`` for several ranks per node): ranks whose threads outnumber the
    cores spin in OpenMP's barriers on cores the other ranks need - measured 30% of a
    2-rank test's CPU time on a 2-core machine. Inductor keeps its pool of compile
    workers: without it, cold compiles on several ranks took longer (gcc no longer
    overlaps the rank's tracing). A user who set ``OMP_NUM_THREADS`` shares the cores
    themselves; this process's environment is restored."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // world))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


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
    from compile_rng._torch import distributed_internals

    distributed_internals.exit_skipping_teardown()  # multiprocessing's own exit step still runs


def end_of_rank() -> None:
    """At the end of a script that ran as one rank of a gloo job (``torchrun``, Lightning's
    DDP launcher): wait for every rank, destroy the default group and end the process
    without the interpreter's teardown, which gloo's threads can abort ("terminate called
    without an active exception", SIGABRT) after the work has passed. Returns at once
    where no process group is initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    from compile_rng._torch import distributed_internals

    distributed_internals.exit_skipping_teardown()


def torchrun_world() -> int | None:
    """The world size ``torchrun`` started this process in (None: not started by torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"])


def _torchrun_group() -> None:
    """The default process group of a torchrun job (gloo: CPU tensors), made once; it
    lives until the process ends, so one job runs several bodies."""
    import atexit

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
        atexit.register(dist.destroy_process_group)


def spawn(body: Callable, world: int, *args) -> bool:
    """``body(rank, world, *args)`` on ``world`` gloo ranks (each with the default
    process group initialized); raises if any rank fails. ``body`` and ``args`` must be
    picklable (a module-level function).

    Under ``torchrun`` this process is one of the ranks: ``body`` runs here, for this
    rank, and ``world`` must be torchrun's world size. Returns whether this process
    reports the results: the parent of spawned ranks, or rank 0 under torchrun.
    """
    launched = torchrun_world()
    if launched is None:
        import torch.multiprocessing as mp

        with _cores_shared(world):
            mp.spawn(_entry, args=(world, free_port(), body, args), nprocs=world, join=True)
        return True
    if launched != world:
        raise SystemExit(
            f"compile_rng: this run needs {world} ranks, but torchrun started {launched}; "
            f"launch it with torchrun --nproc-per-node {world} (or without torchrun)"
        )
    import torch.distributed as dist

    _torchrun_group()
    body(dist.get_rank(), world, *args)
    dist.barrier()  # no rank moves on while another is still in a collective
    return dist.get_rank() == 0


def reporting() -> bool:
    """Whether this process prints a run's report: always, but for torchrun's ranks other than 0."""
    return torchrun_world() is None or os.environ.get("RANK", "0") == "0"


def results_dict() -> dict:
    """A dict the ranks' ``body`` can fill for the reporting process: shared across spawned
    processes, a plain dict under torchrun (rank 0 reports what it filled itself)."""
    if torchrun_world() is not None:
        return {}
    import torch.multiprocessing as mp

    return mp.Manager().dict()


def progress(message: str) -> None:
    """``[compile_rng +12.3s] message`` on stderr, from rank 0 (or a process without a
    process group) only."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"[compile_rng +{time.perf_counter() - _START:.1f}s] {message}", file=sys.stderr, flush=True)
