"""compile_rng demo: functional random numbers in a compiled model, on several CPU ranks.

Starts WORLD gloo ranks (torch.multiprocessing). Every rank seeds with
``torch.manual_seed``, then runs a small compiled MLP with dropout and a compiled
``torch.rand`` through ``backend="compile_rng"``. Plain tensors are replicas, so every
rank must draw the same bits; the demo gathers them and checks that, checks the values
against the canonical stream computed by the eager kernels, and shows that the state
advanced by exactly the graph's total (``ceil4(numel)`` per random op).

Run: ``python examples/demo.py [--world 2]``
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import compile_rng
from compile_rng import ops

SEED = 2026


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.dropout(F.gelu(self.up(x)), p=0.1, training=True)
        noise = torch.rand(x.shape[0], 8)
        return self.down(h), noise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # same weights everywhere
    block = Block()
    x = torch.randn(32, 64)
    torch.manual_seed(SEED)  # the habit: also restarts compile_rng's stream
    compiled = torch.compile(block, backend="compile_rng")
    start = time.perf_counter()
    out, noise = compiled(x)
    elapsed = time.perf_counter() - start
    seed, offset = compile_rng.get_state()

    # Independent check: the same counters through the eager functional ops.
    # Program order: dropout on (32, 256) at offset 0, then rand(32, 8) at ceil4(8192).
    key = ops.make_key(SEED, 0)
    want_noise = ops.uniform(key, 32 * 256, [32, 8], [8, 1], 0.0, 1.0, torch.float32)
    h = F.gelu(block.up(x))
    want_h, _ = ops.dropout(key, 0, h, [256, 1], 0.1)
    want_out = block.down(want_h)

    gathered = [None] * world
    dist.all_gather_object(gathered, (out.detach(), noise))
    if rank == 0:
        results.update(
            replicas_equal=all(torch.equal(g[0], gathered[0][0]) and torch.equal(g[1], gathered[0][1]) for g in gathered),
            matches_stream=torch.equal(noise, want_noise) and torch.allclose(out, want_out, atol=1e-6, rtol=0),
            state=(seed, offset),
            compile_and_run_s=elapsed,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="number of CPU ranks")
    args = parser.parse_args()
    print(f"compile_rng demo: {args.world} gloo ranks, torch {torch.__version__}")
    print("compiling on every rank (Inductor, ~30 s on 2 cores)...", flush=True)
    results = mp.Manager().dict()
    mp.spawn(run_rank, args=(args.world, _free_port(), results), nprocs=args.world, join=True)
    expected_offset = 32 * 256 + 32 * 8
    rows = [
        ("replicas bitwise equal on all ranks", results["replicas_equal"]),
        ("values == canonical stream (eager kernels)", results["matches_stream"]),
        (f"state advanced to (seed, {expected_offset})", results["state"] == (SEED, expected_offset)),
    ]
    width = max(len(r[0]) for r in rows)
    for name, ok in rows:
        print(f"  {name:<{width}}  {'OK' if ok else 'FAILED'}")
    print(f"  first call (compile + run) on rank 0: {results['compile_and_run_s']:.1f} s")
    if not all(ok for _, ok in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
