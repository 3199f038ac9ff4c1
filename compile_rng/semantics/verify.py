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
from collections.abc import Sequence

import torch
import torch.distributed as dist

from compile_rng._torch.dynamo_internals import disable_dynamo
from compile_rng.stream import state


def collective_device(group: object = None) -> torch.device:
    """The device a collective's tensors must be on for ``group``'s backend: the CPU where
    the backend takes CPU tensors (gloo, mpi, the fake group, a ``cpu:gloo,cuda:nccl`` pair),
    else the device type the backend serves (NCCL: CUDA; the tensor lands on the current
    device, the one NCCL expects)."""
    backend = str(dist.get_backend(group)).lower()
    if backend in ("gloo", "mpi", "fake") or "cpu:" in backend:
        return torch.device("cpu")
    for device_type, name in dist.Backend.default_device_backend_map.items():
        if name == backend:
            return torch.device(device_type)
    return torch.device("cpu")


def gather_int_lists(mine: Sequence[int], group: object, device: torch.device,
                     lengths: Sequence[int] | None = None) -> list[list[int]]:
    """Every rank of ``group``'s list of ints, in the group's rank order: an all-gather of
    the lengths (unless ``lengths`` gives them), then one of the lists padded to the longest."""
    if lengths is None:
        count = torch.tensor([len(mine)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, count, group=group)
        lengths = [int(c) for c in counts]
    padded = torch.zeros(max(lengths, default=0), dtype=torch.int64, device=device)
    padded[: len(mine)] = torch.tensor(list(mine), dtype=torch.int64)
    everyone = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(everyone, padded, group=group)
    return [t.tolist()[:n] for t, n in zip(everyone, lengths)]


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


def _gathered_uint64s(group: object, mine: tuple) -> list[tuple]:
    """Every rank of ``group``'s ``mine`` (uint64 values): one all-gather of a fixed-size
    int64 tensor, each value as two 32-bit halves (a step pays it; an object gather
    pickles and sends sizes first)."""
    halves = [h for v in mine for h in (v & 0xFFFFFFFF, v >> 32)]
    tensor = torch.tensor(halves, dtype=torch.int64, device=collective_device(group))
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor, group=group)
    return [tuple(lo + (hi << 32) for lo, hi in zip(t.tolist()[::2], t.tolist()[1::2])) for t in everyone]


def _uint64s(mine: tuple) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in mine)


def disagreements(groups: list, mine: tuple) -> list[dict]:
    """Per field of ``mine``: value -> ranks, for every group where the ranks disagree;
    afterwards every rank of the groups knows whether any rank saw a disagreement. One
    group and uint64 values (stream positions): a single fixed-size all-gather, after
    which every rank holds the same values and so the same answer."""
    seen: list[dict] = []
    single = len(groups) == 1 and _uint64s(mine)
    for group in groups:
        if single:
            everyone = _gathered_uint64s(group, mine)
        else:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        for i in range(len(mine)):
            values: dict = {}
            for rank, other in zip(ranks, everyone):
                values.setdefault(other[i], []).append(rank)
            if len(values) > 1:
                seen.append({"field": i, "values": values})
    if single:
        return seen
    flag = 0
    for group in groups:  # one pass over the dims reaches every rank of a mesh
        t = torch.tensor([int(bool(seen)) or flag], device=collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flag = int(t.item())
    if flag and not seen:
        seen.append({"field": None, "values": {}})
    return seen


def describe(seen: list[dict], fields: tuple[str, ...]) -> str:
    lines = []
    for item in seen:
        if item["field"] is None:
            lines.append("  another rank of the group saw the ranks disagree")
            continue
        groups = "; ".join(f"ranks {ranks} have {value}" for value, ranks in item["values"].items())
        line = f"  {fields[item['field']]}: {groups}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def communicates(groups: list) -> bool:
    return dist.is_initialized() and all(dist.get_backend(g) != "fake" for g in groups) and any(
        dist.get_world_size(g) > 1 for g in groups
    )


def require_agreement(groups: list, mine: tuple, fields: tuple[str, ...], problem: str, advice: str) -> None:
    """Raise a RuntimeError on every rank of ``groups`` unless they all hold ``mine`` (one
    value per name of ``fields``): ``problem``, the fields the ranks differ on, ``advice``.
    Nothing is checked where the groups do not communicate (one rank, the fake group)."""
    if not communicates(groups):
        return
    seen = disagreements(groups, mine)
    if seen:
        raise RuntimeError(f"{problem}:\n{describe(seen, fields)}\n{advice}")


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
