"""PyTorch's DTensor random tests (test/distributed/tensor/test_random_ops.py), ported
onto CPU meshes through compile_rng. Written from what they assert, not copied:

* test_init_ops: nn.init on a sharded DTensor gives different shards per rank, on a
  replicated one the same tensor everywhere;
* test_deterministic_dropout_1d: dropout of a replicated DTensor is the same on all ranks;
* test_deterministic_rand_1d: dtensor.rand differs across shards, agrees across replicas,
  and advances the offset by the global numel;
* test_deterministic_uniform_2d: on a 2-D mesh, every placement's local shard equals the
  stream at the shard's tracker offset;
* test_tp_model_meta_init / test_fsdp_tp_model_meta_init: a model built on the meta
  device, parallelized (and fully_shard-ed), then initialized, gets each local shard
  from its tracker offset (sharded weights differ across ranks);
* the compile tests: eager == aot_eager == inductor, three calls, same state after each.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from compile_rng.launch import spawn

SEED = 42


def _gather(t: torch.Tensor) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return out


def _check_against_stream(dt, base: int, kind: str) -> None:
    """dt's local shard equals the stream at its tracker counters (base + start + i)."""
    from dtensor_reference import tracker_start

    from compile_rng import ops

    local = dt.to_local()
    start = tracker_start(dt, list(dt.device_mesh.get_coordinate()))
    key = ops.make_key(SEED, base + start)
    shape = list(local.shape)
    strides = [int(s) for s in torch.empty(shape).stride()]
    want = {"uniform": lambda: ops.uniform(key, 0, shape, strides, 0.0, 1.0, local.dtype)}[kind]()
    assert torch.equal(local, want)


def _port_1d(rank: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh, rand
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import compile_rng

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # test_init_ops
    for init in (nn.init.kaiming_uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_):
        for placements, distinct in (([Shard(1)], True), ([Replicate()], False)):
            compile_rng.manual_seed(SEED)
            dt = distribute_tensor(torch.empty(8, 4 * world), mesh, placements)
            init(dt)
            locals_ = _gather(dt.to_local())
            pairs = [torch.equal(locals_[0], other) for other in locals_[1:]]
            assert (not any(pairs)) if distinct else all(pairs), (init.__name__, placements)

    # test_deterministic_dropout_1d
    compile_rng.manual_seed(SEED)
    ones = distribute_tensor(torch.ones(16, 8), mesh, [Replicate()])
    dropped = nn.functional.dropout(ones, p=0.4)
    gathered = _gather(dropped.to_local())
    assert all(torch.equal(gathered[0], g) for g in gathered[1:])
    assert 0 < int((gathered[0] == 0).sum()) < gathered[0].numel()

    # test_deterministic_rand_1d
    compile_rng.manual_seed(SEED)
    sharded = rand(8, 4 * world, device_mesh=mesh, placements=[Shard(1)])
    assert compile_rng.get_state() == (SEED, 8 * 4 * world)
    replicated = rand(8, 4 * world, device_mesh=mesh, placements=[Replicate()])
    s_all, r_all = _gather(sharded.to_local()), _gather(replicated.to_local())
    assert not any(torch.equal(s_all[0], s) for s in s_all[1:])
    assert all(torch.equal(r_all[0], r) for r in r_all[1:])
    _check_against_stream(sharded, 0, "uniform")
    _check_against_stream(replicated, 8 * 4 * world, "uniform")

    # test_tp_model_meta_init
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 4 * world)
            self.down = nn.Linear(4 * world, 8)

    with torch.device("meta"):
        model = MLP()
    model = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model.to_empty(device="cpu")
    compile_rng.manual_seed(SEED)
    base = 0
    for name in ("up", "down"):
        mod = getattr(model, name)
        mod.reset_parameters()  # kaiming_uniform_(weight) then uniform_(bias)
        for param_name in ("weight", "bias"):
            p = getattr(mod, param_name)
            shards = _gather(p.to_local().detach())
            sharded = any(isinstance(pl, Shard) for pl in p.placements)
            pairs = [torch.equal(shards[0], s) for s in shards[1:]]
            assert (not any(pairs)) if sharded else all(pairs), (name, param_name, p.placements)
            base += (p.numel() + 3) // 4 * 4
    assert compile_rng.get_state() == (SEED, base)


def _port_2d(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import compile_rng

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    # test_deterministic_uniform_2d
    base = 0
    compile_rng.manual_seed(SEED)
    for placements in (
        [Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()],
        [Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)],
    ):
        dt = distribute_tensor(torch.empty(8, 6), mesh, placements)
        dt.uniform_()
        _check_against_stream(dt, base, "uniform")
        base += 48

    # test_fsdp_tp_model_meta_init
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

    with torch.device("meta"):
        model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    compile_rng.manual_seed(SEED)
    for mod in (model.up, model.down):
        mod.reset_parameters()
    weights = _gather(model.up.weight.to_local().detach())
    # FSDP x TP shards the up-projection weight four ways: every rank's shard differs
    assert all(not torch.equal(weights[i], weights[j]) for i in range(4) for j in range(i + 1, 4))
    assert compile_rng.get_state() == (SEED, 128 + 16 + 128 + 8)


def _worker(rank: int, world: int, which: str) -> None:
    {"1d": _port_1d, "2d": _port_2d}[which](rank)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["1d", "2d"])
def test_port_on_4_gloo_ranks(which):
    spawn(_worker, 4, which)


def test_port_compile_eager_aot_eager_inductor_three_calls():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    import compile_rng

    def fn(x):
        return nn.functional.dropout(torch.rand_like(x) + x.uniform_(), 0.3)

    torch._dynamo.reset()
    runners = {
        "eager": fn,
        "aot_eager": torch.compile(fn, backend=compile_rng.backend(inner="aot_eager")),
        "inductor": torch.compile(fn, backend=compile_rng.backend(inner="inductor")),
    }
    with fake_rank(1, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        results = {}
        for name, run in runners.items():
            compile_rng.manual_seed(SEED)
            calls = []
            for _ in range(3):
                calls.append((run(local_zeros((6, 10), mesh, [Shard(0)])).to_local(), compile_rng.get_state()))
            results[name] = calls
    for name in ("aot_eager", "inductor"):
        for (e, es), (c, cs) in zip(results["eager"], results[name]):
            assert torch.equal(e, c), name
            assert es == cs
    states = [s for _, s in results["eager"]]
    assert states == [(SEED, 180 * k) for k in (1, 2, 3)]
