"""The parts of the CUDA path that run without a GPU.

* DTensor's accelerator branch (``_dispatch.py``: ``_compute_rng_offsets(spec)`` then
  ``run_dtensor_rng_op``), called as DTensor calls it for a CUDA DTensor, on the local
  shards of a CPU mesh (fake process group, 4 ranks): same values and state advance as
  the tracker's region, so a CUDA mesh gets compile_rng's semantics.
* The backend on a graph whose inputs are fake CUDA tensors: the key is a CUDA input,
  every random op is functional and reads it (no generator, no ``run_dtensor_rng_op``).
* Eager plain-tensor ops draw from the stream of their own device; meta tensors draw nothing.
"""

from __future__ import annotations

import pytest
import torch
from dtensor_reference import accelerator_branch, fake_rank, local_zeros
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import compile_rng
from compile_rng import dispatch_modes, dynamo_backend, torch_internals, tracker

WORLD = 4
aten = torch.ops.aten


@pytest.mark.parametrize("op", ["uniform_", "native_dropout"])
def test_the_accelerator_branch_runs_in_the_trackers_region(op):
    for rank in range(WORLD):
        with fake_rank(rank, WORLD):
            mesh = DeviceMesh("cpu", list(range(WORLD)))
            results = []
            for branch in ("region", "accelerator"):
                compile_rng.manual_seed(7)
                x = local_zeros((10, 6), mesh, [Shard(0)]) + 1.0
                if branch == "region":  # DTensor's CPU dispatch
                    out = x.uniform_(-1.0, 1.0) if op == "uniform_" else torch.ops.aten.native_dropout(x, 0.3, True)[0]
                    results.append((out.to_local().clone(), compile_rng.get_state()))
                else:
                    local = x.to_local().clone()
                    if op == "uniform_":
                        out = accelerator_branch(x, aten.uniform_.default, local, -1.0, 1.0)
                    else:
                        out = accelerator_branch(x, aten.native_dropout.default, local, 0.3, True)[0]
                    results.append((out, compile_rng.get_state()))
            (want, want_state), (got, got_state) = results
            assert torch.equal(got, want)
            assert got_state == want_state == (7, 60)  # ceil4(10 * 6) on every rank


def test_the_hook_leaves_other_offsets_to_torch_and_uninstall_restores_it():
    calls = []
    hook = tracker.run_dtensor_rng_op_hook(lambda *a, **k: calls.append((a, k)) or "stock")
    assert hook(0, 8, aten.rand.default, [2]) == "stock" and calls == [((0, 8, aten.rand.default, [2]), {})]
    installed = torch_internals.dtensor_dispatch().run_dtensor_rng_op
    compile_rng.uninstall()
    try:
        assert torch_internals.dtensor_dispatch().run_dtensor_rng_op is installed._compile_rng_stock
    finally:
        compile_rng.install()
    assert torch_internals.dtensor_dispatch().run_dtensor_rng_op._compile_rng_stock is installed._compile_rng_stock


def test_a_cuda_graph_gets_a_cuda_key_and_only_functional_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x):
        return (torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x) + torch.randn(3, 4, device=x.device),)

    with FakeTensorMode():
        x = torch.empty(3, 4, device="cuda")
    gm = torch.fx.symbolic_trace(f)
    assert dynamo_backend._graph_device(gm, [x]) == torch.device("cuda", 0)
    be = compile_rng.backend(inner="aot_eager")
    be(gm, [x])
    (plan,) = be.plans
    (graph,) = plan.graphs
    assert plan.total_advance == 36
    assert "torch.ops.compile_rng.dropout" in graph and "torch.ops.compile_rng.normal" in graph
    assert "aten.rand" not in graph and "native_dropout" not in graph and "run_dtensor_rng_op" not in graph


def test_eager_plain_ops_draw_on_their_device_and_meta_draws_nothing():
    with dispatch_modes.eager_stream():
        t = torch.rand(5, device="meta")
        assert t.device.type == "meta"
        assert compile_rng.get_state() == (0, 0)
        u = torch.rand(5)
    assert u.device.type == "cpu" and compile_rng.get_state() == (0, 8)
