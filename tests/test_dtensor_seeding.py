"""DTensor's own seeding API on CPU meshes, and ranks that disagree.

Ports the assertions of PyTorch's ``test_manual_seed``, ``test_manual_seed_submesh`` and
``test_pipeline_parallel_manual_seed`` (test/distributed/tensor/test_random_ops.py; GPU
only upstream) to 4 gloo ranks with compile_rng imported. Upstream also asserts that
no tracker exists before ``manual_seed``: compile_rng installs its tracker on import,
so that one line does not apply. Then: a mesh whose ranks were seeded differently
raises at its first DTensor random op, on every rank; ``verify=True`` checks a pipeline
stage's graph within the stage.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import compile_rng
from compile_rng.launch import spawn

WORLD = 4


def _expect_error(fn, *fragments):
    try:
        fn()
    except RuntimeError as e:
        for fragment in fragments:
            assert fragment in str(e), (fragment, str(e))
        return
    raise AssertionError(f"no error; expected {fragments}")


def _seeding(rank, world):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor import ones as dtensor_ones
    from torch.distributed.tensor._random import manual_seed
    from torch.distributed.tensor.debug import CommDebugMode

    # test_manual_seed: the seed is the calling rank's, nothing is communicated
    mesh = DeviceMesh("cpu", torch.arange(world))
    with CommDebugMode() as comm:
        manual_seed(rank, mesh)
        assert compile_rng.get_state() == (rank, 0)
        manual_seed(1234, mesh)
        assert compile_rng.get_state() == (1234, 0)
    assert comm.get_total_counts() == 0

    # test_manual_seed_submesh: a rank outside the mesh gets torch's error
    outside = DeviceMesh("cpu", [(rank + 1) % world])
    _expect_error(lambda: manual_seed(rank, outside), "manual_seed requires the current rank to be a part of the device mesh")

    # test_pipeline_parallel_manual_seed: stages seeded 123 + pp_rank on their SPMD meshes
    world_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "spmd"))
    pp_rank, spmd = world_mesh["pp"].get_local_rank(), world_mesh["spmd"]
    manual_seed(123 + pp_rank, spmd)
    assert compile_rng.get_state()[0] == 123 + pp_rank
    weight = dtensor_ones(2 * spmd.size(), 2, device_mesh=spmd, placements=[Shard(0)])
    torch.nn.init.normal_(weight)  # the first op on the stage mesh: its ranks agree, no error
    everyone = [torch.empty_like(weight.to_local()) for _ in range(world)]
    dist.all_gather(everyone, weight.to_local())
    for other in range(world):
        if other != rank:
            assert not torch.equal(everyone[rank], everyone[other]), other

    # ranks of one mesh seeded differently: the first DTensor random op raises on every rank
    torch.manual_seed(7 + rank % 2)
    x = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])
    _expect_error(lambda: torch.rand_like(x), "different RNG states", "seed: ranks [0, 2] have 7; ranks [1, 3] have 8")
    torch.manual_seed(7)  # reseeding alike restarts the check: the op now runs
    torch.rand_like(x)

    # verify=True: each stage runs its own graph with its own seed, checked within the stage
    manual_seed(50 + pp_rank, spmd)
    stage_input = distribute_tensor(torch.ones(4, 4), spmd, [Shard(0)])
    stage_fn = (lambda t: F.dropout(t, 0.5)) if pp_rank == 0 else (lambda t: torch.rand_like(t) + t)
    compiled = torch.compile(stage_fn, backend=compile_rng.backend(inner="aot_eager", verify=True))
    compiled(stage_input)  # no error, no hang: the other stage is not asked
    # a plain-tensor graph names its ranks with verify=<mesh>
    torch.manual_seed(60 + pp_rank + (rank % 2 if pp_rank == 1 else 0))
    plain = torch.compile(lambda t: F.dropout(t, 0.5), backend=compile_rng.backend(inner="aot_eager", verify=spmd))
    if pp_rank == 0:
        plain(torch.ones(4))
    else:
        _expect_error(lambda: plain(torch.ones(4)), "seed: ranks [2] have 61; ranks [3] have 62")


@pytest.mark.slow
def test_dtensor_seeding_api_and_disagreeing_ranks_on_gloo():
    spawn(_seeding, WORLD)
