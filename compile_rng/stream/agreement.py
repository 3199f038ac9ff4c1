"""Whether ranks agree: one collective that gathers what each rank holds (stream
positions, graph signatures, row positions) and an error on every rank, naming the ranks
that differ, where they do not. A leaf over ``torch.distributed``: every check that ranks
agree goes through :func:`require_agreement` (a compiled call's, a mesh's first DTensor
random op's, a step's, a checkpoint's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


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
