"""Rank-divergence checks: ``compile_rng.backend(verify=True)`` or ``COMPILE_RNG_VERIFY=1``.

SPMD random numbers are only right if every rank enters each compiled call with the
same seed, the same offset and the same graph. A rank seeded differently, or one that
ran an extra random op, silently desynchronizes every later value. With verification
on, each compiled call first all-gathers ``(seed, offset, graph signature)`` over the
default process group and raises on every rank, naming the ranks that differ.
"""

from __future__ import annotations

import hashlib
import os

import torch.distributed as dist


def enabled(flag: bool) -> bool:
    return flag or os.environ.get("COMPILE_RNG_VERIFY", "") not in ("", "0")


def signature(plan) -> str:
    """A short hash of the graph's random ops: op, sharding, shapes, offsets."""
    text = repr([(op.original, op.mode, str(op.sharding), str(op.offset), str(op.advance)) for op in plan.ops])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check(name: str, seed: int, offset: int, graph: str) -> None:
    """Raise on every rank unless all ranks agree on ``(seed, offset, graph)``."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = (seed, offset, graph)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(other == everyone[0] for other in everyone):
        return
    fields = ("seed", "offset", "random-op signature")
    lines = []
    for i, field in enumerate(fields):
        groups: dict = {}
        for rank, values in enumerate(everyone):
            groups.setdefault(values[i], []).append(rank)
        if len(groups) > 1:
            lines.append(f"  {field}: " + "; ".join(f"ranks {ranks} have {value}" for value, ranks in groups.items()))
    raise RuntimeError(
        f"compile_rng verify: ranks disagree before compiled graph {name!r}:\n" + "\n".join(lines) + "\n"
        "Seed every rank with the same torch.manual_seed / compile_rng.manual_seed and run the same "
        "random ops on every rank of the mesh."
    )
