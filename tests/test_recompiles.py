"""Long jobs that recompile: compile_rng keeps nothing alive per compiled graph (the
trace-time data of a DTensor random op lives on its graph node and goes with it)."""

import gc

import torch
import torch.nn.functional as F
from dtensor_reference import fake_rank, local_zeros
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import compile_rng
from compile_rng.semantics import pending_key


def _live(kind: type) -> int:
    gc.collect()
    return sum(isinstance(o, kind) for o in gc.get_objects())


def _reachable(root: object) -> list:
    seen, todo, out = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        out.append(obj)
        todo.extend(gc.get_referents(obj))
    return out


def test_many_compiles_leave_no_trace_time_data_behind():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    backend = compile_rng.backend(inner="aot_eager")
    sites = []
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        for rows in (4, 8, 12, 16, 20):
            torch._dynamo.reset()
            x = local_zeros((rows, 4), mesh, [Shard(0)])
            out = torch.compile(lambda t: F.dropout(t + 1, 0.5), backend=backend, dynamic=False)(x)
            assert out.to_local().shape == (rows // 2, 4)
            del x, out
            torch._dynamo.reset()
            sites.append(_live(pending_key.Site))
    assert len(backend.plans) == 5 and all(len(p.ops) == 1 for p in backend.plans)  # the pass saw every site
    # Flat: graphs compiled elsewhere in the session may still be alive, these are not.
    assert sites == [sites[0]] * 5, sites
    # What the backend keeps for dumps and explain holds no traced SymInt (whose ShapeEnv
    # would stay alive with it). (torch's own lru_caches keep recent ShapeEnvs; not ours.)
    kept = _reachable(backend.plans)
    assert not any(isinstance(o, (torch.SymInt, ShapeEnv)) for o in kept)


def test_recompilation_never_double_advances():
    torch._dynamo.reset()
    be = compile_rng.backend(inner="aot_eager")
    fn = torch.compile(lambda x: torch.rand_like(x) * 2, backend=be, dynamic=False)
    compile_rng.manual_seed(2)
    fn(torch.ones(5))
    fn(torch.ones(9))  # recompiles for the new shape
    fn(torch.ones(5))
    assert len(be.plans) == 2
    assert compile_rng.get_state() == (2, 8 + 12 + 8)
