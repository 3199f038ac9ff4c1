"""Graph breaks and exceptions inside compiled calls: the stream stays where one graph
would leave it (``compile_rng.compile``), and ``backend="compile_rng"`` says where it
cannot."""

import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from dtensor_reference import ceil4

import compile_rng
from compile_rng.launch import spawn


@contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_exception_inside_a_compiled_call_consumes_the_whole_graph():
    torch._dynamo.reset()

    def fn(x, idx):
        return torch.rand(3) + x[idx], torch.rand(5)

    compiled = torch.compile(fn, backend=compile_rng.backend(inner="aot_eager"))
    compile_rng.manual_seed(1)
    compiled(torch.ones(4), torch.tensor([0, 1, 2]))
    graph_advance = ceil4(3) + ceil4(5)  # rand(3), rand(5)
    assert compile_rng.get_state() == (1, graph_advance)
    with pytest.raises(IndexError):
        compiled(torch.ones(4), torch.tensor([0, 1, 9]))  # fails inside the graph, after rand(3)
    # documented: a call reserves its graph's counters before running, so it consumed them all
    assert compile_rng.get_state() == (1, 2 * graph_advance)


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
    # rand_like and dropout each reserve ceil4(numel(global)) on every rank, in either split
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == (3, 2 * ceil4(4 * 6))


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
            with compile_rng.eager.dispatch_modes.eager_stream():
                outs = _split_program(x)
        else:
            if run == "compile_rng.compile":
                torch._dynamo.reset()
                fn = compile_rng.compile(_split_program, inner="aot_eager")
            outs = fn(x)
        runs.append((outs, compile_rng.get_state()))
    # program order of the draws and what each reserves (contract: ceil4(numel) per op):
    # rand(5), random_ on x, rand_like(x) and dropout(x + 1) in the disabled function, randn(3)
    n = x.numel()
    advances = [ceil4(5), ceil4(n), ceil4(n), ceil4(n), ceil4(3)]
    bases = [sum(advances[:k]) for k in range(len(advances))]  # 0, 8, 52, 96, 140
    assert runs[0][1] == runs[1][1] == runs[2][1] == (11, sum(advances))
    for outs, _ in runs[1:]:
        for got, want in zip(outs, runs[0][0]):
            assert torch.equal(got, want)
    # independent reference: the scalar stream at those program-order bases
    a, b, c, _ = runs[1][0]
    assert a.tolist() == [ref.uniform01(11, bases[0] + i, "float32") for i in range(5)]
    assert b.flatten().tolist() == [float(ref.randint(11, bases[1] + i, 0, 100)) for i in range(n)]
    keep = [ref.keep_bernoulli(11, bases[3] + i, 0.5) for i in range(n)]
    expect_c = [ref.uniform01(11, bases[2] + i, "float32") + (4.0 if k else 0.0) for i, k in zip(range(n), keep)]
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
    with compile_rng.eager.dispatch_modes.eager_stream():
        want = block(x)
    # dropout and randn_like, each over the (4, 8) activations
    assert torch.equal(got, want) and compile_rng.get_state() == (5, 2 * ceil4(x.numel()))
    assert len(compiled.forward.backend.plans) == 2


def _segments_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from dtensor_reference import counters, keep, uniform
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    global_shape, plain_numel = (8, 3), 6  # x's global shape; the plain rand's size

    def program(x):
        a = torch.rand_like(x)
        plain = torch.compiler.disable(lambda: torch.rand(plain_numel))()  # eager, between graphs
        return a, plain, F.dropout(x + 1, 0.5)

    # program order of the draws and what each reserves (ceil4(numel(global)) on every rank):
    # rand_like(x), the eager rand(6) between graphs, dropout(x + 1)
    x_advance = ceil4(global_shape[0] * global_shape[1])  # 24
    advances = [x_advance, ceil4(plain_numel), x_advance]  # 24, 8, 24
    bases = [sum(advances[:k]) for k in range(len(advances))]  # 0, 24, 32
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.zeros(global_shape), mesh, [Shard(0)])
    outs = []
    for run in ("eager", "compiled"):
        compile_rng.manual_seed(21)
        if run == "eager":
            with compile_rng.eager.dispatch_modes.eager_stream():
                got = program(x)
        else:
            got = compile_rng.compile(program, inner="aot_eager")(x)
        outs.append([t.to_local() if hasattr(t, "to_local") else t for t in got])
        assert compile_rng.get_state() == (21, sum(advances))  # 24 + 8 + 24
    for e, c in zip(*outs):
        assert torch.equal(e, c)
    a, plain, b = outs[1]
    assert torch.equal(a, uniform(21, counters(x, bases[0]), a.shape))
    assert torch.equal(plain, uniform(21, list(range(bases[1], bases[1] + plain_numel)), (plain_numel,)))
    assert torch.equal(b, keep(21, counters(x, bases[2]), b.shape, 0.5).float() * 2)
    gathered = [None] * world
    dist.all_gather_object(gathered, (plain, a))
    assert all(torch.equal(g[0], plain) for g in gathered)  # a plain tensor is a replica
    assert not torch.equal(gathered[0][1], gathered[1][1])  # shards differ


@pytest.mark.slow
def test_real_ranks_eager_segments_stay_on_the_stream():
    spawn(_segments_worker, 2)
