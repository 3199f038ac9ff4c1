"""Uneven ``_StridedShard`` (FSDP2 x TP on a dim the mesh does not divide, like GPT-2's
50257-row vocabulary) in invariant layout: every rank's local values, assembled, are the
single device's tensor, which is the scalar reference at the global counters.

Fake-process-group sweep over every rank. The assembly uses DTensor's own split of the
placements (``_split_tensor`` applied left to right to the global row-major indices),
so it is independent of compile_rng's layout code. On a 2x2 mesh each rank's shard is
one run of rows; on a 1-D mesh or a 3x2 mesh a shard spans several ``_StridedShard``
pieces and is drawn piece by piece.
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

SEED = 7
P = 0.3


def fsdp_tp(dim: int) -> list:
    """FSDP2's placements on top of TP's ``Shard(dim)`` on a (dp, tp=2) mesh."""
    return [_StridedShard(dim, split_factor=2), Shard(dim)]


# (name, mesh shape, placements, global shape, trunc_normal_ std). A std of 1 makes
# trunc_normal_ redraw rejected elements, which needs one affine window per shard.
CASES = [
    ("2x2 rows 10", (2, 2), fsdp_tp(0), (10, 3), 1.0),
    ("2x2 rows 11", (2, 2), fsdp_tp(0), (11, 3), 1.0),
    ("2x2 rows 13", (2, 2), fsdp_tp(0), (13, 2), 1.0),
    ("2x2 rows 7", (2, 2), fsdp_tp(0), (7, 4), 1.0),
    ("2x2 rows 3 (empty shard)", (2, 2), fsdp_tp(0), (3, 5), 1.0),
    ("2x2 cols 13", (2, 2), fsdp_tp(1), (3, 13), 1.0),
    ("1-D strided only, pieces", (2,), [_StridedShard(0, split_factor=2)], (7, 3), 0.02),
    ("3x2 rows 13, pieces", (3, 2), fsdp_tp(0), (13, 2), 0.02),
    ("3x2 cols 19, pieces", (3, 2), fsdp_tp(1), (2, 19), 0.02),
    ("2x2 replicate + strided, pieces", (2, 2), [Replicate(), _StridedShard(0, split_factor=2)], (11, 2), 0.02),
]


def make_program(trunc_std: float):
    @compile_rng.init(mode="invariant")
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


def test_trunc_normal_redraws_on_pieces_refuse_clearly():
    """trunc_normal_'s redraws read one affine window; a shard of several pieces says so."""
    mesh_shape, placements, shape = (2,), [_StridedShard(0, split_factor=2)], (7, 3)
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", list(range(2)))
        with pytest.raises(NotImplementedError, match="affine only piecewise.*trunc_normal_"):
            make_program(1.0)(local_zeros(shape, mesh, placements))


FIX = r"NotImplementedError: compile_rng: aten.rand_like.default .*@compile_rng.init.*divides evenly"


def test_compiled_graph_refuses_clearly():
    """Compiled graphs trace the coordinate symbolically and do not draw pieces yet."""

    def fn(w):
        return torch.rand_like(w)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=compile_rng.backend(layout="invariant", inner="aot_eager"))
    with fake_rank(0, 4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2))
        # Dynamo wraps the backend's error (BackendCompilerFailed), keeping its text.
        with compile_rng.mode("invariant"), pytest.raises(Exception, match=FIX):
            compiled(local_zeros((11, 3), mesh, fsdp_tp(0)))
