"""Run a test body on real gloo ranks (torch.multiprocessing)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, body: Callable, args: tuple) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
        dist.barrier()  # no rank tears down while another is still in a collective
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without
    # an active exception") after the body has passed. Failures raise before this line.
    os._exit(0)


def spawn(body: Callable, world: int, *args) -> None:
    """``body(rank, world, *args)`` on ``world`` gloo ranks; raises if any rank fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, body, args), nprocs=world, join=True)
