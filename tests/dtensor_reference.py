"""Expected DTensor shard values in tracker mode, computed independently of compile_rng:
the shard's start offset from torch's own OffsetBasedRNGTracker helpers, the values
from the scalar pure-Python stream reference."""

from __future__ import annotations

import contextlib

import pytest
import reference as ref
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _random as dtensor_random
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def ceil4(n: int) -> int:
    return (n + 3) // 4 * 4


def tracker_start(dt: DTensor, coord: list[int]) -> int:
    """``OffsetBasedRNGTracker``'s start offset for ``coord``, via torch's helpers."""
    spec = dt._spec
    idx, total = dtensor_random._calc_shard_info(coord, spec)
    linear = dtensor_random._calc_shard_linear_idx(idx, total)
    first = 1
    for s in dtensor_random._calc_first_shard_size(spec):
        first *= s
    return ceil4(linear * first)


def counters(dt: DTensor, base: int) -> list[int]:
    """Counters of the calling rank's local elements (row-major) in tracker mode."""
    coord = dt.device_mesh.get_coordinate()
    start = base + tracker_start(dt, coord)
    return [start + i for i in range(dt.to_local().numel())]


def uniform(seed: int, cs: list[int], shape, low=0.0, high=1.0) -> torch.Tensor:
    from helpers import f32

    vals = [f32(f32(ref.uniform01(seed, c, "float32") * f32(high - low)) + f32(low)) for c in cs]
    return torch.tensor(vals, dtype=torch.float32).view(shape)


def normal(seed: int, cs: list[int], shape) -> torch.Tensor:
    return torch.tensor([ref.normal_std(seed, c) for c in cs], dtype=torch.float64).view(shape)


def keep(seed: int, cs: list[int], shape, p: float) -> torch.Tensor:
    return torch.tensor([ref.keep_bernoulli(seed, c, p) for c in cs]).view(shape)


def local_zeros(global_shape, mesh, placements, dtype=torch.float32) -> DTensor:
    """A DTensor of zeros built without communication (works on the fake process group)."""
    local_shape, _ = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    stride = torch.empty(global_shape).stride()
    return DTensor.from_local(
        torch.zeros(local_shape, dtype=dtype), mesh, placements, shape=torch.Size(global_shape), stride=stride
    )


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """Act as ``rank`` of ``world`` in this process (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Stock torch 2.13 bug, not compile_rng's: a sharding decision cached under an
    # earlier process group makes AOTAutograd's partitioner fail on the next compile of a
    # DTensor backward ("Node tangents_2 was invalid, but is output"), with any backend.
    torch._C._clear_DTensor_sharding_propagator_cache()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


#: torch 2.11's DTensor has no accelerator branch: it runs every random op, on any device,
#: in the tracker's region (the branch and its ``run_dtensor_rng_op`` came in 2.12).
HAS_ACCELERATOR_BRANCH = hasattr(__import__("torch.distributed.tensor._dispatch").distributed.tensor._dispatch,
                                 "run_dtensor_rng_op")
needs_accelerator_branch = pytest.mark.skipif(
    not HAS_ACCELERATOR_BRANCH, reason="this torch's DTensor has no accelerator branch (run_dtensor_rng_op, torch 2.12+)"
)


def accelerator_branch(x: DTensor, op, *local_args):
    """Run ``op`` as DTensor's dispatch runs a random op on an accelerator DTensor
    (``_dispatch.py``): the tracker's ``_compute_rng_offsets(spec)``, then
    ``run_dtensor_rng_op`` on the local arguments."""
    import torch.distributed.tensor._dispatch as dispatch

    start, end = dtensor_random._rng_tracker._compute_rng_offsets(x._spec)
    return dispatch.run_dtensor_rng_op(start, end, op, *local_args)

