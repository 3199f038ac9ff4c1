"""Failures stay loud and the stream stays defined: rank divergence, exceptions inside
compiled calls, recompilation, determinism across processes, bad inputs."""

import os
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import spawn

import compile_rng


@contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --- rank divergence: verify=True ---------------------------------------------------------


def _verify_worker(rank: int, world: int, scenario: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    compile_rng.manual_seed(7 + rank if scenario == "seeds" else 7)
    if scenario == "extra-op":
        # Both ranks run the first eager op on the mesh (it checks that they agree), then
        # only rank 1 runs another (eager DTensor random ops after that are collective-free).
        torch.rand_like(x)
        if rank == 1:
            torch.rand_like(x)
    fn = torch.compile(lambda t: F.dropout(t + 1, 0.5), backend=compile_rng.backend(inner="aot_eager", verify=True))
    try:
        fn(x)
    except Exception as e:  # noqa: BLE001 - the message is the test
        message = str(e)
    else:
        message = ""
    expected = {"seeds": "seed: ranks [0] have 7; ranks [1] have 8", "extra-op": "offset: ranks [0] have 32; ranks [1] have 64", "agree": ""}
    assert expected[scenario] in message and bool(message) == bool(expected[scenario]), message


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["agree", "seeds", "extra-op"])
def test_verify_names_the_diverging_ranks_on_every_rank(scenario):
    spawn(_verify_worker, 2, scenario)


def test_verify_env_variable(monkeypatch):
    from compile_rng import verify

    monkeypatch.setenv("COMPILE_RNG_VERIFY", "1")
    assert verify.enabled(False)
    monkeypatch.setenv("COMPILE_RNG_VERIFY", "0")
    assert not verify.enabled(False)


# --- exceptions, graph breaks, recompilation ----------------------------------------------


def test_exception_inside_a_compiled_call_consumes_the_whole_graph():
    torch._dynamo.reset()

    def fn(x, idx):
        return torch.rand(3) + x[idx], torch.rand(5)

    compiled = torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))
    compile_rng.manual_seed(1)
    compiled(torch.ones(4), torch.tensor([0, 1, 2]))
    assert compile_rng.get_state() == (1, 12)
    with pytest.raises(IndexError):
        compiled(torch.ones(4), torch.tensor([0, 1, 9]))  # fails inside the graph, after rand(3)
    # documented: a call reserves its graph's counters before running, so it consumed all 12
    assert compile_rng.get_state() == (1, 24)


def test_graph_breaks_give_the_values_of_one_graph_for_dtensors():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    def one_graph(x):
        return torch.rand_like(x) + F.dropout(x + 1, 0.5)

    def with_break(x):
        a = torch.rand_like(x)
        torch._dynamo.graph_break()
        return a + F.dropout(x + 1, 0.5)

    torch._dynamo.reset()
    with fake_rank(1, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        outs = []
        for fn in (one_graph, with_break):
            compile_rng.manual_seed(3)
            outs.append((torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))(local_zeros((4, 6), mesh, [Shard(0)])).to_local(), compile_rng.get_state()))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == (3, 48)


def _split_program(x):
    """Plain-tensor random ops in the eager code between graphs: a ``random_`` (Dynamo
    graph-breaks on it) and a ``torch.compiler.disable``d function."""
    a = torch.rand(5)
    b = x.clone().random_(0, 100)
    c = torch.compiler.disable(lambda t: torch.rand_like(t) + F.dropout(t + 1, 0.5))(x)
    return a, b, c, torch.randn(3)


def test_eager_segments_of_compile_rng_compile_stay_on_the_stream():
    import reference as ref

    x = torch.ones(6, 7)
    runs = []
    for run in ("eager_stream", "compile_rng.compile", "compile_rng.compile again"):
        compile_rng.manual_seed(11)
        if run == "eager_stream":
            with compile_rng.dispatch_modes.eager_stream():
                outs = _split_program(x)
        else:
            if run == "compile_rng.compile":
                torch._dynamo.reset()
                fn = compile_rng.compile(_split_program, inner="aot_eager")
            outs = fn(x)
        runs.append((outs, compile_rng.get_state()))
    n = 42
    assert runs[0][1] == runs[1][1] == runs[2][1] == (11, 8 + 3 * 44 + 4)
    for outs, _ in runs[1:]:
        for got, want in zip(outs, runs[0][0]):
            assert torch.equal(got, want)
    # independent reference: the scalar stream at the program-order bases 0, 8, 52, 96, 140
    a, b, c, _ = runs[1][0]
    assert a.tolist() == [ref.uniform01(11, 8 * 0 + i, "float32") for i in range(5)]
    assert b.flatten().tolist() == [float(ref.randint(11, 8 + i, 0, 100)) for i in range(n)]
    keep = [ref.keep_bernoulli(11, 96 + i, 0.5) for i in range(n)]
    expect_c = [ref.uniform01(11, 52 + i, "float32") + (4.0 if k else 0.0) for i, k in zip(range(n), keep)]
    assert c.flatten().tolist() == [float(torch.tensor(v, dtype=torch.float32)) for v in expect_c]
    assert len(fn.backend.plans) >= 2  # the function really was split


def test_torch_compile_string_backend_warns_where_dynamo_splits():
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="compile_rng.compile"):
        torch.compile(_split_program, backend=compile_rng.backend(inner="aot_eager"))(torch.ones(2, 3))
    torch._dynamo.reset()
    with warnings_as_errors():
        compile_rng.compile(_split_program, inner="aot_eager")(torch.ones(2, 3))


def test_compile_rng_compile_module_with_a_graph_break_matches_eager_stream():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, t):
            h = F.dropout(self.lin(t), 0.3)
            torch._dynamo.graph_break()
            return h + torch.compiler.disable(lambda u: torch.randn_like(u))(h)

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    compiled = compile_rng.compile(block, inner="aot_eager")
    compile_rng.manual_seed(5)
    got = compiled(x)
    compile_rng.manual_seed(5)
    with compile_rng.dispatch_modes.eager_stream():
        want = block(x)
    assert torch.equal(got, want) and compile_rng.get_state() == (5, 64)
    assert len(compiled.forward.backend.plans) == 2


def _segments_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from dtensor_reference import counters, keep, uniform
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    def program(x):
        a = torch.rand_like(x)
        plain = torch.compiler.disable(lambda: torch.rand(6))()  # eager, between graphs
        return a, plain, F.dropout(x + 1, 0.5)

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
    outs = []
    for run in ("eager", "compiled"):
        compile_rng.manual_seed(21)
        if run == "eager":
            with compile_rng.dispatch_modes.eager_stream():
                got = program(x)
        else:
            got = compile_rng.compile(program, inner="aot_eager")(x)
        outs.append([t.to_local() if hasattr(t, "to_local") else t for t in got])
        assert compile_rng.get_state() == (21, 24 + 8 + 24)
    for e, c in zip(*outs):
        assert torch.equal(e, c)
    a, plain, b = outs[1]
    assert torch.equal(a, uniform(21, counters(x, 0), a.shape))
    assert torch.equal(plain, uniform(21, list(range(24, 30)), (6,)))
    assert torch.equal(b, keep(21, counters(x, 32), b.shape, 0.5).float() * 2)
    gathered = [None] * world
    dist.all_gather_object(gathered, (plain, a))
    assert all(torch.equal(g[0], plain) for g in gathered)  # a plain tensor is a replica
    assert not torch.equal(gathered[0][1], gathered[1][1])  # shards differ


@pytest.mark.slow
def test_real_ranks_eager_segments_stay_on_the_stream():
    spawn(_segments_worker, 2)


def _outside_sub_mesh_worker(rank: int, world: int) -> None:
    from dtensor_reference import uniform
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    sub = DeviceMesh("cpu", [0])  # rank 1 is not in it
    local = torch.zeros(4, 3) if rank == 0 else torch.zeros(0)
    t = DTensor.from_local(local, sub, [Replicate()], run_check=False)
    compile_rng.manual_seed(4)
    eager = [torch.rand_like(t), t.clone().exponential_()]
    compiled = torch.compile(lambda u: torch.rand_like(u), backend=compile_rng.backend(inner="aot_eager"))(t)
    if rank == 0:
        assert torch.equal(eager[0].to_local(), uniform(4, list(range(12)), (4, 3)))
        assert torch.equal(compiled.to_local(), uniform(4, list(range(24, 36)), (4, 3)))
        assert compile_rng.get_state() == (4, 36)
    else:  # documented: a rank outside the op's mesh runs nothing and keeps its state
        assert all(o.to_local().numel() == 0 for o in (*eager, compiled))
        assert compile_rng.get_state() == (4, 0)
    # the divergence this leaves is caught by the next verified call on a common mesh
    world_mesh = init_device_mesh("cpu", (world,))
    w = DTensor.from_local(torch.zeros(2), world_mesh, [Replicate()], run_check=False)
    fn = torch.compile(lambda u: torch.rand_like(u), backend=compile_rng.backend(inner="aot_eager", verify=True))
    with pytest.raises(RuntimeError, match=r"offset: ranks \[0\] have 36; ranks \[1\] have 0"):
        fn(w)


@pytest.mark.slow
def test_rank_outside_a_sub_mesh_skips_the_op_and_verify_reports_the_divergence():
    spawn(_outside_sub_mesh_worker, 2)


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


# --- determinism across processes, thread counts and compile caches ------------------------

PROGRAM = textwrap.dedent(
    """
    import hashlib, sys, torch, compile_rng
    import torch.nn.functional as F
    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(123)
    x = torch.ones(300, 70)
    fn = torch.compile(lambda t: (torch.rand_like(t), torch.randn(257), F.dropout(t, 0.3), torch.randint(0, 9, (64,))),
                       backend="compile_rng")
    outs = [*fn(x), *fn(x)]
    h = hashlib.sha256()
    for o in outs:
        h.update(o.numpy().tobytes())
    print(h.hexdigest(), compile_rng.get_state())
    """
)


@pytest.mark.slow
def test_same_seed_same_values_across_processes_threads_and_caches(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = []
    for threads in ("1", "2", "2"):  # cold cache, then a different thread count, then a warm cache
        out = subprocess.run([sys.executable, str(script), threads], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.strip())
    assert runs[0] == runs[1] == runs[2]


# --- bad inputs: each error names the op/argument and the fix ------------------------------


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda x: F.dropout(x, 1.5), "p=1.5 is not a probability"),
        (lambda x: torch.bernoulli(x, float("nan")), "p=nan is not a probability"),
        (lambda x: x.to(torch.int64).uniform_(), "dtype torch.int64 has no continuous distribution"),
        (lambda x: x.exponential_(-1.0), "lambd=-1.0 is not positive"),
        (lambda x: x.to(torch.bool).normal_(), "floating-point|no continuous distribution"),
    ],
    ids=["dropout p>1", "bernoulli p nan", "integer uniform_", "negative rate", "bool normal_"],
)
def test_bad_arguments_are_named(fn, match):
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))(torch.ones(4))


def test_bad_arguments_on_dtensors_in_eager():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        x = local_zeros((4, 2), mesh, [Shard(0)])
        with pytest.raises((ValueError, RuntimeError), match="floating-point|no continuous distribution"):
            x.to(torch.int32).normal_()
        with pytest.raises(ValueError, match="is not a probability"):
            x.bernoulli_(-0.5)


def test_generator_argument_in_an_eager_segment_is_named():
    def fn(x):
        return x + torch.rand(4, generator=torch.Generator().manual_seed(0))  # Dynamo runs it eagerly

    torch._dynamo.reset()
    with pytest.raises(NotImplementedError, match="generator= inside compile_rng's stream; drop the argument"):
        compile_rng.compile(fn, inner="aot_eager")(torch.ones(4))


def test_dtensor_operands_from_another_mesh_or_plain_tensors_are_refused():
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    with fake_rank(0, 2):
        mesh, reversed_mesh = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1, 0])
        x = local_zeros((4, 4), mesh, [Shard(0)])
        p = DTensor.from_local(torch.full((2, 4), 0.5), reversed_mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"bernoulli_.Tensor: an operand lives on the cpu mesh of ranks \[1, 0\]"):
            x.clone().bernoulli_(p)
        with pytest.raises(ValueError, match="mixes a torch.Tensor operand with a DTensor"):
            x.clone().bernoulli_(torch.full((2, 4), 0.5))


def _operand_layout_worker(rank: int, world: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    probabilities = torch.tensor([[1.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4])  # rows 0-1 certain, rows 2-3 never
    for placement in ([Replicate()], [Shard(1)], [Shard(0)]):
        p = distribute_tensor(probabilities, mesh, placement)
        got = x.clone().bernoulli_(p).to_local()
        assert torch.equal(got, torch.full((2, 4), 1.0 if rank == 0 else 0.0)), (placement, got)


@pytest.mark.slow
def test_bernoulli_probabilities_in_another_layout_follow_the_target_shard_on_real_ranks():
    spawn(_operand_layout_worker, 2)
