"""Uneven ``_StridedShard`` (FSDP2 x TP on a dim the mesh does not divide, like GPT-2's
50257-row vocabulary) in invariant layout: every rank's local values, assembled, are the
single device's tensor, which is the scalar reference at the global counters.

Fake-process-group sweep over every rank. The assembly uses DTensor's own split of the
placements (``_split_tensor`` applied left to right to the global row-major indices),
so it is independent of compile_rng's layout code. On a 2x2 mesh each rank's shard is
one run of rows; on a 1-D mesh or a 3x2 mesh a shard spans several ``_StridedShard``
pieces and is drawn piece by piece - eagerly (``@compile_rng.init``) and in compiled
graphs (each rank's traced for its coordinate), batched graphs included.
"""

import pytest
import reference as ref
import torch
import torch.nn as nn
import torch.nn.functional as F
from dtensor_reference import ceil4, fake_rank, local_zeros, uniform
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import compile_rng
from compile_rng.eager.dispatch_modes import eager_stream

SEED = 7
P = 0.3


def fsdp_tp(dim: int) -> list:
    """FSDP2's placements on top of TP's ``Shard(dim)`` on a (dp, tp=2) mesh."""
    return [_StridedShard(dim, split_factor=2), Shard(dim)]


# (name, mesh shape, placements, global shape, trunc_normal_ std). A std of 1 makes
# trunc_normal_ redraw rejected elements (at one affine window's counters, or by whole
# redraws where a shard is several pieces); 0.02 never redraws.
CASES = [
    ("2x2 rows 10", (2, 2), fsdp_tp(0), (10, 3), 1.0),
    ("2x2 rows 11", (2, 2), fsdp_tp(0), (11, 3), 1.0),
    ("2x2 rows 13", (2, 2), fsdp_tp(0), (13, 2), 1.0),
    ("2x2 rows 7", (2, 2), fsdp_tp(0), (7, 4), 1.0),
    ("2x2 rows 3 (empty shard)", (2, 2), fsdp_tp(0), (3, 5), 1.0),
    ("2x2 cols 13", (2, 2), fsdp_tp(1), (3, 13), 1.0),
    ("1-D strided only, pieces", (2,), [_StridedShard(0, split_factor=2)], (7, 3), 1.0),
    ("3x2 rows 13, pieces", (3, 2), fsdp_tp(0), (13, 2), 1.0),
    ("3x2 cols 19, pieces", (3, 2), fsdp_tp(1), (2, 19), 0.02),
    ("2x2 replicate + strided, pieces", (2, 2), [Replicate(), _StridedShard(0, split_factor=2)], (11, 2), 1.0),
]


def make_program(trunc_std: float):
    @compile_rng.init(layout="invariant")
    def program(w):
        nn.init.uniform_(w, -1.0, 1.0)
        a = w.clone()
        nn.init.normal_(w, 0.0, 0.5)
        b = w.clone()
        d = F.dropout(torch.ones_like(w), P)
        e = torch.rand_like(w)
        state = compile_rng.get_state()
        nn.init.trunc_normal_(w, std=trunc_std)
        return (a, b, d, e, w.clone()), state

    return program


def global_indices(shape, mesh_shape, placements, coords) -> torch.Tensor:
    """Row-major global indices of the local shard at ``coords``, by DTensor's own split."""
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            x = p._split_tensor(x, mesh_shape[mesh_dim], with_padding=False)[0][coords[mesh_dim]]
    return x


def single_device(shape, trunc_std):
    compile_rng.manual_seed(SEED)
    outs, state = make_program(trunc_std)(torch.zeros(shape))
    return outs, state, compile_rng.get_state()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_assembled_shards_are_the_single_device_tensor(case):
    _, mesh_shape, placements, shape, trunc_std = case
    want, want_state, want_end = single_device(shape, trunc_std)
    world = torch.Size(mesh_shape).numel()
    full = [torch.full(shape, float("nan")) for _ in want]
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", torch.arange(world).view(mesh_shape))
            compile_rng.manual_seed(SEED)
            outs, state = make_program(trunc_std)(local_zeros(shape, mesh, placements))
            assert state == want_state
            if trunc_std < 1:
                # With redraws the count comes from a mesh all-reduce, which the fake
                # process group does not perform.
                assert compile_rng.get_state() == want_end
            index = global_indices(shape, mesh_shape, placements, mesh.get_coordinate())
            for out, f in zip(outs, full):
                assert out.placements == tuple(placements)
                f.view(-1)[index.reshape(-1)] = out.to_local().reshape(-1)
    for i, (got, ref_) in enumerate(zip(full, want)):
        assert torch.equal(got, ref_), (case[0], i)


@pytest.mark.parametrize("shape", [(13, 2), (3, 7)])
def test_single_device_is_the_scalar_reference(shape):
    (a, b, d, e, _), _, _ = single_device(shape, 1.0)
    n = a.numel()
    cs = list(range(n))
    base = [k * ceil4(n) for k in range(4)]
    assert torch.equal(a, uniform(SEED, [base[0] + c for c in cs], shape, -1.0, 1.0))
    normal = torch.tensor([ref.normal_std(SEED, base[1] + c) for c in cs], dtype=torch.float64).view(shape)
    torch.testing.assert_close(b.double(), normal * 0.5, rtol=1e-5, atol=1e-6)
    keep = torch.tensor([ref.keep_bernoulli(SEED, base[2] + c, 1 - P) for c in cs]).view(shape)
    assert torch.equal(d != 0, keep)
    assert torch.equal(e, uniform(SEED, [base[3] + c for c in cs], shape))


def _functional(w):
    return torch.rand_like(w), torch.randn_like(w), F.dropout(torch.ones_like(w), P)


def _assembled(case, run) -> list[torch.Tensor]:
    """Every rank's ``run(local input)`` placed at its global indices."""
    _, mesh_shape, placements, shape, _ = case
    world = torch.Size(mesh_shape).numel()
    full = None
    for rank in range(world):
        with fake_rank(rank, world):
            torch._dynamo.reset()
            mesh = DeviceMesh("cpu", torch.arange(world).view(mesh_shape))
            compile_rng.manual_seed(SEED)
            outs = run(local_zeros(shape, mesh, placements))
            full = full or [torch.full(shape, float("nan")) for _ in outs]
            index = global_indices(shape, mesh_shape, placements, mesh.get_coordinate())
            for out, f in zip(outs, full):
                f.view(-1)[index.reshape(-1)] = out.to_local().reshape(-1)
    return full


def _on_one_device(fn, shape) -> list[torch.Tensor]:
    compile_rng.manual_seed(SEED)
    with compile_rng.layout("invariant"), eager_stream():
        return fn(torch.zeros(shape))


# Inductor on the cases whose shards are several pieces, and one of a single run
INDUCTOR_CASES = [c for c in CASES if c[0] in ("2x2 rows 11", "3x2 cols 19, pieces")]


@pytest.mark.parametrize(
    "inner, case",
    [("aot_eager", c) for c in CASES] + [("inductor", c) for c in INDUCTOR_CASES],
    ids=[f"aot_eager-{c[0]}" for c in CASES] + [f"inductor-{c[0]}" for c in INDUCTOR_CASES],
)
def test_compiled_graphs_draw_the_single_device_tensor(inner, case):
    """Each rank's graph draws its runs of rows at constant bounds (traced for its own
    coordinate); a shard of one run keeps the symbolic coordinate."""
    want = _on_one_device(_functional, case[3])
    backend = compile_rng.backend(layout="invariant", inner=inner)
    got = _assembled(case, lambda w: torch.compile(_functional, backend=backend)(w))
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    # normal: Inductor's log/sin/cos may round differently from the eager kernel's
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_compiled_init_draws_the_single_device_tensor():
    case = next(c for c in CASES if c[0] == "3x2 rows 13, pieces")

    @compile_rng.init(layout="invariant", compile=True)
    def init(w):
        nn.init.uniform_(w, -1.0, 1.0)
        return (w.clone(),)

    want = _on_one_device(lambda w: (nn.init.uniform_(w, -1.0, 1.0),), case[3])
    assert torch.equal(_assembled(case, init)[0], want[0])


def test_batched_graph_draws_microbatches_at_their_rows():
    """A batched graph's random op on uneven _StridedShard columns, two microbatches of
    a step: the rows assemble to one device's step on the whole batch."""
    rows, cols, mesh_shape = 4, 13, (2, 2)
    backend = compile_rng.backend(layout="invariant", batched=True)
    compiled = torch.compile(lambda x: torch.rand_like(x), backend=backend)
    compile_rng.manual_seed(SEED)
    with compile_rng.step(rows):
        want = torch.rand(rows, cols)
    full = torch.full((rows, cols), float("nan"))
    for rank in range(4):
        with fake_rank(rank, 4):
            torch._dynamo.reset()
            mesh = DeviceMesh("cpu", torch.arange(4).view(mesh_shape))
            index = global_indices((rows // 2, cols), mesh_shape, fsdp_tp(1), mesh.get_coordinate())
            compile_rng.manual_seed(SEED)
            with compile_rng.step(rows) as step:
                for m in range(2):
                    with step.microbatch(rows // 2):
                        out = compiled(local_zeros((rows // 2, cols), mesh, fsdp_tp(1)))
                    full[m * 2 : (m + 1) * 2].reshape(-1)[index.reshape(-1)] = out.to_local().reshape(-1)
    assert torch.equal(full, want)
