"""mode="invariant": the assembled full tensor is bitwise the same for every mesh,
placement list and world size, and equals the canonical stream at global indices.

Fake-process-group sweep; each case runs every rank eagerly (under
compile_rng.layout("invariant")) and compiled (backend(layout="invariant"), one graph per
local shape), assembles the full tensors from the local shards at the global offsets
torch computes, and compares them with the world-size-1 run of the same program on a
plain tensor.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dtensor_reference import fake_rank, local_zeros
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import compile_rng
from compile_rng import ops

SEED = 31
G = (12, 8)


def program(w):
    nn.init.uniform_(w, -1.0, 1.0)
    a = w * 1
    nn.init.normal_(w, 0.0, 0.5)
    b = w * 1
    nn.init.kaiming_uniform_(w, a=5**0.5)
    c = w * 1
    d = F.dropout(torch.ones_like(w), 0.3)
    e = torch.rand_like(w)
    f = torch.randn_like(w)
    return a, b, c, d, e, f


NORMAL_OUTPUTS = {1, 5}  # checked within the ulp bound when Inductor runs them

CASES = [
    ("(1,)", (1,), [Shard(0)]),
    ("(2,) shard0", (2,), [Shard(0)]),
    ("(3,) uneven rows", (3,), [Shard(0)]),
    ("(3,) uneven cols", (3,), [Shard(1)]),
    ("(4,) replicate", (4,), [Replicate()]),
    ("(4,) shard1", (4,), [Shard(1)]),
    ("(2,2) shard0 shard1", (2, 2), [Shard(0), Shard(1)]),
    ("(2,2) two mesh dims one tensor dim", (2, 2), [Shard(0), Shard(0)]),
    ("(2,2) strided FSDP+TP", (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ("(2,1,2)", (2, 1, 2), [Shard(1), Replicate(), Shard(0)]),
]


@pytest.fixture(scope="module")
def single_device():
    """The world-size-1 result: the same program on a plain tensor, compiled."""
    torch._dynamo.reset()
    compile_rng.manual_seed(SEED)
    with compile_rng.layout("invariant"):
        fn = torch.compile(program, backend=compile_rng.backend(layout="invariant", inner="aot_eager"))
        out = fn(torch.zeros(G))
    state = compile_rng.get_state()
    return out, state


def test_single_device_is_the_canonical_stream(single_device):
    (a, *_), _ = single_device
    want = ops.uniform(ops.make_key(SEED, 0), 0, list(G), [G[1], 1], -1.0, 1.0, torch.float32)
    assert torch.equal(a, want)


def _world(mesh_shape):
    n = 1
    for s in mesh_shape:
        n *= s
    return n


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_full_tensor_is_sharding_invariant(single_device, case, inner):
    _, mesh_shape, placements = case
    world = _world(mesh_shape)
    torch._dynamo.reset()
    run = program
    if inner != "eager":
        run = torch.compile(program, backend=compile_rng.backend(layout="invariant", inner=inner))
    want, want_state = single_device
    full = [torch.full(G, float("nan")) for _ in want]
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", torch.arange(world).view(mesh_shape))
            compile_rng.manual_seed(SEED)
            with compile_rng.layout("invariant"):
                outs = run(local_zeros(G, mesh, placements))
            assert compile_rng.get_state() == want_state
            shape, offset = compute_local_shape_and_global_offset(G, mesh, placements)
            window = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            for i, out in enumerate(outs):
                full[i][window] = out.to_local()
    for i, (got, ref) in enumerate(zip(full, want)):
        assert torch.equal(got, ref), (i, case[0])


def test_init_decorator_on_meta_built_tp_and_plain_modules():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 12)
            self.down = nn.Linear(12, 8)

    @compile_rng.init(layout="invariant", inner="aot_eager")
    def init_weights(model):
        for m in (model.up, model.down):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    torch._dynamo.reset()
    compile_rng.manual_seed(SEED)
    plain = MLP()
    init_weights(plain)
    want = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    assert 0.01 < float(want["up.weight"].std()) < 0.03
    world = 2
    full = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", list(range(world)))
            with torch.device("meta"):
                model = MLP()
            parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            model.to_empty(device="cpu")
            compile_rng.manual_seed(SEED)
            init_weights(model)
            for name, p in model.state_dict().items():
                shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
                full[name][tuple(slice(o, o + s) for o, s in zip(offset, shape))] = p.to_local()
    for name in want:
        assert torch.equal(full[name], want[name]), name


def test_tracker_mode_differs_from_invariant_when_sharded():
    def one(mode):
        world = 2
        full = torch.empty(G)
        for rank in range(world):
            with fake_rank(rank, world):
                mesh = DeviceMesh("cpu", list(range(world)))
                compile_rng.manual_seed(SEED)
                with compile_rng.layout(mode):
                    w = local_zeros(G, mesh, [Shard(1)])
                    nn.init.uniform_(w)
                full[:, rank * 4:(rank + 1) * 4] = w.to_local()
        return full

    assert not torch.equal(one("tracker"), one("invariant"))


def test_init_decorator_compiles_whole_graphs_and_matches_eager():
    def init_fn(w, b):
        nn.init.kaiming_uniform_(w, a=5**0.5)
        nn.init.normal_(b, 0.0, 0.1)

    outs = []
    for compile in ("auto", False):
        torch._dynamo.reset()
        fn = compile_rng.init(init_fn, layout="invariant", inner="aot_eager", compile=compile)
        compile_rng.manual_seed(SEED)
        w, b = torch.zeros(G), torch.zeros(7)
        fn(w, b)
        outs.append((w, b, compile_rng.get_state()))
        assert fn.compiled() == (compile == "auto")
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2] == (SEED, 96 + 8)


def test_init_compile_true_refuses_graph_breaks():
    torch._dynamo.reset()
    def init(w):
        torch._dynamo.graph_break()  # as torch 2.12+'s trunc_normal_ (its loop reads .item())
        nn.init.normal_(w, std=0.02)

    fn = compile_rng.init(init, compile=True, inner="aot_eager")
    with pytest.raises(RuntimeError, match="one graph"):
        fn(torch.zeros(G))
