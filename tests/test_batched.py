"""Invariant activations: a batched graph draws at its rows of the step's global batch.

Data-parallel ranks (fake process group, uneven last batch), microbatches and DTensor
sequence-parallel shards each assemble to the single-device tensors bitwise, forward
and backward (also under activation checkpointing); the single-device masks are the
scalar reference's Philox stream at the global row-major counters. Real gloo ranks:
``test_train_parity.py``.
"""

import contextlib

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from dtensor_reference import fake_rank
from device_threads import stream_key_in_thread_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import compile_rng

SEED = 11
B, S, D = 10, 4, 6  # 10 rows over 4 ranks: 3, 3, 3, 1 (torch.chunk, like Shard(0))
P = 0.4


def block(x):
    """Dropout twice and a uniform: the second op's base depends on the global batch."""
    y = F.dropout(torch.tanh(x), P)
    return F.dropout(y * 3, P) + torch.rand_like(x)


def checkpointed(x):
    return checkpoint(block, x, use_reentrant=False)


def _input():
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _run(fn, x):
    """Output and input gradient of ``fn`` on rows ``x``: the backward of a sum weighted by
    a function of each element's input (so the weights follow the rows to any rank)."""
    x = x.clone().requires_grad_()
    out = fn(x)
    (out * torch.cos(x.detach())).sum().backward()
    return out.detach(), x.grad


@pytest.fixture(scope="module")
def compiled():
    """One batched backend for the module: every rank's and microbatch's calls share it."""
    torch._dynamo.reset()
    be = compile_rng.backend(layout="invariant", batched=True)
    return be, torch.compile(block, backend=be), torch.compile(checkpointed, backend=be)


@pytest.fixture(scope="module")
def single(compiled):
    _, fn, _ = compiled
    compile_rng.manual_seed(SEED)
    out, grad = _run(fn, _input())
    return out, grad, compile_rng.get_state()


def test_single_device_is_the_stream_at_global_counters(single):
    out, _, state = single
    n = S * D
    advance = 4 * -(-B * n // 4)
    keep1 = torch.tensor([ref.keep_bernoulli(SEED, i, 1 - P) for i in range(B * n)]).view(B, S, D)
    keep2 = torch.tensor([ref.keep_bernoulli(SEED, advance + i, 1 - P) for i in range(B * n)]).view(B, S, D)
    uniform = torch.tensor([ref.uniform01(SEED, 2 * advance + i, "float64") for i in range(B * n)], dtype=torch.float64)
    x = _input()
    scale = 1 / (1 - P)
    expected = torch.tanh(x) * keep1 * scale * 3 * keep2 * scale + uniform.view(B, S, D)
    assert (out - expected).abs().max() < 1e-12
    assert torch.equal((out - uniform.view(B, S, D)) == 0, ~(keep1 & keep2))
    assert state == (SEED, 3 * advance)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ranks_assemble_to_single_device(compiled, single, world):
    _, fn, _ = compiled
    x = _input()
    outs, grads = [], []
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", list(range(world)))
            rows = x.chunk(world)[rank] if rank < len(x.chunk(world)) else x[:0]
            compile_rng.manual_seed(SEED)
            with compile_rng.step(rows.shape[0], data_parallel=mesh, global_batch=B):
                out, grad = _run(fn, rows)
            assert compile_rng.get_state() == single[2], rank  # every rank advances alike
            outs.append(out)
            grads.append(grad)
    assert torch.equal(torch.cat(outs), single[0])
    assert torch.equal(torch.cat(grads), single[1])


@pytest.fixture(scope="module")
def interleaved_backend():
    """A batched backend whose graphs compile in steps of interleaved rows (its own: the
    row spacing is a constant of a graph, one compile per spacing)."""
    return compile_rng.backend(layout="invariant", batched=True)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_ranks_and_their_microbatches_draw_the_single_device(single, interleaved_backend, world):
    """``DistributedSampler``'s rows (rank ``r`` holds global rows ``r, r + W, ...``) in a
    compiled batched graph: local row ``i`` draws global row ``r + i * W``'s counters, a
    stride the graph compiled with. Every rank, split in two microbatches, gives the single
    device's rows bitwise, forward and backward."""
    torch._dynamo.reset()
    fn = torch.compile(block, backend=interleaved_backend)
    x = _input()
    out, grad = torch.empty_like(single[0]), torch.empty_like(single[1])
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = DeviceMesh("cpu", list(range(world)))
            rows = x[rank::world]
            compile_rng.manual_seed(SEED)
            parts = []
            with compile_rng.step(rows.shape[0], data_parallel=mesh, global_batch=B, rows="interleaved") as step:
                assert step.rows.stride == world
                for part in rows.split([rows.shape[0] // 2, rows.shape[0] - rows.shape[0] // 2]):
                    with step.microbatch(part.shape[0]):
                        parts.append(_run(fn, part))
            assert compile_rng.get_state() == single[2], rank
            out[rank::world] = torch.cat([o for o, _ in parts])
            grad[rank::world] = torch.cat([g for _, g in parts])
    assert torch.equal(out, single[0]) and torch.equal(grad, single[1])
    assert not torch.equal(out[:world], single[0][:world].roll(1, 0))  # rows differ: the comparison can fail
    # the spacing is the graph's: a step of contiguous rows is refused, never drawn wrongly (the
    # same graph: a call that would compile another - no grad, say - gets the spacing it
    # compiles in). Outside a step on torch 2.13+ the thread's dispatch state differs (no
    # stream's key), so Dynamo compiles a graph of its own there, which draws the single
    # device's values; on 2.11 and 2.12 the same graph runs, and refuses.
    compile_rng.manual_seed(SEED)
    if stream_key_in_thread_state():
        assert torch.equal(_run(fn, x)[0], single[0])
    else:
        with pytest.raises(NotImplementedError, match=f"compiled for rows .* every {world}th row.* outside a step"):
            _run(fn, x)
    with pytest.raises(NotImplementedError, match=f"every {world}th row.*a contiguous block"):
        with compile_rng.step(B):
            _run(fn, x)


@pytest.mark.parametrize("split", [(5, 5), (4, 4, 2), (1, 9)], ids=str)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpoint"])
def test_microbatches_draw_the_big_batch(compiled, single, split, checkpointing):
    _, fn, ck = compiled
    x = _input()
    compile_rng.manual_seed(SEED)
    outs, grads = [], []
    with compile_rng.step(B) as step:
        for rows in x.split(list(split)):
            with step.microbatch(rows.shape[0]):
                out, grad = _run(ck if checkpointing else fn, rows)
            outs.append(out)
            grads.append(grad)
    assert torch.equal(torch.cat(outs), single[0])
    assert torch.equal(torch.cat(grads), single[1])
    assert compile_rng.get_state() == single[2]


def sequence_parallel_rows(fn, expected_state) -> torch.Tensor:
    """``fn`` on a 2x2 mesh (dp, tp): rows over dp, the sequence dim ``Shard(1)`` over tp, one
    step per fake rank; returns the ranks' outputs assembled (each rank's state must be
    ``expected_state``)."""
    x = _input()
    pieces = {}
    for rank in range(4):
        with fake_rank(rank, 4):
            mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
            dp, tp = divmod(rank, 2)
            rows = x.chunk(2)[dp]
            local = rows.chunk(2, dim=1)[tp].clone()
            compile_rng.manual_seed(SEED)
            with compile_rng.step(rows.shape[0], data_parallel=mesh["dp"], global_batch=B):
                out = fn(DTensor.from_local(local, mesh["tp"], [Shard(1)]))
            assert compile_rng.get_state() == expected_state, rank
            pieces[dp, tp] = out.to_local()
    return torch.cat([torch.cat([pieces[dp, 0], pieces[dp, 1]], dim=1) for dp in range(2)])


def test_sequence_parallel_dtensor_with_data_parallel_rows(single):
    """A 2x2 mesh (dp, tp): rows over dp, the sequence dim ``Shard(1)`` over tp."""
    torch._dynamo.reset()
    fn = torch.compile(block, backend=compile_rng.backend(layout="invariant", batched=True))
    assert torch.equal(sequence_parallel_rows(fn, single[2]), single[0])


def test_outside_a_step_the_call_is_the_whole_batch(compiled, single):
    _, fn, _ = compiled
    compile_rng.manual_seed(SEED)
    out, _ = _run(fn, _input())
    assert torch.equal(out, single[0])


def test_two_batch_inputs_after_a_dynamic_recompile_draw_the_stream():
    """At a second batch size Dynamo recompiles with dynamic shapes and gives each input's
    batch dim a size symbol of its own: the graph takes the two for one batch and checks it
    at every call. Both sizes, in microbatches, draw the scalar reference at the global
    counters; a call whose inputs disagree on the batch is refused and draws nothing."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(lambda x, p: (F.dropout(x, P), torch.bernoulli(p)),
                       backend=compile_rng.backend(layout="invariant", batched=True))
    for rows in (4, 6):
        g = torch.Generator().manual_seed(rows)
        x = torch.rand(rows, D, generator=g, dtype=torch.float64) + 0.5
        p = torch.rand(rows, D, generator=g, dtype=torch.float64)
        compile_rng.manual_seed(SEED)
        parts = []
        with compile_rng.step(rows) as step:
            for part in (slice(0, rows // 2), slice(rows // 2, rows)):
                with step.microbatch(rows // 2):
                    parts.append(fn(x[part], p[part]))
        advance = 4 * -(-rows * D // 4)
        keep = torch.tensor([ref.keep_bernoulli(SEED, i, 1 - P) for i in range(rows * D)]).view(rows, D)
        drawn = torch.tensor([ref.keep_bernoulli(SEED, advance + i, q) for i, q in enumerate(p.flatten().tolist())])
        dropped = torch.cat([d for d, _ in parts])
        assert torch.equal(dropped != 0, keep)
        assert (dropped - x * keep / (1 - P)).abs().max() < 1e-12
        assert torch.equal(torch.cat([b for _, b in parts]), drawn.view(rows, D).to(torch.float64))
        assert compile_rng.get_state() == (SEED, 2 * advance)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the second size: one dynamic graph
    compile_rng.manual_seed(SEED)
    with pytest.raises(NotImplementedError, match=r"bernoulli.*but this batched graph's batch has .*this call's sizes"):
        fn(torch.ones(5, D, dtype=torch.float64), torch.rand(3, D, dtype=torch.float64))
    assert compile_rng.get_state() == (SEED, 0)


# --- errors ------------------------------------------------------------------------


def test_batched_needs_invariant_mode():
    with pytest.raises(ValueError, match="batched=True needs layout='invariant'"):
        compile_rng.backend(batched=True)


def test_a_random_op_off_the_batch_is_refused():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: F.dropout(x, 0.5) + torch.rand(x.shape[1]),
                       backend=compile_rng.backend(layout="invariant", batched=True))
    with pytest.raises(Exception, match=r"aten.rand.default .*dim 0 of size 7.*batch has 3 rows"):
        fn(torch.ones(3, 7))


def test_rows_must_match_the_step(compiled):
    _, fn, _ = compiled
    with compile_rng.step(B) as step, pytest.raises(ValueError, match="activations of 3 rows.*holds 10 rows"):
        fn(torch.ones(3, S, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="microbatch of 6 rows after 5"):
        with compile_rng.step(B) as step:
            with step.microbatch(5):
                pass
            with step.microbatch(6):
                pass


def test_microbatches_must_draw_alike_and_cover_the_batch(compiled):
    _, fn, _ = compiled
    with pytest.raises(RuntimeError, match="different amounts of randomness"):
        with compile_rng.step(4) as step:
            with step.microbatch(2):
                fn(torch.ones(2, S, D, dtype=torch.float64))
            with step.microbatch(2):
                pass
    with pytest.raises(ValueError, match="covered 2 of this rank's 4 rows"):
        with compile_rng.step(4) as step:
            with step.microbatch(2):
                pass


def test_a_step_inside_a_microbatch_is_refused():
    """A step opened in a microbatch would draw at its own rows of its own batch, so every
    microbatch would get the same values: refused before it draws. A step of the enclosing
    rows inside a step changes nothing (the values and state of one flat step)."""
    compile_rng.manual_seed(SEED)
    with pytest.raises(RuntimeError, match="steps do not nest"):
        with compile_rng.step(4) as step, step.microbatch(2), compile_rng.step(2):
            torch.rand(2, 3)
    runs = []
    for nested in (False, True):
        compile_rng.manual_seed(SEED)
        with compile_rng.step(4):
            first = torch.rand(4, 3)
            with compile_rng.step(4) if nested else contextlib.nullcontext():
                second = torch.rand(4, 3)
        runs.append((first, second, compile_rng.get_state()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2]


def test_global_batch_must_match_the_chunk_layout():
    with fake_rank(1, 2):
        mesh = DeviceMesh("cpu", [0, 1])
        with pytest.raises(ValueError, match="coordinate 1 5 rows"):
            with compile_rng.step(4, data_parallel=mesh, global_batch=10):
                pass
