"""Rank-divergence checks.

SPMD random numbers are only right if every rank enters each compiled call with the
same seed, the same offset and the same graph. A rank seeded differently, or one that
ran an extra random op, silently desynchronizes every later value.

* ``compile_rng.backend(verify=True)`` or ``COMPILE_RNG_VERIFY=1``: each compiled call
  first all-gathers ``(seed, offset, graph signature)`` over the ranks that run the
  graph and raises on every rank, naming the ranks that differ.
* Always: the first eager DTensor random op on a mesh after each seeding checks that the
  mesh's ranks hold one ``(seed, offset)`` (:func:`check_mesh_once`). Stock torch copies
  rank 0's state there (a deprecated behaviour); silently different replicas are worse
  than an error, so compile_rng raises.
"""

from __future__ import annotations

import hashlib
import os

import torch.distributed as dist

from compile_rng._torch.dynamo_internals import disable_dynamo
from compile_rng.stream import state
from compile_rng.stream.agreement import require_agreement


def enabled(flag: object) -> bool:
    """``flag``: False, True, or the DeviceMesh / ProcessGroup to check over."""
    return (flag is not False and flag is not None) or os.environ.get("COMPILE_RNG_VERIFY", "") not in ("", "0")


def signature(plan) -> str:
    """A short hash of the graph's random ops: op, sharding, shapes, offsets."""
    text = repr([(op.original, op.layout, str(op.sharding), str(op.offset), str(op.advance)) for op in plan.ops])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def groups_of(meshes: list, explicit: object = None) -> list:
    """The process groups a compiled graph's check runs over: ``explicit`` (a DeviceMesh or
    a ProcessGroup) if given, else the dims of the meshes of the graph's DTensor random
    ops (the ranks that run it: a pipeline stage's graph is checked within the stage),
    else the default group."""
    if explicit is not None and explicit is not True:
        meshes = [explicit] if hasattr(explicit, "get_group") else []
        if not meshes:
            return [explicit]
    groups = []
    for mesh in meshes:
        for d in range(mesh.ndim):
            group = mesh.get_group(d)
            if group not in groups:
                groups.append(group)
    return groups or [dist.group.WORLD]


def check(name: str, seed: int, offset: int, graph: str, groups: list) -> None:
    """Raise on every rank of ``groups`` unless they agree on ``(seed, offset, graph)``."""
    require_agreement(
        groups, (seed, offset, graph), ("seed", "offset", "random-op signature"),
        f"compile_rng verify: ranks disagree before compiled graph {name!r}",
        "Seed every rank with the same torch.manual_seed / compile_rng.manual_seed and run the same "
        "random ops on every rank of the mesh.",
    )


_checked: set[tuple] = set()


@disable_dynamo  # eager only: it communicates and reads the state (Dynamo imported lazily)
def check_mesh_once(mesh) -> None:
    """Raise on the mesh's ranks unless they all hold the same ``(seed, offset)``; runs a
    collective over the mesh once per mesh and seeding (every rank of the mesh must
    reach it: the first DTensor random op of an SPMD program does)."""
    key = (state.seedings(), mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()))
    if key in _checked:
        return
    _checked.add(key)
    if mesh.size() == 1 or not dist.is_initialized():
        return
    require_agreement(
        groups_of([mesh]), state.get_state(mesh.device_type), ("seed", "offset"),
        f"compile_rng: the ranks of the {mesh.device_type} mesh {mesh.mesh.tolist()} reach their first "
        "DTensor random op with different RNG states",
        "Replicas would silently differ. Seed every rank of an SPMD mesh alike (torch.manual_seed / "
        "compile_rng.manual_seed / torch.distributed.tensor._random.manual_seed(seed, mesh)); pipeline "
        "stages may use different seeds, ranks within a stage may not.",
    )
