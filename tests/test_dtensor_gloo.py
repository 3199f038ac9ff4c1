"""Real ranks: 2 and 4 gloo processes on CPU.

Every rank checks its local shards bitwise against the canonical stream at the
tracker counters, eager against compiled, and the state advance; then the ranks
gather their shards: replicas must be bitwise equal and shards pairwise different.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from compile_rng.launch import spawn

SEED = 99


def program(x, y):
    a = torch.rand_like(x)
    x.uniform_(-1.0, 2.0)
    b = F.dropout(torch.ones_like(x), 0.5)
    c = torch.randn_like(y)
    return a, x * 1, b, c


def _worker(rank: int, world: int, inner: str, mesh_shape: tuple) -> None:
    from dtensor_reference import counters, keep, normal, uniform
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import compile_rng

    mesh = init_device_mesh("cpu", mesh_shape)
    shard_all = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    gx, gy = (12, 5), (3, 7)
    n_x = 12 * 5
    adv = (n_x + 3) // 4 * 4
    compiled = torch.compile(program, backend=compile_rng.backend(inner=inner))
    outs = []
    for fn in (program, compiled):
        compile_rng.manual_seed(SEED)
        x = distribute_tensor(torch.zeros(gx), mesh, shard_all)
        y = distribute_tensor(torch.zeros(gy), mesh, [Replicate()] * len(mesh_shape))
        outs.append([o.to_local() for o in fn(x, y)])
        assert compile_rng.get_state() == (SEED, 3 * adv + 24), compile_rng.get_state()
    eager, comp = outs
    for e, c in zip(eager[:3], comp[:3]):
        assert torch.equal(e, c)
    assert (eager[3].double() - comp[3].double()).abs().max() < 1e-5
    ref_x = distribute_tensor(torch.zeros(gx), mesh, shard_all)
    shape = comp[0].shape
    assert torch.equal(comp[0], uniform(SEED, counters(ref_x, 0), shape))
    assert torch.equal(comp[1], uniform(SEED, counters(ref_x, adv), shape, -1.0, 2.0))
    assert torch.equal(comp[2], keep(SEED, counters(ref_x, 2 * adv), shape, 0.5).float() * 2)
    ref_y = distribute_tensor(torch.zeros(gy), mesh, [Replicate()] * len(mesh_shape))
    assert (comp[3].double() - normal(SEED, counters(ref_y, 3 * adv), gy)).abs().max() < 2e-4

    gathered = [None] * world
    dist.all_gather_object(gathered, (comp[0], comp[3]))
    replicas = [g[1] for g in gathered]
    assert all(torch.equal(r, replicas[0]) for r in replicas), "replicated tensor differs across ranks"
    # DTensor's accelerator branch (what a CUDA mesh runs on torch 2.12+) gives the same local values
    from dtensor_reference import HAS_ACCELERATOR_BRANCH, accelerator_branch

    if HAS_ACCELERATOR_BRANCH:
        compile_rng.manual_seed(SEED)
        branch = accelerator_branch(ref_x, torch.ops.aten.uniform_.default, torch.zeros(shape), -1.0, 2.0)
        assert torch.equal(branch, uniform(SEED, counters(ref_x, 0), shape, -1.0, 2.0))
        assert compile_rng.get_state() == (SEED, adv)
    # init_device_mesh lays ranks out row-major: rank r holds shard r // (world / mesh_shape[0])
    shard_of = [r // (world // mesh_shape[0]) for r in range(world)]
    for i in range(world):
        for j in range(world):
            same_shard = shard_of[i] == shard_of[j]
            equal = torch.equal(gathered[i][0], gathered[j][0])
            assert equal == same_shard, (i, j, "shards must differ; replicas of a shard must agree")


@pytest.mark.parametrize(
    "world,inner,mesh_shape",
    [(2, "inductor", (2,)), pytest.param(4, "aot_eager", (4,), marks=pytest.mark.slow),
     pytest.param(4, "aot_eager", (2, 2), marks=pytest.mark.slow)],
    ids=["2-ranks-inductor", "4-ranks-1d", "4-ranks-2d"],
)
def test_real_ranks(world, inner, mesh_shape):
    spawn(_worker, world, inner, mesh_shape)


def _threads_body(rank: int, world: int, out: str) -> None:
    torch.save(torch.get_num_threads(), f"{out}.{rank}")


@pytest.mark.parametrize("user_threads", [None, "2"])
def test_spawned_ranks_share_the_cores(tmp_path, monkeypatch, user_threads):
    """Each of ``world`` ranks gets ``cores // world`` threads, as torchrun gives them; the
    user's ``OMP_NUM_THREADS`` wins; this process's environment is left as it was."""
    import os

    if user_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user_threads)
    before = dict(os.environ)
    world = 2
    share = max(1, len(os.sched_getaffinity(0)) // world)
    if user_threads and int(user_threads) == share:
        pytest.skip("the user's choice equals the default share on this machine")
    spawn(_threads_body, world, str(tmp_path / "threads"))
    expected = int(user_threads) if user_threads else share
    assert [torch.load(tmp_path / f"threads.{r}") for r in range(world)] == [expected] * world
    assert dict(os.environ) == before
