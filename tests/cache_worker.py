"""One process of ``tests/test_caches.py``: fake rank ``argv[1]`` of 4 compiles a random
program with ``backend="compile_rng"`` (Inductor's cache folder from the environment) -
on a sharded DTensor (``argv[2] == "dtensor"``) or on plain tensors - and prints, as
JSON, Inductor's FX-graph cache counters, whether the values equal the canonical stream
(at torch's tracker offsets for the DTensor), the values and the state."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from dtensor_reference import fake_rank, local_zeros, tracker_start  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import compile_rng  # noqa: E402
from compile_rng import ops  # noqa: E402

SEED, WORLD, SHAPE = 21, 4, (12, 6)  # even shards: every rank runs the same graph


def program(x):
    return x.uniform_(-1.0, 1.0) * 2, torch.rand(5)


def plain_program(x):
    return torch.rand_like(x) * 2, torch.rand(5)


def report(values: torch.Tensor, ok: bool) -> None:
    print(json.dumps({
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "values_ok": ok,
        "state": list(compile_rng.get_state()),
        "values": values.flatten().tolist(),
    }))


def main(rank: int, kind: str) -> None:
    if kind == "plain":
        compile_rng.manual_seed(SEED)
        a, b = torch.compile(plain_program, backend="compile_rng")(torch.zeros(SHAPE))
        want = ops.uniform(ops.make_key(SEED, 0), 0, list(SHAPE), [SHAPE[1], 1], 0.0, 1.0, torch.float32) * 2
        report(a, torch.equal(a, want) and torch.equal(b, ops.uniform(ops.make_key(SEED, 72), 0, [5], [1], 0.0, 1.0, torch.float32)))
        return
    with fake_rank(rank, WORLD):
        mesh = DeviceMesh("cpu", list(range(WORLD)))
        compile_rng.manual_seed(SEED)
        x = local_zeros(SHAPE, mesh, [Shard(0)])
        shard, plain = torch.compile(program, backend="compile_rng")(x)
        ref = local_zeros(SHAPE, mesh, [Shard(0)])
        start = tracker_start(ref, list(mesh.get_coordinate()))
        local_shape = list(ref.to_local().shape)
        want = ops.uniform(ops.make_key(SEED, start), 0, local_shape, [SHAPE[1], 1], -1.0, 1.0, torch.float32) * 2
        want_plain = ops.uniform(ops.make_key(SEED, 72), 0, [5], [1], 0.0, 1.0, torch.float32)
        report(shard.to_local(), torch.equal(shard.to_local(), want) and torch.equal(plain, want_plain))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
