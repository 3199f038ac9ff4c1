"""Op coverage on a sharded DTensor (fake process group, 4 ranks, Shard(0)).

For every random op: eager == compiled (aot_eager, one compile for all ranks), the
local shard equals the functional op evaluated at torch's tracker counters, shards
differ across ranks, and the state advances by ceil4(numel(global)). Ops with no
counter-based form, Partial inputs and user generators raise errors naming the op.
"""

import math

import pytest
import torch
import torch.nn as nn
from dtensor_reference import ceil4, fake_rank, local_zeros, tracker_start
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

import compile_rng
from compile_rng import ops

SEED = 5
WORLD = 4
GSHAPE = (8, 6)
F32 = torch.float32


def _st(shape):
    return [shape[1], 1]


# name -> (program on a zero DTensor x, expected local values from the functional ops)
CASES = {
    "uniform_": (lambda x: x.uniform_(-2.0, 2.0), lambda k, s: ops.uniform(k, 0, s, _st(s), -2.0, 2.0, F32)),
    "normal_": (lambda x: x.normal_(1.0, 2.0), lambda k, s: ops.normal(k, 0, s, _st(s), 1.0, 2.0, F32)),
    "exponential_": (lambda x: x.exponential_(2.0), lambda k, s: ops.exponential(k, 0, s, _st(s), 2.0, F32)),
    "log_normal_": (
        lambda x: x.log_normal_(0.5, 0.25),
        lambda k, s: torch.exp(ops.normal(k, 0, s, _st(s), 0.5, 0.25, F32)),
    ),
    "cauchy_": (
        lambda x: x.cauchy_(1.0, 3.0),
        lambda k, s: torch.tan(ops.uniform(k, 0, s, _st(s), -0.5, 0.5, F32) * math.pi) * 3.0 + 1.0,
    ),
    "geometric_": (
        lambda x: x.geometric_(0.3),
        lambda k, s: torch.ceil(ops.exponential(k, 0, s, _st(s), -math.log1p(-0.3), torch.float64)).to(F32),
    ),
    "random_": (lambda x: x.random_(0, 10), lambda k, s: ops.randint(k, 0, s, _st(s), 0, 10, F32)),
    "bernoulli_": (lambda x: x.bernoulli_(0.3), lambda k, s: ops.bernoulli(k, 0, s, _st(s), 0.3, F32)),
    "bernoulli(p tensor)": (
        lambda x: torch.bernoulli(torch.full_like(x, 0.25)),
        lambda k, s: ops.bernoulli_tensor(k, 0, torch.full(s, 0.25), _st(s), F32),
    ),
    "rand_like": (lambda x: torch.rand_like(x), lambda k, s: ops.uniform(k, 0, s, _st(s), 0.0, 1.0, F32)),
    "randn_like": (lambda x: torch.randn_like(x), lambda k, s: ops.normal(k, 0, s, _st(s), 0.0, 1.0, F32)),
    "randint_like": (lambda x: torch.randint_like(x, 3, 9), lambda k, s: ops.randint(k, 0, s, _st(s), 3, 9, F32)),
    "dropout": (
        lambda x: nn.functional.dropout(x + 1, 0.2),
        lambda k, s: ops.dropout(k, 0, torch.ones(s), _st(s), 0.2)[0],
    ),
}


# Ops Dynamo does not trace (it graph-breaks and runs them eagerly).
def run_all_ranks(fn):
    """fn(mesh) on every rank; returns the per-rank results."""
    out = []
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            out.append(fn(DeviceMesh("cpu", list(range(WORLD)))))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_op_on_sharded_dtensor(name):
    program, expected = CASES[name]
    torch._dynamo.reset()
    be = compile_rng.backend(inner="aot_eager")
    compiled = torch.compile(lambda x: program(x) * 1, backend=be)
    adv = ceil4(math.prod(GSHAPE))  # 48: one op over the global (8, 6), on every rank

    def on_rank(mesh):
        results = []
        for fn in (lambda x: program(x) * 1, compiled):
            compile_rng.manual_seed(SEED)
            results.append(fn(local_zeros(GSHAPE, mesh, [Shard(0)])).to_local())
            assert compile_rng.get_state() == (SEED, adv)
        x = local_zeros(GSHAPE, mesh, [Shard(0)])
        start = tracker_start(x, list(mesh.get_coordinate()))
        want = expected(ops.make_key(SEED, start), list(x.to_local().shape))
        return results, want, len(be.plans)

    per_rank = run_all_ranks(on_rank)
    for (eager, comp), want, _ in per_rank:
        assert torch.equal(eager, comp)
        assert torch.equal(comp, want), (name, comp, want)
    locals_ = [r[0][1] for r in per_rank]
    assert not torch.equal(locals_[0], locals_[1])
    counts = [r[2] for r in per_rank]
    # compiled as rank 0, reused by all; an op Dynamo graph-breaks on (random_) runs
    # eagerly in the tracker's region, which Dynamo never compiles: it would fold the
    # rank into a constant and give every rank rank 0's shard
    assert counts == [counts[0]] * WORLD, counts


INITS = {
    "trunc_normal_": lambda w: nn.init.trunc_normal_(w, std=0.02),
    "kaiming_uniform_": lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
    "kaiming_normal_": lambda w: nn.init.kaiming_normal_(w),
    "xavier_uniform_": lambda w: nn.init.xavier_uniform_(w),
    "xavier_normal_": lambda w: nn.init.xavier_normal_(w),
    "normal_": lambda w: nn.init.normal_(w, 0.0, 0.5),
    "uniform_": lambda w: nn.init.uniform_(w, -0.1, 0.1),
}


@pytest.mark.parametrize("name", list(INITS))
def test_nn_init_eager_equals_compiled_and_shards_differ(name):
    init = INITS[name]
    torch._dynamo.reset()
    compiled = torch.compile(init, backend=compile_rng.backend(inner="aot_eager"))

    def on_rank(mesh):
        results = []
        for fn in (init, compiled):
            compile_rng.manual_seed(SEED)
            w = local_zeros(GSHAPE, mesh, [Shard(0)])
            fn(w)
            results.append(w.to_local().clone())
            state = compile_rng.get_state()
        return results, state

    per_rank = run_all_ranks(on_rank)
    for (eager, comp), state in per_rank:
        assert torch.equal(eager, comp), name
        assert state == per_rank[0][1]  # every rank advanced alike
    assert not torch.equal(per_rank[0][0][0], per_rank[1][0][0])


def test_partial_input_is_rejected():
    def on_rank(mesh):
        x = DTensor.from_local(torch.zeros(2, 3), mesh, [Partial()])
        for op in (lambda: x.uniform_(), lambda: torch.rand_like(x), lambda: x.exponential_()):
            with pytest.raises((ValueError, RuntimeError), match="Partial"):
                op()

    run_all_ranks(on_rank)


def test_user_generator_is_rejected():
    def on_rank(mesh):
        x = local_zeros(GSHAPE, mesh, [Shard(0)])
        with pytest.raises(NotImplementedError, match="generator"):
            x.uniform_(generator=torch.Generator().manual_seed(1))

    run_all_ranks(on_rank)


def test_other_backend_is_refused_loudly():
    torch._dynamo.reset()

    def on_rank(mesh):
        compile_rng.manual_seed(SEED)
        fn = torch.compile(lambda x: x.uniform_() * 1, backend="aot_eager")
        with pytest.raises(Exception, match="backend='compile_rng'"):
            fn(local_zeros(GSHAPE, mesh, [Shard(0)]))

    with fake_rank(0, WORLD):
        on_rank(DeviceMesh("cpu", list(range(WORLD))))


def test_dtensor_rand_and_randn_work_on_cpu_meshes():
    from torch.distributed.tensor import randn, rand

    rows, cols = GSHAPE
    adv = ceil4(rows * cols)  # 48: each op's advance, from its global (8, 6) shape (§2)

    def on_rank(mesh):
        compile_rng.manual_seed(SEED)
        a = rand(rows, cols, device_mesh=mesh, placements=[Shard(0)])
        b = randn(rows, cols, device_mesh=mesh, placements=[Shard(1)])
        coord = list(mesh.get_coordinate())
        local_a = [rows // WORLD, cols]  # [2, 6]: Shard(0) of 8 rows over 4 ranks
        want_a = ops.uniform(ops.make_key(SEED, tracker_start(a, coord)), 0, local_a, [cols, 1], 0.0, 1.0, F32)
        # b is the second op: its range starts where a's ends
        want_b = ops.normal(ops.make_key(SEED, adv + tracker_start(b, coord)), 0, list(b.to_local().shape),
                            [b.to_local().shape[1], 1], 0.0, 1.0, F32)
        assert torch.equal(a.to_local(), want_a)
        assert torch.equal(b.to_local(), want_b)
        assert compile_rng.get_state() == (SEED, 2 * adv)  # 96: rand then randn

    run_all_ranks(on_rank)
