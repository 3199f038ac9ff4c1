"""One compile per job (compile_rng.compiled.job_compile): 4 gloo ranks compiling the
demo's tensor-parallel MLP (forward and backward) queue on one lock per graph, so
Inductor compiles each graph once on the node and the other ranks load its artifact.

Every rank's masks and values equal what the rank gets compiling alone (Inductor's
FX-graph cache off: its own codegen), bitwise. Rank 3 gets a cache folder of its own,
where the others' artifacts are not: its load misses, it compiles itself and still
matches. Without the queue every rank misses (``COMPILE_RNG_JOB_COMPILE=0``: one miss
per graph on every rank, the count this test rejects).
"""

import os

import pytest
import torch

from compile_rng.launch import results_dict, spawn

WORLD = 4
GRAPHS = 2  # the forward and the backward


def _run(rank: int, world: int, cache_dir: str, results: dict) -> None:
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import Replicate, distribute_tensor

    from compile_rng import demo

    # rank 3's cache folder holds nothing the others compiled: its load misses
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir + ("-alone" if rank == 3 else "")

    def step():
        torch._dynamo.reset()
        model, mesh = demo._build(world)
        torch.manual_seed(demo.SEED)
        demo.init_weights(model)
        x = distribute_tensor(torch.ones(demo.BATCH, demo.DIM), mesh, [Replicate()])
        out = torch.compile(model, backend="compile_rng")(x)
        out.to_local().sum().backward()
        return out.to_local().detach(), model.up.weight.grad.to_local().clone()

    counters.clear()
    queued = step()
    tally = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    with inductor_config.patch(fx_graph_cache=False):
        alone = step()
    results[rank] = (tally, all(torch.equal(a, b) for a, b in zip(queued, alone)), queued)


@pytest.mark.slow
def test_ranks_compile_each_graph_once_and_match_compiling_alone(tmp_path):
    results = results_dict()
    spawn(_run, WORLD, str(tmp_path / "inductor"), results)
    results = dict(results)
    for rank in range(WORLD):
        assert results[rank][1], f"rank {rank}: the queued compile differs from compiling alone"
    queued = [results[r][0] for r in range(3)]
    assert sum(t.get("fxgraph_cache_miss", 0) for t in queued) == GRAPHS, queued
    assert sum(t.get("fxgraph_cache_hit", 0) for t in queued) == 2 * GRAPHS, queued
    assert results[3][0].get("fxgraph_cache_miss", 0) == GRAPHS, results[3][0]
    # the masks are the ranks' own: the hidden activation's dropout is sharded
    grads = [results[r][2][1] for r in range(WORLD)]
    assert all(not torch.equal(grads[0], g) for g in grads[1:])
