"""The edge of the stream: ordinary code around a step gets exact values or a clear error.

Each case here was silent before (other values, no error): a checkpointed forward
recomputed by a ``backward()`` after the step's block, or on a device thread, or from a
forward that ran outside every stream; torch's CUDA generator moved backwards between
microbatches; batch-dim rules that trusted a size; a gradient hook's draw taken for
activation rows; a process forked inside a step; ``uninstall()`` inside one. The CUDA
cases run here with the suite's stand-ins (another thread handed the caller's thread
state, as the autograd engine hands its device threads; a generator object for the
CUDA one) and on a GPU in ``tests/gpu/``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import compile_rng
from device_threads import on_a_device_thread
from compile_rng.eager import random_kernels
from compile_rng.eager.batches import open_step
from compile_rng.stream import state

ROWS = {"whole": {}, "second half": {"rows": [4, 5, 6, 7], "global_batch": 8}}


def _block() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(32, 32), torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


def _input_grad(lin: nn.Linear, x: torch.Tensor, ckpt: dict | None, rows: dict, backward_inside: bool) -> torch.Tensor:
    def block(t):
        return F.dropout(lin(t), 0.3)

    part = x.clone().requires_grad_()
    compile_rng.manual_seed(4)
    with compile_rng.step(4, **rows):
        out = checkpoint(block, part, **ckpt) if ckpt is not None else block(part)
        loss = out.square().sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return part.grad


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("rows", list(ROWS), ids=list(ROWS))
def test_backward_after_the_steps_block_recomputes_the_forwards_masks(reentrant, rows):
    """``loss.backward()`` after the step (``scaler.scale(loss).backward()``,
    ``accelerator.backward(loss)``): the recomputation draws the forward's masks at the
    forward's rows, so the input gradient equals the uncheckpointed one bitwise (it
    differed by up to ~4 before: the recomputation drew torch's generator)."""
    lin, x = _block()
    want = _input_grad(lin, x, None, ROWS[rows], backward_inside=True)
    got = _input_grad(lin, x, {"use_reentrant": reentrant}, ROWS[rows], backward_inside=False)
    assert torch.equal(got, want)


def test_backward_after_a_microbatched_step_recomputes_each_microbatchs_masks():
    """Each microbatch's checkpointed forward, recomputed after the step, draws at that
    microbatch's rows: the gradients equal the whole batch's uncheckpointed ones."""
    lin, x8 = _block()
    x8 = torch.cat([x8, x8.flip(0)])

    def block(t):
        return F.dropout(lin(t), 0.3)

    compile_rng.manual_seed(4)
    whole = x8.clone().requires_grad_()
    with compile_rng.step(8):
        block(whole).square().sum().backward()
    compile_rng.manual_seed(4)
    parts = [x8[:4].clone().requires_grad_(), x8[4:].clone().requires_grad_()]
    losses = []
    with compile_rng.step(8) as s:
        for part in parts:
            with s.microbatch(4):
                losses.append(checkpoint(block, part, use_reentrant=False).square().sum())
    sum(losses).backward()
    assert torch.equal(torch.cat([p.grad for p in parts]), whole.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_forward_outside_every_stream_is_recomputed_with_torchs_generator(reentrant):
    """The converse: a checkpointed forward that ran outside any stream, recomputed by a
    backward inside a step, replays torch's generator as stock torch does (it drew from
    the step's stream before: other masks than the forward's)."""
    lin, x = _block()

    def block(t):
        return F.dropout(lin(t), 0.3)

    grads = []
    for ckpt in (False, True):
        part = x.clone().requires_grad_()
        torch.manual_seed(1)
        out = checkpoint(block, part, use_reentrant=reentrant) if ckpt else block(part)
        with compile_rng.step(4):
            out.square().sum().backward()
        grads.append(part.grad)
    assert torch.equal(grads[0], grads[1])


def test_a_recomputation_on_a_device_thread_after_the_step_draws_the_forwards_masks():
    """A CUDA backward runs the recomputation on a device thread, which the engine hands
    the caller's thread state - after the step, none. The state set back brings the
    forward's stream and rows there too (simulated: the recomputation on another thread)."""
    lin, x = _block()
    compile_rng.manual_seed(4)
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
        saved = torch.get_rng_state()
        here = F.dropout(x, 0.5)
    there = []

    def device_thread():
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(saved)
            there.append(F.dropout(x, 0.5))

    worker = threading.Thread(target=device_thread)
    worker.start()
    worker.join()
    assert torch.equal(there[0], here)


def test_a_dtensor_draw_on_a_device_thread_takes_the_callers_rows():
    """DTensor ops go through the tracker, which read the rows, layout and names from
    the device thread's own (empty) context: a ``Shard(1)`` DTensor dropout at rows 4-7
    of 8 recomputed on another thread drew another mask than its forward."""
    from dtensor_reference import fake_rank, local_zeros
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    for rank in range(2):
        with fake_rank(rank, 2):
            mesh = DeviceMesh("cpu", [0, 1])
            x = local_zeros((4, 6), mesh, [Shard(1)]) + 1.0
            compile_rng.manual_seed(9)
            with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8):
                start = compile_rng.get_state()
                here = F.dropout(x, 0.5).to_local()
                compile_rng.set_state(*start)  # the recomputation draws at the forward's position
                there = on_a_device_thread(lambda x=x: F.dropout(x, 0.5).to_local())
            compile_rng.manual_seed(9)
            with compile_rng.step(8):
                whole = F.dropout(local_zeros((8, 6), mesh, [Shard(1)]) + 1.0, 0.5).to_local()
            assert torch.equal(there, here) and torch.equal(here, whole[4:])


class _StandInGenerator:
    """torch's CUDA generator as compile_rng's state sees it (no GPU here)."""

    def __init__(self) -> None:
        self.seed, self.offset = 0, 0

    def initial_seed(self) -> int:
        return self.seed

    def manual_seed(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def draw(self, n: int) -> int:
        """A stock torch draw of ``n`` counters: where it starts."""
        start = self.offset
        self.offset += n
        return start


def test_microbatches_never_move_torchs_cuda_generator_backwards(monkeypatch):
    """Code between microbatches that draws from torch's CUDA generator (augmentation in
    Lightning's ``on_after_batch_transfer``) got the same numbers for batches 1 and 2:
    each microbatch set the generator back to the step's position. Now each microbatch
    draws from the step's position held apart, and the generator only moves forward."""
    generator = _StandInGenerator()
    monkeypatch.setattr(state, "_generator", lambda kind: generator)
    monkeypatch.setattr(state, "device_types", lambda: ["cpu", "cuda"])
    generator.manual_seed(5)
    step = open_step(8)
    between, draws = [], []
    for _ in range(2):
        between.append(generator.draw(16))  # the loop's own augmentation, outside compile_rng
        with step.microbatch(4):
            draws.append(state.advance(40, "cuda"))  # what a step's CUDA draw reserves
            assert state.get_state("cuda") == (5, draws[0][1] + 40)
    step.finish()
    between.append(generator.draw(16))
    assert draws[0] == draws[1] == (5, 16)  # every microbatch at the step's position
    assert between == [0, 56, 72]  # never a counter twice
    assert state.get_state("cuda") == (5, 88)


def test_a_cuda_recomputation_in_a_microbatch_draws_at_its_forwards_position(monkeypatch):
    """The held position travels with the RNG state checkpointing saves: the recomputation
    draws where the forward drew even though the generator itself was not set back."""
    generator = _StandInGenerator()
    monkeypatch.setattr(state, "_generator", lambda kind: generator)
    monkeypatch.setattr(state, "device_types", lambda: ["cpu", "cuda"])
    generator.manual_seed(5)
    step = open_step(8)
    with step.microbatch(4):
        pass
    with step.microbatch(4):
        saved = torch.get_rng_state()
        forward = state.advance(40, "cuda")
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(saved)
        # where the recomputation's draws run: the forward's context, its streams held
        recomputed = random_kernels.stream_context().run(state.get_state, "cuda")
    assert recomputed == forward == (5, 0)
    assert generator.offset == 40


class _Packed(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(3, hidden, num_layers=2, dropout=0.5, dtype=torch.float64)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        return self.lstm(packed)[0].data


def test_an_lstm_on_a_packed_sequence_is_refused_in_a_step():
    """The dropout between layers runs on the packed ``(tokens, hidden)`` data, whose rows
    mix the batch's samples; with hidden == local batch it was drawn along the hidden
    units, silently."""
    model = _Packed(hidden=4)
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="PackedSequence.*Pad the batch instead of packing"):
        with compile_rng.step(4):
            model(x, torch.tensor([5, 3, 2, 4]))


def test_a_declared_sequence_major_step_refuses_an_attention_dropout_it_cannot_tell():
    """``step(batch_dim=1)``: ``scaled_dot_product_attention``'s dropout runs on ``(batch,
    heads, L, S)``; with as many heads as the local batch it was drawn along the heads."""
    q = torch.randn(4, 4, 6, 8)
    with pytest.raises(NotImplementedError, match="cannot tell whether this op is sequence-major"):
        with compile_rng.step(4, batch_dim=1):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.3)


def _attention(need_weights: bool, x: torch.Tensor, **step) -> torch.Tensor:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.4, batch_first=True, dtype=torch.float64)
    compile_rng.manual_seed(7)
    with compile_rng.step(x.shape[0], **step):
        return mha(x, x, x, need_weights=need_weights)[0]


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_draws_the_one_process_rows_with_or_without_weights(need_weights):
    """With the default ``need_weights=True`` the attention dropout runs on ``(batch *
    heads, L, S)``: it was refused for 2 heads. Now its rows are a batch row's heads, and
    a rank holding rows 2-3 of 4 gets the one process's outputs for them."""
    x = torch.randn(4, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    whole = _attention(need_weights, x)
    half = _attention(need_weights, x[2:], rows=[2, 3], global_batch=4)
    assert (half - whole[2:]).abs().max() < 1e-12
    assert not torch.allclose(_attention(need_weights, x[:2], rows=[0, 1], global_batch=4), whole[2:])


@pytest.mark.parametrize("need_weights", [True, False])
def test_compiled_multihead_attention_draws_the_eager_rows(need_weights):
    """A batched graph's ``nn.MultiheadAttention``: with ``need_weights=True`` its dropout
    draws on ``(batch * heads, L, S)``, and the graph was refused (its batch looked
    ``heads`` times the step's). Now the head count comes from the module, read from the
    frame Dynamo compiled: compiled draws eager's values for the whole batch, a rank's rows and
    microbatches (the second size recompiles dynamic: ``batch * heads`` is then a symbol's
    multiple). float64, so matmul rounding stays far below a mask's difference."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.4, batch_first=True, dtype=torch.float64)
    x = torch.randn(4, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: mha(t, t, t, need_weights=need_weights)[0],
        backend=compile_rng.backend(layout="invariant", batched=True),
    )

    def run(fn, parts: int = 1, **step) -> tuple[torch.Tensor, tuple]:
        compile_rng.manual_seed(7)
        rows = x if not step else x[2:]
        with compile_rng.step(rows.shape[0], **step) as s:
            outs = []
            for part in rows.chunk(parts):
                with s.microbatch(part.shape[0]):
                    outs.append(fn(part))
        return torch.cat(outs), compile_rng.get_state()

    for parts, step in ((1, {}), (1, {"rows": [2, 3], "global_batch": 4}), (2, {})):
        want, want_state = run(lambda t: mha(t, t, t, need_weights=need_weights)[0], parts, **step)
        got, state = run(compiled, parts, **step)
        assert state == want_state and (got - want).abs().max() < 1e-12, (parts, step)


def test_multihead_attention_with_weights_refuses_interleaved_rows():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="need_weights=False"):
        _attention(True, x, rows=[1, 3], global_batch=4)


@pytest.mark.parametrize("shape", [(3, 5), (4, 5)])
def test_a_gradient_hooks_draw_is_a_replica_not_rows(shape):
    """A gradient is not a batch of rows: a hook's noise in backward was refused for a
    (3, 5) weight and drawn at the step's rows for a (4, 5) one (batch 4) - so two ranks
    holding different rows added different noise. Now it is drawn as a replica at the
    stream's position: every rank and the one process add the same noise."""
    def noise(rows: dict) -> torch.Tensor:
        drawn = []

        def hook(g):
            drawn.append(torch.randn_like(g))
            return g + 0.01 * drawn[-1]

        torch.manual_seed(0)
        w = torch.randn(shape, requires_grad=True)
        w.register_hook(hook)
        compile_rng.manual_seed(3)
        local = 4 if not rows else len(rows["rows"])
        with compile_rng.step(local, **rows):
            x = F.dropout(torch.ones(local, shape[1]), 0.5)
            (x @ w.T).sum().backward()
        return drawn[0]

    one = noise({})
    ranks = [noise({"rows": [r, r + 2], "global_batch": 4}) for r in range(2)]
    assert torch.equal(ranks[0], ranks[1]) and torch.equal(ranks[0], one)
    assert one.abs().max() > 0


@pytest.mark.parametrize("hook", ["tensor", "module", "function"])
def test_a_backward_draw_in_one_of_several_microbatches_is_refused(hook):
    """Each microbatch's backward runs the hooks one call on the whole batch runs once: an
    activation's gradient noise was drawn as the same replica in every microbatch, and the
    step ended 8 counters on where the whole batch ends 12 on - other values from then on,
    silently. Now refused; a step of one microbatch over its whole batch still draws the
    whole batch's replica."""
    class Noisy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return 2 * g + torch.randn_like(g)

    layer = nn.Linear(3, 3)
    layer.register_full_backward_hook(lambda m, gi, go: (gi[0] + torch.randn_like(gi[0]),))

    def run(part):
        x = part.clone().requires_grad_()
        if hook == "tensor":
            y = x * 2
            y.register_hook(lambda g: g + torch.randn_like(g))
        else:
            y = layer(x) if hook == "module" else Noisy.apply(x)
        y.sum().backward()
        return x.grad

    data = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))

    def step(parts: int):
        compile_rng.manual_seed(3)
        with compile_rng.step(4) as s:
            grads = []
            for part in data.chunk(parts):
                with s.microbatch(part.shape[0]):
                    grads.append(run(part))
        return torch.cat(grads), compile_rng.get_state()

    whole, whole_state = step(1)
    compile_rng.manual_seed(3)
    with compile_rng.step(4):
        assert torch.equal(run(data), whole) and compile_rng.get_state() == whole_state
    with pytest.raises(NotImplementedError, match="drawn in backward .* inside one of several microbatches"):
        step(2)


def test_a_plain_graph_refuses_in_a_step_what_eager_code_refuses():
    """A draw whose dim 0 is not the step's batch (``Normal.sample((2,))`` on a batch of 4)
    is refused by eager code in a step; a graph compiled without ``batched=True`` drew it at
    its own counters. Now it refuses too, and a draw over the batch still gives eager's."""
    loc = torch.zeros(4, 6)

    def program(t):
        return torch.distributions.Normal(t, 1.0).sample((2,))

    torch._dynamo.reset()
    compiled = torch.compile(program, backend="compile_rng")
    for fn, match in ((program, "on a tensor of shape .2, 4, 6. inside compile_rng.step"),
                      (compiled, "draws aten.normal.* on a tensor of shape .2, 4, 6. in a compile_rng.step")):
        with pytest.raises(NotImplementedError, match=match):
            with compile_rng.step(4):
                fn(loc)
    outs = []
    for fn in (lambda t: torch.distributions.Normal(t, 1.0).sample(), torch.compile(
            lambda t: torch.distributions.Normal(t, 1.0).sample(), backend="compile_rng")):
        compile_rng.manual_seed(5)
        with compile_rng.step(4):
            outs.append((fn(loc), compile_rng.get_state()))
    assert outs[0][1] == outs[1][1] and torch.equal(outs[0][0], outs[1][0])


def _layouts(x: torch.Tensor, t: torch.Tensor) -> tuple:
    """Random ops on strided inputs: ``x`` channels_last, ``t`` transposed."""
    return (F.dropout(x, 0.3), F.dropout(x.double(), 0.3), torch.rand_like(x), torch.bernoulli(x.sigmoid()),
            F.dropout(t, 0.3), torch.randn_like(t))


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_compiled_draws_on_strided_inputs_give_eagers_values(monkeypatch, isa):
    """Without AVX-512 Inductor calls the functional ops as kernels (at every size; with
    it, float32 streams from 2**18 elements): on a channels_last input their output came
    back in that layout where the op's fake said contiguous, and Inductor's stride check
    failed the call (a CNN's dropout under backend="compile_rng" crashed). Now the ops return
    what their fakes say, and compiled draws have eager's values either way. (Their layout
    is contiguous: docs/compiling.md.)"""
    from compile_rng._torch.inductor_internals import inductor_caches_off
    from compile_rng.ops import lowering

    monkeypatch.setattr(lowering, "inductor_vector_isa", lambda: isa)
    x = torch.randn(4, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    t = torch.randn(4, 6, 10).transpose(1, 2)
    torch._dynamo.reset()
    outs = []
    with inductor_caches_off():  # their keys do not hold the ISA
        for fn in (_layouts, torch.compile(_layouts, backend="compile_rng")):
            compile_rng.manual_seed(5)
            with compile_rng.step(4):
                outs.append((fn(x, t), compile_rng.get_state()))
    (want, want_state), (got, state) = outs
    assert state == want_state
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_generator_in_a_step_draws_from_torchs_generator():
    """``generator=`` is the way to torch's generator inside a step (a shuffled DataLoader
    made there, PowerSGD's seeded projections): torch's values, the stream untouched."""
    compile_rng.manual_seed(2)
    with compile_rng.step(4):
        before = compile_rng.get_state()
        got = torch.rand(4, 3, generator=torch.Generator().manual_seed(11))
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(11))
        assert compile_rng.get_state() == before
    assert torch.equal(got, torch.rand(4, 3, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(perm, torch.randperm(10, generator=torch.Generator().manual_seed(11)))


def test_a_process_forked_inside_a_step_draws_torchs_values():
    """A child forked in a step (a DataLoader's workers started there) inherited the
    handler and the step's rows: its ``torch.rand`` did not give torch's values."""
    torch.manual_seed(3)
    want = torch.rand(4)
    read, write = os.pipe()
    with compile_rng.step(4):
        pid = os.fork()
        if pid == 0:  # the child
            from compile_rng.semantics.rows import current_rows

            torch.manual_seed(3)
            ok = torch.equal(torch.rand(4), want) and current_rows() is None and random_kernels.active() is None
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert random_kernels.active() is not None  # the parent is still in its step
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.close(write)


def test_uninstall_inside_an_open_step_is_refused_and_changes_nothing():
    compile_rng.manual_seed(1)
    with compile_rng.step(4):
        first = torch.rand(4, 2)
        with pytest.raises(RuntimeError, match=r"uninstall\(\) with 1 compile_rng stream.*after the block"):
            compile_rng.uninstall()
        second = torch.rand(4, 2)
    compile_rng.manual_seed(1)
    with compile_rng.step(4):
        assert torch.equal(torch.rand(4, 2), first) and torch.equal(torch.rand(4, 2), second)
    from compile_rng import installation

    assert installation.installed()
