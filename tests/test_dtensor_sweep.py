"""Fake-process-group sweep: meshes x placements, every rank, eager and compiled.

Each case compiles once (as rank 0) and then runs as every other rank of the mesh: a
rank-agnostic graph must not recompile (only a different local shape may) and must
give each rank its own shard. Values are checked bitwise against the canonical stream
at the counters torch's OffsetBasedRNGTracker assigns (tests/dtensor_reference.py).
"""

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import counters, fake_rank, keep, local_zeros, normal, uniform
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import compile_rng

SEED = 1234
P = 0.25


def program(x):
    a = torch.rand_like(x)
    x.uniform_(-1.0, 2.0)
    b = F.dropout(torch.ones_like(x), P)
    c = torch.randn_like(x)
    return a, x * 1, b, c


def make_mesh(shape, names, sub):
    world = 1
    for s in shape:
        world *= s
    mesh = DeviceMesh("cpu", torch.arange(world).view(shape), mesh_dim_names=names)
    return mesh[sub] if sub else mesh


# (id, mesh shape, dim names, sub-mesh, global shape, placements)
CASES = [
    ("1d-replicate", (4,), None, None, (8, 6), [Replicate()]),
    ("1d-shard0", (4,), None, None, (8, 6), [Shard(0)]),
    ("1d-shard1-uneven", (4,), None, None, (5, 6), [Shard(1)]),
    ("1d-uneven-10-rows", (4,), None, None, (10, 3), [Shard(0)]),
    ("1d-dim-smaller-than-mesh", (4,), None, None, (3, 5), [Shard(0)]),
    ("2d-shard0-shard1", (2, 2), ("dp", "tp"), None, (6, 4), [Shard(0), Shard(1)]),
    ("2d-replicate-shard0", (2, 2), ("dp", "tp"), None, (6, 4), [Replicate(), Shard(0)]),
    ("2d-two-mesh-dims-one-tensor-dim", (2, 2), ("dp", "tp"), None, (8, 3), [Shard(0), Shard(0)]),
    ("2d-strided-shard", (2, 2), ("dp", "tp"), None, (8, 4), [_StridedShard(0, split_factor=2), Shard(0)]),
    ("3d", (2, 1, 2), ("pp", "dp", "tp"), None, (4, 6), [Shard(0), Replicate(), Shard(1)]),
    ("submesh-tp", (2, 2), ("dp", "tp"), "tp", (6, 4), [Shard(0)]),
]


def run_case(mesh_shape, names, sub, gshape, placements, inner):
    world = 1
    for s in mesh_shape:
        world *= s
    be = compile_rng.backend(inner=inner)
    torch._dynamo.reset()
    compiled = torch.compile(program, backend=be)
    n = 1
    for s in gshape:
        n *= s
    adv = (n + 3) // 4 * 4
    local_shapes = set()
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = make_mesh(mesh_shape, names, sub)
            results = []
            for fn in (program, compiled):
                compile_rng.manual_seed(SEED)
                x = local_zeros(gshape, mesh, placements)
                out = [o.to_local() for o in fn(x)]
                assert compile_rng.get_state() == (SEED, 4 * adv)
                results.append(out)
            local_shapes.add(tuple(results[0][0].shape))
            (ea, ex, eb, ec), (ca, cx, cb, cc) = results
            for e, c in zip(results[0], results[1]):
                assert torch.equal(e, c) if inner == "aot_eager" else e.shape == c.shape, (rank, e, c)
            ref_x = local_zeros(gshape, mesh, placements)
            shape = ea.shape
            assert torch.equal(ca, uniform(SEED, counters(ref_x, 0), shape))
            assert torch.equal(cx, uniform(SEED, counters(ref_x, adv), shape, -1.0, 2.0))
            assert torch.equal(cb, keep(SEED, counters(ref_x, 2 * adv), shape, 1 - P).float().div_(1 - P))
            if cc.numel():
                assert (cc.double() - normal(SEED, counters(ref_x, 3 * adv), shape)).abs().max() < 2e-4
    # one graph per distinct local shape: the mesh coordinate is a runtime value
    assert len(be.plans) == len(local_shapes)
    return be


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sweep_aot_eager(case):
    _, mesh_shape, names, sub, gshape, placements = case
    run_case(mesh_shape, names, sub, gshape, placements, "aot_eager")


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[8]], ids=[CASES[i][0] for i in (1, 5, 8)])
def test_sweep_inductor(case):
    _, mesh_shape, names, sub, gshape, placements = case
    be = run_case(mesh_shape, names, sub, gshape, placements, "inductor")
    code = be.plans[0].graphs[-1]
    assert "_runtime_compute_coordinate_on_dim" in code  # the coordinate is read at run time
    assert "aten.uniform" not in code and "aten.rand" not in code and "native_dropout" not in code


def test_dynamic_shapes_one_graph_for_every_rank_and_size():
    def fn(x):
        return torch.rand_like(x) + F.dropout(x + 1, 0.5)

    torch._dynamo.reset()
    be = compile_rng.backend()
    compiled = torch.compile(fn, backend=be, dynamic=True)
    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            for rows in (8, 12, 20):
                results = []
                for run in (fn, compiled):
                    compile_rng.manual_seed(3)
                    results.append(run(local_zeros((rows, 5), mesh, [Shard(0)])).to_local())
                    assert compile_rng.get_state() == (3, 2 * ((rows * 5 + 3) // 4 * 4))
                assert torch.equal(*results)
    assert len(be.plans) == 1
