"""AOTAutograd's cache serves compile_rng graphs: a hit returns the graph untraced, and
the backend loads the plan the compile that ran the pass filed (compile_rng.compiled.plan_store).

In one process, with a fresh Inductor cache folder: the first compile runs the pass and
files its plan; after ``torch._dynamo.reset()`` the same program hits AOTAutograd's
cache, and the loaded plan gives the call its advance - for the sizes of *this* call on
a dynamic-shape graph. Values are checked against the canonical stream
(``compile_rng.ops``), the state against ``ceil4`` of each op's numel.
"""

from __future__ import annotations

import shutil

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_rng
from compile_rng import ops
from compile_rng.compiled import plan_store
from compile_rng.passes.plan import RewrittenOp, RngPlan

SEED = 5


def program(x):
    return F.dropout(x, 0.25) + torch.rand_like(x)


def ceil4(n: int) -> int:
    return (n + 3) // 4 * 4


def reference(x: torch.Tensor, base: int) -> torch.Tensor:
    dropped, _ = ops.dropout(ops.make_key(SEED, base), 0, x, [x.shape[1], 1], 0.25)
    after = base + ceil4(x.numel())
    return dropped + ops.uniform(ops.make_key(SEED, after), 0, list(x.shape), [x.shape[1], 1], 0.0, 1.0, x.dtype)


def _compile_and_run(x: torch.Tensor) -> tuple[torch.Tensor, RngPlan, dict]:
    counters.clear()
    be = compile_rng.backend()
    compile_rng.manual_seed(SEED)
    out = torch.compile(program, backend=be, dynamic=True)(x)
    return out, be.plans[-1], dict(counters["aot_autograd"])


@pytest.mark.skipif(torch.__version__.startswith("2.12"), reason="torch 2.12's AOTAutograd cache does not hit "
                    "these graphs (cause not yet found; a miss compiles again, the values are unaffected)")
def test_a_cache_hit_loads_the_plan_the_pass_filed(cache_dir):
    x = torch.randn(6, 5)
    first, plan, aot = _compile_and_run(x)
    assert aot.get("autograd_cache_miss") == 1 and plan.pass_runs >= 1 and not plan.loaded_from_cache
    assert torch.equal(first, reference(x, 0))
    assert compile_rng.get_state() == (SEED, 2 * ceil4(30))

    torch._dynamo.reset()
    x = torch.randn(7, 5)  # another size: the advance is the filed expression at 35 elements
    got, cached, aot = _compile_and_run(x)
    assert aot.get("autograd_cache_hit") == 1 and cached.pass_runs == 0 and cached.loaded_from_cache
    assert torch.equal(got, reference(x, 0))
    assert compile_rng.get_state() == (SEED, 2 * ceil4(35))
    # the plan as the pass recorded it: ops, offsets, advance and code (no meshes)
    assert [(o.original, o.replacement) for o in cached.ops] == [(o.original, o.replacement) for o in plan.ops]
    assert sympy.simplify(cached.total_advance - plan.total_advance) == 0
    assert cached.graphs == plan.graphs


@pytest.mark.skipif(torch.__version__.startswith("2.12"), reason="torch 2.12's AOTAutograd cache does not hit "
                    "these graphs (cause not yet found; a miss compiles again, the values are unaffected)")
def test_a_hit_without_a_filed_plan_compiles_again(cache_dir):
    _compile_and_run(torch.randn(6, 5))
    shutil.rmtree(cache_dir / "compile_rng_plans")
    torch._dynamo.reset()
    x = torch.randn(6, 5)
    got, plan, aot = _compile_and_run(x)
    # the AOTAutograd hit had no plan: the backend compiled again without that cache
    assert aot.get("autograd_cache_hit") == 1 and plan.pass_runs >= 1 and not plan.loaded_from_cache
    assert torch.equal(got, reference(x, 0))
    assert compile_rng.get_state() == (SEED, 2 * ceil4(30))
    torch._dynamo.reset()  # that compile filed the plan under the hit's key
    got, plan, aot = _compile_and_run(x)
    assert aot.get("autograd_cache_hit") == 1 and plan.loaded_from_cache and torch.equal(got, reference(x, 0))


def test_an_unreadable_plan_compiles_again(cache_dir):
    _compile_and_run(torch.randn(6, 5))
    for path in (cache_dir / "compile_rng_plans").iterdir():
        path.write_bytes(b"not a pickle")
    torch._dynamo.reset()
    x = torch.randn(6, 5)
    got, plan, _ = _compile_and_run(x)
    assert plan.pass_runs >= 1 and torch.equal(got, reference(x, 0))
    assert compile_rng.get_state() == (SEED, 2 * ceil4(30))


def test_verify_compiles_run_the_pass(cache_dir):
    _compile_and_run(torch.randn(6, 5))
    torch._dynamo.reset()
    be = compile_rng.backend(verify=True)
    torch.compile(program, backend=be, dynamic=True)(torch.randn(6, 5))
    assert be.plans[-1].pass_runs >= 1 and not be.plans[-1].loaded_from_cache


def test_filed_symbols_are_renamed_to_the_asking_graphs_inputs(cache_dir):
    s0, s1, t = (sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1", "t"))
    op = RewrittenOp("aten.rand", "compile_rng.uniform", "u", "?", (s0, 4), torch.float32, sympy.Integer(0), 4 * s0)
    plan = RngPlan(name="g", ops=[op], total_advance=4 * s0 + s1, pass_runs=1)
    plan_store.save("k", plan, {s0: (0, 0), s1: (2, None)})
    loaded = plan_store.load("k", {(0, 0): t, (2, None): s0})
    assert loaded.total_advance == 4 * t + s0 and loaded.ops[0].local_shape == (t, 4)
    assert plan_store.load("k", {(0, 0): t}) is None  # an input the asking graph lacks
    assert plan_store.load("missing", {}) is None


@pytest.mark.skipif(not hasattr(__import__("torch.distributed.device_mesh").distributed.device_mesh.DeviceMesh,
                               "_stable_hash"), reason="torch 2.11 lifts no DeviceMesh into graphs (no _stable_hash)")
def test_the_mesh_cache_key_is_rank_free_inside_compile_rng_compiles_only():
    """Inside the backend's compile a DeviceMesh graph input pickles into Inductor's key
    by its ranks and layout, the same on every rank; outside it, as torch pickles it."""
    import torch._functorch._aot_autograd.autograd_cache as aot_cache
    from dtensor_reference import fake_rank
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.distributed.device_mesh import DeviceMesh

    from compile_rng._torch import dynamo_internals, inductor_internals

    def key_bytes(rank: int) -> bytes:
        with fake_rank(rank, 4):
            mesh = DeviceMesh("cpu", [0, 1, 2, 3])
            hash(mesh)  # torch's __dict__ then holds this process's hash() too
            fake = FakeScriptObject(object(), "torch.distributed.device_mesh.DeviceMesh", mesh)
            return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(fake)

    stock = (FxGraphCachePickler.__dict__["_reduce_fake_script_object"], aot_cache.autograd_cache_key)
    assert key_bytes(0) != key_bytes(3)  # torch's key: the rank is in it
    with inductor_internals.rank_free_mesh_cache_keys(), dynamo_internals.autograd_cache_keys(""):
        assert key_bytes(0) == key_bytes(3)
    assert (FxGraphCachePickler.__dict__["_reduce_fake_script_object"], aot_cache.autograd_cache_key) == stock
