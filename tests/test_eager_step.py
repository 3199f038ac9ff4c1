"""Eager code inside ``compile_rng.step`` draws what a batched graph draws.

Inside a step every eager random op - a model that is not compiled, the eager code
between the graphs of a split function, SDPA's attention dropout, an eager DTensor op -
takes the counters of its rows of the step's global batch. Checked against the scalar
reference (the single-device stream at global row-major counters, as
``test_batched.py`` derives it), against the compiled batched graph (masks and state
exactly, values to float64 rounding: Inductor's ``tanh`` is not eager's), across fake
data-parallel ranks and microbatches (bitwise), and on real gloo ranks.
"""

import warnings

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from dtensor_reference import fake_rank
from test_batched import B, D, P, S, SEED, _input, _run, block, sequence_parallel_rows
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import compile_rng
from compile_rng.launch import spawn


def split_block(x):
    """``block`` with a graph break between its random ops (run compiled, it is two graphs
    and eager code)."""
    y = F.dropout(torch.tanh(x), P)
    torch._dynamo.graph_break()
    return F.dropout(y * 3, P) + torch.rand_like(x)


def _in_step(fn, x, **step_kwargs):
    compile_rng.manual_seed(SEED)
    with compile_rng.step(x.shape[0], **step_kwargs):
        out, grad = _run(fn, x)
    return out, grad, compile_rng.get_state()


@pytest.fixture(scope="module")
def eager():
    """The whole global batch, eagerly, in one step."""
    return _in_step(block, _input())


def _expected(x):
    """``block`` at the global counters, from the scalar reference: (values, advance)."""
    n = S * D
    advance = 4 * -(-B * n // 4)
    keep1 = torch.tensor([ref.keep_bernoulli(SEED, i, 1 - P) for i in range(B * n)]).view(B, S, D)
    keep2 = torch.tensor([ref.keep_bernoulli(SEED, advance + i, 1 - P) for i in range(B * n)]).view(B, S, D)
    uniform = torch.tensor([ref.uniform01(SEED, 2 * advance + i, "float64") for i in range(B * n)], dtype=torch.float64)
    scale = 1 / (1 - P)
    return torch.tanh(x) * keep1 * scale * 3 * keep2 * scale + uniform.view(B, S, D), 3 * advance


def test_eager_ops_in_a_step_draw_the_global_counters(eager):
    out, _, state = eager
    expected, advance = _expected(_input())
    assert (out - expected).abs().max() < 1e-12
    assert state == (SEED, advance)
    # the dropped elements are exactly the reference's
    x = _input()
    compile_rng.manual_seed(SEED)
    with compile_rng.step(B):
        mask = F.dropout(torch.ones_like(x), P) != 0
    assert torch.equal(mask, torch.tensor([ref.keep_bernoulli(SEED, i, 1 - P) for i in range(B * S * D)]).view(B, S, D))


@pytest.mark.parametrize("fn", [block, split_block], ids=["one graph", "graph break"])
def test_compiled_and_eager_agree_in_a_step(eager, fn):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=compile_rng.backend(layout="invariant", batched=True))
    with warnings.catch_warnings():
        # inside a step the eager code between graphs is on the stream: nothing to warn about
        warnings.filterwarnings("error", "compile_rng: Dynamo split")
        out, grad, state = _in_step(compiled, _input())
    assert state == eager[2]
    # the input gradient is zero exactly where either dropout dropped: the same masks
    assert torch.equal(grad == 0, eager[1] == 0) and (grad == 0).any()
    assert (out - eager[0]).abs().max() < 1e-12
    assert (grad - eager[1]).abs().max() < 1e-12


@pytest.mark.parametrize("world", [2, 4])
def test_eager_data_parallel_ranks_assemble_to_the_global_batch(eager, world):
    x = _input()
    outs, grads = [], []
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", list(range(world)))
            rows = x.chunk(world)[rank]
            out, grad, state = _in_step(block, rows, data_parallel=mesh, global_batch=B)
            assert state == eager[2], rank
            outs.append(out)
            grads.append(grad)
    assert torch.equal(torch.cat(outs), eager[0])
    assert torch.equal(torch.cat(grads), eager[1])


@pytest.mark.parametrize("split", [(5, 5), (1, 9)], ids=str)
def test_eager_microbatches_draw_the_big_batch(eager, split):
    x = _input()
    compile_rng.manual_seed(SEED)
    outs = []
    with compile_rng.step(B) as step:
        for rows in x.split(list(split)):
            with step.microbatch(rows.shape[0]):
                outs.append(_run(block, rows)[0])
    assert torch.equal(torch.cat(outs), eager[0])
    assert compile_rng.get_state() == eager[2]


def test_eager_sequence_parallel_dtensor_with_data_parallel_rows(eager):
    """A 2x2 mesh (dp, tp), eagerly: rows over dp, the sequence ``Shard(1)`` over tp."""
    assert torch.equal(sequence_parallel_rows(block, eager[2]), eager[0])


def attention(q):
    """SDPA with attention dropout on ``q`` (batch, heads, seq, dim) as keys and values."""
    return F.scaled_dot_product_attention(q, q * 2, q.tanh(), dropout_p=0.3, is_causal=True)


def test_sdpa_attention_dropout_eager_equals_compiled():
    q = torch.randn(4, 2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=compile_rng.backend(layout="invariant", batched=True))
    results = {}
    for name, fn in (("eager", attention), ("compiled", compiled)):
        compile_rng.manual_seed(SEED)
        outs = []
        with compile_rng.step(4) as step:
            for rows in q.split(2):
                with step.microbatch(2):
                    outs.append(fn(rows))
        results[name] = torch.cat(outs), compile_rng.get_state()
    assert results["eager"][1] == results["compiled"][1] == (SEED, 4 * 2 * 8 * 8)
    assert (results["eager"][0] - results["compiled"][0]).abs().max() < 1e-12
    # the dropout is live: without it the output differs
    assert (results["eager"][0] - F.scaled_dot_product_attention(q, q * 2, q.tanh(), is_causal=True)).abs().max() > 1e-3


def test_an_eager_op_off_the_batch_is_refused():
    with compile_rng.step(3), pytest.raises(NotImplementedError, match=r"aten.rand.default on a tensor of shape \(7,\).*dim 0 must be the batch.*outside the step"):
        torch.rand(7)
    with fake_rank(0, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        x = DTensor.from_local(torch.ones(2, 5), mesh, [Shard(1)])
        with compile_rng.step(3), pytest.raises(NotImplementedError, match=r"shape \(2, 10\).*batch here has 3 rows"):
            F.dropout(x, 0.5)


def _gloo_body(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    x = _input().chunk(world)[rank]
    result = _in_step(split_block, x, data_parallel=dist.group.WORLD)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out)


@pytest.mark.slow
def test_real_ranks_eager_equals_one_process(eager, tmp_path):
    """Two gloo ranks, eager ``split_block``, rows gathered from the ranks' actual sizes."""
    out = str(tmp_path / "ranks.pt")
    spawn(_gloo_body, 2, out)
    gathered = torch.load(out)
    assert all(state == eager[2] for _, _, state in gathered)
    assert torch.equal(torch.cat([o for o, _, _ in gathered]), eager[0])
    assert torch.equal(torch.cat([g for _, g, _ in gathered]), eager[1])
